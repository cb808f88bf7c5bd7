"""The moe_reorder suite's ``block`` case on CPU (tiny blocks of three families, fp32, kernels under
the interpreter): every arm gives a record with both timings, ours ran the feature's experts
implementation with the parts the report names fused, and it matches transformers' grouped_mm."""
import argparse
import json

from deepspeed_fused.bench import moe_reorder as suite
from deepspeed_fused.bench.common import write_results

# family -> what the feature fuses in its block (GPT-OSS: its own clamped gate and its top-k-first router)
FUSED = {"Qwen3-30B-A3B": ("swiglu", 1), "Mixtral-8x7B": ("swiglu", 1), "GPT-OSS-20B": ("oai", 1)}


def test_block_case_records(interpret, tmp_path):
    recs = suite.run(argparse.Namespace(extra=["--case=block"], quick=True))
    assert suite.RESULT == "moe_reorder_block" and ">= 2x transformers' grouped_mm path;" in suite.NOTES
    for name, (gate, routers) in FUSED.items():
        rs = {r.impl: r for r in recs if r.shape.startswith(f"block {name} ")}
        assert set(rs) == {"transformers grouped_mm", "transformers eager", "deepspeed_fused"}, rs.keys()
        for r in rs.values():
            assert r.fwd_ms and r.fwd_bwd_ms and "failed" not in r.note, r
        ours = rs["deepspeed_fused"]
        assert ours.ours and not rs["transformers grouped_mm"].ours
        assert ours.extra["fused"] == dict(applied=True, experts_gathers=1, gate_fused=gate, routers_fused=routers)
        assert ours.extra["experts_calls"] > 0  # the block's experts ran our implementation
        for impl in ("deepspeed_fused", "transformers eager"):
            for key in ("rel_err_out", "rel_err_dx", "rel_err_dgate_up"):
                assert rs[impl].extra[key] < 1e-4, (impl, key, rs[impl].extra)
        assert ours.extra["vs_grouped_mm_fwd_bwd"] > 0 and "vs grouped_mm: rel. error" in ours.note
    paths = write_results(suite.RESULT, recs, str(tmp_path), title=suite.TITLE, notes=suite.NOTES,
                          command=suite.COMMAND)
    assert paths["md"].endswith("moe_reorder_block.md") and len(json.load(open(paths["json"]))) == len(recs)
    assert "--case=block" in open(paths["md"]).read()
