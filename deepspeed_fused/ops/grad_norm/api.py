"""The public per-tensor norms: a function for eager calls, a custom op for torch.compile."""
from __future__ import annotations

from typing import Sequence

import torch

from . import launch
from .checks import check_tensors, split_by_kernel
from .reference import tensor_norms_reference

_NS = "deepspeed_fused"


def _norms(tensors: list) -> torch.Tensor:
    groups, others = split_by_kernel(tensors)
    if not groups:
        return tensor_norms_reference(tensors)
    out = None
    for idx in groups.values():
        part = launch.norms(tensors if len(idx) == len(tensors) else [tensors[i] for i in idx])
        if part is None:  # the group cannot share a base pointer: one launch per tensor
            part = torch.cat([launch.norms([tensors[i]]) for i in idx])
        if len(idx) == len(tensors):
            return part
        if out is None:
            out = torch.empty(len(tensors), dtype=torch.float64, device=tensors[0].device)
        out[idx] = part
    if others:
        out[others] = tensor_norms_reference([tensors[i] for i in others])
    return out


@torch.library.custom_op(f"{_NS}::tensor_norms", mutates_args=())
def _tensor_norms_op(tensors: list[torch.Tensor]) -> torch.Tensor:
    return _norms(list(tensors))


@_tensor_norms_op.register_fake
def _(tensors):
    return tensors[0].new_empty((len(tensors),), dtype=torch.float64)


def tensor_norms(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of each tensor of ``tensors`` (a non-empty list or tuple of floating-point tensors
    on one device), as a ``[len(tensors)]`` float64 tensor: each tensor's squares added in float64
    while it is read in its own dtype (no float64 copy of it), one pair of launches per dtype of
    the list. Equal to :func:`~.reference.tensor_norms_reference` (a float64 copy, then
    ``torch.linalg.vector_norm``) up to the order of the float64 additions. No autograd: the
    result does not require grad."""
    ts = check_tensors(tensors)
    with torch.no_grad():
        if torch.compiler.is_compiling():
            return _tensor_norms_op(ts)
        return _norms(ts)
