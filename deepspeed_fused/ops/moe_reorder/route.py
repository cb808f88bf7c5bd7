"""The routed dispatch and combine of a top-k MoE layer: one API for both integrations.

A top-k router assigns token ``t`` to ``k`` experts: assignment ``a = t * k + j``. A layer sorts
the assignments by expert (``token_indices_sorted``: sorted position -> assignment) and places the
sorted rows into slots, optionally padded per expert (``permuted_indices``: slot -> sorted
position, out of range for a padding slot). :func:`route_maps` composes both into
:class:`RouteMaps` in one launch; :func:`route_dispatch` then gathers token rows straight into the
slots (times a per-assignment score, in FP32, when given) and :func:`route_combine` gathers each
token's ``k`` slot rows back, weights them and sums in FP32 (``j`` in order, one rounding): no
``[N, H]`` intermediate in token-slot order, no scatter, no atomics. Their backwards are the same
gathers and, for scores and weights, per-assignment dot products; all differentiate again.

The ``moe_reorder`` feature uses it on both of its paths: transformers' experts (the assignments
sorted by expert id, the experts of other ranks as padding slots) and DeepSpeed AutoEP's local
token path (DeepSpeed's padded permutation as the slots at ``autoep_size`` 1, the all-to-all
send buffer above it).

Eager calls run autograd Functions over the kernels (a cheaper dispatch than a custom op's: the
gathers are short); under ``torch.compile`` the same kernels are the custom ops
``deepspeed_fused::moe_route_maps``, ``moe_dispatch``, ``moe_combine``, ``moe_combine_backward``
and ``moe_slot_dot``, with fake implementations and derivatives written in one another, so a
compiled graph holds them whole (``fullgraph=True``) and differentiates twice.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._common import kernel_device_ok, note_reference, warn_fallback
from .checks import OP, check_device, check_index, check_rows, kernel_ok, kernels_take
from .kernels import SORT_MAX_EXPERTS
from .launch import combine_rows, gather_rows, route_maps_into, route_sort_into, slot_pass
from .reference import (RouteMaps, RouteSort, per_assignment, route_combine_reference, route_dispatch_reference,
                        route_maps_reference, route_sort_reference, slot_dot_reference)

_NS = "deepspeed_fused"


def route_maps(token_indices_sorted: torch.Tensor, top_k: int,
               permuted_indices: Optional[torch.Tensor] = None) -> RouteMaps:
    """The maps of assignments sorted by ``token_indices_sorted`` ([T * top_k], a permutation of
    the assignments) placed in slots: slot ``s`` holds sorted position ``permuted_indices[s]``
    (padding where out of range), or ``s`` when ``permuted_indices`` is None. One launch."""
    check_index("token_indices_sorted", token_indices_sorted)
    if permuted_indices is not None:
        check_index("permuted_indices", permuted_indices)
        check_device(token_indices_sorted, permuted_indices=permuted_indices)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k: expected a positive int, got {top_k!r}")
    n = token_indices_sorted.numel()
    if n % top_k:
        raise ValueError(f"token_indices_sorted: expected T * top_k entries, got {n} (top_k={top_k})")
    if torch.compiler.is_compiling():
        return RouteMaps(*_route_maps_op(token_indices_sorted, permuted_indices, top_k), top_k)
    return _route_maps_impl(token_indices_sorted, permuted_indices, top_k)


def _route_maps_impl(order: torch.Tensor, positions: Optional[torch.Tensor], top_k: int) -> RouteMaps:
    if not kernel_device_ok(order)[0]:
        note_reference()
        return route_maps_reference(order, top_k, positions)
    return RouteMaps(*route_maps_into(order, positions, top_k), top_k)


def _check_count(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected a positive int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name}: expected a positive int, got {value}")
    return value


def route_sort(expert_ids: torch.Tensor, num_experts: int, top_k: int) -> RouteSort:
    """Assignments sorted by expert, their route maps and grouped_mm's offsets, in two launches
    and no host sync. ``expert_ids`` (``[T * top_k]``, int32/int64): the expert of assignment
    ``a = t * top_k + j``; ids outside ``[0, num_experts)`` are sentinels (experts of other ranks
    under transformers' expert parallelism): sorted after every expert, their slots padding, left
    out of ``offsets``. Within an expert the assignments keep their order (a stable counting
    sort). The maps are :func:`route_maps` of ``order`` with the sentinels' positions as padding;
    the slots are the sorted positions. See :class:`RouteSort`."""
    check_index("expert_ids", expert_ids)
    _check_count("num_experts", num_experts)
    _check_count("top_k", top_k)
    n = expert_ids.numel()
    if n % top_k:
        raise ValueError(f"expert_ids: expected T * top_k entries, got {n} (top_k={top_k})")
    if n >= 2**31:
        raise ValueError(f"expert_ids: expected fewer than 2**31 assignments (int32 maps), got {n}")
    if torch.compiler.is_compiling():
        order, tok, assign, slot, offsets, experts = _route_sort_op(expert_ids, num_experts, top_k)
    else:
        order, tok, assign, slot, offsets, experts = _route_sort_impl(expert_ids, num_experts, top_k)
    return RouteSort(order, RouteMaps(tok, assign, slot, top_k), offsets, experts)


def _route_sort_impl(expert_ids: torch.Tensor, num_experts: int, top_k: int) -> tuple:
    ok, why = kernel_device_ok(expert_ids)
    if ok and num_experts > SORT_MAX_EXPERTS:
        ok, why = False, f"num_experts above {SORT_MAX_EXPERTS}"
    if not ok:
        warn_fallback(f"{OP}.route_sort", why)
        r = route_sort_reference(expert_ids, num_experts, top_k)
        return (r.order, *r.maps[:3], r.offsets, r.experts)
    return route_sort_into(expert_ids, num_experts, top_k)


def _dispatch_impl(x: torch.Tensor, m: RouteMaps, scores: Optional[torch.Tensor]) -> torch.Tensor:
    if kernel_ok("route_dispatch", x):
        return gather_rows(x, m.token, scores, assign=m.assignment if scores is not None else None)
    return route_dispatch_reference(x, m, scores).contiguous()


def _combine_impl(y: torch.Tensor, m: RouteMaps, weights: Optional[torch.Tensor]) -> torch.Tensor:
    if kernel_ok("route_combine", y):
        slot = m.slot.view(-1, m.top_k)
        return combine_rows(y, slot, weights.reshape(slot.shape) if weights is not None else None)
    return route_combine_reference(y, m, weights)


def _slot_pass(a_rows: torch.Tensor, b_slots: torch.Tensor, m: RouteMaps,
               scale: Optional[torch.Tensor] = None) -> tuple:
    """One pass over the slots (kernels only): ``d[a] = <a_rows[a // k], b_slots[slot[a]]>`` in FP32
    (0 where unplaced), ``[T * k]``; with ``scale`` (per assignment) also
    ``g[s] = a_rows[token[s]] * scale[assignment[s]]`` in ``b_slots``'s dtype (else None)."""
    g, dot = slot_pass(a_rows, b_slots, m.token, m.assignment, scale)
    return g, per_assignment(dot, m)


def _slot_dot(a_rows: torch.Tensor, b_slots: torch.Tensor, m: RouteMaps) -> torch.Tensor:
    """``d[a] = <a_rows[a // k], b_slots[slot[a]]>`` in FP32 (0 where unplaced), ``[T * k]``."""
    if kernels_take(b_slots)[0] and b_slots.shape[0] and b_slots.shape[1]:
        return _slot_pass(a_rows, b_slots, m)[1]
    return slot_dot_reference(a_rows, b_slots, m)


def _fused_backward_ok(grad: torch.Tensor, m: RouteMaps) -> bool:
    """Whether the combine's two gradients can come from one pass over the slots."""
    return kernels_take(grad)[0] and m.token.numel() > 0 and grad.shape[1] > 0


# ---- eager: autograd Functions over the kernels ------------------------------------------------
class _RouteDispatch(torch.autograd.Function):
    """``out[s] = x[token[s]]`` (times ``scores[assignment[s]]`` in FP32, rounded once), zero rows
    at padding slots. Backward: a combine (FP32 sum of a token's k slot gradients, fixed order)
    and, for the scores, per-assignment dot products. Differentiable again."""

    @staticmethod
    def forward(ctx, x, scores, maps):
        ctx.maps = maps
        ctx.save_for_backward(x if scores is not None else None, scores)
        return _dispatch_impl(x, maps, scores)

    @staticmethod
    def backward(ctx, grad):
        x, scores = ctx.saved_tensors
        m = ctx.maps
        dx = _combine_eager(grad, m, scores) if ctx.needs_input_grad[0] else None
        ds = None
        if scores is not None and ctx.needs_input_grad[1]:
            ds = _dot_eager(x, grad, m).view(scores.shape).to(scores.dtype)
        return dx, ds, None


class _RouteCombine(torch.autograd.Function):
    """``out[t] = sum_j y[slot[t, j]] * weights[t, j]`` in FP32 (``j`` in order), rounded once.
    Backward: ``dy`` is a dispatch of the gradient scaled by the weights, the weights' gradient
    per-assignment dot products: one fused pass unless a graph of the gradient is built."""

    @staticmethod
    def forward(ctx, y, weights, maps):
        ctx.maps = maps
        ctx.save_for_backward(y if weights is not None else None, weights)
        return _combine_impl(y, maps, weights)

    @staticmethod
    def backward(ctx, grad):
        y, weights = ctx.saved_tensors
        m = ctx.maps
        need_y, need_w = ctx.needs_input_grad[0], weights is not None and ctx.needs_input_grad[1]
        if not torch.is_grad_enabled() and need_y and need_w and _fused_backward_ok(grad, m):
            # one fused pass: dy and the weights' gradient
            dy, dw = _slot_pass(grad, y, m, weights)
            return dy, dw.view(weights.shape).to(weights.dtype), None
        dy = _dispatch_eager(grad, m, weights) if need_y else None
        dw = _dot_eager(grad, y, m).view(weights.shape).to(weights.dtype) if need_w else None
        return dy, dw, None


class _RouteDot(torch.autograd.Function):
    """``d[a] = <tokens[a // k], slots[slot[a]]>`` in FP32; the scores' gradient of a dispatch and
    the weights' gradient of a combine. Its own gradient is a combine and a dispatch."""

    @staticmethod
    def forward(ctx, tokens, slots, maps):
        ctx.maps = maps
        ctx.save_for_backward(tokens, slots)
        return _slot_dot(tokens, slots, maps)

    @staticmethod
    def backward(ctx, grad):
        tokens, slots = ctx.saved_tensors
        m = ctx.maps
        dt = _combine_eager(slots, m, grad).to(tokens.dtype) if ctx.needs_input_grad[0] else None
        ds = _dispatch_eager(tokens, m, grad).to(slots.dtype) if ctx.needs_input_grad[1] else None
        return dt, ds, None


def _graph(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


# Without a graph to build (no input requires grad, or a backward outside create_graph) the
# kernels run directly; else the Functions, so gradients of gradients exist.
def _dispatch_eager(x: torch.Tensor, m: RouteMaps, scores: Optional[torch.Tensor]) -> torch.Tensor:
    return _RouteDispatch.apply(x, scores, m) if _graph(x, scores) else _dispatch_impl(x, m, scores)


def _combine_eager(y: torch.Tensor, m: RouteMaps, weights: Optional[torch.Tensor]) -> torch.Tensor:
    return _RouteCombine.apply(y, weights, m) if _graph(y, weights) else _combine_impl(y, m, weights)


def _dot_eager(tokens: torch.Tensor, slots: torch.Tensor, m: RouteMaps) -> torch.Tensor:
    return _RouteDot.apply(tokens, slots, m) if _graph(tokens, slots) else _slot_dot(tokens, slots, m)


# ---- torch.compile: custom ops over the same kernels --------------------------------------------

@torch.library.custom_op(f"{_NS}::moe_route_maps", mutates_args=())
def _route_maps_op(order: torch.Tensor, positions: Optional[torch.Tensor],
                   top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(_route_maps_impl(order, positions, top_k)[:3])


@_route_maps_op.register_fake
def _(order, positions, top_k):
    num_slots = order.shape[0] if positions is None else positions.shape[0]
    return (order.new_empty((num_slots, ), dtype=torch.int32), order.new_empty((num_slots, ), dtype=torch.int32),
            order.new_empty((order.shape[0], ), dtype=torch.int32))


@torch.library.custom_op(f"{_NS}::moe_route_sort", mutates_args=())
def _route_sort_op(expert_ids: torch.Tensor, num_experts: int, top_k: int) -> tuple[
        torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(order, token, assignment, slot, offsets, experts) of :func:`route_sort`."""
    return tuple(_route_sort_impl(expert_ids, num_experts, top_k))


@_route_sort_op.register_fake
def _(expert_ids, num_experts, top_k):
    n = expert_ids.shape[0]
    per = [expert_ids.new_empty((n, ), dtype=torch.int32) for _ in range(4)]
    return (*per, expert_ids.new_empty((num_experts, ), dtype=torch.int32),
            expert_ids.new_empty((n, ), dtype=torch.int32))


@torch.library.custom_op(f"{_NS}::moe_dispatch", mutates_args=())
def _dispatch_op(x: torch.Tensor, token: torch.Tensor, assignment: torch.Tensor, slot: torch.Tensor,
                 scores: Optional[torch.Tensor], top_k: int) -> torch.Tensor:
    return _dispatch_impl(x, RouteMaps(token, assignment, slot, top_k), scores)


@_dispatch_op.register_fake
def _(x, token, assignment, slot, scores, top_k):
    return x.new_empty((token.shape[0], x.shape[1]))


@torch.library.custom_op(f"{_NS}::moe_combine", mutates_args=())
def _combine_op(y: torch.Tensor, token: torch.Tensor, assignment: torch.Tensor, slot: torch.Tensor,
                weights: Optional[torch.Tensor], top_k: int) -> torch.Tensor:
    return _combine_impl(y, RouteMaps(token, assignment, slot, top_k), weights)


@_combine_op.register_fake
def _(y, token, assignment, slot, weights, top_k):
    return y.new_empty((slot.shape[0] // top_k, y.shape[1]))


@torch.library.custom_op(f"{_NS}::moe_slot_dot", mutates_args=())
def _slot_dot_op(tokens: torch.Tensor, slots: torch.Tensor, token: torch.Tensor, assignment: torch.Tensor,
                 slot: torch.Tensor, top_k: int) -> torch.Tensor:
    return _slot_dot(tokens, slots, RouteMaps(token, assignment, slot, top_k))


@_slot_dot_op.register_fake
def _(tokens, slots, token, assignment, slot, top_k):
    return slots.new_empty((slot.shape[0], ), dtype=torch.float32)


@torch.library.custom_op(f"{_NS}::moe_combine_backward", mutates_args=())
def _combine_backward_op(grad: torch.Tensor, y: torch.Tensor, token: torch.Tensor, assignment: torch.Tensor,
                         slot: torch.Tensor, weights: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Both gradients of the weighted combine: ``dy`` (a dispatch of ``grad`` scaled by the
    weights) and ``dw`` (per-assignment dot products), in one pass over the slots where the
    kernels run."""
    m = RouteMaps(token, assignment, slot, top_k)
    if _fused_backward_ok(grad, m):
        dy, dw = _slot_pass(grad, y, m, weights)
    else:
        dy, dw = _dispatch_impl(grad, m, weights), _slot_dot(grad, y, m)
    return dy, dw.reshape(weights.shape).to(weights.dtype)


@_combine_backward_op.register_fake
def _(grad, y, token, assignment, slot, weights, top_k):
    return torch.empty_like(y), torch.empty_like(weights)


def _maps_of(ctx) -> tuple:
    return ctx.saved_tensors[-3:] + (ctx.top_k, )


def _save(ctx, *tensors_then_maps):
    *tensors, token, assignment, slot, top_k = tensors_then_maps
    ctx.top_k = top_k
    ctx.save_for_backward(*tensors, token, assignment, slot)


def _dispatch_setup(ctx, inputs, output):
    x, token, assignment, slot, scores, top_k = inputs
    _save(ctx, x if scores is not None else None, scores, token, assignment, slot, top_k)


def _dispatch_backward(ctx, grad):
    x, scores = ctx.saved_tensors[:2]
    maps = _maps_of(ctx)
    dx = _combine_op(grad, *maps[:3], scores, maps[3]) if ctx.needs_input_grad[0] else None
    ds = None
    if scores is not None and ctx.needs_input_grad[4]:
        ds = _slot_dot_op(x, grad, *maps).view(scores.shape).to(scores.dtype)
    return dx, None, None, None, ds, None


def _combine_setup(ctx, inputs, output):
    y, token, assignment, slot, weights, top_k = inputs
    _save(ctx, y if weights is not None else None, weights, token, assignment, slot, top_k)


def _combine_backward(ctx, grad):
    y, weights = ctx.saved_tensors[:2]
    maps = _maps_of(ctx)
    need_y, need_w = ctx.needs_input_grad[0], weights is not None and ctx.needs_input_grad[4]
    dy = dw = None
    if need_y and need_w:
        dy, dw = _combine_backward_op(grad, y, *maps[:3], weights, maps[3])
    elif need_y:
        dy = _dispatch_op(grad, *maps[:3], weights, maps[3])
    elif need_w:
        dw = _slot_dot_op(grad, y, *maps).view(weights.shape).to(weights.dtype)
    return dy, None, None, None, dw, None


def _slot_dot_setup(ctx, inputs, output):
    tokens, slots, token, assignment, slot, top_k = inputs
    _save(ctx, tokens, slots, token, assignment, slot, top_k)


def _slot_dot_backward(ctx, grad):
    tokens, slots = ctx.saved_tensors[:2]
    maps = _maps_of(ctx)
    dt = _combine_op(slots, *maps[:3], grad, maps[3]).to(tokens.dtype) if ctx.needs_input_grad[0] else None
    ds = _dispatch_op(tokens, *maps[:3], grad, maps[3]).to(slots.dtype) if ctx.needs_input_grad[1] else None
    return dt, ds, None, None, None, None


def _combine_backward_setup(ctx, inputs, output):
    grad, y, token, assignment, slot, weights, top_k = inputs
    _save(ctx, grad, y, weights, token, assignment, slot, top_k)


def _combine_backward_backward(ctx, gg_y, gg_w):
    """With ``dy[s] = grad[token[s]] * w[assignment[s]]`` and ``dw[a] = <grad[a // k], y[slot[a]]>``:
    ``d grad = combine(gg_y, w) + combine(y, gg_w)``, ``d y = dispatch(grad, gg_w)`` and
    ``d w = slot_dot(grad, gg_y)``."""
    grad, y, weights = ctx.saved_tensors[:3]
    maps = _maps_of(ctx)
    d_grad = d_y = d_w = None
    if ctx.needs_input_grad[0]:
        parts = ([_combine_op(gg_y, *maps[:3], weights, maps[3])] if gg_y is not None else []) + \
                ([_combine_op(y, *maps[:3], gg_w.reshape(-1), maps[3]).to(grad.dtype)] if gg_w is not None else [])
        d_grad = sum(parts[1:], parts[0]) if parts else None
    if ctx.needs_input_grad[1] and gg_w is not None:
        d_y = _dispatch_op(grad, *maps[:3], gg_w.reshape(-1), maps[3]).to(y.dtype)
    if ctx.needs_input_grad[5] and gg_y is not None:
        d_w = _slot_dot_op(grad, gg_y, *maps).view(weights.shape).to(weights.dtype)
    return d_grad, d_y, None, None, None, d_w, None


_dispatch_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)
_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)
_slot_dot_op.register_autograd(_slot_dot_backward, setup_context=_slot_dot_setup)
_combine_backward_op.register_autograd(_combine_backward_backward, setup_context=_combine_backward_setup)


# ---- the API -------------------------------------------------------------------------------------

def route_dispatch(x: torch.Tensor, maps: RouteMaps, scores: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Token rows ``[T, H]`` into slots ``[S, H]`` through ``maps`` (zero rows at padding slots); with
    ``scores`` (``[T, k]``, DeepSpeed's ``score_apply="pre"``) each row is multiplied by its
    assignment's score in FP32 and rounded once. Backward: gathers, no atomics."""
    check_rows("x", x)
    if scores is not None:
        if not scores.is_floating_point() or scores.numel() != maps.slot.numel():
            raise ValueError(f"scores: expected {maps.slot.numel()} floating-point routing scores, got "
                             f"{scores.numel()} of {scores.dtype}")
    if x.shape[0] * maps.top_k != maps.slot.numel():
        raise ValueError(f"x: expected {maps.slot.numel() // maps.top_k} token rows, got {x.shape[0]}")
    check_device(x, scores=scores, maps=maps.slot)
    if torch.compiler.is_compiling():
        return _dispatch_op(x, maps.token, maps.assignment, maps.slot, scores, maps.top_k)
    return _dispatch_eager(x, maps, scores)


def route_combine(y: torch.Tensor, maps: RouteMaps, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Slot rows ``[S, H]`` back to tokens ``[T, H]``: ``out[t] = sum_j y[slot[t, j]] * weights[t, j]``
    in FP32, rounded once (no weights: the plain sum; unplaced assignments contribute nothing).
    Backward: gathers, no atomics."""
    check_rows("y", y)
    if y.shape[0] != maps.token.numel():
        raise ValueError(f"y: expected {maps.token.numel()} slot rows, got {y.shape[0]}")
    if weights is not None and (not weights.is_floating_point() or weights.numel() != maps.slot.numel()):
        raise ValueError(f"weights: expected {maps.slot.numel()} floating-point routing weights, got "
                         f"{weights.numel()} of {weights.dtype}")
    check_device(y, weights=weights, maps=maps.slot)
    if torch.compiler.is_compiling():
        return _combine_op(y, maps.token, maps.assignment, maps.slot, weights, maps.top_k)
    return _combine_eager(y, maps, weights)
