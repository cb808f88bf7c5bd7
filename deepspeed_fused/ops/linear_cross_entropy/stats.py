"""Per-token partial statistics: merge over vocabulary shards, finalize, pack the outputs.

The row kernel (:mod:`.kernels.row`) emits per-token *partial statistics* [tokens, 5]: running max
``m``, ``d = sum exp(z-m)``, ``a = sum exp(z-m)(z-m)``, ``sum z`` and the target logit if the
target falls in the ``[vocab_start, vocab_start + V)`` shard. :func:`_finalize_stats` turns
them into loss, lse and entropy. :func:`merge_partial_stats` combines the statistics of
vocabulary shards: this is where a tensor-parallel group plugs in (:mod:`.parallel`: an
all-gather of the statistics per token chunk). :func:`_pack` applies the reduction and builds the
returned value, for the kernel path and the torch reference (:mod:`.reference`) alike.
Plain torch; no Triton.
"""
import torch


_NSTAT = 5  # m, d, a, sum z, target z


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


def _pack(loss_tok, lse, ent, valid, shape, opts):
    """The returned value from per-token outputs: the reduction of ``opts`` (an
    :class:`.options.LCEOptions`) applied, then ``(loss, entropy, lse)`` restricted to what it asks
    for (or the loss alone), shaped like the target (``shape``)."""
    if opts.reduction == "none":
        loss = loss_tok.reshape(shape)
    else:
        loss = loss_tok.sum()
        if opts.mean:
            loss = loss / valid.sum().clamp(min=1).to(loss.dtype)
    if not (opts.return_entropy or opts.return_lse):
        return loss
    out = [loss]
    if opts.return_entropy:
        out.append(ent.reshape(shape))
    if opts.return_lse:
        out.append(lse.reshape(shape))
    return tuple(out)
