"""The token reorder's public API: the padded permute of DeepSpeed AutoEP and its inverse, as row
gathers (autograd Functions, custom ops, the public functions).

* :func:`permute_rows` ``[N, H] -> [NP, H]``: rows into the padded order of ``permuted_indices``
  (as from ``deepspeed.moe.ep_kernels.generate_permute_indices``); zeros at padding slots.
* :func:`unpermute_rows` ``[NP, H] -> [N, H]``: each row back from the slot it went to, a gather
  through :func:`inverse_permutation`; padding slots are never read.
* Each is the other's backward. Because the valid entries of ``permuted_indices`` are a
  one-to-one map of the rows, a row's gradient is that of its single slot: no scatter-add, no
  atomics, and outputs and gradients equal (``torch.equal``) those of the eager formulations
  (append a zero row and index; zero-fill and ``index_put``). Both are differentiable again.

Eager calls run autograd Functions over the kernels; under ``torch.compile`` the same kernels are
the custom ops ``deepspeed_fused::moe_permute``, ``moe_unpermute`` and ``moe_permute_with_inverse``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils.weak import WeakTensorKeyDictionary

from .checks import check_device, check_index, check_num_rows, check_rows, kernel_ok
from .launch import gather_rows
from .reference import invert, permute_rows_reference, unpermute_rows_reference

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
    check_index("permuted_indices", permuted_indices)
    num_rows = check_num_rows(num_rows)
    inverse = _cached_inverse(permuted_indices, num_rows)
    if inverse is None:
        inverse = invert(permuted_indices, num_rows)
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


def validate_permutation(permuted_indices: torch.Tensor, num_rows: int) -> None:
    """Check that ``permuted_indices`` holds each of ``0 .. num_rows-1`` exactly once and that every
    other entry is padding (``-1``, or ``num_rows``). Raises ``TypeError`` for a wrong dtype and
    ``ValueError`` naming the first out-of-range entry, the first duplicate, or the first missing
    row. Synchronises with the device."""
    check_index("permuted_indices", permuted_indices)
    num_rows = check_num_rows(num_rows)
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


_NS = "deepspeed_fused"


def _permute_impl(rows: torch.Tensor, permuted_indices: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    if kernel_ok("permute_rows", rows):
        return gather_rows(rows, permuted_indices)
    return permute_rows_reference(rows, permuted_indices).contiguous()


def _unpermute_impl(rows: torch.Tensor, permuted_indices: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    if kernel_ok("unpermute_rows", rows):
        return gather_rows(rows, inverse)
    return unpermute_rows_reference(rows, permuted_indices, inverse.numel()).clone()


@torch.library.custom_op(f"{_NS}::moe_permute", mutates_args=())
def _permute_op(rows: torch.Tensor, permuted_indices: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    return _permute_impl(rows, permuted_indices, inverse)


@torch.library.custom_op(f"{_NS}::moe_unpermute", mutates_args=())
def _unpermute_op(rows: torch.Tensor, permuted_indices: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    return _unpermute_impl(rows, permuted_indices, inverse)


@torch.library.custom_op(f"{_NS}::moe_permute_with_inverse", mutates_args=())
def _permute_inverse_op(rows: torch.Tensor, permuted_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The permute that also returns the inverse permutation, written by the gather kernel itself."""
    return _permute_inverse_impl(rows, permuted_indices)


def _permute_inverse_impl(rows: torch.Tensor, permuted_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if kernel_ok("permute_rows", rows):
        inverse = torch.full((rows.shape[0], ), -1, dtype=torch.int64, device=rows.device)
        if permuted_indices.numel() and not rows.shape[1]:  # no columns: no program would run
            return gather_rows(rows, permuted_indices), invert(permuted_indices, rows.shape[0])
        return gather_rows(rows, permuted_indices, inverse=inverse), inverse
    return (permute_rows_reference(rows, permuted_indices).contiguous(),
            invert(permuted_indices, rows.shape[0]))


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


def permute_rows(rows: torch.Tensor, permuted_indices: torch.Tensor, *, validate: bool = False,
                 inverse: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``out[i] = rows[permuted_indices[i]]``, a zero row where the index is padding (``-1`` or
    ``len(rows)``). ``[N, H] -> [NP, H]``. The valid entries must be a one-to-one map of the rows
    (checked only with ``validate=True``). The backward is :func:`unpermute_rows` of the gradient."""
    check_rows("rows", rows)
    check_index("permuted_indices", permuted_indices)
    check_device(rows, permuted_indices=permuted_indices, inverse=inverse)
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
    check_rows("rows", rows)
    check_index("permuted_indices", permuted_indices)
    check_device(rows, permuted_indices=permuted_indices, inverse=inverse)
    num_rows = check_num_rows(num_rows)
    if rows.shape[0] != permuted_indices.shape[0]:
        raise ValueError(f"rows: expected {permuted_indices.shape[0]} rows (one per entry of permuted_indices), "
                         f"got {rows.shape[0]}")
    if validate:
        validate_permutation(permuted_indices, num_rows)
    if inverse is None:
        inverse = inverse_permutation(permuted_indices, num_rows)
    return _pair_eager(rows, permuted_indices, inverse, True)

