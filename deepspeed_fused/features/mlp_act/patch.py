"""Patching for the ``mlp_act`` feature: the fused forward of a recognised MLP, the class
dispatcher (installed once per class, kept for the life of the process) and the per-instance
opt-in (see the package's docstring)."""
from __future__ import annotations

import collections
from typing import Optional

import torch

from ...ops._common import warn_fallback
from ...ops.mlp_act import kernels_take, mlp_act, mlp_act_fused
from ..base import OptInMarker, count_op_call, op_call_mark
from .recognition import Form, activation_of, recognise

MARKER = "_ds_fused_mlp_act"  # instance attribute holding OPT_IN on opted-in modules
CALLS = "_ds_fused_mlp_act_calls"  # instance attribute: the CallCounts of the apply that opted the module in

OPT_IN_MARKER = OptInMarker("mlp_act", MARKER, CALLS)
OPT_IN = OPT_IN_MARKER.value  # read by the dispatchers

_DISPATCHERS: dict = {}  # class -> the dispatcher installed on it


def _eager_tail(act_mod, gate, up):
    """The forms' own math on the projections already computed (``act(gate) * up``; the product's
    operand order does not change its value or its gradients)."""
    return act_mod(gate) * up


def _private_output(mod) -> bool:
    """Whether the output of the projection ``mod`` is a fresh tensor that only the activation will
    read: ``mod`` runs ``torch.nn.Linear``'s own forward (``F.linear``: a new tensor), with no forward
    hook, its own or global, that could keep it. Then the activation's backward may write the
    gradient over it (``grads_in_place``)."""
    return (type(mod).forward is torch.nn.Linear.forward and "forward" not in mod.__dict__
            and not mod._forward_hooks and not torch.nn.modules.module._global_forward_hooks)


def _make_fused(form: Form):
    """``fused(self, x, settle)``: the forward of ``form`` with the gated activation fused, or None
    (then the class's forward runs: the call's arguments or the module's activation are not the
    form's). ``settle(why)`` counts the call once the activation has run ("" fused, else why the
    eager math ran)."""
    layout = form.layout
    act_name, down_name = form.attr("act"), form.attr("down")

    if layout == "split":
        gate_name, up_name = form.attr("gate"), form.attr("up")
        drop_name = dict(form.roles).get("dropout")

        def fused(self, x, settle):
            act_mod = getattr(self, act_name)
            act = activation_of(act_mod)
            if type(act) is not str:
                return None, act[1]
            gate_mod, up_mod = getattr(self, gate_name), getattr(self, up_name)
            gate = gate_mod(x)
            up = up_mod(x)
            ok, why = kernels_take(gate, up)
            if ok and gate.shape == up.shape:
                private = _private_output(gate_mod) and _private_output(up_mod)
                h, why = mlp_act(gate, up, act, grads_in_place=private), ""
            else:
                h, why = _eager_tail(act_mod, gate, up), why or "gate and up of different shapes"
            settle(why)
            if drop_name is not None:
                h = getattr(self, drop_name)(h)
            return getattr(self, down_name)(h), why
    else:
        gu_name = form.attr("gate_up")
        gate_first = layout == "gate_up"

        def fused(self, x, settle):
            act_mod = getattr(self, act_name)
            act = activation_of(act_mod)
            if type(act) is not str:
                return None, act[1]
            gu_mod = getattr(self, gu_name)
            gu = gu_mod(x)
            ok, why = kernels_take(gu)
            if ok and gu.dim() and gu.shape[-1] % 2 == 0:
                h = mlp_act_fused(gu, act, gate_first, grads_in_place=_private_output(gu_mod))
                settle("")
                return getattr(self, down_name)(h), ""
            a, b = gu.chunk(2, dim=-1)
            gate, up = (a, b) if gate_first else (b, a)
            why = why or "an odd gate-up width"
            h = _eager_tail(act_mod, gate, up)
            settle(why)
            return getattr(self, down_name)(h), why

    return fused


def _make_dispatcher(original, form: Form):
    fused = _make_fused(form)

    def forward(self, *args, **kwargs):
        if getattr(self, MARKER, None) is OPT_IN and len(args) == 1 and not kwargs:
            calls = self.__dict__.get(CALLS)
            mark = op_call_mark()

            def settle(why):
                # counted as soon as the activation ran, before the down projection: a non-reentrant
                # checkpoint's recomputation ends inside that projection (its saved input is the
                # layer's last), and the call's ops have run by then
                if calls is not None:
                    if why:
                        calls.eager += 1
                    else:
                        count_op_call(calls, mark)  # fused, or reference when the op ran its torch code

            out, why = fused(self, args[0], settle)
            if out is not None:
                if why:
                    warn_fallback("mlp_act", f"{why}; {type(self).__name__} runs its eager math")
                return out
            warn_fallback("mlp_act", f"{why}; {type(self).__name__} runs its eager forward")
            if calls is not None:
                calls.eager += 1
        return original(self, *args, **kwargs)

    forward.__qualname__ = f"deepspeed_fused_mlp_act_dispatcher[{getattr(original, '__qualname__', '?')}]"
    forward.__doc__ = getattr(original, "__doc__", None)
    forward.__wrapped__ = original  # inspect.signature reads the original's
    forward.__ds_mlp_act__ = (original, form)
    return forward


def _is_our_dispatcher(fn) -> bool:
    return getattr(fn, "__ds_mlp_act__", None) is not None and any(fn is d for d in _DISPATCHERS.values())


def form_of(cls) -> Optional[Form]:
    """The form a class's dispatcher runs, or the form of its forward, or None."""
    fwd = cls.forward
    if _is_our_dispatcher(fwd):
        return fwd.__ds_mlp_act__[1]
    f = recognise(fwd)
    return f if isinstance(f, Form) else None


def _classify(module) -> tuple:
    """('replace', form) | ('already', form) | ('skip', reason) | ('ignore', None)."""
    cls = type(module)
    fwd = cls.forward
    if _is_our_dispatcher(fwd):
        form = fwd.__ds_mlp_act__[1]
    else:
        form = recognise(fwd)
        if not isinstance(form, Form):
            return "ignore", None
    if "forward" in module.__dict__:
        return "skip", "forward patched on the instance"
    for role, attr in form.roles:
        v = getattr(module, attr, None)
        if role != "act" and not isinstance(v, torch.nn.Module):
            return "skip", f"{attr} is not a module ({type(v).__name__})"
    act = activation_of(getattr(module, form.attr("act"), None))
    if type(act) is not str:
        return "skip", f"activation {act[1]}"
    if _is_our_dispatcher(fwd) and OPT_IN_MARKER.holds(module):
        return "already", form
    return "replace", form


def _plan(model: torch.nn.Module) -> dict:
    plan = dict(replace=[], already=collections.Counter(), skipped={}, forms={})
    for module in model.modules():
        action, info = _classify(module)
        cname = type(module).__name__
        if action in ("replace", "already"):
            plan["forms"][cname] = f"{info.describe()} [{activation_of(getattr(module, info.attr('act')))}]"
            if action == "replace":
                plan["replace"].append(module)
            else:
                plan["already"][cname] += 1
        elif action == "skip":
            plan["skipped"].setdefault(info, collections.Counter())[cname] += 1
    return plan


def _install(cls) -> None:
    fwd = cls.forward
    if _is_our_dispatcher(fwd):
        return
    form = recognise(fwd)
    disp = _make_dispatcher(fwd, form)
    _DISPATCHERS[cls] = disp
    cls.forward = disp


def _commit(plan: dict) -> collections.Counter:
    replaced = collections.Counter()
    for module in plan["replace"]:
        _install(type(module))
        OPT_IN_MARKER.mark(module)
        replaced[type(module).__name__] += 1
    return replaced


def replace_mlp_act(model: torch.nn.Module) -> int:
    """Opt every MLP of ``model`` whose forward is a recognised gated form (and whose activation is
    SiLU, tanh GELU or exact GELU) into the fused gated activation. Returns how many were newly
    opted in."""
    return sum(_commit(_plan(model)).values())


def restore_mlp_act(model: torch.nn.Module) -> int:
    """Opt the modules of ``model`` out again (they run their eager forward). Returns the count."""
    return OPT_IN_MARKER.clear(model)


def is_replaced(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs the fused gated activation now (opted in, its class's dispatcher
    installed, no forward of its own instance)."""
    return (OPT_IN_MARKER.holds(module) and "forward" not in module.__dict__
            and _is_our_dispatcher(type(module).forward))
