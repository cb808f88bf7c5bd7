"""Fused linear cross-entropy: ``loss = CE(hidden @ weight.T + bias, target)`` without the logits.

The tokens are processed in chunks. Per chunk, cuBLAS writes the chunk's logits into one
reused workspace (``chunk_tokens x V`` in the input dtype, <= 480 MiB by default), and one
Triton kernel walks each row once in fp32: online max / sum-of-exp, the target logit, the
entropy term and the label-smoothing sum. Nothing of size ``tokens x V`` is ever allocated.

Two gradient strategies:

* **Scalar loss** (``reduction`` "mean"/"sum", no entropy/lse output) while gradients are
  needed: the same kernel makes a second pass over the row and overwrites the logits with
  ``dL/dlogits`` (already weighted by ``1/n_valid`` for "mean"); two more chunk GEMMs give
  ``dhidden`` and accumulate ``dweight``. Backward only multiplies these by ``grad_output``:
  3 GEMMs in all.
* **Per-token upstream gradients** (reduction "none", entropy or lse returned): forward keeps
  per-token ``lse`` and entropy (fp32); backward recomputes the chunk logits and the kernel
  turns them in place into ``dlogits`` from the per-token upstream gradients: 4 GEMMs.

The kernel emits per-token *partial statistics* (running max ``m``, ``d = sum exp(z-m)``,
``a = sum exp(z-m)(z-m)``, ``sum z`` and the target logit if the target falls in the
``[vocab_start, vocab_start + V)`` shard) which :func:`_finalize_stats` turns into loss,
lse and entropy. :func:`merge_partial_stats` combines the statistics of vocabulary shards:
this is where a tensor-parallel group plugs in (one all-gather of the packed statistics).

Math per token with ``s`` the raw logits, ``T`` the temperature, ``c`` the soft cap:
``z = c*tanh(s/(T c))`` (or ``s/T``), ``lse = logsumexp(z)``, ``p = softmax(z)``,
``loss = lse - (1-eps) z_t - eps mean(z) + z_loss lse^2`` (0 for ignored targets),
``entropy = lse - sum p z``. With upstream gradients ``gL`` (loss), ``gE`` (entropy),
``gS`` (lse): ``dz_j = p_j (gL (1 + 2 z_loss lse) + gS - gE (z_j - sum p z))
- gL eps/V - gL (1-eps) [j == t]``, then ``ds = dz (1 - (z/c)^2) / T``.
"""
import math
from typing import Optional

import torch

from ._common import HAS_TRITON, kernel_device_ok, interpreter_active, tl, triton, warn_fallback

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "merge_partial_stats"]

_OP = "linear_cross_entropy"
# Logits chunk budget: with the per-token statistics and cuBLAS workspace the total extra
# memory stays under 512 MiB.
DEFAULT_WORKSPACE_BYTES = 480 * 1024 * 1024
_NSTAT = 5  # m, d, a, sum z, target z
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

if HAS_TRITON:

    @triton.jit
    def _softcap(z, cap):
        # cap * tanh(z / cap); tanh via exp so it runs compiled and interpreted
        return cap - 2.0 * cap / (tl.exp(2.0 * z / cap) + 1.0)

    @triton.jit
    def _lce_rows_kernel(
        x_ptr, stride_x, V,
        tgt_ptr, ignore_index, vocab_start,
        temp_ptr, inv_temp, cap, z_loss, smooth, inv_vocab_total,
        stat_ptr, lse_ptr, ent_ptr, gl_ptr, ge_ptr, gs_ptr,
        HAS_TEMP: tl.constexpr, HAS_CAP: tl.constexpr, STATS: tl.constexpr, GRAD: tl.constexpr,
        PER_TOKEN: tl.constexpr, HAS_GE: tl.constexpr, HAS_GS: tl.constexpr,
        NEED_ENT: tl.constexpr, NEED_SUMZ: tl.constexpr, BLOCK: tl.constexpr,
    ):
        """One program per row of the logits chunk ``x`` [rows, V].

        STATS: write the row's partial statistics to ``stat_ptr`` [rows, 5].
        GRAD: overwrite the row with dlogits (input dtype). Without STATS, lse (and the
        entropy, for gE) are read from ``lse_ptr``/``ent_ptr``. PER_TOKEN: loss upstream
        gradient per row from ``gl_ptr``; else ``gl_ptr[0]`` for every valid row.
        """
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * stride_x
        t = tl.load(tgt_ptr + row).to(tl.int64)
        valid = t != ignore_index
        lt = t - vocab_start
        in_shard = valid & (lt >= 0) & (lt < V)
        lt = tl.where(in_shard, lt, 0)
        if HAS_TEMP:
            inv_t = 1.0 / tl.load(temp_ptr + row).to(tl.float32)
        else:
            inv_t = inv_temp
        offs = tl.arange(0, BLOCK)
        if STATS:
            m = -1e30
            d = 0.0
            a = 0.0
            sz = 0.0
            for start in range(0, V, BLOCK):
                cols = start + offs
                mask = cols < V
                z = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_t
                if HAS_CAP:
                    z = _softcap(z, cap)
                if NEED_SUMZ:
                    sz += tl.sum(tl.where(mask, z, 0.0), axis=0)
                z = tl.where(mask, z, float("-inf"))
                m_new = tl.maximum(m, tl.max(z, axis=0))
                e = tl.exp(z - m_new)
                alpha = tl.exp(m - m_new)
                if NEED_ENT:
                    a = alpha * (a + (m - m_new) * d) + tl.sum(e * tl.where(mask, z - m_new, 0.0), axis=0)
                d = d * alpha + tl.sum(e, axis=0)
                m = m_new
            zt = tl.load(x_row + lt).to(tl.float32) * inv_t
            if HAS_CAP:
                zt = _softcap(zt, cap)
            zt = tl.where(in_shard, zt, 0.0)
            sp = stat_ptr + row * 5
            tl.store(sp + 0, m)
            tl.store(sp + 1, d)
            tl.store(sp + 2, a)
            tl.store(sp + 3, sz)
            tl.store(sp + 4, zt)
            lse = m + tl.log(d)
            s_pz = m + a / d
        if GRAD:
            if not STATS:
                lse = tl.load(lse_ptr + row)
                if HAS_GE:
                    s_pz = lse - tl.load(ent_ptr + row)
            if PER_TOKEN:
                gl = tl.load(gl_ptr + row)
            else:
                gl = tl.load(gl_ptr)
            gl = tl.where(valid, gl, 0.0)
            coef = gl * (1.0 + 2.0 * z_loss * lse)
            if HAS_GS:
                coef += tl.load(gs_ptr + row)
            if HAS_GE:
                ge = tl.load(ge_ptr + row)
            g_smooth = gl * smooth * inv_vocab_total
            g_tgt = gl * (1.0 - smooth)
            for start in range(0, V, BLOCK):
                cols = start + offs
                mask = cols < V
                z = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32) * inv_t
                if HAS_CAP:
                    z = _softcap(z, cap)
                p = tl.exp(z - lse)
                if HAS_GE:
                    g = p * (coef - ge * (z - s_pz))
                else:
                    g = p * coef
                g = g - g_smooth
                g = tl.where(in_shard & (cols == lt), g - g_tgt, g)
                if HAS_CAP:
                    th = z / cap
                    g = g * (1.0 - th * th)
                g = g * inv_t
                tl.store(x_row + cols, g.to(x_ptr.dtype.element_ty), mask=mask)


def _launch_rows(x, target, *, temp=None, inv_temp=1.0, softcap=0.0, z_loss=0.0, smoothing=0.0,
                 ignore_index=-100, vocab_start=0, vocab_total=None, stats=None, lse=None, ent=None,
                 g_loss=None, g_ent=None, g_lse=None, per_token=False, need_ent=False):
    """Run the row kernel over the chunk ``x`` [rows, V] (contiguous rows).

    ``stats`` given: write partial statistics there. ``g_loss`` given: overwrite ``x`` with
    dlogits (``per_token``: g_loss is [rows]; else a 1-element weight for valid rows).
    """
    n, V = x.shape
    if n == 0:
        return
    assert x.stride(1) == 1
    dummy = torch.empty(1, dtype=torch.float32, device=x.device)
    if interpreter_active():
        block, warps = min(64, triton.next_power_of_2(V)), 1
    else:
        block = min(4096, triton.next_power_of_2(V))
        warps = 8 if block >= 2048 else 4
    grad = g_loss is not None
    _lce_rows_kernel[(n,)](
        x, x.stride(0), V,
        target, ignore_index, vocab_start,
        temp if temp is not None else dummy, float(inv_temp), float(softcap or 1.0), float(z_loss),
        float(smoothing), 1.0 / float(vocab_total or V),
        stats if stats is not None else dummy, lse if lse is not None else dummy,
        ent if ent is not None else dummy, g_loss if grad else dummy,
        g_ent if g_ent is not None else dummy, g_lse if g_lse is not None else dummy,
        HAS_TEMP=temp is not None, HAS_CAP=bool(softcap), STATS=stats is not None, GRAD=grad,
        PER_TOKEN=per_token, HAS_GE=g_ent is not None, HAS_GS=g_lse is not None,
        NEED_ENT=need_ent, NEED_SUMZ=smoothing != 0.0, BLOCK=block, num_warps=warps,
    )


# ----------------------------------------------------------------------------------------
# Partial statistics: finalize and merge (the tensor-parallel hook)
# ----------------------------------------------------------------------------------------

def merge_partial_stats(stats: torch.Tensor) -> torch.Tensor:
    """Combine per-shard statistics ``[shards, tokens, 5]`` into ``[tokens, 5]``.

    Each shard holds (m, d = sum exp(z-m), a = sum exp(z-m)(z-m), sum z, target z or 0) over
    its slice of the vocabulary; the result is the same statistics over the whole of it.
    """
    m_r, d_r, a_r, sz_r, zt_r = stats.unbind(-1)
    m = m_r.amax(0)
    scale = torch.exp(m_r - m)
    d = (d_r * scale).sum(0)
    a = (scale * (a_r + (m_r - m) * d_r)).sum(0)
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
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    ent = logd - a / d if need_ent else None
    return loss, lse, ent


# ----------------------------------------------------------------------------------------
# Chunk drivers (cuBLAS GEMMs + the row kernel)
# ----------------------------------------------------------------------------------------

def _logits_into(h, weight, bias, out):
    if bias is None:
        torch.mm(h, weight.t(), out=out)
    else:
        torch.addmm(bias, h, weight.t(), out=out)


_FP32_OUT_DTYPE_OK = [True]


def _addmm_fp32_(acc, a, b):
    """acc (fp32) += a @ b with half inputs, accumulating in fp32 inside the GEMM."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    if _FP32_OUT_DTYPE_OK[0] and acc.is_cuda:
        try:
            torch.addmm(acc, a, b, torch.float32, out=acc)
            return
        except (RuntimeError, TypeError):
            _FP32_OUT_DTYPE_OK[0] = False
    acc.add_(torch.mm(a, b))


class _ParamGrads:
    """dweight / dbias accumulated over token chunks."""

    def __init__(self, weight, bias, accum_fp32, need_dw, need_db):
        self.weight, self.bias = weight, bias
        self.fp32 = accum_fp32 and weight.dtype != torch.float32
        self.need_dw, self.need_db = need_dw, need_db
        self.dw = self.db = None

    def add(self, dlogits, h):
        if self.need_dw:
            if self.fp32:
                if self.dw is None:
                    self.dw = torch.zeros(self.weight.shape, dtype=torch.float32, device=h.device)
                _addmm_fp32_(self.dw, dlogits.t(), h)
            elif self.dw is None:
                self.dw = torch.mm(dlogits.t(), h)
            else:
                self.dw.addmm_(dlogits.t(), h)
        if self.need_db:
            s = dlogits.sum(0, dtype=torch.float32)
            self.db = s if self.db is None else self.db.add_(s)

    def result(self, like_h):
        w = self.weight
        if not self.need_dw:
            dw = like_h.new_empty(0)
        elif self.dw is None:
            dw = torch.zeros_like(w)
        else:
            dw = self.dw.to(w.dtype)
        if not self.need_db:
            db = like_h.new_empty(0)
        elif self.db is None:
            db = torch.zeros_like(self.bias)
        else:
            db = self.db.to(self.bias.dtype)
        return dw, db


def _logit_chunks(hidden, weight, bias, chunk):
    """Yield ``(s, e, logits, hidden[s:e])`` per token chunk; the chunk logits are written into
    one reused ``[chunk, V]`` buffer (the op's whole workspace), freed when the loop ends."""
    M, V = hidden.shape[0], weight.shape[0]
    buf = hidden.new_empty((min(chunk, M), V))
    for s in range(0, M, chunk):
        e = min(M, s + chunk)
        x, h = buf[: e - s], hidden[s:e]
        _logits_into(h, weight, bias, x)
        yield s, e, x, h


def _kw(temp_c, inv_temp, ignore_index, z_loss, smoothing, softcap):
    return dict(temp=temp_c, inv_temp=inv_temp, ignore_index=ignore_index, z_loss=z_loss,
                smoothing=smoothing, softcap=softcap)


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
    for s, e, x, h in _logit_chunks(hidden, weight, bias, chunk):
        _launch_rows(x, target[s:e], stats=stats[s:e], g_loss=w1, per_token=False,
                     **_kw(None if temp is None else temp[s:e], inv_temp, ignore_index, z_loss, smoothing, softcap))
        if need_dh:
            torch.mm(x, weight, out=dh[s:e])
        pg.add(x, h)
    loss_tok, _, _ = _finalize_stats(stats, valid, V, z_loss, smoothing, False)
    loss = loss_tok.sum() * w
    dw, db = pg.result(hidden)
    return loss, dh, dw, db


def _forward_impl(hidden, weight, target, bias, temp, inv_temp, ignore_index, z_loss, smoothing, softcap,
                  chunk, need_ent):
    """Per-token (loss, lse, entropy) in fp32; one GEMM."""
    M = hidden.shape[0]
    V = weight.shape[0]
    stats = torch.empty((M, _NSTAT), dtype=torch.float32, device=hidden.device)
    for s, e, x, _ in _logit_chunks(hidden, weight, bias, chunk):
        _launch_rows(x, target[s:e], stats=stats[s:e], need_ent=need_ent,
                     **_kw(None if temp is None else temp[s:e], inv_temp, ignore_index, z_loss, smoothing, softcap))
    valid = target != ignore_index
    loss, lse, ent = _finalize_stats(stats, valid, V, z_loss, smoothing, need_ent)
    return loss, lse, ent if need_ent else hidden.new_empty(0, dtype=torch.float32)


def _backward_impl(hidden, weight, target, bias, temp, lse, ent, g_loss, g_ent, g_lse, inv_temp, ignore_index,
                   z_loss, smoothing, softcap, accum_fp32, chunk, need_dh, need_dw, need_db):
    """Recompute the chunk logits, turn them into dlogits from per-token upstream gradients."""
    M = hidden.shape[0]
    if g_loss is None:
        g_loss = torch.zeros(M, dtype=torch.float32, device=hidden.device)
    g_loss = g_loss.float().contiguous()
    g_ent = None if g_ent is None else g_ent.float().contiguous()
    g_lse = None if g_lse is None else g_lse.float().contiguous()
    dh = torch.empty_like(hidden) if need_dh else hidden.new_empty(0)
    pg = _ParamGrads(weight, bias, accum_fp32, need_dw, need_db)
    for s, e, x, h in _logit_chunks(hidden, weight, bias, chunk):
        _launch_rows(x, target[s:e], lse=lse[s:e], ent=None if g_ent is None else ent[s:e],
                     g_loss=g_loss[s:e], g_ent=None if g_ent is None else g_ent[s:e],
                     g_lse=None if g_lse is None else g_lse[s:e], per_token=True,
                     **_kw(None if temp is None else temp[s:e], inv_temp, ignore_index, z_loss, smoothing, softcap))
        if need_dh:
            torch.mm(x, weight, out=dh[s:e])
        pg.add(x, h)
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
    # Held as plain attributes, not saved tensors: backward drops them, so the gradient it
    # returns has no other owner and autograd accumulates dweight without a second copy.
    ctx.grads = [dh, dw, db]


def _fused_backward(ctx, g, _gdh, _gdw, _gdb):
    # The gradients were formed in the forward; scale them in place (no second copy of
    # dweight). They can be used once: a second backward through the same graph
    # (retain_graph=True) raises instead of reusing scaled values.
    if ctx.grads is None:
        raise RuntimeError("deepspeed_fused.linear_cross_entropy: the scalar-loss path forms its gradients in the "
                           "forward and can be backpropagated once; ask for reduction='none' (per-token path) "
                           "to backward twice")
    dh, dw, db = ctx.grads
    ctx.grads = None
    need_dh, need_dw, need_db = ctx.needs
    return (dh.mul_(g) if need_dh else None, dw.mul_(g) if need_dw else None, None,
            db.mul_(g) if need_db else None) + (None,) * 12


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
        ctx.grads = [dh, dw, db]
        return loss

    @staticmethod
    def backward(ctx, g):
        return _fused_backward(ctx, g, None, None, None)


@torch.library.custom_op("deepspeed_fused::lce_forward", mutates_args=())
def _lce_forward_op(hidden: T, weight: T, target: T, bias: Optional[T], temp: Optional[T], inv_temp: float,
                    ignore_index: int, z_loss: float, smoothing: float, softcap: float, accum_fp32: bool,
                    chunk: int, need_ent: bool) -> tuple[T, T, T]:
    return _forward_impl(hidden, weight, target, bias, temp, inv_temp, ignore_index, z_loss, smoothing, softcap,
                         chunk, need_ent)


@_lce_forward_op.register_fake
def _(hidden, weight, target, bias, temp, inv_temp, ignore_index, z_loss, smoothing, softcap, accum_fp32, chunk,
      need_ent):
    M = hidden.shape[0]
    f = dict(dtype=torch.float32)
    return hidden.new_empty(M, **f), hidden.new_empty(M, **f), hidden.new_empty(M if need_ent else 0, **f)


@torch.library.custom_op("deepspeed_fused::lce_backward", mutates_args=())
def _lce_backward_op(hidden: T, weight: T, target: T, bias: Optional[T], temp: Optional[T], lse: T, ent: T,
                     g_loss: Optional[T], g_ent: Optional[T], g_lse: Optional[T], inv_temp: float,
                     ignore_index: int, z_loss: float, smoothing: float, softcap: float, accum_fp32: bool,
                     chunk: int, need_dh: bool, need_dw: bool, need_db: bool) -> tuple[T, T, T]:
    return _backward_impl(hidden, weight, target, bias, temp, lse, ent, g_loss, g_ent, g_lse, inv_temp,
                          ignore_index, z_loss, smoothing, softcap, accum_fp32, chunk, need_dh, need_dw, need_db)


@_lce_backward_op.register_fake
def _(hidden, weight, target, bias, temp, lse, ent, g_loss, g_ent, g_lse, inv_temp, ignore_index, z_loss,
      smoothing, softcap, accum_fp32, chunk, need_dh, need_dw, need_db):
    return (torch.empty_like(hidden) if need_dh else hidden.new_empty(0),
            torch.empty_like(weight) if need_dw else hidden.new_empty(0),
            torch.empty_like(bias) if need_db else hidden.new_empty(0))


def _forward_setup(ctx, inputs, output):
    hidden, weight, target, bias, temp, inv_temp, ignore_index, z_loss, smoothing, softcap, accum_fp32, chunk, \
        need_ent = inputs
    _, lse, ent = output
    ctx.has_bias = bias is not None
    ctx.has_temp = temp is not None
    ctx.args = (inv_temp, ignore_index, z_loss, smoothing, softcap, accum_fp32, chunk)
    ctx.need_ent = need_ent
    ctx.save_for_backward(hidden, weight, target, bias, temp, lse, ent)


def _forward_backward(ctx, g_loss, g_lse, g_ent):
    hidden, weight, target, bias, temp, lse, ent = ctx.saved_tensors
    need_dh, need_dw, _, need_db = ctx.needs_input_grad[:4]
    if not (need_dh or need_dw or need_db):
        return (None,) * 13
    if not ctx.need_ent:
        g_ent = None
    dh, dw, db = _lce_backward_op(hidden, weight, target, bias, temp, lse, ent, g_loss, g_ent, g_lse,
                                  *ctx.args, need_dh, need_dw, bool(need_db and ctx.has_bias))
    return (dh if need_dh else None, dw if need_dw else None, None,
            db if need_db and ctx.has_bias else None) + (None,) * 9


_lce_forward_op.register_autograd(_forward_backward, setup_context=_forward_setup)


# ----------------------------------------------------------------------------------------
# Argument checks and the torch reference
# ----------------------------------------------------------------------------------------

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(hidden, weight, target, bias, ignore_index, reduction, temperature, z_loss, label_smoothing, softcap,
           accum_dtype, chunk_tokens, tp_group):
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise TypeError("linear_cross_entropy: `hidden` must be a tensor [..., H]")
    if hidden.dtype not in _FLOATS:
        raise TypeError(f"linear_cross_entropy: `hidden` must be float16/bfloat16/float32/float64, got {hidden.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("linear_cross_entropy: `weight` must be a 2-D tensor [V, H]")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_cross_entropy: `weight` is {tuple(weight.shape)}, expected [V, {hidden.shape[-1]}] "
                         f"(hidden's last dimension)")
    if weight.shape[0] < 1:
        raise ValueError("linear_cross_entropy: `weight` has an empty vocabulary")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"linear_cross_entropy: `weight` dtype {weight.dtype} differs from `hidden` dtype {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"linear_cross_entropy: `weight` is on {weight.device}, `hidden` on {hidden.device}")
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8,
                                                                     torch.int8):
        raise TypeError("linear_cross_entropy: `target` must be an integer tensor")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"linear_cross_entropy: `target` shape {tuple(target.shape)} must equal hidden.shape[:-1] "
                         f"= {tuple(hidden.shape[:-1])}")
    if target.device != hidden.device:
        raise ValueError(f"linear_cross_entropy: `target` is on {target.device}, `hidden` on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"linear_cross_entropy: `bias` must be a tensor [{weight.shape[0]}]")
        if bias.dtype != weight.dtype or bias.device != weight.device:
            raise TypeError("linear_cross_entropy: `bias` must have the dtype and device of `weight`")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError("linear_cross_entropy: `ignore_index` must be an int")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"linear_cross_entropy: `reduction` must be 'mean', 'sum' or 'none', got {reduction!r}")
    if isinstance(temperature, torch.Tensor):
        if tuple(temperature.shape) != tuple(target.shape):
            raise ValueError(f"linear_cross_entropy: per-token `temperature` shape {tuple(temperature.shape)} must "
                             f"equal target's {tuple(target.shape)}")
        if not temperature.is_floating_point():
            raise TypeError("linear_cross_entropy: `temperature` tensor must be floating point")
        if temperature.device != hidden.device:
            raise ValueError("linear_cross_entropy: `temperature` must be on hidden's device")
    elif isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"linear_cross_entropy: `temperature` must be a float > 0 or a tensor, got {temperature!r}")
    for name, v in (("z_loss", z_loss), ("label_smoothing", label_smoothing)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"linear_cross_entropy: `{name}` must be a float >= 0, got {v!r}")
    if label_smoothing >= 1:
        raise ValueError(f"linear_cross_entropy: `label_smoothing` must be < 1, got {label_smoothing!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not (softcap > 0 and math.isfinite(softcap))):
        raise ValueError(f"linear_cross_entropy: `softcap` must be None or a float > 0, got {softcap!r}")
    if accum_dtype in (None, "auto", weight.dtype):
        accum_fp32 = False
    elif accum_dtype in (torch.float32, "fp32", "float32"):
        accum_fp32 = True
    else:
        raise ValueError(f"linear_cross_entropy: `accum_dtype` must be None ('auto') or torch.float32, "
                         f"got {accum_dtype!r}")
    if chunk_tokens not in (None, "auto") and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                               or chunk_tokens < 1):
        raise ValueError(f"linear_cross_entropy: `chunk_tokens` must be a positive int or None, got {chunk_tokens!r}")
    return accum_fp32


def _check_values(target, temperature, V, ignore_index):
    """Targets in [0, V) or ignore_index, temperatures > 0: one device reduction, one sync."""
    t = target
    bad_t = ((t != ignore_index) & ((t < 0) | (t >= V))).any()
    if isinstance(temperature, torch.Tensor):
        bad_temp = ~(temperature > 0).all()
        flags = torch.stack([bad_t, bad_temp]).tolist()
    else:
        flags = [bool(bad_t), False]
    if flags[0]:
        raise ValueError(f"linear_cross_entropy: `target` has values outside [0, {V}) other than "
                         f"ignore_index={ignore_index}")
    if flags[1]:
        raise ValueError("linear_cross_entropy: `temperature` tensor has values <= 0")


def auto_chunk_tokens(V: int, dtype: torch.dtype, tokens: int, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> int:
    """Tokens per chunk so the ``chunk x V`` logits workspace fits ``workspace_bytes``.

    A multiple of 128 where possible, and balanced: the fewest chunks, of near-equal size
    (no small ragged last chunk for the GEMMs).
    """
    cmax = workspace_bytes // max(1, V * dtype.itemsize)
    if cmax >= 128:
        cmax = cmax // 128 * 128
    cmax = max(1, cmax)
    tokens = max(tokens, 1)
    if tokens <= cmax:
        return int(tokens)
    n = -(-tokens // cmax)
    c = -(-tokens // n)
    c128 = -(-c // 128) * 128
    return int(c128 if c128 <= cmax else c)


def _ref_chunk(h, weight, bias, t, temp, temperature, ignore_index, z_loss, smoothing, softcap, need_ent):
    logits = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(cdt)
    z = z / temp.to(cdt)[:, None] if temp is not None else z / temperature
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    lse = torch.logsumexp(z, dim=-1)
    valid = t != ignore_index
    zt = z.gather(1, torch.where(valid, t, torch.zeros_like(t)).long()[:, None]).squeeze(1)
    loss = lse - (1.0 - smoothing) * zt
    if smoothing:
        loss = loss - smoothing * z.mean(-1)
    if z_loss:
        loss = loss + z_loss * lse * lse
    loss = torch.where(valid, loss, torch.zeros_like(loss))
    ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1) if need_ent else lse.new_empty(0)
    return loss, lse, ent


def _reference_impl(h, weight, t, bias, temp, temperature, ignore_index, z_loss, smoothing, softcap, chunk,
                    need_ent):
    M = h.shape[0]
    outs = []
    ckpt = torch.is_grad_enabled() and M > chunk and not torch.compiler.is_compiling()
    for s in range(0, max(M, 1), chunk):
        e = min(M, s + chunk)
        args = (h[s:e], weight, bias, t[s:e], None if temp is None else temp[s:e], temperature, ignore_index,
                z_loss, smoothing, softcap, need_ent)
        if ckpt:
            outs.append(torch.utils.checkpoint.checkpoint(_ref_chunk, *args, use_reentrant=False))
        else:
            outs.append(_ref_chunk(*args))
    loss, lse, ent = (torch.cat([o[i] for o in outs]) for i in range(3))
    return loss, lse, (ent if need_ent else None)


def _pack(loss_tok, lse, ent, valid, shape, reduction, return_entropy, return_lse):
    if reduction == "none":
        loss = loss_tok.reshape(shape)
    else:
        loss = loss_tok.sum()
        if reduction == "mean":
            loss = loss / valid.sum().clamp(min=1).to(loss.dtype)
    if not (return_entropy or return_lse):
        return loss
    out = [loss]
    if return_entropy:
        out.append(ent.reshape(shape))
    if return_lse:
        out.append(lse.reshape(shape))
    return tuple(out)


def _prepare(hidden, weight, target, bias, ignore_index, reduction, temperature, z_loss, label_smoothing, softcap,
             accum_dtype, chunk_tokens, validate_targets, tp_group, vocab_start=None, sequence_parallel=False):
    accum_fp32 = _check(hidden, weight, target, bias, ignore_index, reduction, temperature, z_loss, label_smoothing,
                        softcap, accum_dtype, chunk_tokens, tp_group)
    tp = _tp_setup(tp_group, vocab_start, weight.shape[0])
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"linear_cross_entropy: `sequence_parallel` must be a bool, got {sequence_parallel!r}")
    if sequence_parallel and tp is None:
        raise ValueError("linear_cross_entropy: `sequence_parallel=True` needs a `tp_group` of more than one rank "
                         "(hidden/target are then this rank's token shard of the group's sequence)")
    V, H = weight.shape
    if validate_targets and target.numel() and tp is None:  # TP: checked against the global V after the gather
        _check_values(target, temperature, V, ignore_index)
    h = hidden.reshape(-1, H)
    t = target.reshape(-1)
    temp = temperature.reshape(-1) if isinstance(temperature, torch.Tensor) else None
    return accum_fp32, h, t, temp, tp


# ----------------------------------------------------------------------------------------
# Vocabulary-parallel form over a tensor-parallel group
# ----------------------------------------------------------------------------------------
#
# Each rank holds weight rows [vocab_start, vocab_start + V_local). Forward: the local shard's
# per-token partial statistics (the same fused pass as above), then ONE all-gather of a packed
# fp32 tensor [M + 3, 5]: the statistics plus three rows of metadata (shard bounds, dtype,
# options) so the layout is validated by the same collective, then a local merge: every rank
# computes bitwise the same loss / lse / entropy. Backward: dweight (and dbias) stay local,
# dhidden partials are summed with one all-reduce, started asynchronously so it overlaps the
# last dweight GEMM (on CUDA NCCL runs it on its own stream).

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


def _ref_partial_chunk(h, weight, bias, t, temp, temperature, ignore_index, softcap, vocab_start, need_ent,
                       need_sumz):
    """Torch version of the kernel's partial statistics [rows, 5] for a vocabulary shard.

    The running max m is detached: (m, d, a) represent the same values for any m, so the
    gradient is exact without flowing through the max."""
    logits = h @ weight.t() if bias is None else torch.addmm(bias, h, weight.t())
    cdt = torch.float64 if logits.dtype == torch.float64 else torch.float32
    z = logits.to(cdt)
    z = z / temp.to(cdt)[:, None] if temp is not None else z / temperature
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    m = z.amax(-1).detach()
    zm = z - m[:, None]
    e = torch.exp(zm)
    d = e.sum(-1)
    a = (e * zm).sum(-1) if need_ent else torch.zeros_like(d)
    sz = z.sum(-1) if need_sumz else torch.zeros_like(d)
    lt = t.long() - vocab_start
    ins = (t != ignore_index) & (lt >= 0) & (lt < z.shape[1])
    zt = z.gather(1, torch.where(ins, lt, torch.zeros_like(lt))[:, None]).squeeze(1)
    zt = torch.where(ins, zt, torch.zeros_like(zt))
    return torch.stack([m, d, a, sz, zt], dim=-1)


def _reference_tp(h, weight, t, bias, temp, temperature, ignore_index, z_loss, smoothing, softcap, chunk, need_ent,
                  tp, meta, validate, accum_fp32, sp=False):
    """Reference over a tensor-parallel group: local partial statistics (autograd), the same
    all-gather and merge as the kernels; the other ranks' statistics are constants here, and
    dhidden is summed over the group by _CopyToGroup (by _SeqGather's reduce-scatter under
    sequence parallelism, where ``h`` is already the group's gathered tokens)."""
    M = h.shape[0]
    if h.requires_grad and not sp:
        h = _CopyToGroup.apply(h, tp.group, accum_fp32)
    ckpt = torch.is_grad_enabled() and M > chunk and not torch.compiler.is_compiling()
    parts = []
    for s in range(0, max(M, 1), chunk):
        e = min(M, s + chunk)
        args = (h[s:e], weight, bias, t[s:e], None if temp is None else temp[s:e], temperature, ignore_index,
                softcap, tp.start, need_ent, bool(smoothing))
        if ckpt:
            parts.append(torch.utils.checkpoint.checkpoint(_ref_partial_chunk, *args, use_reentrant=False))
        else:
            parts.append(_ref_partial_chunk(*args))
    stats = torch.cat(parts)
    packed = _tp_pack(M, meta, stats.dtype, stats.device, stats.detach())
    gathered, V_total = _tp_exchange(packed, M, meta, tp, validate, t, temp, ignore_index)
    shards = list(gathered.unbind(0))
    shards[tp.rank] = stats  # the local shard, differentiable (bitwise the gathered values)
    return _finalize_stats(merge_partial_stats(torch.stack(shards)), t != ignore_index, V_total, z_loss, smoothing,
                           need_ent)


def linear_cross_entropy_reference(hidden, weight, target, *, bias=None, ignore_index=-100, reduction="mean",
                                   temperature=1.0, return_entropy=False, return_lse=False, z_loss=0.0,
                                   label_smoothing=0.0, softcap=None, accum_dtype=None, chunk_tokens=None,
                                   validate_targets=True, tp_group=None, vocab_start=None, sequence_parallel=False):
    """Plain torch version of :func:`linear_cross_entropy` (same API and semantics).

    Chunked over tokens (each chunk checkpointed when gradients are on), math in fp32
    (float64 for float64 inputs); autograd does the gradients. ``accum_dtype`` is ignored
    (except that, with a ``tp_group``, fp32 makes the dhidden all-reduce run in fp32).
    With a ``tp_group`` it computes the same partial statistics of the local vocabulary
    shard as the kernels and combines them with the same single all-gather and merge
    (``sequence_parallel``: after the same all-gather of the token shards as the kernels).
    """
    accum_fp32, h, t, temp, tp = _prepare(hidden, weight, target, bias, ignore_index, reduction, temperature, z_loss,
                                          label_smoothing, softcap, accum_dtype, chunk_tokens, validate_targets,
                                          tp_group, vocab_start, sequence_parallel)
    temperature_f = None if temp is not None else float(temperature)
    if tp is not None:
        meta = _tp_meta_rows(tp, weight, h, reduction, temp, temperature, ignore_index, z_loss, label_smoothing,
                             softcap, return_entropy, return_lse, bias, accum_fp32)
        temp = None if temp is None else temp.detach()
        if sequence_parallel:
            h, t, temp = _sp_gather(h, t, temp, tp, accum_fp32)
        chunk = chunk_tokens if isinstance(chunk_tokens, int) else auto_chunk_tokens(weight.shape[0], torch.float32,
                                                                                     h.shape[0])
        loss, lse, ent = _reference_tp(h, weight, t, bias, temp, temperature_f, ignore_index, float(z_loss),
                                       float(label_smoothing), softcap, chunk, bool(return_entropy), tp, meta,
                                       validate_targets, accum_fp32, sequence_parallel)
        if sequence_parallel:
            loss, lse, ent = _sp_local(tp, loss, lse, ent, reduction, return_entropy, return_lse)
        return _pack(loss, lse, ent, t != ignore_index, target.shape, reduction, return_entropy, return_lse)
    chunk = chunk_tokens if isinstance(chunk_tokens, int) else auto_chunk_tokens(weight.shape[0], torch.float32,
                                                                                 h.shape[0])
    loss, lse, ent = _reference_impl(h, weight, t, bias, None if temp is None else temp.detach(), temperature_f,
                                     ignore_index, float(z_loss), float(label_smoothing), softcap, chunk,
                                     return_entropy)
    return _pack(loss, lse, ent, t != ignore_index, target.shape, reduction, return_entropy, return_lse)


def linear_cross_entropy(hidden, weight, target, *, bias=None, ignore_index=-100, reduction="mean", temperature=1.0,
                         return_entropy=False, return_lse=False, z_loss=0.0, label_smoothing=0.0, softcap=None,
                         accum_dtype=None, chunk_tokens=None, validate_targets=True, tp_group=None,
                         vocab_start=None, sequence_parallel=False):
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``target`` without materializing logits.

    Args:
        hidden: [..., H] float16/bfloat16/float32 (float64 runs the reference).
        weight: [V, H], same dtype and device as ``hidden``. bias: optional [V].
        target: integer tensor of shape hidden.shape[:-1]; ``ignore_index`` rows give loss 0
            and no loss gradient.
        reduction: "mean" (over non-ignored tokens, on device; all ignored gives 0),
            "sum", or "none" (per-token fp32 losses shaped like ``target``).
        temperature: float > 0, or a tensor shaped like ``target`` (per token; treated as a
            constant, no gradient).
        return_entropy / return_lse: also return per-token fp32 entropy of softmax(logits) /
            logsumexp(logits), differentiable, computed for every token (ignored ones too).
        z_loss: adds ``z_loss * lse**2`` per token. label_smoothing: as torch's cross_entropy.
        softcap: logits -> softcap * tanh(logits / softcap) (after the temperature).
        accum_dtype: None (dweight partial sums across chunks kept in the weight's dtype) or
            torch.float32 (fp32 accumulator: more memory).
        chunk_tokens: tokens per chunk (None: the ``chunk x V`` logits workspace stays
            <= 480 MiB, so all extra memory stays under 512 MiB).
        validate_targets: check targets and temperatures (one host sync). False makes the
            call free of host synchronization (CUDA-graph capturable).
        tp_group: a torch.distributed process group over which the vocabulary is split
            (Megatron-style vocab-parallel head): ``weight``/``bias`` hold this rank's rows
            ``[vocab_start, vocab_start + V_local)`` and ``target`` holds global ids, the same
            ``hidden``/``target`` on every rank. Outputs are those of the full head, identical
            on every rank; dweight stays local, dhidden is summed over the group. Forward
            issues one all-gather; backward one all-reduce (of dhidden). A group of size 1
            (or None) is the single-GPU op.
        vocab_start: first global vocabulary row of this rank's shard (default
            ``rank * V_local``: equal shards); give it for ragged shards. Only with ``tp_group``.
        sequence_parallel: only with a ``tp_group`` of more than one rank: ``hidden``,
            ``target`` (and a per-token ``temperature``) are this rank's contiguous token shard
            of the group's tokens (flattened rows ordered by rank, Megatron-style), equal in
            size on every rank. The op all-gathers them (forward: two all-gathers in all),
            returns per-token outputs for the local shard ("mean"/"sum": the scalar over all
            the group's tokens, identical on every rank) and reduce-scatters dhidden instead
            of the all-reduce. Per-token outputs all-gather their upstream gradients in backward.

    Returns:
        ``loss`` alone, or the tuple ``(loss, entropy, lse)`` restricted to what was asked,
        in that order (e.g. ``(loss, lse)`` with only ``return_lse``).

    Note: the scalar-loss path ("mean"/"sum" without entropy/lse) forms the gradients in the
    forward and scales them in place in backward: do not backward through it twice.
    """
    accum_fp32, h, t, temp, tp = _prepare(hidden, weight, target, bias, ignore_index, reduction, temperature, z_loss,
                                          label_smoothing, softcap, accum_dtype, chunk_tokens, validate_targets,
                                          tp_group, vocab_start, sequence_parallel)
    M = h.shape[0]
    V = weight.shape[0]
    ok, reason = kernel_device_ok(hidden)
    if ok and hidden.dtype not in _KERNEL_DTYPES:
        ok, reason = False, f"dtype {hidden.dtype} (kernels take float16/bfloat16/float32)"
    if not ok or M == 0:
        if M:
            warn_fallback(_OP, reason)
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
                             return_entropy, return_lse, bias, accum_fp32)
        if sequence_parallel:
            h, t, temp = _sp_gather(h, t, temp, tp, accum_fp32)
            M = h.shape[0]
    chunk = chunk_tokens if isinstance(chunk_tokens, int) else auto_chunk_tokens(V, hidden.dtype, M)
    chunk = min(chunk, M)
    if tp is not None:
        cfg = _TPConfig(tp, meta, inv_temp, ignore_index, z_loss, smoothing, cap, accum_fp32, chunk,
                        bool(validate_targets), reduction == "mean", bool(return_entropy), sequence_parallel)
        if grads and reduction != "none" and not (return_entropy or return_lse):
            return _tp_apply(_TPScalarLoss, h, weight, bias, t, temp, cfg)
        loss, lse, ent = _tp_apply(_TPPerToken, h, weight, bias, t, temp, cfg)
        if sequence_parallel:
            loss, lse, ent = _sp_local(tp, loss, lse, ent, reduction, return_entropy, return_lse)
        return _pack(loss, lse, ent, t != ignore_index, target.shape, reduction, return_entropy, return_lse)
    if grads and reduction != "none" and not (return_entropy or return_lse):
        args = (h, weight, t, bias, temp, inv_temp, ignore_index, reduction == "mean", z_loss, smoothing, cap,
                accum_fp32, chunk, need_dh, need_dw, need_db)
        if torch.compiler.is_compiling():
            return _lce_fused_op(*args)[0]
        return _FusedScalarLoss.apply(*args)
    loss, lse, ent = _lce_forward_op(h, weight, t, bias, temp, inv_temp, ignore_index, z_loss, smoothing, cap,
                                     accum_fp32, chunk, bool(return_entropy))
    return _pack(loss, lse, ent, t != ignore_index, target.shape, reduction, return_entropy, return_lse)
