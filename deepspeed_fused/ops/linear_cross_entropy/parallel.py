"""Vocabulary-parallel form of the fused op over a tensor-parallel group (the kernels' side).

Each rank holds weight rows [vocab_start, vocab_start + V_local). :func:`run_tp` runs one call;
the group's setup, layout exchange and collectives are in :mod:`.group` (shared with the torch
reference over a group, :mod:`.reference`), the chunk loops in :mod:`.chunks`. The steps:

* **Layout** (:func:`.group.tp_layout`): one small all-gather of every rank's metadata rows
  (shard bounds, dtype, hidden size, token count, options, chunk size and, when validating, its
  targets' extremes and temperature flag), checked on the host, so a bad call raises on every
  rank before any other collective; cached per layout (later calls with
  ``validate_targets=False`` issue none).
* **Statistics, per token chunk**: the chunk's local logits GEMM, the row kernel's partial
  statistics of the shard (:mod:`.kernels.row`), an asynchronous all-gather of them ([rows, 5]
  fp32 per rank). Every rank merges the same gathered values in the same order
  (:func:`.stats.merge_partial_stats`), so loss / lse / entropy are bitwise the same on every
  rank.
* **Scalar loss** (:class:`_TPScalarLoss`): the gradient is formed in the forward, as on one
  GPU, from the chunk's logits still in memory: the row kernel merges the chunk's lse from the
  gathered statistics and overwrites the logits with dlogits; then the dhidden-partial GEMM and
  the dweight accumulation. Three GEMMs per chunk, like the single-GPU op; two logits
  workspaces alternate so that the next chunk's GEMM and statistics run while this chunk's
  gather is in flight. Backward scales the buffers by grad_output and all-reduces dhidden.
* **Per-token outputs** (:class:`_TPPerToken`): forward as above without the gradient (one GEMM
  per chunk, each chunk's gather overlapping the next chunk); backward recomputes the logits
  (3 GEMMs per chunk) and all-reduces dhidden, started asynchronously before the last dweight
  GEMM, which it overlaps (on CUDA NCCL runs on its own stream).

Sequence parallelism (:class:`.group._SeqGather`, :class:`.group._SeqLocal`) all-gathers the
token shards first (after the layout check) and reduce-scatters dhidden instead of the
all-reduce. The call's options travel as its :class:`.options.LCEOptions`; the autograd
functions take it with the global vocabulary size and the chunk size.
"""
import torch

from .chunks import (_backward_vocab_chunks, _ChunkBuffers, _dhidden_into, _fused_stats, _logit_chunks,
                     _logits_into, _ParamGrads, _scale_formed_grads, _Upstream)
from .group import (dh_reduce_finish, dh_reduce_start, sp_gather, sp_local, stats_gather, tp_apply, tp_layout,
                    tp_meta_rows)
from .launch import _launch_rows
from .sizing import _token_chunk
from .stats import _NSTAT, _finalize_stats, _pack, merge_partial_stats


def run_tp(h, weight, bias, t, temp, opts, shape):
    """One call of the vocabulary-parallel op on checked rows (from :func:`.api.linear_cross_entropy`,
    ``opts.tp`` set; the rows as for :func:`.single.run_single`, this rank's token shard under
    sequence parallelism): the layout exchange and checks first (a bad call raises on every rank
    before any other collective), then the scalar loss with gradients formed in the forward
    (:class:`_TPScalarLoss`) or the per-token outputs (:class:`_TPPerToken`)."""
    tp, loss = opts.tp, opts.loss
    grads = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad
                                         or (bias is not None and bias.requires_grad))
    V_total, V_max = tp_layout(opts, tp_meta_rows(weight, h, bias, temp, opts), t, temp, h.device)
    if opts.sequence_parallel:
        h, t, temp = sp_gather(h, t, temp, tp, loss.accum_fp32)
    fused = grads and opts.scalar_loss
    chunk = _token_chunk(opts.chunk_tokens, V_max, h.dtype, h.shape[0], fused, loss.softcap, grads)
    if fused:
        return tp_apply(_TPScalarLoss, h, weight, bias, t, temp, opts, V_total, chunk)
    loss_tok, lse, ent = tp_apply(_TPPerToken, h, weight, bias, t, temp, opts, V_total, chunk)
    if opts.sequence_parallel:
        loss_tok, lse, ent = sp_local(opts, loss_tok, lse, ent)
    return _pack(loss_tok, lse, ent, t != loss.ignore_index, shape, opts)


def _bounds(M, chunk):
    return [(s, min(M, s + chunk)) for s in range(0, M, chunk)]


def _rows_temp(temp, s, e):
    return None if temp is None else temp[s:e]


def _tp_stats_pass(h, weight, bias, t, temp, opts, chunk):
    """Statistics of every shard [size, M, 5]: per chunk the local logits GEMM, the shard's
    statistics and their asynchronous all-gather, which the next chunk's GEMM overlaps. Where the
    fused GEMM runs (:func:`.launch.gemm_stats`, Hopper) it forms the shard's statistics of all
    tokens at once, without logits in memory; they are gathered in the same chunks, so every rank
    issues the same collectives whichever way its statistics were formed."""
    tp, loss = opts.tp, opts.loss
    stats = _fused_stats(h, weight, bias, t, temp, loss, opts.return_entropy, vocab_start=tp.start)
    if stats is not None:
        parts = [stats_gather(stats[s:e], tp, async_op=True) for s, e in _bounds(h.shape[0], chunk)]
    else:
        stats = torch.empty((h.shape[0], _NSTAT), dtype=torch.float32, device=h.device)
        parts = []
        for s, e, x, _, _ in _logit_chunks(h, weight, bias, chunk, loss.softcap, False):  # workspace freed after
            _launch_rows(x, t[s:e], stats=stats[s:e], need_ent=opts.return_entropy, vocab_start=tp.start,
                         **loss.kernel_kw(_rows_temp(temp, s, e)))
            parts.append(stats_gather(stats[s:e], tp, async_op=True))
    for _, work in parts:
        work.wait()
    return torch.cat([g for g, _ in parts], 1)


def _tp_fused_pass(h, weight, bias, t, temp, opts, V_total, chunk, w1, needs):
    """The scalar loss's gradient formed in the forward, three GEMMs per chunk: the local logits
    GEMM, the shard's statistics and their asynchronous all-gather; then, once the chunk's
    gather is done, the row kernel merges its lse and overwrites the logits still in memory with
    dlogits (or writes them to the workspace's gradient buffer: fp32 logits), and the
    dhidden-partial GEMM and the dweight accumulation follow. Two workspaces alternate (one when
    there is one chunk): chunk j + 1's GEMM and statistics are issued before chunk j waits for
    its gather. Returns (statistics of every shard [size, M, 5], dh partial or
    None, dw, db)."""
    tp, loss = opts.tp, opts.loss
    need_dh, need_dw, need_db = needs
    M, V = h.shape[0], weight.shape[0]
    bounds = _bounds(M, chunk)
    bufs = [_ChunkBuffers(h, min(chunk, M), V, loss.softcap, True) for _ in range(min(2, len(bounds)))]
    stats = torch.empty((M, _NSTAT), dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if need_dh else None
    pg = _ParamGrads(weight, bias, loss.accum_fp32, need_dw, need_db)
    parts = []

    def issue(j):
        s, e = bounds[j]
        x, _ = bufs[j % len(bufs)].views(e - s, V)
        _logits_into(h[s:e], weight, bias, x)
        _launch_rows(x, t[s:e], stats=stats[s:e], vocab_start=tp.start, **loss.kernel_kw(_rows_temp(temp, s, e)))
        parts.append(stats_gather(stats[s:e], tp, async_op=True))

    issue(0)
    for j, (s, e) in enumerate(bounds):
        if j + 1 < len(bounds):
            issue(j + 1)
        gathered, work = parts[j]
        work.wait()
        x, g = bufs[j % len(bufs)].views(e - s, V)
        _launch_rows(x, t[s:e], merged=gathered, g_loss=w1, per_token=False, out=g, vocab_start=tp.start,
                     vocab_total=V_total, **loss.kernel_kw(_rows_temp(temp, s, e)))
        if need_dh:
            _dhidden_into(g, weight, dh[s:e])
        pg.add(g, h[s:e])
    del bufs
    dw, db = pg.result(h)
    return torch.cat([g for g, _ in parts], 1), dh, dw, db


def _tp_grad_pass(h, weight, bias, t, temp, up, opts, V_total, chunk, needs, reduce_dh):
    """Per-token backward: the chunk logits recomputed and turned into dlogits from the per-token
    upstream gradients (``up``, a :class:`.chunks._Upstream`), local dweight/dbias and the dhidden
    partials (3 GEMMs per chunk). With ``reduce_dh`` the dhidden all-reduce starts before the last
    dweight GEMM, which it overlaps. One chunk of all tokens: the shard as one vocabulary slice
    (``chunks._backward_vocab_chunks``: the fused GEMM writing dlogits where it runs, else cuBLAS
    and the row kernel), the dhidden all-reduce after it. Returns (dh, reduce handle or None, dw, db)."""
    tp, loss = opts.tp, opts.loss
    need_dh, need_dw, need_db = needs
    M = h.shape[0]
    if chunk >= M:
        dh, dw, db = _backward_vocab_chunks(h, weight, bias, t, temp, up, loss, weight.shape[0], needs,
                                            base=tp.start, total=V_total)
        handle = dh_reduce_start(dh, tp.group, loss.accum_fp32) if need_dh and reduce_dh else None
        return (dh if need_dh else None), handle, dw, db
    dh = torch.empty_like(h) if need_dh else None
    pg = _ParamGrads(weight, bias, loss.accum_fp32, need_dw, need_db)
    handle = None
    for s, e, x, g, hc in _logit_chunks(h, weight, bias, chunk, loss.softcap, True):
        _launch_rows(x, t[s:e], per_token=True, out=g, vocab_start=tp.start, vocab_total=V_total,
                     **up.rows_kw(s, e), **loss.kernel_kw(_rows_temp(temp, s, e)))
        if need_dh:
            _dhidden_into(g, weight, dh[s:e])
            if reduce_dh and e == M:  # the last chunk
                handle = dh_reduce_start(dh, tp.group, loss.accum_fp32)
        pg.add(g, hc)
    dw, db = pg.result(h)
    return dh, handle, dw, db


class _TPScalarLoss(torch.autograd.Function):
    """Scalar loss ("mean"/"sum") with the local gradients formed in the forward
    (:func:`_tp_fused_pass`: 3 GEMMs per chunk, a statistics all-gather per chunk). Backward
    scales them by grad_output and all-reduces dhidden."""

    @staticmethod
    def forward(ctx, h, weight, bias, t, temp, opts, V_total, chunk):
        loss = opts.loss
        needs = tuple(ctx.needs_input_grad[:3])
        valid = t != loss.ignore_index
        if opts.mean:
            w = 1.0 / valid.sum().clamp(min=1).to(torch.float32)
        else:
            w = torch.ones((), dtype=torch.float32, device=h.device)
        gathered, dh, dw, db = _tp_fused_pass(h, weight, bias, t, temp, opts, V_total, chunk, w.reshape(1), needs)
        loss_tok, _, _ = _finalize_stats(merge_partial_stats(gathered), valid, V_total, loss.z_loss, loss.smoothing,
                                         False)
        ctx.group, ctx.fp32, ctx.sp = opts.tp.group, loss.accum_fp32, opts.sequence_parallel
        ctx.needs = needs
        ctx.ignore_index = loss.ignore_index
        ctx.save_for_backward(t)
        ctx.grads = [dh, dw if needs[1] else None, db if needs[2] else None]  # released in backward (no copy)
        return loss_tok.sum() * w

    @staticmethod
    def backward(ctx, g):
        # in place, as the single-GPU op (ignored rows stay exact zeros whatever g is); usable once
        if ctx.grads is None:
            raise RuntimeError("deepspeed_fused.linear_cross_entropy: the scalar-loss path can be backpropagated once")
        grads = ctx.grads
        ctx.grads = None
        (t,) = ctx.saved_tensors
        dh, dw, db = _scale_formed_grads(g, t, ctx.ignore_index, grads, ctx.needs, kernel=not torch.is_grad_enabled())
        # sequence parallel: dhidden [tokens of the group, H] is reduce-scattered by _SeqGather
        handle = dh_reduce_start(dh, ctx.group, ctx.fp32) if dh is not None and not ctx.sp else None
        return (dh_reduce_finish(handle) if handle is not None else dh), dw, db, None, None, None, None, None


class _TPPerToken(torch.autograd.Function):
    """Per-token (loss, lse, entropy): statistics pass with per-chunk gathers, merge in forward;
    backward recomputes the local logits (4 GEMMs per chunk in all) from per-token upstream
    gradients."""

    @staticmethod
    def forward(ctx, h, weight, bias, t, temp, opts, V_total, chunk):
        loss = opts.loss
        need_ent = opts.return_entropy
        gathered = _tp_stats_pass(h, weight, bias, t, temp, opts, chunk)
        loss_tok, lse, ent = _finalize_stats(merge_partial_stats(gathered), t != loss.ignore_index, V_total,
                                             loss.z_loss, loss.smoothing, need_ent)
        if ent is None:
            ent = lse.new_empty(0)
        ctx.call = (opts, V_total, chunk)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, weight, bias, t, temp, lse, ent)
        ctx.mark_non_differentiable(*(() if need_ent else (ent,)))
        return loss_tok, lse, ent

    @staticmethod
    def backward(ctx, g_loss, g_lse, g_ent):
        h, weight, bias, t, temp, lse, ent = ctx.saved_tensors
        opts, V_total, chunk = ctx.call
        needs = tuple(ctx.needs_input_grad[:3])
        if not any(needs):
            return (None,) * 8
        M = h.shape[0]
        g_loss = torch.zeros(M, dtype=torch.float32, device=h.device) if g_loss is None else g_loss.float()
        g_ent = None if (g_ent is None or not opts.return_entropy) else g_ent.float().contiguous()
        g_lse = None if g_lse is None else g_lse.float().contiguous()
        up = _Upstream.of(lse, ent, g_loss.contiguous(), g_ent, g_lse)
        dh, handle, dw, db = _tp_grad_pass(h, weight, bias, t, temp, up, opts, V_total, chunk, needs,
                                           reduce_dh=not opts.sequence_parallel)
        if handle is not None:
            dh = dh_reduce_finish(handle)
        return dh, (dw if needs[1] else None), (db if needs[2] else None), None, None, None, None, None
