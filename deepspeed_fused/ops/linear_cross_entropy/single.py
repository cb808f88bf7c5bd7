"""Single-GPU fused linear cross-entropy: chunked cuBLAS GEMMs around the row kernel, the
``torch.library`` custom ops (``deepspeed_fused::lce_fused``, ``lce_forward``, ``lce_backward``)
and the eager autograd function.

The tokens are processed in chunks (:func:`_logit_chunks`): per chunk, cuBLAS writes the
chunk's logits into one reused workspace and the row kernel (:mod:`.kernels`) walks each row.
Two gradient strategies:

* **Scalar loss** (``reduction`` "mean"/"sum", no entropy/lse output) while gradients are
  needed: the same kernel makes a second pass over the row and overwrites the logits with
  ``dL/dlogits`` (or writes them to a second buffer when the logits are fp32, see
  :func:`fp32_logits`; already weighted by ``1/n_valid`` for "mean"); two more chunk GEMMs give
  ``dhidden`` and accumulate ``dweight``. Backward only multiplies these by ``grad_output``
  (:func:`_scale_formed_grads`: ignored rows stay exact zeros, whatever it is): 3 GEMMs in all.
* **Per-token upstream gradients** (reduction "none", entropy or lse returned): forward keeps
  per-token ``lse`` and entropy (fp32); backward recomputes the chunk logits and the kernel
  turns them in place (or into the second buffer) into ``dlogits`` from the per-token upstream
  gradients: 4 GEMMs. With ``vchunk`` > 0 this path runs over vocabulary chunks instead
  (:func:`_vocab_chunks`: all tokens against a slice of the vocabulary; partial statistics per
  slice merged by :func:`.stats.merge_partial_stats`; each slice's dweight rows from one GEMM,
  dhidden summed over the slices).

The chunk drivers (:func:`_logit_chunks`, :class:`_ChunkBuffers`, :func:`_logits_into`,
:func:`_dhidden_into`, :class:`_ParamGrads`, :func:`_kw`) are shared with the tensor-parallel
form (:mod:`.parallel`). The public entry point is in :mod:`.api`.
"""
from typing import Optional

import torch

from .chunks import (_backward_vocab_chunks, _dhidden_into, _fused_stats, _kw, _logit_chunks, _ParamGrads,
                     _scale_formed_grads, _vocab_chunks)
from .row_kernel import _launch_rows
from .stats import _NSTAT, _finalize_stats, merge_partial_stats


def _fused_impl(hidden, weight, target, bias, temp, inv_temp, ignore_index, mean, z_loss, smoothing,
                softcap, accum_fp32, chunk, need_dh, need_dw, need_db):
    """Scalar loss with its gradient formed in the forward (3 GEMMs)."""
    M = hidden.shape[0]
    V = weight.shape[0]
    valid = target != ignore_index
    if mean:
        w = 1.0 / valid.sum().clamp(min=1).to(torch.float32)
    else:
        w = torch.ones((), dtype=torch.float32, device=hidden.device)
    w1 = w.reshape(1)
    stats = torch.empty((M, _NSTAT), dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden) if need_dh else hidden.new_empty(0)
    pg = _ParamGrads(weight, bias, accum_fp32, need_dw, need_db)
    for s, e, x, g, h in _logit_chunks(hidden, weight, bias, chunk, softcap, True):
        _launch_rows(x, target[s:e], stats=stats[s:e], g_loss=w1, per_token=False, out=g,
                     **_kw(None if temp is None else temp[s:e], inv_temp, ignore_index, z_loss, smoothing, softcap))
        if need_dh:
            _dhidden_into(g, weight, dh[s:e])
        pg.add(g, h)
    loss_tok, _, _ = _finalize_stats(stats, valid, V, z_loss, smoothing, False)
    loss = loss_tok.sum() * w
    dw, db = pg.result(hidden)
    return loss, dh, dw, db


def _forward_impl(hidden, weight, target, bias, temp, inv_temp, ignore_index, z_loss, smoothing, softcap,
                  chunk, vchunk, need_ent):
    """Per-token (loss, lse, entropy) in fp32; one GEMM: the fused GEMM with the statistics in its
    epilogue where it runs (:func:`.kernels.gemm_stats`: Hopper, fp16/bf16), else cuBLAS and the
    row kernel over token chunks of ``chunk`` rows or, with ``vchunk`` > 0, vocabulary chunks of
    that many columns (partial statistics per chunk, merged)."""
    M = hidden.shape[0]
    V = weight.shape[0]
    stats = _fused_stats(hidden, weight, bias, target, temp, inv_temp, ignore_index, smoothing, softcap, need_ent)
    if stats is None and vchunk:
        n_v = -(-V // vchunk)
        parts = torch.empty((n_v, M, _NSTAT), dtype=torch.float32, device=hidden.device)
        kw = _kw(temp, inv_temp, ignore_index, z_loss, smoothing, softcap)
        for j, (v0, _, x, _) in enumerate(_vocab_chunks(hidden, weight, bias, vchunk, softcap, False)):
            _launch_rows(x, target, stats=parts[j], need_ent=need_ent, vocab_start=v0, vocab_total=V, **kw)
        stats = merge_partial_stats(parts) if n_v > 1 else parts[0]
    elif stats is None:
        stats = torch.empty((M, _NSTAT), dtype=torch.float32, device=hidden.device)
        for s, e, x, _, _ in _logit_chunks(hidden, weight, bias, chunk, softcap, False):
            _launch_rows(x, target[s:e], stats=stats[s:e], need_ent=need_ent,
                         **_kw(None if temp is None else temp[s:e], inv_temp, ignore_index, z_loss, smoothing,
                               softcap))
    valid = target != ignore_index
    loss, lse, ent = _finalize_stats(stats, valid, V, z_loss, smoothing, need_ent)
    return loss, lse, ent if need_ent else hidden.new_empty(0, dtype=torch.float32)


def _backward_impl(hidden, weight, target, bias, temp, lse, ent, g_loss, g_ent, g_lse, inv_temp, ignore_index,
                   z_loss, smoothing, softcap, accum_fp32, chunk, vchunk, need_dh, need_dw, need_db):
    """Recompute the chunk logits, turn them into dlogits from per-token upstream gradients."""
    M = hidden.shape[0]
    if g_loss is None:
        g_loss = torch.zeros(M, dtype=torch.float32, device=hidden.device)
    g_loss = g_loss.float().contiguous()
    g_ent = None if g_ent is None else g_ent.float().contiguous()
    g_lse = None if g_lse is None else g_lse.float().contiguous()
    if not vchunk and chunk >= M:
        vchunk = weight.shape[0]  # one chunk: the whole vocabulary as one slice (the same GEMMs)
    if vchunk:
        return _backward_vocab_chunks(hidden, weight, target, bias, temp, lse, ent, g_loss, g_ent, g_lse, inv_temp,
                                      ignore_index, z_loss, smoothing, softcap, accum_fp32, vchunk, need_dh,
                                      need_dw, need_db)
    dh = torch.empty_like(hidden) if need_dh else hidden.new_empty(0)
    pg = _ParamGrads(weight, bias, accum_fp32, need_dw, need_db)
    for s, e, x, g, h in _logit_chunks(hidden, weight, bias, chunk, softcap, True):
        _launch_rows(x, target[s:e], lse=lse[s:e], ent=None if g_ent is None else ent[s:e],
                     g_loss=g_loss[s:e], g_ent=None if g_ent is None else g_ent[s:e],
                     g_lse=None if g_lse is None else g_lse[s:e], per_token=True, out=g,
                     **_kw(None if temp is None else temp[s:e], inv_temp, ignore_index, z_loss, smoothing, softcap))
        if need_dh:
            _dhidden_into(g, weight, dh[s:e])
        pg.add(g, h)
    dw, db = pg.result(hidden)
    return dh, dw, db


# ----------------------------------------------------------------------------------------
# torch.library custom ops (opaque to torch.compile; no host sync inside)
# ----------------------------------------------------------------------------------------


T = torch.Tensor


@torch.library.custom_op("deepspeed_fused::lce_fused", mutates_args=())
def _lce_fused_op(hidden: T, weight: T, target: T, bias: Optional[T], temp: Optional[T], inv_temp: float,
                  ignore_index: int, mean: bool, z_loss: float, smoothing: float, softcap: float,
                  accum_fp32: bool, chunk: int, need_dh: bool, need_dw: bool, need_db: bool
                  ) -> tuple[T, T, T, T]:
    return _fused_impl(hidden, weight, target, bias, temp, inv_temp, ignore_index, mean, z_loss, smoothing,
                       softcap, accum_fp32, chunk, need_dh, need_dw, need_db)


@_lce_fused_op.register_fake
def _(hidden, weight, target, bias, temp, inv_temp, ignore_index, mean, z_loss, smoothing, softcap,
      accum_fp32, chunk, need_dh, need_dw, need_db):
    return (hidden.new_empty((), dtype=torch.float32),
            torch.empty_like(hidden) if need_dh else hidden.new_empty(0),
            torch.empty_like(weight) if need_dw else hidden.new_empty(0),
            torch.empty_like(bias) if need_db else hidden.new_empty(0))


def _fused_setup(ctx, inputs, output):
    _, dh, dw, db = output
    ctx.needs = inputs[13:16]
    ctx.ignore_index = inputs[6]
    ctx.save_for_backward(inputs[2])  # the targets: which rows and sums the upstream gradient scales
    # Held as plain attributes, not saved tensors: backward drops them, so the gradient it
    # returns has no other owner and autograd accumulates dweight without a second copy.
    ctx.grads = [dh, dw, db]


def _fused_backward(ctx, g, _gdh, _gdw, _gdb, kernel=False):
    # The gradients were formed in the forward; scale them in place (no second copy of
    # dweight). They can be used once: a second backward through the same graph
    # (retain_graph=True) raises instead of reusing scaled values. ``kernel`` (eager): an in-place
    # scaling that skips the work on the device when g == 1; the custom op's (traced) uses torch ops.
    if ctx.grads is None:
        raise RuntimeError("deepspeed_fused.linear_cross_entropy: the scalar-loss path forms its gradients in the "
                           "forward and can be backpropagated once; ask for reduction='none' (per-token path) "
                           "to backward twice")
    grads = ctx.grads
    ctx.grads = None
    (target,) = ctx.saved_tensors
    dh, dw, db = _scale_formed_grads(g, target, ctx.ignore_index, grads, ctx.needs, kernel)
    return (dh, dw, None, db) + (None,) * 12


_lce_fused_op.register_autograd(_fused_backward, setup_context=_fused_setup)


class _FusedScalarLoss(torch.autograd.Function):
    """Eager mode: the same computation as the ``lce_fused`` custom op (which torch.compile
    traces), without returning the forward-formed gradients as op outputs, so that the only
    reference to them is dropped in backward and autograd accumulates dweight and dhidden
    without a second copy (the custom-op wrapper kept one on torch 2.11)."""

    @staticmethod
    def forward(ctx, *args):
        loss, dh, dw, db = _fused_impl(*args)
        ctx.needs = args[13:16]
        ctx.ignore_index = args[6]
        ctx.save_for_backward(args[2])
        ctx.grads = [dh, dw, db]
        return loss

    @staticmethod
    def backward(ctx, g):
        # under create_graph the scaling must be an autograd op on g (torch ops)
        return _fused_backward(ctx, g, None, None, None, kernel=not torch.is_grad_enabled())


@torch.library.custom_op("deepspeed_fused::lce_forward", mutates_args=())
def _lce_forward_op(hidden: T, weight: T, target: T, bias: Optional[T], temp: Optional[T], inv_temp: float,
                    ignore_index: int, z_loss: float, smoothing: float, softcap: float, accum_fp32: bool,
                    chunk: int, vchunk: int, need_ent: bool) -> tuple[T, T, T]:
    return _forward_impl(hidden, weight, target, bias, temp, inv_temp, ignore_index, z_loss, smoothing, softcap,
                         chunk, vchunk, need_ent)


@_lce_forward_op.register_fake
def _(hidden, weight, target, bias, temp, inv_temp, ignore_index, z_loss, smoothing, softcap, accum_fp32, chunk,
      vchunk, need_ent):
    M = hidden.shape[0]
    f = dict(dtype=torch.float32)
    return hidden.new_empty(M, **f), hidden.new_empty(M, **f), hidden.new_empty(M if need_ent else 0, **f)


@torch.library.custom_op("deepspeed_fused::lce_backward", mutates_args=())
def _lce_backward_op(hidden: T, weight: T, target: T, bias: Optional[T], temp: Optional[T], lse: T, ent: T,
                     g_loss: Optional[T], g_ent: Optional[T], g_lse: Optional[T], inv_temp: float,
                     ignore_index: int, z_loss: float, smoothing: float, softcap: float, accum_fp32: bool,
                     chunk: int, vchunk: int, need_dh: bool, need_dw: bool, need_db: bool) -> tuple[T, T, T]:
    return _backward_impl(hidden, weight, target, bias, temp, lse, ent, g_loss, g_ent, g_lse, inv_temp,
                          ignore_index, z_loss, smoothing, softcap, accum_fp32, chunk, vchunk, need_dh, need_dw,
                          need_db)


@_lce_backward_op.register_fake
def _(hidden, weight, target, bias, temp, lse, ent, g_loss, g_ent, g_lse, inv_temp, ignore_index, z_loss,
      smoothing, softcap, accum_fp32, chunk, vchunk, need_dh, need_dw, need_db):
    return (torch.empty_like(hidden) if need_dh else hidden.new_empty(0),
            torch.empty_like(weight) if need_dw else hidden.new_empty(0),
            torch.empty_like(bias) if need_db else hidden.new_empty(0))


def _forward_setup(ctx, inputs, output):
    hidden, weight, target, bias, temp, inv_temp, ignore_index, z_loss, smoothing, softcap, accum_fp32, chunk, \
        vchunk, need_ent = inputs
    _, lse, ent = output
    ctx.has_bias = bias is not None
    ctx.has_temp = temp is not None
    ctx.args = (inv_temp, ignore_index, z_loss, smoothing, softcap, accum_fp32, chunk, vchunk)
    ctx.need_ent = need_ent
    ctx.save_for_backward(hidden, weight, target, bias, temp, lse, ent)


def _forward_backward(ctx, g_loss, g_lse, g_ent):
    hidden, weight, target, bias, temp, lse, ent = ctx.saved_tensors
    need_dh, need_dw, _, need_db = ctx.needs_input_grad[:4]
    if not (need_dh or need_dw or need_db):
        return (None,) * 14
    if not ctx.need_ent:
        g_ent = None
    dh, dw, db = _lce_backward_op(hidden, weight, target, bias, temp, lse, ent, g_loss, g_ent, g_lse,
                                  *ctx.args, need_dh, need_dw, bool(need_db and ctx.has_bias))
    return (dh if need_dh else None, dw if need_dw else None, None,
            db if need_db and ctx.has_bias else None) + (None,) * 10


_lce_forward_op.register_autograd(_forward_backward, setup_context=_forward_setup)
