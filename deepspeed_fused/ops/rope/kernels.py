"""The rotation kernel: one launch rotates q and k (programs ``[0, NP0)`` take q, the rest k);
with ``BACKWARD`` the same kernel applies the transposed rotation to the incoming gradients.

The backward is eager autograd's: the incoming gradient's products with cos and sin are rounded
to the compute dtype, then to the dtype in which autograd sums the two contributions of each
element (``grad_accum``: the input's dtype where each use casts on its own, the compute dtype
where the input was upcast once), the sum rounded there and stored in the input's dtype.
Products are never contracted into FMAs (the launch passes ``enable_fp_fusion=False``), so
float32 inputs round as eager does too.

Rows are addressed through up to three strided leading dims and a strided head dim with no
copy; cos/sin are broadcast over the heads through zero strides, their last dims read with
strides of their own (``csd``, ``ssd``: the halves of a complex tensor are views of step 2,
a ``freqs_cis`` built from a transposed product has a larger step). Per-position angles whose
two columns of each pair hold the same bits (``SAME``, checked on the device by the launch) are
read once, from the pair's first column.
"""
from __future__ import annotations

import torch

from .._common import HAS_TRITON, tl, triton

# dtype codes of the constexprs PROD / ACC
_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


if HAS_TRITON:

    @triton.jit
    def _round(x, CODE: tl.constexpr):
        # x (float32) rounded to the dtype of CODE (0 float32, 1 float16, 2 bfloat16), back in float32
        if CODE == 1:
            x = x.to(tl.float16).to(tl.float32)
        if CODE == 2:
            x = x.to(tl.bfloat16).to(tl.float32)
        return x

    @triton.jit
    def _rope_rows(X, Y, C, S, SAME, tile, n_rows, N1, N2, xs0, xs1, xs2, xsd, ys0, ys1, ys2, ysd, cs0, cs1, cs2,
                   ss0, ss1, ss2,
                   H, ROFF, PS, PE, csd, ssd, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_P: tl.constexpr, PAIRS: tl.constexpr, ANGLE_PAIR: tl.constexpr, HALVES: tl.constexpr,
                   NEG: tl.constexpr, BACKWARD: tl.constexpr, PROD: tl.constexpr, ACC: tl.constexpr,
                   PASS: tl.constexpr, CONTRACT: tl.constexpr):
        # rows of the leading shape [N0, N1, N2] (N0 = n_rows / (N1 * N2)), each a head whose rotated
        # columns start at ROFF (the pass-through columns: [PS, PE)); angle column j of cos at
        # j * csd, of sin at j * ssd (1: contiguous, 2: the halves of a complex tensor, any other)
        rows = tile * BLOCK_R + tl.arange(0, BLOCK_R)
        rmask = rows < n_rows
        i2 = (rows % N2).to(tl.int64)
        rest = rows // N2
        i1 = (rest % N1).to(tl.int64)
        i0 = (rest // N1).to(tl.int64)
        xrow = (i0 * xs0 + i1 * xs1 + i2 * xs2)[:, None]
        yrow = (i0 * ys0 + i1 * ys1 + i2 * ys2)[:, None]
        crow = (i0 * cs0 + i1 * cs1 + i2 * cs2)[:, None]
        srow = (i0 * ss0 + i1 * ss1 + i2 * ss2)[:, None]
        p = tl.arange(0, BLOCK_H)
        m = rmask[:, None] & (p < H)[None, :]
        # the pair's two elements (f, s) in the input's columns, and where their results go
        if PAIRS:
            f = 2 * p
            s = f + 1
        else:
            f = p
            s = p + H
        if HALVES:
            of = p
            os = p + H
        else:
            of = f
            os = s
        if ANGLE_PAIR:
            af = p
            as_ = p
        else:
            af = f
            as_ = s
        # forward: x at (f, s) -> out at (of, os); backward: the gradient at (of, os) -> dx at (f, s)
        if BACKWARD:
            src_f = of
            src_s = os
            dst_f = f
            dst_s = s
        else:
            src_f = f
            src_s = s
            dst_f = of
            dst_s = os
        a = tl.load(X + xrow + ((src_f + ROFF) * xsd)[None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(X + xrow + ((src_s + ROFF) * xsd)[None, :], mask=m, other=0.0).to(tl.float32)
        cf = tl.load(C + crow + (af * csd)[None, :], mask=m, other=0.0).to(tl.float32)
        sf = tl.load(S + srow + (af * ssd)[None, :], mask=m, other=0.0).to(tl.float32)
        if ANGLE_PAIR:
            cs = cf
            ss = sf
        else:
            # SAME (an int32 on the device) is nonzero when cos's and sin's columns s hold the very
            # bits of their columns f (Hugging Face builds them as two copies of one half): the
            # second half is then not read, and its values are those of the first, bit for bit
            same = tl.load(SAME)
            ms = m & (same == 0)
            cs = tl.load(C + crow + (as_ * csd)[None, :], mask=ms, other=0.0).to(tl.float32)
            ss = tl.load(S + srow + (as_ * ssd)[None, :], mask=ms, other=0.0).to(tl.float32)
            cs = tl.where(same != 0, cf, cs)
            ss = tl.where(same != 0, sf, ss)
        if NEG:
            sf = -sf
            ss = -ss
        if BACKWARD:
            # transposed rotation: dx_f = g_f * cf + g_s * ss, dx_s = g_s * cs - g_f * sf
            t = sf
            sf = -ss
            ss = -t
        # each product rounded to the compute dtype (PROD), then to the dtype the two terms are
        # summed in (ACC: the compute dtype forward; the input's or the compute dtype backward)
        out_ty = Y.dtype.element_ty
        if CONTRACT:
            # complex64 (a + ib)(c + id) as CUDA's complex multiply rounds it (float32 throughout;
            # backward: the gradient times the conjugate, the same expression with -d)
            o_f = tl.fma(a, cf, -(b * sf))
            o_s = tl.fma(a, ss, b * cs)
        else:
            t1 = _round(_round(a * cf, PROD), ACC)
            t2 = _round(_round(b * sf, PROD), ACC)
            t3 = _round(_round(b * cs, PROD), ACC)
            t4 = _round(_round(a * ss, PROD), ACC)
            o_f = _round(t1 - t2, ACC)
            o_s = _round(t3 + t4, ACC)
        tl.store(Y + yrow + ((dst_f + ROFF) * ysd)[None, :], o_f.to(out_ty), mask=m)
        tl.store(Y + yrow + ((dst_s + ROFF) * ysd)[None, :], o_s.to(out_ty), mask=m)
        if PASS:  # columns [PS, PE) pass through, converted to the output's dtype
            for c0 in range(PS, PE, BLOCK_P):
                c = c0 + tl.arange(0, BLOCK_P)
                mm = rmask[:, None] & (c < PE)[None, :]
                v = tl.load(X + xrow + (c * xsd)[None, :], mask=mm, other=0.0)
                tl.store(Y + yrow + (c * ysd)[None, :], v.to(out_ty), mask=mm)

    @triton.jit
    def _rope_kernel(X0, Y0, X1, Y1, C, S, SAME, NP0,
                     n0, a1, a2, xa0, xa1, xa2, xad, ya0, ya1, ya2, yad, ca0, ca1, ca2, sa0, sa1, sa2,
                     n1, b1, b2, xb0, xb1, xb2, xbd, yb0, yb1, yb2, ybd, cb0, cb1, cb2, sb0, sb1, sb2,
                     H, ROFF, PS, PE, csd, ssd,
                     BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, PAIRS: tl.constexpr,
                     ANGLE_PAIR: tl.constexpr, HALVES: tl.constexpr, NEG: tl.constexpr, BACKWARD: tl.constexpr,
                     PROD: tl.constexpr, ACC: tl.constexpr, PASS: tl.constexpr, TWO: tl.constexpr,
                     CONTRACT: tl.constexpr, INTERLEAVE: tl.constexpr):
        # programs [0, NP0) take tensor 0 (q), the rest tensor 1 (k): one launch for both; with
        # INTERLEAVE, q's and k's tiles alternate in proportion (program i is q's tile
        # floor(i * NP0 / n) when that count grows at i + 1, else k's next tile), so where rows are
        # token-major the k tiles of a stretch of tokens run right after its q tiles, while the
        # angles the two share are still in L2
        pid = tl.program_id(0)
        if TWO:
            if INTERLEAVE:
                n = tl.num_programs(0).to(tl.int64)
                i = pid.to(tl.int64)
                tile_q = (i * NP0) // n
                is_q = ((i + 1) * NP0) // n > tile_q
                tile_k = i - tile_q
            else:
                is_q = pid < NP0
                tile_q = pid
                tile_k = pid - NP0
            if is_q:
                _rope_rows(X0, Y0, C, S, SAME, tile_q, n0, a1, a2, xa0, xa1, xa2, xad, ya0, ya1, ya2, yad, ca0, ca1,
                           ca2, sa0, sa1, sa2, H, ROFF, PS, PE, csd, ssd, BLOCK_R, BLOCK_H, BLOCK_P, PAIRS, ANGLE_PAIR,
                           HALVES, NEG, BACKWARD, PROD, ACC, PASS, CONTRACT)
            else:
                _rope_rows(X1, Y1, C, S, SAME, tile_k, n1, b1, b2, xb0, xb1, xb2, xbd, yb0, yb1, yb2, ybd, cb0, cb1,
                           cb2, sb0, sb1, sb2, H, ROFF, PS, PE, csd, ssd, BLOCK_R, BLOCK_H, BLOCK_P, PAIRS, ANGLE_PAIR,
                           HALVES, NEG, BACKWARD, PROD, ACC, PASS, CONTRACT)
        else:
            _rope_rows(X0, Y0, C, S, SAME, pid, n0, a1, a2, xa0, xa1, xa2, xad, ya0, ya1, ya2, yad, ca0, ca1, ca2,
                       sa0, sa1, sa2, H, ROFF, PS, PE, csd, ssd, BLOCK_R, BLOCK_H, BLOCK_P, PAIRS, ANGLE_PAIR,
                       HALVES, NEG, BACKWARD, PROD, ACC, PASS, CONTRACT)
