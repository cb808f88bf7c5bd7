"""The rotation as plain torch ops: the rounding and autograd of the Hugging Face forms.

Inputs the kernels cannot take run :func:`rope_reference` (with one warning per reason); the tests
compare the kernels against it in float64 and element for element in the inputs' dtypes.
"""
from __future__ import annotations

from typing import Optional

import torch

from .spec import LLAMA, RopeSpec, compute_dtype


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
    if spec.tail:
        xr, xp = x[..., d - rdim:], x[..., :d - rdim]
    else:
        xr, xp = x[..., :rdim], x[..., rdim:]
    if spec.contract == "complex":  # the complex multiply itself (its rounding is the device's)
        xc = xr.to(ct)
        z = torch.complex(xc[..., 0::2], xc[..., 1::2]) * torch.complex(c[..., :h].to(ct), s[..., :h].to(ct))
        rot = torch.view_as_real(z).flatten(-2)
        od = x.dtype if spec.out_dtype == "input" else ct
        return rot.to(od) if rdim == d else torch.cat([rot.to(od), xp.to(od)], dim=-1)
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
        return torch.cat([xp.to(od), rot.to(od)] if spec.tail else [rot.to(od), xp.to(od)], dim=-1)
    return rot.to(od)


def rope_reference(q: torch.Tensor, k: Optional[torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                   unsqueeze_dim: int = 1, spec: RopeSpec = LLAMA):
    """The rotation as plain torch ops, rounded as the Hugging Face forms round (and, through
    autograd, their gradients). Returns ``(q_out, k_out)``, or ``q_out`` when ``k`` is None."""
    yq = _reference_one(q, cos, sin, unsqueeze_dim, spec)
    if k is None:
        return yq
    return yq, _reference_one(k, cos, sin, unsqueeze_dim, spec)
