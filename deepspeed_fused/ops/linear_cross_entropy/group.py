"""The tensor-parallel group of the linear cross-entropy, shared by the kernels' TP form
(:mod:`.parallel`) and the torch reference over a group (:mod:`.reference`).

* :func:`tp_setup`: the rank's :class:`TPInfo` (group, rank, size, shard start), or None for
  the single-GPU op (called by the argument checks, :mod:`.checks`).
* **Layout** (:func:`tp_layout`): one small all-gather of every rank's metadata rows (shard
  bounds, dtype, hidden size, token count, options, chunk size and, when validating, its
  targets' extremes and temperature flag), read on the host and checked together, so a bad
  call raises on every rank before any other collective. Issued when ``validate_targets`` or
  the first time a rank sees its shard layout; then the layout is cached and later calls with
  ``validate_targets=False`` issue none (no host sync).
* The collectives on data: the statistics all-gather (:func:`stats_gather`), the dhidden
  all-reduce (:func:`dh_reduce_start` / :func:`dh_reduce_finish`, :class:`CopyToGroup`),
  and sequence parallelism: the token shards all-gathered (:class:`_SeqGather`, backward a
  reduce-scatter of dhidden) and per-token outputs cut back to the local shard
  (:class:`_SeqLocal`, backward an all-gather of their upstream gradients).

The names without a leading underscore are what the other modules (and the TP benchmark) use;
the underscored ones are this module's own. Plain torch and torch.distributed; no Triton.
"""
import torch

from .stats import _NSTAT


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


class TPInfo:
    __slots__ = ("group", "rank", "size", "start")

    def __init__(self, group, rank, size, start):
        self.group, self.rank, self.size, self.start = group, rank, size, start


def tp_setup(tp_group, vocab_start, V_local):
    """None for the single-GPU op (no group, or a group of one rank), else the rank's TPInfo."""
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
    return TPInfo(tp_group, rank, size, rank * V_local if vocab_start is None else vocab_start)


def tp_meta_rows(weight, h, bias, temp, opts):
    """This rank's metadata rows [4, 5] (exact in float64), checked by the layout exchange: its
    shard and shapes, and the options of ``opts`` (an :class:`.options.LCEOptions`)."""
    loss = opts.loss
    return [[weight.shape[0], opts.tp.start, _DTYPE_CODE[weight.dtype], weight.shape[1], h.shape[0]],
            [loss.z_loss, loss.smoothing, loss.softcap, -1.0 if temp is not None else opts.temperature,
             loss.ignore_index],
            [opts.return_entropy, _REDUCTION_CODE[opts.reduction], bias is not None, loss.accum_fp32, opts.return_lse],
            [opts.chunk_tokens or 0, 0, 0, 0, 0]]


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


def tp_layout(opts, meta_rows, target, temp, device):
    """(global V, largest V_local) of the group's shard layout (``opts.tp``'s).

    With ``opts.validate_targets``, or the first time this rank sees its layout, all-gathers every rank's
    metadata rows (and, with ``validate``, the checks of its targets and temperatures) and
    checks them on the host (one device-to-host read): every rank raises the same error.
    Otherwise the cached layout, with no collective.
    """
    import torch.distributed as dist

    tp, validate, ignore_index = opts.tp, opts.validate_targets, opts.loss.ignore_index
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


def stats_gather(stats, tp, async_op=False):
    """All-gather the partial statistics [rows, 5] of every rank: ([size, rows, 5], work or None)."""
    import torch.distributed as dist

    out = stats.new_empty((tp.size * stats.shape[0], stats.shape[1]))
    work = dist.all_gather_into_tensor(out, stats, group=tp.group, async_op=async_op)
    return out.view(tp.size, stats.shape[0], stats.shape[1]), work


def dh_reduce_start(dh, group, fp32):
    """Start the async all-reduce (sum) of the dhidden partials; fp32 when asked."""
    import torch.distributed as dist

    buf = dh.float() if fp32 and dh.dtype != torch.float32 else dh
    return dist.all_reduce(buf, group=group, async_op=True), buf, dh


def dh_reduce_finish(handle):
    work, buf, dh = handle
    work.wait()
    if buf is not dh:
        dh.copy_(buf)
    return dh


@torch.compiler.disable
def tp_apply(fn, *args):
    """The TP autograd functions run eagerly (torch.compile graph-breaks around them)."""
    return fn.apply(*args)


class CopyToGroup(torch.autograd.Function):
    """Identity forward; backward sums the gradient over the group (the reference's dhidden)."""

    @staticmethod
    def forward(ctx, x, group, fp32):
        ctx.group, ctx.fp32 = group, fp32
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous().clone()
        return dh_reduce_finish(dh_reduce_start(g, ctx.group, ctx.fp32)), None, None


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


def sp_gather(h, t, temp, tp, fp32):
    hf, tf, tempf = tp_apply(_SeqGather, h, t, temp, tp.group, tp.size, fp32)
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


def sp_local(opts, loss, lse, ent):
    """Per-token outputs for this rank's token shard; a scalar loss stays over the group's tokens."""
    tp = opts.tp
    keys = [k for k, on in (("loss", opts.reduction == "none"), ("ent", opts.return_entropy),
                            ("lse", opts.return_lse)) if on]
    if not keys:
        return loss, lse, ent
    vals = dict(loss=loss, lse=lse, ent=ent)
    out = tp_apply(_SeqLocal, tp.group, tp.rank, tp.size, *(vals[k] for k in keys))
    vals.update(zip(keys, out))
    return vals["loss"], vals["lse"], vals["ent"]
