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


def test_faster_of_keeps_each_median_from_its_faster_round():
    """Of two rounds, the forward and the forward+backward each keep their lower median and its
    rate; the peak memory is the larger; the rounds are counted."""
    from deepspeed_fused.bench.common import Record

    def rec(fwd, fb, mib):
        return Record(suite="mlp_act", impl="x", shape="s", dtype="bfloat16", fwd_ms=fwd, fwd_bwd_ms=fb,
                      fwd_rate=1.0 / fwd, fwd_bwd_rate=1.0 / fb, peak_extra_mib=mib, extra={})

    first = suite.faster_of(None, rec(2.0, 5.0, 10.0))
    assert first.extra["rounds"] == 1
    both = suite.faster_of(first, rec(3.0, 4.0, 12.0))
    assert (both.fwd_ms, both.fwd_rate, both.fwd_bwd_ms, both.fwd_bwd_rate) == (2.0, 0.5, 4.0, 0.25)
    assert both.peak_extra_mib == 12.0 and both.extra["rounds"] == 2


def test_tokens_option_keeps_the_shapes_of_that_many_tokens(interpret):
    recs = suite.run(argparse.Namespace(extra=["--tokens", "32"], quick=True))
    assert {r.shape for r in recs} == {"tiny gelu_tanh gate_up"}
    import pytest

    for bad in (["--tokens"], ["--tokens", "x"], ["--tokens", "7"]):
        with pytest.raises(SystemExit, match="--tokens|no shape"):
            suite.run(argparse.Namespace(extra=bad, quick=True))


def test_rounds_alternate_the_order_and_bad_counts_are_refused(interpret):
    assert suite.round_orders(["a", "b", "c"], 3) == [["a", "b", "c"], ["c", "b", "a"], ["a", "b", "c"]]
    assert suite.round_orders(["a", "b"], 1) == [["a", "b"]]
    import pytest

    for bad in (["--rounds", "0"], ["--rounds", "-2"], ["--rounds", "two"]):
        with pytest.raises(SystemExit, match="--rounds"):
            suite.run(argparse.Namespace(extra=bad, quick=True))


def test_fast_silu_arm_turns_the_fast_path_on_while_it_runs(monkeypatch):
    from deepspeed_fused.ops.mlp_act import launch

    seen = []
    run = suite._fast_silu_forward(lambda *xs: seen.append(launch.FAST_SILU) or len(xs))
    assert not launch.FAST_SILU and run(1, 2) == 2 and seen == [True] and not launch.FAST_SILU
    with __import__("pytest").raises(ZeroDivisionError):
        suite._fast_silu_forward(lambda: 1 / 0)()
    assert not launch.FAST_SILU


def test_fast_silu_arm_is_ours_and_no_peer():
    """On a GPU the fast-path arm is listed as ours: the ratios to the best peer and the summary's
    columns compare ours with the peers alone, never with our own other forward."""
    from deepspeed_fused.bench.common import Record, ratios_to_best_peer

    arms = {name: ours for name, _, ours in suite._impls("silu", "split", "cuda")}
    assert arms["deepspeed_fused"] and arms["deepspeed_fused, fast SiLU forward"] and not arms["HF eager"]

    def rec(impl, ms, ours):
        return Record(suite="mlp_act", impl=impl, shape="s", dtype="bfloat16", ours=ours, fwd_ms=ms, fwd_bwd_ms=ms,
                      extra={"fwd_bwd_graph_ms": ms})

    recs = [rec("deepspeed_fused", 2.0, True), rec("deepspeed_fused, fast SiLU forward", 1.0, True),
            rec("HF eager", 4.0, False)]
    assert ratios_to_best_peer(recs)[("s", "deepspeed_fused")] == (2.0, 2.0)
    table = suite.summary(recs)
    assert "vs HF eager" in table and "fast SiLU" not in table and "2.00x / 2.00x" in table
