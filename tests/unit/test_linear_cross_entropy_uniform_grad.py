"""``expect_uniform_grad=True``: per-token outputs with the gradients formed in the forward.

Against the per-token path (the same call without it) and a float64 reference: uniform upstream
gradients (a mean or a sum of the per-token losses, ignored rows, an all-ignored batch) use the
forward-formed gradients; per-token weights, an entropy or lse gradient and a non-finite upstream
gradient on a labelled row make the backward recompute (exact); a frozen head scales dhidden row by
row for any weights. Kernels under Triton's interpreter on CPU (fp32 / fp16), tiny shapes.
"""
import pytest
import torch

from deepspeed_fused.ops import _common
from deepspeed_fused.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from deepspeed_fused.ops.linear_cross_entropy import single as lce_single
from lce_testing import confident_inputs, rel

TOL = {torch.float32: (1e-5, 1e-4), torch.float16: (1e-3, 1e-2)}  # (outputs rel, grads rel-norm) vs float64
SAME = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-3, 1e-2)}  # vs the per-token path
EXTRAS = ("return_mean_logits", "return_is_top1", "return_log_sum_sq")


def _inputs(M, H, V, dtype, device, seed=0, ignore_every=4, bias=False, temp=False):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.3
    t = torch.randint(0, V, (M,), generator=g)
    if ignore_every:
        t[(1 if ignore_every > 1 else 0)::ignore_every] = -100  # 1: every row ignored
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    tt = torch.rand(M, generator=g) + 0.5 if temp else None
    cast = lambda x: None if x is None else x.to(device=device, dtype=dtype)  # noqa: E731
    return cast(h), cast(w), t.to(device), cast(b), None if tt is None else tt.to(device)


def _run(fn, h, w, t, b, upstream, *, dtype=None, ent_w=None, lse_w=None, needs=(True, True, True), retain=False,
         **kw):
    """Forward (reduction "none") and backward of ``upstream(loss)`` (+ <ent_w, entropy> + <lse_w, lse>);
    the outputs and the gradients of the leaves that need them (float64), and the graph's loss."""
    def leaf(x, need):
        return None if x is None else x.detach().to(dtype or x.dtype).clone().requires_grad_(need)

    leaves = [leaf(x, n) for x, n in zip((h, w, b), needs)]
    if dtype is not None:
        kw = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    out = fn(leaves[0], leaves[1], t, bias=leaves[2], reduction="none", **kw)
    outs = out if isinstance(out, tuple) else (out,)
    total = upstream(outs[0])
    i = 1
    if kw.get("return_entropy"):
        if ent_w is not None:
            total = total + (outs[1] * ent_w.to(outs[1])).sum()
        i += 1
    if kw.get("return_lse") and lse_w is not None:
        total = total + (outs[i] * lse_w.to(outs[i])).sum()
    total.backward(retain_graph=retain)
    grads = [x.grad.double() for x in leaves if x is not None and x.requires_grad]
    return [o.detach() for o in outs], grads, total


def _mean(t):
    n = (t != -100).sum().clamp(min=1)
    return lambda loss: loss.sum() / n


def _sum(loss):
    return loss.sum()


def _check(dtype, device, upstream, expect, *, M=13, H=16, V=37, bias=False, temp=False, ignore_every=4,
           ent_w=None, lse_w=None, needs=(True, True, True), **kw):
    """The mode against the per-token path and float64; ``expect``: what the callback must be told."""
    h, w, t, b, tt = _inputs(M, H, V, dtype, device, ignore_every=ignore_every, bias=bias, temp=temp)
    if tt is not None:
        kw["temperature"] = tt
    up = upstream(t) if upstream is _mean else upstream
    told = []
    ref_calls = _common.reference_calls()
    mine = _run(linear_cross_entropy, h, w, t, b, up, ent_w=ent_w, lse_w=lse_w, needs=needs,
                expect_uniform_grad=True, uniform_grad_callback=told.append, **kw)
    assert _common.reference_calls() == ref_calls  # the kernels ran
    assert told == [expect]
    base = _run(linear_cross_entropy, h, w, t, b, up, ent_w=ent_w, lse_w=lse_w, needs=needs, **kw)
    r64 = _run(linear_cross_entropy_reference, h, w, t, b, up, dtype=torch.float64, ent_w=ent_w, lse_w=lse_w,
               needs=needs, **kw)
    so, sg = SAME[dtype]
    to, tg = TOL[dtype]
    for o, p, r in zip(mine[0], base[0], r64[0], strict=True):
        assert o.dtype == p.dtype and o.shape == p.shape
        if o.dtype == torch.bool:
            assert torch.equal(o, p) and torch.equal(o, r)
            continue
        assert torch.isfinite(o).all()
        assert rel(o.double(), p.double()) <= so or (o - p).abs().max() <= so
        assert rel(o.double(), r) <= to or (o.double() - r).abs().max() <= to
    assert len(mine[1]) == len(base[1]) == len(r64[1]) == sum(n and x is not None for n, x in zip(needs, (h, w, b)))
    for g, p, r in zip(mine[1], base[1], r64[1], strict=True):
        assert torch.isfinite(g).all()
        if r.norm() == 0:
            assert torch.equal(g, p) and (g == 0).all()
            continue
        assert rel(g, p) <= sg, rel(g, p)
        assert rel(g, r) <= tg, rel(g, r)
    return mine, base


_OPTS = {
    "plain": {},
    "bias": dict(bias=True),
    "softcap_temperature": dict(softcap=3.0, temperature=0.7, bias=True),
    "token_temperature": dict(temp=True, softcap=2.0),
    "z_loss_smoothing": dict(z_loss=0.05, label_smoothing=0.1, bias=True),
    "extras": {k: True for k in EXTRAS},
    "chunks": dict(chunk_tokens=4, bias=True, return_is_top1=True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", ["mean", "sum"])
@pytest.mark.parametrize("opts", list(_OPTS))
def test_uniform_upstream_uses_the_formed_gradients(interpret, dtype, form, opts):
    kw = dict(_OPTS[opts])
    if dtype == torch.float16 and opts not in ("plain", "softcap_temperature", "extras"):
        pytest.skip("fp16: three option sets are enough")
    # fp16 and a sum: the formed dlogits (weighted 1 / n_valid) would have lost the probabilities that
    # fp16 keeps at weight 1, so the backward recomputes (see the fp16 test below)
    expect = form == "mean" or dtype != torch.float16
    _check(dtype, interpret, _mean if form == "mean" else _sum, expect, return_entropy=True, **kw)


@pytest.mark.parametrize("form", ["mean", "sum", "frozen_weighted"])
def test_fp16_formed_gradients_never_lose_what_the_per_token_path_keeps(interpret, form):
    """fp16: the formed dlogits are ``(p - y) / n_valid``; a probability below ``n_valid * 2**-25``
    rounds to zero there, while the per-token path's ``(p - y) * g`` keeps it for g = 1 (a sum). So
    the mode takes the formed gradients only where every factor g * n_valid is at most 1 (a mean
    here) and recomputes otherwise (a sum, per-token weights up to 1.5); against float64 it is then
    as accurate as the per-token path or eager's fp16 autograd. Inputs with small probabilities
    (orthogonal head rows, each target's logit ~12 above the rest)."""
    M = 64
    g = torch.Generator().manual_seed(11)
    h, w, t, b = confident_inputs(g, M)
    wts = torch.rand(M, generator=g) + 0.5
    n = int((t != -100).sum())
    up = {"mean": lambda x: x.sum() / n, "sum": lambda x: x.sum(),
          "frozen_weighted": lambda x: (x * wts.to(x)).sum()}[form]
    needs = (True, form != "frozen_weighted", True)
    cast = lambda x: x.half().to(interpret)  # noqa: E731
    h, w, b, t = cast(h), cast(w), cast(b), t.to(interpret)
    told = []
    mine = _run(linear_cross_entropy, h, w, t, b, up, needs=needs, expect_uniform_grad=True,
                uniform_grad_callback=told.append, chunk_tokens=16)
    assert told == [form == "mean"]
    base = _run(linear_cross_entropy, h, w, t, b, up, needs=needs, chunk_tokens=16)
    r64 = _run(linear_cross_entropy_reference, h, w, t, b, up, dtype=torch.float64, needs=needs)

    def eager_ce(hh, ww, tt, bias=None, reduction="none", **_):
        return torch.nn.functional.cross_entropy(torch.nn.functional.linear(hh, ww, bias).float(), tt,
                                                 ignore_index=-100, reduction=reduction)

    eager = _run(eager_ce, h, w, t, b, up, needs=needs)
    # the per-token path's fused GEMMs keep fp32 logits with a bias (more accurate than eager); the
    # mode forms its gradient from cuBLAS's rounded logits, as eager does: as accurate as eager
    for gm, gp, ge, gr in zip(mine[1], base[1], eager[1], r64[1], strict=True):
        assert torch.isfinite(gm).all()
        assert rel(gm, gr) <= max(1.05 * rel(gp, gr), 1.5 * rel(ge, gr)) + 1e-4, (rel(gm, gr), rel(gp, gr),
                                                                                 rel(ge, gr))


def test_entropy_returned_without_its_gradient_and_without_entropy(interpret):
    _check(torch.float32, interpret, _mean, True, return_entropy=True, return_lse=True)
    _check(torch.float32, interpret, _sum, True)  # the loss alone
    _check(torch.float32, interpret, _mean, True, return_entropy=True, ent_w=torch.zeros(13))  # a zero gradient


@pytest.mark.parametrize("case", ["weights", "entropy_grad", "lse_grad", "weights_bias_only"])
def test_other_upstream_gradients_recompute_exactly(interpret, case):
    g = torch.Generator().manual_seed(5)
    wts = (torch.rand(13, generator=g) + 0.5).to(interpret)
    if case == "weights":
        _check(torch.float32, interpret, lambda loss: (loss * wts).sum(), False, return_entropy=True, bias=True)
        _check(torch.float16, interpret, lambda loss: (loss * wts.half()).sum(), False, return_entropy=True)
    elif case == "entropy_grad":
        _check(torch.float32, interpret, _mean, False, return_entropy=True, ent_w=torch.randn(13, generator=g),
               softcap=3.0, **{k: True for k in EXTRAS})
    elif case == "lse_grad":
        _check(torch.float32, interpret, _sum, False, return_lse=True, lse_w=torch.randn(13, generator=g), z_loss=0.1)
    else:  # dbias alone needs the common value too
        _check(torch.float32, interpret, lambda loss: (loss * wts).sum(), False, bias=True, needs=(False, False, True))


def test_frozen_head_scales_dhidden_per_row_for_any_weights(interpret, monkeypatch):
    """dhidden alone: each row times its own upstream gradient is exact, no host read."""
    g = torch.Generator().manual_seed(6)
    wts = (torch.randn(13, generator=g)).to(interpret)
    reads = []
    real = lce_single._uniform_upstream

    def spy(*a, **k):
        out = real(*a, **k)
        reads.append(out[1])
        return out

    monkeypatch.setattr(lce_single, "_uniform_upstream", spy)
    _check(torch.float32, interpret, lambda loss: (loss * wts).sum(), True, return_entropy=True, bias=True,
           needs=(True, False, False))
    assert reads == [None]  # the per-row scaling: nothing was read
    # fp16: rows whose factor g * n_valid is at most 1 take the formed dhidden; a larger one recomputes
    # (test_fp16_formed_gradients_never_lose_what_the_per_token_path_keeps)
    n = int((_inputs(13, 16, 37, torch.float16, interpret)[2] != -100).sum())
    small = wts.half() / (n * wts.abs().max())
    _check(torch.float16, interpret, lambda loss: (loss * small).sum(), True, softcap=2.0, needs=(True, False, False))
    _check(torch.float16, interpret, lambda loss: (loss * wts.half()).sum(), False, softcap=2.0,
           needs=(True, False, False))


def test_all_ignored_batch(interpret):
    for upstream in (_mean, _sum):
        mine, _ = _check(torch.float32, interpret, upstream, True, ignore_every=1, bias=True, return_entropy=True)
        assert (mine[0][0] == 0).all()
        assert all((g == 0).all() for g in mine[1])
    # a sum over no labelled token divided by zero items (infinite upstream gradient): zero gradients
    h, w, t, b, _ = _inputs(9, 16, 37, torch.float32, interpret, ignore_every=1, bias=True)
    told = []
    _, grads, total = _run(linear_cross_entropy, h, w, t, b, lambda loss: loss.sum() / torch.tensor(0.0),
                           return_entropy=True, expect_uniform_grad=True, uniform_grad_callback=told.append)
    assert torch.isnan(total) and told == [True]
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)


def test_non_finite_upstream(interpret):
    """NaN / inf on a labelled row propagate (as the per-token path, which the backward then runs);
    NaN or inf on an ignored row counts as 0 (the formed gradients are used)."""
    h, w, t, b, _ = _inputs(13, 16, 37, torch.float32, interpret, bias=True)
    lab = int((t != -100).nonzero()[2])
    ign = int((t == -100).nonzero()[0])
    for bad in (float("nan"), float("inf")):
        res = []
        for mode in (True, False):
            up = torch.full((13,), 0.25, device=interpret)
            up[lab] = bad
            told = []
            kw = dict(expect_uniform_grad=True, uniform_grad_callback=told.append) if mode else {}
            _, grads, _ = _run(linear_cross_entropy, h, w, t, b, lambda loss: (loss * up).sum(), **kw)
            assert told == ([False] if mode else [])
            res.append(grads)
        for a, c in zip(*res, strict=True):
            assert not torch.isfinite(a).all()
            assert torch.equal(torch.isnan(a), torch.isnan(c)) and torch.equal(torch.isinf(a), torch.isinf(c))
            fin = torch.isfinite(c)
            assert rel(a[fin], c[fin]) <= 1e-5
        # dhidden alone: the row of the non-finite gradient is non-finite, the others exact
        up = torch.full((13,), 0.25, device=interpret)
        up[lab] = bad
        _, (dh,), _ = _run(linear_cross_entropy, h, w, t, b, lambda loss: (loss * up).sum(), needs=(True, False, False),
                           expect_uniform_grad=True)
        _, (dh0,), _ = _run(linear_cross_entropy, h, w, t, b, lambda loss: (loss * up).sum(), needs=(True, False, False))
        assert not torch.isfinite(dh[lab]).any() and not torch.isfinite(dh0[lab]).any()
        rows = torch.arange(13, device=interpret) != lab
        assert torch.isfinite(dh[rows]).all() and rel(dh[rows], dh0[rows]) <= 1e-5
        # on an ignored row: as a 0 there
        up = torch.full((13,), 0.25, device=interpret)
        up[ign] = bad
        told = []
        _, grads, _ = _run(linear_cross_entropy, h, w, t, b, lambda loss: (loss * up).sum(), expect_uniform_grad=True,
                           uniform_grad_callback=told.append)
        up[ign] = 0.0
        _, base, _ = _run(linear_cross_entropy, h, w, t, b, lambda loss: (loss * up).sum())
        assert told == [True]
        for a, c in zip(grads, base, strict=True):
            assert torch.isfinite(a).all() and rel(a, c) <= 1e-5


def test_every_element_written(interpret, monkeypatch):
    """Fresh buffers filled with NaN: the mode writes every element it returns or scales."""
    def poisoned(fn):
        def make(*a, **k):
            x = fn(*a, **k)
            if x.is_floating_point():
                x.fill_(float("nan"))
            return x
        return make

    h, w, t, b, _ = _inputs(13, 16, 37, torch.float32, interpret, bias=True)
    base = _run(linear_cross_entropy, h, w, t, b, _sum, return_entropy=True, return_mean_logits=True,
                return_log_sum_sq=True)
    monkeypatch.setattr(torch, "empty", poisoned(torch.empty))
    monkeypatch.setattr(torch, "empty_like", poisoned(torch.empty_like))
    mine = _run(linear_cross_entropy, h, w, t, b, _sum, return_entropy=True, return_mean_logits=True,
                return_log_sum_sq=True, expect_uniform_grad=True, chunk_tokens=5)
    for a, c in zip(mine[0] + mine[1], base[0] + base[1], strict=True):
        assert torch.isfinite(a).all() and rel(a.double(), c.double()) <= 1e-5


def test_backward_once_only(interpret):
    h, w, t, b, _ = _inputs(13, 16, 37, torch.float32, interpret)
    hl, wl = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, ent = linear_cross_entropy(hl, wl, t, reduction="none", return_entropy=True, expect_uniform_grad=True)
    total = loss.sum()
    total.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backpropagated once"):
        total.backward()


def test_no_gradients_compile_and_reference_ignore_it(interpret, monkeypatch):
    h, w, t, b, _ = _inputs(13, 16, 37, torch.float32, interpret, bias=True)
    told = []
    kw = dict(return_entropy=True, return_is_top1=True)
    base = linear_cross_entropy(h, w, t, bias=b, reduction="none", **kw)
    with torch.no_grad():
        out = linear_cross_entropy(h.requires_grad_(), w, t, bias=b, reduction="none", expect_uniform_grad=True,
                                   uniform_grad_callback=told.append, **kw)
    for a, c in zip(out, base):
        assert torch.equal(a, c)
    # under torch.compile (its check only: the per-token custom ops run, the callback is never called)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    _, grads, _ = _run(linear_cross_entropy, h, w, t, b, _sum, expect_uniform_grad=True,
                       uniform_grad_callback=told.append, **kw)
    monkeypatch.undo()
    _, base_grads, _ = _run(linear_cross_entropy, h, w, t, b, _sum, **kw)
    assert told == []
    for a, c in zip(grads, base_grads, strict=True):
        assert torch.equal(a, c)
    # the reference takes the keywords and is exact anyway
    r = _run(linear_cross_entropy_reference, h, w, t, b, _sum, dtype=torch.float64, expect_uniform_grad=True,
             uniform_grad_callback=told.append, **kw)
    assert told == [] and all(rel(a, c) <= 1e-5 for a, c in zip(base_grads, r[1]))


def test_argument_errors(interpret):
    h, w, t, b, _ = _inputs(5, 16, 37, torch.float32, interpret)
    with pytest.raises(ValueError, match="expect_uniform_grad.*reduction='none'"):
        linear_cross_entropy(h, w, t, reduction="mean", expect_uniform_grad=True)
    with pytest.raises(TypeError, match="expect_uniform_grad"):
        linear_cross_entropy(h, w, t, reduction="none", expect_uniform_grad=1)
    with pytest.raises(TypeError, match="uniform_grad_callback"):
        linear_cross_entropy(h, w, t, reduction="none", expect_uniform_grad=True, uniform_grad_callback=3)
    with pytest.raises(ValueError, match="uniform_grad_callback"):
        linear_cross_entropy(h, w, t, reduction="none", uniform_grad_callback=print)
    with pytest.raises(ValueError, match="expect_uniform_grad.*reduction='none'"):
        linear_cross_entropy_reference(h, w, t, reduction="sum", expect_uniform_grad=True)
