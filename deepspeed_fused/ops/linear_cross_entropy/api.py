"""The public entry point :func:`linear_cross_entropy`: checks, then dispatch.

:func:`.checks.prepare` checks the arguments and builds the call's one
:class:`.options.LCEOptions`; then the call goes to the torch reference
(:func:`.reference.run_reference`, on the rows already checked) where the kernels cannot run
(device, dtype, no tokens), else to the tensor-parallel form (:func:`.parallel.run_tp`) with a
``tp_group`` of more than one rank, else to the single-GPU op (:func:`.single.run_single`).
"""
import torch

from .._common import kernel_device_ok, warn_fallback
from .checks import prepare
from .parallel import run_tp
from .reference import run_reference
from .kernels.row import _KERNEL_DTYPES
from .single import run_single


_OP = "linear_cross_entropy"


def linear_cross_entropy(hidden, weight, target, *, bias=None, ignore_index=-100, reduction="mean", temperature=1.0,
                         return_entropy=False, return_lse=False, z_loss=0.0, label_smoothing=0.0, softcap=None,
                         accum_dtype=None, chunk_tokens=None, validate_targets=True, tp_group=None,
                         vocab_start=None, sequence_parallel=False, return_mean_logits=False, return_is_top1=False,
                         return_log_sum_sq=False, expect_uniform_grad=False, uniform_grad_callback=None):
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
        return_mean_logits / return_is_top1 / return_log_sum_sq: also return, per token and
            without gradient, computed in the same pass as the loss statistics (the row kernel
            or the fused GEMM's epilogue; one device only, not with a ``tp_group``):
            ``mean_logits`` (fp32 mean over the vocabulary of the transformed logits z),
            ``is_top1`` (bool: ``z.argmax(-1) == target``, torch's first index on ties and a NaN's
            index on a row with NaN; False for ignored targets) and ``log_sum_sq_probs`` (fp32
            ``logsumexp(2z) - 2 logsumexp(z)``). Asking for any makes the call take the per-token path.
        expect_uniform_grad: with ``reduction="none"`` on one device: form the gradients in the
            forward as the scalar loss does (3 GEMMs instead of the per-token path's 4), for an
            upstream gradient of the per-token losses that is the same on every labelled row (a sum
            or mean of them, as SFT's loss), entropy and lse without gradient. The outputs are the
            per-token path's. Backward checks that assumption and is exact either way: the
            forward-formed gradients are scaled in place (dhidden row by row by each row's gradient,
            dweight/dbias by the common value) where it holds, else dropped and the per-token
            backward recomputes the logits (one GEMM more). The check reads one flag on the host (a
            device sync) when dweight/dbias are needed or the entropy/lse has an upstream gradient
            (which must be zero); with dhidden alone (a frozen head) the per-row scaling is exact
            for any per-token weights and nothing is read. A non-finite upstream gradient on a
            labelled row propagates (with dweight/dbias needed: through the recomputation). One
            backward only (a second raises, as on the scalar-loss path); ignored under
            torch.compile, without gradients and where the reference runs (the per-token path
            then). Memory: dhidden and dweight live from the forward to the backward. Not with a
            ``tp_group`` of more than one rank.
        uniform_grad_callback: with ``expect_uniform_grad``: called in backward with True when the
            forward-formed gradients were used, False when the backward recomputed (so that a
            caller can stop asking for the mode).

    Returns:
        ``loss`` alone, or the tuple ``(loss, entropy, lse, mean_logits, is_top1,
        log_sum_sq_probs)`` restricted to what was asked, in that order (e.g. ``(loss, lse)``
        with only ``return_lse``).

    Note: the scalar-loss path ("mean"/"sum" without entropy/lse) forms the gradients in the
    forward and scales them in place in backward: do not backward through it twice.
    """
    opts, h, t, temp, check = prepare(
        hidden, weight, target, bias=bias, ignore_index=ignore_index, reduction=reduction, temperature=temperature,
        return_entropy=return_entropy, return_lse=return_lse, z_loss=z_loss, label_smoothing=label_smoothing,
        softcap=softcap, accum_dtype=accum_dtype, chunk_tokens=chunk_tokens, validate_targets=validate_targets,
        tp_group=tp_group, vocab_start=vocab_start, sequence_parallel=sequence_parallel,
        return_mean_logits=return_mean_logits, return_is_top1=return_is_top1, return_log_sum_sq=return_log_sum_sq,
        expect_uniform_grad=expect_uniform_grad, uniform_grad_callback=uniform_grad_callback, defer=True)
    M = h.shape[0]
    ok, reason = kernel_device_ok(hidden)
    if ok and hidden.dtype not in _KERNEL_DTYPES:
        ok, reason = False, f"dtype {hidden.dtype} (kernels take float16/bfloat16/float32)"
    if not ok or M == 0:
        if M:
            warn_fallback(_OP, reason)
        if check is not None:
            check.finish()  # the reference computes eagerly: check first
        # TP: the targets are checked against the global vocabulary by the layout exchange
        return run_reference(h, weight, bias, t, temp, opts, target.shape)
    h = h.contiguous()
    if t.dtype not in (torch.int32, torch.int64):
        t = t.long()
    t = t.contiguous()
    if temp is not None:
        temp = temp.detach().float().contiguous()
    if opts.tp is not None:
        return run_tp(h, weight, bias, t, temp, opts, target.shape)
    return run_single(h, weight, bias, t, temp, opts, target.shape, check)
