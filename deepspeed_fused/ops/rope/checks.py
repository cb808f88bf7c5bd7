"""Input validation: which inputs the kernels take (and each one's row geometry), which run the
reference (a reason), and which eager rejects too (:class:`RopeInputError`, a ValueError or
TypeError naming the argument).

q and k may be strided views (Hugging Face passes ``[B, S, H, D]`` projections transposed to
``[B, H, S, D]``; ZAYA's come from a transposed convolution, their head dim strided). The outputs
take the inputs' layout (``empty_like``), as eager's elementwise results do, and the input
gradients are contiguous, as eager autograd's are: the layers before see the gradient eager would
give them, down to its strides (except where only a reshape and a matrix product read it:
``api.grad_layout_is_free``). cos and sin are constants: inputs where they require grad run
the reference.
"""
from __future__ import annotations

import dataclasses

import torch

from .._common import kernel_device_ok
from .spec import RopeSpec, output_dtype

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_GRAD_REASON = "cos/sin require grad (the fused op treats them as constants)"



@dataclasses.dataclass
class _Geometry:
    """One tensor's rows: its leading shape (padded to three dims), the strides the kernel reads
    the angles with (cos/sin expanded over the leading shape), and its output's layout."""

    out_dtype: torch.dtype
    y_strides: tuple  # the forward output's strides (as empty_like lays it out), all dims
    dx_strides: tuple  # the input gradient's (contiguous, as eager autograd's), all dims
    sizes: tuple  # leading sizes, padded to 3
    pad: int
    angle_strides: tuple  # cos, padded to 3
    sin_strides: tuple
    n_rows: int

    def ints(self, x_strides: tuple, y_strides: tuple) -> tuple:
        """The kernel's 17 ints of this tensor read with ``x_strides`` and written with
        ``y_strides``: rows in the written tensor's memory order (sizes of the two inner leading
        dims), then the x and y strides of those dims and of the head dim, cos / sin strides."""
        pad = (0,) * self.pad
        xs, ys = pad + tuple(x_strides[:-1]), pad + tuple(y_strides[:-1])
        order = tuple(sorted(range(3), key=lambda i: (-ys[i], i)))
        pick = lambda t: tuple(t[o] for o in order)  # noqa: E731
        sizes = pick(self.sizes)
        return ((self.n_rows, sizes[1], sizes[2]) + pick(xs) + (x_strides[-1],) + pick(ys) + (y_strides[-1],)
                + pick(self.angle_strides) + pick(self.sin_strides))


class RopeInputError(Exception):
    """An input eager would reject too (wrong type, shapes that do not broadcast, ...)."""


class _Invalid(RopeInputError, ValueError):
    pass


class _InvalidType(RopeInputError, TypeError):
    pass


def _expanded_lead_strides(t: torch.Tensor, lead: tuple) -> tuple:
    return t.expand(*lead, t.shape[-1]).stride()[:-1]


def _cpu_complex_reason(pairs: int, cos: torch.Tensor, sin: torch.Tensor) -> str:
    """Why a complex multiply on the CPU is left to eager, or "". ATen's CPU loop rounds its
    vectorized body as the interpreter's unfused ``tl.fma`` does, but its scalar loop (a pair count's
    remainder past the vector width, or every element where ``freqs_cis``'s pairs are not adjacent)
    with FMA. (On CUDA, every element rounds with FMA, as the kernels there; a probe checks it.)"""
    if pairs % 16:
        return ("complex multiply on the CPU with a pair count that is not a multiple of 16 (ATen's CPU loop "
                "rounds its remainder with FMA, the kernels as its vectorized body)")
    if cos.shape[-1] > 1 and (cos.stride(-1) not in (1, 2) or sin.stride(-1) not in (1, 2)):
        return ("complex multiply on the CPU with freqs_cis whose pairs are not adjacent (ATen's CPU loop is then "
                "its scalar one, which rounds with FMA, the kernels as its vectorized body)")
    return ""


def _check(q, k, cos, sin, ud, spec: RopeSpec, geometry: bool = True, cpu_rule: bool = True):
    """(rdim, pairs, geometries) for inputs the kernels take; a str (why not) for valid inputs they
    do not; raises _Invalid for inputs eager rejects. ``geometry=False`` (under torch.compile, on
    fake tensors): the checks only, no tensor made (geometries None). ``cpu_rule=False`` (the
    rounding probe): leave out :func:`_cpu_complex_reason`."""
    _check_types(q, k, cos, sin, ud)
    for name, t in (("q", q), ("cos", cos), ("sin", sin)) + ((("k", k),) if k is not None else ()):
        if not t.is_floating_point():
            raise _InvalidType(f"rope: {name} must be a floating-point tensor, got {t.dtype}")
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        if t is not None and t.device != q.device:
            raise _Invalid(f"rope: {name} must be on q's device {q.device}, got {t.device}")
    if not -cos.dim() - 1 <= ud <= cos.dim():
        raise _Invalid(f"rope: unsqueeze_dim {ud} is out of range for cos of {cos.dim()} dims")
    if q.dim() == 0 or (k is not None and k.dim() == 0):
        raise _Invalid("rope: q and k must have at least one dimension [..., head_dim]")
    ok, why = kernel_device_ok(q)
    if not ok:
        return why
    for name, t in (("q", q), ("cos", cos)) + ((("k", k),) if k is not None else ()):
        if t.dtype not in _KERNEL_DTYPES:
            return f"{name} dtype {t.dtype} (kernels take float16, bfloat16, float32)"
    if sin.dtype != cos.dtype:
        return f"sin ({sin.dtype}) and cos ({cos.dtype}) of different dtypes"
    if k is not None and k.dtype != q.dtype:
        return f"q ({q.dtype}) and k ({k.dtype}) of different dtypes"
    if sin.shape != cos.shape:
        return f"sin {tuple(sin.shape)} and cos {tuple(cos.shape)} of different shapes"
    if ud in (-1, cos.dim()):
        return "unsqueeze_dim puts the new dim last (the angles would broadcast over the head dim)"
    width = cos.shape[-1]
    d = q.shape[-1]
    if k is not None and k.shape[-1] != d:
        return f"q and k of different head dims ({d}, {k.shape[-1]})"
    if spec.angles == "position":
        if width == 1 and d != 1:
            return "cos/sin of width 1 (broadcast over the head dim)"
        rdim = width if spec.partial else d
        if (width > d) if spec.partial else (width != d):
            raise _Invalid(f"rope: cos/sin width {width} does not match the head dim {d}"
                           + (" (partial rotary needs width <= head dim)" if spec.partial else ""))
    else:
        pairs = width // 2 if spec.angles == "pair_half" else width
        rdim = 2 * pairs
        if spec.partial:
            if rdim > d:
                raise _Invalid(f"rope: cos/sin give {pairs} pairs, more than the head dim {d} holds")
        elif rdim != d:
            if pairs == 1 or 2 * pairs == d + 1:
                return f"cos/sin giving {pairs} pair angles for head dim {d} (broadcast)"
            raise _Invalid(f"rope: cos/sin give {pairs} pair angles, the head dim {d} needs {d // 2}")
    if rdim % 2 or rdim == 0:  # the spec's pairs do not exist
        raise _Invalid(f"rope: the rotary dim must be even and nonzero, got {rdim}")
    if spec.contract == "complex" and not q.is_cuda and cpu_rule:
        why = _cpu_complex_reason(rdim // 2, cos, sin)
        if why:
            return why
    if cos.requires_grad or sin.requires_grad:
        return "cos/sin require grad (the fused op treats them as constants)"
    geos = []
    cos_shape = list(cos.shape)
    cos_shape.insert(ud if ud >= 0 else len(cos_shape) + 1 + ud, 1)  # cos.unsqueeze(ud).shape
    for name, x in (("q", q),) + ((("k", k),) if k is not None else ()):
        if x.dim() > 4:
            return f"{name} of {x.dim()} dims (the kernels take up to 4)"
        lead = tuple(x.shape[:-1])
        try:
            full = torch.broadcast_shapes(lead, tuple(cos_shape[:-1]))
        except RuntimeError as e:
            raise _Invalid(f"rope: cos/sin (unsqueezed at {ud}: {tuple(cos_shape)}) do not broadcast against "
                           f"{name} {tuple(x.shape)}") from e
        if tuple(full) != lead:
            return f"cos/sin broadcast {name} {tuple(x.shape)} to a larger shape"
        if not geometry:
            continue
        cos_b = cos.unsqueeze(ud)
        od = output_dtype(spec, x.dtype, cos.dtype)
        y_strides = tuple(torch.empty_like(x, dtype=od, device="meta").stride())
        dx_strides = tuple(torch.empty(x.shape, device="meta").stride())
        pad = 3 - len(lead)
        cst = (0,) * pad + tuple(_expanded_lead_strides(cos_b, lead))
        sst = (0,) * pad + tuple(_expanded_lead_strides(sin.unsqueeze(ud), lead))
        n_rows = 1
        for v in lead:
            n_rows *= v
        geos.append(_Geometry(od, y_strides, dx_strides, (1,) * pad + lead, pad, cst, sst, n_rows))
    return rdim, rdim // 2, (geos if geometry else None)



def _check_types(q, k, cos, sin, ud) -> None:
    for name, t in (("q", q), ("cos", cos), ("sin", sin)) + ((("k", k),) if k is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise _InvalidType(f"rope: {name} must be a tensor, got {type(t).__name__}")
    if isinstance(ud, bool) or not isinstance(ud, int):
        raise _InvalidType(f"rope: unsqueeze_dim must be an int, got {type(ud).__name__}")
