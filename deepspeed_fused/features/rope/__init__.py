"""Feature "rope": Hugging Face attention modules apply their rotary embedding with the fused op.

What is recognised is the math of the function, never a class or module name. Hugging Face
attention forwards call a module-level function (``apply_rotary_pos_emb``,
``apply_rotary_pos_emb_interleave``, ``apply_rotary_pos_emb_vision``, ...) by its global name.
Such a function is taken only when its bytecode is exactly one of the known forms (the Llama
form and its split-half / interleaved rotations, partial rotary in its four spellings, the GLM and
DeepSeek interleaved forms, the float32 forms of Cohere, ESM, Ernie and the vision towers, the
single-tensor Gemma-3n form, gpt-oss's half-width form, Llama 4's and DeepSeek-V2's complex
multiply by ``freqs_cis``, GPT-J's ``rotate_every_two`` form, DeepSeek-V4's last-columns form,
Qwen4-Exp's and Mistral Large 4's forms with an optional k), with its ``rotate_half`` (whatever its
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

The package, one concern per file: ``templates`` (the known forms, written as Hugging Face writes
them), ``recognition`` (bytecode normalisation, :func:`recognise`, :func:`coverage`), ``patch``
(the fused call, the forward's copy, the dispatcher and the opt-in); here the feature itself
(its config, apply and its report, revert).
"""
from __future__ import annotations

import collections
from typing import Any

import torch

from ..base import FeatureConfig, FeatureReport, ReplacementFeature
from .patch import (CALLS, MARKER, OPT_IN, OPT_IN_MARKER, PREFIX, _analyse_forward, _commit,  # noqa: F401
                    _copy_forward, _innermost, _make_call, _plan, is_replaced, replace_rope, restore_rope)
from .recognition import Form, coverage, pair_rotation_kind, plain_function, recognise, rotation_kind  # noqa: F401
from .templates import _rh_half  # noqa: F401


class RopeConfig(FeatureConfig):
    """Options of the "rope" feature (only ``enabled``: which functions qualify is read from
    their bytecode)."""


class RopeFeature(ReplacementFeature):
    name = "rope"
    config_model = RopeConfig
    opt_in = OPT_IN_MARKER
    is_replaced = staticmethod(is_replaced)
    none_found = "no attention module calls a recognised rotary embedding"
    fused_what = "the fused RoPE"

    def apply(self, model: torch.nn.Module, engine: Any, cfg: Any) -> FeatureReport:
        plan = _plan(model)
        replaced, failed = _commit(plan)
        already = plan["already"]
        skipped = {reason: dict(c) for reason, c in plan["skipped"].items()}
        for reason, c in failed.items():
            skipped.setdefault(reason, {}).update(c)
        total = collections.Counter(replaced) + already
        forms = sorted(f"{c}.{n}: {d}" for (c, n), d in plan["forms"].items() if c in total)
        refused = [f"{c} also calls {n}, left eager: {r}" for (c, n), r in sorted(plan["refused"].items())]
        return self.replacement_report(model, replaced, already, skipped, refused, forms=forms)
