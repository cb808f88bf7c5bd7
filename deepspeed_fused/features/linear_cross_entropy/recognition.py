"""Which Hugging Face forwards the "linear_cross_entropy" feature can fuse, read from the source of
a model class's ``forward`` (its AST), and the per-call evaluation of what that reading found.

What qualifies is the math, not a class name. The forward must

* call one submodule once, ``<var> = self.<head>(x)`` (``lm_head``, ``embed_out``, ``head``,
  ``output_projection``, ``decoder``, ...; at run time it must be an ``nn.Linear`` or a DeepSpeed
  AutoTP vocabulary shard: a vocabulary projection), other uses of ``self.<head>`` being reads
  of its attributes (``self.lm_head.weight.dtype``);
* hand ``<var>`` to ``self.loss_function`` once (positionally or as ``logits=``), the call's
  other arguments not reading it;
* change ``<var>`` between the two only by upcasts and copies (``.float()``, ``.contiguous()``),
  multiplications or divisions by scalars read from the model (``self.config.logits_scaling``,
  ``self.logit_scale``, ``self.config.get_text_config().x``, a local bound once to such a value)
  and at most one ``tanh``, possibly under ``if`` conditions on such scalars. ``s * tanh(p * z)``
  is the op's ``softcap`` ``s`` after the temperature ``1 / (p * s)``, no ``tanh`` the
  temperature ``1 / p``: Cohere's ``logits * logit_scale``, Granite's ``logits / logits_scaling``,
  Gemma's ``cap * tanh(logits / cap)``, MuseSpark's both;
* after the loss, read ``<var>`` only as an output field (``logits=<var>``) or in code that the
  fused path does not run: a branch whose condition is false on it (``if not return_dict:``: the
  fused forward asks for a ModelOutput; ``if self.z_loss_coefficient > 0:`` when it is 0).

Conditions and scalars are evaluated per call from the model (``_value``: attributes, the
methods ``get_text_config``/``get_decoder``, ``getattr`` with a default, arithmetic and
comparisons; ``labels`` is known to be set and ``return_dict`` true on the fused path).
Anything else is refused with the statement that stands in the way.

The class-level entry points (:func:`causal_lm_support`, :func:`_analyze`, :func:`_is_lm_candidate`)
are at the end of this module; the fixed spellings it accepts are in :mod:`.templates`.
"""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import math
import textwrap
from typing import Optional

from .templates import _COPIES, _PURE_METHODS, _TANH

_ORIG = "_deepspeed_fused_lce_original"  # on the dispatcher: the class's original forward


@dataclasses.dataclass(frozen=True, eq=False)
class HeadSpec:
    """What the reading of a forward found (evaluated per call by ``logit_transform``/``blocked``)."""

    head: str  # self.<head>: the module whose output is the logits ("" when they come through `via`)
    var: str  # the forward's name for the logits
    steps: tuple  # (conditions, op, scalar AST): op "mul" | "div" | "tanh" (no scalar)
    blockers: tuple  # (conditions, text): reads of the logits after the loss, harmful when the conditions hold
    env: dict  # local name -> the AST of its single assignment
    params: frozenset  # the forward's parameter names
    via: str = ""  # the logits are the output of self.<via>, a model called without labels
    unless_labels: tuple = ()  # reads of the logits skipped only because labels are given (texts)


class Unsupported(Exception):
    """The forward's logits cannot be the op's at this call (the message says why)."""


class _Unknown(Exception):
    pass


_SET = object()  # `labels` on the fused path: some tensor, not None


def _src(node) -> str:
    return ast.unparse(node).splitlines()[0]


def _is_self_attr(node, name=None) -> bool:
    return (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self"
            and (name is None or node.attr == name))


def _mentions(node, var) -> bool:
    return any(isinstance(n, ast.Name) and n.id == var for n in ast.walk(node))


def _params(func) -> frozenset:
    a = func.args
    names = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
    names += [x.arg for x in (a.vararg, a.kwarg) if x is not None]
    return frozenset(names)


def _single_assignments(func) -> dict:
    """Local names bound exactly once in the forward (plain ``x = ...`` or ``(x := ...)``)."""
    count, value = {}, {}

    def bind(target, v):
        for n in ast.walk(target):
            if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                count[n.id] = count.get(n.id, 0) + 1
                value[n.id] = v if isinstance(target, ast.Name) else None

    for n in ast.walk(func):
        if isinstance(n, ast.Assign):
            for t in n.targets:
                bind(t, n.value if len(n.targets) == 1 else None)
        elif isinstance(n, (ast.AugAssign, ast.AnnAssign)):
            bind(n.target, None if isinstance(n, ast.AugAssign) else n.value)
        elif isinstance(n, ast.NamedExpr):
            bind(n.target, n.value)
        elif isinstance(n, (ast.For, ast.AsyncFor, ast.comprehension)):
            bind(n.target, None)
        elif isinstance(n, ast.withitem) and n.optional_vars is not None:
            bind(n.optional_vars, None)
        elif isinstance(n, ast.ExceptHandler) and n.name:
            count[n.name] = 2
    return {k: value[k] for k, c in count.items() if c == 1 and value.get(k) is not None}


# --------------------------------------------------------------------------------------------
# Scalars and conditions: static check (could it be evaluated from the model?) and evaluation.


_CMP = {ast.Eq: lambda a, b: a == b, ast.NotEq: lambda a, b: a != b, ast.Lt: lambda a, b: a < b,
        ast.LtE: lambda a, b: a <= b, ast.Gt: lambda a, b: a > b, ast.GtE: lambda a, b: a >= b}
_BIN = {ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b, ast.Add: lambda a, b: a + b,
        ast.Sub: lambda a, b: a - b}


def _static(node, spec_env, params, seen=()) -> str:
    """"" when ``node`` can be evaluated by ``_value`` from the model, else the part that cannot."""
    def rec(n):
        return _static(n, spec_env, params, seen)

    if isinstance(node, ast.Constant):
        return ""
    if isinstance(node, ast.Name):
        if node.id == "self" or (node.id in ("labels", "return_dict") and node.id in params):
            return ""
        if node.id in spec_env and node.id not in seen:
            return _static(spec_env[node.id], spec_env, params, seen + (node.id,))
        return node.id
    if isinstance(node, ast.Attribute):
        return rec(node.value)
    if isinstance(node, ast.NamedExpr):
        return rec(node.value)
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr in _PURE_METHODS and not node.args and not node.keywords:
            return rec(f.value)
        if (isinstance(f, ast.Name) and f.id == "getattr" and len(node.args) in (2, 3) and not node.keywords
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)):
            return rec(node.args[0]) or (rec(node.args[2]) if len(node.args) == 3 else "")
        return _src(node)
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        return rec(node.left) or rec(node.right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.Not, ast.USub, ast.UAdd)):
        return rec(node.operand)
    if isinstance(node, ast.BoolOp):
        return next((w for w in map(rec, node.values) if w), "")
    if isinstance(node, ast.Compare) and len(node.ops) == 1 and \
            isinstance(node.ops[0], (ast.Is, ast.IsNot, *_CMP)):
        return rec(node.left) or rec(node.comparators[0])
    return _src(node)


def _number(v):
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise _Unknown(f"{type(v).__name__}, not a number")
    return v


def _truth(v) -> bool:
    if v is None or isinstance(v, (bool, int, float, str)):
        return bool(v)
    raise _Unknown(f"the truth of a {type(v).__name__}")


def _value(node, model, spec: HeadSpec, depth=0):
    """Evaluate a scalar or condition of the forward against ``model`` (raises _Unknown)."""
    if depth > 32:
        raise _Unknown("nested too deep")
    ev = functools.partial(_value, model=model, spec=spec, depth=depth + 1)
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id == "self":
            return model
        if node.id == "labels" and "labels" in spec.params:
            return _SET
        if node.id == "return_dict" and "return_dict" in spec.params:
            return True  # the fused forward calls with return_dict=True
        if node.id in spec.env:
            return ev(spec.env[node.id])
        raise _Unknown(f"`{node.id}`")
    if isinstance(node, ast.NamedExpr):
        return ev(node.value)
    if isinstance(node, ast.Attribute):
        obj = ev(node.value)
        if obj is _SET:
            raise _Unknown(_src(node))
        try:
            return getattr(obj, node.attr)
        except Exception as e:
            raise _Unknown(f"`{_src(node)}` ({type(e).__name__})")
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute):
            obj = ev(f.value)
            try:
                return getattr(obj, f.attr)()
            except Exception as e:
                raise _Unknown(f"`{_src(node)}` ({type(e).__name__})")
        obj = ev(node.args[0])
        if obj is _SET:
            raise _Unknown(_src(node))
        default = ev(node.args[2]) if len(node.args) == 3 else _SET
        try:
            return getattr(obj, node.args[1].value) if default is _SET else getattr(obj, node.args[1].value, default)
        except Exception as e:
            raise _Unknown(f"`{_src(node)}` ({type(e).__name__})")
    if isinstance(node, ast.BinOp) and type(node.op) in _BIN:
        return _BIN[type(node.op)](_number(ev(node.left)), _number(ev(node.right)))
    if isinstance(node, ast.UnaryOp):
        v = ev(node.operand)
        if isinstance(node.op, ast.Not):
            return not (True if v is _SET else _truth(v))
        if isinstance(node.op, ast.USub):
            return -_number(v)
        if isinstance(node.op, ast.UAdd):
            return _number(v)
    if isinstance(node, ast.BoolOp):
        is_and = isinstance(node.op, ast.And)
        for x in node.values:
            v = ev(x)
            t = True if v is _SET else _truth(v)
            if t != is_and:
                return t
        return is_and
    if isinstance(node, ast.Compare) and len(node.ops) == 1:
        a, b, op = ev(node.left), ev(node.comparators[0]), node.ops[0]
        if isinstance(op, (ast.Is, ast.IsNot)):
            if b is not None and a is not None:
                raise _Unknown(_src(node))
            same = a is b
            return same if isinstance(op, ast.Is) else not same
        if a is _SET or b is _SET or type(op) not in _CMP:
            raise _Unknown(_src(node))
        return _CMP[type(op)](a, b)
    raise _Unknown(_src(node))


def _holds(conds, model, spec) -> bool:
    return all(_truth(v) if (v := _value(c, model, spec)) is not _SET else True for c in conds)


# --------------------------------------------------------------------------------------------
# The reading of a forward.


def _chain(expr, is_base, scalar_ok):
    """The transformations of ``expr`` over its base (a list of (op, scalar AST)), or None."""
    if is_base(expr):
        return []
    if isinstance(expr, ast.Call) and not expr.keywords:
        f = expr.func
        if isinstance(f, ast.Attribute) and f.attr in _COPIES and not expr.args:
            return _chain(f.value, is_base, scalar_ok)
        if isinstance(f, ast.Attribute) and f.attr == "tanh" and not expr.args:
            c = _chain(f.value, is_base, scalar_ok)
            return None if c is None else c + [("tanh", None)]
        if ast.unparse(f) in _TANH and len(expr.args) == 1:
            c = _chain(expr.args[0], is_base, scalar_ok)
            return None if c is None else c + [("tanh", None)]
        return None
    if isinstance(expr, ast.BinOp) and isinstance(expr.op, (ast.Mult, ast.Div)):
        op = "mul" if isinstance(expr.op, ast.Mult) else "div"
        c = _chain(expr.left, is_base, scalar_ok)
        if c is not None and scalar_ok(expr.right):
            return c + [(op, expr.right)]
        if op == "mul" and scalar_ok(expr.left):
            c = _chain(expr.right, is_base, scalar_ok)
            if c is not None:
                return c + [(op, expr.left)]
    return None


def _leaves(body, conds=()):
    """Simple statements in source order with the if-conditions they run under; compound
    statements other than ``if`` are leaves of their own."""
    for s in body:
        if isinstance(s, ast.If):
            yield from _leaves(s.body, conds + (s.test,))
            yield from _leaves(s.orelse, conds + (ast.UnaryOp(op=ast.Not(), operand=s.test),))
        else:
            yield s, conds


def _contains(stmt, node) -> bool:
    return any(n is node for n in ast.walk(stmt))


def _assigns(stmt, var) -> bool:
    targets = (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
               if isinstance(stmt, (ast.AugAssign, ast.AnnAssign, ast.For, ast.AsyncFor)) else [])
    stores = [n for t in targets for n in ast.walk(t) if isinstance(n, ast.Name) and n.id == var]
    stores += [n for n in ast.walk(stmt) if isinstance(n, ast.NamedExpr) and n.target.id == var]
    return bool(stores)


def _custom_loss_text(func) -> str:
    for n in ast.walk(func):
        if isinstance(n, ast.Call) and ast.unparse(n.func).split(".")[-1] in ("CrossEntropyLoss", "cross_entropy"):
            return _src(n)
    return ""


def read_forward(func) -> tuple[Optional[HeadSpec], str]:
    """(spec, "") when the forward's AST ``func`` qualifies, else (None, why not)."""
    params = _params(func)
    env = _single_assignments(func)
    loss_uses = [n for n in ast.walk(func) if _is_self_attr(n, "loss_function")]
    if not loss_uses:
        own = _custom_loss_text(func)
        return None, (f"forward computes its loss itself (`{own}`), not through self.loss_function "
                      "(transformers' ForCausalLMLoss)" if own else "forward does not call self.loss_function")
    calls = [n for n in ast.walk(func) if isinstance(n, ast.Call) and n.func is loss_uses[0]]
    if len(loss_uses) != 1 or len(calls) != 1:
        return None, f"forward uses self.loss_function {len(loss_uses)} times (expected one call)"
    call = calls[0]
    first = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "logits"), None)
    if not isinstance(first, ast.Name):
        return None, (f"self.loss_function is given `{_src(first)}` as its logits" if first is not None
                      else "self.loss_function is given no logits")
    var = first.id
    for a in list(call.args[1:]) + [k.value for k in call.keywords if k.value is not first]:
        if _mentions(a, var):
            return None, (f"the loss call reads the logits beyond passing them (`{_src(a)}`), which the fused "
                          "path never forms")
    leaves = list(_leaves(func.body))
    at_loss = next(i for i, (s, _) in enumerate(leaves) if _contains(s, call))
    loss_stmt, loss_conds = leaves[at_loss]
    if not isinstance(loss_stmt, (ast.Assign, ast.AugAssign, ast.AnnAssign, ast.Expr, ast.Return)):
        return None, f"the loss is computed inside a `{type(loss_stmt).__name__.lower()}` block"
    # The head: the first assignment of the logits before the loss.
    before = [(s, c) for s, c in leaves[:at_loss] if _mentions(s, var)]
    head_i = next((i for i, (s, _) in enumerate(before) if _assigns(s, var)), None)
    if head_i is None:
        return None, f"forward passes `{var}` to the loss without assigning it"
    head_stmt, head_conds = before[head_i]
    head_call = []

    def is_head(e):
        ok = (isinstance(e, ast.Call) and _is_self_attr(e.func) and len(e.args) == 1 and not e.keywords
              and not isinstance(e.args[0], ast.Starred))
        if ok:
            head_call.append(e)
        return ok

    def scalar_ok(e):
        return not _mentions(e, var) and not any(isinstance(n, ast.Call) and _is_self_attr(n.func)
                                                 and n.func.attr not in _PURE_METHODS for n in ast.walk(e)) \
            and not _static(e, env, params)

    ops, via = None, []
    simple = (isinstance(head_stmt, ast.Assign) and len(head_stmt.targets) == 1
              and isinstance(head_stmt.targets[0], ast.Name))
    if simple:
        ops = _chain(head_stmt.value, is_head, scalar_ok)
        if ops is None or not head_call:
            head_call.clear()
            ops = _chain(head_stmt.value, lambda e: _is_model_output(e, env, via), scalar_ok)
    if ops is None or not (head_call or via):
        return None, (f"the logits are not a submodule's output (self.<head>(hidden), or the logits of a model "
                      f"called without labels) changed only by scalars: `{_src(head_stmt)}`")
    head_attr = head_call[-1].func.attr if head_call else via[-1]
    if head_conds:
        return None, f"self.{head_attr} is called under a condition (`{_src(head_conds[-1])}`)"
    if head_call and (sum(1 for n in ast.walk(func) if isinstance(n, ast.Call) and n.func is not head_call[-1].func
                          and _is_self_attr(n.func, head_attr)) or _mentions(head_call[-1].args[0], var)):
        return None, f"forward calls self.{head_attr} more than once"
    for n in ast.walk(func) if head_call else ():
        if _is_self_attr(n, head_attr) and n is not head_call[-1].func:
            parent_ok = any(isinstance(p, ast.Attribute) and p.value is n for p in ast.walk(func))
            if not parent_ok:
                return None, f"forward uses self.{head_attr} other than by one call and reads of its attributes"
    if via and sum(1 for n in ast.walk(func) if isinstance(n, ast.Call) and _is_self_attr(n.func, head_attr)) != 1:
        return None, f"forward calls self.{head_attr} more than once"
    steps = [((), op, e) for op, e in ops]
    for s, conds in before[head_i + 1:]:
        step = None
        if isinstance(s, ast.Assign) and len(s.targets) == 1 and isinstance(s.targets[0], ast.Name) \
                and s.targets[0].id == var:
            step = _chain(s.value, lambda e: isinstance(e, ast.Name) and e.id == var, scalar_ok)
        elif isinstance(s, ast.AugAssign) and isinstance(s.target, ast.Name) and s.target.id == var \
                and isinstance(s.op, (ast.Mult, ast.Div)) and scalar_ok(s.value):
            step = [("mul" if isinstance(s.op, ast.Mult) else "div", s.value)]
        if step is None:
            changes = _assigns(s, var) or any(isinstance(t, ast.Subscript) and _mentions(t, var) for n in ast.walk(s)
                                              if isinstance(n, (ast.Assign, ast.AugAssign))
                                              for t in (n.targets if isinstance(n, ast.Assign) else [n.target]))
            return None, (f"forward {'changes' if changes else 'reads'} the logits before the loss: `{_src(s)}`"
                          + ("" if changes else " (the fused path never forms them)"))
        for c in conds:
            why = _static(c, env, params)
            if why:
                return None, (f"forward changes the logits under a condition read from `{why}`, not from the model: "
                              f"`if {_src(c)}:`")
        steps += [(tuple(conds), op, e) for op, e in step]
    if sum(op == "tanh" for _, op, _ in steps) > 1:
        return None, "forward applies tanh to the logits more than once"
    # After the loss: the logits only as an output field, or where the fused path does not go.
    returned = [r.value for r in ast.walk(func) if isinstance(r, ast.Return) and isinstance(r.value, ast.Call)]
    allowed = {id(k.value) for r in returned for k in r.keywords if k.arg == "logits"}  # return Output(logits=...)
    allowed.add(id(first))
    blockers, unless_labels = [], []
    probe = HeadSpec(head="", var=var, steps=(), blockers=(), env=env, params=params)
    for s, conds in leaves[at_loss:]:
        uses = [n for n in ast.walk(s) if isinstance(n, ast.Name) and n.id == var and id(n) not in allowed]
        if not uses:
            continue
        text = f"forward uses `{var}` after the loss other than in its output: `{_src(s)}`"
        for c in conds:
            why = _static(c, env, params)
            if why:
                return None, text
        try:  # decided without the model (no condition, or only on labels / return_dict)?
            if not _holds(conds, None, probe):
                if any(_mentions(c, "labels") for c in conds):
                    unless_labels.append(text)
                continue  # never runs on the fused path
            return None, text
        except _Unknown:
            blockers.append((tuple(conds), text))  # decided per call
    spec = HeadSpec(head="" if via else head_attr, var=var, steps=tuple(steps), blockers=tuple(blockers), env=env,
                    params=params, via=head_attr if via else "", unless_labels=tuple(unless_labels))
    return spec, ""


def _is_model_output(e, env, via) -> bool:
    """``out[0]`` or ``out.logits`` where ``out = self.<sub>(...)`` (keywords only, no ``labels``)."""
    if isinstance(e, ast.Subscript) and isinstance(e.slice, ast.Constant) and e.slice.value == 0:
        base = e.value
    elif isinstance(e, ast.Attribute) and e.attr == "logits":
        base = e.value
    else:
        return False
    call = env.get(base.id) if isinstance(base, ast.Name) else None
    ok = (isinstance(call, ast.Call) and _is_self_attr(call.func) and not call.args
          and all(k.arg != "labels" for k in call.keywords))
    if ok:
        via.append(call.func.attr)
    return ok


def read_class(cls, forward=None) -> tuple[Optional[HeadSpec], str]:
    fn = inspect.unwrap(forward if forward is not None else cls.forward)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError) as e:
        return None, f"forward source unavailable ({type(e).__name__})"
    func = tree.body[0]
    if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return None, "forward is not a function definition"
    return read_forward(func)


# --------------------------------------------------------------------------------------------
# Per call: what the op must do, and whether something else needs the logits.


def _cancel(num: list, den: list) -> float:
    """prod(num) / prod(den) with equal factors cancelled first (Gemma's ``/ cap ... * cap`` is 1 exactly)."""
    den = list(den)
    rest = []
    for x in num:
        if x in den:
            den.remove(x)
        else:
            rest.append(x)
    return math.prod(rest) / math.prod(den)


def locate(spec: HeadSpec, model, analyze):
    """Where the head of ``model`` is: (module holding it, its attribute name, the chain of
    (spec, module) whose steps form the logits, innermost first). ``analyze(cls)`` reads another
    class (a model whose logits the forward takes). Raises Unsupported."""
    if not spec.via:
        return model, spec.head, ((spec, model),)
    inner = model._modules.get(spec.via)
    name = f"self.{spec.via} ({type(inner).__name__})"
    ispec, why = analyze(type(inner)) if inner is not None else (None, "not a submodule")
    if ispec is None:
        raise Unsupported(f"the logits are those of {name}, whose forward does not qualify: {why}")
    if ispec.via:
        raise Unsupported(f"the logits are those of {name}, whose logits come from yet another model")
    if ispec.blockers or ispec.unless_labels:
        raise Unsupported(f"the logits are those of {name}, whose forward reads them after its loss")
    if any(_mentions(c, "labels") for conds, _, _ in ispec.steps for c in conds):
        raise Unsupported(f"the logits are those of {name}, which changes them depending on labels (given none)")
    return inner, ispec.head, ((ispec, inner), (spec, model))


def logit_transform(chain) -> tuple[float, Optional[float]]:
    """(temperature, softcap) of the op for the models' current scalars (``chain`` from ``locate``);
    raises Unsupported."""
    pre, post = ([], []), ([], [])  # (multipliers, divisors) before / after the tanh
    tanh = False
    for spec, model in chain:
        for conds, op, expr in spec.steps:
            try:
                if not _holds(conds, model, spec):
                    continue
            except _Unknown as e:
                raise Unsupported(f"cannot evaluate the condition `{_src(conds[-1])}` on the logits ({e})")
            if op == "tanh":
                if tanh:
                    raise Unsupported("the logits go through tanh twice")
                tanh = True
                continue
            try:
                v = float(_number(_value(expr, model, spec)))
            except _Unknown as e:
                raise Unsupported(f"cannot evaluate the logits' scale `{_src(expr)}` as a number ({e})")
            if not (math.isfinite(v) and v != 0):
                raise Unsupported(f"the logits are scaled by `{_src(expr)}` = {v}")
            (post if tanh else pre)[op == "div"].append(v)
    if not tanh:
        temperature, softcap = _cancel(pre[1], pre[0]), None
    else:
        softcap = _cancel(post[0], post[1])
        temperature = _cancel(pre[1] + post[1], pre[0] + post[0])
        if not softcap > 0:
            raise Unsupported(f"the soft cap's scale {softcap} is not positive")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise Unsupported(f"the logits' scale 1/{temperature} is not a positive temperature")
    return temperature, softcap


def blocked(chain) -> str:
    """Why something after the loss needs the real logits ("" when nothing does; only the outermost
    forward computes the loss, ``locate`` refuses inner forwards with blockers)."""
    spec, model = chain[-1]
    for conds, text in spec.blockers:
        try:
            if _holds(conds, model, spec):
                return text + ("" if not conds else f" (`{_src(conds[-1])}` holds)")
        except _Unknown as e:
            return f"{text} (cannot evaluate its condition: {e})"
    return ""



# --------------------------------------------------------------------------------------------
# Which classes qualify: the reading above applied to the class's original forward.


def _original_forward(cls):
    fwd = cls.forward
    return getattr(fwd, _ORIG, fwd)


@functools.lru_cache(maxsize=None)
def _analyze(cls) -> tuple[Optional[HeadSpec], str]:
    """(spec, "") when ``cls.forward`` follows the supported pattern, else (None, why not)."""
    return read_class(cls, _original_forward(cls))


def causal_lm_support(cls) -> tuple[bool, str]:
    """Whether instances of ``cls`` can take the fused loss path, and why not (from its forward's
    source: a vocabulary projection whose logits reach ``self.loss_function``; the head module,
    the loss and the scalars are checked per instance)."""
    try:
        from transformers import PreTrainedModel
    except Exception as e:  # pragma: no cover
        return False, f"transformers not importable ({e})"
    if not (isinstance(cls, type) and issubclass(cls, PreTrainedModel)):
        return False, "not a transformers PreTrainedModel"
    spec, why = _analyze(cls)
    return spec is not None, why


def _is_lm_candidate(model) -> bool:
    """A PreTrainedModel with a head: an output embedding, or a forward calling
    ``self.loss_function`` (patched, or reported with the reason it is not)."""
    try:
        from transformers import PreTrainedModel
    except Exception:  # pragma: no cover
        return False
    if not isinstance(model, PreTrainedModel):
        return False
    try:
        if model.get_output_embeddings() is not None:
            return True
    except Exception:
        pass
    return _calls_loss_function(type(model))


@functools.lru_cache(maxsize=None)
def _calls_loss_function(cls) -> bool:
    try:
        return "self.loss_function" in inspect.getsource(inspect.unwrap(_original_forward(cls)))
    except (OSError, TypeError):
        return False
