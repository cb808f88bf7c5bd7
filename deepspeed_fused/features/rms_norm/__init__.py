"""Feature "rms_norm": run RMSNorm modules through the fused op, each in its own form.

Installation is class-level plus a per-instance opt-in. The first time a class is replaced, its
``forward`` is wrapped (once) by a dispatcher; the dispatcher runs the fused op only for
instances that carry the opt-in marker and inputs the kernels take, and the class's previous
forward otherwise. The marker is an instance attribute holding a shared object that copies
(``copy.copy``, ``copy.deepcopy``, ``nn.DataParallel`` replicas, which copy ``__dict__``) keep
as is and that pickles as ``False``: a model saved with ``torch.save`` and loaded again runs
eager until it is replaced again. Parameters, buffers, state_dict keys and module hooks are not
touched.

Which modules qualify: the exact classes of :data:`SUPPORTED_CLASSES` (by qualified name) while
their class still runs its own forward, plus (``match_forms``) any other class whose forward (and
the helpers it calls: ``_norm``, xLSTM's ``_rms_normalize`` and ``_apply_weight_bias``) compiles
to the same bytecode as one of the known forms' templates (only the epsilon attribute name,
``variance_epsilon`` or ``eps``, may differ; see :func:`~.recognition.recognise`), and ``torch.nn.RMSNorm``
modules. Llama-form classes get the Llama dispatcher (the op's hot path); the other forms (Gemma's
``1 + w``, the weight before the cast, T5's, unweighted, gated, and the grouped norms, whose group
size is read from the module at every call) get a form dispatcher that resolves the module's form
per call. Norms with other math do not match. Modules already replaced by DeepSpeed's own ``replace_rms_norm``
are left to it and report

The package: ``templates`` (the known forms as transformers spells them), ``recognition``
(bytecode matching, :func:`recognise`, the per-module conditions), ``patch`` (the dispatchers,
the plan and commit, :func:`replace_rms_norm`); here the feature (its config and apply).
"""
from __future__ import annotations

from typing import Any

import torch
from pydantic import Field, StrictBool

from ..base import FeatureConfig, FeatureReport, ReplacementFeature
from .patch import (_DISPATCHERS, CALLS, MARKER, OPT_IN, OPT_IN_MARKER, _commit, _plan, is_replaced,  # noqa: F401
                    replace_rms_norm, replaced_form, restore_rms_norm, try_fused_rms_norm, try_fused_rms_norm_form)
from .recognition import SUPPORTED_CLASSES, FormSpec, llama_form_eps_attr, recognise  # noqa: F401
from .templates import TEMPLATE_SOURCES  # noqa: F401


class RmsNormConfig(FeatureConfig):
    """Options of the "rms_norm" feature."""

    match_forms: StrictBool = True
    """Also replace RMSNorm classes outside the built-in list (Llama, Mistral, Mixtral, Phi3,
    Qwen2, Qwen2-MoE, Qwen3, Qwen3-MoE, DeepSeek-V2/V3) whose forward (and the helpers it calls,
    such as ``_norm``) compiles to exactly the bytecode of one of the known forms (the Llama form
    and its Llama 4 spelling, Gemma's ``1 + w``, the weight multiplied before the cast (OLMo 2,
    GPT-OSS, Helium), T5's, unweighted norms, xLSTM's, the gated norms of Qwen3-Next, Kimi-Linear,
    Mamba2 and Falcon-H1, and the norms with statistics over groups of columns (Mamba2's
    ``group_size``, Falcon-H1's ``n_groups``, Qwen4's grouped norm); only the epsilon attribute name
    may differ), and ``torch.nn.RMSNorm`` modules."""

    match_llama_form: StrictBool = Field(True, json_schema_extra=dict(deprecated=True, new_param="match_forms"))
    """Deprecated: the earlier name of ``match_forms`` (a value given here is taken as ``match_forms``)."""


class RmsNormFeature(ReplacementFeature):
    name = "rms_norm"
    config_model = RmsNormConfig
    opt_in = OPT_IN_MARKER
    is_replaced = staticmethod(is_replaced)
    none_found = "no supported RMSNorm modules found"
    fused_what = "the fused RMSNorm"

    def apply(self, model: torch.nn.Module, engine: Any, cfg: Any) -> FeatureReport:
        plan = _plan(model, bool(getattr(cfg, "match_forms", True)))
        replaced = _commit(plan)
        skipped = {reason: dict(c) for reason, c in plan["skipped"].items()}
        return self.replacement_report(model, replaced, plan["already"], skipped)
