"""Recognition for the ``grad_norm`` feature: the bytecode of an optimizer's
``get_grad_norm_direct`` (:func:`recognise`) and of its overflow check and the two functions that
check calls (:func:`recognise_overflow`) normalised and compared with the templates of
:mod:`.templates` (-> :class:`Form` or why not).

Normalisation: local names by order of first use (the parameters by position), globals,
attributes and constants by name or value, jump targets by offset, nested code (the generator
expression) normalised the same way. The method's module must bind each global a template loads
to what the template means by it (:data:`.templates.GLOBALS`): the fused method calls those objects.
"""
from __future__ import annotations

import dataclasses
import dis
import functools
import math
import types
from typing import Union

import torch

from .templates import (FORMS, GLOBALS, HAS_INF_OR_NAN_FORMS, HAS_INF_OR_NAN_GLOBALS, HAS_INF_OR_NAN_STATIC_FORMS,
                        HAS_INF_OR_NAN_STATIC_GLOBALS, OVERFLOW_FORMS, OVERFLOW_GLOBALS)

_SKIP_OPS = {"CACHE", "RESUME", "NOP", "EXTENDED_ARG", "PRECALL"}


@dataclasses.dataclass(frozen=True)
class Form:
    """A recognised gradient-norm method: the template it matched and what it computes."""

    template: str
    description: str

    def describe(self) -> str:
        return self.description


def _normalized(code: types.CodeType) -> tuple:
    """``code``'s instructions as (opname, argument) with local names by first use."""
    n_params = code.co_argcount + code.co_kwonlyargcount
    locals_: dict = {n: i for i, n in enumerate(code.co_varnames[:n_params])}
    ops = []
    for ins in dis.get_instructions(code):
        op = ins.opname
        if op in _SKIP_OPS:
            continue
        if "FAST" in op or op in ("LOAD_CLOSURE", "LOAD_DEREF", "STORE_DEREF", "DELETE_DEREF"):
            val = ins.argval
            names = val if isinstance(val, tuple) else (val,)
            arg = tuple(locals_.setdefault(n, len(locals_)) for n in names)
        elif isinstance(ins.argval, types.CodeType):
            arg = ("code", _normalized(ins.argval))
        elif ins.opcode in dis.hasconst or op in ("LOAD_SMALL_INT", "KW_NAMES"):
            val = ins.argval
            arg = (type(val).__name__, repr(val))
        elif ins.opcode in dis.hasname:
            arg = (ins.argval, ins.arg & 1 if op in ("LOAD_GLOBAL", "LOAD_ATTR") else 0)
        elif ins.opcode in dis.hasjrel or ins.opcode in dis.hasjabs:
            arg = ("to", ins.argval)
        else:
            arg = ins.arg
        ops.append((op, arg))
    return tuple(ops), code.co_argcount, code.co_kwonlyargcount, code.co_flags & 0x0C


@functools.lru_cache(maxsize=None)
def _templates(kind: str) -> list:
    return [(_normalized(t.__code__), t.__name__, desc) for t, desc in _KINDS[kind][0]]


def _global_problem(g: dict, expected: dict) -> str:
    """'' when module globals ``g`` bind every name of ``expected`` as expected."""
    for name, kind in expected.items():
        v = g.get(name, g.get("__builtins__", {}).get(name) if isinstance(g.get("__builtins__"), dict) else None)
        ok = {
            "torch": v is torch,
            "inf": isinstance(v, float) and v == math.inf,
            "module": isinstance(v, types.ModuleType),
            "str": isinstance(v, str),
            "callable": callable(v),
        }[kind]
        if not ok:
            return f"its module binds {name} to {type(v).__name__}, not the {kind} the known forms use"
    return ""


def _match(fn, kind: str, what: str, defaults) -> Union[Form, str]:
    code = getattr(fn, "__code__", None)
    if code is None:
        return f"{getattr(fn, '__qualname__', fn)!s} is not a Python function"
    if fn.__closure__:
        inner = [c.cell_contents for c in fn.__closure__ if isinstance(getattr(c, "cell_contents", None),
                                                                      types.FunctionType)]
        wrapped = inner[0] if len(inner) == 1 else None
        if wrapped is not None:  # a decorator's wrapper (DeepSpeed wraps ZeRO-3's norm for NVTX ranges)
            return (f"{wrapped.__qualname__} ({wrapped.__module__}), wrapped by {fn.__qualname__}, is not a known "
                    f"form of {what} (the known forms are plain methods)")
        return (f"{fn.__qualname__} is a closure (a method built at run time), not a known form of {what} "
                f"(the known forms are plain methods)")
    norm = _normalized(code)
    forms, expected = _KINDS[kind]
    for tmpl, name, desc in _templates(kind):
        if norm == tmpl:
            problem = _global_problem(fn.__globals__, expected)
            if problem:
                return f"{fn.__qualname__}: {problem}"
            if fn.__defaults__ != defaults:
                return f"{fn.__qualname__}: its defaults are {fn.__defaults__!r}, not {defaults!r}"
            return Form(template=name, description=desc)
    return (f"{fn.__qualname__} ({fn.__module__}) is not a known form of {what} "
            f"(known: {', '.join(d for _, d in forms)})")


def recognise(method) -> Union[Form, str]:
    """The :class:`Form` of ``method`` (an optimizer class's ``get_grad_norm_direct``), or why it
    stays as it is (a str)."""
    return _match(getattr(method, "__func__", method), "norm", "DeepSpeed's ZeRO-1/2 gradient norm", (2,))


def recognise_overflow(optimizer_class) -> Union[Form, str]:
    """The :class:`Form` of ``optimizer_class``'s overflow check (its
    ``has_overflow_partitioned_grads_serial``, the ``_has_inf_or_nan`` that calls and the module
    function that calls in turn), or why it stays as it is (a str). The fused check answers "is any
    gradient element non-finite", which is what the three compute together."""
    method = getattr(optimizer_class, OVERFLOW_METHOD, None)
    if method is None:
        return f"{optimizer_class.__name__} has no {OVERFLOW_METHOD}"
    form = _match(method, "overflow", "DeepSpeed's ZeRO-1/2 overflow check", None)
    if not isinstance(form, Form):
        return form
    # the staticmethod object where the class or a base defines it
    static = next((k.__dict__["_has_inf_or_nan"] for k in optimizer_class.__mro__ if "_has_inf_or_nan" in k.__dict__),
                  None)
    if not isinstance(static, staticmethod):
        return f"{optimizer_class.__name__}._has_inf_or_nan is not a staticmethod"
    inner = _match(static.__func__, "static", "the optimizer's _has_inf_or_nan", (None,))
    if not isinstance(inner, Form):
        return inner
    leaf = static.__func__.__globals__["has_inf_or_nan"]
    leaf_form = _match(leaf, "leaf", "DeepSpeed's has_inf_or_nan", None)
    if not isinstance(leaf_form, Form):
        return leaf_form
    return form


OVERFLOW_METHOD = "has_overflow_partitioned_grads_serial"
_KINDS = {
    "norm": (FORMS, GLOBALS),
    "overflow": (OVERFLOW_FORMS, OVERFLOW_GLOBALS),
    "static": (HAS_INF_OR_NAN_STATIC_FORMS, HAS_INF_OR_NAN_STATIC_GLOBALS),
    "leaf": (HAS_INF_OR_NAN_FORMS, HAS_INF_OR_NAN_GLOBALS),
}
