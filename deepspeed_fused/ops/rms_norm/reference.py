"""The RMSNorm's forms and their plain PyTorch references: :class:`RMSForm` (the math of one
spelling, with its eager rounding points), :data:`FORMS`, the output dtypes, and the forward as the
eager modules write it (what the kernels are tested against and what unsupported inputs run)."""
from __future__ import annotations

import functools
import operator
from typing import NamedTuple, Optional

import torch


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
# The other forms: RMSNorm spellings whose rounding points differ from the Llama form's
# ----------------------------------------------------------------------------------------------
_HALF = (torch.float16, torch.bfloat16)
_NORM_CASTS = ("input", "weight_half", "none")
_WEIGHTS = ("plain", "fp32", "offset", "offset_w", "none", "input_scaled")
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
      sum rounded to the weight's dtype), ``"none"`` (no weight), ``"input_scaled"`` (the weight
      scales the input before the statistics: ``h = (x.float() * (1 + w).float()).type_as(x).float()``,
      then the unweighted norm: MuseSpark's input-scaled norm);
    * ``gate``: ``"after"`` (the weighted value times ``act(gate.float())``: Qwen3-Next's gated
      norm), ``"before"`` (``h = x.float() * act(gate.float())`` before the statistics: Mamba2's,
      its groups given by ``group_size``; a missing gate means no gating), ``"none"``; ``act``:
      ``"silu"`` or ``"sigmoid"``;
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
    "input_scaled": RMSForm(norm_cast="none", weight="input_scaled", out_cast=True),  # MuseSpark's post-norms
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
    if form.weight == "input_scaled" and (form.gate != "none" or form.norm_cast != "none" or not form.out_cast):
        raise ValueError("fused_rms_norm: form.weight 'input_scaled' takes no gate, norm_cast 'none' and out_cast")
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
    if form.weight in ("none", "input_scaled") or form.rstd_cast:
        dp = xd if form.rstd_cast else nd
    else:
        dp = torch.promote_types(nd, wd if form.weight == "plain" else f32)
    dq = f32 if form.gate == "after" else dp
    return nd, dp, dq, (xd if form.out_cast else dq)


def _gate_act(g: torch.Tensor, act: str) -> torch.Tensor:
    return torch.nn.functional.silu(g) if act == "silu" else torch.sigmoid(g)


def rms_norm_form_reference(hidden: torch.Tensor, weight: Optional[torch.Tensor], eps: float, form,
                            gate: Optional[torch.Tensor] = None, group_size: Optional[int] = None) -> torch.Tensor:
    """``form`` written as the eager modules write it (same rounding points). ``group_size``:
    statistics per group of that many columns (a divisor of the width), as the grouped modules take
    them: the norm of ``hidden`` (and the gate) viewed ``[..., N // group_size, group_size]`` with
    the weight viewed ``[N // group_size, group_size]`` (every other step is elementwise, so its
    rounding is the modules')."""
    form = _check_form(form)
    gs = _check_group_size(group_size, hidden) if hidden.dim() else None
    if gs is None:
        return _form_eager(hidden, weight, eps, form, gate)
    groups = (hidden.shape[-1] // gs, gs)
    y = _form_eager(hidden.unflatten(-1, groups), None if weight is None else weight.view(groups), eps, form,
                    None if gate is None else gate.unflatten(-1, groups))
    return y.flatten(-2)


def _form_eager(hidden, weight, eps, form: RMSForm, gate=None, rstd=None):
    """The reference; ``rstd`` (tests): this FP32 rstd ([..., 1]) instead of the input's own."""
    input_dtype = hidden.dtype
    h = hidden.to(torch.float32)
    if form.weight == "input_scaled":  # x.float() * (1 + w).float(), rounded to x's dtype, then the statistics
        h = (h * (1.0 + weight).float()).to(input_dtype).to(torch.float32)
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


def _check_group_size(group_size, hidden: torch.Tensor) -> Optional[int]:
    """The group size of a call with grouped statistics, or None where the statistics span the
    whole row (``group_size`` None or the row's width); a wrong one raises."""
    if group_size is None:
        return None
    if isinstance(group_size, bool):
        raise TypeError("fused_rms_norm: group_size must be an int or None, got bool")
    try:
        gs = operator.index(group_size)
    except TypeError:
        raise TypeError(f"fused_rms_norm: group_size must be an int or None, got {type(group_size).__name__}") \
            from None
    n = hidden.shape[-1]
    if gs <= 0 or n % gs:
        raise ValueError(f"fused_rms_norm: group_size must be a positive divisor of the last dimension {n} of "
                         f"hidden {tuple(hidden.shape)}, got {gs}")
    return None if gs == n else gs


# ---- autograd and custom ops ----------------------------------------------------------------------
def _form_code(form: RMSForm) -> list:
    if form.weight == "input_scaled":  # its scale runs before the kernels, which see the unweighted form
        raise ValueError("fused_rms_norm: the input-scaled form has no kernel code of its own (run its scale, "
                         "then the unweighted form)")
    return [_NORM_CASTS.index(form.norm_cast), _WEIGHTS.index(form.weight), _GATES.index(form.gate),
            _ACTS.index(form.act), int(form.out_cast), int(form.rstd_cast)]


def _form_of(code) -> RMSForm:
    return RMSForm(_NORM_CASTS[code[0]], _WEIGHTS[code[1]], _GATES[code[2]], _ACTS[code[3]], bool(code[4]),
                   bool(code[5]))
