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
  gather-weight-sum for the combine; the GEMMs go through transformers' own ``_grouped_linear``.
"""
from __future__ import annotations

import functools
import warnings
import weakref
from typing import Any

import torch
from pydantic import StrictBool

from ..ops import moe_reorder as reorder
from .base import CallCounts, Environment, Feature, FeatureConfig, FeatureReport, SharedCallCounts
from .moe_routers import _ROUTER_OPT_IN, _code_key, _opt_in_routers, router_form  # noqa: F401  (router_form: API)

IMPL_NAME = "deepspeed_fused"
_STATE_ATTR = "_deepspeed_fused_moe_reorder"
_CALLS_ATTR = "_deepspeed_fused_moe_calls"  # on transformers experts modules: their apply's CallCounts
# AutoEP layer forwards whose token reorder ran as our gathers (the fused local token path, or
# DeepSpeed's forward calling our permute_by_local_expert): one per layer call, process-wide as the
# patch is. ``eager`` stays 0: while the patch is in, no AutoEP reorder runs DeepSpeed's own code.
_AUTOEP_CALLS = SharedCallCounts()
# Models whose apply installed the process-wide AutoEP patches (a copy of one shares the patch
# while it lasts, but never owns it: reverting a copy leaves the original's patch in place).
_AUTOEP_OWNERS: "weakref.WeakSet" = weakref.WeakSet()


class _State(dict):
    """The feature's record on a model. Unpickled in another process it registers the experts
    implementation again (transformers path: the loaded model keeps running the gathers) and is
    otherwise only a record: what runs is read from the process's state (``is_applied``)."""

    def __reduce__(self):
        return (_restore_state, (dict(self),))


def _restore_state(d: dict) -> "_State":
    if d.get("path") == "transformers":
        try:
            register_experts_implementation()
        except Exception:  # transformers missing there: the load still succeeds
            pass
    return _State(d)


with warnings.catch_warnings():  # "validate" shadows pydantic's deprecated BaseModel.validate: intended
    warnings.filterwarnings("ignore", message='Field name "validate"')

    class MoeReorderConfig(FeatureConfig):
        """Options of the "moe_reorder" feature."""

        validate: StrictBool = False
        """Check on every AutoEP reorder that the permutation indices are a one-to-one map of the
        token rows, raising a ValueError that names the first duplicate, out-of-range or missing
        entry. Costs a device-to-host sync per layer: for debugging. The alignment of each expert's
        group is DeepSpeed's (``deepspeed.moe.ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M``)."""


# ----------------------------------------------------------------------------------------------
# Integration 1: DeepSpeed AutoEP
# ----------------------------------------------------------------------------------------------

_AUTOEP = {"count": 0, "validate": 0, "originals": None, "ours": None, "direct": False}


def _autoep_module():
    import deepspeed.module_inject.auto_ep_layer as layer

    return layer


def _direct_indices(tokens: torch.Tensor, local_counts: torch.Tensor):
    """DeepSpeed's index build of ``permute_by_local_expert`` (0.19.2-0.19.8): the counts' layout,
    the padded length and ``generate_permute_indices`` with DeepSpeed's alignment constant."""
    from deepspeed.moe import ep_kernels

    if local_counts.ndim == 1:
        ep_degree, num_local = 1, local_counts.shape[0]
    elif local_counts.ndim == 2:
        ep_degree, num_local = local_counts.shape
    else:
        raise ValueError(f"local_counts must have shape [E_local] or [ep_degree, E_local], got "
                         f"{tuple(local_counts.shape)}")
    flat = local_counts.reshape(-1)
    n_tokens = tokens.shape[0]
    alignment = ep_kernels.TOKEN_GROUP_ALIGN_SIZE_M
    padded_max_len = ((n_tokens + num_local * alignment + alignment - 1) // alignment) * alignment
    use_cpu = tokens.device.type == "cpu"
    with torch.no_grad():
        permuted_indices, m_sizes, _ = ep_kernels.generate_permute_indices(
            flat.cpu() if use_cpu else flat, num_local, ep_degree, padded_max_len, alignment, use_cpu=use_cpu)
    if not use_cpu:
        permuted_indices = permuted_indices.to(tokens.device)
        m_sizes = m_sizes.to(tokens.device)
    return permuted_indices, m_sizes, n_tokens


def _probe_indices(original_permute, tokens, local_counts):
    """Any version: DeepSpeed's own function on a zero-width stand-in of the tokens (its row
    movement is then free); indices, aligned counts and n_tokens are exactly its own."""
    probe = tokens.detach().new_empty((tokens.shape[0], 0))
    _, permuted_indices, aligned_counts, n_tokens = original_permute(probe, local_counts)
    return permuted_indices, aligned_counts, n_tokens


def _direct_matches(original_permute) -> bool:
    """Self-check at install: the direct index build equals this DeepSpeed version's on CPU cases
    (1-D and 2-D counts, empty experts). If not, every call uses the probe."""
    try:
        cases = [torch.tensor([3, 0, 5, 1], dtype=torch.int32), torch.tensor([0, 0, 0], dtype=torch.int32),
                 torch.tensor([[2, 0, 7], [1, 4, 0]], dtype=torch.int32), torch.tensor([9], dtype=torch.int32)]
        for counts in cases:
            tokens = torch.zeros(int(counts.sum()), 0)
            ref = _probe_indices(original_permute, tokens, counts)
            got = _direct_indices(tokens, counts)
            if not all(isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
                       for a, b in zip(ref[:2], got[:2])) or ref[2] != got[2]:
                return False
        return True
    except Exception:
        return False


def check_counts(local_counts: torch.Tensor, n_rows: int) -> None:
    """Inconsistent routing counts fail loudly without a host sync: a device-side assert that the
    counts sum to the rows (on CUDA it raises at the next synchronisation, as a device-side
    assert; on CPU at once). Without it, counts above the rows would leave zero rows where tokens
    should be (DeepSpeed's own function raises IndexError there)."""
    if isinstance(local_counts, torch.Tensor) and local_counts.numel():
        torch._assert_async(local_counts.sum() == n_rows,
                            f"deepspeed_fused moe_reorder: local_counts must sum to the {n_rows} token rows")


def _make_autoep_functions(original_permute, original_unpermute, direct: bool):
    def permute_by_local_expert(tokens, local_counts):
        _AUTOEP_CALLS.fused += 1  # one per layer forward (the fused local path calls it only for ep_size > 1)
        check_counts(local_counts, tokens.shape[0])
        if direct:
            permuted_indices, aligned_counts, n_tokens = _direct_indices(tokens, local_counts)
        else:
            permuted_indices, aligned_counts, n_tokens = _probe_indices(original_permute, tokens, local_counts)
        permuted = reorder.permute_rows(tokens, permuted_indices, validate=_AUTOEP["validate"] > 0)
        return permuted, permuted_indices, aligned_counts, n_tokens

    def unpermute_by_local_expert(expert_output, permuted_indices, n_tokens):
        return reorder.unpermute_rows(expert_output, permuted_indices, n_tokens, validate=_AUTOEP["validate"] > 0)

    permute_by_local_expert.__doc__ = ("deepspeed_fused: " + (original_permute.__doc__ or "")).strip()
    unpermute_by_local_expert.__doc__ = ("deepspeed_fused: " + (original_unpermute.__doc__ or "")).strip()
    permute_by_local_expert._deepspeed_fused = True
    unpermute_by_local_expert._deepspeed_fused = True
    return permute_by_local_expert, unpermute_by_local_expert


def _install_autoep(validate: bool) -> None:
    layer = _autoep_module()
    if _AUTOEP["count"] == 0:
        originals = (layer.permute_by_local_expert, layer.unpermute_by_local_expert)
        _AUTOEP["direct"] = _direct_matches(originals[0])
        ours = _make_autoep_functions(*originals, direct=_AUTOEP["direct"])
        layer.permute_by_local_expert, layer.unpermute_by_local_expert = ours
        _AUTOEP["originals"], _AUTOEP["ours"] = originals, ours
    _AUTOEP["count"] += 1
    _AUTOEP["validate"] += int(validate)


def _uninstall_autoep(validate: bool) -> None:
    if _AUTOEP["count"] == 0:
        return
    _AUTOEP["count"] -= 1
    _AUTOEP["validate"] = max(0, _AUTOEP["validate"] - int(validate))
    if _AUTOEP["count"] == 0:
        layer = _autoep_module()
        ours = _AUTOEP["ours"]
        if layer.permute_by_local_expert is ours[0]:
            layer.permute_by_local_expert = _AUTOEP["originals"][0]
        if layer.unpermute_by_local_expert is ours[1]:
            layer.unpermute_by_local_expert = _AUTOEP["originals"][1]
        _AUTOEP["originals"] = _AUTOEP["ours"] = None


# ---- the whole local token path (DeepSpeed 0.19.8's AutoEPMoELayer._forward) ----------------------
# What is taken over is checked by source hash at install: the layer's forward, the combine and
# the pre-expert score step must be the code this path was written against (DeepSpeed 0.19.8).
# Any other version keeps DeepSpeed's forward (and still gets the gathers above), and the
# report says why. Per call, folded tensor parallelism, DeepEP and inputs the kernels cannot take
# run DeepSpeed's forward.
_LOCAL_SOURCES = {
    "AutoEPMoELayer._forward": "aaeba465e7dff210",
    "AutoEPMoELayer.forward": "44c146856ba8aea4",
    "combine_from_routed": "452b0879012446b1",
    "apply_scores_before_experts_if_enabled": "932035ecfee91ba9",
}
_LOCAL = {"count": 0, "original": None, "why": ""}


def _source_hash(fn) -> str:
    import hashlib
    import inspect
    import textwrap

    return hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()[:16]


def _local_path_mismatch(layer) -> str:
    """Empty when this DeepSpeed's AutoEP code is the code the local path replaces; else why not."""
    try:
        cls = layer.AutoEPMoELayer
        found = {"AutoEPMoELayer._forward": getattr(cls, "_forward", None), "AutoEPMoELayer.forward": cls.forward,
                 "combine_from_routed": layer.combine_from_routed,
                 "apply_scores_before_experts_if_enabled": layer.apply_scores_before_experts_if_enabled}
        for name, fn in found.items():
            if fn is None:
                return f"DeepSpeed has no {name}"
            if _source_hash(fn) != _LOCAL_SOURCES[name]:
                return f"DeepSpeed's {name} differs from the 0.19.8 code this path replaces"
        return ""
    except Exception as e:  # source not readable (zipped install, ...)
        return f"DeepSpeed's AutoEP source could not be checked ({type(e).__name__})"


def _fused_local_forward(self, hidden_states):
    """AutoEPMoELayer._forward with the local token work as gathers: the routed rows go from the
    tokens straight into the expert-major buffer (``autoep_size == 1``, padded) or the all-to-all
    send buffer (``> 1``), and come back through one fused gather-combine."""
    layer = _autoep_module()
    original = _LOCAL["original"]
    bsz, seqlen, hdim = hidden_states.shape
    handles = getattr(self, "folding_group_handles", None)
    if ((handles is not None and handles.spec.tp_size > 1)
            or (self.ep_size > 1 and self.comm_backend == layer.DEEPEP_BACKEND)
            or not reorder.kernels_take(hidden_states)[0]):
        return original(self, hidden_states)  # its reorder runs our permute_by_local_expert (counted there)
    x = hidden_states.reshape(-1, hdim)
    # DeepSpeed's own early checks (fail every rank before any collective)
    if self.combine_impl == "fused_weighted_sum" and not self._fused_combine_checked:
        layer.fused_token_ops.assert_supported(x, score_apply=self.score_apply)
        self._fused_combine_checked = True
    if self.row_weighting_impl == "fused" and not self._fused_row_weighting_checked:
        layer.fused_token_ops.assert_row_weighting_supported(x, x.new_empty((x.shape[0], 1), dtype=torch.float32))
        self._fused_row_weighting_checked = True
    ro = layer.RouterOutput(*self.router(x, self.expert_bias))
    pending_plan = None
    if self.async_split_plan and self.ep_size > 1 and self.comm_backend == layer.COMM_BACKEND:
        pending_plan = self._start_async_split_plan(ro.num_tokens_per_expert)
    with torch.no_grad():
        self.tokens_per_expert.add_(ro.num_tokens_per_expert)
    top_k = self.top_k
    sorted_assignments = torch.argsort(ro.selected_experts.view(-1), stable=True)
    pre = ro.top_scores if self.score_apply == "pre" else None
    post = ro.top_scores if self.score_apply == "post" else None
    validate = _AUTOEP["validate"] > 0
    if self.ep_size == 1:
        _AUTOEP_CALLS.fused += 1  # (ep_size > 1: counted in permute_by_local_expert below)
        n_routed = sorted_assignments.numel()
        stand_in = x.new_empty((n_routed, 0))
        if _AUTOEP["direct"]:
            permuted_indices, aligned_counts, _ = _direct_indices(stand_in, ro.num_tokens_per_expert)
        else:
            permuted_indices, aligned_counts, _ = _probe_indices(_AUTOEP["originals"][0], stand_in,
                                                                 ro.num_tokens_per_expert)
        if validate:
            reorder.validate_permutation(permuted_indices, n_routed)
        maps = reorder.route_maps(sorted_assignments, top_k, permuted_indices)
        expert_output = self.experts(reorder.route_dispatch(x, maps, pre), aligned_counts)
    else:
        if pending_plan is not None:
            plan = self._wait_async_split_plan(pending_plan)
        else:
            plan = layer.compute_split_plan(selected_experts=ro.selected_experts, num_experts=self.num_experts,
                                            ep_size=self.ep_size, num_local_experts=self.num_local_experts,
                                            ep_group=self.ep_group, num_tokens_per_expert=ro.num_tokens_per_expert)
        maps = reorder.route_maps(sorted_assignments, top_k)
        routed = reorder.route_dispatch(x, maps, pre)  # the all-to-all send buffer, in one pass
        routed = layer._AllToAllV.apply(self.ep_group, routed, plan.input_splits, plan.output_splits)
        routed, perm_indices, aligned_counts, n_tokens = layer.permute_by_local_expert(routed,
                                                                                      plan.local_counts_by_source)
        expert_output = self.experts(routed, aligned_counts)
        expert_output = layer.unpermute_by_local_expert(expert_output, perm_indices, n_tokens)
        expert_output = layer._AllToAllV.apply(self.ep_group, expert_output, plan.output_splits, plan.input_splits)
    output = reorder.route_combine(expert_output, maps, post).reshape(bsz, seqlen, hdim)
    return self._finalize_output(output, x, hidden_states, hdim)


def _install_local_path() -> None:
    layer = _autoep_module()
    if _LOCAL["count"] == 0:
        why = _local_path_mismatch(layer)
        _LOCAL["why"] = why
        if not why:
            _LOCAL["original"] = layer.AutoEPMoELayer._forward
            layer.AutoEPMoELayer._forward = _fused_local_forward
    _LOCAL["count"] += 1


def _uninstall_local_path() -> None:
    if _LOCAL["count"] == 0:
        return
    _LOCAL["count"] -= 1
    if _LOCAL["count"] == 0 and _LOCAL["original"] is not None:
        cls = _autoep_module().AutoEPMoELayer
        if cls.__dict__.get("_forward") is _fused_local_forward:
            cls._forward = _LOCAL["original"]
        _LOCAL["original"] = None


def local_path_patched() -> bool:
    """Whether AutoEP layers run the fused local token path now."""
    try:
        return _autoep_module().AutoEPMoELayer.__dict__.get("_forward") is _fused_local_forward
    except Exception:
        return False


def autoep_patched() -> bool:
    """Whether DeepSpeed's AutoEP reorder functions are ours now."""
    try:
        return bool(getattr(_autoep_module().permute_by_local_expert, "_deepspeed_fused", False))
    except Exception:
        return False


def _autoep_layers(model: torch.nn.Module) -> int:
    try:
        from deepspeed.module_inject.auto_ep_layer import AutoEPMoELayer
    except Exception:
        return 0
    return sum(isinstance(m, AutoEPMoELayer) for m in model.modules())


# ----------------------------------------------------------------------------------------------
# Integration 2: transformers experts implementation
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def _silu_forwards() -> tuple:
    fns = [torch.nn.SiLU.forward]
    try:
        from transformers.activations import SiLUActivation

        fns.append(SiLUActivation.forward)
    except ImportError:  # pragma: no cover - transformers without it
        pass
    return tuple(fns)


def fused_gate(experts: torch.nn.Module) -> bool:
    """Whether an experts module's gate is transformers' default, ``act_fn(gate) * up`` of the
    chunked gate-up projection (the class keeps ``_default_apply_gate``: a family with its own
    gate, GPT-OSS's clamped one or a soft-capped one, does not), with SiLU as ``act_fn`` (the
    forward of ``torch.nn.SiLU`` or of transformers' ``SiLUActivation``, not a hub kernel's):
    then :func:`~deepspeed_fused.ops.moe_reorder.swiglu` computes it."""
    if _gate_form(getattr(type(experts), "_apply_gate", None)) != "default" or "_apply_gate" in experts.__dict__:
        return False
    act = getattr(experts, "act_fn", None)
    return (isinstance(act, torch.nn.Module) and getattr(type(act), "forward", None) in _silu_forwards()
            and not (act._forward_hooks or act._forward_pre_hooks))


def _gate_oai(self, gate_up: torch.Tensor) -> torch.Tensor:  # GPT-OSS, as transformers 5.24 writes it
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=self.limit)
    up = up.clamp(min=-self.limit, max=self.limit)
    glu = gate * torch.sigmoid(gate * self.alpha)
    gated_output = (up + 1) * glu
    return gated_output


@functools.lru_cache(maxsize=None)
def _gate_form(fn) -> Any:
    """What an experts class's ``_apply_gate`` is: ``"default"`` (transformers'
    ``_default_apply_gate`` itself), ``"oai"`` (the bytecode of :func:`_gate_oai`, its module's
    ``torch`` torch's own) or None. Read once per function (the experts forward asks per call)."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # pragma: no cover - transformers without the experts interface
        _default_apply_gate = None
    if fn is not None and fn is _default_apply_gate:
        return "default"
    if hasattr(fn, "__code__") and fn.__globals__.get("torch") is torch and _code_key(fn) == _code_key(_gate_oai):
        return "oai"
    return None


def oai_gate_of(experts: torch.nn.Module) -> bool:
    """Whether an experts module's gate is GPT-OSS's clamped gate (its class's ``_apply_gate`` has
    the bytecode of :func:`_gate_oai`, its module's ``torch`` is torch, ``alpha`` and ``limit`` are
    Python numbers): then :func:`~deepspeed_fused.ops.moe_reorder.oai_gate` computes it."""
    if _gate_form(getattr(type(experts), "_apply_gate", None)) != "oai" or "_apply_gate" in experts.__dict__:
        return False
    return all(isinstance(getattr(experts, a, None), (int, float)) and not isinstance(getattr(experts, a), bool)
               for a in ("alpha", "limit"))


def deepspeed_fused_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts forward with gathers for the dispatch and the combine.

    Assignments are sorted by expert, mapped to slots and counted into grouped_mm's offsets by
    one op (:func:`~deepspeed_fused.ops.moe_reorder.route_sort`, two launches, where grouped_mm
    runs a sort, a histogram and a cumsum);
    ``hidden[perm // top_k]`` is :func:`~deepspeed_fused.ops.moe_reorder.route_dispatch` (backward:
    a gather-sum per token, no scatter-add); the GEMMs are transformers' ``_grouped_linear``;
    the default gate with SiLU (:func:`fused_gate`) is one
    :func:`~deepspeed_fused.ops.moe_reorder.swiglu` (one kernel each way, eager's rounding);
    weighting, the inverse permutation and the sum over ``top_k`` are one
    :func:`~deepspeed_fused.ops.moe_reorder.route_combine` (FP32 sum, one rounding); per-expert
    biases are :func:`~deepspeed_fused.ops.moe_reorder.expert_bias` (no ``[S, out]`` gather, a
    segmented sum for the gradient where eager runs an index-put over every row). Sentinel
    expert ids (``>= num_experts``, experts of other ranks under transformers' expert parallelism)
    sit in padding slots: zero rows, no GEMM rows and no contribution or gradient."""
    from transformers.integrations.moe import _grouped_linear

    calls = self.__dict__.get(_CALLS_ATTR)
    if calls is not None:
        calls.fused += 1
    num_top_k = top_k_index.size(-1)
    num_experts = self.num_experts

    # One counting sort builds what grouped_mm's sort, histc and cumsum build, plus the route maps
    # (two launches, no host sync). The order within an expert is the assignments' own (a stable
    # sort; torch.sort's is unspecified), which changes no row's result.
    sort = reorder.route_sort(top_k_index.reshape(-1), num_experts, num_top_k)
    maps, offsets = sort.maps, sort.offsets
    # Sentinels (ids >= num_experts) exist only under transformers' expert parallelism (>= 5.2x says
    # so; older 5.x does not, so they are assumed possible). They sort after every expert and
    # their slots are padding: the dispatch writes zero rows there, the combine never reads them
    # and its backward writes zero gradients there, and grouped_mm leaves rows past offsets[-1]
    # unwritten, which only the next grouped_mm (reading rows below offsets[-1]) consumes. So the
    # outputs need no mask. A per-row expert bias (GPT-OSS) is expert_bias: transformers' gather
    # bias[ids] sums its gradient over every row, the sentinels' included (hence its masks); this
    # one sums each expert's own rows offsets[e-1]:offsets[e] only.
    has_bias = getattr(self, "has_bias", False)
    selected = reorder.route_dispatch(hidden_states, maps)

    if getattr(self, "has_gate", True):
        weight, bias = self.gate_up_proj, (self.gate_up_proj_bias if has_bias else None)
    else:
        weight, bias = self.up_proj, (self.up_proj_bias if has_bias else None)
    is_transposed = getattr(self, "is_transposed", False)
    proj = _grouped_linear(selected, weight, offsets, is_transposed=is_transposed)
    # the activation, decided once: none (act_fn), the fused SiLU gate, GPT-OSS's gate (which adds
    # the gate-up bias as its rows load) or the module's own
    gate = None if not getattr(self, "has_gate", True) else \
        "swiglu" if fused_gate(self) else "oai" if oai_gate_of(self) else "module"
    if bias is not None and gate != "oai":
        proj = reorder.expert_bias(proj, bias, sort.experts, offsets)
    if gate is None:
        proj = self.act_fn(proj)
    elif gate == "swiglu":
        proj = reorder.swiglu(proj)  # silu(gate) * up in one kernel (its backward one more)
    elif gate == "oai":  # GPT-OSS's clamped gate, one kernel each way, its bias added as the rows load
        bias_args = (bias, sort.experts, offsets) if bias is not None else ()
        proj = reorder.oai_gate(proj, self.alpha, self.limit, *bias_args)
    else:
        proj = self._apply_gate(proj)
    proj = _grouped_linear(proj, self.down_proj, offsets, is_transposed=is_transposed)
    if has_bias:
        proj = reorder.expert_bias(proj, self.down_proj_bias, sort.experts, offsets)
    if getattr(self, "has_post_expert_norm", False):
        proj = self.post_expert_norm(proj)

    out = reorder.route_combine(proj, maps, top_k_weights)
    return out.to(hidden_states.dtype)


def register_experts_implementation() -> None:
    """Register ``"deepspeed_fused"`` in transformers' ``ALL_EXPERTS_FUNCTIONS`` (idempotent)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    if ALL_EXPERTS_FUNCTIONS.get(IMPL_NAME, None) is not deepspeed_fused_experts_forward:
        ALL_EXPERTS_FUNCTIONS.register(IMPL_NAME, deepspeed_fused_experts_forward)


def _experts_modules(model: torch.nn.Module) -> list:
    """Modules of classes decorated with transformers' ``@use_experts_implementation``."""
    return [m for m in model.modules()
            if hasattr(m, "has_gate") and hasattr(m, "is_transposed") and hasattr(type(m), "_apply_gate")
            and getattr(m, "config", None) is not None]


def _get_impl(model) -> Any:
    if hasattr(model, "get_experts_implementation"):
        return model.get_experts_implementation()
    return model.config._experts_implementation


# ----------------------------------------------------------------------------------------------
# The feature
# ----------------------------------------------------------------------------------------------


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
