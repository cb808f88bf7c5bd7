"""The gated activation op ``mlp_act`` (CPU: Triton interpreter, fp32 and fp16; bf16 in the GPU
tests): forward and backward of SiLU, tanh GELU and exact GELU in the split and gate-up layouts
against eager and float64, poisoned outputs, strided inputs, non-finite inputs, wrong arguments,
the fallback, the custom ops, and the kernels shared with the MoE experts' gate."""
from __future__ import annotations

import importlib
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not in every forked test: custom ops need it)
from unit.test_rms_norm import ulp

from deepspeed_fused.ops import _common
from deepspeed_fused.ops import mlp_act as M

API = importlib.import_module("deepspeed_fused.ops.mlp_act.api")
FLOATS = [torch.float32, torch.float16]
ACTS = ["silu", "gelu_tanh", "gelu"]
LAYOUTS = ["split", "gate_up", "up_gate"]


def _act64(g, act):
    if act == "silu":
        return g * torch.sigmoid(g)
    if act == "gelu_tanh":
        return 0.5 * g * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (g + 0.044715 * g ** 3)))
    return 0.5 * g * (1 + torch.erf(g / 2 ** 0.5))


def _dact64(g, act):
    g = g.detach().clone().requires_grad_()
    (d,) = torch.autograd.grad(_act64(g, act).sum(), g)
    return d


def _inputs(shape, dtype, device, layout, seed=0):
    gen = torch.Generator().manual_seed(seed)
    width = shape[-1] * (2 if layout != "split" else 1)
    a = (2 * torch.randn(*shape[:-1], width, generator=gen)).to(dtype).to(device)
    b = (2 * torch.randn(*shape[:-1], width, generator=gen)).to(dtype).to(device)
    dh = torch.randn(*shape, generator=gen).to(dtype).to(device)
    return (a, b) if layout == "split" else (a,), dh


def _fns(layout, act):
    if layout == "split":
        return (lambda g, u: M.mlp_act(g, u, act)), (lambda g, u: M.mlp_act_reference(g, u, act))
    first = layout == "gate_up"
    return (lambda gu: M.mlp_act_fused(gu, act, first)), (lambda gu: M.mlp_act_fused_reference(gu, act, first))


def _run(fn, xs, dh):
    xs = [x.detach().clone().requires_grad_() for x in xs]
    y = fn(*xs)
    y.backward(dh)
    return y.detach(), [x.grad for x in xs]


def _gate_up(xs, layout):
    """(gate, up) in float64 of the inputs of a layout."""
    if layout == "split":
        return xs[0].double(), xs[1].double()
    a, b = xs[0].double().chunk(2, -1)
    return (a, b) if layout == "gate_up" else (b, a)


def _grad_halves(gs, layout):
    if layout == "split":
        return gs[0].double(), gs[1].double()
    a, b = gs[0].double().chunk(2, -1)
    return (a, b) if layout == "gate_up" else (b, a)


# the interpreter's tanh is built from exp (no libdevice), CPU eager's tanh and erf are Sleef's: near -1 their
# errors, absolute, are a few FP32 ULP of 1, which 1 + tanh does not shrink
_TANH_SLACK = 8 * 2.0 ** -24


def _act_err(g, act):
    """A bound on the FP32 activation's error (ours or CPU eager's), absolute, before its rounding."""
    a64 = _act64(g, act)
    return 8 * ulp(a64, torch.float32) + (_TANH_SLACK * g.abs() if act != "silu" else 0)


def _check(layout, act, xs, dh):
    fn, ref = _fns(layout, act)
    y, gs = _run(fn, xs, dh)
    yr, gsr = _run(ref, xs, dh)
    dtype = xs[0].dtype
    assert y.dtype == yr.dtype == dtype and y.shape == yr.shape
    assert all(g.shape == x.shape and g.dtype == dtype for g, x in zip(gs, xs))
    g, u = _gate_up(xs, layout)
    a64 = _act64(g, act)
    # the activation's own error in FP32 (exp, erf, tanh of the interpreter), before its rounding
    act_err = _act_err(g, act)
    dg, du = _grad_halves(gs, layout)
    dgr, dur = _grad_halves(gsr, layout)
    if dtype == torch.float32:
        assert ((y.double() - a64 * u).abs() <= (act_err + ulp(a64, dtype)) * u.abs() + ulp(a64 * u, dtype)).all()
        assert ((du - dur).abs() <= (act_err + ulp(a64, dtype)) * dh.double().abs() + ulp(dur, dtype)).all()
        d64 = _dact64(g, act) * (dh.double() * u)
        assert ((dg - d64).abs() <= 1e-5 * d64.abs() + 1e-5 * (dh.double() * u).abs()).all()
        return
    # half precision: eager's roundings at the same points. Where the FP32 activation lies within its
    # error of a rounding midpoint, the rounded activation may take the other neighbour: one ULP of
    # act, times |up|, plus the output's own ULP
    act_ulp = ulp(a64, dtype) + 2 * act_err
    assert ((y.double() - yr.double()).abs() <= act_ulp * u.abs() + ulp(yr, dtype)).all()
    share = 0.95 if act != "silu" else 0.99  # see _TANH_SLACK: tanh and erf differ near -1
    assert (y == yr).double().mean() >= share
    assert ((du - dur).abs() <= ulp(dur, dtype) + act_ulp * dh.double().abs()).all()
    deriv = _dact64(g, act).abs()
    slack = 16 * 2.0 ** -24 * (deriv + 1) + (_TANH_SLACK * g.abs() if act != "silu" else 0)
    assert ((dg - dgr).abs() <= ulp(dgr, dtype) + slack * (dh.double() * u).abs()).all()
    assert (dg == dgr).double().mean() >= share and (du == dur).double().mean() >= share


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("shape", [(37, 48), (3, 5, 20), (1, 1), (9, 1000)])  # (9, 1000): flat blocks and a masked tail
def test_matches_eager(interpret, layout, act, dtype, shape):
    xs, dh = _inputs(shape, dtype, interpret, layout, seed=sum(shape) + len(act))
    _check(layout, act, xs, dh)


@pytest.mark.parametrize("act", ACTS)
def test_fp16_bitwise_where_act_is_far_from_a_midpoint(interpret, act):
    # where the FP32 activation is not within its error of an fp16 rounding midpoint, every output and
    # gradient element is eager's bit for bit (the same rounding points): no tolerance there
    xs, dh = _inputs((64, 96), torch.float16, interpret, "split", seed=11)
    fn, ref = _fns("split", act)
    y, (dg, du) = _run(fn, xs, dh)
    yr, (dgr, dur) = _run(ref, xs, dh)
    g = xs[0].double()
    a64 = _act64(g, act)
    r = a64.to(torch.float16).double()
    half = ulp(r, torch.float16) / 2
    far = ((a64 - r).abs() - half).abs() > 4 * _act_err(g, act)
    assert far.double().mean() > 0.6
    assert torch.equal(y[far], yr[far]) and torch.equal(du[far], dur[far])


def test_writes_every_element(interpret, monkeypatch):
    real_empty = torch.empty

    def poisoned(*a, **k):
        return real_empty(*a, **k).fill_(float("nan"))

    monkeypatch.setattr(torch, "empty", poisoned)
    for layout in LAYOUTS:
        xs, dh = _inputs((33, 70), torch.float32, interpret, layout, seed=3)
        fn, _ = _fns(layout, "gelu_tanh")
        y, gs = _run(fn, xs, dh)
        assert torch.isfinite(y).all() and all(torch.isfinite(g).all() for g in gs), layout


def test_strided_inputs(interpret):
    # gate a column slice of a wider buffer (row stride, no copy), up column-major (copied), a gate-up
    # projection that is itself a slice; results as eager's
    gen = torch.Generator().manual_seed(4)
    base = torch.randn(19, 64, generator=gen).to(interpret)
    gate = base[:, :40]
    up = torch.randn(40, 19, generator=gen).to(interpret).t()
    assert not gate.is_contiguous() and up.stride(-1) != 1
    dh = torch.randn(19, 40, generator=gen).to(interpret)
    _check("split", "silu", [gate, up], dh)
    gu = torch.randn(7, 3, 2 * 24 + 8, generator=gen).to(interpret)[..., :48]
    _check("gate_up", "gelu", [gu], torch.randn(7, 3, 24, generator=gen).to(interpret))
    # a broadcast gate (stride 0 rows) is read as a copy
    g0 = torch.randn(1, 24, generator=gen).to(interpret).expand(5, 24)
    _check("split", "gelu_tanh", [g0, torch.randn(5, 24, generator=gen).to(interpret)],
           torch.randn(5, 24, generator=gen).to(interpret))


@pytest.mark.parametrize("act", ACTS)
def test_non_finite_where_eager_is(interpret, act):
    gen = torch.Generator().manual_seed(5)
    g = torch.randn(4, 16, generator=gen)
    u = torch.randn(4, 16, generator=gen)
    g[0, :4] = torch.tensor([float("inf"), float("-inf"), float("nan"), 3e38])
    if act == "gelu":  # CPU's vectorised erf GELU gives NaN at +inf and overflows at 3e38 (CUDA's, which the
        g[0, 0], g[0, 3] = -3e38, 50.0  # kernels follow, gives inf and 3e38: the GPU tests cover those)
    u[1, :3] = torch.tensor([float("inf"), float("nan"), float("-inf")])
    g, u = g.to(interpret), u.to(interpret)
    y, yr = M.mlp_act(g, u, act), M.mlp_act_reference(g, u, act)
    assert torch.equal(torch.isnan(y), torch.isnan(yr)) and torch.equal(torch.isinf(y), torch.isinf(yr))
    fin = torch.isfinite(yr)
    torch.testing.assert_close(y[fin], yr[fin], rtol=1e-5, atol=1e-6)


def test_wrong_inputs_raise():
    g = torch.randn(3, 4)
    with pytest.raises(ValueError, match="up"):
        M.mlp_act(g, torch.randn(3, 5))
    with pytest.raises(TypeError, match="gate"):
        M.mlp_act(torch.ones(3, 4, dtype=torch.int32), g)
    with pytest.raises(TypeError, match="up"):
        M.mlp_act(g, [1.0])
    with pytest.raises(ValueError, match="act"):
        M.mlp_act(g, g, "relu")
    with pytest.raises(TypeError, match="act"):
        M.mlp_act(g, g, 1)
    with pytest.raises(ValueError, match="gate_up"):
        M.mlp_act_fused(torch.randn(3, 5))
    with pytest.raises(TypeError, match="gate_first"):
        M.mlp_act_fused(g, "silu", "yes")
    with pytest.raises(ValueError, match="gate"):
        M.mlp_act(torch.tensor(1.0), torch.tensor(1.0))


def test_fallback_warns_once():
    _common.reset_fallback_warnings()
    g, u = torch.randn(4, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y1, y2 = M.mlp_act(g, u, "gelu"), M.mlp_act(g, u, "gelu")
        M.mlp_act_fused(torch.cat([g, u], -1), "gelu")
    assert sum("mlp_act" in str(m.message) and "float64" in str(m.message) for m in w) == 1
    assert torch.equal(y1, M.mlp_act_reference(g, u, "gelu")) and torch.equal(y1, y2)
    ok, why = M.kernels_take(torch.randn(2, 2, dtype=torch.float16), torch.randn(2, 2))
    assert not ok and "different dtypes" in why


def test_custom_ops_fake_and_autograd(interpret):
    gen = torch.Generator().manual_seed(6)
    g, u, dh = (torch.randn(6, 16, generator=gen).to(interpret) for _ in range(3))
    torch.library.opcheck(API._split_op, (g.clone().requires_grad_(), u.clone().requires_grad_(), "gelu_tanh"))
    torch.library.opcheck(API._split_backward_op, (g, u, dh, "silu"))
    gu = torch.cat([g, u], -1)
    torch.library.opcheck(API._fused_op, (gu.clone().requires_grad_(), "gelu", False))
    torch.library.opcheck(API._fused_backward_op, (gu, dh, "gelu", True))
    x = gu.clone().requires_grad_()
    (g1,) = torch.autograd.grad(API._fused_op(x, "silu", True), x, dh)
    (g2,) = torch.autograd.grad(M.mlp_act_fused_reference(x, "silu", True), x, dh)
    torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-6)


def test_experts_gate_runs_the_same_kernels(interpret):
    # the MoE experts' SiLU gate launches this op's kernels (one family): in FP32 the two agree bit for bit
    from deepspeed_fused.ops import moe_reorder as mr

    S = importlib.import_module("deepspeed_fused.ops.moe_reorder.swiglu")
    L = importlib.import_module("deepspeed_fused.ops.mlp_act.launch")
    assert S._mlp_launch is L
    xs, dh = _inputs((9, 40), torch.float32, interpret, "gate_up", seed=8)
    y1, (d1,) = _run(mr.swiglu, xs, dh)
    y2, (d2,) = _run(lambda gu: M.mlp_act_fused(gu, "silu", True), xs, dh)
    assert torch.equal(y1, y2) and torch.equal(d1, d2)


def test_double_backward_raises_not_silently_wrong(interpret):
    g = torch.randn(4, 8, device=interpret, requires_grad=True)
    u = torch.randn(4, 8, device=interpret, requires_grad=True)
    (dg, _) = torch.autograd.grad(M.mlp_act(g, u, "silu").sum(), (g, u), create_graph=True)
    with pytest.raises(RuntimeError):
        dg.sum().backward()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("dtype", FLOATS)
def test_gradients_written_over_the_inputs_equal_fresh_ones(interpret, layout, act, dtype):
    """With ``grads_in_place`` the backward writes the gradients over gate and up (gate_up): the
    very same tensors come back as the gradients, bit for bit what the fresh-buffer backward gives;
    the forward is unchanged."""
    xs, dh = _inputs((3, 5, 40), dtype, interpret, layout, seed=7)
    first = layout == "gate_up"

    def run(in_place):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        mids = [x * 1 for x in leaves]  # non-leaf temporaries, as a projection's outputs are
        seen = {}

        def keep(grad, i):
            seen[i] = grad
        for i, m in enumerate(mids):
            m.register_hook(lambda g, i=i: keep(g, i))
        ptrs = [m.data_ptr() for m in mids]
        if layout == "split":
            y = M.mlp_act(*mids, act, grads_in_place=in_place)
        else:
            y = M.mlp_act_fused(*mids, act, first, grads_in_place=in_place)
        y.backward(dh)
        return y.detach(), [seen[i] for i in range(len(mids))], ptrs

    y0, g0, _ = run(False)
    y1, g1, ptrs = run(True)
    assert torch.equal(y0, y1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))
    assert [g.data_ptr() for g in g1] == ptrs  # written over the inputs
    assert all(g.data_ptr() not in ptrs for g in g0)


def test_gradients_in_place_only_where_the_inputs_can_take_them(interpret):
    """Inputs that share memory (one tensor as gate and up, the halves of one projection) or that
    the kernel reads through a copy (a transposed view) get fresh gradients, still exact; a
    non-bool ``grads_in_place`` is a TypeError."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4, 6, 32, generator=gen, device=interpret)
    dh = torch.randn(4, 6, 32, generator=gen, device=interpret)

    def grads(make, in_place):
        leaf = x.detach().clone().requires_grad_()
        g, u = make(leaf * 1)
        y = M.mlp_act(g, u, "silu", grads_in_place=in_place)
        y.backward(dh)
        return leaf.grad

    same = lambda t: (t, t)  # noqa: E731
    halves = lambda t: (torch.cat([t, t], -1)[..., :32], torch.cat([t, t], -1)[..., 32:])  # noqa: E731
    chunked = lambda t: torch.cat([t, t * 2], -1).chunk(2, -1)  # noqa: E731
    transposed = lambda t: (t.transpose(0, 1).contiguous().transpose(0, 1), t * 3)  # noqa: E731
    for make in (same, halves, chunked, transposed):
        assert torch.equal(grads(make, True), grads(make, False))
    leaf = x.detach().clone().requires_grad_()
    with pytest.raises(TypeError, match="grads_in_place must be a bool"):
        M.mlp_act(leaf * 1, leaf * 2, "silu", grads_in_place=1)
    with pytest.raises(TypeError, match="grads_in_place must be a bool"):
        M.mlp_act_fused(torch.cat([leaf, leaf], -1), "silu", True, grads_in_place="yes")


@pytest.mark.parametrize("layout", ["split", "gate_up"])
def test_a_second_backward_after_gradients_in_place_raises(interpret, layout):
    """Once the gradients were written over the saved inputs, a second backward through the same
    graph (``retain_graph=True``) raises autograd's in-place error instead of reading them; with
    fresh buffers it runs and gives the same gradients again."""
    xs, dh = _inputs((2, 3, 16), torch.float32, interpret, layout, seed=5)
    for in_place in (False, True):
        leaves = [x.detach().clone().requires_grad_() for x in xs]
        mids = [x * 1 for x in leaves]
        if layout == "split":
            y = M.mlp_act(*mids, "silu", grads_in_place=in_place)
        else:
            y = M.mlp_act_fused(*mids, "silu", True, grads_in_place=in_place)
        y.backward(dh, retain_graph=True)
        first = [x.grad.clone() for x in leaves]
        if in_place:
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                y.backward(dh)
        else:
            y.backward(dh)
            assert all(torch.equal(x.grad, 2 * f) for x, f in zip(leaves, first))
