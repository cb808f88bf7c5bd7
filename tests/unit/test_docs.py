import os

from deepspeed_fused import docs
from deepspeed_fused.config import config_reference


def test_config_reference_blocks_are_current():
    assert docs.main(["--check"]) == 0


def test_readme_names_every_key_and_the_two_commands():
    with open(os.path.join(docs.ROOT, "README.md")) as f:
        readme = f.read()
    for row in config_reference():
        assert f"`{row['key']}`" in readme
    assert "python -m pytest tests -q --forked" in readme
    assert "examples/train.py" in readme


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(docs.ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert "python -m pytest tests -q --forked" in ci


def test_readme_architecture_and_makefile_give_the_gpu_test_command():
    command = "-m pytest tests/gpu -q -n 4 --forked"
    for name in ("README.md", os.path.join("docs", "architecture.md"), "Makefile"):
        with open(os.path.join(docs.ROOT, name)) as f:
            assert command in f.read(), name
