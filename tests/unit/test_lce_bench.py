"""The linear_cross_entropy suite's chunk sweep on CPU (tiny shape): one T row, then our forward
and forward+backward at each chunk size with the target check on and off."""
import argparse
import warnings

from deepspeed_fused.bench import linear_cross_entropy as suite


def test_chunk_sweep_records():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # CPU without the interpreter: the reference runs
        recs = suite.run(argparse.Namespace(extra=["--sweep"], quick=True))
    assert recs[0].impl == suite.GEMM and recs[0].fwd_ms
    names = [r.impl for r in recs[1:]]
    assert names == ["chunk=8", "chunk=8, no check", "chunk=auto", "chunk=auto, no check"]
    for r in recs[1:]:
        assert r.ours and r.fwd_ms and r.fwd_bwd_ms and "failed" not in r.note, r
        assert r.extra["fwd_over_T"] > 0 and r.extra["fb_over_T"] > 0


def test_trl_case_records(tmp_path):
    """``--case trl``: T, then TRL's ChunkedLogProbFunction, our served head (for SFT with the gradient
    formed in the forward, then its per-token path) and the op for each of the SFT, GRPO and DPO
    field sets (CPU: a tiny shape, the logic only), written under its own name."""
    import pytest

    pytest.importorskip("trl")
    from deepspeed_fused.bench.__main__ import main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        assert main(["linear_cross_entropy", "--case", "trl", "--out", str(tmp_path)]) == 0
    import json

    recs = json.load(open(tmp_path / "linear_cross_entropy_trl.json"))
    recs = recs["records"] if isinstance(recs, dict) else recs
    names = [r["impl"] for r in recs]
    assert names[0] == suite.GEMM
    for case in ("SFT", "GRPO", "DPO"):
        rows = [r for r in recs if r["extra"].get("case") == case]
        served = ["ours: served head"] + (["ours: served head, per-token path"] if case == "SFT" else [])
        assert [r["impl"].split(" (")[0] for r in rows] == ["TRL ChunkedLogProbFunction", *served, "ours: op"], names
        for r in rows:
            assert r["fwd_bwd_ms"] and "failed" not in r["note"], r
        assert all("speedup_vs_trl" in r["extra"] for r in rows[1:])
