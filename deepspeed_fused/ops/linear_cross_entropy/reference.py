"""The plain torch reference of the linear cross-entropy.

:func:`linear_cross_entropy_reference` has the API and semantics of the fused op: chunked
over tokens (each chunk checkpointed when gradients are on), math in fp32 (float64 for float64
inputs), autograd does the gradients. Over a tensor-parallel group it computes the kernel's
partial statistics in torch and exchanges them with the group's collectives (:mod:`.group`,
the same as the kernels' TP form). The fused op (:mod:`.api`) falls back to it where the kernels
cannot run: :func:`run_reference` on the inputs the op has already checked. Its token chunks
are sized by :func:`.sizing._reference_chunk`.
"""
import torch

from .checks import prepare
from .group import CopyToGroup, sp_gather, sp_local, stats_gather, tp_layout, tp_meta_rows
from .sizing import _reference_chunk
from .stats import EXTRA_NAMES, _finalize_stats, _pack, merge_partial_stats


def linear_cross_entropy_reference(hidden, weight, target, *, bias=None, ignore_index=-100, reduction="mean",
                                   temperature=1.0, return_entropy=False, return_lse=False, z_loss=0.0,
                                   label_smoothing=0.0, softcap=None, accum_dtype=None, chunk_tokens=None,
                                   validate_targets=True, tp_group=None, vocab_start=None, sequence_parallel=False,
                                   return_mean_logits=False, return_is_top1=False, return_log_sum_sq=False,
                                   expect_uniform_grad=False, uniform_grad_callback=None):
    """Plain torch version of :func:`.api.linear_cross_entropy` (same API and semantics).

    Chunked over tokens (each chunk checkpointed when gradients are on), math in fp32
    (float64 for float64 inputs); autograd does the gradients. ``accum_dtype`` is ignored
    (except that, with a ``tp_group``, fp32 makes the dhidden all-reduce run in fp32);
    ``expect_uniform_grad`` is checked and ignored (autograd's gradients are exact for any upstream
    gradient; ``uniform_grad_callback`` is never called).
    With a ``tp_group`` it computes the same partial statistics of the local vocabulary
    shard as the kernels and combines them with an all-gather and the same merge
    (``sequence_parallel``: after the same all-gather of the token shards as the kernels), after
    the kernels' layout exchange and checks.
    """
    opts, h, t, temp, _ = prepare(
        hidden, weight, target, bias=bias, ignore_index=ignore_index, reduction=reduction, temperature=temperature,
        return_entropy=return_entropy, return_lse=return_lse, z_loss=z_loss, label_smoothing=label_smoothing,
        softcap=softcap, accum_dtype=accum_dtype, chunk_tokens=chunk_tokens, validate_targets=validate_targets,
        tp_group=tp_group, vocab_start=vocab_start, sequence_parallel=sequence_parallel,
        return_mean_logits=return_mean_logits, return_is_top1=return_is_top1, return_log_sum_sq=return_log_sum_sq,
        expect_uniform_grad=expect_uniform_grad, uniform_grad_callback=uniform_grad_callback)
    return run_reference(h, weight, bias, t, temp, opts, target.shape)


def run_reference(h, weight, bias, t, temp, opts, shape):
    """The reference on checked rows (from :func:`.checks.prepare`: ``h`` [M, H], ``t`` [M], ``temp``
    [M] or None, the call's :class:`.options.LCEOptions`; ``shape``: the target's). Over a group the
    layout exchange (and, with ``validate_targets``, the target checks against the global
    vocabulary) comes first; on one GPU the targets were checked by ``prepare``."""
    tp = opts.tp
    temp = None if temp is None else temp.detach()
    if tp is not None:
        V_total, _ = tp_layout(opts, tp_meta_rows(weight, h, bias, temp, opts), t, temp, h.device)
        if opts.sequence_parallel:
            h, t, temp = sp_gather(h, t, temp, tp, opts.loss.accum_fp32)
        chunk = _reference_chunk(opts.chunk_tokens, weight.shape[0], h.shape[0])
        loss_tok, lse, ent = _reference_tp(h, weight, bias, t, temp, opts, chunk, V_total)
        if opts.sequence_parallel:
            loss_tok, lse, ent = sp_local(opts, loss_tok, lse, ent)
    else:
        chunk = _reference_chunk(opts.chunk_tokens, weight.shape[0], h.shape[0])
        loss_tok, lse, ent = _reference_impl(h, weight, bias, t, temp, opts, chunk)
    extra = _reference_extras(h, weight, bias, t, temp, opts, chunk) if opts.extras else None
    return _pack(loss_tok, lse, ent, t != opts.loss.ignore_index, shape, opts, extra)


def _reference_extras(h, weight, bias, t, temp, opts, chunk):
    """The forward-only fields (no gradient) from the transformed logits in plain torch:
    ``z.mean(-1)``, ``z.argmax(-1) == t`` (False for ignored targets) and
    ``logsumexp(2z) - 2 logsumexp(z)``, fp32 (float64 for float64 inputs)."""
    names = [n for bit, n in EXTRA_NAMES if opts.extras & bit]
    outs = {n: [] for n in names}
    with torch.no_grad():
        for s in range(0, max(h.shape[0], 1), chunk):
            e = min(h.shape[0], s + chunk)
            z = _ref_logits(h[s:e], weight, bias, None if temp is None else temp[s:e], opts)
            if "mean_logits" in outs:
                outs["mean_logits"].append(z.mean(-1))
            if "is_top1" in outs:
                ts = t[s:e]
                outs["is_top1"].append((ts != opts.loss.ignore_index) & (z.argmax(-1) == ts))
            if "log_sum_sq_probs" in outs:
                outs["log_sum_sq_probs"].append(torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1))
    return {n: torch.cat(v) for n, v in outs.items()}


def _ref_logits(h, weight, bias, temp, opts):
    """The chunk's logits in FP32 (FP64 for FP64 inputs), divided by the temperature (per row or
    one value) and soft-capped: what every reference pass starts from."""
    softcap = opts.loss.softcap
    logits = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(cdt)
    z = z / temp.to(cdt)[:, None] if temp is not None else z / opts.temperature
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z


def _ref_chunk(h, weight, bias, t, temp, opts):
    loss_opts = opts.loss
    smoothing, z_loss = loss_opts.smoothing, loss_opts.z_loss
    z = _ref_logits(h, weight, bias, temp, opts)
    lse = torch.logsumexp(z, dim=-1)
    valid = t != loss_opts.ignore_index
    # a target outside [0, V) (unchecked with validate_targets=False) has no target logit: 0, as in the kernels
    has_zt = valid & (t >= 0) & (t < z.shape[1])
    # lse - (1 - eps) z_t - eps mean(z), written with log_softmax as eager's cross_entropy takes it
    # (a +inf logit: NaN loss and gradient over the row, where lse alone is +inf)
    logp = torch.log_softmax(z, dim=-1)
    lpt = logp.gather(1, torch.where(has_zt, t, torch.zeros_like(t)).long()[:, None]).squeeze(1)
    loss = torch.where(has_zt, -lpt, lse) * (1.0 - smoothing)
    if smoothing:
        loss = loss - smoothing * logp.mean(-1)
    if z_loss:
        loss = loss + z_loss * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if opts.return_entropy else lse.new_empty(0)
    return loss, lse, ent


def _reference_impl(h, weight, bias, t, temp, opts, chunk):
    M = h.shape[0]
    outs = []
    ckpt = torch.is_grad_enabled() and M > chunk and not torch.compiler.is_compiling()
    for s in range(0, max(M, 1), chunk):
        e = min(M, s + chunk)
        args = (h[s:e], weight, bias, t[s:e], None if temp is None else temp[s:e], opts)
        if ckpt:
            outs.append(torch.utils.checkpoint.checkpoint(_ref_chunk, *args, use_reentrant=False))
        else:
            outs.append(_ref_chunk(*args))
    loss, lse, ent = (torch.cat([o[i] for o in outs]) for i in range(3))
    return loss, lse, (ent if opts.return_entropy else None)


def _ref_partial_chunk(h, weight, bias, t, temp, opts):
    """Torch version of the kernel's partial statistics [rows, 5] for this rank's vocabulary shard.

    The running max m is detached: (m, d, a) represent the same values for any m, so the
    gradient is exact without flowing through the max."""
    z = _ref_logits(h, weight, bias, temp, opts)
    m = z.amax(-1).detach()
    zm = z - m[:, None]
    e = torch.exp(zm)
    d = e.sum(-1)
    a = (e * zm).sum(-1) if opts.return_entropy else torch.zeros_like(d)
    sz = z.sum(-1) if opts.loss.smoothing else torch.zeros_like(d)
    lt = t.long() - opts.tp.start
    ins = (t != opts.loss.ignore_index) & (lt >= 0) & (lt < z.shape[1])
    zt = z.gather(1, torch.where(ins, lt, torch.zeros_like(lt))[:, None]).squeeze(1)
    zt = torch.where(ins, zt, torch.zeros_like(zt))
    return torch.stack([m, d, a, sz, zt], dim=-1)


def _reference_tp(h, weight, bias, t, temp, opts, chunk, V_total):
    """Reference over a tensor-parallel group: local partial statistics (autograd), one
    all-gather of them (of all the tokens at once) and the kernels' merge; the other ranks'
    statistics are constants here, and dhidden is summed over the group by CopyToGroup (by
    _SeqGather's reduce-scatter under sequence parallelism, where ``h`` is already the group's
    gathered tokens)."""
    tp, loss = opts.tp, opts.loss
    M = h.shape[0]
    if h.requires_grad and not opts.sequence_parallel:
        h = CopyToGroup.apply(h, tp.group, loss.accum_fp32)
    ckpt = torch.is_grad_enabled() and M > chunk and not torch.compiler.is_compiling()
    parts = []
    for s in range(0, max(M, 1), chunk):
        e = min(M, s + chunk)
        args = (h[s:e], weight, bias, t[s:e], None if temp is None else temp[s:e], opts)
        if ckpt:
            parts.append(torch.utils.checkpoint.checkpoint(_ref_partial_chunk, *args, use_reentrant=False))
        else:
            parts.append(_ref_partial_chunk(*args))
    stats = torch.cat(parts)
    if M == 0:  # every rank has no tokens (the layout exchange checked the counts): nothing to gather
        gathered = stats.detach().unsqueeze(0).expand(tp.size, 0, stats.shape[1])
    else:
        gathered, _ = stats_gather(stats.detach().contiguous(), tp)
    shards = list(gathered.unbind(0))
    shards[tp.rank] = stats  # the local shard, differentiable (bitwise the gathered values)
    return _finalize_stats(merge_partial_stats(torch.stack(shards)), t != loss.ignore_index, V_total, loss.z_loss,
                           loss.smoothing, opts.return_entropy)
