import os

from deepspeed_fused import docs
from deepspeed_fused.docs import config_reference

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GENERATED = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "docs", "config.md")]


def test_config_reference_blocks_are_current():
    assert docs.main(["--check", *GENERATED]) == 0


def test_docs_tool_writes_only_the_files_it_is_given(tmp_path, capsys):
    assert docs.main([]) == 0  # no file: the table on stdout
    assert capsys.readouterr().out.strip() == docs.reference_table()
    f = tmp_path / "x.md"
    f.write_text(f"head\n{docs.START}\nold\n{docs.END}\ntail\n")
    assert docs.main(["--check", str(f)]) == 1
    assert docs.main(["--write", str(f)]) == 0
    assert f.read_text() == f"head\n{docs.START}\n{docs.reference_table()}\n{docs.END}\ntail\n"
    assert docs.main(["--check", str(f)]) == 0


def test_readme_names_every_key_and_the_two_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    for row in config_reference():
        assert f"`{row['key']}`" in readme
    assert "python -m pytest tests -q --forked -n 2" in readme
    assert "examples/train.py" in readme


def test_ci_runs_the_readme_test_command():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    assert "python -m pytest tests -q --forked -n 2" in ci


def test_readme_architecture_and_makefile_give_the_gpu_test_command():
    command = "-m pytest tests/gpu -q -n 4 --forked"
    for name in ("README.md", os.path.join("docs", "architecture.md"), "Makefile"):
        with open(os.path.join(ROOT, name)) as f:
            assert command in f.read(), name
