"""Fused RMSNorm: the op (kernels under the Triton interpreter on CPU) and the installer."""
from __future__ import annotations

import copy
import functools
import io
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not in every forked test: custom ops need it)

from deepspeed_fused.ops import rms_norm as R
from deepspeed_fused.ops._common import reset_fallback_warnings
from deepspeed_fused.features import rms_norm as F
from deepspeed_fused.features.rms_norm import patch as FP

EPS = 1e-6
_MANT = {torch.float16: 10, torch.bfloat16: 7, torch.float32: 23}
_EMIN = {torch.float16: -14, torch.bfloat16: -126, torch.float32: -126}


@pytest.fixture(autouse=True)
def rms_norm_dispatchers_restored():
    """Each test leaves the RMSNorm classes as it found them. The feature's class dispatchers stay
    installed for the life of the process (by design), so a test that applies it to a model would
    otherwise leave, e.g., ``Qwen3RMSNorm.forward`` wrapped for the tests after it when they share
    a process (without ``--forked``). After the test, every class that got a dispatcher during it
    gets back the forward the dispatcher wraps, and ``_DISPATCHERS`` its earlier entries.
    test_rms_norm_forms.py imports this fixture (autouse there too)."""
    before = dict(FP._DISPATCHERS)
    yield
    for cls, disp in list(FP._DISPATCHERS.items()):
        if before.get(cls) is disp or cls.__dict__.get("forward") is not disp:
            continue  # installed before the test, or wrapped again since (not ours to undo)
        original = disp.__closure__[disp.__code__.co_freevars.index("original")].cell_contents
        del cls.forward
        if cls.forward is not original:  # it was the class's own forward, not an inherited one
            cls.forward = original
    FP._DISPATCHERS.clear()
    FP._DISPATCHERS.update(before)


# ---- numerics helpers (the GPU tests import these) ---------------------------------------------
def ulp(v: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Spacing of ``dtype`` at magnitude ``|v|`` (float64), exact on every device: the exponent
    from ``frexp`` and the power of two built from its bits (CUDA's double ``log2`` and ``pow`` need
    not be exact there, and a bound of one ULP a hair too small fails a difference of one ULP)."""
    a = v.detach().double().abs()
    e = torch.frexp(a.clamp_min(2.0 ** _EMIN[dtype])).exponent.to(torch.int64) - 1  # floor(log2 |v|)
    k = e.clamp_min(_EMIN[dtype]) - _MANT[dtype]
    spacing = ((k + 1023) << 52).view(torch.float64)  # 2 ** k, k within float64's normal range
    return torch.where(torch.isfinite(a), spacing, a)  # inf and nan stay what they are


def ulp_err(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    a, b = a.detach().double(), b.detach().double()
    return (a - b).abs() / ulp(torch.maximum(a.abs(), b.abs()), dtype)


def oracle_forward(x, w, eps):
    """The Llama form in float64 (no rounding anywhere); float64 inputs keep their autograd graph."""
    x64 = x if x.dtype == torch.float64 else x.detach().double()
    w64 = w if w.dtype == torch.float64 else w.detach().double()
    return w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps))


def _neighbours(v: torch.Tensor) -> list:
    """``v`` and its two neighbouring values in its own (16-bit) dtype, by bit pattern."""
    bits = v.view(torch.int16).to(torch.int32)
    out = [v]
    for step in (1, -1):
        nb = (bits + step).clamp(-32768, 32767).to(torch.int16).view(v.dtype)
        out.append(torch.where(nb.isfinite(), nb, v))
    return out


def assert_forward_close(y, y_ref, x, w, eps):
    """Within 1 ULP of eager as eager rounds: for half-precision input, y must be exactly what
    eager's weight multiply gives for eager's normalized value (rounded to the input dtype) or
    one of its two neighbours in that dtype. FP32 input (no narrowing rounding): at most 1 ULP
    less accurate than eager against the float64 oracle (eager itself is ~2-3 ULP off there)."""
    assert y.dtype == y_ref.dtype and y.shape == y_ref.shape
    if not y.numel():
        return
    if x.dtype != torch.float32:
        xf = x.detach().float()
        xn = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
        ok = torch.zeros_like(y, dtype=torch.bool)
        for v in _neighbours(xn):
            ok |= (w.detach() * v) == y
        assert torch.equal(w.detach() * xn, y_ref)
        if not ok.all():
            err = ulp_err(y, y_ref, y.dtype)
            raise AssertionError(f"{int((~ok).sum())} outputs are not eager's multiply of a normalized value "
                                 f"within 1 ULP (max {err.max().item()} output ULP off)")
    else:
        o = oracle_forward(x, w, eps)
        e_f = ulp_err(y, o, torch.float32)
        e_e = ulp_err(y_ref, o, torch.float32)
        assert e_f.max() <= e_e.max() + 1, f"forward {e_f.max().item()} ULP off exact, eager {e_e.max().item()}"


def assert_dx_close(dx, dx_ref, dtype, dx_oracle=None, floor=None):
    """Half precision: within 8 ULP of eager or 1e-7 absolute per element (1e-7 times the row's
    largest |dx| when that exceeds 1: elements that cancel carry the row sum's rounding), or no
    farther from the float64 oracle than eager is (plus 1 ULP), or within ``floor`` (per element:
    what eager's own intermediate roundings allow, see ``check_form``), at least 95% within 1 ULP.
    FP32 (no narrowing rounding, so a 1-ULP change of rstd moves every element): the error
    against the float64 oracle, relative to the row's largest |dx|, at most twice eager's plus 2 ULP."""
    assert dx.dtype == dx_ref.dtype and dx.shape == dx_ref.shape
    if not dx.numel():
        return
    rowmax = dx_ref.double().abs().amax(-1, keepdim=True).clamp_min(1e-30)
    if dtype == torch.float32 and dx_oracle is not None:
        e_f = ((dx.double() - dx_oracle) / rowmax).abs().max()
        e_e = ((dx_ref.double() - dx_oracle) / rowmax).abs().max()
        assert e_f <= 2 * e_e + 2 * 2.0 ** -23, f"dx error {e_f.item():.3g} vs eager {e_e.item():.3g}"
        return
    err = ulp_err(dx, dx_ref, dtype)
    absd = (dx.double() - dx_ref.double()).abs()
    near = absd <= 1e-7 * rowmax.clamp_min(1.0)
    if floor is not None:
        near = near | (absd <= floor)
    if dx_oracle is not None:  # more accurate than eager where eager's half-precision steps cancel
        o = dx_oracle.double()
        near = near | ((dx.double() - o).abs() <= (dx_ref.double() - o).abs() + ulp(dx, dtype))
    ok8 = (err <= 8) | near
    ok1 = (err <= 1) | near
    assert ok8.all(), f"dx off by {err[~ok8].max().item()} ULP"
    assert ok1.double().mean() >= 0.95, f"only {ok1.double().mean().item():.3f} of dx within 1 ULP"


def assert_dw_close(dw, dw_ref, dtype, terms_abs_sum, flips_abs_sum=None):
    """Within 1 ULP of eager, plus the FP32 summation-order allowance 4 * eps32 * sum|terms|,
    plus ``flips_abs_sum``: the summed |difference| of the rounded terms where our normalized
    value rounds to a neighbour of eager's (our statistics sum in another order, so a row's
    rstd can differ from eager's in the last bit; see :func:`dw_flip_allowance`)."""
    assert dw.dtype == dw_ref.dtype and dw.shape == dw_ref.shape
    bound = ulp(torch.maximum(dw.double().abs(), dw_ref.double().abs()), dtype) \
        + 4 * 2.0 ** -24 * terms_abs_sum.double()
    if flips_abs_sum is not None:
        bound = bound + flips_abs_sum.double()
    d = (dw.double() - dw_ref.double()).abs()
    assert (d <= bound).all(), f"dw off by {(d / bound).max().item()} of the bound"


def eager_normalized(x, eps):
    """Eager's normalized value, rounded to the input dtype."""
    xf = x.detach().float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def dw_flip_allowance(x, w, eps, dy):
    """Per column, sum over rows of |dy*xn_ours - dy*xn_eager| in the output dtype, where
    xn_ours uses the rstd our forward computes: nonzero only where the two normalized values
    round to different neighbours in the input dtype. Every other difference must come from
    the FP32 sum alone."""
    _, rstd = R.launch._forward_impl(x.detach(), w.detach(), eps)
    xn_ours = (x.detach().float() * rstd[..., None]).to(x.dtype)
    out = torch.promote_types(x.dtype, w.dtype)
    d = (dy.to(out) * xn_ours.to(out)).double() - (dy.to(out) * eager_normalized(x, eps).to(out)).double()
    return d.abs().reshape(-1, x.shape[-1]).sum(0)


def eager_rms_grads(x, w, eps, dy):
    """The HF Llama form with eager autograd: y, dx, dw and sum |dw terms|."""
    xr = x.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    y = R.rms_norm_reference(xr, wr, eps)
    y.backward(dy)
    terms = (dy.float() * eager_normalized(x, eps).float()).abs().reshape(-1, x.shape[-1]).sum(0)
    return y.detach(), xr.grad, wr.grad, terms


def fused_grads(x, w, eps, dy):
    xf = x.detach().clone().requires_grad_()
    wf = w.detach().clone().requires_grad_()
    y = R.fused_rms_norm(xf, wf, eps)
    y.backward(dy)
    return y.detach(), xf.grad, wf.grad


def make_inputs(shape, dtype, wdtype=None, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(wdtype or dtype)
    out = torch.promote_types(dtype, wdtype or dtype)
    dy = torch.randn(shape, generator=g).to(out)
    return x.to(device), w.to(device), dy.to(device)


def on_streams_bitwise(ins, call, ref, rounds=20):
    """``call(x, w, dy)`` for every input set, each on its own CUDA stream and all in flight at
    once, ``rounds`` times: every result (a tuple of tensors) bitwise equal to its ``ref``."""
    streams = [torch.cuda.Stream() for _ in ins]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    for _ in range(rounds):
        outs = []
        for s, args in zip(streams, ins):
            with torch.cuda.stream(s):
                outs.append(call(*args))
        for s in streams:
            torch.cuda.current_stream().wait_stream(s)
        for got, want in zip(outs, ref):
            assert all(a is None and b is None or torch.equal(a, b) for a, b in zip(got, want))


def check_against_eager(x, w, dy, eps=EPS):
    y, dx, dw = fused_grads(x, w, eps, dy)
    y_r, dx_r, dw_r, terms = eager_rms_grads(x, w, eps, dy)
    assert_forward_close(y, y_r, x, w, eps)
    x64 = x.detach().double().requires_grad_()
    oracle_forward(x64, w, eps).backward(dy.double())
    assert_dx_close(dx, dx_r, x.dtype, x64.grad)
    assert_dw_close(dw, dw_r, w.dtype, terms, dw_flip_allowance(x, w, eps, dy))
    return y, dx, dw


# ---- the op ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n", [15, 16, 127, 128, 129, 130, 256])
@pytest.mark.parametrize("rows", [0, 1, 7, 65])
def test_matches_eager(interpret, dtype, n, rows):
    x, w, dy = make_inputs((rows, n), dtype, seed=n * 1000 + rows, device=interpret)
    y, dx, dw = check_against_eager(x, w, dy)
    if rows == 0:
        assert y.shape == (0, n) and dx.shape == (0, n)
        assert torch.equal(dw, torch.zeros_like(w))


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("n,rows", [(16, 300), (15, 257), (64, 129)])
def test_tile_boundaries_and_several_programs(interpret, tune, n, rows, prefetch):
    tune(_BWD_PREFETCH=prefetch)
    x, w, dy = make_inputs((rows, n), torch.float16, seed=rows, device=interpret)
    check_against_eager(x, w, dy)


@pytest.mark.parametrize("col", [True, False])
@pytest.mark.parametrize("loop", [False, True])
def test_wide_weight_gradient_sums(interpret, tune, loop, col):
    # wide sums (the two-level in-launch tail would be latency-bound) are finished by the last
    # programs a column strip each (col; under the interpreter by one), or in a second launch;
    # same results either way
    knobs = dict(_MAX_TAIL_BYTES=0, _SMALL_ELEMS=0, _COL_FINISH=col)
    if loop:
        knobs.update(_MAX_FWD_BLOCK=32, _MAX_BWD_BLOCK=32, _LOOP_BLOCK=16)
    x, w, dy = make_inputs((67, 40), torch.float16, seed=9, device=interpret)
    one = fused_grads(x, w, EPS, dy)
    tune(**knobs)
    assert not R.plans._reduce_meta(3, 40, 67).finish
    two = check_against_eager(x, w, dy)
    plan = next(iter(R.plans._bwd_plans.values()))
    assert plan.const["FINISH"] == (2 if col else 0) and (plan.red is None) == col
    assert torch.equal(one[0], two[0]) and torch.equal(one[1], two[1])
    torch.testing.assert_close(one[2], two[2], rtol=0, atol=float(one[2].abs().max()) * 2 ** -10)
    dx, dw = torch.full_like(dy, float("nan")), torch.full_like(w, float("nan"))
    R.launch._backward_impl(dy, x, w, R.launch._forward_impl(x, w, EPS)[1], dx=dx, dw=dw)
    assert torch.equal(dx, two[1]) and torch.equal(dw, two[2])


@pytest.mark.parametrize("dtype,wdtype", [(torch.float16, torch.float32), (torch.float32, torch.float16)])
def test_mixed_weight_dtype_promotes(interpret, dtype, wdtype):
    x, w, dy = make_inputs((3, 5, 40), dtype, wdtype, seed=3, device=interpret)
    y, dx, dw = check_against_eager(x, w, dy)
    assert y.dtype == torch.float32 and dx.dtype == dtype and dw.dtype == wdtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_width_one_against_float64_oracle(interpret, dtype):
    eps = 0.25
    x, w, dy = make_inputs((9, 1), dtype, seed=11, device=interpret)
    y, dx, dw = fused_grads(x, w, eps, dy)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    y64 = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps))
    y64.backward(dy.double())
    assert x64.grad.abs().min() > 0  # the derivative is not zero at width 1 with eps > 0
    tol = {torch.float32: 1e-5, torch.float16: 4e-3}[dtype]
    torch.testing.assert_close(y.double(), y64.detach(), rtol=tol, atol=tol)
    torch.testing.assert_close(dx.double(), x64.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(dw.double(), w64.grad, rtol=tol, atol=tol)
    check_against_eager(x, w, dy, eps)


@pytest.fixture
def tune(monkeypatch):
    """Set the op's tuning knobs for one test; the launch plans made under them are dropped
    before and after (plans are cached per shape and would otherwise outlive the knobs)."""
    def set_knobs(**knobs):
        for name, value in knobs.items():
            monkeypatch.setattr(R.plans, name, value)
        R.clear_plans()

    yield set_knobs
    R.clear_plans()


@pytest.fixture
def loop_kernels(tune):
    """Force the looping (wide-row) kernels at small widths so the interpreter stays fast."""
    tune(_MAX_FWD_BLOCK=64, _MAX_BWD_BLOCK=64, _LOOP_BLOCK=32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,rows", [(130, 7), (256, 5), (97, 1)])
def test_wide_rows_loop(interpret, loop_kernels, dtype, n, rows):
    assert not R.plans._fwd_config(rows, n, 2, 1)[2] and not R.plans._bwd_config(rows, n)[2]
    x, w, dy = make_inputs((rows, n), dtype, seed=n + rows, device=interpret)
    check_against_eager(x, w, dy)


def test_strided_rows_without_copy(interpret):
    # a fused QKV projection sliced and viewed as [B, S, heads, head_dim] (Qwen3 q_norm input)
    B, S, H, KV, hd = 2, 3, 4, 2, 16
    g = torch.Generator().manual_seed(5)
    qkv = torch.randn(B, S, (H + 2 * KV) * hd, generator=g).to(interpret)
    q = qkv[..., : H * hd].view(B, S, H, hd)
    assert not q.is_contiguous() and R.plans._row_layout(q) is not None and R.plans._row_layout(q)[1] == H
    w = (1 + 0.1 * torch.randn(hd, generator=g)).to(interpret)
    # the gradient arrives transposed, as after `.transpose(1, 2)` in attention: 3 row groups
    dyt = torch.randn(B, H, S, hd, generator=g).to(interpret)
    dy = dyt.transpose(1, 2)
    assert R.plans._row_layout(dy) is not None and R.plans._row_layout(dy)[0] > 1
    check_against_eager(q, w, dy)
    # four groups cannot be addressed by one row formula: copied, still right
    x5 = torch.randn(2, 3, 2, 5, 16, generator=g).permute(3, 1, 0, 2, 4).to(interpret)
    assert R.plans._row_layout(x5) is None
    check_against_eager(x5, w, torch.randn(x5.shape, generator=g).to(interpret))


def test_repeated_runs_bitwise_equal(interpret):
    x, w, dy = make_inputs((150, 48), torch.float32, seed=21, device=interpret)
    first = fused_grads(x, w, EPS, dy)
    for _ in range(2):
        again = fused_grads(x, w, EPS, dy)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("loop", [False, True])
def test_poisoned_outputs_are_fully_written(interpret, tune, loop):
    if loop:
        tune(_MAX_FWD_BLOCK=32, _MAX_BWD_BLOCK=32, _LOOP_BLOCK=16)
    x, w, dy = make_inputs((37, 40), torch.float16, seed=8, device=interpret)
    y0, r0 = R.launch._forward_impl(x, w, EPS)
    y = torch.full_like(y0, float("nan"))
    r = torch.full_like(r0, float("nan"))
    R.launch._forward_impl(x, w, EPS, y=y, rstd=r)
    assert torch.equal(y, y0) and torch.equal(r, r0)
    dx0, dw0 = R.launch._backward_impl(dy, x, w, r0)
    dx = torch.full_like(dx0, float("nan"))
    dw = torch.full_like(dw0, float("nan"))
    R.launch._backward_impl(dy, x, w, r0, dx=dx, dw=dw)
    assert torch.equal(dx, dx0) and torch.equal(dw, dw0)
    assert not y.isnan().any() and not dx.isnan().any() and not dw.isnan().any()


def test_leading_shapes_and_empty(interpret):
    x, w, dy = make_inputs((2, 3, 4, 24), torch.float32, seed=2, device=interpret)
    check_against_eager(x, w, dy)
    x, w, dy = make_inputs((0, 5, 24), torch.float16, seed=2, device=interpret)
    y, dx, dw = check_against_eager(x, w, dy)
    assert y.shape == (0, 5, 24) and torch.equal(dw, torch.zeros_like(dw))


def test_bad_inputs_raise(interpret):
    x = torch.randn(4, 8, device=interpret)
    w = torch.ones(8, device=interpret)
    with pytest.raises(ValueError, match="weight must have shape"):
        R.fused_rms_norm(x, torch.ones(7, device=interpret), EPS)
    with pytest.raises(ValueError, match="weight must have shape"):
        R.fused_rms_norm(x, torch.ones(2, 4, device=interpret), EPS)
    with pytest.raises(ValueError, match="weight must be on"):
        R.fused_rms_norm(x, torch.ones(8, device="meta"), EPS)
    with pytest.raises(TypeError, match="hidden must be a floating-point"):
        R.fused_rms_norm(torch.ones(4, 8, dtype=torch.int32), w, EPS)
    with pytest.raises(TypeError, match="weight must be a floating-point"):
        R.fused_rms_norm(x, torch.ones(8, dtype=torch.int64), EPS)
    with pytest.raises(TypeError, match="eps"):
        R.fused_rms_norm(x, w, "1e-6")
    with pytest.raises(ValueError, match="at least one dimension"):
        R.fused_rms_norm(torch.tensor(1.0), torch.ones(1), EPS)


def test_fallbacks_warn_once(interpret, monkeypatch):
    reset_fallback_warnings()
    x = torch.randn(3, 8, dtype=torch.float64, device=interpret)
    w = torch.ones(8, dtype=torch.float64, device=interpret)
    with pytest.warns(RuntimeWarning, match="float64"):
        y = R.fused_rms_norm(x, w, EPS)
    assert torch.equal(y, R.rms_norm_reference(x, w, EPS))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        R.fused_rms_norm(x, w, EPS)  # the same reason warns once
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # CPU tensors without the interpreter
    x32, w32 = x.cpu().float().requires_grad_(), w.cpu().float().requires_grad_()
    with pytest.warns(RuntimeWarning, match="kernels need CUDA"):
        y = R.fused_rms_norm(x32, w32, EPS)
    y.sum().backward()
    assert torch.equal(y, R.rms_norm_reference(x32, w32, EPS)) and x32.grad is not None


def test_custom_op_opcheck(interpret):
    x, w, dy = make_inputs((5, 24), torch.float32, seed=4, device=interpret)
    torch.library.opcheck(R.api._rms_norm_fwd, (x, w.requires_grad_(), EPS),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    rstd = R.launch._forward_impl(x, w, EPS)[1]
    torch.library.opcheck(R.api._rms_norm_bwd, (dy, x, w.detach(), rstd),
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_traces_without_graph_break(interpret):
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    x, w, dy = make_inputs((6, 32), torch.float32, seed=9, device=interpret)
    lin = torch.nn.Linear(32, 32).to(interpret)

    def f(x, w):
        return R.fused_rms_norm(lin(x), w, EPS).sin()

    from torch._dynamo.testing import AotEagerAndRecordGraphs

    rec = AotEagerAndRecordGraphs()
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    yc = torch.compile(f, backend=rec, fullgraph=True)(xc, wc)
    yc.backward(dy)
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    ye = f(xe, we)
    ye.backward(dy)
    assert len(rec.graphs) == 1  # one graph: no break
    targets = lambda gs: {str(n.target) for g in gs for n in g.graph.nodes}  # noqa: E731
    assert "deepspeed_fused.rms_norm_fwd.default" in targets(rec.fw_graphs)
    assert "deepspeed_fused.rms_norm_bwd.default" in targets(rec.bw_graphs)
    assert torch.equal(yc, ye) and torch.equal(xc.grad, xe.grad) and torch.equal(wc.grad, we.grad)
    # the installer's class-level dispatcher traces too (one graph, no break)
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    m = torch.nn.Sequential(torch.nn.Linear(32, 32), LlamaRMSNorm(32)).to(interpret)
    F.replace_rms_norm(m)
    cnt = CompileCounterWithBackend("aot_eager")
    assert torch.equal(torch.compile(m, backend=cnt, fullgraph=True)(x), m(x)) and cnt.frame_count == 1


# ---- the installer -----------------------------------------------------------------------------
from tiny_models import FAMILIES, build_model  # noqa: E402


def _randomize_norms(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if "RMSNorm" in type(m).__name__:
                m.weight.copy_(1 + 0.1 * torch.randn(m.weight.shape, generator=g))
    return model


def _norms(model):
    return [m for m in model.modules() if "RMSNorm" in type(m).__name__]


@pytest.fixture
def count_fused(monkeypatch):
    calls = []
    real = FP.try_fused_rms_norm

    def spy(h, w, eps):
        y = real(h, w, eps)
        if y is not None:
            calls.append((tuple(h.shape), eps))
        return y

    monkeypatch.setattr(FP, "try_fused_rms_norm", spy)
    return calls


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", FAMILIES)
def test_installer_training_step_matches_eager(interpret, count_fused, name):
    model = _randomize_norms(build_model(name)).to(interpret)
    ref = copy.deepcopy(model)
    norms = _norms(model)
    report = F.RmsNormFeature().apply(model, None, F.RmsNormConfig(enabled=True))
    cls = type(norms[0]).__name__
    assert report.applied and report.details["replaced"] == {cls: len(norms)} and not report.details["skipped"]
    assert all(F.is_replaced(m) for m in norms)
    assert not any(F.is_replaced(m) for m in _norms(ref))  # the copy made before stays eager
    ids = torch.randint(0, 257, (2, 6), generator=torch.Generator().manual_seed(1)).to(interpret)
    loss, grads = _step(model, ids)
    assert len(count_fused) == len(norms)
    loss_r, grads_r = _step(ref, ids)
    assert len(count_fused) == len(norms)
    torch.testing.assert_close(loss, loss_r, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_r.keys()
    for k in grads:
        torch.testing.assert_close(grads[k], grads_r[k], rtol=1e-4, atol=1e-6, msg=k)


def test_copies_keep_opt_in_and_use_own_weights(interpret, count_fused):
    model = _randomize_norms(build_model("llama-tiny")).to(interpret)
    assert F.replace_rms_norm(model) == 5
    norm = model.model.norm
    x = torch.randn(2, 3, 64, device=interpret)
    w0 = norm.weight.detach().clone()
    for kind in ("copy", "deepcopy", "replica"):
        if kind == "copy":
            clone = copy.copy(norm)
            clone._parameters = dict(clone._parameters)  # do not touch the original's dict
            clone.weight = torch.nn.Parameter(w0 * 2)
        elif kind == "deepcopy":
            clone = copy.deepcopy(norm)
            clone.weight.data.mul_(2)
        else:  # what nn.parallel.replicate does: a __dict__ copy, then plain tensors set
            clone = norm._replicate_for_data_parallel()
            clone.weight = w0 * 2
        assert F.is_replaced(clone), kind
        clone.variance_epsilon = 0.5
        n = len(count_fused)
        y = clone(x)
        assert len(count_fused) == n + 1 and count_fused[-1][1] == 0.5
        assert_forward_close(y, R.rms_norm_reference(x, clone.weight, 0.5), x, clone.weight, 0.5)
    assert torch.equal(norm.weight, w0) and norm.variance_epsilon == 1e-6
    deep = copy.deepcopy(model)
    assert sum(F.is_replaced(m) for m in deep.modules()) == 5


def test_save_load_runs_eager_until_installed_again(interpret, count_fused):
    model = _randomize_norms(build_model("qwen3-tiny")).to(interpret)
    keys = list(model.state_dict())
    assert F.replace_rms_norm(model) == 9
    assert list(model.state_dict()) == keys
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert not any(F.is_replaced(m) for m in loaded.modules())
    ids = torch.randint(0, 257, (1, 5), device=interpret)
    n = len(count_fused)
    loaded(input_ids=ids)
    assert len(count_fused) == n
    assert F.replace_rms_norm(loaded) == 9
    loaded(input_ids=ids)
    assert len(count_fused) == n + 9


def test_restore_and_install_twice(interpret, count_fused):
    model = _randomize_norms(build_model("llama-tiny")).to(interpret)
    ref = copy.deepcopy(model)
    feat = F.RmsNormFeature()
    cfg = F.RmsNormConfig(enabled=True)
    before = [(n, id(p)) for n, p in model.named_parameters()]
    hooks = [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks)) for m in model.modules()]
    assert feat.apply(model, None, cfg).details["replaced"] == {"LlamaRMSNorm": 5}
    assert [(n, id(p)) for n, p in model.named_parameters()] == before
    assert [(len(m._forward_pre_hooks), len(m._forward_hooks), len(m._backward_hooks))
            for m in model.modules()] == hooks
    again = feat.apply(model, None, cfg)
    assert again.applied and again.details["replaced"] == {} and again.details["already"] == {"LlamaRMSNorm": 5}
    assert F.replace_rms_norm(model) == 0
    assert feat.revert(model) == 5
    assert not any(F.is_replaced(m) for m in model.modules())
    ids = torch.randint(0, 257, (1, 5), device=interpret)
    n = len(count_fused)
    assert torch.equal(model(input_ids=ids).logits, ref(input_ids=ids).logits)  # eager again, bitwise
    assert len(count_fused) == n
    assert F.restore_rms_norm(model) == 0


def _llama_like_class(eps_attr):
    # the Llama form written with other local names and an `eps` attribute
    src = f"""
import torch


class CustomNorm(torch.nn.Module):
    def __init__(self, n, e=1e-6):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.{eps_attr} = e

    def forward(self, h):
        \"\"\"Docstrings do not matter.\"\"\"
        dt = h.dtype
        h = h.to(torch.float32)
        v = h.pow(2).mean(-1, keepdim=True)
        h = h * torch.rsqrt(v + self.{eps_attr})
        return self.weight * h.to(dt)
"""
    ns = {"torch": torch, "__name__": "user_models"}
    exec(compile(src, "user_models.py", "exec"), ns)
    return ns["CustomNorm"]


def test_which_classes_are_replaced(interpret):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    Custom = _llama_like_class("eps")

    class ScaledRMSNorm(LlamaRMSNorm):  # other math under a subclass
        def forward(self, h):
            return super().forward(h) * 2

    # a class that claims to be LlamaRMSNorm but whose forward is wrapped
    @functools.wraps(LlamaRMSNorm.forward)
    def wrapped(self, h):
        return LlamaRMSNorm.forward(self, h)

    def fake_init(self, n):
        torch.nn.Module.__init__(self)
        self.weight = torch.nn.Parameter(torch.ones(n))
        self.variance_epsilon = 1e-6

    Fake = type("LlamaRMSNorm", (torch.nn.Module,), {"__init__": fake_init, "forward": wrapped,
                                                      "__module__": LlamaRMSNorm.__module__})
    patched = LlamaRMSNorm(16)
    patched.forward = lambda h: h
    mods = torch.nn.ModuleList([GemmaRMSNorm(16), GptOssRMSNorm(16), Olmo2RMSNorm(16), torch.nn.RMSNorm(16),
                                Custom(16), ScaledRMSNorm(16), Fake(16), patched, LlamaRMSNorm(16)]).to(interpret)
    rep = F.RmsNormFeature().apply(mods, None, F.RmsNormConfig(enabled=True))
    # Gemma's 1 + w, GptOss and Olmo2 (the weight before the cast) and torch.nn.RMSNorm are other
    # forms of the op (tests/unit/test_rms_norm_forms.py); other math is not
    assert rep.details["replaced"] == {"CustomNorm": 1, "LlamaRMSNorm": 1, "GemmaRMSNorm": 1, "GptOssRMSNorm": 1,
                                       "Olmo2RMSNorm": 1, "RMSNorm": 1}
    sk = rep.details["skipped"]
    assert sk["forward is not a known RMSNorm form"] == {"ScaledRMSNorm": 1}
    assert sk["the class's forward was replaced or wrapped"] == {"LlamaRMSNorm": 1}
    assert sk["forward patched on the instance"] == {"LlamaRMSNorm": 1}
    assert "skipped" in rep.reason and "ScaledRMSNorm" in rep.reason
    x = torch.randn(3, 16, device=interpret)
    for m in mods:
        m.weight.data.normal_(1, 0.1)
    assert F.is_replaced(mods[4]) and F.is_replaced(mods[8])
    assert_forward_close(mods[4](x), R.rms_norm_reference(x, mods[4].weight, mods[4].eps), x, mods[4].weight, 1e-6)
    # off: only the built-in list
    F.restore_rms_norm(mods)
    rep = F.RmsNormFeature().apply(mods, None, F.RmsNormConfig(enabled=True, match_forms=False))
    assert rep.details["replaced"] == {"LlamaRMSNorm": 1}


def test_builtin_classes_are_llama_form():
    import importlib

    for qn in F.SUPPORTED_CLASSES:
        mod, cls = qn.rsplit(".", 1)
        try:
            klass = getattr(importlib.import_module(mod), cls)
        except (ImportError, AttributeError):
            continue
        assert F.llama_form_eps_attr(klass.forward) == "variance_epsilon", qn


def test_deepspeed_replaced_modules_are_left_to_it(interpret, monkeypatch, count_fused):
    ds = pytest.importorskip("deepspeed.ops.triton_ops.fused_rms_norm")
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    monkeypatch.setattr(LlamaRMSNorm, "forward", LlamaRMSNorm.forward)  # restored after the test
    monkeypatch.setattr(ds, "_FUSED_CLASS_FORWARDS", dict(ds._FUSED_CLASS_FORWARDS))
    monkeypatch.setattr(FP, "_DISPATCHERS", dict(FP._DISPATCHERS))
    model = _randomize_norms(build_model("llama-tiny")).to(interpret)
    wide = LlamaRMSNorm(4096).to(interpret)  # wider than DeepSpeed's kernels take: not replaced by it
    model.model.extra = wide
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert ds.replace_rms_norm(model) == 5
    rep = F.RmsNormFeature().apply(model, None, F.RmsNormConfig(enabled=True))
    assert rep.details["replaced"] == {"LlamaRMSNorm": 1}
    assert rep.details["skipped"] == {"already replaced by DeepSpeed's replace_rms_norm (left to it)":
                                      {"LlamaRMSNorm": 5}}
    assert F.is_replaced(wide) and not F.is_replaced(model.model.norm)
    x = torch.randn(2, 64, device=interpret)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = model.model.norm(x)  # DeepSpeed's dispatcher: eager on CPU
    assert len(count_fused) == 0 and torch.equal(y, R.rms_norm_reference(x, model.model.norm.weight, 1e-6))
    wide(torch.randn(1, 4096, device=interpret))
    assert len(count_fused) == 1


def test_patch_model_and_config():
    from deepspeed_fused import patch_model, parse_config, unpatch_model
    from deepspeed_fused.config import ConfigError

    cfg = parse_config({"rms_norm": {"enabled": True, "match_forms": False}})
    assert cfg.rms_norm.match_forms is False
    with pytest.raises(ConfigError, match="match_forms"):
        parse_config({"rms_norm": {"enabled": True, "match_forms": "yes"}})
    model = build_model("mixtral-tiny")
    report = patch_model(model, {"deepspeed_fused": {"rms_norm": {"enabled": True}}})
    assert report["rms_norm"].applied and "5 x MixtralRMSNorm" in report["rms_norm"].where
    assert unpatch_model(model) == {"rms_norm": 5}
    assert not any(F.is_replaced(m) for m in model.modules())


def test_unsupported_input_runs_eager_with_warning(interpret, monkeypatch):
    reset_fallback_warnings()
    model = build_model("llama-tiny").to(interpret)
    F.replace_rms_norm(model)
    norm = model.model.norm
    x = torch.randn(2, 64, dtype=torch.float64, device=interpret)
    norm.double()
    with pytest.warns(RuntimeWarning, match="float64"):
        y = norm(x)
    assert torch.equal(y, R.rms_norm_reference(x, norm.weight, norm.variance_epsilon))


def test_torch_compile_model_with_fused_norm(interpret, count_fused):
    torch._dynamo.reset()
    model = _randomize_norms(build_model("llama-tiny")).to(interpret)
    ref = copy.deepcopy(model)
    F.replace_rms_norm(model)
    ids = torch.randint(0, 257, (1, 5), generator=torch.Generator().manual_seed(3)).to(interpret)
    compiled = torch.compile(model, backend="aot_eager")
    out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    assert len(count_fused) == 5  # traced through the dispatcher
    loss_r, grads_r = _step(ref, ids)
    torch.testing.assert_close(out.loss.detach(), loss_r, rtol=1e-5, atol=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads_r[n], rtol=1e-4, atol=1e-6, msg=n)


# ---- ZeRO-3 through deepspeed.initialize and the config flag ------------------------------------
from unit.common import DistributedTest  # noqa: E402


class TestZero3(DistributedTest):
    world_size = 2

    def test_zero3_with_config_flag(self):
        import deepspeed
        import deepspeed.comm as dist

        import deepspeed_fused  # noqa: F401  (installs the hook)
        from deepspeed.utils import safe_get_full_grad

        model = _randomize_norms(build_model("llama-tiny"))
        ref = copy.deepcopy(model)
        names = [n for n, _ in model.named_parameters()]
        cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
               "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
               "steps_per_print": 10**6, "deepspeed_fused": {"rms_norm": {"enabled": True}}}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
        rep = engine.deepspeed_fused_report["rms_norm"]
        assert rep.applied and rep.details["replaced"] == {"LlamaRMSNorm": 5}, rep
        assert [n for n, _ in engine.module.named_parameters()] == names
        ids = torch.randint(0, 257, (2, 8), generator=torch.Generator().manual_seed(dist.get_rank()))
        ids = ids.to(engine.device)
        ref.to(engine.device)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        loss_r, grads_r = _step(ref, ids)
        torch.testing.assert_close(loss.detach(), loss_r, rtol=1e-5, atol=1e-5)
        for n, p in engine.module.named_parameters():
            if "norm" in n:
                g = grads_r[n].clone()
                dist.all_reduce(g)
                torch.testing.assert_close(safe_get_full_grad(p), g / dist.get_world_size(),
                                           rtol=1e-4, atol=1e-6, msg=n)
        engine.step()


def test_gradient_of_gradient_raises(interpret):
    x, w, dy = make_inputs((5, 16), torch.float32, seed=31, device=interpret)
    x.requires_grad_()
    y = R.fused_rms_norm(x, w, EPS)
    (gx,) = torch.autograd.grad(y, x, dy, create_graph=True)  # first order works under create_graph
    _, dx_r, _, _ = eager_rms_grads(x, w, EPS, dy)
    torch.testing.assert_close(gx, dx_r, rtol=1e-5, atol=1e-6)
    with pytest.raises(RuntimeError, match="does not require grad|differentiate twice"):
        torch.autograd.grad(gx.sum(), x)


def test_column_finish_never_waits_on_more_programs_than_can_run():
    """The column-parallel finish: at most 64 finishers, never more than the programs or half the
    SMs (they wait for the last programs), strips covering every column; one under the interpreter."""
    for progs, N, sms in [(264, 2048, 132), (396, 4096, 132), (40, 8192, 132), (264, 2048, 14), (3, 100, 2)]:
        sw, rb_p = R.plans._col_finish_meta(progs, N, True, sms)
        n_fin = -(-N // sw)
        assert n_fin <= min(64, progs, max(1, sms // 2)) and n_fin * sw >= N and rb_p * sw <= 4096
    sw, _ = R.plans._col_finish_meta(264, 2048, False)
    assert -(-2048 // sw) == 1
