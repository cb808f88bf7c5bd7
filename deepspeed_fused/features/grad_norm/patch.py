"""Patching for the ``grad_norm`` feature: the fused ``get_grad_norm_direct`` and
``has_overflow_partitioned_grads_serial`` installed on one optimizer instance (its class is left
alone), and the link from the engine's model to that optimizer, by which the hook asks whether the
feature is in force and reverts it."""
from __future__ import annotations

import types
import weakref
from typing import Optional

import torch

from ...ops.grad_norm import tensor_norms
from ..base import CallCounts, count_op_call, op_call_mark

METHOD = "get_grad_norm_direct"
OVERFLOW_METHOD = "has_overflow_partitioned_grads_serial"
METHODS = (METHOD, OVERFLOW_METHOD)
# the gradient dtypes whose squares a float64 sum holds without overflow (each square below 2^256):
# for these, a non-finite norm means a non-finite element
_NARROW_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
LINK = "_ds_fused_grad_norm_optimizer"  # model attribute: the OptimizerLink of the optimizer patched


class OptimizerLink:
    """A model's link to the optimizer whose gradient norm is fused (a weak reference). A copy of the
    model does not carry it (the copy has no engine of its own), nor does a pickle."""

    __slots__ = ("_ref",)

    def __init__(self, optimizer):
        self._ref = weakref.ref(optimizer)

    def optimizer(self):
        return self._ref()

    def __copy__(self):
        return None

    def __deepcopy__(self, memo):
        return None

    def __reduce__(self):
        return (type(None), ())


def make_fused(original, calls: CallCounts, norms=tensor_norms):
    """The fused ``get_grad_norm_direct(self, gradients, params, norm_type=2)`` for ``original`` (a
    recognised method): the same gradients picked and the same float32 total, all-reduces and
    masking as the original, with every gradient's float64 norm from one
    :func:`~deepspeed_fused.ops.grad_norm.tensor_norms` call in place of a float64 copy and a
    ``vector_norm`` per gradient. Norms other than 2, and a DeepSpeed whose norm dtype is not float64
    (devices without it), run the original. ``norms`` (a list of tensors -> their float64 norms)
    is for the benchmark, which puts other per-tensor norms in the same method to compare them."""
    g = original.__globals__
    dist = g["dist"]
    pipe_replicated = g["PIPE_REPLICATED"]
    is_mp_param = g["is_model_parallel_parameter"]
    norm_dtype, accelerator = g["get_norm_dtype"], g["get_accelerator"]
    mask_invalid = g["mask_nan_or_inf_with_val_inplace"]

    def get_grad_norm_direct(self, gradients, params, norm_type=2):
        if float(norm_type) != 2.0 or norm_dtype() is not torch.float64:
            calls.eager += 1
            return original(self, gradients, params, norm_type)
        mark = op_call_mark()
        picked = []
        param_gradients = (t for t in gradients if not getattr(t, "_zero_padding", False))
        for grad, p in zip(param_gradients, params):
            if hasattr(p, pipe_replicated) and p.ds_pipe_replicated:
                continue
            # DeepSpeed's test, its two terms in the other order (both are pure): on model-parallel
            # rank 0, as in every run without model parallelism, no per-parameter call
            if self.model_parallel_rank == 0 or is_mp_param(p):
                picked.append(grad.data)
        if picked:
            per_grad = norms(picked).to(accelerator().current_device_name())
            total_norm = per_grad.pow(2.0).sum().float()
        else:
            total_norm = torch.tensor(0.0, dtype=torch.float32).to(self.device)
        dist.all_reduce(total_norm, op=dist.ReduceOp.SUM, group=self.dp_process_group)
        self._model_parallel_all_reduce(tensor=total_norm, op=dist.ReduceOp.SUM)
        total_norm = total_norm.pow(1. / 2.0)
        mask_invalid(total_norm, device=self.device)
        count_op_call(calls, mark)
        return total_norm

    get_grad_norm_direct.deepspeed_fused = True  # ours: recognised when reverting
    get_grad_norm_direct.__wrapped__ = original
    return get_grad_norm_direct


def make_fused_overflow(original, calls: CallCounts):
    """The fused ``has_overflow_partitioned_grads_serial(self)`` for ``original`` (a recognised
    method, whose ``_has_inf_or_nan`` is DeepSpeed's): whether any element of any gradient of the
    partition is infinite or NaN, from one :func:`~deepspeed_fused.ops.grad_norm.tensor_norms` call
    in place of an ``amax``, an ``amin`` and five small kernels per gradient. A float64 sum of the
    squares of float16, bfloat16 or float32 values cannot overflow (their squares are below 2^256),
    so a norm is non-finite exactly where its gradient holds a non-finite element; the result is
    DeepSpeed's (a one-element bool tensor). Sparse or float64 gradients run the original."""

    def has_overflow_partitioned_grads_serial(self):
        grads = []
        for i in range(len(self.bit16_groups)):
            for grad in self.averaged_gradients[i]:
                if grad is not None:
                    grads.append(grad.data)
        if not grads or any(g.is_sparse or g.dtype not in _NARROW_FLOATS for g in grads):
            calls.eager += 1
            return original(self)
        mark = op_call_mark()
        overflow = torch.isfinite(tensor_norms(grads)).all().logical_not().reshape(1)
        count_op_call(calls, mark)
        return overflow

    has_overflow_partitioned_grads_serial.deepspeed_fused = True
    has_overflow_partitioned_grads_serial.__wrapped__ = original
    return has_overflow_partitioned_grads_serial


_MAKERS = {METHOD: make_fused, OVERFLOW_METHOD: make_fused_overflow}


def fused_methods(optimizer) -> list:
    """The names of the fused methods installed on ``optimizer``."""
    d = getattr(optimizer, "__dict__", {})
    return [m for m in METHODS if getattr(getattr(d.get(m), "__func__", None), "deepspeed_fused", False) is True]


def is_fused(optimizer) -> bool:
    """Whether ``optimizer`` runs a fused method (installed on the instance)."""
    return bool(fused_methods(optimizer))


def install(model: torch.nn.Module, optimizer, calls: CallCounts, methods=(METHOD,)) -> None:
    """Install the fused ``methods`` on ``optimizer`` (its class's must be recognised) and link
    ``model`` to it."""
    for name in methods:
        original = getattr(type(optimizer), name)
        optimizer.__dict__[name] = types.MethodType(_MAKERS[name](original, calls), optimizer)
    model.__dict__[LINK] = OptimizerLink(optimizer)


def linked_optimizer(model: torch.nn.Module) -> Optional[object]:
    """The optimizer ``model`` is linked to (alive), or None."""
    link = model.__dict__.get(LINK)
    return link.optimizer() if isinstance(link, OptimizerLink) else None


def remove(optimizer) -> int:
    """Remove the fused methods from ``optimizer``; returns how many there were."""
    names = fused_methods(optimizer)
    for name in names:
        del optimizer.__dict__[name]
    return len(names)


def uninstall(model: torch.nn.Module) -> int:
    """Remove the fused methods from the optimizer ``model`` is linked to, and the link. Returns 1
    when fused methods were removed, else 0."""
    opt = linked_optimizer(model)
    model.__dict__.pop(LINK, None)
    return int(opt is not None and remove(opt) > 0)
