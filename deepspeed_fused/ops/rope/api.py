"""Public entry points, the eager autograd Function and the ``torch.compile`` custom ops.

Under ``torch.compile`` the op is the custom op ``deepspeed_fused::rope_fwd`` with ``rope_bwd`` as
its backward; in eager mode the same kernels run behind an ``autograd.Function``, launched through
the compiled kernel's C launcher once a shape has been seen.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from .._common import note_reference, warn_fallback
from .checks import _InvalidType, _check
from .launch import _backward, _forward, _get_plan, _key, _plans
from .reference import rope_reference
from .spec import LLAMA, RopeSpec, output_dtype

_OP = "rope"


class _RopeFn(torch.autograd.Function):
    """The kernels for eager mode (an autograd.Function dispatches faster than a custom op);
    ``plan`` is the forward's launch plan, built by the caller."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, plan, keep=(False, False)):
        ctx.set_materialize_grads(False)  # an unused output gives its input no gradient, as in eager
        yq, yk = _forward(plan, q, k, cos, sin)
        ctx.save_for_backward(cos, sin)
        ctx.plan, ctx.keep = plan, keep
        if k is None:
            return yq
        return yq, yk

    @staticmethod
    def backward(ctx, *grads):
        # create_graph=True: the gradient is not differentiable again (once_differentiable makes a
        # second differentiation raise); otherwise skip that wrapper's cost
        if torch.is_grad_enabled():
            return _backward_once(ctx, *grads)
        return _backward_body(ctx, *grads)


def _backward_body(ctx, *grads):
    cos, sin = ctx.saved_tensors
    need = ctx.needs_input_grad
    grads = tuple(g if need[i] else None for i, g in enumerate(grads))
    dx = _backward(ctx.plan, grads, cos, sin, keep=ctx.keep)
    return dx[0], (dx[1] if len(dx) > 1 else None), None, None, None, None


# Autograd nodes between a Hugging Face q/k projection and its rotation: the reshapes (to heads, and
# the Linear's own of a 3-D input) and the matrix product.
_RESHAPE_NODES = frozenset({"ViewBackward0", "UnsafeViewBackward0", "ReshapeAliasBackward0"})
_MATMUL_NODES = frozenset({"MmBackward0", "AddmmBackward0"})


def grad_layout_is_free(x: torch.Tensor) -> bool:
    """True when the layout of ``x``'s gradient changes no value the layers before compute, only
    whether autograd copies it: ``x`` is a transpose of a contiguous tensor that is reshaped from a
    matrix product's output (``proj(h).view(b, s, heads, d).transpose(1, 2)``, the Hugging Face
    attention's q and k). A gradient in ``x``'s own layout then transposes back to a contiguous
    tensor, the reshapes view it and the product's backward reads the very matrix it reads after
    eager's copy of a contiguous gradient. Anything else on the way (a norm, an adapter's add,
    ZeRO-3's linear function) may reduce in an order that depends on the layout: False there, and
    the gradient stays contiguous as eager's."""
    fn = x.grad_fn
    if fn is None or type(fn).__name__ != "TransposeBackward0":
        return False
    try:
        if not x.transpose(fn._saved_dim0, fn._saved_dim1).is_contiguous():
            return False
        node, reshapes = fn.next_functions[0][0], 0
        while node is not None and type(node).__name__ in _RESHAPE_NODES and reshapes < 3:
            node, reshapes = node.next_functions[0][0], reshapes + 1
    except (AttributeError, IndexError, RuntimeError):
        return False
    return reshapes > 0 and node is not None and type(node).__name__ in _MATMUL_NODES


_backward_once = once_differentiable(_backward_body)


@torch.library.custom_op("deepspeed_fused::rope_fwd", mutates_args=())
def _rope_fwd_op(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int, spec: int) -> list[torch.Tensor]:
    plan = _get_plan(q, k, cos, sin, unsqueeze_dim, RopeSpec.from_code(spec))
    if isinstance(plan, str):  # the caller checked; only a change between trace and run lands here
        note_reference()
        with torch.no_grad():
            out = rope_reference(q, k, cos, sin, unsqueeze_dim, RopeSpec.from_code(spec))
        return [out] if k is None else list(out)
    yq, yk = _forward(plan, q, k, cos, sin)
    return [yq] if k is None else [yq, yk]


@_rope_fwd_op.register_fake
def _(q, k, cos, sin, unsqueeze_dim, spec):
    od = output_dtype(RopeSpec.from_code(spec), q.dtype, cos.dtype)
    out = [torch.empty_like(q, dtype=od)]
    if k is not None:
        out.append(torch.empty_like(k, dtype=od))
    return out


@torch.library.custom_op("deepspeed_fused::rope_bwd", mutates_args=())
def _rope_bwd_op(gq: Optional[torch.Tensor], gk: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int, spec: int, x_dtype: torch.dtype) -> list[torch.Tensor]:
    grads = (gq, gk)
    present = [g for g in grads if g is not None]
    plan = _get_plan(present[0], present[1] if len(present) == 2 else None, cos, sin, unsqueeze_dim,
                     RopeSpec.from_code(spec), x_dtype=x_dtype)
    if isinstance(plan, str):  # pragma: no cover - the forward's checks cover the gradients
        raise RuntimeError(f"deepspeed_fused::rope_bwd: {plan}")
    dx = _backward(plan, tuple(present), cos, sin)
    it = iter(dx)
    return [next(it) if g is not None else torch.empty(0, dtype=x_dtype, device=cos.device) for g in grads]


@_rope_bwd_op.register_fake
def _(gq, gk, cos, sin, unsqueeze_dim, spec, x_dtype):
    return [torch.empty(g.shape, dtype=x_dtype, device=g.device) if g is not None
            else torch.empty(0, dtype=x_dtype, device=cos.device)
            for g in (gq, gk)]


def _op_setup_context(ctx, inputs, output):
    q, k, cos, sin, unsqueeze_dim, spec = inputs
    ctx.save_for_backward(cos, sin)
    ctx.meta = (unsqueeze_dim, spec, q.dtype, k is not None)
    ctx.set_materialize_grads(False)


def _op_backward(ctx, grads):
    cos, sin = ctx.saved_tensors
    unsqueeze_dim, spec, x_dtype, has_k = ctx.meta
    gq = grads[0]
    gk = grads[1] if has_k else None
    if gq is None and gk is None:
        return None, None, None, None, None, None
    dq, dk = _rope_bwd_op(gq, gk, cos, sin, unsqueeze_dim, spec, x_dtype)
    return (dq if gq is not None else None), (dk if gk is not None else None), None, None, None, None


_rope_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)



def rope_kernel_ok(q, k, cos, sin, unsqueeze_dim: int = 1, spec: RopeSpec = LLAMA) -> tuple[bool, str]:
    """(True, "") when the kernels take these inputs, else (False, why); inputs eager rejects
    raise :class:`RopeInputError` (a ValueError or TypeError)."""
    plan = _get_plan(q, k, cos, sin, unsqueeze_dim, spec)
    return (False, plan) if isinstance(plan, str) else (True, "")


def try_fused_rope(q, k, cos, sin, unsqueeze_dim: int = 1, spec: RopeSpec = LLAMA):
    """:func:`fused_rope`, or None (no warning) when the kernels cannot take these inputs; inputs
    eager rejects raise :class:`RopeInputError`. The hot path: inputs whose plan exists (same
    metadata as an earlier call, hence checked) go straight to the launch."""
    if torch.compiler.is_compiling():
        if not isinstance(spec, RopeSpec):
            raise _InvalidType(f"rope: spec must be a RopeSpec, got {type(spec).__name__}")
        if isinstance(_check(q, k, cos, sin, unsqueeze_dim, spec, geometry=False), str):
            return None
        out = _rope_fwd_op(q, k, cos, sin, unsqueeze_dim, spec.code)
        return out[0] if k is None else (out[0], out[1])
    plan = None
    if isinstance(q, torch.Tensor) and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) \
            and (k is None or isinstance(k, torch.Tensor)) and type(unsqueeze_dim) is int:
        plan = _plans.get(_key(q, k, cos, sin, unsqueeze_dim, spec))
        if plan is not None and (cos.requires_grad or sin.requires_grad):
            plan = None
    if plan is None:
        plan = _get_plan(q, k, cos, sin, unsqueeze_dim, spec)
        if isinstance(plan, str):
            return None
    if torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)):
        keep = (grad_layout_is_free(q), k is not None and grad_layout_is_free(k))
        return _RopeFn.apply(q, k, cos, sin, plan, keep)
    yq, yk = _forward(plan, q, k, cos, sin)
    return yq if k is None else (yq, yk)


def fused_rope(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int = 1, spec: RopeSpec = LLAMA):
    """Rotary embedding of ``q`` and ``k`` (``[..., head_dim]``, up to 4 dims, any strides) by
    ``cos``/``sin`` unsqueezed at ``unsqueeze_dim`` and broadcast over their leading dims, as
    ``spec`` describes (default: the Llama form ``q * cos + rotate_half(q) * sin``). Returns
    ``(q_out, k_out)``, or ``q_out`` when ``k`` is None, in the inputs' layout and
    ``output_dtype(spec, ...)``, equal to the Hugging Face form's result element for element;
    differentiable in q and k (first order; cos and sin are constants). Inputs the kernels
    cannot take run :func:`rope_reference` with a one-time warning per reason; inputs eager
    rejects raise a ValueError or TypeError naming the argument."""
    out = try_fused_rope(q, k, cos, sin, unsqueeze_dim, spec)
    if out is None:
        warn_fallback(_OP, rope_kernel_ok(q, k, cos, sin, unsqueeze_dim, spec)[1])
        return rope_reference(q, k, cos, sin, unsqueeze_dim, spec)
    return out
