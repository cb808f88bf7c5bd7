"""The chunk loops of the fused linear cross-entropy, shared by the single-GPU op (:mod:`.single`)
and the tensor-parallel form (:mod:`.parallel`).

Per chunk, cuBLAS writes the chunk's logits into one reused workspace (:class:`_ChunkBuffers`,
:func:`_logit_chunks` over tokens, :func:`_vocab_chunks` over vocabulary rows) and the row
kernel (:mod:`.kernels.row`) walks each row; where the fused GEMMs run (:mod:`.kernels.gemm`:
Hopper, fp16/bf16) the statistics or dlogits come from the GEMM's epilogue instead
(:func:`_fused_stats`, :func:`_vocab_grad_chunks`). The dhidden / dweight GEMMs
(:func:`_dhidden_into`, :class:`_ParamGrads`), the per-token backward over vocabulary chunks
(:func:`_backward_vocab_chunks`) and the in-place scaling of the scalar loss's forward-formed
gradients (:func:`_scale_formed_grads`) complete the set.
"""
import warnings
from typing import NamedTuple, Optional

import torch

from .launch import gemm_grad, gemm_grad_supported, gemm_stats, gemm_stats_supported
from .launch import _launch_rows
from .launch import _scale_masked_torch_, _scale_unless_one_
from .sizing import _fp32_logits_failed, fp32_logits


class _ChunkBuffers:
    """A chunk's workspace: the logits ``[rows, cols]`` (fp32 when :func:`fp32_logits`, else the
    input dtype) and where the row kernel writes dlogits for the GEMMs that follow: the logits
    themselves (in place), or, for fp32 logits, a second ``[rows, cols]`` buffer in the input dtype.
    Flat storage: ``views(n, c)`` gives contiguous ``[n, c]`` blocks of it (a smaller last chunk of
    tokens or of the vocabulary), so cuBLAS writes them in place."""

    __slots__ = ("logits", "grad")

    def __init__(self, hidden, rows, cols, softcap, grad):
        fp32 = fp32_logits(hidden.dtype, softcap)
        self.logits = hidden.new_empty(rows * cols, dtype=torch.float32 if fp32 else hidden.dtype)
        self.grad = hidden.new_empty(rows * cols) if (fp32 and grad) else self.logits

    def views(self, n, c):
        return self.logits[:n * c].view(n, c), self.grad[:n * c].view(n, c)


def _logits_into(h, weight, bias, out):
    if out.dtype != h.dtype:  # fp32 logits of half inputs
        _logits_fp32_into(h, weight, bias, out)
    elif bias is None:
        torch.mm(h, weight.t(), out=out)
    else:
        torch.addmm(bias, h, weight.t(), out=out)


def _logits_fp32_into(h, weight, bias, out):
    """out (fp32) = h @ weight.T (+ bias), the GEMM accumulating in fp32 and writing fp32."""
    if not out.is_cuda:  # CPU (the Triton interpreter's tests): fp32 copies, small shapes
        torch.mm(h.float(), weight.t().float(), out=out)
    else:
        try:
            torch.mm(h, weight.t(), torch.float32, out=out)
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError) as e:
            # this call's buffers are already fp32: rounded logits in them (eager's accuracy)
            _fp32_logits_failed()
            warnings.warn("deepspeed_fused.linear_cross_entropy: cuBLAS could not write fp32 logits of "
                          f"{h.dtype} inputs ({type(e).__name__}: {str(e).splitlines()[0][:200]}); with a soft "
                          "cap the logits are now rounded to the input dtype first, as in eager PyTorch",
                          RuntimeWarning, stacklevel=2)
            out.copy_(torch.mm(h, weight.t()))
    if bias is not None:
        out.add_(bias)


_FP32_LOGITS_PROBED = [False]


def _fp32_logits_probed(hidden, weight, softcap) -> bool:
    """:func:`fp32_logits`, after trying the fp32-output GEMM once in this process (a 1 x 1 product)
    when it would be used: a forward that forms its statistics without cuBLAS (the fused GEMM)
    must take the logits as the backward's cuBLAS GEMM will, and a torch without ``mm``'s
    ``out_dtype`` is found (one warning) before the forward rather than in the backward."""
    if fp32_logits(hidden.dtype, softcap) and hidden.is_cuda and not _FP32_LOGITS_PROBED[0]:
        _FP32_LOGITS_PROBED[0] = True
        _logits_fp32_into(hidden[:1], weight[:1], None, hidden.new_empty((1, 1), dtype=torch.float32))
    return fp32_logits(hidden.dtype, softcap)


def _dhidden_into(dlogits, weight, out):
    torch.mm(dlogits, weight, out=out)


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
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, TypeError):
            _FP32_OUT_DTYPE_OK[0] = False
    acc.add_(torch.mm(a, b))


def _mm_sum(acc, a, b, fp32):
    """``acc + a @ b``, with ``acc`` None for the first term of a sum over chunks: in fp32
    (``fp32``: a zero-started fp32 accumulator, each product formed in fp32 by cuBLAS) or in the
    operands' dtype (the first product one GEMM, the next ones added by ``addmm_``)."""
    if fp32:
        if acc is None:
            acc = torch.zeros((a.shape[0], b.shape[1]), dtype=torch.float32, device=a.device)
        _addmm_fp32_(acc, a, b)
        return acc
    return torch.mm(a, b) if acc is None else acc.addmm_(a, b)


class _ParamGrads:
    """dweight / dbias accumulated over token chunks."""

    def __init__(self, weight, bias, accum_fp32, need_dw, need_db):
        self.weight, self.bias = weight, bias
        self.fp32 = accum_fp32 and weight.dtype != torch.float32
        self.need_dw, self.need_db = need_dw, need_db
        self.dw = self.db = None

    def add(self, dlogits, h):
        if self.need_dw:
            self.dw = _mm_sum(self.dw, dlogits.t(), h, self.fp32)
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


def _logit_chunks(hidden, weight, bias, chunk, softcap, grad):
    """Yield ``(s, e, logits, dlogits, hidden[s:e])`` per token chunk; the chunk logits are written
    into one reused workspace (:class:`_ChunkBuffers`, the op's whole workspace; ``dlogits`` is
    where the row kernel writes the gradient when ``grad``), freed when the loop ends."""
    M, V = hidden.shape[0], weight.shape[0]
    buf = _ChunkBuffers(hidden, min(chunk, M), V, softcap, grad)
    for s in range(0, M, chunk):
        e = min(M, s + chunk)
        (x, g), h = buf.views(e - s, V), hidden[s:e]
        _logits_into(h, weight, bias, x)
        yield s, e, x, g, h


def _vocab_chunks(hidden, weight, bias, vchunk, softcap, grad):
    """Yield ``(v0, v1, logits, dlogits)`` per vocabulary chunk ``[v0, v1)``: the logits of every
    token against those vocabulary rows, ``[M, v1 - v0]``, in one reused workspace (as
    :func:`_logit_chunks`). Each chunk reads all of ``hidden`` and its own rows of ``weight``, so
    the weight is read once in all (token chunks read all of it per chunk): the better split
    when there are fewer tokens than vocabulary rows (see ``sizing._vocab_chunk``)."""
    M, V = hidden.shape[0], weight.shape[0]
    buf = _ChunkBuffers(hidden, M, min(vchunk, V), softcap, grad)
    for v0 in range(0, V, vchunk):
        v1 = min(V, v0 + vchunk)
        x, g = buf.views(M, v1 - v0)
        _logits_into(hidden, weight[v0:v1], None if bias is None else bias[v0:v1], x)
        yield v0, v1, x, g


class _Upstream(NamedTuple):
    """What the per-token backward forms dlogits from, fp32 per token: the forward's ``lse``, its
    entropy ``ent`` (None unless the entropy has an upstream gradient), and the upstream
    gradients of the loss, the entropy and the lse (``g_ent`` / ``g_lse`` None: none). Its fields
    are the keyword arguments of the row kernel's and the fused GEMM's gradient passes."""

    lse: torch.Tensor
    ent: Optional[torch.Tensor]
    g_loss: torch.Tensor
    g_ent: Optional[torch.Tensor]
    g_lse: Optional[torch.Tensor]

    @classmethod
    def of(cls, lse, ent, g_loss, g_ent, g_lse):
        return cls(lse, ent if g_ent is not None else None, g_loss, g_ent, g_lse)

    def kw(self) -> dict:
        """The fields as keyword arguments (of ``_launch_rows`` and ``gemm_grad``)."""
        return dict(lse=self.lse, ent=self.ent, g_loss=self.g_loss, g_ent=self.g_ent, g_lse=self.g_lse)

    def rows_kw(self, s, e) -> dict:
        """:meth:`kw` of the token rows ``[s, e)``."""
        return dict(lse=self.lse[s:e], ent=None if self.ent is None else self.ent[s:e], g_loss=self.g_loss[s:e],
                    g_ent=None if self.g_ent is None else self.g_ent[s:e],
                    g_lse=None if self.g_lse is None else self.g_lse[s:e])


def _fused_stats(hidden, weight, bias, target, temp, loss, need_ent, vocab_start=0, xt=None, extras=0):
    """The row statistics [M, 5] of ``weight``'s vocabulary rows (a TP shard from ``vocab_start``)
    from one fused GEMM, no logits in memory (:func:`.launch.gemm_stats`: Hopper, fp16/bf16),
    the logits taken as the backward's cuBLAS GEMM forms them; None where it cannot run or failed
    (the caller then runs cuBLAS and the row kernel). ``loss``: the :class:`.options.LossOptions`;
    ``xt``/``extras``: the forward-only fields' statistics, see :func:`.launch.gemm_stats`."""
    if not gemm_stats_supported(hidden, weight):
        return None
    return gemm_stats(hidden, weight, bias, target, temp=temp, inv_temp=loss.inv_temp, softcap=loss.softcap,
                      ignore_index=loss.ignore_index, need_ent=need_ent, need_sumz=loss.smoothing != 0.0,
                      fp32_logits=_fp32_logits_probed(hidden, weight, loss.softcap), vocab_start=vocab_start,
                      xt=xt, extras=extras)


def _vocab_grad_chunks(hidden, weight, bias, target, temp, up, loss, vchunk, base=0, total=None, fused=True):
    """Yield ``(v0, v1, dlogits)`` per vocabulary chunk for the per-token backward (``weight``: the
    vocabulary from column ``base`` of ``total``, a TP shard, or all of it; ``up``: the
    :class:`_Upstream` of all tokens): from the fused GEMM with the gradient in its epilogue where
    it runs (one input-dtype workspace, no logits in memory), else from cuBLAS's logits and the row
    kernel (:func:`_vocab_chunks`). If the fused GEMM fails (compile, launch; one warning), every
    chunk is yielded again from the first by the second way: the consumer's first chunk starts its
    sums, so nothing is counted twice. ``fused`` False: cuBLAS's logits and the row kernel only (the
    forward's statistics came from those: the gradient's logits must be the same)."""
    M, V = hidden.shape[0], weight.shape[0]
    total = total or V
    kw = {**loss.kernel_kw(temp), **up.kw()}
    if fused and gemm_grad_supported(hidden, weight):
        f32 = _fp32_logits_probed(hidden, weight, loss.softcap)
        ld = -(-min(vchunk, V) // 8) * 8  # rows padded to 16 bytes: vector stores, aligned GEMM operands
        buf = hidden.new_empty(M * ld)
        for v0 in range(0, V, vchunk):
            v1 = min(V, v0 + vchunk)
            g = buf.view(M, ld)[:, :v1 - v0]
            if not gemm_grad(hidden, weight[v0:v1], None if bias is None else bias[v0:v1], target, g,
                             vocab_start=base + v0, vocab_total=total, fp32_logits=f32, **kw):
                break  # the loop below yields every chunk again, from the first (whose dhidden GEMM starts the sum)
            yield v0, v1, g
        else:
            return
        del buf, g  # the consumer drops its reference too: the fallback's workspace replaces this one
    for v0, v1, x, g in _vocab_chunks(hidden, weight, bias, vchunk, loss.softcap, True):
        _launch_rows(x, target, out=g, vocab_start=base + v0, vocab_total=total, per_token=True, **kw)
        yield v0, v1, g


def _backward_vocab_chunks(hidden, weight, bias, target, temp, up, loss, vchunk, needs, base=0, total=None,
                           fused=True):
    """The per-token backward over vocabulary chunks: each chunk's dweight (and dbias) rows are
    final after one GEMM over all tokens (no accumulation); dhidden sums over the chunks, in
    the hidden dtype (fp32 with ``loss.accum_fp32``) with the sum of each chunk formed by cuBLAS in
    fp32. ``base``/``total``: ``weight`` is the vocabulary shard from column ``base`` of
    ``total`` (tensor parallel; dhidden is then this shard's partial sum). ``needs``: whether
    (dhidden, dweight, dbias) are wanted; returns them (empty where not)."""
    need_dh, need_dw, need_db = needs
    V = weight.shape[0]
    dh = None
    dh32 = loss.accum_fp32 and hidden.dtype != torch.float32 and vchunk < V  # an fp32 sum only where there is a sum
    dw = torch.empty_like(weight) if need_dw else hidden.new_empty(0)
    db = torch.empty(V, dtype=torch.float32, device=hidden.device) if need_db else None
    for v0, v1, g in _vocab_grad_chunks(hidden, weight, bias, target, temp, up, loss, vchunk, base, total, fused):
        if need_dh:  # the first chunk starts the sum (also when a fallback yields the chunks again)
            dh = _mm_sum(None if v0 == 0 else dh, g, weight[v0:v1], dh32)
        if need_dw:
            torch.mm(g.t(), hidden, out=dw[v0:v1])
        if need_db:
            torch.sum(g, 0, dtype=torch.float32, out=db[v0:v1])
        del g  # (a fused chunk's workspace is freed if the generator falls back)
    dh = hidden.new_empty(0) if dh is None else dh.to(hidden.dtype)
    return dh, dw, db.to(bias.dtype) if need_db else hidden.new_empty(0)


def _scale_formed_grads(g, target, ignore_index, grads, needs, kernel):
    """The scalar loss's forward-formed gradients ``(dh, dw, db)`` times the upstream gradient ``g``,
    in place, with ignored tokens' rows exactly zero whatever ``g`` is (eager's cross_entropy
    backward writes zeros there, so a loss divided by ``num_items_in_batch = 0`` gives an infinite
    ``g`` and zero gradients, never 0 * inf): dhidden's rows of ignored targets are left as formed
    (zeros), and so are dweight and dbias when no target is labelled (sums of nothing); a
    labelled row takes ``g`` as it is (inf / NaN there propagate as in eager). ``kernel``: the
    eager scaling kernel (nothing read or written when ``g == 1``), else torch ops (an autograd op
    on ``g`` under ``create_graph``, and what torch.compile traces). None for what is not needed."""
    scale = _scale_unless_one_ if kernel else _scale_masked_torch_
    dh, dw, db = grads
    need_dh, need_dw, need_db = needs
    out = [None, None, None]
    if need_dh:
        out[0] = scale(dh, g, target=target, ignore_index=ignore_index)
    if need_dw or need_db:
        gate = (target != ignore_index).any()
        if need_dw:
            out[1] = scale(dw, g, gate=gate)
        if need_db:
            out[2] = scale(db, g, gate=gate)
    return out
