"""Argument checks of the per-tensor norms, and which tensors the kernels take.

A wrong argument raises (``TypeError`` / ``ValueError`` naming it) before any launch; a tensor the
kernels cannot take has its norm computed by the torch reference, with one warning per reason.
"""
from __future__ import annotations

import torch

from .._common import FLOAT_KERNEL_DTYPES, float_kernel_ok, kernel_device_ok, warn_fallback

OP = "grad_norm"


def check_tensors(tensors) -> list:
    """``tensors`` as a list, after checking it is a non-empty list or tuple of floating-point
    tensors on one device."""
    if isinstance(tensors, torch.Tensor) or not isinstance(tensors, (list, tuple)):
        raise TypeError(f"tensors: expected a list or tuple of torch.Tensor, got {type(tensors).__name__}")
    if not tensors:
        raise ValueError("tensors: expected at least one tensor, got an empty sequence")
    device = None
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{i}]: expected a torch.Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"tensors[{i}]: expected a floating-point tensor, got {t.dtype}")
        if device is None:
            device = t.device
        elif t.device != device:
            raise ValueError(f"tensors[{i}]: expected a tensor on {device} (where tensors[0] is), got {t.device}")
    return list(tensors)


def kernels_take(t: torch.Tensor) -> tuple[bool, str]:
    """Whether the kernels take tensor ``t`` (device, dtype, layout), and why not."""
    ok, reason = float_kernel_ok(t)
    if ok and not t.is_contiguous():
        ok, reason = False, "a non-contiguous tensor (kernels read each tensor as one run of memory)"
    return ok, reason


def split_by_kernel(tensors: list) -> tuple[dict, list]:
    """({dtype: [index, ...]} of the tensors the kernels take, [index, ...] of the others), warning
    once per reason for the others (the call then counts as one that ran the reference). The
    tensors share a device (:func:`check_tensors`): where it lies is decided once, then each
    tensor's dtype and layout (a few attribute reads per tensor: DeepSpeed hands hundreds)."""
    ok, reason = kernel_device_ok(tensors[0])
    if not ok:
        warn_fallback(OP, reason)
        return {}, list(range(len(tensors)))
    no_bf16 = tensors[0].device.type == "cpu"  # the interpreter's bfloat16 is not exact
    groups: dict = {}
    others: list = []
    for i, t in enumerate(tensors):
        dt = t.dtype
        if dt in FLOAT_KERNEL_DTYPES and not (no_bf16 and dt is torch.bfloat16) and t.is_contiguous():
            g = groups.get(dt)
            if g is None:
                groups[dt] = g = []
            g.append(i)
        else:
            others.append(i)
    reasons = dict.fromkeys(kernels_take(tensors[i])[1] for i in others)
    for reason in reasons:
        warn_fallback(OP, reason)
    return groups, others
