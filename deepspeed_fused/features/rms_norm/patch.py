"""Applying and reverting the rms_norm feature: the dispatchers installed on recognised classes
(the fused call), the per-call resolution of a recognised class's form, and the plan/commit of a
model's modules.
"""
from __future__ import annotations

import collections
import functools
from typing import Any, Optional

import torch

from ...ops._common import warn_fallback
from ...ops.rms_norm import (FORMS, RMSForm, rms_norm_form_kernel_ok, rms_norm_kernel_ok, try_fused_rms_norm,
                              try_fused_rms_norm_form)
from ..base import OptInMarker, counted_if_recompute_stops
from .recognition import (_ACT_NAMES, _LLAMA_SPEC, SUPPORTED_CLASSES, FormSpec, _looks_like_norm, _module_reason,
                          recognise)

MARKER = "_ds_fused_rms"  # instance attribute holding OPT_IN on replaced modules
CALLS = "_ds_fused_rms_calls"  # instance attribute: the CallCounts of the apply that replaced the module


OPT_IN_MARKER = OptInMarker("rms_norm", MARKER, CALLS)
OPT_IN = OPT_IN_MARKER.value  # read by the dispatchers

# class -> the dispatcher installed on it. Dispatchers stay installed for the life of the
# process: for instances without the marker they only call the forward they wrap.
_DISPATCHERS: dict = {}


def _add_fused(calls) -> None:
    if calls is not None:
        calls.fused += 1


def _dispatcher(original, attempt):
    """The forward installed on a recognised class. On an opted-in instance, ``attempt(self,
    hidden_states, args, kwargs)`` gives the fused output (counted fused), a str saying why this call
    runs eager (warned, once per reason), or None for a call whose arguments the form does not take
    (eager, not warned); the eager calls are counted and run ``original``, as do all calls of
    instances without the marker."""
    def forward(self, hidden_states, *args, **kwargs):
        if getattr(self, MARKER, None) is OPT_IN:
            calls = self.__dict__.get(CALLS)
            # a region whose last saved tensor is a norm's (Gemma's post-feedforward norm ends its
            # decoder layer) ends a non-reentrant checkpoint's recomputation inside the fused norm:
            # counted there too (the eager forward below is counted before it runs)
            with counted_if_recompute_stops(lambda: _add_fused(calls)):
                got = attempt(self, hidden_states, args, kwargs)
            if got is not None and not isinstance(got, str):
                _add_fused(calls)
                return got
            if got is not None:
                warn_fallback("rms_norm", f"{got}; the module runs its eager forward", reference=False)
            if calls is not None:
                calls.eager += 1
        return original(self, hidden_states, *args, **kwargs)

    forward.__qualname__ = f"deepspeed_fused_rms_norm_dispatcher[{getattr(original, '__qualname__', '?')}]"
    forward.__doc__ = getattr(original, "__doc__", None)
    return forward


def _make_dispatcher(original, eps_attr: str):
    def attempt(self, hidden_states, args, kwargs):
        if args or kwargs:
            return None
        weight = self.weight
        y = try_fused_rms_norm(hidden_states, weight, getattr(self, eps_attr))
        return y if y is not None else rms_norm_kernel_ok(hidden_states, weight)[1]

    return _dispatcher(original, attempt)


_NOT_FUSED = object()


def _make_form_dispatcher(original, spec):
    """The dispatcher of a class whose forward is another form (``spec``, see :func:`recognise`):
    the same structure as the Llama form's; the module's form, weight, epsilon and group size (None:
    statistics over the whole row) come from ``spec.resolve`` (a reason string where this instance
    or call must run eager)."""
    resolve, gated = functools.partial(_RESOLVERS[spec.kind], spec), spec.gated

    def attempt(self, hidden_states, args, kwargs):
        gate = _gate_argument(args, kwargs) if gated else (None if not args and not kwargs else _NOT_FUSED)
        if gate is _NOT_FUSED:
            return None
        got = resolve(self, hidden_states, gate)
        if type(got) is not tuple:
            return got
        form, weight, eps, group_size = got
        if group_size is None:
            y = try_fused_rms_norm_form(hidden_states, weight, eps, form, gate)
        else:
            y = try_fused_rms_norm_form(hidden_states, weight, eps, form, gate, group_size)
        return y if y is not None else rms_norm_form_kernel_ok(hidden_states, weight, gate)[1]

    return _dispatcher(original, attempt)


def _gate_argument(args, kwargs):
    """The gate of a gated norm's call ``forward(hidden_states, gate)``, or _NOT_FUSED for other
    argument lists."""
    if not kwargs:
        return args[0] if len(args) == 1 else (None if not args else _NOT_FUSED)
    if not args and len(kwargs) == 1 and "gate" in kwargs:
        return kwargs["gate"]
    return _NOT_FUSED


def _is_our_dispatcher(fn) -> bool:
    return any(fn is d for d in _DISPATCHERS.values())



_F32_EPS = torch.finfo(torch.float32).eps


# ---- per-call resolution of a recognised class's form: (form, weight, eps, group size or None), or
# a reason string (run eager) -------------------------------------------------------------------------
def _resolve_weighted(spec, module, hidden, gate):
    return FORMS[spec.form], module.weight, getattr(module, spec.eps_attr), None


def _resolve_unweighted(spec, module, hidden, gate):
    return FORMS[spec.form], None, getattr(module, spec.eps_attr), None


def _resolve_cpmant(spec, module, hidden, gate):
    if hidden.shape[-1] != getattr(module, "dim_norm", None):
        return "the input width is not dim_norm (the module raises)"
    return FORMS["llama"], module.weight, module.eps, None


def _resolve_with_scale(spec, module, hidden, gate):
    # the epsilon under the name the forward reads (Gemma 3n's and Gemma 4's norms read
    # ``variance_epsilon`` in transformers 5.25, where ``module.eps`` does not exist)
    eps = getattr(module, spec.eps_attr)
    if module.with_scale:
        return FORMS["weight_first_fp32"], module.weight, eps, None
    return FORMS["unweighted"], None, eps, None


_NOT_DIVIDED = "the input width is not a multiple of the group size (the module raises)"


def _group_size(hidden, size) -> Optional[int]:
    """``size`` where it divides the input width (None: the whole width), else -1."""
    n = hidden.shape[-1] if hidden.dim() else 0
    if n == 0 or n % size:
        return -1
    return None if size == n else size


def _resolve_grouped(spec, module, hidden, gate):
    # statistics over groups of group_size columns (None: the whole row), the weight spanning the row
    size = module.group_size
    if size is not None:
        size = _group_size(hidden, size)
        if size == -1:
            return _NOT_DIVIDED
    return FORMS[spec.form], module.weight, getattr(module, spec.eps_attr), size



def _resolve_gated(spec, module, hidden, gate):
    act = _ACT_NAMES.get(getattr(module, "activation", None))
    if act is None:
        return f"gate activation {getattr(module, 'activation', None)!r} (the op takes silu and sigmoid)"
    if gate is None:
        return "a gated norm called without a gate"
    form = FORMS[spec.form]
    return ((form if form.act == act else form._replace(act=act)), module.weight, getattr(module, spec.eps_attr),
            None)


def _resolve_gate_first(spec, module, hidden, gate):
    # Mamba2's gated norm: silu(gate) before the statistics, which are over groups of group_size
    size = _group_size(hidden, module.group_size)
    if size == -1:
        return _NOT_DIVIDED
    return FORMS["gate_first"], module.weight, getattr(module, spec.eps_attr), size


def _resolve_gate_first_row(spec, module, hidden, gate):
    # the same with the statistics over the whole row
    return FORMS["gate_first"], module.weight, getattr(module, spec.eps_attr), None


# Falcon-H1's gated norm: the weight product stays FP32 (weight * FP32 value), the gate after it
# (norm_before_gate) or before the statistics, the result cast to the input's dtype
_N_GROUPS_AFTER = RMSForm(norm_cast="none", weight="plain", gate="after", out_cast=True)
_N_GROUPS_BEFORE = RMSForm(norm_cast="none", weight="plain", gate="before", out_cast=True)


def _resolve_n_groups_gated(spec, module, hidden, gate):
    if hidden.dim() not in (2, 3):
        return "the input is not [batch, width] or [batch, seq, width] (the module raises)"
    n = hidden.shape[-1]
    if n == 0 or n % module.n_groups:
        return "the input width is not a multiple of n_groups (the module raises)"
    if gate is None:
        form = FORMS["weight_first"]
    else:
        form = _N_GROUPS_AFTER if module.norm_before_gate else _N_GROUPS_BEFORE
    size = n // module.n_groups
    return form, module.weight, getattr(module, spec.eps_attr), (None if size == n else size)


def _resolve_optional_weight_bias(spec, module, hidden, gate):
    # xLSTM's norm: FP32 statistics (force_float32_reductions; else in the input's dtype, the same
    # only for FP32 inputs), the normalized value cast back, then times the weight where there is one
    if not module.force_float32_reductions and hidden.dtype != torch.float32:
        return "statistics in the input dtype (force_float32_reductions is False)"
    if module.weight is None:
        return FORMS["unweighted"], None, module.eps, None
    return FORMS["llama"], module.weight, module.eps, None


def _resolve_torch(spec, module, hidden, gate):
    eps = module.eps if module.eps is not None else _F32_EPS
    if module.weight is None:
        return FORMS["unweighted"], None, eps, None
    return FORMS["weight_first_fp32"], module.weight, eps, None


_RESOLVERS = {"weighted": _resolve_weighted, "unweighted": _resolve_unweighted, "cpmant": _resolve_cpmant,
              "with_scale": _resolve_with_scale, "gated": _resolve_gated, "gate_first": _resolve_gate_first,
              "gate_first_row": _resolve_gate_first_row,
              "grouped": _resolve_grouped, "n_groups_gated": _resolve_n_groups_gated,
              "optional_weight_bias": _resolve_optional_weight_bias, "torch": _resolve_torch,
              "llama": _resolve_weighted}


def _qualname(cls) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _deepspeed_installer():
    try:
        from deepspeed.ops.triton_ops import fused_rms_norm as ds
    except Exception:
        return None
    return ds


def _deepspeed_class_forward(ds, cls):
    table = getattr(ds, "_FUSED_CLASS_FORWARDS", None) if ds is not None else None
    return table.get(cls) if isinstance(table, dict) else None


def _deepspeed_opted_in(ds, module) -> bool:
    if ds is None or _deepspeed_class_forward(ds, type(module)) is None:
        return False
    attr = getattr(ds, "_FUSED_INSTANCE_ATTRIBUTE", "_deepspeed_use_fused_rms_norm")
    marker = getattr(ds, "_FUSED_INSTANCE_OPT_IN", None)
    return marker is not None and module.__dict__.get(attr) is marker


def _classify(module, match_forms: bool, ds) -> tuple[str, Any]:
    """('replace', FormSpec) | ('already', '') | ('skip', reason) | ('ignore', '')."""
    cls = type(module)
    fwd = cls.forward
    ours = _is_our_dispatcher(fwd)
    qn = _qualname(cls)
    spec = recognise(cls) if not ours and (match_forms or qn in SUPPORTED_CLASSES) else None
    if not ours and spec is None and not _looks_like_norm(module):
        return "ignore", ""
    if ours and OPT_IN_MARKER.holds(module):
        return "already", ""
    if "forward" in module.__dict__:
        return "skip", "forward patched on the instance"
    if _deepspeed_opted_in(ds, module):
        return "skip", "already replaced by DeepSpeed's replace_rms_norm (left to it)"
    if ours:
        if qn not in SUPPORTED_CLASSES and not match_forms:
            return "skip", "not a supported class (match_forms is off)"
        spec = fwd.__spec__
    elif qn in SUPPORTED_CLASSES and fwd is _deepspeed_class_forward(ds, cls):
        spec = _LLAMA_SPEC  # DeepSpeed's dispatcher around the class's own forward
    elif qn in SUPPORTED_CLASSES:
        own = cls.__dict__.get("forward")
        if fwd is not own or getattr(fwd, "__qualname__", "") != f"{cls.__qualname__}.forward" \
                or hasattr(fwd, "__wrapped__"):
            return "skip", "the class's forward was replaced or wrapped"
        spec = spec if spec is not None and spec.template == "llama" else _LLAMA_SPEC
    elif match_forms:
        if spec is None:
            return "skip", "forward is not a known RMSNorm form"
    else:
        return "skip", "not a supported class (match_forms is off)"
    reason = _module_reason(module, spec)
    if reason:
        return "skip", reason
    return "replace", spec


def _plan(model: torch.nn.Module, match_forms: bool = True) -> dict:
    ds = _deepspeed_installer()
    plan = dict(replace=[], already=collections.Counter(), skipped={})
    for name, module in model.named_modules():
        action, info = _classify(module, match_forms, ds)
        cname = type(module).__name__
        if action == "replace":
            plan["replace"].append((module, info))
        elif action == "already":
            plan["already"][cname] += 1
        elif action == "skip":
            plan["skipped"].setdefault(info, collections.Counter())[cname] += 1
    return plan


def _commit(plan: dict) -> collections.Counter:
    replaced = collections.Counter()
    for module, spec in plan["replace"]:
        cls = type(module)
        if not _is_our_dispatcher(cls.forward):
            if spec.kind == "llama":
                disp = _make_dispatcher(cls.forward, spec.eps_attr)
            else:
                disp = _make_form_dispatcher(cls.forward, spec)
            disp.__eps_attr__ = spec.eps_attr
            disp.__spec__ = spec
            _DISPATCHERS[cls] = disp
            cls.forward = disp
        OPT_IN_MARKER.mark(module)
        replaced[cls.__name__] += 1
    return replaced


def replace_rms_norm(model: torch.nn.Module, match_forms: bool = True) -> int:
    """Opt every qualifying RMSNorm module of ``model`` into the fused op. Returns how many
    modules were newly replaced (modules already replaced are not counted again)."""
    return sum(_commit(_plan(model, match_forms)).values())


def restore_rms_norm(model: torch.nn.Module) -> int:
    """Opt the modules of ``model`` out again (they run their eager forward). Returns the count."""
    return OPT_IN_MARKER.clear(model)


def is_replaced(module: torch.nn.Module) -> bool:
    """Whether ``module`` currently runs the fused op (opted in, dispatcher installed)."""
    return OPT_IN_MARKER.holds(module) and _is_our_dispatcher(type(module).forward)


def replaced_form(module: torch.nn.Module) -> Optional[str]:
    """The template a replaced module's class was recognised as (``"llama"``, ``"gemma"``,
    ``"torch.nn.RMSNorm"``, ...; see :func:`recognise`), or None when ``module`` is not replaced."""
    if not is_replaced(module):
        return None
    spec = getattr(type(module).forward, "__spec__", None)
    return spec.template if isinstance(spec, FormSpec) else "llama"
