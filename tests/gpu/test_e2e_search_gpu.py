"""The e2e suite's micro-batch search on a GPU: a size that runs out of memory is caught in the
job (``deepspeed_fused.train --batch-sizes``), recorded as ``oom`` and its memory freed, and the
suite's search (fresh processes, the confirmation alone) finds the largest size that fits; the
accumulation job records every micro-step. The jobs run under the deepspeed launcher in
subprocesses; this test's worker never initialises CUDA itself."""
import json
import os
import sys

import pytest

from deepspeed_fused.bench import e2e

pytestmark = pytest.mark.gpu


def _launch(tmp_path, *train_args, timeout=600):
    metrics = tmp_path / "m.json"
    r = e2e.launch(["--deepspeed_config", e2e.config_file("configs/fused_all.json"), "--model", "qwen3-moe-tiny",
                    "--no-progress", "--metrics-out", str(metrics), *train_args], 1, timeout, str(tmp_path))
    assert r["rc"] == 0, r["stdout"][-3000:] + r["stderr"][-3000:]
    return json.loads(metrics.read_text())


@pytest.mark.gpu_heavy
def test_out_of_memory_size_is_caught_and_its_memory_freed(tmp_path):
    # 2 sequences of 8192 tokens fit the tiny model; 2**15 sequences of 8192 tokens need far more
    # than any GPU's memory (the first layer's queries alone: 2**28 tokens x 512 x 2 bytes = 256 GiB)
    d = _launch(tmp_path, "--steps", "2", "--warmup", "1", "--seq-len", "8192", "--batch-sizes", "2,32768")
    t = d["trials"]
    assert [x["batch"] for x in t] == [2, 32768] and [x["status"] for x in t] == ["ok", "oom"], t
    assert "OutOfMemoryError" in t[1]["error"] or "out of memory" in t[1]["error"].lower()
    # after the failed size, no more memory is held than after the size that ran
    assert t[1]["allocated_after_mib"] <= t[0]["allocated_after_mib"] + 8, t


@pytest.mark.gpu_heavy
def test_search_finds_the_largest_size_in_fresh_processes(tmp_path):
    """A tiny model and long sequences: the largest micro-batch is some hundreds of sequences; the
    search ends with it fitting and the next size out of memory first in its process."""
    o = e2e.parse_options(type("A", (), dict(extra=["--model", "qwen3-moe-tiny", "--seq-len", "16384",
                                                    "--search", "zero2", "--search-steps", "1",
                                                    "--search-warmup", "0", "--search-start", "16",
                                                    "--search-max", "4096", "--search-timeout", "300"],
                                             quick=False))())
    r = e2e.run_search("zero2", "fused", o, str(tmp_path))
    assert r["stopped"] is None, r["stopped"]
    assert r["largest"] is not None and r["smallest_failed"] == r["largest"] + 1 and not r["capped"], r
    bound = [x for x in r["trials"] if x["batch"] == r["smallest_failed"]]
    assert all(x["status"] == "oom" for x in bound) and any(x["position"] == 0 for x in bound)
    assert r["features"].startswith("ours: rms_norm, linear_cross_entropy, moe_reorder, rope"), r["features"]


class _Stopped(Exception):
    pass


@pytest.mark.gpu_heavy
def test_a_search_stopped_after_two_processes_resumes_to_the_same_kind_of_answer(tmp_path):
    """The search stopped from outside after its second process (the progress it reported then is
    what the suite writes to e2e.json), continued from that report in new processes: it ends with
    the largest size fitting and the next out of memory first in its process, the stopped run's
    sizes kept and none of them run again."""
    o = e2e.parse_options(type("A", (), dict(extra=["--model", "qwen3-moe-tiny", "--seq-len", "16384",
                                                    "--search", "zero2", "--search-steps", "1",
                                                    "--search-warmup", "0", "--search-start", "16",
                                                    "--search-max", "4096", "--search-timeout", "300"],
                                             quick=False))())
    seen = []
    for part in ("a", "b"):  # each run's own folder: its metrics files are numbered from 1
        (tmp_path / part).mkdir()

    def stop_after_two(r):
        seen.append(json.loads(json.dumps(r, default=str)))  # as the suite's e2e.json keeps it
        if r["processes"] == 2:
            raise _Stopped

    with pytest.raises(_Stopped):
        e2e.run_search("zero2", "fused", o, str(tmp_path / "a"), progress=stop_after_two)
    snapshot = seen[-1]
    assert snapshot["unfinished"] and snapshot["largest"] is not None, snapshot
    r = e2e.run_search("zero2", "fused", o, str(tmp_path / "b"), earlier=snapshot)
    assert r["stopped"] is None and "unfinished" not in r, r
    assert r["trials"][:len(snapshot["trials"])] == snapshot["trials"]
    assert r["processes"] > 2 and r["largest"] >= snapshot["largest"], r
    assert r["smallest_failed"] == r["largest"] + 1 and not r["capped"], r
    bound = [x for x in r["trials"] if x["batch"] == r["smallest_failed"]]
    assert all(x["status"] == "oom" for x in bound) and any(x["position"] == 0 for x in bound)
    later = [x["batch"] for x in r["trials"][len(snapshot["trials"]):] if not x.get("alone")]
    assert not set(later) & {x["batch"] for x in snapshot["trials"]}


def test_accumulation_job_records_every_micro_step(tmp_path):
    d = _launch(tmp_path, "--steps", "3", "--warmup", "1", "--seq-len", "256", "--deepspeed_config",
                e2e.config_file("configs/accum8_fused.json"), "--profile-out", str(tmp_path / "p.json"))
    assert d["gradient_accumulation_steps"] == 8 and d["tokens_per_step"] == 8 * 2 * 256
    for h in d["history"]:
        assert len(h["micro_fb_s"]) == 8 and len(h["micro_losses"]) == 8
        assert 0 < sum(h["micro_fb_s"]) <= h["step_s"]
    b = d["breakdown"]
    assert len(b["micro_steps"]) == 8 and b["outside_micro_steps"]["categories"]["optimizer step"] > 0
    feats = {f["name"]: f for f in d["report"]["features"]}
    for name in ("rms_norm", "linear_cross_entropy", "moe_reorder", "rope"):
        assert feats[name]["applied"], feats[name]
    assert feats["linear_cross_entropy"]["calls"]["fused"] >= 8 * 4  # every micro-step, the profiled step too


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
