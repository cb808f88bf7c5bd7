"""The rope suite on CPU (tiny shapes, kernels under the interpreter): every implementation that
runs here gives a record with both timings, and the files are written."""
import argparse
import json

import pytest

from deepspeed_fused.bench import rope as suite
from deepspeed_fused.bench.common import write_results


def test_rope_suite_records(interpret, tmp_path):
    recs = suite.run(argparse.Namespace(extra=[], quick=True))
    shapes = [sh[0] for sh in suite.CPU_SHAPES]
    for shape in shapes:
        rs = {r.impl: r for r in recs if r.shape == shape}
        assert {"deepspeed_fused", "deepspeed_fused op", "HF eager"} <= set(rs), rs.keys()
        for r in rs.values():
            assert r.fwd_ms and r.fwd_bwd_ms and "failed" not in r.note, r
            assert r.unit == "TB/s" and r.fwd_rate > 0
        assert rs["deepspeed_fused"].ours and not rs["HF eager"].ours
    paths = write_results(suite.SUITE, recs, str(tmp_path), title=suite.TITLE, notes=suite.NOTES)
    assert len(json.load(open(paths["json"]))) == len(recs)
    assert "deepspeed_fused" in open(paths["md"]).read()


def test_breakdown_counts_the_rope_kernel_as_rope():
    """The e2e breakdown attributes our rotary kernel to the rope category by its name, wherever it
    is launched (the backward's launch has no enclosing range)."""
    from deepspeed_fused.bench.breakdown import attribute
    from unit.test_e2e_breakdown import Trace

    t = Trace()
    t.kernel("_rope_kernel", 100, 40)
    t.range("e2e::attention", 1000, 500)
    t.kernel("_rope_kernel", 1010, 60)
    b = attribute(t.events)
    assert b["categories"]["rope + attention elementwise"] == pytest.approx(0.1)


def test_sweep_writes_its_own_files(monkeypatch, tmp_path):
    """``rope --sweep`` writes rope_sweep.* with its own title, timing method and command, and
    leaves the suite's rope.* alone; a plain run afterwards names the suite's files again. (The
    sweep itself needs a GPU: its timing is replaced by one record here.)"""
    from deepspeed_fused.bench import common
    from deepspeed_fused.bench.__main__ import main

    for name in ("RESULT", "TITLE", "COMMAND", "METHOD", "NOTES", "PANELS"):  # restored after the test whatever happens
        monkeypatch.setattr(suite, name, getattr(suite, name))
    rec = common.Record(suite.SUITE, "tile_pairs/max_block_r/warps/interleave_qk/share_halves 2048/64/4/False/True",
                 "Qwen3 8192 tok", "bfloat16", ours=True, fwd_ms=0.058, fwd_bwd_ms=0.059, unit="TB/s")
    monkeypatch.setattr(suite, "sweep", lambda args: [rec])
    plotted = []
    monkeypatch.setattr(common, "plot", lambda records, path, title, panels: plotted.append((path, panels)))
    assert main(["rope", "--sweep", "--out", str(tmp_path)]) == 0
    # the plot's panels say what the two columns hold here: each direction alone, not forward+backward
    assert plotted == [(str(tmp_path / "rope_sweep.png"), suite._SWEEP_PANELS)]
    assert "backward alone" in suite._SWEEP_PANELS[1]
    assert not (tmp_path / "rope.md").exists()
    md = (tmp_path / "rope_sweep.md").read_text()
    assert "`python -m deepspeed_fused.bench rope --sweep`" in md
    assert "CUDA-graph replays" in md and "do_bench" not in md.split("\n")[2]
    assert "backward alone" in md and "Targets" not in md
    assert json.load(open(tmp_path / "rope_sweep.json"))[0]["impl"] == rec.impl
    # a plain run names the suite's files again (with no shapes it times nothing: the module state is checked)
    monkeypatch.setattr(suite, "CPU_SHAPES", [])
    assert suite.run(argparse.Namespace(extra=[], quick=True)) == []
    assert (suite.RESULT, suite.COMMAND, suite.METHOD, suite.PANELS) == (None, None, None, None)
    assert suite.TITLE.startswith("Fused rotary embedding") and suite.NOTES.startswith("Targets")
