"""The RMSNorm's input checks: wrong inputs (types, shapes, devices, a form's weight or gate) raise a
TypeError or ValueError naming the argument; :func:`rms_norm_kernel_ok` and
:func:`rms_norm_form_kernel_ok` say whether the kernels take valid inputs, and why not."""
from __future__ import annotations

import torch

from .._common import kernel_device_ok
from .reference import RMSForm

_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _validate(hidden, weight, eps) -> None:
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"fused_rms_norm: hidden must be a tensor, got {type(hidden).__name__}")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"fused_rms_norm: weight must be a tensor, got {type(weight).__name__}")
    if not hidden.is_floating_point():
        raise TypeError(f"fused_rms_norm: hidden must be a floating-point tensor, got {hidden.dtype}")
    if not weight.is_floating_point():
        raise TypeError(f"fused_rms_norm: weight must be a floating-point tensor, got {weight.dtype}")
    if isinstance(eps, bool) or not isinstance(eps, (float, int)):
        raise TypeError(f"fused_rms_norm: eps must be a float, got {type(eps).__name__}")
    if hidden.dim() == 0:
        raise ValueError("fused_rms_norm: hidden must have at least one dimension [..., N]")
    if weight.dim() != 1 or weight.shape[0] != hidden.shape[-1]:
        raise ValueError(f"fused_rms_norm: weight must have shape ({hidden.shape[-1]},) to match the last "
                         f"dimension of hidden {tuple(hidden.shape)}, got {tuple(weight.shape)}")
    if weight.device != hidden.device:
        raise ValueError(f"fused_rms_norm: weight must be on hidden's device {hidden.device}, got {weight.device}")


def rms_norm_kernel_ok(hidden: torch.Tensor, weight: torch.Tensor) -> tuple[bool, str]:
    """Whether the kernels take these (valid) inputs; otherwise the reason."""
    ok, reason = kernel_device_ok(hidden)
    if not ok:
        return False, reason
    if hidden.dtype not in _KERNEL_DTYPES:
        return False, f"input dtype {hidden.dtype} (kernels take float16, bfloat16, float32)"
    if weight.dtype not in _KERNEL_DTYPES:
        return False, f"weight dtype {weight.dtype} (kernels take float16, bfloat16, float32)"
    if hidden.shape[-1] == 0:
        return False, "zero-width rows"
    return True, ""


def _validate_form(hidden, weight, eps, form: RMSForm, gate) -> None:
    if not isinstance(hidden, torch.Tensor):
        raise TypeError(f"fused_rms_norm: hidden must be a tensor, got {type(hidden).__name__}")
    if form.weight == "none":
        if weight is not None:
            raise ValueError("fused_rms_norm: this form takes no weight (weight must be None)")
        _validate(hidden, hidden.new_empty(hidden.shape[-1:]) if hidden.dim() else hidden, eps)
    else:
        if weight is None:
            raise ValueError("fused_rms_norm: this form needs a weight")
        _validate(hidden, weight, eps)
    if form.gate == "after" and gate is None:
        raise ValueError("fused_rms_norm: this gated form needs a gate tensor")
    if gate is not None:
        if form.gate == "none":
            raise ValueError("fused_rms_norm: this form takes no gate (gate must be None)")
        if not isinstance(gate, torch.Tensor) or not gate.is_floating_point():
            raise TypeError("fused_rms_norm: gate must be a floating-point tensor")
        if gate.shape != hidden.shape:
            raise ValueError(f"fused_rms_norm: gate must have hidden's shape {tuple(hidden.shape)}, "
                             f"got {tuple(gate.shape)}")
        if gate.device != hidden.device:
            raise ValueError(f"fused_rms_norm: gate must be on hidden's device {hidden.device}, got {gate.device}")


def rms_norm_form_kernel_ok(hidden, weight, gate=None) -> tuple[bool, str]:
    """Whether the kernels take these (valid) inputs of a form; otherwise the reason."""
    ok, reason = rms_norm_kernel_ok(hidden, hidden if weight is None else weight)
    if ok and gate is not None and gate.dtype not in _KERNEL_DTYPES:
        return False, f"gate dtype {gate.dtype} (kernels take float16, bfloat16, float32)"
    return ok, reason
