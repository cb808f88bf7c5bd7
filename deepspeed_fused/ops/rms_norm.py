"""Fused RMSNorm in the Hugging Face Llama form, with eager's rounding points.

The Llama-form module computes ``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``:
FP32 statistics, one rounding of the normalized value to the input dtype, then the multiply by
the weight in the promoted dtype (an FP32 weight with bf16 input gives an FP32 output). The
kernels reproduce those rounding points (``rstd`` itself is formed in FP64 from the row's sum of
squares and rounded once, where eager rounds the mean and then takes an approximate ``rsqrt``)
and the ones eager autograd applies in the backward:

* ``g = dy * w`` is formed in the output dtype and rounded to the input dtype (the gradient of
  the rounded normalized value), then the input gradient is FP32 math on ``g``;
* the weight-gradient product ``dy * normalized`` is rounded to the output dtype before its FP32
  sum over rows, and the sum is rounded to the weight dtype.

Kernels: a forward over ``[BLOCK_R, BLOCK_N]`` tiles (many rows per program for narrow widths,
one row per program for wide ones, looping over column blocks when a row does not fit one
block), and a persistent backward (a bounded grid; each program walks row tiles, writes ``dx``
and keeps its own FP32 weight-gradient partial, stored as its row of a per-stream workspace).
The partials are summed in a fixed order, so results are bitwise repeatable: in the backward's
own launch by its last programs (two levels: per group, then the groups) where that tail is
short, else by a second launch over column strips. Launch plans (configs, grids, compiled
kernels) are cached per shape/stride/dtype/alignment key: a repeated call builds its key,
allocates its outputs and launches through the compiled kernel's C launcher. On CUDA, once a
key with contiguous, aligned inputs has launched its forward and backward (contiguous incoming
gradient) directly, its calls that need a backward go through a C++ autograd node
(``ops/_native.py``) that makes the same two launches with no Python in the forward's node or in
the backward (strided rows keep the Python node). Rows may be
strided (last dim contiguous, leading dims collapsing to at most three strided groups, e.g. a
slice of a fused QKV projection viewed as ``[B, S, heads, head_dim]``): no copy is made for them.

The other forms of transformers' RMSNorms (:class:`RMSForm`, :data:`FORMS`: Gemma's ``1 + w``, the
weight multiplied before the cast, T5's, unweighted, gated by ``act(gate)`` after the weight or
before the statistics) run :func:`fused_rms_norm_form`: one more kernel family with the form's
rounding points as constexprs, the same tiling, plans, fast closures and C++ node.
"""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch
from torch.autograd.function import once_differentiable

from . import _native
from ._common import (HAS_TRITON, CachedLaunches, _current_device, _launch_hooks, _raw_stream, _stream_capturing,
                      kernel_device_ok, launch_binding, tl, triton, warn_fallback)
from ._common import sm_count as _sm_count

__all__ = ["fused_rms_norm", "try_fused_rms_norm", "rms_norm_reference", "rms_norm_kernel_ok", "output_dtype",
           "RMSForm", "FORMS", "fused_rms_norm_form", "try_fused_rms_norm_form", "rms_norm_form_reference",
           "form_output_dtype"]

_OP = "rms_norm"
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

# Tuning knobs (module attributes so tests can force the looping kernels at small widths).
_MAX_FWD_BLOCK = 16384  # widest row the forward holds in one block
_MAX_BWD_BLOCK = 8192  # widest row the backward holds in one block
_LOOP_BLOCK = 4096  # column block of the looping kernels
_FWD_TILE_BYTES = 8192  # input bytes per forward tile (narrow widths: many rows per program; swept)
_BWD_TILE_ELEMS = 4096  # elements per backward tile
_FWD_ELEMS_PER_WARP = 1024  # forward tile elements per warp (sets num_warps)
_BWD_ELEMS_PER_WARP = 512  # backward tile elements per warp
_BWD_PREFETCH = True  # persistent backward: load the next tile before processing the current one
_INTERPRET_PROGRAMS = 3  # persistent programs under the CPU interpreter


# ----------------------------------------------------------------------------------------------
# Reference
# ----------------------------------------------------------------------------------------------
def output_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype of the result: PyTorch promotion of the input and weight dtypes."""
    return torch.promote_types(hidden.dtype, weight.dtype)


def rms_norm_reference(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The Hugging Face Llama-form RMSNorm, written as the modules write it (same rounding)."""
    input_dtype = hidden.dtype
    h = hidden.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    return weight * h.to(input_dtype)


# ----------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _row_offsets(rows, D1, D2, S0, S1, S2):
        # Row r of the collapsed leading shape [D0, D1, D2] lives at
        # (r // (D1*D2)) * S0 + ((r // D2) % D1) * S1 + (r % D2) * S2 (element units).
        outer = rows // (D1 * D2)
        mid = (rows // D2) % D1
        inner = rows % D2
        return tl.cast(outer, tl.int64) * S0 + tl.cast(mid, tl.int64) * S1 + tl.cast(inner, tl.int64) * S2

    @triton.jit
    def _rstd(sum_sq, N, eps):
        # 1 / sqrt(mean + eps) with one rounding to FP32: computed in FP64 from the row's sum of
        # squares (per row, so it costs nothing); Triton's plain FP32 '/' is an approximate
        # division and rsqrt an approximate instruction, each worth an ULP or two.
        var = sum_sq.to(tl.float64) / N
        return (1.0 / tl.sqrt(var + eps)).to(tl.float32)

    @triton.jit
    def _rms_fwd_kernel(X, W, Y, RSTD, n_rows, N, D1, D2, S0, S1, S2, eps,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
                        STATS64: tl.constexpr, WRITE_RSTD: tl.constexpr):
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        xrow = _row_offsets(rows, D1, D2, S0, S1, S2)[:, None]
        yrow = rows.to(tl.int64)[:, None] * N
        cols = tl.arange(0, BLOCK_N)
        in_ty = X.dtype.element_ty
        out_ty = Y.dtype.element_ty
        if SINGLE:
            cmask = cols < N
            m = rmask[:, None] & cmask[None, :]
            x = tl.load(X + xrow + cols[None, :], mask=m, other=0.0).to(tl.float32)
            if STATS64:
                x64 = x.to(tl.float64)
                ss = tl.sum(x64 * x64, axis=1)
            else:
                ss = tl.sum(x * x, axis=1)
            rstd = _rstd(ss, N, eps)
            w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
            xn = (x * rstd[:, None]).to(in_ty).to(tl.float32)
            tl.store(Y + yrow + cols[None, :], (w[None, :] * xn).to(out_ty), mask=m)
        else:
            acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float64 if STATS64 else tl.float32)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                m = rmask[:, None] & (c < N)[None, :]
                x = tl.load(X + xrow + c[None, :], mask=m, other=0.0).to(acc.dtype)
                acc += x * x
            rstd = _rstd(tl.sum(acc, axis=1), N, eps)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                cm = c < N
                m = rmask[:, None] & cm[None, :]
                x = tl.load(X + xrow + c[None, :], mask=m, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=cm, other=0.0).to(tl.float32)
                xn = (x * rstd[:, None]).to(in_ty).to(tl.float32)
                tl.store(Y + yrow + c[None, :], (w[None, :] * xn).to(out_ty), mask=m)
        if WRITE_RSTD:
            tl.store(RSTD + rows, rstd, mask=rmask)

    @triton.jit
    def _sum_rows(SRC, n, N, DST, RB_P: tl.constexpr, RB_N: tl.constexpr):
        # DST[c] = sum over i < n of SRC[i, c] in FP32, in a fixed order, rounded to DST's dtype.
        # Loads bypass L1: the rows were written by other programs of this launch.
        pr = tl.arange(0, RB_P)
        for c0 in range(0, N, RB_N):
            c = c0 + tl.arange(0, RB_N)
            cm = c < N
            acc = tl.zeros([RB_P, RB_N], dtype=tl.float32)
            for p0 in range(0, n, RB_P):
                p = p0 + pr
                m = (p < n)[:, None] & cm[None, :]
                acc += tl.load(SRC + p.to(tl.int64)[:, None] * N + c[None, :], mask=m, other=0.0,
                               cache_modifier=".cg")
            tl.store(DST + c, tl.sum(acc, axis=0).to(DST.dtype.element_ty), mask=cm)

    @triton.jit
    def _dw_finish(PART, CNT, DW, pid, nprog, N, GROUP: tl.constexpr, RB_P: tl.constexpr, RB_N: tl.constexpr):
        # Called by every program after it stored its weight-gradient partial PART[pid, :N].
        # Two-level fixed-order sum in the same launch: the last program of each group of GROUP
        # consecutive programs sums the group's rows into PART[nprog + group]; the last group to
        # finish sums those into DW. Which program arrives last does not change any sum, so the
        # result is bitwise repeatable. Each counter is reset to zero by its last user.
        g = pid // GROUP
        n_groups = tl.cdiv(nprog, GROUP)
        first = g * GROUP
        size = tl.minimum(nprog - first, GROUP)
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(CNT + g, 1, sem="acq_rel", scope="gpu")
        if arrived == size - 1:
            _sum_rows(PART + first.to(tl.int64) * N, size, N, PART + (nprog + g).to(tl.int64) * N, RB_P, RB_N)
            tl.store(CNT + g, 0)
            tl.debug_barrier()
            groups_done = tl.atomic_add(CNT + n_groups, 1, sem="acq_rel", scope="gpu")
            if groups_done == n_groups - 1:
                _sum_rows(PART + nprog.to(tl.int64) * N, n_groups, N, DW, RB_P, RB_N)
                tl.store(CNT + n_groups, 0)

    @triton.jit
    def _dw_finish_cols(PART, CNT, DW, pid, nprog, N, SW: tl.constexpr, RB_P: tl.constexpr):
        # Called by every program after it stored its weight-gradient partial PART[pid, :N]. The
        # last n_fin = cdiv(N, SW) programs to arrive each wait until all have arrived, then each
        # sums one strip of SW columns over all nprog partial rows (fixed order: bitwise
        # repeatable whoever arrives last). Waiting cannot deadlock: a program that arrives
        # earlier exits, so the at most n_fin - 1 programs still to arrive find free slots as
        # long as n_fin programs fit on the device at once. The last finisher to leave resets
        # both counters. Under the interpreter (programs run one after another) n_fin is 1.
        n_fin = tl.cdiv(N, SW)
        tl.debug_barrier()  # every thread's partial stored before the release below
        arrived = tl.atomic_add(CNT, 1, sem="acq_rel", scope="gpu")
        j = arrived - (nprog - n_fin)
        if j >= 0:
            done = arrived + 1
            while done < nprog:
                done = tl.atomic_add(CNT, 0, sem="acquire", scope="gpu")
            c = j * SW + tl.arange(0, SW)
            cm = c < N
            pr = tl.arange(0, RB_P)
            acc = tl.zeros([RB_P, SW], dtype=tl.float32)
            for p0 in range(0, nprog, RB_P):
                p = p0 + pr
                m = (p < nprog)[:, None] & cm[None, :]
                acc += tl.load(PART + p.to(tl.int64)[:, None] * N + c[None, :], mask=m, other=0.0,
                               cache_modifier=".cg")
            tl.store(DW + c, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=cm)
            tl.debug_barrier()
            left = tl.atomic_add(CNT + 1, 1, sem="acq_rel", scope="gpu")
            if left == n_fin - 1:
                tl.store(CNT, 0)
                tl.store(CNT + 1, 0)

    @triton.jit
    def _bwd_load_tile(DY, X, RSTD, tile, n_rows, cols, cmask,
                       XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2, BLOCK_R: tl.constexpr):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows  # all false past the last tile: no memory traffic
        m = rmask[:, None] & cmask[None, :]
        xoff = _row_offsets(rows, XD1, XD2, XS0, XS1, XS2)[:, None] + cols[None, :]
        goff = _row_offsets(rows, GD1, GD2, GS0, GS1, GS2)[:, None] + cols[None, :]
        x = tl.load(X + xoff, mask=m, other=0.0)
        dy = tl.load(DY + goff, mask=m, other=0.0)
        rstd = tl.load(RSTD + rows, mask=rmask, other=0.0)
        return x, dy, rstd

    @triton.jit
    def _rms_bwd_kernel(DY, X, W, RSTD, DX, PART, CNT, DW, n_rows, N, n_tiles,
                        XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2,
                        BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
                        GROUP: tl.constexpr, RB_P: tl.constexpr, RB_N: tl.constexpr, FINISH: tl.constexpr):
        # One persistent program: walks row tiles pid, pid + P, ...; writes dx for them and one
        # FP32 weight-gradient partial row PART[pid, :N] (the row fits one block). With PREFETCH
        # the next tile's x and dy are loaded before the current one is processed.
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        in_ty = X.dtype.element_ty
        out_ty = DY.dtype.element_ty
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        w = tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32)
        acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        if PREFETCH:
            x_nx, dy_nx, rstd_nx = _bwd_load_tile(DY, X, RSTD, pid, n_rows, cols, cmask,
                                                  XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2, BLOCK_R)
        for tile in range(pid, n_tiles, nprog):
            if PREFETCH:
                x = x_nx.to(tl.float32)
                dy = dy_nx.to(tl.float32)
                rstd = rstd_nx
                x_nx, dy_nx, rstd_nx = _bwd_load_tile(DY, X, RSTD, tile + nprog, n_rows, cols, cmask,
                                                      XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2, BLOCK_R)
            else:
                x, dy, rstd = _bwd_load_tile(DY, X, RSTD, tile, n_rows, cols, cmask,
                                             XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2, BLOCK_R)
                x = x.to(tl.float32)
                dy = dy.to(tl.float32)
            rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
            m = (rows < n_rows)[:, None] & cmask[None, :]
            # eager: grad of the rounded normalized value = dy * w in the output dtype, then the
            # input dtype; the rest is FP32.
            g = (dy * w[None, :]).to(out_ty).to(in_ty).to(tl.float32)
            dot = tl.sum(g * x, axis=1)
            dvar = (-0.5 * dot) * (rstd * rstd * rstd)
            dx = g * rstd[:, None] + (dvar / N)[:, None] * (2.0 * x)
            tl.store(DX + rows.to(tl.int64)[:, None] * N + cols[None, :], dx.to(in_ty), mask=m)
            xn = (x * rstd[:, None]).to(in_ty).to(tl.float32)
            acc += (dy * xn).to(out_ty).to(tl.float32)
        tl.store(PART + pid.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=cmask)
        if FINISH == 1:
            _dw_finish(PART, CNT, DW, pid, nprog, N, GROUP, RB_P, RB_N)
        if FINISH == 2:
            _dw_finish_cols(PART, CNT, DW, pid, nprog, N, RB_N, RB_P)

    @triton.jit
    def _rms_bwd_loop_kernel(DY, X, W, RSTD, DX, PART, CNT, DW, n_rows, N,
                             XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2,
                             BLOCK_N: tl.constexpr, GROUP: tl.constexpr, RB_P: tl.constexpr,
                             RB_N: tl.constexpr, FINISH: tl.constexpr):
        # Wide rows: one row at a time, two passes over column blocks (the row sum, then dx);
        # the weight-gradient partial accumulates in this program's own row PART[pid, :] (its
        # first row stores, later rows add; only this program touches the row, so no atomics).
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        in_ty = X.dtype.element_ty
        out_ty = DY.dtype.element_ty
        cols = tl.arange(0, BLOCK_N)
        prow = PART + pid.to(tl.int64) * N
        for row in range(pid, n_rows, nprog):
            xb = X + _row_offsets(row, XD1, XD2, XS0, XS1, XS2)
            gb = DY + _row_offsets(row, GD1, GD2, GS0, GS1, GS2)
            rstd = tl.load(RSTD + row)
            dacc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                cm = c < N
                x = tl.load(xb + c, mask=cm, other=0.0).to(tl.float32)
                dy = tl.load(gb + c, mask=cm, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=cm, other=0.0).to(tl.float32)
                g = (dy * w).to(out_ty).to(in_ty).to(tl.float32)
                dacc += g * x
            dvar = (-0.5 * tl.sum(dacc, axis=0)) * (rstd * rstd * rstd)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                cm = c < N
                x = tl.load(xb + c, mask=cm, other=0.0).to(tl.float32)
                dy = tl.load(gb + c, mask=cm, other=0.0).to(tl.float32)
                w = tl.load(W + c, mask=cm, other=0.0).to(tl.float32)
                g = (dy * w).to(out_ty).to(in_ty).to(tl.float32)
                dx = g * rstd + (dvar / N) * (2.0 * x)
                tl.store(DX + tl.cast(row, tl.int64) * N + c, dx.to(in_ty), mask=cm)
                xn = (x * rstd).to(in_ty).to(tl.float32)
                p = tl.where(row > pid, tl.load(prow + c, mask=cm, other=0.0), 0.0)
                tl.store(prow + c, p + (dy * xn).to(out_ty).to(tl.float32), mask=cm)
        if FINISH == 1:
            _dw_finish(PART, CNT, DW, pid, nprog, N, GROUP, RB_P, RB_N)
        if FINISH == 2:
            _dw_finish_cols(PART, CNT, DW, pid, nprog, N, RB_N, RB_P)

    @triton.jit
    def _dw_reduce_kernel(PART, DW, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
        # The weight-gradient sum as its own launch (wide sums, where one program's tail would
        # be latency-bound): dW[c] = sum over programs p of PART[p, c], in a fixed order, rounded
        # to the weight dtype, column strips in parallel.
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        cmask = cols < N
        acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
        for p0 in range(0, P, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            m = (p < P)[:, None] & cmask[None, :]
            acc += tl.load(PART + p.to(tl.int64)[:, None] * N + cols[None, :], mask=m, other=0.0)
        tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=cmask)

    # ---- the other forms (see RMSForm): one kernel family, the form's rounding points as constexprs.
    # Codes of a rounding (NRND: the normalized value; PRND: the weight product; QRND: the value the
    # output is cast from): 0 stays FP32, 1 the input's dtype, 2 the weight's dtype. WMODE: 0 no
    # weight, 1 the weight, 2 1 + w in FP32, 3 1 + w rounded to the weight's dtype. GATE: 0 none, 1
    # times act(gate) after the weight, 2 times act(gate) before the statistics. ACT: 0 SiLU, 1 sigmoid.
    # RSTD_RND: rstd rounded to the input dtype and multiplied in it (no weight, DeepSeek-V4's
    # unweighted norm).
    @triton.jit
    def _rnd(v, CODE: tl.constexpr, X, W):
        if CODE == 1:
            v = v.to(X.dtype.element_ty).to(tl.float32)
        elif CODE == 2:
            v = v.to(W.dtype.element_ty).to(tl.float32)
        return v

    @triton.jit
    def _act(g, ACT: tl.constexpr):
        # eager's FP32 activation: silu(g) = g / (1 + exp(-g)), sigmoid(g) = 1 / (1 + exp(-g))
        e = 1.0 + tl.exp(-g)
        if ACT == 0:
            s = tl.div_rn(g, e)
        else:
            s = tl.div_rn(tl.zeros_like(g) + 1.0, e)
        return s

    @triton.jit
    def _act_bwd(ds, g, ACT: tl.constexpr):
        # eager's activation backward: silu: ds * sig * (1 + g * (1 - sig)); sigmoid: ds * (1 - sig) * sig
        sig = tl.div_rn(tl.zeros_like(g) + 1.0, 1.0 + tl.exp(-g))
        if ACT == 0:
            d = ds * sig * (1.0 + g * (1.0 - sig))
        else:
            d = ds * (1.0 - sig) * sig
        return d

    @triton.jit
    def _wfac(w, WMODE: tl.constexpr, X, W):
        # the factor the normalized value is multiplied by (w already FP32)
        if WMODE == 2:
            w = 1.0 + w
        elif WMODE == 3:
            w = _rnd(1.0 + w, 2, X, W)
        return w

    @triton.jit
    def _form_out(h, g, rstd, a, X, W, NRND: tl.constexpr, WMODE: tl.constexpr, PRND: tl.constexpr,
                  GATE: tl.constexpr, ACT: tl.constexpr, RSTD_RND: tl.constexpr):
        # the forward's value before its final cast to the output dtype (h: the FP32 input, gated
        # for GATE 2; rstd, a: broadcast to h's shape or scalars)
        if RSTD_RND:
            n = h * rstd.to(X.dtype.element_ty).to(tl.float32)
        else:
            n = _rnd(h * rstd, NRND, X, W)
        if WMODE != 0:
            n = _rnd(a * n, PRND, X, W)
        if GATE == 1:
            n = n * _act(g, ACT)
        return n

    @triton.jit
    def _form_grads(x, g, dy, rstd, a, X, W, NRND: tl.constexpr, WMODE: tl.constexpr, PRND: tl.constexpr,
                    QRND: tl.constexpr, GATE: tl.constexpr, ACT: tl.constexpr):
        # eager autograd's chain down to the normalized value: (h, gradient of the FP32 normalized
        # value, the weight-gradient term, the gate's gradient (GATE 1) or act(gate) (GATE 2))
        if GATE == 2:
            s = _act(g, ACT)
            h = x * s
        else:
            s = x
            h = x
        nr = _rnd(h * rstd, NRND, X, W)
        dp = _rnd(dy, QRND, X, W)
        if GATE == 1:
            if WMODE != 0:
                p = _rnd(a * nr, PRND, X, W)
            else:
                p = nr
            s = _act_bwd(dp * p, g, ACT)
            dp = _rnd(dp * _act(g, ACT), PRND, X, W)
        if WMODE != 0:
            gn = _rnd(_rnd(dp * a, PRND, X, W), NRND, X, W)
            term = _rnd(dp * nr, PRND, X, W)
        else:
            gn = dp
            term = dp
        return h, gn, term, s

    @triton.jit
    def _form_dx(x, g, h, gn, s, rstd, dvar, N, GATE: tl.constexpr, ACT: tl.constexpr):
        # (dx in FP32, the gate's gradient for GATE 2) from the gradient of the normalized value
        dh = gn * rstd + (dvar / N) * (2.0 * h)
        if GATE == 2:
            dg = _act_bwd(dh * x, g, ACT)
            dh = dh * s
        else:
            dg = dh
        return dh, dg

    @triton.jit
    def _rms_fwd_form_kernel(X, W, Y, RSTD, G, n_rows, N, D1, D2, S0, S1, S2, eps,
                             BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE: tl.constexpr,
                             STATS64: tl.constexpr, WRITE_RSTD: tl.constexpr, NRND: tl.constexpr,
                             WMODE: tl.constexpr, PRND: tl.constexpr, GATE: tl.constexpr, ACT: tl.constexpr,
                             RSTD_RND: tl.constexpr):
        # _rms_fwd_kernel for the other forms; the gate (if any) is contiguous like Y
        pid = tl.program_id(0)
        rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        xrow = _row_offsets(rows, D1, D2, S0, S1, S2)[:, None]
        yrow = rows.to(tl.int64)[:, None] * N
        cols = tl.arange(0, BLOCK_N)
        out_ty = Y.dtype.element_ty
        if SINGLE:
            cmask = cols < N
            m = rmask[:, None] & cmask[None, :]
            h = tl.load(X + xrow + cols[None, :], mask=m, other=0.0).to(tl.float32)
            g = h
            if GATE != 0:
                g = tl.load(G + yrow + cols[None, :], mask=m, other=0.0).to(tl.float32)
            if GATE == 2:
                h = h * _act(g, ACT)
            if STATS64:
                h64 = h.to(tl.float64)
                ss = tl.sum(h64 * h64, axis=1)
            else:
                ss = tl.sum(h * h, axis=1)
            rstd = _rstd(ss, N, eps)
            a = rstd
            if WMODE != 0:
                a = _wfac(tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32), WMODE, X, W)[None, :]
            y = _form_out(h, g, rstd[:, None], a, X, W, NRND, WMODE, PRND, GATE, ACT, RSTD_RND)
            tl.store(Y + yrow + cols[None, :], y.to(out_ty), mask=m)
        else:
            acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float64 if STATS64 else tl.float32)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                m = rmask[:, None] & (c < N)[None, :]
                h = tl.load(X + xrow + c[None, :], mask=m, other=0.0).to(tl.float32)
                if GATE == 2:
                    h = h * _act(tl.load(G + yrow + c[None, :], mask=m, other=0.0).to(tl.float32), ACT)
                h = h.to(acc.dtype)
                acc += h * h
            rstd = _rstd(tl.sum(acc, axis=1), N, eps)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                cm = c < N
                m = rmask[:, None] & cm[None, :]
                h = tl.load(X + xrow + c[None, :], mask=m, other=0.0).to(tl.float32)
                g = h
                if GATE != 0:
                    g = tl.load(G + yrow + c[None, :], mask=m, other=0.0).to(tl.float32)
                if GATE == 2:
                    h = h * _act(g, ACT)
                a = rstd
                if WMODE != 0:
                    a = _wfac(tl.load(W + c, mask=cm, other=0.0).to(tl.float32), WMODE, X, W)[None, :]
                y = _form_out(h, g, rstd[:, None], a, X, W, NRND, WMODE, PRND, GATE, ACT, RSTD_RND)
                tl.store(Y + yrow + c[None, :], y.to(out_ty), mask=m)
        if WRITE_RSTD:
            tl.store(RSTD + rows, rstd, mask=rmask)

    @triton.jit
    def _bwd_form_load_tile(DY, X, G, RSTD, tile, n_rows, N, cols, cmask,
                            XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2,
                            BLOCK_R: tl.constexpr, GATE: tl.constexpr):
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        m = rmask[:, None] & cmask[None, :]
        x, dy, rstd = _bwd_load_tile(DY, X, RSTD, tile, n_rows, cols, cmask,
                                     XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2, BLOCK_R)
        g = x
        if GATE != 0:
            g = tl.load(G + rows.to(tl.int64)[:, None] * N + cols[None, :], mask=m, other=0.0)
        return x, dy, g, rstd

    @triton.jit
    def _rms_bwd_form_kernel(DY, X, W, RSTD, DX, PART, CNT, DW, G, DG, n_rows, N, n_tiles,
                             XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2,
                             BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, PREFETCH: tl.constexpr,
                             GROUP: tl.constexpr, RB_P: tl.constexpr, RB_N: tl.constexpr, FINISH: tl.constexpr,
                             NRND: tl.constexpr, WMODE: tl.constexpr, PRND: tl.constexpr, QRND: tl.constexpr,
                             GATE: tl.constexpr, ACT: tl.constexpr, RSTD_RND: tl.constexpr):
        # _rms_bwd_kernel for the other forms (persistent; rows fit one block); DG like DX
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        in_ty = X.dtype.element_ty
        cols = tl.arange(0, BLOCK_N)
        cmask = cols < N
        a = cols.to(tl.float32)[None, :]
        if WMODE != 0:
            a = _wfac(tl.load(W + cols, mask=cmask, other=0.0).to(tl.float32), WMODE, X, W)[None, :]
        acc = tl.zeros([BLOCK_R, BLOCK_N], dtype=tl.float32)
        if PREFETCH:
            x_nx, dy_nx, g_nx, rstd_nx = _bwd_form_load_tile(DY, X, G, RSTD, pid, n_rows, N, cols, cmask, XD1, XD2,
                                                              XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2, BLOCK_R, GATE)
        for tile in range(pid, n_tiles, nprog):
            if PREFETCH:
                x = x_nx.to(tl.float32)
                dy = dy_nx.to(tl.float32)
                g = g_nx.to(tl.float32)
                rstd = rstd_nx
                x_nx, dy_nx, g_nx, rstd_nx = _bwd_form_load_tile(DY, X, G, RSTD, tile + nprog, n_rows, N, cols, cmask,
                                                                  XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2,
                                                                  BLOCK_R, GATE)
            else:
                x, dy, g, rstd = _bwd_form_load_tile(DY, X, G, RSTD, tile, n_rows, N, cols, cmask, XD1, XD2,
                                                     XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2, BLOCK_R, GATE)
                x = x.to(tl.float32)
                dy = dy.to(tl.float32)
                g = g.to(tl.float32)
            rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
            m = (rows < n_rows)[:, None] & cmask[None, :]
            orow = rows.to(tl.int64)[:, None] * N + cols[None, :]
            r2 = rstd[:, None]
            if RSTD_RND:
                # y = x * rstd.to(in): both products in the input dtype, the row sum too
                rr = rstd.to(in_ty).to(tl.float32)
                drr = tl.sum(_rnd(dy * x, 1, X, W), axis=1).to(in_ty).to(tl.float32)
                dvar = (-0.5 * drr) * (rstd * rstd * rstd)
                dx = _rnd(dy * rr[:, None], 1, X, W) + _rnd((dvar / N)[:, None] * (2.0 * x), 1, X, W)
            else:
                h, gn, term, s = _form_grads(x, g, dy, r2, a, X, W, NRND, WMODE, PRND, QRND, GATE, ACT)
                dot = tl.sum(gn * h, axis=1)
                dvar = (-0.5 * dot) * (rstd * rstd * rstd)
                dx, dg = _form_dx(x, g, h, gn, s, r2, dvar[:, None], N, GATE, ACT)
                if GATE == 1:
                    dg = s
                if GATE != 0:
                    tl.store(DG + orow, dg.to(DG.dtype.element_ty), mask=m)
                if WMODE != 0:
                    acc += term
            tl.store(DX + orow, dx.to(in_ty), mask=m)
        if WMODE != 0:
            tl.store(PART + pid.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=cmask)
            if FINISH == 1:
                _dw_finish(PART, CNT, DW, pid, nprog, N, GROUP, RB_P, RB_N)
            if FINISH == 2:
                _dw_finish_cols(PART, CNT, DW, pid, nprog, N, RB_N, RB_P)

    @triton.jit
    def _rms_bwd_loop_form_kernel(DY, X, W, RSTD, DX, PART, CNT, DW, G, DG, n_rows, N,
                                  XD1, XD2, XS0, XS1, XS2, GD1, GD2, GS0, GS1, GS2,
                                  BLOCK_N: tl.constexpr, GROUP: tl.constexpr, RB_P: tl.constexpr,
                                  RB_N: tl.constexpr, FINISH: tl.constexpr, NRND: tl.constexpr,
                                  WMODE: tl.constexpr, PRND: tl.constexpr, QRND: tl.constexpr,
                                  GATE: tl.constexpr, ACT: tl.constexpr, RSTD_RND: tl.constexpr):
        # _rms_bwd_loop_kernel for the other forms: one row at a time, two passes over column blocks
        pid = tl.program_id(0)
        nprog = tl.num_programs(0)
        in_ty = X.dtype.element_ty
        cols = tl.arange(0, BLOCK_N)
        prow = PART + pid.to(tl.int64) * N
        for row in range(pid, n_rows, nprog):
            xb = X + _row_offsets(row, XD1, XD2, XS0, XS1, XS2)
            gb = DY + _row_offsets(row, GD1, GD2, GS0, GS1, GS2)
            ob = tl.cast(row, tl.int64) * N
            rstd = tl.load(RSTD + row)
            dacc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                cm = c < N
                x = tl.load(xb + c, mask=cm, other=0.0).to(tl.float32)
                dy = tl.load(gb + c, mask=cm, other=0.0).to(tl.float32)
                if RSTD_RND:
                    dacc += _rnd(dy * x, 1, X, W)
                else:
                    g = x
                    if GATE != 0:
                        g = tl.load(G + ob + c, mask=cm, other=0.0).to(tl.float32)
                    a = x
                    if WMODE != 0:
                        a = _wfac(tl.load(W + c, mask=cm, other=0.0).to(tl.float32), WMODE, X, W)
                    h, gn, term, s = _form_grads(x, g, dy, rstd, a, X, W, NRND, WMODE, PRND, QRND, GATE, ACT)
                    dacc += gn * h
            if RSTD_RND:
                dvar = (-0.5 * tl.sum(dacc, axis=0).to(in_ty).to(tl.float32)) * (rstd * rstd * rstd)
            else:
                dvar = (-0.5 * tl.sum(dacc, axis=0)) * (rstd * rstd * rstd)
            for c0 in range(0, N, BLOCK_N):
                c = c0 + cols
                cm = c < N
                x = tl.load(xb + c, mask=cm, other=0.0).to(tl.float32)
                dy = tl.load(gb + c, mask=cm, other=0.0).to(tl.float32)
                if RSTD_RND:
                    rr = rstd.to(in_ty).to(tl.float32)
                    dx = _rnd(dy * rr, 1, X, W) + _rnd((dvar / N) * (2.0 * x), 1, X, W)
                else:
                    g = x
                    if GATE != 0:
                        g = tl.load(G + ob + c, mask=cm, other=0.0).to(tl.float32)
                    a = x
                    if WMODE != 0:
                        a = _wfac(tl.load(W + c, mask=cm, other=0.0).to(tl.float32), WMODE, X, W)
                    h, gn, term, s = _form_grads(x, g, dy, rstd, a, X, W, NRND, WMODE, PRND, QRND, GATE, ACT)
                    dx, dg = _form_dx(x, g, h, gn, s, rstd, dvar, N, GATE, ACT)
                    if GATE == 1:
                        dg = s
                    if GATE != 0:
                        tl.store(DG + ob + c, dg.to(DG.dtype.element_ty), mask=cm)
                    if WMODE != 0:
                        p = tl.where(row > pid, tl.load(prow + c, mask=cm, other=0.0), 0.0)
                        tl.store(prow + c, p + term, mask=cm)
                tl.store(DX + ob + c, dx.to(in_ty), mask=cm)
        if WMODE != 0:
            if FINISH == 1:
                _dw_finish(PART, CNT, DW, pid, nprog, N, GROUP, RB_P, RB_N)
            if FINISH == 2:
                _dw_finish_cols(PART, CNT, DW, pid, nprog, N, RB_N, RB_P)



# ----------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------
def _row_layout(t: torch.Tensor) -> Optional[tuple]:
    """(D1, D2, S0, S1, S2) addressing the rows of ``t`` ([..., N], last dim contiguous) as up
    to three strided groups of leading dims, or None when that is not possible."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return None
    groups: list = []  # [size, stride], innermost first
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size == 1:
            continue
        if groups and groups[-1][0] * groups[-1][1] == stride:
            groups[-1][0] *= size
        else:
            groups.append([size, stride])
    if not groups:
        return (1, 1, 0, 0, 0)
    if len(groups) > 3:
        return None
    if len(groups) == 1:
        return (1, 1, groups[0][1], 0, 0)
    if len(groups) == 2:
        (d2, s2), (_, s0) = groups
        return (1, d2, s0, 0, s2)
    (d2, s2), (d1, s1), (_, s0) = groups
    return (d1, d2, s0, s1, s2)


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


_occupancy_cache: dict = {}


def _occupancy(kernel, args: tuple, meta: dict, t: torch.Tensor) -> int:
    """Programs of ``kernel`` (compiled for these args) resident on one SM at once, from its
    register and shared-memory use; computed once per configuration (compiles it if needed)."""
    num_warps = meta["num_warps"]
    key = (id(kernel), _device_index(t), args[0].dtype, args[1].dtype, getattr(args[2], "dtype", None),
           tuple(meta.items()))
    occ = _occupancy_cache.get(key)
    if occ is None:
        occ = max(1, 32 // num_warps)  # a guess, used if the compiled kernel cannot be inspected
        try:
            compiled = kernel.warmup(*args, grid=(1,), **meta)
            compiled._init_handles()
            props = torch.cuda.get_device_properties(_device_index(t))
            regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
            threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
            smem_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
            regs = max(1, int(compiled.n_regs))
            regs_warp = -(-regs * 32 // 256) * 256  # registers are allocated per warp in 256s
            by_regs = regs_sm // (regs_warp * num_warps)
            by_threads = threads_sm // (32 * num_warps)
            smem = int(getattr(compiled.metadata, "shared", 0) or 0)
            by_smem = smem_sm // (smem + 1024) if smem else by_threads
            occ = max(1, min(by_regs, by_threads, by_smem))
        except Exception:  # pragma: no cover - depends on the Triton version
            pass
        _occupancy_cache[key] = occ
    return occ


def _persistent_grid(kernel, args: tuple, meta: dict, t: torch.Tensor, work: int, per_sm: int = 64) -> int:
    if not t.is_cuda:
        return max(1, min(work, _INTERPRET_PROGRAMS))
    return max(1, min(work, _sm_count(_device_index(t)) * min(per_sm, _occupancy(kernel, args, meta, t))))


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _fwd_config(n_rows: int, N: int, elem: int, cap_rows: int) -> tuple:
    if N <= _MAX_FWD_BLOCK:
        block_n, single = triton.next_power_of_2(N), True
    else:
        block_n, single = _LOOP_BLOCK, False
    block_r = max(1, (_FWD_TILE_BYTES // elem) // block_n)
    block_r = min(block_r, triton.next_power_of_2(max(n_rows, 1)), 128)
    # keep at least `cap_rows` programs busy when the input is short (decode-like shapes)
    block_r = max(1, min(block_r, _prev_pow2(max(n_rows // max(cap_rows, 1), 1))))
    num_warps = min(16, max(1, (block_r * block_n) // _FWD_ELEMS_PER_WARP))
    return block_r, block_n, single, num_warps


def _bwd_config(n_rows: int, N: int) -> tuple:
    if N <= _MAX_BWD_BLOCK:
        block_n = triton.next_power_of_2(N)
        block_r = max(1, _BWD_TILE_ELEMS // block_n)
        block_r = min(block_r, triton.next_power_of_2(max(n_rows, 1)))
        num_warps = min(16, max(1, (block_r * block_n) // _BWD_ELEMS_PER_WARP))
        return block_r, block_n, True, num_warps
    return 1, _LOOP_BLOCK, False, min(16, max(4, _LOOP_BLOCK // 512))


class _on_device:
    """Launch on the tensor's CUDA device (Triton launches on the current one)."""

    def __init__(self, t: torch.Tensor):
        self.ctx = None
        if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
            self.ctx = torch.cuda.device(t.device.index)

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *a):
        if self.ctx is not None:
            self.ctx.__exit__(*a)


# Launch plans: everything a call derives from shapes, strides, dtypes, devices and pointer
# alignment (configs, grids, persistent-program counts, workspace sizes, the compiled kernels),
# computed once per such key. A repeated call then builds its key, allocates its outputs and
# launches one kernel through the compiled kernel's C launcher (``CachedLaunches``).
#
# Keys are plain tuples (built on every call: a record's constructor would cost a Python call
# there); the records below name their fields for the code that reads them (``FwdKey._make(k)``).
# Plans are records (tuples: the per-call paths unpack them into locals at once).
class TensorKey(NamedTuple):
    """What a plan depends on of one tensor (``_tkey``)."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    align: int  # data_ptr() & 15


class FwdKey(NamedTuple):
    """The Llama form's forward key (``_fwd_key``)."""
    x_shape: tuple
    x_stride: tuple
    x_dtype: torch.dtype
    x_device: torch.device
    x_align: int
    w_shape: tuple
    w_stride: tuple
    w_dtype: torch.dtype
    w_device: torch.device
    w_align: int
    write_rstd: bool  # a backward follows


class BwdKey(NamedTuple):
    """The Llama form's backward key (``_bwd_key``)."""
    x_shape: tuple
    x_stride: tuple
    x_dtype: torch.dtype
    x_device: torch.device
    x_align: int
    dy_shape: tuple
    dy_stride: tuple
    dy_dtype: torch.dtype
    dy_device: torch.device
    dy_align: int
    w_stride: tuple
    w_dtype: torch.dtype
    w_align: int
    rstd_align: int


class FormKey(NamedTuple):
    """The other forms' forward key (``_form_key``)."""
    form: "RMSForm"
    x_shape: tuple
    x_stride: tuple
    x_dtype: torch.dtype
    x_device: torch.device
    x_align: int
    w: Optional[tuple]  # TensorKey fields, or None
    g: Optional[tuple]
    write_rstd: bool


class FormBwdKey(NamedTuple):
    """The other forms' backward key (``_form_bwd_key``)."""
    form: "RMSForm"
    x_shape: tuple
    x_stride: tuple
    x_dtype: torch.dtype
    x_device: torch.device
    x_align: int
    dy_shape: tuple
    dy_stride: tuple
    dy_dtype: torch.dtype
    dy_device: torch.device
    dy_align: int
    w: Optional[tuple]
    g: Optional[tuple]
    rstd_align: int


class FastKey(NamedTuple):
    """A backward fast path's key: the forward's key and the incoming gradient's layout (its shape
    and device are the output's, checked by autograd)."""
    key: tuple
    dy_stride: tuple
    dy_dtype: torch.dtype
    dy_align: int


class FormSpec(NamedTuple):
    """What another form changes in a plan: its kernels' constexprs and output dtype (and, for the
    backward, the gate when the kernels read one)."""
    consts: dict
    out_dtype: torch.dtype
    gate: Optional[torch.Tensor] = None


class FwdPlan(NamedTuple):
    """The forward's launch plan (``_fwd_plan``; the other forms' too)."""
    copy: bool  # x's rows cannot be addressed in place: x is copied contiguous first
    wcopy: bool  # the weight is strided: copied
    like: bool  # y is empty_like(x)
    out_dtype: torch.dtype
    rshape: tuple  # rstd's shape
    device: torch.device
    ints: tuple  # the kernel's integer arguments (n_rows, N, D1, D2, S0, S1, S2)
    grid: tuple
    const: dict  # the kernel's constexprs, in its parameter order
    num_warps: int
    dev: Optional[int]  # the CUDA device's index (None: CPU, the interpreter)
    lkey: tuple  # the launch's key in ``_launches``: (kind,) + the plan's key
    gate_copy: bool = False  # other forms: the gate is copied contiguous
    gated: bool = False  # other forms: the kernel reads a gate


class ReducePlan(NamedTuple):
    """The weight-gradient sum's own launch (``_dw_reduce_kernel``)."""
    grid: tuple
    const: dict


class BwdPlan(NamedTuple):
    """The backward's launch plan (``_bwd_plan``; the other forms' too)."""
    convert: bool  # dy is converted to the output dtype
    out_dtype: torch.dtype
    xcopy: bool  # x's rows cannot be addressed in place: copied
    gcopy: bool  # dy's rows cannot be addressed in place: copied
    wcopy: bool
    dx_like: bool  # dx is empty_like(x)
    device: torch.device
    kernel: object  # the persistent or the looping kernel
    ints: tuple  # (n_rows, N[, n_tiles]) + x's and dy's row layouts
    progs: int  # persistent programs
    const: dict
    num_warps: int
    ws_numel: int  # workspace floats (weight-gradient partials)
    n_cnt: int  # workspace counters
    red: Optional[ReducePlan]  # the weight-gradient sum's own launch, or None (summed in the launch)
    dev: Optional[int]
    lkey: tuple
    gate_copy: bool = False  # other forms: the gate is copied contiguous
    gated: bool = False  # other forms: the kernels read a gate (and write its gradient)


# A form whose rounding at these dtypes is the Llama form's: its plan entry (the Llama op runs it)
AS_LLAMA = "as llama"


class NativeEntry(NamedTuple):
    """A forward key's C++ node: the extension's function, the plan id it was registered under,
    the CUDA device index."""
    apply: object
    plan_id: int
    dev: int


class NativePending(NamedTuple):
    """A forward key's launches noted for the C++ node until the extension is built."""
    fast_key: tuple
    bplan: BwdPlan
    bfn: object  # the backward's direct launcher


def _key_of(lkey: tuple) -> tuple:
    """The plan key inside a launch key ``(kind,) + key``."""
    return lkey[1:]


class PlanCache:
    """Every cache of the RMSNorm's launch plans, with one clearing path. The dicts are made once
    and only ever cleared in place, so the per-call paths hold them as module globals (one lookup
    fewer than through this object)."""

    MAX_PLANS = 4096

    def __init__(self):
        self.fwd_plans: dict = {}  # FwdKey -> FwdPlan
        self.bwd_plans: dict = {}  # BwdKey -> BwdPlan
        self.form_fwd_plans: dict = {}  # FormKey -> FwdPlan or AS_LLAMA
        self.form_bwd_plans: dict = {}  # FormBwdKey -> BwdPlan or AS_LLAMA
        # fast paths: per key, once its kernel has a direct launcher, a closure that allocates
        # the outputs and makes the one launch (no plan unpacking, no launcher lookup): the
        # backward's runs on autograd's device thread, where every Python step costs more than on
        # the calling thread. The backward's are keyed by FastKey.
        self.fwd_fast: dict = {}
        self.bwd_fast: dict = {}
        self.form_fwd_fast: dict = {}
        self.form_bwd_fast: dict = {}
        # C++ autograd node entries: forward key -> NativeEntry (None: not describable)
        self.native_plans: dict = {}
        self.native_pending: dict = {}  # forward key -> NativePending until the build is done
        # launch descriptions -> the extension's plan id (kept by clear(): the extension keeps them)
        self.native_ids: dict = {}
        self.launches = CachedLaunches()

    def _derived(self):
        return (self.fwd_fast, self.bwd_fast, self.form_fwd_fast, self.form_bwd_fast, self.native_plans,
                self.native_pending)

    def clear(self) -> None:
        """Forget every plan, fast path, C++ node entry and compiled launch."""
        for d in (self.fwd_plans, self.bwd_plans, self.form_fwd_plans, self.form_bwd_plans) + self._derived():
            d.clear()
        self.launches.clear()

    def remember(self, plans: dict, key, plan):
        """``plans[key] = plan``; a full dict starts over (shapes that never repeat), with what
        was derived from plans (fast paths, C++ node entries)."""
        if len(plans) >= self.MAX_PLANS:
            plans.clear()
            for d in self._derived():
                d.clear()
        plans[key] = plan
        return plan


PLANS = PlanCache()
_fwd_plans = PLANS.fwd_plans
_bwd_plans = PLANS.bwd_plans
_form_fwd_plans = PLANS.form_fwd_plans
_form_bwd_plans = PLANS.form_bwd_plans
_fwd_fast = PLANS.fwd_fast
_bwd_fast = PLANS.bwd_fast
_form_fwd_fast = PLANS.form_fwd_fast
_form_bwd_fast = PLANS.form_bwd_fast
_native_plans = PLANS.native_plans
_native_pending = PLANS.native_pending
_native_ids = PLANS.native_ids
_launches = PLANS.launches
_F32 = torch.float32

# ``NATIVE``: whether calls may use the C++ node (the benchmark times both paths).
NATIVE = True


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def _offer_native(fast_key, bplan, bfn) -> None:
    """Note this key's launches for the C++ node when its inputs are aligned and the backward's
    incoming gradient is the planned one (contiguous, the output dtype, aligned), and register
    them if the extension is ready (else the forward's hot path registers them once it is)."""
    fkey, dstride, ddtype, dalign = fast_key
    fplan = _fwd_plans.get(fkey)
    k = FwdKey._make(fkey)
    if fkey in _native_plans or dalign or k.x_align or k.w_align or fplan is None:
        return
    if ddtype != fplan.out_dtype or dstride != _contiguous_strides(k.x_shape):
        return
    _native_pending[fkey] = NativePending(fast_key, bplan, bfn)
    _register_native(fkey)


def _register_native(fkey):
    """The C++ node's entry for forward key ``fkey`` (registered now if pending and the extension
    is built), or None. Safe to call from the forward's thread and autograd's device thread at once:
    the pending entry is taken by one of them."""
    pending = _native_pending.pop(fkey, None)
    if pending is None:
        return _native_plans.get(fkey)
    mod = _native.get()
    if mod is None:
        if _native.enabled():  # still building: ask again on a later call
            _native_pending.setdefault(fkey, pending)
        return None
    fast_key, bplan, bfn = pending
    fplan = _fwd_plans.get(fkey)
    ffn = _launches.get(fplan.lkey) if fplan is not None else None
    if ffn is None or _fwd_fast.get(fkey) is None or _bwd_fast.get(fast_key) is None:
        return None
    P = _native.PTR
    fdesc = _native.describe(ffn, [(P, 0), (P, 1), (P, 2), (P, 3)] + list(fplan.ints) + [_native.EPS])
    ws_numel, n_cnt = bplan.ws_numel, bplan.n_cnt
    bdesc = _native.describe(bfn, [(P, i) for i in range(8)] + list(bplan.ints))
    if fdesc is None or bdesc is None:
        _native_plans[fkey] = None  # not describable: this key keeps the Python node
        return None
    k = FwdKey._make(fkey)
    like = fplan.like
    dtypes = (k.x_dtype, k.w_dtype, fplan.out_dtype)
    ident = (fdesc, bdesc, dtypes, bool(like), int(ws_numel), int(n_cnt))
    plan_id = _native_ids.get(ident)
    if plan_id is None:  # the extension keeps every plan: one per distinct description
        plan_id = _native_ids[ident] = mod.register_rms_plan(
            *fdesc, *bdesc, *(torch.empty(0, dtype=d) for d in dtypes), bool(like), int(ws_numel), int(n_cnt))
    nat = _native_plans[fkey] = NativeEntry(mod.rms_norm, plan_id, fplan.dev)
    return nat


def clear_plans() -> None:
    """Forget the launch plans (tests that change the tuning knobs call this)."""
    PLANS.clear()


_remember = PLANS.remember


def _make_fwd_fast(plan, fn):
    copy, wcopy, like, out_dtype, rshape, device, ints, grid, const, num_warps, dev, lkey, _, _ = plan
    parts = getattr(fn, "parts", None)
    if copy or wcopy or dev is None or parts is None:
        return None
    launch, grid3, fixed, tail = launch_binding(parts)
    write_rstd = const["WRITE_RSTD"]
    empty, empty_like, get_device, raw_stream, hooks = torch.empty, torch.empty_like, _current_device, _raw_stream, _launch_hooks

    def run(x, w, eps):
        if get_device() != dev or hooks():
            return None
        y = empty_like(x) if like else empty(x.shape, dtype=out_dtype, device=device)
        rstd = empty(rshape, dtype=_F32, device=device) if write_rstd else None
        launch(*grid3, raw_stream(dev), *fixed,
               x.data_ptr(), w.data_ptr(), y.data_ptr(), (rstd if write_rstd else y).data_ptr(), *ints, eps, *tail)
        return y, rstd

    return run


def _make_bwd_fast(plan, fn):
    (convert, out_dtype, xcopy, gcopy, wcopy, dx_like, device, kernel, ints, progs, const, num_warps, ws_numel,
     n_cnt, red, dev, lkey, _, _) = plan
    parts = getattr(fn, "parts", None)
    if convert or xcopy or gcopy or wcopy or not dx_like or dev is None or red is not None or parts is None:
        return None
    launch, grid3, fixed, tail = launch_binding(parts)
    rest = tuple(ints) + tuple(tail)
    empty_like, get_device, raw_stream, capturing, hooks = torch.empty_like, _current_device, _raw_stream, _stream_capturing, _launch_hooks
    workspaces = _workspaces
    k = BwdKey._make(_key_of(lkey))
    x_dtype, x_align, w_dtype, w_align = k.x_dtype, k.x_align, k.w_dtype, k.w_align

    def run(dy, x, w, rstd):
        if capturing() or get_device() != dev or hooks():
            return None
        # saved-tensor hooks may hand back other dtypes or layouts than the key's: the plan path then
        if (x.dtype != x_dtype or w.dtype != w_dtype or (x.data_ptr() & 15) != x_align
                or (w.data_ptr() & 15) != w_align or not x.is_contiguous() or rstd.data_ptr() & 15):
            return None
        stream = raw_stream(dev)
        ws = workspaces.get((dev, stream))
        if ws is None or ws[0].numel() < ws_numel or ws[1].numel() < n_cnt:
            ws = _workspace(device, dev, stream, ws_numel, n_cnt)
        dx = empty_like(x)
        dw = empty_like(w)
        launch(*grid3, stream, *fixed,
               dy.data_ptr(), x.data_ptr(), w.data_ptr(), rstd.data_ptr(), dx.data_ptr(), ws[0].data_ptr(),
               ws[1].data_ptr(), dw.data_ptr(), *rest)
        return dx, dw, None, None, None

    return run


def _cuda_index(t: torch.Tensor) -> Optional[int]:
    return _device_index(t) if t.is_cuda else None


def _current_device_is(dev: int) -> bool:
    return _current_device() == dev


# ---- workspace: the backward's weight-gradient partials and its arrival counters ---------------
# One per (device, stream), grown when a larger one is needed and never freed (a CUDA graph
# captured earlier may still use a smaller one, and kernels in flight may too). The counters
# are zero between launches: each is reset by the program that uses it last. Launches on one
# stream run one after another, so they can share it; launches on another stream get their own.
# While a stream is being captured into a CUDA graph, each call gets a private workspace from
# the graph's pool (zeroed inside the graph), so replays never share one with eager work.
_N_COUNTERS = 1024
_workspaces: dict = {}
_retired: list = []


def _workspace(device: torch.device, dev: Optional[int], stream: int, numel: int, n_cnt: int):
    if dev is not None and _stream_capturing():
        return (torch.empty(numel, dtype=_F32, device=device), torch.zeros(n_cnt, dtype=torch.int32, device=device))
    key = (dev, stream) if dev is not None else (device.type, 0)
    ws = _workspaces.get(key)
    if ws is not None and ws[0].numel() >= numel and ws[1].numel() >= n_cnt:
        return ws
    if ws is not None:
        _retired.append(ws)
        numel = max(numel, 2 * ws[0].numel())
    ws = (torch.empty(numel, dtype=_F32, device=device),
          torch.zeros(max(n_cnt, _N_COUNTERS), dtype=torch.int32, device=device))
    _workspaces[key] = ws
    return ws


_SMALL_ELEMS = 1 << 20  # inputs this small are host-bound: one launch whatever the tail
_MAX_TAIL_BYTES = 65536  # in-launch weight-gradient sum only while its serial tail reads at most this


def _reduce_meta(progs: int, N: int, n_rows: int = 0) -> tuple:
    """(GROUP, RB_P, RB_N, workspace rows, counters, FINISH) of the weight-gradient sum. FINISH:
    summed in the backward's own launch (the last programs, two levels); otherwise, where the
    serial tail (a group's rows, then the groups' rows, read by one program each) would be
    latency-bound, a second launch sums column strips in parallel. Small inputs (host-bound: the
    device waits for the launches anyway) always sum in the one launch."""
    group = min(64, max(2, triton.next_power_of_2(math.isqrt(max(progs - 1, 0)) + 1)))
    n_groups = triton.cdiv(progs, group)
    rb_p = 16
    rb_n = min(triton.next_power_of_2(N), 256)
    finish = (group + n_groups) * N * 4 <= _MAX_TAIL_BYTES or n_rows * N <= _SMALL_ELEMS
    return group, rb_p, rb_n, progs + n_groups, n_groups + 1, finish


_COL_FINISH = True  # wide sums: finished in the launch by its last programs, a column strip each


def _col_finish_meta(progs: int, N: int, on_gpu: bool, sms: int = 0) -> tuple:
    """(SW, RB_P) of the column-parallel finish: strips of SW columns, one per finisher, at most
    64 finishers, never more than the programs nor half the SMs (the finishers wait for the last
    programs: at least as many programs as finishers must fit on the device at once, even with
    other kernels holding SMs); under the interpreter one finisher (its programs run one after
    another, so none may wait for a later one)."""
    if on_gpu:
        sw = max(16, triton.next_power_of_2(triton.cdiv(N, max(1, min(64, progs, sms // 2)))))
    else:
        sw = triton.next_power_of_2(N)
    return sw, max(1, min(4096 // sw, triton.next_power_of_2(progs)))


# ---- forward ------------------------------------------------------------------------------------
def _fwd_key(x: torch.Tensor, w: torch.Tensor, write_rstd: bool) -> tuple:
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, w.shape, w.stride(), w.dtype, w.device,
            w.data_ptr() & 15, write_rstd)


def _fwd_plan(x: torch.Tensor, w: Optional[torch.Tensor], write_rstd: bool, key,
              form: Optional[FormSpec] = None) -> FwdPlan:
    """The forward's launch plan; ``form``: None (the Llama form) or another form's
    :class:`FormSpec` (its kernel, ``_rms_fwd_form_kernel``, takes the gate pointer after RSTD)."""
    N = x.shape[-1]
    n_rows = x.numel() // N if N else 0
    lay = _row_layout(x)
    copy = lay is None
    if copy:
        lay = (1, 1, N, 0, 0)
    cap = _sm_count(_device_index(x)) if x.is_cuda else 1
    block_r, block_n, single, num_warps = _fwd_config(n_rows, N, x.element_size(), cap)
    grid = (triton.cdiv(n_rows, block_r),)
    const = dict(BLOCK_R=block_r, BLOCK_N=block_n, SINGLE=single, STATS64=x.dtype == torch.float32,
                 WRITE_RSTD=write_rstd)
    if form is None:
        out_dtype = torch.promote_types(x.dtype, w.dtype)
    else:
        const.update(form.consts)
        out_dtype = form.out_dtype
    like = out_dtype == x.dtype and (copy or x.is_contiguous())
    wcopy = w is not None and N > 1 and w.stride(0) != 1
    return FwdPlan(copy, wcopy, like, out_dtype, x.shape[:-1], x.device, (n_rows, N) + lay, grid, const, num_warps,
                   _cuda_index(x), ("fwd",) + key)


def _forward_impl(x: torch.Tensor, w: torch.Tensor, eps: float, y: Optional[torch.Tensor] = None,
                  rstd: Optional[torch.Tensor] = None, write_rstd: bool = True, key=None):
    """Forward into fresh (or given, contiguous: tests poison them) ``y`` and ``rstd`` (``rstd``
    is None when ``write_rstd`` is False: no backward follows)."""
    if key is None:
        key = _fwd_key(x, w, write_rstd)
    plan = _fwd_plans.get(key)
    if plan is None:
        if x.numel() == 0:
            y = y if y is not None else torch.empty(x.shape, dtype=output_dtype(x, w), device=x.device)
            if write_rstd and rstd is None:
                rstd = torch.empty(x.shape[:-1], dtype=_F32, device=x.device)
            return y, rstd
        plan = _remember(_fwd_plans, key, _fwd_plan(x, w, write_rstd, key))
    copy, wcopy, like, out_dtype, rshape, device, ints, grid, const, num_warps, dev, lkey, _, _ = plan
    if copy:
        x = x.contiguous()
    if wcopy:
        w = w.contiguous()
    given = y is not None or rstd is not None
    if y is None:
        y = torch.empty_like(x) if like else torch.empty(x.shape, dtype=out_dtype, device=device)
    if write_rstd and rstd is None:
        rstd = torch.empty(rshape, dtype=_F32, device=device)
    r = rstd if write_rstd else y  # not written without WRITE_RSTD
    if dev is not None and not given and _current_device_is(dev):
        fn = _launches.get(lkey)
        if fn is not None:
            fn(_raw_stream(dev), x.data_ptr(), w.data_ptr(), y.data_ptr(), r.data_ptr(),
               *ints, eps)
            if key not in _fwd_fast:
                _fwd_fast[key] = _make_fwd_fast(plan, fn)
            return y, rstd
    args = (x, w, y, r) + ints + (float(eps),)
    with _on_device(x):
        if given:  # outputs of any alignment: not a cached launch
            _rms_fwd_kernel[grid](*args, **const, num_warps=num_warps)
        else:
            _launches.launch(_rms_fwd_kernel, lkey, grid, args, const, num_warps, dev)
    return y, rstd


# ---- backward -----------------------------------------------------------------------------------
def _bwd_inputs(dy: torch.Tensor, x: torch.Tensor, convert: bool, out_dtype, xcopy: bool, gcopy: bool):
    """``dy`` in the output dtype and ``dy``/``x`` copied where the plan says their rows cannot be
    addressed in place."""
    if convert:
        dy = dy.to(out_dtype)
    if gcopy:
        dy = dy.contiguous()
    if xcopy:
        x = x.contiguous()
    return dy, x


def _bwd_key(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor) -> tuple:
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, dy.shape, dy.stride(), dy.dtype, dy.device,
            dy.data_ptr() & 15, w.stride(), w.dtype, w.data_ptr() & 15, rstd.data_ptr() & 15)


def _bwd_plan(dy: torch.Tensor, x: torch.Tensor, w: Optional[torch.Tensor], rstd: torch.Tensor, key,
              form: Optional[FormSpec] = None) -> BwdPlan:
    """The backward's launch plan; ``form``: None (the Llama form) or another form's
    :class:`FormSpec` (its kernels take the gate and its gradient after DW; without a weight
    there is no weight-gradient sum)."""
    N = x.shape[-1]
    n_rows = x.numel() // N
    out_dtype = torch.promote_types(x.dtype, w.dtype) if form is None else form.out_dtype
    convert = dy.dtype != out_dtype
    xl, gl = _row_layout(x), (None if convert else _row_layout(dy))
    xcopy, gcopy = xl is None, gl is None
    xl = (1, 1, N, 0, 0) if xcopy else xl
    gl = (1, 1, N, 0, 0) if gcopy else gl
    wcopy = w is not None and N > 1 and w.stride(0) != 1
    block_r, block_n, single, num_warps = _bwd_config(n_rows, N)
    # the call's own arguments (and stand-in outputs) probe the compiled kernel's occupancy,
    # which sizes the grid; the reduction knobs do not change the register use much, so the
    # probe uses those of the largest grid
    gs, xs = _bwd_inputs(dy, x, convert, out_dtype, xcopy, gcopy)
    ws = w.contiguous() if w is not None else None
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    probe = _reduce_meta(2048, N)
    probe_ws = (torch.empty(1, dtype=_F32, device=x.device), torch.zeros(1, dtype=torch.int32, device=x.device))
    red = dict(GROUP=probe[0], RB_P=probe[1], RB_N=probe[2], FINISH=1)
    pargs = (gs, xs, ws, rstd, dx) + probe_ws + (ws,)
    kernels, fconst = (_rms_bwd_kernel, _rms_bwd_loop_kernel), {}
    if form is not None:
        gate = form.gate.contiguous() if form.gate is not None else None
        pargs += (gate, None if gate is None else torch.empty_like(gate))
        kernels, fconst = (_rms_bwd_form_kernel, _rms_bwd_loop_form_kernel), form.consts
    if single:
        n_tiles = triton.cdiv(n_rows, block_r)
        kernel = kernels[0]
        ints = (n_rows, N, n_tiles) + xl + gl
        const = dict(BLOCK_R=block_r, BLOCK_N=block_n, PREFETCH=_BWD_PREFETCH)
        progs = _persistent_grid(kernel, pargs + ints, dict(const, **red, **fconst, num_warps=num_warps), x, n_tiles)
    else:
        kernel = kernels[1]
        ints = (n_rows, N) + xl + gl
        const = dict(BLOCK_N=block_n)
        # each program read-modify-writes its own partial row: keep their number (and the
        # partial buffer, which stays in L2) small
        progs = _persistent_grid(kernel, pargs + ints, dict(const, **red, **fconst, num_warps=num_warps), x, n_rows,
                                 per_sm=2)
    group, rb_p, rb_n, ws_rows, n_cnt, finish = _reduce_meta(progs, N, n_rows)
    dx_like = xcopy or x.is_contiguous()
    red = None
    if finish:
        const.update(GROUP=group, RB_P=rb_p, RB_N=rb_n, FINISH=1)
    elif _COL_FINISH:
        sw, rb_p = _col_finish_meta(progs, N, x.is_cuda, _sm_count(_device_index(x)) if x.is_cuda else 0)
        const.update(GROUP=group, RB_P=rb_p, RB_N=sw, FINISH=2)
        ws_rows, n_cnt = progs, 2
    else:  # a second launch; narrow column strips so the partial buffer is read by many programs at once
        const.update(GROUP=group, RB_P=rb_p, RB_N=rb_n, FINISH=0)
        rn = min(triton.next_power_of_2(N), 32)
        red = ReducePlan((triton.cdiv(N, rn),), dict(BLOCK_P=min(triton.next_power_of_2(progs), 128), BLOCK_N=rn))
    if form is not None:
        const.update(fconst)  # after the reduction's: the kernels' parameter order
        if w is None:  # no weight gradient: no second launch
            red = None
    return BwdPlan(convert, out_dtype, xcopy, gcopy, wcopy, dx_like, x.device, kernel, ints, progs, const, num_warps,
                   ws_rows * N, n_cnt, red, _cuda_index(x), ("bwd",) + key)


def _backward_impl(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
                   dx: Optional[torch.Tensor] = None, dw: Optional[torch.Tensor] = None, fast_key=None):
    """Backward into fresh (or given, contiguous: tests poison them) ``dx`` and ``dw``: one
    launch, the weight-gradient sum included. ``fast_key``: the autograd Function's key for
    this call's fast path (registered once the launch is direct)."""
    key = _bwd_key(dy, x, w, rstd)
    plan = _bwd_plans.get(key)
    if plan is None:
        if rstd.numel() == 0:
            dx = dx if dx is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
            dw = dw if dw is not None else torch.empty(w.shape, dtype=w.dtype, device=w.device)
            return dx, dw.zero_()
        plan = _remember(_bwd_plans, key, _bwd_plan(dy, x, w, rstd, key))
    (convert, out_dtype, xcopy, gcopy, wcopy, dx_like, device, kernel, ints, progs, const, num_warps, ws_numel,
     n_cnt, red, dev, lkey, _, _) = plan
    if convert or xcopy or gcopy:
        dy, x = _bwd_inputs(dy, x, convert, out_dtype, xcopy, gcopy)
    if wcopy:
        w = w.contiguous()
    given = dx is not None or dw is not None
    if dx is None:
        dx = torch.empty_like(x) if dx_like else torch.empty(x.shape, dtype=x.dtype, device=device)
    if dw is None:
        dw = torch.empty_like(w)
    if dev is not None:
        stream = _raw_stream(dev)
        part, cnt = _workspace(device, dev, stream, ws_numel, n_cnt)
        if not given and _current_device_is(dev):
            fn = _launches.get(lkey)
            fn_red = _launches.get(("red",) + lkey) if red is not None else True
            if fn is not None and fn_red is not None:
                fn(stream, dy.data_ptr(), x.data_ptr(), w.data_ptr(), rstd.data_ptr(), dx.data_ptr(), part.data_ptr(),
                   cnt.data_ptr(), dw.data_ptr(), *ints)
                if red is not None:
                    fn_red(stream, part.data_ptr(), dw.data_ptr(), progs, x.shape[-1])
                if fast_key is not None and fast_key not in _bwd_fast:
                    _bwd_fast[fast_key] = _make_bwd_fast(plan, fn)
                    if NATIVE and _native.enabled():
                        _offer_native(fast_key, plan, fn)
                return dx, dw
    else:
        part, cnt = _workspace(device, None, 0, ws_numel, n_cnt)
    args = (dy, x, w, rstd, dx, part, cnt, dw) + ints
    with _on_device(x):
        if given:
            kernel[(progs,)](*args, **const, num_warps=num_warps)
            if red is not None:
                _dw_reduce_kernel[red.grid](part, dw, progs, x.shape[-1], **red.const, num_warps=4)
        else:
            _launches.launch(kernel, lkey, (progs,), args, const, num_warps, dev)
            if red is not None:
                _launches.launch(_dw_reduce_kernel, ("red",) + lkey, red.grid, (part, dw, progs, x.shape[-1]), red.const, 4,
                                 dev)
    return dx, dw


# ----------------------------------------------------------------------------------------------
# Custom ops (torch.compile traces through them; no host synchronisation)
# ----------------------------------------------------------------------------------------------
@torch.library.custom_op("deepspeed_fused::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd(x: torch.Tensor, w: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward_impl(x, w, eps)


@_rms_norm_fwd.register_fake
def _(x, w, eps):
    y = x.new_empty(x.shape, dtype=torch.promote_types(x.dtype, w.dtype))
    return y, x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("deepspeed_fused::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                  rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward_impl(dy, x, w, rstd)


@_rms_norm_bwd.register_fake
def _(dy, x, w, rstd):
    return x.new_empty(x.shape), w.new_empty(w.shape)


def _setup_context(ctx, inputs, output):
    x, w, _ = inputs
    _, rstd = output
    ctx.save_for_backward(x, w, rstd)
    ctx.mark_non_differentiable(rstd)


def _backward(ctx, dy, _drstd):
    x, w, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_bwd(dy, x, w, rstd)
    return dx, dw, None


_rms_norm_fwd.register_autograd(_backward, setup_context=_setup_context)


class _FusedRMSNormFn(torch.autograd.Function):
    """The same kernels for eager mode: autograd.Function dispatch costs a fraction of a custom
    op's Python dispatch, which dominates short (decode-like) inputs. torch.compile traces the
    custom op instead. ``key`` is the forward's launch-plan key (already built by the caller)."""

    @staticmethod
    def forward(ctx, x, w, eps, key, run=None):
        out = run(x, w, eps) if run is not None else None
        y, rstd = out if out is not None else _forward_impl(x, w, eps, key=key)
        ctx.save_for_backward(x, w, rstd)
        ctx.key = key
        return y

    @staticmethod
    def backward(ctx, dy):
        # create_graph=True: the gradient is not differentiable again (once_differentiable makes a
        # second differentiation raise); otherwise skip that wrapper's cost
        if torch.is_grad_enabled():
            return _backward_once(ctx, dy)
        x, w, rstd = ctx.saved_tensors
        fast_key = (ctx.key, dy.stride(), dy.dtype, dy.data_ptr() & 15)
        run = _bwd_fast.get(fast_key)
        if run is not None:
            out = run(dy, x, w, rstd)
            if out is not None:
                return out
        dx, dw = _backward_impl(dy, x, w, rstd, fast_key=fast_key)
        return dx, dw, None, None, None


def _backward_body(ctx, dy):
    x, w, rstd = ctx.saved_tensors
    dx, dw = _backward_impl(dy, x, w, rstd)
    return dx, dw, None, None, None


_backward_once = once_differentiable(_backward_body)


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------
def _validate(hidden, weight, eps) -> None:
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"fused_rms_norm: hidden must be a tensor, got {type(hidden).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"fused_rms_norm: weight must be a tensor, got {type(weight).__name__}")
    if not hidden.is_floating_point():
        raise TypeError(f"fused_rms_norm: hidden must be a floating-point tensor, got {hidden.dtype}")
    if not weight.is_floating_point():
        raise TypeError(f"fused_rms_norm: weight must be a floating-point tensor, got {weight.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (float, int)):
        raise TypeError(f"fused_rms_norm: eps must be a float, got {type(eps).__name__}")
    if hidden.dim() == 0:
        raise ValueError("fused_rms_norm: hidden must have at least one dimension [..., N]")
    if weight.dim() != 1 or weight.shape[0] != hidden.shape[-1]:
        raise ValueError(f"fused_rms_norm: weight must have shape ({hidden.shape[-1]},) to match the last "
                         f"dimension of hidden {tuple(hidden.shape)}, got {tuple(weight.shape)}")
    if weight.device != hidden.device:
        raise ValueError(f"fused_rms_norm: weight must be on hidden's device {hidden.device}, got {weight.device}")


def rms_norm_kernel_ok(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[bool, str]:
    """Whether the kernels take these (valid) inputs; otherwise the reason."""
    ok, reason = kernel_device_ok(hidden)
    if not ok:
        return False, reason
    if hidden.dtype not in _KERNEL_DTYPES:
        return False, f"input dtype {hidden.dtype} (kernels take float16, bfloat16, float32)"
    if weight.dtype not in _KERNEL_DTYPES:
        return False, f"weight dtype {weight.dtype} (kernels take float16, bfloat16, float32)"
    if hidden.shape[-1] == 0:
        return False, "zero-width rows"
    return True, ""


def _run(hidden: torch.Tensor, weight: torch.Tensor, eps: float, key, grad: bool) -> torch.Tensor:
    if grad:
        return _FusedRMSNormFn.apply(hidden, weight, eps, key)
    return _forward_impl(hidden, weight, eps, write_rstd=False, key=key)[0]


def try_fused_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> Optional[torch.Tensor]:
    """:func:`fused_rms_norm`, or None (no warning) when the kernels cannot take these valid
    inputs; wrong inputs raise. The hot path: inputs whose launch plan exists (same shapes,
    strides, dtypes, devices and alignment as an earlier call, hence already checked) go
    straight to the kernels."""
    if torch.compiler.is_compiling():
        _validate(hidden, weight, eps)
        if not rms_norm_kernel_ok(hidden, weight)[0]:
            return None
        return _rms_norm_fwd(hidden, weight, float(eps))[0]
    if type(eps) is float and isinstance(hidden, torch.Tensor) and isinstance(weight, torch.Tensor):
        grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
        key = _fwd_key(hidden, weight, grad)
        run = _fwd_fast.get(key)
        if run is not None:
            if grad:
                nat = (_native_plans.get(key) or (_register_native(key) if key in _native_pending else None)
                       if NATIVE else None)
                if nat is not None:
                    apply, plan_id, ndev = nat
                    if _current_device() == ndev and not _launch_hooks():
                        return apply(hidden, weight, eps, plan_id)
                return _FusedRMSNormFn.apply(hidden, weight, eps, key, run)
            out = run(hidden, weight, eps)
            if out is not None:
                return out[0]
        if key in _fwd_plans:
            return _run(hidden, weight, eps, key, grad)
    _validate(hidden, weight, eps)
    if not rms_norm_kernel_ok(hidden, weight)[0]:
        return None
    eps = float(eps)
    grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    return _run(hidden, weight, eps, _fwd_key(hidden, weight, grad), grad)


def fused_rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama-form RMSNorm of ``hidden`` ([..., N]) with ``weight`` ([N]) and epsilon ``eps``.

    The result has ``hidden``'s shape and dtype ``promote_types(hidden.dtype, weight.dtype)``,
    and is contiguous. Differentiable in ``hidden`` and ``weight`` (first order; differentiating
    the gradient again raises). Under ``torch.compile`` it is the custom op
    ``deepspeed_fused::rms_norm_fwd`` (with ``rms_norm_bwd`` as its backward). Inputs the
    kernels cannot take (CPU tensors without the Triton interpreter, float64) run
    :func:`rms_norm_reference` with a one-time warning per reason; wrong inputs raise.
    """
    y = try_fused_rms_norm(hidden, weight, eps)
    if y is None:
        warn_fallback(_OP, rms_norm_kernel_ok(hidden, weight)[1])
        return rms_norm_reference(hidden, weight, eps)
    return y


# ----------------------------------------------------------------------------------------------
# The other forms: RMSNorm spellings whose rounding points differ from the Llama form's
# ----------------------------------------------------------------------------------------------
_HALF = (torch.float16, torch.bfloat16)
_NORM_CASTS = ("input", "weight_half", "none")
_WEIGHTS = ("plain", "fp32", "offset", "offset_w", "none")
_GATES = ("none", "after", "before")
_ACTS = ("silu", "sigmoid")


class RMSForm(NamedTuple):
    """The math of one RMSNorm spelling, with the rounding points of its eager forward. Every form
    takes FP32 statistics of ``h = x.float()`` (``rstd = rsqrt(mean(h**2) + eps)``, ``n = h * rstd``).

    * ``norm_cast``: where ``n`` is rounded before the weight multiplies it: ``"input"`` (to the
      input's dtype, the Llama form), ``"weight_half"`` (to the weight's dtype when that is fp16
      or bf16, else not: T5), ``"none"`` (stays FP32);
    * ``weight``: ``"plain"`` (``w * n`` in the promoted dtype), ``"fp32"`` (``w.float() * n``),
      ``"offset"`` (``n * (1 + w.float())``: Gemma), ``"offset_w"`` (``n * (1 + w).float()``, the
      sum rounded to the weight's dtype), ``"none"`` (no weight);
    * ``gate``: ``"after"`` (the weighted value times ``act(gate.float())``: Qwen3-Next's gated
      norm), ``"before"`` (``h = x.float() * act(gate.float())`` before the statistics: Mamba2's,
      without groups; a missing gate means no gating), ``"none"``; ``act``: ``"silu"`` or ``"sigmoid"``;
    * ``out_cast``: the result cast to the input's dtype (else it keeps the dtype of its last op);
    * ``rstd_cast``: ``x * rstd.to(x.dtype)``, both in the input's dtype (no weight: DeepSeek-V4's
      unweighted norm).
    """

    norm_cast: str = "input"
    weight: str = "plain"
    gate: str = "none"
    act: str = "silu"
    out_cast: bool = False
    rstd_cast: bool = False


LLAMA = RMSForm()
#: every form by name (the features layer's recognition maps a class's forward to one of these)
FORMS = {
    "llama": LLAMA,
    "offset": RMSForm(norm_cast="none", weight="offset", out_cast=True),  # Gemma 1-3, Qwen3.5/Next
    "offset_w": RMSForm(norm_cast="none", weight="offset_w", out_cast=True),
    "weight_first": RMSForm(norm_cast="none", weight="plain", out_cast=True),  # OLMo 2/3, GPT-OSS
    "weight_first_fp32": RMSForm(norm_cast="none", weight="fp32", out_cast=True),  # Helium, Gemma3n, torch
    "t5": RMSForm(norm_cast="weight_half", weight="plain"),
    "unweighted": RMSForm(norm_cast="none", weight="none", out_cast=True),
    "unweighted_rstd_cast": RMSForm(norm_cast="none", weight="none", out_cast=True, rstd_cast=True),
    "gated": RMSForm(gate="after", out_cast=True),  # Qwen3-Next / Qwen3.5 RMSNormGated (act per module)
    "gated_weight_first": RMSForm(norm_cast="none", weight="fp32", gate="after", out_cast=True),  # Kimi-Linear
    "gate_first": RMSForm(gate="before"),  # Mamba2-style RMSNormGated with one group
}


def _check_form(form) -> RMSForm:
    if isinstance(form, str):
        if form not in FORMS:
            raise ValueError(f"fused_rms_norm: unknown form {form!r}; known: {', '.join(sorted(FORMS))}")
        return FORMS[form]
    if not isinstance(form, RMSForm):
        raise TypeError(f"fused_rms_norm: form must be an RMSForm or one of {sorted(FORMS)}, got {type(form).__name__}")
    for name, value, allowed in (("norm_cast", form.norm_cast, _NORM_CASTS), ("weight", form.weight, _WEIGHTS),
                                 ("gate", form.gate, _GATES), ("act", form.act, _ACTS)):
        if value not in allowed:
            raise ValueError(f"fused_rms_norm: form.{name} must be one of {allowed}, got {value!r}")
    if form.rstd_cast and (form.weight != "none" or form.gate != "none"):
        raise ValueError("fused_rms_norm: form.rstd_cast takes no weight and no gate")
    return form


def form_output_dtype(form: RMSForm, x_dtype: torch.dtype, w_dtype: Optional[torch.dtype]) -> torch.dtype:
    """The dtype of ``form``'s result for these input and weight dtypes (eager's promotion)."""
    return _form_dtypes(form, x_dtype, w_dtype)[3]


@functools.lru_cache(maxsize=None)
def _form_dtypes(form: RMSForm, xd: torch.dtype, wd: Optional[torch.dtype]) -> tuple:
    """(normalized value, weight product, value before the output cast, output) dtypes."""
    f32 = torch.float32
    if form.norm_cast == "input":
        nd = xd
    elif form.norm_cast == "weight_half" and wd in _HALF:
        nd = wd
    else:
        nd = f32
    if form.weight == "none" or form.rstd_cast:
        dp = xd if form.rstd_cast else nd
    else:
        dp = torch.promote_types(nd, wd if form.weight == "plain" else f32)
    dq = f32 if form.gate == "after" else dp
    return nd, dp, dq, (xd if form.out_cast else dq)


@functools.lru_cache(maxsize=None)
def _form_consts(form: RMSForm, xd: torch.dtype, wd: Optional[torch.dtype], gated: bool):
    """(constexprs of the form kernels, output dtype), or None where the form, at these dtypes and
    without a gate, rounds exactly as the Llama form does (the Llama op runs it)."""
    nd, dp, dq, out = _form_dtypes(form, xd, wd)

    def code(d):
        return 0 if d == torch.float32 else 1 if d == xd else 2

    gate = _GATES.index(form.gate) if gated else 0
    consts = dict(NRND=code(nd), WMODE=("none", "plain", "offset", "offset_w").index(
        "plain" if form.weight == "fp32" else form.weight) if not form.rstd_cast else 0,
        PRND=code(dp), QRND=code(dq), GATE=gate, ACT=_ACTS.index(form.act), RSTD_RND=bool(form.rstd_cast))
    if wd is not None and not form.rstd_cast and gate == 0 and consts["WMODE"] == 1 and consts["NRND"] == 1 \
            and out == torch.promote_types(xd, wd) and dq == out and dp == out:
        return None  # the Llama form: w * n.to(x.dtype) in the promoted dtype
    return tuple(consts.items()), out


def _gate_act(g: torch.Tensor, act: str) -> torch.Tensor:
    return torch.nn.functional.silu(g) if act == "silu" else torch.sigmoid(g)


def rms_norm_form_reference(hidden: torch.Tensor, weight: Optional[torch.Tensor], eps: float, form,
                            gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``form`` written as the eager modules write it (same rounding points)."""
    return _form_eager(hidden, weight, eps, _check_form(form), gate)


def _form_eager(hidden, weight, eps, form: RMSForm, gate=None, rstd=None):
    """The reference; ``rstd`` (tests): this FP32 rstd ([..., 1]) instead of the input's own."""
    input_dtype = hidden.dtype
    h = hidden.to(torch.float32)
    if form.gate == "before" and gate is not None:
        h = h * _gate_act(gate.to(torch.float32), form.act)
    if rstd is None:
        rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if form.rstd_cast:
        return hidden * rstd.to(input_dtype)
    h = h * rstd
    if form.norm_cast == "input":
        h = h.to(input_dtype)
    elif form.norm_cast == "weight_half" and weight is not None and weight.dtype in _HALF:
        h = h.to(weight.dtype)
    if form.weight == "plain":
        h = weight * h
    elif form.weight == "fp32":
        h = weight.float() * h
    elif form.weight == "offset":
        h = h * (1.0 + weight.float())
    elif form.weight == "offset_w":
        h = h * (1.0 + weight).float()
    if form.gate == "after":
        h = h * _gate_act(gate.to(torch.float32), form.act)
    return h.to(input_dtype) if form.out_cast else h


# ---- plans and launches (the plan caches are PLANS') ------------------------------------------------
def _tkey(t: Optional[torch.Tensor]):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def _form_key(x: torch.Tensor, w: Optional[torch.Tensor], g: Optional[torch.Tensor], form: RMSForm,
              write_rstd: bool) -> tuple:
    return (form, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, _tkey(w), _tkey(g), write_rstd)


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


def _form_fwd_plan(x, w, g, form: RMSForm, write_rstd: bool, key):
    """The form's forward plan (an :class:`FwdPlan`), or :data:`AS_LLAMA`."""
    spec = _form_consts(form, x.dtype, None if w is None else w.dtype, g is not None and form.gate != "none")
    if spec is None:
        return AS_LLAMA
    consts, out_dtype = spec
    plan = _fwd_plan(x, w, write_rstd, key, form=FormSpec(dict(consts), out_dtype))
    return plan._replace(lkey=("form_fwd",) + key, gate_copy=g is not None and not g.is_contiguous(),
                         gated=dict(consts)["GATE"] != 0)


def _form_forward_impl(x, w, g, eps: float, form: RMSForm, y=None, rstd=None, write_rstd: bool = True, key=None):
    """The form's forward into fresh (or given, contiguous: tests poison them) ``y`` and ``rstd``."""
    if key is None:
        key = _form_key(x, w, g, form, write_rstd)
    plan = _form_fwd_plans.get(key)
    if plan is None:
        if x.numel() == 0:
            out = form_output_dtype(form, x.dtype, None if w is None else w.dtype)
            y = y if y is not None else torch.empty(x.shape, dtype=out, device=x.device)
            if write_rstd and rstd is None:
                rstd = torch.empty(x.shape[:-1], dtype=_F32, device=x.device)
            return y, rstd
        plan = _remember(_form_fwd_plans, key, _form_fwd_plan(x, w, g, form, write_rstd, key))
    if plan is AS_LLAMA:  # rounds as the Llama form
        return _forward_impl(x, w, eps, y=y, rstd=rstd, write_rstd=write_rstd)
    copy, wcopy, like, out_dtype, rshape, device, ints, grid, const, num_warps, dev, lkey, gcopy, gated = plan
    if copy:
        x = x.contiguous()
    if wcopy:
        w = w.contiguous()
    if not gated:
        g = None
    elif gcopy:
        g = g.contiguous()
    given = y is not None or rstd is not None
    if y is None:
        y = torch.empty_like(x) if like else torch.empty(x.shape, dtype=out_dtype, device=device)
    if write_rstd and rstd is None:
        rstd = torch.empty(rshape, dtype=_F32, device=device)
    r = rstd if write_rstd else y
    if dev is not None and not given and _current_device_is(dev):
        fn = _launches.get(lkey)
        if fn is not None:
            fn(_raw_stream(dev), x.data_ptr(), _ptr(w), y.data_ptr(), r.data_ptr(), _ptr(g), *ints, eps)
            if key not in _form_fwd_fast:
                _form_fwd_fast[key] = _make_form_fwd_fast(plan, fn)
            return y, rstd
    args = (x, w, y, r, g) + ints + (float(eps),)
    with _on_device(x):
        if given:
            _rms_fwd_form_kernel[grid](*args, **const, num_warps=num_warps)
        else:
            _launches.launch(_rms_fwd_form_kernel, lkey, grid, args, const, num_warps, dev)
    return y, rstd


def _make_form_fwd_fast(plan, fn):
    copy, wcopy, like, out_dtype, rshape, device, ints, grid, const, num_warps, dev, lkey, gcopy, gated = plan
    parts = getattr(fn, "parts", None)
    if copy or wcopy or gcopy or dev is None or parts is None:
        return None
    launch, grid3, fixed, tail = launch_binding(parts)
    write_rstd = const["WRITE_RSTD"]
    empty, empty_like, get_device, raw_stream, hooks = torch.empty, torch.empty_like, _current_device, _raw_stream, _launch_hooks

    def run(x, w, g, eps):
        if get_device() != dev or hooks():
            return None
        y = empty_like(x) if like else empty(x.shape, dtype=out_dtype, device=device)
        rstd = empty(rshape, dtype=_F32, device=device) if write_rstd else None
        launch(*grid3, raw_stream(dev), *fixed,
               x.data_ptr(), None if w is None else w.data_ptr(), y.data_ptr(), (rstd if write_rstd else y).data_ptr(),
               g.data_ptr() if gated else None, *ints, eps, *tail)
        return y, rstd

    return run


def _form_bwd_key(dy, x, w, g, rstd, form) -> tuple:
    return (form, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, dy.shape, dy.stride(), dy.dtype,
            dy.device, dy.data_ptr() & 15, _tkey(w), _tkey(g), rstd.data_ptr() & 15)


def _form_bwd_plan(dy, x, w, g, rstd, form: RMSForm, key) -> tuple:
    spec = _form_consts(form, x.dtype, None if w is None else w.dtype, g is not None and form.gate != "none")
    if spec is None:
        return AS_LLAMA
    consts, out_dtype = spec
    gated = dict(consts)["GATE"] != 0
    plan = _bwd_plan(dy, x, w, rstd, key, form=FormSpec(dict(consts), out_dtype, g if gated else None))
    return plan._replace(lkey=("form_bwd",) + key, gate_copy=gated and not g.is_contiguous(), gated=gated)


def _form_backward_impl(dy, x, w, g, rstd, form: RMSForm, dx=None, dw=None, dg=None, fast_key=None):
    """The form's backward: (dx, dw or None, dgate or None), into fresh or given (contiguous) tensors."""
    key = _form_bwd_key(dy, x, w, g, rstd, form)
    plan = _form_bwd_plans.get(key)
    if plan is None:
        if rstd.numel() == 0:
            dx = dx if dx is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
            if w is not None:
                dw = (dw if dw is not None else torch.empty(w.shape, dtype=w.dtype, device=w.device)).zero_()
            if g is not None:
                dg = dg if dg is not None else torch.empty(g.shape, dtype=g.dtype, device=g.device)
            return dx, dw, dg
        plan = _remember(_form_bwd_plans, key, _form_bwd_plan(dy, x, w, g, rstd, form, key))
    if plan is AS_LLAMA:
        dx, dw = _backward_impl(dy, x, w, rstd, dx=dx, dw=dw)
        return dx, dw, (None if g is None else torch.zeros_like(g) if dg is None else dg.zero_())
    (convert, out_dtype, xcopy, gcopy, wcopy, dx_like, device, kernel, ints, progs, const, num_warps, ws_numel,
     n_cnt, red, dev, lkey, g_copy, gated) = plan
    if convert or xcopy or gcopy:
        dy, x = _bwd_inputs(dy, x, convert, out_dtype, xcopy, gcopy)
    if wcopy:
        w = w.contiguous()
    gk = None
    if gated:
        gk = g.contiguous() if g_copy else g
    given = dx is not None or dw is not None or dg is not None
    if dx is None:
        dx = torch.empty_like(x) if dx_like else torch.empty(x.shape, dtype=x.dtype, device=device)
    if w is not None and dw is None:
        dw = torch.empty_like(w)
    if gated and dg is None:
        dg = torch.empty(g.shape, dtype=g.dtype, device=device)
    dgk = dg if gated else None
    if dev is not None:
        stream = _raw_stream(dev)
        part, cnt = _workspace(device, dev, stream, ws_numel, n_cnt)
        if not given and _current_device_is(dev):
            fn = _launches.get(lkey)
            fn_red = _launches.get(("red",) + lkey) if red is not None else True
            if fn is not None and fn_red is not None:
                fn(stream, dy.data_ptr(), x.data_ptr(), _ptr(w), rstd.data_ptr(), dx.data_ptr(), part.data_ptr(),
                   cnt.data_ptr(), _ptr(dw), _ptr(gk), _ptr(dgk), *ints)
                if red is not None:
                    fn_red(stream, part.data_ptr(), dw.data_ptr(), progs, x.shape[-1])
                if fast_key is not None and fast_key not in _form_bwd_fast:
                    _form_bwd_fast[fast_key] = _make_form_bwd_fast(plan, fn)
                    if NATIVE and _native.enabled():
                        _offer_native_form(fast_key, plan, fn)
                return dx, dw, (dg if g is not None else None)
    else:
        part, cnt = _workspace(device, None, 0, ws_numel, n_cnt)
    args = (dy, x, w, rstd, dx, part, cnt, dw, gk, dgk) + ints
    with _on_device(x):
        if given:
            kernel[(progs,)](*args, **const, num_warps=num_warps)
            if red is not None:
                _dw_reduce_kernel[red.grid](part, dw, progs, x.shape[-1], **red.const, num_warps=4)
        else:
            _launches.launch(kernel, lkey, (progs,), args, const, num_warps, dev)
            if red is not None:
                _launches.launch(_dw_reduce_kernel, ("red",) + lkey, red.grid, (part, dw, progs, x.shape[-1]), red.const, 4,
                                 dev)
    if g is not None and not gated:  # a gate the form did not use ("before" forms never get here without one)
        dg = torch.zeros_like(g) if dg is None else dg.zero_()
    return dx, dw, dg


def _make_form_bwd_fast(plan, fn):
    (convert, out_dtype, xcopy, gcopy, wcopy, dx_like, device, kernel, ints, progs, const, num_warps, ws_numel,
     n_cnt, red, dev, lkey, g_copy, gated) = plan
    parts = getattr(fn, "parts", None)
    if convert or xcopy or gcopy or wcopy or g_copy or not dx_like or dev is None or red is not None or parts is None:
        return None
    launch, grid3, fixed, tail = launch_binding(parts)
    rest = tuple(ints) + tuple(tail)
    empty_like, get_device, raw_stream, capturing, hooks = torch.empty_like, _current_device, _raw_stream, _stream_capturing, _launch_hooks
    workspaces = _workspaces
    k = FormBwdKey._make(_key_of(lkey))
    x_dtype, x_align, wk, gk = k.x_dtype, k.x_align, k.w, k.g

    def run(dy, x, w, g, rstd):
        if capturing() or get_device() != dev or hooks():
            return None
        # saved-tensor hooks may hand back other dtypes or layouts than the key's: the plan path then
        if (x.dtype != x_dtype or (x.data_ptr() & 15) != x_align or not x.is_contiguous() or rstd.data_ptr() & 15
                or _tkey(w) != wk or _tkey(g) != gk):
            return None
        stream = raw_stream(dev)
        ws = workspaces.get((dev, stream))
        if ws is None or ws[0].numel() < ws_numel or ws[1].numel() < n_cnt:
            ws = _workspace(device, dev, stream, ws_numel, n_cnt)
        dx = empty_like(x)
        dw = None if w is None else empty_like(w)
        dg = empty_like(g) if gated else None
        launch(*grid3, stream, *fixed,
               dy.data_ptr(), x.data_ptr(), None if w is None else w.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
               ws[0].data_ptr(), ws[1].data_ptr(), None if dw is None else dw.data_ptr(),
               g.data_ptr() if gated else None, dg.data_ptr() if gated else None, *rest)
        return dx, dw, dg, None, None, None, None

    return run


def _offer_native_form(fast_key, bplan, bfn) -> None:
    """:func:`_offer_native` for the other forms: x, the weight and the gate contiguous and aligned,
    the incoming gradient the planned one."""
    fkey, dstride, ddtype, dalign = fast_key
    fplan = _form_fwd_plans.get(fkey)
    k = FormKey._make(fkey)
    if fkey in _native_plans or dalign or k.x_align or fplan is None or fplan is AS_LLAMA:
        return
    wk = None if k.w is None else TensorKey._make(k.w)
    gk = None if k.g is None else TensorKey._make(k.g)
    if (wk is not None and wk.align) or (gk is not None and (gk.align or gk.stride != _contiguous_strides(gk.shape))):
        return
    if ddtype != fplan.out_dtype or dstride != _contiguous_strides(k.x_shape):
        return
    _native_pending[fkey] = NativePending(fast_key, bplan, bfn)
    _register_native_form(fkey)


def _register_native_form(fkey):
    """:func:`_register_native` for the other forms (the extension's ``rms_norm_form`` node)."""
    pending = _native_pending.pop(fkey, None)
    if pending is None:
        return _native_plans.get(fkey)
    mod = _native.get()
    if mod is None:
        if _native.enabled():
            _native_pending.setdefault(fkey, pending)
        return None
    fast_key, bplan, bfn = pending
    fplan = _form_fwd_plans.get(fkey)
    ffn = _launches.get(fplan.lkey) if fplan is not None else None
    if ffn is None or _form_fwd_fast.get(fkey) is None or _form_bwd_fast.get(fast_key) is None:
        return None
    k = FormKey._make(fkey)
    like, gated, out_dtype = fplan.like, fplan.gated, fplan.out_dtype
    has_w = k.w is not None
    P = _native.PTR
    fdesc = _native.describe(ffn, [(P, 0), (P, 1) if has_w else None, (P, 2), (P, 3), (P, 4) if gated else None]
                             + list(fplan.ints) + [_native.EPS])
    ws_numel, n_cnt = bplan.ws_numel, bplan.n_cnt
    bdesc = _native.describe(bfn, [(P, 0), (P, 1), (P, 2) if has_w else None, (P, 3), (P, 4), (P, 5), (P, 6),
                                   (P, 7) if has_w else None, (P, 8) if gated else None, (P, 9) if gated else None]
                             + list(bplan.ints))
    if fdesc is None or bdesc is None:
        _native_plans[fkey] = None
        return None
    xd = k.x_dtype
    dtypes = (xd, TensorKey._make(k.w).dtype if has_w else xd, out_dtype, TensorKey._make(k.g).dtype if gated else xd)
    ident = ("form", fdesc, bdesc, dtypes, bool(like), int(ws_numel), int(n_cnt), has_w, gated)
    plan_id = _native_ids.get(ident)
    if plan_id is None:
        e = [torch.empty(0, dtype=d) for d in dtypes]
        plan_id = _native_ids[ident] = mod.register_rms_form_plan(
            *fdesc, *bdesc, e[0], e[1], e[2], bool(like), int(ws_numel), int(n_cnt), has_w, gated, e[3])
    nat = _native_plans[fkey] = NativeEntry(mod.rms_norm_form, plan_id, fplan.dev)
    return nat


# ---- autograd and custom ops ----------------------------------------------------------------------
def _form_code(form: RMSForm) -> list:
    return [_NORM_CASTS.index(form.norm_cast), _WEIGHTS.index(form.weight), _GATES.index(form.gate),
            _ACTS.index(form.act), int(form.out_cast), int(form.rstd_cast)]


def _form_of(code) -> RMSForm:
    return RMSForm(_NORM_CASTS[code[0]], _WEIGHTS[code[1]], _GATES[code[2]], _ACTS[code[3]], bool(code[4]),
                   bool(code[5]))


@torch.library.custom_op("deepspeed_fused::rms_norm_form_fwd", mutates_args=())
def _rms_norm_form_fwd(x: torch.Tensor, w: Optional[torch.Tensor], g: Optional[torch.Tensor], eps: float,
                       form: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    y, rstd = _form_forward_impl(x, w, g, eps, _form_of(form))
    return y, rstd


@_rms_norm_form_fwd.register_fake
def _(x, w, g, eps, form):
    out = form_output_dtype(_form_of(form), x.dtype, None if w is None else w.dtype)
    return x.new_empty(x.shape, dtype=out), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("deepspeed_fused::rms_norm_form_bwd", mutates_args=())
def _rms_norm_form_bwd(dy: torch.Tensor, x: torch.Tensor, w: Optional[torch.Tensor], g: Optional[torch.Tensor],
                       rstd: torch.Tensor, form: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    dx, dw, dg = _form_backward_impl(dy, x, w, g, rstd, _form_of(form))
    return dx, (x.new_empty(0) if dw is None else dw), (x.new_empty(0) if dg is None else dg)


@_rms_norm_form_bwd.register_fake
def _(dy, x, w, g, rstd, form):
    return (x.new_empty(x.shape), x.new_empty(0) if w is None else w.new_empty(w.shape),
            x.new_empty(0) if g is None else g.new_empty(g.shape))


def _form_setup_context(ctx, inputs, output):
    x, w, g, _, form = inputs
    ctx.save_for_backward(x, w, g, output[1])
    ctx.form = form
    ctx.mark_non_differentiable(output[1])


def _form_backward(ctx, dy, _drstd):
    x, w, g, rstd = ctx.saved_tensors
    dx, dw, dg = _rms_norm_form_bwd(dy, x, w, g, rstd, ctx.form)
    return dx, (None if w is None else dw), (None if g is None else dg), None, None


_rms_norm_form_fwd.register_autograd(_form_backward, setup_context=_form_setup_context)


class _FusedRMSNormFormFn(torch.autograd.Function):
    """:class:`_FusedRMSNormFn` for the other forms (inputs x, weight or None, gate or None)."""

    @staticmethod
    def forward(ctx, x, w, g, eps, form, key, run=None):
        out = run(x, w, g, eps) if run is not None else None
        y, rstd = out if out is not None else _form_forward_impl(x, w, g, eps, form, key=key)
        ctx.save_for_backward(x, w, g, rstd)
        ctx.form, ctx.key = form, key
        return y

    @staticmethod
    def backward(ctx, dy):
        if torch.is_grad_enabled():
            return _form_backward_once(ctx, dy)
        x, w, g, rstd = ctx.saved_tensors
        fast_key = (ctx.key, dy.stride(), dy.dtype, dy.data_ptr() & 15)
        run = _form_bwd_fast.get(fast_key)
        if run is not None:
            out = run(dy, x, w, g, rstd)
            if out is not None:
                return out
        dx, dw, dg = _form_backward_impl(dy, x, w, g, rstd, ctx.form, fast_key=fast_key)
        return dx, dw, dg, None, None, None, None


def _form_backward_body(ctx, dy):
    x, w, g, rstd = ctx.saved_tensors
    dx, dw, dg = _form_backward_impl(dy, x, w, g, rstd, ctx.form)
    return dx, dw, dg, None, None, None, None


_form_backward_once = once_differentiable(_form_backward_body)


# ---- public entry points ----------------------------------------------------------------------------
def _validate_form(hidden, weight, eps, form: RMSForm, gate) -> None:
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"fused_rms_norm: hidden must be a tensor, got {type(hidden).__name__}")
    if form.weight == "none":
        if weight is not None:
            raise ValueError("fused_rms_norm: this form takes no weight (weight must be None)")
        _validate(hidden, hidden.new_empty(hidden.shape[-1:]) if hidden.dim() else hidden, eps)
    else:
        if weight is None:
            raise ValueError("fused_rms_norm: this form needs a weight")
        _validate(hidden, weight, eps)
    if form.gate == "after" and gate is None:
        raise ValueError("fused_rms_norm: this gated form needs a gate tensor")
    if gate is not None:
        if form.gate == "none":
            raise ValueError("fused_rms_norm: this form takes no gate (gate must be None)")
        if not isinstance(gate, torch.Tensor) or not gate.is_floating_point():
            raise TypeError("fused_rms_norm: gate must be a floating-point tensor")
        if gate.shape != hidden.shape:
            raise ValueError(f"fused_rms_norm: gate must have hidden's shape {tuple(hidden.shape)}, "
                             f"got {tuple(gate.shape)}")
        if gate.device != hidden.device:
            raise ValueError(f"fused_rms_norm: gate must be on hidden's device {hidden.device}, got {gate.device}")


def rms_norm_form_kernel_ok(hidden, weight, gate=None) -> tuple[bool, str]:
    """Whether the kernels take these (valid) inputs of a form; otherwise the reason."""
    ok, reason = rms_norm_kernel_ok(hidden, hidden if weight is None else weight)
    if ok and gate is not None and gate.dtype not in _KERNEL_DTYPES:
        return False, f"gate dtype {gate.dtype} (kernels take float16, bfloat16, float32)"
    return ok, reason


def _needs_grad(hidden, weight, gate) -> bool:
    return torch.is_grad_enabled() and (hidden.requires_grad or (weight is not None and weight.requires_grad)
                                        or (gate is not None and gate.requires_grad))


def try_fused_rms_norm_form(hidden: torch.Tensor, weight: Optional[torch.Tensor], eps: float, form,
                            gate: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """:func:`fused_rms_norm_form`, or None (no warning) when the kernels cannot take these valid
    inputs; wrong inputs raise. Inputs whose launch plan exists go straight to the kernels."""
    if type(form) is not RMSForm:
        form = _check_form(form)
    if torch.compiler.is_compiling():
        _check_form(form)
        _validate_form(hidden, weight, eps, form, gate)
        if not rms_norm_form_kernel_ok(hidden, weight, gate)[0]:
            return None
        if gate is not None and form.gate == "none":
            gate = None
        if _form_consts(form, hidden.dtype, None if weight is None else weight.dtype,
                        gate is not None and form.gate != "none") is None:
            return _rms_norm_fwd(hidden, weight, float(eps))[0]
        return _rms_norm_form_fwd(hidden, weight, gate, float(eps), _form_code(form))[0]
    if (type(eps) is float and isinstance(hidden, torch.Tensor) and (weight is None or isinstance(weight, torch.Tensor))
            and (gate is None or isinstance(gate, torch.Tensor))):
        grad = _needs_grad(hidden, weight, gate)
        key = _form_key(hidden, weight, gate, form, grad)
        run = _form_fwd_fast.get(key)
        if run is not None:
            if grad:
                nat = (_native_plans.get(key) or (_register_native_form(key) if key in _native_pending else None)
                       if NATIVE else None)
                if nat is not None:
                    apply, plan_id, ndev = nat
                    if _current_device() == ndev and not _launch_hooks():
                        return apply(hidden, weight, gate, eps, plan_id)
                return _FusedRMSNormFormFn.apply(hidden, weight, gate, eps, form, key, run)
            out = run(hidden, weight, gate, eps)
            if out is not None:
                return out[0]
        plan = _form_fwd_plans.get(key)
        if plan is not None:
            return _run_form(hidden, weight, gate, eps, form, key, plan, grad)
    _check_form(form)
    _validate_form(hidden, weight, eps, form, gate)
    if not rms_norm_form_kernel_ok(hidden, weight, gate)[0]:
        return None
    eps = float(eps)
    grad = _needs_grad(hidden, weight, gate)
    key = _form_key(hidden, weight, gate, form, grad)
    plan = _form_fwd_plans.get(key)
    if plan is None and hidden.numel():
        plan = _remember(_form_fwd_plans, key, _form_fwd_plan(hidden, weight, gate, form, grad, key))
    return _run_form(hidden, weight, gate, eps, form, key, plan, grad)


def _run_form(hidden, weight, gate, eps, form, key, plan, grad: bool):
    if plan is AS_LLAMA:  # the Llama form at these dtypes (there is no gate then)
        return try_fused_rms_norm(hidden, weight, eps)
    if grad:
        return _FusedRMSNormFormFn.apply(hidden, weight, gate, eps, form, key)
    return _form_forward_impl(hidden, weight, gate, eps, form, write_rstd=False, key=key)[0]


def fused_rms_norm_form(hidden: torch.Tensor, weight: Optional[torch.Tensor], eps: float, form,
                        gate: Optional[torch.Tensor] = None) -> torch.Tensor:
    """RMSNorm of ``hidden`` ([..., N]) in ``form`` (an :class:`RMSForm` or a name in
    :data:`FORMS`), with ``weight`` ([N], or None for forms without one) and, for gated forms,
    ``gate`` (hidden's shape). The result is what the form's eager forward returns, rounding
    included (dtype :func:`form_output_dtype`). Differentiable in ``hidden``, ``weight`` and
    ``gate`` (first order). Forms that round as the Llama form does at these dtypes run
    :func:`fused_rms_norm`. Inputs the kernels cannot take run :func:`rms_norm_form_reference`
    with a one-time warning per reason; wrong inputs raise."""
    y = try_fused_rms_norm_form(hidden, weight, eps, form, gate)
    if y is None:
        warn_fallback(_OP, rms_norm_form_kernel_ok(hidden, weight, gate)[1])
        return rms_norm_form_reference(hidden, weight, eps, form, gate)
    return y
