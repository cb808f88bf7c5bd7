"""The torch references: the eager formulations the kernels reproduce."""
from __future__ import annotations

import torch

ACTIVATIONS = ("silu", "gelu_tanh", "gelu")


def activation_reference(x: torch.Tensor, act: str) -> torch.Tensor:
    """``act(x)`` as torch computes it (FP32 math for half-precision inputs, one rounding)."""
    if act == "silu":
        return torch.nn.functional.silu(x)
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(x, approximate="tanh")
    return torch.nn.functional.gelu(x)


def mlp_act_reference(gate: torch.Tensor, up: torch.Tensor, act: str = "silu") -> torch.Tensor:
    """``act(gate) * up``: the activation rounded to the input dtype, then the product."""
    return activation_reference(gate, act) * up


def mlp_act_fused_reference(gate_up: torch.Tensor, act: str = "silu", gate_first: bool = True) -> torch.Tensor:
    """``act(gate) * up`` of ``gate, up = gate_up.chunk(2, -1)`` (``gate_first``) or of
    ``up, gate = gate_up.chunk(2, -1)``."""
    a, b = gate_up.chunk(2, dim=-1)
    gate, up = (a, b) if gate_first else (b, a)
    return activation_reference(gate, act) * up
