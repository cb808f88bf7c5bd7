"""Triton kernels of the gated activation ``act(gate) * up``, one family for every layout.

A forward kernel reads a ``[rows, I]`` gate and a ``[rows, I]`` up (two tensors, or the two halves
of one gate-up projection: each is a base pointer and a row stride, the columns contiguous) and
writes ``[rows, I]``; a backward kernel reads them and the output's gradient and writes the gate's
and the up's gradients (again two tensors or the two halves of one buffer). The dense MLP's op
(:mod:`.api`) and the MoE experts' gate (``ops.moe_reorder.swiglu``) launch these kernels.

The activation (``ACT``) is a constexpr: 0 SiLU, 1 GELU with the tanh approximation, 2 exact
(erf) GELU, each written as ATen's CUDA kernel writes it in FP32 (``opmath``), in the same
order of operations, with CUDA's ``expf``/``tanhf``/``erff`` (libdevice). Each step is rounded
where eager rounds it: the activation once to the input dtype, the product once; backward: the
product's two gradients each rounded to the input dtype, the activation's backward in FP32 from
the rounded ``dh * up``, one rounding. ``EXACT_EXP`` (SiLU only) false takes Triton's faster
``exp`` for half-precision inputs, as the experts' gate always has.
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

if HAS_TRITON:
    from .._common import exp_cuda

    _C_BETA_TANH = tl.constexpr(K_BETA_TANH)
    _C_KAPPA = tl.constexpr(K_KAPPA)
    _C_3_KAPPA = tl.constexpr(K_3_KAPPA)
    _C_ALPHA = tl.constexpr(K_ALPHA)
    _C_BETA_ERF = tl.constexpr(K_BETA_ERF)

    if _INTERPRET_AT_IMPORT:  # no libdevice under the interpreter: numpy's exp and erf, tanh from exp

        @triton.jit
        def _tanh(v):
            e = tl.exp(-2.0 * tl.abs(v))
            t = (1.0 - e) / (1.0 + e)
            return tl.where(v < 0, -t, t)

        @triton.jit
        def _erf(v):
            return tl.erf(v)
    else:
        from triton.language.extra.cuda import libdevice

        @triton.jit
        def _tanh(v):
            return libdevice.tanh(v)  # CUDA's tanhf, as ATen's c10::cuda::compat::tanh

        @triton.jit
        def _erf(v):
            return libdevice.erf(v)  # CUDA's erff

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
            cdf = 0.5 * (1.0 + _erf(x * _C_ALPHA))
            pdf = exp_cuda(-0.5 * x * x) * _C_BETA_ERF
            d = dy * (cdf + x * pdf)
        return d

    @triton.jit
    def _gated_fwd_kernel(G, U, H, n_rows, inter, stride_g, stride_u, stride_h, ACT: tl.constexpr,
                          EXACT_EXP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        m = (rows < n_rows)[:, None] & (cols < inter)[None, :]
        r64 = rows.to(tl.int64)[:, None]
        g = tl.load(G + r64 * stride_g + cols[None, :], mask=m, other=0.0)
        u = tl.load(U + r64 * stride_u + cols[None, :], mask=m, other=0.0)
        ty = g.dtype
        a = _act_f32(g.to(tl.float32), ACT, EXACT_EXP).to(ty)  # act(gate): one rounding to the input dtype
        h = (a.to(tl.float32) * u.to(tl.float32)).to(ty)  # the product: one rounding
        tl.store(H + r64 * stride_h + cols[None, :], h, mask=m)

    @triton.jit
    def _gated_bwd_kernel(G, U, DH, DG, DU, n_rows, inter, stride_g, stride_u, stride_dh, stride_dg, stride_du,
                          ACT: tl.constexpr, EXACT_EXP: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        m = (rows < n_rows)[:, None] & (cols < inter)[None, :]
        r64 = rows.to(tl.int64)[:, None]
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
