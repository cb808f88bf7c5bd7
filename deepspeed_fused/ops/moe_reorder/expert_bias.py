"""A per-expert bias on expert-sorted rows: ``rows + bias[experts]``, its gradient a segmented sum.

transformers' experts with biases (GPT-OSS) add the bias after each grouped GEMM as
``out + bias[expert_ids]``: a gather that writes a ``[S, out]`` copy of bias rows, then the add.
Its backward is the gather's: an index-put with accumulation over all ``S`` rows (a sort of the ids
and a scatter, about 1.4 ms per call at GPT-OSS-20B's 32768 x 5760 on the H200), and because that
sums every row, padding rows included, transformers masks the GEMM outputs of the sentinel rows
(experts of other ranks) twice per projection.

Here the rows are sorted by expert already, so expert ``e``'s rows are ``offsets[e-1]:offsets[e]``
(grouped_mm's offsets): the forward is one kernel (each row's bias row read from L2, the sum in
FP32, one rounding, as eager's half-precision add rounds), and the bias gradient is one kernel
that sums each expert's own rows in FP32 in a fixed order (one rounding: eager's index-put
accumulates in FP32 too, in another order). Rows past ``offsets[-1]`` (padding) get the bias added
like any other row but add nothing to its gradient, so no mask is needed. The rows' gradient is the
output's gradient itself (no copy).

CUDA tensors (CPU ones under the interpreter, not bf16 there) with rows and bias of one dtype run
the kernels; anything else the torch reference (:func:`expert_bias_reference`) with one warning per
reason. Eager calls run an autograd Function; ``torch.compile`` traces the custom ops
``deepspeed_fused::moe_expert_bias`` and ``deepspeed_fused::moe_expert_bias_grad``.
"""
from __future__ import annotations

import torch

from .._common import HAS_TRITON, cdiv, next_power_of_2, DirectKernel, tl, triton, warn_fallback
from .checks import OP, check_device, check_index, kernel_ok

_NS = "deepspeed_fused"

if HAS_TRITON:

    @triton.jit
    def _bias_add_kernel(X, B, E, Y, n_rows, N, stride_x, stride_b, stride_y, BLOCK_R: tl.constexpr,
                         BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        rm = rows < n_rows
        m = rm[:, None] & (cols < N)[None, :]
        e = tl.load(E + rows, mask=rm, other=0).to(tl.int64)
        r64 = rows.to(tl.int64)[:, None]
        x = tl.load(X + r64 * stride_x + cols[None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(B + e[:, None] * stride_b + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(Y + r64 * stride_y + cols[None, :], (x + b).to(Y.dtype.element_ty), mask=m)

    @triton.jit
    def _bias_grad_kernel(DY, OFFS, DB, N, stride_dy, stride_db, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        # program (e, column strip): the sum of expert e's rows offsets[e-1]:offsets[e] of DY, in
        # FP32 and row order (bitwise repeatable), rounded once to the bias dtype
        e = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = cols < N
        end = tl.load(OFFS + e).to(tl.int32)
        start = tl.where(e > 0, tl.load(OFFS + tl.maximum(e - 1, 0)).to(tl.int32), 0)
        acc = tl.zeros([BLOCK_R, BLOCK_C], dtype=tl.float32)
        for r0 in range(start, end, BLOCK_R):
            r = r0 + tl.arange(0, BLOCK_R)
            m = (r < end)[:, None] & cm[None, :]
            acc += tl.load(DY + r.to(tl.int64)[:, None] * stride_dy + cols[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(DB + e.to(tl.int64) * stride_db + cols, tl.sum(acc, axis=0).to(DB.dtype.element_ty), mask=cm)

    _launch_add = DirectKernel(_bias_add_kernel)
    _launch_grad = DirectKernel(_bias_grad_kernel)


def expert_bias_reference(rows: torch.Tensor, bias: torch.Tensor, experts: torch.Tensor,
                          offsets: torch.Tensor) -> torch.Tensor:
    """``rows + bias[experts]`` in torch, the bias's gradient taken from rows below ``offsets[-1]``
    only (the padding rows' bias is added but detached), as :func:`expert_bias` defines it."""
    b = bias.index_select(0, experts.to(torch.int64))
    if b.requires_grad and offsets.numel():
        valid = torch.arange(rows.shape[0], device=rows.device) < offsets[-1].to(torch.int64)
        b = torch.where(valid[:, None], b, b.detach())
    return rows + b


def _check(rows, bias, experts, offsets) -> None:
    for name, t in (("rows", rows), ("bias", bias)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
        if t.dim() != 2:
            raise ValueError(f"{name}: expected a 2-D tensor, got shape {tuple(t.shape)}")
    if bias.shape[1] != rows.shape[1]:
        raise ValueError(f"bias: expected [num_experts, {rows.shape[1]}] (the rows' width), got {tuple(bias.shape)}")
    check_index("experts", experts)
    check_index("offsets", offsets)
    if experts.numel() != rows.shape[0]:
        raise ValueError(f"experts: expected one expert id per row ({rows.shape[0]}), got {experts.numel()}")
    if offsets.numel() != bias.shape[0]:
        raise ValueError(f"offsets: expected one end per expert ({bias.shape[0]}), got {offsets.numel()}")
    check_device(rows, bias=bias, experts=experts, offsets=offsets)


def _tile(n_rows: int, width: int) -> tuple:
    block_c = min(1024, next_power_of_2(max(width, 1)))
    block_r = max(1, min(4096 // block_c, next_power_of_2(max(n_rows, 1))))
    return block_r, block_c


def _add(rows: torch.Tensor, bias: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    x = rows if rows.stride(-1) == 1 else rows.contiguous()
    b = bias if bias.stride(-1) == 1 else bias.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if y.numel():
        block_r, block_c = _tile(*x.shape)
        grid = (cdiv(x.shape[0], block_r), cdiv(x.shape[1], block_c))
        _launch_add(grid, (x, b, experts.contiguous(), y, x.shape[0], x.shape[1], x.stride(0), b.stride(0),
                           y.stride(0)), dict(BLOCK_R=block_r, BLOCK_C=block_c), 4 if block_r * block_c >= 2048 else 2)
    return y


def _grad(dy: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    d = dy if dy.stride(-1) == 1 else dy.contiguous()
    E, N = offsets.numel(), d.shape[1]
    db = torch.empty((E, N), dtype=dtype, device=d.device)
    if db.numel():
        block_c = min(128, next_power_of_2(max(N, 1)))
        block_r = max(1, 2048 // block_c)
        _launch_grad((E, cdiv(N, block_c)), (d, offsets.contiguous(), db, N, d.stride(0), db.stride(0)),
                     dict(BLOCK_R=block_r, BLOCK_C=block_c), 4)
    return db


class _ExpertBiasFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, bias, experts, offsets):
        ctx.save_for_backward(offsets)
        ctx.bias_dtype = bias.dtype
        return _add(rows, bias, experts)

    @staticmethod
    def backward(ctx, dy):
        (offsets,) = ctx.saved_tensors
        db = _grad(dy, offsets, ctx.bias_dtype) if ctx.needs_input_grad[1] else None
        return (dy if ctx.needs_input_grad[0] else None), db, None, None


@torch.library.custom_op(f"{_NS}::moe_expert_bias", mutates_args=())
def _bias_op(rows: torch.Tensor, bias: torch.Tensor, experts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    return _add(rows, bias, experts)


@_bias_op.register_fake
def _(rows, bias, experts, offsets):
    return torch.empty_like(rows, memory_format=torch.contiguous_format)


@torch.library.custom_op(f"{_NS}::moe_expert_bias_grad", mutates_args=())
def _bias_grad_op(dy: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _grad(dy, offsets, dtype)


@_bias_grad_op.register_fake
def _(dy, offsets, dtype):
    return dy.new_empty((offsets.shape[0], dy.shape[1]), dtype=dtype)


def _op_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[3])
    ctx.bias_dtype = inputs[1].dtype


def _op_backward(ctx, dy):
    (offsets,) = ctx.saved_tensors
    db = _bias_grad_op(dy, offsets, ctx.bias_dtype) if ctx.needs_input_grad[1] else None
    return dy, db, None, None


_bias_op.register_autograd(_op_backward, setup_context=_op_setup)


def expert_bias(rows: torch.Tensor, bias: torch.Tensor, experts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``rows + bias[experts]`` for rows sorted by expert (``rows`` ``[S, N]``, ``bias`` ``[E, N]``,
    ``experts`` ``[S]`` the expert of each row in ``[0, E)``, ``offsets`` ``[E]`` the end of each
    expert's rows, as grouped_mm takes them): one kernel forward (FP32 sum, one rounding to the
    rows' dtype), and the bias's gradient the FP32 sum of each expert's own rows
    ``offsets[e-1]:offsets[e]`` (rows past ``offsets[-1]``, padding, contribute nothing); the rows'
    gradient is the output's. Ids are not checked on the hot path (a host sync): they must be in
    range, and the rows of expert ``e`` must be the ones its offsets say."""
    _check(rows, bias, experts, offsets)
    if rows.dtype != bias.dtype:
        warn_fallback(f"{OP}.expert_bias", f"rows {rows.dtype} and bias {bias.dtype} (the kernels take one dtype)")
        return expert_bias_reference(rows, bias, experts, offsets)
    if not kernel_ok("expert_bias", rows):
        return expert_bias_reference(rows, bias, experts, offsets)
    if torch.compiler.is_compiling():
        return _bias_op(rows, bias, experts, offsets)
    if torch.is_grad_enabled() and (rows.requires_grad or bias.requires_grad):
        return _ExpertBiasFn.apply(rows, bias, experts, offsets)
    return _add(rows, bias, experts)
