"""Fused linear cross-entropy on the GPU: full-size vocabularies against a float64 reference,
every option at small shapes, repeatability, no host sync, CUDA graphs, torch.compile, memory."""
import pytest
import torch

from deepspeed_fused.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

pytestmark = pytest.mark.gpu
DEV = "cuda"
# (loss relative error, gradient relative-norm error) against float64
TOL = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-3, 1e-2), torch.float16: (1e-3, 1e-2)}


def _data(M, H, V, dtype, seed=0, ignore_every=7, bias=False, h_std=0.5, w_std=0.02):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = (torch.randn(M, H, device=DEV, generator=g) * h_std).to(dtype)
    w = (torch.randn(V, H, device=DEV, generator=g) * w_std).to(dtype)
    t = torch.randint(0, V, (M,), device=DEV, generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    b = (torch.randn(V, device=DEV, generator=g) * 0.5).to(dtype) if bias else None
    return h, w, t, b


def _run(fn, h, w, t, b, dtype=None, **kw):
    leaf = lambda x: None if x is None else x.detach().to(dtype or x.dtype).clone().requires_grad_()  # noqa: E731
    h, w, b = leaf(h), leaf(w), leaf(b)
    out = fn(h, w, t, bias=b, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    total = 0
    for i, o in enumerate(outs):
        wt = torch.linspace(0.5, 1.5, o.numel(), dtype=torch.float64, device=DEV).reshape(o.shape) * (i + 1)
        total = total + (o.double() * wt).sum()
    total.backward()
    grads = [x.grad for x in (h, w, b) if x is not None]
    return [o.detach() for o in outs], grads


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _check(M, H, V, dtype, seed=0, bias=False, data_kw=None, eager_floor=False, **kw):
    h, w, t, b = _data(M, H, V, dtype, seed, bias=bias, **(data_kw or {}))
    out, grads = _run(linear_cross_entropy, h, w, t, b, **kw)
    ref_kw = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    rout, rgrads = _run(linear_cross_entropy_reference, h, w, t, b, dtype=torch.float64, **ref_kw)
    tl_, tg = TOL[dtype]
    if eager_floor and dtype != torch.float32:
        # Stress data (logits of std ~1.6, entropy-dominated gradients): the bound is the issue's
        # or, where rounding the logits to 16 bits alone costs more, 1.1x what eager torch with
        # 16-bit logits (the chunked reference run in this dtype) gets against float64.
        _, egrads = _run(linear_cross_entropy_reference, h, w, t, b, **kw)
        tg = max(tg, 1.1 * max(_rel(g, r) for g, r in zip(egrads, rgrads)))
    for o, r in zip(out, rout, strict=True):
        assert torch.isfinite(o).all()
        err = _rel(o, r)
        assert err <= tl_ or (o.double() - r).abs().max().item() <= tl_, (err, o, r)
    for g, r in zip(grads, rgrads, strict=True):
        assert torch.isfinite(g).all()
        assert _rel(g, r) <= tg, _rel(g, r)
    del out, grads, rout, rgrads
    torch.cuda.empty_cache()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("H,V", [(2048, 151936), (4096, 128256), pytest.param(7168, 202048, marks=pytest.mark.gpu_heavy),
                                 (2880, 151936), (5120, 128256)])
@pytest.mark.parametrize("mode", ["mean", "none+entropy+lse"])
def test_full_vocab(dtype, H, V, mode):
    """7168 x 202048: the weight, its copy and gradient, their float64 copies: 32-42 GiB."""
    kw = dict(reduction="none", return_entropy=True, return_lse=True) if mode != "mean" else {}
    _check(384, H, V, dtype, chunk_tokens=128, **kw)  # 3 token chunks: cross-chunk dW accumulation


@pytest.mark.parametrize("accum", [None, torch.float32])
@pytest.mark.parametrize("mode", ["mean", "none+entropy"])
def test_benchmark_shape_bf16(accum, mode):
    """8192 x 4096 x 128256 bf16 with the default chunking (5 token chunks for the mean loss, 5
    vocabulary chunks for the per-token path): error bounds hold."""
    from deepspeed_fused.ops.linear_cross_entropy import sizing as api

    assert api._vocab_chunk(None, 1664, 128256, torch.bfloat16, 8192, 0.0, True) == 25728
    kw = dict(reduction="none", return_entropy=True) if mode != "mean" else {}
    _check(8192, 4096, 128256, torch.bfloat16, accum_dtype=accum, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opts", ["plain", "all"])
def test_vocab_chunks(monkeypatch, dtype, opts):
    """The per-token path over vocabulary chunks (forced by a 16 MiB budget: 512 tokens, V=32000 in
    chunks of ~8000), every option, against float64."""
    from deepspeed_fused.ops.linear_cross_entropy import sizing as api

    monkeypatch.setattr(api, "DEFAULT_WORKSPACE_BYTES", 16 << 20)
    M, V = 512, 32000
    assert api._vocab_chunk(None, 1, V, dtype, M, 2.0 if opts == "all" else 0.0, True) < V
    kw = {}
    if opts == "all":
        temp = torch.rand(M, device=DEV, generator=torch.Generator(device=DEV).manual_seed(1)) + 0.5
        kw = dict(temperature=temp, softcap=2.0, z_loss=1e-2, label_smoothing=0.1, bias=True)
    bias = kw.pop("bias", False)
    _check(M, 1024, V, dtype, bias=bias, reduction="none", return_entropy=True, return_lse=True, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("opts", ["plain", "all", "softcap", "ragged"])
def test_fused_gemm_forward_agrees_with_row_kernel(monkeypatch, dtype, opts):
    """The per-token path through the fused GEMMs (forward statistics, backward dlogits; the logits
    rounded in their epilogues as cuBLAS rounds them) against cuBLAS and the row kernel at a
    Qwen3-head shape: the same outputs and gradients up to the GEMMs' different summation orders
    (an occasional last-bit difference of a logit), and within the usual bounds of float64.
    "ragged": tokens and vocabulary off the tile sizes (1000 x 50001: odd rows, padded dlogits
    rows) and a small workspace, so the backward's fused GEMM takes several vocabulary slices."""
    from deepspeed_fused.ops.linear_cross_entropy import launch as kernels, sizing as api

    M, H, V = 1024, 2048, 151936
    if opts == "ragged":
        M, V = 1000, 50001
        monkeypatch.setattr(api, "DEFAULT_WORKSPACE_BYTES", 24 * 2**20)
    h, w, t, b = _data(M, H, V, dtype, bias=opts == "all")
    assert kernels.gemm_stats_supported(h, w)
    kw = dict(reduction="none", return_entropy=True, return_lse=True, bias=b)
    if opts == "all":
        kw.update(temperature=torch.rand(M, device=DEV) + 0.5, z_loss=1e-3, label_smoothing=0.1)
    elif opts == "softcap":
        kw.update(softcap=20.0)
    bias = kw.pop("bias")
    from deepspeed_fused.ops.linear_cross_entropy import chunks as single

    slices, real_grad = [], single.gemm_grad
    monkeypatch.setattr(single, "gemm_grad", lambda hh, ww, *a, vocab_start=0, **k: (
        slices.append((vocab_start, vocab_start + ww.shape[0])), real_grad(hh, ww, *a, vocab_start=vocab_start, **k))[1])
    fused, fgrads = _run(linear_cross_entropy, h, w, t, bias, **kw)
    assert kernels._GEMM_STATS_OK[0] and kernels._GEMM_GRAD_OK[0], "a fused GEMM fell back (see its warning)"
    assert slices and slices[0][0] == 0 and slices[-1][1] == V, slices  # the backward's fused GEMM covered V
    assert all(a[1] == b[0] for a, b in zip(slices, slices[1:])) and (len(slices) > 1 or opts != "ragged"), slices
    monkeypatch.setattr(kernels, "_GEMM_STATS_OK", [False])
    monkeypatch.setattr(kernels, "_GEMM_GRAD_OK", [False])
    rows, rgrads = _run(linear_cross_entropy, h, w, t, bias, **kw)
    if bias is None:
        for a, r in zip(fused, rows, strict=True):
            assert (a - r).abs().max().item() <= 2e-3, (a - r).abs().max().item()
        for a, r in zip(fgrads, rgrads, strict=True):  # the backward's fused GEMM against cuBLAS + rows
            assert _rel(a, r) <= 2e-3, _rel(a, r)
    else:
        # With a bias the fused GEMMs keep the biased logits in fp32 (the log-sum-exp is then never
        # less accurate than eager's), where cuBLAS rounds them to the input dtype: the two paths
        # differ by up to a rounding of a logit. Each output element of the fused path is no farther
        # from float64 than the rows path's plus the bound above, each gradient no farther in norm.
        ref_kw = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v)
                  for k, v in kw.items()}
        ref, refgrads = _run(linear_cross_entropy_reference, h, w, t, bias, dtype=torch.float64, **ref_kw)
        for a, r, x in zip(fused, rows, ref, strict=True):
            excess = ((a.double() - x).abs() - (r.double() - x).abs()).max().item()
            assert excess <= 2e-3, excess
        for a, r, x in zip(fgrads, rgrads, refgrads, strict=True):
            assert _rel(a, x) <= 1.1 * _rel(r, x) + 2e-3, (_rel(a, x), _rel(r, x))
    monkeypatch.setattr(kernels, "_GEMM_STATS_OK", [True])
    monkeypatch.setattr(kernels, "_GEMM_GRAD_OK", [True])
    _check(M, H, V, dtype, bias=opts == "all", **kw)


_OPTIONS = {
    "plain": {},
    "temp_cap_bias": dict(temperature=0.7, softcap=3.0, bias=True),
    "tensor_temp": dict(temperature="tensor"),
    "all": dict(temperature="tensor", softcap=2.0, z_loss=1e-2, label_smoothing=0.1, bias=True),
    "zloss_smooth": dict(z_loss=1e-3, label_smoothing=0.2),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("extra", ["", "entropy", "lse", "entropy+lse"])
@pytest.mark.parametrize("opts", list(_OPTIONS))
def test_options_small(dtype, reduction, extra, opts):
    kw = dict(_OPTIONS[opts])
    M, V = 77, 3001
    if kw.get("temperature") == "tensor":
        kw["temperature"] = torch.rand(M, device=DEV, generator=torch.Generator(DEV).manual_seed(5)) + 0.5
    bias = kw.pop("bias", False)
    _check(M, 64, V, dtype, bias=bias, reduction=reduction, return_entropy="entropy" in extra,
           return_lse="lse" in extra, chunk_tokens=32, data_kw=dict(w_std=0.2, h_std=1.0), eager_floor=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", ["all_ignored", "one_token", "small_V", "odd_H", "unchecked_targets"])
def test_edge_cases(dtype, case):
    if case == "all_ignored":
        h, w, t, b = _data(50, 64, 1000, dtype, bias=True)
        t.fill_(-100)
        for kw in ({}, dict(reduction="sum"), dict(reduction="none")):
            out, grads = _run(linear_cross_entropy, h, w, t, b, **kw)
            assert (out[0] == 0).all()
            assert all(torch.isfinite(g).all() and (g == 0).all() for g in grads)
            # divided by num_items_in_batch = 0 (HF's summed loss of a step with no labelled token):
            # NaN, every gradient exactly 0 (scalar path: the in-place scaling; per-token: the fused
            # gradient GEMM on Hopper in bf16)
            leaves = [x.clone().requires_grad_() for x in (h, w, b)]
            loss = linear_cross_entropy(leaves[0], leaves[1], t, bias=leaves[2], z_loss=1e-3, label_smoothing=0.1,
                                        **kw).sum() / torch.tensor(0, device=DEV)
            loss.backward()
            assert torch.isnan(loss) and all(torch.equal(x.grad, torch.zeros_like(x)) for x in leaves)
        # labelled tokens with an infinite upstream gradient: dhidden's ignored rows stay 0 (as eager)
        h, w, t, b = _data(50, 64, 1000, dtype, bias=True, ignore_every=3)
        hh = h.clone().requires_grad_()
        (linear_cross_entropy(hh, w, t, reduction="sum") / torch.tensor(0, device=DEV)).backward()
        ign = t == -100
        assert torch.equal(hh.grad[ign], torch.zeros_like(hh.grad[ign])) and not hh.grad[~ign].isfinite().any()
    elif case == "unchecked_targets":
        # validate_targets=False: a target outside [0, V) has no target logit on every path (the
        # scalar path's row kernel, the per-token fused GEMMs), as in the reference
        h, w, t, b = _data(77, 64, 3001, dtype, bias=True)
        t[[1, 2, 3]] = torch.tensor([3001, -5, 10 ** 6], device=DEV)
        for kw in (dict(), dict(reduction="sum", z_loss=1e-3), dict(reduction="none", return_lse=True,
                                                                     label_smoothing=0.1)):
            out, grads = _run(linear_cross_entropy, h, w, t, b, validate_targets=False, **kw)
            rout, rgrads = _run(linear_cross_entropy_reference, h, w, t, b, dtype=torch.float64,
                                validate_targets=False, **kw)
            tl_, tg = TOL[dtype]
            for o, r in zip(out, rout, strict=True):
                assert torch.isfinite(o).all() and _rel(o, r) <= tl_, (kw, o, r)
            for g, r in zip(grads, rgrads, strict=True):
                assert torch.isfinite(g).all() and _rel(g, r) <= tg, (kw, _rel(g, r))
    elif case == "one_token":
        _check(1, 64, 5003, dtype, data_kw=dict(ignore_every=0))
        _check(1, 64, 5003, dtype, data_kw=dict(ignore_every=0), reduction="none", return_entropy=True)
    elif case == "small_V":
        _check(100, 32, 7, dtype, data_kw=dict(w_std=0.5))
    else:
        _check(200, 2881, 10007, dtype, data_kw=dict(w_std=0.05), return_lse=True)


@pytest.mark.parametrize("kw", [{}, dict(reduction="none", return_entropy=True)])
def test_bitwise_repeatable(kw):
    h, w, t, b = _data(1024, 2048, 151936, torch.bfloat16, bias=True)
    a = _run(linear_cross_entropy, h, w, t, b, chunk_tokens=256, **kw)
    c = _run(linear_cross_entropy, h, w, t, b, chunk_tokens=256, **kw)
    for x, y in zip(a[0] + a[1], c[0] + c[1]):
        assert torch.equal(x, y)


@pytest.mark.parametrize("kw", [{}, dict(reduction="none", return_entropy=True, return_lse=True)])
def test_no_host_sync(kw):
    h, w, t, _ = _data(512, 1024, 50257, torch.bfloat16)
    h.requires_grad_()
    w.requires_grad_()
    out = linear_cross_entropy(h, w, t, validate_targets=False, chunk_tokens=128, **kw)  # warm-up (JIT)
    (sum(o.sum() for o in out) if isinstance(out, tuple) else out).backward()
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = linear_cross_entropy(h, w, t, validate_targets=False, chunk_tokens=128, **kw)
        loss = sum(o.sum() for o in out) if isinstance(out, tuple) else out
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert h.grad is not None and w.grad is not None


def _loss_of(out):
    return sum(o.float().sum() * (i + 1) for i, o in enumerate(out)) if isinstance(out, tuple) else out


@pytest.mark.parametrize("kw", [{}, dict(reduction="none", return_entropy=True),
                                dict(temperature="tensor", reduction="sum", accum_dtype=torch.float32)])
def test_cuda_graph_capture(kw):
    kw = dict(kw)
    M, H, V = 256, 512, 32003
    h, w, t, _ = _data(M, H, V, torch.bfloat16)
    temp = torch.rand(M, device=DEV) + 0.5 if kw.get("temperature") == "tensor" else None
    if temp is not None:
        kw["temperature"] = temp
    hs, ws = h.clone().requires_grad_(), w.clone().requires_grad_()

    def step():
        out = linear_cross_entropy(hs, ws, t, validate_targets=False, chunk_tokens=96, **kw)
        loss = _loss_of(out)
        loss.backward()
        return loss

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            hs.grad = ws.grad = None
            step()
    torch.cuda.current_stream().wait_stream(s)
    hs.grad = ws.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_loss = step()
    h2, _, t2, _ = _data(M, H, V, torch.bfloat16, seed=1)
    t2[:50] = -100
    with torch.no_grad():
        hs.copy_(h2)
        t.copy_(t2)
        if temp is not None:
            temp.copy_(torch.rand(M, device=DEV) + 0.5)
    graph.replay()
    torch.cuda.synchronize()
    he, we = h2.clone().requires_grad_(), w.clone().requires_grad_()
    eager = _loss_of(linear_cross_entropy(he, we, t2, chunk_tokens=96, **kw))
    eager.backward()
    # replay saw the new hidden, targets (50 more ignored: n_valid on device) and temperatures
    assert _rel(static_loss, eager) < 1e-5
    assert _rel(hs.grad, he.grad) < 1e-3 and _rel(ws.grad, we.grad) < 1e-3


@pytest.mark.parametrize("kw", [{}, dict(reduction="none", return_entropy=True)])
def test_torch_compile(kw):
    h, w, t, _ = _data(300, 256, 20011, torch.bfloat16)

    def f(h, w, t):
        return _loss_of(linear_cross_entropy(h, w, t, validate_targets=False, chunk_tokens=128, **kw))

    res = []
    for fn in (f, torch.compile(f, fullgraph=True)):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(hh, ww, t)
        out.backward()
        res.append((out.float(), hh.grad.float(), ww.grad.float()))
    for a, b in zip(*res):
        assert _rel(a, b) < 1e-3


@pytest.mark.parametrize("mode", ["mean", "none+entropy"])
def test_peak_memory_bounded(mode):
    """Default mode at 8192 x 4096 x 128256 bf16: extra memory (beyond inputs and grads) <= 512 MiB."""
    h, w, t, _ = _data(8192, 4096, 128256, torch.bfloat16)
    h.requires_grad_()
    w.requires_grad_()
    kw = dict(reduction="none", return_entropy=True) if mode != "mean" else {}

    def fb():
        out = linear_cross_entropy(h, w, t, validate_targets=False, **kw)
        _loss_of(out).backward()

    fb()  # warm-up: kernels compiled, cuBLAS workspace allocated
    h.grad = w.grad = None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fb()
    torch.cuda.synchronize()
    grads = h.numel() * 2 + w.numel() * 2
    extra = (torch.cuda.max_memory_allocated() - base - grads) / 2**20
    assert extra <= 512, extra


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bias,softcap", [(True, None), (False, 20.0), (True, 20.0)])
def test_lse_at_least_as_accurate_as_eager(dtype, bias, softcap):
    """The op's numerics (Apple CCE's contract), per row: |lse - lse_fp32| <= |lse_eager - lse_fp32|
    + 1e-5, where eager is F.linear in the input dtype, then the soft cap in that dtype, then an FP32
    logsumexp, and lse_fp32 is the same from FP32 copies of the inputs. (With a soft cap on half
    inputs ours forms the chunk logits in fp32: until then bf16 bias + softcap missed on one row
    of 512 by 2e-5.)"""
    import torch.nn.functional as F

    M, H, V = 512, 1024, 32000
    h, w, t, b = _data(M, H, V, dtype, seed=11, bias=bias, w_std=0.05)

    def eager(h_, w_, b_):
        z = F.linear(h_, w_, b_)
        if softcap:
            z = softcap * torch.tanh(z / softcap)
        return torch.logsumexp(z.float(), dim=-1)

    lse_fp32 = eager(h.float(), w.float(), None if b is None else b.float()).double()
    lse_eager = eager(h, w, b).double()
    _, lse = linear_cross_entropy(h, w, t, bias=b, softcap=softcap, reduction="none", return_lse=True)
    from deepspeed_fused.ops.linear_cross_entropy import sizing as single

    assert single._FP32_LOGITS_OK[0], "cuBLAS did not write fp32 logits (the fallback ran)"
    ours_err = (lse.double() - lse_fp32).abs()
    eager_err = (lse_eager - lse_fp32).abs()
    excess = (ours_err - eager_err - 1e-5).max().item()
    assert excess <= 0, (f"worst row exceeds eager's error by {excess:.2e} (ours max {ours_err.max().item():.2e}, "
                         f"eager max {eager_err.max().item():.2e})")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("g", [1.0, 1 / 3, 2.0, float("inf")])
def test_upstream_gradient_scaling(dtype, g):
    """The eager scalar loss's in-place scaling by the upstream gradient: the product in fp32, one
    rounding; nothing changes when g == 1. Rows of ignored targets (dhidden's) are left as they
    are, and so is a tensor whose gate is False (dweight with no labelled token)."""
    from deepspeed_fused.ops.linear_cross_entropy import launch as kernels

    x = torch.randn(1000, 777, device=DEV).to(dtype)
    gt = torch.tensor(g, dtype=torch.float32, device=DEV)
    scaled = (x.float() * gt).to(dtype)
    assert torch.equal(kernels._scale_unless_one_(x.clone(), gt), scaled)
    t = torch.randint(0, 50, (1000,), device=DEV)
    t[::3] = -100
    rows = kernels._scale_unless_one_(x.clone(), gt, target=t, ignore_index=-100)
    assert torch.equal(rows, torch.where((t != -100)[:, None], scaled, x))
    for on in (True, False):
        gated = kernels._scale_unless_one_(x.clone(), gt, gate=torch.tensor(on, device=DEV))
        assert torch.equal(gated, scaled if on else x)
