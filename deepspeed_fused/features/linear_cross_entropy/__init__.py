"""Feature "linear_cross_entropy": Hugging Face language models compute their training loss with
the fused LM-head + cross-entropy op, so the [tokens, vocab] logits are never materialized.

One generic mechanism serves every model whose forward has a vocabulary projection feeding
transformers' ``ForCausalLMLoss`` (``*ForCausalLM``, ``*LMHeadModel``, the language model's head
of a ``*ForConditionalGeneration`` vision-language model, ...): hidden states ->
``logits = self.<head>(hidden)`` (scaled, soft-capped) -> ``self.loss_function(logits, labels,
vocab_size, **kwargs)``, optional router aux loss. Which forwards qualify, and what the op must
do to the logits, is read from the forward's source (``recognition.py``), never from a class name:

* The class's ``forward`` is wrapped once by a dispatcher; only instances that opted in (a state
  object in their ``__dict__``) take the fused path, and only when training with labels and with
  transformers' own ``ForCausalLMLoss``. Everything else (eval, generation, no labels, a user's own
  ``loss_function``) runs the original forward unchanged and gets real logits.
* On the fused path the model's own forward runs with two per-call substitutions in the instance
  ``__dict__``: the head (``self.lm_head``, or whatever the forward calls) becomes a capture that
  records the (already ``logits_to_keep`` sliced) hidden states and returns a zero-width tensor
  (reads of the head's attributes pass through), and ``self.loss_function`` becomes a loss
  that shifts/pads labels exactly as ``ForCausalLMLoss`` does (or takes ``shift_labels`` as given),
  then calls the real head *as a module* with its forward swapped for the op. When the logits
  are those of an inner model called without labels (``outputs = self.language_model(...)``;
  ``logits = outputs[0]``), the capture goes on the inner model's head. Calling the
  module keeps DeepSpeed ZeRO-3's hooks in charge: the partitioned weight is gathered for the op's
  forward and backward and its gradient reaches the partitioned parameter like an ``nn.Linear``'s.
  The model's code therefore still does the slicing, router aux loss, output class and
  ``return_dict`` handling; the output is rebuilt with ``logits=None`` (training mode with labels
  returns no logits: code that reads ``out.logits`` there must compute them itself or run eval).
* A patched model called in training mode without labels runs its eager head (the logits are
  materialized): it warns once, naming the cause when it is the HF Trainer's
  ``label_smoothing_factor`` or ``compute_loss_func`` (which take the labels out before the
  forward). The report counts fused and eager forwards since the feature was applied.
* Between the head and the loss the logits may only be upcast or copied, multiplied or divided
  by scalars read from the model (-> the op's ``temperature``) and go through one ``tanh``
  (-> ``softcap``), under conditions on such scalars; after the loss they may be read only where
  the fused path does not go. The scalars and conditions are evaluated per call; the head must be
  an ``nn.Linear`` (or an AutoTP vocabulary shard). Anything else is reported and left
  unpatched (or, found at call time, runs eager with a warning), never silently changed.
* DeepSpeed AutoTP heads split by vocabulary (``tensor_parallel``: ``VocabParallelLinear`` with
  DeepSpeed's ``VocabParallelCausalLMLoss``, or the training-mode ``LinearLayer`` that all-gathers
  the logits) take the op's vocab-parallel path with the layer's TP group (``mp_group``) and its
  shard's ``vocab_start``: small all-gathers of per-token statistics (one per token chunk)
  instead of DeepSpeed's logits gather or its three-collective loss. The layer's own forward (with its input-gradient
  all-reduce) is swapped out for the call, so dhidden is summed over the group once, by the op.
* A model carrying TRL's fused LM head (``trl.trainer.utils.add_fused_lm_head``: ``forward``
  replaced on the instance) is not class-patched: its ``fused_lm_head=True`` calls are served by
  the op with TRL's output and semantics (``trl``), found at apply or, when TRL adds the head
  later, at the engine's next forward. The report says "TRL fused LM head served". A model whose
  log-probs were seen to get a uniform upstream gradient (SFT's loss) then has its gradient formed
  in the forward (the op's ``expect_uniform_grad``; docs/trl.md).
* A Trainer whose ``compute_loss`` reads the outputs' ``logits`` in training (``clients``) gets the
  eager head for its forwards, with one warning naming it.

The package: ``recognition`` (the reading of a forward's source, :func:`causal_lm_support`),
``templates`` (the fixed spellings that reading accepts and the loss it must find), ``clients``
(Trainers that read the training logits), ``patch`` (the per-call machinery, the dispatcher, the
opt-in state), ``trl`` (serving TRL's fused head); here the feature (its config, apply, report,
revert).
"""
from __future__ import annotations

from typing import Literal, Union

from pydantic import Field, StrictBool, StrictFloat, StrictInt
from typing_extensions import Annotated

from ..base import CallCounts, Feature, FeatureConfig, FeatureReport, reference_fallback
from .patch import (_PATCHED_CLASSES, _STATE, _head_module, _own_state, _patch_class, _shard_text,  # noqa: F401
                    _state_from_cfg, _unfused_reason, _unpatch_class, _vocab_shard, fused_state, is_patched)
from .recognition import _analyze, _is_lm_candidate, causal_lm_support  # noqa: F401
from . import trl


class LinearCrossEntropyConfig(FeatureConfig):
    """Options of the "linear_cross_entropy" feature."""

    ignore_index: StrictInt = -100
    """Label value that contributes no loss and no gradient (used unless the call passes its own
    ``ignore_index``; transformers' default is -100)."""
    chunk_tokens: Union[Literal["auto"], Annotated[StrictInt, Field(gt=0)]] = "auto"
    """Tokens per chunk of the fused op ("auto": the op picks one that bounds its workspace)."""
    accum_dtype: Literal["auto", "fp32"] = "auto"
    """Accumulation of gradients summed over the op's chunks (the LM-head weight over token chunks,
    the hidden states over vocabulary chunks): "auto" lets the op choose (may keep partial sums in
    the parameter's dtype), "fp32" keeps fp32 accumulators (more memory)."""
    z_loss: Annotated[StrictFloat, Field(ge=0, allow_inf_nan=False)] = 0.0
    """Weight of the z-loss term ``z_loss * logsumexp(logits)**2`` added per token (0: off)."""
    label_smoothing: Annotated[StrictFloat, Field(ge=0, lt=1, allow_inf_nan=False)] = 0.0
    """Label smoothing of the cross-entropy, as in ``torch.nn.functional.cross_entropy``."""
    validate_targets: StrictBool = True
    """Check that every label is in [0, vocab) or ``ignore_index`` (a device reduction, read once
    per call after the op's kernels are queued; turn off for CUDA-graph capture). Unchecked, a label
    outside [0, vocab) has no target logit: its loss is the logsumexp (it still counts as a token)."""



def _trl_options(cfg) -> dict:
    """The section's options that serving TRL's head takes (TRL defines its loss: no z-loss or
    smoothing, ignore index -100)."""
    import torch

    return {"chunk_tokens": None if cfg.chunk_tokens == "auto" else int(cfg.chunk_tokens),
            "accum_dtype": torch.float32 if cfg.accum_dtype == "fp32" else None,
            "validate_targets": bool(cfg.validate_targets)}


class LinearCrossEntropyFeature(Feature):
    name = "linear_cross_entropy"
    config_model = LinearCrossEntropyConfig

    def is_supported(self, env):
        if env.transformers_version is None:
            return False, "transformers is not importable"
        return True, ""

    def apply(self, model, engine, cfg):
        report = FeatureReport(name=self.name, enabled=True)
        plans, skipped, trl_models = [], {}, []
        for name, m in model.named_modules():
            cls = type(m)
            if is_patched(m) or not _is_lm_candidate(m):
                continue
            if trl.trl_forward_of(m) is not None:  # TRL's fused head: its flagged calls are served
                trl_models.append((name, m))
                continue
            ok, why = causal_lm_support(cls)
            if ok:
                if "forward" in m.__dict__:
                    ok, why = False, "forward is overridden on the instance"
                else:
                    why = _unfused_reason(m, _analyze(cls)[0])
                    ok = not why
            if ok:
                plans.append((name, m, _analyze(cls)[0]))
            else:
                skipped.setdefault(cls.__name__, why)
        already = [m for _, m in model.named_modules() if is_patched(m)]
        # Mutate only after every check passed (nothing below can fail half-way).
        counts: dict = {}
        calls = CallCounts()
        served = trl.apply_trl(trl_models, calls, _trl_options(cfg), skipped)
        for cls_name, n in served.items():
            counts[f"{cls_name} (TRL fused LM head served)"] = n
        for name, m, spec in plans:
            _patch_class(type(m))
            st = _state_from_cfg(spec, cfg)
            st.owner = type(m)
            st.calls = calls
            _PATCHED_CLASSES[type(m)][2].add(st)
            m.__dict__[_STATE] = st
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
        for m in already:
            counts[type(m).__name__] = counts.get(type(m).__name__, 0) + 1
            fused_state(m).calls = calls  # counted from this apply on
        # AutoTP heads split by vocabulary (the op runs over their TP group): by module name.
        vocab_parallel, modes = {}, {}
        for name, m in model.named_modules():
            shard = _vocab_shard(_head_module(m)) if is_patched(m) else None
            if shard is not None:
                vocab_parallel[name or "<root>"] = {"tp": shard.tp, "vocab": shard.vocab, "vocab_start": shard.start,
                                                    "head": shard.kind}
                modes.setdefault(type(m).__name__, set()).add(_shard_text(shard))
        report.applied = bool(counts)
        report.calls = calls if counts else None
        report.where = ", ".join(f"{n} x {c}" + (f": {'; '.join(sorted(modes[c]))}" if c in modes else "")
                                 for c, n in counts.items())
        report.details = {"patched": counts, "skipped": skipped,
                          "modules": [n or "<root>" for n, _, _ in plans]}
        if vocab_parallel:
            report.details["vocab_parallel"] = vocab_parallel
            report.details["mode"] = "; ".join(sorted(set().union(*modes.values())))
        if not counts:
            report.reason = "no supported language-model head found" + (
                "; " + "; ".join(f"{c}: {w}" for c, w in skipped.items()) if skipped else "")
        elif skipped:
            report.reason = "skipped " + "; ".join(f"{c}: {w}" for c, w in skipped.items())
        if counts:  # a TRL head added after this apply is served from the engine's next forward on
            trl.install_late(model, engine, calls, _trl_options(cfg), served, skipped)
            report.details["trl_served"] = served
        if counts and len(served) < len(counts):
            note = "training forwards with labels return logits=None"
            report.reason = f"{report.reason}; {note}" if report.reason else note
        return report

    def revert(self, model):
        n = trl.revert_trl(model)
        for _, m in model.named_modules():
            st = _own_state(m)
            m.__dict__.pop(_STATE, None)
            if st is None:
                continue
            n += int(not st.revoked and type(m) in _PATCHED_CLASSES)
            st.revoked = True
            entry = _PATCHED_CLASSES.get(type(m))
            if entry is not None:
                entry[2].discard(st)
                if not len(entry[2]):
                    _unpatch_class(type(m))
        return n

    def is_applied(self, model):
        return (any(is_patched(m) or trl.served(m) is not None for m in model.modules())
                or trl.late_hook(model) is not None)

    def fallback(self, env):
        return reference_fallback("linear_cross_entropy", env)
