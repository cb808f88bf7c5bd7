"""The known gated-MLP forwards and activation forwards of the ``mlp_act`` feature, as templates
compiled here.

Each template is written as Hugging Face writes one MLP ``forward``; :mod:`.recognition` compares
the bytecode of a model's forward with these. Attribute names of ``self`` are placeholders: a
model's forward may name its projections and its activation anything, as long as it uses them in
the template's order and roles. Nothing here is called.
"""
from __future__ import annotations

import torch
from torch import nn


# ---- gated MLP forwards: (template, layout, roles of self's attributes in order of first use) ----
def _t_split(self, x):  # Llama, Mistral, Qwen3, Gemma, ...
    down_proj = self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))
    return down_proj


def _t_split_return(self, x):  # Qwen2, Qwen2.5-VL, Exaone
    return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _t_split_named(self, x):
    hidden_states = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
    return self.down_proj(hidden_states)


def _t_split_dropout(self, x):  # T5Gemma, GTE: the product dropped out before the down projection
    hidden_states = self.act_fn(self.gate_proj(x)) * self.up_proj(x)
    hidden_states = self.dropout(hidden_states)
    down_proj = self.down_proj(hidden_states)
    return down_proj


def _t_fused_up_times_act(self, hidden_states):  # Phi-3, GLM, GLM-4
    up_states = self.gate_up_proj(hidden_states)
    gate, up_states = up_states.chunk(2, dim=-1)
    up_states = up_states * self.activation_fn(gate)
    return self.down_proj(up_states)


def _t_fused_indexed(self, hidden_states):  # Granite MoE's shared MLP
    hidden_states = self.input_linear(hidden_states)
    chunked_hidden_states = hidden_states.chunk(2, dim=-1)
    hidden_states = self.activation(chunked_hidden_states[0]) * chunked_hidden_states[1]
    hidden_states = self.output_linear(hidden_states)
    return hidden_states


def _t_fused_gate_second(self, hidden_states):  # Moonshine's decoder MLP: the gate is the second half
    hidden_states = self.fc1(hidden_states)
    hidden_states, gate = hidden_states.chunk(2, dim=-1)
    hidden_states = self.activation_fn(gate) * hidden_states
    hidden_states = self.fc2(hidden_states)
    return hidden_states


SPLIT_ROLES = ("down", "act", "gate", "up")
FORMS = [
    (_t_split, "split", SPLIT_ROLES),
    (_t_split_return, "split", SPLIT_ROLES),
    (_t_split_named, "split", ("act", "gate", "up", "down")),
    (_t_split_dropout, "split", ("act", "gate", "up", "dropout", "down")),
    (_t_fused_up_times_act, "gate_up", ("gate_up", "act", "down")),
    (_t_fused_indexed, "gate_up", ("gate_up", "act", "down")),
    (_t_fused_gate_second, "up_gate", ("gate_up", "act", "down")),
]


# ---- activation module forwards -> activation (None: read the instance's ``act`` attribute) ------
def _a_silu(self, input):  # transformers' SiLUActivation
    return nn.functional.silu(input)


def _a_delegate(self, input):  # transformers' GELUActivation, GELUTanh: self.act chosen in __init__
    return self.act(input)


ACT_FORMS = [(_a_silu, "silu"), (_a_delegate, None)]
