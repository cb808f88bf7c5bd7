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

from .kernels import _launch_rows
from .single import (_backward_vocab_chunks, _ChunkBuffers, _fused_stats, _ParamGrads, _dhidden_into, _kw,
                     _logit_chunks, _logits_into, _scale_formed_grads)
from .stats import _NSTAT, _finalize_stats, merge_partial_stats


_DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_CODE_DTYPE = {v: k for k, v in _DTYPE_CODE.items()}
_REDUCTION_CODE = {"none": 0, "sum": 1, "mean": 2}
_META_NAMES = ("V_local", "vocab_start", "dtype", "hidden size", "tokens",
               "z_loss", "label_smoothing", "softcap", "temperature", "ignore_index",
               "return_entropy", "reduction", "bias", "accum_dtype", "return_lse",
               "chunk_tokens")
_META_ROWS = 4  # rows of 5 values; the layout exchange adds one row of per-rank value checks
# Shard layouts already checked on the host: (group id, rank, size, V_local, vocab_start, dtype,
# H) -> (global V, largest V_local). With validate_targets=False later calls exchange nothing.
_TP_LAYOUTS: dict = {}


class _TPInfo:
    __slots__ = ("group", "rank", "size", "start")

    def __init__(self, group, rank, size, start):
        self.group, self.rank, self.size, self.start = group, rank, size, start


def _tp_setup(tp_group, vocab_start, V_local):
    """None for the single-GPU op (no group, or a group of one rank), else the rank's _TPInfo."""
    if vocab_start is not None and (isinstance(vocab_start, bool) or not isinstance(vocab_start, int)
                                    or vocab_start < 0):
        raise ValueError(f"linear_cross_entropy: `vocab_start` must be None or an int >= 0, got {vocab_start!r}")
    if tp_group is None:
        if vocab_start is not None:
            raise ValueError("linear_cross_entropy: `vocab_start` needs a `tp_group` (the vocabulary shard's group)")
        return None
    import torch.distributed as dist

    if not dist.is_available():
        raise ValueError("linear_cross_entropy: `tp_group` given but torch.distributed is not available")
    size = dist.get_world_size(tp_group)
    if size == 1:
        if vocab_start not in (None, 0):
            raise ValueError(f"linear_cross_entropy: `vocab_start`={vocab_start} with a tp_group of one rank: the "
                             f"shard must be the whole vocabulary (vocab_start 0)")
        return None
    rank = dist.get_rank(tp_group)
    return _TPInfo(tp_group, rank, size, rank * V_local if vocab_start is None else vocab_start)


def _tp_meta_rows(tp, weight, h, reduction, temp, temperature, ignore_index, z_loss, smoothing, softcap,
                  return_entropy, return_lse, bias, accum_fp32, chunk_tokens):
    """This rank's metadata rows [4, 5] (exact in float64), checked by the layout exchange."""
    return [[weight.shape[0], tp.start, _DTYPE_CODE[weight.dtype], weight.shape[1], h.shape[0]],
            [float(z_loss), float(smoothing), float(softcap or 0.0), -1.0 if temp is not None else float(temperature),
             ignore_index],
            [bool(return_entropy), _REDUCTION_CODE[reduction], bias is not None, bool(accum_fp32), bool(return_lse)],
            [chunk_tokens if isinstance(chunk_tokens, int) else 0, 0, 0, 0, 0]]


def _tp_check_layout(meta):
    """Host check of every rank's metadata values (a list per rank); returns (global V, largest V_local)."""
    def fmt(j):
        vals = [m[j] for m in meta]
        if j == 2:
            vals = [str(_CODE_DTYPE.get(int(v), v)).replace("torch.", "") for v in vals]
        if j == 15:
            vals = [int(v) if v else "auto" for v in vals]
        return ", ".join(f"rank {r}: {v}" for r, v in enumerate(vals))

    for j in range(2, len(_META_NAMES)):
        if any(m[j] != meta[0][j] for m in meta):
            exc = TypeError if j == 2 else ValueError
            hint = (" (with sequence_parallel=True every rank's token shard must have the same size)"
                    if j == 4 else "")
            raise exc(f"linear_cross_entropy: the ranks of `tp_group` disagree on {_META_NAMES[j]} ({fmt(j)}){hint}; "
                      f"every rank must call the op with the same dtype, hidden/target shapes and options")
    shards = sorted((int(m[1]), int(m[0]), r) for r, m in enumerate(meta))
    expect = 0
    for start, v, r in shards:
        if v < 1 or start != expect:
            bounds = ", ".join(f"rank {r}: [{int(m[1])}, {int(m[1] + m[0])})" for r, m in enumerate(meta))
            raise ValueError(f"linear_cross_entropy: the vocabulary shards of `tp_group` ({bounds}) do not tile "
                             f"[0, V) without gaps or overlaps (V_local {fmt(0)}); vocab_start=None assumes equal "
                             f"shards at rank * V_local: pass `vocab_start` for ragged shards")
        expect = start + v
    return expect, max(int(m[0]) for m in meta)


_META_TENSORS: dict = {}


def _meta_tensor(meta_rows, device):
    """The metadata rows as a float64 device tensor, cached (no host-to-device copy per call)."""
    key = (device, str(meta_rows))
    meta = _META_TENSORS.get(key)
    if meta is None:
        if len(_META_TENSORS) > 256:
            _META_TENSORS.clear()
        meta = _META_TENSORS[key] = torch.tensor(meta_rows, dtype=torch.float64, device=device)
    return meta


def _value_flags(target, temp, ignore_index, device):
    """[1, 5] float64: (a valid target < 0, largest valid target or -1, a temperature <= 0, 0, 0),
    on device (the host reads them with the layout)."""
    z = torch.zeros((), dtype=torch.float64, device=device)
    neg = tmax = bad_temp = z
    if target.numel():
        t = target.long()
        valid = t != ignore_index
        neg = (valid & (t < 0)).any().to(torch.float64)
        tmax = torch.where(valid, t, torch.full_like(t, -1)).amax().to(torch.float64)
    if temp is not None and temp.numel():
        bad_temp = (~(temp > 0)).any().to(torch.float64)
    return torch.stack([neg, tmax, bad_temp, z, z]).reshape(1, _NSTAT)


def _tp_layout(tp, meta_rows, validate, target, temp, ignore_index, device):
    """(global V, largest V_local) of the group's shard layout.

    With ``validate``, or the first time this rank sees its layout, all-gathers every rank's
    metadata rows (and, with ``validate``, the checks of its targets and temperatures) and
    checks them on the host (one device-to-host read): every rank raises the same error.
    Otherwise the cached layout, with no collective.
    """
    import torch.distributed as dist

    key = (id(tp.group), tp.rank, tp.size) + tuple(meta_rows[0][:4])
    known = _TP_LAYOUTS.get(key)
    if known is not None and not validate:
        return known
    rows = [_meta_tensor(meta_rows, device)]
    rows.append(_value_flags(target, temp, ignore_index, device) if validate
                else torch.zeros((1, _NSTAT), dtype=torch.float64, device=device))
    packed = torch.cat(rows)
    out = packed.new_empty((tp.size * packed.shape[0], packed.shape[1]))  # gloo takes the concatenated form
    dist.all_gather_into_tensor(out, packed, group=tp.group)
    vals = out.view(tp.size, -1).tolist()
    n = _META_ROWS * _NSTAT
    V_total, V_max = _tp_check_layout([v[:n] for v in vals])
    if validate:
        flags = [v[n:] for v in vals]
        if any(f[0] or f[1] >= V_total for f in flags):
            raise ValueError(f"linear_cross_entropy: `target` has values outside [0, {V_total}) (the global "
                             f"vocabulary of the tp_group) other than ignore_index={ignore_index}")
        if any(f[2] for f in flags):
            raise ValueError("linear_cross_entropy: `temperature` tensor has values <= 0")
    _TP_LAYOUTS[key] = (V_total, V_max)
    return V_total, V_max


def _stats_gather(stats, tp, async_op=False):
    """All-gather the partial statistics [rows, 5] of every rank: ([size, rows, 5], work or None)."""
    import torch.distributed as dist

    out = stats.new_empty((tp.size * stats.shape[0], stats.shape[1]))
    work = dist.all_gather_into_tensor(out, stats, group=tp.group, async_op=async_op)
    return out.view(tp.size, stats.shape[0], stats.shape[1]), work


def _dh_reduce_start(dh, group, fp32):
    """Start the async all-reduce (sum) of the dhidden partials; fp32 when asked."""
    import torch.distributed as dist

    buf = dh.float() if fp32 and dh.dtype != torch.float32 else dh
    return dist.all_reduce(buf, group=group, async_op=True), buf, dh


def _dh_reduce_finish(handle):
    work, buf, dh = handle
    work.wait()
    if buf is not dh:
        dh.copy_(buf)
    return dh


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


@torch.compiler.disable
def _tp_apply(fn, *args):
    """The TP autograd functions run eagerly (torch.compile graph-breaks around them)."""
    return fn.apply(*args)


class _CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (the reference's dhidden)."""

    @staticmethod
    def forward(ctx, x, group, fp32):
        ctx.group, ctx.fp32 = group, fp32
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        return _dh_reduce_finish(_dh_reduce_start(g, ctx.group, ctx.fp32)), None, None


class _SeqGather(torch.autograd.Function):
    """Sequence parallel: all-gather this rank's token shard of hidden, target and per-token
    temperature in ONE collective (their bytes packed side by side per row, rows ordered by
    rank); backward reduce-scatters dhidden (summed over the group's vocabulary shards, each
    rank keeping its own token rows)."""

    @staticmethod
    def forward(ctx, h, t, temp, group, size, fp32):
        import torch.distributed as dist

        M, H = h.shape
        parts = [h.contiguous().view(torch.uint8).reshape(M, -1),
                 t.long().reshape(M, 1).contiguous().view(torch.uint8)]
        if temp is not None:
            parts.append(temp.contiguous().reshape(M, 1).view(torch.uint8))
        packed = torch.cat(parts, 1)
        out = packed.new_empty((size * M, packed.shape[1]))
        dist.all_gather_into_tensor(out, packed, group=group)
        nh = parts[0].shape[1]
        hf = out[:, :nh].contiguous().view(h.dtype)
        tf = out[:, nh:nh + 8].contiguous().view(torch.int64).reshape(-1)
        tempf = out[:, nh + 8:].contiguous().view(temp.dtype).reshape(-1) if temp is not None else tf.new_empty(0)
        ctx.group, ctx.fp32, ctx.shape = group, fp32, (M, H)
        ctx.mark_non_differentiable(tf, tempf)
        return hf, tf, tempf

    @staticmethod
    def backward(ctx, g, _gt, _gtemp):
        import torch.distributed as dist

        buf = g.float() if ctx.fp32 and g.dtype != torch.float32 else g.contiguous()
        out = buf.new_empty(ctx.shape)
        dist.reduce_scatter_tensor(out, buf, group=ctx.group)
        return out.to(g.dtype), None, None, None, None, None


def _sp_gather(h, t, temp, tp, fp32):
    hf, tf, tempf = _tp_apply(_SeqGather, h, t, temp, tp.group, tp.size, fp32)
    return hf, tf, (tempf if temp is not None else None)


class _SeqLocal(torch.autograd.Function):
    """Sequence parallel: this rank's rows of per-token outputs computed on the group's tokens;
    backward all-gathers the per-token upstream gradients (one collective for all outputs):
    every vocabulary shard's dweight needs the gradients of every token."""

    @staticmethod
    def forward(ctx, group, rank, size, *xs):
        ml = xs[0].shape[0] // size
        ctx.group, ctx.size = group, size
        return tuple(x[rank * ml:(rank + 1) * ml].clone() for x in xs)

    @staticmethod
    def backward(ctx, *gs):
        import torch.distributed as dist

        packed = torch.stack([g.to(gs[0].dtype) for g in gs], 1).contiguous()
        out = packed.new_empty((ctx.size * packed.shape[0], packed.shape[1]))
        dist.all_gather_into_tensor(out, packed, group=ctx.group)
        return (None, None, None) + tuple(out.unbind(1))


def _sp_local(tp, loss, lse, ent, reduction, return_entropy, return_lse):
    """Per-token outputs for this rank's token shard; a scalar loss stays over the group's tokens."""
    keys = [k for k, on in (("loss", reduction == "none"), ("ent", return_entropy), ("lse", return_lse)) if on]
    if not keys:
        return loss, lse, ent
    vals = dict(loss=loss, lse=lse, ent=ent)
    out = _tp_apply(_SeqLocal, tp.group, tp.rank, tp.size, *(vals[k] for k in keys))
    vals.update(zip(keys, out))
    return vals["loss"], vals["lse"], vals["ent"]
