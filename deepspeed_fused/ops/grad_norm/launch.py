"""Launches of the per-tensor norms: the chunk table of a list of tensors (built once per layout:
the tensors' sizes and distances from one another, as DeepSpeed's gradient views keep them from
step to step) and the two launches.

A table holds, for each chunk of :data:`CHUNK` elements, its element offset from the base tensor
(the one lowest in memory; the table does not depend on where that lies) and its length, and for each tensor the index of its first chunk and
its number of chunks. Tensors whose distance from the base is not a whole number of elements
cannot share the base pointer: :func:`norms` returns None for them and the caller runs the
reference.
"""
from __future__ import annotations

import collections
from typing import Optional

import torch

from .._common import cdiv, on_device
from . import kernels

# Chunk and block sizes: a program reads 64 KiB of bfloat16 in 16-byte loads over 8 warps; the
# segment pass adds a few thousand partials per tensor at most. An H100 sweep (2026-12-06, bf16
# gradients of Llama-3.2-3B, Qwen3-1.7B and Gemma-3-1B, CUDA graphs): chunks of 16384 to 131072
# elements, blocks of 1024 to 4096 and 4 to 16 warps all ran within 3% of one another, 3.2 TB/s at
# Llama-3.2-3B's 6.4 GB.
CHUNK = 32768
BLOCK, WARPS = 2048, 8
SEG_BLOCK, SEG_WARPS = 1024, 4
_CACHE_SIZE = 16


class Plan:
    """The chunk table of one list of tensors (device tensors) and the launch constants."""

    __slots__ = ("base", "offsets", "lengths", "firsts", "counts", "n_chunks", "align")

    def __init__(self, base, offsets, lengths, firsts, counts, n_chunks, align):
        self.base, self.offsets, self.lengths = base, offsets, lengths
        self.firsts, self.counts, self.n_chunks, self.align = firsts, counts, n_chunks, align


_PLANS: "collections.OrderedDict" = collections.OrderedDict()


def _build(rel: tuple, numels: tuple, itemsize: int, base_aligned: bool, device: torch.device) -> Optional[Plan]:
    """The table of tensors at byte distances ``rel`` from the lowest of them, with ``numels``
    elements: per-tensor values in Python, the per-chunk ones expanded on ``device`` (no host loop
    over chunks; no sync)."""
    starts, counts, firsts = [], [], []
    n_chunks = 0
    for dist, n in zip(rel, numels):
        if dist % itemsize:
            return None
        starts.append(dist // itemsize)
        c = cdiv(n, CHUNK)
        firsts.append(n_chunks)
        counts.append(c)
        n_chunks += c
    per16 = max(1, 16 // itemsize)
    aligned = base_aligned and CHUNK % per16 == 0 and all(s % per16 == 0 for s, c in zip(starts, counts) if c)

    def dev(values):
        return torch.tensor(values, dtype=torch.int64).to(device)

    t_start, t_numel, t_first, t_count = dev(starts), dev(list(numels)), dev(firsts), dev(counts)
    tensor_of = torch.repeat_interleave(torch.arange(len(rel), device=device), t_count, output_size=n_chunks)
    k = (torch.arange(n_chunks, device=device) - t_first[tensor_of]) * CHUNK  # element offset in its tensor
    offsets = t_start[tensor_of] + k
    lengths = torch.clamp(t_numel[tensor_of] - k, max=CHUNK).to(torch.int32)
    return Plan(rel.index(0), offsets, lengths, t_first, t_count.to(torch.int32), n_chunks,
                per16 if aligned else 1)


def plan(tensors: list) -> Optional[Plan]:
    """The cached table of ``tensors`` (contiguous, one dtype, one device), or None where they
    cannot share a base pointer. The table holds offsets from the lowest tensor, so it serves the
    same layout wherever it lies in memory (DeepSpeed may hand a step's gradients in a buffer at
    another address): the key is the tensors' distances from the lowest, their sizes, the dtype,
    the device and whether the lowest is 16-byte aligned."""
    t0 = tensors[0]
    ptrs = [t.data_ptr() for t in tensors]
    low = min(ptrs)
    rel = tuple(p - low for p in ptrs)
    numels = tuple(t.numel() for t in tensors)
    key = (t0.device, t0.dtype, rel, numels, low % 16 == 0, CHUNK)
    p = _PLANS.get(key)
    if p is None:
        if key in _PLANS:  # known not to share a base
            return None
        p = _build(rel, numels, t0.element_size(), low % 16 == 0, t0.device)
        if len(_PLANS) >= _CACHE_SIZE:
            _PLANS.popitem(last=False)
        _PLANS[key] = p
    else:
        _PLANS.move_to_end(key)
    return p


def norms(tensors: list) -> Optional[torch.Tensor]:
    """``[len(tensors)]`` float64 2-norms of ``tensors`` (contiguous, one dtype the kernels take, one
    device) by the kernels, or None where they cannot share a base pointer."""
    p = plan(tensors)
    if p is None:
        return None
    x = tensors[0]
    sums = torch.empty(len(tensors), dtype=torch.float64, device=x.device)
    if p.n_chunks == 0:
        return sums.zero_()
    part = torch.empty(p.n_chunks, dtype=torch.float64, device=x.device)
    with on_device(x):
        kernels.chunk_squares((p.n_chunks,), (tensors[p.base], p.offsets, p.lengths, part),
                              dict(BLOCK=BLOCK, ALIGN=p.align), WARPS)
        kernels.segment_sums((len(tensors),), (part, p.firsts, p.counts, sums), dict(BLOCK=SEG_BLOCK), SEG_WARPS)
    return sums.sqrt_()


def clear_plans() -> None:
    """Forget the cached tables (tests use this)."""
    _PLANS.clear()
