"""Triton kernels of the gated activation ``act(gate) * up``, one family for every layout.

A forward kernel reads a ``[rows, I]`` gate and a ``[rows, I]`` up (two tensors, or the two halves
of one gate-up projection: each is a base pointer and a row stride, the columns contiguous) and
writes ``[rows, I]``; a backward kernel reads them and the output's gradient and writes the gate's
and the up's gradients (again two tensors or the two halves of one buffer). The dense MLP's op
(:mod:`.api`) and the MoE experts' gate (``ops.moe_reorder.swiglu``) launch these kernels.

The activation (``ACT``) is a constexpr: 0 SiLU, 1 GELU with the tanh approximation, 2 exact
(erf) GELU, each written as ATen's CUDA kernel writes it in FP32 (``opmath``), in the same
order of operations, with CUDA's ``expf``/``tanhf`` (libdevice) and CUDA's ``erff`` written out
(:func:`_erf`, below), and with the multiply-adds that nvcc contracts into FMAs as explicit
``tl.fma``. Each step is rounded where eager rounds it: the activation once to the input dtype,
the product once; backward: the product's two gradients each rounded to the input dtype, the
activation's backward in FP32 from the rounded ``dh * up``, one rounding. ``EXACT_EXP`` (SiLU
only) false takes Triton's faster ``exp`` for half-precision inputs, as the experts' gate always has.

A program covers ``BLOCK_R`` rows and ``BLOCK_C`` columns; programs are numbered with the column
block fastest, so consecutive programs (which the GPU starts together) read consecutive memory,
as a flat elementwise kernel does. Row-contiguous tensors are launched as one row of
``rows * I`` elements (:mod:`.launch`); offsets are int64.
"""
from __future__ import annotations

import struct

from .._common import _INTERPRET_AT_IMPORT, HAS_TRITON, DirectKernel, tl, triton

SILU, GELU_TANH, GELU = 0, 1, 2
ACT_CODES = {"silu": SILU, "gelu_tanh": GELU_TANH, "gelu": GELU}


def _f32(v: float) -> float:
    """``v`` rounded to FP32 (a C++ ``constexpr float`` initialised from a double expression)."""
    return struct.unpack("f", struct.pack("f", v))[0]


# ATen's constants (ActivationGeluKernel.cu), each a float formed from double expressions
_SQRT2, _2_SQRTPI, _SQRT1_2 = 1.41421356237309504880, 1.12837916709551257390, 0.70710678118654752440
K_BETA_TANH = _f32(_SQRT2 * _2_SQRTPI * 0.5)
K_KAPPA = _f32(0.044715)
K_3_KAPPA = _f32(3.0 * K_KAPPA)  # opmath_t(3) * kKappa: a product of two floats, folded in FP32
K_ALPHA = _f32(_SQRT1_2)
K_BETA_ERF = _f32(_2_SQRTPI * _SQRT1_2 * 0.5)


def _bits(h: int) -> float:
    """The FP32 number with bit pattern ``h``."""
    return struct.unpack("<f", struct.pack("<I", h))[0]


# CUDA's erff (libdevice's __nv_erff of CUDA 12.6 to 13.0, what nvcc builds eager's GELU with): below
# ERF_SPLIT, erf(a) = a + a p(a^2); from it, erf(a) = copysign(1 - 2^(-|a| - |a| q(|a|)), a) with
# ex2.approx.ftz. p and q are degree-6 polynomials in Horner form, one FMA a step (highest first).
# Triton's bundled libdevice carries an older erff (other q coefficients): 1 ULP apart on a few
# percent of inputs, which eager's GELU turns into many ULP where 1 + erf cancels.
ERF_SPLIT = _bits(0x3F8060FE)  # 1.00296
ERF_P = tuple(map(_bits, (0x38B1E96A, 0xBA574D20, 0x3BAAD5EA, 0xBCDC1BE7, 0x3DE718AF, 0xBEC093AC, 0x3E0375D3)))
ERF_Q = tuple(map(_bits, (0x38EB4C3A, 0xBAAE005B, 0x3C09919F, 0xBD24D99A, 0x3E235519, 0x3F69B4F9, 0x3F210A14)))

# The half-precision SiLU forward's opt-in fast path (FAST_SILU): a value from ex2.approx and rcp.approx, kept
# where it lies more than SELECT_ULPS FP32 units (bit patterns) from every rounding midpoint of the
# 16-bit output, so that it rounds as the exact value does; the exact value (below) elsewhere, and
# wherever x < SELECT_X_MIN (the exponential's argument error grows with |x|), |x| < SELECT_TINY,
# x is NaN, or (fp16) the output is subnormal. For x >= -8 the fast and exact values lie under 30
# units apart (tests/unit/test_mlp_act_fast_silu.py bounds it over every bf16 and fp16 input, under
# assumed error bounds of the approximations); launch.fast_silu_ok probes every input on each GPU.
SELECT_ULPS = 32
SELECT_X_MIN = -8.0
SELECT_TINY = 1.0e-30
NEG_LOG2E = -1.4426950408889634  # the fast value's exponent scale, e^-x = 2^(x NEG_LOG2E)
# CUDA's expf as Triton's libdevice compiles it, then 1 + e contracted into one FMA, as in the exact
# kernel's PTX (the test above compares the whole expression with the compiled one)
EXPF_PTX = (
    "neg.f32 v, $1;",
    "fma.rn.ftz.f32 t, v, 0f3BBB989D, 0f3F000000;",
    "cvt.ftz.sat.f32.f32 t, t;",
    "fma.rm.ftz.f32 j, t, 0f437C0000, 0f4B400001;",
    "add.f32 k, j, 0fCB40007F;",
    "neg.f32 k, k;",
    "fma.rn.ftz.f32 f, v, 0f3FB8AA3B, k;",
    "fma.rn.ftz.f32 f, v, 0f32A57060, f;",
    "shl.b32 s, j, 23;",
    "ex2.approx.ftz.f32 r, f;",
    "fma.rn.f32 d, r, s, 0f3F800000;",
)


def _hex32(v: float) -> str:
    return "0f%08X" % struct.unpack("<I", struct.pack("<f", v))[0]


def select_window(out_bits: int) -> tuple:
    """(midpoint, mask) of the low ``out_bits`` bits: the 16-bit type's rounding midpoint in FP32 bits."""
    return 1 << (out_bits - 1), (1 << out_bits) - 1


FP16_MIN_NORMAL = 2.0 ** -14  # below it an fp16 output is subnormal: its rounding point moves


SILU_PACKS = (1, 2, 4)  # the group sizes the kernels are built for (launch.silu_pack picks one)


def silu_select_ptx(out_bits: int, pack: int = 1) -> str:
    """The PTX of ``pack`` elements of the fast SiLU forward: ``$i`` the FP32 activation of the FP32
    gate ``$(pack + i)``, each rounding to the 16-bit type (``out_bits`` below its top bits: 16 for
    bf16, 13 for fp16) as the exact one does. The fast values of the group come first (so their
    approximations overlap), then one branch per lane: where any element of the group needs the exact
    value, the lane computes it for all of them (a correctly rounded value, so no output changes; a
    warp runs the branch when one of its lanes takes it). Scoped registers and a per-instance label
    keep every inlined copy apart."""
    if pack not in SILU_PACKS:
        raise ValueError(f"pack must be one of {SILU_PACKS}, got {pack!r}")
    mid, mask = select_window(out_bits)
    out, gate = [f"${i}" for i in range(pack)], [f"${pack + i}" for i in range(pack)]
    lines = ["{", ".reg .pred p;", ".reg .b32 v, t, j, k, f, r, s, d, b, a;"]
    for y, x in zip(out, gate):
        lines += [f"mul.ftz.f32 t, {x}, {_hex32(NEG_LOG2E)};", "ex2.approx.ftz.f32 t, t;",
                  "add.ftz.f32 d, t, 0f3F800000;", "rcp.approx.ftz.f32 r, d;", f"mul.ftz.f32 {y}, {x}, r;"]
    for i, (y, x) in enumerate(zip(out, gate)):
        near = f"setp.le.or.u32 p, b, {2 * SELECT_ULPS}, p;" if i else f"setp.le.u32 p, b, {2 * SELECT_ULPS};"
        lines += [f"add.s32 b, {y}, {SELECT_ULPS - mid};", f"and.b32 b, b, {mask};", near,
                  f"setp.ltu.or.f32 p, {x}, {_hex32(SELECT_X_MIN)}, p;", f"abs.f32 a, {x};",
                  f"setp.lt.or.f32 p, a, {_hex32(SELECT_TINY)}, p;"]
        if out_bits == 13:  # an fp16 output below the normal range: its rounding point moves
            lines += [f"abs.f32 a, {y};", f"setp.lt.or.f32 p, a, {_hex32(FP16_MIN_NORMAL)}, p;"]
    lines.append("@!p bra DSF_SILU_EXACT${:uid};")
    for y, x in zip(out, gate):
        lines += [ln.replace("$1", x) for ln in EXPF_PTX] + [f"div.rn.f32 {y}, {x}, d;"]
    return "\n".join(lines + ["DSF_SILU_EXACT${:uid}:", "}"])


def silu_constraints(pack: int) -> str:
    """The inline-asm constraints of :func:`silu_select_ptx`: ``pack`` outputs, then ``pack`` gates."""
    return ",".join(["=r"] * pack + ["r"] * pack)


if HAS_TRITON:
    from .._common import exp_cuda

    _C_BETA_TANH = tl.constexpr(K_BETA_TANH)
    _C_KAPPA = tl.constexpr(K_KAPPA)
    _C_3_KAPPA = tl.constexpr(K_3_KAPPA)
    _C_ALPHA = tl.constexpr(K_ALPHA)
    _C_BETA_ERF = tl.constexpr(K_BETA_ERF)
    _C_ERF_SPLIT = tl.constexpr(ERF_SPLIT)
    _P0, _P1, _P2, _P3, _P4, _P5, _P6 = map(tl.constexpr, ERF_P)
    _Q0, _Q1, _Q2, _Q3, _Q4, _Q5, _Q6 = map(tl.constexpr, ERF_Q)
    _C_NEG_LOG2E = tl.constexpr(_f32(NEG_LOG2E))
    _C_SELECT_ULPS = tl.constexpr(SELECT_ULPS)
    _C_SELECT_X_MIN = tl.constexpr(SELECT_X_MIN)
    _C_SELECT_TINY = tl.constexpr(_f32(SELECT_TINY))
    _C_BF16_MID, _C_BF16_MASK = map(tl.constexpr, select_window(16))
    _C_FP16_MID, _C_FP16_MASK = map(tl.constexpr, select_window(13))
    _C_FP16_MIN_NORMAL = tl.constexpr(FP16_MIN_NORMAL)
    _C_SILU_BF16_1, _C_SILU_BF16_2, _C_SILU_BF16_4 = (tl.constexpr(silu_select_ptx(16, n)) for n in SILU_PACKS)
    _C_SILU_FP16_1, _C_SILU_FP16_2, _C_SILU_FP16_4 = (tl.constexpr(silu_select_ptx(13, n)) for n in SILU_PACKS)
    _C_CONS_1, _C_CONS_2, _C_CONS_4 = (tl.constexpr(silu_constraints(n)) for n in SILU_PACKS)

    if _INTERPRET_AT_IMPORT:  # no libdevice or PTX under the interpreter: numpy's exp and exp2, tanh from exp

        @triton.jit
        def _tanh(v):
            e = tl.exp(-2.0 * tl.abs(v))
            t = (1.0 - e) / (1.0 + e)
            return tl.where(v < 0, -t, t)

        @triton.jit
        def _ex2_approx(v):
            return tl.exp2(v)

        @triton.jit
        def _fma(a, b, c):
            # the interpreter's tl.fma rounds the product first; FP64 holds it exactly
            return (a.to(tl.float64) * b + c.to(tl.float64)).to(tl.float32)
    else:
        from triton.language.extra.cuda import libdevice

        @triton.jit
        def _tanh(v):
            return libdevice.tanh(v)  # CUDA's tanhf, as ATen's c10::cuda::compat::tanh

        @triton.jit
        def _ex2_approx(v):
            return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [v], dtype=tl.float32,
                                             is_pure=True, pack=1)

        @triton.jit
        def _fma(a, b, c):
            return tl.fma(a, b, c)  # fma.rn.f32

    if _INTERPRET_AT_IMPORT:  # the fast SiLU forward's selection, numpy's exp2 and division standing in

        @triton.jit
        def _silu_half(x, BF16: tl.constexpr, PACK: tl.constexpr):
            # element by element (the PTX's groups change no output: a value it replaces is the exact one)
            y = x * (1.0 / (1.0 + tl.exp2(x * _C_NEG_LOG2E)))
            bits = y.to(tl.int32, bitcast=True)
            if BF16:
                off = (bits + (_C_SELECT_ULPS - _C_BF16_MID)) & _C_BF16_MASK
                sel = off <= 2 * _C_SELECT_ULPS
            else:
                off = (bits + (_C_SELECT_ULPS - _C_FP16_MID)) & _C_FP16_MASK
                sel = (off <= 2 * _C_SELECT_ULPS) | (tl.abs(y) < _C_FP16_MIN_NORMAL)
            sel = sel | (x < _C_SELECT_X_MIN) | (tl.abs(x) < _C_SELECT_TINY) | (x != x)
            return tl.where(sel, _act_f32(x, 0, True), y)
    else:

        @triton.jit
        def _silu_asm(x, ASM: tl.constexpr, CONS: tl.constexpr, PACK: tl.constexpr):
            return tl.inline_asm_elementwise(ASM, CONS, [x], dtype=tl.float32, is_pure=True, pack=PACK)

        @triton.jit
        def _silu_half(x, BF16: tl.constexpr, PACK: tl.constexpr):
            if PACK == 4:
                y = _silu_asm(x, _C_SILU_BF16_4 if BF16 else _C_SILU_FP16_4, _C_CONS_4, 4)
            elif PACK == 2:
                y = _silu_asm(x, _C_SILU_BF16_2 if BF16 else _C_SILU_FP16_2, _C_CONS_2, 2)
            else:
                y = _silu_asm(x, _C_SILU_BF16_1 if BF16 else _C_SILU_FP16_1, _C_CONS_1, 1)
            return y

    @triton.jit
    def _erf(a):
        # CUDA's erff step for step (see ERF_P / ERF_Q): both branches computed, one selected
        ax = tl.abs(a)
        far = ax >= _C_ERF_SPLIT
        t = tl.where(far, ax, a * a)
        p = tl.where(far, _Q0, _P0)
        p = _fma(p, t, tl.where(far, _Q1, _P1))
        p = _fma(p, t, tl.where(far, _Q2, _P2))
        p = _fma(p, t, tl.where(far, _Q3, _P3))
        p = _fma(p, t, tl.where(far, _Q4, _P4))
        p = _fma(p, t, tl.where(far, _Q5, _P5))
        p = _fma(p, t, tl.where(far, _Q6, _P6))
        s = tl.where(far, -ax, a)
        r = _fma(p, s, s)
        e = 1.0 - _ex2_approx(r)
        # copysign: on the far branch a is never 0 or NaN
        return tl.where(far, tl.where(a < 0, -e, e), r)

    @triton.jit
    def _exp(v, EXACT_EXP: tl.constexpr):
        if EXACT_EXP:
            e = exp_cuda(v)
        else:
            e = tl.exp(v)
        return e

    @triton.jit
    def _act_f32(x, ACT: tl.constexpr, EXACT_EXP: tl.constexpr):
        # the activation of FP32 x as ATen's CUDA kernels compute it (before their one rounding)
        if ACT == 0:
            y = tl.div_rn(x, 1.0 + _exp(-x, EXACT_EXP))
        elif ACT == 1:
            x_cube = x * x * x
            inner = _C_BETA_TANH * (x + _C_KAPPA * x_cube)
            y = 0.5 * x * (1.0 + _tanh(inner))
        else:
            y = x * 0.5 * (1.0 + _erf(x * _C_ALPHA))
        return y

    @triton.jit
    def _act_grad_f32(dy, x, ACT: tl.constexpr, EXACT_EXP: tl.constexpr):
        # the activation's backward (silu_backward / gelu_backward) in FP32, before its rounding
        if ACT == 0:
            s = tl.div_rn(tl.zeros_like(x) + 1.0, 1.0 + _exp(-x, EXACT_EXP))
            d = dy * s * (1.0 + x * (1.0 - s))
        elif ACT == 1:
            x_sq = x * x
            x_cube = x_sq * x
            inner = _C_BETA_TANH * (x + _C_KAPPA * x_cube)
            t = _tanh(inner)
            left = 0.5 * x
            right = 1.0 + t
            left_derivative = 0.5 * right
            tanh_derivative = 1.0 - t * t
            inner_derivative = _C_BETA_TANH * (1.0 + _C_3_KAPPA * x_sq)
            right_derivative = left * tanh_derivative * inner_derivative
            d = dy * (left_derivative + right_derivative)
        else:
            # cdf + x * pdf with cdf = 0.5 * (1 + erf): nvcc contracts the cdf's product into the
            # sum (fma(1 + erf, 0.5, x * pdf)), x * pdf rounded on its own
            pdf = exp_cuda(-0.5 * x * x) * _C_BETA_ERF
            d = dy * _fma(1.0 + _erf(x * _C_ALPHA), 0.5, x * pdf)
        return d

    @triton.jit
    def _tile_of(n_col_blocks, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FLAT: tl.constexpr):
        # this program's rows and columns (int64), the column block fastest; FLAT: one row (launch.plan's
        # flat launches), where the program is the column block (no division by the block count)
        pid = tl.program_id(0)
        if FLAT:
            rb = pid * 0
            cb = pid
        else:
            rb = pid // n_col_blocks
            cb = pid - rb * n_col_blocks
        rows = rb.to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = cb.to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
        return rows, cols

    @triton.jit
    def _gated_fwd_kernel(G, U, H, n_rows, inter, n_col_blocks, stride_g, stride_u, stride_h, ACT: tl.constexpr,
                          EXACT_EXP: tl.constexpr, FAST_SILU: tl.constexpr, SILU_PACK: tl.constexpr,
                          BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, FLAT: tl.constexpr):
        rows, cols = _tile_of(n_col_blocks, BLOCK_R, BLOCK_C, FLAT)
        m = (rows < n_rows)[:, None] & (cols < inter)[None, :]
        r64 = rows[:, None]
        g = tl.load(G + r64 * stride_g + cols[None, :], mask=m, other=0.0)
        u = tl.load(U + r64 * stride_u + cols[None, :], mask=m, other=0.0)
        ty = g.dtype
        if FAST_SILU:  # SiLU of a bf16 / fp16 gate, the fast value where it rounds as the exact one
            a = _silu_half(g.to(tl.float32), ty == tl.bfloat16, SILU_PACK).to(ty)
        else:
            a = _act_f32(g.to(tl.float32), ACT, EXACT_EXP).to(ty)  # act(gate): one rounding to the input dtype
        h = (a.to(tl.float32) * u.to(tl.float32)).to(ty)  # the product: one rounding
        tl.store(H + r64 * stride_h + cols[None, :], h, mask=m)

    @triton.jit
    def _gated_bwd_kernel(G, U, DH, DG, DU, n_rows, inter, n_col_blocks, stride_g, stride_u, stride_dh, stride_dg,
                          stride_du, ACT: tl.constexpr, EXACT_EXP: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_C: tl.constexpr, FLAT: tl.constexpr):
        rows, cols = _tile_of(n_col_blocks, BLOCK_R, BLOCK_C, FLAT)
        m = (rows < n_rows)[:, None] & (cols < inter)[None, :]
        r64 = rows[:, None]
        g = tl.load(G + r64 * stride_g + cols[None, :], mask=m, other=0.0)
        u = tl.load(U + r64 * stride_u + cols[None, :], mask=m, other=0.0).to(tl.float32)
        dh = tl.load(DH + r64 * stride_dh + cols[None, :], mask=m, other=0.0).to(tl.float32)
        ty = g.dtype
        gf = g.to(tl.float32)
        a = _act_f32(gf, ACT, EXACT_EXP).to(ty).to(tl.float32)
        d_up = (dh * a).to(ty)  # the product's gradients, each rounded to the input dtype
        d_act = (dh * u).to(ty).to(tl.float32)
        d_gate = _act_grad_f32(d_act, gf, ACT, EXACT_EXP).to(ty)
        tl.store(DG + r64 * stride_dg + cols[None, :], d_gate, mask=m)
        tl.store(DU + r64 * stride_du + cols[None, :], d_up, mask=m)

    launch_forward = DirectKernel(_gated_fwd_kernel)
    launch_backward = DirectKernel(_gated_bwd_kernel)
