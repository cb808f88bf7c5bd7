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
arithmetic: FP32 softmax ``exp(x - max) / sum``, values in descending order as torch.topk orders them
(NaN of either sign above +inf; equal values, a row of NaN included: the lower expert id first, every
id a real expert; the ranking is of integer keys, so neither the GPU's NaN-dropping ``max.f32`` nor a
NaN's sign bit enters it), the renormalisation's gradient as autograd forms it for ``values /= s``
(``g / s`` plus the sum of ``-g * v / (s * s)``), the softmax backward ``p * (dp - sum(dp * p))``,
one rounding to the logits' dtype. The exponential is CUDA's ``expf`` (as eager's softmax and
sigmoid); the sums run in another order than eager's, so two probabilities within an ULP of each
other can still swap places in the order (the same experts are chosen unless they straddle the k-th
place).

CUDA tensors (CPU ones under the interpreter, fp32/fp16 there) with up to 1024 experts and top-k
up to 32 run the kernels; anything else the torch reference (:func:`topk_softmax_reference`) with
one warning per reason. Eager calls run an autograd Function; ``torch.compile`` traces the custom
ops ``deepspeed_fused::moe_topk_softmax`` and ``deepspeed_fused::moe_topk_softmax_backward``
(``moe_group_topk_sigmoid`` and its backward for DeepSeek-V3's grouped sigmoid router, below).
"""
from __future__ import annotations

import functools
from typing import Optional

import torch

from .._common import HAS_TRITON, cdiv, next_power_of_2, DirectKernel, tl, triton, warn_fallback
from .checks import OP, kernels_take

_NS = "deepspeed_fused"
MAX_EXPERTS = 1024
MAX_TOP_K = 32

if HAS_TRITON:
    from .._common import exp_cuda

    # ---- shared by the router kernels: [BLOCK_T, KP] tiles of the k chosen (column j: the j-th) ----
    @triton.jit
    def _col(t, ks, j):
        # column j of a [BLOCK_T, KP] tile, per row
        return tl.sum(tl.where(ks[None, :] == j, t, tl.zeros_like(t)), axis=1)

    @triton.jit
    def _ordered_sum(t, ks, K: tl.constexpr):
        # the first K columns added left to right (eager's sum of the k values, in their order)
        tot = _col(t, ks, 0)
        for j in tl.static_range(1, K):
            tot += _col(t, ks, j)
        return tot

    @triton.jit
    def _order_key(x):
        # an int32 key per FP32 value ordered as torch.topk orders the values: NaN of either sign
        # above +inf (every NaN equal: ``x != x``, not its bits), -0.0 equal to 0.0; integer
        # comparisons, so no reduction can drop a NaN
        x = tl.where(x == 0.0, 0.0, x)
        b = x.to(tl.int32, bitcast=True)
        k = tl.where(b < 0, b ^ 0x7FFFFFFF, b)
        return tl.where(x != x, 0x7FFFFFFF, k)

    @triton.jit
    def _key_value(k):
        # the FP32 value of a key (a NaN key: a NaN)
        return tl.where(k < 0, k ^ 0x7FFFFFFF, k).to(tl.float32, bitcast=True)

    @triton.jit
    def _top_k(work, valid, cols, ks, K: tl.constexpr, BLOCK_T: tl.constexpr, KP: tl.constexpr,
               BLOCK_E: tl.constexpr):
        # the K largest of each row of ``work`` among its ``valid`` columns, in torch.topk's order (NaN
        # the largest; descending; equal values: the lower column first): their values and columns
        key = tl.where(valid, _order_key(work), -2147483648)
        vals = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
        ids = tl.zeros([BLOCK_T, KP], dtype=tl.int32)
        for j in tl.static_range(K):
            kv = tl.max(key, axis=1)
            i = tl.min(tl.where(key == kv[:, None], cols[None, :], BLOCK_E), axis=1)
            vals = tl.where(ks[None, :] == j, _key_value(kv)[:, None], vals)
            ids = tl.where(ks[None, :] == j, i[:, None], ids)
            key = tl.where(cols[None, :] == i[:, None], -2147483648, key)
        return vals, ids

    @triton.jit
    def _gather_cols(t, cols, ids, ks, K: tl.constexpr, BLOCK_T: tl.constexpr, KP: tl.constexpr):
        # t[row, ids[row, j]] for the K chosen columns
        v = tl.zeros([BLOCK_T, KP], dtype=tl.float32)
        for j in tl.static_range(K):
            vj = tl.sum(tl.where(cols[None, :] == _col(ids, ks, j)[:, None], t, 0.0), axis=1)
            v = tl.where(ks[None, :] == j, vj[:, None], v)
        return v

    @triton.jit
    def _scatter_cols(g, cols, ids, ks, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
        # top-k's backward: g at the chosen columns, 0 elsewhere
        d = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.float32)
        for j in tl.static_range(K):
            d = tl.where(cols[None, :] == _col(ids, ks, j)[:, None], _col(g, ks, j)[:, None], d)
        return d

    @triton.jit
    def _renorm_bwd(g, v, den, km):
        # autograd's gradient of ``v /= den`` with den the sum of v (+ a constant): g / den plus
        # the sum of -g * v / (den * den)
        t = tl.where(km, tl.div_rn(-g * v, (den * den)[:, None]), 0.0)
        return tl.div_rn(g, den[:, None]) + tl.sum(t, axis=1)[:, None]

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
        e = exp_cuda(x - mx[:, None])
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
        vals, ids = _top_k(p, (cols < E)[None, :], cols, ks, K, BLOCK_T, KP, BLOCK_E)
        if RENORM:
            vals = tl.div_rn(vals, _ordered_sum(vals, ks, K)[:, None])
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
        if RENORM:  # the selected probabilities, gathered from the recomputed softmax
            v = _gather_cols(p, cols, ids, ks, K, BLOCK_T, KP)
            g = _renorm_bwd(g, v, tl.where(rmask, _ordered_sum(v, ks, K), 1.0), km)
        dp = _scatter_cols(g, cols, ids, ks, K, BLOCK_T, BLOCK_E)
        dot = tl.sum(dp * p, axis=1)
        dx = p * (dp - dot[:, None])
        m = rmask[:, None] & (cols < E)[None, :]
        tl.store(DL + rows.to(tl.int64)[:, None] * stride_dl + cols[None, :], dx.to(DL.dtype.element_ty), mask=m)

    _launch_fwd = DirectKernel(_topk_softmax_fwd_kernel)
    _launch_bwd = DirectKernel(_topk_softmax_bwd_kernel)

    # ---- the top-k of the logits, then the softmax of those k (GPT-OSS, Aria, Cohere2-MoE) ----------
    @triton.jit
    def _round_to(v, ROUND: tl.constexpr):
        # FP32 values rounded to the softmax's dtype (1: bf16, 2: fp16, 0: kept FP32)
        if ROUND == 1:
            v = v.to(tl.bfloat16).to(tl.float32)
        elif ROUND == 2:
            v = v.to(tl.float16).to(tl.float32)
        return v

    @triton.jit
    def _k_softmax(v, ks, rmask, K: tl.constexpr, ROUND: tl.constexpr):
        # eager's softmax over the k chosen logits (FP32 arithmetic, one rounding to its dtype)
        km = (ks < K)[None, :]
        mx = tl.max(tl.where(km, v, float("-inf")), axis=1)
        mx = tl.where(rmask, mx, 0.0)
        e = tl.where(km, exp_cuda(v - mx[:, None]), 0.0)
        s = tl.where(rmask, tl.sum(e, axis=1), 1.0)
        return _round_to(tl.div_rn(e, s[:, None]), ROUND)

    @triton.jit
    def _topk_logits_fwd_kernel(L, SCORES, IDX, n_rows, E, stride, K: tl.constexpr, ROUND: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, KP: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < n_rows
        cols = tl.arange(0, BLOCK_E)
        m = rmask[:, None] & (cols < E)[None, :]
        x = tl.load(L + rows.to(tl.int64)[:, None] * stride + cols[None, :], mask=m, other=float("-inf"))
        x = tl.where(m, x.to(tl.float32), float("-inf"))
        ks = tl.arange(0, KP)
        vals, ids = _top_k(x, m, cols, ks, K, BLOCK_T, KP, BLOCK_E)
        p = _k_softmax(vals, ks, rmask, K, ROUND)
        om = rmask[:, None] & (ks < K)[None, :]
        o = rows.to(tl.int64)[:, None] * K + ks[None, :]
        tl.store(SCORES + o, p.to(SCORES.dtype.element_ty), mask=om)
        tl.store(IDX + o, ids.to(tl.int64), mask=om)

    @triton.jit
    def _topk_logits_bwd_kernel(L, IDX, DS, DL, n_rows, E, stride, stride_dl, K: tl.constexpr, ROUND: tl.constexpr,
                                BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, KP: tl.constexpr):
        # the softmax's backward over the k as CUDA's eager computes it, from its output in its
        # dtype (as autograd saves it): t = g * y, a tensor in the softmax's dtype (its own
        # elementwise kernel, one rounding), then t - y * sum(t) in FP32 (the product fused into the
        # subtraction, as nvcc builds it), one rounding to the logits' dtype; scattered into a zero
        # row of experts (top-k's backward)
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < n_rows
        ks = tl.arange(0, KP)
        km = rmask[:, None] & (ks < K)[None, :]
        o = rows.to(tl.int64)[:, None] * K + ks[None, :]
        ids = tl.load(IDX + o, mask=km, other=0).to(tl.int32)
        v = tl.load(L + rows.to(tl.int64)[:, None] * stride + ids, mask=km, other=float("-inf")).to(tl.float32)
        y = _k_softmax(v, ks, rmask, K, ROUND)
        g = _round_to(tl.load(DS + o, mask=km, other=0.0).to(tl.float32), ROUND)  # the cast's backward
        gy = tl.where(km, _round_to(g * y, ROUND), 0.0)
        dv = gy - y * tl.sum(gy, axis=1)[:, None]
        dv = dv.to(DL.dtype.element_ty).to(tl.float32)
        cols = tl.arange(0, BLOCK_E)
        dx = _scatter_cols(dv, cols, ids, ks, K, BLOCK_T, BLOCK_E)
        m = rmask[:, None] & (cols < E)[None, :]
        tl.store(DL + rows.to(tl.int64)[:, None] * stride_dl + cols[None, :], dx.to(DL.dtype.element_ty), mask=m)

    _launch_kl_fwd = DirectKernel(_topk_logits_fwd_kernel)
    _launch_kl_bwd = DirectKernel(_topk_logits_bwd_kernel)

    @triton.jit
    def _sigmoid_tile(L, rows, n_rows, E, stride, BLOCK_E: tl.constexpr):
        cols = tl.arange(0, BLOCK_E)
        m = (rows < n_rows)[:, None] & (cols < E)[None, :]
        x = tl.load(L + rows.to(tl.int64)[:, None] * stride + cols[None, :], mask=m, other=0.0).to(tl.float32)
        s = tl.div_rn(tl.zeros_like(x) + 1.0, 1.0 + exp_cuda(-x))  # eager's FP32 sigmoid
        return s, cols, m

    @triton.jit
    def _group_topk_fwd_kernel(L, BIAS, W, IDX, n_rows, E, stride, group_size, scale, K: tl.constexpr,
                               G: tl.constexpr, TG: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr,
                               BLOCK_E: tl.constexpr, KP: tl.constexpr, GP: tl.constexpr):
        # DeepSeek-V3's routing: sigmoid scores; the choice adds the correction bias; the TG groups
        # with the largest sum of their two best choices; the K best choices among those groups;
        # their (uncorrected) scores, divided by their sum + 1e-20 where RENORM, times ``scale``
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < n_rows
        s, cols, m = _sigmoid_tile(L, rows, n_rows, E, stride, BLOCK_E)
        b = tl.load(BIAS + cols, mask=cols < E, other=0.0).to(tl.float32)
        choice = tl.where(m, s + b[None, :], float("-inf"))
        grp = cols // group_size
        gs_ = tl.arange(0, GP)
        gsc = tl.full([BLOCK_T, GP], float("-inf"), dtype=tl.float32)
        key = _order_key(choice)
        for q in tl.static_range(G):  # each group's two best choices (torch.topk's order), summed
            kq = tl.where((grp == q)[None, :] & m, key, -2147483648)
            k1 = tl.max(kq, axis=1)
            i1 = tl.min(tl.where(kq == k1[:, None], cols[None, :], BLOCK_E), axis=1)
            k2 = tl.max(tl.where(cols[None, :] == i1[:, None], -2147483648, kq), axis=1)
            gsc = tl.where(gs_[None, :] == q, (_key_value(k1) + _key_value(k2))[:, None], gsc)
        gkey = tl.where((gs_ < G)[None, :], _order_key(gsc), -2147483648)
        keep = tl.zeros([BLOCK_T, BLOCK_E], dtype=tl.int1)
        for j in tl.static_range(TG):
            kv = tl.max(gkey, axis=1)
            q = tl.min(tl.where(gkey == kv[:, None], gs_[None, :], GP), axis=1)
            gkey = tl.where(gs_[None, :] == q[:, None], -2147483648, gkey)
            keep = keep | (grp[None, :] == q[:, None])
        ks = tl.arange(0, KP)
        _, ids = _top_k(tl.where(keep, choice, float("-inf")), m, cols, ks, K, BLOCK_T, KP, BLOCK_E)
        vals = _gather_cols(s, cols, ids, ks, K, BLOCK_T, KP)
        if RENORM:
            vals = tl.div_rn(vals, (_ordered_sum(vals, ks, K) + 1e-20)[:, None])
        vals = vals * scale
        om = rmask[:, None] & (ks < K)[None, :]
        o = rows.to(tl.int64)[:, None] * K + ks[None, :]
        tl.store(W + o, vals, mask=om)
        tl.store(IDX + o, ids.to(tl.int64), mask=om)

    @triton.jit
    def _group_topk_bwd_kernel(L, IDX, DW, DL, n_rows, E, stride, stride_dl, scale, K: tl.constexpr,
                               RENORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                               KP: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < n_rows
        s, cols, m = _sigmoid_tile(L, rows, n_rows, E, stride, BLOCK_E)
        ks = tl.arange(0, KP)
        km = rmask[:, None] & (ks < K)[None, :]
        o = rows.to(tl.int64)[:, None] * K + ks[None, :]
        g = tl.load(DW + o, mask=km, other=0.0).to(tl.float32) * scale
        ids = tl.load(IDX + o, mask=km, other=-1).to(tl.int32)
        if RENORM:
            v = _gather_cols(s, cols, ids, ks, K, BLOCK_T, KP)
            g = _renorm_bwd(g, v, tl.where(rmask, _ordered_sum(v, ks, K) + 1e-20, 1.0), km)
        ds = _scatter_cols(g, cols, ids, ks, K, BLOCK_T, BLOCK_E)
        dx = ds * (1.0 - s) * s  # eager's sigmoid backward
        tl.store(DL + rows.to(tl.int64)[:, None] * stride_dl + cols[None, :], dx.to(DL.dtype.element_ty), mask=m)

    _launch_group_fwd = DirectKernel(_group_topk_fwd_kernel)
    _launch_group_bwd = DirectKernel(_group_topk_bwd_kernel)


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


@functools.lru_cache(maxsize=256)
def _meta(n_rows: int, E: int, K: int) -> tuple:
    block_e = next_power_of_2(max(E, 2))
    block_t = max(1, min(2048 // block_e, next_power_of_2(max(n_rows, 1))))
    kp = next_power_of_2(max(K, 2))
    return (cdiv(n_rows, block_t),), dict(BLOCK_T=block_t, BLOCK_E=block_e, KP=kp), 4


# ---- host side shared by the two top-k softmax routers: scores and indices [T, k] forward, the
# logits' gradient [T, E] backward; ``flag`` is each kernel's one option (RENORM, ROUND)
def _select_forward(launch, logits: torch.Tensor, top_k: int, out_dtype, consts: dict) -> tuple:
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    T, E = x.shape
    scores = torch.empty((T, top_k), dtype=out_dtype, device=x.device)
    idx = torch.empty((T, top_k), dtype=torch.int64, device=x.device)
    if T:
        grid, meta, warps = _meta(T, E, top_k)
        launch(grid, (x, scores, idx, T, E, x.stride(0)), dict(K=top_k, **consts, **meta), warps)
    return scores, idx


def _select_backward(launch, logits: torch.Tensor, idx: torch.Tensor, d_scores: torch.Tensor,
                     consts: dict) -> torch.Tensor:
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    T, E = x.shape
    K = idx.shape[-1]
    dl = torch.empty((T, E), dtype=logits.dtype, device=x.device)
    if T:
        grid, meta, warps = _meta(T, E, K)
        launch(grid, (x, idx.contiguous(), d_scores.contiguous(), dl, T, E, x.stride(0), dl.stride(0)),
               dict(K=K, **consts, **meta), warps)
    return dl


class _SelectFn(torch.autograd.Function):
    """Eager autograd of either router: ``forward(logits, top_k, flag, out_dtype)`` and
    ``backward(logits, idx, d_scores, flag)`` are the router's host functions."""

    @staticmethod
    def forward(ctx, logits, top_k, flag, out_dtype, forward, backward):
        scores, idx = forward(logits, top_k, flag, out_dtype)
        ctx.save_for_backward(logits, idx)
        ctx.flag, ctx.backward_fn = flag, backward
        ctx.mark_non_differentiable(idx)
        return scores, idx

    @staticmethod
    def backward(ctx, d_scores, _d_idx):
        logits, idx = ctx.saved_tensors
        return ctx.backward_fn(logits, idx, d_scores, ctx.flag), None, None, None, None, None


def _register_select_autograd(op, backward_op) -> None:
    """The autograd of a router's custom op ``op(logits, top_k, flag, out_dtype)``: its backward
    custom op ``backward_op(logits, idx, d_scores, flag)``."""

    def setup(ctx, inputs, output):
        ctx.save_for_backward(inputs[0], output[1])
        ctx.flag = inputs[2]
        ctx.mark_non_differentiable(output[1])

    def backward(ctx, d_scores, _d_idx):
        logits, idx = ctx.saved_tensors
        return backward_op(logits, idx, d_scores, ctx.flag), None, None, None

    op.register_autograd(backward, setup_context=setup)


def _forward(logits: torch.Tensor, top_k: int, renormalize: bool, out_dtype) -> tuple:
    return _select_forward(_launch_fwd, logits, top_k, out_dtype, dict(RENORM=bool(renormalize)))


def _backward(logits: torch.Tensor, idx: torch.Tensor, d_scores: torch.Tensor, renormalize: bool) -> torch.Tensor:
    return _select_backward(_launch_bwd, logits, idx, d_scores, dict(RENORM=bool(renormalize)))


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


_register_select_autograd(_topk_softmax_op, _topk_softmax_backward_op)


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
        return _SelectFn.apply(logits, top_k, bool(renormalize), dtype, _forward, _backward)
    return _forward(logits, top_k, bool(renormalize), dtype)


# ---- the top-k of the logits, then the softmax of those k ---------------------------------------
_ROUND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def topk_logits_softmax_reference(logits: torch.Tensor, top_k: int, softmax_dtype: Optional[torch.dtype] = None,
                                  out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """GPT-OSS's router after its GEMM (Aria's and Cohere2-MoE's the same with other dtypes): the
    ``top_k`` largest logits (descending), the softmax of those k with output ``softmax_dtype``
    (None: the logits' dtype), cast to ``out_dtype`` (None: kept)."""
    values, indices = torch.topk(logits, top_k, dim=-1)
    scores = torch.nn.functional.softmax(values, dim=-1, dtype=softmax_dtype or logits.dtype)
    return (scores if out_dtype is None else scores.to(out_dtype)), indices


def _kl_forward(logits, top_k, rnd, out_dtype):
    return _select_forward(_launch_kl_fwd, logits, top_k, out_dtype, dict(ROUND=rnd))


def _kl_backward(logits, idx, d_scores, rnd):
    return _select_backward(_launch_kl_bwd, logits, idx, d_scores, dict(ROUND=rnd))


@torch.library.custom_op(f"{_NS}::moe_topk_logits_softmax", mutates_args=())
def _kl_op(logits: torch.Tensor, top_k: int, rnd: int, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return _kl_forward(logits, top_k, rnd, out_dtype)


@_kl_op.register_fake
def _(logits, top_k, rnd, out_dtype):
    T = logits.shape[0]
    return logits.new_empty((T, top_k), dtype=out_dtype), logits.new_empty((T, top_k), dtype=torch.int64)


@torch.library.custom_op(f"{_NS}::moe_topk_logits_softmax_backward", mutates_args=())
def _kl_backward_op(logits: torch.Tensor, idx: torch.Tensor, d_scores: torch.Tensor, rnd: int) -> torch.Tensor:
    return _kl_backward(logits, idx, d_scores, rnd)


@_kl_backward_op.register_fake
def _(logits, idx, d_scores, rnd):
    return torch.empty_like(logits)


_register_select_autograd(_kl_op, _kl_backward_op)


def topk_logits_softmax(logits: torch.Tensor, top_k: int, softmax_dtype: Optional[torch.dtype] = None,
                        out_dtype: Optional[torch.dtype] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scores [T, top_k], indices [T, top_k] int64)`` of a router that takes the top-k of its
    logits ``[T, E]`` first and then the softmax of those k (GPT-OSS: ``softmax_dtype`` the logits'
    dtype; Cohere2-MoE: FP32, then ``out_dtype`` its hidden states' dtype): the softmax in FP32
    arithmetic rounded once to ``softmax_dtype`` (None: the logits' dtype), cast to ``out_dtype``
    (None: ``softmax_dtype``). Equal logits: the lower expert first. One kernel forward (the
    ``[T, E]`` probabilities never formed), one backward (the softmax's backward scattered into the
    logits' gradient)."""
    _check(logits, top_k, out_dtype)
    if softmax_dtype is not None and softmax_dtype not in _ROUND:
        raise TypeError(f"softmax_dtype: expected None, torch.float32, torch.bfloat16 or torch.float16, got "
                        f"{softmax_dtype!r}")
    sd = softmax_dtype or logits.dtype
    out = out_dtype or sd
    ok, why = kernels_take_router(logits, top_k)
    if ok and sd not in _ROUND:
        ok, why = False, f"a softmax in {sd}"
    if not ok:
        warn_fallback(f"{OP}.topk_logits_softmax", why)
        return topk_logits_softmax_reference(logits, top_k, sd, out)
    rnd = _ROUND[sd]
    if torch.compiler.is_compiling():
        return _kl_op(logits, top_k, rnd, out)
    if torch.is_grad_enabled() and logits.requires_grad:
        return _SelectFn.apply(logits, top_k, rnd, out, _kl_forward, _kl_backward)
    return _kl_forward(logits, top_k, rnd, out)


# ---- DeepSeek-V3's grouped sigmoid routing -------------------------------------------------------
MAX_GROUPS = 32


def group_topk_sigmoid_reference(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int,
                                 topk_group: int, renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router selection (transformers' ``DeepseekV3TopkRouter`` after its GEMM):
    ``(weights [T, top_k] FP32, indices [T, top_k])``."""
    E = logits.shape[-1]
    scores = logits.sigmoid()
    choice = scores + bias
    group_scores = choice.view(-1, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, n_group, E // n_group).reshape(-1, E)
    choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
    idx = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    w = scores.gather(1, idx)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * scale, idx


def _group_check(logits, bias, top_k, n_group, topk_group) -> None:
    _check(logits, top_k, None)
    E = logits.shape[-1]
    if not isinstance(bias, torch.Tensor) or bias.shape != (E,):
        raise ValueError(f"bias: expected a [{E}] tensor (the score correction), got "
                         f"{getattr(bias, 'shape', type(bias).__name__)}")
    if not isinstance(n_group, int) or n_group < 1 or E % n_group or E // n_group < 2:
        raise ValueError(f"n_group: expected a divisor of the {E} experts leaving at least 2 per group, "
                         f"got {n_group!r}")
    if not isinstance(topk_group, int) or not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group: expected an int in [1, {n_group}], got {topk_group!r}")
    if top_k > topk_group * (E // n_group):
        raise ValueError(f"top_k: {top_k} is more than the {topk_group * (E // n_group)} experts of the chosen groups")


def _group_meta(n_rows, E, K, G) -> tuple:
    grid, meta, warps = _meta(n_rows, E, K)
    return grid, dict(meta, GP=next_power_of_2(max(G, 2))), warps


def _group_forward(logits, bias, top_k, n_group, topk_group, renormalize, scale):
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    T, E = x.shape
    w = torch.empty((T, top_k), dtype=torch.float32, device=x.device)
    idx = torch.empty((T, top_k), dtype=torch.int64, device=x.device)
    if T:
        grid, meta, warps = _group_meta(T, E, top_k, n_group)
        gp = meta.pop("GP")
        _launch_group_fwd(grid, (x, bias.contiguous(), w, idx, T, E, x.stride(0), E // n_group, float(scale)),
                          dict(K=top_k, G=n_group, TG=topk_group, RENORM=bool(renormalize), **meta, GP=gp), warps)
    return w, idx


def _group_backward(logits, idx, d_w, renormalize, scale):
    x = logits if logits.stride(-1) == 1 else logits.contiguous()
    T, E = x.shape
    K = idx.shape[-1]
    dl = torch.empty((T, E), dtype=logits.dtype, device=x.device)
    if T:
        grid, meta, warps = _meta(T, E, K)
        _launch_group_bwd(grid, (x, idx.contiguous(), d_w.contiguous(), dl, T, E, x.stride(0), dl.stride(0),
                                 float(scale)), dict(K=K, RENORM=bool(renormalize), **meta), warps)
    return dl


class _GroupTopKFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, bias, top_k, n_group, topk_group, renormalize, scale):
        w, idx = _group_forward(logits, bias, top_k, n_group, topk_group, renormalize, scale)
        ctx.save_for_backward(logits, idx)
        ctx.args = (renormalize, scale)
        ctx.mark_non_differentiable(idx)
        return w, idx

    @staticmethod
    def backward(ctx, d_w, _d_idx):
        logits, idx = ctx.saved_tensors
        return (_group_backward(logits, idx, d_w, *ctx.args),) + (None,) * 6


@torch.library.custom_op(f"{_NS}::moe_group_topk_sigmoid", mutates_args=())
def _group_op(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int, renormalize: bool,
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _group_forward(logits, bias, top_k, n_group, topk_group, renormalize, scale)


@_group_op.register_fake
def _(logits, bias, top_k, n_group, topk_group, renormalize, scale):
    T = logits.shape[0]
    return logits.new_empty((T, top_k), dtype=torch.float32), logits.new_empty((T, top_k), dtype=torch.int64)


@torch.library.custom_op(f"{_NS}::moe_group_topk_sigmoid_backward", mutates_args=())
def _group_backward_op(logits: torch.Tensor, idx: torch.Tensor, d_w: torch.Tensor, renormalize: bool,
                       scale: float) -> torch.Tensor:
    return _group_backward(logits, idx, d_w, renormalize, scale)


@_group_backward_op.register_fake
def _(logits, idx, d_w, renormalize, scale):
    return torch.empty_like(logits)


def _group_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], output[1])
    ctx.args = (inputs[5], inputs[6])
    ctx.mark_non_differentiable(output[1])


def _group_op_backward(ctx, d_w, _d_idx):
    logits, idx = ctx.saved_tensors
    return (_group_backward_op(logits, idx, d_w, *ctx.args),) + (None,) * 6


_group_op.register_autograd(_group_op_backward, setup_context=_group_setup)


def group_topk_sigmoid(logits: torch.Tensor, bias: torch.Tensor, top_k: int, n_group: int, topk_group: int,
                       renormalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's router selection from FP32 logits ``[T, E]`` (sigmoid scores, the correction
    ``bias`` for the choice only, the ``topk_group`` best of ``n_group`` groups by their two best
    choices, the ``top_k`` best choices there; their scores renormalised (+1e-20) where
    ``renormalize``, times ``scale``): ``(weights FP32, indices int64)``, one kernel each way. The
    order of the k (transformers' ``sorted=False``) is ours: best first."""
    _group_check(logits, bias, top_k, n_group, topk_group)
    ok, why = kernels_take_router(logits, top_k)
    if ok and logits.dtype != torch.float32:
        ok, why = False, f"logits of {logits.dtype} (DeepSeek-V3's router computes them in FP32)"
    if ok and n_group > MAX_GROUPS:
        ok, why = False, f"{n_group} groups (the kernel takes at most {MAX_GROUPS})"
    if ok and bias.device != logits.device:
        ok, why = False, "the bias on another device"
    if not ok:
        warn_fallback(f"{OP}.group_topk_sigmoid", why)
        return group_topk_sigmoid_reference(logits, bias, top_k, n_group, topk_group, renormalize, scale)
    if torch.compiler.is_compiling():
        return _group_op(logits, bias, top_k, n_group, topk_group, bool(renormalize), float(scale))
    if torch.is_grad_enabled() and logits.requires_grad:
        return _GroupTopKFn.apply(logits, bias, top_k, n_group, topk_group, bool(renormalize), float(scale))
    return _group_forward(logits, bias, top_k, n_group, topk_group, bool(renormalize), float(scale))
