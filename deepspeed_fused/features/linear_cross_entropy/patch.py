"""Applying and reverting the linear_cross_entropy feature: the per-call machinery (the head's
capture, the fused loss, the AutoTP vocabulary shard), the class dispatcher and its fused forward,
and the per-instance opt-in state."""
from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import warnings
from typing import Optional

import torch

from ..base import CallCounts, reference_calls
from .clients import logits_client
from .recognition import _ORIG, HeadSpec, Unsupported, _analyze, blocked, locate, logit_transform
from .templates import _causal_lm_loss

_STATE = "_deepspeed_fused_lce"  # instance __dict__ key: the per-instance opt-in
_MISSING = object()


# --------------------------------------------------------------------------------------------
# The per-call machinery.


@dataclasses.dataclass(eq=False)
class _State:
    """What an opted-in instance carries: its options and what it did (for tests and reports).

    It keeps the class's dispatcher installed while it lives and is not revoked (``revert``
    revokes it, which also switches off shallow copies and DataParallel replicas sharing it). A
    deep copy of the model gets its own live state, so the copy stays fused when the original is
    reverted; a pickled model loads the state as ``False`` (eager until it is patched again)."""

    spec: HeadSpec
    ignore_index: int
    chunk_tokens: Optional[int]
    accum_dtype: Optional[torch.dtype]
    z_loss: float
    label_smoothing: float
    validate_targets: bool
    fused_calls: int = 0  # forwards that took the fused-loss path (the op ran: its kernels or its torch reference)
    unfused_reason: str = ""
    owner: Optional[type] = dataclasses.field(default=None, repr=False)  # the patched class
    revoked: bool = False
    # forwards since applied by what ran (fused, reference, eager), shared by the instances patched in one
    # apply (the report's)
    calls: CallCounts = dataclasses.field(default_factory=CallCounts, repr=False)
    warned_no_labels: bool = False
    warned_clients: set = dataclasses.field(default_factory=set)

    def __deepcopy__(self, memo):
        import copy

        new = dataclasses.replace(self, calls=copy.deepcopy(self.calls, memo))  # the copy's report's counter
        entry = _PATCHED_CLASSES.get(self.owner)
        if not self.revoked and entry is not None:
            entry[2].add(new)
        return new

    def __reduce__(self):
        return (bool, (False,))


class _Capture:
    """Stands in for the head (``self.lm_head``) during one fused forward: records the hidden
    states and returns zero-width "logits" (any unexpected use of them fails loudly). Reads of
    other attributes (``self.lm_head.weight.dtype``) go to the real head."""

    def __init__(self, module):
        self.module = module
        self.hidden = None
        self.calls = 0

    def __call__(self, hidden, *args, **kwargs):
        if args or kwargs:
            raise TypeError("deepspeed_fused.linear_cross_entropy: the LM head called with extra arguments")
        self.calls += 1
        self.hidden = hidden
        return hidden.new_empty(hidden.shape[:-1] + (0,))

    def __getattr__(self, name):  # only for names not set in __init__
        return getattr(self.__dict__["module"], name)


@dataclasses.dataclass(frozen=True)
class _VocabShard:
    """This rank's part of a DeepSpeed AutoTP LM head split by vocabulary rows."""

    group: object  # the head's tensor-parallel process group (mp_group)
    start: int  # first global vocabulary row held here
    vocab: int  # global vocabulary size
    tp: int  # size of the group
    kind: str  # "VocabParallelLinear" (local logits) or "LinearLayer" (gathered logits)


def _vocab_shard(lm_head) -> Optional[_VocabShard]:
    """The vocabulary shard of a DeepSpeed AutoTP column-parallel LM head, else None.

    Only the exact classes whose output rows are a contiguous vocabulary block of the full head
    and whose forward is a plain column-parallel GEMM: ``VocabParallelLinear`` (rank-local logits)
    and ``LinearLayer(gather_output=True)`` (logits all-gathered). Subclasses with other layouts
    (``SubParamColumnParallel``, ``fused_LinearLayer``), row-parallel heads (``LmHeadLinearAllreduce``,
    split by hidden size) and ``LinearLayer`` without the gather (its logits are not a full head's)
    are not vocabulary shards of an LM head here."""
    layers = sys.modules.get("deepspeed.module_inject.layers")  # loaded whenever such a layer exists
    if layers is None or lm_head is None:
        return None
    cls = type(lm_head)
    if cls is getattr(layers, "VocabParallelLinear", None):
        kind = "VocabParallelLinear"
    elif cls is getattr(layers, "LinearLayer", None) and getattr(lm_head, "gather_output", False) is True:
        kind = "LinearLayer"
    else:
        return None
    group = getattr(lm_head, "mp_group", None)
    sizes = getattr(lm_head, "_partition_sizes", None)
    shape = getattr(lm_head, "_orig_weight_shape", None)
    idx = getattr(lm_head, "tp_index", None)
    if group is None or not sizes or shape is None or not isinstance(idx, int) or not 0 <= idx < len(sizes):
        return None
    if sum(sizes) != int(shape[0]):
        return None
    return _VocabShard(group=group, start=int(sum(sizes[:idx])), vocab=int(shape[0]), tp=len(sizes), kind=kind)


def _ds_vocab_parallel_loss(loss, lm_head) -> str:
    """Empty when ``loss`` is the ``VocabParallelCausalLMLoss`` DeepSpeed installs for ``lm_head``
    (which the fused path replaces), else why it is not."""
    mod = sys.modules.get("deepspeed.sequence.cross_entropy")
    cls = getattr(mod, "VocabParallelCausalLMLoss", None) if mod is not None else None
    if cls is None or type(loss) is not cls:
        return (f"lm_head is DeepSpeed's VocabParallelLinear (rank-local logits) but the model's loss_function is "
                f"{getattr(loss, '__name__', type(loss).__name__)}, not DeepSpeed's VocabParallelCausalLMLoss")
    if getattr(loss, "sp_group", None) is not None:
        return "DeepSpeed's VocabParallelCausalLMLoss also reduces over a sequence-parallel group (sp_group)"
    if getattr(loss, "tp_group", None) is not lm_head.mp_group:
        return "DeepSpeed's VocabParallelCausalLMLoss uses a different group than lm_head.mp_group"
    return ""


def _shard_text(shard: _VocabShard) -> str:
    return f"vocab-parallel over the AutoTP group (tp={shard.tp})"


def _fused_loss(model, lm_head, st: _State, cap: _Capture, counter: list, shard: Optional[_VocabShard] = None,
                transform: tuple = (1.0, None)):
    """A replacement for ``ForCausalLMLoss`` (or DeepSpeed's ``VocabParallelCausalLMLoss``) that
    runs the fused op on the captured hidden states (over ``shard.group`` for an AutoTP head)."""

    def loss_function(logits=None, labels=None, vocab_size=None, num_items_in_batch=None, ignore_index=None,
                      shift_labels=None, **kwargs):
        from ...ops.linear_cross_entropy import linear_cross_entropy

        counter[0] += 1
        hidden = cap.hidden
        if hidden is None:
            raise RuntimeError("deepspeed_fused.linear_cross_entropy: loss called before the LM head")
        ii = st.ignore_index if ignore_index is None else int(ignore_index)
        full_vocab = shard.vocab if shard is not None else lm_head.out_features
        if vocab_size is not None and int(vocab_size) != full_vocab:
            what = "the AutoTP head's global vocabulary" if shard is not None else "the head's out_features"
            raise ValueError(f"vocab_size: expected {what}={full_vocab}, got {vocab_size}")
        if shift_labels is None:
            if labels is None:
                raise ValueError("labels: expected a tensor of token ids, got None")
            # Shift so that tokens < n predict n (as ForCausalLMLoss: pad with ignore_index, drop first).
            shift_labels = torch.nn.functional.pad(labels, (0, 1), value=ii)[..., 1:]
        targets = shift_labels.reshape(-1).to(hidden.device)
        h = hidden.reshape(-1, hidden.shape[-1])
        if h.shape[0] != targets.numel():
            raise ValueError(f"labels: {targets.numel()} (shifted) labels for {h.shape[0]} positions whose logits "
                             "are kept; with logits_to_keep, labels must cover the kept positions")
        temperature, softcap = transform  # the forward's scalings of the logits (recognition.logit_transform)
        reduction = "mean" if num_items_in_batch is None else "sum"

        def head_forward(x):
            return linear_cross_entropy(
                x, lm_head.weight, targets, bias=lm_head.bias, ignore_index=ii, reduction=reduction,
                temperature=temperature, z_loss=st.z_loss, label_smoothing=st.label_smoothing,
                softcap=None if softcap is None else float(softcap), accum_dtype=st.accum_dtype,
                chunk_tokens=st.chunk_tokens, validate_targets=st.validate_targets,
                tp_group=None if shard is None else shard.group, vocab_start=None if shard is None else shard.start)

        # Call lm_head as a module (ZeRO-3 gathers its weight around the op, forward and backward).
        # For an AutoTP head this also skips its forward's ColumnParallel input wrapper (identity
        # forward, all-reduce of dhidden in backward): the op sums dhidden over the group itself.
        prev = lm_head.__dict__.get("forward", _MISSING)
        lm_head.__dict__["forward"] = head_forward
        before = None if torch.compiler.is_compiling() else reference_calls()
        try:
            loss = lm_head(h)
            counter[1] = before is not None and reference_calls() != before  # the op ran its torch reference
        finally:
            if prev is _MISSING:
                lm_head.__dict__.pop("forward", None)
            else:
                lm_head.__dict__["forward"] = prev
        if num_items_in_batch is not None:
            if torch.is_tensor(num_items_in_batch):
                num_items_in_batch = num_items_in_batch.to(loss.device)
            loss = loss / num_items_in_batch
        else:
            # Eager's mean over no labelled token is 0/0: NaN, with zero gradients. The op's mean is
            # 0 there; give the same NaN without a host sync (the gradients stay the op's zeros).
            # torch.where also makes a fresh tensor: models add the router aux loss in place.
            loss = torch.where((targets != ii).any(), loss, torch.full_like(loss, float("nan")))
        return loss

    return loss_function


def _labels_of(sig_names, args, kwargs):
    if "labels" in kwargs:
        return kwargs["labels"]
    try:
        i = sig_names.index("labels") - 1  # minus self
    except ValueError:
        return None
    return args[i] if 0 <= i < len(args) else None


def _head(model, spec: HeadSpec):
    """(module holding the head, the head's attribute name, the chain for recognition); raises Unsupported."""
    return locate(spec, model, _analyze)


def _unfused_reason(model, spec: Optional[HeadSpec] = None) -> str:
    """Why a patched instance must not fuse right now ("" when it may); ``spec``: its class's
    reading (default: the patched state's, else read now)."""
    if spec is None:
        st = fused_state(model)
        spec, why = (st.spec, "") if st is not None else _analyze(type(model))
        if spec is None:
            return why
    try:
        owner, name, chain = _head(model, spec)
        logit_transform(chain)
    except Unsupported as e:
        return str(e)
    lm_head = owner._modules.get(name)
    if owner is not model:
        name = f"{spec.via}.{name}"
    if lm_head is None:
        return f"self.{name} is not a submodule (the forward calls it as the head)"
    shard = _vocab_shard(lm_head)
    if shard is None and not isinstance(lm_head, torch.nn.Linear):
        kind = _head_kind(lm_head)
        if kind.startswith("peft's"):
            return f"self.{name} is {kind}"
        return (f"self.{name} is {kind}, not nn.Linear or a DeepSpeed AutoTP head split by "
                "vocabulary (VocabParallelLinear, LinearLayer with gather_output)")
    if shard is None and type(lm_head).forward is not torch.nn.Linear.forward:
        return (f"self.{name} is {type(lm_head).__name__}, an nn.Linear with its own forward (quantized or "
                "otherwise not x @ weight.T + bias)")
    if "forward" in lm_head.__dict__:
        return f"self.{name}.forward is overridden on the instance"
    if shard is not None and getattr(lm_head, "defer_collectives_to_compiler", False):
        return f"self.{name}'s tensor-parallel collectives are deferred to DeepSpeed's AutoTP compile pass"
    why = blocked(chain)
    if why:
        return why
    if shard is not None and shard.kind == "VocabParallelLinear":
        return _ds_vocab_parallel_loss(model.loss_function, lm_head)
    if model.loss_function is not _causal_lm_loss():
        if "_loss_function" in model.__dict__:
            return "the model's loss_function is not transformers' ForCausalLMLoss (a user's own loss is kept)"
        loss = model.loss_function
        return (f"the model's loss_function is {getattr(loss, '__name__', type(loss).__name__)} (loss_type "
                f"{getattr(model, 'loss_type', None)!r}), not transformers' ForCausalLMLoss")
    return ""


def _head_module(model):
    try:
        owner, name, _ = _head(model, fused_state(model).spec)
    except Unsupported:
        return None
    return owner._modules.get(name)


def _head_kind(lm_head) -> str:
    """What a head that is not an ``nn.Linear`` is, for the reason: peft's tuner layers (a LoRA
    ``Linear`` has the name of the class it wraps) are named with their package and base layer, and
    with what to do."""
    cls = type(lm_head)
    if cls.__module__.split(".")[0] != "peft":
        return cls.__name__
    base = getattr(lm_head, "base_layer", None)
    if base is None:
        base = getattr(lm_head, "original_module", None)  # peft's modules_to_save wrapper
    what = "peft's LoRA layer" if hasattr(lm_head, "lora_A") else "peft's wrapper"
    inner = ""
    if base is not None:
        inner = " around " + ("nn.Linear" if type(base) is torch.nn.Linear else type(base).__name__)
    return (f"{what} {cls.__module__}.{cls.__qualname__}{inner} (the fused loss takes the plain head: leave lm_head "
            "out of the adapter's target_modules and modules_to_save)")


def _trainer_cause():
    """The HF Trainer's setting that took the labels out before this forward, read from the
    calling ``Trainer.compute_loss`` frame: ("label_smoothing", epsilon) | ("compute_loss_func", fn)
    | None (not called from a Trainer that does so)."""
    trainer_mod = sys.modules.get("transformers.trainer")
    trainer_cls = getattr(trainer_mod, "Trainer", None)
    if trainer_cls is None:
        return None
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "compute_loss":
            owner = frame.f_locals.get("self")
            if isinstance(owner, trainer_cls):
                if getattr(owner, "compute_loss_func", None) is not None:
                    return ("compute_loss_func", owner.compute_loss_func)
                smoother = getattr(owner, "label_smoother", None)
                if smoother is not None:
                    return ("label_smoothing", getattr(smoother, "epsilon", None))
                return None
        frame = frame.f_back
    return None


def _mib(t) -> str:
    return f"{t.numel() * t.element_size() / 2**20:.3g} MiB"


def _warn_no_labels(model, out) -> None:
    """Once per patched model: a training-mode forward without labels ran the eager head."""
    name = type(model).__name__
    logits = out.get("logits") if isinstance(out, dict) else (out[0] if isinstance(out, tuple) and out else None)
    size = (f" ({'x'.join(map(str, logits.shape))} {str(logits.dtype).replace('torch.', '')}, {_mib(logits)} "
            "per forward, and as much again for their gradient)") if torch.is_tensor(logits) else ""
    head = (f"deepspeed_fused.linear_cross_entropy: {name} ran in training mode without labels, so the fused loss "
            f"did not run and the [tokens, vocab] logits were materialized{size}")
    cause = _trainer_cause()
    if cause is not None and cause[0] == "label_smoothing":
        eps = cause[1]
        msg = (f"{head}: the HF Trainer's label_smoothing_factor={eps} takes the labels out before the forward and "
               "smooths the loss from the logits. Set TrainingArguments(label_smoothing_factor=0) and "
               f"\"label_smoothing\": {eps} in the ds_config's deepspeed_fused.linear_cross_entropy section: the "
               "fused loss smooths as torch's cross_entropy(label_smoothing=...) does, without the logits.")
    elif cause is not None:
        fn = getattr(cause[1], "__qualname__", type(cause[1]).__name__)
        msg = (f"{head}: the HF Trainer's compute_loss_func ({fn}) takes the labels out before the forward and "
               "computes the loss from outputs.logits, which the fused path does not form. Its cost is those logits "
               "and their gradient on every step; without compute_loss_func the model's own loss runs fused (the "
               "section's z_loss and label_smoothing options cover those two variants).")
    else:
        msg = (f"{head}. Pass labels= (or the Trainer's \"labels\" column) to use the fused loss; in training mode "
               "with labels the output's logits are None. For per-token losses or entropy without logits, call "
               "deepspeed_fused.ops.linear_cross_entropy.linear_cross_entropy on the hidden states "
               "(reduction=\"none\", return_entropy=True).")
    warnings.warn(msg, RuntimeWarning, stacklevel=3)


def _fused_forward(model, st: _State, orig, args, kwargs):
    owner, name, chain = _head(model, st.spec)  # checked by _unfused_reason just before
    lm_head = owner._modules[name]
    cap, counter = _Capture(lm_head), [0, False]  # loss_function calls, whether the op ran its reference
    transform = logit_transform(chain)
    return_dict = kwargs.get("return_dict", None)
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    if not return_dict:
        kwargs = {**kwargs, "return_dict": True}
    d = model.__dict__
    prev_loss = d.get("_loss_function", _MISSING)
    owner.__dict__[name] = cap  # instance __dict__ wins over nn.Module.__getattr__ (the real one stays in _modules)
    d["_loss_function"] = _fused_loss(model, lm_head, st, cap, counter, _vocab_shard(lm_head), transform)
    try:
        out = orig(model, *args, **kwargs)
    finally:
        owner.__dict__.pop(name, None)
        if prev_loss is _MISSING:
            d.pop("_loss_function", None)
        else:
            d["_loss_function"] = prev_loss
    if cap.calls != 1 or counter[0] != 1:
        raise RuntimeError(f"deepspeed_fused.linear_cross_entropy: {type(model).__name__}.forward called self.{name} "
                           f"{cap.calls} and loss_function {counter[0]} times with labels (expected once each)")
    from transformers.utils import ModelOutput

    if not isinstance(out, ModelOutput):
        raise RuntimeError(f"deepspeed_fused.linear_cross_entropy: {type(model).__name__}.forward returned "
                           f"{type(out).__name__} with return_dict=True")
    fields = [f.name for f in dataclasses.fields(out)]
    out = type(out)(**{n: getattr(out, n) for n in fields if n != "logits"})
    st.fused_calls += 1
    if counter[1]:
        st.calls.reference += 1
    else:
        st.calls.fused += 1
    if return_dict:
        return out
    # Eager's tuple holds the fields that are set, in order: keep the logits' slot (None, as the
    # logits are never formed) so that what follows it keeps its position.
    return tuple(None if n == "logits" else getattr(out, n) for n in fields
                 if n == "logits" or getattr(out, n) is not None)


def _make_dispatcher(orig):
    names = list(inspect.signature(orig).parameters)

    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        st = fused_state(self)
        if st is None or isinstance(self.__dict__.get(st.spec.head), _Capture):
            # (a capture on its head: an outer model's fused forward takes this one's logits)
            return orig(self, *args, **kwargs)
        if not self.training or _labels_of(names, args, kwargs) is None:
            st.calls.eager += 1
            out = orig(self, *args, **kwargs)
            if self.training and not st.warned_no_labels:
                st.warned_no_labels = True
                _warn_no_labels(self, out)
            return out
        client = logits_client(sys._getframe(1))
        if client is not None:  # it reads the training logits: the eager head forms them
            st.calls.eager += 1
            if client not in st.warned_clients:
                st.warned_clients.add(client)
                warnings.warn(f"deepspeed_fused.linear_cross_entropy: {type(self).__name__}: not fused for {client}: "
                              "it reads the outputs' logits in training, which the fused loss does not form; the "
                              "eager head runs for its forwards (the [tokens, vocab] logits are materialized)",
                              RuntimeWarning, stacklevel=2)
            return orig(self, *args, **kwargs)
        why = _unfused_reason(self, st.spec)
        if why:
            st.calls.eager += 1
            if why != st.unfused_reason:
                st.unfused_reason = why
                warnings.warn(f"deepspeed_fused.linear_cross_entropy: {type(self).__name__}: not fused: {why}",
                              RuntimeWarning, stacklevel=2)
            return orig(self, *args, **kwargs)
        return _fused_forward(self, st, orig, args, kwargs)

    setattr(forward, _ORIG, orig)
    return forward


# class -> (had its own forward in __dict__, original forward, weak set of the live _State objects)
_PATCHED_CLASSES: dict = {}


def _patch_class(cls) -> None:
    if cls in _PATCHED_CLASSES:
        return
    import weakref

    own = "forward" in cls.__dict__
    orig = cls.forward
    cls.forward = _make_dispatcher(orig)
    _PATCHED_CLASSES[cls] = (own, orig, weakref.WeakSet())


def _unpatch_class(cls) -> None:
    own, orig, _ = _PATCHED_CLASSES.pop(cls)
    if own:
        cls.forward = orig
    else:
        delattr(cls, "forward")


def _state_from_cfg(spec: HeadSpec, cfg) -> _State:
    return _State(spec=spec, ignore_index=int(cfg.ignore_index),
                  chunk_tokens=None if cfg.chunk_tokens == "auto" else int(cfg.chunk_tokens),
                  accum_dtype=torch.float32 if cfg.accum_dtype == "fp32" else None,
                  z_loss=float(cfg.z_loss), label_smoothing=float(cfg.label_smoothing),
                  validate_targets=bool(cfg.validate_targets))


def _own_state(module) -> Optional[_State]:
    st = module.__dict__.get(_STATE)
    return st if isinstance(st, _State) else None


def fused_state(module) -> Optional[_State]:
    """The opted-in state of a patched causal LM (None if not patched or no longer in force: revoked,
    or its class's dispatcher is gone)."""
    st = _own_state(module)
    if st is None or st.revoked or type(module) not in _PATCHED_CLASSES:
        return None
    return st


def is_patched(module) -> bool:
    return fused_state(module) is not None
