"""Helpers shared by the ops: where kernels may run, and warn-once fallbacks.

The ops never import DeepSpeed. A kernel runs on CUDA tensors when Triton imports, and on
CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1`` set before the kernels
are defined), which is how the CPU test-suite exercises the kernels themselves.
"""
from __future__ import annotations

import os
import warnings

import torch

try:  # Triton is optional: without it every op runs its torch reference.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False


def interpreter_active() -> bool:
    """True when Triton kernels are interpreted on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def kernel_device_ok(t: torch.Tensor) -> tuple[bool, str]:
    """Whether a Triton kernel can take tensor ``t`` because of where it lives."""
    if not HAS_TRITON:
        return False, "Triton is not installed"
    if t.is_cuda:
        if interpreter_active():
            return False, "TRITON_INTERPRET=1 with CUDA tensors"
        return True, ""
    if t.device.type == "cpu" and interpreter_active():
        return True, ""
    return False, f"tensors on {t.device.type} (kernels need CUDA)"


_warned: set[tuple[str, str]] = set()


def warn_fallback(op: str, reason: str) -> None:
    """Warn once per (op, reason) that the torch reference runs instead of the kernel."""
    key = (op, reason)
    if key in _warned:
        return
    _warned.add(key)
    warnings.warn(f"deepspeed_fused.{op}: running the torch reference: {reason}", RuntimeWarning, stacklevel=3)


def reset_fallback_warnings() -> None:
    """Forget which fallbacks have warned (tests use this)."""
    _warned.clear()
