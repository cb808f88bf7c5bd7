"""The mlp_act suite on CPU (tiny shapes, kernels under the interpreter): every implementation that
runs here gives a record with both timings, and the files are written."""
import argparse
import json

from deepspeed_fused.bench import mlp_act as suite
from deepspeed_fused.bench.common import write_results


def test_mlp_act_suite_records(interpret, tmp_path):
    recs = suite.run(argparse.Namespace(extra=[], quick=True))
    for shape in (sh[0] for sh in suite.CPU_SHAPES):
        rs = {r.impl: r for r in recs if r.shape == shape}
        assert {"deepspeed_fused", "HF eager"} <= set(rs), rs.keys()
        for r in rs.values():
            assert r.fwd_ms and r.fwd_bwd_ms and "failed" not in r.note, r
            assert r.unit == "TB/s" and r.fwd_rate > 0
        assert rs["deepspeed_fused"].ours and not rs["HF eager"].ours
    paths = write_results(suite.SUITE, recs, str(tmp_path), title=suite.TITLE, notes=suite.NOTES)
    assert len(json.load(open(paths["json"]))) == len(recs)
    assert "deepspeed_fused" in open(paths["md"]).read()
    # the GPU shapes: the four dense families' MLP widths at 8192 and 16384 tokens, in bf16
    widths = {(s[1], s[2]) for s in suite.SHAPES if s[3] == "silu" and s[4] == "split"}
    assert {(t, i) for t in (8192, 16384) for i in (8192, 14336, 6144, 9728)} <= widths
