"""Applying and reverting the moe_reorder feature: the AutoEP patches (DeepSpeed's permute /
unpermute functions and the fused local token path), the transformers experts implementation
(the fused call), and the router dispatchers."""
from __future__ import annotations

import collections
import weakref
from typing import Any

import torch

from ...ops import moe_reorder as reorder
from ..base import OptInMarker, SharedCallCounts, count_op_call, counted_if_recompute_stops, op_call_mark
from .recognition import _local_path_mismatch, fused_gate, oai_gate_of, router_form

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
        mark = op_call_mark()
        check_counts(local_counts, tokens.shape[0])
        if direct:
            permuted_indices, aligned_counts, n_tokens = _direct_indices(tokens, local_counts)
        else:
            permuted_indices, aligned_counts, n_tokens = _probe_indices(original_permute, tokens, local_counts)
        permuted = reorder.permute_rows(tokens, permuted_indices, validate=_AUTOEP["validate"] > 0)
        # one per layer forward (the fused local path calls it only for ep_size > 1): kernels or reference
        count_op_call(_AUTOEP_CALLS, mark)
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
# What is taken over is checked by source hash at install (recognition._local_path_mismatch).
# Per call, folded tensor parallelism, DeepEP and inputs the kernels cannot take run DeepSpeed's forward.
_LOCAL = {"count": 0, "original": None, "why": ""}


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
    mark = op_call_mark()

    def count():  # (ep_size > 1: counted in permute_by_local_expert)
        if self.ep_size == 1:
            count_op_call(_AUTOEP_CALLS, mark)

    x = hidden_states.reshape(-1, hdim)
    # (a non-reentrant checkpoint's recomputation may end inside the combine: counted there too)
    with counted_if_recompute_stops(count):
        output = _local_tokens_as_gathers(self, layer, x).reshape(bsz, seqlen, hdim)
    count()
    return self._finalize_output(output, x, hidden_states, hdim)


def _local_tokens_as_gathers(self, layer, x):
    """The local token work of :func:`_fused_local_forward` on the rows ``x`` (uncounted): the
    router, the dispatch into the experts (through the all-to-all above ``autoep_size`` 1) and the
    combine, whose ``[tokens, hidden]`` result it returns."""
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
    return reorder.route_combine(expert_output, maps, post)


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


# dtypes torch's grouped_mm takes, by device type (fp32/bf16/fp16 on CUDA and CPU, torch 2.11-2.13;
# transformers' _grouped_mm calls it on sm80+ and recent CPU torch whatever the dtype, so a float64
# model failed in transformers' own grouped_mm experts forward as well)
_HALF_AND_FP32 = (torch.float32, torch.bfloat16, torch.float16)
_GROUPED_MM_DTYPES = {"cuda": _HALF_AND_FP32, "cpu": _HALF_AND_FP32}


def _experts_linear(grouped_linear, x, weight, offsets, is_transposed):
    """transformers' ``_grouped_linear`` (passed in), or, for a dtype torch's grouped_mm refuses on
    this device (float64), transformers' own per-expert fallback op
    (``transformers::grouped_mm_fallback``: one ``mm`` per expert, with its backward)."""
    takes = _GROUPED_MM_DTYPES.get(x.device.type)
    if takes is None or x.dtype in takes:
        return grouped_linear(x, weight, offsets, is_transposed=is_transposed)
    w = weight if is_transposed else weight.transpose(-2, -1)
    return torch.ops.transformers.grouped_mm_fallback(x.to(w.dtype), w, offs=offsets)


def deepspeed_fused_experts_forward(self: torch.nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' ``grouped_mm`` experts forward with gathers for the dispatch and the combine.

    Assignments are sorted by expert, mapped to slots and counted into grouped_mm's offsets by
    one op (:func:`~deepspeed_fused.ops.moe_reorder.route_sort`, two launches, where grouped_mm
    runs a sort, a histogram and a cumsum);
    ``hidden[perm // top_k]`` is :func:`~deepspeed_fused.ops.moe_reorder.route_dispatch` (backward:
    a gather-sum per token, no scatter-add); the GEMMs are transformers' ``_grouped_linear``
    (its per-expert fallback op for a dtype grouped_mm refuses: float64);
    the default gate with SiLU (:func:`fused_gate`) is one
    :func:`~deepspeed_fused.ops.moe_reorder.swiglu` (one kernel each way, eager's rounding);
    weighting, the inverse permutation and the sum over ``top_k`` are one
    :func:`~deepspeed_fused.ops.moe_reorder.route_combine` (FP32 sum, one rounding); per-expert
    biases are :func:`~deepspeed_fused.ops.moe_reorder.expert_bias` (no ``[S, out]`` gather, a
    segmented sum for the gradient where eager runs an index-put over every row). Sentinel
    expert ids (``>= num_experts``, experts of other ranks under transformers' expert parallelism)
    sit in padding slots: zero rows, no GEMM rows and no contribution or gradient."""
    mark = op_call_mark()  # counted once its ops ran: fused, or reference when an op ran its torch reference
    calls = self.__dict__.get(_CALLS_ATTR)
    # (a non-reentrant checkpoint's recomputation may end inside the combine, whose saved inputs are
    # the layer's last: counted there too)
    with counted_if_recompute_stops(lambda: count_op_call(calls, mark)):
        out = _experts_as_gathers(self, hidden_states, top_k_index, top_k_weights)
    count_op_call(calls, mark)
    return out.to(hidden_states.dtype)


def _experts_as_gathers(self, hidden_states, top_k_index, top_k_weights):
    """The work of :func:`deepspeed_fused_experts_forward` (uncounted): the combined rows, in the
    combine's dtype."""
    from transformers.integrations.moe import _grouped_linear

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
    proj = _experts_linear(_grouped_linear, selected, weight, offsets, is_transposed)
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
    proj = _experts_linear(_grouped_linear, proj, self.down_proj, offsets, is_transposed)
    if has_bias:
        proj = reorder.expert_bias(proj, self.down_proj_bias, sort.experts, offsets)
    if getattr(self, "has_post_expert_norm", False):
        proj = self.post_expert_norm(proj)

    return reorder.route_combine(proj, maps, top_k_weights)


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


# ---- the routers: their selection fused (ops/moe_reorder/router.py) --------------------------------
_ROUTER_OPT_IN = OptInMarker("moe_reorder", "_deepspeed_fused_router", "_deepspeed_fused_router_calls")
_ROUTER_DISPATCHERS: dict = {}  # class -> its dispatcher (installed once per process)



def _logits_first_forward(self, original, variant, hidden_states):
    # [tokens, hidden] states only (the templates' softmax over dim 1 is over the k there); Cohere2's
    # sigmoid branch keeps its code
    if hidden_states.dim() != 2 or (variant == "selectable" and self.expert_selection_fn != "softmax"):
        return original(self, hidden_states)
    bias = self.bias if variant == "bias" else None
    router_logits = torch.nn.functional.linear(hidden_states, self.weight, bias)
    if variant == "selectable":  # an FP32 softmax, cast to the hidden states' dtype
        scores, indices = reorder.topk_logits_softmax(router_logits, self.top_k, torch.float32, hidden_states.dtype)
    else:  # the softmax in the logits' dtype
        scores, indices = reorder.topk_logits_softmax(router_logits, self.top_k)
    return router_logits, scores, indices


def _router_dispatcher(original, renorm, cast):
    def forward(self, hidden_states):
        if self.__dict__.get(_ROUTER_OPT_IN.marker) is not _ROUTER_OPT_IN.value:
            return original(self, hidden_states)
        if renorm == "grouped":
            hidden_states = hidden_states.view(-1, self.hidden_dim)
            router_logits = torch.nn.functional.linear(hidden_states.type(torch.float32),
                                                       self.weight.type(torch.float32))
            weights, indices = reorder.group_topk_sigmoid(
                router_logits, self.e_score_correction_bias, self.top_k, self.num_group, self.topk_group,
                bool(self.norm_topk_prob), self.routed_scaling_factor)
            return router_logits, weights, indices
        if renorm == "logits_first":
            return _logits_first_forward(self, original, cast, hidden_states)
        hidden_states = hidden_states.reshape(-1, self.hidden_dim)
        router_logits = torch.nn.functional.linear(hidden_states, self.weight)
        norm = bool(getattr(self, renorm)) if isinstance(renorm, str) else renorm
        scores, indices = reorder.topk_softmax(router_logits, self.top_k, norm,
                                               router_logits.dtype if cast else None)
        return router_logits, scores, indices

    forward.__deepspeed_fused_original__ = original
    forward.__wrapped__ = original
    forward.__name__ = getattr(original, "__name__", "forward")
    forward.__doc__ = original.__doc__
    return forward


def _opt_in_routers(model: torch.nn.Module) -> tuple:
    """Opt the model's recognised top-k softmax routers in (installing their classes' dispatchers
    once); returns (routers fused, {class name: count} of the experts' sibling gates kept)."""
    fused, kept = 0, collections.Counter()
    for parent in model.modules():
        if not any(n == "experts" for n, _ in parent.named_children()):
            continue
        for name in ("gate", "router"):
            gate = getattr(parent, name, None)
            if not isinstance(gate, torch.nn.Module):
                continue
            cls = type(gate)
            form = router_form(cls)
            if form == ("logits_first", "selectable") and getattr(gate, "expert_selection_fn", None) != "softmax":
                form = None  # Cohere2-MoE's sigmoid selection: its own code
            if form is None or "forward" in gate.__dict__:
                kept[cls.__name__] += 1
                continue
            if cls not in _ROUTER_DISPATCHERS:
                _ROUTER_DISPATCHERS[cls] = _router_dispatcher(cls.forward, *form)
                cls.forward = _ROUTER_DISPATCHERS[cls]
            _ROUTER_OPT_IN.mark(gate)
            fused += 1
    return fused, kept
