"""TRL's fused LM head, served by the fused linear cross-entropy op.

TRL (``trl.trainer.utils.add_fused_lm_head``) replaces ``model.forward`` on the instance with its
own wrapper: a call with ``fused_lm_head=True`` runs the backbone and TRL's chunked log-prob head
and returns a ``FusedCausalLMOutput`` (loss, log_probs, entropy, log_sum_sq_probs, mean_logits,
is_top1, label_mask, aux_loss); a call without the flag runs the model's own forward. Every
TRL trainer (SFT, DPO, GRPO, KTO, RLOO) trains through such calls.

Here the flagged calls are answered with :func:`~deepspeed_fused.ops.linear_cross_entropy.linear_cross_entropy`:
the same output class and fields, TRL's semantics for each argument (labels with ``-100`` and
the one-token shift, ``shift_labels``, ``num_items_in_batch``, the head's temperature, soft cap
and logit scale, ``cast_lm_head_to_fp32``, the requested ``outputs``, the MoE ``aux_loss``).
Calls without the flag go to TRL's wrapper unchanged.

What TRL's head was configured with is read from TRL's public protocol, never copied: the
wrapper is recognised as the function ``add_fused_lm_head`` builds (its code object is one of
``add_fused_lm_head``'s), its settings are the values it closed over (by name), its keyword
parameters and the fields of ``FusedCausalLMOutput`` are checked against the ones known here. A
TRL whose wrapper takes another argument, closes over another setting, or whose output has
another field keeps its own head, and the feature's report says which.

TRL's transform of the logits ``x`` is ``softcap(x * scale) / temperature``; the op's is
``softcap'(x / temperature')``. They are the same function with ``temperature' = temperature /
scale`` and ``softcap' = softcap / temperature`` (a positive scale). The forward-only fields
(``log_sum_sq_probs``, ``mean_logits``, ``is_top1``) are formed by the op in the same pass as the
log-probs (``return_log_sum_sq`` / ``return_mean_logits`` / ``return_is_top1``); only where the op
cannot form them (options with a ``tp_group``: it forms them on one device only) do they come
from :func:`extra_fields`, a no-gradient pass over token chunks of the same transformed logits (at
most ``_EXTRA_BYTES`` of fp32 logits at a time).

The gradient: TRL's SFT loss ``-sum(log_probs) / num_items`` gives every labelled token the same
upstream gradient and leaves the entropy without one; GRPO, DPO and KTO weight the tokens. Which it
is is observed, not guessed from the trainer (:class:`_GradPolicy`, one per served model): while
it learns, a gradient call's log-probs and entropy pass through :class:`_ObserveUpstream`, whose
backward reads one flag (uniform over the labelled rows, no entropy gradient). Once a call showed
that (or the head is frozen and the entropy had no gradient), the next calls ask the op for
``expect_uniform_grad``: the gradients are formed in the forward (3 GEMMs instead of 4). If the op
then reports a backward it had to recompute (a call weighted after all), the mode is off again and
learning resumes; after ``_MAX_STRIKES`` non-uniform observations or recomputations in all the
model stays on the per-token path for good, with nothing more observed (a weighting trainer pays
the recomputation at most that many times, usually never).
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import sys
import types
import warnings
from contextlib import nullcontext
from typing import Optional

import torch

from ..base import CallCounts, count_op_call, op_call_mark

_SERVED = "_deepspeed_fused_trl"  # attribute of the serving function: its _Served record
_MAX_STRIKES = 2  # non-uniform upstream gradients seen (observed or reported by the op) before settling
_EXTRA_BYTES = 256 << 20  # fp32 logits per chunk of the no-gradient pass (extra fields)

# TRL's protocol as known here: the wrapper's parameters, the settings it closes over, the
# output's fields and the per-token outputs it can be asked for.
KNOWN_PARAMETERS = ("self", "args", "fused_lm_head", "labels", "shift_labels", "num_items_in_batch", "kwargs")
KNOWN_SETTINGS = ("backbone_attr", "cast_lm_head_to_fp32", "final_logit_softcapping", "logit_scale",
                  "original_forward", "outputs", "temperature", "text_config")
KNOWN_FIELDS = ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask",
                "aux_loss")
KNOWN_OUTPUTS = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
_EXTRA = ("log_sum_sq_probs", "mean_logits", "is_top1")
# the op's keyword (after ``return_``) for each, and the order it returns them in
_OP_FLAG = {"log_sum_sq_probs": "log_sum_sq", "mean_logits": "mean_logits", "is_top1": "is_top1"}
_OP_ORDER = ("mean_logits", "is_top1", "log_sum_sq_probs")


def _trl_utils():
    return sys.modules.get("trl.trainer.utils")


@dataclasses.dataclass
class TrlHead:
    """What a TRL fused head on a model was configured with (read from TRL's wrapper)."""

    temperature: float
    cast_lm_head_to_fp32: bool
    outputs: tuple
    softcap: Optional[float]
    logit_scale: float
    backbone_attr: str
    text_config: object
    output_class: type


@dataclasses.dataclass(eq=False)
class _GradPolicy:
    """Whether a served model's head asks the op for ``expect_uniform_grad`` (the gradient formed in
    the forward), from the upstream gradients its log-probs and entropy received (see the module's
    docstring). ``on``: ask; ``settled``: never again, and observe no more; ``strikes``: non-uniform
    upstream gradients seen; ``formed`` / ``recomputed``: the op's backwards under the mode by the
    way they went."""

    on: bool = False
    settled: bool = False
    strikes: int = 0
    formed: int = 0
    recomputed: int = 0

    @property
    def learning(self) -> bool:
        return not (self.on or self.settled)

    def _strike(self) -> None:
        self.on = False
        self.strikes += 1
        self.settled = self.strikes >= _MAX_STRIKES

    def observed(self, suits: Optional[bool]) -> None:
        """One learning call's backward: ``suits`` True (the mode would have been exact without
        recomputing), False (it would have recomputed), None (nothing to learn from: fewer than
        two labelled tokens, or a zero gradient)."""
        if suits is None or not self.learning:
            return
        if suits:
            self.on = True
        else:
            self._strike()

    def op_told(self, formed: bool) -> None:
        """The op's ``uniform_grad_callback``: how a backward under the mode went."""
        if formed:
            self.formed += 1
        else:
            self.recomputed += 1
            if self.on:
                self._strike()


class _ObserveUpstream(torch.autograd.Function):
    """Identity on the labelled rows' log-probs (and entropy, or None); its backward tells the
    policy whether the mode would have served this call exactly: the log-probs' upstream gradient
    is one finite nonzero value on every row (or the head is ``frozen``: dhidden alone, exact for
    any weights) and the entropy's is absent or zero. One host read (none when the answer is known
    without the values)."""

    @staticmethod
    def forward(ctx, policy, frozen, log_probs, entropy):
        ctx.set_materialize_grads(False)  # an unused output's gradient is None
        ctx.policy, ctx.frozen = policy, frozen
        return log_probs.clone(), None if entropy is None else entropy.clone()

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        ctx.policy.observed(_suits(g_lp, g_ent, ctx.frozen))
        return None, None, g_lp, g_ent


def _suits(g_lp, g_ent, frozen) -> Optional[bool]:
    """See :meth:`_GradPolicy.observed` (reads one flag vector on the host where values decide)."""
    if g_lp is None:
        return False if g_ent is not None else None
    g = g_lp.reshape(-1)
    if g_ent is None and (frozen or g.numel() < 2):
        return True if frozen else None
    flags = [(g_ent != 0).any() if g_ent is not None else torch.zeros((), dtype=torch.bool, device=g.device)]
    if not frozen and g.numel() >= 2:
        first = g[0]
        flags += [torch.isfinite(first) & (g == first).all(), first == 0]
    f = torch.stack(flags).tolist()  # the one host read
    if f[0]:
        return False  # the entropy has a gradient
    if frozen:
        return True
    if g.numel() < 2:
        return None
    uniform, zero = f[1], f[2]
    return None if (uniform and zero) else uniform


@dataclasses.dataclass(eq=False)
class _Served:
    """The record a serving forward carries: TRL's wrapper, its settings, the counts."""

    trl_forward: object  # TRL's bound wrapper (the flag-less calls and the calls kept eager go there)
    head: TrlHead
    calls: CallCounts
    options: dict  # the feature's op options (ignore_index is TRL's -100, not the section's)
    revoked: bool = False
    warned: set = dataclasses.field(default_factory=set)
    grad: _GradPolicy = dataclasses.field(default_factory=_GradPolicy)


def _trl_wrapper_codes(utils) -> tuple:
    add = getattr(utils, "add_fused_lm_head", None)
    code = getattr(add, "__code__", None)
    if code is None:
        return ()
    return tuple(c for c in code.co_consts if isinstance(c, types.CodeType))


def trl_forward_of(model):
    """TRL's fused-head wrapper installed on ``model`` (the bound method in its ``__dict__``), or
    None. A serving forward installed here is looked through (its TRL wrapper is returned)."""
    fwd = model.__dict__.get("forward")
    if fwd is None:
        return None
    rec = served(model)
    if rec is not None:
        return rec.trl_forward
    utils = _trl_utils()
    if utils is None or not isinstance(fwd, types.MethodType) or fwd.__self__ is not model:
        return None
    return fwd if fwd.__func__.__code__ in _trl_wrapper_codes(utils) else None


def served(model) -> Optional[_Served]:
    """The serving record of ``model`` when its forward is the one installed here and in force."""
    fwd = model.__dict__.get("forward")
    rec = getattr(getattr(fwd, "__func__", None), _SERVED, None)
    return rec if isinstance(rec, _Served) and not rec.revoked else None


def read_trl_head(trl_forward) -> tuple[Optional[TrlHead], str]:
    """(settings, "") of a TRL wrapper whose protocol is the one known here, else (None, why not)."""
    utils = _trl_utils()
    fn = trl_forward.__func__
    try:
        params = tuple(inspect.signature(fn, follow_wrapped=False).parameters)
    except (TypeError, ValueError) as e:
        return None, f"TRL's fused head has no readable signature ({e})"
    if params != KNOWN_PARAMETERS:
        extra = [p for p in params if p not in KNOWN_PARAMETERS] or [p for p in KNOWN_PARAMETERS if p not in params]
        return None, f"TRL's fused head takes parameters {list(params)} (unknown here: {extra})"
    names = fn.__code__.co_freevars
    unknown = [n for n in names if n not in KNOWN_SETTINGS]
    missing = [n for n in KNOWN_SETTINGS if n not in names]
    if unknown or missing:
        return None, f"TRL's fused head has settings {list(names)} (unknown here: {unknown or missing})"
    cells = dict(zip(names, (c.cell_contents for c in fn.__closure__)))
    out_cls = getattr(utils, "FusedCausalLMOutput", None)
    if out_cls is None or not dataclasses.is_dataclass(out_cls):
        return None, "trl.trainer.utils.FusedCausalLMOutput is missing"
    fields = tuple(f.name for f in dataclasses.fields(out_cls))
    if fields != KNOWN_FIELDS:
        return None, f"TRL's FusedCausalLMOutput has fields {list(fields)} (known here: {list(KNOWN_FIELDS)})"
    outputs = tuple(cells["outputs"])
    bad = [o for o in outputs if o not in KNOWN_OUTPUTS]
    if bad:
        return None, f"TRL's fused head asks for outputs {bad}, unknown here"
    head = TrlHead(temperature=cells["temperature"], cast_lm_head_to_fp32=bool(cells["cast_lm_head_to_fp32"]),
                   outputs=outputs, softcap=cells["final_logit_softcapping"], logit_scale=cells["logit_scale"],
                   backbone_attr=cells["backbone_attr"], text_config=cells["text_config"], output_class=out_cls)
    why = _settings_reason(head)
    return (None, why) if why else (head, "")


def _settings_reason(head: TrlHead) -> str:
    """Why the op cannot reproduce these settings exactly ("" if it can)."""
    for name in ("temperature", "logit_scale"):
        v = getattr(head, name)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            return f"TRL's fused head has {name}={v!r} (the fused op takes a finite value > 0)"
    c = head.softcap
    if c is not None and (isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c <= 0):
        return f"TRL's fused head has final_logit_softcapping={c!r} (the fused op takes a finite value > 0 or None)"
    return ""


def op_transform(head: TrlHead) -> tuple[float, Optional[float]]:
    """(temperature, softcap) of the op that give TRL's ``softcap(x * scale) / temperature``."""
    temperature = float(head.temperature) / float(head.logit_scale)
    softcap = None if head.softcap is None else float(head.softcap) / float(head.temperature)
    return temperature, softcap


# --------------------------------------------------------------------------------------------
# The forward-only fields where the op cannot form them: a no-gradient pass over token chunks.


def extra_fields(hidden, weight, bias, target, temperature, softcap, which) -> dict:
    """``log_sum_sq_probs`` / ``mean_logits`` / ``is_top1`` of rows ``hidden`` [M, H] against
    ``target`` [M], for the op's (temperature, softcap) transform, without gradient; the logits
    are formed in fp32 chunks of at most ``_EXTRA_BYTES``."""
    M, V = hidden.shape[0], weight.shape[0]
    res = {}
    if "log_sum_sq_probs" in which:
        res["log_sum_sq_probs"] = torch.empty(M, device=hidden.device, dtype=torch.float32)
    if "mean_logits" in which:
        res["mean_logits"] = torch.empty(M, device=hidden.device, dtype=torch.float32)
    if "is_top1" in which:
        res["is_top1"] = torch.empty(M, device=hidden.device, dtype=torch.bool)
    rows = max(1, _EXTRA_BYTES // max(1, V * 4))
    with torch.no_grad():
        for s in range(0, M, rows):
            e = min(M, s + rows)
            x = hidden[s:e] @ weight.t()
            if bias is not None:
                x = x + bias
            z = x.float() / temperature
            if softcap is not None:
                z = softcap * torch.tanh(z / softcap)
            if "log_sum_sq_probs" in res:
                res["log_sum_sq_probs"][s:e] = torch.logsumexp(2 * z, -1) - 2 * torch.logsumexp(z, -1)
            if "mean_logits" in res:
                res["mean_logits"][s:e] = z.mean(-1)
            if "is_top1" in res:
                res["is_top1"][s:e] = z.argmax(-1) == target[s:e]  # the first maximum, as TRL's
    return res


# --------------------------------------------------------------------------------------------
# The serving forward.


def _warn_once(rec: _Served, model, why: str) -> None:
    if why not in rec.warned:
        rec.warned.add(why)
        warnings.warn(f"deepspeed_fused.linear_cross_entropy: {type(model).__name__}: TRL's fused LM head kept for "
                      f"this call: {why}", RuntimeWarning, stacklevel=4)


def _call_reason(lm_head) -> str:
    """Why this call keeps TRL's head ("" when the op serves it)."""
    if type(lm_head) is not torch.nn.Linear and type(lm_head).forward is not torch.nn.Linear.forward:
        return f"the output embedding is {type(lm_head).__name__}, not nn.Linear"
    if "forward" in lm_head.__dict__:
        return "the output embedding's forward is overridden on the instance"
    dtensor = sys.modules.get("torch.distributed.tensor")
    if dtensor is not None and isinstance(lm_head.weight, getattr(dtensor, "DTensor", ())):
        return "the output embedding's weight is a DTensor (FSDP2)"
    return ""


def _aux_loss_of(model, head: TrlHead):
    """(loss function, experts, experts per token) of the MoE load-balancing loss: the model's own
    family module's ``load_balancing_loss_func`` (Mixtral's, which TRL uses and the MoE families
    share) with the config's counts; or (None, why not)."""
    fn = getattr(sys.modules.get(type(model).__module__), "load_balancing_loss_func", None)
    tc = head.text_config
    num_experts = getattr(tc, "num_experts", None)
    if num_experts is None:
        num_experts = getattr(tc, "num_local_experts", None)
    top_k = getattr(tc, "num_experts_per_tok", None)
    if fn is None:
        return None, f"{type(model).__module__} has no load_balancing_loss_func for the MoE aux_loss"
    if num_experts is None or top_k is None:
        return None, "the config has no num_experts / num_experts_per_tok for the MoE aux_loss"
    return (fn, num_experts, top_k), ""


def _run_head(lm_head, hidden, target, rec: _Served, head: TrlHead):
    """Per-token (log_probs, entropy or None, extras) of the labelled rows, by calling the head as
    a module with its forward swapped for the op (ZeRO-3's hooks gather a partitioned weight)."""
    from ...ops.linear_cross_entropy import linear_cross_entropy

    temperature, softcap = op_transform(head)
    want_entropy = "entropy" in head.outputs
    extras = tuple(o for o in _EXTRA if o in head.outputs)
    result = {}
    # the op forms the fields in its own pass, on one device; over a tensor-parallel group the
    # extra pass forms them instead
    in_op = extras if rec.options.get("tp_group") is None else ()
    flags = {"return_" + _OP_FLAG[o]: True for o in in_op}
    policy = rec.grad
    # (traced by torch.compile: neither; the op runs its per-token custom ops there)
    grads = (torch.is_grad_enabled() and rec.options.get("tp_group") is None
             and not torch.compiler.is_compiling())
    if grads and policy.on:  # the gradient formed in the forward (the op checks the assumption)
        flags.update(expect_uniform_grad=True, uniform_grad_callback=policy.op_told)

    def op_forward(h):
        w, b = lm_head.weight, lm_head.bias
        if head.cast_lm_head_to_fp32:
            h, w = h.float(), w.float()
            b = None if b is None else b.float()
        elif torch.is_autocast_enabled(h.device.type):
            dt = torch.get_autocast_dtype(h.device.type)
            h, w = h.to(dt), w.to(dt)
            b = None if b is None else b.to(dt)
        elif w.dtype != h.dtype:  # TRL's head computes in the hidden states' dtype
            w = w.to(h.dtype)
            b = None if b is None else b.to(h.dtype)
        with torch.autocast(h.device.type, enabled=False):
            out = linear_cross_entropy(h, w, target, bias=b, ignore_index=-100, reduction="none",
                                       temperature=temperature, softcap=softcap, return_entropy=want_entropy,
                                       **flags, **rec.options)
            if in_op:  # the op's order: (loss, entropy, mean_logits, is_top1, log_sum_sq_probs)
                names = [n for n in _OP_ORDER if n in in_op]
                result.update(zip(names, out[len(out) - len(names):]))
                out = out[:len(out) - len(names)]
                out = out[0] if len(out) == 1 else out
            elif extras:
                result.update(extra_fields(h.detach(), w.detach(), None if b is None else b.detach(), target,
                                           temperature, softcap, extras))
        return out

    lm_head.__dict__["forward"] = op_forward
    try:
        out = lm_head(hidden)
    finally:
        lm_head.__dict__.pop("forward", None)
    loss, entropy = (out if want_entropy else (out, None))
    log_probs = -loss
    if grads and policy.learning and log_probs.requires_grad:
        w, b = lm_head.weight, lm_head.bias
        frozen = not (w.requires_grad or (b is not None and b.requires_grad))
        log_probs, entropy = _ObserveUpstream.apply(policy, frozen, log_probs, entropy)
    return log_probs, entropy, result


def _serve(model, rec: _Served, args, kwargs, labels, shift_labels, num_items_in_batch):
    head = rec.head
    kwargs = dict(kwargs)
    kwargs["use_cache"] = False
    if getattr(head.text_config, "output_router_logits", False):
        kwargs.setdefault("output_router_logits", True)
    lm_head = model.get_output_embeddings()
    why = _call_reason(lm_head)
    aux_needed = bool(kwargs.get("output_router_logits"))
    aux = None
    if not why and aux_needed:
        aux, why = _aux_loss_of(model, head)
    if why:
        return None, why
    backbone_outputs = getattr(model, head.backbone_attr)(*args, **kwargs)
    if shift_labels is None:
        hidden = backbone_outputs.last_hidden_state[:, :-1]
        labels = labels[:, 1:]
    else:
        hidden = backbone_outputs.last_hidden_state
        labels = shift_labels
    dev = lm_head.weight.device
    hidden, labels = hidden.to(dev), labels.to(dev)
    mask = labels != -100
    log_probs, entropy, extra = _run_head(lm_head, hidden[mask], labels[mask], rec, head)

    def scatter(x):
        return x.new_zeros(mask.shape).masked_scatter(mask, x)  # stays connected when nothing is labelled

    log_probs = scatter(log_probs)
    fields = {"log_probs": log_probs, "entropy": None if entropy is None else scatter(entropy)}
    for name, x in extra.items():
        fields[name] = scatter(x)
    denom = mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
    loss = -log_probs.sum() / denom
    aux_loss = None
    if aux_needed:
        fn, num_experts, top_k = aux
        aux_loss = fn(backbone_outputs.router_logits, num_experts, top_k, kwargs.get("attention_mask"))
        loss = loss + getattr(head.text_config, "router_aux_loss_coef", 0.0) * aux_loss
    out = head.output_class(loss=loss, label_mask=mask, aux_loss=aux_loss,
                            **{n: fields.get(n) for n in KNOWN_OUTPUTS})
    return out, ""


def _make_serving_forward(trl_forward, rec: _Served):
    trl_fn = trl_forward.__func__  # called on the instance at hand (a deep copy's own, like TRL's wrapper)

    @functools.wraps(trl_fn)  # keeps TRL's signature (generate validates its kwargs against it)
    def forward(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
                **kwargs):
        if not fused_lm_head or rec.revoked:
            for k, v in (("labels", labels), ("shift_labels", shift_labels),
                         ("num_items_in_batch", num_items_in_batch)):
                if v is not None:
                    kwargs[k] = v
            return trl_fn(self, *args, fused_lm_head=fused_lm_head, **kwargs)
        mark = op_call_mark()
        out, why = _serve(self, rec, args, kwargs, labels, shift_labels, num_items_in_batch)
        if out is None:
            rec.calls.eager += 1
            _warn_once(rec, self, why)
            return trl_fn(self, *args, fused_lm_head=True, labels=labels, shift_labels=shift_labels,
                          num_items_in_batch=num_items_in_batch, **kwargs)
        count_op_call(rec.calls, mark)  # fused, or reference when the op ran its torch code
        return out

    setattr(forward, _SERVED, rec)
    return forward


def serve(model, calls: CallCounts, options: dict) -> tuple[bool, str]:
    """Serve the flagged calls of ``model``'s TRL fused head with the op. (True, "") when done (or
    already served: its counts then go to ``calls``), (False, why) when the model has no TRL head
    or TRL's protocol is not the one known here (the model keeps TRL's head)."""
    rec = served(model)
    if rec is not None:
        rec.calls = calls
        return True, ""
    trl_forward = trl_forward_of(model)
    if trl_forward is None:
        return False, "no TRL fused LM head"
    head, why = read_trl_head(trl_forward)
    if head is None:
        return False, why
    rec = _Served(trl_forward=trl_forward, head=head, calls=calls, options=dict(options))
    model.__dict__["forward"] = types.MethodType(_make_serving_forward(trl_forward, rec), model)
    return True, ""


def unserve(model) -> bool:
    """Give ``model`` back TRL's own head. True if it was served."""
    rec = served(model)
    if rec is None:
        return False
    rec.revoked = True
    model.__dict__["forward"] = rec.trl_forward
    return True


def head_text(model) -> str:
    rec = served(model)
    if rec is None:
        return ""
    h = rec.head
    parts = [f"outputs {', '.join(h.outputs)}"]
    if h.temperature != 1.0:
        parts.append(f"temperature {h.temperature:g}")
    if h.logit_scale != 1.0:
        parts.append(f"logit scale {h.logit_scale:g}")
    if h.softcap is not None:
        parts.append(f"soft cap {h.softcap:g}")
    if h.cast_lm_head_to_fp32:
        parts.append("fp32 head")
    if rec.grad.on:
        parts.append("gradient formed in the forward (uniform upstream gradient seen)")
    elif rec.grad.settled:
        parts.append("per-token gradient (weighted upstream gradient seen)")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# The feature's side: serve the heads found at apply, and those TRL adds later.

_LATE = "_deepspeed_fused_trl_late"  # model __dict__: the engine pre-hook's handle


def apply_trl(found, calls: CallCounts, options: dict, skipped: dict) -> dict:
    """Serve the TRL heads of ``found`` [(name, module)]; {class name: count served}. A head kept
    (unknown protocol) is reported in ``skipped`` with why."""
    served_counts: dict = {}
    for _, m in found:
        ok, why = serve(m, calls, options)
        if ok:
            served_counts[type(m).__name__] = served_counts.get(type(m).__name__, 0) + 1
        else:
            skipped.setdefault(type(m).__name__, f"TRL's fused LM head kept: {why}")
    return served_counts


def install_late(model, engine, calls: CallCounts, options: dict, served_counts: dict, skipped: dict) -> bool:
    """Serve a TRL head added to a language model inside ``model`` after this apply (TRL's
    ``add_fused_lm_head`` run after ``deepspeed.initialize``): a forward pre-hook on ``engine``
    (the module that calls ``model``) looks once per new instance forward, before ``model`` runs.
    ``served_counts`` / ``skipped`` (the report's) are updated in place. False when there is no
    such engine module."""
    if not isinstance(engine, torch.nn.Module) or engine is model:
        return False
    try:
        from transformers import PreTrainedModel
    except Exception:  # pragma: no cover
        return False
    lms = [m for m in model.modules() if isinstance(m, PreTrainedModel)]
    seen = {id(m): m.__dict__.get("forward") for m in lms}

    def hook(module, args):
        for m in lms:
            fwd = m.__dict__.get("forward")
            if fwd is seen[id(m)]:
                continue
            seen[id(m)] = fwd
            if fwd is None or served(m) is not None or trl_forward_of(m) is None:
                continue
            served_counts.update(apply_trl([("", m)], calls, options, skipped) or {})
            seen[id(m)] = m.__dict__.get("forward")
        return None

    model.__dict__[_LATE] = engine.register_forward_pre_hook(hook)
    return True


def late_hook(model):
    return model.__dict__.get(_LATE)


def revert_trl(model) -> int:
    """Give every served model inside ``model`` TRL's own head back and remove the engine hook."""
    handle = model.__dict__.pop(_LATE, None)
    if handle is not None:
        handle.remove()
    return sum(unserve(m) for m in model.modules())
