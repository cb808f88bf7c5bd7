"""Feature "grad_norm": DeepSpeed's ZeRO-1/2 gradient norm and overflow check read each gradient once.

Every step, DeepSpeed's ZeRO stage 1 and 2 optimizer (``DeepSpeedZeroOptimizer``) measures the
global norm of the gradients (for ``gradient_clipping`` and for the norm it logs) in
``get_grad_norm_direct``: each gradient of the rank's partition is copied to float64 and its norm
taken, two launches and a float64 copy per gradient. With this feature on, the engine's optimizer
runs a fused version of that method: one :func:`~deepspeed_fused.ops.grad_norm.tensor_norms` call
reads the gradients in their own dtype and adds their squares in float64, and the rest of the
method (which gradients count, the float32 total, the all-reduces over the data- and
model-parallel groups, the masking of a non-finite norm) is the original's, with the objects the
original's module binds. The per-gradient norms differ from DeepSpeed's only in the order of their
float64 additions, so the float32 total is DeepSpeed's except where that float64 sum lies within a
few float64 units of a float32 rounding boundary.

Before the norm, with bf16 or fp16, the optimizer checks the gradients for infinities and NaNs
(``has_overflow_partitioned_grads_serial``: an ``amax`` and an ``amin`` of each gradient and five
small kernels to count it). Where that method and the two functions it calls are the known forms,
it runs fused too: the same per-gradient float64 norms, which are non-finite exactly where a
gradient holds a non-finite element (a float64 sum of squares of 16- or 32-bit floats cannot
overflow), give DeepSpeed's answer. The call counts count each call of either method (DeepSpeed
takes the norm once per parameter group and step, and checks for overflow once per step).

What is recognised is the method's bytecode (:mod:`.templates`: the form of DeepSpeed 0.19), not
the class name; any other form (another DeepSpeed release, a subclass that overrides the method,
ZeRO stage 3's method) stays as it is with the reason. Only the engine's own optimizer instance is
patched (its class is not); ZeRO-Offload, which computes the norm on the host by another method,
is left as it is. A norm other than 2 runs the original method.

The package, one concern per file: ``templates`` (the known forms), ``recognition`` (bytecode
normalisation, :func:`recognise`), ``patch`` (the fused method, install and uninstall); here the
feature itself.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

from ..base import CallCounts, Environment, Feature, FeatureConfig, FeatureReport, reference_fallback
from .patch import METHOD, OVERFLOW_METHOD, fused_methods, install, is_fused, linked_optimizer, remove, uninstall
from .recognition import Form, recognise, recognise_overflow


class GradNormConfig(FeatureConfig):
    """Options of the "grad_norm" feature (only ``enabled``: whether the optimizer's method
    qualifies is read from its bytecode)."""


def _installed_form() -> str:
    """Whether the installed DeepSpeed's ZeRO-1/2 gradient norm is a known form (for a report made
    without an engine, such as ``python -m deepspeed_fused report``)."""
    try:
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer
    except Exception as e:  # pragma: no cover - depends on the DeepSpeed build
        return f"DeepSpeed's ZeRO-1/2 optimizer does not import ({type(e).__name__})"
    form = recognise(getattr(DeepSpeedZeroOptimizer, METHOD, None))
    if isinstance(form, Form):
        return "this DeepSpeed's ZeRO-1/2 gradient norm is a known form"
    return f"this DeepSpeed's ZeRO-1/2 gradient norm stays as it is: {form}"


def _why_not(engine: Any) -> tuple[Optional[object], Any]:
    """(the engine's optimizer, its recognised Form) or (None, the reason it is left as it is)."""
    if engine is None:
        return None, ("needs the DeepSpeed engine: the gradient norm is its ZeRO optimizer's, patched at "
                      f"deepspeed.initialize (a model patched without engine= has none); {_installed_form()}")
    opt = getattr(engine, "optimizer", None)
    if opt is None:
        return None, "the engine has no optimizer (inference, or one built outside deepspeed.initialize)"
    name = type(opt).__name__
    method = getattr(type(opt), METHOD, None)
    if method is None:
        return None, (f"the engine's optimizer is {name}, which has no {METHOD}: only DeepSpeed's ZeRO stage 1 "
                      f"and 2 optimizer's gradient norm is fused")
    if getattr(opt, "cpu_offload", False):
        return None, f"{name} offloads to the CPU (ZeRO-Offload computes the norm on the host)"
    if METHOD in getattr(opt, "__dict__", {}) and METHOD not in fused_methods(opt):
        return None, f"{name}.{METHOD} is already replaced on this optimizer by other code"
    form = recognise(method)
    if not isinstance(form, Form):
        return None, form  # names the method
    return opt, form


class GradNormFeature(Feature):
    name = "grad_norm"
    config_model = GradNormConfig
    needs_engine = True

    def apply(self, model: torch.nn.Module, engine: Any, cfg: Any) -> FeatureReport:
        opt, form = _why_not(engine)
        if opt is None:
            return FeatureReport(name=self.name, enabled=True, reason=form)
        uninstall(model)
        remove(opt)  # linked from another model: one set of fused methods per optimizer
        name = type(opt).__name__
        methods, details, reason = [METHOD], {"norm": form.describe()}, ""
        overflow = recognise_overflow(type(opt))
        if OVERFLOW_METHOD in opt.__dict__:
            reason = f"overflow check left as it is: {name}.{OVERFLOW_METHOD} is already replaced on this optimizer"
        elif isinstance(overflow, Form):
            methods.append(OVERFLOW_METHOD)
            details["overflow check"] = overflow.describe()
        else:
            reason = f"overflow check left as it is: {overflow}"
        calls = CallCounts()
        install(model, opt, calls, methods)
        stage = getattr(opt, "partition_gradients", None)
        where = f"{name}." + ", ".join(fused_methods(opt)) + \
            ("" if stage is None else f" (ZeRO stage {2 if stage else 1})")
        return FeatureReport(name=self.name, enabled=True, applied=True, where=where, reason=reason,
                             details=details, calls=calls)

    def revert(self, model: torch.nn.Module) -> int:
        return uninstall(model)

    def is_applied(self, model: torch.nn.Module) -> Optional[bool]:
        opt = linked_optimizer(model)
        return opt is not None and is_fused(opt)

    def serves(self, model: torch.nn.Module, engine: Any) -> bool:
        return engine is None or linked_optimizer(model) is getattr(engine, "optimizer", None)

    def fallback(self, env: Environment) -> str:
        return reference_fallback("grad_norm", env)
