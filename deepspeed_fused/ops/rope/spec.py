"""What the rotary embedding computes: :class:`RopeSpec` and the dtypes it rounds in.

For each pair of elements ``(f, s)`` of a head (``(j, j + R/2)`` in the split-half form,
``(2j, 2j + 1)`` in the interleaved one), with angles ``(cf, sf)`` and ``(cs, ss)``::

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
"""
from __future__ import annotations

import dataclasses

import torch

_CHOICES = dict(pairing=("half", "adjacent"), angles=("position", "pair_half", "pair"), output=("same", "halves"),
                compute=("promote", "float32"), out_dtype=("compute", "input"), grad_accum=("input", "compute"),
                contract=("none", "complex"))
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
    * ``tail``: with ``partial``, rotate the last R columns instead (DeepSeek-V4's ``x[..., -rd:]``).
    * ``negate``: the rotation by minus the angle (``rotate_half`` as ``cat((x2, -x1))``).
    * ``compute``: the dtype products and sums are rounded to: ``"promote"`` (``promote_types``
      of x and cos, as ``q * cos`` does) or ``"float32"`` (the families that call ``.float()``).
    * ``out_dtype``: ``"compute"`` or ``"input"`` (a final ``.to(q.dtype)``).
    * ``grad_accum``: where autograd sums an element's two gradient contributions: ``"input"``
      (each use casts x on its own, or none does) or ``"compute"`` (x upcast once).
    * ``contract``: ``"none"`` (each product rounded, then the sum) or ``"complex"``: the pair is a
      complex number multiplied by ``cos + i sin`` in complex64 (Llama 4's and DeepSeek-V2's
      ``view_as_complex``), rounded as CUDA's complex multiply rounds it: ``fma(a, c, -(b * d))``
      and ``fma(a, d, b * c)`` (nvcc contracts c10::complex's ``a * c - b * d``; interleaved
      pairs, pair angles and float32 only; probed once per CUDA device, which runs these forms
      eager if its complex multiply rounds otherwise). Triton's interpreter computes ``tl.fma`` unfused,
      which is how ATen's CPU complex multiply rounds in its vectorized body (its scalar remainder
      is contracted, and so is its strided loop, which a ``freqs_cis`` whose pairs are not adjacent
      takes: the checks leave such CPU calls, and those whose pairs are not a multiple of 16, to eager).
    """

    pairing: str = "half"
    angles: str = "position"
    output: str = "same"
    partial: bool = False
    negate: bool = False
    compute: str = "promote"
    out_dtype: str = "compute"
    grad_accum: str = "input"
    contract: str = "none"
    tail: bool = False

    def __post_init__(self):
        for name, allowed in _CHOICES.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"RopeSpec.{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("partial", "negate", "tail"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"RopeSpec.{name} must be a bool")
        if self.output == "halves" and self.pairing != "adjacent":
            raise ValueError("RopeSpec.output='halves' needs pairing='adjacent'")
        if self.tail and not self.partial:
            raise ValueError("RopeSpec.tail needs partial=True")
        if self.contract == "complex" and (self.pairing, self.angles, self.output, self.compute, self.negate) != \
                ("adjacent", "pair", "same", "float32", False):
            raise ValueError("RopeSpec.contract='complex' needs interleaved pairs, pair angles, output 'same', "
                             "compute float32 and no negate")
        _BY_CODE.setdefault(self.code, self)

    @property
    def code(self) -> int:
        """The spec as one int (the custom ops take it so)."""
        c = 0
        for name, allowed in _CHOICES.items():
            c = c * 4 + allowed.index(getattr(self, name))
        return ((c * 2 + self.tail) * 2 + self.partial) * 2 + self.negate

    @staticmethod
    def from_code(code: int) -> "RopeSpec":
        spec = _BY_CODE.get(code)
        if spec is None:
            negate, code = bool(code & 1), code >> 1
            partial, code = bool(code & 1), code >> 1
            tail, code = bool(code & 1), code >> 1
            vals = {}
            for name, allowed in reversed(list(_CHOICES.items())):
                vals[name] = allowed[code % 4]
                code //= 4
            spec = RopeSpec(partial=partial, negate=negate, tail=tail, **vals)
        return spec


LLAMA = RopeSpec()  # q * cos + rotate_half(q) * sin, split-half


def compute_dtype(spec: RopeSpec, x_dtype: torch.dtype, angle_dtype: torch.dtype) -> torch.dtype:
    base = torch.float32 if spec.compute == "float32" else x_dtype
    return torch.promote_types(base, angle_dtype)


def output_dtype(spec: RopeSpec, x_dtype: torch.dtype, angle_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the rotated tensor."""
    return x_dtype if spec.out_dtype == "input" else compute_dtype(spec, x_dtype, angle_dtype)
