"""Which RMSNorm classes match a known form: bytecode normalisation, the compiled templates,
:func:`recognise` (exact instruction match of a class's forward and the helpers it calls), and
the per-module conditions under which a recognised class's module can run its form's op.
"""
from __future__ import annotations

import builtins
import dis
import functools
import sys
from typing import NamedTuple, Optional

import torch

from ..base import global_names
from .templates import TEMPLATE_SOURCES, _llama_form

SUPPORTED_CLASSES = frozenset(f"transformers.models.{m}.modeling_{m}.{c}" for m, c in [
    ("llama", "LlamaRMSNorm"), ("mistral", "MistralRMSNorm"), ("mixtral", "MixtralRMSNorm"),
    ("phi3", "Phi3RMSNorm"), ("qwen2", "Qwen2RMSNorm"), ("qwen2_moe", "Qwen2MoeRMSNorm"),
    ("qwen3", "Qwen3RMSNorm"), ("qwen3_moe", "Qwen3MoeRMSNorm"), ("deepseek_v2", "DeepseekV2RMSNorm"),
    ("deepseek_v3", "DeepseekV3RMSNorm"),
])
_EPS_ATTRS = ("variance_epsilon", "eps")

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
    for name, kind, form, fwd_src, helper_src in TEMPLATE_SOURCES:  # templates.py
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
# gate activations the op takes (the module's name -> the op's)
_ACT_NAMES = {"silu": "silu", "swish": "silu", "sigmoid": "sigmoid"}


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
