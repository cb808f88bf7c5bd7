"""The launches of the MoE token reorder's kernels (:mod:`.kernels`).

The functions here (:func:`gather_rows`, :func:`combine_rows`, :func:`slot_pass`,
:func:`route_maps_into`, :func:`route_sort_into`) are the only way the other modules of the
package start them. They take tensors the kernels can take (checked by the callers); sizes change
from call to call, so every launch goes through :class:`~deepspeed_fused.ops._common.DirectKernel`
(the C launcher once a specialization is compiled).
"""
from __future__ import annotations

from typing import Optional

import torch

from .._common import HAS_TRITON, cdiv, next_power_of_2, DirectKernel, sm_count
from .kernels import SORT_MAX_EXPERTS, SORT_SUB  # noqa: F401  (SORT_MAX_EXPERTS: the callers' bound)

if HAS_TRITON:
    from .kernels import (_combine_backward_kernel, _combine_kernel, _gather_rows_kernel, _route_maps_kernel,
                          _route_sort_count_kernel, _route_sort_kernel)

if HAS_TRITON:
    # launches through the C launcher once a specialization is compiled (sizes change per call)
    _launch_gather = DirectKernel(_gather_rows_kernel)
    _launch_combine = DirectKernel(_combine_kernel)
    _launch_combine_backward = DirectKernel(_combine_backward_kernel)
    _launch_route_maps = DirectKernel(_route_maps_kernel)
    _launch_route_sort_count = DirectKernel(_route_sort_count_kernel)
    _launch_route_sort = DirectKernel(_route_sort_kernel)


def _tile(num_rows: int, hidden: int, elem: int, device: torch.device, max_bytes: int = 32768,
          max_block: int = 1 << 30, bytes_per_warp: int = 4096):
    """(ROWS, BLOCK_H, VEC, num_warps) of a 2-D tiled row copy.

    16-byte vectors; a column block of up to 4 KiB (and ``max_block`` columns) per row, chosen to
    waste at most 1/16 of the lanes on a ragged last block (H=2880 -> 1024 bf16 columns, 3
    blocks); several rows per program so each moves ~``max_bytes`` (small H -> many rows); fewer
    rows when the grid would leave SMs idle (few rows); a warp per ``bytes_per_warp`` of tile."""
    vec = max(1, 16 // elem)
    block_h = max(vec, min(next_power_of_2(hidden), 4096 // elem, max_block))
    while block_h > vec * 32:
        n = cdiv(hidden, block_h)
        if (n * block_h - hidden) * 16 <= n * block_h:
            break
        block_h //= 2
    rows = max(1, min(128, (max_bytes // elem) // block_h))
    rows = min(rows, next_power_of_2(max(1, num_rows)))
    n_col = cdiv(hidden, block_h)
    if device.type == "cuda":
        target = 4 * sm_count(device.index if device.index is not None else torch.cuda.current_device())
        while rows > 1 and cdiv(num_rows, rows) * n_col < target:
            rows //= 2
    tile_bytes = rows * block_h * elem
    num_warps = max(1, min(8, tile_bytes // bytes_per_warp))
    num_warps = 1 << (num_warps.bit_length() - 1)
    return rows, block_h, vec, num_warps


def gather_rows(src: torch.Tensor, index: torch.Tensor, scale: Optional[torch.Tensor] = None,
                out_dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None,
                inverse: Optional[torch.Tensor] = None, assign: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launch the gather: ``out[i] = src[index[i]] (* scale[i])``; ``out`` (tests) is written whole;
    ``inverse`` (int64 ``[len(src)]``, pre-filled) receives ``inverse[index[i]] = i``; with
    ``assign`` the scale of row ``i`` is ``scale[assign[i]]``."""
    src = src.contiguous()
    index = index.contiguous()
    n_out, hidden = index.numel(), src.shape[1]
    if out is None:
        out = torch.empty((n_out, hidden), dtype=out_dtype or src.dtype, device=src.device)
    if out.numel() == 0:
        return out
    rows, block_h, vec, warps = _tile(n_out, hidden, src.element_size(), src.device)
    n_col = cdiv(hidden, block_h)
    _launch_gather((cdiv(n_out, rows) * n_col, ), (
        src, index, scale.contiguous() if scale is not None else src, out, inverse if inverse is not None else index,
        assign if assign is not None else index, n_out, src.shape[0], hidden, n_col), dict(
        HAS_SCALE=scale is not None, WRITE_INVERSE=inverse is not None, SCALE_BY_ASSIGN=assign is not None,
        ROWS=rows, BLOCK_H=block_h, VEC=vec, ALIGNED=hidden % vec == 0), warps)
    return out


def combine_rows(src: torch.Tensor, slot: torch.Tensor, weights: Optional[torch.Tensor],
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Launch the combine: ``out[t] = sum_j src[slot[t, j]] * weights[t, j]`` (``slot`` ``[T, k]``,
    ``-1`` contributes nothing) in FP32, rounded once; ``out`` (tests) is written whole."""
    src = src.contiguous()
    slot = slot.contiguous()
    num_tokens, top_k = slot.shape
    hidden = src.shape[1]
    if out is None:
        out = torch.empty((num_tokens, hidden), dtype=src.dtype, device=src.device)
    if out.numel() == 0:
        return out
    if top_k == 0:
        return out.zero_()
    # Small tiles (1024 elements, 16 per thread) and many programs: each program's k gathers are
    # serial (the row index, then the row), so the memory system is kept busy by programs, not by
    # a program's width (swept on an H200 at k=8: H 7168 2.18 -> 4.25 TB/s, H 2048 2.97 -> 3.79)
    elem = src.element_size()
    rows, block_h, vec, warps = _tile(num_tokens, hidden, elem, src.device, max_bytes=1024 * elem, max_block=1024,
                                      bytes_per_warp=1024)
    n_col = cdiv(hidden, block_h)
    _launch_combine((cdiv(num_tokens, rows) * n_col, ), (
        src, slot, weights.contiguous() if weights is not None else src, out, num_tokens, src.shape[0], hidden,
        n_col), dict(TOP_K=top_k, HAS_WEIGHT=weights is not None, ROWS=rows, BLOCK_H=block_h, VEC=vec,
                     ALIGNED=hidden % vec == 0), warps)
    return out


def slot_pass(a_rows: torch.Tensor, b_slots: torch.Tensor, token: torch.Tensor, assignment: torch.Tensor,
              scale: Optional[torch.Tensor] = None) -> tuple:
    """One pass over the slots ``[S, H]`` of ``b_slots``: ``dot[s] = <a_rows[token[s]], b_slots[s]>``
    in FP32 (``[S]``, 0 at padding slots); with ``scale`` (per assignment) also
    ``g[s] = a_rows[token[s]] * scale[assignment[s]]`` in ``b_slots``'s dtype (else None).
    Needs at least one slot and one column."""
    num_slots, hidden = b_slots.shape
    a_rows, b_slots = a_rows.contiguous(), b_slots.contiguous()
    dot = torch.empty(num_slots, dtype=torch.float32, device=b_slots.device)
    g = torch.empty_like(b_slots) if scale is not None else None
    rows, block_h, vec, warps = _tile(num_slots, hidden, b_slots.element_size(), b_slots.device, 16384)
    _launch_combine_backward((cdiv(num_slots, rows), ), (
        a_rows, token, scale.reshape(-1).contiguous() if scale is not None else dot, b_slots,
        g if g is not None else dot, dot, assignment, num_slots, a_rows.shape[0], hidden), dict(
        ROWS=rows, BLOCK_H=block_h, VEC=vec, ALIGNED=hidden % vec == 0, SCALE_BY_ASSIGN=True,
        WRITE_GRAD_SRC=g is not None), warps)
    return g, dot


def route_maps_into(order: torch.Tensor, positions: Optional[torch.Tensor], top_k: int) -> tuple:
    """Launch the route maps: for ``order`` (sorted position -> assignment, ``[T * top_k]``) placed
    in slots (slot ``s`` holds sorted position ``positions[s]``, padding where out of range; ``s``
    itself without ``positions``), the int32 maps ``(token, assignment)`` per slot (``-1`` at
    padding) and ``slot`` per assignment (``-1`` where unplaced)."""
    srt = order.contiguous()
    n = srt.numel()
    num_slots = n if positions is None else positions.numel()
    dev = srt.device
    assign = torch.empty(num_slots, dtype=torch.int32, device=dev)
    tok = torch.empty(num_slots, dtype=torch.int32, device=dev)
    slot = torch.full((n, ), -1, dtype=torch.int32, device=dev)
    if num_slots:
        block = 1024
        perm = positions.contiguous() if positions is not None else srt
        _launch_route_maps((cdiv(num_slots, block), ), (perm, srt, assign, tok, slot, num_slots, n),
                           dict(TOP_K=top_k, HAS_PERM=positions is not None, BLOCK=block), 4)
    return tok, assign, slot


def sort_buckets(num_experts: int) -> int:
    """Buckets of the counting sort: a power of two above the E experts and the sentinel bucket."""
    return max(32, next_power_of_2(num_experts + 2))  # (a GPU tl.histogram counts into >= 32 bins)


def _sort_chunk(n: int, device: torch.device) -> int:
    """Assignments per program: a power of two (at least one comparison block), as few programs as
    the work allows on the interpreter, about 128 on a GPU (each program reads every chunk's counts)."""
    target = 128 if device.type == "cuda" else 4
    return max(SORT_SUB, next_power_of_2(cdiv(max(n, 1), target)))


def route_sort_into(expert_ids: torch.Tensor, num_experts: int, top_k: int, out: Optional[tuple] = None,
                    chunk: Optional[int] = None) -> tuple:
    """Launch the expert sort (two launches): for ``expert_ids`` (``[N]``, ``N = T * top_k``) the
    int32 ``(order, token, assignment, slot, offsets, experts)``: sorted position -> assignment
    (stable, ids outside ``[0, num_experts)`` last), the route maps with those as padding slots,
    grouped_mm's ``offsets`` ``[num_experts]`` (cumulative counts of the real experts) and the
    expert id per sorted position clamped to ``num_experts - 1``. ``out`` (tests) are the six
    outputs to write; ``chunk`` (a power of two, at least ``SORT_SUB``) the assignments per program."""
    ids = expert_ids.contiguous()
    n, dev = ids.numel(), ids.device
    if out is None:
        out = tuple(torch.empty(n, dtype=torch.int32, device=dev) for _ in range(4)) + (
            torch.empty(num_experts, dtype=torch.int32, device=dev), torch.empty(n, dtype=torch.int32, device=dev))
    order, tok, assign, slot, offsets, experts = out
    if n == 0:
        offsets.zero_()
        return out
    nb = sort_buckets(num_experts)
    chunk = chunk or _sort_chunk(n, dev)
    num_chunks = cdiv(n, chunk)
    counts = torch.empty((num_chunks, nb), dtype=torch.int32, device=dev)
    _launch_route_sort_count((num_chunks, ), (ids, counts, n, num_experts),
                             dict(CHUNK=chunk, BLOCK=min(chunk, 1024), NB=nb), 4)
    _launch_route_sort((num_chunks, ), (ids, counts, order, tok, assign, slot, experts, offsets, n, num_experts,
                                        num_chunks),
                       dict(TOP_K=top_k, CHUNK=chunk, SUB=SORT_SUB, NB=nb, CT=max(1, 8192 // nb)), 8)
    return out
