"""bench.common's CUDA-graph timing helper (the graph replay faked: it needs a GPU)."""
from deepspeed_fused.bench import common


def test_add_graph_times(monkeypatch):
    times = iter([0.5, 2.0])
    monkeypatch.setattr(common, "graph_ms", lambda fn, rep=100: next(times))
    rec = common.Record(suite="s", impl="i", shape="x", dtype="bfloat16", note="ours")
    common.add_graph_times(rec, None, None, 10, bytes_fwd=1e9, bytes_fwd_bwd=4e9)
    assert rec.extra == dict(fwd_graph_ms=0.5, fwd_bwd_graph_ms=2.0, fwd_graph_tbps=2.0, fwd_bwd_graph_tbps=2.0)
    assert rec.note == "ours; CUDA graph: fwd 0.5000 ms, fwd+bwd 2.0000 ms"

    def fail(fn, rep=100):
        raise RuntimeError("capture")

    monkeypatch.setattr(common, "graph_ms", fail)
    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda: None)
    rec = common.Record(suite="s", impl="i", shape="x", dtype="bfloat16")
    common.add_graph_times(rec, None, None, 10)
    assert rec.extra == {} and rec.note == "no CUDA graph: RuntimeError"
