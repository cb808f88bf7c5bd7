"""The gated activation ``mlp_act`` on the GPU: SiLU, tanh GELU and exact GELU in bf16/fp16/fp32 at
real MLP shapes, split and gate-up layouts, forward and backward bit for bit against CUDA eager
(``act(gate) * up``: eager's FP32 activation rounded once, the product rounded once), non-finite
inputs, poisoned outputs, CUDA graphs, torch.compile, no host syncs; dense models in bf16 with the
feature on equal to unpatched bit for bit. Each body runs in a clean worker (tests/conftest.py)."""
from __future__ import annotations

import copy

import pytest
import torch

from deepspeed_fused import patch_model, unpatch_model
from deepspeed_fused.features import mlp_act as F
from deepspeed_fused.ops import mlp_act as M

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
ACTS = ["silu", "gelu_tanh", "gelu"]
# rows, intermediate width: Llama-3.2-3B (8192), Llama-3-8B (14336), Qwen3-1.7B (6144), Qwen3-4B
# (9728), Gemma-3-1B (6912), odd sizes
SHAPES = [(8192, 8192), (4096, 14336), (8192, 6144), (2048, 9728), (4096, 6912), (1000, 1000), (3, 24)]


def _mismatch(a, b) -> str:
    d = a != b
    if not d.any():
        return ""
    i = d.nonzero()[0].tolist()
    return f"{int(d.sum())} of {d.numel()} differ; first at {i}: {a[tuple(i)].item()!r} vs {b[tuple(i)].item()!r}"


def _inputs(rows, inter, dtype, layout, seed):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    width = 2 * inter if layout != "split" else inter
    xs = [(2 * torch.randn(rows, width, generator=gen, device="cuda")).to(dtype)
          for _ in range(1 if layout != "split" else 2)]
    dh = torch.randn(rows, inter, generator=gen, device="cuda").to(dtype)
    return xs, dh


def _fns(layout, act):
    if layout == "split":
        return (lambda g, u: M.mlp_act(g, u, act)), (lambda g, u: M.mlp_act_reference(g, u, act))
    first = layout == "gate_up"
    return (lambda gu: M.mlp_act_fused(gu, act, first)), (lambda gu: M.mlp_act_fused_reference(gu, act, first))


def _both(layout, act, xs, dh):
    out = []
    for fn in _fns(layout, act):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        y = fn(*leaves)
        grads = torch.autograd.grad(y, leaves, dh)
        out.append((y.detach(), grads))
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_bitwise_equal_to_cuda_eager(act, dtype):
    # every shape and layout in one worker (a clean worker per test costs seconds)
    bad = []
    for shape in SHAPES:
        for layout in ("split", "gate_up", "up_gate"):
            if layout != "split" and shape[0] * shape[1] > 2 ** 26:
                continue  # the gate-up layouts at the smaller shapes
            xs, dh = _inputs(*shape, dtype, layout, seed=shape[0] + shape[1])
            (y, g), (yr, gr) = _both(layout, act, xs, dh)
            for what, a, b in [("out", y, yr)] + [(f"grad {i}", x, z) for i, (x, z) in enumerate(zip(g, gr))]:
                if a.dtype != b.dtype or _mismatch(a, b):
                    bad.append(f"{shape} {layout} {what}: {_mismatch(a, b)}")
            del xs, dh, y, g, yr, gr
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ACTS)
def test_non_finite_and_extreme_inputs(act, dtype):
    gen = torch.Generator(device="cuda").manual_seed(5)
    g = (3 * torch.randn(64, 512, generator=gen, device="cuda")).to(dtype)
    u = torch.randn(64, 512, generator=gen, device="cuda").to(dtype)
    big = torch.finfo(dtype).max
    g[0, :8] = torch.tensor([float("inf"), float("-inf"), float("nan"), big, -big, 30.0, -30.0, 0.0], device="cuda")
    u[1, :3] = torch.tensor([float("inf"), float("nan"), float("-inf")], device="cuda")
    dh = torch.randn(64, 512, generator=gen, device="cuda").to(dtype)
    (y, gs), (yr, gsr) = _both("split", act, [g, u], dh)
    assert torch.equal(y.isnan(), yr.isnan()) and torch.equal(y.isinf(), yr.isinf())
    fin = yr.isfinite()
    assert not _mismatch(y[fin], yr[fin]), _mismatch(y[fin], yr[fin])
    for a, b in zip(gs, gsr):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
        assert not _mismatch(a[b.isfinite()], b[b.isfinite()])


@pytest.mark.parametrize("pack", [1, 2, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fast_silu_forward_on_every_input(dtype, pack, monkeypatch):
    # the probe passes on this GPU (else the exact forward runs and says so), and the forward then
    # taken equals CUDA eager on every one of the 65536 gate values, in both layouts, each group size
    from deepspeed_fused.ops.mlp_act import launch as L

    monkeypatch.setattr(L, "FAST_SILU", True)
    monkeypatch.setattr(L, "SILU_PACK", pack)
    g = L.every_half_value(dtype, "cuda")
    u = torch.randn(256, 256, device="cuda").to(dtype)
    assert L.fast_silu_ok(g) and L._FAST_SILU_PROBES == {(g.device.index, dtype): True}
    # the values spread over many lanes and groups, so that a group's exact branch serves its neighbours
    gs, us = g.reshape(-1)[torch.randperm(g.numel(), device="cuda")].view(64, 1024), u.view(64, 1024)
    for y, yr in ((M.mlp_act(g, u, "silu"), M.mlp_act_reference(g, u, "silu")),
                  (M.mlp_act(gs, us, "silu"), M.mlp_act_reference(gs, us, "silu")),
                  (M.mlp_act_fused(torch.cat([g, u], 1), "silu", True),
                   M.mlp_act_fused_reference(torch.cat([g, u], 1), "silu", True))):
        assert bool(L.same_bits(y, yr).all()), _mismatch(y.float().nan_to_num(7.0), yr.float().nan_to_num(7.0))


def test_poisoned_outputs_and_strided_inputs():
    real_empty = torch.empty

    def poisoned(*a, **k):
        return real_empty(*a, **k).fill_(float("nan"))

    xs, dh = _inputs(4097, 3000, torch.bfloat16, "split", seed=7)
    gate = torch.cat([xs[0], xs[0][:, :128]], 1)[:, :3000]  # a row stride wider than the row
    torch.empty = poisoned
    try:
        (y, g), (yr, gr) = _both("split", "silu", [gate, xs[1]], dh)
    finally:
        torch.empty = real_empty
    assert torch.equal(y, yr) and all(torch.equal(a, b) for a, b in zip(g, gr))


def test_cuda_graph_no_host_sync_and_compile():
    xs, dh = _inputs(2048, 8192, torch.bfloat16, "split", seed=8)
    leaves = [x.detach().clone().requires_grad_() for x in xs]

    def step():
        y = M.mlp_act(*leaves, "gelu_tanh")
        return (y,) + torch.autograd.grad(y, leaves, dh)

    first = step()
    second = step()  # the direct launches
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    static = [x.detach().clone() for x in xs]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        M.mlp_act(*static, "silu")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = M.mlp_act(*static, "silu")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, M.mlp_act_reference(*static, "silu"))
    torch._dynamo.reset()
    f = torch.compile(lambda gu: M.mlp_act_fused(gu, "gelu", True) * 2, fullgraph=True)
    gu = torch.cat(xs, 1)
    a, b = gu.detach().clone().requires_grad_(), gu.detach().clone().requires_grad_()
    (ga,) = torch.autograd.grad(f(a), a, dh)
    (gb,) = torch.autograd.grad(M.mlp_act_fused_reference(b, "gelu", True) * 2, b, dh)
    assert torch.equal(ga, gb)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "phi3", "glm"])
def test_models_bf16_equal_unpatched(family):
    from unit.test_mlp_act_feature import build

    model = build(family, dtype=torch.bfloat16).cuda().train()
    ref = copy.deepcopy(model)
    rep = patch_model(model, {"mlp_act": {"enabled": True}})["mlp_act"]
    assert rep.applied and rep.fallback == ""
    ids = torch.randint(0, 97, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    losses, grads = [], []
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in m.parameters()])
    assert rep.calls.fused == model.config.num_hidden_layers and rep.calls.eager == 0
    assert torch.equal(*losses)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    assert sum(F.is_replaced(m) for m in model.modules()) == model.config.num_hidden_layers
    unpatch_model(model)
