"""Feature "moe_reorder": MoE token reorder by row gathers (``deepspeed_fused.ops.moe_reorder``).

Two integrations, chosen per model:

* DeepSpeed AutoEP (the model holds ``AutoEPMoELayer`` modules): ``permute_by_local_expert`` and
  ``unpermute_by_local_expert`` of ``deepspeed.module_inject.auto_ep_layer`` are looked up as
  module globals at call time, so they are replaced there (one patch for every layer, reference
  counted over patched models). Ours keep DeepSpeed's exact contract: the indices and aligned
  counts come from DeepSpeed's ``generate_permute_indices`` with its alignment constant, built the
  way ``permute_by_local_expert`` builds them (checked against the installed version's own function
  when installing; if that check fails, every call lets DeepSpeed's function build them from a
  zero-width copy of the tokens), and only the rows move through our gathers.
* transformers experts (no AutoEP): an experts implementation named ``"deepspeed_fused"`` is
  registered in ``ALL_EXPERTS_FUNCTIONS`` and selected with ``model.set_experts_implementation``.
  It is transformers' ``grouped_mm`` path with our gather for the dispatch and the fused
  gather-weight-sum for the combine; the GEMMs go through transformers' own ``_grouped_linear

The package: ``templates`` (the router forwards, GPT-OSS's gate and the AutoEP sources it
recognises), ``recognition`` (bytecode and source checks), ``patch`` (the AutoEP patches, the
experts implementation, the router dispatchers); here the feature (its config, apply, report,
revert).
"""
from __future__ import annotations

import warnings

from pydantic import StrictBool

from ..base import CallCounts, Environment, Feature, FeatureConfig, FeatureReport
from .patch import (_AUTOEP, _AUTOEP_CALLS, _AUTOEP_OWNERS, _CALLS_ATTR, _LOCAL, _ROUTER_OPT_IN,  # noqa: F401
                    _STATE_ATTR, IMPL_NAME, _autoep_layers, _direct_indices, _direct_matches, _experts_modules,
                    _get_impl, _install_autoep, _install_local_path, _make_autoep_functions, _opt_in_routers, _State,
                    _uninstall_autoep, _uninstall_local_path, autoep_patched, check_counts,
                    deepspeed_fused_experts_forward, local_path_patched, register_experts_implementation)
from .recognition import fused_gate, oai_gate_of, router_form  # noqa: F401

with warnings.catch_warnings():  # "validate" shadows pydantic's deprecated BaseModel.validate: intended
    warnings.filterwarnings("ignore", message='Field name "validate"')

    class MoeReorderConfig(FeatureConfig):
        """Options of the "moe_reorder" feature."""

        validate: StrictBool = False
        """Check on every AutoEP reorder that the permutation indices are a one-to-one map of the
        token rows, raising a ValueError that names the first duplicate, out-of-range or missing
        entry. Costs a device-to-host sync per layer: for debugging. The alignment of each expert's
        group is DeepSpeed's (``deepspeed.moe.ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M``)."""


class MoeReorderFeature(Feature):
    name = "moe_reorder"
    config_model = MoeReorderConfig

    def is_supported(self, env: Environment) -> tuple[bool, str]:
        if not env.kernels_available:
            return False, ("the gathers need Triton and a CUDA GPU (or TRITON_INTERPRET=1); on CPU the "
                           "eager reorder is already what would run")
        return True, ""

    def apply(self, model, engine, cfg) -> FeatureReport:
        rep = FeatureReport(name=self.name, enabled=True)
        if getattr(model, _STATE_ATTR, None) is not None:
            if self.is_applied(model):
                rep.applied, rep.reason = True, "already applied"
                if model.__dict__[_STATE_ATTR].get("path") == "transformers":
                    # a model loaded from a pickle has its routers' opt-in off: on again
                    routers, _ = _opt_in_routers(model)
                    rep.reason += f"; routers fused: {routers}"
                return rep
            model.__dict__.pop(_STATE_ATTR, None)  # a stale record (copied or loaded): apply afresh
        n_autoep = _autoep_layers(model)
        if n_autoep:
            _install_autoep(cfg.validate)
            _install_local_path()
            model.__dict__[_STATE_ATTR] = _State(path="autoep", layers=n_autoep, validate=cfg.validate)
            _AUTOEP_OWNERS.add(model)
            from deepspeed.moe import ep_kernels

            replaces = ("DeepSpeed's Triton permute_rows/unpermute_rows" if hasattr(ep_kernels, "permute_rows")
                        else "DeepSpeed's vstack+index / zero+index_put reorder")
            rep.applied = True
            rep.where = f"{n_autoep} x AutoEPMoELayer (DeepSpeed AutoEP permute/unpermute_by_local_expert)"
            rep.reason = f"replaces {replaces}" + ("; validate=on (host sync per layer)" if cfg.validate else "")
            rep.details = {"path": "autoep", "layers": n_autoep}
            rep.calls = _AUTOEP_CALLS.since_now()  # AutoEP layer forwards in this process from now on
            if not _AUTOEP["direct"]:
                rep.reason += "; indices built by DeepSpeed's own function (probe)"
            if local_path_patched():
                rep.reason += ("; the local token path (routed gather, scores, reorder, combine) runs as fused "
                               "gathers (DeepSpeed's forward where TP folding, DeepEP or the input dtype/device "
                               "rule it out)")
            else:
                rep.reason += f"; local token path kept: {_LOCAL['why']}"
            return rep

        experts = _experts_modules(model)
        if not experts:
            rep.reason = "no DeepSpeed AutoEP layers and no transformers experts modules in the model"
            return rep
        if not hasattr(model, "set_experts_implementation"):
            rep.reason = "the model has no set_experts_implementation (not a transformers PreTrainedModel)"
            return rep
        register_experts_implementation()
        previous = _get_impl(model)
        try:
            model.set_experts_implementation(IMPL_NAME)
            selected = [m for m in experts if m.config._experts_implementation == IMPL_NAME]
            if not selected:
                raise RuntimeError("set_experts_implementation did not select it for any experts module")
        except Exception:
            model.set_experts_implementation(previous)
            raise
        model.__dict__[_STATE_ATTR] = _State(path="transformers", layers=len(selected), previous=previous)
        rep.calls = CallCounts()  # experts forwards through the implementation (it has no eager branch)
        for m in selected:
            m.__dict__[_CALLS_ATTR] = rep.calls
        kinds = sorted({type(m).__name__ for m in selected})
        rep.applied = True
        rep.where = f"{len(selected)} x {', '.join(kinds)} (transformers experts implementation {IMPL_NAME!r})"
        prev = previous.get("", previous) if isinstance(previous, dict) else previous
        rep.reason = f"replaces experts implementation {prev!r}"
        if len(selected) < len(experts):
            rep.reason += f"; {len(experts) - len(selected)} experts modules kept their implementation"
        fused = sum(1 for m in selected if getattr(m, "has_gate", True) and (fused_gate(m) or oai_gate_of(m)))
        gated = sum(1 for m in selected if getattr(m, "has_gate", True))
        if gated:
            rep.reason += f"; gate fused in {fused} of {gated} experts modules" + (
                "" if fused == gated
                else " (the others: neither transformers' default gate with SiLU nor GPT-OSS's, kept)")
        routers, kept = _opt_in_routers(model)
        rep.reason += f"; routers fused: {routers}"
        if kept:
            rep.reason += (" (kept: " + ", ".join(f"{n} x {c}" for c, n in sorted(kept.items()))
                           + ": not a known router forward)")
        rep.details = {"path": "transformers", "layers": len(selected), "previous": previous, "fused_gate": fused,
                       "routers": routers, "routers_kept": dict(kept)}
        return rep

    def is_applied(self, model) -> bool:
        """AutoEP: the process-wide patch is in place (a copy of a patched model runs it too,
        until the original is unpatched). transformers: the model's experts modules select the
        implementation and it is registered in this process."""
        state = model.__dict__.get(_STATE_ATTR)
        if state is None:
            return False
        if state.get("path") == "autoep":
            return autoep_patched()
        try:
            from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

            registered = ALL_EXPERTS_FUNCTIONS.get(IMPL_NAME, None) is deepspeed_fused_experts_forward
        except Exception:
            return False
        return registered and any(getattr(m.config, "_experts_implementation", None) == IMPL_NAME
                                  for m in _experts_modules(model))

    def revert(self, model) -> int:
        state = model.__dict__.pop(_STATE_ATTR, None)
        if state is None:
            return 0
        if state["path"] == "autoep":
            if model not in _AUTOEP_OWNERS:  # a copy: the patch belongs to the model that installed it
                return state["layers"]
            _AUTOEP_OWNERS.discard(model)
            _uninstall_local_path()
            _uninstall_autoep(state["validate"])
        else:
            model.set_experts_implementation(state["previous"])
            _ROUTER_OPT_IN.clear(model)
            for m in model.modules():
                m.__dict__.pop(_CALLS_ATTR, None)
        return state["layers"]
