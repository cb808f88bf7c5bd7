"""A top-k softmax router's selection from its logits, fused: softmax, top-k, renormalisation.

transformers' top-k routers (Qwen2/3-MoE, OLMoE, Qwen3-Next, Qwen3.5-MoE, Mixtral, ...) compute, from
``router_logits = F.linear(hidden, weight)``::

    probs = softmax(router_logits.float(), -1)
    values, indices = torch.topk(probs, top_k, dim=-1)
    values /= values.sum(-1, keepdim=True)        # where the family renormalises
    scores = values.to(router_logits.dtype)        # where the family casts

That is five launches forward and about ten backward (the cast, the in-place division's two
gradients, top-k's scatter into a zero ``[T, E]`` buffer, the softmax backward, the cast). Here one
kernel computes the scores and indices, and one kernel the logits' gradient from the scores'
gradient (the softmax recomputed from the logits, which the router returns anyway), with eager's
arithmetic: FP32 softmax ``exp(x - max) / sum``, values in descending order (equal values: the lower
expert id first), the renormalisation's gradient as autograd forms it for ``values /= s``
(``g / s`` plus the sum of ``-g * v / (s * s)``), the softmax backward ``p * (dp - sum(dp * p))``,
one rounding to the logits' dtype. Triton's ``exp`` differs from CUDA's in the last FP32 bits, so
two probabilities within an ULP of each other can swap places in the order (the same experts are
chosen unless they straddle the k-th place).

CUDA tensors (CPU ones under the interpreter, fp32/fp16 there) with up to 1024 experts and top-k
up to 32 run the kernels; anything else the torch reference (:func:`topk_softmax_reference`) with
one warning per reason. Eager calls run an autograd Function; ``torch.compile`` traces the custom
ops ``deepspeed_fused::moe_topk_softmax`` and ``deepspeed_fused::moe_topk_softmax_backward``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._common import HAS_TRITON, DirectKernel, tl, triton, warn_fallback
from .checks import OP, kernels_take

_NS = "deepspeed_fused"
MAX_EXPERTS = 1024
MAX_TOP_K = 32

if HAS_TRITON:

    @triton.jit
    def _probs(L, rows, n_rows, E, stride, BLOCK_E: tl.constexpr):
        # the FP32 softmax of a [BLOCK_T, BLOCK_E] tile of logits (padding columns: probability 0)
        cols = tl.arange(0, BLOCK_E)
        m = (rows < n_rows)[:, None] & (cols < E)[None, :]
        x = tl.load(L + rows.to(tl.int64)[:, None] * stride + cols[None, :], mask=m, other=float("-inf"))
        x = x.to(tl.float32)
        x = tl.where(m, x, float("-inf"))
        mx = tl.max(x, axis=1)
        mx = tl.where(rows < n_rows, mx, 0.0)
        e = tl.exp(x - mx[:, None])
        e = tl.where(m, e, 0.0)
        s = tl.sum(e, axis=1)
        s = tl.where(rows < n_rows, s, 1.0)
        return tl.div_rn(e, s[:, None]), cols

    @triton.jit
    def _topk_softmax_fwd_kernel(L, SCORES, IDX, n_rows, E, stride, K: tl.constexpr, RENORM: tl.constexpr,
                                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, KP: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < n_rows
        p, cols = _probs(L, rows, n_rows, E, stride, BLOCK_E)
        ks = tl.arange(0, KP)
        vals = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
        ids = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
        work = tl.where((cols < E)[None, :], p, -1.0)
        for j in tl.static_range(K):
            v = tl.max(work, axis=1)
            i = tl.min(tl.where(work == v[:, None], cols[None, :], BLOCK_E), axis=1)
            vals = tl.where(ks[None, :] == j, v[:, None], vals)
            ids = tl.where(ks[None, :] == j, i[:, None], ids)
            work = tl.where(cols[None, :] == i[:, None], -2.0, work)
        if RENORM:
            tot = tl.zeros([BLOCK_T], dtype=tl.float32)
            for j in tl.static_range(K):  # in the order of the values, as eager's sum of k values
                tot += tl.sum(tl.where(ks[None, :] == j, vals, 0.0), axis=1)
            vals = tl.div_rn(vals, tot[:, None])
        om = rmask[:, None] & (ks < K)[None, :]
        o = rows.to(tl.int64)[:, None] * K + ks[None, :]
        tl.store(SCORES + o, vals.to(SCORES.dtype.element_ty), mask=om)
        tl.store(IDX + o, ids.to(tl.int64), mask=om)

    @triton.jit
    def _topk_softmax_bwd_kernel(L, IDX, DS, DL, n_rows, E, stride, stride_dl, K: tl.constexpr, RENORM: tl.constexpr,
                                 BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, KP: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < n_rows
        p, cols = _probs(L, rows, n_rows, E, stride, BLOCK_E)
        ks = tl.arange(0, KP)
        km = rmask[:, None] & (ks < K)[None, :]
        o = rows.to(tl.int64)[:, None] * K + ks[None, :]
        g = tl.load(DS + o, mask=km, other=0.0).to(tl.float32)
        ids = tl.load(IDX + o, mask=km, other=-1).to(tl.int32)
        # the selected probabilities, gathered from the recomputed softmax
        v = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
        for j in tl.static_range(K):
            ij = tl.sum(tl.where(ks[None, :] == j, ids, 0), axis=1)
            vj = tl.sum(tl.where(cols[None, :] == ij[:, None], p, 0.0), axis=1)
            v = tl.where(ks[None, :] == j, vj[:, None], v)
        if RENORM:
            tot = tl.zeros([BLOCK_T], dtype=tl.float32)
            for j in tl.static_range(K):
                tot += tl.sum(tl.where(ks[None, :] == j, v, 0.0), axis=1)
            tot = tl.where(rmask, tot, 1.0)
            t = tl.div_rn(-g * v, (tot * tot)[:, None])
            t = tl.where(km, t, 0.0)
            g = tl.div_rn(g, tot[:, None]) + tl.sum(t, axis=1)[:, None]
        # top-k's backward: dp is g at the selected columns, 0 elsewhere
        dp = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for j in tl.static_range(K):
            ij = tl.sum(tl.where(ks[None, :] == j, ids, 0), axis=1)
            gj = tl.sum(tl.where(ks[None, :] == j, g, 0.0), axis=1)
            dp = tl.where(cols[None, :] == ij[:, None], gj[:, None], dp)
        dot = tl.sum(dp * p, axis=1)
        dx = p * (dp - dot[:, None])
        m = rmask[:, None] & (cols < E)[None, :]
        tl.store(DL + rows.to(tl.int64)[:, None] * stride_dl + cols[None, :], dx.to(DL.dtype.element_ty), mask=m)

    _launch_fwd = DirectKernel(_topk_softmax_fwd_kernel)
    _launch_bwd = DirectKernel(_topk_softmax_bwd_kernel)


def topk_softmax_reference(logits: torch.Tensor, top_k: int, renormalize: bool,
                           out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager router: ``(scores, indices)``; ``out_dtype`` None keeps the FP32 values."""
    probs = torch.nn.functional.softmax(logits.float(), dim=-1)
    values, indices = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        values = values / values.sum(dim=-1, keepdim=True)
    return (values if out_dtype is None else values.to(out_dtype)), indices


def _check(logits, top_k, out_dtype) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits: expected a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point() or logits.dim() != 2:
        raise ValueError(f"logits: expected a 2-D [tokens, experts] floating-point tensor, got "
                         f"{tuple(logits.shape)} of {logits.dtype}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"top_k: expected an int in [1, {logits.shape[-1]}] (the experts), got {top_k!r}")
    if out_dtype is not None and not (isinstance(out_dtype, torch.dtype) and out_dtype.is_floating_point):
        raise TypeError(f"out_dtype: expected None or a floating-point torch.dtype, got {out_dtype!r}")


def kernels_take_router(logits: torch.Tensor, top_k: int) -> tuple[bool, str]:
    ok, why = kernels_take(logits)
    if ok and logits.shape[-1] > MAX_EXPERTS:
        ok, why = False, f"{logits.shape[-1]} experts (the kernel holds at most {MAX_EXPERTS} per row)"
    if ok and top_k > MAX_TOP_K:
        ok, why = False, f"top_k {top_k} (the kernel takes at most {MAX_TOP_K})"
    return ok, why


def _meta(n_rows: int, E: int, K: int) -> tuple:
    block_e = triton.next_power_of_2(max(E, 2))
    block_t = max(1, min(2048 // block_e, triton.next_power_of_2(max(n_rows, 1))))
    kp = triton.next_power_of_2(max(K, 2))
    return (triton.cdiv(n_rows, block_t),), dict(BLOCK_T=block_t, BLOCK_E=block_e, KP=kp), 4


def _forward(logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype) -> tuple:
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    T, E = x.shape
    scores = torch.empty((T, top_k), dtype=out_dtype, device=x.device)
    idx = torch.empty((T, top_k), dtype=torch.int64, device=x.device)
    if T:
        grid, meta, warps = _meta(T, E, top_k)
        _launch_fwd(grid, (x, scores, idx, T, E, x.stride(0)), dict(K=top_k, RENORM=bool(renormalize), **meta),
                    warps)
    return scores, idx


def _backward(logits: torch.Tensor, idx: torch.Tensor, d_scores: torch.Tensor, renormalize: bool) -> torch.Tensor:
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    T, E = x.shape
    K = idx.shape[-1]
    ds = d_scores.contiguous()
    dl = torch.empty((T, E), dtype=logits.dtype, device=x.device)
    if T:
        grid, meta, warps = _meta(T, E, K)
        _launch_bwd(grid, (x, idx.contiguous(), ds, dl, T, E, x.stride(0), dl.stride(0)),
                    dict(K=K, RENORM=bool(renormalize), **meta), warps)
    return dl


class _TopKSoftmaxFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, top_k, renormalize, out_dtype):
        scores, idx = _forward(logits, top_k, renormalize, out_dtype)
        ctx.save_for_backward(logits, idx)
        ctx.renormalize = renormalize
        ctx.mark_non_differentiable(idx)
        return scores, idx

    @staticmethod
    def backward(ctx, d_scores, _d_idx):
        logits, idx = ctx.saved_tensors
        return _backward(logits, idx, d_scores, ctx.renormalize), None, None, None


@torch.library.custom_op(f"{_NS}::moe_topk_softmax", mutates_args=())
def _topk_softmax_op(logits: torch.Tensor, top_k: int, renormalize: bool,
                     out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(logits, top_k, renormalize, out_dtype)


@_topk_softmax_op.register_fake
def _(logits, top_k, renormalize, out_dtype):
    T = logits.shape[0]
    return logits.new_empty((T, top_k), dtype=out_dtype), logits.new_empty((T, top_k), dtype=torch.int64)


@torch.library.custom_op(f"{_NS}::moe_topk_softmax_backward", mutates_args=())
def _topk_softmax_backward_op(logits: torch.Tensor, idx: torch.Tensor, d_scores: torch.Tensor,
                              renormalize: bool) -> torch.Tensor:
    return _backward(logits, idx, d_scores, renormalize)


@_topk_softmax_backward_op.register_fake
def _(logits, idx, d_scores, renormalize):
    return torch.empty_like(logits)


def _op_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])
    ctx.renormalize = inputs[2]
    ctx.mark_non_differentiable(output[1])


def _op_backward(ctx, d_scores, _d_idx):
    logits, idx = ctx.saved_tensors
    return _topk_softmax_backward_op(logits, idx, d_scores, ctx.renormalize), None, None, None


_topk_softmax_op.register_autograd(_op_backward, setup_context=_op_setup)


def topk_softmax(logits: torch.Tensor, top_k: int, renormalize: bool,
                 out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [T, top_k], indices [T, top_k] int64)`` of a top-k softmax router from its logits
    ``[T, E]``: FP32 softmax, the ``top_k`` largest (descending), divided by their sum when
    ``renormalize``, cast to ``out_dtype`` (None: FP32 scores). One kernel forward, one backward."""
    _check(logits, top_k, out_dtype)
    ok, why = kernels_take_router(logits, top_k)
    if not ok:
        warn_fallback(f"{OP}.topk_softmax", why)
        return topk_softmax_reference(logits, top_k, renormalize, out_dtype)
    dtype = torch.float32 if out_dtype is None else out_dtype
    if torch.compiler.is_compiling():
        return _topk_softmax_op(logits, top_k, bool(renormalize), dtype)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _TopKSoftmaxFn.apply(logits, top_k, bool(renormalize), dtype)
    return _forward(logits, top_k, bool(renormalize), dtype)
