"""Feature "rms_norm": run Llama-form RMSNorm modules through the fused op.

Installation is class-level plus a per-instance opt-in. The first time a class is replaced, its
``forward`` is wrapped (once) by a dispatcher; the dispatcher runs the fused op only for
instances that carry the opt-in marker and inputs the kernels take, and the class's previous
forward otherwise. The marker is an instance attribute holding a shared object that copies
(``copy.copy``, ``copy.deepcopy``, ``nn.DataParallel`` replicas, which copy ``__dict__``) keep
as is and that pickles as ``False``: a model saved with ``torch.save`` and loaded again runs
eager until it is replaced again. Parameters, buffers, state_dict keys and module hooks are not
touched.

Which modules qualify: the exact classes of :data:`SUPPORTED_CLASSES` (by qualified name) while
their class still runs its own forward, plus (``match_llama_form``) any other class whose
forward compiles to the same bytecode as the Llama form (only the epsilon attribute name,
``variance_epsilon`` or ``eps``, may differ). Norms with other math (Gemma's ``1 + w``, GptOss
and Olmo2 multiplying by the weight before the cast, ``torch.nn.RMSNorm``) do not match. Modules
already replaced by DeepSpeed's own ``replace_rms_norm`` are left to it and reported.
"""
from __future__ import annotations

import collections
import dis
import functools
from typing import Any, Optional

import torch
from pydantic import StrictBool

from ..config import FeatureConfig
from ..ops._common import warn_fallback
from ..ops.rms_norm import rms_norm_kernel_ok, try_fused_rms_norm
from .base import CallCounts, Environment, Feature, FeatureReport
from .registry import register

SUPPORTED_CLASSES = frozenset(f"transformers.models.{m}.modeling_{m}.{c}" for m, c in [
    ("llama", "LlamaRMSNorm"), ("mistral", "MistralRMSNorm"), ("mixtral", "MixtralRMSNorm"),
    ("phi3", "Phi3RMSNorm"), ("qwen2", "Qwen2RMSNorm"), ("qwen2_moe", "Qwen2MoeRMSNorm"),
    ("qwen3", "Qwen3RMSNorm"), ("qwen3_moe", "Qwen3MoeRMSNorm"), ("deepseek_v2", "DeepseekV2RMSNorm"),
    ("deepseek_v3", "DeepseekV3RMSNorm"),
])
MARKER = "_ds_fused_rms"  # instance attribute holding OPT_IN on replaced modules
CALLS = "_ds_fused_rms_calls"  # instance attribute: the CallCounts of the apply that replaced the module
_EPS_ATTRS = ("variance_epsilon", "eps")


class _OptIn:
    """The opt-in marker value: one shared object; copies keep it, pickles load it as False."""

    __slots__ = ()

    def __copy__(self):
        return self

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        return (bool, (False,))

    def __repr__(self):
        return "<deepspeed_fused rms_norm opt-in>"


OPT_IN = _OptIn()

# class -> the dispatcher installed on it. Dispatchers stay installed for the life of the
# process: for instances without the marker they only call the forward they wrap.
_DISPATCHERS: dict = {}


def _make_dispatcher(original, eps_attr: str):
    def forward(self, hidden_states, *args, **kwargs):
        if getattr(self, MARKER, None) is OPT_IN:
            calls = self.__dict__.get(CALLS)
            if not args and not kwargs:
                weight = self.weight
                y = try_fused_rms_norm(hidden_states, weight, getattr(self, eps_attr))
                if y is not None:
                    if calls is not None:
                        calls.fused += 1
                    return y
                warn_fallback("rms_norm", f"{rms_norm_kernel_ok(hidden_states, weight)[1]}; the module runs its "
                                          "eager forward")
            if calls is not None:
                calls.eager += 1
        return original(self, hidden_states, *args, **kwargs)

    forward.__qualname__ = f"deepspeed_fused_rms_norm_dispatcher[{getattr(original, '__qualname__', '?')}]"
    forward.__doc__ = getattr(original, "__doc__", None)
    return forward


def _is_our_dispatcher(fn) -> bool:
    return any(fn is d for d in _DISPATCHERS.values())


# ---- recognising the Llama form ---------------------------------------------------------------
def _llama_form(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


_NAME_OPS = {"LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "LOAD_CONST", "KW_NAMES", "LOAD_NAME"}
_SKIP_OPS = {"CACHE", "RESUME", "NOP", "EXTENDED_ARG", "PUSH_NULL"}


def _normalized_ops(fn, eps_attr: str = "variance_epsilon") -> Optional[tuple]:
    """The instructions of ``fn`` with local variables by slot, names and constants by value,
    ``LOAD_METHOD`` read as ``LOAD_ATTR`` (CPython picks one or the other depending on whether
    the module imported ``torch``), and attribute ``eps_attr`` read as ``variance_epsilon``."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_argcount != 2 or code.co_kwonlyargcount or code.co_flags & 0x0C:
        return None
    ops = []
    for ins in dis.get_instructions(code):
        if ins.opname in _SKIP_OPS:
            continue
        op = "LOAD_ATTR" if ins.opname == "LOAD_METHOD" else ins.opname
        if op in _NAME_OPS:
            arg = ins.argval
            if op == "LOAD_ATTR" and arg == eps_attr:
                arg = "variance_epsilon"
        else:
            arg = ins.arg
        ops.append((op, arg))
    return tuple(ops)


@functools.lru_cache(maxsize=512)
def llama_form_eps_attr(fn) -> Optional[str]:
    """If ``fn`` (a forward) compiles to the Llama form, the name of its epsilon attribute."""
    if getattr(fn, "__globals__", {}).get("torch") is not torch:
        return None
    try:
        for attr in _EPS_ATTRS:
            if _normalized_ops(fn, attr) == _TEMPLATE:
                names = fn.__code__.co_names
                if attr in names and (attr == "variance_epsilon" or "variance_epsilon" not in names):
                    return attr
    except Exception:  # pragma: no cover - an unusual callable
        return None
    return None


_TEMPLATE = _normalized_ops(_llama_form)


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


def _looks_like_norm(module) -> bool:
    return "rmsnorm" in type(module).__name__.lower() or isinstance(module, getattr(torch.nn, "RMSNorm", ()))


def _classify(module, match_llama_form: bool, ds) -> tuple[str, str]:
    """('replace', eps_attr) | ('already', '') | ('skip', reason) | ('ignore', '')."""
    cls = type(module)
    fwd = cls.forward
    ours = _is_our_dispatcher(fwd)
    if not ours and not _looks_like_norm(module) and not (match_llama_form and llama_form_eps_attr(fwd)):
        return "ignore", ""
    if ours and module.__dict__.get(MARKER) is OPT_IN:
        return "already", ""
    if "forward" in module.__dict__:
        return "skip", "forward patched on the instance"
    if _deepspeed_opted_in(ds, module):
        return "skip", "already replaced by DeepSpeed's replace_rms_norm (left to it)"
    qn = _qualname(cls)
    eps_attr = None
    if ours:
        if qn not in SUPPORTED_CLASSES and not match_llama_form:
            return "skip", "not a supported class (match_llama_form is off)"
        eps_attr = fwd.__eps_attr__
    elif qn in SUPPORTED_CLASSES and fwd is _deepspeed_class_forward(ds, cls):
        eps_attr = "variance_epsilon"  # DeepSpeed's dispatcher around the class's own forward
    elif qn in SUPPORTED_CLASSES:
        own = cls.__dict__.get("forward")
        if fwd is not own or getattr(fwd, "__qualname__", "") != f"{cls.__qualname__}.forward" \
                or hasattr(fwd, "__wrapped__"):
            return "skip", "the class's forward was replaced or wrapped"
        eps_attr = llama_form_eps_attr(fwd) or "variance_epsilon"
    elif match_llama_form:
        eps_attr = llama_form_eps_attr(fwd)
        if eps_attr is None:
            return "skip", "forward is not the Llama form"
    else:
        return "skip", "not a supported class (match_llama_form is off)"
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or len(getattr(weight, "ds_shape", weight.shape)) != 1 \
            or not weight.is_floating_point():
        return "skip", "weight is not a 1-D floating-point Parameter"
    eps = getattr(module, eps_attr, None)
    if isinstance(eps, bool) or not isinstance(eps, (float, int)):
        return "skip", f"{eps_attr} is not a number"
    return "replace", eps_attr


def _plan(model: torch.nn.Module, match_llama_form: bool = True) -> dict:
    ds = _deepspeed_installer()
    plan = dict(replace=[], already=collections.Counter(), skipped={})
    for name, module in model.named_modules():
        action, info = _classify(module, match_llama_form, ds)
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
    for module, eps_attr in plan["replace"]:
        cls = type(module)
        if not _is_our_dispatcher(cls.forward):
            disp = _make_dispatcher(cls.forward, eps_attr)
            disp.__eps_attr__ = eps_attr
            _DISPATCHERS[cls] = disp
            cls.forward = disp
        module.__dict__[MARKER] = OPT_IN
        replaced[cls.__name__] += 1
    return replaced


def replace_rms_norm(model: torch.nn.Module, match_llama_form: bool = True) -> int:
    """Opt every qualifying RMSNorm module of ``model`` into the fused op. Returns how many
    modules were newly replaced (modules already replaced are not counted again)."""
    return sum(_commit(_plan(model, match_llama_form)).values())


def restore_rms_norm(model: torch.nn.Module) -> int:
    """Opt the modules of ``model`` out again (they run their eager forward). Returns the count."""
    n = 0
    for module in model.modules():
        module.__dict__.pop(CALLS, None)
        if module.__dict__.get(MARKER) is OPT_IN:
            del module.__dict__[MARKER]
            n += 1
    return n


def is_replaced(module: torch.nn.Module) -> bool:
    """Whether ``module`` currently runs the fused op (opted in, dispatcher installed)."""
    return module.__dict__.get(MARKER) is OPT_IN and _is_our_dispatcher(type(module).forward)


def _fmt(counter) -> str:
    return ", ".join(f"{n} x {c}" for c, n in sorted(counter.items()))


class RmsNormConfig(FeatureConfig):
    """Options of the "rms_norm" feature."""

    match_llama_form: StrictBool = True
    """Also replace RMSNorm classes outside the built-in list (Llama, Mistral, Mixtral, Phi3,
    Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, DeepSeek-V2/V3) whose forward compiles to exactly the
    bytecode of the Llama form (only the epsilon attribute name may differ)."""


@register
class RmsNormFeature(Feature):
    name = "rms_norm"
    config_model = RmsNormConfig

    def is_supported(self, env: Environment) -> tuple[bool, str]:
        if not env.kernels_available:
            return False, "the fused RMSNorm needs Triton and a CUDA GPU (or TRITON_INTERPRET=1)"
        return True, ""

    def apply(self, model: torch.nn.Module, engine: Any, cfg: Any) -> FeatureReport:
        plan = _plan(model, bool(getattr(cfg, "match_llama_form", True)))
        replaced = _commit(plan)
        already = plan["already"]
        skipped = {reason: dict(c) for reason, c in plan["skipped"].items()}
        total = collections.Counter(replaced) + already
        notes = [f"skipped {_fmt(c)}: {reason}" for reason, c in plan["skipped"].items()]
        if already:
            notes.insert(0, f"already replaced: {_fmt(already)}")
        rep = FeatureReport(name=self.name, enabled=True, applied=bool(total), where=_fmt(total),
                            details=dict(replaced=dict(replaced), already=dict(already), skipped=skipped))
        if total:  # fused and eager calls of this model's replaced modules, counted from now on
            rep.calls = CallCounts()
            for module in model.modules():
                if is_replaced(module):
                    module.__dict__[CALLS] = rep.calls
        rep.reason = "; ".join(notes) if total else \
            "; ".join(["no supported RMSNorm modules found"] + notes)
        return rep

    def revert(self, model: torch.nn.Module) -> int:
        return restore_rms_norm(model)

    def is_applied(self, model: torch.nn.Module) -> bool:
        return any(is_replaced(m) for m in model.modules())
