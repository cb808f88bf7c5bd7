"""Fused rotary position embedding (RoPE), forward and backward, with eager's rounding points.

One kernel family in one file (issue 28's size rule: its spec, the two kernels, their launches,
the autograd Function, the custom ops and the reference belong together).

One kernel applies the rotation to q and k in one launch (and a second one, with the transposed
rotation, gives both gradients). What it computes is described by a :class:`RopeSpec`, which
covers the Hugging Face ``apply_rotary_pos_emb`` spellings: for each pair of elements ``(f, s)``
of a head (``(j, j + R/2)`` in the split-half form, ``(2j, 2j + 1)`` in the interleaved one),
with angles ``(cf, sf)`` and ``(cs, ss)``::

    out_f = x_f * cf - x_s * sf
    out_s = x_s * cs + x_f * ss

where eager rounds each product to the compute dtype (``promote_types(x, cos)``, or float32 for
the families that upcast first), then the sum; the result is stored in the output dtype. The
angles of an element are its own column of cos/sin (``angles="position"``: ``cos`` is
``cat(freqs, freqs)`` or already interleaved) or the pair's (``"pair_half"``: the first half of
cos's columns, as GLM's ``repeat_interleave`` and DeepSeek's interleave form read them;
``"pair"``: all of them, as gpt-oss's half-width cos). Partial rotary (``partial``) rotates the
first ``R`` columns (R from cos's width) and passes the rest through. ``output="halves"`` writes
pair j's results at ``(j, j + R/2)`` (DeepSeek's ``cat([q1 * cos - q2 * sin, ...])`` of the
de-interleaved pairs).

The backward is eager autograd's: the incoming gradient's products with cos and sin are rounded
to the compute dtype, then to the dtype in which autograd sums the two contributions of each
element (``grad_accum``: the input's dtype where each use casts on its own, the compute dtype
where the input was upcast once), the sum rounded there and stored in the input's dtype.
Products are never contracted into FMAs (``enable_fp_fusion=False``), so float32 inputs round
as eager does too. Outputs equal eager's element for element (as ``torch.equal`` compares:
``-0.0`` and ``+0.0`` are not told apart).

q and k may be strided views (Hugging Face passes ``[B, S, H, D]`` projections transposed to
``[B, H, S, D]``; ZAYA's come from a transposed convolution, their head dim strided): rows are
addressed through up to three strided leading dims and a strided head dim with no copy, and
cos/sin are broadcast over the heads through zero strides. The outputs take the inputs' layout
(``empty_like``), as eager's elementwise results do, and the input gradients are contiguous, as
eager autograd's are (the slices' backward builds them so): the layers before see the gradient
eager would give them, down to its strides, so their own reductions round as in eager. cos and
sin are constants: inputs where they require grad, and inputs the kernels cannot take, run the
plain torch reference (:func:`rope_reference`) with one warning per reason. Under ``torch.compile`` the op is the custom
op ``deepspeed_fused::rope_fwd`` with ``rope_bwd`` as its backward; in eager mode the same kernels
run behind an ``autograd.Function``, launched through the compiled kernel's C launcher once a
shape has been seen.

One kernel family, kept in one file on purpose (past the package's ~800-line guide): the spec,
the reference, the kernel, its plans and launches, the autograd Function and the custom ops all
serve the one rotation kernel, and its tuning knobs are this module's attributes (the benchmark's
sweep sets them, and every launch reads them here).
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ._common import on_device as _on_device
from ._common import (HAS_TRITON, _current_device, _launch_hooks, _raw_stream, cdiv, direct_launcher, kernel_device_ok,
                      next_power_of_2, tl, triton, warn_fallback)

__all__ = ["RopeSpec", "LLAMA", "fused_rope", "try_fused_rope", "rope_reference", "rope_kernel_ok", "output_dtype"]

_OP = "rope"
_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_CODE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}

# Tuning knobs (module attributes: the benchmark's sweep sets them).
_TILE_PAIRS = 2048  # rows x pairs per program
_MAX_BLOCK_R = 64
_NUM_WARPS = 4


# ----------------------------------------------------------------------------------------------
# What is computed
# ----------------------------------------------------------------------------------------------
_CHOICES = dict(pairing=("half", "adjacent"), angles=("position", "pair_half", "pair"), output=("same", "halves"),
                compute=("promote", "float32"), out_dtype=("compute", "input"), grad_accum=("input", "compute"))
_BY_CODE: dict = {}


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """Which rotary embedding: pairing of a head's elements, where their angles are read, where
    results go, and the dtypes eager rounds in.

    * ``pairing``: ``"half"`` pairs ``(j, j + R/2)`` (``rotate_half`` as ``cat((-x2, x1))``),
      ``"adjacent"`` pairs ``(2j, 2j + 1)`` (``stack((-x2, x1), -1).flatten(-2)``).
    * ``angles``: ``"position"``: an element's cos/sin are its own column of ``cos``/``sin``;
      ``"pair_half"``: pair j reads column j of the first half of their columns (GLM's
      ``cos[..., :d // 2].repeat_interleave(2)``, DeepSeek's ``cos[..., :d // 2]``); ``"pair"``:
      pair j reads column j (a cos as wide as the number of pairs, gpt-oss).
    * ``output``: ``"same"``: results at the input positions; ``"halves"``: pair j's at
      ``(j, j + R/2)`` (DeepSeek's interleave form).
    * ``partial``: rotate only the first R columns, R given by cos's width; the rest pass through.
    * ``negate``: the rotation by minus the angle (``rotate_half`` as ``cat((x2, -x1))``).
    * ``compute``: the dtype products and sums are rounded to: ``"promote"`` (``promote_types``
      of x and cos, as ``q * cos`` does) or ``"float32"`` (the families that call ``.float()``).
    * ``out_dtype``: ``"compute"`` or ``"input"`` (a final ``.to(q.dtype)``).
    * ``grad_accum``: where autograd sums an element's two gradient contributions: ``"input"``
      (each use casts x on its own, or none does) or ``"compute"`` (x upcast once).
    """

    pairing: str = "half"
    angles: str = "position"
    output: str = "same"
    partial: bool = False
    negate: bool = False
    compute: str = "promote"
    out_dtype: str = "compute"
    grad_accum: str = "input"

    def __post_init__(self):
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"RopeSpec.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("partial", "negate"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"RopeSpec.{name} must be a bool")
        if self.output == "halves" and self.pairing != "adjacent":
            raise ValueError("RopeSpec.output='halves' needs pairing='adjacent'")
        _BY_CODE.setdefault(self.code, self)

    @property
    def code(self) -> int:
        """The spec as one int (the custom ops take it so)."""
        c = 0
        for name, allowed in _CHOICES.items():
            c = c * 4 + allowed.index(getattr(self, name))
        return (c * 2 + self.partial) * 2 + self.negate

    @staticmethod
    def from_code(code: int) -> "RopeSpec":
        spec = _BY_CODE.get(code)
        if spec is None:
            negate, code = bool(code & 1), code >> 1
            partial, code = bool(code & 1), code >> 1
            vals = {}
            for name, allowed in reversed(list(_CHOICES.items())):
                vals[name] = allowed[code % 4]
                code //= 4
            spec = RopeSpec(partial=partial, negate=negate, **vals)
        return spec


LLAMA = RopeSpec()  # q * cos + rotate_half(q) * sin, split-half


def compute_dtype(spec: RopeSpec, x_dtype: torch.dtype, angle_dtype: torch.dtype) -> torch.dtype:
    base = torch.float32 if spec.compute == "float32" else x_dtype
    return torch.promote_types(base, angle_dtype)


def output_dtype(spec: RopeSpec, x_dtype: torch.dtype, angle_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the rotated tensor."""
    return x_dtype if spec.out_dtype == "input" else compute_dtype(spec, x_dtype, angle_dtype)


# ----------------------------------------------------------------------------------------------
# Reference (plain torch, the rounding and autograd of the Hugging Face forms)
# ----------------------------------------------------------------------------------------------
def _angles(spec: RopeSpec, t: torch.Tensor, ud: int) -> torch.Tensor:
    t = t.unsqueeze(ud)
    return t[..., : t.shape[-1] // 2] if spec.angles == "pair_half" else t


def _reference_one(x, cos, sin, ud, spec: RopeSpec):
    c, s = _angles(spec, cos, ud), _angles(spec, sin, ud)
    ct = compute_dtype(spec, x.dtype, c.dtype)
    d = x.shape[-1]
    width = c.shape[-1]
    rdim = width if spec.angles == "position" else 2 * width
    if not spec.partial:
        rdim = d
    h = rdim // 2
    xr, xp = x[..., :rdim], x[..., rdim:]
    if spec.grad_accum == "compute":
        xc = xr.to(ct)

        def src():
            return xc
    else:
        def src():  # a cast of its own per use: autograd sums the contributions in x's dtype
            return xr.to(ct)

    if spec.pairing == "half":
        def first():
            return src()[..., :h]

        def second():
            return src()[..., h:]
    else:
        def first():
            return src()[..., 0::2]

        def second():
            return src()[..., 1::2]

    if spec.angles == "position":
        if width == 1:  # broadcast over the head dim, as eager's multiply broadcasts it
            c, s = c.expand(*c.shape[:-1], rdim), s.expand(*s.shape[:-1], rdim)
        if spec.pairing == "half":
            cf, cs, sf, ss = c[..., :h], c[..., h:rdim], s[..., :h], s[..., h:rdim]
        else:
            cf, cs, sf, ss = c[..., 0:rdim:2], c[..., 1:rdim:2], s[..., 0:rdim:2], s[..., 1:rdim:2]
    else:
        cf = cs = c[..., :h]
        sf = ss = s[..., :h]
    if spec.negate:
        sf, ss = -sf, -ss
    out_f = first() * cf - second() * sf
    out_s = second() * cs + first() * ss
    if spec.pairing == "half" or spec.output == "halves":
        rot = torch.cat([out_f, out_s], dim=-1)
    else:
        rot = torch.stack([out_f, out_s], dim=-1).flatten(-2)
    od = x.dtype if spec.out_dtype == "input" else ct
    if rdim < d:
        return torch.cat([rot.to(od), xp.to(od)], dim=-1)
    return rot.to(od)


def rope_reference(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                   unsqueeze_dim: int = 1, spec: RopeSpec = LLAMA):
    """The rotation as plain torch ops, rounded as the Hugging Face forms round (and, through
    autograd, their gradients). Returns ``(q_out, k_out)``, or ``q_out`` when ``k`` is None."""
    yq = _reference_one(q, cos, sin, unsqueeze_dim, spec)
    if k is None:
        return yq
    return yq, _reference_one(k, cos, sin, unsqueeze_dim, spec)


# ----------------------------------------------------------------------------------------------
# Kernel
# ----------------------------------------------------------------------------------------------
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
    def _rope_rows(X, Y, C, S, tile, n_rows, N1, N2, xs0, xs1, xs2, xsd, ys0, ys1, ys2, ysd, cs0, cs1, cs2,
                   ss0, ss1, ss2,
                   H, D, R, BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
                   PAIRS: tl.constexpr, ANGLE_PAIR: tl.constexpr, HALVES: tl.constexpr, NEG: tl.constexpr,
                   BACKWARD: tl.constexpr, PROD: tl.constexpr, ACC: tl.constexpr, PASS: tl.constexpr):
        # rows of the leading shape [N0, N1, N2] (N0 = n_rows / (N1 * N2)), each a head of D elements
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
        a = tl.load(X + xrow + (src_f * xsd)[None, :], mask=m, other=0.0).to(tl.float32)
        b = tl.load(X + xrow + (src_s * xsd)[None, :], mask=m, other=0.0).to(tl.float32)
        cf = tl.load(C + crow + af[None, :], mask=m, other=0.0).to(tl.float32)
        sf = tl.load(S + srow + af[None, :], mask=m, other=0.0).to(tl.float32)
        if ANGLE_PAIR:
            cs = cf
            ss = sf
        else:
            cs = tl.load(C + crow + as_[None, :], mask=m, other=0.0).to(tl.float32)
            ss = tl.load(S + srow + as_[None, :], mask=m, other=0.0).to(tl.float32)
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
        t1 = _round(_round(a * cf, PROD), ACC)
        t2 = _round(_round(b * sf, PROD), ACC)
        t3 = _round(_round(b * cs, PROD), ACC)
        t4 = _round(_round(a * ss, PROD), ACC)
        out_ty = Y.dtype.element_ty
        tl.store(Y + yrow + (dst_f * ysd)[None, :], _round(t1 - t2, ACC).to(out_ty), mask=m)
        tl.store(Y + yrow + (dst_s * ysd)[None, :], _round(t3 + t4, ACC).to(out_ty), mask=m)
        if PASS:  # columns [R, D) pass through, converted to the output's dtype
            for c0 in range(R, D, BLOCK_P):
                c = c0 + tl.arange(0, BLOCK_P)
                mm = rmask[:, None] & (c < D)[None, :]
                v = tl.load(X + xrow + (c * xsd)[None, :], mask=mm, other=0.0)
                tl.store(Y + yrow + (c * ysd)[None, :], v.to(out_ty), mask=mm)

    @triton.jit
    def _rope_kernel(X0, Y0, X1, Y1, C, S, NP0,
                     n0, a1, a2, xa0, xa1, xa2, xad, ya0, ya1, ya2, yad, ca0, ca1, ca2, sa0, sa1, sa2,
                     n1, b1, b2, xb0, xb1, xb2, xbd, yb0, yb1, yb2, ybd, cb0, cb1, cb2, sb0, sb1, sb2,
                     H, D, R,
                     BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, PAIRS: tl.constexpr,
                     ANGLE_PAIR: tl.constexpr, HALVES: tl.constexpr, NEG: tl.constexpr, BACKWARD: tl.constexpr,
                     PROD: tl.constexpr, ACC: tl.constexpr, PASS: tl.constexpr, TWO: tl.constexpr):
        # programs [0, NP0) take tensor 0 (q), the rest tensor 1 (k): one launch for both
        pid = tl.program_id(0)
        if TWO:
            if pid >= NP0:
                _rope_rows(X1, Y1, C, S, pid - NP0, n1, b1, b2, xb0, xb1, xb2, xbd, yb0, yb1, yb2, ybd, cb0, cb1, cb2,
                           sb0, sb1, sb2, H, D, R, BLOCK_R, BLOCK_H, BLOCK_P, PAIRS, ANGLE_PAIR, HALVES, NEG,
                           BACKWARD, PROD, ACC, PASS)
            else:
                _rope_rows(X0, Y0, C, S, pid, n0, a1, a2, xa0, xa1, xa2, xad, ya0, ya1, ya2, yad, ca0, ca1, ca2,
                           sa0, sa1, sa2, H, D, R, BLOCK_R, BLOCK_H, BLOCK_P, PAIRS, ANGLE_PAIR, HALVES, NEG,
                           BACKWARD, PROD, ACC, PASS)
        else:
            _rope_rows(X0, Y0, C, S, pid, n0, a1, a2, xa0, xa1, xa2, xad, ya0, ya1, ya2, yad, ca0, ca1, ca2,
                       sa0, sa1, sa2, H, D, R, BLOCK_R, BLOCK_H, BLOCK_P, PAIRS, ANGLE_PAIR, HALVES, NEG, BACKWARD,
                       PROD, ACC, PASS)


# ----------------------------------------------------------------------------------------------
# Checks and launch plans
# ----------------------------------------------------------------------------------------------
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


def _check(q, k, cos, sin, ud, spec: RopeSpec, geometry: bool = True):
    """(rdim, pairs, geometries) for inputs the kernels take; a str (why not) for valid inputs they
    do not; raises _Invalid for inputs eager rejects. ``geometry=False`` (under torch.compile, on
    fake tensors): the checks only, no tensor made (geometries None)."""
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
    if cos.stride(-1) != 1 and width > 1 or sin.stride(-1) != 1 and width > 1:
        return "cos/sin with a strided last dim"
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


class _Plan:
    """Everything a call derives from its inputs' metadata (one per key): the geometry of q and k,
    block sizes, program counts, the forward's kernel arguments; the backward's per gradient
    layout (``bwd``)."""

    __slots__ = ("key", "spec", "rdim", "head_dim", "geos", "x_dtype", "prod", "acc_bwd", "common", "tail", "progs",
                 "dev", "fwd_args", "fwd_const", "bwd")

    def __init__(self, key, spec: RopeSpec, x: torch.Tensor, x_dtype: torch.dtype, angle_dtype: torch.dtype,
                 checked: tuple):
        rdim, pairs, geos = checked
        self.key, self.spec, self.rdim, self.geos, self.x_dtype = key, spec, rdim, geos, x_dtype
        self.head_dim = d = x.shape[-1]
        ct = compute_dtype(spec, x_dtype, angle_dtype)
        self.prod = _CODE[ct]
        self.acc_bwd = _CODE[x_dtype if spec.grad_accum == "input" else ct]
        block_h = next_power_of_2(pairs)
        n_max = max(g.n_rows for g in geos)
        cap = _MAX_BLOCK_R if x.is_cuda else 4096  # the interpreter: few programs
        block_r = max(1, min(max(1, _TILE_PAIRS // block_h), cap, next_power_of_2(max(n_max, 1))))
        rest = d - rdim
        self.common = dict(BLOCK_R=block_r, BLOCK_H=block_h,
                           BLOCK_P=next_power_of_2(min(rest, 128)) if rest else 1,
                           PAIRS=spec.pairing == "adjacent", ANGLE_PAIR=spec.angles != "position",
                           HALVES=spec.output == "halves", NEG=spec.negate)
        self.tail = (pairs, d, rdim)
        self.progs = tuple(cdiv(g.n_rows, block_r) for g in geos)
        self.dev = x.device.index if x.is_cuda else None
        self.bwd = {}
        self.fwd_args = self.fwd_const = None

    def set_forward(self, q: torch.Tensor, k: Optional[torch.Tensor]) -> None:
        ints = tuple(g.ints(x.stride(), g.y_strides) for g, x in zip(self.geos, (q, k)))
        if len(ints) == 1:
            ints = ints * 2
        self.fwd_args = ints[0] + ints[1] + self.tail
        self.fwd_const = dict(self.common, BACKWARD=False, PROD=self.prod, ACC=self.prod,
                              PASS=self.rdim < self.head_dim, TWO=len(self.geos) == 2)

    def backward_entry(self, present: tuple, grads: tuple):
        """(args, programs of the first tensor, all programs, constexprs, launch key) of the backward
        launch for the gradients ``grads`` of the outputs ``present`` (indices into geos)."""
        bkey = tuple((i, g.stride(), g.dtype, g.data_ptr() & 15) for i, g in zip(present, grads))
        entry = self.bwd.get(bkey)
        if entry is None:
            ints = tuple(self.geos[i].ints(g.stride(), self.geos[i].dx_strides) for i, g in zip(present, grads))
            if len(ints) == 1:
                ints = ints * 2
            np0 = self.progs[present[0]]
            total = np0 + (self.progs[present[1]] if len(present) == 2 else 0)
            const = dict(self.common, BACKWARD=True, PROD=self.prod, ACC=self.acc_bwd, PASS=self.rdim < self.head_dim,
                         TWO=len(present) == 2)
            entry = self.bwd[bkey] = (ints[0] + ints[1] + self.tail, np0, total, const, (self.key, "bwd", bkey))
        return entry


_MAX_PLANS = 1024
_plans: dict = {}
_direct: dict = {}  # launch key -> the compiled kernel's direct launcher


def clear_plans() -> None:
    """Forget the launch plans and direct launchers (the benchmark's sweep changes the knobs)."""
    _plans.clear()
    _direct.clear()


def _key(q, k, cos, sin, ud, spec, tag=None):
    """Everything the checks and the plan read: shapes, strides, dtypes, devices, 16-byte alignment."""
    return (spec, ud, q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15,
            None if k is None else (k.shape, k.stride(), k.dtype, k.device, k.data_ptr() & 15),
            cos.shape, cos.stride(), cos.dtype, cos.device, cos.data_ptr() & 15,
            sin.shape, sin.stride(), sin.dtype, sin.device, sin.data_ptr() & 15, tag)


def _get_plan(q, k, cos, sin, ud, spec, key=None, x_dtype=None):
    """The plan of these inputs, or a str saying why the kernels do not take them; raises a
    :class:`RopeInputError` for inputs eager rejects too. ``x_dtype``: the backward-only plans of
    the custom op (q and k are then the gradients, x_dtype the inputs' dtype)."""
    if not isinstance(spec, RopeSpec):
        raise _InvalidType(f"rope: spec must be a RopeSpec, got {type(spec).__name__}")
    if key is None:
        _check_types(q, k, cos, sin, ud)
        key = _key(q, k, cos, sin, ud, spec, x_dtype)
    plan = _plans.get(key)
    if plan is not None:
        if cos.requires_grad or sin.requires_grad:
            return _GRAD_REASON
        return plan
    checked = _check(q, k, cos, sin, ud, spec)
    if isinstance(checked, str):
        return checked  # not cached: some reasons (grad) depend on more than the key
    if len(_plans) >= _MAX_PLANS:  # shapes that never repeat: start over rather than grow
        _plans.clear()
        _direct.clear()
    plan = _Plan(key, spec, q, x_dtype or q.dtype, cos.dtype, checked)
    if x_dtype is None:
        plan.set_forward(q, k)
    _plans[key] = plan
    return plan


_GRAD_REASON = "cos/sin require grad (the fused op treats them as constants)"


def _launch(plan: _Plan, lkey, x0, y0, x1, y1, cos, sin, np0: int, total: int, args: tuple, const: dict) -> None:
    """One launch: programs [0, np0) rotate x0 into y0, the rest x1 into y1. The first launch of a
    key goes through Triton's JIT (which compiles), later ones through the compiled kernel's C
    launcher (pointers as ints; the key fixes everything the JIT specializes on)."""
    if total == 0:
        return
    dev = plan.dev
    direct = dev is not None and not _launch_hooks() and _current_device() == dev
    if direct:
        fn = _direct.get(lkey)
        if fn is not None:
            fn(_raw_stream(dev), x0.data_ptr(), y0.data_ptr(), x1.data_ptr(), y1.data_ptr(), cos.data_ptr(),
               sin.data_ptr(), np0, *args)
            return
    grid = (total,)
    with _on_device(x0):
        compiled = _rope_kernel[grid](x0, y0, x1, y1, cos, sin, np0, *args, **const, num_warps=_NUM_WARPS,
                                      enable_fp_fusion=False)
    if direct:
        fn = direct_launcher(compiled, grid, tuple(const.values()))
        if fn is not None:
            _direct[lkey] = fn


def _forward(plan: _Plan, q, k, cos, sin, outs=None):
    """The outputs, fresh (or ``outs``, in the plan's layout: tests poison them)."""
    g0 = plan.geos[0]
    yq = torch.empty_strided(q.shape, g0.y_strides, dtype=g0.out_dtype, device=q.device) if outs is None else outs[0]
    if outs is not None and any(o.stride() != g.y_strides for o, g in zip(outs, plan.geos)):
        raise ValueError("rope: outs must have the plan's output strides")
    if k is None:
        _launch(plan, plan.key, q, yq, q, yq, cos, sin, plan.progs[0], plan.progs[0], plan.fwd_args, plan.fwd_const)
        return yq, None
    g1 = plan.geos[1]
    yk = torch.empty_strided(k.shape, g1.y_strides, dtype=g1.out_dtype, device=k.device) if outs is None else outs[1]
    _launch(plan, plan.key, q, yq, k, yk, cos, sin, plan.progs[0], plan.progs[0] + plan.progs[1], plan.fwd_args,
            plan.fwd_const)
    return yq, yk


def _backward(plan: _Plan, grads: tuple, cos, sin, outs=None) -> list:
    """Input gradients of the outputs whose gradients ``grads`` holds (None: no gradient), in the
    inputs' dtype, contiguous as eager autograd leaves them (or into ``outs``); one launch for both."""
    present = tuple(i for i, g in enumerate(grads) if g is not None)
    out = [None] * len(grads)
    if not present:
        return out
    gs = tuple(grads[i] for i in present)
    args, np0, total, const, lkey = plan.backward_entry(present, gs)
    dxs = [torch.empty_strided(g.shape, plan.geos[i].dx_strides, dtype=plan.x_dtype, device=g.device)
           if outs is None else outs[i] for i, g in zip(present, gs)]
    if outs is not None and any(dx.stride() != plan.geos[i].dx_strides for i, dx in zip(present, dxs)):
        raise ValueError("rope: outs must have the plan's gradient strides")
    x1, y1 = (gs[1], dxs[1]) if len(gs) == 2 else (gs[0], dxs[0])
    _launch(plan, lkey, gs[0], dxs[0], x1, y1, cos, sin, np0, total, args, const)
    for i, dx in zip(present, dxs):
        out[i] = dx
    return out


# ----------------------------------------------------------------------------------------------
# Autograd (eager) and custom ops (torch.compile)
# ----------------------------------------------------------------------------------------------
class _RopeFn(torch.autograd.Function):
    """The kernels for eager mode (an autograd.Function dispatches faster than a custom op);
    ``plan`` is the forward's launch plan, built by the caller."""

    @staticmethod
    def forward(ctx, q, k, cos, sin, plan):
        ctx.set_materialize_grads(False)  # an unused output gives its input no gradient, as in eager
        yq, yk = _forward(plan, q, k, cos, sin)
        ctx.save_for_backward(cos, sin)
        ctx.plan = plan
        if k is None:
            return yq
        return yq, yk

    @staticmethod
    def backward(ctx, *grads):
        # create_graph=True: the gradient is not differentiable again (once_differentiable makes a
        # second differentiation raise); otherwise skip that wrapper's cost
        if torch.is_grad_enabled():
            return _backward_once(ctx, *grads)
        return _backward_body(ctx, *grads)


def _backward_body(ctx, *grads):
    cos, sin = ctx.saved_tensors
    need = ctx.needs_input_grad
    grads = tuple(g if need[i] else None for i, g in enumerate(grads))
    dx = _backward(ctx.plan, grads, cos, sin)
    return dx[0], (dx[1] if len(dx) > 1 else None), None, None, None


_backward_once = once_differentiable(_backward_body)


@torch.library.custom_op("deepspeed_fused::rope_fwd", mutates_args=())
def _rope_fwd_op(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int, spec: int) -> list[torch.Tensor]:
    plan = _get_plan(q, k, cos, sin, unsqueeze_dim, RopeSpec.from_code(spec))
    if isinstance(plan, str):  # the caller checked; only a change between trace and run lands here
        with torch.no_grad():
            out = rope_reference(q, k, cos, sin, unsqueeze_dim, RopeSpec.from_code(spec))
        return [out] if k is None else list(out)
    yq, yk = _forward(plan, q, k, cos, sin)
    return [yq] if k is None else [yq, yk]


@_rope_fwd_op.register_fake
def _(q, k, cos, sin, unsqueeze_dim, spec):
    od = output_dtype(RopeSpec.from_code(spec), q.dtype, cos.dtype)
    out = [torch.empty_like(q, dtype=od)]
    if k is not None:
        out.append(torch.empty_like(k, dtype=od))
    return out


@torch.library.custom_op("deepspeed_fused::rope_bwd", mutates_args=())
def _rope_bwd_op(gq: Optional[torch.Tensor], gk: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                 unsqueeze_dim: int, spec: int, x_dtype: torch.dtype) -> list[torch.Tensor]:
    grads = (gq, gk)
    present = [g for g in grads if g is not None]
    plan = _get_plan(present[0], present[1] if len(present) == 2 else None, cos, sin, unsqueeze_dim,
                     RopeSpec.from_code(spec), x_dtype=x_dtype)
    if isinstance(plan, str):  # pragma: no cover - the forward's checks cover the gradients
        raise RuntimeError(f"deepspeed_fused::rope_bwd: {plan}")
    dx = _backward(plan, tuple(present), cos, sin)
    it = iter(dx)
    return [next(it) if g is not None else torch.empty(0, dtype=x_dtype, device=cos.device) for g in grads]


@_rope_bwd_op.register_fake
def _(gq, gk, cos, sin, unsqueeze_dim, spec, x_dtype):
    return [torch.empty(g.shape, dtype=x_dtype, device=g.device) if g is not None
            else torch.empty(0, dtype=x_dtype, device=cos.device)
            for g in (gq, gk)]


def _op_setup_context(ctx, inputs, output):
    q, k, cos, sin, unsqueeze_dim, spec = inputs
    ctx.save_for_backward(cos, sin)
    ctx.meta = (unsqueeze_dim, spec, q.dtype, k is not None)
    ctx.set_materialize_grads(False)


def _op_backward(ctx, grads):
    cos, sin = ctx.saved_tensors
    unsqueeze_dim, spec, x_dtype, has_k = ctx.meta
    gq = grads[0]
    gk = grads[1] if has_k else None
    if gq is None and gk is None:
        return None, None, None, None, None, None
    dq, dk = _rope_bwd_op(gq, gk, cos, sin, unsqueeze_dim, spec, x_dtype)
    return (dq if gq is not None else None), (dk if gk is not None else None), None, None, None, None


_rope_fwd_op.register_autograd(_op_backward, setup_context=_op_setup_context)


# ----------------------------------------------------------------------------------------------
# Public entry points
# ----------------------------------------------------------------------------------------------
def _check_types(q, k, cos, sin, ud) -> None:
    for name, t in (("q", q), ("cos", cos), ("sin", sin)) + ((("k", k),) if k is not None else ()):
        if not isinstance(t, torch.Tensor):
            raise _InvalidType(f"rope: {name} must be a tensor, got {type(t).__name__}")
    if isinstance(ud, bool) or not isinstance(ud, int):
        raise _InvalidType(f"rope: unsqueeze_dim must be an int, got {type(ud).__name__}")


def rope_kernel_ok(q, k, cos, sin, unsqueeze_dim: int = 1, spec: RopeSpec = LLAMA) -> tuple[bool, str]:
    """(True, "") when the kernels take these inputs, else (False, why); inputs eager rejects
    raise :class:`RopeInputError` (a ValueError or TypeError)."""
    plan = _get_plan(q, k, cos, sin, unsqueeze_dim, spec)
    return (False, plan) if isinstance(plan, str) else (True, "")


def try_fused_rope(q, k, cos, sin, unsqueeze_dim: int = 1, spec: RopeSpec = LLAMA):
    """:func:`fused_rope`, or None (no warning) when the kernels cannot take these inputs; inputs
    eager rejects raise :class:`RopeInputError`. The hot path: inputs whose plan exists (same
    metadata as an earlier call, hence checked) go straight to the launch."""
    if torch.compiler.is_compiling():
        if not isinstance(spec, RopeSpec):
            raise _InvalidType(f"rope: spec must be a RopeSpec, got {type(spec).__name__}")
        if isinstance(_check(q, k, cos, sin, unsqueeze_dim, spec, geometry=False), str):
            return None
        out = _rope_fwd_op(q, k, cos, sin, unsqueeze_dim, spec.code)
        return out[0] if k is None else (out[0], out[1])
    plan = None
    if isinstance(q, torch.Tensor) and isinstance(cos, torch.Tensor) and isinstance(sin, torch.Tensor) \
            and (k is None or isinstance(k, torch.Tensor)) and type(unsqueeze_dim) is int:
        plan = _plans.get(_key(q, k, cos, sin, unsqueeze_dim, spec))
        if plan is not None and (cos.requires_grad or sin.requires_grad):
            plan = None
    if plan is None:
        plan = _get_plan(q, k, cos, sin, unsqueeze_dim, spec)
        if isinstance(plan, str):
            return None
    if torch.is_grad_enabled() and (q.requires_grad or (k is not None and k.requires_grad)):
        return _RopeFn.apply(q, k, cos, sin, plan)
    yq, yk = _forward(plan, q, k, cos, sin)
    return yq if k is None else (yq, yk)


def fused_rope(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
               unsqueeze_dim: int = 1, spec: RopeSpec = LLAMA):
    """Rotary embedding of ``q`` and ``k`` (``[..., head_dim]``, up to 4 dims, any strides) by
    ``cos``/``sin`` unsqueezed at ``unsqueeze_dim`` and broadcast over their leading dims, as
    ``spec`` describes (default: the Llama form ``q * cos + rotate_half(q) * sin``). Returns
    ``(q_out, k_out)``, or ``q_out`` when ``k`` is None, in the inputs' layout and
    ``output_dtype(spec, ...)``, equal to the Hugging Face form's result element for element;
    differentiable in q and k (first order; cos and sin are constants). Inputs the kernels
    cannot take run :func:`rope_reference` with a one-time warning per reason; inputs eager
    rejects raise a ValueError or TypeError naming the argument."""
    out = try_fused_rope(q, k, cos, sin, unsqueeze_dim, spec)
    if out is None:
        warn_fallback(_OP, rope_kernel_ok(q, k, cos, sin, unsqueeze_dim, spec)[1])
        return rope_reference(q, k, cos, sin, unsqueeze_dim, spec)
    return out
