"""The Triton kernels of the MoE token reorder: one kernel family.

All of it is one kind of kernel, the padded row gather (``out[i] = src[index[i]]``, a zero row
where the index is padding) and what rides on it:

* ``_gather_rows_kernel``: the gather, optionally scaled per row (in FP32, rounded once) and
  optionally writing the inverse map as it goes (the permute builds its own inverse);
* ``_combine_kernel``: each token gathers its ``k`` rows, weights them and sums in FP32;
* ``_combine_backward_kernel``: per slot, the weighted gradient row and the dot product with the
  slot's row (the routing weight's gradient) in one pass over the columns;
* ``_route_maps_kernel``: the slot / assignment / token maps of a routed batch, in one launch;
* ``_route_sort_count_kernel`` / ``_route_sort_kernel``: the expert sort, a stable counting sort.

Their launches are in :mod:`.launch`.
"""
from __future__ import annotations

from .._common import HAS_TRITON, tl, triton

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


# ---- the expert sort: a stable counting sort of the assignments, and the maps from it ---------------
# Buckets: experts 0..E-1, then one sentinel bucket E (ids outside [0, E): experts of other ranks),
# then the lanes past the end of the input in the last bucket NB - 1 > E (so no op needs a mask).
SORT_SUB = 128  # assignments ranked at once (a [SUB, SUB] comparison tile)
SORT_MAX_EXPERTS = 8190  # NB <= 8192 buckets held per program



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
