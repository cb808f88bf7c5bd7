"""Argument checks of the gated activation, and where its kernels run.

A wrong argument raises (``TypeError`` / ``ValueError`` naming it) before any launch; an input
the kernels cannot take runs the torch reference with one warning per reason (:func:`kernel_ok`).
"""
from __future__ import annotations

import torch

from .._common import kernel_device_ok, warn_fallback
from .reference import ACTIVATIONS

OP = "mlp_act"
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def check_act(act) -> str:
    if not isinstance(act, str):
        raise TypeError(f"act: expected one of {', '.join(ACTIVATIONS)} (a str), got {type(act).__name__}")
    if act not in ACTIVATIONS:
        raise ValueError(f"act: expected one of {', '.join(ACTIVATIONS)}, got {act!r}")
    return act


def _tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got {t.dtype}")
    if t.dim() < 1:
        raise ValueError(f"{name}: expected at least one dimension, got a 0-d tensor")


def _in_place_flag(op: str, grads_in_place) -> None:
    if not isinstance(grads_in_place, bool):
        raise TypeError(f"{op}: grads_in_place must be a bool, got {type(grads_in_place).__name__}")


def check_split(gate, up, act, grads_in_place: bool = False) -> None:
    _tensor("gate", gate)
    _tensor("up", up)
    if up.shape != gate.shape:
        raise ValueError(f"up: expected the gate's shape {tuple(gate.shape)}, got {tuple(up.shape)}")
    if up.device != gate.device:
        raise ValueError(f"up: expected a tensor on {gate.device} (where the gate is), got {up.device}")
    check_act(act)
    _in_place_flag("mlp_act", grads_in_place)


def check_fused(gate_up, act, gate_first, grads_in_place: bool = False) -> None:
    _tensor("gate_up", gate_up)
    if gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up: expected an even last dimension (gate and up halves), got shape "
                         f"{tuple(gate_up.shape)}")
    check_act(act)
    if not isinstance(gate_first, bool):
        raise TypeError(f"gate_first: expected a bool, got {type(gate_first).__name__}")
    _in_place_flag("mlp_act_fused", grads_in_place)


def kernels_take(*ts: torch.Tensor) -> tuple[bool, str]:
    """Whether the kernels take tensors like these (device, dtype), and why not."""
    x = ts[0]
    ok, reason = kernel_device_ok(x)
    if ok and x.dtype not in KERNEL_DTYPES:
        ok, reason = False, f"dtype {x.dtype} (kernels take float16, bfloat16, float32)"
    if ok and any(t.dtype != x.dtype for t in ts[1:]):
        ok, reason = False, f"gate and up of different dtypes ({', '.join(str(t.dtype) for t in ts)})"
    if ok and x.dtype == torch.bfloat16 and x.device.type == "cpu":
        ok, reason = False, "bfloat16 under the Triton interpreter (not exact there)"
    return ok, reason


def kernel_ok(*ts: torch.Tensor) -> bool:
    """:func:`kernels_take`, warning once per reason when not."""
    ok, reason = kernels_take(*ts)
    if not ok:
        warn_fallback(OP, reason)
    return ok
