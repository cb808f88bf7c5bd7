"""The public entry point :func:`linear_cross_entropy`: checks, then dispatch.

After :func:`.checks._prepare`, the call goes to the torch reference (:mod:`.reference`) where
the kernels cannot run (device, dtype, no tokens), else to the tensor-parallel autograd
functions (:mod:`.parallel`) with a ``tp_group`` of more than one rank, else to the
single-GPU custom ops and autograd function (:mod:`.single`).
"""
import torch

from .._common import kernel_device_ok, warn_fallback
from .checks import _prepare
from .row_kernel import _KERNEL_DTYPES
from .group import _sp_gather, _sp_local, _tp_apply, _tp_layout, _tp_meta_rows
from .parallel import _TPConfig, _TPPerToken, _TPScalarLoss
from .reference import linear_cross_entropy_reference
from .single import _FusedScalarLoss, _lce_forward_op, _lce_fused_op
from .sizing import _chunk, _vocab_chunk
from .stats import _pack


_OP = "linear_cross_entropy"


def linear_cross_entropy(hidden, weight, target, *, bias=None, ignore_index=-100, reduction="mean", temperature=1.0,
                         return_entropy=False, return_lse=False, z_loss=0.0, label_smoothing=0.0, softcap=None,
                         accum_dtype=None, chunk_tokens=None, validate_targets=True, tp_group=None,
                         vocab_start=None, sequence_parallel=False):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target`` without materializing logits.

    Args:
        hidden: [..., H] float16/bfloat16/float32 (float64 runs the reference).
        weight: [V, H], same dtype and device as ``hidden``. bias: optional [V].
        target: integer tensor of shape hidden.shape[:-1]; ``ignore_index`` rows give loss 0
            and exactly zero loss gradient whatever the upstream gradient is (as eager's
            ``cross_entropy``, which writes zeros there): a "sum" over no labelled token divided by
            ``num_items_in_batch = 0`` (an infinite upstream gradient) gives a NaN loss and zero
            gradients, and a NaN or inf per-token upstream gradient on an ignored row counts as 0.
            Labelled rows take the upstream gradient as it is (inf/NaN propagate there).
        reduction: "mean" (over non-ignored tokens, on device; all ignored gives 0),
            "sum", or "none" (per-token fp32 losses shaped like ``target``).
        temperature: float > 0, or a tensor shaped like ``target`` (per token; treated as a
            constant, no gradient).
        return_entropy / return_lse: also return per-token fp32 entropy of softmax(logits) /
            logsumexp(logits), differentiable, computed for every token (ignored ones too).
        z_loss: adds ``z_loss * lse**2`` per token. label_smoothing: as torch's cross_entropy.
        softcap: logits -> softcap * tanh(logits / softcap) (after the temperature).
        accum_dtype: None (partial sums across chunks kept in the parameter's dtype: dweight
            over token chunks, dhidden over vocabulary chunks) or torch.float32 (fp32
            accumulator: more memory).
        chunk_tokens: tokens per chunk (None: the logits workspace stays <= 480 MiB, so all
            extra memory stays under 512 MiB; the per-token path then splits the vocabulary
            instead when there are fewer tokens than vocabulary rows; with ``softcap`` on fp16/bf16
            inputs the logits are fp32 and the automatic chunk is smaller, an explicit one not).
        validate_targets: check targets and temperatures: a device reduction started before
            the kernels and read after they are queued (one host wait, for the work queued
            before the call; a bad value raises ValueError then). False makes the call free of
            host synchronization (CUDA-graph capturable). With a ``tp_group`` the check runs
            with the layout exchange, before any other collective. Unchecked, a target outside
            ``[0, V)`` (V: the global vocabulary under a ``tp_group``) other than ``ignore_index``
            has no target logit, on every path alike (kernels, fused GEMMs, TP shards, the
            reference): its loss is ``lse`` (plus the ``z_loss`` and label-smoothing terms), its
            gradient that loss's, and it counts in the "mean"; no memory outside the vocabulary
            is read.
        tp_group: a torch.distributed process group over which the vocabulary is split
            (Megatron-style vocab-parallel head): ``weight``/``bias`` hold this rank's rows
            ``[vocab_start, vocab_start + V_local)`` and ``target`` holds global ids, the same
            ``hidden``/``target`` on every rank. Outputs are those of the full head, identical
            on every rank; dweight stays local, dhidden is summed over the group. Forward
            issues one small all-gather of the shard layout and options (with
            ``validate_targets``, or the first call of a layout) and one all-gather of the
            per-token statistics per token chunk; backward one all-reduce (of dhidden). The
            chunk is sized on the largest shard and is the same on every rank; with an
            explicit ``chunk_tokens`` the scalar-loss path keeps two ``chunk x V_local``
            workspaces. A group of size 1 (or None) is the single-GPU op.
        vocab_start: first global vocabulary row of this rank's shard (default
            ``rank * V_local``: equal shards); give it for ragged shards. Only with ``tp_group``.
        sequence_parallel: only with a ``tp_group`` of more than one rank: ``hidden``,
            ``target`` (and a per-token ``temperature``) are this rank's contiguous token shard
            of the group's tokens (flattened rows ordered by rank, Megatron-style), equal in
            size on every rank. The op all-gathers them (one more all-gather in forward),
            returns per-token outputs for the local shard ("mean"/"sum": the scalar over all
            the group's tokens, identical on every rank) and reduce-scatters dhidden instead
            of the all-reduce. Per-token outputs all-gather their upstream gradients in backward.

    Returns:
        ``loss`` alone, or the tuple ``(loss, entropy, lse)`` restricted to what was asked,
        in that order (e.g. ``(loss, lse)`` with only ``return_lse``).

    Note: the scalar-loss path ("mean"/"sum" without entropy/lse) forms the gradients in the
    forward and scales them in place in backward: do not backward through it twice.
    """
    accum_fp32, h, t, temp, tp, check = _prepare(hidden, weight, target, bias, ignore_index, reduction, temperature,
                                                 z_loss, label_smoothing, softcap, accum_dtype, chunk_tokens,
                                                 validate_targets, tp_group, vocab_start, sequence_parallel, defer=True)
    M = h.shape[0]
    V = weight.shape[0]
    ok, reason = kernel_device_ok(hidden)
    if ok and hidden.dtype not in _KERNEL_DTYPES:
        ok, reason = False, f"dtype {hidden.dtype} (kernels take float16/bfloat16/float32)"
    if not ok or M == 0:
        if M:
            warn_fallback(_OP, reason)
        _finish(check)  # the reference computes eagerly: check first
        return linear_cross_entropy_reference(
            hidden, weight, target, bias=bias, ignore_index=ignore_index, reduction=reduction,
            temperature=temperature, return_entropy=return_entropy, return_lse=return_lse, z_loss=z_loss,
            label_smoothing=label_smoothing, softcap=softcap, chunk_tokens=chunk_tokens,
            accum_dtype=torch.float32 if accum_fp32 else None,
            # TP: the targets are checked against the global vocabulary after the gather
            validate_targets=validate_targets and tp is not None,
            tp_group=None if tp is None else tp.group, vocab_start=None if tp is None else tp.start,
            sequence_parallel=sequence_parallel)
    h = h.contiguous()
    if t.dtype not in (torch.int32, torch.int64):
        t = t.long()
    t = t.contiguous()
    if temp is not None:
        temp = temp.detach().float().contiguous()
    inv_temp = 1.0 if temp is not None else 1.0 / float(temperature)
    cap = float(softcap) if softcap else 0.0
    z_loss, smoothing = float(z_loss), float(label_smoothing)
    need_dh = h.requires_grad
    need_dw = weight.requires_grad
    need_db = bias is not None and bias.requires_grad
    grads = torch.is_grad_enabled() and (need_dh or need_dw or need_db)
    if tp is not None:
        meta = _tp_meta_rows(tp, weight, h, reduction, temp, temperature, ignore_index, z_loss, smoothing, softcap,
                             return_entropy, return_lse, bias, accum_fp32, chunk_tokens)
        # the layout (and the checks) before any other collective: a bad call raises on every rank
        V_total, V_max = _tp_layout(tp, meta, bool(validate_targets), t, temp, ignore_index, h.device)
        if sequence_parallel:
            h, t, temp = _sp_gather(h, t, temp, tp, accum_fp32)
            M = h.shape[0]
        fused = grads and reduction != "none" and not (return_entropy or return_lse)
        chunk = _chunk(chunk_tokens, V_max, hidden.dtype, M, fused, cap, grads)
        cfg = _TPConfig(tp, V_total, inv_temp, ignore_index, z_loss, smoothing, cap, accum_fp32, chunk,
                        reduction == "mean", bool(return_entropy), sequence_parallel)
        if fused:
            return _tp_apply(_TPScalarLoss, h, weight, bias, t, temp, cfg)
        loss, lse, ent = _tp_apply(_TPPerToken, h, weight, bias, t, temp, cfg)
        if sequence_parallel:
            loss, lse, ent = _sp_local(tp, loss, lse, ent, reduction, return_entropy, return_lse)
        return _pack(loss, lse, ent, t != ignore_index, target.shape, reduction, return_entropy, return_lse)
    chunk = _chunk(chunk_tokens, V, hidden.dtype, M, False, cap, grads)
    if grads and reduction != "none" and not (return_entropy or return_lse):
        args = (h, weight, t, bias, temp, inv_temp, ignore_index, reduction == "mean", z_loss, smoothing, cap,
                accum_fp32, chunk, need_dh, need_dw, need_db)
        if torch.compiler.is_compiling():
            return _finish(check, _lce_fused_op(*args)[0])
        return _finish(check, _FusedScalarLoss.apply(*args))
    vchunk = _vocab_chunk(chunk_tokens, chunk, V, hidden.dtype, M, cap, grads)
    loss, lse, ent = _lce_forward_op(h, weight, t, bias, temp, inv_temp, ignore_index, z_loss, smoothing, cap,
                                     accum_fp32, chunk, vchunk, bool(return_entropy))
    _finish(check)  # the targets were checked on the device while the kernels were queued
    return _pack(loss, lse, ent, t != ignore_index, target.shape, reduction, return_entropy, return_lse)


def _finish(check, out=None):
    """Read a deferred target check (raises ValueError on a bad target or temperature); ``out``."""
    if check is not None:
        check.finish()
    return out
