"""The launches of the linear cross-entropy's Triton kernels (:mod:`.kernels`): the row kernel's
configuration and launch (:func:`_launch_rows`), the fused GEMMs' configurations, support checks and
launches (:func:`gemm_stats`, :func:`gemm_grad`; a compile or launch failure turns one off for the
process, with one warning), and the scaling of forward-formed gradients (:func:`_scale_unless_one_`,
with :func:`_scale_masked_torch_` its torch form)."""
import contextlib

import torch

from .._common import HAS_TRITON, cdiv, interpreter_active, next_power_of_2, sm_count
from .kernels.row import _KERNEL_DTYPES
from .stats import EXTRA_MEAN as _EXTRA_MEAN, EXTRA_SQ as _EXTRA_SQ, EXTRA_TOP1 as _EXTRA_TOP1

if HAS_TRITON:
    from .kernels.gemm import _lce_gemm_grad_kernel, _lce_gemm_stats_kernel, _merge_tile_stats_kernel
    from .kernels.row import _lce_rows_kernel
    from .kernels.scale import _scale_unless_one_kernel


# ---- the row kernel -------------------------------------------------------------------------------
def _row_config(V):
    """(BLOCK, num_warps) of the row kernel for rows of V logits."""
    if interpreter_active():
        return min(64, next_power_of_2(V)), 1
    # swept on the H200 (scratch rows A/B, 2026-11-30): software-pipelined loops (num_stages 2-3)
    # and BLOCK 1024-8192 with 4-16 warps are no faster over the suite's chunk shapes
    block = min(4096, next_power_of_2(V))
    return block, 8 if block >= 2048 else 4


def _launch_rows(x, target, *, temp=None, inv_temp=1.0, softcap=0.0, z_loss=0.0, smoothing=0.0,
                 ignore_index=-100, vocab_start=0, vocab_total=None, stats=None, lse=None, ent=None,
                 g_loss=None, g_ent=None, g_lse=None, per_token=False, need_ent=False, merged=None, out=None,
                 xt=None, extras=0):
    """Run the row kernel over the chunk ``x`` [rows, V] (contiguous rows).

    ``stats`` given: write partial statistics there. ``g_loss`` given: write dlogits to ``out``
    (default ``x`` itself; else a ``[rows, V]`` buffer with contiguous rows, in its own dtype)
    (``per_token``: g_loss is [rows]; else a 1-element weight for valid rows), from
    ``lse`` or, with ``merged`` (the partial statistics of every vocabulary shard for these
    rows, [shards, rows, 5] fp32, rows contiguous), from the lse the kernel merges from them.
    """
    n, V = x.shape
    if n == 0:
        return
    assert x.stride(1) == 1
    out = x if out is None else out
    assert out.shape == x.shape and out.stride(1) == 1 and out.device == x.device
    dummy = torch.empty(1, dtype=torch.float32, device=x.device)
    block, warps = _row_config(V)
    grad = g_loss is not None
    merge = merged is not None
    if merge:
        assert grad and stats is None and g_ent is None and merged.dtype == torch.float32
        assert merged.shape[1:] == (n, 5) and merged.stride(1) == 5 and merged.stride(2) == 1
    need_top, need_sq = bool(extras & _EXTRA_TOP1), bool(extras & _EXTRA_SQ)
    if need_top or need_sq:
        assert stats is not None and xt is not None and xt.shape == (n, 3) and xt.stride() == (3, 1)
    xt = xt if (need_top or need_sq) else dummy
    _lce_rows_kernel[(n,)](
        x, x.stride(0), V, out, out.stride(0),
        target, ignore_index, vocab_start,
        temp if temp is not None else dummy, float(inv_temp), float(softcap or 1.0), float(z_loss),
        float(smoothing), 1.0 / float(vocab_total or V),
        merged if merge else (stats if stats is not None else dummy), lse if lse is not None else dummy,
        ent if ent is not None else dummy, g_loss if grad else dummy,
        g_ent if g_ent is not None else dummy, g_lse if g_lse is not None else dummy,
        merged.shape[0] if merge else 0, merged.stride(0) if merge else 0, xt, xt.view(torch.int32),
        HAS_TEMP=temp is not None, HAS_CAP=bool(softcap), STATS=stats is not None, GRAD=grad,
        PER_TOKEN=per_token, HAS_GE=g_ent is not None, HAS_GS=g_lse is not None,
        NEED_ENT=need_ent, NEED_SUMZ=smoothing != 0.0 or bool(extras & _EXTRA_MEAN), MERGE=merge,
        NEED_TOP=need_top, NEED_SQ=need_sq, BLOCK=block, num_warps=warps,
    )


# ---- the fused GEMMs ------------------------------------------------------------------------------
# (BM, BN, BK, GROUP_M, num_stages, num_warps, SUBTILE) of the fused statistics GEMM, swept on the
# H200 at the suite's four shapes: the GEMM alone (a scratch prototype, 2026-11-30; BK 128, BN 128,
# BM 256, GROUP_M 1/4/8/32, warp specialization all slower), then in the op (2026-12-01,
# docs/benchmarks/linear_cross_entropy_fused_ab.json): per-token forward 1.005-1.04 T with the
# epilogue in two column halves and 4 stages (the whole tile at once: 0.99-1.04; 3 stages
# 1.01-1.05), against 1.05-1.13 T for cuBLAS + row kernel
_GEMM_STATS_CFG = (128, 256, 64, 16, 4, 8, 2)
_GEMM_STATS_CFG_INTERP = (16, 64, 16, 2, 1, 1, 2)
# bound on the fused GEMM's per-tile partial statistics (fp32, [V / BN, tokens] per field)
_GEMM_STATS_PART_BYTES = 256 * 1024 * 1024
# False once the fused GEMM has failed to compile or launch in this process (one warning): later
# calls form the logits with cuBLAS and run the row kernel
_GEMM_STATS_OK = [True]
# the same for the backward's fused GEMM (dlogits in its epilogue), and its switch for A/B runs
_GEMM_GRAD_OK = [True]
_GEMM_GRAD_ON = [True]
# the gradient GEMM's configuration (as _GEMM_STATS_CFG; the interpreter uses _GEMM_STATS_CFG_INTERP
# for both): the tile stored by TMA from shared memory, whole (fewest registers, 175), 3 stages to
# leave the store its shared memory. Per-token + entropy fwd+bwd (the same A/B):
# 4.04 / 4.20 / 4.02 / 4.06 T, against 4.01-4.31 T for the column halves with TMA or pointer stores
# and 4.08-4.29 T for cuBLAS + row kernel
_GEMM_GRAD_CFG = (128, 256, 64, 16, 3, 8, 1)
# the gradient GEMM stores its tiles through a TMA descriptor of the output (A/B switch)
_GEMM_GRAD_TMA_OUT = [True]


def _gemm_fusable(hidden, weight) -> bool:
    """Whether the fused GEMMs can run: a Hopper GPU (TMA, sm90) with fp16/bf16 operands whose
    rows are 16-byte aligned, or the Triton interpreter on CPU (fp32/fp16, for the tests)."""
    if not (HAS_TRITON and _TensorDescriptor is not None):
        return False
    if hidden.shape[1] % 8 or hidden.stride(1) != 1 or weight.stride(1) != 1:
        return False
    if interpreter_active():
        return hidden.device.type == "cpu" and hidden.dtype in (torch.float32, torch.float16)
    # Hopper only: the tile configuration (and its shared memory) is the one swept on the H200
    return (hidden.is_cuda and hidden.dtype in (torch.float16, torch.bfloat16)
            and torch.cuda.get_device_capability(hidden.device)[0] == 9
            and hidden.data_ptr() % 16 == 0 and weight.data_ptr() % 16 == 0
            and hidden.stride(0) % 8 == 0 and weight.stride(0) % 8 == 0)


def gemm_stats_supported(hidden, weight) -> bool:
    """Whether :func:`gemm_stats` runs: see :func:`_gemm_fusable`, and it has not failed."""
    return _GEMM_STATS_OK[0] and _gemm_fusable(hidden, weight)


def gemm_grad_supported(hidden, weight) -> bool:
    """Whether :func:`gemm_grad` runs: see :func:`_gemm_fusable`, and it has not failed."""
    return _GEMM_GRAD_OK[0] and _GEMM_GRAD_ON[0] and _gemm_fusable(hidden, weight)


try:
    from triton.tools.tensor_descriptor import TensorDescriptor as _TensorDescriptor
except Exception:  # pragma: no cover - older Triton
    _TensorDescriptor = None

# the last launched fused GEMMs ("stats", "grad"): their registers, spills and shared memory are
# what a tuning run reads (n_regs, n_spills, metadata.shared)
_COMPILED = {}


def _fused_launch(hidden, fp32_logits, interp, has_bias=False):
    """What both fused GEMMs launch with: the persistent grid's size (the device's SM count, cached
    per device; 4 programs under the interpreter), the epilogue's rounding of the logits (0: none,
    fp32 logits; 1: fp16; 2: bf16, as cuBLAS writes them) and the device context (Triton launches
    on the current device: make it the tensors'). With a bias the logits stay fp32 (``acc + bias``
    unrounded): this GEMM's accumulator and bias rounding are not cuBLAS's, and rounded here the
    lse can land farther from the exact one than eager's on some rows; unrounded, its error is
    FP32 arithmetic's, below eager's rounding on every row. Both kernels take the same logits."""
    fp32_logits = fp32_logits or has_bias
    rnd = 0 if (fp32_logits or hidden.dtype == torch.float32) else (1 if hidden.dtype == torch.float16 else 2)
    if interp:
        return 4, rnd, contextlib.nullcontext()
    idx = hidden.device.index if hidden.device.index is not None else torch.cuda.current_device()
    return sm_count(idx), rnd, torch.cuda.device(hidden.device)


def _fused_failed(flag, which, path, e):
    """A fused GEMM failed to compile or launch: never try it again in this process (``flag``), and
    say so once."""
    import warnings

    flag[0] = False
    warnings.warn(f"deepspeed_fused.linear_cross_entropy: the fused logits GEMM{which} failed "
                  f"({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}); the per-token "
                  f"{path} now runs cuBLAS and the row kernel", RuntimeWarning, stacklevel=3)


def gemm_stats(hidden, weight, bias, target, *, temp=None, inv_temp=1.0, softcap=0.0, ignore_index=-100,
               need_ent=False, need_sumz=False, fp32_logits=False, vocab_start=0, xt=None, extras=0):
    """Row statistics [M, 5] (fp32, as ``stats._finalize_stats`` reads them) of the logits
    ``hidden @ weight.T (+ bias)`` from the fused GEMM (``_lce_gemm_stats_kernel``) and a merge over
    its vocabulary tiles. The logits are taken as cuBLAS would write them: rounded to the input
    dtype, unless ``fp32_logits`` (see ``sizing.fp32_logits``), so the statistics agree with a
    backward that recomputes them. ``weight`` may be a vocabulary shard starting at column
    ``vocab_start``: the target logit is then this shard's (0 for targets outside it), as the row
    kernel's partial statistics of a shard. None when the kernel failed (one warning; the caller
    runs cuBLAS and the row kernel instead). ``extras`` (a mask of ``stats.EXTRA_*``): also the
    forward-only fields' statistics into ``xt`` [M, 3] fp32, as the row kernel writes them (and the
    sum of the logits for ``EXTRA_MEAN``)."""
    M, K = hidden.shape
    V = weight.shape[0]
    interp = interpreter_active()
    BM, BN, BK, group_m, stages, warps, subtile = _GEMM_STATS_CFG_INTERP if interp else _GEMM_STATS_CFG
    n_n = cdiv(V, BN)
    # token chunks so the per-tile partials stay within _GEMM_STATS_PART_BYTES (one chunk up to
    # M x V = 2^33 (bf16 sizes: 8192 x 1M vocabulary) with two fields)
    need_sumz = need_sumz or bool(extras & _EXTRA_MEAN)
    need_top, need_sq = bool(extras & _EXTRA_TOP1), bool(extras & _EXTRA_SQ)
    if need_top or need_sq:
        assert xt is not None and xt.shape == (M, 3) and xt.stride() == (3, 1) and xt.dtype == torch.float32
    nf = 2 + int(need_ent) + int(need_sumz) + 2 * int(need_top) + int(need_sq)
    rows = max(BM, _GEMM_STATS_PART_BYTES // (n_n * 4 * nf) // BM * BM)
    rows = min(rows, M)
    f32 = dict(dtype=torch.float32, device=hidden.device)
    bufs = [torch.empty(n_n * rows, **f32) for _ in range(nf)]
    zt = torch.zeros(M, **f32)
    stats = torch.empty((M, 5), **f32)
    sms, rnd, device = _fused_launch(hidden, fp32_logits, interp, bias is not None)
    block = 64 if interp else 128
    if bias is not None:
        bias = bias.contiguous()  # the epilogue reads it as one contiguous row
    try:
        with device:
            w_desc = _TensorDescriptor.from_tensor(weight, [BN, BK])
            for s in range(0, M, rows):
                e = min(M, s + rows)
                n = e - s
                m, d = bufs[0][:n_n * n].view(n_n, n), bufs[1][:n_n * n].view(n_n, n)
                fields = iter(bufs[2:])
                a = next(fields)[:n_n * n].view(n_n, n) if need_ent else m
                sz = next(fields)[:n_n * n].view(n_n, n) if need_sumz else m
                bv = next(fields)[:n_n * n].view(n_n, n) if need_top else m
                bi = next(fields)[:n_n * n].view(torch.int32).view(n_n, n) if need_top else m.view(torch.int32)
                q = next(fields)[:n_n * n].view(n_n, n) if need_sq else m
                xs = xt[s:e] if (need_top or need_sq) else stats[s:e]
                h_desc = _TensorDescriptor.from_tensor(hidden[s:e], [BM, BK])
                _COMPILED["stats"] = _lce_gemm_stats_kernel[(min(sms, cdiv(n, BM) * n_n),)](
                    h_desc, w_desc, bias if bias is not None else m, target[s:e], temp[s:e] if temp is not None else m,
                    m, d, a, sz, zt[s:e], bv, bi, q, n, V, K, ignore_index, vocab_start, float(inv_temp),
                    float(softcap or 1.0),
                    ROUND=rnd, HAS_BIAS=bias is not None, HAS_TEMP=temp is not None, HAS_CAP=bool(softcap),
                    NEED_ENT=need_ent, NEED_SUMZ=need_sumz, NEED_TOP=need_top, NEED_SQ=need_sq, SUBTILE=subtile, BM=BM, BN=BN, BK=BK, GROUP_M=group_m,
                    NUM_SMS=sms, num_stages=stages, num_warps=warps)
                _merge_tile_stats_kernel[(cdiv(n, block),)](
                    m, d, a, sz, zt[s:e], stats[s:e], n_n, n, bv, bi, q, xs, xs.view(torch.int32),
                    NEED_ENT=need_ent, NEED_SUMZ=need_sumz, NEED_TOP=need_top, NEED_SQ=need_sq, BLOCK=block,
                    num_warps=1 if interp else 4)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a compile or launch failure on this GPU/Triton: fall back, once
        _fused_failed(_GEMM_STATS_OK, "", "forward", e)
        return None
    return stats


def gemm_grad(hidden, weight, bias, target, out, *, lse, g_loss, ent=None, g_ent=None, g_lse=None, temp=None,
              inv_temp=1.0, softcap=0.0, z_loss=0.0, smoothing=0.0, ignore_index=-100, vocab_start=0,
              vocab_total=None, fp32_logits=False) -> bool:
    """``out`` [M, V] (input dtype) = dL/dlogits of the vocabulary slice ``weight`` (rows from
    ``vocab_start`` of ``vocab_total``) from the fused GEMM (``_lce_gemm_grad_kernel``): what the
    cuBLAS logits GEMM and the row kernel's per-token gradient pass would write, without the
    logits in memory. ``lse``/``ent``/``g_*``: fp32 per token, as for ``_launch_rows``. False when
    the kernel failed (one warning, ``out`` not written; the caller runs cuBLAS and the row kernel)."""
    M, K = hidden.shape
    V = weight.shape[0]
    interp = interpreter_active()
    BM, BN, BK, group_m, stages, warps, subtile = _GEMM_STATS_CFG_INTERP if interp else _GEMM_GRAD_CFG
    assert g_ent is None or ent is not None, "the entropy gradient needs the forward's entropy"
    sms, rnd, device = _fused_launch(hidden, fp32_logits, interp, bias is not None)
    if bias is not None:
        bias = bias.contiguous()
    assert out.shape == (M, V) and out.stride(1) == 1
    try:
        with device:
            h_desc = _TensorDescriptor.from_tensor(hidden, [BM, BK])
            w_desc = _TensorDescriptor.from_tensor(weight, [BN, BK])
            # the gradient tiles stored by TMA where the output's rows allow it (16-byte aligned)
            tma_out = (_GEMM_GRAD_TMA_OUT[0] and out.data_ptr() % 16 == 0
                       and (out.stride(0) * out.element_size()) % 16 == 0)
            if not tma_out:
                subtile = 2  # a pointer store of the whole tile spills registers
            out_desc = (_TensorDescriptor(out, list(out.shape), list(out.stride()), [BM, BN // subtile])
                        if tma_out else h_desc)
            _COMPILED["grad"] = _lce_gemm_grad_kernel[(min(sms, cdiv(M, BM) * cdiv(V, BN)),)](
                h_desc, w_desc, bias if bias is not None else lse, target, temp if temp is not None else lse,
                lse, ent if ent is not None else lse, g_loss, g_ent if g_ent is not None else lse,
                g_lse if g_lse is not None else lse, out, out.stride(0), out_desc, M, V, K, vocab_start,
                ignore_index, float(inv_temp), float(softcap or 1.0), float(z_loss), float(smoothing),
                1.0 / float(vocab_total or V),
                ROUND=rnd, HAS_BIAS=bias is not None, HAS_TEMP=temp is not None, HAS_CAP=bool(softcap),
                HAS_GE=g_ent is not None, HAS_GS=g_lse is not None, TMA_OUT=tma_out, SUBTILE=subtile, BM=BM,
                BN=BN, BK=BK, GROUP_M=group_m, NUM_SMS=sms, num_stages=stages, num_warps=warps)
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # a compile or launch failure on this GPU/Triton: fall back, once
        _fused_failed(_GEMM_GRAD_OK, " (gradient)", "backward", e)
        return False
    return True


# ---- the scaling of forward-formed gradients ------------------------------------------------------
def _scale_masked_torch_(x, g, target=None, ignore_index=-100, gate=None):
    """:func:`_scale_unless_one_` in torch ops (an autograd op on ``g``: differentiable under
    ``create_graph``, traceable by torch.compile): the rows or tensors left alone are multiplied
    by exactly 1 (``mul_``; a 0-d ``g`` may be rounded to ``x``'s dtype first on CUDA)."""
    s = g.reshape(())
    if gate is not None:
        s = torch.where(gate, s, torch.ones_like(s))
    if target is not None:
        s = torch.where(target.reshape(-1, *([1] * (x.dim() - 1))) != ignore_index, s, torch.ones_like(s))
    return x.mul_(s)


def _scale_unless_one_(x, g, *, target=None, ignore_index=-100, gate=None):
    """``x = (x.float() * g.float()).to(x.dtype)`` in place, for the forward-formed gradients and the
    scalar upstream gradient ``g`` (almost always 1, as ``loss.backward()`` makes it): no memory
    traffic when ``g == 1``, and no host sync to find out.

    ``target`` ([x.shape[0]], the tokens of x's rows, e.g. dhidden's): rows whose target is
    ``ignore_index`` are left as formed (their exact zeros stay zeros whatever g is: no 0 * inf).
    ``gate`` (a 0-d bool tensor on x's device, e.g. "some token is labelled"): x is left as formed
    where it is False (the zeros of dweight summed over no labelled token). Where the kernel
    cannot run, :func:`_scale_masked_torch_`."""
    if (x.numel() == 0 or g.numel() != 1 or not x.is_contiguous() or x.dtype not in _KERNEL_DTYPES
            or g.device != x.device or (gate is not None and gate.device != x.device)
            or (target is not None and (target.device != x.device or target.numel() != x.shape[0]))
            or not (x.is_cuda or (interpreter_active() and x.device.type == "cpu" and x.dtype != torch.bfloat16))):
        return _scale_masked_torch_(x, g, target, ignore_index, gate)
    g1 = g.reshape(1)
    if target is not None:
        n = x[0].numel()
        block = min(4096, next_power_of_2(n))
        grid = (x.shape[0], cdiv(n, block))
    else:
        n = x.numel()
        block = 4096
        grid = (cdiv(n, block),)
    _scale_unless_one_kernel[grid](x, n, g1, g1 if gate is None else gate.reshape(1),
                                   g1 if target is None else target.contiguous(), int(ignore_index),
                                   GATE=gate is not None, ROWS=target is not None, BLOCK=block,
                                   num_warps=(8 if block >= 2048 else 4) if x.is_cuda else 1)
    return x
