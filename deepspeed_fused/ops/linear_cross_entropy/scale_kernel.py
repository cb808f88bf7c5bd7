"""The in-place scaling of the scalar loss's forward-formed gradients by the upstream gradient.

:func:`_scale_unless_one_` (a Triton kernel that reads and writes nothing when the upstream
gradient is 1, without a host sync to find out; ignored rows and gated tensors left as formed)
and :func:`_scale_masked_torch_`, the same in torch ops (differentiable, traceable).
"""
import torch

from .._common import HAS_TRITON, cdiv, next_power_of_2, interpreter_active, tl, triton
from .row_kernel import _KERNEL_DTYPES


if HAS_TRITON:

    @triton.jit
    def _scale_unless_one_kernel(x_ptr, n, g_ptr, gate_ptr, tgt_ptr, ignore_index,
                                 GATE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # x *= g in place, the product in fp32 with g as given (fp32) and one rounding, unless
        # g == 1: then no program reads or writes x. g is read on the device, so the host never
        # waits for it. ROWS: program (r, j) takes block j of row r (n elements a row), left as
        # it is where the row's target is ignore_index. GATE: nothing is scaled where the flag at
        # gate_ptr is 0.
        g = tl.load(g_ptr).to(tl.float32)
        go = g != 1.0
        if GATE:
            go = go & (tl.load(gate_ptr) != 0)
        base = 0
        if ROWS:
            row = tl.program_id(0).to(tl.int64)
            go = go & (tl.load(tgt_ptr + row) != ignore_index)
            base = row * n
            blk = tl.program_id(1).to(tl.int64)
        else:
            blk = tl.program_id(0).to(tl.int64)
        if go:
            offs = blk * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)
            tl.store(x_ptr + base + offs, (x.to(tl.float32) * g).to(x_ptr.dtype.element_ty), mask=mask)


def _scale_masked_torch_(x, g, target=None, ignore_index=-100, gate=None):
    """:func:`_scale_unless_one_` in torch ops (an autograd op on ``g``: differentiable under
    ``create_graph``, traceable by torch.compile): the rows or tensors left alone are multiplied
    by exactly 1 (``mul_``; a 0-d ``g`` may be rounded to ``x``'s dtype first on CUDA)."""
    s = g.reshape(())
    if gate is not None:
        s = torch.where(gate, s, torch.ones_like(s))
    if target is not None:
        s = torch.where(target.reshape(-1, *([1] * (x.dim() - 1))) != ignore_index, s, torch.ones_like(s))
    return x.mul_(s)


def _scale_unless_one_(x, g, *, target=None, ignore_index=-100, gate=None):
    """``x = (x.float() * g.float()).to(x.dtype)`` in place, for the forward-formed gradients and the
    scalar upstream gradient ``g`` (almost always 1, as ``loss.backward()`` makes it): no memory
    traffic when ``g == 1``, and no host sync to find out.

    ``target`` ([x.shape[0]], the tokens of x's rows, e.g. dhidden's): rows whose target is
    ``ignore_index`` are left as formed (their exact zeros stay zeros whatever g is: no 0 * inf).
    ``gate`` (a 0-d bool tensor on x's device, e.g. "some token is labelled"): x is left as formed
    where it is False (the zeros of dweight summed over no labelled token). Where the kernel
    cannot run, :func:`_scale_masked_torch_`."""
    if (x.numel() == 0 or g.numel() != 1 or not x.is_contiguous() or x.dtype not in _KERNEL_DTYPES
            or g.device != x.device or (gate is not None and gate.device != x.device)
            or (target is not None and (target.device != x.device or target.numel() != x.shape[0]))
            or not (x.is_cuda or (interpreter_active() and x.device.type == "cpu" and x.dtype != torch.bfloat16))):
        return _scale_masked_torch_(x, g, target, ignore_index, gate)
    g1 = g.reshape(1)
    if target is not None:
        n = x[0].numel()
        block = min(4096, next_power_of_2(n))
        grid = (x.shape[0], cdiv(n, block))
    else:
        n = x.numel()
        block = 4096
        grid = (cdiv(n, block),)
    _scale_unless_one_kernel[grid](x, n, g1, g1 if gate is None else gate.reshape(1),
                                   g1 if target is None else target.contiguous(), int(ignore_index),
                                   GATE=gate is not None, ROWS=target is not None, BLOCK=block,
                                   num_warps=(8 if block >= 2048 else 4) if x.is_cuda else 1)
    return x
