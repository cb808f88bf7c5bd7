"""The public gated activation: autograd Functions for eager calls, custom ops for torch.compile."""
from __future__ import annotations

import torch

from . import launch
from .checks import check_fused, check_split, kernel_ok
from .reference import mlp_act_fused_reference, mlp_act_reference

_NS = "deepspeed_fused"


def _mark_overwritten(*pairs) -> None:
    """Bump the version of each saved input its gradient was written over, so that autograd refuses
    a second backward through the same graph (``retain_graph=True``) instead of reading gradients
    as inputs."""
    for saved, grad in pairs:
        if grad is saved:
            torch.autograd.graph.increment_version(saved)


class _SplitFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up, act, in_place):
        ctx.save_for_backward(gate, up)
        ctx.act, ctx.in_place = act, in_place
        return launch.split_forward(gate, up, act)

    @staticmethod
    @torch.autograd.function.once_differentiable  # a double backward raises (the kernels have no graph)
    def backward(ctx, dh):
        gate, up = ctx.saved_tensors
        dg, du = launch.split_backward(gate, up, dh, ctx.act, ctx.in_place)
        _mark_overwritten((gate, dg), (up, du))
        return dg, du, None, None


class _FusedFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, act, gate_first, in_place):
        ctx.save_for_backward(gate_up)
        ctx.args = (act, gate_first)
        ctx.in_place = in_place
        return launch.fused_forward(gate_up, act, gate_first)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dh):
        (gate_up,) = ctx.saved_tensors
        dgu = launch.fused_backward(gate_up, dh, *ctx.args, in_place=ctx.in_place)
        _mark_overwritten((gate_up, dgu))
        return dgu, None, None, None


@torch.library.custom_op(f"{_NS}::mlp_act", mutates_args=())
def _split_op(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    return launch.split_forward(gate, up, act)


@_split_op.register_fake
def _(gate, up, act):
    return torch.empty_like(gate, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{_NS}::mlp_act_backward", mutates_args=())
def _split_backward_op(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, act: str) -> tuple[torch.Tensor,
                                                                                                    torch.Tensor]:
    return launch.split_backward(gate, up, dh, act)


@_split_backward_op.register_fake
def _(gate, up, dh, act):
    return (torch.empty_like(gate, memory_format=torch.contiguous_format),
            torch.empty_like(gate, memory_format=torch.contiguous_format))


def _split_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[1])
    ctx.act = inputs[2]


def _split_op_backward(ctx, dh):
    gate, up = ctx.saved_tensors
    dg, du = _split_backward_op(gate, up, dh, ctx.act)
    return dg, du, None


_split_op.register_autograd(_split_op_backward, setup_context=_split_setup)


@torch.library.custom_op(f"{_NS}::mlp_act_fused", mutates_args=())
def _fused_op(gate_up: torch.Tensor, act: str, gate_first: bool) -> torch.Tensor:
    return launch.fused_forward(gate_up, act, gate_first)


@_fused_op.register_fake
def _(gate_up, act, gate_first):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op(f"{_NS}::mlp_act_fused_backward", mutates_args=())
def _fused_backward_op(gate_up: torch.Tensor, dh: torch.Tensor, act: str, gate_first: bool) -> torch.Tensor:
    return launch.fused_backward(gate_up, dh, act, gate_first)


@_fused_backward_op.register_fake
def _(gate_up, dh, act, gate_first):
    return torch.empty_like(gate_up, memory_format=torch.contiguous_format)


def _fused_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])
    ctx.args = (inputs[1], inputs[2])


def _fused_op_backward(ctx, dh):
    (gate_up,) = ctx.saved_tensors
    return _fused_backward_op(gate_up, dh, *ctx.args), None, None


_fused_op.register_autograd(_fused_op_backward, setup_context=_fused_setup)


def mlp_act(gate: torch.Tensor, up: torch.Tensor, act: str = "silu", grads_in_place: bool = False) -> torch.Tensor:
    """``act(gate) * up`` (``act``: ``"silu"``, ``"gelu_tanh"`` or ``"gelu"``) of two tensors of one
    shape, one kernel forward and one backward, with eager's rounding (see :mod:`.kernels`). Only
    ``gate`` and ``up`` are saved for the backward (eager keeps ``act(gate)`` too).

    ``grads_in_place``: the caller guarantees that nothing reads ``gate`` or ``up`` once this
    call's backward runs (they are temporaries of its own forward, seen by no hook); the backward
    then writes their gradients over them, two ``gate``-sized buffers fewer at its peak (under
    ``torch.compile`` the gradients are fresh tensors still)."""
    check_split(gate, up, act, grads_in_place)
    if not kernel_ok(gate, up):
        return mlp_act_reference(gate, up, act)
    if torch.compiler.is_compiling():
        return _split_op(gate, up, act)
    if torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad):
        return _SplitFn.apply(gate, up, act, grads_in_place)
    return launch.split_forward(gate, up, act)


def mlp_act_fused(gate_up: torch.Tensor, act: str = "silu", gate_first: bool = True,
                  grads_in_place: bool = False) -> torch.Tensor:
    """``act(gate) * up`` of one gate-up projection ``[..., 2 I]`` -> ``[..., I]``: the gate its
    first half (``gate_first``, Phi-3's and GLM's ``gate, up = gate_up.chunk(2, -1)``) or its second
    half; the backward writes the ``[..., 2 I]`` input gradient in one buffer (eager's chunk
    backward copies two halves into a zero-filled one), over ``gate_up`` itself with
    ``grads_in_place`` (as :func:`mlp_act`'s)."""
    check_fused(gate_up, act, gate_first, grads_in_place)
    if not kernel_ok(gate_up):
        return mlp_act_fused_reference(gate_up, act, gate_first)
    if torch.compiler.is_compiling():
        return _fused_op(gate_up, act, gate_first)
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return _FusedFn.apply(gate_up, act, gate_first, grads_in_place)
    return launch.fused_forward(gate_up, act, gate_first)
