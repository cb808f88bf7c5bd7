"""Torch references of the MoE reorder ops (the eager formulations), and the route maps.

What the kernels compute, in plain torch: the padded permute and its inverse as DeepSpeed <= 0.19.7
wrote them, the routed dispatch and combine (FP32 products and sum, ``j`` in order, one rounding),
and the slot / assignment maps of a routed batch. The ops run these on inputs their kernels
cannot take.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch


class RouteMaps(NamedTuple):
    """Slot <-> assignment maps of one routed batch (int32). A top-k router assigns token ``t`` to
    ``k`` experts: assignment ``a = t * k + j``. ``token`` and ``assignment`` per slot (``-1`` for
    padding slots), ``slot`` per assignment ``[T * top_k]`` (``-1`` if unplaced)."""
    token: torch.Tensor
    assignment: torch.Tensor
    slot: torch.Tensor
    top_k: int


class RouteSort(NamedTuple):
    """Assignments sorted by expert and what a grouped GEMM over them needs (int32), from
    :func:`~deepspeed_fused.ops.moe_reorder.route_sort`. ``order``: sorted position -> assignment
    (``[T * k]``; a stable sort, ids outside ``[0, E)``, the sentinels, after every expert);
    ``maps``: the route maps of the sorted positions as slots, the sentinels' as padding;
    ``offsets``: ``[E]``, the end of each expert's rows (``cumsum`` of the counts, as grouped_mm
    takes them); ``experts``: the expert id per sorted position, clamped to ``E - 1`` (a
    sentinel's slot is past ``offsets[-1]``)."""
    order: torch.Tensor
    maps: RouteMaps
    offsets: torch.Tensor
    experts: torch.Tensor


def invert(index: torch.Tensor, size: int) -> torch.Tensor:
    """``inv[index[i]] = i`` for the entries of ``index`` in ``[0, size)``; ``-1`` where no entry
    points. Entries outside the range go to distinct scratch slots past ``size``, so no location
    is written twice when the in-range entries are distinct."""
    n = index.numel()
    positions = torch.arange(n, device=index.device, dtype=torch.int64)
    idx = index.reshape(-1).to(torch.int64)
    targets = torch.where((idx >= 0) & (idx < size), idx, size + positions)
    scratch = torch.full((size + n, ), -1, dtype=torch.int64, device=index.device)
    scratch.scatter_(0, targets, positions)
    return scratch[:size]


def _pad_index(index: torch.Tensor, num_rows: int) -> torch.Tensor:
    idx = index.to(torch.int64)
    return torch.where((idx >= 0) & (idx < num_rows), idx, num_rows)


def permute_rows_reference(rows: torch.Tensor, permuted_indices: torch.Tensor) -> torch.Tensor:
    """DeepSpeed <= 0.19.7: append a zero row and index (padding ``-1`` or ``N`` reads it)."""
    padded = torch.vstack((rows, rows.new_zeros((1, rows.shape[-1]))))
    return padded[_pad_index(permuted_indices, rows.shape[0])]


def unpermute_rows_reference(rows: torch.Tensor, permuted_indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """DeepSpeed <= 0.19.7: zero-fill ``N + 1`` rows, ``index_put`` the slots, drop the last row."""
    out = rows.new_zeros((num_rows + 1, rows.shape[-1]))
    out[_pad_index(permuted_indices, num_rows)] = rows
    return out[:-1]


def combine_reference(src: torch.Tensor, slot_of_assignment: torch.Tensor,
                      routing_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_j src[slot[t, j]] * w[t, j]`` (``slot`` ``[T, k]``, ``-1``: nothing) in FP32 (j in
    order), rounded once to ``src.dtype``."""
    gathered = permute_rows_reference(src, slot_of_assignment.reshape(-1)).float()
    gathered = gathered.view(*slot_of_assignment.shape, src.shape[-1])
    acc = torch.zeros(slot_of_assignment.shape[0], src.shape[-1], dtype=torch.float32, device=src.device)
    for j in range(slot_of_assignment.shape[1]):
        x = gathered[:, j]
        acc = acc + (x * routing_weights[:, j, None].float() if routing_weights is not None else x)
    return acc.to(src.dtype)


def route_maps_reference(token_indices_sorted: torch.Tensor, top_k: int,
                         permuted_indices: Optional[torch.Tensor] = None) -> RouteMaps:
    """:func:`~deepspeed_fused.ops.moe_reorder.route_maps` in torch."""
    n = token_indices_sorted.numel()
    srt = token_indices_sorted.reshape(-1).to(torch.int64)
    p = (torch.arange(n, device=srt.device) if permuted_indices is None
         else permuted_indices.reshape(-1).to(torch.int64))
    valid = (p >= 0) & (p < n)
    a = torch.where(valid, srt[p.clamp(0, max(n - 1, 0))] if n else p, -1)
    tok = torch.where(a >= 0, a // top_k, -1)
    slot = invert(a, n)
    return RouteMaps(tok.to(torch.int32), a.to(torch.int32), slot.to(torch.int32), top_k)


def route_sort_reference(expert_ids: torch.Tensor, num_experts: int, top_k: int) -> RouteSort:
    """:func:`~deepspeed_fused.ops.moe_reorder.route_sort` in torch: a stable ``torch.sort`` of the
    ids with every sentinel mapped to ``num_experts``, and :func:`route_maps_reference`."""
    ids = expert_ids.reshape(-1).to(torch.int64)
    n = ids.numel()
    bucket = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts)
    sorted_bucket, order = torch.sort(bucket, stable=True)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids.device)
    counts.index_add_(0, bucket, torch.ones_like(bucket))
    offsets = torch.cumsum(counts[:num_experts], 0).to(torch.int32)
    positions = torch.arange(n, device=ids.device).masked_fill(sorted_bucket == num_experts, -1)
    maps = route_maps_reference(order, top_k, positions)
    return RouteSort(order.to(torch.int32), maps, offsets, sorted_bucket.clamp(max=num_experts - 1).to(torch.int32))


def route_dispatch_reference(x: torch.Tensor, maps: RouteMaps, scores: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[s] = x[token[s]]`` (zero at padding), times ``scores[assignment[s]]`` in FP32, rounded once."""
    out = permute_rows_reference(x, maps.token)
    if scores is not None:
        a = maps.assignment.to(torch.int64)
        sc = torch.where(a >= 0, scores.reshape(-1).float()[a.clamp(min=0)], 0.0)
        out = (out.float() * sc[:, None]).to(x.dtype)
    return out


def route_combine_reference(y: torch.Tensor, maps: RouteMaps, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[t] = sum_j y[slot[t, j]] * weights[t, j]`` in FP32 (``j`` in order), rounded once."""
    slot = maps.slot.view(-1, maps.top_k)
    return combine_reference(y, slot, weights.reshape(slot.shape) if weights is not None else None)


def per_assignment(per_slot: torch.Tensor, maps: RouteMaps) -> torch.Tensor:
    """A per-slot value read per assignment (``[T * k]``, 0 where unplaced)."""
    slot = maps.slot.to(torch.int64)
    n = per_slot.numel()
    return torch.where(slot >= 0, per_slot[slot.clamp(0, max(n - 1, 0))] if n else 0.0, 0.0)


def slot_dot_reference(tokens: torch.Tensor, slots: torch.Tensor, maps: RouteMaps) -> torch.Tensor:
    """``d[a] = <tokens[a // k], slots[slot[a]]>`` in FP32 (0 where unplaced), ``[T * k]``."""
    return per_assignment((permute_rows_reference(tokens, maps.token).float() * slots.float()).sum(-1), maps)
