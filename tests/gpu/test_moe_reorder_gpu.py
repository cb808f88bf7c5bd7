"""moe_reorder on CUDA: the full matrix of dtypes, hidden sizes, row counts and index dtypes against
the eager formulations (torch.equal), the fused combine, and the transformers path with grouped_mm;
DeepSpeed AutoEP over NCCL on 2 GPUs."""
import pytest
import torch

from deepspeed_fused.ops import moe_reorder as rg
from deepspeed_fused.ops.moe_reorder import launch as kernels, route
from unit.common import DistributedTest

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
HIDDEN = [2048, 2880, 4096, 5120, 7168]


def _indices(num_rows, experts, alignment, index_dtype, gen, kind="random"):
    from deepspeed.moe.ep_kernels import generate_permute_indices

    if kind == "one":
        counts = torch.zeros(experts, dtype=torch.int32)
        counts[-1] = num_rows
    else:
        assign = torch.randint(0, experts, (num_rows, ), generator=gen)
        if kind == "empty":
            assign = assign // 2 * 2
        counts = torch.bincount(assign, minlength=experts).to(torch.int32)
    max_len = ((num_rows + experts * alignment + alignment - 1) // alignment) * alignment
    pidx, _, _ = generate_permute_indices(counts.cuda(), experts, 1, max_len, alignment)
    return pidx.to(index_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", HIDDEN)
@pytest.mark.parametrize("rows,index_dtype,kind,alignment", [
    (1, torch.int32, "random", 8), (777, torch.int64, "empty", 16), (4096, torch.int32, "one", 32),
    (100_003, torch.int32, "random", 8), (100_003, torch.int64, "random", 16)])
def test_permute_unpermute_equal_eager(dtype, hidden, rows, index_dtype, kind, alignment):
    gen = torch.Generator().manual_seed(rows + hidden)
    pidx = _indices(rows, 128, alignment, index_dtype, gen, kind)
    x = torch.randn(rows, hidden, dtype=dtype, device="cuda").requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out = rg.permute_rows(x, pidx, validate=rows < 5000)
    ref = rg.permute_rows_reference(x_ref, pidx)
    assert torch.equal(out, ref)
    g = torch.randn_like(out).requires_grad_()
    (gx, ) = torch.autograd.grad(out, x, g, create_graph=True)
    (gx_ref, ) = torch.autograd.grad(ref, x_ref, g, create_graph=True)
    assert torch.equal(gx, gx_ref)
    v = torch.randn_like(gx)
    assert torch.equal(torch.autograd.grad(gx, g, v)[0], torch.autograd.grad(gx_ref, g, v)[0])
    del g, gx, gx_ref, v

    s = torch.randn(pidx.numel(), hidden, dtype=dtype, device="cuda").requires_grad_()
    s_ref = s.detach().clone().requires_grad_()
    back = rg.unpermute_rows(s, pidx, rows)
    back_ref = rg.unpermute_rows_reference(s_ref, pidx, rows)
    assert torch.equal(back, back_ref)
    g2 = torch.randn_like(back)
    (gs, ) = torch.autograd.grad(back, s, g2)
    (gs_ref, ) = torch.autograd.grad(back_ref, s_ref, g2)
    assert torch.equal(gs, gs_ref)
    assert torch.equal(rg.unpermute_rows(out.detach(), pidx, rows), x.detach())


def test_matches_deepspeed_0198_gathers():
    ek = pytest.importorskip("deepspeed.moe.ep_kernels")
    if not hasattr(ek, "permute_rows"):
        pytest.skip("DeepSpeed < 0.19.8 has no permute_rows")
    gen = torch.Generator().manual_seed(0)
    pidx = _indices(65536, 128, 8, torch.int32, gen)
    x = torch.randn(65536, 2048, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(rg.permute_rows(x, pidx), ek.permute_rows(x, pidx))
    s = torch.randn(pidx.numel(), 2048, dtype=torch.bfloat16, device="cuda")
    assert torch.equal(rg.unpermute_rows(s, pidx, 65536), ek.unpermute_rows(s, pidx, 65536))


def test_large_offsets_int64():
    """Row offsets beyond 2**31 elements (300k rows x 7168)."""
    gen = torch.Generator().manual_seed(1)
    rows, hidden = 300_000, 7168
    pidx = _indices(rows, 16, 8, torch.int32, gen)
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
    out = rg.permute_rows(x, pidx)
    valid = pidx >= 0
    last = int(valid.nonzero()[-1])
    assert torch.equal(out[last], x[int(pidx[last])])
    assert torch.equal(rg.unpermute_rows(out, pidx, rows), x)


def test_poisoned_outputs():
    gen = torch.Generator().manual_seed(2)
    pidx = _indices(5000, 64, 16, torch.int64, gen, "empty")
    x = torch.randn(5000, 2880, dtype=torch.bfloat16, device="cuda")
    out = torch.full((pidx.numel(), 2880), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.gather_rows(x, pidx, out=out)
    assert torch.equal(out, rg.permute_rows_reference(x, pidx))
    slot = torch.randperm(4096 * 8, device="cuda").view(4096, 8)
    slot[::7, 3] = -1
    w = torch.rand(4096, 8, device="cuda")
    src = torch.randn(4096 * 8, 2880, dtype=torch.bfloat16, device="cuda")
    out = torch.full((4096, 2880), float("nan"), dtype=torch.bfloat16, device="cuda")
    kernels.combine_rows(src, slot, w, out=out)
    assert not out.isnan().any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden,top_k", [(2048, 8), (4096, 2), (7168, 8), (2880, 4)])
def test_combine_and_dispatch(dtype, hidden, top_k):
    tokens, experts = 4096, 64
    ids = torch.randint(0, experts, (tokens, top_k), device="cuda")
    w = torch.rand(tokens, top_k, device="cuda").softmax(-1).to(dtype).requires_grad_()
    flat = ids.reshape(-1)
    _, perm = torch.sort(flat)
    maps = rg.route_maps(perm, top_k)
    slot = maps.slot.view(tokens, top_k)
    h = torch.randn(tokens, hidden, dtype=dtype, device="cuda").requires_grad_()
    x = rg.route_dispatch(h, maps)
    assert torch.equal(x, h.detach()[perm // top_k])
    y = rg.route_combine(x, maps, w)
    ref = rg.combine_reference(x.detach(), slot, w.detach())
    tol = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]
    torch.testing.assert_close(y, ref, rtol=tol, atol=tol)
    # eager transformers formulation: weight, inverse gather, sum over k
    eager = (x.detach() * w.detach().reshape(-1)[perm][:, None])
    inv = torch.empty_like(perm)
    inv[perm] = torch.arange(perm.numel(), device="cuda")
    eager = eager[inv].view(tokens, top_k, hidden).sum(1).to(dtype)
    torch.testing.assert_close(y, eager, rtol=2 * tol, atol=2 * tol)
    g = torch.randn_like(y)
    gh, gw = torch.autograd.grad(y, (h, w), g)
    # each token is dispatched top_k times with weight w: grad_h = sum_j w_j * g
    exp_h = (g.float()[:, None, :] * w.detach().float()[:, :, None]).sum(1)
    torch.testing.assert_close(gh.float(), exp_h, rtol=4 * tol, atol=4 * tol)
    # every slot of a token holds that token's row: grad_w[t, k] = g[t] . h[t] for each k
    exp_w = (g.float() * h.detach().float()).sum(-1, keepdim=True).expand(-1, top_k)
    torch.testing.assert_close(gw.float(), exp_w, rtol=4 * tol, atol=4 * tol * hidden**0.5)


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "mixtral-tiny", "deepseek-v3-tiny", "qwen2-moe-tiny"])
def test_transformers_path_grouped_mm(name):
    """bf16 loss and gradients with our experts implementation are as close to an fp32 grouped_mm
    reference as bf16 grouped_mm itself is (the combine rounds once instead of per product)."""
    from tiny_models import build_model

    from deepspeed_fused import patch_model, unpatch_model

    ids = torch.randint(0, 257, (4, 64), generator=torch.Generator().manual_seed(3)).cuda()
    results = {}
    for key, dtype, use in (("ref", torch.float32, False), ("grouped_mm", torch.bfloat16, False),
                            ("ours", torch.bfloat16, True)):
        model = build_model(name, dtype, seed=0).cuda()
        if use:
            report = patch_model(model, {"moe_reorder": {"enabled": True}})
            rep = {f.name: f for f in report.features}["moe_reorder"]
            assert rep.applied and rep.details["path"] == "transformers", rep
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        results[key] = (out.loss.detach().float(),
                        {k: p.grad.float() for k, p in model.named_parameters() if p.grad is not None})
        if use:
            unpatch_model(model)
    (l_ref, g_ref), (l_mm, g_mm), (l_us, g_us) = results["ref"], results["grouped_mm"], results["ours"]
    assert abs(float(l_us - l_ref)) <= 1.5 * abs(float(l_mm - l_ref)) + 2e-3
    assert g_us.keys() == g_mm.keys()
    for k in g_ref:
        norm = g_ref[k].norm().clamp_min(1e-12)
        err_us = float((g_us[k] - g_ref[k]).norm() / norm)
        err_mm = float((g_mm[k] - g_ref[k]).norm() / norm)
        assert err_us <= 1.5 * err_mm + 1e-3, (k, err_us, err_mm)


class TestAutoEPNCCL(DistributedTest):
    """DeepSpeed AutoEP with ``autoep_size`` 2 on 2 GPUs: 20 training steps with the feature on and
    off give the same losses (the unit test's runner, tests/unit/test_moe_reorder.py)."""

    world_size = 2
    backend = "nccl"

    @pytest.mark.parametrize("name", ["mixtral-tiny", "qwen3-moe-tiny"])
    def test_autoep_20_steps_equal_with_and_without(self, name):
        from unit.test_moe_reorder import _autoep_run

        losses_ref, _ = _autoep_run(name, 2, feature=False, steps=20)
        losses, _ = _autoep_run(name, 2, feature=True, steps=20)
        # DeepSpeed's own router backward accumulates with atomics (run-to-run noise, with or
        # without the feature) and 20 SGD steps carry it forward: a tight tolerance, not bitwise.
        torch.testing.assert_close(torch.stack(losses), torch.stack(losses_ref), rtol=1e-4, atol=1e-5)


class TestAutoEPLocalPathGPU(DistributedTest):
    """One GPU, ``autoep_size`` 1: the fused local token path against DeepSpeed's forward for every
    ``combine_impl`` and both ``score_apply`` modes, 20 training steps (equal loss curves)."""

    world_size = 1
    backend = "nccl"

    @pytest.mark.parametrize("ep_extra", [{"combine_impl": "weighted_sum"}, {"combine_impl": "fused_weighted_sum"},
                                          {"combine_impl": "legacy_bmm"},
                                          {"score_apply": "pre", "combine_impl": "weighted_sum"}],
                             ids=["weighted_sum", "fused_weighted_sum", "legacy_bmm", "pre"])
    def test_local_path_20_steps(self, ep_extra):
        from deepspeed_fused.features import moe_reorder as feat
        from unit.test_moe_reorder import _autoep_run

        losses_ref, _ = _autoep_run("qwen3-moe-tiny", 1, feature=False, steps=20, ep_extra=ep_extra)
        losses, _ = _autoep_run("qwen3-moe-tiny", 1, feature=True, steps=20, ep_extra=ep_extra)
        assert not feat.local_path_patched()
        torch.testing.assert_close(torch.stack(losses), torch.stack(losses_ref), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_combine_double_backward(dtype):
    """Second-order gradients through route_dispatch -> experts -> route_combine on CUDA (the
    eager Functions and the custom ops torch.compile traces) against autograd of the float64
    references; with a sentinel assignment (weight 0, slot -1)."""
    gen = torch.Generator().manual_seed(11)
    tokens, top_k, experts, hidden = 512, 8, 16, 2048
    ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
    ids[5, 3] = experts
    w = torch.rand(tokens, top_k, generator=gen).masked_fill(ids >= experts, 0.0)
    h = torch.randn(tokens, hidden, generator=gen)
    mat = torch.randn(hidden, hidden, generator=gen) / hidden**0.5
    flat = ids.reshape(-1)
    vals, perm = torch.sort(flat)
    maps = rg.route_maps(perm.cuda(), top_k, torch.arange(perm.numel()).masked_fill(vals >= experts, -1).cuda())
    m3 = (maps.token, maps.assignment, maps.slot)
    g = torch.randn(tokens, hidden, generator=gen)
    vh, vw = torch.randn(tokens, hidden, generator=gen), torch.randn(tokens, top_k, generator=gen)

    def second_order(dispatch, combine, dt):
        hh = h.to("cuda", dt).requires_grad_()
        ww = w.to("cuda", dt).requires_grad_()
        m = mat.to("cuda", dt)
        out = combine(torch.tanh(dispatch(hh, maps) @ m), maps, ww)
        gh, gw = torch.autograd.grad(out, (hh, ww), g.to("cuda", dt), create_graph=True)
        d2 = torch.autograd.grad((gh * vh.to("cuda", dt)).sum() + (gw * vw.to("cuda", dt)).sum(), (hh, ww))
        return [t.double() for t in (out, gh, gw) + d2]

    ref = second_order(rg.route_dispatch_reference, rg.route_combine_reference, torch.float64)
    for name, disp, comb in (("eager", rg.route_dispatch, rg.route_combine),
                             ("custom ops", lambda x, mp: route._dispatch_op(x, *m3, None, top_k),
                              lambda y, mp, ww: route._combine_op(y, *m3, ww, top_k))):
        got = second_order(disp, comb, dtype)
        for what, a, b in zip(("out", "d h", "d w", "d2 h", "d2 w"), got, ref):
            assert b.abs().sum() > 0, what
            rel = ((a - b).norm() / b.norm()).item()
            assert rel < (2e-5 if dtype == torch.float32 else 2e-2), f"{name} {what}: relative error {rel:.2e}"


ROUTE_SORT_SHAPES = [  # name, tokens, top_k, experts, expert-parallel degree (ids of other ranks -> sentinels)
    ("Qwen3-30B-A3B", 8192, 8, 128, 1), ("Qwen3-30B-A3B-EP8", 8192, 8, 128, 8), ("DeepSeek-V3", 8192, 8, 256, 1),
    ("DeepSeek-V3-EP16", 8192, 8, 256, 16), ("Mixtral-8x7B", 8192, 2, 8, 1), ("Kimi-K2-16k", 16384, 8, 384, 1),
    ("tiny", 3, 1, 1, 1), ("one-expert-hot", 4096, 8, 64, 1),
]


def _route_sort_ids(tokens, top_k, experts, ep, seed, hot=False):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randn(tokens, experts, generator=gen).topk(top_k, dim=-1).indices
    if hot:  # every token picks expert 5 first: one group of T rows
        ids[:, 0] = 5
        ids[:, 1:] = torch.where(ids[:, 1:] == 5, 6, ids[:, 1:])
    local = experts // ep
    if ep > 1:  # transformers' expert parallelism: other ranks' experts are ids >= local
        ids = torch.where(ids < local, ids, local + ids % 3)
    return ids.reshape(-1), local


def _route_sort_tuple(s):
    return (s.order, *s.maps[:3], s.offsets, s.experts)


def _without_host_sync(fn):
    """``fn()`` with any device-to-host sync an error."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _graph_of(fn, warmup: int = 1):
    """``fn`` warmed up on a side stream (as capture requires), then captured: (graph, outputs)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fn()
    return g, out


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("shape", ROUTE_SORT_SHAPES, ids=lambda s: s[0])
def test_route_sort_model_shapes(shape, index_dtype):
    """route_sort on CUDA at model shapes equals the torch reference (torch.equal, every output),
    its offsets equal transformers' histc + cumsum, and the call makes no host sync."""
    name, tokens, top_k, experts, ep = shape
    flat, local = _route_sort_ids(tokens, top_k, experts, ep, seed=tokens + experts, hot=name == "one-expert-hot")
    ids = flat.to("cuda", index_dtype)
    rg.route_sort(ids, local, top_k)  # compile outside the sync check
    torch.cuda.synchronize()
    got = _without_host_sync(lambda: rg.route_sort(ids, local, top_k))
    ref = rg.route_sort_reference(ids.cpu(), local, top_k)
    for what, a, b in zip(("order", "token", "assignment", "slot", "offsets", "experts"), _route_sort_tuple(got),
                          _route_sort_tuple(ref)):
        assert a.dtype == torch.int32 and torch.equal(a.cpu(), b), what
    vals = torch.sort(ids.long()).values
    hf = torch.cumsum(torch.histc(vals.int(), bins=local, min=0, max=local - 1), 0, dtype=torch.int32)
    if local > 1:  # (histc at min == max == 0 takes its range from the data)
        assert torch.equal(got.offsets, hf)
    # the maps are route_maps of the order with the sentinels' positions (past offsets[-1]) as padding
    positions = torch.arange(ids.numel(), device="cuda")
    m = rg.route_maps(got.order, top_k, positions.masked_fill(positions >= got.offsets[-1], -1))
    for a, b in zip(m[:3], got.maps[:3]):
        assert torch.equal(a, b)


def test_route_sort_poisoned_and_chunks():
    """Poisoned outputs are written whole, for several chunk sizes (programs) at 131072 assignments."""
    flat, local = _route_sort_ids(16384, 8, 384, 1, seed=9)
    ids = flat.cuda()
    ref = _route_sort_tuple(rg.route_sort_reference(flat, local, 8))
    n = ids.numel()
    for chunk in (128, 1024, 8192, 131072):
        out = tuple(torch.full((n, ), 0x5A5A5A5A, dtype=torch.int32, device="cuda") for _ in range(4)) + (
            torch.full((local, ), -7, dtype=torch.int32, device="cuda"),
            torch.full((n, ), 0x5A5A5A5A, dtype=torch.int32, device="cuda"))
        kernels.route_sort_into(ids, local, 8, out=out, chunk=chunk)
        for a, b in zip(out, ref):
            assert torch.equal(a.cpu(), b), chunk


def test_route_sort_cuda_graph():
    """route_sort captured in a CUDA graph: replays on new ids (same shape) give the reference's
    outputs for those ids."""
    top_k, experts = 8, 128
    first, _ = _route_sort_ids(8192, top_k, experts, 1, seed=1)
    static = first.cuda()
    g, out = _graph_of(lambda: rg.route_sort(static, experts, top_k), warmup=2)
    for seed, ep in ((2, 1), (3, 4), (4, 1)):
        new, local = _route_sort_ids(8192, top_k, experts, ep, seed=seed)
        new = torch.where(new < local, new, experts)  # sentinels, in the graph's E
        static.copy_(new.cuda())
        g.replay()
        torch.cuda.synchronize()
        ref = rg.route_sort_reference(new, experts, top_k)
        for a, b in zip(_route_sort_tuple(out), _route_sort_tuple(ref)):
            assert torch.equal(a.cpu(), b)


# ---- the experts' fused gate (swiglu) -----------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(65536, 768), (16384, 14336 // 4), (1000, 2048), (3, 24)])
def test_swiglu_matches_cuda_eager(dtype, rows, inter):
    from unit.test_moe_swiglu import _check, _inputs

    gu, dh = _inputs((rows, 2 * inter), dtype, "cuda", seed=rows + inter)
    _check(gu, dh)


def test_swiglu_no_host_sync_and_graph_replay():
    from unit.test_moe_swiglu import _inputs

    gu, dh = _inputs((4096, 2 * 768), torch.bfloat16, "cuda", seed=9)
    leaf = gu.detach().clone().requires_grad_()

    def step():
        return torch.autograd.grad(rg.swiglu(leaf), leaf, dh)[0]

    first = step()
    _without_host_sync(step)
    g, out = _graph_of(lambda: rg.swiglu(gu))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, rg.swiglu(gu)) and torch.equal(first, step())


def test_swiglu_under_torch_compile():
    from unit.test_moe_swiglu import _inputs

    gu, dh = _inputs((512, 2 * 256), torch.bfloat16, "cuda", seed=10)
    torch._dynamo.reset()
    f = torch.compile(lambda x: rg.swiglu(x) * 2, fullgraph=True)
    a = gu.detach().clone().requires_grad_()
    b = gu.detach().clone().requires_grad_()
    (ga,) = torch.autograd.grad(f(a), a, dh)
    (gb,) = torch.autograd.grad(rg.swiglu(b) * 2, b, dh)
    assert torch.equal(ga, gb)


# ---- the fused top-k softmax router ------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,E,k", [(8192, 128, 8), (8192, 8, 2), (4096, 512, 10), (7, 64, 4)])
@pytest.mark.parametrize("renorm,cast", [(True, True), (False, True), (True, False)])
def test_topk_softmax_matches_cuda_eager(dtype, T, E, k, renorm, cast):
    from unit.test_moe_router import _check, _logits

    _check(_logits(T, E, dtype, "cuda", seed=T + E), k, renorm, dtype if cast else None)


def test_topk_softmax_no_host_sync_and_graph_replay():
    from unit.test_moe_router import _logits

    logits = _logits(8192, 128, torch.bfloat16, "cuda", seed=3).requires_grad_()

    def step():
        s, i = rg.topk_softmax(logits, 8, True, torch.bfloat16)
        return torch.autograd.grad(s.float().square().sum(), logits)[0], i

    first = step()
    _without_host_sync(step)
    x = logits.detach()
    g, out = _graph_of(lambda: rg.topk_softmax(x, 8, True, torch.bfloat16))
    g.replay()
    torch.cuda.synchronize()
    ref = rg.topk_softmax(x, 8, True, torch.bfloat16)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])
    again = step()
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])


@pytest.mark.parametrize("T,E,G,TG,k", [(8192, 256, 8, 4, 8), (8192, 128, 1, 1, 8), (1000, 64, 8, 3, 6)])
@pytest.mark.parametrize("renorm", [True, False])
def test_group_topk_sigmoid_matches_cuda_eager(T, E, G, TG, k, renorm):
    from unit.test_moe_router import _sorted_pairs

    gen = torch.Generator().manual_seed(T + E)
    logits = (2 * torch.randn(T, E, generator=gen)).cuda()
    bias = (0.3 * torch.randn(E, generator=gen)).cuda()
    w, i = rg.group_topk_sigmoid(logits, bias, k, G, TG, renorm, 2.5)
    wr, ir = rg.group_topk_sigmoid_reference(logits, bias, k, G, TG, renorm, 2.5)
    ws, is_ = _sorted_pairs(w, i)
    wrs, irs = _sorted_pairs(wr, ir)
    same = (is_ == irs).all(-1)  # Triton's exp against CUDA's: a near tie may choose the other expert
    assert same.double().mean() >= 0.999
    torch.testing.assert_close(ws[same], wrs[same], rtol=8 * 2.0 ** -23, atol=1e-30)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("T,E,k", [(8192, 32, 4), (8192, 128, 8), (7, 64, 4)])
@pytest.mark.parametrize("sd,out", [(None, None), ("fp32", "same")])
def test_topk_logits_softmax_matches_cuda_eager(dtype, T, E, k, sd, out):
    # GPT-OSS-20B (32 experts, top-4) and a 128-expert shape; (None, None): GPT-OSS / Aria,
    # ("fp32", "same"): Cohere2-MoE
    from unit.test_moe_router import _check_logits_first, _logits

    _check_logits_first(_logits(T, E, dtype, "cuda", seed=T + E), k, torch.float32 if sd else None,
                        dtype if out else None)


def test_gpt_oss_router_model_step_matches_unpatched():
    # GPT-OSS's tiny model in bf16 on the GPU with its router, gate and gathers fused: the loss and
    # every gradient against the unpatched model's (bf16 noise: relative to each gradient's norm)
    import copy

    from unit.test_moe_router import _logits_first_model

    from deepspeed_fused import patch_model

    model = _logits_first_model("gpt_oss").cuda().to(torch.bfloat16)
    ref = copy.deepcopy(model)
    rep = patch_model(model, {"moe_reorder": {"enabled": True}})
    r = rep.features[[f.name for f in rep.features].index("moe_reorder")]
    assert r.details["routers"] == r.details["layers"] == 2, r
    ids = torch.randint(0, 64, (4, 64), generator=torch.Generator().manual_seed(1)).cuda()
    outs = []
    for m in (model, ref):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        outs.append((out.loss.float(), {k: p.grad.float() for k, p in m.named_parameters() if p.grad is not None}))
    (loss, grads), (loss_r, grads_r) = outs
    assert abs(loss.item() - loss_r.item()) <= 1e-2 * abs(loss_r.item())
    for k in grads_r:
        assert (grads[k] - grads_r[k]).norm() <= 5e-2 * grads_r[k].norm() + 1e-6, k


def test_routers_under_torch_compile():
    gen = torch.Generator().manual_seed(11)
    logits = torch.randn(512, 128, generator=gen).cuda()
    bias = (0.1 * torch.randn(128, generator=gen)).cuda()
    torch._dynamo.reset()
    f = torch.compile(lambda x: rg.topk_softmax(x, 8, True, torch.bfloat16), fullgraph=True)
    h = torch.compile(lambda x: rg.group_topk_sigmoid(x, bias, 8, 8, 4, True, 2.5), fullgraph=True)
    q = torch.compile(lambda x: rg.topk_logits_softmax(x, 4, None, torch.bfloat16), fullgraph=True)
    for fn, eager in ((f, lambda x: rg.topk_softmax(x, 8, True, torch.bfloat16)),
                      (h, lambda x: rg.group_topk_sigmoid(x, bias, 8, 8, 4, True, 2.5)),
                      (q, lambda x: rg.topk_logits_softmax(x, 4, None, torch.bfloat16))):
        a, b = logits.clone().requires_grad_(), logits.clone().requires_grad_()
        (wa, ia), (wb, ib) = fn(a), eager(b)
        assert torch.equal(ia, ib) and torch.equal(wa, wb)
        d = torch.randn_like(wa)
        (ga,) = torch.autograd.grad(wa, a, d)
        (gb,) = torch.autograd.grad(wb, b, d)
        assert torch.equal(ga, gb)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("rows,inter", [(16384, 2880), (1000, 640), (3, 24)])
def test_oai_gate_matches_cuda_eager(dtype, rows, inter):
    from unit.test_moe_swiglu import LIMIT, check_oai

    gen = torch.Generator().manual_seed(rows + inter)
    gu = (5 * torch.randn(rows, 2 * inter, generator=gen)).to(dtype)
    gu.view(-1)[:2] = torch.tensor([LIMIT, -LIMIT], dtype=dtype)
    dh = torch.randn(rows, inter, generator=gen).to(dtype)
    check_oai(gu.cuda(), dh.cuda())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("S,N,E,pad", [(32768, 5760, 32, 0), (32768, 2880, 32, 1000), (1000, 640, 128, 7), (3, 24, 4, 0)])
def test_expert_bias_matches_cuda_eager(dtype, S, N, E, pad):
    # forward bitwise CUDA eager's rows + bias[ids]; the bias gradient within FP32 summation and one
    # rounding of the float64 per-expert sums, and no farther from them than eager's index-put (the
    # first H200 run found eager's half-precision bias gradient several ULP from ours)
    from unit.test_moe_expert_bias import _case, _run, _oracle_bound

    rows, bias, experts, offsets, dy = _case(S, N, E, dtype, "cuda", pad=pad)
    y, dr, db = _run(rg.expert_bias, rows, bias, experts, offsets, dy)
    b = bias.clone().requires_grad_()
    ref = rows + b[experts.long()]
    valid = S - pad
    ref[:valid].backward(dy[:valid])
    assert torch.equal(y, ref.detach()) and torch.equal(dr, dy)
    oracle, bound = _oracle_bound(dy, offsets, dtype)
    ours, eager = (db.double() - oracle).abs(), (b.grad.double() - oracle).abs()
    assert (ours <= bound).all()
    assert ours.norm() <= eager.norm() * 1.01 + 1e-30


def test_expert_bias_no_host_sync_and_graph_replay():
    from unit.test_moe_expert_bias import _case

    import importlib

    B = importlib.import_module("deepspeed_fused.ops.moe_reorder.expert_bias")
    rows, bias, experts, offsets, dy = _case(4096, 2880, 32, torch.bfloat16, "cuda", pad=100)
    r, b = rows.clone().requires_grad_(), bias.clone().requires_grad_()

    def step():
        return torch.autograd.grad(rg.expert_bias(r, b, experts, offsets), [r, b], dy)

    first = step()
    _without_host_sync(step)
    g1, out = _graph_of(lambda: rg.expert_bias(rows, bias, experts, offsets))
    g2, grad = _graph_of(lambda: B._grad(dy, offsets, torch.bfloat16))
    g1.replay()
    g2.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, rg.expert_bias(rows, bias, experts, offsets)) and torch.equal(grad, first[1])
