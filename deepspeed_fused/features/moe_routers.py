"""The moe_reorder feature's routers: transformers' router forwards recognised by their bytecode
and their selection handed to the fused router ops (:mod:`deepspeed_fused.ops.moe_reorder.router`).
Split from :mod:`.moe_reorder` (the experts implementation and AutoEP), which opts the routers of
the experts modules it takes in."""
from __future__ import annotations

import collections
from typing import Any

import torch
import torch.nn.functional as F  # noqa: F401  (the name the router templates below use, as transformers does)
from torch import nn  # noqa: F401  (likewise)

from ..ops import moe_reorder as reorder
from .base import OptInMarker, global_names

# ---- the router: its selection fused (ops/moe_reorder/router.py) ----------------------------------
# Templates of transformers' top-k softmax router forwards, written as transformers 5.24 writes them:
# a router class is taken only when its forward's bytecode (instructions, names, constants,
# variables) is one of these and its module's ``F`` and ``torch`` are torch's own. What each
# computes: the FP32 softmax of the logits, the top-k, renormalised (always, or where
# ``norm_topk_prob``), cast to the logits' dtype or kept FP32.
def _router_norm_optional(self, hidden_states):  # Qwen2/3-MoE, OLMoE, FlexOlmo, Qwen3-Next, ...
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)  # (seq_len, num_experts)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)  # (seq_len, top_k)
    if self.norm_topk_prob:
        router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    router_scores = router_top_value
    return router_logits, router_scores, router_indices


def _router_norm_cast(self, hidden_states):  # Qwen3.5-MoE, Qwen3-VL-MoE, Qwen3-Omni-MoE text
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)  # (seq_len, num_experts)
    router_probs = torch.nn.functional.softmax(router_logits, dtype=torch.float, dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)  # (seq_len, top_k)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_top_value = router_top_value.to(router_logits.dtype)
    router_scores = router_top_value
    return router_logits, router_scores, router_indices


def _router_norm_fp32(self, hidden_states):  # Mixtral, MiniMax
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states, self.weight)  # (seq_len, num_experts)
    router_probs = torch.nn.functional.softmax(router_logits.float(), dim=-1)
    router_top_value, router_indices = torch.topk(router_probs, self.top_k, dim=-1)  # (seq_len, top_k)
    router_top_value /= router_top_value.sum(dim=-1, keepdim=True)
    router_scores = router_top_value
    return router_logits, router_scores, router_indices


def _router_grouped_sigmoid(self, hidden_states):  # DeepSeek-V3, GLM-4 MoE, Dots1, Exaone-MoE, ...
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    group_scores = (
        scores_for_choice.view(-1, self.num_group, self.num_experts // self.num_group)
        .topk(2, dim=-1)[0]
        .sum(dim=-1)
    )
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = (
        group_mask.unsqueeze(-1)
        .expand(-1, self.num_group, self.num_experts // self.num_group)
        .reshape(-1, self.num_experts)
    )
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * self.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


# the routers that take the top-k of the logits first, then the softmax of those k
def _router_logits_first_bias(self, hidden_states):  # GPT-OSS
    router_logits = F.linear(hidden_states, self.weight, self.bias)  # (num_tokens, num_experts)
    router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)  # (num_tokens, top_k)
    router_scores = torch.nn.functional.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)
    return router_logits, router_scores, router_indices


def _router_logits_first(self, hidden_states):  # Aria's text MoE
    router_logits = nn.functional.linear(hidden_states, self.weight)  # (num_tokens, num_experts)
    top_k_logits, top_k_index = torch.topk(router_logits, self.top_k, dim=-1)  # (num_tokens, top_k)
    top_k_weights = nn.functional.softmax(top_k_logits, dim=-1)  # (num_tokens, top_k)
    return router_logits, top_k_weights, top_k_index


def _router_logits_first_selectable(self, hidden_states):  # Cohere2-MoE (its softmax branch is fused)
    router_logits = F.linear(hidden_states, self.weight)
    router_scores, selected_experts = torch.topk(router_logits, self.top_k, dim=-1)
    if self.expert_selection_fn == "softmax":
        router_scores = F.softmax(router_scores, dim=1, dtype=torch.float)
    elif self.expert_selection_fn == "sigmoid":
        router_scores = F.sigmoid(router_scores)
        if self.norm_topk_prob:
            router_scores = router_scores / torch.sum(router_scores, dim=-1, keepdims=True)
    else:
        raise ValueError("`expert_selection_fn` can only be `softmax` or `sigmoid`")

    # we cast back to the input dtype if it was upcasted in softmax
    router_scores = router_scores.to(hidden_states.dtype)

    return router_logits, router_scores, selected_experts


# template -> (renormalise: True, or the attribute that says so; cast the scores to the logits' dtype);
# the grouped sigmoid router: "grouped"
# the routers that take the top-k first: "logits_first" with the variant (the bias, the softmax's dtype)
_ROUTER_FORMS = ((_router_norm_optional, "norm_topk_prob", True), (_router_norm_cast, True, True),
                 (_router_norm_fp32, True, False), (_router_grouped_sigmoid, "grouped", None),
                 (_router_logits_first_bias, "logits_first", "bias"), (_router_logits_first, "logits_first", "plain"),
                 (_router_logits_first_selectable, "logits_first", "selectable"))
_TORCH_GLOBALS = {"F": torch.nn.functional, "torch": torch, "nn": torch.nn}
_ROUTER_OPT_IN = OptInMarker("moe_reorder", "_deepspeed_fused_router", "_deepspeed_fused_router_calls")
_ROUTER_DISPATCHERS: dict = {}  # class -> its dispatcher (installed once per process)


def _code_key(fn) -> tuple:
    co = fn.__code__
    return (co.co_code, co.co_names, co.co_consts, co.co_varnames, co.co_argcount)


def router_form(cls) -> Any:
    """``(renormalise, cast)`` when ``cls.forward`` is one of transformers' top-k softmax router
    forwards, ``("grouped", None)`` for DeepSeek-V3's grouped sigmoid router, ``("logits_first",
    variant)`` for the routers that take the top-k of the logits before the softmax (bytecode equal
    to a template above, each of ``F`` / ``torch`` / ``nn`` it names torch's own), else None."""
    fwd = getattr(cls, "forward", None)
    fwd = getattr(fwd, "__deepspeed_fused_original__", fwd)
    if not hasattr(fwd, "__code__"):
        return None
    g = fwd.__globals__
    if any(name in global_names(fwd.__code__) and g.get(name) is not obj for name, obj in _TORCH_GLOBALS.items()):
        return None
    key = _code_key(fwd)
    for template, renorm, cast in _ROUTER_FORMS:
        if _code_key(template) == key:
            return renorm, cast
    return None


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
