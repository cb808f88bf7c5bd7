"""The RMSNorm's entry points (argument checks in :mod:`.checks`): the custom ops ``torch.compile`` traces, the
autograd Functions of eager mode, and the public functions with their per-call hot path (a known
key goes straight to its fast closure or C++ node). ``NATIVE`` (here): whether calls may use the
C++ node (the benchmark and tests switch it off to time or check the Python node)."""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .._common import _current_device, _launch_hooks, warn_fallback
from .checks import _validate, _validate_form, rms_norm_form_kernel_ok, rms_norm_kernel_ok
from .launch import _backward_impl, _form_backward_impl, _form_forward_impl, _forward_impl
from .native import _register_native, _register_native_form
from .plans import (AS_LLAMA, _bwd_fast, _form_bwd_fast, _form_consts, _form_fwd_fast, _form_fwd_plan,
                    _form_fwd_plans, _form_key, _fwd_fast, _fwd_key, _fwd_plans, _native_pending, _native_plans,
                    _remember)
from .reference import (FORMS, RMSForm, _check_form, _check_group_size, _form_code, _form_of, form_output_dtype,
                        rms_norm_form_reference, rms_norm_reference)


_OP = "rms_norm"


# ``NATIVE``: whether calls may use the C++ node (the benchmark times both paths).
NATIVE = True


# ----------------------------------------------------------------------------------------------
# Custom ops (torch.compile traces through them; no host synchronisation)
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("deepspeed_fused::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_impl(x, w, eps)


@_rms_norm_fwd.register_fake
def _(x, w, eps):
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype))
    return y, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("deepspeed_fused::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                  rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward_impl(dy, x, w, rstd)


@_rms_norm_bwd.register_fake
def _(dy, x, w, rstd):
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _setup_context(ctx, inputs, output):
    x, w, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, w, rstd)
    ctx.mark_non_differentiable(rstd)


def _backward(ctx, dy, _drstd):
    x, w, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_bwd(dy, x, w, rstd)
    return dx, dw, None


_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _FusedRMSNormFn(torch.autograd.Function):
    """The same kernels for eager mode: autograd.Function dispatch costs a fraction of a custom
    op's Python dispatch, which dominates short (decode-like) inputs. torch.compile traces the
    custom op instead. ``key`` is the forward's launch-plan key (already built by the caller)."""

    @staticmethod
    def forward(ctx, x, w, eps, key, run=None):
        out = run(x, w, eps) if run is not None else None
        y, rstd = out if out is not None else _forward_impl(x, w, eps, key=key)
        ctx.save_for_backward(x, w, rstd)
        ctx.key = key
        return y

    @staticmethod
    def backward(ctx, dy):
        # create_graph=True: the gradient is not differentiable again (once_differentiable makes a
        # second differentiation raise); otherwise skip that wrapper's cost
        if torch.is_grad_enabled():
            return _backward_once(ctx, dy)
        x, w, rstd = ctx.saved_tensors
        fast_key = (ctx.key, dy.stride(), dy.dtype, dy.data_ptr() & 15)
        run = _bwd_fast.get(fast_key)
        if run is not None:
            out = run(dy, x, w, rstd)
            if out is not None:
                return out
        dx, dw = _backward_impl(dy, x, w, rstd, fast_key=fast_key, native=NATIVE)
        return dx, dw, None, None, None


def _backward_body(ctx, dy):
    x, w, rstd = ctx.saved_tensors
    dx, dw = _backward_impl(dy, x, w, rstd)
    return dx, dw, None, None, None


_backward_once = once_differentiable(_backward_body)


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------
def _run(hidden: torch.Tensor, weight: torch.Tensor, eps: float, key, grad: bool) -> torch.Tensor:
    if grad:
        return _FusedRMSNormFn.apply(hidden, weight, eps, key)
    return _forward_impl(hidden, weight, eps, write_rstd=False, key=key)[0]


def try_fused_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """:func:`fused_rms_norm`, or None (no warning) when the kernels cannot take these valid
    inputs; wrong inputs raise. The hot path: inputs whose launch plan exists (same shapes,
    strides, dtypes, devices and alignment as an earlier call, hence already checked) go
    straight to the kernels."""
    if torch.compiler.is_compiling():
        _validate(hidden, weight, eps)
        if not rms_norm_kernel_ok(hidden, weight)[0]:
            return None
        return _rms_norm_fwd(hidden, weight, float(eps))[0]
    if type(eps) is float and isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor):
        grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        key = _fwd_key(hidden, weight, grad)
        run = _fwd_fast.get(key)
        if run is not None:
            if grad:
                nat = (_native_plans.get(key) or (_register_native(key) if key in _native_pending else None)
                       if NATIVE else None)
                if nat is not None:
                    apply, plan_id, ndev = nat
                    if _current_device() == ndev and not _launch_hooks():
                        return apply(hidden, weight, eps, plan_id)
                return _FusedRMSNormFn.apply(hidden, weight, eps, key, run)
            out = run(hidden, weight, eps)
            if out is not None:
                return out[0]
        if key in _fwd_plans:
            return _run(hidden, weight, eps, key, grad)
    _validate(hidden, weight, eps)
    if not rms_norm_kernel_ok(hidden, weight)[0]:
        return None
    eps = float(eps)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _run(hidden, weight, eps, _fwd_key(hidden, weight, grad), grad)


def fused_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-form RMSNorm of ``hidden`` ([..., N]) with ``weight`` ([N]) and epsilon ``eps``.

    The result has ``hidden``'s shape and dtype ``promote_types(hidden.dtype, weight.dtype)``,
    and is contiguous. Differentiable in ``hidden`` and ``weight`` (first order; differentiating
    the gradient again raises). Under ``torch.compile`` it is the custom op
    ``deepspeed_fused::rms_norm_fwd`` (with ``rms_norm_bwd`` as its backward). Inputs the
    kernels cannot take (CPU tensors without the Triton interpreter, float64) run
    :func:`rms_norm_reference` with a one-time warning per reason; wrong inputs raise.
    """
    y = try_fused_rms_norm(hidden, weight, eps)
    if y is None:
        warn_fallback(_OP, rms_norm_kernel_ok(hidden, weight)[1])
        return rms_norm_reference(hidden, weight, eps)
    return y


@torch.library.custom_op("deepspeed_fused::rms_norm_form_fwd", mutates_args=())
def _rms_norm_form_fwd(x: torch.Tensor, w: Optional[torch.Tensor], g: Optional[torch.Tensor], eps: float,
                       form: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    y, rstd = _form_forward_impl(x, w, g, eps, _form_of(form))
    return y, rstd


@_rms_norm_form_fwd.register_fake
def _(x, w, g, eps, form):
    out = form_output_dtype(_form_of(form), x.dtype, None if w is None else w.dtype)
    return x.new_empty(x.shape, dtype=out), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("deepspeed_fused::rms_norm_form_bwd", mutates_args=())
def _rms_norm_form_bwd(dy: torch.Tensor, x: torch.Tensor, w: Optional[torch.Tensor], g: Optional[torch.Tensor],
                       rstd: torch.Tensor, form: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, dg = _form_backward_impl(dy, x, w, g, rstd, _form_of(form))
    return dx, (x.new_empty(0) if dw is None else dw), (x.new_empty(0) if dg is None else dg)


@_rms_norm_form_bwd.register_fake
def _(dy, x, w, g, rstd, form):
    return (x.new_empty(x.shape), x.new_empty(0) if w is None else w.new_empty(w.shape),
            x.new_empty(0) if g is None else g.new_empty(g.shape))


def _form_setup_context(ctx, inputs, output):
    x, w, g, _, form = inputs
    ctx.save_for_backward(x, w, g, output[1])
    ctx.form = form
    ctx.mark_non_differentiable(output[1])


def _form_backward(ctx, dy, _drstd):
    x, w, g, rstd = ctx.saved_tensors
    dx, dw, dg = _rms_norm_form_bwd(dy, x, w, g, rstd, ctx.form)
    return dx, (None if w is None else dw), (None if g is None else dg), None, None


_rms_norm_form_fwd.register_autograd(_form_backward, setup_context=_form_setup_context)


class _FusedRMSNormFormFn(torch.autograd.Function):
    """:class:`_FusedRMSNormFn` for the other forms (inputs x, weight or None, gate or None)."""

    @staticmethod
    def forward(ctx, x, w, g, eps, form, key, run=None):
        out = run(x, w, g, eps) if run is not None else None
        y, rstd = out if out is not None else _form_forward_impl(x, w, g, eps, form, key=key)
        # an absent weight or gate is saved as the empty stand-in the C++ node saves (x's dtype and
        # device): both nodes then save the same tensors, so a recomputation under non-reentrant
        # activation checkpointing may take either node whatever the original forward took (the
        # C++ node becomes available while training runs)
        ctx.save_for_backward(x, _stand_in(w, x), _stand_in(g, x), rstd)
        ctx.form, ctx.key, ctx.has = form, key, (w is not None, g is not None)
        return y

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():
            return _form_backward_once(ctx, dy)
        x, w, g, rstd = _form_saved(ctx)
        fast_key = (ctx.key, dy.stride(), dy.dtype, dy.data_ptr() & 15)
        run = _form_bwd_fast.get(fast_key)
        if run is not None:
            out = run(dy, x, w, g, rstd)
            if out is not None:
                return out
        dx, dw, dg = _form_backward_impl(dy, x, w, g, rstd, ctx.form, fast_key=fast_key, native=NATIVE)
        return dx, dw, dg, None, None, None, None


def _stand_in(t, x):
    return x.new_empty(0) if t is None else t


def _form_saved(ctx):
    """(x, w or None, g or None, rstd) from what :class:`_FusedRMSNormFormFn` saved."""
    x, w, g, rstd = ctx.saved_tensors
    has_w, has_g = ctx.has
    return x, (w if has_w else None), (g if has_g else None), rstd


def _form_backward_body(ctx, dy):
    x, w, g, rstd = _form_saved(ctx)
    dx, dw, dg = _form_backward_impl(dy, x, w, g, rstd, ctx.form)
    return dx, dw, dg, None, None, None, None


_form_backward_once = once_differentiable(_form_backward_body)


# ---- public entry points ----------------------------------------------------------------------------
def _needs_grad(hidden, weight, gate) -> bool:
    return torch.is_grad_enabled() and (hidden.requires_grad or (weight is not None and weight.requires_grad)
                                        or (gate is not None and gate.requires_grad))


def _try_grouped(hidden, weight, eps, form, gate, group_size):
    """:func:`try_fused_rms_norm_form` with statistics over groups of ``group_size`` columns: the
    norm of ``hidden`` viewed as ``[..., N // group_size, group_size]`` (the gate too) with the
    weight spanning all N columns (the kernels' weight rows, ``WG``; see ``plans._weight_rows``)."""
    form = _check_form(form)
    _validate_form(hidden, weight, eps, form, gate)
    gs = _check_group_size(group_size, hidden)
    if gs is None:
        return try_fused_rms_norm_form(hidden, weight, eps, form, gate)
    if not rms_norm_form_kernel_ok(hidden, weight, gate)[0]:
        return None
    groups = (hidden.shape[-1] // gs, gs)
    x = hidden.unflatten(-1, groups)
    g = gate.unflatten(-1, groups) if gate is not None else None
    eps = float(eps)
    if torch.compiler.is_compiling():
        return _rms_norm_form_fwd(x, weight, g, eps, _form_code(form))[0].flatten(-2)
    grad = _needs_grad(x, weight, g)
    return _run_keyed(x, weight, g, eps, form, grad, _form_key(x, weight, g, form, grad)).flatten(-2)


def _run_known(x, w, g, eps: float, form: RMSForm, grad: bool, key):
    """The form's forward with launch-plan key ``key`` when the key is known: its fast closure or
    C++ node where it has one, else its plan; :data:`_NO_PLAN` when there is no plan yet."""
    run = _form_fwd_fast.get(key)
    if run is not None:
        if grad:
            nat = (_native_plans.get(key) or (_register_native_form(key) if key in _native_pending else None)
                   if NATIVE else None)
            if nat is not None:
                apply, plan_id, ndev = nat
                if _current_device() == ndev and not _launch_hooks():
                    return apply(x, w, g, eps, plan_id)
            return _FusedRMSNormFormFn.apply(x, w, g, eps, form, key, run)
        out = run(x, w, g, eps)
        if out is not None:
            return out[0]
    plan = _form_fwd_plans.get(key)
    if plan is not None:
        return _run_form(x, w, g, eps, form, key, plan, grad)
    return _NO_PLAN


_NO_PLAN = object()


def _run_keyed(x, w, g, eps: float, form: RMSForm, grad: bool, key):
    """The form's forward of checked inputs with launch-plan key ``key`` (:func:`_run_known`, the
    plan made now if needed)."""
    out = _run_known(x, w, g, eps, form, grad, key)
    if out is not _NO_PLAN:
        return out
    plan = _remember(_form_fwd_plans, key, _form_fwd_plan(x, w, g, form, grad, key)) if x.numel() else None
    return _run_form(x, w, g, eps, form, key, plan, grad)


def try_fused_rms_norm_form(hidden: torch.Tensor, weight: Optional[torch.Tensor], eps: float, form,
                            gate: Optional[torch.Tensor] = None, group_size: Optional[int] = None
                            ) -> Optional[torch.Tensor]:
    """:func:`fused_rms_norm_form`, or None (no warning) when the kernels cannot take these valid
    inputs; wrong inputs raise. Inputs whose launch plan exists go straight to the kernels."""
    if type(form) is not RMSForm:
        form = _check_form(form)
    if form.weight == "input_scaled":
        return _try_input_scaled(hidden, weight, eps, form, gate, group_size)
    if group_size is not None:
        return _try_grouped(hidden, weight, eps, form, gate, group_size)
    if torch.compiler.is_compiling():
        _check_form(form)
        _validate_form(hidden, weight, eps, form, gate)
        if not rms_norm_form_kernel_ok(hidden, weight, gate)[0]:
            return None
        if gate is not None and form.gate == "none":
            gate = None
        if _form_consts(form, hidden.dtype, None if weight is None else weight.dtype,
                        gate is not None and form.gate != "none") is None:
            return _rms_norm_fwd(hidden, weight, float(eps))[0]
        return _rms_norm_form_fwd(hidden, weight, gate, float(eps), _form_code(form))[0]
    if (type(eps) is float and isinstance(hidden, torch.Tensor) and (weight is None or isinstance(weight, torch.Tensor))
            and (gate is None or isinstance(gate, torch.Tensor))):
        grad = _needs_grad(hidden, weight, gate)
        out = _run_known(hidden, weight, gate, eps, form, grad, _form_key(hidden, weight, gate, form, grad))
        if out is not _NO_PLAN:
            return out
    _check_form(form)
    _validate_form(hidden, weight, eps, form, gate)
    if not rms_norm_form_kernel_ok(hidden, weight, gate)[0]:
        return None
    eps = float(eps)
    grad = _needs_grad(hidden, weight, gate)
    key = _form_key(hidden, weight, gate, form, grad)
    plan = _form_fwd_plans.get(key)
    if plan is None and hidden.numel():
        plan = _remember(_form_fwd_plans, key, _form_fwd_plan(hidden, weight, gate, form, grad, key))
    return _run_form(hidden, weight, gate, eps, form, key, plan, grad)


def _try_input_scaled(hidden, weight, eps, form, gate, group_size):
    """The input-scaled form: the scale ``(x.float() * (1 + w).float()).type_as(x)`` as eager's own
    torch ops (its rounding and autograd are eager's: the weight gradient is the sum autograd
    takes), then the unweighted form's kernels on the scaled input."""
    form = _check_form(form)
    _validate_form(hidden, weight, eps, form, gate)
    _check_group_size(group_size, hidden)
    if not rms_norm_form_kernel_ok(hidden, weight, gate)[0]:
        return None
    scaled = (hidden.float() * (1.0 + weight).float()).type_as(hidden)
    return try_fused_rms_norm_form(scaled, None, eps, FORMS["unweighted"], None, group_size)


def _run_form(hidden, weight, gate, eps, form, key, plan, grad: bool):
    if plan is AS_LLAMA:  # the Llama form at these dtypes (there is no gate then)
        return try_fused_rms_norm(hidden, weight, eps)
    if grad:
        return _FusedRMSNormFormFn.apply(hidden, weight, gate, eps, form, key)
    return _form_forward_impl(hidden, weight, gate, eps, form, write_rstd=False, key=key)[0]


def fused_rms_norm_form(hidden: torch.Tensor, weight: Optional[torch.Tensor], eps: float, form,
                        gate: Optional[torch.Tensor] = None, group_size: Optional[int] = None) -> torch.Tensor:
    """RMSNorm of ``hidden`` ([..., N]) in ``form`` (an :class:`RMSForm` or a name in
    :data:`FORMS`), with ``weight`` ([N], or None for forms without one) and, for gated forms,
    ``gate`` (hidden's shape). ``group_size`` (a divisor of N, or None): the statistics (and
    ``rstd``) are taken per group of ``group_size`` consecutive columns, the weight still spanning
    all N (Mamba2's gated norm, Qwen4's grouped norm, Falcon-H1's ``n_groups``). The result is
    what the form's eager forward returns, rounding included (dtype :func:`form_output_dtype`).
    Differentiable in ``hidden``, ``weight`` and ``gate`` (first order). Forms that round as the
    Llama form does at these dtypes run :func:`fused_rms_norm` (ungrouped). Inputs the kernels
    cannot take run :func:`rms_norm_form_reference` with a one-time warning per reason; wrong
    inputs (a group size that does not divide N included) raise."""
    y = try_fused_rms_norm_form(hidden, weight, eps, form, gate, group_size)
    if y is None:
        warn_fallback(_OP, rms_norm_form_kernel_ok(hidden, weight, gate)[1])
        return rms_norm_form_reference(hidden, weight, eps, form, gate, group_size)
    return y
