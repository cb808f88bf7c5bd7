"""Single-GPU fused linear cross-entropy: the token-chunk passes, the ``torch.library`` custom
ops (``deepspeed_fused::lce_fused``, ``lce_forward``, ``lce_backward``) and the eager autograd
function; :func:`run_single` picks the path for one call.

The tokens are processed in chunks (:func:`.chunks._logit_chunks`): per chunk, cuBLAS writes
the chunk's logits into one reused workspace and the row kernel (:mod:`.kernels.row`) walks each
row. Two gradient strategies:

* **Scalar loss** (``reduction`` "mean"/"sum", no entropy/lse output) while gradients are
  needed: the same kernel makes a second pass over the row and overwrites the logits with
  ``dL/dlogits`` (or writes them to a second buffer when the logits are fp32, see
  :func:`.sizing.fp32_logits`; already weighted by ``1/n_valid`` for "mean"); two more chunk
  GEMMs give ``dhidden`` and accumulate ``dweight``. Backward only multiplies these by
  ``grad_output`` (:func:`.chunks._scale_formed_grads`: ignored rows stay exact zeros, whatever
  it is): 3 GEMMs in all.
* **Per-token upstream gradients** (reduction "none", entropy or lse returned): forward keeps
  per-token ``lse`` and entropy (fp32); backward recomputes the chunk logits and the kernel
  turns them in place (or into the second buffer) into ``dlogits`` from the per-token upstream
  gradients: 4 GEMMs. With ``vchunk`` > 0 this path runs over vocabulary chunks instead
  (:func:`.chunks._vocab_chunks`: all tokens against a slice of the vocabulary; partial
  statistics per slice merged by :func:`.stats.merge_partial_stats`; each slice's dweight rows
  from one GEMM, dhidden summed over the slices).
* **Per-token outputs, uniform upstream gradient expected** (``expect_uniform_grad``, eager):
  :class:`_UniformGradTokens` forms the gradients in the forward as the scalar loss does (3 GEMMs;
  :func:`_uniform_impl`) and returns the per-token outputs; backward scales them where the
  upstream gradient allows it exactly (:func:`_uniform_upstream`), else recomputes as the
  per-token path does.

The options travel as the call's :class:`.options.LCEOptions`; the custom ops take its
:class:`.options.LossOptions` as flat scalars, after their tensors and sizes
(:meth:`~.options.LossOptions.to_args` / :meth:`~.options.LossOptions.from_args`, nowhere else).
"""
import torch

from .chunks import (_backward_vocab_chunks, _dhidden_into, _fused_stats, _logit_chunks, _ParamGrads,
                     _scale_formed_grads, _Upstream, _vocab_chunks)
from .options import LossOptions
from .launch import _launch_rows, gemm_grad_supported, gemm_stats_supported
from .sizing import _token_chunk, _vocab_chunk
from .stats import (EXTRA_NAMES, EXTRA_TOP1, _NSTAT, _finalize_extras, _finalize_stats, _pack, merge_partial_extras,
                    merge_partial_stats)


def run_single(h, weight, bias, t, temp, opts, shape, check):
    """One call of the single-GPU op on checked rows (from :func:`.api.linear_cross_entropy`:
    ``h`` [M, H] contiguous, ``t`` [M] int32/int64, ``temp`` [M] fp32 or None; ``shape``: the
    target's). The scalar loss with gradients forms them in the forward (the ``lce_fused`` custom
    op under torch.compile, :class:`_FusedScalarLoss` in eager mode); everything else runs the
    per-token ``lce_forward`` op. ``check``: a started target check (or None), read once the
    kernels are queued."""
    M, V = h.shape[0], weight.shape[0]
    loss = opts.loss
    needs = (h.requires_grad, weight.requires_grad, bias is not None and bias.requires_grad)
    grads = torch.is_grad_enabled() and (needs[0] or needs[1] or needs[2])
    chunk = _token_chunk(opts.chunk_tokens, V, h.dtype, M, False, loss.softcap, grads)
    if grads and opts.scalar_loss:
        if torch.compiler.is_compiling():
            out = _lce_fused_op(h, weight, t, bias, temp, opts.mean, chunk, *needs, *loss.to_args())[0]
        else:
            out = _FusedScalarLoss.apply(h, weight, t, bias, temp, loss, opts.mean, chunk, needs)
        return _finish(check, out)
    vchunk = _vocab_chunk(opts.chunk_tokens, chunk, V, h.dtype, M, loss.softcap, grads)
    if grads and opts.expect_uniform_grad and not torch.compiler.is_compiling():
        loss_tok, lse, ent, xf = _UniformGradTokens.apply(h, weight, t, bias, temp, loss, opts.return_entropy,
                                                          opts.extras, chunk, vchunk, needs,
                                                          opts.uniform_grad_callback)
    else:
        loss_tok, lse, ent, xf = _lce_forward_op(h, weight, t, bias, temp, opts.return_entropy, chunk, vchunk,
                                                 opts.extras, *loss.to_args())
    _finish(check)  # the targets were checked on the device while the kernels were queued
    return _pack(loss_tok, lse, ent, t != loss.ignore_index, shape, opts, _unpack_extras(xf, opts.extras))


def _unpack_extras(xf, extras):
    """The forward-only fields by name from the op's [3, M] fp32 output (is_top1 as 0/1)."""
    if not extras:
        return None
    out = {}
    for i, (bit, name) in enumerate(EXTRA_NAMES):
        if extras & bit:
            out[name] = xf[i] != 0 if bit == EXTRA_TOP1 else xf[i]
    return out


def _finish(check, out=None):
    """Read a deferred target check (raises ValueError on a bad target or temperature); ``out``."""
    if check is not None:
        check.finish()
    return out


# ----------------------------------------------------------------------------------------
# The passes over token chunks (cuBLAS GEMMs + the row kernel, or the fused GEMMs)
# ----------------------------------------------------------------------------------------

def _fused_impl(hidden, weight, target, bias, temp, loss, mean, chunk, needs):
    """Scalar loss with its gradient formed in the forward (3 GEMMs): ``(loss, dh, dw, db)``."""
    need_dh, need_dw, need_db = needs
    M = hidden.shape[0]
    V = weight.shape[0]
    valid = target != loss.ignore_index
    if mean:
        w = 1.0 / valid.sum().clamp(min=1).to(torch.float32)
    else:
        w = torch.ones((), dtype=torch.float32, device=hidden.device)
    w1 = w.reshape(1)
    stats = torch.empty((M, _NSTAT), dtype=torch.float32, device=hidden.device)
    dh = torch.empty_like(hidden) if need_dh else hidden.new_empty(0)
    pg = _ParamGrads(weight, bias, loss.accum_fp32, need_dw, need_db)
    for s, e, x, g, h in _logit_chunks(hidden, weight, bias, chunk, loss.softcap, True):
        _launch_rows(x, target[s:e], stats=stats[s:e], g_loss=w1, per_token=False, out=g,
                     **loss.kernel_kw(None if temp is None else temp[s:e]))
        if need_dh:
            _dhidden_into(g, weight, dh[s:e])
        pg.add(g, h)
    loss_tok, _, _ = _finalize_stats(stats, valid, V, loss.z_loss, loss.smoothing, False)
    out = loss_tok.sum() * w
    dw, db = pg.result(hidden)
    return out, dh, dw, db


def _forward_impl(hidden, weight, target, bias, temp, loss, chunk, vchunk, need_ent, extras=0):
    """Per-token (loss, lse, entropy, extras) in fp32; one GEMM: the fused GEMM with the statistics in
    its epilogue where it runs (:func:`.launch.gemm_stats`: Hopper, fp16/bf16), else cuBLAS and
    the row kernel over token chunks of ``chunk`` rows or, with ``vchunk`` > 0, vocabulary chunks
    of that many columns (partial statistics per chunk, merged). ``extras`` (a mask of
    ``stats.EXTRA_*``): the forward-only fields, formed in the same pass, as [3, M] fp32 rows
    (mean_logits, is_top1 as 0/1, log_sum_sq_probs; those not asked for unwritten), else empty."""
    M = hidden.shape[0]
    V = weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    xt = torch.empty((M, 3), **f32) if extras else None
    stats = _fused_stats(hidden, weight, bias, target, temp, loss, need_ent, xt=xt, extras=extras)
    if stats is None and vchunk:
        n_v = -(-V // vchunk)
        parts = torch.empty((n_v, M, _NSTAT), **f32)
        xparts = torch.empty((n_v, M, 3), **f32) if extras else None
        kw = loss.kernel_kw(temp)
        for j, (v0, _, x, _) in enumerate(_vocab_chunks(hidden, weight, bias, vchunk, loss.softcap, False)):
            _launch_rows(x, target, stats=parts[j], need_ent=need_ent, vocab_start=v0, vocab_total=V,
                         xt=None if xparts is None else xparts[j], extras=extras, **kw)
        stats = merge_partial_stats(parts) if n_v > 1 else parts[0]
        if extras:
            xt = merge_partial_extras(parts, xparts) if n_v > 1 else xparts[0]
    elif stats is None:
        stats = torch.empty((M, _NSTAT), **f32)
        for s, e, x, _, _ in _logit_chunks(hidden, weight, bias, chunk, loss.softcap, False):
            _launch_rows(x, target[s:e], stats=stats[s:e], need_ent=need_ent, xt=None if xt is None else xt[s:e],
                         extras=extras, **loss.kernel_kw(None if temp is None else temp[s:e]))
    valid = target != loss.ignore_index
    loss_tok, lse, ent = _finalize_stats(stats, valid, V, loss.z_loss, loss.smoothing, need_ent)
    xf = _extras_rows(stats, xt, target, valid, V, extras, hidden)
    return loss_tok, lse, ent if need_ent else hidden.new_empty(0, dtype=torch.float32), xf


def _extras_rows(stats, xt, target, valid, V, extras, like):
    """The forward-only fields as the per-token op returns them: [3, M] fp32 rows (mean_logits,
    is_top1 as 0/1, log_sum_sq_probs; zero where not asked for), or empty without ``extras``."""
    if not extras:
        return like.new_empty(0, dtype=torch.float32)
    xf = torch.zeros((3, target.shape[0]), dtype=torch.float32, device=like.device)
    for i, (bit, name) in enumerate(EXTRA_NAMES):
        if extras & bit:
            xf[i] = _finalize_extras(stats, xt, target, valid, V, bit)[name]
    return xf


def _backward_impl(hidden, weight, target, bias, temp, up, loss, chunk, vchunk, needs, stats_fused=None):
    """Recompute the chunk logits, turn them into dlogits from the per-token upstream gradients
    (``up``, an :class:`.chunks._Upstream`); ``(dh, dw, db)``."""
    M = hidden.shape[0]
    if stats_fused is None:
        stats_fused = gemm_stats_supported(hidden, weight)
    if not vchunk and chunk >= M:
        vchunk = weight.shape[0]  # one chunk: the whole vocabulary as one slice (the same GEMMs)
    elif not vchunk and stats_fused and gemm_grad_supported(hidden, weight):
        # the forward's statistics came from the fused GEMM (``_forward_impl`` tries it first): the
        # gradient's logits must come from the fused GEMM too, over vocabulary chunks of the same
        # workspace. cuBLAS's logits for the row kernel may round otherwise (with a bias the fused
        # GEMMs keep fp32 logits; without one, a different summation order can flip a rounding),
        # and p = exp(z - lse) from logits that are not the lse's would be off by a rounding step
        # of z: far off for a confidently predicted token.
        vchunk = max(8, chunk * weight.shape[0] // M)
    if vchunk:
        return _backward_vocab_chunks(hidden, weight, bias, target, temp, up, loss, vchunk, needs, fused=stats_fused)
    need_dh, need_dw, need_db = needs
    dh = torch.empty_like(hidden) if need_dh else hidden.new_empty(0)
    pg = _ParamGrads(weight, bias, loss.accum_fp32, need_dw, need_db)
    for s, e, x, g, h in _logit_chunks(hidden, weight, bias, chunk, loss.softcap, True):
        _launch_rows(x, target[s:e], per_token=True, out=g, **up.rows_kw(s, e),
                     **loss.kernel_kw(None if temp is None else temp[s:e]))
        if need_dh:
            _dhidden_into(g, weight, dh[s:e])
        pg.add(g, h)
    dw, db = pg.result(hidden)
    return dh, dw, db


def _uniform_impl(hidden, weight, target, bias, temp, loss, need_ent, extras, chunk, needs):
    """Per-token outputs as :func:`_forward_impl` returns them, and the gradients of
    ``sum(loss) / n_valid`` formed in the same pass (3 GEMMs): per token chunk the row kernel writes
    the statistics and the dlogits of every labelled row with the weight ``1 / n_valid`` (``n_valid``
    >= 1: the sums stay those of a mean, within the input dtype's range), then the dhidden GEMM and
    the dweight accumulation. ``(loss, lse, ent, xf, dh, dw, db, n_valid)``: ``n_valid`` fp32 0-d, what
    the backward multiplies the upstream gradient by."""
    need_dh, need_dw, need_db = needs
    M, V = hidden.shape[0], weight.shape[0]
    f32 = dict(dtype=torch.float32, device=hidden.device)
    valid = target != loss.ignore_index
    n_valid = valid.sum().clamp(min=1).to(torch.float32)
    w1 = (1.0 / n_valid).reshape(1)
    stats = torch.empty((M, _NSTAT), **f32)
    xt = torch.empty((M, 3), **f32) if extras else None
    dh = torch.empty_like(hidden) if need_dh else hidden.new_empty(0)
    pg = _ParamGrads(weight, bias, loss.accum_fp32, need_dw, need_db)
    for s, e, x, g, h in _logit_chunks(hidden, weight, bias, chunk, loss.softcap, True):
        _launch_rows(x, target[s:e], stats=stats[s:e], need_ent=need_ent, xt=None if xt is None else xt[s:e],
                     extras=extras, g_loss=w1, per_token=False, out=g,
                     **loss.kernel_kw(None if temp is None else temp[s:e]))
        if need_dh:
            _dhidden_into(g, weight, dh[s:e])
        pg.add(g, h)
    loss_tok, lse, ent = _finalize_stats(stats, valid, V, loss.z_loss, loss.smoothing, need_ent)
    xf = _extras_rows(stats, xt, target, valid, V, extras, hidden)
    dw, db = pg.result(hidden)
    return (loss_tok, lse, ent if need_ent else hidden.new_empty(0, dtype=torch.float32), xf, dh, dw, db,
            n_valid)


def _uniform_upstream(g_loss, g_ent, g_lse, target, ignore_index, n_valid, param_grads, half_range=False):
    """Whether the gradients formed by :func:`_uniform_impl` give the exact backward for these upstream
    gradients, and the factor: ``(True, None)``: dhidden alone is needed, each row scaled by its own
    ``g_loss * n_valid`` (exact for any per-token weights; no host read but in fp16, see below); ``(True, s)``: ``g_loss``
    equals one ``c`` on every labelled row and ``s = c * n_valid`` (0-d, on the device) is finite, so
    the formed gradients times ``s`` are the exact ones; ``(False, None)``: not so (no loss
    gradient, a nonzero entropy or lse gradient, per-token weights or a non-finite one with
    dweight/dbias needed), the backward recomputes. The decision reads one flag on the host where
    it depends on values (a device sync).

    fp16 (``half_range``): the formed ``dlogits`` are ``(p - y) / n_valid`` in fp16, so a
    probability below ``n_valid * 2**-25`` rounded to zero there; the per-token path forms
    ``(p - y) * g`` and keeps those where ``g > 1 / n_valid`` (a sum of the losses: every small
    probability's share of dbias and dweight would be lost). So in fp16 the formed gradients are
    used only where every factor applied to them is at most 1 (within fp32's rounding of
    ``g * n_valid``): the per-token path's ``dlogits`` are then no larger and lose at least as
    much; else the backward recomputes. (bf16 and fp32 reach 1e-38: no such loss.)"""
    if g_loss is None:
        return False, None
    limit = 1.0 + 2.0 ** -10 if half_range else None
    if not param_grads and g_ent is None and g_lse is None and limit is None:
        return True, None
    flags = [(g == 0).all() for g in (g_ent, g_lse) if g is not None]
    scale = None
    if not param_grads:  # fp16 here, or an entropy / lse gradient: each row's own factor, at most 1
        if limit is not None:
            rows = torch.where(target != ignore_index, g_loss.reshape(-1).float() * n_valid, 0.0)
            flags.append((rows.abs() <= limit).all())
    else:
        valid = target != ignore_index
        gf = g_loss.reshape(-1).float()
        first = gf[valid.to(torch.int32).argmax()]  # the first labelled row's (row 0 when none is labelled)
        c = torch.where(valid.any(), first, torch.ones_like(first))
        scale = c * n_valid
        flags.append(torch.isfinite(scale) & (torch.where(valid, gf, c) == c).all())
        if limit is not None:
            flags.append(scale.abs() <= limit)
    if not bool(torch.stack(flags).all()):  # the one host read
        return False, None
    return True, scale


# ----------------------------------------------------------------------------------------
# torch.library custom ops (opaque to torch.compile; no host sync inside). Each takes its
# tensors, its sizes and flags, then the loss options flattened (LossOptions.to_args()).
# ----------------------------------------------------------------------------------------

def _custom_op(name, inputs, returns):
    """Register the decorated function as ``deepspeed_fused::<name>``: the schema's arguments are
    ``inputs`` then the fields of :class:`.options.LossOptions`, which the function takes as
    ``*loss_args`` (for :meth:`~.options.LossOptions.from_args`)."""
    schema = f"({inputs}, {LossOptions.SCHEMA}) -> {returns}"
    return lambda fn: torch.library.custom_op(f"deepspeed_fused::{name}", fn, mutates_args=(), schema=schema)


_TENSORS = "Tensor hidden, Tensor weight, Tensor target, Tensor? bias, Tensor? temp"


@_custom_op("lce_fused", f"{_TENSORS}, bool mean, SymInt chunk, bool need_dh, bool need_dw, bool need_db",
            "(Tensor, Tensor, Tensor, Tensor)")
def _lce_fused_op(hidden, weight, target, bias, temp, mean, chunk, need_dh, need_dw, need_db, *loss_args):
    return _fused_impl(hidden, weight, target, bias, temp, LossOptions.from_args(*loss_args), mean, chunk,
                       (need_dh, need_dw, need_db))


@_lce_fused_op.register_fake
def _(hidden, weight, target, bias, temp, mean, chunk, need_dh, need_dw, need_db, *loss_args):
    return (hidden.new_empty((), dtype=torch.float32),
            torch.empty_like(hidden) if need_dh else hidden.new_empty(0),
            torch.empty_like(weight) if need_dw else hidden.new_empty(0),
            torch.empty_like(bias) if need_db else hidden.new_empty(0))


def _fused_setup(ctx, inputs, output):
    hidden, weight, target, bias, temp, mean, chunk, need_dh, need_dw, need_db, *loss_args = inputs
    _, dh, dw, db = output
    ctx.n_inputs = len(inputs)
    ctx.needs = (need_dh, need_dw, need_db)
    ctx.ignore_index = LossOptions.from_args(*loss_args).ignore_index
    ctx.save_for_backward(target)  # the targets: which rows and sums the upstream gradient scales
    # Held as plain attributes, not saved tensors: backward drops them, so the gradient it
    # returns has no other owner and autograd accumulates dweight without a second copy.
    ctx.grads = [dh, dw, db]


def _scaled_formed_grads(ctx, g, kernel):
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
    return _scale_formed_grads(g, target, ctx.ignore_index, grads, ctx.needs, kernel)


def _fused_backward(ctx, g, _gdh, _gdw, _gdb):
    dh, dw, db = _scaled_formed_grads(ctx, g, kernel=False)
    return (dh, dw, None, db) + (None,) * (ctx.n_inputs - 4)


_lce_fused_op.register_autograd(_fused_backward, setup_context=_fused_setup)


class _FusedScalarLoss(torch.autograd.Function):
    """Eager mode: the same computation as the ``lce_fused`` custom op (which torch.compile
    traces), without returning the forward-formed gradients as op outputs, so that the only
    reference to them is dropped in backward and autograd accumulates dweight and dhidden
    without a second copy (the custom-op wrapper kept one on torch 2.11)."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, temp, loss, mean, chunk, needs):
        out, dh, dw, db = _fused_impl(hidden, weight, target, bias, temp, loss, mean, chunk, needs)
        ctx.needs = needs
        ctx.ignore_index = loss.ignore_index
        ctx.save_for_backward(target)
        ctx.grads = [dh, dw, db]
        return out

    @staticmethod
    def backward(ctx, g):
        # under create_graph the scaling must be an autograd op on g (torch ops)
        dh, dw, db = _scaled_formed_grads(ctx, g, kernel=not torch.is_grad_enabled())
        return dh, dw, None, db, None, None, None, None, None


@_custom_op("lce_forward", f"{_TENSORS}, bool need_ent, SymInt chunk, SymInt vchunk, int extras",
            "(Tensor, Tensor, Tensor, Tensor)")
def _lce_forward_op(hidden, weight, target, bias, temp, need_ent, chunk, vchunk, extras, *loss_args):
    return _forward_impl(hidden, weight, target, bias, temp, LossOptions.from_args(*loss_args), chunk, vchunk,
                         need_ent, extras)


@_lce_forward_op.register_fake
def _(hidden, weight, target, bias, temp, need_ent, chunk, vchunk, extras, *loss_args):
    M = hidden.shape[0]
    f = dict(dtype=torch.float32)
    return (hidden.new_empty(M, **f), hidden.new_empty(M, **f), hidden.new_empty(M if need_ent else 0, **f),
            hidden.new_empty((3, M) if extras else (0,), **f))


@_custom_op("lce_backward", f"{_TENSORS}, Tensor lse, Tensor ent, Tensor? g_loss, Tensor? g_ent, Tensor? g_lse, "
            "SymInt chunk, SymInt vchunk, bool need_dh, bool need_dw, bool need_db", "(Tensor, Tensor, Tensor)")
def _lce_backward_op(hidden, weight, target, bias, temp, lse, ent, g_loss, g_ent, g_lse, chunk, vchunk, need_dh,
                     need_dw, need_db, *loss_args):
    if g_loss is None:
        g_loss = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    up = _Upstream.of(lse, ent, g_loss.float().contiguous(), None if g_ent is None else g_ent.float().contiguous(),
                      None if g_lse is None else g_lse.float().contiguous())
    return _backward_impl(hidden, weight, target, bias, temp, up, LossOptions.from_args(*loss_args), chunk, vchunk,
                          (need_dh, need_dw, need_db))


@_lce_backward_op.register_fake
def _(hidden, weight, target, bias, temp, lse, ent, g_loss, g_ent, g_lse, chunk, vchunk, need_dh, need_dw, need_db,
      *loss_args):
    return (torch.empty_like(hidden) if need_dh else hidden.new_empty(0),
            torch.empty_like(weight) if need_dw else hidden.new_empty(0),
            torch.empty_like(bias) if need_db else hidden.new_empty(0))


def _forward_setup(ctx, inputs, output):
    hidden, weight, target, bias, temp, need_ent, chunk, vchunk, _extras, *loss_args = inputs
    _, lse, ent, xf = output
    ctx.mark_non_differentiable(xf)
    ctx.n_inputs = len(inputs)
    ctx.has_bias = bias is not None
    ctx.need_ent = need_ent
    ctx.sizes = (chunk, vchunk)
    ctx.loss_args = loss_args  # passed on to the backward op as they came
    ctx.save_for_backward(hidden, weight, target, bias, temp, lse, ent)


def _forward_backward(ctx, g_loss, g_lse, g_ent, _g_extras):
    hidden, weight, target, bias, temp, lse, ent = ctx.saved_tensors
    need_dh, need_dw, _, need_db = ctx.needs_input_grad[:4]
    if not (need_dh or need_dw or need_db):
        return (None,) * ctx.n_inputs
    if not ctx.need_ent:
        g_ent = None
    chunk, vchunk = ctx.sizes
    dh, dw, db = _lce_backward_op(hidden, weight, target, bias, temp, lse, ent, g_loss, g_ent, g_lse, chunk, vchunk,
                                  need_dh, need_dw, bool(need_db and ctx.has_bias), *ctx.loss_args)
    return (dh if need_dh else None, dw if need_dw else None, None,
            db if need_db and ctx.has_bias else None) + (None,) * (ctx.n_inputs - 4)


_lce_forward_op.register_autograd(_forward_backward, setup_context=_forward_setup)


class _UniformGradTokens(torch.autograd.Function):
    """Eager per-token outputs (``expect_uniform_grad=True``) with the gradients formed in the forward
    (:func:`_uniform_impl`, 3 GEMMs) for an upstream gradient that is uniform over the labelled rows.
    Backward (once only, as the scalar-loss path) scales them in place where
    :func:`_uniform_upstream` finds that exact; otherwise it drops them and runs the per-token
    backward (:func:`_backward_impl`, recomputing the logits, as the ``lce_forward`` op would: exact
    in every case, one GEMM more). ``callback(bool)``, if given, is told which way it went."""

    @staticmethod
    def forward(ctx, hidden, weight, target, bias, temp, loss, need_ent, extras, chunk, vchunk, needs, callback):
        loss_tok, lse, ent, xf, dh, dw, db, n_valid = _uniform_impl(hidden, weight, target, bias, temp, loss,
                                                                    need_ent, extras, chunk, needs)
        ctx.set_materialize_grads(False)  # an unused output's gradient is None, not zeros
        ctx.mark_non_differentiable(xf)
        ctx.loss, ctx.need_ent, ctx.sizes, ctx.needs, ctx.callback = loss, need_ent, (chunk, vchunk), needs, callback
        ctx.save_for_backward(hidden, weight, target, bias, temp, lse, ent, n_valid)
        ctx.grads = [dh, dw, db]  # plain attributes (see _FusedScalarLoss): dropped in backward
        return loss_tok, lse, ent, xf

    @staticmethod
    def backward(ctx, g_loss, g_lse, g_ent, _g_extras):
        if ctx.grads is None:
            raise RuntimeError("deepspeed_fused.linear_cross_entropy: expect_uniform_grad=True forms the gradients in "
                               "the forward and can be backpropagated once; leave it False to backward twice")
        grads, ctx.grads = ctx.grads, None
        hidden, weight, target, bias, temp, lse, ent, n_valid = ctx.saved_tensors
        loss, needs = ctx.loss, ctx.needs
        if not ctx.need_ent:
            g_ent = None
        use, scale = _uniform_upstream(g_loss, g_ent, g_lse, target, loss.ignore_index, n_valid,
                                       needs[1] or needs[2], hidden.dtype == torch.float16)
        if ctx.callback is not None:
            ctx.callback(use)
        if use and scale is None:  # dhidden alone: each labelled row times its own upstream gradient
            s = torch.where(target != loss.ignore_index, g_loss.reshape(-1).float() * n_valid, 1.0)
            dh, dw, db = grads[0].mul_(s.unsqueeze(1)), None, None
        elif use:
            dh, dw, db = _scale_formed_grads(scale, target, loss.ignore_index, grads, needs,
                                             kernel=not torch.is_grad_enabled())
        else:
            del grads  # freed before the recomputation allocates its own
            M = hidden.shape[0]
            gl = (torch.zeros(M, dtype=torch.float32, device=hidden.device) if g_loss is None
                  else g_loss.reshape(-1).float().contiguous())
            up = _Upstream.of(lse, ent, gl, None if g_ent is None else g_ent.reshape(-1).float().contiguous(),
                              None if g_lse is None else g_lse.reshape(-1).float().contiguous())
            # the forward's statistics came from cuBLAS's logits and the row kernel: so do the gradient's
            dh, dw, db = _backward_impl(hidden, weight, target, bias, temp, up, loss, *ctx.sizes, needs,
                                        stats_fused=False)
        need_dh, need_dw, need_db = needs
        return ((dh if need_dh else None, dw if need_dw else None, None, db if need_db else None)
                + (None,) * 8)
