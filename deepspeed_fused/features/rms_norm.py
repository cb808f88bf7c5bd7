"""Feature "rms_norm": run RMSNorm modules through the fused op, each in its own form.

Installation is class-level plus a per-instance opt-in. The first time a class is replaced, its
``forward`` is wrapped (once) by a dispatcher; the dispatcher runs the fused op only for
instances that carry the opt-in marker and inputs the kernels take, and the class's previous
forward otherwise. The marker is an instance attribute holding a shared object that copies
(``copy.copy``, ``copy.deepcopy``, ``nn.DataParallel`` replicas, which copy ``__dict__``) keep
as is and that pickles as ``False``: a model saved with ``torch.save`` and loaded again runs
eager until it is replaced again. Parameters, buffers, state_dict keys and module hooks are not
touched.

Which modules qualify: the exact classes of :data:`SUPPORTED_CLASSES` (by qualified name) while
their class still runs its own forward, plus (``match_forms``) any other class whose forward (and
the helpers it calls: ``_norm``, xLSTM's ``_rms_normalize`` and ``_apply_weight_bias``) compiles
to the same bytecode as one of the known forms' templates (only the epsilon attribute name,
``variance_epsilon`` or ``eps``, may differ; see :func:`recognise`), and ``torch.nn.RMSNorm``
modules. Llama-form classes get the Llama dispatcher (the op's hot path); the other forms (Gemma's
``1 + w``, the weight before the cast, T5's, unweighted, gated, and the grouped norms, whose group
size is read from the module at every call) get a form dispatcher that resolves the module's form
per call. Norms with other math do not match. Modules already replaced by DeepSpeed's own ``replace_rms_norm``
are left to it and reported.
"""
from __future__ import annotations

import builtins
import collections
import dis
import functools
import sys
from typing import Any, NamedTuple, Optional

import torch
from pydantic import Field, StrictBool

from ..ops._common import warn_fallback
from ..ops.rms_norm import (FORMS, RMSForm, rms_norm_form_kernel_ok, rms_norm_kernel_ok, try_fused_rms_norm,
                             try_fused_rms_norm_form)
from .base import FeatureConfig, FeatureReport, OptInMarker, ReplacementFeature, global_names
from .rms_norm_templates import TEMPLATE_SOURCES

SUPPORTED_CLASSES = frozenset(f"transformers.models.{m}.modeling_{m}.{c}" for m, c in [
    ("llama", "LlamaRMSNorm"), ("mistral", "MistralRMSNorm"), ("mixtral", "MixtralRMSNorm"),
    ("phi3", "Phi3RMSNorm"), ("qwen2", "Qwen2RMSNorm"), ("qwen2_moe", "Qwen2MoeRMSNorm"),
    ("qwen3", "Qwen3RMSNorm"), ("qwen3_moe", "Qwen3MoeRMSNorm"), ("deepseek_v2", "DeepseekV2RMSNorm"),
    ("deepseek_v3", "DeepseekV3RMSNorm"),
])
MARKER = "_ds_fused_rms"  # instance attribute holding OPT_IN on replaced modules
CALLS = "_ds_fused_rms_calls"  # instance attribute: the CallCounts of the apply that replaced the module
_EPS_ATTRS = ("variance_epsilon", "eps")


OPT_IN_MARKER = OptInMarker("rms_norm", MARKER, CALLS)
OPT_IN = OPT_IN_MARKER.value  # read by the dispatchers

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


_NOT_FUSED = object()


def _make_form_dispatcher(original, spec):
    """The dispatcher of a class whose forward is another form (``spec``, see :func:`recognise`):
    the same structure as the Llama form's; the module's form, weight, epsilon and group size (None:
    statistics over the whole row) come from ``spec.resolve`` (a reason string where this instance
    or call must run eager)."""
    resolve, gated = spec.resolve, spec.gated

    def forward(self, hidden_states, *args, **kwargs):
        if getattr(self, MARKER, None) is OPT_IN:
            calls = self.__dict__.get(CALLS)
            gate = _gate_argument(args, kwargs) if gated else (None if not args and not kwargs else _NOT_FUSED)
            if gate is not _NOT_FUSED:
                got = resolve(self, hidden_states, gate)
                if type(got) is tuple:
                    form, weight, eps, group_size = got
                    if group_size is None:
                        y = try_fused_rms_norm_form(hidden_states, weight, eps, form, gate)
                    else:
                        y = try_fused_rms_norm_form(hidden_states, weight, eps, form, gate, group_size)
                    if y is not None:
                        if calls is not None:
                            calls.fused += 1
                        return y
                    got = rms_norm_form_kernel_ok(hidden_states, weight, gate)[1]
                warn_fallback("rms_norm", f"{got}; the module runs its eager forward")
            if calls is not None:
                calls.eager += 1
        return original(self, hidden_states, *args, **kwargs)

    forward.__qualname__ = f"deepspeed_fused_rms_norm_dispatcher[{getattr(original, '__qualname__', '?')}]"
    forward.__doc__ = getattr(original, "__doc__", None)
    return forward


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


# ---- recognising the forms ----------------------------------------------------------------------
def _llama_form(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)


_NAME_OPS = {"LOAD_GLOBAL", "LOAD_ATTR", "LOAD_METHOD", "LOAD_CONST", "KW_NAMES", "LOAD_NAME"}
_SKIP_OPS = {"CACHE", "RESUME", "NOP", "EXTENDED_ARG", "PUSH_NULL"}


def _normalized_ops(fn, eps_attr: str = "variance_epsilon", argcount: int = 2) -> Optional[tuple]:
    """The instructions of ``fn`` with local variables by slot, names and constants by value,
    ``LOAD_METHOD`` read as ``LOAD_ATTR`` (CPython picks one or the other depending on whether
    the module imported the name the attribute is read from), jumps by the index of their target
    among the kept instructions (the two spellings above differ in their inline caches, hence in
    byte offsets), and attribute ``eps_attr`` read as ``variance_epsilon``."""
    code = getattr(fn, "__code__", None)
    if code is None or code.co_argcount != argcount or code.co_kwonlyargcount or code.co_flags & 0x0C:
        return None
    instructions = list(dis.get_instructions(code))
    index, kept = {}, 0  # byte offset -> index of the first kept instruction at or after it
    for ins in instructions:
        index[ins.offset] = kept
        if ins.opname not in _SKIP_OPS:
            kept += 1
    jumps = set(dis.hasjrel) | set(dis.hasjabs)
    ops = []
    for ins in instructions:
        if ins.opname in _SKIP_OPS:
            continue
        if ins.opcode in jumps:
            ops.append((ins.opname, ("to", index.get(ins.argval, ins.argval))))
            continue
        op = "LOAD_ATTR" if ins.opname == "LOAD_METHOD" else ins.opname
        if op == "KW_NAMES":  # the keyword names of the next call (dis shows no argval for them)
            arg = code.co_consts[ins.arg]
        elif op == "LOAD_CONST":  # by type and value: 1 == 1.0 == True in Python
            arg = (type(ins.argval), ins.argval)
        elif op in _NAME_OPS:
            arg = ins.argval
            if op == "LOAD_ATTR" and arg == eps_attr:
                arg = "variance_epsilon"
        else:
            arg = ins.arg
        ops.append((op, arg))
    return tuple(ops)



class _Template(NamedTuple):
    name: str
    kind: str
    form: str
    argcount: int
    ops: dict  # eps attribute -> normalized forward instructions
    helpers: tuple  # ((helper name, {eps attribute -> its normalized instructions}), ...): the methods it calls


def _compile_template(src: str):
    ns: dict = {}
    exec(compile(src, "<deepspeed_fused rms_norm template>", "exec"), ns)
    return next(v for k, v in ns.items() if callable(v) and not k.startswith("__"))


def _build_templates() -> list:
    out = [_Template("llama", "llama", "llama", 2, {a: _normalized_ops(_llama_form, a) for a in _EPS_ATTRS}, ())]
    for name, kind, form, fwd_src, helper_src in TEMPLATE_SOURCES:  # rms_norm_templates.py
        fwd = _compile_template(fwd_src)
        argc = fwd.__code__.co_argcount
        if isinstance(helper_src, str):
            helper_src = {"_norm": helper_src}
        helpers = []
        for hname, src in sorted((helper_src or {}).items()):
            h = _compile_template(src)
            helpers.append((hname, {a: _normalized_ops(h, a) for a in _EPS_ATTRS}))
        ops = {a: _normalized_ops(fwd, a, argc) for a in _EPS_ATTRS}
        out.append(_Template(name, kind, form, argc, ops, tuple(helpers)))
    return out


_TEMPLATES = _build_templates()
# the methods the templates' forwards call (read off a candidate class by these names)
_HELPER_NAMES = tuple(sorted({h for t in _TEMPLATES for h, _ in t.helpers}))
_TEMPLATE = _TEMPLATES[0].ops["variance_epsilon"]
# names a candidate forward must use for any template to match (a cheap first filter)
_HINTS = ("rsqrt", "rms_norm") + _HELPER_NAMES


def _expected_global(name: str):
    """What a template's module global ``name`` must be (None: not one a template loads)."""
    if name == "torch":
        return torch
    if name == "nn":
        return torch.nn
    if name == "F":
        return torch.nn.functional
    if name == "ACT2FN":
        return getattr(sys.modules.get("transformers.activations"), "ACT2FN", _MISSING)
    return None


_MISSING = object()


def _globals_ok(fn) -> bool:
    """The module globals ``fn`` loads (not its attribute names: ``x.nn`` is no global) resolve to
    torch's and transformers' own, and Python's builtins it calls (``len``, ``int``) are not shadowed
    by a module global of that name. The bytecode match compares the names; this, what they name."""
    code, glb = getattr(fn, "__code__", None), getattr(fn, "__globals__", None)
    if code is None or glb is None:
        return False
    for name in global_names(code):
        want = _expected_global(name)
        if want is not None:
            if want is _MISSING or glb.get(name) is not want:
                return False
        elif name in glb and hasattr(builtins, name) and glb[name] is not getattr(builtins, name):
            return False
    return True


class FormSpec(NamedTuple):
    """How a recognised class runs: the template it matched, its dispatch kind and the op's form,
    the epsilon attribute, whether its forward takes a gate."""

    template: str
    kind: str
    form: str
    eps_attr: str
    gated: bool

    @property
    def resolve(self):
        return functools.partial(_RESOLVERS[self.kind], self)


@functools.lru_cache(maxsize=1024)
def _match(fwd, helpers: tuple = ()) -> Optional[FormSpec]:
    """``helpers``: ((name, the class's method of that name or None), ...)."""
    code = getattr(fwd, "__code__", None)
    if code is None or not any(h in code.co_names for h in _HINTS) or not _globals_ok(fwd):
        return None
    have = {name: fn for name, fn in helpers if getattr(fn, "__code__", None) is not None}
    try:
        for t in _TEMPLATES:
            if code.co_argcount != t.argcount:
                continue
            if any(h not in have or not _globals_ok(have[h]) for h, _ in t.helpers):
                continue
            names = set(code.co_names)
            for h, _ in t.helpers:
                names |= set(have[h].__code__.co_names)
            for attr in _EPS_ATTRS:
                # the epsilon attribute: the one the code reads (``eps`` only where it reads no
                # ``variance_epsilon``); both spellings of the template count
                if attr not in names or (attr == "eps" and "variance_epsilon" in names):
                    continue
                if any(_normalized_ops(have[h], attr) not in hops.values() for h, hops in t.helpers):
                    continue
                if _normalized_ops(fwd, attr, t.argcount) in t.ops.values():
                    return FormSpec(t.name, t.kind, t.form, attr, t.argcount == 3)
    except Exception:  # pragma: no cover - an unusual callable
        return None
    return None


def recognise(cls) -> Optional[FormSpec]:
    """The form of ``cls.forward`` (with the helpers it calls, such as ``_norm``), or None: exact
    instruction match against the templates; ``torch.nn.RMSNorm`` (its own forward) by class."""
    fwd = cls.forward
    if _TORCH_RMSNORM is not None and issubclass(cls, _TORCH_RMSNORM) and fwd is _TORCH_RMSNORM.forward:
        return FormSpec("torch.nn.RMSNorm", "torch", "weight_first_fp32", "eps", False)
    helpers = []
    for name in _HELPER_NAMES:
        fn = getattr(cls, name, None)
        helpers.append((name, fn if callable(fn) else None))
    return _match(fwd, tuple(helpers))


@functools.lru_cache(maxsize=512)
def llama_form_eps_attr(fn) -> Optional[str]:
    """If ``fn`` (a forward) compiles to the Llama form, the name of its epsilon attribute."""
    spec = _match(fn)
    return spec.eps_attr if spec is not None and spec.template == "llama" else None


_TORCH_RMSNORM = getattr(torch.nn, "RMSNorm", None)
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


_ACT_NAMES = {"silu": "silu", "swish": "silu", "sigmoid": "sigmoid"}


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


def _looks_like_norm(module) -> bool:
    return "rmsnorm" in type(module).__name__.lower() or isinstance(module, getattr(torch.nn, "RMSNorm", ()))


_LLAMA_SPEC = FormSpec("llama", "llama", "llama", "variance_epsilon", False)


def _weight_reason(module) -> str:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or len(getattr(weight, "ds_shape", weight.shape)) != 1 \
            or not weight.is_floating_point():
        return "weight is not a 1-D floating-point Parameter"
    return ""


def _eps_reason(module, attr: str, none_ok: bool = False) -> str:
    eps = getattr(module, attr, None)
    if (none_ok and eps is None) or (not isinstance(eps, bool) and isinstance(eps, (float, int))):
        return ""
    return f"{attr} is not a number"


def _module_reason(module, spec: FormSpec) -> str:
    """Why a module of a recognised class cannot run its form's op ('' if it can)."""
    kind = spec.kind
    if kind == "torch":
        if len(module.normalized_shape) != 1:
            return "normalized over more than the last dimension"
        if module.weight is not None and _weight_reason(module):
            return _weight_reason(module)
        return _eps_reason(module, "eps", none_ok=True)
    if kind == "with_scale":
        if not isinstance(getattr(module, "with_scale", None), bool):
            return "with_scale is not a bool"
        if module.with_scale and _weight_reason(module):
            return _weight_reason(module)
    elif kind == "optional_weight_bias":
        if getattr(module, "bias", None) is not None:
            return "a bias added after the weight (x * w + b is not a form of the op)"
        if not isinstance(getattr(module, "force_float32_reductions", None), bool):
            return "force_float32_reductions is not a bool"
        if getattr(module, "weight", None) is not None and _weight_reason(module):
            return _weight_reason(module)
    elif kind != "unweighted":
        reason = _weight_reason(module)
        if reason:
            return reason
    if kind == "gated" and getattr(module, "activation", None) not in _ACT_NAMES:
        return f"gate activation {getattr(module, 'activation', None)!r} (the op takes silu and sigmoid)"
    if kind in ("gate_first", "grouped", "n_groups_gated"):
        n = getattr(module.weight, "ds_shape", module.weight.shape)[0]
        attr = "n_groups" if kind == "n_groups_gated" else "group_size"
        size = getattr(module, attr, None)
        if not (kind == "grouped" and size is None):
            if isinstance(size, bool) or not isinstance(size, int) or size <= 0 or n % size:
                return f"{attr} is not a positive divisor of the weight's width {n}"
        if kind == "n_groups_gated" and not isinstance(getattr(module, "norm_before_gate", None), bool):
            return "norm_before_gate is not a bool"
    return _eps_reason(module, spec.eps_attr)


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


class RmsNormConfig(FeatureConfig):
    """Options of the "rms_norm" feature."""

    match_forms: StrictBool = True
    """Also replace RMSNorm classes outside the built-in list (Llama, Mistral, Mixtral, Phi3,
    Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, DeepSeek-V2/V3) whose forward (and the helpers it calls,
    such as ``_norm``) compiles to exactly the bytecode of one of the known forms (the Llama form
    and its Llama 4 spelling, Gemma's ``1 + w``, the weight multiplied before the cast (OLMo 2,
    GPT-OSS, Helium), T5's, unweighted norms, xLSTM's, the gated norms of Qwen3-Next, Kimi-Linear,
    Mamba2 and Falcon-H1, and the norms with statistics over groups of columns (Mamba2's
    ``group_size``, Falcon-H1's ``n_groups``, Qwen4's grouped norm); only the epsilon attribute name
    may differ), and ``torch.nn.RMSNorm`` modules."""

    match_llama_form: StrictBool = Field(True, json_schema_extra=dict(deprecated=True, new_param="match_forms"))
    """Deprecated: the earlier name of ``match_forms`` (a value given here is taken as ``match_forms``)."""


class RmsNormFeature(ReplacementFeature):
    name = "rms_norm"
    config_model = RmsNormConfig
    opt_in = OPT_IN_MARKER
    is_replaced = staticmethod(is_replaced)
    none_found = "no supported RMSNorm modules found"
    fused_what = "the fused RMSNorm"

    def apply(self, model: torch.nn.Module, engine: Any, cfg: Any) -> FeatureReport:
        plan = _plan(model, bool(getattr(cfg, "match_forms", True)))
        replaced = _commit(plan)
        skipped = {reason: dict(c) for reason, c in plan["skipped"].items()}
        return self.replacement_report(model, replaced, plan["already"], skipped)
