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
