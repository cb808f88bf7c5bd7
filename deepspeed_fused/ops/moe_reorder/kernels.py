"""The Triton kernels of the MoE token reorder and their launches: one kernel family.

All of it is one kind of kernel, the padded row gather (``out[i] = src[index[i]]``, a zero row
where the index is padding) and what rides on it, so the four kernels live together:

* ``_gather_rows_kernel``: the gather, optionally scaled per row (in FP32, rounded once) and
  optionally writing the inverse map as it goes (the permute builds its own inverse);
* ``_combine_kernel``: each token gathers its ``k`` rows, weights them and sums in FP32;
* ``_combine_backward_kernel``: per slot, the weighted gradient row and the dot product with the
  slot's row (the routing weight's gradient) in one pass over the columns;
* ``_route_maps_kernel``: the slot / assignment / token maps of a routed batch, in one launch.

The functions below (:func:`gather_rows`, :func:`combine_rows`, :func:`slot_pass`,
:func:`route_maps_into`) are the only way the other modules of the package start them. They
take tensors the kernels can take (checked by the callers); sizes change from call to call, so
every launch goes through :class:`~deepspeed_fused.ops._common.DirectKernel` (the C launcher
once a specialization is compiled).
"""
from __future__ import annotations

from typing import Optional

import torch

from .._common import HAS_TRITON, cdiv, next_power_of_2, DirectKernel, sm_count, tl, triton

if HAS_TRITON:

    @triton.jit
    def _gather_rows_kernel(src_ptr, index_ptr, scale_ptr, out_ptr, inverse_ptr, assign_ptr, num_out, num_src,
                            hidden, num_col_tiles, HAS_SCALE: tl.constexpr, WRITE_INVERSE: tl.constexpr,
                            SCALE_BY_ASSIGN: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                            VEC: tl.constexpr, ALIGNED: tl.constexpr):
        # SCALE_BY_ASSIGN: the scale of output row i is scale[assign[i]] (a routing weight of the
        # assignment the row holds) instead of scale[i].
        # One program copies a [ROWS, BLOCK_H] tile: the row indices are loaded once per tile, and
        # column tiles of one row tile are adjacent program ids (consecutive DRAM pages).
        # WRITE_INVERSE: the first column tile also records inverse[index[i]] = i (one write per
        # valid slot, no duplicates for a one-to-one map), so the permute builds its inverse free.
        pid = tl.program_id(0)
        pid_r = pid // num_col_tiles
        pid_c = pid - pid_r * num_col_tiles
        rows = pid_r.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < num_out
        index = tl.load(index_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        valid = row_ok & (index >= 0) & (index < num_src)
        if WRITE_INVERSE:
            tl.store(inverse_ptr + index, rows, mask=valid & (tl.zeros_like(rows) == pid_c))
        cols = pid_c * BLOCK_H + tl.arange(0, BLOCK_H)
        cols = tl.max_contiguous(tl.multiple_of(cols, VEC), VEC)
        col_ok = cols < hidden
        src_off = index * hidden
        out_off = rows * hidden
        if ALIGNED:  # rows start on 16-byte boundaries: vector loads and stores
            src_off = tl.multiple_of(src_off, VEC)
            out_off = tl.multiple_of(out_off, VEC)
        values = tl.load(src_ptr + src_off[:, None] + cols[None, :], mask=valid[:, None] & col_ok[None, :],
                         other=0.0)
        if HAS_SCALE:
            if SCALE_BY_ASSIGN:
                assign = tl.load(assign_ptr + rows, mask=valid, other=0).to(tl.int64)
                scale = tl.load(scale_ptr + assign, mask=valid, other=0.0).to(tl.float32)
            else:
                scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
            values = (values.to(tl.float32) * scale[:, None]).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + out_off[:, None] + cols[None, :], values, mask=row_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _combine_kernel(src_ptr, slot_ptr, weight_ptr, out_ptr, num_tokens, num_src, hidden, num_col_tiles,
                        TOP_K: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                        VEC: tl.constexpr, ALIGNED: tl.constexpr):
        # out[t] = sum_j src[slot[t, j]] * weight[t, j], summed in FP32 in the order j = 0..k-1.
        pid = tl.program_id(0)
        pid_r = pid // num_col_tiles
        pid_c = pid - pid_r * num_col_tiles
        toks = pid_r.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        tok_ok = toks < num_tokens
        cols = pid_c * BLOCK_H + tl.arange(0, BLOCK_H)
        cols = tl.max_contiguous(tl.multiple_of(cols, VEC), VEC)
        col_ok = cols < hidden
        acc = tl.zeros((ROWS, BLOCK_H), dtype=tl.float32)
        for j in tl.static_range(TOP_K):
            slot = tl.load(slot_ptr + toks * TOP_K + j, mask=tok_ok, other=-1).to(tl.int64)
            valid = tok_ok & (slot >= 0) & (slot < num_src)
            src_off = slot * hidden
            if ALIGNED:
                src_off = tl.multiple_of(src_off, VEC)
            x = tl.load(src_ptr + src_off[:, None] + cols[None, :], mask=valid[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            if HAS_WEIGHT:
                w = tl.load(weight_ptr + toks * TOP_K + j, mask=valid, other=0.0).to(tl.float32)
                acc += x * w[:, None]
            else:
                acc += x
        out_off = toks * hidden
        if ALIGNED:
            out_off = tl.multiple_of(out_off, VEC)
        tl.store(out_ptr + out_off[:, None] + cols[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=tok_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _combine_backward_kernel(grad_ptr, tok_ptr, scale_ptr, src_ptr, grad_src_ptr, dot_ptr, assign_ptr,
                                 num_slots, num_tokens, hidden, ROWS: tl.constexpr, BLOCK_H: tl.constexpr,
                                 VEC: tl.constexpr, ALIGNED: tl.constexpr, SCALE_BY_ASSIGN: tl.constexpr,
                                 WRITE_GRAD_SRC: tl.constexpr):
        # For each slot s used by assignment (t, j): grad_src[s] = grad[t] * weight[t, j] and
        # dot[s] = <grad[t], src[s]> (the routing weight's gradient), one pass over the columns.
        # SCALE_BY_ASSIGN: the weight is scale[assign[s]]; else scale[s].
        pid = tl.program_id(0)
        rows = pid.to(tl.int64) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < num_slots
        tok = tl.load(tok_ptr + rows, mask=row_ok, other=-1).to(tl.int64)
        valid = row_ok & (tok >= 0) & (tok < num_tokens)
        if WRITE_GRAD_SRC:
            if SCALE_BY_ASSIGN:
                assign = tl.load(assign_ptr + rows, mask=valid, other=0).to(tl.int64)
                scale = tl.load(scale_ptr + assign, mask=valid, other=0.0).to(tl.float32)
            else:
                scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        g_off = tok * hidden
        r_off = rows * hidden
        if ALIGNED:
            g_off = tl.multiple_of(g_off, VEC)
            r_off = tl.multiple_of(r_off, VEC)
        dot = tl.zeros((ROWS, ), dtype=tl.float32)
        for start in range(0, hidden, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            cols = tl.max_contiguous(tl.multiple_of(cols, VEC), VEC)
            col_ok = cols < hidden
            g = tl.load(grad_ptr + g_off[:, None] + cols[None, :], mask=valid[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            x = tl.load(src_ptr + r_off[:, None] + cols[None, :], mask=valid[:, None] & col_ok[None, :],
                        other=0.0).to(tl.float32)
            if WRITE_GRAD_SRC:
                tl.store(grad_src_ptr + r_off[:, None] + cols[None, :], (g * scale[:, None]).to(
                    grad_src_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])
            dot += tl.sum(g * x, axis=1)
        tl.store(dot_ptr + rows, dot, mask=row_ok)

    # launches through the C launcher once a specialization is compiled (sizes change per call)
    _launch_gather = DirectKernel(_gather_rows_kernel)
    _launch_combine = DirectKernel(_combine_kernel)
    _launch_combine_backward = DirectKernel(_combine_backward_kernel)


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


if HAS_TRITON:

    @triton.jit
    def _route_maps_kernel(perm_ptr, sorted_ptr, assign_ptr, tok_ptr, slot_ptr, num_slots, num_sorted,
                           TOP_K: tl.constexpr, HAS_PERM: tl.constexpr, BLOCK: tl.constexpr):
        s = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = s < num_slots
        if HAS_PERM:
            p = tl.load(perm_ptr + s, mask=ok, other=-1).to(tl.int64)
        else:
            p = s.to(tl.int64)
        valid = ok & (p >= 0) & (p < num_sorted)
        a = tl.load(sorted_ptr + p, mask=valid, other=-1).to(tl.int64)
        valid = valid & (a >= 0)
        a = tl.where(valid, a, -1)
        tl.store(assign_ptr + s, a.to(tl.int32), mask=ok)
        tl.store(tok_ptr + s, tl.where(valid, a // TOP_K, -1).to(tl.int32), mask=ok)
        tl.store(slot_ptr + a, s.to(tl.int32), mask=valid)

    _launch_route_maps = DirectKernel(_route_maps_kernel)


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


# ---- the expert sort: a stable counting sort of the assignments, and the maps from it ---------------
# Buckets: experts 0..E-1, then one sentinel bucket E (ids outside [0, E): experts of other ranks),
# then the lanes past the end of the input in the last bucket NB - 1 > E (so no op needs a mask).
SORT_SUB = 128  # assignments ranked at once (a [SUB, SUB] comparison tile)
SORT_MAX_EXPERTS = 8190  # NB <= 8192 buckets held per program


def sort_buckets(num_experts: int) -> int:
    """Buckets of the counting sort: a power of two above the E experts and the sentinel bucket."""
    return max(32, next_power_of_2(num_experts + 2))  # (a GPU tl.histogram counts into >= 32 bins)


if HAS_TRITON:

    @triton.jit
    def _sort_bucket(ids_ptr, a, n, num_experts, NB: tl.constexpr):
        ok = a < n
        e = tl.load(ids_ptr + a, mask=ok, other=0)
        real = ok & (e >= 0) & (e < num_experts)
        b = tl.where(real, e, num_experts).to(tl.int32)
        return tl.where(ok, b, NB - 1), real, ok

    @triton.jit
    def _route_sort_count_kernel(ids_ptr, counts_ptr, n, num_experts, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                                 NB: tl.constexpr):
        # counts[p, b]: the assignments of chunk p (CHUNK of them) in bucket b
        pid = tl.program_id(0)
        hist = tl.zeros((NB, ), dtype=tl.int32)
        for start in range(0, CHUNK, BLOCK):
            a = pid.to(tl.int64) * CHUNK + start + tl.arange(0, BLOCK)
            b, _, _ = _sort_bucket(ids_ptr, a, n, num_experts, NB)
            hist += tl.histogram(b, NB)
        tl.store(counts_ptr + pid.to(tl.int64) * NB + tl.arange(0, NB), hist)

    @triton.jit
    def _route_sort_kernel(ids_ptr, counts_ptr, order_ptr, tok_ptr, assign_ptr, slot_ptr, experts_ptr, offsets_ptr,
                           n, num_experts, num_chunks, TOP_K: tl.constexpr, CHUNK: tl.constexpr, SUB: tl.constexpr,
                           NB: tl.constexpr, CT: tl.constexpr):
        # Sorted position of assignment a in bucket b: the assignments of buckets < b, plus those of
        # bucket b in earlier chunks, plus those of bucket b earlier in this chunk (a stable sort).
        pid = tl.program_id(0)
        bins = tl.arange(0, NB)
        total = tl.zeros((NB, ), dtype=tl.int32)
        before = tl.zeros((NB, ), dtype=tl.int32)
        for c0 in range(0, num_chunks, CT):
            rows = c0 + tl.arange(0, CT)
            c = tl.load(counts_ptr + rows.to(tl.int64)[:, None] * NB + bins[None, :],
                        mask=(rows < num_chunks)[:, None], other=0)
            total += tl.sum(c, axis=0)
            before += tl.sum(tl.where((rows < pid)[:, None], c, 0), axis=0)
        inclusive = tl.cumsum(total, axis=0)
        if pid == 0:  # grouped_mm's offsets: the end of each expert's rows (the sentinels excluded)
            tl.store(offsets_ptr + bins, inclusive, mask=bins < num_experts)
        start = inclusive - total + before  # next sorted position of each bucket in this chunk
        lane = tl.arange(0, SUB)
        earlier = lane[None, :] < lane[:, None]
        for s0 in range(0, CHUNK, SUB):
            a = pid.to(tl.int64) * CHUNK + s0 + lane
            b, real, ok = _sort_bucket(ids_ptr, a, n, num_experts, NB)
            # rank among this block's assignments of the same bucket, in assignment order
            rank = tl.sum(tl.where((b[:, None] == b[None, :]) & earlier, 1, 0), axis=1)
            pos = tl.gather(start, b, 0) + rank
            start += tl.histogram(b, NB)
            a32 = a.to(tl.int32)
            pos64 = pos.to(tl.int64)
            tl.store(order_ptr + pos64, a32, mask=ok)
            tl.store(experts_ptr + pos64, tl.minimum(b, num_experts - 1), mask=ok)
            tl.store(assign_ptr + pos64, tl.where(real, a32, -1), mask=ok)
            tl.store(tok_ptr + pos64, tl.where(real, a32 // TOP_K, -1), mask=ok)
            tl.store(slot_ptr + a, tl.where(real, pos, -1), mask=ok)

    _launch_route_sort_count = DirectKernel(_route_sort_count_kernel)
    _launch_route_sort = DirectKernel(_route_sort_kernel)


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
