"""Recognition for the ``grad_norm`` feature: the bytecode of an optimizer's
``get_grad_norm_direct`` normalised and compared with the templates of :mod:`.templates`
(:func:`recognise` -> :class:`Form` or why not).

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

from .templates import FORMS, GLOBALS

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
def _templates() -> list:
    return [(_normalized(t.__code__), t.__name__, desc) for t, desc in FORMS]


def _global_problem(g: dict) -> str:
    """'' when module globals ``g`` bind every name of :data:`.templates.GLOBALS` as expected."""
    for name, kind in GLOBALS.items():
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


def recognise(method) -> Union[Form, str]:
    """The :class:`Form` of ``method`` (an optimizer class's ``get_grad_norm_direct``), or why it
    stays as it is (a str)."""
    fn = getattr(method, "__func__", method)
    code = getattr(fn, "__code__", None)
    if code is None:
        return f"{getattr(fn, '__qualname__', fn)!s} is not a Python function"
    if fn.__closure__:
        return (f"{fn.__qualname__} is a closure (a wrapper around the method, or a method built at run time), "
                f"not a known form of DeepSpeed's ZeRO-1/2 gradient norm (plain methods)")
    norm = _normalized(code)
    for tmpl, name, desc in _templates():
        if norm == tmpl:
            problem = _global_problem(fn.__globals__)
            if problem:
                return f"{fn.__qualname__}: {problem}"
            if fn.__defaults__ != (2,):
                return f"{fn.__qualname__}: norm_type defaults to {fn.__defaults__!r}, not 2"
            return Form(template=name, description=desc)
    return (f"{fn.__qualname__} ({fn.__module__}) is not a known form of DeepSpeed's ZeRO-1/2 gradient norm "
            f"(known: {', '.join(d for _, d in FORMS)})")
