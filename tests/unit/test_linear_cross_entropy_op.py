"""Fused linear cross-entropy op: kernels (Triton interpreter on CPU) against a float64 reference.

Shapes stay tiny (the interpreter costs ~1 ms per program): M <= 40, V <= 300, H <= 32.
"""
import warnings

import pytest
import torch
import torch.nn.functional as F

from deepspeed_fused.ops import _common
from lce_testing import rel, weighted_backward
from deepspeed_fused.ops.linear_cross_entropy import launch as lce_gemm, launch as lce_rows
from deepspeed_fused.ops.linear_cross_entropy import launch as lce_scale, stats as lce_stats
from deepspeed_fused.ops.linear_cross_entropy import (auto_chunk_tokens, linear_cross_entropy,
                                                      linear_cross_entropy_reference, merge_partial_stats)

TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (1e-3, 1e-2)}  # (loss rel, grad rel-norm)

if _common.interpreter_active():  # first custom-op call costs seconds: pay it once in the parent,
    _w = torch.randn(5, 4, requires_grad=True)  # forked tests inherit the warm state
    linear_cross_entropy(torch.randn(3, 4), _w, torch.tensor([1, 2, 3])).backward()
    linear_cross_entropy(torch.randn(3, 4), _w, torch.tensor([1, 2, 3]), reduction="none")[0].backward()


def _inputs(M, H, V, dtype, device, seed=0, ignore_every=5, bias=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.3
    t = torch.randint(0, V, (M,), generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    cast = lambda x: None if x is None else x.to(device=device, dtype=dtype)  # noqa: E731
    return cast(h), cast(w), t.to(device), cast(b)


def _compare(dtype, device, M=13, H=16, V=37, seed=0, bias=False, ignore_every=5, **kw):
    h, w, t, b = _inputs(M, H, V, dtype, device, seed, ignore_every, bias)
    out, grads = weighted_backward(linear_cross_entropy, h, w, t, b, **kw)
    ref_kw = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    rout, rgrads = weighted_backward(linear_cross_entropy_reference, h, w, t, b, dtype=torch.float64, **ref_kw)
    tl_, tg = TOL[dtype]
    for o, r in zip(out, rout, strict=True):
        assert torch.isfinite(o).all()
        assert rel(o, r) <= tl_ or (o - r).abs().max() <= tl_, (o, r)
    for g, r in zip(grads, rgrads, strict=True):
        assert torch.isfinite(g).all()
        assert rel(g, r) <= tg, rel(g, r)
    return out, grads


# every reduction x extra outputs x option set, through the kernels
_OPTIONS = {
    "plain": {},
    "temp_cap_bias": dict(temperature=0.7, softcap=3.0, bias=True),
    "all": dict(temperature="tensor", softcap=2.0, z_loss=0.05, label_smoothing=0.1, bias=True),
}


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("extra", ["", "entropy+lse", "lse"])
@pytest.mark.parametrize("opts", list(_OPTIONS))
def test_matches_float64_reference(interpret, reduction, extra, opts):
    kw = dict(_OPTIONS[opts])
    M = 13
    if kw.get("temperature") == "tensor":
        kw["temperature"] = (torch.rand(M, generator=torch.Generator().manual_seed(3)) + 0.5).to(interpret)
    bias = kw.pop("bias", False)
    _compare(torch.float32, interpret, M=M, bias=bias, reduction=reduction, return_entropy="entropy" in extra,
             return_lse="lse" in extra, **kw)


@pytest.mark.parametrize("case", ["ragged_V_chunks", "one_token", "fp16", "fp16_softcap", "accum_fp32", "int32_3d",
                                  "z_smooth_sum"])
def test_special_shapes(interpret, case):
    if case == "ragged_V_chunks":  # V=300: 5 kernel blocks of 64, last ragged; 3 token chunks
        _compare(torch.float32, interpret, M=29, H=24, V=300, chunk_tokens=11, return_lse=True)
        _compare(torch.float32, interpret, M=29, H=24, V=300, chunk_tokens=11)
    elif case == "one_token":
        _compare(torch.float32, interpret, M=1, V=50, ignore_every=0, return_entropy=True)
        _compare(torch.float32, interpret, M=1, V=50, ignore_every=0)
    elif case == "fp16":
        _compare(torch.float16, interpret, M=16, H=32, V=100, bias=True)
        _compare(torch.float16, interpret, M=16, H=32, V=100, reduction="none", return_entropy=True)
    elif case == "fp16_softcap":  # fp32 chunk logits, dlogits in a separate fp16 buffer; several chunks
        _compare(torch.float16, interpret, M=16, H=32, V=100, bias=True, softcap=3.0, chunk_tokens=5)
        _compare(torch.float16, interpret, M=16, H=32, V=100, softcap=2.0, temperature=0.8, chunk_tokens=7,
                 reduction="none", return_entropy=True, return_lse=True)
        _compare(torch.float16, interpret, M=16, H=32, V=100, bias=True, softcap=3.0,
                 accum_dtype=torch.float32)
    elif case == "accum_fp32":
        _compare(torch.float32, interpret, M=20, chunk_tokens=6, accum_dtype=torch.float32, bias=True)
        _compare(torch.float16, interpret, M=20, chunk_tokens=6, accum_dtype=torch.float32, reduction="none")
    elif case == "int32_3d":
        h, w, t, _ = _inputs(12, 8, 37, torch.float32, interpret)
        h3, t3 = h.reshape(3, 4, 8), t.reshape(3, 4).int()
        out = linear_cross_entropy(h3, w, t3, reduction="none", return_lse=True)
        ref = linear_cross_entropy_reference(h3.double(), w.double(), t3, reduction="none", return_lse=True)
        assert out[0].shape == (3, 4) and out[0].dtype == torch.float32
        for o, r in zip(out, ref):
            assert rel(o.double(), r) < 1e-5
    elif case == "z_smooth_sum":
        _compare(torch.float32, interpret, M=17, V=64, reduction="sum", z_loss=1e-3, label_smoothing=0.3,
                 chunk_tokens=8)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_all_targets_ignored(interpret, reduction):
    h, w, t, b = _inputs(9, 16, 37, torch.float32, interpret, bias=True)
    t = torch.full_like(t, -100)
    out, grads = weighted_backward(linear_cross_entropy, h, w, t, b, reduction=reduction)
    assert (out[0] == 0).all()
    for g in grads:
        assert torch.isfinite(g).all() and (g == 0).all()
    # entropy still flows for ignored targets (entropy is defined for every token)
    out, grads = weighted_backward(linear_cross_entropy, h, w, t, None, reduction=reduction, return_entropy=True)
    assert (out[0] == 0).all() and (out[1] > 0).all() and grads[0].abs().sum() > 0


def test_reference_matches_torch(interpret):
    """The reference itself against materialized logits and torch's own losses."""
    h, w, t, b = _inputs(15, 8, 23, torch.float64, "cpu", bias=True)
    logits = (h @ w.t() + b) / 0.8
    for ls in (0.0, 0.2):
        ref = linear_cross_entropy_reference(h, w, t, bias=b, temperature=0.8, label_smoothing=ls)
        assert torch.allclose(ref, F.cross_entropy(logits, t, ignore_index=-100, label_smoothing=ls), rtol=1e-12)
    loss, ent, lse = linear_cross_entropy_reference(h, w, t, bias=b, temperature=0.8, reduction="none",
                                                    return_entropy=True, return_lse=True, chunk_tokens=4)
    assert torch.allclose(loss, F.cross_entropy(logits, t, reduction="none"), rtol=1e-12)
    assert torch.allclose(ent, torch.distributions.Categorical(logits=logits).entropy(), rtol=1e-12)
    assert torch.allclose(lse, torch.logsumexp(logits, -1), rtol=1e-12)
    capped = 2.0 * torch.tanh(logits / 2.0)
    zl = linear_cross_entropy_reference(h, w, t, bias=b, temperature=0.8, softcap=2.0, z_loss=0.1, reduction="sum")
    valid = t != -100
    expect = (F.cross_entropy(capped, t, reduction="none") + 0.1 * torch.logsumexp(capped, -1) ** 2)[valid].sum()
    assert torch.allclose(zl, expect, rtol=1e-12)


def _row_inputs(seed, n, V, scale, ignored):
    """Logits [n, V] (x scale), targets with row ``ignored`` ignored, and the generator."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g) * scale
    t = torch.randint(0, V, (n,), generator=g)
    t[ignored] = -100
    return x, t, g


def test_kernel_writes_every_element(interpret):
    """Poisoned stats buffer and logits buffer: every element is written, with the right value."""
    n, V = 7, 150
    x, t, g = _row_inputs(1, n, V, 3, 2)
    stats = torch.full((n, 5), float("nan"))
    lce_rows._launch_rows(x, t, stats=stats, need_ent=True, smoothing=0.1)
    assert torch.isfinite(stats).all()
    loss, lse, ent = lce_stats._finalize_stats(stats, t != -100, V, 0.0, 0.1, True)
    z = x.double()
    assert torch.allclose(lse.double(), torch.logsumexp(z, -1), rtol=1e-6)
    assert torch.allclose(ent.double(), torch.distributions.Categorical(logits=z).entropy(), rtol=1e-5, atol=1e-6)
    # gradient mode: x is overwritten with dlogits of sum(gl * loss + ge * ent)
    gl, ge = torch.rand(n, generator=g), torch.rand(n, generator=g)
    zz = z.clone().requires_grad_()
    lossr = F.cross_entropy(zz, t, reduction="none", label_smoothing=0.1)
    entr = torch.distributions.Categorical(logits=zz).entropy()
    (lossr * gl.double() + entr * ge.double()).sum().backward()
    y = x.clone()
    lce_rows._launch_rows(y, t, lse=lse, ent=ent, g_loss=gl, g_ent=ge, per_token=True, smoothing=0.1)
    assert torch.allclose(y.double(), zz.grad, atol=1e-6)


def test_kernel_writes_gradient_to_another_buffer(interpret):
    """``out=``: fp32 logits stay as they are, dlogits land (every element) in a poisoned fp16
    buffer, equal to the in-place result rounded once."""
    n, V = 6, 130
    x, t, g = _row_inputs(4, n, V, 3, 1)
    stats = torch.empty(n, 5)
    gl = torch.rand(n, generator=g)
    kw = dict(softcap=2.5, inv_temp=0.9)
    lce_rows._launch_rows(x, t, stats=stats, **kw)
    lse = lce_stats._finalize_stats(stats, t != -100, V, 0.0, 0.0, False)[1]
    x0 = x.clone()
    out = torch.full((n, V), float("nan"), dtype=torch.float16)
    lce_rows._launch_rows(x, t, lse=lse, g_loss=gl, per_token=True, out=out, **kw)
    assert torch.equal(x, x0) and torch.isfinite(out).all()
    y = x.clone()
    lce_rows._launch_rows(y, t, lse=lse, g_loss=gl, per_token=True, **kw)
    assert torch.equal(out, y.half())


@pytest.mark.parametrize("bias", [False, True])
def test_softcap_lse_at_least_as_accurate_as_eager(interpret, bias):
    """The op's accuracy contract per row in fp16 with a soft cap: |lse - lse_fp64| <= |lse_eager -
    lse_fp64| + 1e-5, eager being F.linear in fp16, the cap in fp16, an fp32 logsumexp (ours forms
    the chunk logits in fp32 then, so it is close to the fp64 result on every row)."""
    M, H, V, cap = 40, 32, 300, 3.0
    h, w, t, b = _inputs(M, H, V, torch.float16, interpret, seed=9, bias=bias)

    def eager(h_, w_, b_):
        z = F.linear(h_, w_, b_)
        return torch.logsumexp((cap * torch.tanh(z / cap)).float(), dim=-1).double()

    exact = eager(h.double(), w.double(), None if b is None else b.double())
    _, lse = linear_cross_entropy(h, w, t, bias=b, softcap=cap, reduction="none", return_lse=True, chunk_tokens=16)
    ours_err = (lse.double() - exact).abs()
    assert ours_err.max() <= 1e-5, ours_err.max()
    assert (ours_err <= (eager(h, w, b) - exact).abs() + 1e-5).all()


def test_fp32_logits_fallback(interpret, monkeypatch):
    """When cuBLAS cannot write fp32 logits: one warning, this call's logits rounded first (into
    its fp32 buffer), and later calls take input-dtype workspaces (no fp32 buffers)."""
    from deepspeed_fused.ops.linear_cross_entropy import chunks, sizing

    calls = []

    class _FakeOut:  # reaches the CUDA branch of _logits_fp32_into on CPU
        def __init__(self, t):
            self.t, self.is_cuda = t, True

        def copy_(self, v):
            calls.append(v.dtype)
            self.t.copy_(v)

        def add_(self, b):
            self.t.add_(b)

    real_mm = torch.mm

    def mm(*a, **k):
        if len(a) == 3:  # the out_dtype overload
            raise RuntimeError("no fp32 output here")
        return real_mm(*a, **k)

    monkeypatch.setattr(sizing, "_FP32_LOGITS_OK", [True])
    monkeypatch.setattr(torch, "mm", mm)
    h, w = torch.randn(3, 8).half(), torch.randn(5, 8).half()
    out = torch.empty(3, 5)
    with pytest.warns(RuntimeWarning, match="fp32 logits"):
        chunks._logits_fp32_into(h, w, None, _FakeOut(out))
    assert calls == [torch.float16] and torch.equal(out, real_mm(h, w.t()).float())
    assert not sizing.fp32_logits(torch.bfloat16, 3.0)
    assert sizing.chunk_bytes_per_logit(torch.bfloat16, 3.0, True) == 2
    assert chunks._ChunkBuffers(h, 3, 5, 3.0, True).logits.dtype == torch.float16


def test_vocab_shards_merge(interpret):
    """Stats over vocabulary shards (vocab_start) merged == full-vocabulary stats (TP hook)."""
    n, V = 6, 200
    x, t, _ = _row_inputs(2, n, V, 4, 0)
    full = torch.empty(n, 5)
    lce_rows._launch_rows(x, t, stats=full, need_ent=True, smoothing=0.2)
    bounds = [0, 70, 71, 200]  # ragged shards, one of one column
    parts = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        st = torch.empty(n, 5)
        lce_rows._launch_rows(x[:, lo:hi].contiguous(), t, stats=st, need_ent=True, smoothing=0.2,
                                 vocab_start=lo, vocab_total=V)
        parts.append(st)
    merged = merge_partial_stats(torch.stack(parts))
    a = lce_stats._finalize_stats(full, t != -100, V, 0.01, 0.2, True)
    b = lce_stats._finalize_stats(merged, t != -100, V, 0.01, 0.2, True)
    for u, v in zip(a, b):
        assert torch.allclose(u, v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", [{}, dict(reduction="none", return_entropy=True)])
def test_bitwise_repeatable(interpret, kw):
    h, w, t, b = _inputs(21, 16, 90, torch.float32, interpret, bias=True)
    a = weighted_backward(linear_cross_entropy, h, w, t, b, chunk_tokens=8, **kw)
    c = weighted_backward(linear_cross_entropy, h, w, t, b, chunk_tokens=8, **kw)
    for x, y in zip(a[0] + a[1], c[0] + c[1]):
        assert torch.equal(x, y)


def test_grad_modes(interpret):
    h, w, t, _ = _inputs(10, 16, 37, torch.float32, interpret)
    ref = linear_cross_entropy_reference(h.double(), w.double(), t)
    with torch.no_grad():
        assert abs(linear_cross_entropy(h, w, t).item() - ref.item()) < 1e-5 * abs(ref.item())
    hh = h.clone().requires_grad_()  # frozen head: only dhidden
    linear_cross_entropy(hh, w, t).backward()
    hr = h.double().requires_grad_()
    linear_cross_entropy_reference(hr, w.double(), t).backward()
    assert rel(hh.grad.double(), hr.grad) < 1e-4
    # the scalar path consumes its precomputed gradients: a second backward fails loudly
    ww = w.clone().requires_grad_()
    loss = linear_cross_entropy(h, ww, t)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError):
        loss.backward()


def test_torch_compile(interpret):
    h, w, t, _ = _inputs(11, 16, 37, torch.float32, interpret)

    def f(h, w, t):
        loss, ent = linear_cross_entropy(h, w, t, reduction="none", return_entropy=True, validate_targets=False)
        return loss.sum() + 0.5 * ent.sum() + linear_cross_entropy(h, w, t, validate_targets=False)

    res = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        out = fn(hh, ww, t)
        out.backward()
        res.append((out, hh.grad, ww.grad))
    for a, b in zip(*res):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def test_cpu_fallback_warns_once(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # plain CPU tensors: the reference runs
    _common.reset_fallback_warnings()
    h, w, t, _ = _inputs(8, 8, 20, torch.float32, "cpu")
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        a = linear_cross_entropy(h, w, t)
        linear_cross_entropy(h, w, t)
    msgs = [str(r.message) for r in rec if issubclass(r.category, RuntimeWarning)]
    assert len(msgs) == 1 and "linear_cross_entropy" in msgs[0]
    assert torch.equal(a, linear_cross_entropy_reference(h, w, t))
    compiled = torch.compile(lambda h, w, t: linear_cross_entropy(h, w, t, validate_targets=False), backend="eager")
    assert torch.allclose(compiled(h, w, t), a)
    _common.reset_fallback_warnings()


def test_float64_runs_reference(interpret):
    _common.reset_fallback_warnings()
    h, w, t, _ = _inputs(8, 8, 20, torch.float64, interpret)
    with pytest.warns(RuntimeWarning, match="dtype"):
        out = linear_cross_entropy(h, w, t)
    assert out.dtype == torch.float64 and torch.equal(out, linear_cross_entropy_reference(h, w, t))
    _common.reset_fallback_warnings()


def test_validation_errors(monkeypatch):
    h, w, t, _ = _inputs(6, 8, 20, torch.float32, "cpu")
    f = linear_cross_entropy
    cases = [
        (TypeError, "hidden", lambda: f(h.long(), w, t)),
        (ValueError, "weight", lambda: f(h, w[:, :4], t)),
        (ValueError, "weight", lambda: f(h, w[0], t)),
        (TypeError, "weight", lambda: f(h, w.double(), t)),
        (TypeError, "target", lambda: f(h, w, t.float())),
        (ValueError, "target", lambda: f(h, w, t[:3])),
        (ValueError, "bias", lambda: f(h, w, t, bias=torch.zeros(19))),
        (TypeError, "bias", lambda: f(h, w, t, bias=torch.zeros(20, dtype=torch.float64))),
        (ValueError, "reduction", lambda: f(h, w, t, reduction="avg")),
        (ValueError, "temperature", lambda: f(h, w, t, temperature=0.0)),
        (ValueError, "temperature", lambda: f(h, w, t, temperature=torch.ones(5))),
        (ValueError, "temperature", lambda: f(h, w, t, temperature=torch.tensor([1.0, 1, 1, -1, 1, 1]))),
        (ValueError, "z_loss", lambda: f(h, w, t, z_loss=-1.0)),
        (ValueError, "label_smoothing", lambda: f(h, w, t, label_smoothing=1.0)),
        (ValueError, "softcap", lambda: f(h, w, t, softcap=0.0)),
        (ValueError, "accum_dtype", lambda: f(h, w, t, accum_dtype=torch.float16)),
        (ValueError, "chunk_tokens", lambda: f(h, w, t, chunk_tokens=0)),
        (TypeError, "ignore_index", lambda: f(h, w, t, ignore_index=1.5)),
        (ValueError, "target", lambda: f(h, w, torch.tensor([0, 1, 2, 20, 1, -100]))),
        (ValueError, "target", lambda: f(h, w, torch.tensor([0, 1, 2, -5, 1, -100]))),
    ]
    for exc, name, call in cases:
        with pytest.raises(exc, match=name):
            call()
    # out-of-range targets pass unchecked with validate_targets=False (no host sync) without crashing
    f(h, w, torch.tensor([0, 1, 2, 3, 1, -100]), validate_targets=False)
    # tp_group of size 1 behaves as single GPU; vocab_start needs a group (tests/unit/test_linear_cross_entropy_tp.py
    # covers real groups)
    import torch.distributed as dist

    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1)
    assert torch.equal(f(h, w, t, tp_group=object()), f(h, w, t))
    with pytest.raises(ValueError, match="vocab_start"):
        f(h, w, t, tp_group=object(), vocab_start=3)
    with pytest.raises(ValueError, match="vocab_start"):
        f(h, w, t, vocab_start=0)


@pytest.mark.parametrize("per_token", [False, True])
def test_target_check_read_after_the_kernels_are_queued(interpret, monkeypatch, per_token):
    # the check's reduction is started before the kernels and read after them (on CUDA through
    # pinned memory and an event): a bad target still raises ValueError naming it, and nothing
    # else is left behind; invalid targets are never read out of bounds by the kernels
    from deepspeed_fused.ops.linear_cross_entropy import checks, chunks, single

    order = []
    finish = checks._ValueCheck.finish
    monkeypatch.setattr(checks._ValueCheck, "finish", lambda self: (order.append("check"), finish(self))[1])
    launch, fused = single._launch_rows, chunks.gemm_stats
    for mod in (single, chunks):  # the row kernel's launches, from both
        monkeypatch.setattr(mod, "_launch_rows", lambda *a, **k: (order.append("kernel"), launch(*a, **k))[1])
    monkeypatch.setattr(chunks, "gemm_stats", lambda *a, **k: (order.append("kernel"), fused(*a, **k))[1])
    h, w, t, _ = _inputs(6, 8, 20, torch.float32, interpret)
    h.requires_grad_(not per_token)
    bad = torch.tensor([0, 1, 2, 20, 1, -100], device=interpret)
    with pytest.raises(ValueError, match=r"target.*\[0, 20\)"):
        linear_cross_entropy(h, w, bad, reduction="none" if per_token else "mean")
    assert "kernel" in order and order[-1] == "check" and order.index("check") > order.index("kernel")
    order.clear()
    out = linear_cross_entropy(h, w, t, reduction="none" if per_token else "mean")
    assert order[-1] == "check" and torch.isfinite(out).all()
    # float64 runs the reference, which computes eagerly: the check is read before it
    order.clear()
    _common.reset_fallback_warnings()
    with pytest.warns(RuntimeWarning), pytest.raises(ValueError, match="target"):
        linear_cross_entropy(h.double(), w.double(), bad)
    assert order == ["check"]
    _common.reset_fallback_warnings()


@pytest.mark.parametrize("fused_fwd", [False, True])
@pytest.mark.parametrize("case", ["all_options", "fp16_softcap", "fp16_accum_fp32", "target_at_chunk_edges"])
def test_vocab_chunks(interpret, monkeypatch, case, fused_fwd):
    """The per-token path splits the vocabulary when the automatic chunk would split fewer tokens
    than there are vocabulary rows: partial statistics per chunk, merged; dweight rows per chunk,
    dhidden summed over chunks. A small workspace budget forces it here (13 tokens, V=300: three
    vocabulary chunks, 112 + 112 + 76, each ragged kernel blocks of 64 under the interpreter)."""
    from deepspeed_fused.ops.linear_cross_entropy import chunks as lce_chunks, single as lce_single
    from deepspeed_fused.ops.linear_cross_entropy import sizing as lce_sizing

    seen = []
    real = lce_chunks._vocab_chunks

    def spy(hidden, weight, bias, vchunk, softcap, grad):
        for v0, v1, x, g in real(hidden, weight, bias, vchunk, softcap, grad):
            seen.append((v0, v1))
            yield v0, v1, x, g

    monkeypatch.setattr(lce_single, "_vocab_chunks", spy)  # the forward's
    monkeypatch.setattr(lce_chunks, "_vocab_chunks", spy)  # the backward's
    fused, real_grad = [], lce_chunks.gemm_grad

    def grad_spy(hidden, weight, *a, vocab_start=0, **k):
        fused.append((vocab_start, vocab_start + weight.shape[0]))
        return real_grad(hidden, weight, *a, vocab_start=vocab_start, **k)

    monkeypatch.setattr(lce_chunks, "gemm_grad", grad_spy)
    # the fused GEMMs (forward statistics, backward gradients), or cuBLAS and the row kernel
    monkeypatch.setattr(lce_gemm, "_GEMM_STATS_OK", [fused_fwd])
    monkeypatch.setattr(lce_gemm, "_GEMM_GRAD_OK", [fused_fwd])
    M, V = 13, 300
    temp = (torch.rand(M, generator=torch.Generator().manual_seed(3)) + 0.5).to(interpret)
    if case == "all_options":
        monkeypatch.setattr(lce_sizing, "DEFAULT_WORKSPACE_BYTES", 5 * V * 4)
        _compare(torch.float32, interpret, M=M, H=24, V=V, bias=True, reduction="none", return_entropy=True,
                 return_lse=True, temperature=temp, softcap=2.0, z_loss=0.05, label_smoothing=0.1)
    elif case == "fp16_softcap":  # fp32 logits (4 bytes) and an fp16 dlogits buffer (2) per element
        monkeypatch.setattr(lce_sizing, "DEFAULT_WORKSPACE_BYTES", 5 * V * 2 * 6 // 2)
        _compare(torch.float16, interpret, M=M, H=24, V=V, bias=True, reduction="none", return_lse=True,
                 softcap=3.0)
    elif case == "fp16_accum_fp32":  # dhidden summed over the chunks in fp32
        monkeypatch.setattr(lce_sizing, "DEFAULT_WORKSPACE_BYTES", 5 * V * 2)
        _compare(torch.float16, interpret, M=M, H=24, V=V, reduction="none", return_entropy=True,
                 accum_dtype=torch.float32)
    else:  # every target on the first or last row of a chunk, none ignored
        monkeypatch.setattr(lce_sizing, "DEFAULT_WORKSPACE_BYTES", 5 * V * 4)
        h, w, _, b = _inputs(M, 24, V, torch.float32, interpret, bias=True)
        t = torch.tensor([0, 111, 112, 223, 224, 299, 0, 111, 112, 223, 224, 299, 150], device=interpret)
        out, grads = weighted_backward(linear_cross_entropy, h, w, t, b, reduction="none", label_smoothing=0.2,
                                       return_lse=True)
        rout, rgrads = weighted_backward(linear_cross_entropy_reference, h, w, t, b, dtype=torch.float64,
                                         reduction="none", label_smoothing=0.2, return_lse=True)
        for o, r in zip(out + grads, rout + rgrads, strict=True):
            assert rel(o, r) <= 1e-5
    # without the fused GEMM the forward and the backward went over the three chunks through
    # cuBLAS and the row kernel; with it, the backward's three chunks went through the fused GEMM
    assert seen == ([] if fused_fwd else [(0, 112), (112, 224), (224, 300)] * 2), seen
    assert fused == ([(0, 112), (112, 224), (224, 300)] if fused_fwd else []), fused
    if case == "all_options":
        assert lce_sizing._vocab_chunk(None, 5, V, torch.float32, M, 0.0, True) == 112
    assert lce_sizing._vocab_chunk(7, 7, V, torch.float32, M, 0.0, True) == 0  # chunk_tokens given: tokens
    assert lce_sizing._vocab_chunk(None, 5, 12, torch.float32, M, 0.0, True) == 0  # more tokens than V rows


@pytest.mark.parametrize("subtile", [1, 2])
@pytest.mark.parametrize("opts", ["plain", "all", "fp16_rounded", "fp16_softcap"])
def test_fused_gemm_statistics(interpret, monkeypatch, opts, subtile):
    """The fused GEMM's row statistics (after the merge over its vocabulary tiles) against the same
    statistics of float64 logits formed as the cuBLAS path forms them (fp16: rounded to fp16 first,
    unless the soft cap makes them fp32): ragged edges in every dimension (M=37 over tiles of 16
    rows, V=150 over 64 columns, H=24 over 16), every workspace poisoned with NaN first, the
    epilogue whole or in two column halves (then also in token chunks of 16 rows: the partials'
    memory bound)."""
    if interpret == "cuda":
        pytest.skip("the interpreter's tile sizes")
    from deepspeed_fused.ops.linear_cross_entropy import launch as kernels, sizing

    cfg = kernels._GEMM_STATS_CFG_INTERP
    monkeypatch.setattr(kernels, "_GEMM_STATS_CFG_INTERP", cfg[:-1] + (subtile,))
    if subtile == 2:  # token chunks of 16 rows for the partials (3 tiles x 16 rows x 4 fields)
        monkeypatch.setattr(kernels, "_GEMM_STATS_PART_BYTES", 3 * 16 * 4 * (4 if opts == "all" else 2))
    M, H, V = 37, 24, 150
    dt = torch.float16 if opts.startswith("fp16") else torch.float32
    # fp16_rounded: no bias (with a bias the epilogue keeps fp32 logits, as fp16_softcap tests)
    h, w, t, b = _inputs(M, H, V, dt, interpret, bias=opts not in ("plain", "fp16_rounded"))
    BN = cfg[1]
    # a target in the last, ragged tile, and on every tile and half-tile edge: exactly one tile
    # (and one half) must hold each (a wrong range check writes the target logit twice or never)
    t[3:11] = torch.tensor([149, BN - 1, BN, BN + BN // 2 - 1, BN + BN // 2, 2 * BN - 1, 2 * BN, 0])
    ignore = -100
    if opts == "plain":  # a positive ignore_index, itself a vocabulary column: its rows match no column
        ignore = 5
        t[11:14] = 5
    temp = (torch.rand(M, generator=torch.Generator().manual_seed(2)) + 0.5) if opts == "all" else None
    cap = {"all": 2.5, "fp16_softcap": 3.0}.get(opts, 0.0)
    full = opts == "all"
    real_empty = torch.empty
    monkeypatch.setattr(kernels.torch, "empty", lambda *a, **k: real_empty(*a, **k).fill_(float("nan")))
    stats = kernels.gemm_stats(h, w, b, t, temp=temp, softcap=cap, need_ent=full, need_sumz=full,
                               fp32_logits=sizing.fp32_logits(dt, cap), ignore_index=ignore)
    monkeypatch.setattr(kernels.torch, "empty", real_empty)
    assert stats is not None and stats.shape == (M, 5) and torch.isfinite(stats).all()
    z = h.double() @ w.double().t() + (0 if b is None else b.double())
    if opts == "fp16_rounded":
        z = z.half().double()
    if temp is not None:
        z = z / temp.double()[:, None]
    if cap:
        z = cap * torch.tanh(z / cap)
    m, d, a, sz, zt = stats.double().unbind(-1)
    assert torch.allclose(m + d.log(), torch.logsumexp(z, 1), rtol=1e-5, atol=1e-5)
    valid = (t != ignore) & (t >= 0)
    assert valid.sum() < M - 4  # ignored rows (every 7th, or ignore_index 5) are in the check
    assert torch.allclose(zt, torch.where(valid, z.gather(1, t.clamp(min=0)[:, None]).squeeze(1), 0.0), atol=1e-5)
    if full:
        p = torch.softmax(z, 1)
        assert torch.allclose(d.log() - a / d, -(p * p.log()).sum(1), rtol=1e-5, atol=1e-5)  # entropy
        assert torch.allclose(sz, z.sum(1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("case", ["strided_bias", "target_past_vocab"])
def test_fused_gemm_agrees_with_row_kernel(interpret, monkeypatch, case):
    """Inputs the cuBLAS path takes as they are: a bias that is a strided view, and (without the
    target check) a target past the vocabulary, whose logit counts as 0 in both paths; forward
    outputs and gradients, with the fused GEMMs and without."""
    if interpret == "cuda":
        pytest.skip("CPU")
    from deepspeed_fused.ops.linear_cross_entropy import chunks, launch as kernels

    h, w, t, b = _inputs(13, 16, 150, torch.float32, interpret, bias=True)
    kw = dict(reduction="none", return_lse=True, return_entropy=True)
    if case == "strided_bias":
        b = torch.randn(300, generator=torch.Generator().manual_seed(4))[::2]
    else:
        t[2] = 150 + 3  # in the last tile's padding
        kw.update(validate_targets=False)
    calls, real_grad = [], chunks.gemm_grad
    monkeypatch.setattr(chunks, "gemm_grad", lambda *a, **k: (calls.append(1), real_grad(*a, **k))[1])

    def run(fused):
        monkeypatch.setattr(kernels, "_GEMM_STATS_OK", [fused])
        monkeypatch.setattr(kernels, "_GEMM_GRAD_OK", [fused])
        leaves = [x.clone().requires_grad_() for x in (h, w, b if case != "strided_bias" else b._base)]
        bias = leaves[2][::2] if case == "strided_bias" else leaves[2]  # a strided view, also in backward
        outs = linear_cross_entropy(leaves[0], leaves[1], t, bias=bias, **kw)
        sum((o * torch.linspace(0.5, 1.5, o.numel()) * (i + 1)).sum() for i, o in enumerate(outs)).backward()
        if fused:
            assert kernels._GEMM_STATS_OK[0] and kernels._GEMM_GRAD_OK[0] and calls  # both fused GEMMs ran
        return [o.detach() for o in outs] + [x.grad for x in leaves]

    for a, r in zip(run(True), run(False), strict=True):
        assert torch.isfinite(a).all() and torch.allclose(a, r, rtol=1e-5, atol=1e-5), (a, r)


@pytest.mark.parametrize("store", ["tma", "pointer"])
@pytest.mark.parametrize("subtile", [1, 2])
@pytest.mark.parametrize("opts", ["plain", "all", "fp16_rounded", "fp16_softcap"])
def test_fused_gemm_gradient(interpret, monkeypatch, opts, subtile, store):
    """The backward's fused GEMM (dlogits in its epilogue) against cuBLAS's logits and the row
    kernel's per-token gradient pass on a vocabulary slice (columns 64..214 of 300: the target
    offsets and ragged edges), the output poisoned with NaN first so every element is written.
    ``store``: the tiles stored through a TMA descriptor of the output (rows padded to 16 bytes, as
    the op allocates them) or through pointers (packed rows, which TMA cannot take)."""
    if interpret == "cuda":
        pytest.skip("the interpreter's tile sizes")
    if store == "pointer" and subtile == 1:
        pytest.skip("pointer stores always take the column halves")
    from deepspeed_fused.ops.linear_cross_entropy import chunks, launch as kernels, launch as row_kernel, sizing

    cfg = kernels._GEMM_STATS_CFG_INTERP
    monkeypatch.setattr(kernels, "_GEMM_STATS_CFG_INTERP", cfg[:-1] + (subtile,))
    M, H, V, v0, v1 = 37, 24, 300, 64, 214
    dt = torch.float16 if opts.startswith("fp16") else torch.float32
    h, w, t, b = _inputs(M, H, V, dt, interpret, bias=opts != "plain")
    BN = cfg[1]
    # first and last column of the slice, just outside it, and on the slice's tile and half-tile edges
    t[:9] = torch.tensor([64, 213, 63, 214, v0 + BN - 1, v0 + BN, v0 + BN // 2 - 1, v0 + BN // 2, v0 + 2 * BN])
    if opts == "plain":  # a positive ignore_index inside the slice: those rows get no target term
        kw_ignore = dict(ignore_index=100)
        t[9:12] = 100
    else:
        kw_ignore = {}
    gen = torch.Generator().manual_seed(5)
    lse = torch.randn(M, generator=gen) + 5
    ent = torch.rand(M, generator=gen) + 1
    gl, ge, gs = (torch.randn(M, generator=gen) for _ in range(3))
    kw = {}
    if opts == "all":
        kw = dict(temp=torch.rand(M, generator=gen) + 0.5, softcap=2.5, z_loss=0.01, smoothing=0.1)
    elif opts == "fp16_softcap":
        kw = dict(softcap=3.0, inv_temp=1.25)
    elif opts == "fp16_rounded":  # fp16 logits: rounded in the epilogue as cuBLAS rounds them
        kw = dict(temp=torch.rand(M, generator=gen) + 0.5)
    grads = dict(lse=lse, g_loss=gl) if opts == "plain" else dict(lse=lse, ent=ent, g_loss=gl, g_ent=ge, g_lse=gs)
    f32 = sizing.fp32_logits(dt, kw.get("softcap", 0.0)) or b is not None  # a bias: fp32 logits in the epilogue
    ld = v1 - v0 + (10 if store == "tma" else 0)  # 160 columns: 16-byte rows in fp16 and fp32
    out = torch.full((M, ld), float("nan"), dtype=dt)[:, :v1 - v0]
    wb = None if b is None else b[v0:v1]
    made, real = [], kernels._TensorDescriptor

    class Spy(real):  # records the blocks of descriptors made directly: the output's (from_tensor makes the operands')
        def __init__(self, base, shape, strides, block_shape, *a, **k):
            made.append(list(block_shape))
            super().__init__(base, shape, strides, block_shape, *a, **k)

    monkeypatch.setattr(kernels, "_TensorDescriptor", Spy)
    assert kernels.gemm_grad(h, w[v0:v1], wb, t, out, vocab_start=v0, vocab_total=V, fp32_logits=f32, **grads, **kw,
                             **kw_ignore)
    assert out._base[:, v1 - v0:].isnan().all()  # the padding is not written (TMA clips at the slice)
    BM, BN = cfg[:2]
    assert made == ([[BM, BN // subtile]] if store == "tma" else []), made
    x = torch.empty(M, v1 - v0, dtype=torch.float32 if f32 else dt)
    chunks._logits_into(h, w[v0:v1], wb, x)
    want = torch.empty(M, v1 - v0, dtype=dt)
    row_kernel._launch_rows(x, t, out=want, vocab_start=v0, vocab_total=V, per_token=True, **grads, **kw, **kw_ignore)
    assert torch.isfinite(out).all()
    rtol, atol = (1e-5, 1e-5) if dt == torch.float32 else (1e-3, 1e-6)  # fp16: the same rounded logits
    assert torch.allclose(out.float(), want.float(), rtol=rtol, atol=atol), (out.float() - want.float()).abs().max()


def test_fused_gemm_failure_falls_back(interpret, monkeypatch):
    """A fused GEMM that fails to compile or launch: one warning, later calls skip it, and the
    per-token forward runs cuBLAS and the row kernel with the same results."""
    if interpret == "cuda":
        pytest.skip("CPU: a stand-in kernel that raises")
    from deepspeed_fused.ops.linear_cross_entropy import launch as kernels

    h, w, t, _ = _inputs(13, 16, 37, torch.float32, interpret)
    want = linear_cross_entropy(h, w, t, reduction="none", return_lse=True, return_entropy=True)

    class _Broken:
        def __getitem__(self, grid):
            def launch(*a, **k):
                raise RuntimeError("no TMA here")
            return launch

    real_stats_kernel = kernels._lce_gemm_stats_kernel
    monkeypatch.setattr(kernels, "_GEMM_STATS_OK", [True])
    monkeypatch.setattr(kernels, "_lce_gemm_stats_kernel", _Broken())
    with pytest.warns(RuntimeWarning, match="fused logits GEMM failed"):
        got = linear_cross_entropy(h, w, t, reduction="none", return_lse=True, return_entropy=True)
    # the backward's fused GEMM failing after the forward's ran: its chunks redone by cuBLAS and
    # the row kernel (vocabulary chunks forced), the gradients as without it
    from deepspeed_fused.ops.linear_cross_entropy import sizing as lce_sizing

    monkeypatch.setattr(lce_sizing, "DEFAULT_WORKSPACE_BYTES", 5 * 37 * 4)
    monkeypatch.setattr(kernels, "_GEMM_STATS_OK", [False])
    monkeypatch.setattr(kernels, "_GEMM_GRAD_OK", [False])
    hw = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    linear_cross_entropy(*hw, t, reduction="none", return_entropy=True)[1].sum().backward()
    want_grads = [x.grad for x in hw]
    monkeypatch.setattr(kernels, "_lce_gemm_stats_kernel", real_stats_kernel)
    monkeypatch.setattr(kernels, "_GEMM_STATS_OK", [True])
    monkeypatch.setattr(kernels, "_GEMM_GRAD_OK", [True])
    calls = []
    real_grad_kernel = kernels._lce_gemm_grad_kernel

    class _BreaksSecond:
        def __getitem__(self, grid):
            def launch(*a, **k):
                calls.append(1)
                if len(calls) == 2:
                    raise RuntimeError("second chunk fails")
                return real_grad_kernel[grid](*a, **k)
            return launch

    monkeypatch.setattr(kernels, "_lce_gemm_grad_kernel", _BreaksSecond())
    hw = [h.clone().requires_grad_(), w.clone().requires_grad_()]
    out = linear_cross_entropy(*hw, t, reduction="none", return_entropy=True)
    assert kernels._GEMM_STATS_OK[0]  # the forward's fused GEMM ran
    with pytest.warns(RuntimeWarning, match=r"fused logits GEMM \(gradient\) failed"):
        out[1].sum().backward()
    assert len(calls) == 2 and not kernels._GEMM_GRAD_OK[0] and kernels._GEMM_STATS_OK[0]  # its own flag
    for x, r in zip(hw, want_grads):
        assert torch.allclose(x.grad, r, rtol=1e-5, atol=1e-6)
    monkeypatch.setattr(kernels, "_lce_gemm_stats_kernel", _Broken())
    monkeypatch.setattr(kernels, "_GEMM_STATS_OK", [False])
    assert not kernels._GEMM_STATS_OK[0] and not kernels.gemm_stats_supported(h, w)
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6)
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        linear_cross_entropy(h, w, t, reduction="none")
    assert not [r for r in rec if "fused logits GEMM" in str(r.message)]  # no second warning
    assert not kernels.gemm_stats_supported(torch.randn(4, 12), torch.randn(5, 12))  # H % 8


def test_auto_chunk_bounds_workspace():
    MiB = 1 << 20
    for V in (128256, 131072, 151936, 202048):
        for dt in (torch.bfloat16, torch.float32):
            for M in (1 << 20, 8192, 16384, 5000):
                c = auto_chunk_tokens(V, dt, M)
                n = -(-M // c)
                assert c * V * (2 if dt == torch.bfloat16 else 4) <= 480 * MiB
                assert n == -(-M // (480 * MiB // (V * dt.itemsize)))  # the fewest chunks
                assert M - (n - 1) * c > c - 128 * n  # balanced: no small ragged last chunk
    assert auto_chunk_tokens(131072, torch.bfloat16, 1 << 20) == 1920
    assert auto_chunk_tokens(131072, torch.bfloat16, 4096) == 1408  # 3 balanced chunks, not 1920+1920+256
    assert auto_chunk_tokens(131072, torch.bfloat16, 1920) == 1920
    assert auto_chunk_tokens(151936, torch.bfloat16, 8192) == 1648  # 5 chunks of 1648, not 6 of 1408
    assert auto_chunk_tokens(257, torch.float32, 100) == 100
    assert auto_chunk_tokens(257, torch.float32, 100, 257 * 4 * 30) == 25  # 4 chunks of 25 (not 16-aligned)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("g", [1.0, 1 / 3, 2.0, 0.99999994, float("inf"), float("nan")])
def test_upstream_gradient_scaling_matches_mul(interpret, dtype, g):
    """The eager scalar loss scales its forward-formed gradients with a kernel that skips the work
    when the upstream gradient is 1 (read on the device): the product in fp32, one rounding. Rows
    whose target is ignored (dhidden's) are left as they are, and so is all of a tensor whose gate
    is False (dweight with no labelled token); the torch form (create_graph, torch.compile) agrees."""
    x = torch.randn(37, 29, generator=torch.Generator().manual_seed(1)).to(dtype).to(interpret)
    gt = torch.tensor(g, dtype=torch.float32, device=interpret)
    scaled = (x.float() * gt).to(dtype)
    ours = lce_scale._scale_unless_one_(x.clone(), gt)
    assert torch.equal(ours, scaled) or (g != g and ours.isnan().all())
    t = torch.randint(0, 5, (37,), generator=torch.Generator().manual_seed(2)).to(interpret)
    t[::3] = -100
    want = torch.where((t != -100)[:, None], scaled, x)
    for fn in (lce_scale._scale_unless_one_, lce_scale._scale_masked_torch_):
        rows = fn(x.clone(), gt, target=t, ignore_index=-100)
        assert torch.equal(rows[::3], x[::3])  # ignored rows untouched, bitwise
        assert torch.equal(rows.nan_to_num(), want.nan_to_num()) and torch.equal(rows.isnan(), want.isnan())
        for on in (True, False):
            gated = fn(x.clone(), gt, gate=torch.tensor(on, device=interpret))
            expect = scaled if on else x
            assert torch.equal(gated.nan_to_num(), expect.nan_to_num()) and torch.equal(gated.isnan(), expect.isnan())


def test_scalar_loss_gradient_scaled_by_upstream(interpret):
    """loss.backward() (g = 1) and (3 * loss).backward() through the eager scalar path: gradients
    exactly g times apart where g is a power of two, close otherwise."""
    g = torch.Generator().manual_seed(2)
    h = torch.randn(12, 16, generator=g).to(interpret)
    w = (0.1 * torch.randn(50, 16, generator=g)).to(interpret)
    t = torch.randint(0, 50, (12,), generator=g).to(interpret)
    grads = []
    for scale in (1.0, 4.0, 3.0):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        (scale * linear_cross_entropy(hh, ww, t)).backward()
        grads.append((hh.grad, ww.grad))
    assert torch.equal(grads[1][0], 4 * grads[0][0]) and torch.equal(grads[1][1], 4 * grads[0][1])
    torch.testing.assert_close(grads[2][0], 3 * grads[0][0], rtol=1e-6, atol=0)


# ---------------------------------------------------------------------------------------------
# A fully masked accumulated batch (HF's summed loss / num_items_in_batch = 0), and
# out-of-range targets without the target check.

_MASK_OPTS = {"plain": {}, "all": dict(temperature="tensor", softcap=2.0, z_loss=0.05, label_smoothing=0.1)}


def _masked_call(fn, h, w, t, b, reduction, opts, extra=()):
    leaves = [x.detach().clone().requires_grad_() for x in (h, w, b)]
    kw = dict(opts)
    if kw.get("temperature") == "tensor":
        kw["temperature"] = (torch.rand(t.shape[0], generator=torch.Generator().manual_seed(3)) + 0.5).to(h.device)
    out = fn(leaves[0], leaves[1], t, bias=leaves[2], reduction=reduction, return_entropy="entropy" in extra,
             return_lse="lse" in extra, **kw)
    return leaves, (out if isinstance(out, tuple) else (out,))


def test_fully_masked_batch_like_eager(interpret):
    """What eager PyTorch does, the contract below: cross_entropy(reduction="sum") over no labelled
    token is 0; divided by 0 items, NaN; its backward (an infinite upstream gradient) gives every
    gradient exactly 0 (the ignored rows' gradient is written as 0, not multiplied)."""
    h, w, t, b = _inputs(9, 16, 37, torch.float32, interpret, bias=True)
    t = torch.full_like(t, -100)
    for red, ls in (("sum", 0.0), ("sum", 0.2), ("none", 0.0)):
        leaves = [x.clone().requires_grad_() for x in (h, w, b)]
        loss = F.cross_entropy(leaves[0] @ leaves[1].t() + leaves[2], t, reduction=red, label_smoothing=ls)
        loss = loss.sum() / torch.tensor(0)
        loss.backward()
        assert torch.isnan(loss) and all(torch.equal(x.grad, torch.zeros_like(x)) for x in leaves)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("opts", list(_MASK_OPTS))
def test_fully_masked_batch_divided_by_zero_items(interpret, impl, reduction, opts):
    """The op's loss over no labelled token divided by num_items_in_batch = 0 (an infinite upstream
    gradient), or times NaN: a NaN loss and every gradient exactly 0, on the scalar path (mean/sum:
    forward-formed gradients scaled in backward), the per-token path (none), and the reference,
    with temperature, soft cap, z-loss and label smoothing too."""
    fn = linear_cross_entropy if impl == "kernel" else linear_cross_entropy_reference
    h, w, t, b = _inputs(9, 16, 37, torch.float32, interpret, bias=True)
    t = torch.full_like(t, -100)
    for upstream in ("zero_items", "nan"):
        leaves, (loss,) = _masked_call(fn, h, w, t, b, reduction, _MASK_OPTS[opts])
        loss = loss.sum()
        assert loss == 0
        loss = loss / torch.tensor(0) if upstream == "zero_items" else loss * float("nan")
        assert torch.isnan(loss)
        loss.backward()
        for x in leaves:
            assert torch.equal(x.grad, torch.zeros_like(x)), (upstream, x.grad)


@pytest.mark.parametrize("impl", ["kernel", "reference"])
def test_masked_rows_zero_whatever_the_upstream_gradient(interpret, impl):
    """Only ignored rows are exactly zero: with some labelled tokens an infinite scalar upstream
    gradient gives non-finite gradients, as in eager, except dhidden's ignored rows (0, as eager);
    the per-token path takes a NaN upstream gradient on ignored rows as 0 (bitwise the gradients of
    a 0 there); the loss contributes nothing next to entropy / lse outputs on an all-ignored batch."""
    fn = linear_cross_entropy if impl == "kernel" else linear_cross_entropy_reference
    h, w, t, b = _inputs(9, 16, 37, torch.float32, interpret, bias=True, ignore_every=3)
    ign = t == -100
    for reduction in ("sum", "mean"):
        leaves, (loss,) = _masked_call(fn, h, w, t, b, reduction, {})
        (loss / torch.tensor(0)).backward()
        e = [x.clone().requires_grad_() for x in (h, w, b)]
        lg = F.cross_entropy(e[0] @ e[1].t() + e[2], t, reduction=reduction)
        (lg / torch.tensor(0)).backward()
        for ours, eager in ((leaves[0].grad, e[0].grad), (leaves[1].grad, e[1].grad), (leaves[2].grad, e[2].grad)):
            assert torch.equal(torch.isfinite(ours), torch.isfinite(eager)), (reduction, ours, eager)
        assert torch.equal(leaves[0].grad[ign], torch.zeros_like(leaves[0].grad[ign]))
        assert not torch.isfinite(leaves[0].grad[~ign]).any() and not torch.isfinite(leaves[1].grad).any()
    for opts in _MASK_OPTS.values():
        grads = []
        for g_ign in (float("nan"), float("inf"), 0.0):
            leaves, (loss, lse) = _masked_call(fn, h, w, t, b, "none", opts, extra=("lse",))
            g = torch.linspace(0.5, 1.5, 9, device=interpret)
            g[ign] = g_ign
            torch.autograd.backward([loss, lse], [g, torch.linspace(-1, 1, 9, device=interpret)])
            grads.append([x.grad for x in leaves])
        for a, c in zip(grads[0] + grads[1], grads[2] * 2, strict=True):
            assert torch.isfinite(a).all() and torch.equal(a, c)
    tm = torch.full_like(t, -100)
    for reduction in ("sum", "mean", "none"):
        for extra in (("entropy",), ("lse",), ("entropy", "lse")):
            leaves, outs = _masked_call(fn, h, w, tm, b, reduction, _MASK_OPTS["all"], extra)
            (outs[0].sum() / torch.tensor(0) + sum(o.sum() for o in outs[1:])).backward()
            with_loss = [x.grad for x in leaves]
            leaves, outs = _masked_call(fn, h, w, tm, b, reduction, _MASK_OPTS["all"], extra)
            sum(o.sum() for o in outs[1:]).backward()
            for a, c in zip(with_loss, [x.grad for x in leaves], strict=True):
                assert torch.isfinite(a).all() and torch.equal(a, c) and a.abs().sum() > 0


def test_fully_masked_scalar_loss_under_compile_and_create_graph(interpret):
    """The scalar path's torch-op scaling (what torch.compile traces, and create_graph): zero
    gradients for a masked batch divided by zero items, and gradients differentiable in g."""
    h, w, t, _ = _inputs(7, 16, 37, torch.float32, interpret)
    t = torch.full_like(t, -100)

    def f(h, w):
        return linear_cross_entropy(h, w, t, reduction="sum", validate_targets=False) / torch.tensor(0)

    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fn(hh, ww)
        loss.backward()
        assert torch.isnan(loss) and not hh.grad.any() and not ww.grad.any()
    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    g = torch.tensor(float("inf"), requires_grad=True)
    gh, gw = torch.autograd.grad(linear_cross_entropy(hh, ww, t, reduction="sum"), (hh, ww), g, create_graph=True)
    assert not gh.any() and not gw.any()


_OUT_OF_RANGE = {"past_vocab": (37, 40, 1000), "negative": (-1, -5, -101)}


@pytest.mark.parametrize("kind", list(_OUT_OF_RANGE))
@pytest.mark.parametrize("path", ["scalar", "per_token_fused", "per_token_rows", "vocab_chunks"])
def test_out_of_range_targets_unchecked_score_lse(interpret, monkeypatch, kind, path):
    """validate_targets=False, a target outside [0, V) other than ignore_index: no target logit on
    every path (the kernels' row pass, the fused GEMMs, vocabulary chunks, the reference): the
    token's loss is lse (with the smoothing and z-loss terms), its gradient that loss's, and it
    counts in the mean; the same as the float64 reference and the formula on materialized logits."""
    from deepspeed_fused.ops.linear_cross_entropy import chunks as lce_chunks, single as lce_single
    from deepspeed_fused.ops.linear_cross_entropy import sizing as lce_sizing

    seen, real = [], lce_chunks._vocab_chunks

    def spy(*a):
        for c in real(*a):
            seen.append(c[0])
            yield c

    monkeypatch.setattr(lce_single, "_vocab_chunks", spy)  # the forward's
    monkeypatch.setattr(lce_chunks, "_vocab_chunks", spy)  # the backward's
    M, V = 13, 37
    h, w, t, b = _inputs(M, 16, V, torch.float32, interpret, bias=True)
    t[[1, 6, 11]] = torch.tensor(_OUT_OF_RANGE[kind], device=interpret)
    fused = path == "per_token_fused"
    monkeypatch.setattr(lce_gemm, "_GEMM_STATS_OK", [fused])
    monkeypatch.setattr(lce_gemm, "_GEMM_GRAD_OK", [fused])
    if path == "vocab_chunks":  # three vocabulary slices (see test_vocab_chunks)
        monkeypatch.setattr(lce_sizing, "DEFAULT_WORKSPACE_BYTES", 5 * 16 * 4)
    opts = dict(temperature=0.8, softcap=3.0, z_loss=0.05, label_smoothing=0.1, validate_targets=False)
    reductions = ("mean", "sum") if path == "scalar" else ("none",)
    for reduction in reductions:
        extra = {} if path == "scalar" else dict(return_lse=True)
        out, grads = weighted_backward(linear_cross_entropy, h, w, t, b, reduction=reduction, **extra, **opts)
        rout, rgrads = weighted_backward(linear_cross_entropy_reference, h, w, t, b, dtype=torch.float64,
                                         reduction=reduction, **extra, **opts)
        for o, r in zip(out + grads, rout + rgrads, strict=True):
            assert torch.isfinite(o).all() and rel(o, r) <= 1e-4, (reduction, o, r)
    # the path taken: vocabulary slices through cuBLAS and the row kernel (several, or the one
    # slice of the one-chunk backward), or none at all (the fused GEMMs, the scalar path)
    assert {"scalar": [], "per_token_fused": [], "per_token_rows": [0]}.get(path, seen) == seen
    assert path != "vocab_chunks" or len(seen) > 2
    # the formula, on the reference's per-token losses
    z = (h.double() @ w.double().t() + b.double()) / 0.8
    z = 3.0 * torch.tanh(z / 3.0)
    lse = torch.logsumexp(z, -1)
    valid = t != -100
    inside = valid & (t >= 0) & (t < V)
    zt = torch.where(inside, z.gather(1, t.clamp(0, V - 1)[:, None]).squeeze(1), torch.zeros_like(lse))
    want = torch.where(valid, lse - 0.9 * zt - 0.1 * z.mean(-1) + 0.05 * lse ** 2, torch.zeros_like(lse))
    assert (valid & ~inside).sum() == 3
    got = linear_cross_entropy_reference(h.double(), w.double(), t, bias=b.double(), reduction="none", **opts)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=0)
    mean = linear_cross_entropy_reference(h.double(), w.double(), t, bias=b.double(), **opts)
    torch.testing.assert_close(mean, want.sum() / valid.sum(), rtol=1e-12, atol=0)
