"""Patching for the ``rope`` feature: the fused call a forward's copy makes, the copy of the
forward itself, the class dispatcher and the per-instance opt-in (see the package's docstring).
"""
from __future__ import annotations

import collections
import dis
import functools
import inspect
import threading
import types
from typing import Optional

import torch

from ...ops._common import warn_fallback
from ...ops.rope import RopeInputError, rope_kernel_ok, try_fused_rope
from ..base import OptInMarker
from .recognition import Form, _cell_value, _GlobalsCache, plain_function, recognise


MARKER = "_ds_fused_rope"  # instance attribute holding OPT_IN on opted-in modules
CALLS = "_ds_fused_rope_calls"  # instance attribute: the CallCounts of the apply that opted the module in
PREFIX = "__deepspeed_fused_rope__"  # the private global the forward's copy calls


OPT_IN_MARKER = OptInMarker("rope", MARKER, CALLS)
OPT_IN = OPT_IN_MARKER.value  # read by the dispatchers


# ----------------------------------------------------------------------------------------------
# The fused call and the forward's copy
# ----------------------------------------------------------------------------------------------
def _make_call(g: dict, name: str, original, form: Form):
    """The function the forward's copy calls instead of ``g[name]``: the fused op when it takes
    the inputs and ``g[name]`` is still ``original``; the module's current function otherwise."""
    spec, single, fixed_ud = form.spec, form.single, form.unsqueeze_dim
    cplx, no_k, x_dim, angle_dim = form.complex, form.no_k, form.x_dim, form.angle_dim
    n_fast = 3 if single or cplx else 4
    sin_first = form.roles.index("sin") < form.roles.index("cos") if "sin" in form.roles else False  # GPT-J
    default_ud = fixed_ud if fixed_ud is not None else 1  # the forms' default (checked when recognised)
    ud_name = form.params[form.roles.index("ud")] if "ud" in form.roles else None
    roles = form.roles
    helpers = form.helpers
    sig = inspect.signature(plain_function(original))
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
                warn_fallback("rope", f"{where}: {hname} was replaced; it runs eager", reference=False)
                return eager(original, args, kwargs)
        if len(args) == n_fast and (not kwargs or (len(kwargs) == 1 and ud_name in kwargs)):
            if cplx:
                q, k, cis = args
                cos = sin = None
            elif single:
                q, cos, sin = args if not sin_first else (args[0], args[2], args[1])
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
            cos, sin, cis = vals.get("cos"), vals.get("sin"), vals.get("cis")
            ud = fixed_ud if fixed_ud is not None else vals["ud"]
        if x_dim is not None or cplx:
            why = _fixed_dims_reason(q, k, cis if cplx else cos, x_dim, angle_dim, cplx)
            if why:  # the form indexes fixed dims, or eager's complex view would reject these: eager decides
                warn_fallback("rope", f"{why}; {where} runs eager", reference=False)
                return eager(original, args, kwargs)
            if cplx:
                ri = torch.view_as_real(cis)
                cos, sin = ri[..., 0], ri[..., 1]
        try:
            out = try_fused_rope(q, k, cos, sin, ud, spec)
        except RopeInputError as e:  # not a form's input (eager raises its own error, or computes it)
            warn_fallback("rope", f"{e}; {where} runs eager", reference=False)
            return eager(original, args, kwargs)
        if out is None:
            warn_fallback("rope", f"{rope_kernel_ok(q, k, cos, sin, ud, spec)[1]}; {where} runs eager", reference=False)
            return eager(original, args, kwargs)
        _count("fused")
        if no_k == "pair" and k is None:
            return out, None
        return out

    fused_call.__qualname__ = f"deepspeed_fused_rope[{where}]"
    fused_call.__doc__ = original.__doc__
    fused_call.__ds_rope_original__ = original
    fused_call.__ds_rope_form__ = form
    return fused_call


def _complex_view_ok(x: torch.Tensor) -> bool:
    """Whether eager's ``torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))`` takes
    ``x``: ``x.float()`` (``x`` itself in float32, else a new tensor laid out as ``empty_like``
    lays it out) must have a last stride of 1, even other strides and an even storage offset."""
    if x.dtype == torch.float32:
        strides, offset = x.stride(), x.storage_offset()
    else:
        strides, offset = torch.empty_like(x, dtype=torch.float32, device="meta").stride(), 0
    return bool(x.dim()) and strides[-1] == 1 and offset % 2 == 0 and all(st % 2 == 0 for st in strides[:-1])


def _fixed_dims_reason(q, k, angles, x_dim, angle_dim, cplx) -> str:
    """Why a call of a form that indexes fixed dims (``x[:, :, :, ::2]``, ``sin[:, :, None, :]``,
    ``.flatten(3)``) or views its pairs as complex numbers is left to eager, or ""."""
    xs = (q,) if k is None and not cplx else (q, k)  # the complex forms take k always
    if not all(isinstance(t, torch.Tensor) for t in xs + (angles,)):
        return "an argument is not a tensor"
    if x_dim is not None and any(t.dim() != x_dim for t in xs):
        return f"q/k of other than {x_dim} dims"
    if angle_dim is not None and angles.dim() != angle_dim:
        return f"angles of other than {angle_dim} dims"
    if cplx:
        if angles.dtype != torch.complex64 or angles.device != q.device:
            return f"freqs_cis of dtype {angles.dtype} on {angles.device} (the kernels take complex64 on q's device)"
        if not all(t.is_floating_point() and t.shape[-1] % 2 == 0 and _complex_view_ok(t) for t in xs):
            return "q/k that eager's complex view does not take as they are"
    return ""


def _install_call(g: dict, name: str, original, form: Form) -> str:
    """Bind the private global for ``g[name]`` (once per recognised function) and return its name."""
    private = PREFIX + name
    cur = g.get(private)
    if getattr(cur, "__ds_rope_original__", None) is not original or getattr(cur, "__ds_rope_form__", None) != form:
        g[private] = _make_call(g, name, original, form)
    return private


def _kernelized(module, funcs: dict) -> str:
    """The first name of ``funcs`` (global name -> the module global) whose call in ``module`` runs
    a hub kernel that the kernels package's ``kernelize`` selected (the module's private function
    module, under the function's ``kernel_layer_name``, has its forward replaced on the
    instance), or ""."""
    private = module.__dict__.get("_kernel_funcs")
    if not isinstance(private, dict):
        return ""
    for n, v in funcs.items():
        w = private.get(getattr(v, "__name__", None) or getattr(v, "kernel_layer_name", None))
        if isinstance(w, torch.nn.Module) and "forward" in w.__dict__:
            return n
    return ""


def _hub_reason(module, forms: dict) -> str:
    """Why ``module`` is left to a hub kernel (``forms``: global name -> (function, form), as the
    recognition and the dispatcher hold them), or "" when none of its calls runs one."""
    kernel = _kernelized(module, {n: fn for n, (fn, _) in forms.items()})
    return f"{kernel} runs a hub kernel that the kernels package's kernelize selected (left to it)" if kernel else ""


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
                fn = plain_function(g.get(n))
                if fn is not None and isinstance(recognise(fn), Form):
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


DEEPSPEED_REPLACED = "already replaced by DeepSpeed's replace_rotary_pos_emb (left to it)"


def _deepspeed_replaced(v) -> bool:
    """Whether ``v`` is DeepSpeed's ``replace_rotary_pos_emb`` replacement of a module's function."""
    return getattr(v, "_deepspeed_fused_rotary_original", None) is not None


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
        if _deepspeed_replaced(v):
            out[ins.argval] = DEEPSPEED_REPLACED
            continue
        fn = plain_function(v)
        if fn is None:
            if looks:
                out[ins.argval] = f"not a plain Python function ({type(v).__name__})"
            continue
        form = recognise(fn)
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
    # the functions that are kernels function modules: an instance whose hub kernel was selected
    # (kernelize, also after the patch) runs its own forward
    hub = {n: fn for n, (fn, _) in forms.items() if not isinstance(fn, types.FunctionType)}

    def forward(self, *args, **kwargs):
        if getattr(self, MARKER, None) is OPT_IN and not (hub and _kernelized(self, hub)):
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
            _, _, forms, g = fwd.__ds_rope__
            if any(_deepspeed_replaced(g.get(n)) for n in forms):
                return "skip", DEEPSPEED_REPLACED
            return "skip", "the rotary function recognised earlier was replaced in its module"
        if "forward" in module.__dict__:
            return "skip", "forward patched on the instance"
        why = _hub_reason(module, fwd.__ds_rope__[2])
        if why:  # the class was patched for another model; this instance runs its hub kernel
            return "skip", why
        if OPT_IN_MARKER.holds(module):
            return "already", live
        return "replace", (None, live, {})
    kind, info = _analyse_forward(fwd)
    if kind != "ok":
        return kind, info
    if "forward" in module.__dict__:
        return "skip", "forward patched on the instance"
    forms, refused = info
    why = _hub_reason(module, forms)
    if why:
        return "skip", why
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
        OPT_IN_MARKER.mark(module)
        replaced[cls.__name__] += 1
    return replaced, failed


def replace_rope(model: torch.nn.Module) -> int:
    """Opt every attention module of ``model`` whose forward calls a recognised rotary function
    into the fused op. Returns how many modules were newly opted in."""
    return sum(_commit(_plan(model))[0].values())


def restore_rope(model: torch.nn.Module) -> int:
    """Opt the modules of ``model`` out again (they run their eager forward). Returns the count."""
    return OPT_IN_MARKER.clear(model)


def is_replaced(module: torch.nn.Module) -> bool:
    """Whether ``module`` runs the fused rotary embedding now (opted in, its class's dispatcher
    installed, the recognised function still its module's)."""
    fwd = type(module).forward
    if not (OPT_IN_MARKER.holds(module) and "forward" not in module.__dict__ and _is_our_dispatcher(fwd)):
        return False
    live = _live_forms(fwd)
    g = fwd.__ds_rope__[3]
    return bool(live) and not _kernelized(module, {n: g[n] for n in live})
