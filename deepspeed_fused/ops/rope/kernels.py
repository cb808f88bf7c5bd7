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
a ``freqs_cis`` built from a transposed product has a larger step). Where the angles do not
change along the innermost leading dim of the written tensor (the heads of a token, as Hugging
Face's ``[B, S, H, D]`` projections are laid out), a tile is whole tokens and reads each token's
cos and sin once for all its heads (``TOK0``/``TOK1``); otherwise it is a block of rows.
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
    def _rotate(a, b, cf, sf, cs, ss, NEG: tl.constexpr, BACKWARD: tl.constexpr, PROD: tl.constexpr,
                ACC: tl.constexpr, CONTRACT: tl.constexpr):
        # the pair (a, b) rotated by the angles (cf, sf | cs, ss), float32 in and out, rounded as
        # eager rounds it; the angle operands may broadcast against the pair's (the token tiles)
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
        return o_f, o_s

    @triton.jit
    def _columns(p, H, PAIRS: tl.constexpr, ANGLE_PAIR: tl.constexpr, HALVES: tl.constexpr, BACKWARD: tl.constexpr):
        # pair p's two elements (f, s) in the input's columns and where their results go; forward:
        # x at (f, s) -> out at (of, os), backward: the gradient at (of, os) -> dx at (f, s).
        # Returns (source f, source s, destination f, destination s, angle f, angle s).
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
        return src_f, src_s, dst_f, dst_s, af, as_

    @triton.jit
    def _rope_rows(X, Y, C, S, tile, n_rows, N1, N2, xs0, xs1, xs2, xsd, ys0, ys1, ys2, ysd, cs0, cs1, cs2,
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
        src_f, src_s, dst_f, dst_s, af, as_ = _columns(p, H, PAIRS, ANGLE_PAIR, HALVES, BACKWARD)
        a = tl.load(X + xrow + ((src_f + ROFF) * xsd)[None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(X + xrow + ((src_s + ROFF) * xsd)[None, :], mask=m, other=0.0).to(tl.float32)
        cf = tl.load(C + crow + (af * csd)[None, :], mask=m, other=0.0).to(tl.float32)
        sf = tl.load(S + srow + (af * ssd)[None, :], mask=m, other=0.0).to(tl.float32)
        if ANGLE_PAIR:
            cs = cf
            ss = sf
        else:
            cs = tl.load(C + crow + (as_ * csd)[None, :], mask=m, other=0.0).to(tl.float32)
            ss = tl.load(S + srow + (as_ * ssd)[None, :], mask=m, other=0.0).to(tl.float32)
        o_f, o_s = _rotate(a, b, cf, sf, cs, ss, NEG, BACKWARD, PROD, ACC, CONTRACT)
        out_ty = Y.dtype.element_ty
        tl.store(Y + yrow + ((dst_f + ROFF) * ysd)[None, :], o_f.to(out_ty), mask=m)
        tl.store(Y + yrow + ((dst_s + ROFF) * ysd)[None, :], o_s.to(out_ty), mask=m)
        if PASS:  # columns [PS, PE) pass through, converted to the output's dtype
            for c0 in range(PS, PE, BLOCK_P):
                c = c0 + tl.arange(0, BLOCK_P)
                mm = rmask[:, None] & (c < PE)[None, :]
                v = tl.load(X + xrow + (c * xsd)[None, :], mask=mm, other=0.0)
                tl.store(Y + yrow + (c * ysd)[None, :], v.to(out_ty), mask=mm)

    @triton.jit
    def _rope_tokens(X, Y, C, S, tile, n_rows, N1, N2, xs0, xs1, xs2, xsd, ys0, ys1, ys2, ysd, cs0, cs1,
                     ss0, ss1, H, ROFF, PS, PE, csd, ssd, TOK: tl.constexpr, HP: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, PAIRS: tl.constexpr, ANGLE_PAIR: tl.constexpr,
                     HALVES: tl.constexpr, NEG: tl.constexpr, BACKWARD: tl.constexpr, PROD: tl.constexpr,
                     ACC: tl.constexpr, PASS: tl.constexpr, CONTRACT: tl.constexpr):
        # _rope_rows where the angles do not change along the innermost leading dim (the heads of a
        # token): a tile of TOK whole tokens x HP (>= N2) head rows x the pairs, whose cos and sin
        # are read once per token and broadcast over its heads
        o = tile * TOK + tl.arange(0, TOK)
        omask = o < n_rows // N2
        i1 = (o % N1).to(tl.int64)
        i0 = (o // N1).to(tl.int64)
        h = tl.arange(0, HP)
        hmask = h < N2
        h64 = h.to(tl.int64)
        xrow = (i0 * xs0 + i1 * xs1)[:, None, None] + (h64 * xs2)[None, :, None]
        yrow = (i0 * ys0 + i1 * ys1)[:, None, None] + (h64 * ys2)[None, :, None]
        crow = (i0 * cs0 + i1 * cs1)[:, None, None]
        srow = (i0 * ss0 + i1 * ss1)[:, None, None]
        p = tl.arange(0, BLOCK_H)
        pmask = (p < H)[None, None, :]
        am = omask[:, None, None] & pmask
        m = am & hmask[None, :, None]
        src_f, src_s, dst_f, dst_s, af, as_ = _columns(p, H, PAIRS, ANGLE_PAIR, HALVES, BACKWARD)
        a = tl.load(X + xrow + ((src_f + ROFF) * xsd)[None, None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(X + xrow + ((src_s + ROFF) * xsd)[None, None, :], mask=m, other=0.0).to(tl.float32)
        cf = tl.load(C + crow + (af * csd)[None, None, :], mask=am, other=0.0).to(tl.float32)
        sf = tl.load(S + srow + (af * ssd)[None, None, :], mask=am, other=0.0).to(tl.float32)
        if ANGLE_PAIR:
            cs = cf
            ss = sf
        else:
            cs = tl.load(C + crow + (as_ * csd)[None, None, :], mask=am, other=0.0).to(tl.float32)
            ss = tl.load(S + srow + (as_ * ssd)[None, None, :], mask=am, other=0.0).to(tl.float32)
        o_f, o_s = _rotate(a, b, cf, sf, cs, ss, NEG, BACKWARD, PROD, ACC, CONTRACT)
        out_ty = Y.dtype.element_ty
        tl.store(Y + yrow + ((dst_f + ROFF) * ysd)[None, None, :], o_f.to(out_ty), mask=m)
        tl.store(Y + yrow + ((dst_s + ROFF) * ysd)[None, None, :], o_s.to(out_ty), mask=m)
        if PASS:  # columns [PS, PE) pass through, converted to the output's dtype
            for c0 in range(PS, PE, BLOCK_P):
                c = c0 + tl.arange(0, BLOCK_P)
                mm = (omask[:, None, None] & hmask[None, :, None]) & (c < PE)[None, None, :]
                v = tl.load(X + xrow + (c * xsd)[None, None, :], mask=mm, other=0.0)
                tl.store(Y + yrow + (c * ysd)[None, None, :], v.to(out_ty), mask=mm)

    @triton.jit
    def _rope_one(X, Y, C, S, tile, n_rows, N1, N2, xs0, xs1, xs2, xsd, ys0, ys1, ys2, ysd, cs0, cs1, cs2,
                  ss0, ss1, ss2, H, ROFF, PS, PE, csd, ssd, BLOCK_R: tl.constexpr, TOK: tl.constexpr,
                  HP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, PAIRS: tl.constexpr,
                  ANGLE_PAIR: tl.constexpr, HALVES: tl.constexpr, NEG: tl.constexpr, BACKWARD: tl.constexpr,
                  PROD: tl.constexpr, ACC: tl.constexpr, PASS: tl.constexpr, CONTRACT: tl.constexpr):
        # one tensor's tile: by tokens (TOK > 0: the angles shared by the innermost leading dim)
        # or by rows
        if TOK > 0:
            _rope_tokens(X, Y, C, S, tile, n_rows, N1, N2, xs0, xs1, xs2, xsd, ys0, ys1, ys2, ysd, cs0, cs1,
                         ss0, ss1, H, ROFF, PS, PE, csd, ssd, TOK, HP, BLOCK_H, BLOCK_P, PAIRS, ANGLE_PAIR,
                         HALVES, NEG, BACKWARD, PROD, ACC, PASS, CONTRACT)
        else:
            _rope_rows(X, Y, C, S, tile, n_rows, N1, N2, xs0, xs1, xs2, xsd, ys0, ys1, ys2, ysd, cs0, cs1, cs2,
                       ss0, ss1, ss2, H, ROFF, PS, PE, csd, ssd, BLOCK_R, BLOCK_H, BLOCK_P, PAIRS, ANGLE_PAIR,
                       HALVES, NEG, BACKWARD, PROD, ACC, PASS, CONTRACT)

    @triton.jit
    def _rope_kernel(X0, Y0, X1, Y1, C, S, NP0,
                     n0, a1, a2, xa0, xa1, xa2, xad, ya0, ya1, ya2, yad, ca0, ca1, ca2, sa0, sa1, sa2,
                     n1, b1, b2, xb0, xb1, xb2, xbd, yb0, yb1, yb2, ybd, cb0, cb1, cb2, sb0, sb1, sb2,
                     H, ROFF, PS, PE, csd, ssd,
                     BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, PAIRS: tl.constexpr,
                     ANGLE_PAIR: tl.constexpr, HALVES: tl.constexpr, NEG: tl.constexpr, BACKWARD: tl.constexpr,
                     PROD: tl.constexpr, ACC: tl.constexpr, PASS: tl.constexpr, TWO: tl.constexpr,
                     CONTRACT: tl.constexpr, TOK0: tl.constexpr, HP0: tl.constexpr, TOK1: tl.constexpr,
                     HP1: tl.constexpr):
        # programs [0, NP0) take tensor 0 (q), the rest tensor 1 (k): one launch for both; each
        # tensor tiled by tokens (TOKi > 0) or by rows
        pid = tl.program_id(0)
        if TWO:
            if pid >= NP0:
                _rope_one(X1, Y1, C, S, pid - NP0, n1, b1, b2, xb0, xb1, xb2, xbd, yb0, yb1, yb2, ybd, cb0, cb1, cb2,
                          sb0, sb1, sb2, H, ROFF, PS, PE, csd, ssd, BLOCK_R, TOK1, HP1, BLOCK_H, BLOCK_P, PAIRS,
                          ANGLE_PAIR, HALVES, NEG, BACKWARD, PROD, ACC, PASS, CONTRACT)
            else:
                _rope_one(X0, Y0, C, S, pid, n0, a1, a2, xa0, xa1, xa2, xad, ya0, ya1, ya2, yad, ca0, ca1, ca2,
                          sa0, sa1, sa2, H, ROFF, PS, PE, csd, ssd, BLOCK_R, TOK0, HP0, BLOCK_H, BLOCK_P, PAIRS,
                          ANGLE_PAIR, HALVES, NEG, BACKWARD, PROD, ACC, PASS, CONTRACT)
        else:
            _rope_one(X0, Y0, C, S, pid, n0, a1, a2, xa0, xa1, xa2, xad, ya0, ya1, ya2, yad, ca0, ca1, ca2,
                      sa0, sa1, sa2, H, ROFF, PS, PE, csd, ssd, BLOCK_R, TOK0, HP0, BLOCK_H, BLOCK_P, PAIRS,
                      ANGLE_PAIR, HALVES, NEG, BACKWARD, PROD, ACC, PASS, CONTRACT)
