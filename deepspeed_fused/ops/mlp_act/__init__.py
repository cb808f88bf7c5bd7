"""The ``mlp_act`` op: the dense MLP's gated activation ``act(gate) * up``, fused.

A gated MLP computes ``down(act(gate(x)) * up(x))``. Eager runs the activation (one pass
writing ``act``), the product (reading ``act`` and ``up``) and in the backward the product's two
gradients and the activation's backward (three more passes); here one kernel reads ``gate`` and
``up`` and writes the product, and one kernel reads them with the output's gradient and writes
both input gradients. Activations: SiLU, GELU with the tanh approximation, exact GELU, with
eager's rounding at every point (:mod:`.kernels`). Layouts: two tensors (``gate_proj`` and
``up_proj``: :func:`mlp_act`), or one gate-up projection whose halves are the gate and the up
(Phi-3, GLM, Granite's shared MLP; the gate second in Moonshine: :func:`mlp_act_fused`).

The MoE experts' SiLU gate (``ops.moe_reorder.swiglu``) launches the same kernels with the
gate-up layout. One module per part: :mod:`.kernels` (Triton), :mod:`.launch` (tiles, views,
outputs), :mod:`.reference` (torch), :mod:`.checks` (arguments, where the kernels run), :mod:`.api`
(autograd Functions, custom ops ``deepspeed_fused::mlp_act*`` for ``torch.compile``). CUDA tensors
(CPU ones under ``TRITON_INTERPRET=1``, not bf16 there) run the kernels, anything else the torch
reference with one warning per reason.
"""
from .api import mlp_act, mlp_act_fused
from .checks import check_act, kernels_take
from .reference import ACTIVATIONS, activation_reference, mlp_act_fused_reference, mlp_act_reference

__all__ = ["mlp_act", "mlp_act_fused", "mlp_act_reference", "mlp_act_fused_reference", "activation_reference",
           "ACTIVATIONS", "kernels_take", "check_act"]
