"""The moe_reorder feature's templates: the forms it recognises, written as their sources write
them (:mod:`.recognition` compares a candidate's bytecode with these, so each repeats that code on
purpose): transformers' router forwards, GPT-OSS's experts gate, and the source hashes of the
DeepSpeed AutoEP code the fused local token path replaces."""
import torch
import torch.nn.functional as F  # noqa: F401  (the name the router templates below use, as transformers does)
from torch import nn  # noqa: F401  (likewise)


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


def _gate_oai(self, gate_up: torch.Tensor) -> torch.Tensor:  # GPT-OSS, as transformers 5.24 writes it
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = gate.clamp(min=None, max=self.limit)
    up = up.clamp(min=-self.limit, max=self.limit)
    glu = gate * torch.sigmoid(gate * self.alpha)
    gated_output = (up + 1) * glu
    return gated_output



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
