"""The other RMSNorm forms (RMSForm): the op under the Triton interpreter against each form's eager
formulation and a float64 oracle, and the installer on transformers' own classes of each form."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from deepspeed_fused.features import rms_norm as F
from deepspeed_fused.ops import rms_norm as R
from deepspeed_fused.ops._common import reset_fallback_warnings
from unit.test_rms_norm import EPS, assert_dx_close, tune, ulp, ulp_err  # noqa: F401  (tune: a fixture)

FORM_NAMES = sorted(n for n in R.FORMS if n != "llama")
_ACT = {"silu": torch.nn.functional.silu, "sigmoid": torch.sigmoid}


def form_inputs(form, shape, dtype, wdtype=None, gdtype=None, seed=0, device="cpu", gate=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    w = None
    if form.weight != "none":
        base = 0.0 if form.weight.startswith("offset") else 1.0
        w = (base + 0.1 * torch.randn(shape[-1], generator=g)).to(wdtype or dtype)
    gt = torch.randn(shape, generator=g).to(gdtype or dtype) if form.gate != "none" and gate else None
    out = R.form_output_dtype(form, dtype, None if w is None else w.dtype)
    dy = torch.randn(shape, generator=g).to(out)
    to = (lambda t: None if t is None else t.to(device))
    return to(x), to(w), to(gt), to(dy)


def oracle_form(x, w, g, eps, form):
    """The form in float64 with no rounding anywhere (float64 leaves keep their graph)."""
    h = x
    if form.gate == "before" and g is not None:
        h = h * _ACT[form.act](g)
    n = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if form.weight in ("plain", "fp32"):
        n = w * n
    elif form.weight in ("offset", "offset_w"):
        n = n * (1.0 + w)
    if form.gate == "after":
        n = n * _ACT[form.act](g)
    return n


def _grads(fn, x, w, g, dy, dtype=None):
    leaves = [None if t is None else (t.detach().to(dtype) if dtype else t.detach().clone()).requires_grad_()
              for t in (x, w, g)]
    y = fn(*leaves)
    y.backward(dy.to(dtype) if dtype else dy)
    return (y.detach(),) + tuple(None if t is None else t.grad for t in leaves)


def _assert_y(y, y_ref, y64):
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    if not y.numel():
        return
    if y.dtype == torch.float32:
        rowmax = y64.abs().amax(-1, keepdim=True).clamp_min(1e-30)
        e_f = ((y.double() - y64) / rowmax).abs().max()
        e_e = ((y_ref.double() - y64) / rowmax).abs().max()
        assert e_f <= 2 * e_e + 2.0 ** -21, f"forward {e_f.item():.3g} off float64, eager {e_e.item():.3g}"
    else:
        err = ulp_err(y, y_ref, y.dtype)
        assert err.max() <= 2, f"forward {err.max().item()} ULP off eager"
        assert (err == 0).double().mean() >= 0.9, "forward: fewer than 90% of outputs equal eager's"


def check_form(form, x, w, g, dy, eps=EPS):
    """Forward, dx, dw and the gate's gradient against eager (its own rounding) and float64."""
    y, dx, dw, dg = _grads(lambda a, b, c: R.fused_rms_norm_form(a, b, eps, form, c), x, w, g, dy)
    yr, dxr, dwr, dgr = _grads(lambda a, b, c: R.rms_norm_form_reference(a, b, eps, form, c), x, w, g, dy)
    y64, dx64, dw64, dg64 = _grads(lambda a, b, c: oracle_form(a, b, c, eps, form), x, w, g, dy, torch.float64)
    _assert_y(y, yr, y64)
    assert_dx_close(dx, dxr, x.dtype, dx64)
    if g is not None:
        assert dg.dtype == g.dtype
        assert_dx_close(dg, dgr, g.dtype, dg64)
    if w is not None:
        # dw against eager's own formula given our rstd (the same rounded terms; only the FP32
        # summation order differs): within 1 ULP + 4 eps32 * sum |terms|
        _, rstd = R._form_forward_impl(x, w, g, eps, form)
        _, _, dw_inj, _ = _grads(lambda a, b, c: R._form_eager(a, b, eps, form, c, rstd[..., None]), x, w, g, dy)
        h = x.double() * (_ACT[form.act](g.double()) if form.gate == "before" and g is not None else 1)
        s = _ACT[form.act](g.double()).abs() if form.gate == "after" else 1
        terms = (dy.double().abs() * s * (h * rstd[..., None].double()).abs()).reshape(-1, x.shape[-1]).sum(0)
        assert dw.dtype == w.dtype
        bound = ulp(torch.maximum(dw.double().abs(), dw_inj.double().abs()), w.dtype) + 4 * 2.0 ** -24 * terms
        d = (dw.double() - dw_inj.double()).abs()
        assert (d <= bound).all(), f"dw off by {(d / bound).max().item()} of the bound"
        rel = (dw.double() - dw64).norm() / dw64.norm().clamp_min(1e-30)
        tol = 1e-5 if x.dtype == w.dtype == torch.float32 else 1e-2  # a half-precision rounding in the chain
        assert rel < tol, f"dw vs float64: {rel.item():.3g}"
    return y, dx, dw, dg


# ---- the op ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", FORM_NAMES)
@pytest.mark.parametrize("rows,n", [(7, 40), (65, 128), (0, 16)])
def test_form_matches_eager(interpret, form, dtype, rows, n):
    f = R.FORMS[form]
    x, w, g, dy = form_inputs(f, (rows, n), dtype, seed=rows * 7 + n + len(form), device=interpret)
    y, dx, dw, dg = check_form(f, x, w, g, dy)
    if rows == 0 and w is not None:
        assert torch.equal(dw, torch.zeros_like(w))


@pytest.mark.parametrize("form", ["offset", "weight_first", "t5", "gated", "gate_first", "gated_weight_first"])
@pytest.mark.parametrize("dtype,wdtype", [(torch.float16, torch.float32), (torch.float32, torch.float16)])
def test_form_mixed_weight_dtype(interpret, form, dtype, wdtype):
    f = R.FORMS[form]
    x, w, g, dy = form_inputs(f, (3, 5, 24), dtype, wdtype, seed=5, device=interpret)
    y, dx, dw, dg = check_form(f, x, w, g, dy)
    assert y.dtype == R.form_output_dtype(f, dtype, wdtype) and dx.dtype == dtype and dw.dtype == wdtype
    if form == "t5":  # T5 rounds to a half-precision weight's dtype and returns it
        assert y.dtype == (torch.float32 if wdtype == torch.float32 else wdtype)
    elif f.out_cast:
        assert y.dtype == dtype


@pytest.mark.parametrize("act", ["silu", "sigmoid"])
@pytest.mark.parametrize("form", ["gated", "gated_weight_first", "gate_first"])
def test_gate_activations_and_gate_dtype(interpret, form, act):
    f = R.FORMS[form]._replace(act=act)
    x, w, g, dy = form_inputs(f, (9, 48), torch.float16, gdtype=torch.float32, seed=3, device=interpret)
    check_form(f, x, w, g, dy)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", FORM_NAMES)
def test_form_wide_rows_loop(interpret, tune, form, dtype):
    tune(_MAX_FWD_BLOCK=64, _MAX_BWD_BLOCK=64, _LOOP_BLOCK=32)
    assert not R._fwd_config(5, 130, 2, 1)[2] and not R._bwd_config(5, 130)[2]
    f = R.FORMS[form]
    x, w, g, dy = form_inputs(f, (5, 130), dtype, seed=13, device=interpret)
    check_form(f, x, w, g, dy)


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("form", ["gated", "gate_first", "offset"])
def test_form_tile_boundaries_and_several_programs(interpret, tune, form, prefetch):
    tune(_BWD_PREFETCH=prefetch)
    f = R.FORMS[form]
    x, w, g, dy = form_inputs(f, (300, 16), torch.float16, seed=17, device=interpret)
    check_form(f, x, w, g, dy)


@pytest.mark.parametrize("col", [True, False])
def test_form_wide_weight_gradient_sums(interpret, tune, col):
    f = R.FORMS["gated"]
    x, w, g, dy = form_inputs(f, (67, 40), torch.float16, seed=9, device=interpret)
    tune(_MAX_TAIL_BYTES=0, _SMALL_ELEMS=0, _COL_FINISH=col)
    check_form(f, x, w, g, dy)
    plan = next(iter(R._form_bwd_plans.values()))
    assert plan[10]["FINISH"] == (2 if col else 0) and (plan[14] is None) == col


@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("form", FORM_NAMES)
def test_form_poisoned_outputs_are_fully_written(interpret, tune, form, loop):
    if loop:
        tune(_MAX_FWD_BLOCK=32, _MAX_BWD_BLOCK=32, _LOOP_BLOCK=16)
    f = R.FORMS[form]
    x, w, g, dy = form_inputs(f, (37, 40), torch.float16, seed=8, device=interpret)
    y0, r0 = R._form_forward_impl(x, w, g, EPS, f)
    y, r = torch.full_like(y0, float("nan")), torch.full_like(r0, float("nan"))
    R._form_forward_impl(x, w, g, EPS, f, y=y, rstd=r)
    assert torch.equal(y, y0) and torch.equal(r, r0) and not y.isnan().any()
    dx0, dw0, dg0 = R._form_backward_impl(dy, x, w, g, r0, f)
    nan = (lambda t: None if t is None else torch.full_like(t, float("nan")))
    dx, dw, dg = nan(dx0), nan(dw0), nan(dg0)
    R._form_backward_impl(dy, x, w, g, r0, f, dx=dx, dw=dw, dg=dg)
    for a, b in ((dx, dx0), (dw, dw0), (dg, dg0)):
        assert (a is None and b is None) or (torch.equal(a, b) and not a.isnan().any())


def test_form_strided_rows_without_copy(interpret):
    # Gemma-style q/k norms on a slice of a fused projection viewed as [B, S, heads, head_dim]
    B, S, H, hd = 2, 3, 4, 16
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, S, 3 * H * hd, generator=gen).to(interpret)
    q = qkv[..., : H * hd].view(B, S, H, hd)
    assert not q.is_contiguous() and R._row_layout(q) is not None
    f = R.FORMS["offset"]
    w = (0.1 * torch.randn(hd, generator=gen)).to(interpret)
    dy = torch.randn(B, H, S, hd, generator=gen).to(interpret).transpose(1, 2)
    check_form(f, q, w, None, dy)
    key = next(iter(R._form_fwd_plans))
    assert not R._form_fwd_plans[key][0]  # no copy of x


def test_forms_that_round_as_llama_run_the_llama_op(interpret, monkeypatch):
    calls = []
    real = R.try_fused_rms_norm
    monkeypatch.setattr(R, "try_fused_rms_norm", lambda *a: calls.append(1) or real(*a))
    x, w, _, dy = form_inputs(R.FORMS["t5"], (4, 24), torch.float16, device=interpret)
    torch.testing.assert_close(R.fused_rms_norm_form(x, w, EPS, "t5"), R.fused_rms_norm(x, w, EPS), rtol=0, atol=0)
    assert len(calls) == 2  # T5 with a weight of the input's half dtype is the Llama form
    y = R.fused_rms_norm_form(x, w, EPS, "gate_first", None)  # the Mamba2 form without a gate
    assert len(calls) == 3 and torch.equal(y, R.fused_rms_norm(x, w, EPS))
    R.fused_rms_norm_form(x, w.float(), EPS, "t5")
    assert len(calls) == 4 or len(calls) == 3  # fp32 weight: T5 keeps FP32 (its own kernel)
    assert R._form_consts(R.FORMS["t5"], torch.float16, torch.float32, False) is not None


def test_form_bad_inputs_raise(interpret):
    x = torch.randn(4, 8, device=interpret)
    w = torch.ones(8, device=interpret)
    with pytest.raises(ValueError, match="unknown form"):
        R.fused_rms_norm_form(x, w, EPS, "nope")
    with pytest.raises(ValueError, match="takes no weight"):
        R.fused_rms_norm_form(x, w, EPS, "unweighted")
    with pytest.raises(ValueError, match="needs a weight"):
        R.fused_rms_norm_form(x, None, EPS, "offset")
    with pytest.raises(ValueError, match="needs a gate"):
        R.fused_rms_norm_form(x, w, EPS, "gated")
    with pytest.raises(ValueError, match="takes no gate"):
        R.fused_rms_norm_form(x, w, EPS, "offset", x)
    with pytest.raises(ValueError, match="gate must have hidden's shape"):
        R.fused_rms_norm_form(x, w, EPS, "gated", x[:, :4])
    with pytest.raises(TypeError, match="gate must be a floating-point"):
        R.fused_rms_norm_form(x, w, EPS, "gated", torch.ones(4, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="weight must have shape"):
        R.fused_rms_norm_form(x, torch.ones(7, device=interpret), EPS, "weight_first")
    with pytest.raises(ValueError, match="rstd_cast takes no weight"):
        R.fused_rms_norm_form(x, w, EPS, R.RMSForm(rstd_cast=True))
    with pytest.raises(TypeError, match="form must be"):
        R.fused_rms_norm_form(x, w, EPS, 3)


def test_form_fallback_warns_and_runs_reference(interpret):
    reset_fallback_warnings()
    f = R.FORMS["gated"]
    x, w, g, _ = form_inputs(f, (3, 8), torch.float64, device=interpret)
    with pytest.warns(RuntimeWarning, match="float64"):
        y = R.fused_rms_norm_form(x, w, EPS, f, g)
    assert torch.equal(y, R.rms_norm_form_reference(x, w, EPS, f, g))


def test_form_custom_ops_and_compile(interpret):
    from torch._dynamo.testing import AotEagerAndRecordGraphs

    f = R.FORMS["gated"]
    x, w, g, dy = form_inputs(f, (6, 32), torch.float32, seed=4, device=interpret)
    torch.library.opcheck(R._rms_norm_form_fwd, (x, w.requires_grad_(), g, EPS, R._form_code(f)),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    w = w.detach()
    rstd = R._form_forward_impl(x, w, g, EPS, f)[1]
    torch.library.opcheck(R._rms_norm_form_bwd, (dy, x, w, g, rstd, R._form_code(f)),
                          test_utils=("test_schema", "test_faketensor"))
    torch._dynamo.reset()
    for form, (a, b, c) in (("gated", (x, w, g)), ("unweighted", (x, None, None))):
        rec = AotEagerAndRecordGraphs()

        def fn(a, b, c, form=form):
            return R.fused_rms_norm_form(a * 2, b, EPS, form, c).sin()

        ins = [None if t is None else t.clone().requires_grad_() for t in (a, b, c)]
        yc = torch.compile(fn, backend=rec, fullgraph=True)(*ins)
        yc.backward(dy)
        ref = [None if t is None else t.clone().requires_grad_() for t in (a, b, c)]
        ye = fn(*ref)
        ye.backward(dy)
        assert len(rec.graphs) == 1
        assert "deepspeed_fused.rms_norm_form_fwd.default" in {str(n.target) for gr in rec.fw_graphs
                                                                for n in gr.graph.nodes}
        assert torch.equal(yc, ye)
        for p, q in zip(ins, ref):
            assert p is None or torch.equal(p.grad, q.grad)


def test_form_gradient_of_gradient_raises(interpret):
    f = R.FORMS["offset"]
    x, w, _, dy = form_inputs(f, (5, 16), torch.float32, seed=31, device=interpret)
    x.requires_grad_()
    y = R.fused_rms_norm_form(x, w, EPS, f)
    (gx,) = torch.autograd.grad(y, x, dy, create_graph=True)
    with pytest.raises(RuntimeError, match="does not require grad|differentiate twice"):
        torch.autograd.grad(gx.sum(), x)
