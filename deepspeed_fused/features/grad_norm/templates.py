"""The known forms of DeepSpeed's ZeRO-1/2 gradient norm (``get_grad_norm_direct`` of
``DeepSpeedZeroOptimizer``) and overflow check (``has_overflow_partitioned_grads_serial``, with the
``_has_inf_or_nan`` it calls and the module function that calls), as templates compiled here.

Each template is written as DeepSpeed writes the method; :mod:`.recognition` compares the bytecode
of the engine's optimizer's method with these, with local names free and every global, attribute
and constant as written. The names a template loads from its module are DeepSpeed's; the fused
method (:mod:`.patch`) calls the same objects, read from the recognised method's own module.
Nothing here is called.
"""
from __future__ import annotations

import typing

import torch

# The globals of the templates, imported as DeepSpeed's module imports them: Python compiles a
# method call on an imported name differently from one on any other global, so the templates'
# names must be imports too (recognition compares the names, and checks that the recognised
# method's module binds each to what is expected). Never imported at run time.
if typing.TYPE_CHECKING:  # pragma: no cover
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import has_inf_or_nan, inf, is_model_parallel_parameter, \
        mask_nan_or_inf_with_val_inplace
    from deepspeed.runtime.zero.utils import get_norm_dtype


def _t_vector_norm_per_gradient(self, gradients, params, norm_type=2):  # DeepSpeed 0.19
    norm_type = float(norm_type)
    all_norms = []
    if norm_type == inf:
        for g in gradients:
            all_norms.append(g.data.abs().max().float())
        total_norm = torch.stack(all_norms).max()
        dist.all_reduce(total_norm, op=dist.ReduceOp.MAX, group=self.dp_process_group)

        self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.MAX)
    else:
        param_gradients = (g for g in gradients if not getattr(g, "_zero_padding", False))
        for g, p in zip(param_gradients, params):
            if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
                continue
            if is_model_parallel_parameter(p) or (self.model_parallel_rank == 0):
                all_norms.append(
                    torch.linalg.vector_norm(g.data.to(get_norm_dtype()).detach(),
                                             ord=norm_type).to(get_accelerator().current_device_name()))
        if len(all_norms) > 0:
            total_norm = torch.stack(all_norms).pow(norm_type).sum().float()
        else:
            total_norm = torch.tensor(0.0, dtype=torch.float32).to(self.device)
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)

        self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)

        total_norm = total_norm.pow(1. / norm_type)

    mask_nan_or_inf_with_val_inplace(total_norm, device=self.device)

    return total_norm


def _t_overflow_count(self):  # DeepSpeed 0.19
    invalid_grad_count = torch.zeros([1], dtype=torch.float, device=get_accelerator().current_device_name())
    for i in range(len(self.bit16_groups)):
        for j, grad in enumerate(self.averaged_gradients[i]):
            if grad is not None:
                invalid_grad_count += self._has_inf_or_nan(grad)
    return invalid_grad_count.bool()


def _t_has_inf_or_nan_static(x, j=None):  # the optimizer's _has_inf_or_nan (a staticmethod)
    return has_inf_or_nan(x)


def _t_has_inf_or_nan(x):  # deepspeed.runtime.utils.has_inf_or_nan, DeepSpeed 0.19
    if x.is_sparse:
        x = x._values()
    if x.numel() == 0:
        return torch.tensor(False, device=x.device)
    return torch.isfinite(x.amax()).logical_and(torch.isfinite(x.amin())).logical_not()


# method name -> [(template, description)]
FORMS = [
    (_t_vector_norm_per_gradient, "per-gradient float64 vector_norm, summed in float32 (DeepSpeed 0.19)"),
]
OVERFLOW_FORMS = [
    (_t_overflow_count, "a count of gradients with a non-finite amax or amin (DeepSpeed 0.19)"),
]
HAS_INF_OR_NAN_STATIC_FORMS = [(_t_has_inf_or_nan_static, "has_inf_or_nan(x)")]
HAS_INF_OR_NAN_FORMS = [(_t_has_inf_or_nan, "isfinite of amax and amin (DeepSpeed 0.19)")]

# The module globals a recognised method must bind, and what each must be: "torch" the torch
# module, "inf" the float infinity, "callable" a function, "str" a string.
GLOBALS = {
    "torch": "torch", "inf": "inf", "dist": "module", "PIPE_REPLICATED": "str",
    "is_model_parallel_parameter": "callable", "get_norm_dtype": "callable", "get_accelerator": "callable",
    "mask_nan_or_inf_with_val_inplace": "callable",
}
OVERFLOW_GLOBALS = {"torch": "torch", "get_accelerator": "callable"}
HAS_INF_OR_NAN_STATIC_GLOBALS = {"has_inf_or_nan": "callable"}
HAS_INF_OR_NAN_GLOBALS = {"torch": "torch"}
