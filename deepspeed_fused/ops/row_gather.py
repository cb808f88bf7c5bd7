"""Row gathers for the MoE token reorder, with gathers as their backwards.

A MoE layer moves token rows into an expert-major buffer and back. All of it is done here with
one kind of kernel, a padded row gather: ``out[i] = src[index[i]]``, or a zero row where
``index[i]`` is padding (``-1``, or ``len(src)``: the zero row the eager formulation appends).

* :func:`permute_rows` ``[N, H] -> [NP, H]``: rows into the padded order of ``permuted_indices``
  (as from ``deepspeed.moe.ep_kernels.generate_permute_indices``); zeros at padding slots.
* :func:`unpermute_rows` ``[NP, H] -> [N, H]``: each row back from the slot it went to, a gather
  through :func:`inverse_permutation`; padding slots are never read.
* Each is the other's backward. Because the valid entries of ``permuted_indices`` are a
  one-to-one map of the rows, a row's gradient is that of its single slot: no scatter-add, no
  atomics, and outputs and gradients equal (``torch.equal``) those of the eager formulations
  (append a zero row and index; zero-fill and ``index_put``). Both are differentiable again.
* :func:`gather_dispatch` ``[T, H] -> [S, H]``: the dispatch of a top-k router (each token to
  its ``k`` slots); its backward is :func:`gather_combine` without weights.
* :func:`gather_combine` ``[S, H] -> [T, H]``: each token gathers its ``k`` expert rows,
  multiplies them by the routing weights and sums in FP32, rounding once.

The kernels run on CUDA tensors (and on CPU tensors under ``TRITON_INTERPRET=1``); anything
else runs the torch reference with one warning per reason. Index validity is not checked on
the hot path (that would need a host sync); pass ``validate=True`` to check it.
"""
from __future__ import annotations

import functools
from typing import NamedTuple, Optional

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from ._common import HAS_TRITON, DirectKernel, kernel_device_ok, interpreter_active, tl, triton, warn_fallback

__all__ = [
    "permute_rows", "unpermute_rows", "inverse_permutation", "validate_permutation", "gather_dispatch",
    "gather_combine", "permute_rows_reference", "unpermute_rows_reference", "gather_combine_reference",
    "gather_dispatch_reference", "RouteMaps", "route_maps", "route_maps_reference", "route_dispatch", "route_combine",
]

_OP = "row_gather"
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)

# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------

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


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _tile(num_rows: int, hidden: int, elem: int, device: torch.device, max_bytes: int = 32768,
          max_block: int = 1 << 30, bytes_per_warp: int = 4096):
    """(ROWS, BLOCK_H, VEC, num_warps) of a 2-D tiled row copy.

    16-byte vectors; a column block of up to 4 KiB (and ``max_block`` columns) per row, chosen to
    waste at most 1/16 of the lanes on a ragged last block (H=2880 -> 1024 bf16 columns, 3
    blocks); several rows per program so each moves ~``max_bytes`` (small H -> many rows); fewer
    rows when the grid would leave SMs idle (few rows); a warp per ``bytes_per_warp`` of tile."""
    vec = max(1, 16 // elem)
    block_h = max(vec, min(triton.next_power_of_2(hidden), 4096 // elem, max_block))
    while block_h > vec * 32:
        n = triton.cdiv(hidden, block_h)
        if (n * block_h - hidden) * 16 <= n * block_h:
            break
        block_h //= 2
    rows = max(1, min(128, (max_bytes // elem) // block_h))
    rows = min(rows, triton.next_power_of_2(max(1, num_rows)))
    n_col = triton.cdiv(hidden, block_h)
    if device.type == "cuda":
        target = 4 * _sm_count(device.index if device.index is not None else torch.cuda.current_device())
        while rows > 1 and triton.cdiv(num_rows, rows) * n_col < target:
            rows //= 2
    tile_bytes = rows * block_h * elem
    num_warps = max(1, min(8, tile_bytes // bytes_per_warp))
    num_warps = 1 << (num_warps.bit_length() - 1)
    return rows, block_h, vec, num_warps


def _kernel_ok(op: str, *tensors: torch.Tensor) -> bool:
    """Whether the kernels can take these tensors; warn once per reason when not."""
    t = tensors[0]
    ok, reason = kernel_device_ok(t)
    if ok and t.dtype not in _KERNEL_DTYPES:
        ok, reason = False, f"dtype {t.dtype} (kernels take float16, bfloat16, float32)"
    if ok and t.dtype == torch.bfloat16 and t.device.type == "cpu":
        ok, reason = False, "bfloat16 under the Triton interpreter (not exact there)"
    if not ok:
        warn_fallback(f"{_OP}.{op}", reason)
    return ok


def _gather_kernel(src: torch.Tensor, index: torch.Tensor, scale: Optional[torch.Tensor] = None,
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
    n_col = triton.cdiv(hidden, block_h)
    _launch_gather((triton.cdiv(n_out, rows) * n_col, ), (
        src, index, scale.contiguous() if scale is not None else src, out, inverse if inverse is not None else index,
        assign if assign is not None else index, n_out, src.shape[0], hidden, n_col), dict(
        HAS_SCALE=scale is not None, WRITE_INVERSE=inverse is not None, SCALE_BY_ASSIGN=assign is not None,
        ROWS=rows, BLOCK_H=block_h, VEC=vec, ALIGNED=hidden % vec == 0), warps)
    return out


# ----------------------------------------------------------------------------------------------
# Index helpers
# ----------------------------------------------------------------------------------------------


def _check_index(name: str, index: torch.Tensor, ndim: int = 1) -> None:
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(index).__name__}")
    if index.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name}: expected an int32 or int64 tensor, got {index.dtype}")
    if index.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(index.shape)}")


def _check_rows(name: str, rows: torch.Tensor) -> None:
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(rows).__name__}")
    if rows.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [rows, hidden] tensor, got shape {tuple(rows.shape)}")


def _check_device(rows: torch.Tensor, **indices: torch.Tensor) -> None:
    for name, t in indices.items():
        if t is not None and t.device != rows.device:
            raise ValueError(f"{name}: expected a tensor on {rows.device} (where the rows are), got {t.device}")


def _invert(index: torch.Tensor, size: int) -> torch.Tensor:
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


_inverse_cache = WeakTensorKeyDictionary()


def _version(t: torch.Tensor):
    try:
        return t._version
    except Exception:  # inference tensors have no version counter
        return None


def inverse_permutation(permuted_indices: torch.Tensor, num_rows: int) -> torch.Tensor:
    """For each of ``num_rows`` rows, the slot of ``permuted_indices`` that holds it (int64).

    Padding slots (``-1`` or ``num_rows``) are written to distinct scratch entries and dropped,
    so no location is written twice when the indices are valid. A row no slot holds gets ``-1``
    (it then reads as a zero row). The last result per index tensor is cached (keyed on the
    tensor and its version), so the permute and unpermute of one layer compute it once."""
    _check_index("permuted_indices", permuted_indices)
    num_rows = _check_num_rows(num_rows)
    inverse = _cached_inverse(permuted_indices, num_rows)
    if inverse is None:
        inverse = _invert(permuted_indices, num_rows)
        _remember_inverse(permuted_indices, num_rows, inverse)
    return inverse


def _cached_inverse(permuted_indices: torch.Tensor, num_rows: int) -> Optional[torch.Tensor]:
    version = _version(permuted_indices)
    hit = _inverse_cache.get(permuted_indices) if version is not None else None
    if hit is not None and hit[0] == version and hit[1] == num_rows:
        return hit[2]
    return None


def _remember_inverse(permuted_indices: torch.Tensor, num_rows: int, inverse: torch.Tensor) -> None:
    version = _version(permuted_indices)
    if version is not None:
        _inverse_cache[permuted_indices] = (version, num_rows, inverse)


def _check_num_rows(num_rows) -> int:
    if isinstance(num_rows, torch.Tensor) and num_rows.numel() == 1:
        num_rows = int(num_rows)
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows: expected a non-negative int, got {num_rows!r}")
    return num_rows


def validate_permutation(permuted_indices: torch.Tensor, num_rows: int) -> None:
    """Check that ``permuted_indices`` holds each of ``0 .. num_rows-1`` exactly once and that every
    other entry is padding (``-1``, or ``num_rows``). Raises ``TypeError`` for a wrong dtype and
    ``ValueError`` naming the first out-of-range entry, the first duplicate, or the first missing
    row. Synchronises with the device."""
    _check_index("permuted_indices", permuted_indices)
    num_rows = _check_num_rows(num_rows)
    idx = permuted_indices.detach().to(torch.int64).cpu()
    bad = (idx < -1) | (idx > num_rows)
    if bool(bad.any()):
        pos = int(bad.nonzero()[0])
        raise ValueError(f"permuted_indices: entry {pos} is {int(idx[pos])}, out of range: expected a row in "
                         f"[0, {num_rows}) or padding (-1 or {num_rows})")
    valid = (idx >= 0) & (idx < num_rows)
    vals = idx[valid]
    pos_of = valid.nonzero().reshape(-1)
    if vals.numel():
        sorted_vals, order = torch.sort(vals, stable=True)
        dup = sorted_vals[1:] == sorted_vals[:-1]
        if bool(dup.any()):
            later = pos_of[order[1:][dup]]
            pos = int(later.min())
            first = int(pos_of[(vals == idx[pos]).nonzero()[0]])
            raise ValueError(f"permuted_indices: entry {pos} repeats row {int(idx[pos])} (first at entry {first}); "
                             "each row must appear exactly once")
    if vals.numel() != num_rows:
        seen = torch.zeros(num_rows, dtype=torch.bool)
        seen[vals] = True
        missing = int((~seen).nonzero()[0])
        raise ValueError(f"permuted_indices: row {missing} appears in no entry; each of the {num_rows} rows "
                         "must appear exactly once")


# ----------------------------------------------------------------------------------------------
# Torch references (the eager formulations)
# ----------------------------------------------------------------------------------------------


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


def gather_dispatch_reference(rows: torch.Tensor, token_of_slot: torch.Tensor) -> torch.Tensor:
    """``rows[token_of_slot]`` with zero rows where the token is ``-1``."""
    return permute_rows_reference(rows, token_of_slot)


def gather_combine_reference(src: torch.Tensor, slot_of_assignment: torch.Tensor,
                             routing_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``sum_j src[slot[t, j]] * w[t, j]`` in FP32 (j in order), rounded once to ``src.dtype``."""
    gathered = permute_rows_reference(src, slot_of_assignment.reshape(-1)).float()
    gathered = gathered.view(*slot_of_assignment.shape, src.shape[-1])
    acc = torch.zeros(slot_of_assignment.shape[0], src.shape[-1], dtype=torch.float32, device=src.device)
    for j in range(slot_of_assignment.shape[1]):
        x = gathered[:, j]
        acc = acc + (x * routing_weights[:, j, None].float() if routing_weights is not None else x)
    return acc.to(src.dtype)


# ----------------------------------------------------------------------------------------------
# Custom ops
# ----------------------------------------------------------------------------------------------

_NS = "deepspeed_fused"


def _permute_impl(rows: torch.Tensor, permuted_indices: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    if _kernel_ok("permute_rows", rows, permuted_indices):
        return _gather_kernel(rows, permuted_indices)
    return permute_rows_reference(rows, permuted_indices).contiguous()


def _unpermute_impl(rows: torch.Tensor, permuted_indices: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    if _kernel_ok("unpermute_rows", rows, inverse):
        return _gather_kernel(rows, inverse)
    return unpermute_rows_reference(rows, permuted_indices, inverse.numel()).clone()


@torch.library.custom_op(f"{_NS}::rg_permute", mutates_args=())
def _permute_op(rows: torch.Tensor, permuted_indices: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    return _permute_impl(rows, permuted_indices, inverse)


@torch.library.custom_op(f"{_NS}::rg_unpermute", mutates_args=())
def _unpermute_op(rows: torch.Tensor, permuted_indices: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    return _unpermute_impl(rows, permuted_indices, inverse)


@torch.library.custom_op(f"{_NS}::rg_permute_with_inverse", mutates_args=())
def _permute_inverse_op(rows: torch.Tensor, permuted_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The permute that also returns the inverse permutation, written by the gather kernel itself."""
    return _permute_inverse_impl(rows, permuted_indices)


def _permute_inverse_impl(rows: torch.Tensor, permuted_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if _kernel_ok("permute_rows", rows, permuted_indices):
        inverse = torch.full((rows.shape[0], ), -1, dtype=torch.int64, device=rows.device)
        if permuted_indices.numel() and not rows.shape[1]:  # no columns: no program would run
            return _gather_kernel(rows, permuted_indices), _invert(permuted_indices, rows.shape[0])
        return _gather_kernel(rows, permuted_indices, inverse=inverse), inverse
    return (permute_rows_reference(rows, permuted_indices).contiguous(),
            _invert(permuted_indices, rows.shape[0]))


@_permute_inverse_op.register_fake
def _(rows, permuted_indices):
    return (rows.new_empty((permuted_indices.shape[0], rows.shape[1])),
            rows.new_empty((rows.shape[0], ), dtype=torch.int64))


def _permute_inverse_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], output[1])


@_permute_op.register_fake
def _(rows, permuted_indices, inverse):
    return rows.new_empty((permuted_indices.shape[0], rows.shape[1]))


@_unpermute_op.register_fake
def _(rows, permuted_indices, inverse):
    return rows.new_empty((inverse.shape[0], rows.shape[1]))


def _save_indices(ctx, inputs, output):
    ctx.save_for_backward(inputs[1], inputs[2])


def _permute_backward(ctx, grad):
    permuted_indices, inverse = ctx.saved_tensors
    # Each row went to exactly one slot: its gradient is that slot's, gathered, not accumulated.
    return _unpermute_op(grad.contiguous(), permuted_indices, inverse), None, None


def _unpermute_backward(ctx, grad):
    permuted_indices, inverse = ctx.saved_tensors
    # Padding slots fed no row: zero gradient; every other slot gets its row's.
    return _permute_op(grad.contiguous(), permuted_indices, inverse), None, None


_permute_op.register_autograd(_permute_backward, setup_context=_save_indices)


def _permute_inverse_backward(ctx, grad, grad_inverse):
    permuted_indices, inverse = ctx.saved_tensors
    return _unpermute_op(grad.contiguous(), permuted_indices, inverse), None


_permute_inverse_op.register_autograd(_permute_inverse_backward, setup_context=_permute_inverse_setup)
_unpermute_op.register_autograd(_unpermute_backward, setup_context=_save_indices)


# Eager forms of the three ops: the same kernels behind autograd Functions, whose dispatch costs a
# fraction of a custom op's (the gathers are short: host time is much of a call). torch.compile
# traces the custom ops instead. A backward outside create_graph calls the kernels directly; under
# create_graph it goes through the Functions again, so the gradient is differentiable.
class _PermutePairFn(torch.autograd.Function):
    """The permute (``unpermute`` False) or the unpermute; the backward of each is the other."""

    @staticmethod
    def forward(ctx, rows, permuted_indices, inverse, unpermute):
        _save_indices(ctx, (rows, permuted_indices, inverse), None)
        ctx.unpermute = unpermute
        return (_unpermute_impl if unpermute else _permute_impl)(rows, permuted_indices, inverse)

    @staticmethod
    def backward(ctx, grad):
        permuted_indices, inverse = ctx.saved_tensors
        return _pair_eager(grad.contiguous(), permuted_indices, inverse, not ctx.unpermute), None, None, None


class _PermuteInverseFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, rows, permuted_indices):
        out, inverse = _permute_inverse_impl(rows, permuted_indices)
        _permute_inverse_setup(ctx, (rows, permuted_indices), (out, inverse))
        ctx.mark_non_differentiable(inverse)
        return out, inverse

    @staticmethod
    def backward(ctx, grad, _grad_inverse):
        permuted_indices, inverse = ctx.saved_tensors
        return _pair_eager(grad.contiguous(), permuted_indices, inverse, True), None


def _needs_graph(rows: torch.Tensor) -> bool:
    return rows.requires_grad and torch.is_grad_enabled()


def _pair_eager(rows, permuted_indices, inverse, unpermute: bool):
    if torch.compiler.is_compiling():
        return (_unpermute_op if unpermute else _permute_op)(rows, permuted_indices, inverse)
    if _needs_graph(rows):
        return _PermutePairFn.apply(rows, permuted_indices, inverse, unpermute)
    return (_unpermute_impl if unpermute else _permute_impl)(rows, permuted_indices, inverse)


def permute_rows_with_inverse(rows: torch.Tensor, permuted_indices: torch.Tensor) -> tuple:
    """The permute (no checks: :func:`permute_rows` makes them) that also returns the inverse
    permutation, written by the gather itself; the inverse is not differentiable."""
    if torch.compiler.is_compiling():
        return _permute_inverse_op(rows, permuted_indices)
    if _needs_graph(rows):
        return _PermuteInverseFn.apply(rows, permuted_indices)
    return _permute_inverse_impl(rows, permuted_indices)


def _combine_rows(src: torch.Tensor, slot_of_assignment: torch.Tensor, weights: Optional[torch.Tensor]) -> torch.Tensor:
    if _kernel_ok("gather_combine", src, slot_of_assignment):
        return _combine_kernel_launch(src, slot_of_assignment, weights)
    return gather_combine_reference(src, slot_of_assignment, weights)


@torch.library.custom_op(f"{_NS}::rg_combine", mutates_args=())
def _combine_op(src: torch.Tensor, slot_of_assignment: torch.Tensor,
                weights: Optional[torch.Tensor]) -> torch.Tensor:
    return _combine_rows(src, slot_of_assignment, weights)


def _combine_kernel_launch(src: torch.Tensor, slot: torch.Tensor, weights: Optional[torch.Tensor],
                           out: Optional[torch.Tensor] = None) -> torch.Tensor:
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
    n_col = triton.cdiv(hidden, block_h)
    _launch_combine((triton.cdiv(num_tokens, rows) * n_col, ), (
        src, slot, weights.contiguous() if weights is not None else src, out, num_tokens, src.shape[0], hidden,
        n_col), dict(TOP_K=top_k, HAS_WEIGHT=weights is not None, ROWS=rows, BLOCK_H=block_h, VEC=vec,
                     ALIGNED=hidden % vec == 0), warps)
    return out


@_combine_op.register_fake
def _(src, slot_of_assignment, weights):
    return src.new_empty((slot_of_assignment.shape[0], src.shape[1]))


@torch.library.custom_op(f"{_NS}::rg_combine_backward", mutates_args=())
def _combine_backward_op(grad: torch.Tensor, src: torch.Tensor, slot_of_assignment: torch.Tensor,
                         weights: torch.Tensor, weights_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _combine_backward_rows(grad, src, slot_of_assignment, weights, weights_grad)


def _combine_backward_rows(grad: torch.Tensor, src: torch.Tensor, slot_of_assignment: torch.Tensor,
                           weights: torch.Tensor, weights_grad: bool) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, top_k = slot_of_assignment.shape
    num_slots, hidden = src.shape
    assignment = _invert(slot_of_assignment, num_slots)  # slot -> flat assignment t*k+j, or -1
    used = assignment >= 0
    tok = torch.where(used, assignment // max(top_k, 1), -1)
    scale = torch.where(used, weights.reshape(-1).float()[assignment.clamp(min=0)], 0.0) if top_k and num_tokens \
        else torch.zeros(num_slots, dtype=torch.float32, device=src.device)
    grad = grad.contiguous()
    if _kernel_ok("gather_combine", grad, tok):
        if weights_grad:
            src = src.contiguous()
            grad_src = torch.empty_like(src)
            dot = torch.empty(num_slots, dtype=torch.float32, device=src.device)
            if src.numel():
                rows, block_h, vec, warps = _tile(num_slots, hidden, src.element_size(), src.device, 16384)
                _launch_combine_backward((triton.cdiv(num_slots, rows), ), (
                    grad, tok, scale, src, grad_src, dot, tok, num_slots, num_tokens, hidden), dict(
                    ROWS=rows, BLOCK_H=block_h, VEC=vec, ALIGNED=hidden % vec == 0, SCALE_BY_ASSIGN=False,
                    WRITE_GRAD_SRC=True), warps)
            else:
                dot.zero_()
        else:
            grad_src = _gather_kernel(grad, tok, scale, out_dtype=src.dtype)
    else:
        g = permute_rows_reference(grad, tok).float()
        grad_src = (g * scale[:, None]).to(src.dtype)
        dot = (g * src.float()).sum(-1) if weights_grad else None
    if weights_grad:
        slot = slot_of_assignment.reshape(-1).to(torch.int64)
        ok = (slot >= 0) & (slot < num_slots)
        grad_w = torch.where(ok, dot[slot.clamp(0, max(num_slots - 1, 0))] if num_slots else 0.0, 0.0)
        grad_w = grad_w.view(num_tokens, top_k).to(weights.dtype)
    else:
        grad_w = weights.new_empty((0, ))
    return grad_src, grad_w


@_combine_backward_op.register_fake
def _(grad, src, slot_of_assignment, weights, weights_grad):
    return torch.empty_like(src), (torch.empty_like(weights) if weights_grad else weights.new_empty((0, )))


def _combine_backward_setup(ctx, inputs, output):
    grad, src, slot, weights, weights_grad = inputs
    ctx.weights_grad = weights_grad
    ctx.save_for_backward(grad, src, slot, weights)


def _combine_backward_backward(ctx, gg_src, gg_w):
    """The derivative of the combine's backward (the custom op's, as torch.compile runs it), in
    torch ops, themselves differentiable. With ``s = slot[t, j]``: ``grad_src[s] = grad[t] w[t, j]``
    and ``grad_w[t, j] = <grad[t], src[s]>``, so ``d grad[t] = sum_j gg_src[s] w[t, j] + gg_w[t, j]
    src[s]``, ``d w[t, j] = <gg_src[s], grad[t]>`` and ``d src[s] = gg_w[t, j] grad[t]``."""
    grad, src, slot, weights = ctx.saved_tensors
    num_tokens, top_k = slot.shape
    hidden = src.shape[1]
    flat = slot.reshape(-1)
    g32 = grad.float()
    d_grad = torch.zeros(grad.shape, dtype=torch.float32, device=grad.device)
    d_src = d_w = None
    if gg_src is not None:
        gathered = permute_rows_reference(gg_src, flat).float().view(num_tokens, top_k, hidden)
        d_grad = d_grad + (gathered * weights.float()[..., None]).sum(1)
        if ctx.needs_input_grad[3]:
            d_w = (gathered * g32[:, None, :]).sum(-1).to(weights.dtype)
    if ctx.weights_grad and gg_w is not None and gg_w.numel():
        rows = permute_rows_reference(src, flat).float().view(num_tokens, top_k, hidden)
        d_grad = d_grad + (rows * gg_w.float()[..., None]).sum(1)
        if ctx.needs_input_grad[1]:
            per_assignment = (gg_w.float()[..., None] * g32[:, None, :]).reshape(num_tokens * top_k, hidden)
            d_src = unpermute_rows_reference(per_assignment, flat, src.shape[0]).to(src.dtype)
    return d_grad.to(grad.dtype), d_src, None, d_w, None


_combine_backward_op.register_autograd(_combine_backward_backward, setup_context=_combine_backward_setup)


def _combine_setup(ctx, inputs, output):
    src, slot, weights = inputs
    ctx.has_weights = weights is not None
    ctx.save_for_backward(src, slot, weights if weights is not None else src.new_empty(0))


def _combine_backward(ctx, grad, backward_rows=None):
    """The combine's backward; ``backward_rows`` (eager, outside create_graph): the kernels
    directly instead of the backward op."""
    src, slot, weights = ctx.saved_tensors
    if not ctx.has_weights:
        weights = torch.ones(slot.shape, dtype=torch.float32, device=src.device)
    need_w = ctx.has_weights and ctx.needs_input_grad[2]
    grad_src, grad_w = (backward_rows or _combine_backward_op)(grad, src, slot, weights, need_w)
    return grad_src, None, (grad_w if need_w else None)


_combine_op.register_autograd(_combine_backward, setup_context=_combine_setup)


def _dispatch_rows(rows: torch.Tensor, token_of_slot: torch.Tensor) -> torch.Tensor:
    if _kernel_ok("gather_dispatch", rows, token_of_slot):
        return _gather_kernel(rows, token_of_slot)
    return gather_dispatch_reference(rows, token_of_slot).contiguous()


@torch.library.custom_op(f"{_NS}::rg_dispatch", mutates_args=())
def _dispatch_op(rows: torch.Tensor, token_of_slot: torch.Tensor, slot_of_assignment: torch.Tensor) -> torch.Tensor:
    return _dispatch_rows(rows, token_of_slot)


@_dispatch_op.register_fake
def _(rows, token_of_slot, slot_of_assignment):
    return rows.new_empty((token_of_slot.shape[0], rows.shape[1]))


def _dispatch_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[2])


def _dispatch_backward(ctx, grad):
    (slot_of_assignment, ) = ctx.saved_tensors
    # A token's gradient is the sum of its k slots' gradients: a gather + FP32 sum, no atomics.
    return _combine_op(grad.contiguous(), slot_of_assignment, None), None, None


_dispatch_op.register_autograd(_dispatch_backward, setup_context=_dispatch_setup)


# Eager forms of dispatch and combine (as for the permute above): autograd Functions over the same
# kernels; torch.compile traces the custom ops. Under create_graph the dispatch's backward is the
# combine Function and the combine's backward is its backward op, whose derivative is registered
# above (torch ops), so both differentiate again, as eager torch does.
class _DispatchFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, rows, token_of_slot, slot_of_assignment):
        _dispatch_setup(ctx, (rows, token_of_slot, slot_of_assignment), None)
        return _dispatch_rows(rows, token_of_slot)

    @staticmethod
    def backward(ctx, grad):
        (slot_of_assignment, ) = ctx.saved_tensors
        return _combine_eager(grad.contiguous(), slot_of_assignment, None), None, None


class _CombineFn(torch.autograd.Function):

    @staticmethod
    def forward(ctx, src, slot_of_assignment, weights):
        _combine_setup(ctx, (src, slot_of_assignment, weights), None)
        return _combine_rows(src, slot_of_assignment, weights)

    @staticmethod
    def backward(ctx, grad):
        # under create_graph the backward op, whose registered derivative makes it differentiable
        return _combine_backward(ctx, grad, None if torch.is_grad_enabled() else _combine_backward_rows)


def _combine_eager(src, slot_of_assignment, weights):
    if torch.compiler.is_compiling():
        return _combine_op(src, slot_of_assignment, weights)
    if torch.is_grad_enabled() and (src.requires_grad or (weights is not None and weights.requires_grad)):
        return _CombineFn.apply(src, slot_of_assignment, weights)
    return _combine_rows(src, slot_of_assignment, weights)


def _dispatch_eager(rows, token_of_slot, slot_of_assignment):
    if torch.compiler.is_compiling():
        return _dispatch_op(rows, token_of_slot, slot_of_assignment)
    if _needs_graph(rows):
        return _DispatchFn.apply(rows, token_of_slot, slot_of_assignment)
    return _dispatch_rows(rows, token_of_slot)

# ----------------------------------------------------------------------------------------------
# Public functions
# ----------------------------------------------------------------------------------------------


def permute_rows(rows: torch.Tensor, permuted_indices: torch.Tensor, *, validate: bool = False,
                 inverse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[i] = rows[permuted_indices[i]]``, a zero row where the index is padding (``-1`` or
    ``len(rows)``). ``[N, H] -> [NP, H]``. The valid entries must be a one-to-one map of the rows
    (checked only with ``validate=True``). The backward is :func:`unpermute_rows` of the gradient."""
    _check_rows("rows", rows)
    _check_index("permuted_indices", permuted_indices)
    _check_device(rows, permuted_indices=permuted_indices, inverse=inverse)
    if validate:
        validate_permutation(permuted_indices, rows.shape[0])
    if inverse is None:
        inverse = _cached_inverse(permuted_indices, rows.shape[0])
    if inverse is None:  # build it in the gather, and keep it for the unpermute of the same indices
        out, inverse = permute_rows_with_inverse(rows, permuted_indices)
        _remember_inverse(permuted_indices, rows.shape[0], inverse)
        return out
    return _pair_eager(rows, permuted_indices, inverse, False)


def unpermute_rows(rows: torch.Tensor, permuted_indices: torch.Tensor, num_rows: int, *, validate: bool = False,
                   inverse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Invert :func:`permute_rows`: ``[NP, H] -> [num_rows, H]``, each row from the slot that holds
    it; padding slots are never read. The backward is :func:`permute_rows` of the gradient."""
    _check_rows("rows", rows)
    _check_index("permuted_indices", permuted_indices)
    _check_device(rows, permuted_indices=permuted_indices, inverse=inverse)
    num_rows = _check_num_rows(num_rows)
    if rows.shape[0] != permuted_indices.shape[0]:
        raise ValueError(f"rows: expected {permuted_indices.shape[0]} rows (one per entry of permuted_indices), "
                         f"got {rows.shape[0]}")
    if validate:
        validate_permutation(permuted_indices, num_rows)
    if inverse is None:
        inverse = inverse_permutation(permuted_indices, num_rows)
    return _pair_eager(rows, permuted_indices, inverse, True)


def gather_dispatch(rows: torch.Tensor, token_of_slot: torch.Tensor, slot_of_assignment: torch.Tensor) -> torch.Tensor:
    """Top-k dispatch: ``out[s] = rows[token_of_slot[s]]`` (zero row where ``-1``), ``[T, H] -> [S, H]``.

    ``slot_of_assignment[t, j]`` is the slot holding token ``t``'s ``j``-th copy (``-1``: none),
    the inverse map, used by the backward: ``grad_rows[t] = sum_j grad[slot[t, j]]`` in FP32."""
    _check_rows("rows", rows)
    _check_index("token_of_slot", token_of_slot)
    _check_index("slot_of_assignment", slot_of_assignment, ndim=2)
    _check_device(rows, token_of_slot=token_of_slot, slot_of_assignment=slot_of_assignment)
    if slot_of_assignment.shape[0] != rows.shape[0]:
        raise ValueError(f"slot_of_assignment: expected {rows.shape[0]} rows (one per token), "
                         f"got {slot_of_assignment.shape[0]}")
    return _dispatch_eager(rows, token_of_slot, slot_of_assignment)


def gather_combine(expert_out: torch.Tensor, slot_of_assignment: torch.Tensor,
                   routing_weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[t] = sum_j expert_out[slot[t, j]] * routing_weights[t, j]``, ``[S, H] -> [T, H]``.

    Products and sum in FP32 (``j`` in order), one rounding to ``expert_out.dtype``. Slots ``-1``
    contribute nothing. Gradients: ``expert_out`` (each slot used at most once) and the weights."""
    _check_rows("expert_out", expert_out)
    _check_index("slot_of_assignment", slot_of_assignment, ndim=2)
    _check_device(expert_out, slot_of_assignment=slot_of_assignment, routing_weights=routing_weights)
    if routing_weights is not None:
        if not routing_weights.is_floating_point():
            raise TypeError(f"routing_weights: expected a floating-point tensor, got {routing_weights.dtype}")
        if routing_weights.shape != slot_of_assignment.shape:
            raise ValueError(f"routing_weights: expected shape {tuple(slot_of_assignment.shape)} "
                             f"(that of slot_of_assignment), got {tuple(routing_weights.shape)}")
    return _combine_eager(expert_out, slot_of_assignment, routing_weights)


def _interpreting() -> bool:  # for tests: whether CPU tensors run the kernels
    return interpreter_active() and HAS_TRITON


# ----------------------------------------------------------------------------------------------
# Top-k route: dispatch from tokens into slots, combine from slots back to tokens
# ----------------------------------------------------------------------------------------------
# A top-k router assigns token t to k experts: assignment a = t * k + j. A layer sorts the
# assignments by expert (``token_indices_sorted``: sorted position -> assignment) and places the
# sorted rows into slots, optionally padded per expert (``permuted_indices``: slot -> sorted
# position, out-of-range for a padding slot). The maps below compose both in one launch, so the
# dispatch gathers token rows straight into the slots and the combine gathers slot rows straight
# back to tokens: no [N, H] intermediate in token-slot order, no scatter, no atomics.

class RouteMaps(NamedTuple):
    """Slot <-> assignment maps of one routed batch (int32): ``token`` and ``assignment`` per slot
    (``-1`` for padding slots), ``slot`` per assignment ``[T * top_k]`` (``-1`` if unplaced)."""
    token: torch.Tensor
    assignment: torch.Tensor
    slot: torch.Tensor
    top_k: int


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


def route_maps_reference(token_indices_sorted: torch.Tensor, top_k: int,
                         permuted_indices: Optional[torch.Tensor] = None) -> RouteMaps:
    n = token_indices_sorted.numel()
    srt = token_indices_sorted.reshape(-1).to(torch.int64)
    p = (torch.arange(n, device=srt.device) if permuted_indices is None
         else permuted_indices.reshape(-1).to(torch.int64))
    valid = (p >= 0) & (p < n)
    a = torch.where(valid, srt[p.clamp(0, max(n - 1, 0))] if n else p, -1)
    tok = torch.where(a >= 0, a // top_k, -1)
    slot = _invert(a, n)
    return RouteMaps(tok.to(torch.int32), a.to(torch.int32), slot.to(torch.int32), top_k)


def route_maps(token_indices_sorted: torch.Tensor, top_k: int,
               permuted_indices: Optional[torch.Tensor] = None) -> RouteMaps:
    """The maps of assignments sorted by ``token_indices_sorted`` ([T * top_k], a permutation of
    the assignments) placed in slots: slot ``s`` holds sorted position ``permuted_indices[s]``
    (padding where out of range), or ``s`` when ``permuted_indices`` is None. One launch."""
    _check_index("token_indices_sorted", token_indices_sorted)
    if permuted_indices is not None:
        _check_index("permuted_indices", permuted_indices)
        _check_device(token_indices_sorted, permuted_indices=permuted_indices)
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1:
        raise ValueError(f"top_k: expected a positive int, got {top_k!r}")
    n = token_indices_sorted.numel()
    if n % top_k:
        raise ValueError(f"token_indices_sorted: expected T * top_k entries, got {n} (top_k={top_k})")
    if not kernel_device_ok(token_indices_sorted)[0]:
        return route_maps_reference(token_indices_sorted, top_k, permuted_indices)
    srt = token_indices_sorted.contiguous()
    num_slots = n if permuted_indices is None else permuted_indices.numel()
    dev = srt.device
    assign = torch.empty(num_slots, dtype=torch.int32, device=dev)
    tok = torch.empty(num_slots, dtype=torch.int32, device=dev)
    slot = torch.full((n, ), -1, dtype=torch.int32, device=dev)
    if num_slots:
        block = 1024
        perm = permuted_indices.contiguous() if permuted_indices is not None else srt
        _launch_route_maps((triton.cdiv(num_slots, block), ), (perm, srt, assign, tok, slot, num_slots, n),
                           dict(TOP_K=top_k, HAS_PERM=permuted_indices is not None, BLOCK=block), 4)
    return RouteMaps(tok, assign, slot, top_k)


def _route_kernels(x: torch.Tensor) -> bool:
    ok = kernel_device_ok(x)[0] and x.dtype in _KERNEL_DTYPES
    return ok and not (x.dtype == torch.bfloat16 and x.device.type == "cpu")


def _slot_pass(a_rows: torch.Tensor, b_slots: torch.Tensor, m: RouteMaps,
               scale: Optional[torch.Tensor] = None) -> tuple:
    """One pass over the slots (kernels only): ``d[a] = <a_rows[a // k], b_slots[slot[a]]>`` in FP32
    (0 where unplaced), ``[T * k]``; with ``scale`` (per assignment) also
    ``g[s] = a_rows[token[s]] * scale[assignment[s]]`` in ``b_slots``'s dtype (else None)."""
    num_slots, hidden = b_slots.shape
    a_rows, b_slots = a_rows.contiguous(), b_slots.contiguous()
    dot = torch.empty(num_slots, dtype=torch.float32, device=b_slots.device)
    g = torch.empty_like(b_slots) if scale is not None else None
    rows, block_h, vec, warps = _tile(num_slots, hidden, b_slots.element_size(), b_slots.device, 16384)
    _launch_combine_backward((triton.cdiv(num_slots, rows), ), (
        a_rows, m.token, scale.reshape(-1).contiguous() if scale is not None else dot, b_slots,
        g if g is not None else dot, dot, m.assignment, num_slots, a_rows.shape[0], hidden), dict(
        ROWS=rows, BLOCK_H=block_h, VEC=vec, ALIGNED=hidden % vec == 0, SCALE_BY_ASSIGN=True,
        WRITE_GRAD_SRC=g is not None), warps)
    return g, _per_assignment(dot, m)


def _per_assignment(per_slot: torch.Tensor, m: RouteMaps) -> torch.Tensor:
    slot = m.slot.to(torch.int64)
    n = per_slot.numel()
    return torch.where(slot >= 0, per_slot[slot.clamp(0, max(n - 1, 0))] if n else 0.0, 0.0)


def _slot_dot(a_rows: torch.Tensor, b_slots: torch.Tensor, m: RouteMaps) -> torch.Tensor:
    """``d[a] = <a_rows[a // k], b_slots[slot[a]]>`` in FP32 (0 where unplaced), ``[T * k]``."""
    if _route_kernels(b_slots) and b_slots.shape[0] and b_slots.shape[1]:
        return _slot_pass(a_rows, b_slots, m)[1]
    return _per_assignment((permute_rows_reference(a_rows, m.token).float() * b_slots.float()).sum(-1), m)


def _dispatch_impl(x: torch.Tensor, m: RouteMaps, scores: Optional[torch.Tensor]) -> torch.Tensor:
    if _route_kernels(x):
        return _gather_kernel(x, m.token, scores, assign=m.assignment if scores is not None else None)
    out = permute_rows_reference(x, m.token)
    if scores is not None:
        a = m.assignment.to(torch.int64)
        sc = torch.where(a >= 0, scores.reshape(-1).float()[a.clamp(min=0)], 0.0)
        out = (out.float() * sc[:, None]).to(x.dtype)
    return out.contiguous()


def _combine_impl(y: torch.Tensor, m: RouteMaps, weights: Optional[torch.Tensor]) -> torch.Tensor:
    slot = m.slot.view(-1, m.top_k)
    w = weights.reshape(slot.shape) if weights is not None else None
    if _route_kernels(y):
        return _combine_kernel_launch(y, slot, w)
    return gather_combine_reference(y, slot, w)


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
        dx = _RouteCombine.apply(grad, scores, m) if ctx.needs_input_grad[0] else None
        ds = None
        if scores is not None and ctx.needs_input_grad[1]:
            ds = _RouteDot.apply(x, grad, m).view(scores.shape).to(scores.dtype)
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
        num_slots = m.token.numel()
        if (not torch.is_grad_enabled() and need_y and need_w and _route_kernels(grad) and num_slots
                and grad.shape[1]):  # one fused pass: dy and the weights' gradient
            dy, dw = _slot_pass(grad, y, m, weights)
            return dy, dw.view(weights.shape).to(weights.dtype), None
        dy = _RouteDispatch.apply(grad, weights, m) if need_y else None
        dw = _RouteDot.apply(grad, y, m).view(weights.shape).to(weights.dtype) if need_w else None
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
        dt = _RouteCombine.apply(slots, grad, m).to(tokens.dtype) if ctx.needs_input_grad[0] else None
        ds = _RouteDispatch.apply(tokens, grad, m).to(slots.dtype) if ctx.needs_input_grad[1] else None
        return dt, ds, None


def route_dispatch(x: torch.Tensor, maps: RouteMaps, scores: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Token rows ``[T, H]`` into slots ``[S, H]`` through ``maps``; with ``scores`` (``[T, k]``,
    DeepSpeed's ``score_apply="pre"``) each row is multiplied by its assignment's score in FP32
    and rounded once. Backward: gathers, no atomics."""
    _check_rows("x", x)
    if scores is not None:
        if not scores.is_floating_point() or scores.numel() != maps.slot.numel():
            raise ValueError(f"scores: expected {maps.slot.numel()} floating-point routing scores, got "
                             f"{scores.numel()} of {scores.dtype}")
    if x.shape[0] * maps.top_k != maps.slot.numel():
        raise ValueError(f"x: expected {maps.slot.numel() // maps.top_k} token rows, got {x.shape[0]}")
    _check_device(x, scores=scores, maps=maps.slot)
    return _RouteDispatch.apply(x, scores, maps)


def route_combine(y: torch.Tensor, maps: RouteMaps, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Slot rows ``[S, H]`` back to tokens ``[T, H]``: ``out[t] = sum_j y[slot[t, j]] * weights[t, j]``
    in FP32, rounded once (no weights: the plain sum). Backward: gathers, no atomics."""
    _check_rows("y", y)
    if y.shape[0] != maps.token.numel():
        raise ValueError(f"y: expected {maps.token.numel()} slot rows, got {y.shape[0]}")
    if weights is not None and (not weights.is_floating_point() or weights.numel() != maps.slot.numel()):
        raise ValueError(f"weights: expected {maps.slot.numel()} floating-point routing weights, got "
                         f"{weights.numel()} of {weights.dtype}")
    _check_device(y, weights=weights, maps=maps.slot)
    return _RouteCombine.apply(y, weights, maps)
