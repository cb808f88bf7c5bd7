"""The experts' gated activation, ``act(gate) * up`` of a ``[S, 2 I]`` gate-up projection, fused.

transformers' experts (``_default_apply_gate``) compute ``gate, up = gate_up.chunk(2, -1)`` and
``act_fn(gate) * up``: eager runs the activation (one pass writing ``act``), the product (reading
``act`` and ``up``), and in the backward the product's two gradients, the activation's backward and
the chunk's backward (a zero-filled ``[S, 2 I]`` buffer the two halves are copied into). Here one
kernel reads ``gate_up`` and writes the ``[S, I]`` output, and one kernel reads ``gate_up`` and the
output's gradient and writes the ``[S, 2 I]`` input gradient; only ``gate_up`` is saved (eager
keeps ``act`` and ``up`` too). These two kernels are the dense MLP's (``ops.mlp_act``), launched
with the gate-up layout.

Rounding is eager's at every point (``SiLU`` on a half-precision tensor: FP32 math, one rounding;
the product in FP32, one rounding; backward: ``dh * up`` and ``dh * act`` each rounded to the
input dtype, the activation's backward ``d * s * (1 + g * (1 - s))`` in FP32 from the rounded
``dh * up``, one rounding). The forward's activation is eager's bit for bit: the dense forward's
(CUDA's ``expf`` and IEEE division, or for bf16 / fp16 with the opt-in fast path the fast value
where it rounds as those do: ``ops.mlp_act.launch.fast_silu_ok``). In the backward, for
half-precision inputs the exponential is Triton's, not CUDA's ``expf``, so a rounding of the
activation's gradient lies on the other neighbour where its FP32 value sits within a few ULP of a
midpoint; FP32 inputs take CUDA's ``expf``.

Only SiLU (``torch.nn.SiLU`` or transformers' ``SiLUActivation``) is fused; the caller checks that
(see ``features.moe_reorder``). CUDA tensors (CPU ones under the interpreter, not bf16 there) run
the kernels, anything else the torch reference (:func:`swiglu_reference`) with one warning per
reason. Eager calls run an autograd Function; ``torch.compile`` traces the custom ops
``deepspeed_fused::moe_swiglu`` and ``deepspeed_fused::moe_swiglu_backward``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .._common import HAS_TRITON, DirectKernel, tl, triton
from ..mlp_act import launch as _mlp_launch
from .checks import kernel_ok
from .expert_bias import _bias_grad_op, _check as _check_bias, _grad as _bias_grad, expert_bias

_NS = "deepspeed_fused"

if HAS_TRITON:

    from .._common import exp_cuda

    @triton.jit
    def _exp(v, P):
        # FP32 inputs (no narrowing rounding to hide it) take CUDA's expf, as eager does; half
        # precision takes Triton's faster exp (a few FP32 ULP off, then rounded to 8 or 11 bits)
        if P.dtype.element_ty == tl.float32:
            e = exp_cuda(v)
        else:
            e = tl.exp(v)
        return e

    @triton.jit
    def _oai_load(GU, B, E, rows, cols2, n_rows, inter, stride_gu, stride_b, limit, BLOCK_R: tl.constexpr,
                  BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr):
        # GPT-OSS's interleaved gate/up (gate at 2c, up at 2c + 1) loaded as one contiguous tile of
        # 2 BLOCK_C columns and split in registers (two stride-2 loads cost a second pass through
        # L1), and eager's clamps (the limit is in the input dtype, as a scalar clamp of a
        # half-precision tensor compares there)
        m2 = (rows < n_rows)[:, None] & (cols2 < 2 * inter)[None, :]
        v = tl.load(GU + rows.to(tl.int64)[:, None] * stride_gu + cols2[None, :], mask=m2, other=0.0)
        if HAS_BIAS:  # the experts' bias (expert_bias fused): each row's expert's row, one rounding
            e = tl.load(E + rows, mask=rows < n_rows, other=0).to(tl.int64)
            b = tl.load(B + e[:, None] * stride_b + cols2[None, :], mask=m2, other=0.0)
            v = (v.to(tl.float32) + b.to(tl.float32)).to(GU.dtype.element_ty)
        g, u = tl.split(tl.reshape(v, [BLOCK_R, BLOCK_C, 2]))
        lim = (tl.zeros_like(g.to(tl.float32)) + limit).to(g.dtype).to(tl.float32)
        gf, uf = g.to(tl.float32), u.to(tl.float32)
        return m2, gf, uf, lim

    @triton.jit
    def _oai_fwd_kernel(GU, H, n_rows, inter, stride_gu, stride_h, alpha, limit, B, E, stride_b,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cols2 = tl.program_id(1) * (2 * BLOCK_C) + tl.arange(0, 2 * BLOCK_C)
        _, gf, uf, lim = _oai_load(GU, B, E, rows, cols2, n_rows, inter, stride_gu, stride_b, limit, BLOCK_R, BLOCK_C,
                                   HAS_BIAS)
        m = (rows < n_rows)[:, None] & (cols < inter)[None, :]
        ty = GU.dtype.element_ty
        gc = tl.minimum(gf, lim, propagate_nan=tl.PropagateNan.ALL)  # torch's clamp keeps a NaN
        uc = tl.minimum(tl.maximum(uf, -lim, propagate_nan=tl.PropagateNan.ALL), lim, propagate_nan=tl.PropagateNan.ALL)
        t = (gc * alpha).to(ty).to(tl.float32)  # every step rounded to the input dtype, as eager's
        sg = tl.div_rn(tl.zeros_like(t) + 1.0, 1.0 + _exp(-t, GU)).to(ty).to(tl.float32)
        glu = (gc * sg).to(ty).to(tl.float32)
        u1 = (uc + 1.0).to(ty).to(tl.float32)
        tl.store(H + rows.to(tl.int64)[:, None] * stride_h + cols[None, :], (u1 * glu).to(ty), mask=m)

    @triton.jit
    def _oai_bwd_kernel(GU, DH, DGU, n_rows, inter, stride_gu, stride_dh, alpha, limit, B, E, stride_b,
                        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, HAS_BIAS: tl.constexpr):
        rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        cols2 = tl.program_id(1) * (2 * BLOCK_C) + tl.arange(0, 2 * BLOCK_C)
        m2, gf, uf, lim = _oai_load(GU, B, E, rows, cols2, n_rows, inter, stride_gu, stride_b, limit, BLOCK_R,
                                    BLOCK_C, HAS_BIAS)
        m = (rows < n_rows)[:, None] & (cols < inter)[None, :]
        ty = GU.dtype.element_ty
        r64 = rows.to(tl.int64)[:, None]
        dh = tl.load(DH + r64 * stride_dh + cols[None, :], mask=m, other=0.0).to(tl.float32)
        gc = tl.minimum(gf, lim, propagate_nan=tl.PropagateNan.ALL)  # torch's clamp keeps a NaN
        uc = tl.minimum(tl.maximum(uf, -lim, propagate_nan=tl.PropagateNan.ALL), lim, propagate_nan=tl.PropagateNan.ALL)
        t = (gc * alpha).to(ty).to(tl.float32)
        sg = tl.div_rn(tl.zeros_like(t) + 1.0, 1.0 + _exp(-t, GU)).to(ty).to(tl.float32)
        glu = (gc * sg).to(ty).to(tl.float32)
        u1 = (uc + 1.0).to(ty).to(tl.float32)
        d_u1 = (dh * glu).to(ty).to(tl.float32)  # autograd's chain, each gradient in the input dtype
        d_glu = (dh * u1).to(ty).to(tl.float32)
        d_up = tl.where((uf >= -lim) & (uf <= lim), d_u1, 0.0)
        d_direct = (d_glu * sg).to(ty).to(tl.float32)
        d_sg = (d_glu * gc).to(ty).to(tl.float32)
        # the sigmoid's backward as ATen writes it for half types, d * (1 - s) * s in the input
        # dtype's arithmetic: each operation rounded
        one_m = (1.0 - sg).to(ty).to(tl.float32)
        d_t = ((d_sg * one_m).to(ty).to(tl.float32) * sg).to(ty).to(tl.float32)
        d_via_t = (d_t * alpha).to(ty).to(tl.float32)
        d_gc = (d_direct + d_via_t).to(ty).to(tl.float32)
        d_gate = tl.where(gf <= lim, d_gc, 0.0)
        # interleaved again in registers: one contiguous store (two stride-2 stores write each
        # sector in halves)
        dgu = tl.reshape(tl.join(d_gate.to(ty), d_up.to(ty)), [BLOCK_R, 2 * BLOCK_C])
        tl.store(DGU + r64 * (2 * inter) + cols2[None, :], dgu, mask=m2)

    # no FMA contraction: eager rounds every product of the chain to the input dtype, and LLVM
    # narrows a rounded FP32 product of two half values to a half multiply that the backend then
    # fuses with the following add (d_direct + d_via_t), skipping that rounding (15% of the gate
    # gradients one ULP off CUDA eager, found on the H200)
    _launch_oai_fwd = DirectKernel(_oai_fwd_kernel, enable_fp_fusion=False)
    _launch_oai_bwd = DirectKernel(_oai_bwd_kernel, enable_fp_fusion=False)


def swiglu_reference(gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' default gate: ``silu(gate) * up`` of ``gate, up = gate_up.chunk(2, -1)``."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def _check(gate_up: torch.Tensor) -> None:
    if not isinstance(gate_up, torch.Tensor):
        raise TypeError(f"gate_up: expected a torch.Tensor, got {type(gate_up).__name__}")
    if not gate_up.is_floating_point():
        raise TypeError(f"gate_up: expected a floating-point tensor, got {gate_up.dtype}")
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up: expected an even last dimension (gate and up halves), got shape "
                         f"{tuple(gate_up.shape)}")


# Tiles: (outputs per program, widest column block). A sweep on an H100 (2026-12-05, bf16, every
# tile of 512-2048 columns, 1-8 rows, 2-8 warps; outputs bitwise equal across tiles) put the
# swiglu kernels (now ops.mlp_act's, launch.TILE) at 2048 outputs (I 768: forward 0.134 -> 0.105
# ms at 65536 rows; 1-3% at I 2048 and 14336) and GPT-OSS's gate, which holds twice the columns
# and a longer chain in registers, at 2048 outputs of at most 1024 columns forward and 1024
# backward (0.462 -> 0.371 ms at 32768 x 2880), where 4096 outputs had served all four.
_OAI_FWD_TILE = (2048, 1024)
_OAI_BWD_TILE = (1024, 1024)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, width]`` with unit column stride (a copy only where that needs one)."""
    t2 = t.reshape(-1, t.shape[-1])
    if t2.stride(-1) != 1:
        t2 = t2.contiguous()
    return t2


def _gate_forward(launch, tile, gate_up: torch.Tensor, *scalars, **constexprs) -> torch.Tensor:
    """A gate kernel's forward launch (``launch``: the swiglu's or GPT-OSS's, ``tile``: its
    ``ops.mlp_act.launch.tile`` sizes), into a fresh [..., I]; ``scalars``: the kernel's arguments
    after the rows' layout, ``constexprs``: beside the tile's."""
    gu = _rows(gate_up)
    n_rows, inter = gu.shape[0], gu.shape[1] // 2
    h = torch.empty((n_rows, inter), dtype=gu.dtype, device=gu.device)
    if h.numel():
        grid, const, warps = _mlp_launch.tile(n_rows, inter, tile)
        launch(grid, (gu, h, n_rows, inter, gu.stride(0), h.stride(0)) + scalars, dict(const, **constexprs), warps)
    return h.view(*gate_up.shape[:-1], inter)


def _gate_backward(launch, tile, gate_up: torch.Tensor, dh: torch.Tensor, *scalars, **constexprs) -> torch.Tensor:
    """A gate kernel's backward launch, into a fresh [..., 2 I] input gradient."""
    gu, d = _rows(gate_up), _rows(dh.to(gate_up.dtype))
    n_rows, inter = gu.shape[0], gu.shape[1] // 2
    dgu = torch.empty((n_rows, 2 * inter), dtype=gu.dtype, device=gu.device)
    if dgu.numel():
        grid, const, warps = _mlp_launch.tile(n_rows, inter, tile)
        launch(grid, (gu, d, dgu, n_rows, inter, gu.stride(0), d.stride(0)) + scalars, dict(const, **constexprs),
               warps)
    return dgu.view(gate_up.shape)


def _forward(gate_up: torch.Tensor) -> torch.Tensor:
    # the dense MLP's kernels (ops.mlp_act), gate-up layout, SiLU: the exact forward (its opt-in fast path
    # where that is on and this device's probe passed); the backward takes CUDA's expf for FP32 inputs only
    return _mlp_launch.fused_forward(gate_up, "silu", True)


def _backward(gate_up: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    return _mlp_launch.fused_backward(gate_up, dh, "silu", True, exact_exp=gate_up.dtype == torch.float32)


class _SwiGLUFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        ctx.save_for_backward(gate_up)
        return _forward(gate_up)

    @staticmethod
    def backward(ctx, dh):
        (gate_up,) = ctx.saved_tensors
        return _backward(gate_up, dh)


@torch.library.custom_op(f"{_NS}::moe_swiglu", mutates_args=())
def _swiglu_op(gate_up: torch.Tensor) -> torch.Tensor:
    return _forward(gate_up)


@_swiglu_op.register_fake
def _(gate_up):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op(f"{_NS}::moe_swiglu_backward", mutates_args=())
def _swiglu_backward_op(gate_up: torch.Tensor, dh: torch.Tensor) -> torch.Tensor:
    return _backward(gate_up, dh)


@_swiglu_backward_op.register_fake
def _(gate_up, dh):
    return torch.empty_like(gate_up)


def _op_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _op_backward(ctx, dh):
    (gate_up,) = ctx.saved_tensors
    return _swiglu_backward_op(gate_up, dh)


_swiglu_op.register_autograd(_op_backward, setup_context=_op_setup)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``gate, up = gate_up.chunk(2, -1)`` (``[..., 2 I]`` -> ``[..., I]``),
    forward and backward in one kernel each, with eager's rounding (module docstring)."""
    _check(gate_up)
    if not kernel_ok("swiglu", gate_up):
        return swiglu_reference(gate_up)
    if torch.compiler.is_compiling():
        return _swiglu_op(gate_up)
    if torch.is_grad_enabled() and gate_up.requires_grad:
        return _SwiGLUFn.apply(gate_up)
    return _forward(gate_up)


# ---- GPT-OSS's clamped gate ---------------------------------------------------------------------
def oai_gate_reference(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """GPT-OSS's experts gate (``GptOssExperts._apply_gate``): interleaved gate/up, the gate clamped
    above and the up both ways at ``limit``, ``(up + 1) * gate * sigmoid(gate * alpha)``."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=limit)
    up = up.clamp(min=-limit, max=limit)
    glu = gate * torch.sigmoid(gate * alpha)
    return (up + 1) * glu


def _oai_bias_args(gate_up, bias, experts) -> tuple:
    """The GPT-OSS kernels' arguments after the limit: the bias, the rows' experts and the bias's row
    stride (without a bias, stand-ins the kernel does not read)."""
    b, e = (gate_up, gate_up) if bias is None else (bias, experts)
    return b, e, b.stride(0)


def _oai_forward(gate_up, alpha, limit, bias=None, experts=None):
    return _gate_forward(_launch_oai_fwd, _OAI_FWD_TILE, gate_up, float(alpha), float(limit),
                         *_oai_bias_args(gate_up, bias, experts), HAS_BIAS=bias is not None)


def _oai_backward(gate_up, dh, alpha, limit, bias=None, experts=None):
    return _gate_backward(_launch_oai_bwd, _OAI_BWD_TILE, gate_up, dh, float(alpha), float(limit),
                          *_oai_bias_args(gate_up, bias, experts), HAS_BIAS=bias is not None)


def _oai_bias_grad(grad_fn, dgu, bias, offsets, needs_input_grad):
    """The bias's gradient from the gate-up gradient (``grad_fn``: expert_bias's segmented sum, as a
    function or its custom op), or None. ``needs_input_grad`` is read only with a bias: a custom op
    called without one has no flag for it."""
    if bias is None or not needs_input_grad[3]:
        return None
    return grad_fn(dgu.reshape(-1, dgu.shape[-1]), offsets, bias.dtype)


class _OaiGateFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, alpha, limit, bias, experts, offsets):
        ctx.save_for_backward(gate_up, bias, experts, offsets)
        ctx.args = (alpha, limit)
        return _oai_forward(gate_up, alpha, limit, bias, experts)

    @staticmethod
    def backward(ctx, dh):
        gate_up, bias, experts, offsets = ctx.saved_tensors
        dgu = _oai_backward(gate_up, dh, *ctx.args, bias, experts)
        return dgu, None, None, _oai_bias_grad(_bias_grad, dgu, bias, offsets, ctx.needs_input_grad), None, None


@torch.library.custom_op(f"{_NS}::moe_oai_gate", mutates_args=())
def _oai_op(gate_up: torch.Tensor, alpha: float, limit: float, bias: Optional[torch.Tensor] = None,
            experts: Optional[torch.Tensor] = None, offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _oai_forward(gate_up, alpha, limit, bias, experts)


@_oai_op.register_fake
def _(gate_up, alpha, limit, bias=None, experts=None, offsets=None):
    return gate_up.new_empty((*gate_up.shape[:-1], gate_up.shape[-1] // 2))


@torch.library.custom_op(f"{_NS}::moe_oai_gate_backward", mutates_args=())
def _oai_backward_op(gate_up: torch.Tensor, dh: torch.Tensor, alpha: float, limit: float,
                     bias: Optional[torch.Tensor] = None, experts: Optional[torch.Tensor] = None) -> torch.Tensor:
    return _oai_backward(gate_up, dh, alpha, limit, bias, experts)


@_oai_backward_op.register_fake
def _(gate_up, dh, alpha, limit, bias=None, experts=None):
    return torch.empty_like(gate_up)


def _oai_setup(ctx, inputs, output):
    ctx.save_for_backward(inputs[0], inputs[3], inputs[4], inputs[5])
    ctx.args = (inputs[1], inputs[2])


def _oai_op_backward(ctx, dh):
    gate_up, bias, experts, offsets = ctx.saved_tensors
    dgu = _oai_backward_op(gate_up, dh, *ctx.args, bias, experts)
    return dgu, None, None, _oai_bias_grad(_bias_grad_op, dgu, bias, offsets, ctx.needs_input_grad), None, None


_oai_op.register_autograd(_oai_op_backward, setup_context=_oai_setup)


def oai_gate(gate_up: torch.Tensor, alpha: float, limit: float, bias: Optional[torch.Tensor] = None,
             experts: Optional[torch.Tensor] = None, offsets: Optional[torch.Tensor] = None) -> torch.Tensor:
    """GPT-OSS's clamped gate (:func:`oai_gate_reference`) of an interleaved ``[..., 2 I]`` gate-up
    projection, one kernel forward and one backward, each step rounded to the input dtype as eager
    rounds it (clamps exact, ``gate * alpha``, the sigmoid, ``gate * sigmoid``, ``up + 1``, the
    product; backward: every gradient of that chain, the clamps' masks inclusive). With ``bias``
    ``[E, 2 I]``, ``experts`` and ``offsets`` (as :func:`~.expert_bias.expert_bias` takes them; the
    gate-up rows ``[S, 2 I]``): the gate of ``gate_up + bias[experts]`` (the sum rounded once, as
    eager's add), the bias added as the rows are loaded (no pass of its own) and its gradient the
    segmented sum of each expert's rows of the input gradient."""
    _check(gate_up)
    for name, v in (("alpha", alpha), ("limit", limit)):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise TypeError(f"{name}: expected a Python float, got {type(v).__name__}")
    given = [t is not None for t in (bias, experts, offsets)]
    if any(given) and not all(given):
        raise ValueError("bias, experts, offsets: expected all three or none")
    if bias is not None:
        _check_bias(gate_up, bias, experts, offsets)
        if bias.dtype != gate_up.dtype or not kernel_ok("oai_gate", gate_up):
            return oai_gate(expert_bias(gate_up, bias, experts, offsets), alpha, limit)
    if not kernel_ok("oai_gate", gate_up):
        return oai_gate_reference(gate_up, alpha, limit)
    if torch.compiler.is_compiling():
        return _oai_op(gate_up, float(alpha), float(limit), bias, experts, offsets)
    if torch.is_grad_enabled() and (gate_up.requires_grad or (bias is not None and bias.requires_grad)):
        return _OaiGateFn.apply(gate_up, float(alpha), float(limit), bias, experts, offsets)
    return _oai_forward(gate_up, float(alpha), float(limit), bias, experts)
