"""Feature "rope": Hugging Face attention modules apply their rotary embedding with the fused op.

What is recognised is the math of the function, never a class or module name. Hugging Face
attention forwards call a module-level function (``apply_rotary_pos_emb``,
``apply_rotary_pos_emb_interleave``, ``apply_rotary_pos_emb_vision``, ...) by its global name.
Such a function is taken only when its bytecode is exactly one of the known forms (the Llama
form and its split-half / interleaved rotations, partial rotary in its four spellings, the GLM and
DeepSeek interleaved forms, the float32 forms of Cohere, ESM, Ernie and the vision towers, the
single-tensor Gemma-3n form, gpt-oss's half-width form), with its ``rotate_half`` (whatever its
name) compiled to a known rotation; local names, docstrings, comments and an unused
``position_ids`` parameter may differ. Each form maps to a :class:`~deepspeed_fused.ops.rope.RopeSpec`
whose rounding is the form's. Every other function is left to eager and reported with the reason.

How a model opts in, exactly and revertibly, although module globals are process-wide: nothing
global is replaced. For an attention class whose forward calls a recognised function, a copy of
its forward is made whose code calls that function under a private global name
(``__deepspeed_fused_rope__<name>``, added to the same module, bound to the fused call); a
decorator around the forward (``deprecate_kwarg``) is copied too, with the copied forward in its
closure. The class's ``forward`` becomes a dispatcher (installed once, kept for the life of the
process) that runs the copy for instances carrying the opt-in marker and the class's previous
forward for all others. The marker behaves like the ``rms_norm`` feature's: copies and
``nn.DataParallel`` replicas keep it, a pickle loads it as ``False``. The fused call itself runs
the kernels when the op takes the inputs, and the module's current function otherwise (with one
warning per reason), so a module global replaced later (another library's patch) is honoured
exactly as the original forward would honour it. DeepSpeed's own ``replace_rotary_pos_emb``
patch, when present, is left to it and reported.
"""
from __future__ import annotations

import builtins
import collections
import dataclasses
import dis
import functools
import inspect
import sys
import threading
import types
from typing import Any, Optional

import torch

from ..ops._common import warn_fallback
from ..ops.rope import RopeInputError, RopeSpec, rope_kernel_ok, try_fused_rope
from .base import CallCounts, Environment, Feature, FeatureConfig, FeatureReport, OptIn

MARKER = "_ds_fused_rope"  # instance attribute holding OPT_IN on opted-in modules
CALLS = "_ds_fused_rope_calls"  # instance attribute: the CallCounts of the apply that opted the module in
PREFIX = "__deepspeed_fused_rope__"  # the private global the forward's copy calls


OPT_IN = OptIn("rope")


# ----------------------------------------------------------------------------------------------
# The known forms, as templates compiled here. ``_rotate`` and ``_pair_rotate`` stand for the
# module's helpers, whose own bytecode is checked against the helper templates.
# ----------------------------------------------------------------------------------------------
def _rotate(x):  # placeholder name: a template's call of the module's rotate-half helper
    raise NotImplementedError


def _pair_rotate(x, cos, sin):  # placeholder name: gpt-oss's half-width rotation helper
    raise NotImplementedError


# rotate-half helpers -> (pairing, negate)
def _rh_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rh_half_neg(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((x2, -x1), dim=-1)


def _rh_pairs(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _rh_pairs_named(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    rot_x = torch.stack([-x2, x1], dim=-1).flatten(-2)
    return rot_x


def _rh_pairs_view(x):
    x = x.view(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(start_dim=-2)


def _rh_pairs_view_return(x):
    x = x.view(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(start_dim=-2)


def _rh_pairs_reshape(x):
    x = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


_ROTATIONS = [(_rh_half, ("half", False)), (_rh_half_neg, ("half", True)), (_rh_pairs, ("adjacent", False)),
              (_rh_pairs_named, ("adjacent", False)), (_rh_pairs_view, ("adjacent", False)),
              (_rh_pairs_view_return, ("adjacent", False)), (_rh_pairs_reshape, ("adjacent", False))]


# half-width rotation helpers (cos as wide as the number of pairs) -> pairing
def _pr_chunk(x, cos, sin):
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)


def _pr_pairs(x, cos, sin):
    first_half, second_half = x[..., ::2], x[..., 1::2]
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.stack((first_, second_), dim=-1).flatten(-2)


_PAIR_ROTATIONS = [(_pr_chunk, "half"), (_pr_pairs, "adjacent")]


# apply functions
def _t_llama(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return q_embed, k_embed


def _t_cast_back(q, k, cos, sin, unsqueeze_dim=1):
    q_type, k_type = q.dtype, k.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return q_embed.to(q_type), k_embed.to(k_type)


def _t_partial(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (_rotate(q_rot) * sin)
    k_embed = (k_rot * cos) + (_rotate(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


def _t_partial_inline(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (_rotate(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (_rotate(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def _t_partial_reuse(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rot_dim = cos.shape[-1]
    q, q_pass = q[..., :rot_dim], q[..., rot_dim:]
    k, k_pass = k[..., :rot_dim], k[..., rot_dim:]
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return torch.cat((q_embed, q_pass), dim=-1), torch.cat((k_embed, k_pass), dim=-1)


def _t_glm_partial(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (_rotate(q_rot) * sin)
    k_embed = (k_rot * cos) + (_rotate(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


def _t_glm(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return q_embed, k_embed


def _t_float_once(q, k, cos, sin, unsqueeze_dim=1):
    dtype = q.dtype
    q = q.float()
    k = k.float()
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return q_embed.to(dtype=dtype), k_embed.to(dtype=dtype)


def _t_float_each(q, k, cos, sin, unsqueeze_dim=1):
    original_dtype = q.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q.float() * cos) + (_rotate(q.float()) * sin)
    k_embed = (k.float() * cos) + (_rotate(k.float()) * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)


def _t_float_rotated(q, k, cos, sin, unsqueeze_dim=1):
    original_dtype = q.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q.float() * cos) + (_rotate(q).float() * sin)
    k_embed = (k.float() * cos) + (_rotate(k).float() * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)


def _t_glm_float(q, k, cos, sin, unsqueeze_dim=1):
    original_dtype = q.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    q_embed = (q.float() * cos) + (_rotate(q).float() * sin)
    k_embed = (k.float() * cos) + (_rotate(k).float() * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)


def _t_float_all(q, k, cos, sin, unsqueeze_dim=1):
    origin_dtype = q.dtype
    q, k = q.float(), k.float()
    cos = cos.unsqueeze(unsqueeze_dim).float()
    sin = sin.unsqueeze(unsqueeze_dim).float()
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return q_embed.to(origin_dtype), k_embed.to(origin_dtype)


def _t_vision(q, k, cos, sin):
    orig_q_dtype = q.dtype
    orig_k_dtype = k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    q_embed = q_embed.to(orig_q_dtype)
    k_embed = k_embed.to(orig_k_dtype)
    return q_embed, k_embed


def _t_vision_return(q, k, cos, sin):
    orig_q_dtype = q.dtype
    orig_k_dtype = k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return q_embed.to(orig_q_dtype), k_embed.to(orig_k_dtype)


def _t_deinterleave(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed


def _t_single(x, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (x * cos) + (_rotate(x) * sin)


def _t_half_width(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = _pair_rotate(q, cos, sin)
    k_embed = _pair_rotate(k, cos, sin)
    return q_embed, k_embed


@dataclasses.dataclass(frozen=True)
class Form:
    """A recognised function: its form's name, the spec it computes, how it is called."""

    name: str
    spec: RopeSpec
    single: bool = False  # one tensor (x, cos, sin[, unsqueeze_dim])
    unsqueeze_dim: Optional[int] = None  # fixed (no parameter), else read from the call
    params: tuple = ()  # the function's parameter names
    roles: tuple = ()  # the role of each: q, k, x, cos, sin, ud, pid
    helpers: tuple = ()  # (global name, function) of the helpers it calls (rotate_half), as recognised

    def describe(self) -> str:
        s = self.spec
        rot = "interleaved" if s.pairing == "adjacent" else ("split-half, negated" if s.negate else "split-half")
        parts = [rot]
        if s.angles != "position":
            parts.append("pair angles")
        if s.output == "halves":
            parts.append("de-interleaving")
        if s.partial:
            parts.append("partial")
        if s.compute == "float32":
            parts.append("float32")
        return f"{self.name} ({', '.join(parts)})"


_Q = ("q", "k", "cos", "sin", "ud")
# template, form name, spec fields (the rotation's pairing/negate are added), roles, helper needed,
# rotations allowed ("adjacent": interleaved only)
_FORMS = [
    (_t_llama, "llama", {}, _Q, "rotate", None),
    (_t_cast_back, "llama-cast-back", dict(out_dtype="input"), _Q, "rotate", None),
    (_t_partial, "partial", dict(partial=True), _Q, "rotate", None),
    (_t_partial_inline, "partial", dict(partial=True), _Q, "rotate", None),
    (_t_partial_reuse, "partial", dict(partial=True), _Q, "rotate", None),
    (_t_glm_partial, "glm-partial", dict(angles="pair_half", partial=True), _Q, "rotate", "adjacent"),
    (_t_glm, "glm", dict(angles="pair_half"), _Q, "rotate", "adjacent"),
    (_t_float_once, "float32", dict(compute="float32", out_dtype="input", grad_accum="compute"), _Q, "rotate", None),
    (_t_float_each, "float32-each", dict(compute="float32", out_dtype="input"), _Q, "rotate", None),
    (_t_float_rotated, "float32-each", dict(compute="float32", out_dtype="input"), _Q, "rotate", None),
    (_t_glm_float, "glm-float32", dict(angles="pair_half", compute="float32", out_dtype="input"), _Q, "rotate",
     "adjacent"),
    (_t_float_all, "float32-angles", dict(compute="float32", out_dtype="input", grad_accum="compute"), _Q, "rotate",
     None),
    (_t_vision, "vision", dict(compute="float32", out_dtype="input", grad_accum="compute"), ("q", "k", "cos", "sin"),
     "rotate", None),
    (_t_vision_return, "vision", dict(compute="float32", out_dtype="input", grad_accum="compute"),
     ("q", "k", "cos", "sin"), "rotate", None),
    (_t_deinterleave, "deinterleave", dict(pairing="adjacent", angles="pair_half", output="halves"), _Q, None, None),
    (_t_single, "single", {}, ("x", "cos", "sin", "ud"), "rotate", None),
    (_t_half_width, "half-width", dict(angles="pair"), _Q, "pair_rotate", None),
]


# ----------------------------------------------------------------------------------------------
# Bytecode normalisation
# ----------------------------------------------------------------------------------------------
_SKIP_OPS = {"CACHE", "RESUME", "NOP", "EXTENDED_ARG", "PUSH_NULL", "NOT_TAKEN"}
_NAME_OPS = {"LOAD_ATTR", "LOAD_METHOD", "LOAD_CONST", "KW_NAMES", "STORE_ATTR", "LOAD_SMALL_INT"}
_NULL_BIT_GLOBAL = sys.version_info >= (3, 11)
_NULL_BIT_ATTR = sys.version_info >= (3, 12)
_BAD_FLAGS = inspect.CO_VARARGS | inspect.CO_VARKEYWORDS | inspect.CO_GENERATOR | inspect.CO_COROUTINE \
    | inspect.CO_ASYNC_GENERATOR | inspect.CO_ITERABLE_COROUTINE
_PLACEHOLDERS = {"_rotate": "rotate", "_pair_rotate": "pair_rotate"}


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
            if name in _PLACEHOLDERS and g is globals():
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


@functools.lru_cache(maxsize=4096)
def _global_names(code) -> tuple:
    return tuple(dict.fromkeys(ins.argval for ins in dis.get_instructions(code) if ins.opname == "LOAD_GLOBAL"))


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
        return (t, t.__code__, t.__defaults__) + tuple(g.get(n, _MISSING) for n in _global_names(t.__code__))

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
    return rot, pair


@_GlobalsCache
def rotation_kind(fn) -> Optional[tuple]:
    """(pairing, negate) when ``fn`` compiles to a known rotate-half helper, else None."""
    if not _plain_function(fn) or fn.__code__.co_argcount != 1 or fn.__defaults__ \
            or fn.__globals__.get("torch") is not torch:
        return None
    norm = _normalized(fn, {fn.__code__.co_varnames[0]: "x"}, _no_helpers)
    if norm is None:
        return None
    for ops, kind in _helper_templates()[0]:
        if norm[0] == ops:
            return kind
    return None


@_GlobalsCache
def pair_rotation_kind(fn) -> Optional[str]:
    """The pairing ("half" or "adjacent") when ``fn(x, cos, sin)`` compiles to a known half-width
    rotation helper, else None."""
    if not _plain_function(fn) or fn.__code__.co_argcount != 3 or fn.__defaults__ \
            or fn.__globals__.get("torch") is not torch:
        return None
    names = fn.__code__.co_varnames[:3]
    norm = _normalized(fn, dict(zip(names, ("x", "cos", "sin"))), _no_helpers)
    if norm is None:
        return None
    for ops, kind in _helper_templates()[1]:
        if norm[0] == ops:
            return kind
    return None


def _helper_family(v) -> Optional[str]:
    if rotation_kind(v) is not None:
        return "rotate"
    if pair_rotation_kind(v) is not None:
        return "pair_rotate"
    return None


@functools.lru_cache(maxsize=None)
def _form_templates():
    out = []
    for tmpl, name, fields, roles, helper, allowed in _FORMS:
        params = tmpl.__code__.co_varnames[:tmpl.__code__.co_argcount]
        ops = _normalized(tmpl, dict(zip(params, roles)), _no_helpers)[0]
        out.append((ops, name, fields, roles, helper, allowed, tmpl.__defaults__ or ()))
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
    if "view_as_complex" in code.co_names:
        return "complex multiply (view_as_complex): its rounding is the complex kernel's, not reproduced"
    for ops, name, fields, roles, helper, allowed, defaults in _form_templates():
        for params, rmap in _role_maps(fn, roles, defaults):
            norm = _normalized(fn, dict(zip(params, rmap)), _helper_family)
            if norm is None or norm[0] != ops:
                continue
            used = norm[1]
            spec_fields = dict(fields)
            if helper == "rotate":
                kinds = {rotation_kind(v) for _, v in used}
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
            ud = -2 if "ud" not in rmap else None
            return Form(name=name, spec=RopeSpec(**spec_fields), single="x" in rmap, unsqueeze_dim=ud,
                        params=tuple(params), roles=tuple(rmap), helpers=tuple(dict(used).items()))
    why = "its bytecode matches no known RoPE form"
    rot = [n for n in code.co_names if "rotate" in n]
    for n in rot:
        v = fn.__globals__.get(n)
        if isinstance(v, types.FunctionType) and _helper_family(v) is None:
            why += f" (and its helper {n} is not a known rotation)"
            break
    return why


# ----------------------------------------------------------------------------------------------
# The fused call and the forward's copy
# ----------------------------------------------------------------------------------------------
def _make_call(g: dict, name: str, original, form: Form):
    """The function the forward's copy calls instead of ``g[name]``: the fused op when it takes
    the inputs and ``g[name]`` is still ``original``; the module's current function otherwise."""
    spec, single, fixed_ud = form.spec, form.single, form.unsqueeze_dim
    n_fast = 3 if single else 4
    default_ud = fixed_ud if fixed_ud is not None else 1  # the forms' default (checked when recognised)
    ud_name = form.params[form.roles.index("ud")] if "ud" in form.roles else None
    roles = form.roles
    helpers = form.helpers
    sig = inspect.signature(original)
    where = f"{g.get('__name__', '?')}.{name}"

    def eager(fn, args, kwargs):
        _count("eager")
        return fn(*args, **kwargs)

    def fused_call(*args, **kwargs):
        current = g.get(name)  # not a bound g.get captured once: dynamo cannot trace that
        if current is not original:  # the module's function was replaced since: call what the forward would
            return eager(current, args, kwargs)
        for hname, helper in helpers:
            if g.get(hname) is not helper:  # its rotate_half was replaced: the form's math is not known any more
                warn_fallback("rope", f"{where}: {hname} was replaced; it runs eager")
                return eager(original, args, kwargs)
        if len(args) == n_fast and (not kwargs or (len(kwargs) == 1 and ud_name in kwargs)):
            if single:
                q, cos, sin = args
                k = None
            else:
                q, k, cos, sin = args
            ud = kwargs[ud_name] if kwargs else default_ud
        else:
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return eager(original, args, kwargs)
            bound.apply_defaults()
            vals = dict(zip(roles, bound.arguments.values()))
            q = vals.get("x", vals.get("q"))
            k = vals.get("k")
            cos, sin = vals["cos"], vals["sin"]
            ud = fixed_ud if fixed_ud is not None else vals["ud"]
        try:
            out = try_fused_rope(q, k, cos, sin, ud, spec)
        except RopeInputError as e:  # not a form's input (eager raises its own error, or computes it)
            warn_fallback("rope", f"{e}; {where} runs eager")
            return eager(original, args, kwargs)
        if out is None:
            warn_fallback("rope", f"{rope_kernel_ok(q, k, cos, sin, ud, spec)[1]}; {where} runs eager")
            return eager(original, args, kwargs)
        _count("fused")
        return out

    fused_call.__qualname__ = f"deepspeed_fused_rope[{where}]"
    fused_call.__doc__ = original.__doc__
    fused_call.__ds_rope_original__ = original
    fused_call.__ds_rope_form__ = form
    return fused_call


def _install_call(g: dict, name: str, original, form: Form) -> str:
    """Bind the private global for ``g[name]`` (once per recognised function) and return its name."""
    private = PREFIX + name
    cur = g.get(private)
    if getattr(cur, "__ds_rope_original__", None) is not original or getattr(cur, "__ds_rope_form__", None) != form:
        g[private] = _make_call(g, name, original, form)
    return private


def _cell_value(cell):
    try:
        return cell.cell_contents
    except ValueError:  # empty cell
        return None


def _innermost(fwd):
    """(the function whose code is the forward's body, the chain of wrappers) or a str (why the
    chain cannot be copied): each wrapper must hold the function it wraps (``__wrapped__``) in
    exactly one cell of its closure, as ``functools.wraps`` decorators do."""
    chain = []
    fn = fwd
    for _ in range(8):
        if not isinstance(fn, types.FunctionType):
            return f"forward is not a plain function ({type(fn).__name__})"
        inner = fn.__dict__.get("__wrapped__")
        if inner is None:
            return fn, tuple(chain)
        hits = [i for i, c in enumerate(fn.__closure__ or ()) if _cell_value(c) is inner]
        if len(hits) != 1:
            return "forward is wrapped by a decorator that does not hold it in its closure"
        chain.append((fn, hits[0]))
        fn = inner
    return "forward is wrapped more than 8 times"


def _nested_uses(code, names) -> bool:
    for c in code.co_consts:
        if isinstance(c, types.CodeType) and (set(c.co_names) & names or _nested_uses(c, names)):
            return True
    return False


def _nested_forms(code, g) -> str:
    """A recognised function the nested code objects of ``code`` call, or ""."""
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            for n in c.co_names:
                if isinstance(g.get(n), types.FunctionType) and isinstance(recognise(g[n]), Form):
                    return n
            n = _nested_forms(c, g)
            if n:
                return n
    return ""


def _copy_function(fn, code=None, closure=None):
    new = types.FunctionType(code or fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__,
                             closure if closure is not None else fn.__closure__)
    new.__kwdefaults__ = fn.__kwdefaults__
    new.__dict__.update(fn.__dict__)
    new.__qualname__ = fn.__qualname__
    new.__module__ = fn.__module__
    new.__doc__ = fn.__doc__
    new.__annotations__ = dict(getattr(fn, "__annotations__", {}) or {})
    return new


def _copy_forward(fwd, renames: dict):
    """A copy of ``fwd`` (and its wrappers) whose body calls ``renames[name]`` where it called
    the global ``name``; a str when that cannot be done exactly."""
    got = _innermost(fwd)
    if isinstance(got, str):
        return got
    inner, chain = got
    code = inner.__code__
    for ins in dis.get_instructions(code):
        if ins.opcode in dis.hasname and ins.argval in renames and ins.opname != "LOAD_GLOBAL":
            return f"forward uses the name {ins.argval!r} other than as a global"
    if _nested_uses(code, set(renames)):
        return "forward calls the function from a nested function"
    names = tuple(renames.get(n, n) for n in code.co_names)
    body = _copy_function(inner, code=code.replace(co_names=names))
    for wrapper, cell_index in reversed(chain):
        cells = list(wrapper.__closure__)
        cells[cell_index] = types.CellType(body)
        body_wrapper = _copy_function(wrapper, closure=tuple(cells))
        body_wrapper.__dict__["__wrapped__"] = body
        body = body_wrapper
    return body


def _rope_globals(inner) -> dict:
    """The global functions the forward's body calls that are recognised forms, or that look like a
    rotary embedding but are not: name -> Form or reason."""
    out = {}
    g = inner.__globals__
    for ins in dis.get_instructions(inner.__code__):
        if ins.opname != "LOAD_GLOBAL" or ins.argval in out:
            continue
        v = g.get(ins.argval)
        if not isinstance(v, types.FunctionType) and not callable(v):
            continue
        low = ins.argval.lower()
        looks = "rotary" in low or "rope" in low
        if getattr(v, "_deepspeed_fused_rotary_original", None) is not None:
            out[ins.argval] = "already replaced by DeepSpeed's replace_rotary_pos_emb (left to it)"
            continue
        if not isinstance(v, types.FunctionType):
            if looks:
                out[ins.argval] = f"not a plain Python function ({type(v).__name__})"
            continue
        form = recognise(v)
        if isinstance(form, Form) or looks:
            out[ins.argval] = form
    return out


# ----------------------------------------------------------------------------------------------
# The class dispatcher and the per-instance opt-in
# ----------------------------------------------------------------------------------------------
_DISPATCHERS: dict = {}  # class -> the dispatcher installed on it (kept for the life of the process)


# The counts of the opted-in module whose forward is running, innermost last (per thread: each
# nn.DataParallel replica runs in its own): the fused call adds to them.
_ACTIVE = threading.local()


def _count(kind: str) -> None:
    if torch.compiler.is_compiling():  # the dispatcher counts traced forwards
        return
    stack = getattr(_ACTIVE, "stack", None)
    calls = stack[-1] if stack else None
    if calls is not None:
        setattr(calls, kind, getattr(calls, kind) + 1)


def _make_dispatcher(original, fused, forms: dict, g: dict):
    def forward(self, *args, **kwargs):
        if getattr(self, MARKER, None) is OPT_IN:
            calls = self.__dict__.get(CALLS)
            if torch.compiler.is_compiling():  # traced: one fused count per forward, no thread-local state
                if calls is not None:
                    calls.fused += 1
                return fused(self, *args, **kwargs)
            stack = getattr(_ACTIVE, "stack", None)
            if stack is None:
                stack = _ACTIVE.stack = []
            stack.append(calls)
            try:
                return fused(self, *args, **kwargs)
            finally:
                stack.pop()
        return original(self, *args, **kwargs)

    forward.__qualname__ = f"deepspeed_fused_rope_dispatcher[{getattr(original, '__qualname__', '?')}]"
    forward.__doc__ = getattr(original, "__doc__", None)
    forward.__wrapped__ = original  # inspect.signature reads the original's
    forward.__ds_rope__ = (original, fused, dict(forms), g)
    return forward


def _is_our_dispatcher(fn) -> bool:
    return getattr(fn, "__ds_rope__", None) is not None and any(fn is d for d in _DISPATCHERS.values())


def _live_forms(disp) -> dict:
    """name -> Form of the dispatcher's functions still in force (the module global is still the
    function recognised when the dispatcher was made)."""
    _, _, forms, g = disp.__ds_rope__
    live = {}
    for name, (original, form) in forms.items():
        if g.get(name) is original and getattr(g.get(PREFIX + name), "__ds_rope_original__", None) is original \
                and all(g.get(h) is v for h, v in form.helpers):
            live[name] = form
    return live


def _inner_or_self(fwd):
    got = _innermost(fwd)
    return got[0] if isinstance(got, tuple) else fwd


@functools.partial(_GlobalsCache, target=_inner_or_self)
def _analyse_forward(fwd):
    """('ignore', None) | ('skip', reason) | ('ok', (forms: name -> (fn, Form), refused: name -> reason))."""
    got = _innermost(fwd)
    if isinstance(got, str):
        inner = inspect.unwrap(fwd) if isinstance(fwd, types.FunctionType) else None
        if inner is None or not isinstance(inner, types.FunctionType) or not _rope_globals(inner):
            return "ignore", None
        return "skip", got
    inner, _ = got
    found = _rope_globals(inner)
    if not found:
        nested = _nested_forms(inner.__code__, inner.__globals__)
        if nested:
            return "skip", f"forward calls {nested} from a nested function"
        return "ignore", None
    forms = {n: (inner.__globals__[n], f) for n, f in found.items() if isinstance(f, Form)}
    refused = {n: r for n, r in found.items() if not isinstance(r, Form)}
    if not forms:
        n, r = next(iter(refused.items()))
        return "skip", f"{inner.__globals__.get('__name__', '?')}.{n}: {r}"
    return "ok", (forms, refused)


def _classify(module) -> tuple:
    """('replace', info) | ('already', info) | ('skip', reason) | ('ignore', None)."""
    cls = type(module)
    fwd = cls.forward
    if _is_our_dispatcher(fwd):
        live = _live_forms(fwd)
        if not live:
            return "skip", "the rotary function recognised earlier was replaced in its module"
        if "forward" in module.__dict__:
            return "skip", "forward patched on the instance"
        if module.__dict__.get(MARKER) is OPT_IN:
            return "already", live
        return "replace", (None, live, {})
    kind, info = _analyse_forward(fwd)
    if kind != "ok":
        return kind, info
    if "forward" in module.__dict__:
        return "skip", "forward patched on the instance"
    forms, refused = info
    return "replace", (fwd, {n: f for n, (_, f) in forms.items()}, refused)


def _plan(model: torch.nn.Module) -> dict:
    plan = dict(replace=[], already=collections.Counter(), skipped={}, forms={}, refused={})
    for _, module in model.named_modules():
        action, info = _classify(module)
        cname = type(module).__name__
        if action == "replace":
            plan["replace"].append(module)
            _, forms, refused = info
            for n, f in forms.items():
                plan["forms"][(cname, n)] = f.describe()
            for n, r in refused.items():
                plan["refused"][(cname, n)] = r
        elif action == "already":
            plan["already"][cname] += 1
            for n, f in info.items():
                plan["forms"][(cname, n)] = f.describe()
        elif action == "skip":
            plan["skipped"].setdefault(info, collections.Counter())[cname] += 1
    return plan


def _install(cls) -> Optional[str]:
    """Install the dispatcher on ``cls`` (once); a str when the forward cannot be copied."""
    fwd = cls.forward
    if _is_our_dispatcher(fwd):
        return None
    kind, info = _analyse_forward(fwd)
    if kind != "ok":
        return info or "nothing to patch"
    forms, _ = info
    inner, _ = _innermost(fwd)
    g = inner.__globals__
    renames = {n: _install_call(g, n, fn, form) for n, (fn, form) in forms.items()}
    fused = _copy_forward(fwd, renames)
    if isinstance(fused, str):
        return fused
    disp = _make_dispatcher(fwd, fused, {n: (fn, form) for n, (fn, form) in forms.items()}, g)
    _DISPATCHERS[cls] = disp
    cls.forward = disp
    return None


def _commit(plan: dict) -> tuple:
    replaced = collections.Counter()
    failed = {}
    for module in plan["replace"]:
        cls = type(module)
        why = _install(cls)
        if why is not None:
            failed.setdefault(why, collections.Counter())[cls.__name__] += 1
            continue
        module.__dict__[MARKER] = OPT_IN
        replaced[cls.__name__] += 1
    return replaced, failed


def replace_rope(model: torch.nn.Module) -> int:
    """Opt every attention module of ``model`` whose forward calls a recognised rotary function
    into the fused op. Returns how many modules were newly opted in."""
    return sum(_commit(_plan(model))[0].values())


def restore_rope(model: torch.nn.Module) -> int:
    """Opt the modules of ``model`` out again (they run their eager forward). Returns the count."""
    n = 0
    for module in model.modules():
        module.__dict__.pop(CALLS, None)
        if module.__dict__.get(MARKER) is OPT_IN:
            del module.__dict__[MARKER]
            n += 1
    return n


def is_replaced(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs the fused rotary embedding now (opted in, its class's dispatcher
    installed, the recognised function still its module's)."""
    fwd = type(module).forward
    return (module.__dict__.get(MARKER) is OPT_IN and "forward" not in module.__dict__ and _is_our_dispatcher(fwd)
            and bool(_live_forms(fwd)))


def coverage(module_names) -> list:
    """For each modeling module name: (module, function name, form description or None, reason):
    every module-level function whose name looks like a rotary embedding, recognised or not (the
    coverage table in docs/rope.md)."""
    import importlib

    rows = []
    for mod_name in module_names:
        try:
            mod = importlib.import_module(mod_name)
        except Exception as e:  # a module that does not import here (optional dependency)
            rows.append((mod_name, "", None, f"does not import ({type(e).__name__})"))
            continue
        for name, v in sorted(vars(mod).items()):
            if not isinstance(v, types.FunctionType) or v.__module__ != mod.__name__:
                continue
            low = name.lower()
            if not (low.startswith("apply_rotary") or low.startswith("apply_rope")):
                continue
            form = recognise(v)
            if isinstance(form, Form):
                rows.append((mod_name, name, form.describe(), ""))
            else:
                rows.append((mod_name, name, None, form))
    return rows


def _fmt(counter) -> str:
    return ", ".join(f"{n} x {c}" for c, n in sorted(counter.items()))


class RopeConfig(FeatureConfig):
    """Options of the "rope" feature (only ``enabled``: which functions qualify is read from
    their bytecode)."""


class RopeFeature(Feature):
    name = "rope"
    config_model = RopeConfig

    def is_supported(self, env: Environment) -> tuple[bool, str]:
        if not env.kernels_available:
            return False, "the fused RoPE needs Triton and a CUDA GPU (or TRITON_INTERPRET=1)"
        return True, ""

    def apply(self, model: torch.nn.Module, engine: Any, cfg: Any) -> FeatureReport:
        plan = _plan(model)
        replaced, failed = _commit(plan)
        already = plan["already"]
        skipped = {reason: dict(c) for reason, c in plan["skipped"].items()}
        for reason, c in failed.items():
            skipped.setdefault(reason, {}).update(c)
        total = collections.Counter(replaced) + already
        forms = sorted(f"{c}.{n}: {d}" for (c, n), d in plan["forms"].items() if c in total)
        notes = [f"skipped {_fmt(collections.Counter(c))}: {reason}" for reason, c in skipped.items()]
        notes += [f"{c} also calls {n}, left eager: {r}" for (c, n), r in sorted(plan["refused"].items())]
        if already:
            notes.insert(0, f"already replaced: {_fmt(already)}")
        rep = FeatureReport(name=self.name, enabled=True, applied=bool(total), where=_fmt(total),
                            details=dict(replaced=dict(replaced), already=dict(already), skipped=skipped,
                                         forms=forms))
        if total:  # fused and eager rotary calls of this model's patched modules, counted from now on
            rep.calls = CallCounts()
            for module in model.modules():
                if is_replaced(module):
                    module.__dict__[CALLS] = rep.calls
        rep.reason = "; ".join(notes) if total else \
            "; ".join(["no attention module calls a recognised rotary embedding"] + notes)
        return rep

    def revert(self, model: torch.nn.Module) -> int:
        return restore_rope(model)

    def is_applied(self, model: torch.nn.Module) -> bool:
        return any(is_replaced(m) for m in model.modules())
