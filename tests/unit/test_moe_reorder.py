"""moe_reorder: row gathers (CPU: Triton interpreter at small shapes, eager path at 1e5 rows),
DeepSpeed AutoEP integration (1 and 2 forked gloo ranks) and the transformers experts path."""
import importlib
import os
import warnings

import pytest
import torch
import triton
import transformers
from deepspeed.moe.ep_kernels import generate_permute_indices
from tiny_models import build_model
from transformers.integrations.moe import grouped_mm_experts_forward

from deepspeed_fused import patch_model, unpatch_model
from deepspeed_fused.features import moe_reorder
from deepspeed_fused.ops import _common
from deepspeed_fused.ops import moe_reorder as mr
from deepspeed_fused.ops.moe_reorder import api as permute, launch as kernels, reference, route
from unit.common import DistributedTest

# Import the model classes once here (and in the worker server the ranks fork from), not in every rank.
for _cls in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM",
             "LlamaForCausalLM"):
    getattr(transformers, _cls)

FLOATS = [torch.float32, torch.float16]  # bf16 is not exact in the interpreter: GPU tests cover it


def _indices(counts, alignment, index_dtype=torch.int32, ep_degree=1):
    """DeepSpeed's own permutation indices for per-expert counts (CPU path: -1 padding)."""
    counts = torch.as_tensor(counts, dtype=torch.int32)
    n = int(counts.sum())
    num_local = counts.numel() // ep_degree
    max_len = ((n + num_local * alignment + alignment - 1) // alignment) * alignment
    pidx, _, _ = generate_permute_indices(counts, num_local, ep_degree, max_len, alignment, use_cpu=True)
    return pidx.to(index_dtype), n


def _routing(kind, n, experts, gen):
    if kind == "random":
        assign = torch.randint(0, experts, (n, ), generator=gen)
    elif kind == "empty":  # half the experts get nothing
        assign = torch.randint(0, max(1, experts // 2), (n, ), generator=gen) * 2
    else:  # "one": a single expert takes every row
        assign = torch.full((n, ), experts - 1)
    return torch.bincount(assign, minlength=experts)


CASES = [  # (routing, rows, experts, alignment, ep_degree)
    ("random", 1, 4, 8, 1), ("random", 7, 3, 16, 1), ("empty", 100, 8, 32, 1), ("one", 53, 5, 8, 1),
    ("random", 300, 6, 16, 1), ("random", 90, 4, 8, 2),
]


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-N{c[1]}-E{c[2]}-a{c[3]}-ep{c[4]}")
def test_permute_unpermute_equal_eager(interpret, dtype, case):
    kind, n, experts, alignment, ep = case
    index_dtype = torch.int64 if CASES.index(case) % 2 else torch.int32
    gen = torch.Generator().manual_seed(n * 31 + experts)
    counts = _routing(kind, n, experts * ep, gen)
    pidx, n = _indices(counts, alignment, index_dtype, ep)
    pidx = pidx.to(interpret)
    hidden = 40  # not a power of two: a ragged column block
    rows = torch.randn(n, hidden, dtype=dtype, generator=gen).to(interpret).requires_grad_()
    ref_rows = rows.detach().clone().requires_grad_()
    mr.validate_permutation(pidx, n)

    out = mr.permute_rows(rows, pidx)
    ref = mr.permute_rows_reference(ref_rows, pidx)
    assert out.shape == (pidx.numel(), hidden) and out.dtype == dtype
    assert torch.equal(out, ref)
    assert torch.equal(out[pidx < 0], torch.zeros_like(out[pidx < 0]))
    # gradient and double backward (the backward is the unpermute gather, itself differentiable)
    g = torch.randn(out.shape, dtype=dtype, generator=gen).to(interpret).requires_grad_()
    (gx, ) = torch.autograd.grad(out, rows, g, create_graph=True)
    (gx_ref, ) = torch.autograd.grad(ref, ref_rows, g, create_graph=True)
    assert torch.equal(gx, gx_ref)
    v = torch.randn(gx.shape, dtype=dtype, generator=gen).to(interpret)
    assert torch.equal(torch.autograd.grad(gx, g, v)[0], torch.autograd.grad(gx_ref, g, v)[0])

    slots = torch.randn(pidx.numel(), hidden, dtype=dtype, generator=gen).to(interpret).requires_grad_()
    ref_slots = slots.detach().clone().requires_grad_()
    back = mr.unpermute_rows(slots, pidx, n)
    back_ref = mr.unpermute_rows_reference(ref_slots, pidx, n)
    assert back.shape == (n, hidden) and torch.equal(back, back_ref)
    g2 = torch.randn(back.shape, dtype=dtype, generator=gen).to(interpret).requires_grad_()
    (gs, ) = torch.autograd.grad(back, slots, g2, create_graph=True)
    (gs_ref, ) = torch.autograd.grad(back_ref, ref_slots, g2, create_graph=True)
    assert torch.equal(gs, gs_ref)  # padding slots: zero gradient
    v2 = torch.randn(gs.shape, dtype=dtype, generator=gen).to(interpret)
    assert torch.equal(torch.autograd.grad(gs, g2, v2)[0], torch.autograd.grad(gs_ref, g2, v2)[0])
    # round trip
    assert torch.equal(mr.unpermute_rows(out.detach(), pidx, n), rows.detach())


def test_padding_n_tokens_convention(interpret):
    """Indices padded with N (the appended zero row of the eager formulation) work like -1."""
    pidx, n = _indices([3, 0, 5], 8)
    pidx = pidx.to(interpret)
    pidx_n = torch.where(pidx < 0, n, pidx)
    rows = torch.randn(n, 16, device=interpret)
    assert torch.equal(mr.permute_rows(rows, pidx_n, validate=True), mr.permute_rows(rows, pidx))
    slots = torch.randn(pidx.numel(), 16, device=interpret)
    assert torch.equal(mr.unpermute_rows(slots, pidx_n, n), mr.unpermute_rows_reference(slots, pidx, n))


def test_poisoned_outputs(interpret):
    """The kernels write every element of their output (NaN-poisoned buffers)."""
    d = interpret
    pidx, n = _indices([5, 0, 9, 1], 8, torch.int64)
    pidx = pidx.to(d)
    rows = torch.randn(n, 24, device=d)
    out = torch.full((pidx.numel(), 24), float("nan"), device=d)
    kernels.gather_rows(rows, pidx, out=out)
    assert torch.equal(out, mr.permute_rows_reference(rows, pidx))
    slot = torch.tensor([[0, 3], [2, -1], [5, 1]], device=d)
    w = torch.rand(3, 2, device=d)
    src = torch.randn(6, 24, device=d)
    out = torch.full((3, 24), float("nan"), device=d)
    kernels.combine_rows(src, slot, w, out=out)
    torch.testing.assert_close(out, mr.combine_reference(src, slot, w), rtol=1e-6, atol=1e-6)


def test_inverse_permutation():
    pidx = torch.tensor([2, 0, -1, -1, 1, -1, 3, -1], dtype=torch.int32)
    inv = mr.inverse_permutation(pidx, 4)
    assert inv.dtype == torch.int64 and inv.tolist() == [1, 4, 0, 6]
    assert mr.inverse_permutation(pidx, 4) is inv  # cached for the unpermute of the same layer
    pidx[0] = 3  # an in-place change invalidates the cache
    assert mr.inverse_permutation(pidx, 4) is not inv
    # a missing row reads as -1 (a zero row), never uninitialised memory
    assert mr.inverse_permutation(torch.tensor([1, -1]), 2).tolist() == [-1, 0]


def test_permute_builds_inverse(interpret):
    """The first permute of an index tensor writes the inverse in the gather kernel and caches it."""
    pidx, n = _indices([4, 0, 7, 2], 8, torch.int64)
    pidx = pidx.to(interpret)
    rows = torch.randn(n, 24, device=interpret)
    assert permute._cached_inverse(pidx, n) is None
    out = mr.permute_rows(rows, pidx)
    inv = permute._cached_inverse(pidx, n)
    assert inv is not None and torch.equal(inv, reference.invert(pidx, n))
    assert torch.equal(out, mr.permute_rows_reference(rows, pidx))
    out2, inv2 = permute._permute_inverse_op(rows, pidx)
    assert torch.equal(out2, out) and torch.equal(inv2, inv)


def test_validate_errors():
    pidx = torch.tensor([0, 2, -1, 2, 1, -1], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"entry 3 repeats row 2 \(first at entry 1\)"):
        mr.validate_permutation(pidx, 3)
    with pytest.raises(ValueError, match="entry 1 is 7, out of range"):
        mr.validate_permutation(torch.tensor([0, 7, 1, -1]), 2)
    with pytest.raises(ValueError, match="entry 2 is -3, out of range"):
        mr.validate_permutation(torch.tensor([0, 1, -3]), 2)
    with pytest.raises(ValueError, match="row 1 appears in no entry"):
        mr.validate_permutation(torch.tensor([0, -1, 2]), 3)
    rows = torch.randn(3, 8)
    with pytest.raises(ValueError, match="repeats row 2"):
        mr.permute_rows(rows, pidx, validate=True)
    with pytest.raises(ValueError, match="repeats row 2"):
        mr.unpermute_rows(torch.randn(6, 8), pidx, 3, validate=True)
    with pytest.raises(TypeError, match="permuted_indices: expected an int32 or int64 tensor, got torch.float32"):
        mr.permute_rows(rows, pidx.float())
    with pytest.raises(TypeError, match="int32 or int64"):
        mr.validate_permutation(pidx.to(torch.int16), 3)
    with pytest.raises(ValueError, match="rows: expected a 2-D"):
        mr.permute_rows(rows[0], pidx)
    with pytest.raises(ValueError, match="rows: expected 6 rows"):
        mr.unpermute_rows(rows, pidx, 3)
    with pytest.raises(ValueError, match="num_rows"):
        mr.unpermute_rows(torch.randn(6, 8), pidx, -1)
    maps = mr.route_maps(torch.tensor([2, 0, 1]), 1)
    with pytest.raises(ValueError, match="weights: expected 3 floating-point routing weights, got 3 of torch.int64"):
        mr.route_combine(rows, maps, torch.ones(3, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="weights: expected 3 floating-point routing weights, got 6"):
        mr.route_combine(rows, maps, torch.ones(3, 2))


def test_eager_path_large(monkeypatch):
    """Without the interpreter CPU tensors run the eager formulations (one warning), here at 1e5 rows."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    _common.reset_fallback_warnings()
    gen = torch.Generator().manual_seed(0)
    counts = _routing("random", 100_000, 64, gen)
    counts[3] = 0
    pidx, n = _indices(counts, 16)
    rows = torch.randn(n, 8, generator=gen).requires_grad_()
    ref_rows = rows.detach().clone().requires_grad_()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = mr.permute_rows(rows, pidx)
        mr.permute_rows(rows.detach(), pidx)
    assert sum("moe_reorder.permute_rows" in str(x.message) for x in w) == 1
    ref = mr.permute_rows_reference(ref_rows, pidx)
    assert torch.equal(out, ref)
    g = torch.randn(out.shape, generator=gen)
    out.backward(g)
    ref.backward(g)
    assert torch.equal(rows.grad, ref_rows.grad)
    back = mr.unpermute_rows(out.detach(), pidx, n)
    assert torch.equal(back, rows.detach())


def test_unsupported_dtype_falls_back(interpret):
    _common.reset_fallback_warnings()
    pidx, n = _indices([2, 3], 8)
    pidx = pidx.to(interpret)
    rows = torch.randn(n, 8, dtype=torch.float64, device=interpret)
    with pytest.warns(RuntimeWarning, match="dtype torch.float64"):
        out = mr.permute_rows(rows, pidx)
    assert torch.equal(out, mr.permute_rows_reference(rows, pidx))


def _transformers_maps(ids, num_experts):
    """The maps the transformers path builds: assignments sorted by expert id, the slot of a
    sentinel (an expert of another rank) is padding."""
    vals, perm = torch.sort(ids.reshape(-1))
    positions = torch.arange(perm.numel()).masked_fill(vals >= num_experts, -1)
    return mr.route_maps(perm, ids.shape[1], positions)


def _transformers_style(hidden, ids, weights, num_experts, proj):
    """The grouped_mm data movement in eager torch: sort, gather, expert op, weight, inverse, sum."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1)
    ids_g, perm = torch.sort(flat)
    sentinel = (ids_g >= num_experts)[:, None]
    x = hidden[perm // top_k].masked_fill(sentinel, 0.0)
    y = proj(x).masked_fill(sentinel, 0.0)
    weighted = y * weights.reshape(-1)[perm][:, None]
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel())
    return weighted[inv].view(ids.shape[0], top_k, -1).sum(1).to(hidden.dtype), perm


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_dispatch_combine_vs_transformers(interpret, dtype, top_k):
    gen = torch.Generator().manual_seed(top_k)
    tokens, experts, hidden = 19, 6, 40
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    ids[3, 0] = experts  # a sentinel (expert of another rank)
    w = torch.rand(tokens, top_k, generator=gen).masked_fill(ids >= experts, 0.0).requires_grad_()
    h = torch.randn(tokens, hidden, dtype=dtype, generator=gen).requires_grad_()
    mat = torch.randn(hidden, hidden, generator=gen) / hidden**0.5

    def proj(x):
        return (x.float() @ mat).to(x.dtype)

    h_ref, w_ref = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref, perm = _transformers_style(h_ref, ids, w_ref, experts, proj)
    flat = ids.reshape(-1)
    maps = _transformers_maps(ids, experts)
    token_of_slot = torch.where(torch.sort(flat).values >= experts, -1, perm // top_k)
    slot = mr.inverse_permutation(perm, perm.numel()).masked_fill(flat >= experts, -1)
    assert torch.equal(maps.token.long(), token_of_slot) and torch.equal(maps.slot.long(), slot)
    x = mr.route_dispatch(h, maps)
    assert torch.equal(x, h_ref.detach()[perm // top_k].masked_fill((token_of_slot < 0)[:, None], 0.0))
    out = mr.route_combine(proj(x), maps, w)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out, ref, **tol)
    g = torch.randn(out.shape, dtype=dtype, generator=gen)
    gh, gw = torch.autograd.grad(out, (h, w), g)
    gh_ref, gw_ref = torch.autograd.grad(ref, (h_ref, w_ref), g)
    torch.testing.assert_close(gh, gh_ref, **tol)
    torch.testing.assert_close(gw, gw_ref, **(tol if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)))
    assert gw[3, 0] == 0  # the sentinel gets no router gradient
    # combine without weights (the dispatch backward) has its own backward
    s = torch.randn(perm.numel(), hidden, dtype=dtype, generator=gen).requires_grad_()
    summed = mr.route_combine(s, maps)
    torch.testing.assert_close(summed, mr.combine_reference(s.detach(), slot.view(tokens, top_k)), **tol)
    (gs, ) = torch.autograd.grad(summed, s, torch.ones_like(summed))
    used = torch.zeros(perm.numel(), dtype=torch.bool)
    used[slot[slot >= 0]] = True
    assert torch.equal(gs[used], torch.ones_like(gs[used])) and torch.equal(gs[~used], torch.zeros_like(gs[~used]))


def test_dispatch_combine_double_backward(interpret):
    """Gradients of route_dispatch -> experts -> route_combine differentiate again, as in eager
    transformers, in the eager Functions and in the custom ops torch.compile traces (each op's
    derivative is written in the others, the combine's fused backward included)."""
    gen = torch.Generator().manual_seed(7)
    tokens, top_k, experts, hidden = 13, 2, 4, 24
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    ids[2, 1] = experts  # a sentinel
    w = torch.rand(tokens, top_k, generator=gen).masked_fill(ids >= experts, 0.0).requires_grad_()
    h = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    mat = torch.randn(hidden, hidden, generator=gen) / hidden**0.5

    def proj(x):
        return torch.tanh(x @ mat)  # not linear: second derivatives in h too

    h_ref, w_ref = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    ref, perm = _transformers_style(h_ref, ids, w_ref, experts, proj)
    maps = _transformers_maps(ids, experts)
    m3 = (maps.token, maps.assignment, maps.slot)
    out = mr.route_combine(proj(mr.route_dispatch(h, maps)), maps, w)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-6)
    g = torch.randn(out.shape, generator=gen)
    gh, gw = torch.autograd.grad(out, (h, w), g, create_graph=True)
    gh_r, gw_r = torch.autograd.grad(ref, (h_ref, w_ref), g, create_graph=True)
    torch.testing.assert_close(gh, gh_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gw, gw_r, rtol=1e-5, atol=1e-6)
    vh, vw = torch.randn(gh.shape, generator=gen), torch.randn(gw.shape, generator=gen)
    d2 = torch.autograd.grad((gh * vh).sum() + (gw * vw).sum(), (h, w))
    d2_r = torch.autograd.grad((gh_r * vh).sum() + (gw_r * vw).sum(), (h_ref, w_ref))
    assert d2[0].abs().sum() > 0 and d2[1].abs().sum() > 0
    for a, b in zip(d2, d2_r):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the custom ops (what torch.compile traces)
    hc, wc = h.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    outc = route._combine_op(proj(route._dispatch_op(hc, *m3, None, top_k)), *m3, wc, top_k)
    ghc, gwc = torch.autograd.grad(outc, (hc, wc), g, create_graph=True)
    torch.testing.assert_close(ghc, gh_r, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(gwc, gw_r, rtol=1e-5, atol=1e-6)
    d2c = torch.autograd.grad((ghc * vh).sum() + (gwc * vw).sum(), (hc, wc))
    for a, b in zip(d2c, d2_r):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # the fused backward op's derivative to every input, against autograd of the torch reference
    src = torch.randn(perm.numel(), hidden, generator=gen).requires_grad_()
    gr = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    ww = w.detach().clone().requires_grad_()
    gs_op, gw_op = route._combine_backward_op(gr, src, *m3, ww, top_k)
    src_r, gr_r, ww_r = (t.detach().clone().requires_grad_() for t in (src, gr, ww))
    gs_ref, gw_ref = torch.autograd.grad(mr.route_combine_reference(src_r, maps, ww_r), (src_r, ww_r), gr_r,
                                         create_graph=True)
    torch.testing.assert_close(gs_op, gs_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gw_op, gw_ref, rtol=1e-5, atol=1e-6)
    us, uw = torch.randn(gs_op.shape, generator=gen), torch.randn(gw_op.shape, generator=gen)
    d3 = torch.autograd.grad((gs_op * us).sum() + (gw_op * uw).sum(), (gr, src, ww))
    d3_r = torch.autograd.grad((gs_ref * us).sum() + (gw_ref * uw).sum(), (gr_r, src_r, ww_r))
    for a, b in zip(d3, d3_r):
        assert a.abs().sum() > 0
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    # without create_graph the kernels run directly (the combine's two gradients in one pass):
    # bitwise the same first-order values
    out2 = mr.route_combine(proj(mr.route_dispatch(h, maps)), maps, w)
    gh2, gw2 = torch.autograd.grad(out2, (h, w), g)
    assert torch.equal(gh2, gh.detach()) and torch.equal(gw2, gw.detach())


@pytest.mark.parametrize("tokens,top_k,slots", [(0, 2, 4), (3, 1, 0), (0, 2, 0)])
def test_combine_double_backward_empty(interpret, tokens, top_k, slots):
    """No tokens or no slots (every assignment unplaced): first and second order run and give zeros."""
    hidden = 8
    src = torch.randn(slots, hidden).requires_grad_()
    maps = mr.RouteMaps(torch.full((slots, ), -1, dtype=torch.int32), torch.full((slots, ), -1, dtype=torch.int32),
                        torch.full((tokens * top_k, ), -1, dtype=torch.int32), top_k)
    w = torch.rand(tokens, top_k).requires_grad_()
    out = mr.route_combine(src, maps, w)
    assert out.shape == (tokens, hidden) and not out.abs().sum()
    gs, gw = torch.autograd.grad(out, (src, w), torch.randn(out.shape), create_graph=True, allow_unused=True)
    for g, like in ((gs, src), (gw, w)):
        assert g is None or (g.shape == like.shape and not g.abs().sum())
    gr = torch.randn(tokens, hidden).requires_grad_()
    gs_op, gw_op = route._combine_backward_op(gr, src, maps.token, maps.assignment, maps.slot, w, top_k)
    d = torch.autograd.grad(gs_op.sum() + gw_op.sum(), (gr, src, w), allow_unused=True)
    assert all(t is None or not t.abs().sum() for t in d)


def test_opcheck(interpret):
    """Every custom op torch.compile traces: schema, fake implementation, autograd registration."""
    d = interpret
    pidx, n = _indices([3, 1, 0], 8, torch.int64)
    pidx = pidx.to(d)
    inv = mr.inverse_permutation(pidx, n)
    rows = torch.randn(n, 16, device=d, requires_grad=True)
    ops = torch.ops.deepspeed_fused
    torch.library.opcheck(ops.moe_permute.default, (rows, pidx, inv))
    torch.library.opcheck(ops.moe_unpermute.default,
                          (torch.randn(pidx.numel(), 16, device=d, requires_grad=True), pidx, inv))
    torch.library.opcheck(ops.moe_permute_with_inverse.default, (rows, pidx))
    order = torch.tensor([3, 0, 5, 1, 4, 2], device=d)
    positions = torch.tensor([0, 1, -1, 2, 3, 4, 6, 5], device=d)  # a padding slot, an out-of-range one
    torch.library.opcheck(ops.moe_route_maps.default, (order, positions, 2))
    torch.library.opcheck(ops.moe_route_maps.default, (order, None, 3))
    m = mr.route_maps(order, 2, positions)
    m3 = (m.token, m.assignment, m.slot)
    x = torch.randn(3, 16, device=d, requires_grad=True)
    y = torch.randn(8, 16, device=d, requires_grad=True)
    w = torch.rand(3, 2, device=d, requires_grad=True)
    for weights in (None, w):
        torch.library.opcheck(ops.moe_dispatch.default, (x, *m3, weights, 2))
        torch.library.opcheck(ops.moe_combine.default, (y, *m3, weights, 2))
    torch.library.opcheck(ops.moe_slot_dot.default, (x, y, *m3, 2))
    torch.library.opcheck(ops.moe_combine_backward.default, (torch.randn(3, 16, device=d, requires_grad=True), y,
                                                             *m3, w, 2))


def test_both_paths_compile_whole_and_match_eager(interpret):
    """torch.compile (aot_eager: the custom ops' fake implementations and derivatives) traces the
    transformers path's and AutoEP's dispatch/combine in one graph each (fullgraph), with outputs
    and gradients equal to eager."""
    gen = torch.Generator().manual_seed(2)
    tokens, top_k, experts, hidden = 9, 2, 4, 16
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    ids[1, 0] = experts  # a sentinel
    h = torch.randn(tokens, hidden, generator=gen).to(interpret)
    w = torch.rand(tokens, top_k, generator=gen).to(interpret)
    ids = ids.to(interpret)

    def transformers_path(h, w):
        maps = mr.route_sort(ids.reshape(-1), experts, top_k).maps
        return mr.route_combine(torch.tanh(mr.route_dispatch(h, maps)), maps, w)

    def autoep_path(h, w):  # scores before and after the experts, padding slots every third
        order = torch.argsort(ids.reshape(-1), stable=True)
        n = order.numel()
        positions = torch.arange(n + n // 3, device=h.device)
        positions = torch.where(positions % 3 == 2, -1, positions - positions // 3)
        maps = mr.route_maps(order, top_k, positions)
        return mr.route_combine(torch.tanh(mr.route_dispatch(h, maps, w)), maps, w)

    for fn in (transformers_path, autoep_path):
        res = []
        for compiled in (False, True):
            torch._dynamo.reset()
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            run = torch.compile(fn, backend="aot_eager", fullgraph=True) if compiled else fn
            out = run(hh, ww)
            res.append((out.detach(), ) + torch.autograd.grad(out, (hh, ww), torch.ones_like(out)))
        for a, b in zip(*res):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        assert res[0][2].abs().sum() > 0


# ----------------------------------------------------------------------------------------------
# route_sort: expert ids -> expert order, route maps and grouped_mm's offsets
# ----------------------------------------------------------------------------------------------

def _sort_expected(ids, num_experts, top_k):
    """What the transformers path built before route_sort, with a stable sort: sentinels (ids
    outside [0, E)) to the tail, their positions padding; grouped_mm's histc + cumsum offsets
    (bincount at E=1: histc with min == max == 0 takes its range from the data, sentinels included)."""
    flat = ids.reshape(-1).long()
    bucket = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    vals, order = torch.sort(bucket, stable=True)
    positions = torch.arange(flat.numel()).masked_fill(vals >= num_experts, -1)
    maps = mr.route_maps_reference(order, top_k, positions)
    if num_experts > 1:
        counts = torch.histc(flat.float(), bins=num_experts, min=0, max=num_experts - 1)
    else:
        counts = torch.bincount(bucket, minlength=2)[:1]
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    return order.int(), maps, offsets, vals.clamp(max=num_experts - 1).int()


def _assert_sort_equal(got, want):
    got = mr.RouteSort(got.order.cpu(), mr.RouteMaps(*(t.cpu() for t in got.maps[:3]), got.maps.top_k),
                       got.offsets.cpu(), got.experts.cpu())
    order, maps, offsets, experts = want
    assert got.order.dtype == torch.int32 and torch.equal(got.order, order)
    assert got.maps.top_k == maps.top_k
    for name, a, b in zip(("token", "assignment", "slot"), got.maps[:3], maps[:3]):
        assert a.dtype == torch.int32 and torch.equal(a, b), name
    assert got.offsets.dtype == torch.int32 and torch.equal(got.offsets, offsets)
    assert got.experts.dtype == torch.int32 and torch.equal(got.experts, experts)


SORT_CASES = [  # (tokens, top_k, experts, sentinel ids, chunk: assignments per program, None: the default)
    (37, 2, 6, 0, None), (29, 1, 5, 2, None), (50, 3, 7, 1, 128), (64, 4, 16, 3, None), (19, 5, 4, 2, None),
    (41, 6, 9, 0, 128), (23, 7, 3, 1, None), (90, 8, 40, 4, 256), (33, 8, 1, 0, None), (40, 2, 1, 1, 128),
    (130, 2, 126, 2, 128),  # E + 2 a power of two: the end-of-input bucket is the last one
]


@pytest.mark.parametrize("case", SORT_CASES, ids=lambda c: f"T{c[0]}-k{c[1]}-E{c[2]}-s{c[3]}-c{c[4]}")
def test_route_sort_matches_reference(interpret, case):
    """The kernels and the torch reference against the sort + histc + cumsum + route_maps build,
    int32 and int64 ids, several programs and several rank blocks per program."""
    tokens, top_k, experts, sentinels, chunk = case
    gen = torch.Generator().manual_seed(tokens * 7 + top_k)
    ids = torch.randint(0, experts + sentinels, (tokens, top_k), generator=gen)
    if sentinels:
        ids.view(-1)[::11] = experts + sentinels + 5  # far past the experts
        ids.view(-1)[3] = -1  # negative: a sentinel as well
    want = _sort_expected(ids, experts, top_k)
    for dtype in (torch.int32, torch.int64):
        flat = ids.reshape(-1).to(dtype).to(interpret)
        _assert_sort_equal(mr.route_sort_reference(flat, experts, top_k), want)
        if chunk is None:
            with warnings.catch_warnings():
                warnings.filterwarnings("error", message=".*route_sort")  # the kernels ran
                _assert_sort_equal(mr.route_sort(flat, experts, top_k), want)
        else:
            o = kernels.route_sort_into(flat, experts, top_k, chunk=chunk)
            _assert_sort_equal(mr.RouteSort(o[0], mr.RouteMaps(*o[1:4], top_k), o[4], o[5]), want)
    # what the properties say: a permutation, experts nondecreasing, ascending within an expert
    got = mr.route_sort(ids.reshape(-1).to(interpret), experts, top_k)
    order = got.order.long().cpu()
    assert torch.equal(torch.sort(order).values, torch.arange(order.numel()))
    key = torch.where((ids.reshape(-1) >= 0) & (ids.reshape(-1) < experts), ids.reshape(-1), experts)[order]
    assert bool((key[1:] >= key[:-1]).all())
    same = key[1:] == key[:-1]
    assert bool((order[1:][same] > order[:-1][same]).all())
    n_real = int((key < experts).sum())
    assert int(got.offsets[-1]) == n_real and bool((got.maps.token[n_real:] == -1).all())
    assert bool((got.maps.token[:n_real] >= 0).all())


def test_route_sort_poisoned_outputs(interpret):
    """Every element of the six outputs is written (poisoned buffers), over several programs."""
    gen = torch.Generator().manual_seed(5)
    tokens, top_k, experts = 70, 4, 12
    ids = torch.randint(0, experts + 2, (tokens * top_k, ), generator=gen).to(interpret)
    n = ids.numel()
    out = tuple(torch.full((n, ), 12345, dtype=torch.int32, device=interpret) for _ in range(4)) + (
        torch.full((experts, ), -999, dtype=torch.int32, device=interpret),
        torch.full((n, ), 777, dtype=torch.int32, device=interpret))
    res = kernels.route_sort_into(ids, experts, top_k, out=out, chunk=128)
    assert all(a is b for a, b in zip(res, out))
    _assert_sort_equal(mr.RouteSort(out[0], mr.RouteMaps(*out[1:4], top_k), out[4], out[5]),
                       _sort_expected(ids.cpu(), experts, top_k))


@pytest.mark.parametrize("top_k", [1, 3])
def test_route_sort_empty(interpret, top_k):
    for dtype in (torch.int32, torch.int64):
        got = mr.route_sort(torch.empty(0, dtype=dtype, device=interpret), 5, top_k)
        assert got.order.shape == (0, ) and all(t.shape == (0, ) for t in got.maps[:3]) and got.experts.shape == (0, )
        assert got.offsets.dtype == torch.int32 and not got.offsets.cpu().any() and got.offsets.shape == (5, )
        _assert_sort_equal(got, _sort_expected(torch.empty(0, dtype=torch.long), 5, top_k))


def test_route_sort_wrong_inputs():
    ids = torch.tensor([0, 2, 1, 1])
    with pytest.raises(TypeError, match="expert_ids: expected a torch.Tensor, got list"):
        mr.route_sort([0, 1], 2, 1)
    with pytest.raises(TypeError, match="expert_ids: expected an int32 or int64 tensor, got torch.float32"):
        mr.route_sort(ids.float(), 3, 2)
    with pytest.raises(TypeError, match="expert_ids: expected an int32 or int64 tensor, got torch.int16"):
        mr.route_sort(ids.to(torch.int16), 3, 2)
    with pytest.raises(ValueError, match=r"expert_ids: expected a 1-D tensor, got shape \(2, 2\)"):
        mr.route_sort(ids.view(2, 2), 3, 2)
    with pytest.raises(ValueError, match="expert_ids: expected T \\* top_k entries, got 4 \\(top_k=3\\)"):
        mr.route_sort(ids, 3, 3)
    for bad, err in ((0, ValueError), (-2, ValueError), (2.0, TypeError), (True, TypeError), (None, TypeError)):
        with pytest.raises(err, match="num_experts: expected a positive int"):
            mr.route_sort(ids, bad, 2)
        with pytest.raises(err, match="top_k: expected a positive int"):
            mr.route_sort(ids, 3, bad)


def test_route_sort_falls_back(monkeypatch, interpret):
    """Without the interpreter CPU ids run the reference (one warning per reason); so do more
    experts than the kernel holds."""
    from deepspeed_fused.ops.moe_reorder.kernels import SORT_MAX_EXPERTS

    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 9, (60, ), generator=gen)
    big = SORT_MAX_EXPERTS + 1
    _common.reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        b = mr.route_sort(ids.to(interpret) * 1000, big, 3)
        mr.route_sort(ids.to(interpret), big, 3)
        with monkeypatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "0")
            a = mr.route_sort(ids, 8, 3)
            mr.route_sort(ids, 8, 3)
    msgs = [str(x.message) for x in w if "moe_reorder.route_sort" in str(x.message)]
    assert len(msgs) == 2 and f"num_experts above {SORT_MAX_EXPERTS}" in msgs[0] and "tensors on cpu" in msgs[1], msgs
    _assert_sort_equal(a, _sort_expected(ids, 8, 3))
    _assert_sort_equal(b, _sort_expected(ids * 1000, big, 3))


def test_route_sort_opcheck_and_compile(interpret):
    """The custom op (schema, fake implementation) and route_sort inside a fullgraph compile."""
    gen = torch.Generator().manual_seed(4)
    ids = torch.randint(0, 7, (24, ), generator=gen).to(interpret)
    torch.library.opcheck(torch.ops.deepspeed_fused.moe_route_sort.default, (ids, 6, 2))
    torch.library.opcheck(torch.ops.deepspeed_fused.moe_route_sort.default, (ids.int()[:0], 3, 1))

    def fn(ids):
        s = mr.route_sort(ids, 6, 2)
        return (s.order, *s.maps[:3], s.offsets, s.experts)

    torch._dynamo.reset()
    got = torch.compile(fn, backend="aot_eager", fullgraph=True)(ids)
    for a, b in zip(got, fn(ids)):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------------------------
# Feature: transformers experts implementation
# ----------------------------------------------------------------------------------------------

MOE_MODELS = ["qwen3-moe-tiny", "qwen2-moe-tiny", "mixtral-tiny", "deepseek-v3-tiny"]


def _loss_and_grads(model, seed=1):
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(seed))
    out = model(input_ids=ids, labels=ids)
    loss = out.loss + (out.aux_loss if getattr(out, "aux_loss", None) is not None else 0)
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", MOE_MODELS)
def test_transformers_path_matches_grouped_mm(interpret, name):
    base = build_model(name, torch.float32, seed=0)
    assert base.get_experts_implementation()[""] == "grouped_mm"
    loss_ref, grads_ref = _loss_and_grads(base)

    model = build_model(name, torch.float32, seed=0)
    calls = {"n": 0}
    orig = mr.route_combine

    def counting(*a, **k):
        calls["n"] += 1
        return orig(*a, **k)

    mr.route_combine = counting
    try:
        report = patch_model(model, {"moe_reorder": {"enabled": True}})
        rep = report.features[[f.name for f in report.features].index("moe_reorder")]
        assert rep.applied and rep.details["path"] == "transformers", rep
        n_layers = rep.details["layers"]
        assert n_layers >= 1 and "grouped_mm" in rep.reason
        assert model.get_experts_implementation()[""] == "deepspeed_fused"
        loss, grads = _loss_and_grads(model)
    finally:
        mr.route_combine = orig
    assert calls["n"] == n_layers
    torch.testing.assert_close(loss, loss_ref, rtol=1e-6, atol=1e-6)
    assert grads.keys() == grads_ref.keys()
    for k in grads:  # router weights included: the router-logit capture and aux loss are intact
        torch.testing.assert_close(grads[k], grads_ref[k], rtol=1e-5, atol=1e-6, msg=k)
    assert unpatch_model(model) == {"moe_reorder": n_layers}
    assert model.get_experts_implementation()[""] == "grouped_mm"


def test_transformers_sentinels(interpret):
    """transformers' own expert parallelism marks experts of other ranks with ids >= num_experts."""
    model = build_model("qwen3-moe-tiny", torch.float32, seed=0)
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    experts._is_expert_parallel = True
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, experts.num_experts + 3, (10, 2), generator=gen)
    w = torch.rand(10, 2, generator=gen).masked_fill(ids >= experts.num_experts, 0.0)
    h = torch.randn(10, 64, generator=gen)
    results = []
    for fn in (grouped_mm_experts_forward, moe_reorder.deepspeed_fused_experts_forward):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        experts.zero_grad()
        out = fn(experts, hh, ids, ww)
        out.backward(torch.ones_like(out))
        results.append((out.detach(), hh.grad, ww.grad, experts.gate_up_proj.grad.clone()))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


class _NaNTailOut(torch.autograd.Function):
    """grouped_mm on CUDA leaves output rows past offsets[-1] unwritten: NaN there, on CPU too."""

    @staticmethod
    def forward(ctx, y, end):
        y = y.clone()
        y[end:] = float("nan")
        return y

    @staticmethod
    def backward(ctx, g):
        return g, None


class _NaNTailGrad(torch.autograd.Function):
    """... and rows of the input's gradient past offsets[-1] too."""

    @staticmethod
    def forward(ctx, x, end):
        ctx.end = end
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[ctx.end:] = float("nan")
        return g, None


def _tiny_gpt_oss_experts():
    cfg = transformers.GptOssConfig(hidden_size=64, intermediate_size=32, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                                    vocab_size=257, sliding_window=8)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.1)
    return experts


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_sentinel_rows_unwritten_by_grouped_mm(interpret, monkeypatch, family):
    """With experts of other ranks (sentinels) the dispatch needs no masks around the GEMMs: rows
    grouped_mm leaves unwritten (NaN here, outputs and input gradients past offsets[-1]) never
    reach the outputs or any gradient, also with per-expert biases (GPT-OSS): expert_bias sums each
    expert's own rows, where transformers' bias[ids] gathers every row and needs two masks."""
    import transformers.integrations.moe as hf_moe

    if family == "gpt_oss":
        experts = _tiny_gpt_oss_experts()
    else:
        experts = next(m for m in build_model("qwen3-moe-tiny", torch.float32, seed=0).modules()
                       if hasattr(m, "gate_up_proj"))
    experts._is_expert_parallel = True
    orig = hf_moe._grouped_linear

    def poisoned(x, weight, offs, bias=None, is_transposed=False):
        end = int(offs[-1])
        x = _NaNTailGrad.apply(x, end)
        return _NaNTailOut.apply(orig(x, weight, offs, bias=bias, is_transposed=is_transposed), end)

    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, experts.num_experts + 2, (12, 2), generator=gen)
    assert (ids >= experts.num_experts).any()
    w = torch.rand(12, 2, generator=gen).masked_fill(ids >= experts.num_experts, 0.0)
    h = torch.randn(12, experts.gate_up_proj.shape[1 if experts.is_transposed else 2], generator=gen)
    results = []
    row_masks = []
    masked_fill = torch.Tensor.masked_fill

    def counting(t, *a, **k):  # masks over activation rows (not the int positions)
        row_masks.append(t.is_floating_point() and t.dim() == 2)
        return masked_fill(t, *a, **k)

    for fn, grouped in ((grouped_mm_experts_forward, orig), (moe_reorder.deepspeed_fused_experts_forward, poisoned)):
        monkeypatch.setattr(hf_moe, "_grouped_linear", grouped)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        experts.zero_grad()
        row_masks.clear()
        monkeypatch.setattr(torch.Tensor, "masked_fill", counting)
        out = fn(experts, hh, ids, ww)
        monkeypatch.setattr(torch.Tensor, "masked_fill", masked_fill)
        out.backward(torch.ones_like(out))
        results.append([out.detach(), hh.grad, ww.grad] + [p.grad.clone() for p in experts.parameters()])
    assert sum(row_masks) == 0
    for a, b in zip(*results):
        assert torch.isfinite(b).all()
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


def test_experts_forward_compiles_whole(interpret):
    """The experts implementation compiles in one graph (fullgraph, aot_eager), as grouped_mm does,
    and gives eager's outputs and gradients (sentinel experts included)."""
    model = build_model("qwen3-moe-tiny", torch.float32, seed=0)
    experts = next(m for m in model.modules() if hasattr(m, "gate_up_proj"))
    experts._is_expert_parallel = True
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, experts.num_experts + 2, (10, 2), generator=gen)
    w = torch.rand(10, 2, generator=gen).masked_fill(ids >= experts.num_experts, 0.0)
    h = torch.randn(10, 64, generator=gen)
    res = []
    for compiled in (False, True):
        torch._dynamo.reset()
        fn = lambda hh, ww: moe_reorder.deepspeed_fused_experts_forward(experts, hh, ids, ww)  # noqa: E731
        run = torch.compile(fn, backend="aot_eager", fullgraph=True) if compiled else fn
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = run(hh, ww)
        res.append((out.detach(), ) + torch.autograd.grad(out, (hh, ww), torch.ones_like(out)))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_not_applicable_and_config():
    from deepspeed_fused.config import ConfigError, parse_config

    model = build_model("llama-tiny", torch.float32)
    with pytest.warns(RuntimeWarning, match="moe_reorder"):
        report = patch_model(model, {"moe_reorder": {"enabled": True}})
    rep = report.features[[f.name for f in report.features].index("moe_reorder")]
    assert not rep.applied and "no DeepSpeed AutoEP layers" in rep.reason
    assert parse_config({"moe_reorder": {"enabled": True, "validate": True}}).moe_reorder.validate is True
    with pytest.raises(ConfigError, match="moe_reorder.validate"):
        parse_config({"moe_reorder": {"enabled": True, "validate": "yes"}})


# ----------------------------------------------------------------------------------------------
# Feature: DeepSpeed AutoEP (forked gloo ranks)
# ----------------------------------------------------------------------------------------------


def _autoep_run(name, ep_size, feature, steps=2, ep_extra=None, ckpt=None):
    import deepspeed

    import deepspeed_fused  # noqa: F401  (installs the initialize hook)

    model = build_model(name, torch.float32, seed=0)
    if ckpt is not None:  # Hugging Face gradient checkpointing: each layer's forward again in the backward
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": ckpt == "reentrant"})
        model.train()
    forwards = 2 if ckpt is not None else 1
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 0},
           "zero_allow_untested_optimizer": True,
           "expert_parallel": {"enabled": True, "autoep_size": ep_size, **(ep_extra or {})}}
    if feature:
        cfg["deepspeed_fused"] = {"moe_reorder": {"enabled": True, "validate": True}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=cfg)
    rep = {f.name: f for f in engine.deepspeed_fused_report.features}["moe_reorder"]
    assert rep.applied == feature, rep
    from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer

    layers = [m for m in engine.module.modules() if isinstance(m, AutoEPMoELayer)]
    for key, value in (ep_extra or {}).items():  # the modes under test are the ones the layers run
        assert layers and all(getattr(m, key) == value for m in layers), key
    assert moe_reorder.autoep_patched() == feature
    if feature:
        assert rep.details == {"path": "autoep", "layers": 2}
    assert moe_reorder.local_path_patched() == feature
    if feature:
        assert "local token path (routed gather, scores, reorder, combine) runs as fused gathers" in rep.reason
    calls = {"n": 0, "dispatch": 0}
    orig = mr.permute_rows
    orig_dispatch = mr.route_dispatch

    def counting(*a, **k):
        calls["n"] += 1
        return orig(*a, **k)

    def counting_dispatch(*a, **k):
        calls["dispatch"] += 1
        return orig_dispatch(*a, **k)

    mr.permute_rows = counting
    mr.route_dispatch = counting_dispatch
    gen = torch.Generator().manual_seed(5 + deepspeed.comm.get_rank())
    losses, grads = [], []
    try:
        for _ in range(steps):
            ids = torch.randint(0, 257, (2, 16), generator=gen).to(engine.device)
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            grads.append({k: p.grad.clone() for k, p in engine.module.named_parameters() if p.grad is not None})
            engine.step()
            losses.append(out.loss.detach())
    finally:
        mr.permute_rows = orig
        mr.route_dispatch = orig_dispatch
    # the local path dispatches straight into the padded buffer at autoep_size 1; with more ranks
    # the expert side still permutes (our gathers)
    assert calls["dispatch"] == (2 * steps * forwards if feature else 0)
    assert calls["n"] == (2 * steps * forwards if feature and ep_size > 1 else 0)
    if feature:  # the report's live count: one per layer forward whose reorder ran as our gathers
        assert (rep.calls.fused, rep.calls.eager) == (2 * steps * forwards, 0), rep.calls
        assert unpatch_model(engine.module) == {"moe_reorder": 2}
        assert not moe_reorder.autoep_patched() and not moe_reorder.local_path_patched()
    return losses, grads


class TestAutoEP(DistributedTest):
    world_size = [1, 2]

    @pytest.mark.parametrize("name,ep_extra", [("mixtral-tiny", None), ("qwen3-moe-tiny", None),
                                               ("qwen3-moe-tiny", {"score_apply": "pre", "combine_impl": "legacy_bmm"})],
                             ids=["mixtral", "qwen3", "qwen3-pre-bmm"])
    def test_autoep_equal_with_and_without(self, name, ep_extra):
        import deepspeed.comm as dist

        assert os.environ.get("TRITON_INTERPRET") == "1" or torch.cuda.is_available()
        ep = dist.get_world_size()
        losses_ref, grads_ref = _autoep_run(name, ep, feature=False, ep_extra=ep_extra)
        losses, grads = _autoep_run(name, ep, feature=True, ep_extra=ep_extra)
        # Not bitwise: the fused combine sums a token's k expert rows in FP32 in order j = 0..k-1
        # and the token gradient sums its k slot gradients the same way, where DeepSpeed's weighted
        # sum and index backward use torch's own reduction orders (FP32 summation noise). On CUDA
        # DeepSpeed's router backward also accumulates with atomics.
        same = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731
        for a, b in zip(losses, losses_ref):
            assert same(a, b), (losses, losses_ref)
        for ga, gb in zip(grads, grads_ref):
            assert ga.keys() == gb.keys() and len(ga) > 0
            for k in ga:
                assert same(ga[k], gb[k]), k


class TestAutoEPCheckpointing(DistributedTest):
    """AutoEP layers under gradient checkpointing: the recomputed layers run the fused local path
    again (counted, a non-reentrant recomputation ending inside the combine included), with the
    losses and gradients of the same run without the feature."""
    world_size = [1, 2]

    @pytest.mark.parametrize("ckpt", ["non-reentrant", "reentrant"])
    def test_autoep_recomputed_layers(self, ckpt):
        import deepspeed.comm as dist

        ep = dist.get_world_size()
        losses_ref, grads_ref = _autoep_run("qwen3-moe-tiny", ep, feature=False, ckpt=ckpt)
        losses, grads = _autoep_run("qwen3-moe-tiny", ep, feature=True, ckpt=ckpt)
        same = lambda a, b: torch.allclose(a, b, rtol=1e-5, atol=1e-6)  # noqa: E731  (as above)
        assert all(same(a, b) for a, b in zip(losses, losses_ref)), (losses, losses_ref)
        for ga, gb in zip(grads, grads_ref):
            assert ga.keys() == gb.keys() and len(ga) > 0
            assert all(same(ga[k], gb[k]) for k in ga)


def test_autoep_patch_refcount_and_contract(interpret):
    """Two models patched: the originals come back only after both revert; the patched functions
    keep DeepSpeed's return contract on a direct call."""
    import deepspeed.module_inject.auto_ep_layer as layer


    orig = (layer.permute_by_local_expert, layer.unpermute_by_local_expert)
    counts = torch.tensor([[3, 0, 2], [1, 4, 0]], dtype=torch.int32)  # [ep_degree, E_local]
    tokens = torch.randn(int(counts.sum()), 24)
    ref = orig[0](tokens, counts)
    assert moe_reorder._direct_matches(orig[0])  # the direct index build is this version's
    moe_reorder._install_autoep(False)
    moe_reorder._install_autoep(True)
    try:
        assert moe_reorder._AUTOEP["direct"]
        out = layer.permute_by_local_expert(tokens, counts)
        assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1]) and torch.equal(out[2], ref[2])
        assert out[1].dtype == ref[1].dtype == torch.int32 and out[2].dtype == ref[2].dtype and out[3] == ref[3]
        back = layer.unpermute_by_local_expert(out[0], out[1], out[3])
        assert torch.equal(back, orig[1](ref[0], ref[1], ref[3])) and torch.equal(back, tokens)
        moe_reorder._uninstall_autoep(True)
        assert moe_reorder.autoep_patched()
    finally:
        while moe_reorder._AUTOEP["count"]:
            moe_reorder._uninstall_autoep(False)
    assert (layer.permute_by_local_expert, layer.unpermute_by_local_expert) == orig
    # the probe path (any other DeepSpeed version) gives the same contract
    ours = moe_reorder._make_autoep_functions(*orig, direct=False)[0](tokens, counts)
    assert all(torch.equal(a, b) for a, b in zip(ours[:3], ref[:3])) and ours[3] == ref[3]


def _zero3_run(feature, steps=2):
    import deepspeed

    import deepspeed_fused  # noqa: F401  (installs the initialize hook)

    model = build_model("qwen3-moe-tiny", torch.float32, seed=0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
           "zero_allow_untested_optimizer": True}
    if feature:
        cfg["deepspeed_fused"] = {"moe_reorder": {"enabled": True}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config=cfg)
    rep = {f.name: f for f in engine.deepspeed_fused_report.features}["moe_reorder"]
    assert rep.applied == feature, rep
    if feature:
        assert rep.details["path"] == "transformers" and rep.details["layers"] == 2
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, 257, (2, 16), generator=gen).to(engine.device)
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss + out.aux_loss)
        engine.step()
        losses.append(out.loss.detach().float())
    return torch.stack(losses)


class TestTransformersZero3(DistributedTest):
    world_size = 1

    def test_zero3_transformers_path(self):
        """ZeRO-3 (partitioned expert weights gathered by its hooks) with the experts implementation:
        the same losses over steps (the updates depend on the gradients) as grouped_mm."""
        ref = _zero3_run(False)
        ours = _zero3_run(True)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


# ---- bad counts fail loudly; the record is read from the model's state ---------------
def test_inconsistent_counts_fail_loudly(interpret):
    orig = moe_reorder._make_autoep_functions(lambda t, c: None, lambda *a: None, direct=True)[0]
    with pytest.raises(RuntimeError, match="local_counts must sum to the 4 token rows"):
        orig(torch.randn(4, 8, device=interpret), torch.tensor([3, 3], dtype=torch.int32, device=interpret))


def test_transformers_path_survives_pickle_and_copies(interpret):
    import copy as _copy
    import io as _io

    from deepspeed_fused import patch_model, unpatch_model
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    model = build_model("qwen3-moe-tiny", torch.float32, seed=0)
    rep = patch_model(model, {"moe_reorder": {"enabled": True}})
    assert rep["moe_reorder"].applied
    feat = moe_reorder.MoeReorderFeature()
    clone = _copy.deepcopy(model)
    assert feat.is_applied(model) and feat.is_applied(clone)
    buf = _io.BytesIO()
    torch.save(model, buf)
    unpatch_model(model)
    assert not feat.is_applied(model)
    type(ALL_EXPERTS_FUNCTIONS)._global_mapping.pop(moe_reorder.IMPL_NAME, None)  # as in a fresh process
    assert ALL_EXPERTS_FUNCTIONS.get(moe_reorder.IMPL_NAME, None) is None
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)  # loading registers it again
    assert feat.is_applied(loaded)
    ids = torch.randint(0, 257, (2, 8))
    loaded(input_ids=ids)  # runs (no KeyError) through the gathers
    again = patch_model(loaded, {"moe_reorder": {"enabled": True}})
    assert again["moe_reorder"].applied
    assert unpatch_model(loaded) == {"moe_reorder": 2} and not feat.is_applied(loaded)


def test_eager_functions_match_custom_ops(interpret):
    """permute_rows / unpermute_rows run autograd Functions in eager mode (cheaper dispatch) and the
    custom ops under torch.compile: same outputs and gradients, and the Functions' backward is a
    gather of the gradient."""
    pidx, n = _indices([5, 0, 3, 6], 8, torch.int32)
    pidx = pidx.to(interpret)
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(n, 24, generator=gen).to(interpret)
    a = rows.clone().requires_grad_()
    b = rows.clone().requires_grad_()
    out_a, inv_a = mr.permute_rows_with_inverse(a, pidx)
    out_b, inv_b = permute._permute_inverse_op(b, pidx)
    assert type(out_a.grad_fn).__name__ == "_PermuteInverseFnBackward"
    assert torch.equal(out_a, out_b) and torch.equal(inv_a, inv_b) and not inv_a.requires_grad
    g = torch.randn(out_a.shape, generator=gen).to(interpret)
    out_a.backward(g)
    out_b.backward(g)
    assert torch.equal(a.grad, b.grad)
    slots = torch.randn(pidx.numel(), 24, generator=gen).to(interpret)
    c, d = slots.clone().requires_grad_(), slots.clone().requires_grad_()
    back_c = mr.unpermute_rows(c, pidx, n, inverse=inv_a)
    back_d = permute._unpermute_op(d, pidx, inv_a)
    assert type(back_c.grad_fn).__name__ == "_PermutePairFnBackward" and torch.equal(back_c, back_d)
    g2 = torch.randn(back_c.shape, generator=gen).to(interpret)
    back_c.backward(g2)
    back_d.backward(g2)
    assert torch.equal(c.grad, d.grad)
    with torch.no_grad():  # no graph: the kernels directly
        assert mr.permute_rows(a, pidx, inverse=inv_a).grad_fn is None


def test_dispatch_combine_eager_functions_match_custom_ops(interpret):
    """route_dispatch / route_combine run autograd Functions in eager mode and the custom ops under
    torch.compile: same outputs and gradients (tokens, expert outputs, scores and routing weights)."""
    gen = torch.Generator().manual_seed(3)
    tokens, top_k, hidden = 11, 2, 24
    perm = torch.randperm(tokens * top_k, generator=gen).to(interpret)
    maps = mr.route_maps(perm, top_k)
    m3 = (maps.token, maps.assignment, maps.slot)
    h = torch.randn(tokens, hidden, generator=gen).to(interpret)
    w = torch.rand(tokens, top_k, generator=gen).to(interpret)
    g = torch.randn(tokens, hidden, generator=gen).to(interpret)
    results = []
    for eager in (True, False):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        if eager:
            x = mr.route_dispatch(hh, maps, ww)
            out = mr.route_combine(x * 2.0, maps, ww)
            assert type(x.grad_fn).__name__ == "_RouteDispatchBackward"
            assert type(out.grad_fn).__name__ == "_RouteCombineBackward"
        else:
            x = route._dispatch_op(hh, *m3, ww, top_k)
            out = route._combine_op(x * 2.0, *m3, ww, top_k)
        results.append((out.detach(),) + torch.autograd.grad(out, (hh, ww), g))
    for a, b in zip(*results):
        assert torch.equal(a, b)
    with torch.no_grad():  # no graph: the kernels directly
        assert mr.route_combine(mr.route_dispatch(h.requires_grad_(), maps), maps, w).grad_fn is None


def test_index_tensors_on_another_device_raise():
    """Every index/weight tensor is checked for the rows' device before any launch (the direct
    launches pass integer pointers, which Triton cannot check)."""
    rows = torch.randn(4, 8, device="meta")
    pidx = torch.tensor([0, 1, 2, 3], device="meta")
    with pytest.raises(ValueError, match="inverse: expected a tensor on meta"):
        mr.permute_rows(rows, pidx, inverse=torch.arange(4))
    with pytest.raises(ValueError, match="inverse: expected a tensor on meta"):
        mr.unpermute_rows(rows, pidx, 4, inverse=torch.arange(4))
    maps = mr.route_maps_reference(torch.arange(8), 2)
    with pytest.raises(ValueError, match="maps: expected a tensor on meta"):
        mr.route_dispatch(rows, maps)
    with pytest.raises(ValueError, match="maps: expected a tensor on meta"):
        mr.route_combine(torch.randn(8, 8, device="meta"), maps)


def test_direct_launch_key_follows_triton_specialization():
    """DirectKernel's key: ints by equality to 1, divisibility by 16 and type range; tensors by
    dtype, 16-byte alignment and CUDA-ness (a CPU tensor never reuses a CUDA launch)."""
    from deepspeed_fused.ops._common import _spec

    assert _spec(1) != _spec(17) and _spec(16) != _spec(17) and _spec(32) == _spec(48)
    assert _spec(2 ** 31) != _spec(16) and _spec(2 ** 63) != _spec(2 ** 31)
    t = torch.zeros(8)
    assert _spec(t) == (torch.float32, True, False) and _spec(t[1:]) == (torch.float32, False, False)
    assert _spec(2.5) == _spec(0.5) and _spec(True) != _spec(False)


def test_direct_kernel_launches_with_the_one_launcher_layout(monkeypatch):
    """DirectKernel's later calls of a key go straight to the C launcher, laid out as
    ``launch_binding`` spells it (with this call's grid), exactly as ``direct_launcher``'s own
    closure would call it; the first call goes through the JIT. CUDA state and the launcher are
    faked here (on CPU no real launcher exists)."""
    from deepspeed_fused.ops import _common

    calls = []

    def launch(*a):
        calls.append(a)

    class Dev:
        index = 0

    class Arg:  # what DirectKernel reads of its first argument
        is_cuda = True
        device = Dev()

    class Kernel:
        jit = []

        def __getitem__(self, grid):
            def run(*args, **kw):
                self.jit.append((grid, args, kw))
                return "compiled"
            return run

    def fake_direct_launcher(compiled, grid, constexpr_values):
        assert compiled == "compiled"
        parts = (launch, 9, 9, 9, "FUNCTION", False, True, "META", constexpr_values)

        def fn(stream, *args):
            launch, grid3, fixed, tail = _common.launch_binding(parts)
            launch(*grid3, stream, *fixed, *args, *tail)

        fn.parts = parts
        return fn

    monkeypatch.setattr(_common, "_launch_hooks", lambda: False)
    monkeypatch.setattr(_common, "_current_device", lambda: 0)
    monkeypatch.setattr(_common, "_raw_stream", lambda dev: 1234)
    monkeypatch.setattr(_common, "direct_launcher", fake_direct_launcher)
    k = _common.DirectKernel(Kernel())
    a = Arg()
    k((4,), (a, 7), dict(BLOCK=64, W=2), 4)
    assert len(Kernel.jit) == 1 and not calls  # first call: the JIT
    k((5, 3), (a, 7), dict(BLOCK=64, W=2), 4)
    assert len(Kernel.jit) == 1 and len(calls) == 1
    assert calls[0] == (5, 3, 1, 1234, "FUNCTION", False, True, None, None, "META", None, None, None, a, 7, 64, 2)
    # the same layout direct_launcher's closure makes for a fixed grid
    fake_direct_launcher("compiled", (9,), (64, 2))(1234, a, 7)
    assert calls[1][3:] == calls[0][3:] and calls[1][:3] == (9, 9, 9)
    k((4,), (a, 7), dict(BLOCK=32, W=2), 4)  # another key: the JIT again
    assert len(Kernel.jit) == 2 and len(calls) == 2
    # compile options fixed at construction (enable_fp_fusion=False for the GPT-OSS gate) reach the
    # JIT with each specialization, and not the launcher's argument list
    Kernel.jit.clear()
    nf = _common.DirectKernel(Kernel(), enable_fp_fusion=False)
    nf((4,), (a, 7), dict(BLOCK=64, W=2), 4)
    assert Kernel.jit[-1][2] == dict(BLOCK=64, W=2, num_warps=4, enable_fp_fusion=False)
    n = len(calls)
    nf((4,), (a, 7), dict(BLOCK=64, W=2), 4)
    assert len(Kernel.jit) == 1 and calls[n] == (4, 1, 1) + calls[0][3:]


def test_gpt_oss_gate_kernels_compile_without_contraction():
    # a contracted d_glu * s + d_via_t skips the rounding of the product that eager makes (found on
    # the H200: 15% of the gate gradients one ULP off CUDA eager with contraction on)
    S = importlib.import_module("deepspeed_fused.ops.moe_reorder.swiglu")
    if not hasattr(S, "_launch_oai_bwd"):
        pytest.skip("Triton is not installed")
    assert S._launch_oai_bwd.options == {"enable_fp_fusion": False} == S._launch_oai_fwd.options


def test_host_cdiv_and_next_power_of_2_equal_tritons():
    # the launch plans' host arithmetic (ops/_common) gives Triton's own answers
    for a in range(0, 5000):
        assert _common.next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 7, 64, 1000, 4096):
            assert _common.cdiv(a, b) == triton.cdiv(a, b), (a, b)
    big = 2 ** 40 + 3
    assert _common.next_power_of_2(big) == triton.next_power_of_2(big)
    assert _common.cdiv(big, 128) == triton.cdiv(big, 128)
