"""The package as a user installs it: a wheel built from the tree, installed into a fresh
virtualenv and run from a directory outside the clone. Every command the README documents for an
installed package runs there (the report, the config reference, the benchmark suites' entry point
and a CPU suite, the coverage suite on one family, the example job's command as the README writes
it, the e2e suite, which runs the example job under the deepspeed launcher), and none writes into
the installed package.

Offline and quick: ``pip wheel --no-deps --no-build-isolation`` with this environment's setuptools,
``pip install --no-deps --no-index`` into a venv made without pip, which then sees this
environment's packages (torch, DeepSpeed, transformers, ...) through a ``.pth`` file listing their
folders, added after the install (a plain folder line: the ``.pth`` files inside those folders,
such as an editable install of this clone, are not run, so ``deepspeed_fused`` is the wheel's).
"""
import glob
import json
import os
import shutil
import site
import subprocess
import sys
import zipfile

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
# what setup.py reads: the build's inputs, copied so that the build writes nothing into the clone
BUILD_INPUTS = ["setup.py", "README.md", "LICENSE", "requirements.txt", "deepspeed_fused", "configs"]


def _run(cmd, cwd, env, timeout=600):
    p = subprocess.run([str(c) for c in cmd], cwd=str(cwd), env=env, capture_output=True, text=True,
                       timeout=timeout)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout + p.stderr


def _files(folder) -> dict:
    return {os.path.relpath(os.path.join(d, f), folder): os.path.getmtime(os.path.join(d, f))
            for d, _, fs in os.walk(folder) for f in fs if "__pycache__" not in d}


def _assert_license_in(wheel):
    """The wheel carries the repository's LICENSE (the Apache-2.0 text) in its .dist-info, word for word."""
    with open(os.path.join(ROOT, "LICENSE"), "rb") as f:
        text = f.read()
    assert b"Apache License" in text and b"Version 2.0, January 2004" in text
    with zipfile.ZipFile(wheel) as z:
        names = [n for n in z.namelist() if n.split("/")[0].endswith(".dist-info") and n.endswith("/LICENSE")]
        assert names, z.namelist()
        assert all(z.read(n) == text for n in names), names
        metadata = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    assert "License-File: LICENSE" in metadata, metadata[:2000]


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(python of the venv, the installed package's folder, an environment, a working folder outside the clone)."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        path = os.path.join(ROOT, name)
        if os.path.isdir(path):
            shutil.copytree(path, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(path, src / name)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "TRITON_INTERPRET")}
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w",
          tmp / "dist", src], tmp, env)
    (wheel, ) = glob.glob(str(tmp / "dist" / "deepspeed_fused-*.whl"))
    _assert_license_in(wheel)
    venv = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", venv], tmp, env)
    py = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel], tmp, env)
    purelib = _run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp, env).strip()
    with open(os.path.join(purelib, "_test_environment.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    work = tmp / "elsewhere"
    work.mkdir()
    pkg = _run([py, "-c", "import deepspeed_fused, os; print(os.path.dirname(deepspeed_fused.__file__))"],
               work, env).strip().splitlines()[-1]
    return py, pkg, env, work


def test_the_wheel_is_what_runs(installed):
    py, pkg, env, work = installed
    assert pkg.startswith(str(work.parent / "venv")) and not pkg.startswith(ROOT)
    # every file of the package's tree is in the wheel (sources, the C++ node's source, the configs)
    tree = os.path.join(ROOT, "deepspeed_fused")
    parts = sorted(os.path.relpath(os.path.join(d, f), tree) for d, _, fs in os.walk(tree, followlinks=True)
                   for f in fs if "__pycache__" not in d and not f.endswith(".pyc"))
    for part in ["bench/__init__.py", "bench/e2e.py", "train.py", "docs.py", "configs/fused_all.json",
                 "ops/moe_reorder/route.py"] + parts:
        assert os.path.isfile(os.path.join(pkg, part)), part
    assert any(p.startswith("ops/csrc/") and p.endswith(".cpp") for p in parts)
    assert not os.path.islink(os.path.join(pkg, "configs"))


def test_report_docs_and_bench_entry_points(installed):
    py, pkg, env, work = installed
    before = _files(pkg)
    out = _run([py, "-m", "deepspeed_fused", "report"], work, env)
    assert "torch:" in out and "AutoEP:" in out
    shutil.copy(os.path.join(pkg, "configs", "fused_all.json"), work / "ds_config.json")
    out = _run([os.path.join(os.path.dirname(py), "deepspeed-fused"), "report", "--config", "ds_config.json",
                "--model", "qwen3-moe-tiny"], work, env)
    assert "enabled features: rms_norm, linear_cross_entropy, moe_reorder" in out
    assert "model qwen3-moe-tiny (Qwen3MoeForCausalLM)" in out
    out = _run([py, "-m", "deepspeed_fused.docs"], work, env)
    assert "| `deepspeed_fused.moe_reorder.validate` | bool |" in out
    out = _run([py, "-m", "deepspeed_fused.bench", "--help"], work, env)
    for suite in ("ceilings", "e2e", "multi_gpu", "tp_cross_entropy", "moe_reorder"):
        assert suite in out
    out = _run([py, "-m", "deepspeed_fused.bench", "ceilings", "--quick"], work, env)
    assert os.path.isfile(work / "docs" / "benchmarks" / "ceilings.json")  # here, not in the package
    # the coverage suite (README: --jobs 2 over every family) on one family: it re-executes itself
    # under the interpreter and builds the model from the installed transformers
    out = _run([py, "-m", "deepspeed_fused.bench", "coverage", "--families", "llama", "--jobs", "1", "--out",
                work / "cov"], work, env)
    cov = json.loads((work / "cov" / "coverage.json").read_text())
    assert [r["status"] for r in cov["records"] if r["family"] == "llama"] == ["ok"], cov["records"]
    assert _files(pkg) == before


def _readme_job_command() -> list:
    """The README's command for the example job from an installed package (its one
    ``deepspeed --module deepspeed_fused.train`` line), split into words."""
    with open(os.path.join(ROOT, "README.md")) as f:
        (line, ) = [ln.strip() for ln in f if ln.startswith("deepspeed --module deepspeed_fused.train ")]
    return line.split()


def test_readme_job_command_runs_from_the_wheel(installed):
    """The README's command, word for word, from a folder without ``configs/``: the launcher is
    ``deepspeed`` run by the venv's python (``-m deepspeed.launcher.runner``, with a free port), so
    the ranks import the wheel's package, and ``configs/fused_all.json`` is the config it ships."""
    from deepspeed_fused.bench.common import free_port

    py, pkg, env, work = installed
    cmd = _readme_job_command()
    assert cmd[:2] == ["deepspeed", "--module"] and "configs/fused_all.json" in cmd
    assert not os.path.exists(work / "configs")
    before = _files(pkg)
    port = free_port()
    try:
        out = _run([py, "-m", "deepspeed.launcher.runner", "--master_port", port] + cmd[1:], work, env, timeout=900)
    finally:
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            os.remove(path)
    shipped = os.path.join(pkg, "configs", "fused_all.json")
    assert f"[train] configs/fused_all.json: the shipped {shipped}" in out
    assert "[train] done" in out
    assert _files(pkg) == before


def test_e2e_suite_runs_the_example_job_from_the_wheel(installed):
    """The e2e suite on the tiny model, one arm: it launches the installed example job
    (``deepspeed_fused.train``) through the deepspeed launcher with a config shipped in the
    package, as ``deepspeed --module deepspeed_fused.train`` does."""
    py, pkg, env, work = installed
    before = _files(pkg)
    out = _run([py, "-m", "deepspeed_fused.bench", "e2e", "--quick", "--out", work / "e2e", "--model",
                "qwen3-moe-tiny", "--pairs", "zero2", "--arms", "fused", "--arm-timeout", "400"], work, env, timeout=900)
    assert "--module deepspeed_fused.train" in out and "[train] done" in out
    d = json.loads((work / "e2e" / "e2e.json").read_text())
    arm = d["results"]["zero2"]["fused"]
    assert "error" not in arm, arm.get("error")
    assert arm["config"] == os.path.join(pkg, "configs", "fused_all.json") and len(arm["history"]) == 4
    feats = arm["report"]["features"]
    assert [f["name"] for f in feats][:3] == ["rms_norm", "linear_cross_entropy", "moe_reorder"]
    assert all(f["enabled"] for f in feats[:3])
    if not torch.cuda.is_available():
        assert arm["breakdown"]["categories"]["rms_norm"] > 0
    assert _files(pkg) == before
