"""Vocabulary-parallel form over a tensor-parallel group, and sequence parallelism.

Each rank holds weight rows [vocab_start, vocab_start + V_local). Forward: the local shard's
per-token partial statistics (the same fused pass as the single-GPU op, :mod:`.single`), then
ONE all-gather of a packed fp32 tensor [M + 3, 5]: the statistics plus three rows of metadata
(shard bounds, dtype, options) so the layout is validated by the same collective, then a local
merge (:func:`.stats.merge_partial_stats`): every rank computes bitwise the same loss / lse /
entropy. Backward: dweight (and dbias) stay local, dhidden partials are summed with one
all-reduce, started asynchronously so it overlaps the last dweight GEMM (on CUDA NCCL runs it
on its own stream). Sequence parallelism (:class:`_SeqGather`, :class:`_SeqLocal`) all-gathers
the token shards first and reduce-scatters dhidden instead.

The torch reference over a group (:mod:`.reference`) uses the same packing, exchange and
collectives; :func:`_tp_setup` is called by the argument checks (:mod:`.checks`).
"""
import torch

from .kernels import _launch_rows
from .single import _ParamGrads, _kw, _logits_into
from .stats import _NSTAT, _finalize_stats, merge_partial_stats


_DTYPE_CODE = {torch.float16: 1, torch.bfloat16: 2, torch.float32: 3, torch.float64: 4}
_CODE_DTYPE = {v: k for k, v in _DTYPE_CODE.items()}
_REDUCTION_CODE = {"none": 0, "sum": 1, "mean": 2}
_META_ROWS = 3
_META_NAMES = ("V_local", "vocab_start", "dtype", "hidden size", "tokens",
               "z_loss", "label_smoothing", "softcap", "temperature", "ignore_index",
               "return_entropy", "reduction", "bias", "accum_dtype", "return_lse")
# Shard layouts already validated on the host: (group id, rank, size, V_local, vocab_start, dtype,
# H) -> global V. With validate_targets=False later calls read nothing back (no host sync).
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
                  return_entropy, return_lse, bias, accum_fp32):
    """This rank's metadata rows [3, 5] (exact in fp32), carried by the statistics all-gather."""
    return [[weight.shape[0], tp.start, _DTYPE_CODE[weight.dtype], weight.shape[1], h.shape[0]],
            [float(z_loss), float(smoothing), float(softcap or 0.0), -1.0 if temp is not None else float(temperature),
             ignore_index],
            [bool(return_entropy), _REDUCTION_CODE[reduction], bias is not None, bool(accum_fp32), bool(return_lse)]]


def _tp_check_layout(meta):
    """Host check of every rank's metadata rows (a list per rank); returns the global V."""
    def fmt(j):
        vals = [m[j] for m in meta]
        if j == 2:
            vals = [str(_CODE_DTYPE.get(int(v), v)).replace("torch.", "") for v in vals]
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
    return expect


_META_TENSORS: dict = {}


def _tp_pack(M, meta_rows, dtype, device, stats=None):
    """The all-gather's input [M + 3, 5]: statistics rows (written later by the kernel when
    ``stats`` is None) then the metadata rows, copied from a cached device tensor (no
    host-to-device copy per call, so nothing blocks CUDA-graph capture after the first)."""
    key = (device, dtype, str(meta_rows))
    meta = _META_TENSORS.get(key)
    if meta is None:
        if len(_META_TENSORS) > 256:
            _META_TENSORS.clear()
        meta = _META_TENSORS[key] = torch.tensor(meta_rows, dtype=dtype, device=device)
    if stats is not None:
        return torch.cat([stats, meta])
    packed = torch.empty((M + _META_ROWS, _NSTAT), dtype=dtype, device=device)
    packed[M:].copy_(meta)
    return packed


def _tp_exchange(packed, M, meta_rows, tp, validate, target, temp, ignore_index):
    """The forward's one collective: all-gather ``packed`` = [stats; metadata] ->
    ([size, M, 5] statistics of every shard, global V).

    The metadata is checked on the host when ``validate`` (together with the targets against
    the global V and per-token temperatures, one device-to-host read) or the first time this
    rank sees the layout; then the layout is cached and nothing is read back.
    """
    import torch.distributed as dist

    out = packed.new_empty((tp.size * packed.shape[0], packed.shape[1]))  # gloo takes the concatenated form
    dist.all_gather_into_tensor(out, packed, group=tp.group)
    out = out.view(tp.size, packed.shape[0], packed.shape[1])
    key = (id(tp.group), tp.rank, tp.size) + tuple(meta_rows[0][:4])
    V_total = _TP_LAYOUTS.get(key)
    if validate or V_total is None:
        meta = out[:, M:].reshape(tp.size, -1)
        extra = []
        if validate:
            vt = meta[:, 0].sum()
            bad_t = ((target != ignore_index) & ((target < 0) | (target >= vt))).any()
            bad_temp = (~(temp > 0).all()) if temp is not None else torch.zeros((), dtype=torch.bool,
                                                                                device=packed.device)
            extra = [bad_t.to(meta.dtype).reshape(1), bad_temp.to(meta.dtype).reshape(1)]
        vals = torch.cat([meta.reshape(-1)] + extra).tolist()
        n = meta.shape[1]
        V_total = _tp_check_layout([vals[r * n:(r + 1) * n] for r in range(tp.size)])
        if validate and vals[-2]:
            raise ValueError(f"linear_cross_entropy: `target` has values outside [0, {V_total}) (the global "
                             f"vocabulary of the tp_group) other than ignore_index={ignore_index}")
        if validate and vals[-1]:
            raise ValueError("linear_cross_entropy: `temperature` tensor has values <= 0")
        _TP_LAYOUTS[key] = V_total
    return out[:, :M], V_total


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
    __slots__ = ("tp", "meta", "inv_temp", "ignore_index", "z_loss", "smoothing", "cap", "accum_fp32", "chunk",
                 "validate", "mean", "need_ent", "sp")

    def __init__(self, *args):
        for k, v in zip(self.__slots__, args, strict=True):
            setattr(self, k, v)


def _tp_stats_pass(h, weight, bias, t, temp, c):
    """Local shard statistics, written into the all-gather's packed input [M + 3, 5]; returns
    it and the logits workspace (the last chunk's logits are still in it)."""
    M, V = h.shape[0], weight.shape[0]
    packed = _tp_pack(M, c.meta, torch.float32, h.device)
    stats = packed[:M]
    buf = h.new_empty((min(c.chunk, M), V))
    for s in range(0, M, c.chunk):
        e = min(M, s + c.chunk)
        x = buf[: e - s]
        _logits_into(h[s:e], weight, bias, x)
        _launch_rows(x, t[s:e], stats=stats[s:e], need_ent=c.need_ent, vocab_start=c.tp.start,
                     **_kw(None if temp is None else temp[s:e], c.inv_temp, c.ignore_index, 0.0, c.smoothing, c.cap))
    return packed, buf


def _tp_grad_pass(h, weight, bias, t, temp, c, V_total, buf, need_dh, need_dw, need_db, *, lse, g_loss,
                  per_token, ent=None, g_ent=None, g_lse=None, reuse_last=False, reduce_dh=True):
    """dlogits chunk by chunk (recomputing the logits; with ``reuse_last`` the last chunk's are
    still in ``buf`` and go first), local dweight/dbias and the dhidden partials. With
    ``reduce_dh`` the dhidden all-reduce starts before the last dweight GEMM, which it
    overlaps. Returns (dh, reduce handle or None, dw, db)."""
    M = h.shape[0]
    dh = torch.empty_like(h) if need_dh else None
    pg = _ParamGrads(weight, bias, c.accum_fp32, need_dw, need_db)
    bounds = [(s, min(M, s + c.chunk)) for s in range(0, M, c.chunk)]
    order = bounds[::-1] if reuse_last else bounds
    handle = None
    for i, (s, e) in enumerate(order):
        x, hc = buf[: e - s], h[s:e]
        if not (reuse_last and i == 0):
            _logits_into(hc, weight, bias, x)
        _launch_rows(x, t[s:e], lse=lse[s:e], ent=None if g_ent is None else ent[s:e],
                     g_loss=g_loss[s:e] if per_token else g_loss, g_ent=None if g_ent is None else g_ent[s:e],
                     g_lse=None if g_lse is None else g_lse[s:e], per_token=per_token, vocab_start=c.tp.start,
                     vocab_total=V_total,
                     **_kw(None if temp is None else temp[s:e], c.inv_temp, c.ignore_index, c.z_loss, c.smoothing,
                           c.cap))
        if need_dh:
            torch.mm(x, weight, out=dh[s:e])
            if reduce_dh and i == len(order) - 1:
                handle = _dh_reduce_start(dh, c.tp.group, c.accum_fp32)
        pg.add(x, hc)
    dw, db = pg.result(h)
    return dh, handle, dw, db


class _TPScalarLoss(torch.autograd.Function):
    """Scalar loss ("mean"/"sum") with the local gradients formed in the forward: stats pass,
    gather + merge, gradient pass (the last chunk reuses its logits: with one chunk, 3 GEMMs in
    all). Backward scales them by grad_output and all-reduces dhidden (the forward's only
    collective stays the gather)."""

    @staticmethod
    def forward(ctx, h, weight, bias, t, temp, c):
        need_dh, need_dw, need_db = ctx.needs_input_grad[:3]
        packed, buf = _tp_stats_pass(h, weight, bias, t, temp, c)
        gathered, V_total = _tp_exchange(packed, h.shape[0], c.meta, c.tp, c.validate, t, temp,
                                          c.ignore_index)
        valid = t != c.ignore_index
        loss_tok, lse, _ = _finalize_stats(merge_partial_stats(gathered), valid, V_total, c.z_loss, c.smoothing,
                                           False)
        if c.mean:
            w = 1.0 / valid.sum().clamp(min=1).to(torch.float32)
        else:
            w = torch.ones((), dtype=torch.float32, device=h.device)
        dh, _, dw, db = _tp_grad_pass(h, weight, bias, t, temp, c, V_total, buf, need_dh, need_dw, need_db,
                                      lse=lse, g_loss=w.reshape(1), per_token=False, reuse_last=True,
                                      reduce_dh=False)
        del buf
        ctx.group, ctx.fp32, ctx.sp = c.tp.group, c.accum_fp32, c.sp
        ctx.needs = (need_dh, need_dw, need_db)
        ctx.grads = [dh, dw if need_dw else None, db if need_db else None]  # released in backward (no copy)
        return loss_tok.sum() * w

    @staticmethod
    def backward(ctx, g):
        # in place, as the single-GPU op; usable once
        if ctx.grads is None:
            raise RuntimeError("deepspeed_fused.linear_cross_entropy: the scalar-loss path can be backpropagated once")
        dh, dw, db = ctx.grads
        ctx.grads = None
        need_dh, need_dw, need_db = ctx.needs
        if need_dh:
            dh.mul_(g)
        # sequence parallel: dhidden [tokens of the group, H] is reduce-scattered by _SeqGather
        handle = _dh_reduce_start(dh, ctx.group, ctx.fp32) if need_dh and not ctx.sp else None
        dw = dw.mul_(g) if need_dw else None
        db = db.mul_(g) if need_db else None
        return (_dh_reduce_finish(handle) if handle is not None else dh), dw, db, None, None, None


class _TPPerToken(torch.autograd.Function):
    """Per-token (loss, lse, entropy): stats pass + gather + merge in forward; backward
    recomputes the local logits (4 GEMMs) from per-token upstream gradients."""

    @staticmethod
    def forward(ctx, h, weight, bias, t, temp, c):
        packed, buf = _tp_stats_pass(h, weight, bias, t, temp, c)
        del buf
        gathered, V_total = _tp_exchange(packed, h.shape[0], c.meta, c.tp, c.validate, t, temp,
                                          c.ignore_index)
        loss, lse, ent = _finalize_stats(merge_partial_stats(gathered), t != c.ignore_index, V_total, c.z_loss,
                                         c.smoothing, c.need_ent)
        if ent is None:
            ent = lse.new_empty(0)
        ctx.c, ctx.V_total = c, V_total
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
        buf = h.new_empty((min(c.chunk, M), weight.shape[0]))
        dh, handle, dw, db = _tp_grad_pass(h, weight, bias, t, temp, c, ctx.V_total, buf, need_dh, need_dw,
                                           need_db, lse=lse, g_loss=g_loss.contiguous(), per_token=True, ent=ent,
                                           g_ent=g_ent, g_lse=g_lse, reduce_dh=not c.sp)
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
