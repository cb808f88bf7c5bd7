"""The pytest process and the DistributedTest worker server never initialise CUDA; GPU test
bodies run in workers. Checked on CPU: a pytest subprocess runs on a machine made to look like
a machine with a GPU (tests/unit/fake_gpu: torch reports a GPU and logs every request to initialise
CUDA, naming the process), collecting every tests/gpu module and running
tests/unit/cuda_probe_cases.py under ``--forked``."""
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
import torch

from unit import common

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def test_guard_refuses_and_releases():
    seen = []

    def refuse(what):
        seen.append(what)
        raise RuntimeError("refused: " + what)

    release = common.guard_cuda_init(refuse)
    try:
        with pytest.raises(RuntimeError, match="refused: torch.cuda._lazy_init"):
            torch.empty(1, device="cuda")  # C++ goes through torch.cuda._lazy_init
        with pytest.raises(RuntimeError, match="refused"):
            torch.cuda.init()
    finally:
        release()
    assert seen == ["torch.cuda._lazy_init"] * 2
    with pytest.raises((AssertionError, RuntimeError)) as e:  # the CPU build's own answer again
        torch.cuda.init()
    assert "refused" not in str(e.value)


def test_cuda_device_count_on_cpu():
    assert common.cuda_device_count() == 0 and not torch.cuda.is_initialized()


def _outcomes(junit):
    out = {}
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = case.get("name")
        kinds = [c.tag for c in case if c.tag in ("failure", "error", "skipped")]
        out[name] = (kinds[0] if kinds else "passed", "".join((c.get("message") or "") + (c.text or "") for c in case))
    return out


def test_collection_and_workers_never_initialise_cuda_in_the_pytest_process(tmp_path):
    log, junit = tmp_path / "cuda.jsonl", tmp_path / "junit.xml"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TRITON_INTERPRET", "DS_ACCELERATOR",
                        "PYTORCH_NVML_BASED_CUDA_CHECK", "PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST")}
    env.update(DSF_FAKE_GPU_LOG=str(log), DSF_FAKE_GPUS="1",
               PYTHONPATH=os.pathsep.join([os.path.join(HERE, "fake_gpu"), ROOT] +
                                          ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])))
    cmd = [sys.executable, "-m", "pytest", "tests/gpu", "tests/unit/cuda_probe_cases.py", "-k", "cuda_probe_cases",
           "--forked", "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    report = f"{cmd}: exit {p.returncode}\n{p.stdout[-6000:]}\n{p.stderr[-3000:]}"
    assert junit.exists(), report
    got = _outcomes(junit)
    want = {"test_plain_gpu_function[1]": "passed", "test_plain_gpu_function[2]": "passed",
            "test_method": "passed", "test_method_in_worker[a]": "passed", "test_not_gpu_asking_for_cuda_here": "passed",
            "test_gpu_fixture_asking_for_cuda": "error"}
    assert {k: v[0] for k, v in got.items()} == want, report
    assert "requested in the pytest process for the gpu test" in got["test_gpu_fixture_asking_for_cuda"][1], report
    deselected = re.search(r"(\d+) deselected", p.stdout)
    assert deselected and int(deselected.group(1)) >= 100, report  # the tests/gpu modules were collected

    records = [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []
    in_ranks = {r["test"].split("::")[-1].split(" ")[0] for r in records if r["rank"] == "0" and r["test"]}
    assert {"test_plain_gpu_function[1]", "test_plain_gpu_function[2]", "test_method",
            "test_method_in_worker[a]"} <= in_ranks, records
    here = [r for r in records if r["rank"] is None and "test_not_gpu_asking_for_cuda_here" in (r["test"] or "")]
    assert here and all("forkserver" not in r["argv"] for r in here), records  # the log sees the pytest process
    bad = [r for r in records if r["rank"] != "0" and r not in here]
    assert not bad, "CUDA requested outside the ranks:\n" + "\n".join(
        f"{r['what']} in pid {r['pid']} (started as {r['start_pid']}: {r['argv'][:200]}), test {r['test']}:\n"
        f"{r['stack']}" for r in bad)
