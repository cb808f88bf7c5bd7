"""Recognition for the ``rope`` feature: a function's bytecode normalised and compared with the
templates of :mod:`.templates`; :func:`recognise` returns the :class:`Form` (and its
:class:`~deepspeed_fused.ops.rope.RopeSpec`) or why not; :func:`coverage` lists every rotary
function of the given modeling modules with its verdict (docs/rope.md).
"""
from __future__ import annotations

import builtins
import dataclasses
import dis
import functools
import inspect
import sys
import types
from typing import Optional

import torch

from ...ops.rope import RopeSpec
from ..base import coverage_rows, global_names
from . import templates
from .templates import _FORMS, _PAIR_ROTATIONS, _ROTATIONS, _ROTATIONS_4D


@dataclasses.dataclass(frozen=True)
class Form:
    """A recognised function: its form's name, the spec it computes, how it is called."""

    name: str
    spec: RopeSpec
    single: bool = False  # one tensor (x, cos, sin[, unsqueeze_dim])
    unsqueeze_dim: Optional[int] = None  # fixed (no parameter), else read from the call
    params: tuple = ()  # the function's parameter names
    roles: tuple = ()  # the role of each: q, k, x, cos, sin, cis, ud, pid
    helpers: tuple = ()  # (global name, function) of the helpers it calls (rotate_half), as recognised
    no_k: str = ""  # what a call with k None returns: "q" (q's result alone), "pair" ((q's result, None))
    x_dim: Optional[int] = None  # the dims q/k (x) must have: the form indexes fixed dims
    angle_dim: Optional[int] = None  # likewise for cos/sin (or freqs_cis)
    complex: bool = False  # the angles come as one complex tensor (freqs_cis): cos + i sin

    def describe(self) -> str:
        s = self.spec
        rot = "interleaved" if s.pairing == "adjacent" else ("split-half, negated" if s.negate else "split-half")
        parts = [rot]
        if s.angles != "position":
            parts.append("pair angles")
        if s.output == "halves":
            parts.append("de-interleaving")
        if s.partial:
            parts.append("partial, last columns" if s.tail else "partial")
        if s.contract == "complex":
            parts.append("complex multiply")
        if s.compute == "float32":
            parts.append("float32")
        return f"{self.name} ({', '.join(parts)})"


# ----------------------------------------------------------------------------------------------
# Bytecode normalisation
# ----------------------------------------------------------------------------------------------
_SKIP_OPS = {"CACHE", "RESUME", "NOP", "EXTENDED_ARG", "PUSH_NULL", "NOT_TAKEN"}
_NAME_OPS = {"LOAD_ATTR", "LOAD_METHOD", "LOAD_CONST", "KW_NAMES", "STORE_ATTR", "LOAD_SMALL_INT"}
_NULL_BIT_GLOBAL = sys.version_info >= (3, 11)
_NULL_BIT_ATTR = sys.version_info >= (3, 12)
_BAD_FLAGS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS | inspect.CO_GENERATOR | inspect.CO_COROUTINE \
    | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
_PLACEHOLDERS = {"_rotate": "rotate", "_pair_rotate": "pair_rotate", "_rotate4": "rotate4"}
_TEMPLATE_GLOBALS = vars(templates)  # the templates' globals: there the placeholders stand for helpers


def _const(v):
    return (type(v).__name__, repr(v))


def _normalized(fn, roles: dict, helpers) -> Optional[tuple]:
    """The instructions of ``fn``: parameters by role (``roles``: name -> role), other locals by
    order of first use, constants and attribute names by value, globals as ``torch`` or a
    helper's family (``helpers(value)`` -> family or None; template placeholders by name) or
    their name. Returns (ops, (name, helper) in order of use)."""
    code = fn.__code__
    local_ids: dict = {}
    used_helpers = []

    def local(name):
        if name in roles:
            return ("P", roles[name])
        if name not in local_ids:
            local_ids[name] = len(local_ids)
        return ("L", local_ids[name])

    g = fn.__globals__
    ops = []
    for ins in dis.get_instructions(code):
        op = ins.opname
        if op in _SKIP_OPS:
            continue
        if op == "LOAD_METHOD":
            op = "LOAD_ATTR"
        if "FAST" in op:
            val = ins.argval
            arg = tuple(local(n) for n in val) if isinstance(val, tuple) else local(val)
        elif op == "LOAD_GLOBAL":
            name = ins.argval
            if name in _PLACEHOLDERS and g is _TEMPLATE_GLOBALS:
                arg = ("helper", _PLACEHOLDERS[name])
            else:
                v = g.get(name, getattr(builtins, name, None))
                fam = helpers(v) if isinstance(v, types.FunctionType) else None
                if v is torch:
                    arg = ("torch",)
                elif fam is not None:
                    arg = ("helper", fam)
                    used_helpers.append((name, v))
                else:
                    arg = ("global", name)
            arg = (arg, ins.arg & 1) if _NULL_BIT_GLOBAL else arg
        elif op in _NAME_OPS:
            val = code.co_consts[ins.arg] if op == "KW_NAMES" else ins.argval  # dis shows KW_NAMES as <unknown>
            arg = _const(val) if op in ("LOAD_CONST", "KW_NAMES", "LOAD_SMALL_INT") else val
            if op == "LOAD_ATTR" and _NULL_BIT_ATTR:
                arg = (arg, ins.arg & 1)
        elif ins.opcode in dis.hasname or ins.opcode in dis.hasfree:
            return None  # names or closures the forms never use (imports, cells)
        else:
            arg = ins.arg
        ops.append((op, arg))
    return tuple(ops), tuple(used_helpers)


_MISSING = object()


class _GlobalsCache:
    """Results that depend on a function's code and on the current values of the globals it
    reads (module globals are mutable: another library may replace ``rotate_half`` or
    ``apply_rotary_pos_emb``): an entry is reused only while the code, the defaults and every one
    of those values are the same objects as when it was computed. ``target(fn)`` names the
    function whose globals count (default ``fn``)."""

    def __init__(self, compute, target=None):
        self.compute, self.target, self.entries = compute, target, {}
        functools.update_wrapper(self, compute)

    def snapshot(self, fn) -> tuple:
        t = self.target(fn) if self.target is not None else fn
        if not isinstance(t, types.FunctionType):
            return (t,)
        g = t.__globals__
        return (t, t.__code__, t.__defaults__) + tuple(g.get(n, _MISSING) for n in global_names(t.__code__))

    def __call__(self, fn):
        try:
            snap = self.snapshot(fn)
            entry = self.entries.get(fn)
        except TypeError:  # unhashable
            return self.compute(fn)
        if entry is not None and len(entry[0]) == len(snap) and all(a is b for a, b in zip(entry[0], snap)):
            return entry[1]
        result = self.compute(fn)
        if len(self.entries) > 4096:
            self.entries.clear()
        self.entries[fn] = (snap, result)
        return result

    def cache_clear(self) -> None:
        self.entries.clear()


def _plain_function(fn) -> bool:
    code = getattr(fn, "__code__", None)
    return (isinstance(fn, types.FunctionType) and code is not None and not code.co_flags & _BAD_FLAGS
            and not code.co_kwonlyargcount and not fn.__closure__ and not fn.__kwdefaults__
            and not hasattr(fn, "__wrapped__"))


def _no_helpers(v):
    return None


@functools.lru_cache(maxsize=None)
def _helper_templates():
    rot = [(_normalized(t, {"x": "x"}, _no_helpers)[0], kind) for t, kind in _ROTATIONS]
    pair = [(_normalized(t, {"x": "x", "cos": "cos", "sin": "sin"}, _no_helpers)[0], kind)
            for t, kind in _PAIR_ROTATIONS]
    rot4 = [(_normalized(t, {"x": "x"}, _no_helpers)[0], kind) for t, kind in _ROTATIONS_4D]
    return rot, pair, rot4


def _match_helper(fn, params: tuple, which: int):
    """The kind of helper template ``which`` (0: rotate-half, 1: half-width rotation, 2: a rotate-half
    of 4-D tensors only) that ``fn``
    compiles to, with its positional arguments named ``params`` (a plain function of exactly those,
    no defaults, its module's ``torch`` torch's own), else None."""
    if not _plain_function(fn) or fn.__code__.co_argcount != len(params) or fn.__defaults__ \
            or fn.__globals__.get("torch") is not torch:
        return None
    norm = _normalized(fn, dict(zip(fn.__code__.co_varnames[:len(params)], params)), _no_helpers)
    if norm is None:
        return None
    return next((kind for ops, kind in _helper_templates()[which] if norm[0] == ops), None)


@_GlobalsCache
def rotation_kind(fn) -> Optional[tuple]:
    """(pairing, negate) when ``fn`` compiles to a known rotate-half helper, else None."""
    return _match_helper(fn, ("x",), 0)


@_GlobalsCache
def rotation4_kind(fn) -> Optional[tuple]:
    """(pairing, negate) when ``fn`` compiles to a known rotate-half helper that indexes exactly four
    dims (GPT-J's ``rotate_every_two``: ``x[:, :, :, ::2]``), else None."""
    return _match_helper(fn, ("x",), 2)


@_GlobalsCache
def pair_rotation_kind(fn) -> Optional[str]:
    """The pairing ("half" or "adjacent") when ``fn(x, cos, sin)`` compiles to a known half-width
    rotation helper, else None."""
    return _match_helper(fn, ("x", "cos", "sin"), 1)


def _helper_family(v) -> Optional[str]:
    if rotation_kind(v) is not None:
        return "rotate"
    if pair_rotation_kind(v) is not None:
        return "pair_rotate"
    if rotation4_kind(v) is not None:
        return "rotate4"
    return None


@functools.lru_cache(maxsize=None)
def _form_templates():
    out = []
    for tmpl, name, fields, roles, helper, allowed, *extra in _FORMS:
        params = tmpl.__code__.co_varnames[:tmpl.__code__.co_argcount]
        ops = _normalized(tmpl, dict(zip(params, roles)), _no_helpers)[0]
        out.append((ops, name, fields, roles, helper, allowed, tmpl.__defaults__ or (), extra[0] if extra else {}))
    return out


def _role_maps(fn, roles: tuple, defaults: tuple):
    """Ways ``fn``'s parameters can take a template's roles: as they are, or with an unused
    ``position_ids=None`` before ``unsqueeze_dim`` (Hugging Face keeps it in some families)."""
    code = fn.__code__
    params = code.co_varnames[:code.co_argcount]
    fdefs = fn.__defaults__ or ()
    if len(params) == len(roles) and fdefs == defaults:
        yield params, roles
    if roles and roles[-1] == "ud" and len(params) == len(roles) + 1 and fdefs == (None,) + defaults:
        yield params, roles[:-1] + ("pid", "ud")


@_GlobalsCache
def recognise(fn):
    """The :class:`Form` of ``fn`` when its bytecode is one of the known forms (with known
    helpers), else a str saying why not."""
    if not isinstance(fn, types.FunctionType):
        return f"not a plain Python function ({type(fn).__name__})"
    if hasattr(fn, "__wrapped__"):
        return "wrapped by a decorator"
    if not _plain_function(fn):
        return "takes *args/**kwargs, keyword-only arguments or a closure"
    if fn.__globals__.get("torch") is not torch:
        return "its module's 'torch' is not torch"
    code = fn.__code__
    for ops, name, fields, roles, helper, allowed, defaults, extra in _form_templates():
        for params, rmap in _role_maps(fn, roles, defaults):
            norm = _normalized(fn, dict(zip(params, rmap)), _helper_family)
            if norm is None or norm[0] != ops:
                continue
            used = norm[1]
            spec_fields = dict(fields)
            if helper in ("rotate", "rotate4"):
                kinds = {(rotation_kind if helper == "rotate" else rotation4_kind)(v) for _, v in used}
                if len(kinds) != 1:
                    return "calls two different rotate-half helpers"
                pairing, negate = kinds.pop()
                if allowed and pairing != allowed:
                    return f"{name} form with a {pairing} rotate_half (angles and rotation do not pair up)"
                spec_fields.update(pairing=pairing, negate=negate)
            elif helper == "pair_rotate":
                kinds = {pair_rotation_kind(v) for _, v in used}
                if len(kinds) != 1:
                    return "calls two different rotation helpers"
                spec_fields.update(pairing=kinds.pop())
            ud = extra.get("ud", -2) if "ud" not in rmap else None
            return Form(name=name, spec=RopeSpec(**spec_fields), single="x" in rmap, unsqueeze_dim=ud,
                        params=tuple(params), roles=tuple(rmap), helpers=tuple(dict(used).items()),
                        no_k=extra.get("no_k", ""), x_dim=extra.get("x_dim"), angle_dim=extra.get("angle_dim"),
                        complex=extra.get("complex", False))
    if "view_as_complex" in code.co_names:
        return "complex multiply (view_as_complex) in no known form"
    why = "its bytecode matches no known RoPE form"
    rot = [n for n in code.co_names if "rotate" in n]
    for n in rot:
        v = fn.__globals__.get(n)
        if isinstance(v, types.FunctionType) and _helper_family(v) is None:
            why += f" (and its helper {n} is not a known rotation)"
            break
    return why


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # empty cell
        return None


def _kernels_func_target(v):
    """The plain function behind a kernels-library function module, or None. transformers 5.25
    declares ``apply_rotary_pos_emb`` for the ``kernels`` package's hub kernels
    (``use_kernel_forward_from_hub``): the module global is then an ``nn.Module`` instance (class
    ``_create_func_module.<locals>.Func``) whose forward calls the function it was made from, held
    in its closure as ``func``, unless ``kernelize`` selected a hub kernel for the calling module
    (``_kernel_funcs``; see ``patch._kernelized``)."""
    if not isinstance(v, torch.nn.Module) or type(v).__qualname__ != "_create_func_module.<locals>.Func":
        return None
    fwd = type(v).__dict__.get("forward")
    if not isinstance(fwd, types.FunctionType) or "func" not in fwd.__code__.co_freevars:
        return None
    fn = _cell_value(fwd.__closure__[fwd.__code__.co_freevars.index("func")])
    return fn if isinstance(fn, types.FunctionType) else None


def plain_function(v):
    """``v`` when it is a plain Python function, the function a kernels function module wraps, or None."""
    return v if isinstance(v, types.FunctionType) else _kernels_func_target(v)


def coverage(module_names) -> list:
    """For each modeling module name: (module, function name, form description or None, reason):
    every module-level function whose name looks like a rotary embedding, recognised or not (the
    coverage table in docs/rope.md)."""
    def pick(mod, name, v):
        v = plain_function(v)
        if v is None or v.__module__ != mod.__name__:
            return None
        low = name.lower()
        return v if low.startswith("apply_rotary") or low.startswith("apply_rope") else None

    return coverage_rows(module_names, pick, recognise)
