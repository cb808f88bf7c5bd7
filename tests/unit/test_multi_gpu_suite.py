"""The multi_gpu suite's driver on CPU: the launcher is replaced by a stand-in that writes the
metrics train.py would, so the pairs, configs, time limits, comparisons and outputs are checked
without GPUs (the real runs need several GPUs: docs/results.md says how to run them)."""
import argparse
import json
import os

import pytest

from deepspeed_fused.bench import e2e, multi_gpu


def _args(tmp_path, *extra, quick=False):
    return argparse.Namespace(out=str(tmp_path / "out"), quick=quick, extra=list(extra))


@pytest.fixture
def fake_launch(monkeypatch):
    calls = []

    def launch(train_args, num_gpus, timeout, tmp, env_extra=None):
        a = {k: train_args[i + 1] for i, k in enumerate(train_args[:-1]) if k.startswith("--")}
        with open(a["--deepspeed_config"]) as f:
            cfg = json.load(f)
        calls.append(dict(args=list(train_args), gpus=num_gpus, timeout=timeout, config=cfg,
                          path=a["--deepspeed_config"]))
        fused = "fused" in os.path.basename(a["--deepspeed_config"])
        steps = int(a["--steps"])
        step_s = 0.16 if fused else 0.2
        hist = [dict(step=i, loss=12.3 + (1e-4 if fused else 0.0) - 0.01 * i, step_s=step_s,
                     tokens_per_s=2 * 4096 * num_gpus / step_s, peak_alloc_mib=60000.0 if fused else 66000.0,
                     peak_reserved_mib=70000.0) for i in range(steps)]
        feats = [dict(name=n, enabled=fused, applied=fused, where="1 x Model" if fused else "", reason="")
                 for n in ("rms_norm", "linear_cross_entropy", "moe_reorder")]
        out = dict(model=a["--model"], config=a["--deepspeed_config"], world_size=num_gpus, history=hist,
                   median_step_s=step_s, median_tokens_per_s=hist[0]["tokens_per_s"],
                   peak_alloc_mib=hist[0]["peak_alloc_mib"], peak_reserved_mib=70000.0, report=dict(features=feats))
        with open(a["--metrics-out"], "w") as f:
            json.dump(out, f)
        return dict(rc=0, stdout="[train] done\n", stderr="", wall_s=1.0)

    monkeypatch.setattr(e2e, "launch", launch)
    return calls


def test_three_pairs_two_arms_on_two_gpus(tmp_path, fake_launch):
    doc = multi_gpu.main(_args(tmp_path, "--steps", "4", "--warmup", "1"))
    assert [(os.path.basename(c["path"]), c["gpus"]) for c in fake_launch] == [
        ("baseline.json", 2), ("fused_all.json", 2), ("zero3_baseline.json", 2), ("zero3_fused.json", 2),
        ("autoep2_baseline.json", 2), ("autoep2_fused.json", 2)]
    for c in fake_launch:
        assert "--profile-out" not in c["args"] and c["timeout"] <= 240
        assert c["args"][c["args"].index("--steps") + 1] == "5"  # timed + warm-up
    assert [c["config"]["expert_parallel"]["autoep_size"] for c in fake_launch[4:]] == [2, 2]
    assert fake_launch[3]["config"]["zero_optimization"]["stage"] == 3
    for pair in ("zero2", "zero3", "autoep2"):
        c = doc["results"][pair]["compare"]
        assert c["speedup"] == pytest.approx(0.2 / 0.16) and c["max_loss_rel_diff"] < 1e-4
        assert c["peak_alloc_reduction"] == pytest.approx(1 - 60000 / 66000)
    out = tmp_path / "out"
    with open(out / "multi_gpu.json") as f:
        saved = json.load(f)
    assert "partial" not in saved and saved["meta"]["num_gpus"] == 2
    md = (out / "multi_gpu.md").read_text()
    assert md.startswith("# Benchmark `multi_gpu`") and "autoep2_fused.json" in md
    assert "`linear_cross_entropy` applied: 1 x Model" in md and "`rms_norm` off" in md
    assert "| zero3 | 1.25 |" in md


def test_other_gpu_counts_rewrite_autoep_size(tmp_path, fake_launch):
    multi_gpu.main(_args(tmp_path, "--pairs", "autoep2", "--num-gpus", "4", "--profile", quick=True))
    assert [c["gpus"] for c in fake_launch] == [4, 4]
    assert [c["config"]["expert_parallel"]["autoep_size"] for c in fake_launch] == [4, 4]
    assert all("--profile-out" in c["args"] for c in fake_launch)
    assert fake_launch[0]["args"][fake_launch[0]["args"].index("--seq-len") + 1] == "512"  # --quick


def test_suite_time_limit_skips_runs(tmp_path, fake_launch, monkeypatch):
    """A run is not started with less than a minute of the suite's limit left; each run's own
    limit is at most what is left."""
    clock = [1000.0]
    monkeypatch.setattr(multi_gpu.time, "time", lambda: clock[0])
    orig = e2e.launch

    def slow_launch(*a, **k):
        clock[0] += 100.0  # every run takes 100 s
        return orig(*a, **k)

    monkeypatch.setattr(e2e, "launch", slow_launch)
    doc = multi_gpu.main(_args(tmp_path, "--total-timeout", "250", "--arm-timeout", "240"))
    assert len(fake_launch) == 2  # 250 s: two runs of 100 s, then 50 s left
    assert [c["timeout"] for c in fake_launch] == [240, 150]
    r = doc["results"]
    assert r["zero3"]["baseline"]["skipped"] and "skipped" in r["autoep2"]["fused"]["error"]
    assert "error" in r["zero3"]["compare"]
    md = (tmp_path / "out" / "multi_gpu.md").read_text()
    assert "| zero3 | baseline | zero3_baseline.json | skipped |" in md


def test_failed_run_and_render(tmp_path, fake_launch, monkeypatch):
    orig = e2e.launch

    def failing(train_args, num_gpus, timeout, tmp, env_extra=None):
        if "zero3_fused.json" in " ".join(train_args):
            return dict(rc=1, stdout="", stderr="RuntimeError: boom", wall_s=1.0)
        return orig(train_args, num_gpus, timeout, tmp, env_extra)

    monkeypatch.setattr(e2e, "launch", failing)
    first = tmp_path / "a"
    multi_gpu.main(argparse.Namespace(out=str(first), quick=True, extra=["--pairs", "zero2,zero3"]))
    md = (first / "multi_gpu.md").read_text()
    assert "| zero3 | fused | zero3_fused.json | failed |" in md and "boom" in md
    monkeypatch.setattr(e2e, "launch", orig)
    second = tmp_path / "b"
    multi_gpu.main(argparse.Namespace(out=str(second), quick=True, extra=["--pairs", "zero3"]))
    merged = tmp_path / "c"
    doc = multi_gpu.main(argparse.Namespace(out=str(merged), quick=False, extra=[
        "--render", str(first / "multi_gpu.json"), str(second / "multi_gpu.json")]))
    assert set(doc["results"]) == {"zero2", "zero3"}
    assert "error" not in doc["results"]["zero3"]["compare"]  # the later file's zero3 arms replace the failed one
    assert (merged / "multi_gpu.md").exists()
