"""Per-token partial statistics: merge over vocabulary shards, finalize, pack the outputs.

The row kernel (:mod:`.kernels.row`) emits per-token *partial statistics* [tokens, 5]: running max
``m``, ``d = sum exp(z-m)``, ``a = sum exp(z-m)(z-m)``, ``sum z`` and the target logit if the
target falls in the ``[vocab_start, vocab_start + V)`` shard. :func:`_finalize_stats` turns
them into loss, lse and entropy. :func:`merge_partial_stats` combines the statistics of
vocabulary shards: this is where a tensor-parallel group plugs in (:mod:`.parallel`: an
all-gather of the statistics per token chunk). :func:`_pack` applies the reduction and builds the
returned value, for the kernel path and the torch reference (:mod:`.reference`) alike.

The forward-only *extras* (asked for by the mask ``LCEOptions.extras`` of ``EXTRA_MEAN``,
``EXTRA_TOP1``, ``EXTRA_SQ``; no gradient) come from the same pass: ``mean_logits`` from the
sum of z, ``is_top1`` from ``[tokens, 3]`` extra statistics (the largest logit, NaN if the row has
a NaN, and its first index in the whole vocabulary as int32 bits: ``torch.argmax``'s choice) and
``log_sum_sq_probs`` = ``logsumexp(2z) - 2 lse`` from ``q = sum exp(2(z-m))`` (column 2, with the
same running max ``m``). :func:`merge_partial_extras` merges them over vocabulary shards,
:func:`_finalize_extras` turns them into the fields.
Plain torch; no Triton.
"""
import torch


_NSTAT = 5  # m, d, a, sum z, target z
EXTRA_MEAN, EXTRA_TOP1, EXTRA_SQ = 1, 2, 4  # the forward-only fields (LCEOptions.extras)
EXTRA_NAMES = ((EXTRA_MEAN, "mean_logits"), (EXTRA_TOP1, "is_top1"), (EXTRA_SQ, "log_sum_sq_probs"))


def merge_partial_extras(stats: torch.Tensor, xt: torch.Tensor) -> torch.Tensor:
    """Combine per-shard extra statistics ``xt`` [shards, tokens, 3] (with the shards' statistics
    ``stats`` [shards, tokens, 5], for their maxima) into ``[tokens, 3]``: the first index of the
    largest value over all shards (a NaN before everything; on ties the smallest index, whatever
    the shards' order) and ``q`` rescaled to the merged max."""
    v, q = xt[..., 0], xt[..., 2]
    idx = xt[..., 1].contiguous().view(torch.int32)
    nan = torch.isnan(v)
    any_nan = nan.any(0)
    key = torch.where(nan, torch.full_like(v, float("inf")), v)
    cand = (key == key.amax(0)) & (nan == any_nan)
    big = torch.full_like(idx, torch.iinfo(torch.int32).max)
    best_i = torch.where(cand, idx, big).amin(0)
    best_v = torch.where(any_nan, torch.full_like(v[0], float("nan")), key.amax(0))
    m_r = stats[..., 0]
    m = m_r.amax(0)
    scale = torch.where(m_r == m, torch.ones_like(m_r), torch.exp(m_r - m))  # as merge_partial_stats
    out = torch.empty(xt.shape[1:], dtype=torch.float32, device=xt.device)
    out[:, 0] = best_v
    out[:, 1] = best_i.view(torch.float32)
    out[:, 2] = (q * scale * scale).sum(0)
    return out


def _finalize_extras(stats, xt, target, valid, vocab_total, extras):
    """The forward-only fields ``{name: tensor}`` (fp32 per token; ``is_top1`` bool) from the
    full-vocabulary statistics ``stats`` [M, 5] and extra statistics ``xt`` [M, 3]. ``is_top1`` is
    False on rows whose target is ignored."""
    out = {}
    if extras & EXTRA_MEAN:
        out["mean_logits"] = stats[:, 3] / vocab_total
    if extras & EXTRA_TOP1:
        idx = xt[:, 1].contiguous().view(torch.int32)
        out["is_top1"] = valid & (idx.to(target.dtype) == target)
    if extras & EXTRA_SQ:
        sq = torch.log(xt[:, 2]) - 2.0 * torch.log(stats[:, 1])
        # a +inf logit: eager's logsumexp(2z) - 2 logsumexp(z) is inf - inf
        out["log_sum_sq_probs"] = torch.where(stats[:, 0] == float("inf"), torch.full_like(sq, float("nan")), sq)
    return out


def merge_partial_stats(stats: torch.Tensor) -> torch.Tensor:
    """Combine per-shard statistics ``[shards, tokens, 5]`` into ``[tokens, 5]``.

    Each shard holds (m, d = sum exp(z-m), a = sum exp(z-m)(z-m), sum z, target z or 0) over
    its slice of the vocabulary; the result is the same statistics over the whole of it.
    """
    m_r, d_r, a_r, sz_r, zt_r = stats.unbind(-1)
    m = m_r.amax(0)
    same = m_r == m  # 1 and 0 there (an infinite max: torch.logsumexp's +inf, not inf - inf)
    scale = torch.where(same, torch.ones_like(m_r), torch.exp(m_r - m))
    d = (d_r * scale).sum(0)
    a = (scale * (a_r + torch.where(same, torch.zeros_like(m_r), m_r - m) * d_r)).sum(0)
    return torch.stack([m, d, a, sz_r.sum(0), zt_r.sum(0)], dim=-1)


def _finalize_stats(stats, valid, vocab_total, z_loss, smoothing, need_ent):
    """Per-token (loss, lse, entropy-or-None) in fp32 from full-vocabulary statistics."""
    m, d, a, sz, zt = stats.unbind(-1)
    logd = torch.log(d)
    lse = m + logd
    loss = lse - (1.0 - smoothing) * zt
    if smoothing:
        loss = loss - (smoothing / vocab_total) * sz
    if z_loss:
        loss = loss + z_loss * lse * lse
    # a +inf logit: lse is +inf (torch.logsumexp's), the loss NaN (cross_entropy's log_softmax)
    loss = torch.where(m == float("inf"), torch.full_like(loss, float("nan")), loss)
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    ent = logd - a / d if need_ent else None
    return loss, lse, ent


def _pack(loss_tok, lse, ent, valid, shape, opts, extra=None):
    """The returned value from per-token outputs: the reduction of ``opts`` (an
    :class:`.options.LCEOptions`) applied, then ``(loss, entropy, lse, mean_logits, is_top1,
    log_sum_sq_probs)`` restricted to what it asks for (or the loss alone), shaped like the target
    (``shape``); ``extra``: the asked forward-only fields by name (:func:`_finalize_extras`)."""
    if opts.reduction == "none":
        loss = loss_tok.reshape(shape)
    else:
        loss = loss_tok.sum()
        if opts.mean:
            loss = loss / valid.sum().clamp(min=1).to(loss.dtype)
    if not (opts.return_entropy or opts.return_lse or opts.extras):
        return loss
    out = [loss]
    if opts.return_entropy:
        out.append(ent.reshape(shape))
    if opts.return_lse:
        out.append(lse.reshape(shape))
    for bit, name in EXTRA_NAMES:
        if opts.extras & bit:
            out.append(extra[name].reshape(shape))
    return tuple(out)
