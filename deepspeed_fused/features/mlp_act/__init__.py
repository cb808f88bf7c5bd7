"""Feature "mlp_act": gated MLPs run ``act(gate) * up`` as one fused kernel each way.

What is recognised is the math of the module, never a class name. An MLP qualifies when its
``forward`` compiles to exactly one of the known gated forms (:mod:`.templates`: Llama's
``down(act(gate(x)) * up(x))`` in its three spellings and with a dropout module before ``down``
(T5Gemma, GTE); one gate-up projection split by ``chunk(2, -1)`` with the gate first, as Phi-3,
GLM and Granite's shared MLP write it, or second, as Moonshine's decoder MLP does), whatever its attributes are named, and its activation is SiLU,
GELU with the tanh approximation or exact GELU as torch computes them (``torch.nn.SiLU``,
``torch.nn.GELU``, or a module whose forward compiles to ``nn.functional.silu(input)`` or to
``self.act(input)`` with ``act`` one of ``F.silu``, ``F.gelu``, ``partial(F.gelu,
approximate=...)``: transformers' ``SiLUActivation``, ``GELUActivation``, ``GELUTanh``). The
activation is read again at every call, so a module whose activation is replaced later runs eager.

The class's ``forward`` becomes a dispatcher (installed once, kept for the life of the process)
that runs the fused forward for instances carrying the opt-in marker (the ``rms_norm`` feature's
kind of marker) and the class's previous forward for all others. The fused forward calls the
module's own projections (their hooks, LoRA wrappers and ZeRO-3 gathers run as before) and
:func:`~deepspeed_fused.ops.mlp_act.mlp_act` / :func:`~deepspeed_fused.ops.mlp_act.mlp_act_fused`
on their outputs; where the kernels cannot take them (dtype, device) it computes the form's own
eager math on them, with one warning per reason.

The package, one concern per file: ``templates`` (the known forms), ``recognition`` (bytecode
normalisation, :func:`recognise`, :func:`activation_of`, :func:`coverage`), ``patch`` (the fused
forward, the dispatcher and the opt-in); here the feature itself.
"""
from __future__ import annotations

from typing import Any

import torch

from ..base import FeatureConfig, FeatureReport, ReplacementFeature
from .patch import (CALLS, MARKER, OPT_IN, OPT_IN_MARKER, _plan, _commit, form_of, is_replaced,  # noqa: F401
                    replace_mlp_act, restore_mlp_act)
from .recognition import Form, activation_of, coverage, recognise  # noqa: F401


class MlpActConfig(FeatureConfig):
    """Options of the "mlp_act" feature (only ``enabled``: which MLPs qualify is read from their
    forward's bytecode and their activation)."""


class MlpActFeature(ReplacementFeature):
    name = "mlp_act"
    config_model = MlpActConfig
    opt_in = OPT_IN_MARKER
    is_replaced = staticmethod(is_replaced)
    none_found = "no MLP with a recognised gated form and activation"
    fused_what = "the fused gated activation"

    def apply(self, model: torch.nn.Module, engine: Any, cfg: Any) -> FeatureReport:
        plan = _plan(model)
        replaced = _commit(plan)
        skipped = {reason: dict(c) for reason, c in plan["skipped"].items()}
        forms = sorted(f"{c}: {d}" for c, d in plan["forms"].items())
        return self.replacement_report(model, replaced, plan["already"], skipped, forms=forms)
