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
    buf = hidden.new_empty((min(chunk, M), V))
    for s in range(0, M, chunk):
        e = min(M, s + chunk)
        x, h = buf[: e - s], hidden[s:e]
        _logits_into(h, weight, bias, x)
        _launch_rows(x, target[s:e], stats=stats[s:e], g_loss=w1, per_token=False,
                     **_kw(None if temp is None else temp[s:e], inv_temp, ignore_index, z_loss, smoothing, softcap))
        if need_dh:
            torch.mm(x, weight, out=dh[s:e])
        pg.add(x, h)
    del buf
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
    buf = hidden.new_empty((min(chunk, M), V))
    for s in range(0, M, chunk):
        e = min(M, s + chunk)
        x = buf[: e - s]
        _logits_into(hidden[s:e], weight, bias, x)
        _launch_rows(x, target[s:e], stats=stats[s:e], need_ent=need_ent,
                     **_kw(None if temp is None else temp[s:e], inv_temp, ignore_index, z_loss, smoothing, softcap))
    del buf
    valid = target != ignore_index
    loss, lse, ent = _finalize_stats(stats, valid, V, z_loss, smoothing, need_ent)
    return loss, lse, ent if need_ent else hidden.new_empty(0, dtype=torch.float32)


def _backward_impl(hidden, weight, target, bias, temp, lse, ent, g_loss, g_ent, g_lse, inv_temp, ignore_index,
                   z_loss, smoothing, softcap, accum_fp32, chunk, need_dh, need_dw, need_db):
    """Recompute the chunk logits, turn them into dlogits from per-token upstream gradients."""
    M = hidden.shape[0]
    V = weight.shape[0]
    if g_loss is None:
        g_loss = torch.zeros(M, dtype=torch.float32, device=hidden.device)
    g_loss = g_loss.float().contiguous()
    g_ent = None if g_ent is None else g_ent.float().contiguous()
    g_lse = None if g_lse is None else g_lse.float().contiguous()
    dh = torch.empty_like(hidden) if need_dh else hidden.new_empty(0)
    pg = _ParamGrads(weight, bias, accum_fp32, need_dw, need_db)
    buf = hidden.new_empty((min(chunk, M), V))
    for s in range(0, M, chunk):
        e = min(M, s + chunk)
        x, h = buf[: e - s], hidden[s:e]
        _logits_into(h, weight, bias, x)
        _launch_rows(x, target[s:e], lse=lse[s:e], ent=None if g_ent is None else ent[s:e],
                     g_loss=g_loss[s:e], g_ent=None if g_ent is None else g_ent[s:e],
                     g_lse=None if g_lse is None else g_lse[s:e], per_token=True,
                     **_kw(None if temp is None else temp[s:e], inv_temp, ignore_index, z_loss, smoothing, softcap))
        if need_dh:
            torch.mm(x, weight, out=dh[s:e])
        pg.add(x, h)
    del buf
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
    ctx.save_for_backward(dh, dw, db)


def _fused_backward(ctx, g, _gdh, _gdw, _gdb):
    # The gradients were formed in the forward; scale them in place (no second copy of
    # dweight). A second backward through the same graph (retain_graph=True) then fails
    # loudly in autograd's saved-tensor version check instead of reusing scaled values.
    dh, dw, db = ctx.saved_tensors
    need_dh, need_dw, need_db = ctx.needs
    return (dh.mul_(g) if need_dh else None, dw.mul_(g) if need_dw else None, None,
            db.mul_(g) if need_db else None) + (None,) * 12


_lce_fused_op.register_autograd(_fused_backward, setup_context=_fused_setup)


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
    if tp_group is not None:
        import torch.distributed as dist

        if dist.get_world_size(tp_group) > 1:
            raise NotImplementedError("linear_cross_entropy: `tp_group` with more than one rank is not supported yet")
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
    """Tokens per chunk so the ``chunk x V`` logits workspace fits ``workspace_bytes``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    c = workspace_bytes // max(1, V * itemsize)
    if c >= 128:
        c = c // 128 * 128
    return int(max(1, min(c, max(tokens, 1))))


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
             accum_dtype, chunk_tokens, validate_targets, tp_group):
    accum_fp32 = _check(hidden, weight, target, bias, ignore_index, reduction, temperature, z_loss, label_smoothing,
                        softcap, accum_dtype, chunk_tokens, tp_group)
    V, H = weight.shape
    if validate_targets and target.numel():
        _check_values(target, temperature, V, ignore_index)
    h = hidden.reshape(-1, H)
    t = target.reshape(-1)
    temp = temperature.reshape(-1) if isinstance(temperature, torch.Tensor) else None
    return accum_fp32, h, t, temp


def linear_cross_entropy_reference(hidden, weight, target, *, bias=None, ignore_index=-100, reduction="mean",
                                   temperature=1.0, return_entropy=False, return_lse=False, z_loss=0.0,
                                   label_smoothing=0.0, softcap=None, accum_dtype=None, chunk_tokens=None,
                                   validate_targets=True, tp_group=None):
    """Plain torch version of :func:`linear_cross_entropy` (same API and semantics).

    Chunked over tokens (each chunk checkpointed when gradients are on), math in fp32
    (float64 for float64 inputs); autograd does the gradients. ``accum_dtype`` is ignored.
    """
    _, h, t, temp = _prepare(hidden, weight, target, bias, ignore_index, reduction, temperature, z_loss,
                             label_smoothing, softcap, accum_dtype, chunk_tokens, validate_targets, tp_group)
    chunk = chunk_tokens if isinstance(chunk_tokens, int) else auto_chunk_tokens(weight.shape[0], torch.float32,
                                                                                 h.shape[0])
    temperature_f = None if temp is not None else float(temperature)
    loss, lse, ent = _reference_impl(h, weight, t, bias, None if temp is None else temp.detach(), temperature_f,
                                     ignore_index, float(z_loss), float(label_smoothing), softcap, chunk,
                                     return_entropy)
    return _pack(loss, lse, ent, t != ignore_index, target.shape, reduction, return_entropy, return_lse)


def linear_cross_entropy(hidden, weight, target, *, bias=None, ignore_index=-100, reduction="mean", temperature=1.0,
                         return_entropy=False, return_lse=False, z_loss=0.0, label_smoothing=0.0, softcap=None,
                         accum_dtype=None, chunk_tokens=None, validate_targets=True, tp_group=None):
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
        tp_group: a process group of size 1 (or None); larger groups are not supported yet.

    Returns:
        ``loss`` alone, or the tuple ``(loss, entropy, lse)`` restricted to what was asked,
        in that order (e.g. ``(loss, lse)`` with only ``return_lse``).

    Note: the scalar-loss path ("mean"/"sum" without entropy/lse) forms the gradients in the
    forward and scales them in place in backward: do not backward through it twice.
    """
    accum_fp32, h, t, temp = _prepare(hidden, weight, target, bias, ignore_index, reduction, temperature, z_loss,
                                      label_smoothing, softcap, accum_dtype, chunk_tokens, validate_targets, tp_group)
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
            label_smoothing=label_smoothing, softcap=softcap, chunk_tokens=chunk_tokens, validate_targets=False)
    chunk = chunk_tokens if isinstance(chunk_tokens, int) else auto_chunk_tokens(V, hidden.dtype, M)
    chunk = min(chunk, M)
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
    if grads and reduction != "none" and not (return_entropy or return_lse):
        loss, *_ = _lce_fused_op(h, weight, t, bias, temp, inv_temp, ignore_index, reduction == "mean", z_loss,
                                 smoothing, cap, accum_fp32, chunk, need_dh, need_dw, need_db)
        return loss
    loss, lse, ent = _lce_forward_op(h, weight, t, bias, temp, inv_temp, ignore_index, z_loss, smoothing, cap,
                                     accum_fp32, chunk, bool(return_entropy))
    return _pack(loss, lse, ent, t != ignore_index, target.shape, reduction, return_entropy, return_lse)
