"""Recognition for the ``mlp_act`` feature: an MLP forward's bytecode normalised and compared with
the templates of :mod:`.templates` (:func:`recognise` -> :class:`Form` or why not), and an
activation module's math (:func:`activation_of` -> ``"silu"``, ``"gelu_tanh"``, ``"gelu"`` or
why not).

Normalisation: ``self`` and the input by role, other locals by order of first use, attributes
of ``self`` by order of first use (their names are the model's: they become the form's roles),
other attribute names and constants by value, globals as ``torch``, ``torch.nn`` or their name.
Anything the templates never do (jumps, imports, closures, stores to attributes) does not match.
"""
from __future__ import annotations

import dataclasses
import dis
import functools
import inspect
import sys
import types
from typing import Optional, Union

import torch

from ..base import coverage_rows
from . import templates
from .templates import ACT_FORMS, FORMS

_SKIP_OPS = {"CACHE", "RESUME", "NOP", "EXTENDED_ARG", "PUSH_NULL", "NOT_TAKEN", "PRECALL"}
_CONST_OPS = {"LOAD_CONST", "KW_NAMES", "LOAD_SMALL_INT"}
_NULL_BIT_GLOBAL = sys.version_info >= (3, 11)
_NULL_BIT_ATTR = sys.version_info >= (3, 12)
_BAD_FLAGS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS | inspect.CO_GENERATOR | inspect.CO_COROUTINE \
    | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
_JUMPS = set(dis.hasjrel) | set(dis.hasjabs)


@dataclasses.dataclass(frozen=True)
class Form:
    """A recognised MLP forward: its layout (``"split"``: separate gate and up projections,
    ``"gate_up"``: one projection, gate first, ``"up_gate"``: up first) and the names of
    ``self``'s attributes in each role (``gate``, ``up``, ``gate_up``, ``act``, ``down``)."""

    layout: str
    roles: tuple  # ((role, attribute name), ...)
    template: str

    def attr(self, role: str) -> str:
        return dict(self.roles)[role]

    def describe(self) -> str:
        r = dict(self.roles)
        if self.layout == "split":
            h = f"{r['act']}({r['gate']}(x)) * {r['up']}(x)"
            return f"{r['down']}({r['dropout']}({h}))" if "dropout" in r else f"{r['down']}({h})"
        first, second = ("gate", "up") if self.layout == "gate_up" else ("up", "gate")
        return f"{r['down']}({r['act']}(gate) * up), {first}, {second} = {r['gate_up']}(x).chunk(2, -1)"


def _normalized(fn) -> Optional[tuple]:
    """(ops, names of self's attributes in order of first use) of ``fn(self, x)``, or None."""
    code = fn.__code__
    if code.co_argcount != 2 or code.co_kwonlyargcount or code.co_flags & _BAD_FLAGS or fn.__closure__:
        return None
    params = code.co_varnames[:2]
    local_ids: dict = {}
    attrs: list = []
    g = fn.__globals__
    ops = []
    prev_self = False
    for ins in dis.get_instructions(code):
        op = ins.opname
        if op in _SKIP_OPS:
            continue
        if op == "LOAD_METHOD":
            op = "LOAD_ATTR"
        is_self = False
        if ins.opcode in _JUMPS:
            return None
        if "FAST" in op:
            val = ins.argval
            names = val if isinstance(val, tuple) else (val,)
            args = []
            for n in names:
                if n == params[0]:
                    args.append("self")
                elif n == params[1]:
                    args.append("x")
                else:
                    args.append(local_ids.setdefault(n, len(local_ids)))
            arg = tuple(args)
            is_self = op == "LOAD_FAST" and arg == ("self",)
        elif op == "LOAD_GLOBAL":
            v = g.get(ins.argval, _MISSING)
            arg = ("torch",) if v is torch else ("nn",) if v is torch.nn else ("global", ins.argval)
            arg = (arg, ins.arg & 1) if _NULL_BIT_GLOBAL else arg
        elif op == "LOAD_ATTR":
            if prev_self:
                if ins.argval not in attrs:
                    attrs.append(ins.argval)
                arg = ("self_attr", attrs.index(ins.argval))
            else:
                arg = ins.argval
            arg = (arg, ins.arg & 1) if _NULL_BIT_ATTR else arg
        elif op in _CONST_OPS:
            val = code.co_consts[ins.arg] if op == "KW_NAMES" else ins.argval
            arg = (type(val).__name__, repr(val))
        elif ins.opcode in dis.hasname or ins.opcode in dis.hasfree:
            return None  # stores to attributes or globals, imports, closures: never in a form
        else:
            arg = ins.arg
        ops.append((op, arg))
        prev_self = is_self
    return tuple(ops), tuple(attrs)


_MISSING = object()


@functools.lru_cache(maxsize=None)
def _form_templates():
    return [(_normalized(t)[0], t.__name__, layout, roles) for t, layout, roles in FORMS]


@functools.lru_cache(maxsize=None)
def _act_templates():
    return [(_normalized(t)[0], kind) for t, kind in ACT_FORMS]


def _plain(fn) -> bool:
    return isinstance(fn, types.FunctionType) and not hasattr(fn, "__wrapped__") and not fn.__kwdefaults__


@functools.lru_cache(maxsize=1024)
def _recognise_code(fn, code, defaults, nn_mod, torch_mod) -> Union[Form, str]:
    # keyed on the function, its code and defaults and its module's torch / nn (mutable globals)
    norm = _normalized(fn)
    if norm is None:
        return "its forward is not a plain (self, x) function of the known forms"
    ops, attrs = norm
    for t_ops, name, layout, roles in _form_templates():
        if ops == t_ops and len(attrs) == len(roles):
            return Form(layout=layout, roles=tuple(zip(roles, attrs)), template=name)
    return "its forward's bytecode matches no known gated-MLP form"


def recognise(fwd) -> Union[Form, str]:
    """The :class:`Form` of an MLP ``forward`` when its bytecode is one of the known forms, else a
    str saying why not."""
    if not _plain(fwd):
        return "its forward is not a plain Python function (wrapped or a builtin)"
    g = fwd.__globals__
    try:
        return _recognise_code(fwd, fwd.__code__, fwd.__defaults__, g.get("nn"), g.get("torch"))
    except TypeError:  # unhashable defaults
        return "its forward has unhashable defaults"


# ---- activations ---------------------------------------------------------------------------------
_F = torch.nn.functional


_ACT_CLASSES: dict = {}  # class -> (its forward when read, what it computes): read once per class


def _act_class_kind(cls):
    """What ``cls.forward`` computes: an activation name, "delegate" (``self.act(input)``), or None.
    A plain dict lookup after the first call (the patched forward calls this on every call, also
    while torch.compile traces it)."""
    fwd = cls.forward
    hit = _ACT_CLASSES.get(cls)
    if hit is not None and hit[0] is fwd:
        return hit[1]
    kind = None
    norm = _normalized(fwd) if _plain(fwd) else None
    if norm is not None:
        kind = next((k or "delegate" for t_ops, k in _act_templates() if norm[0] == t_ops), None)
    _ACT_CLASSES[cls] = (fwd, kind)
    return kind


def _function_kind(f) -> Optional[str]:
    """The activation of a function value (``F.silu``, ``F.gelu``, ``partial(F.gelu, approximate=...)``)."""
    if f is _F.silu:
        return "silu"
    if f is _F.gelu:
        return "gelu"
    if isinstance(f, functools.partial) and f.func is _F.gelu and not f.args:
        kw = dict(f.keywords)
        if set(kw) <= {"approximate"}:
            return {"tanh": "gelu_tanh", "none": "gelu"}.get(kw.get("approximate", "none"))
    return None


def activation_of(act) -> Union[str, tuple]:
    """``"silu"``, ``"gelu_tanh"`` or ``"gelu"`` when calling ``act`` (a module or a function)
    computes exactly that activation with torch's kernels, else ``(None, reason)``."""
    if isinstance(act, torch.nn.Module):
        d = act.__dict__
        if act._forward_hooks or act._forward_pre_hooks or "forward" in d:
            return None, f"{type(act).__name__} has hooks or a forward of its own instance"
        if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
            return None, "global module forward hooks are installed"
        cls = type(act)
        if cls is torch.nn.SiLU:
            return "silu"
        if cls is torch.nn.GELU:
            kind = {"tanh": "gelu_tanh", "none": "gelu"}.get(act.approximate)
            return kind if kind else (None, f"GELU(approximate={act.approximate!r})")
        kind = _act_class_kind(cls)
        if kind == "delegate":
            kind = _function_kind(d.get("act"))
        if kind is None:
            return None, f"{cls.__name__}: not SiLU, tanh GELU or exact GELU as torch computes them"
        return kind
    kind = _function_kind(act)
    return kind if kind else (None, f"{getattr(act, '__name__', type(act).__name__)}: not a known activation")


def coverage(module_names) -> list:
    """For each modeling module name: (module, class name, form description or None, reason) of every
    ``nn.Module`` class defined there whose name ends in ``MLP``: the coverage table of docs/mlp_act.md
    (the name only selects the rows to list; recognition reads the forward)."""
    def pick(mod, name, v):
        if not (isinstance(v, type) and issubclass(v, torch.nn.Module) and v.__module__ == mod.__name__
                and name.endswith("MLP")):
            return None
        return getattr(v.forward, "__ds_mlp_act__", (v.forward,))[0]  # the class's own forward when patched

    return coverage_rows(module_names, pick, recognise)


__all__ = ["Form", "recognise", "activation_of", "coverage", "templates"]
