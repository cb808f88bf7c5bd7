"""Triton kernels of the per-tensor norms: float64 sums of squares over chunks, then per tensor.

The tensors of one launch share a dtype and are read through one base pointer (the tensor lowest
in memory) plus each chunk's element offset from it, so one launch reads a whole list of tensors
wherever they live (views of one flat gradient buffer, as DeepSpeed's ZeRO-1/2 keeps them, or
separate allocations). ``_chunk_squares``: program ``p`` reads chunk ``p`` (at most ``CHUNK``
elements of one tensor), converts each element to float64 and adds its square (exact in float64
for float16, bfloat16 and float32 elements) into ``BLOCK`` lanes, and stores the lanes' sum.
Whole blocks load unmasked (16-byte loads where ``ALIGN`` tells the compiler every chunk starts
16-byte aligned), the tail masked. ``_segment_sums``: program ``t`` adds tensor ``t``'s partial
sums, which lie side by side, in a fixed order: the result does not depend on scheduling.
"""
from __future__ import annotations

from .._common import HAS_TRITON, DirectKernel, tl, triton

if HAS_TRITON:

    @triton.jit
    def _chunk_squares(x_ptr, off_ptr, len_ptr, part_ptr, BLOCK: tl.constexpr, ALIGN: tl.constexpr):
        pid = tl.program_id(0)
        off = tl.load(off_ptr + pid)
        if ALIGN > 1:
            off = tl.multiple_of(off, ALIGN)
        n = tl.load(len_ptr + pid)
        base = x_ptr + off
        lanes = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float64)
        n_full = (n // BLOCK) * BLOCK
        for start in range(0, n_full, BLOCK):
            x = tl.load(base + start + lanes).to(tl.float64)
            acc += x * x
        idx = n_full + lanes
        x = tl.load(base + idx, mask=idx < n, other=0.0).to(tl.float64)
        acc += x * x
        tl.store(part_ptr + pid, tl.sum(acc, axis=0))

    @triton.jit
    def _segment_sums(part_ptr, first_ptr, count_ptr, out_ptr, BLOCK: tl.constexpr):
        t = tl.program_id(0)
        first = tl.load(first_ptr + t)
        count = tl.load(count_ptr + t)
        lanes = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float64)
        for start in range(0, count, BLOCK):
            idx = start + lanes
            acc += tl.load(part_ptr + first + idx, mask=idx < count, other=0.0)
        tl.store(out_ptr + t, tl.sum(acc, axis=0))

    chunk_squares = DirectKernel(_chunk_squares)
    segment_sums = DirectKernel(_segment_sums)
else:  # pragma: no cover - without Triton the op runs its reference
    chunk_squares = segment_sums = None
