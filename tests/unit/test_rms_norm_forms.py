"""The other RMSNorm forms (RMSForm): the op under the Triton interpreter against each form's eager
formulation and a float64 oracle, and the installer on transformers' own classes of each form."""
from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
import transformers

from deepspeed_fused.features import rms_norm as F
from deepspeed_fused.features.rms_norm import patch as FP
from deepspeed_fused.ops import rms_norm as R
from deepspeed_fused.ops._common import reset_fallback_warnings
from unit.test_rms_norm import EPS, assert_dx_close, tune, ulp, ulp_err  # noqa: F401  (tune: a fixture)
from unit.test_rms_norm import rms_norm_dispatchers_restored  # noqa: F401  (autouse: each test restores the classes)

# the forms with kernel code of their own (input_scaled runs its scale as eager's torch ops, then the
# unweighted form's kernels: its own tests below)
FORM_NAMES = sorted(n for n in R.FORMS if n not in ("llama", "input_scaled"))
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


def oracle_form(x, w, g, eps, form, group_size=None):
    """The form in float64 with no rounding anywhere (float64 leaves keep their graph); with
    ``group_size``, the statistics per group of that many columns."""
    if group_size is not None:
        groups = (x.shape[-1] // group_size, group_size)
        return oracle_form(x.unflatten(-1, groups), None if w is None else w.view(groups), None if g is None else
                           g.unflatten(-1, groups), eps, form).flatten(-2)
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


def _half_roundings(form, x_dtype, w_dtype) -> int:
    """How many times the form's forward rounds to a half-precision dtype on the way to its output
    (the normalized value, the weight product, the final cast). Our FP32 statistics and activation
    differ from eager CUDA's in the last bits (another summation order, another exp), so each of
    those roundings can land on the neighbouring value: one output ULP each at most."""
    nd, dp, dq, out = R.reference._form_dtypes(form, x_dtype, w_dtype)
    half = (torch.float16, torch.bfloat16)
    n = int(nd in half) + int(form.weight != "none" and dp in half) + int(out in half and dq != out)
    return max(2, n)


def _assert_y(y, y_ref, y64, roundings=2):
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
        assert err.max() <= roundings + 1e-6, f"forward {err.max().item()} ULP off eager ({roundings} roundings)"
        assert (err == 0).double().mean() >= 0.9, "forward: fewer than 90% of outputs equal eager's"


def _near_midpoint(v64, dtype, window=16 * 2.0 ** -24):
    """(ULP of ``dtype`` at |v|, where |v| lies within ``window`` (relative) of a rounding midpoint
    of ``dtype``): the elements whose rounding flips to the other neighbour when an FP32 value
    before it moves by a few ULP (our activation's exp against CUDA's, our statistics' order)."""
    a = v64.abs()
    u = ulp(a, dtype)
    mid = torch.floor(a / u) * u + u / 2
    return u, (a - mid).abs() <= window * a


def check_form(form, x, w, g, dy, eps=EPS, group_size=None):
    """Forward, dx, dw and the gate's gradient against eager (its own rounding) and float64;
    ``group_size``: statistics per group of that many columns."""
    gs = group_size
    groups = (x.shape[-1] // (gs or x.shape[-1]), gs or x.shape[-1])
    y, dx, dw, dg = _grads(lambda a, b, c: R.fused_rms_norm_form(a, b, eps, form, c, group_size=gs), x, w, g, dy)
    yr, dxr, dwr, dgr = _grads(lambda a, b, c: R.rms_norm_form_reference(a, b, eps, form, c, gs), x, w, g, dy)
    y64, dx64, dw64, dg64 = _grads(lambda a, b, c: oracle_form(a, b, c, eps, form, gs), x, w, g, dy, torch.float64)
    _assert_y(y, yr, y64, _half_roundings(form, x.dtype, None if w is None else w.dtype))
    floor = None
    xg, dyg = x.double().unflatten(-1, groups), dy.double().unflatten(-1, groups)
    r64 = torch.rsqrt(xg.pow(2).mean(-1, keepdim=True) + eps)  # per row and group
    if form.rstd_cast and x.dtype != torch.float32:
        # eager rounds dy * rstd and the statistics' term to the input dtype and adds them there:
        # where they cancel, a last-bit flip of either term is one ULP of that term, not of dx
        s64 = (dyg * xg).sum(-1, keepdim=True)
        t2 = (s64 * r64.pow(3) / groups[1]) * xg
        floor = (ulp(dyg * r64, x.dtype) + ulp(t2, x.dtype)).flatten(-2)
    half = (torch.float16, torch.bfloat16)
    pd = R.reference._form_dtypes(form, x.dtype, None if w is None else w.dtype)[1]
    flip_dp = None
    if form.gate == "after" and w is not None and pd in half:
        # eager rounds the gradient of the weighted value, dy * act(gate), to its dtype; our act
        # differs from CUDA's in the last FP32 bits, so near a midpoint that rounding flips: one
        # ULP of it, times the weight and rstd in dx, times the normalized value in dw
        u, close = _near_midpoint(dy.double() * _ACT[form.act](g.double()), pd)
        flip_dp = u * close
        extra = (r64 * w.double().view(groups).abs() * flip_dp.unflatten(-1, groups)).flatten(-2)
        floor = extra if floor is None else floor + extra
    if x.dtype != torch.float32:
        # FP32 summation order: our row sum of gn * h and eager CUDA's add the same terms in another
        # order (each within log2(n) + 8 rounding steps of the exact sum; wide rows loop over
        # blocks), and rstd differs in its last bits; where dx's two terms cancel, those errors are
        # many output ULP of the small result
        wf = 1.0 if w is None else (1 + w.double() if form.weight.startswith("offset") else w.double())
        wf = torch.as_tensor(wf, dtype=torch.float64).abs()
        gd = None if g is None else _ACT[form.act](g.double())
        hg = (x.double() * gd if form.gate == "before" else x.double()).unflatten(-1, groups)
        gn = dy.double().abs() * (gd.abs() if form.gate == "after" else 1)
        gn = (gn.unflatten(-1, groups) * (wf.view(groups) if wf.dim() else wf))
        dot = (gn * hg.abs()).sum(-1, keepdim=True)
        k = (math.log2(groups[1]) + 8) * 2.0 ** -23
        order = (k * (gn * r64 + dot * r64.pow(3) / groups[1] * hg.abs())).flatten(-2)
        floor = order if floor is None else floor + order
    assert_dx_close(dx, dxr, x.dtype, dx64, floor)
    if g is not None:
        assert dg.dtype == g.dtype
        assert_dx_close(dg, dgr, g.dtype, dg64)
    if w is not None:
        # dw against eager's own formula given our rstd (the same rounded terms; only the FP32
        # summation order differs): within 1 ULP + 4 eps32 * sum |terms|
        xv, gv = x.unflatten(-1, groups), None if g is None else g.unflatten(-1, groups)
        _, rstd = R.launch._form_forward_impl(xv, w, gv, eps, form)
        assert rstd.shape == xv.shape[:-1]  # one per (row, group)

        def eager(a, b, c):
            return R.reference._form_eager(a.unflatten(-1, groups), b.view(groups), eps, form,
                                           None if c is None else c.unflatten(-1, groups), rstd[..., None]).flatten(-2)

        _, _, dw_inj, _ = _grads(eager, x, w, g, dy)
        h = xv.double() * (_ACT[form.act](gv.double()) if form.gate == "before" and g is not None else 1)
        s = _ACT[form.act](gv.double()).abs() if form.gate == "after" else 1
        terms = (dy.unflatten(-1, groups).double().abs() * s * (h * rstd[..., None].double()).abs())
        terms = terms.reshape(-1, x.shape[-1]).sum(0)
        assert dw.dtype == w.dtype
        # a gate's activation: our exp and CUDA's differ by a few FP32 ULP per term
        k = 8 if form.gate != "none" else 4
        k = k + 2 * math.log2(max(2, x.numel() // x.shape[-1]))  # and both sums' order over the rows
        bound = ulp(torch.maximum(dw.double().abs(), dw_inj.double().abs()), w.dtype) + k * 2.0 ** -24 * terms
        nd = R.reference._form_dtypes(form, x.dtype, w.dtype)[0]
        n64 = h * rstd[..., None].double()
        if nd != torch.float32:
            # the normalized value before its half-precision rounding differs in its last FP32 bits
            # (rstd against eager's rsqrt; the gated input's activation), so it rounds to the other
            # neighbour where it lies that close to a rounding midpoint: one ULP of it times the
            # gradient it meets (dy, times act(gate) for a gate after the weight)
            u, close = _near_midpoint(n64, nd)
            bound = bound + (dy.unflatten(-1, groups).double().abs() * s * u * close).reshape(-1, x.shape[-1]).sum(0)
        if flip_dp is not None:
            bound = bound + (n64.abs() * flip_dp.unflatten(-1, groups)).reshape(-1, x.shape[-1]).sum(0)
        d = (dw.double() - dw_inj.double()).abs()
        assert (d <= bound).all(), f"dw off by {(d / bound).max().item()} of the bound"
        rel = (dw.double() - dw64).norm() / dw64.norm().clamp_min(1e-30)
        tol = 1e-5 if x.dtype == w.dtype == torch.float32 else 1e-2  # a half-precision rounding in the chain
        assert rel < tol, f"dw vs float64: {rel.item():.3g}"
    return y, dx, dw, dg


# ---- the op ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,wdtype", [(torch.float32, torch.float32), (torch.float16, torch.float16),
                                          (torch.float16, torch.float32)])
@pytest.mark.parametrize("shape", [(7, 40), (2, 3, 128)])
def test_input_scaled_form(interpret, dtype, wdtype, shape):
    """MuseSpark's input-scaled norm, ``norm((x.float() * (1 + w).float()).type_as(x))``: its scale
    is eager's own torch ops (so its rounding and the weight's gradient sum are eager's), its norm
    the unweighted form's kernels (no fallback); output and gradients against the eager formula
    and float64."""
    f = R.FORMS["input_scaled"]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=g).to(interpret, dtype)
    w = (0.1 * torch.randn(shape[-1], generator=g)).to(interpret, wdtype)
    dy = torch.randn(shape, generator=g).to(interpret, dtype)
    assert R.form_output_dtype(f, dtype, wdtype) == dtype
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the kernels ran
        y, dx, dw, _ = _grads(lambda a, b, c: R.fused_rms_norm_form(a, b, EPS, f), x, w, None, dy)
    yr, dxr, dwr, _ = _grads(lambda a, b, c: R.rms_norm_form_reference(a, b, EPS, f), x, w, None, dy)

    def oracle(a, b, c):
        h = a * (1.0 + b)
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)

    y64, dx64, dw64, _ = _grads(oracle, x, w, None, dy, torch.float64)
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == wdtype
    # the scaled input is eager's bit for bit: the unweighted kernels' result on it is the form's
    u = (x.float() * (1.0 + w).float()).type_as(x)
    assert torch.equal(y, R.fused_rms_norm_form(u, None, EPS, "unweighted"))
    _assert_y(y, yr, y64)
    for a, b, c in ((dx, dxr, dx64), (dw, dwr, dw64)):
        rel = (a.double() - b.double()).norm() / b.double().norm()
        rel64 = (a.double() - c).norm() / c.norm()
        assert rel < (1e-5 if a.dtype == torch.float32 else 3e-3), rel
        assert rel64 < (1e-5 if dtype == wdtype == torch.float32 else 1e-2), rel64


def test_input_scaled_form_checks(interpret):
    f = R.FORMS["input_scaled"]
    x = torch.randn(3, 8, device=interpret)
    with pytest.raises(ValueError, match="needs a weight"):
        R.fused_rms_norm_form(x, None, EPS, f)
    with pytest.raises(ValueError, match="no gate"):
        R.fused_rms_norm_form(x, torch.zeros(8, device=interpret), EPS, f, torch.randn(3, 8, device=interpret))
    with pytest.raises(ValueError, match="input_scaled"):
        R.fused_rms_norm_form(x, torch.zeros(8, device=interpret), EPS, R.RMSForm(weight="input_scaled"))
    x64 = x.double()
    reset_fallback_warnings()
    with pytest.warns(RuntimeWarning, match="float64"):
        y = R.fused_rms_norm_form(x64, torch.zeros(8, dtype=torch.float64, device=interpret), EPS, f)
    assert torch.equal(y, R.rms_norm_form_reference(x64, torch.zeros(8, dtype=torch.float64, device=interpret),
                                                    EPS, f))

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
    assert not R.plans._fwd_config(5, 130, 2, 1)[2] and not R.plans._bwd_config(5, 130)[2]
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
    plan = next(iter(R.plans._form_bwd_plans.values()))
    assert plan.const["FINISH"] == (2 if col else 0) and (plan.red is None) == col


@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("form", FORM_NAMES)
def test_form_poisoned_outputs_are_fully_written(interpret, tune, form, loop):
    if loop:
        tune(_MAX_FWD_BLOCK=32, _MAX_BWD_BLOCK=32, _LOOP_BLOCK=16)
    f = R.FORMS[form]
    x, w, g, dy = form_inputs(f, (37, 40), torch.float16, seed=8, device=interpret)
    y0, r0 = R.launch._form_forward_impl(x, w, g, EPS, f)
    y, r = torch.full_like(y0, float("nan")), torch.full_like(r0, float("nan"))
    R.launch._form_forward_impl(x, w, g, EPS, f, y=y, rstd=r)
    assert torch.equal(y, y0) and torch.equal(r, r0) and not y.isnan().any()
    dx0, dw0, dg0 = R.launch._form_backward_impl(dy, x, w, g, r0, f)
    nan = (lambda t: None if t is None else torch.full_like(t, float("nan")))
    dx, dw, dg = nan(dx0), nan(dw0), nan(dg0)
    R.launch._form_backward_impl(dy, x, w, g, r0, f, dx=dx, dw=dw, dg=dg)
    for a, b in ((dx, dx0), (dw, dw0), (dg, dg0)):
        assert (a is None and b is None) or (torch.equal(a, b) and not a.isnan().any())


def test_form_strided_rows_without_copy(interpret):
    # Gemma-style q/k norms on a slice of a fused projection viewed as [B, S, heads, head_dim]
    B, S, H, hd = 2, 3, 4, 16
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, S, 3 * H * hd, generator=gen).to(interpret)
    q = qkv[..., : H * hd].view(B, S, H, hd)
    assert not q.is_contiguous() and R.plans._row_layout(q) is not None
    f = R.FORMS["offset"]
    w = (0.1 * torch.randn(hd, generator=gen)).to(interpret)
    dy = torch.randn(B, H, S, hd, generator=gen).to(interpret).transpose(1, 2)
    check_form(f, q, w, None, dy)
    key = next(iter(R.plans._form_fwd_plans))
    assert not R.plans._form_fwd_plans[key].copy  # no copy of x


# ---- grouped statistics (group_size): Mamba2's gated norm, Qwen4's grouped norm, Falcon-H1's n_groups ----
_GROUPED_FORMS = ["gate_first", "offset", "weight_first", "gated_weight_first", "llama", "unweighted", "t5",
                  "unweighted_rstd_cast"]
_FALCON_BEFORE = R.RMSForm(norm_cast="none", weight="plain", gate="before", out_cast=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", _GROUPED_FORMS + ["falcon_before"])
@pytest.mark.parametrize("shape,gs", [((7, 32), 8), ((3, 5, 48), 16), ((6, 24), 8), ((9, 40), 4), ((4, 16), 16),
                                      ((0, 32), 8)])
def test_grouped_form_matches_eager(interpret, form, dtype, shape, gs):
    # powers of two (4 or 2 groups: the persistent backward) and not (3, 10 groups: the looping
    # backward); gs == width: the ungrouped path
    f = _FALCON_BEFORE if form == "falcon_before" else R.FORMS[form]
    x, w, g, dy = form_inputs(f, shape, dtype, seed=11, device=interpret)
    R.clear_plans()  # the plans checked below are this test's (also without --forked)
    check_form(f, x, w, g, dy, group_size=gs)
    if gs < shape[-1] and shape[0]:
        assert all(p is not R.plans.AS_LLAMA for p in R.plans._form_fwd_plans.values())  # the form kernels ran
        plan = next(p for k, p in R.plans._form_bwd_plans.items())
        assert plan.const["WG"] == (shape[-1] // gs if w is not None else 1)
        if w is not None:
            assert plan.ws_numel % shape[-1] == 0  # partial rows span the weight's width


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("form", ["gate_first", "offset", "falcon_before"])
def test_grouped_form_wide_groups_loop(interpret, tune, form, dtype):
    # groups wider than a block: the looping kernels (forward and backward), several programs
    tune(_MAX_FWD_BLOCK=16, _MAX_BWD_BLOCK=16, _LOOP_BLOCK=16)
    f = _FALCON_BEFORE if form == "falcon_before" else R.FORMS[form]
    x, w, g, dy = form_inputs(f, (11, 160), dtype, seed=12, device=interpret)
    check_form(f, x, w, g, dy, group_size=40)
    plan = next(iter(R.plans._form_bwd_plans.values()))
    assert plan.kernel is R.kernels._rms_bwd_loop_form_kernel and plan.progs > 1


@pytest.mark.parametrize("col", [True, False])
def test_grouped_weight_gradient_sums(interpret, tune, col):
    # the weight-gradient sum over the full width by the last programs' column strips, or by its own
    # launch (many programs, a tail too long for the two-level sum)
    tune(_MAX_TAIL_BYTES=0, _SMALL_ELEMS=0, _COL_FINISH=col, _INTERPRET_PROGRAMS=5, _BWD_TILE_ELEMS=64)
    f = R.FORMS["gate_first"]
    x, w, g, dy = form_inputs(f, (40, 64), torch.float32, seed=13, device=interpret)
    check_form(f, x, w, g, dy, group_size=16)
    plan = next(iter(R.plans._form_bwd_plans.values()))
    # grouped by weight row: 5 programs per weight row, their partials 5 rows of the weight's width
    per_row = 4 if R.plans._GROUPED_BY_WEIGHT_ROW else 1
    assert plan.const["FINISH"] == (2 if col else 0) and (plan.red is None) == col and plan.progs == 5 * per_row
    assert plan.const["WG"] == 4 and plan.ws_numel % 64 == 0 and (not col or plan.ws_numel == 5 * 64)


@pytest.mark.parametrize("finish", [1, 2, 0])
@pytest.mark.parametrize("form", ["gate_first", "offset", "gated"])
def test_grouped_by_weight_row(interpret, tune, form, finish):
    # one weight row per program (_GROUPED_BY_WEIGHT_ROW): 3 programs for each of the 4 weight rows,
    # 10 tiles of 4 rows for each (37 rows: the last tile holds one), the weight-gradient sum by
    # groups in the launch, by column strips, or by its own launch. dx and the gate's gradient
    # are bitwise those of the tiles of WG rows (the same rows' math); the weight gradient sums
    # the same terms in another order
    knobs = dict(_BWD_TILE_ELEMS=64, _BWD_GATED_TILE_ELEMS=64)
    if finish != 1:
        knobs.update(_MAX_TAIL_BYTES=0, _SMALL_ELEMS=0, _COL_FINISH=finish == 2)
    f = R.FORMS[form]
    x, w, g, dy = form_inputs(f, (37, 64), torch.float32, seed=17, device=interpret)
    out = {}
    for by_row in (True, False):
        tune(_GROUPED_BY_WEIGHT_ROW=by_row, **knobs)
        if by_row:
            check_form(f, x, w, g, dy, group_size=16)
        plan = next(iter(R.plans._form_bwd_plans.values())) if by_row else None
        out[by_row] = _grads(lambda a, b, c: R.fused_rms_norm_form(a, b, EPS, f, c, group_size=16), x, w, g, dy)
        if plan is not None:
            assert plan.kernel is R.kernels._rms_bwd_form_kernel and plan.const["WROW"]
            assert plan.const["WG"] == 4 and plan.const["BLOCK_R"] == 4 and plan.const["FINISH"] == finish
            if interpret == "cpu":
                assert plan.progs == 12 and plan.ints[2] == 10  # programs; tiles of one weight row
    (y1, dx1, dw1, dg1), (y0, dx0, dw0, dg0) = out[True], out[False]
    assert torch.equal(y1, y0) and torch.equal(dx1, dx0) and (dg1 is None) == (g is None)
    assert dg1 is None or torch.equal(dg1, dg0)
    torch.testing.assert_close(dw1, dw0, rtol=1e-6, atol=1e-6)
    tune(_GROUPED_BY_WEIGHT_ROW=True, **knobs)  # the weight gradient's sum is repeatable
    assert torch.equal(_grads(lambda a, b, c: R.fused_rms_norm_form(a, b, EPS, f, c, group_size=16), x, w, g, dy)[2],
                       dw1)


@pytest.mark.parametrize("loop", [False, True])
@pytest.mark.parametrize("form", ["gate_first", "offset", "falcon_before", "unweighted"])
def test_grouped_poisoned_outputs_are_fully_written(interpret, tune, form, loop):
    if loop:
        tune(_MAX_FWD_BLOCK=8, _MAX_BWD_BLOCK=8, _LOOP_BLOCK=8)
    f = _FALCON_BEFORE if form == "falcon_before" else R.FORMS[form]
    x, w, g, dy = form_inputs(f, (37, 40), torch.float16, seed=14, device=interpret)
    groups = (4, 10)
    x, g, dy = (None if t is None else t.unflatten(-1, groups) for t in (x, g, dy))
    y0, r0 = R.launch._form_forward_impl(x, w, g, EPS, f)
    assert r0.shape == (37, 4)
    y, r = torch.full_like(y0, float("nan")), torch.full_like(r0, float("nan"))
    R.launch._form_forward_impl(x, w, g, EPS, f, y=y, rstd=r)
    assert torch.equal(y, y0) and torch.equal(r, r0) and not y.isnan().any()
    dx0, dw0, dg0 = R.launch._form_backward_impl(dy, x, w, g, r0, f)
    nan = (lambda t: None if t is None else torch.full_like(t, float("nan")))
    dx, dw, dg = nan(dx0), nan(dw0), nan(dg0)
    R.launch._form_backward_impl(dy, x, w, g, r0, f, dx=dx, dw=dw, dg=dg)
    for a, b in ((dx, dx0), (dw, dw0), (dg, dg0)):
        assert (a is None and b is None) or (torch.equal(a, b) and not a.isnan().any())
    if w is not None:
        assert dw.shape == (40,)


def test_grouped_strided_inputs(interpret):
    # x and the gate as slices of one fused projection ([B, S, 2 * N]), rows strided: no copy of x;
    # a transposed incoming gradient
    B, S, N, gs = 2, 3, 48, 16
    gen = torch.Generator().manual_seed(15)
    zx = torch.randn(B, S, 2 * N, generator=gen).to(interpret)
    g, x = zx[..., :N], zx[..., N:]
    assert not x.is_contiguous()
    w = (1.0 + 0.1 * torch.randn(N, generator=gen)).to(interpret)
    dy = torch.randn(S, B, N, generator=gen).to(interpret).transpose(0, 1)
    f = R.FORMS["gate_first"]
    check_form(f, x, w, g, dy, group_size=gs)  # the numerics (on contiguous copies)
    R.clear_plans()
    zl, wl = zx.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    y = R.fused_rms_norm_form(zl[..., N:], wl, EPS, f, zl[..., :N], group_size=gs)
    fplan = next(iter(R.plans._form_fwd_plans.values()))
    assert not fplan.copy and fplan.gate_copy  # x addressed in place; the gate (read like y) copied
    y.backward(dy)
    yc, dxc, dwc, dgc = _grads(lambda a, b, c: R.fused_rms_norm_form(a, b, EPS, f, c, group_size=gs),
                               x.contiguous(), w, g.contiguous(), dy.contiguous())
    assert torch.equal(y, yc) and torch.equal(zl.grad[..., N:], dxc) and torch.equal(zl.grad[..., :N], dgc)
    assert torch.equal(wl.grad, dwc)
    # a strided weight (every other element of a buffer)
    wbuf = torch.randn(2 * N, generator=gen).to(interpret)
    check_form(R.FORMS["offset"], x, wbuf[::2], None, dy, group_size=gs)


def test_grouped_bad_group_sizes_raise(interpret):
    f = R.FORMS["gate_first"]
    x, w, g, _ = form_inputs(f, (3, 24), torch.float32, device=interpret)
    for bad, err in ((0, ValueError), (-8, ValueError), (5, ValueError), (48, ValueError), (8.0, TypeError),
                     (True, TypeError), ("8", TypeError)):
        with pytest.raises(err, match="group_size"):
            R.fused_rms_norm_form(x, w, EPS, f, g, group_size=bad)
        with pytest.raises(err, match="group_size"):
            R.try_fused_rms_norm_form(x, w, EPS, f, g, group_size=bad)
    with pytest.raises(ValueError, match="group_size"):
        R.rms_norm_form_reference(x, w, EPS, f, g, group_size=5)
    with pytest.raises(ValueError, match="weight must have shape"):  # the weight spans the whole width
        R.fused_rms_norm_form(x, w[:8], EPS, f, g, group_size=8)
    with pytest.raises(ValueError, match="gate must have"):
        R.fused_rms_norm_form(x, w, EPS, f, g[:, :8], group_size=8)


def test_grouped_fallback_warns_and_runs_reference(interpret):
    reset_fallback_warnings()
    f = R.FORMS["gate_first"]
    x, w, g, _ = form_inputs(f, (3, 24), torch.float64, device=interpret)
    with pytest.warns(RuntimeWarning, match="float64"):
        y = R.fused_rms_norm_form(x, w, EPS, f, g, group_size=8)
    torch.testing.assert_close(y, R.rms_norm_form_reference(x, w, EPS, f, g, 8), rtol=0, atol=0)
    assert R.try_fused_rms_norm_form(x, w, EPS, f, g, group_size=8) is None
    # the reference takes the statistics per group
    y1 = R.rms_norm_form_reference(x, w, EPS, f, g, 24)
    assert not torch.allclose(y, y1)


def test_grouped_custom_op_and_compile(interpret):
    f = R.FORMS["gate_first"]
    x, w, g, dy = form_inputs(f, (4, 32), torch.float32, seed=16, device=interpret)

    def fn(a, b, c):
        return R.fused_rms_norm_form(a, b, EPS, f, c, group_size=8)

    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    y, dx, dw, dg = _grads(compiled, x, w, g, dy)
    y_r, dx_r, dw_r, dg_r = _grads(fn, x, w, g, dy)
    for a, b in ((y, y_r), (dx, dx_r), (dw, dw_r), (dg, dg_r)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_forms_that_round_as_llama_run_the_llama_op(interpret, monkeypatch):
    calls = []
    real = R.try_fused_rms_norm
    monkeypatch.setattr(R.api, "try_fused_rms_norm", lambda *a: calls.append(1) or real(*a))
    x, w, _, dy = form_inputs(R.FORMS["t5"], (4, 24), torch.float16, device=interpret)
    torch.testing.assert_close(R.fused_rms_norm_form(x, w, EPS, "t5"), R.fused_rms_norm(x, w, EPS), rtol=0, atol=0)
    assert len(calls) == 2  # T5 with a weight of the input's half dtype is the Llama form
    y = R.fused_rms_norm_form(x, w, EPS, "gate_first", None)  # the Mamba2 form without a gate
    assert len(calls) == 3 and torch.equal(y, R.fused_rms_norm(x, w, EPS))
    R.fused_rms_norm_form(x, w.float(), EPS, "t5")
    assert len(calls) == 4 or len(calls) == 3  # fp32 weight: T5 keeps FP32 (its own kernel)
    assert R.plans._form_consts(R.FORMS["t5"], torch.float16, torch.float32, False) is not None


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
    torch.library.opcheck(R.api._rms_norm_form_fwd, (x, w.requires_grad_(), g, EPS, R.reference._form_code(f)),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    w = w.detach()
    rstd = R.launch._form_forward_impl(x, w, g, EPS, f)[1]
    torch.library.opcheck(R.api._rms_norm_form_bwd, (dy, x, w, g, rstd, R.reference._form_code(f)),
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


# ---- recognition and the installer on transformers' own classes ----------------------------------
# (model, class, template) of transformers' RMSNorm-like classes: two of each template where there
# are two; the docs' table (docs/rms_norm.md) lists every class of transformers 5.24.
RECOGNISED = [
    ("llama", "LlamaRMSNorm", "llama"), ("glm4", "Glm4RMSNorm", "llama"),
    ("llama4", "Llama4TextRMSNorm", "llama4"), ("cpmant", "CpmAntLayerNorm", "cpmant"),
    ("gemma3", "Gemma3RMSNorm", "gemma"), ("qwen3_next", "Qwen3NextRMSNorm", "gemma"),
    ("qwen3_5", "Qwen3_5RMSNorm", "gemma"), ("vaultgemma", "VaultGemmaRMSNorm", "gemma"),
    ("muse_spark", "MuseSparkTextCenteredRMSNorm", "centered"),
    ("muse_spark", "MuseSparkTextInputScaledRMSNorm", "input_scaled"),  # the weight before the statistics
    ("gpt_oss", "GptOssRMSNorm", "olmo2"), ("olmo2", "Olmo2RMSNorm", "olmo2"), ("olmo3", "Olmo3RMSNorm", "olmo2"),
    ("flex_olmo", "FlexOlmoRMSNorm", "olmo2"), ("afmoe", "AfmoeRMSNorm", "olmo2"),
    ("deepseek_v4", "DeepseekV4RMSNorm", "olmo2"),
    ("helium", "HeliumRMSNorm", "helium"), ("nemotron_h", "NemotronHRMSNorm", "helium"),
    ("moshi", "MoshiRMSNorm", "moshi"), ("gemma3n", "Gemma3nRMSNorm", "gemma3n"),
    ("gemma4", "Gemma4RMSNorm", "gemma3n"), ("ergo", "ErgoRMSNorm", "ergo"),  # torch's F.rms_norm in FP32
    ("t5", "T5LayerNorm", "t5"), ("idefics", "IdeficsRMSNorm", "t5"),
    ("falcon_mamba", "FalconMambaWeightlessRMSNorm", "unweighted"), ("llama4", "Llama4TextL2Norm", "unweighted"),
    ("inkling2", "Inkling2UnweightedRMSNorm", "unweighted_square"),
    ("deepseek_v4", "DeepseekV4UnweightedRMSNorm", "rstd_cast"),
    ("qwen3_next", "Qwen3NextRMSNormGated", "gated"), ("qwen3_5", "Qwen3_5RMSNormGated", "gated"),
    ("kimi_linear", "KimiLinearRMSNormGated", "gated_weight_first"),
    ("bailing_hybrid", "BailingHybridRMSNormGated", "gated_weight_first"),
    ("mamba2", "MambaRMSNormGated", "gate_first"), ("granitemoehybrid", "GraniteMoeHybridRMSNormGated", "gate_first"),
    ("nemotron_h", "NemotronHRMSNormGated", "gate_first"), ("bamba", "BambaRMSNormGated", "gate_first"),
    ("zamba2", "Zamba2RMSNormGated", "gate_first"),
    ("qwen4_exp", "Qwen4ExpTextRMSNorm", "grouped_offset"),  # optional group statistics in its _norm
    ("falcon_h1", "FalconH1RMSNormGated", "n_groups_gated"),  # n_groups, the gate's place set by a flag
    ("xlstm", "xLSTMRMSNorm", "optional_weight_bias"),  # optional weight and bias, two helper methods
]
# RMSNorm-like classes whose math is none of the forms: left eager
NOT_RECOGNISED = [
    ("dory", "DoryL2Norm"),  # a sum, not a mean
    ("gradium_phonon_tts", "GradiumPhononTTSTimestepNorm"),  # statistics in the input's dtype
    ("hy_v4", "HYV4UnweightedRMSNorm"),  # returns rstd only
    ("cohere", "CohereLayerNorm"),  # subtracts the mean
]


def _import(model, name):
    """The class, or None where the installed transformers has no such family or class (the GPU
    machine's transformers is older than CI's)."""
    import importlib

    try:
        return getattr(importlib.import_module(f"transformers.models.{model}.modeling_{model}"), name)
    except (ImportError, AttributeError):
        return None


# imported once at collection, so that forked tests do not import them again each
_CLASSES = {(m, n): _import(m, n) for m, n, *_ in RECOGNISED + NOT_RECOGNISED}


def _cls(model, name):
    cls = _CLASSES[(model, name)]
    if cls is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model}.{name}")
    return cls


@pytest.mark.parametrize("model,name,template", RECOGNISED)
def test_transformers_classes_are_recognised(model, name, template):
    spec = F.recognise(_cls(model, name))
    assert spec is not None and spec.template == template, spec


@pytest.mark.parametrize("model,name", NOT_RECOGNISED)
def test_other_math_is_not_recognised(model, name):
    assert F.recognise(_cls(model, name)) is None


def _instance(model, name, n, **kw):
    cls = _cls(model, name)
    if name == "CpmAntLayerNorm":
        from transformers import CpmAntConfig

        return cls(CpmAntConfig(hidden_size=n, eps=1e-6))
    if name in ("Llama4TextL2Norm", "Inkling2UnweightedRMSNorm", "DeepseekV4UnweightedRMSNorm"):
        return cls(1e-6)
    if name == "ErgoRMSNorm":  # eps has no default
        return cls(n, kw.pop("eps", 1e-6), **kw)
    if "group_size" in str(__import__("inspect").signature(cls.__init__)):
        return cls(n, group_size=kw.pop("group_size", n))
    return cls(n, **kw)


def _randomize(m, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in m.parameters():
            base = 0.0 if float(p.detach().float().abs().max()) == 0 else 1.0  # zero-centred (Gemma) weights
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
    return m


def _module_step(m, x, gate, dy):
    x = x.detach().clone().requires_grad_()
    gate = None if gate is None else gate.detach().clone().requires_grad_()
    y = m(x) if gate is None else m(x, gate)
    y.backward(dy)
    grads = [x.grad] + ([gate.grad] if gate is not None else []) + [p.grad for p in m.parameters()]
    return y.detach(), grads


def _close(a, b, dtype):
    assert a.dtype == b.dtype and a.shape == b.shape
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    else:
        rel = (a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)
        assert rel < 2e-3, f"relative error {rel.item():.3g}"


def _close_row_sum(a, b, terms):
    """fp32 gradients that are sums of ``terms`` over the leading dimensions, added in another order
    by the kernel than by eager: apart by at most n * eps * sum(|term|) per element (the standard bound
    of a recursive sum of n terms, for each of the two), where a fixed atol would fail on columns whose
    terms cancel."""
    terms = terms.reshape(-1, terms.shape[-1]).abs().double()
    n = terms.shape[0]
    bound = 2 * n * torch.finfo(torch.float32).eps * terms.sum(0) + 1e-30
    diff = (a.double() - b.double()).abs()
    assert a.dtype == b.dtype and a.shape == b.shape
    assert bool((diff <= bound).all()), f"max excess {(diff / bound).max().item():.3g} x the bound"


def _step_matches_eager(m, ref, x, gate, g, dtype):
    """A training step of the patched module ``m`` (its kernels, no fallback) against its unpatched
    copy ``ref``: output and every gradient (input, gate, parameters); ``g`` draws the output's
    gradient."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback: the kernels ran
        y_r = ref(x) if gate is None else ref(x, gate)
        dy = torch.randn(y_r.shape, generator=g).to(x.device, y_r.dtype)
        y, grads = _module_step(m, x, gate, dy)
    y_r, grads_r = _module_step(ref, x, gate, dy)
    _close(y, y_r, dtype)
    assert len(grads) == len(grads_r)
    for a, b in zip(grads, grads_r):
        _close(a, b, dtype)


_GATED = {"gated", "gated_weight_first", "gate_first", "n_groups_gated"}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("model,name,template", [r for r in RECOGNISED if r[2] != "llama"])
def test_installed_class_matches_its_own_eager_forward(interpret, model, name, template, dtype):
    n = 24
    m = _randomize(_instance(model, name, n)).to(interpret, dtype)
    ref = copy.deepcopy(m)
    rep = F.RmsNormFeature().apply(torch.nn.ModuleList([m]), None, F.RmsNormConfig(enabled=True))
    assert rep.details["replaced"] == {type(m).__name__: 1}, rep  # the class's own name (5.25: an alias's)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, n, generator=g).to(interpret, dtype)
    gate = torch.randn(5, 3, n, generator=g).to(interpret, dtype) if template in _GATED else None
    _step_matches_eager(m, ref, x, gate, g, dtype)


def test_torch_rmsnorm_modules(interpret, monkeypatch):
    calls = []
    real = FP.try_fused_rms_norm_form
    monkeypatch.setattr(FP, "try_fused_rms_norm_form", lambda *a: calls.append(a[3]) or real(*a))
    mods = torch.nn.ModuleList([torch.nn.RMSNorm(16), torch.nn.RMSNorm(16, eps=1e-5, elementwise_affine=False),
                                torch.nn.RMSNorm(16, eps=None), torch.nn.RMSNorm((4, 16))]).to(interpret)
    _randomize(mods)
    ref = copy.deepcopy(mods)
    rep = F.RmsNormFeature().apply(mods, None, F.RmsNormConfig(enabled=True))
    assert rep.details["replaced"] == {"RMSNorm": 3}
    assert rep.details["skipped"] == {"normalized over more than the last dimension": {"RMSNorm": 1}}
    x = torch.randn(3, 4, 16, device=interpret)
    for m, r in zip(mods[:3], ref[:3]):
        dy = torch.randn_like(x)
        y, grads = _module_step(m, x, None, dy)
        y_r, grads_r = _module_step(r, x, None, dy)
        _close(y, y_r, torch.float32)
        _close(grads[0], grads_r[0], torch.float32)
        for a, b in zip(grads[1:], grads_r[1:]):  # the weight's gradient: a sum over the 12 rows
            _close_row_sum(a, b, dy * x * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-6).float())
    assert calls == [R.FORMS["weight_first_fp32"], R.FORMS["unweighted"], R.FORMS["weight_first_fp32"]]


def test_per_instance_conditions_run_eager_with_a_reason(interpret, monkeypatch):
    reset_fallback_warnings()
    grouped = _instance("mamba2", "MambaRMSNormGated", 32, group_size=12).to(interpret)  # does not divide 32
    one = _instance("mamba2", "MambaRMSNormGated", 32).to(interpret)
    gated = _instance("qwen3_next", "Qwen3NextRMSNormGated", 32).to(interpret)
    gelu = _instance("qwen3_next", "Qwen3NextRMSNormGated", 32).to(interpret)
    gelu.activation = "gelu"
    mods = torch.nn.ModuleList([grouped, one, gated, gelu])
    ref = copy.deepcopy(mods)
    rep = F.RmsNormFeature().apply(mods, None, F.RmsNormConfig(enabled=True))
    assert rep.details["replaced"] == {"MambaRMSNormGated": 1, "Qwen3NextRMSNormGated": 1}
    assert rep.details["skipped"] == {
        "group_size is not a positive divisor of the weight's width 32": {"MambaRMSNormGated": 1},
        "gate activation 'gelu' (the op takes silu and sigmoid)": {"Qwen3NextRMSNormGated": 1}}
    calls = []
    real = FP.try_fused_rms_norm_form
    monkeypatch.setattr(FP, "try_fused_rms_norm_form", lambda *a: calls.append(a[3]) or real(*a))
    x, gt = torch.randn(2, 32, device=interpret), torch.randn(2, 32, device=interpret)
    # one group: with a gate (positional or keyword) and without (no gating)
    for args, kw in (((gt,), {}), ((), {"gate": gt}), ((), {})):
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            y = one(x, *args, **kw)
        torch.testing.assert_close(y, ref[1](x, *args, **kw), rtol=1e-5, atol=1e-6)
    assert calls == [R.FORMS["gate_first"]] * 3
    with pytest.raises(RuntimeError):  # not replaced: eager (which cannot view 32 columns as groups of 12)
        grouped(x, gt)
    gated.activation = "relu"  # changed after installation: eager, with a warning
    with pytest.warns(RuntimeWarning, match="gate activation 'relu'"):
        gated(x, gt)
    assert len(calls) == 3


# grouped norms and xLSTM's: (model, class, constructor keywords, input shape, gated)
GROUPED_INSTANCES = [
    ("mamba2", "MambaRMSNormGated", dict(group_size=8), (2, 3, 32), True),  # 4 groups: the persistent kernels
    ("mamba2", "MambaRMSNormGated", dict(group_size=8), (5, 24), True),  # 3 groups: the looping backward
    ("nemotron_h", "NemotronHRMSNormGated", dict(group_size=16), (2, 3, 64), True),
    ("bamba", "BambaRMSNormGated", dict(group_size=8), (4, 32), False),  # called without a gate
    ("zamba2", "Zamba2RMSNormGated", dict(group_size=4), (3, 16), True),
    ("granitemoehybrid", "GraniteMoeHybridRMSNormGated", dict(group_size=8), (3, 32), True),
    ("qwen4_exp", "Qwen4ExpTextRMSNorm", dict(group_size=8), (2, 3, 32), False),
    ("qwen4_exp", "Qwen4ExpTextRMSNorm", dict(group_size=None), (2, 3, 32), False),
    ("falcon_h1", "FalconH1RMSNormGated", dict(n_groups=4), (2, 3, 32), True),  # the gate after
    ("falcon_h1", "FalconH1RMSNormGated", dict(n_groups=4, norm_before_gate=False), (2, 3, 32), True),
    ("falcon_h1", "FalconH1RMSNormGated", dict(n_groups=2, norm_before_gate=False), (5, 24), True),  # 2-D
    ("falcon_h1", "FalconH1RMSNormGated", dict(n_groups=3), (2, 3, 24), False),
    ("falcon_h1", "FalconH1RMSNormGated", dict(n_groups=1, norm_before_gate=False), (2, 3, 24), True),
    ("xlstm", "xLSTMRMSNorm", {}, (2, 3, 24), False),
    ("xlstm", "xLSTMRMSNorm", dict(use_weight=False), (2, 3, 24), False),
    ("xlstm", "xLSTMRMSNorm", dict(force_float32_reductions=False), (2, 3, 24), False),  # the same at FP32
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", range(len(GROUPED_INSTANCES)))
def test_grouped_and_xlstm_classes_match_their_eager_forward(interpret, monkeypatch, case, dtype):
    model, name, kw, shape, gated = GROUPED_INSTANCES[case]
    if dtype == torch.float16 and kw.get("force_float32_reductions") is False:
        pytest.skip("FP16 statistics: eager (test_grouped_and_xlstm_conditions)")
    m = _randomize(_cls(model, name)(shape[-1], **kw)).to(interpret, dtype)
    ref = copy.deepcopy(m)
    rep = F.RmsNormFeature().apply(torch.nn.ModuleList([m]), None, F.RmsNormConfig(enabled=True))
    assert rep.details["replaced"] == {name: 1}, rep
    calls = []
    real = FP.try_fused_rms_norm_form
    monkeypatch.setattr(FP, "try_fused_rms_norm_form", lambda *a: calls.append(a) or real(*a))
    g = torch.Generator().manual_seed(2)
    x = torch.randn(shape, generator=g).to(interpret, dtype)
    gate = torch.randn(shape, generator=g).to(interpret, dtype) if gated else None
    y_r = ref(x) if gate is None else ref(x, gate)
    dy = torch.randn(y_r.shape, generator=g).to(interpret, y_r.dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no fallback: the kernels ran
        y, grads = _module_step(m, x, gate, dy)
    assert len(calls) == 1 and m.__dict__[F.CALLS].fused == 1
    size = kw.get("group_size", shape[-1] // kw.get("n_groups", 1))
    assert (calls[0][5] if len(calls[0]) > 5 else None) == (None if size in (None, shape[-1]) else size)
    y_r, grads_r = _module_step(ref, x, gate, dy)
    _close(y, y_r, dtype)
    assert len(grads) == len(grads_r) == 1 + gated + len(list(m.parameters()))
    for a, b in zip(grads, grads_r):
        _close(a, b, dtype)


def test_grouped_and_xlstm_conditions(interpret):
    reset_fallback_warnings()
    x_lstm = _cls("xlstm", "xLSTMRMSNorm")
    falcon = _cls("falcon_h1", "FalconH1RMSNormGated")
    qwen4 = _cls("qwen4_exp", "Qwen4ExpTextRMSNorm")
    mods = torch.nn.ModuleList([x_lstm(16, use_bias=True), x_lstm(16, force_float32_reductions=False),
                                falcon(16, n_groups=3), falcon(16, n_groups=4), qwen4(16, group_size=8)])
    mods[4].group_size = 3  # changed after construction (the constructor checks it)
    mods = mods.to(interpret)
    _randomize(mods)
    rep = F.RmsNormFeature().apply(mods, None, F.RmsNormConfig(enabled=True))
    assert rep.details["replaced"] == {"xLSTMRMSNorm": 1, "FalconH1RMSNormGated": 1}
    assert rep.details["skipped"] == {
        "a bias added after the weight (x * w + b is not a form of the op)": {"xLSTMRMSNorm": 1},
        "n_groups is not a positive divisor of the weight's width 16": {"FalconH1RMSNormGated": 1},
        "group_size is not a positive divisor of the weight's width 16": {"Qwen4ExpTextRMSNorm": 1}}
    x16 = torch.randn(2, 3, 16, device=interpret).half()
    m = mods[1].half()
    ref = copy.deepcopy(m)
    ref.__dict__.pop(F.MARKER)
    with pytest.warns(RuntimeWarning, match="statistics in the input dtype"):
        y = m(x16)
    torch.testing.assert_close(y, ref(x16), rtol=0, atol=0)  # eager's own FP16 statistics
    assert m.__dict__[F.CALLS].eager == 1
    # Falcon-H1 takes [batch, width] or [batch, seq, width]: other inputs run its forward (which raises)
    fal = mods[3]
    with pytest.warns(RuntimeWarning, match="the module raises"):
        with pytest.raises(ValueError):
            fal(torch.randn(2, 2, 3, 16, device=interpret))


def test_match_forms_off_and_deprecated_key():
    from deepspeed_fused import parse_config

    cfg = parse_config({"rms_norm": {"enabled": True, "match_llama_form": False}})
    assert cfg.rms_norm.match_forms is False
    mods = torch.nn.ModuleList([_instance("gemma3", "Gemma3RMSNorm", 8), _instance("llama", "LlamaRMSNorm", 8)])
    rep = F.RmsNormFeature().apply(mods, None, cfg.rms_norm)
    assert rep.details["replaced"] == {"LlamaRMSNorm": 1}
    assert rep.details["skipped"] == {"not a supported class (match_forms is off)": {"Gemma3RMSNorm": 1}}


# ---- whole models of the forms' families: a training step patched vs eager ----------------------
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=257, max_position_embeddings=256, tie_word_embeddings=False)
FORM_MODELS = {
    "gemma3": ("Gemma3TextConfig", dict(head_dim=16, sliding_window=8), {"Gemma3RMSNorm": 13}),
    "olmo2": ("Olmo2Config", {}, {"Olmo2RMSNorm": 9}),
    "gpt_oss": ("GptOssConfig", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=8),
                {"GptOssRMSNorm": 5}),
    "qwen3_next": ("Qwen3NextConfig", dict(head_dim=16, linear_num_value_heads=4, linear_num_key_heads=2,
                                           linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                                           num_experts_per_tok=2, moe_intermediate_size=32,
                                           shared_expert_intermediate_size=32,
                                           layer_types=["linear_attention", "full_attention"]),
                   {"Qwen3NextRMSNormGated": 1, "Qwen3NextRMSNorm": 7}),
    "helium": ("HeliumConfig", dict(head_dim=16), {"HeliumRMSNorm": 5}),
    "llama4": ("Llama4TextConfig", dict(head_dim=16, num_local_experts=2, intermediate_size_mlp=128),
               {"Llama4TextL2Norm": 2, "Llama4TextRMSNorm": 5}),
    "deepseek_v4": ("DeepseekV4Config", {}, {"DeepseekV4RMSNorm": 11, "DeepseekV4UnweightedRMSNorm": 7}),
    # grouped statistics: 4 groups of 32 columns in the gated norms, Qwen4's hyper-connection norms
    # (groups of hidden_size); xLSTM's norm
    "mamba2": ("Mamba2Config", dict(num_heads=8, head_dim=16, expand=2, n_groups=4, state_size=16, chunk_size=8),
               {"Mamba2RMSNorm": 3, "MambaRMSNormGated": 2}),
    "nemotron_h": ("NemotronHConfig", dict(mamba_num_heads=8, mamba_head_dim=16, n_groups=4, ssm_state_size=16,
                                           chunk_size=8, hybrid_override_pattern="M*", head_dim=16),
                   {"NemotronHRMSNorm": 3, "NemotronHRMSNormGated": 1}),
    "falcon_h1": ("FalconH1Config", dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=4, mamba_d_state=16,
                                         mamba_chunk_size=8, mamba_rms_norm=True, head_dim=16, mamba_d_ssm=128,
                                         mamba_expand=2),
                  {"FalconH1RMSNormGated": 2, "FalconH1RMSNorm": 5}),
    "qwen4_exp": ("Qwen4ExpTextConfig", dict(head_dim=16, use_cache=False),
                  {"Qwen4ExpTextRMSNormGated": 2, "Qwen4ExpTextRMSNorm": 5}),
    "xlstm": ("xLSTMConfig", dict(embedding_dim=64, num_heads=4, num_blocks=2, use_cache=False), {"xLSTMRMSNorm": 5}),
}


# FORM_MODELS's class names as transformers 5.24 spells them -> later spellings of the same class
_LATER_NAMES = {"MambaRMSNormGated": ("Mamba2RMSNormGated", )}  # Mamba2's gated norm, renamed in 5.25


def replaced_names(model, expected: dict) -> dict:
    """``expected`` (a FORM_MODELS entry's class names -> counts) as the feature's report on ``model``
    names them with the installed transformers: by each class's own ``__name__`` (transformers 5.25
    makes ``Llama4TextL2Norm`` an alias of ``Llama4TextWeightlessRMSNorm``), under its later spelling
    where the model's module no longer has the name; a name found in neither stays as written."""
    import sys

    mod = sys.modules[type(model).__module__]
    out = {}
    for name, n in expected.items():
        for spelling in (name, ) + _LATER_NAMES.get(name, ()):
            cls = getattr(mod, spelling, None)
            if isinstance(cls, type):
                name = cls.__name__
                break
        out[name] = n
    return out


@pytest.mark.parametrize("family", sorted(FORM_MODELS))
def test_form_family_training_step_matches_eager(interpret, monkeypatch, family):
    import transformers

    cls_name, kw, expected = FORM_MODELS[family]
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = getattr(transformers, cls_name)(**{**_TINY, **kw})
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).to(interpret)
    _randomize(torch.nn.ModuleList([m for m in model.modules() if F.recognise(type(m)) is not None]))
    ref = copy.deepcopy(model)
    rep = F.RmsNormFeature().apply(model, None, F.RmsNormConfig(enabled=True))
    assert rep.details["replaced"] == replaced_names(model, expected) and not rep.details["skipped"], rep
    calls = []
    for name in ("try_fused_rms_norm", "try_fused_rms_norm_form"):
        real = getattr(FP, name)
        monkeypatch.setattr(FP, name, lambda *a, _real=real: calls.append(1) or _real(*a))
    ids = torch.randint(0, 257, (2, 6), generator=torch.Generator().manual_seed(1)).to(interpret)

    def step(m):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    module_calls = []
    for m in model.modules():
        if F.is_replaced(m):
            m.register_forward_hook(lambda *_: module_calls.append(1))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="deepspeed_fused", category=RuntimeWarning)  # no fallback
        loss, grads = step(model)
    n_fused = len(calls)
    assert n_fused == len(module_calls) > 0  # every call of a replaced module ran the op
    loss_r, grads_r = step(ref)
    assert len(calls) == n_fused
    torch.testing.assert_close(loss, loss_r, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_r.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], grads_r[k], rtol=1e-4, atol=1e-6, msg=k)


def test_bench_forms_smoke(interpret):
    """The suite's forms part runs on CPU (the kernels under the interpreter) and summarises."""
    from deepspeed_fused.bench import rms_norm as B

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        recs = B.run_forms("cpu", torch.float32, rep=2, native=False, quick=True)
    assert len(recs) == 16 and all(r.fwd_bwd_ms for r in recs), [(r.impl, r.note) for r in recs]
    assert {r.extra["form"] for r in recs} == {"offset", "gated", "weight_first", "gate_first"}
    assert sum("groups of 32" in r.shape for r in recs) == 4
    text = B._forms_summary(recs)
    assert text.count("\n| ") == 5  # the header's separator and one row per shape


def test_bench_forms_writes_its_own_files(interpret, tmp_path):
    """``bench rms_norm --forms`` names its files and command after the mode (the Llama suite's
    rms_norm.* are left alone)."""
    from deepspeed_fused.bench import rms_norm as B
    from deepspeed_fused.bench.__main__ import main

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert main(["rms_norm", "--forms", "--quick", "--out", str(tmp_path)]) == 0
    names = {p.name for p in tmp_path.iterdir()}  # the plot only where matplotlib is installed
    assert {"rms_norm_forms.json", "rms_norm_forms.md"} <= names <= {"rms_norm_forms.json", "rms_norm_forms.md",
                                                                      "rms_norm_forms.png"}
    assert "python -m deepspeed_fused.bench rms_norm --forms" in (tmp_path / "rms_norm_forms.md").read_text()
    B.RESULT = B.COMMAND = None


def test_form_dispatcher_counts_fused_and_eager_calls(interpret):
    from deepspeed_fused import patch_model

    mods = torch.nn.ModuleList([_instance("gemma3", "Gemma3RMSNorm", 16), _instance("qwen3_next",
                                                                                    "Qwen3NextRMSNormGated", 16)])
    calls = patch_model(mods, {"rms_norm": {"enabled": True}})["rms_norm"].calls
    x = torch.randn(2, 16, device=interpret)
    mods.to(interpret)
    mods[0](x)
    mods[1](x, x)
    assert (calls.fused, calls.eager) == (2, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mods[0](x.double())  # float64: the module's eager forward
        mods[1].activation = "gelu"
        mods[1](x, x)
    assert (calls.fused, calls.eager) == (2, 2)


def test_form_non_tensor_arguments_raise(interpret):
    x = torch.randn(4, 8, device=interpret)
    with pytest.raises(TypeError, match="weight must be a tensor"):
        R.fused_rms_norm_form(x, [1.0] * 8, EPS, "offset")
    with pytest.raises(TypeError, match="gate must be a floating-point tensor"):
        R.fused_rms_norm_form(x, torch.ones(8, device=interpret), EPS, "gated", [1.0])
    with pytest.raises(TypeError, match="hidden must be a tensor"):
        R.fused_rms_norm_form([1.0], None, EPS, "unweighted")


@pytest.mark.parametrize("form", FORM_NAMES)
def test_planned_constexprs_are_the_kernels_parameters(interpret, form):
    """Every keyword a plan hands a kernel is one of that kernel's parameters: Triton's interpreter
    ignores an unknown keyword, the GPU's launcher raises (the forward once got the backward's QRND)."""
    from deepspeed_fused.ops.rms_norm import kernels as K

    f = R.FORMS[form]
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 32, generator=gen).to(interpret).requires_grad_()
    w = None if f.weight == "none" else (0.1 * torch.randn(32, generator=gen)).to(interpret).requires_grad_()
    g = torch.randn(4, 32, generator=gen).to(interpret).requires_grad_() if f.gate != "none" else None
    R.clear_plans()
    y = R.fused_rms_norm_form(x, w, EPS, f, gate=g)
    y.backward(torch.randn(y.shape, generator=gen).to(interpret))
    fwd = list(R.plans._form_fwd_plans.values())
    bwd = list(R.plans._form_bwd_plans.values())
    if all(p is R.plans.AS_LLAMA for p in fwd + bwd):
        pytest.skip(f"{form} rounds as the Llama form at fp32: the Llama op ran")
    names = lambda k: set(getattr(k, "arg_names", None) or getattr(k.fn, "arg_names"))  # noqa: E731
    for p in fwd:
        if p is not R.plans.AS_LLAMA:
            assert set(p.const) <= names(K._rms_fwd_form_kernel), set(p.const) - names(K._rms_fwd_form_kernel)
    for p in bwd:
        if p is not R.plans.AS_LLAMA:
            assert set(p.const) <= names(p.kernel), set(p.const) - names(p.kernel)


def test_gated_narrow_rows_take_the_gated_tiles():
    # the gated forms' smaller narrow-row tiles (swept on the H200); wide rows keep the common config
    P = R.plans
    assert P._fwd_config(262144, 128, 2, 132, gated=True) == (8, 128, True, 2)
    assert P._bwd_config(262144, 128, gated=True) == (16, 128, True, 8)
    assert P._fwd_config(262144, 128, 2, 132) != P._fwd_config(262144, 128, 2, 132, gated=True)
    for n in (2048, 5376, 20000):
        assert P._fwd_config(4096, n, 2, 132, gated=True) == P._fwd_config(4096, n, 2, 132)
        assert P._bwd_config(4096, n, gated=True) == P._bwd_config(4096, n)


# Mamba2's and Bamba's gated norm as transformers 5.17 (the GPU tests' version) spells it: the gate
# before the statistics, which span the whole row (no group size yet)
_GATE_FIRST_ROW_SRC = '''
class OldMambaRMSNormGated(torch.nn.Module):
    def __init__(self, hidden_size, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states, gate=None):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)

        if gate is not None:
            hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)

        return self.weight * hidden_states.to(input_dtype)
'''


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gate_first_without_groups_transformers_517(interpret, dtype):
    ns = {"torch": torch, "nn": torch.nn, "__name__": "old_mamba2"}
    exec(compile(_GATE_FIRST_ROW_SRC, "<old_mamba2>", "exec"), ns)
    cls = ns["OldMambaRMSNormGated"]
    spec = F.recognise(cls)
    assert spec is not None and spec.kind == "gate_first_row" and spec.form == "gate_first" and spec.gated
    n = 24
    m = _randomize(cls(n)).to(interpret, dtype)
    ref = copy.deepcopy(m)
    rep = F.RmsNormFeature().apply(torch.nn.ModuleList([m]), None, F.RmsNormConfig(enabled=True))
    assert rep.details["replaced"] == {"OldMambaRMSNormGated": 1}, rep
    g = torch.Generator().manual_seed(3)
    x = torch.randn(5, 3, n, generator=g).to(interpret, dtype)
    for gate in (torch.randn(5, 3, n, generator=g).to(interpret, dtype), None):
        _step_matches_eager(m, ref, x, gate, g, dtype)
    assert m._ds_fused_rms_calls.fused == 2 and m._ds_fused_rms_calls.eager == 0


def _class_from_template(name, **globals_):
    """A module class whose forward is template ``name``'s source, compiled in a module namespace
    with torch's names, some replaced by ``globals_``."""
    from deepspeed_fused.features.rms_norm.templates import TEMPLATE_SOURCES

    src = {t[0]: t[3] for t in TEMPLATE_SOURCES}[name]
    ns = {"torch": torch, "nn": torch.nn, "F": torch.nn.functional, "__name__": "a_model", **globals_}
    exec(compile(src, "<a_model>", "exec"), ns)
    return type("SomeNorm", (torch.nn.Module,), {"forward": ns["forward"]})


def test_recognition_checks_what_the_loaded_globals_name():
    import types

    # the code matches; what its module's globals name decides
    assert F.recognise(_class_from_template("gate_first_row")).kind == "gate_first_row"
    fake_nn = types.SimpleNamespace(functional=types.SimpleNamespace(silu=torch.sigmoid))
    assert F.recognise(_class_from_template("gate_first_row", nn=fake_nn)) is None
    assert F.recognise(_class_from_template("gate_first_row", torch=types.SimpleNamespace(float32=None))) is None
    # a global the code does not load does not matter (F here), a shadowed builtin it calls does
    assert F.recognise(_class_from_template("gate_first_row", F=None)) is not None
    assert F.recognise(_class_from_template("n_groups_gated")).kind == "n_groups_gated"
    assert F.recognise(_class_from_template("n_groups_gated", len=lambda s: 3)) is None


@pytest.mark.parametrize("name", ["offset", "unweighted", "gated"])
def test_form_node_saves_what_the_cpp_node_saves(interpret, name):
    """The Python node of the other forms saves (x, weight, gate, rstd) with an empty tensor of x's
    dtype for an absent weight or gate, as the C++ node (csrc/rms_norm_node.cpp) does: a
    recomputation under non-reentrant activation checkpointing may then run either node whatever
    the original forward ran (the C++ node becomes available while training runs)."""
    form = R.FORMS[name]
    for gate in ((True, False) if form.gate == "none" else (True,)):
        x, w, g, dy = form_inputs(form, (2, 5, 64), torch.float32, gate=gate)
        x.requires_grad_()
        if w is not None:
            w.requires_grad_()
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = R.fused_rms_norm_form(x, w, EPS, form, gate=g)
        assert y.grad_fn.name().endswith("_FusedRMSNormFormFnBackward"), y.grad_fn.name()
        meta = [(tuple(t.shape), t.dtype) for t in saved]
        want = [(tuple(x.shape), x.dtype),
                (tuple(w.shape), w.dtype) if w is not None else ((0,), x.dtype),
                (tuple(g.shape), g.dtype) if g is not None else ((0,), x.dtype),
                (tuple(x.shape[:-1]), torch.float32)]
        assert meta == want, (name, gate, meta)
        y.backward(dy)  # the stand-ins are dropped again: gradients as without them
        ref_x = x.detach().double().requires_grad_()
        ref_w = None if w is None else w.detach().double().requires_grad_()
        oracle_form(ref_x, ref_w, None if g is None else g.double(), EPS, form).backward(dy.double())
        torch.testing.assert_close(x.grad.double(), ref_x.grad, rtol=1e-4, atol=1e-5)
        if w is not None:
            torch.testing.assert_close(w.grad.double(), ref_w.grad, rtol=1e-4, atol=1e-4)


def test_checkpoint_recomputation_may_switch_to_a_node_saving_stand_ins(interpret):
    """Non-reentrant checkpointing compares what the recomputation saves with what the forward
    saved: a forward through the Python node and a recomputation through a node that saves the C++
    node's list (stand-ins for the absent gate) train as one node would."""
    from torch.utils.checkpoint import checkpoint

    form = R.FORMS["offset"]
    x, w, _, dy = form_inputs(form, (3, 7, 64), torch.float32, gate=False)

    class CppLike(torch.autograd.Function):  # saves what csrc/rms_norm_node.cpp's form node saves
        @staticmethod
        def forward(ctx, x, w, g):
            inner = []
            with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(
                    lambda t: inner.append(t) or t, lambda t: t):
                y = R.fused_rms_norm_form(x.detach().requires_grad_(), w.detach().requires_grad_(), EPS, form)
            ctx.save_for_backward(x, w, g, inner[-1])  # x, w, the gate's stand-in, rstd
            ctx.xw = (x.detach(), w.detach())
            return y.detach()

        @staticmethod
        def backward(ctx, dy):
            x, w = ctx.xw
            x, w = x.clone().requires_grad_(), w.clone().requires_grad_()
            with torch.enable_grad():
                y = R.fused_rms_norm_form(x, w, EPS, form)
            dx, dw = torch.autograd.grad(y, (x, w), dy)
            return dx, dw, None

    calls = []

    def norm(h, wt):
        calls.append(1)
        if len(calls) == 1:  # the original forward: the Python node
            return R.fused_rms_norm_form(h, wt, EPS, form)
        return CppLike.apply(h, wt, h.new_empty(0))  # the recomputation

    def grads(fn):
        xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        (fn(xr, wr) * 1.0).backward(dy)
        return xr.grad, wr.grad

    want = grads(lambda h, wt: R.fused_rms_norm_form(h, wt, EPS, form) * 1.0)
    got = grads(lambda h, wt: checkpoint(norm, h * 1.0, wt, use_reentrant=False))
    assert len(calls) == 2
    torch.testing.assert_close(got[0], want[0])
    torch.testing.assert_close(got[1], want[1])
