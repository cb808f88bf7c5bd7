"""Vocabulary-parallel form over a tensor-parallel group, and sequence parallelism.

Each rank holds weight rows [vocab_start, vocab_start + V_local). The collectives:

* **Layout** (:func:`_tp_layout`): one small all-gather of every rank's metadata rows (shard
  bounds, dtype, hidden size, token count, options, chunk size and, when validating, its
  targets' extremes and temperature flag), read on the host and checked together, so a bad
  call raises on every rank before any other collective. Issued when ``validate_targets`` or
  the first time a rank sees its shard layout; then the layout is cached and later calls with
  ``validate_targets=False`` issue none (no host sync).
* **Statistics, per token chunk**: the chunk's local logits GEMM, the row kernel's partial
  statistics of the shard (:mod:`.kernels`), an asynchronous all-gather of them ([rows, 5]
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

Sequence parallelism (:class:`_SeqGather`, :class:`_SeqLocal`) all-gathers the token shards
first (after the layout check) and reduce-scatters dhidden instead of the all-reduce.

The torch reference over a group (:mod:`.reference`) uses the same layout exchange and one
all-gather of the statistics of all its tokens; :func:`_tp_setup` is called by the argument
checks (:mod:`.checks`).
"""
import torch

from .chunks import (_backward_vocab_chunks, _ChunkBuffers, _dhidden_into, _fused_stats, _kw, _logit_chunks,
                     _logits_into, _ParamGrads, _scale_formed_grads)
from .group import _dh_reduce_finish, _dh_reduce_start, _stats_gather
from .row_kernel import _launch_rows
from .stats import _NSTAT, _finalize_stats, merge_partial_stats


class _TPConfig:
    __slots__ = ("tp", "V_total", "inv_temp", "ignore_index", "z_loss", "smoothing", "cap", "accum_fp32", "chunk",
                 "mean", "need_ent", "sp")

    def __init__(self, *args):
        for k, v in zip(self.__slots__, args, strict=True):
            setattr(self, k, v)


def _bounds(M, chunk):
    return [(s, min(M, s + chunk)) for s in range(0, M, chunk)]


def _stats_kw(c, temp, s, e):
    """Row-kernel options of the statistics pass (z_loss plays no part in the statistics)."""
    return dict(vocab_start=c.tp.start, **_kw(None if temp is None else temp[s:e], c.inv_temp, c.ignore_index, 0.0,
                                              c.smoothing, c.cap))


def _grad_kw(c, temp, s, e):
    return dict(vocab_start=c.tp.start, vocab_total=c.V_total,
                **_kw(None if temp is None else temp[s:e], c.inv_temp, c.ignore_index, c.z_loss, c.smoothing, c.cap))


def _tp_stats_pass(h, weight, bias, t, temp, c):
    """Statistics of every shard [size, M, 5]: per chunk the local logits GEMM, the shard's
    statistics and their asynchronous all-gather, which the next chunk's GEMM overlaps. Where the
    fused GEMM runs (:func:`.kernels.gemm_stats`, Hopper) it forms the shard's statistics of all
    tokens at once, without logits in memory; they are gathered in the same chunks, so every rank
    issues the same collectives whichever way its statistics were formed."""
    stats = _fused_stats(h, weight, bias, t, temp, c.inv_temp, c.ignore_index, c.smoothing, c.cap, c.need_ent,
                         vocab_start=c.tp.start)
    if stats is not None:
        parts = [_stats_gather(stats[s:e], c.tp, async_op=True) for s, e in _bounds(h.shape[0], c.chunk)]
    else:
        stats = torch.empty((h.shape[0], _NSTAT), dtype=torch.float32, device=h.device)
        parts = []
        for s, e, x, _, _ in _logit_chunks(h, weight, bias, c.chunk, c.cap, False):  # workspace freed after
            _launch_rows(x, t[s:e], stats=stats[s:e], need_ent=c.need_ent, **_stats_kw(c, temp, s, e))
            parts.append(_stats_gather(stats[s:e], c.tp, async_op=True))
    for _, work in parts:
        work.wait()
    return torch.cat([g for g, _ in parts], 1)


def _tp_fused_pass(h, weight, bias, t, temp, c, w1, need_dh, need_dw, need_db):
    """The scalar loss's gradient formed in the forward, three GEMMs per chunk: the local logits
    GEMM, the shard's statistics and their asynchronous all-gather; then, once the chunk's
    gather is done, the row kernel merges its lse and overwrites the logits still in memory with
    dlogits (or writes them to the workspace's gradient buffer: fp32 logits), and the
    dhidden-partial GEMM and the dweight accumulation follow. Two workspaces alternate (one when
    there is one chunk): chunk j + 1's GEMM and statistics are issued before chunk j waits for
    its gather. Returns (statistics of every shard [size, M, 5], dh partial or
    None, dw, db)."""
    M, V = h.shape[0], weight.shape[0]
    bounds = _bounds(M, c.chunk)
    bufs = [_ChunkBuffers(h, min(c.chunk, M), V, c.cap, True) for _ in range(min(2, len(bounds)))]
    stats = torch.empty((M, _NSTAT), dtype=torch.float32, device=h.device)
    dh = torch.empty_like(h) if need_dh else None
    pg = _ParamGrads(weight, bias, c.accum_fp32, need_dw, need_db)
    parts = []

    def issue(j):
        s, e = bounds[j]
        x, _ = bufs[j % len(bufs)].views(e - s, V)
        _logits_into(h[s:e], weight, bias, x)
        _launch_rows(x, t[s:e], stats=stats[s:e], **_stats_kw(c, temp, s, e))
        parts.append(_stats_gather(stats[s:e], c.tp, async_op=True))

    issue(0)
    for j, (s, e) in enumerate(bounds):
        if j + 1 < len(bounds):
            issue(j + 1)
        gathered, work = parts[j]
        work.wait()
        x, g = bufs[j % len(bufs)].views(e - s, V)
        _launch_rows(x, t[s:e], merged=gathered, g_loss=w1, per_token=False, out=g, **_grad_kw(c, temp, s, e))
        if need_dh:
            _dhidden_into(g, weight, dh[s:e])
        pg.add(g, h[s:e])
    del bufs
    dw, db = pg.result(h)
    return torch.cat([g for g, _ in parts], 1), dh, dw, db


def _tp_grad_pass(h, weight, bias, t, temp, c, need_dh, need_dw, need_db, *, lse, g_loss, ent=None, g_ent=None,
                  g_lse=None, reduce_dh=True):
    """Per-token backward: the chunk logits recomputed and turned into dlogits from the per-token
    upstream gradients, local dweight/dbias and the dhidden partials (3 GEMMs per chunk). With
    ``reduce_dh`` the dhidden all-reduce starts before the last dweight GEMM, which it overlaps.
    One chunk of all tokens: the shard as one vocabulary slice (``single._backward_vocab_chunks``:
    the fused GEMM writing dlogits where it runs, else cuBLAS and the row kernel), the dhidden
    all-reduce after it. Returns (dh, reduce handle or None, dw, db)."""
    M = h.shape[0]
    if c.chunk >= M:
        dh, dw, db = _backward_vocab_chunks(h, weight, t, bias, temp, lse, ent, g_loss, g_ent, g_lse, c.inv_temp,
                                            c.ignore_index, c.z_loss, c.smoothing, c.cap, c.accum_fp32,
                                            weight.shape[0], need_dh, need_dw, need_db, base=c.tp.start,
                                            total=c.V_total)
        handle = _dh_reduce_start(dh, c.tp.group, c.accum_fp32) if need_dh and reduce_dh else None
        return (dh if need_dh else None), handle, dw, db
    dh = torch.empty_like(h) if need_dh else None
    pg = _ParamGrads(weight, bias, c.accum_fp32, need_dw, need_db)
    handle = None
    for s, e, x, g, hc in _logit_chunks(h, weight, bias, c.chunk, c.cap, True):
        _launch_rows(x, t[s:e], lse=lse[s:e], ent=None if g_ent is None else ent[s:e], g_loss=g_loss[s:e],
                     g_ent=None if g_ent is None else g_ent[s:e], g_lse=None if g_lse is None else g_lse[s:e],
                     per_token=True, out=g, **_grad_kw(c, temp, s, e))
        if need_dh:
            _dhidden_into(g, weight, dh[s:e])
            if reduce_dh and e == M:  # the last chunk
                handle = _dh_reduce_start(dh, c.tp.group, c.accum_fp32)
        pg.add(g, hc)
    dw, db = pg.result(h)
    return dh, handle, dw, db


class _TPScalarLoss(torch.autograd.Function):
    """Scalar loss ("mean"/"sum") with the local gradients formed in the forward
    (:func:`_tp_fused_pass`: 3 GEMMs per chunk, a statistics all-gather per chunk). Backward
    scales them by grad_output and all-reduces dhidden."""

    @staticmethod
    def forward(ctx, h, weight, bias, t, temp, c):
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        valid = t != c.ignore_index
        if c.mean:
            w = 1.0 / valid.sum().clamp(min=1).to(torch.float32)
        else:
            w = torch.ones((), dtype=torch.float32, device=h.device)
        gathered, dh, dw, db = _tp_fused_pass(h, weight, bias, t, temp, c, w.reshape(1), need_dh, need_dw, need_db)
        loss_tok, _, _ = _finalize_stats(merge_partial_stats(gathered), valid, c.V_total, c.z_loss, c.smoothing,
                                         False)
        ctx.group, ctx.fp32, ctx.sp = c.tp.group, c.accum_fp32, c.sp
        ctx.needs = (need_dh, need_dw, need_db)
        ctx.ignore_index = c.ignore_index
        ctx.save_for_backward(t)
        ctx.grads = [dh, dw if need_dw else None, db if need_db else None]  # released in backward (no copy)
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
        handle = _dh_reduce_start(dh, ctx.group, ctx.fp32) if dh is not None and not ctx.sp else None
        return (_dh_reduce_finish(handle) if handle is not None else dh), dw, db, None, None, None


class _TPPerToken(torch.autograd.Function):
    """Per-token (loss, lse, entropy): statistics pass with per-chunk gathers, merge in forward;
    backward recomputes the local logits (4 GEMMs per chunk in all) from per-token upstream
    gradients."""

    @staticmethod
    def forward(ctx, h, weight, bias, t, temp, c):
        gathered = _tp_stats_pass(h, weight, bias, t, temp, c)
        loss, lse, ent = _finalize_stats(merge_partial_stats(gathered), t != c.ignore_index, c.V_total, c.z_loss,
                                         c.smoothing, c.need_ent)
        if ent is None:
            ent = lse.new_empty(0)
        ctx.c = c
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(h, weight, bias, t, temp, lse, ent)
        ctx.mark_non_differentiable(*(() if c.need_ent else (ent,)))
        return loss, lse, ent

    @staticmethod
    def backward(ctx, g_loss, g_lse, g_ent):
        h, weight, bias, t, temp, lse, ent = ctx.saved_tensors
        c = ctx.c
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        if not (need_dh or need_dw or need_db):
            return (None,) * 6
        M = h.shape[0]
        g_loss = torch.zeros(M, dtype=torch.float32, device=h.device) if g_loss is None else g_loss.float()
        g_ent = None if (g_ent is None or not c.need_ent) else g_ent.float().contiguous()
        g_lse = None if g_lse is None else g_lse.float().contiguous()
        dh, handle, dw, db = _tp_grad_pass(h, weight, bias, t, temp, c, need_dh, need_dw, need_db, lse=lse,
                                           g_loss=g_loss.contiguous(), ent=ent, g_ent=g_ent, g_lse=g_lse,
                                           reduce_dh=not c.sp)
        if handle is not None:
            dh = _dh_reduce_finish(handle)
        return dh, (dw if need_dw else None), (db if need_db else None), None, None, None
