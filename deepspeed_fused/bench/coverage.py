"""Suite ``coverage``: every causal-LM and image-text-to-text family of the installed transformers,
built tiny with random weights, run with every feature on and compared with the unpatched model.

For each family (a ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` or
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``, with the class that mapping names) the default
config is shrunk by walking its fields (and its sub-configs'): widths to 64, FFN widths to 128,
4 heads, 4 experts of which 2 per token, a 256-token vocabulary, and as few layers as cover every
distinct kind of layer the full config has (2 at least, so hybrid patterns stay valid); dropout,
layer drop and router jitter are zeroed. The model is built in fp32 from a fixed seed, deep-copied,
and both copies run one training step's forward and backward on the same random batch (2 x 16
tokens, a right-padded row, some labels -100; image-text models get text only: no pixels): the
unpatched one as it is, the other after ``patch_model`` with every registered feature on
(``rms_norm``, ``linear_cross_entropy``, ``moe_reorder``, ``rope``, ...). Recorded per family:
which RMSNorm modules were replaced out of those present (by class and by form, the form read from
what each module computes, not its name), whether the loss ran fused (the feature's own call
count) or why not, whether the experts ran the gathers (counted) or why not, every feature's
report and call counts, and the loss and gradient differences (loss relative to its value, each
parameter's gradient relative to its norm).

Each family runs in a process of its own under a time limit (on CPU a fork of the suite's process,
made after it imported torch, transformers and deepspeed_fused once; on a GPU spawned workers that
import them once and run family after family, a fresh one after any family that did not run
cleanly), so a family that fails, crashes or hangs is recorded, never fatal. A family whose tiny
model cannot be built or run is listed with the error: a limit of this harness, not a verdict on
the features.

Modes: ``fp32`` (CPU: kernels under Triton's interpreter; GPU: real kernels; target: loss within
1e-5 relative, every gradient within 1e-3 relative to its norm) and ``bf16`` (GPU only: both runs
in bf16, each compared with an fp32 run of the same bf16-rounded weights; the patched run's error
must stay within twice the eager bf16 run's error plus a floor, both recorded).

    python -m deepspeed_fused.bench coverage                        # every family, fp32
    python -m deepspeed_fused.bench coverage --modes fp32,bf16      # on a GPU
    python -m deepspeed_fused.bench coverage --families llama,gpt2 --out /tmp/cov
    python -m deepspeed_fused.bench coverage --render docs/benchmarks/coverage.json /tmp/cov_gpu/coverage.json

Outputs: ``coverage.json`` under ``--out`` (default ``docs/benchmarks/``) and ``coverage.md``
(``docs/coverage.md`` by default, next to the JSON with ``--out``).
Flags: ``--families A,B`` (model types or ``model_type/Class`` ids), ``--modes``, ``--timeout``
(s per family, default 300), ``--jobs`` (families at once, default 1), ``--md PATH``,
``--render JSON [JSON ...]`` (write the outputs from earlier runs' JSON files without running,
their records merged: CPU and GPU runs side by side).
"""
from __future__ import annotations

import argparse
import collections
import copy
import dataclasses
import json
import math
import os
import sys
import time
import traceback
import warnings
from typing import Any, Optional

from .common import OUT_DIR, env_fields

DOCS_DIR = os.path.dirname(OUT_DIR)
TITLE = "families of the installed transformers, every feature on, against the unpatched model"

# the comparison's tolerances
FP32_LOSS_RTOL = 1e-5  # |loss_patched - loss_eager| / |loss_eager|
FP32_GRAD_RTOL = 1e-3  # ||g_patched - g_eager|| / ||g_eager||, every parameter
NOISE_FACTOR = 2.0  # past it only by fp32 noise: no further from an fp64 run than 2x eager fp32 is
FP32_EPS = 2.0 ** -23
BF16_FACTOR = 2.0  # bf16: patched error vs fp32 <= factor * eager bf16 error vs fp32 + floor
BF16_LOSS_FLOOR = 2e-3
BF16_GRAD_FLOOR = 2e-2

BATCH, SEQ = 2, 16
HIDDEN, FFN, MOE_FFN, HEADS, KV_HEADS, HEAD_DIM, VOCAB = 64, 128, 32, 4, 2, 16, 256
EXPERTS, TOP_K = 4, 2
MAX_LAYERS = 6  # at most this many layers even when the full config has more kinds of layer
# the features turned on: every registered feature (rms_norm, linear_cross_entropy, moe_reorder,
# rope, ... as the registry holds them), each with its default options
def features_config() -> dict:
    from ..features.registry import all_features

    return {f.name: {"enabled": True} for f in all_features()}

# RMSNorm forms (as read from what a module computes; see norm_form)
RMS_FORMS = ("llama", "weight_before_cast", "offset", "gated", "gated_pre", "unweighted", "torch")
FORM_TEXT = {
    "llama": "Llama: w * (x / rms(x)) cast to the input dtype first",
    "weight_before_cast": "weight before the cast: (w * x / rms(x)) cast after (GPT-OSS, OLMo2)",
    "offset": "offset: (1 + w) * x / rms(x) (Gemma 1-3)",
    "gated": "gated: w * x / rms(x) * act(gate), act silu or sigmoid (Qwen3-Next, Qwen3.5, Kimi-Linear)",
    "gated_pre": "gated before the norm: w * rms-normalised (x * act(gate)) (Mamba2-style)",
    "unweighted": "no weight: x / rms(x)",
    "torch": "torch.nn.RMSNorm",
    "layernorm": "LayerNorm (mean subtracted; not an RMSNorm)",
    "other": "a norm-named module matching no known form",
}

# ---- families -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Family:
    model_type: str
    cls: str  # the model class the auto mapping names
    kind: str  # "causal-lm" or "image-text-to-text"

    @property
    def id(self) -> str:
        return f"{self.model_type}/{self.cls}"


def families() -> list:
    """Every (model type, class) of the two auto mappings, causal LMs first; a model type whose
    two mappings name the same class is listed once (as a causal LM)."""
    from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
                                                        MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)

    out, seen = [], set()
    for kind, mapping in (("causal-lm", MODEL_FOR_CAUSAL_LM_MAPPING_NAMES),
                          ("image-text-to-text", MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES)):
        for mt, names in mapping.items():
            for cls in (names if isinstance(names, (list, tuple)) else [names]):
                if (mt, cls) not in seen:
                    seen.add((mt, cls))
                    out.append(Family(mt, cls, kind))
    return out


def select(names: Optional[list]) -> list:
    """The families named (model types, or ``model_type/Class`` ids); all when ``names`` is empty."""
    fams = families()
    if not names:
        return fams
    out = []
    for n in names:
        hit = [f for f in fams if f.id == n or f.model_type == n]
        if not hit:
            raise ValueError(f"--families: unknown family {n!r} (not a model type or id of the installed "
                             "transformers' causal-LM or image-text-to-text mappings)")
        out += [f for f in hit if f not in out]
    return out


# ---- shrinking a config -------------------------------------------------------------------------
LAYER_KEYS = ("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "num_decoder_layers",
              "depth", "num_blocks", "layers", "text_layers")
ENCODER_LAYER_KEYS = ("encoder_layers", "num_encoder_layers", "encoder_num_layers")
HIDDEN_KEYS = ("hidden_size", "d_model", "n_embd", "n_embed", "embed_dim", "model_dim", "dim", "word_embed_proj_dim",
               "embedding_size", "out_hidden_size", "codebook_dim", "embedding_dim", "projection_dim",
               "text_hidden_size", "vision_hidden_size",
               "projector_hidden_size", "hidden_dim", "emb_dim")
FFN_KEYS = ("ffn_dim", "n_inner", "d_ff", "ffn_hidden_size", "decoder_ffn_dim", "encoder_ffn_dim", "mlp_dim",
            "intermediate_dim", "inner_hidden_size", "hidden_act_dim", "dense_intermediate_size")
HEAD_KEYS = ("num_attention_heads", "n_head", "num_heads", "decoder_attention_heads", "encoder_attention_heads",
             "n_heads", "attention_heads", "num_attention_heads_per_layer")
KV_KEYS = ("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "num_kv_groups",
           "n_kv_head")
HEAD_DIM_KEYS = ("head_dim", "attention_head_dim", "kv_channels", "head_size", "attention_head_size", "d_head")
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts", "n_experts",
               "num_routed_experts", "expert_num", "num_experts_routed")
TOPK_KEYS = ("num_experts_per_tok", "moe_top_k", "moe_topk", "top_k", "num_selected_experts",
             "experts_per_token", "moe_k", "num_experts_per_token", "topk")
SMALL = {  # other widths and counts (value -> at most this)
    "kv_lora_rank": 16, "q_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
    "qk_head_dim": 24, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 16,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1, "n_group": 2, "topk_group": 1,
    "mamba_d_state": 16, "state_size": 16, "ssm_state_size": 16, "d_state": 16, "mamba_n_heads": 8,
    "mamba_num_heads": 8, "mamba_head_dim": 16, "mamba_headdim": 16, "n_groups": 1, "mamba_n_groups": 1,
    "time_step_rank": 8, "mamba_dt_rank": 8, "num_memory_slots": 4, "num_global_tokens": 4,
    "conv_L_cache": 3, "num_key_value_groups": 2, "sliding_window": 8, "attention_window": 8,
    "window_size": 8, "local_window": 8, "chunk_size": 8, "attention_chunk_size": 8,
    "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16, "laurel_rank": 8,
    "altup_num_inputs": 4, "num_kv_shared_layers": 0, "moe_latent_size": 32,
}
DENSE_FIRST_KEYS = ("first_k_dense_replace", "num_dense_layers", "first_k_dense", "moe_layer_start_index",
                    "n_dense_layers", "num_dense_layer")
ZERO_KEYS_PART = ("dropout", "drop_path", "layerdrop", "jitter", "pdrop", "drop_rate")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _layer_plan(d: dict, n0: int, min_layers: int = 2) -> tuple:
    """The layers to keep: the first layer of each distinct kind (a kind is the layer's entries in
    every per-layer list and its membership of every layer-index list), at least 2."""
    per_layer = {k: v for k, v in d.items()
                 if (isinstance(v, (list, tuple)) or (isinstance(v, str) and any(p in k for p in _PATTERN_PARTS)))
                 and len(v) == n0 and k not in ("architectures",) and not k.endswith("token_id")
                 and not k.endswith("token_ids")}
    index_lists = {k: v for k, v in d.items()
                   if isinstance(v, (list, tuple)) and k not in per_layer and ("layer" in k or "idx" in k)
                   and v and all(_is_int(i) and 0 <= i < n0 for i in v)}
    # {layer index: settings} (keys int or digit strings)
    index_dicts = {k: v for k, v in d.items()
                   if isinstance(v, dict) and v and k not in ("id2label", "label2id")
                   and all(_layer_key(i) is not None and _layer_key(i) < n0 and isinstance(x, dict)
                           for i, x in v.items())}
    keep, kinds = [], set()
    for i in range(n0):
        kind = (tuple(repr(v[i]) for v in per_layer.values()) + tuple(i in v for v in index_lists.values())
                + tuple(repr(next((x for j, x in v.items() if _layer_key(j) == i), None))
                        for v in index_dicts.values()))
        if kind not in kinds:
            kinds.add(kind)
            keep.append(i)
    keep = keep[:MAX_LAYERS]
    for i in range(n0):
        if len(keep) >= min(max(2, min_layers), n0):
            break
        if i not in keep:
            keep.append(i)
    keep.sort()
    return keep, per_layer, index_lists, index_dicts


_PATTERN_PARTS = ("pattern", "layer", "block_type", "override")


def _layer_key(k) -> Optional[int]:
    if _is_int(k) and k >= 0:
        return k
    if isinstance(k, str) and k.isdigit():
        return int(k)
    return None


def _shrink_scalars(d: dict, original: dict) -> dict:
    """The field-by-field rules (widths, heads, experts, vocabulary, dropout) on one dict."""
    heads_before = next((original[k] for k in HEAD_KEYS if _is_int(original.get(k))), None)
    hidden0 = next((original[k] for k in HIDDEN_KEYS if _is_int(original.get(k))), None)
    for k, v in list(d.items()):
        lk = k.lower()
        if isinstance(v, float) and any(p in lk for p in ZERO_KEYS_PART) and "eps" not in lk:
            d[k] = 0.0
        if not _is_int(v) or v <= 0:
            continue
        # a prefixed variant of a known field (swa_head_dim, global_num_key_value_heads, ...)
        base = next((b for b in HEAD_DIM_KEYS + KV_KEYS + HEAD_KEYS if lk.endswith("_" + b)), None)
        if base in KV_KEYS:
            pre = k[: -len(base)]
            heads = next((original[pre + h] for h in HEAD_KEYS if _is_int(original.get(pre + h))), heads_before)
            d[k] = KV_HEADS if (heads is None or v < heads) else HEADS
            continue
        if base in HEAD_DIM_KEYS and k not in SMALL:
            d[k] = HEAD_DIM
            continue
        if k in HIDDEN_KEYS:
            d[k] = HIDDEN
        elif k in FFN_KEYS or ("intermediate" in lk and "moe" not in lk and "expert" not in lk):
            d[k] = FFN
        elif "intermediate" in lk:
            d[k] = MOE_FFN
        elif k in KV_KEYS:
            d[k] = KV_HEADS if (heads_before is None or v < heads_before) else HEADS
        elif k in HEAD_KEYS or lk.endswith("attention_heads"):
            d[k] = HEADS
        elif k in HEAD_DIM_KEYS:
            d[k] = HEAD_DIM
        elif k in EXPERT_KEYS:
            d[k] = min(v, EXPERTS)
        elif k in TOPK_KEYS:
            d[k] = min(v, TOP_K)
        elif k in DENSE_FIRST_KEYS:
            d[k] = min(v, 1)
        elif k in SMALL:
            d[k] = min(v, SMALL[k])
        elif k == "vocab_size" or k.endswith("_vocab_size"):
            d[k] = min(v, VOCAB)
        elif "expert" in lk and ("dim" in lk or "size" in lk) and v > MOE_FFN:
            d[k] = MOE_FFN
        elif hidden0 and ("size" in lk or "dim" in lk) and "max" not in lk and "image" not in lk and \
                "patch" not in lk:
            # another width tied to the model width: keep the ratio (2 x hidden, hidden / 4, ...)
            for r in (1, 2, 3, 4, 8):
                if v == r * hidden0:
                    d[k] = r * HIDDEN
                    break
                if r > 1 and v * r == hidden0:
                    d[k] = HIDDEN // r
                    break
    return d


def _shrink_dict(d: dict, min_layers: int = 2) -> dict:
    d = dict(d)
    n0 = next((d[k] for k in LAYER_KEYS if _is_int(d.get(k))), None)
    if n0 is not None and n0 > 0:
        keep, per_layer, index_lists, index_dicts = _layer_plan(d, n0, min_layers)
        for k in LAYER_KEYS:
            if _is_int(d.get(k)):
                d[k] = len(keep)
        for k, v in per_layer.items():
            picked = [v[i] for i in keep]
            d[k] = "".join(picked) if isinstance(v, str) else type(v)(picked)
        for k, v in index_lists.items():
            d[k] = [keep.index(i) for i in v if i in keep]
        for k, v in index_dicts.items():
            d[k] = {(keep.index(_layer_key(j)) if _is_int(j) else str(keep.index(_layer_key(j)))): x
                    for j, x in v.items() if _layer_key(j) in keep}
    for k in ENCODER_LAYER_KEYS:
        if _is_int(d.get(k)):
            d[k] = min(d[k], 2)
    original = dict(d)
    _shrink_scalars(d, original)
    for k, v in list(d.items()):  # per-layer settings ({layer or layer type: {field: value}}) the same way
        if isinstance(v, dict) and v and "model_type" not in v and k not in ("rope_parameters", "rope_scaling") \
                and all(isinstance(x, dict) and "model_type" not in x for x in v.values()):
            new = {}
            for j, x in v.items():
                x_orig = {**original, **x}
                y = _shrink_scalars(dict(x), x_orig)
                merged = {**d, **y}
                _relations(merged, x_orig)
                new[j] = {f: merged[f] for f in merged if f in y or merged[f] != d.get(f)}
            d[k] = new
    _relations(d, original)
    for k in ("use_cache",):
        if k in d:
            d[k] = False
    if "output_router_logits" in d:
        d["output_router_logits"] = True  # the router aux loss is part of the loss compared
    # sub-configs (text_config, vision_config, ...): shrink each the same way
    for k, v in list(d.items()):
        if isinstance(v, dict) and "model_type" in v:
            d[k] = _shrink_dict(v)
    _feature_layers(d)
    return d


def _relations(d: dict, original: dict) -> None:
    """Fields that must agree with others after the shrinking (each relation is transformers'
    own, checked by its configs or assumed by its models)."""
    experts = any(_is_int(d.get(k)) for k in EXPERT_KEYS)
    moe_shaped = experts or any(("moe" in k or "expert" in k) and "intermediate" in k and _is_int(d.get(k))
                                for k in d)
    for k, v in list(d.items()):
        if v is not None or k not in original:
            continue
        # defaults left None that the models divide or index by (checkpoints always set them)
        if k in HEAD_DIM_KEYS and "head_dim" == k and any(_is_int(d.get(h)) for h in HEAD_KEYS):
            d[k] = HEAD_DIM
        elif k in KV_KEYS and any(_is_int(d.get(h)) for h in HEAD_KEYS):
            d[k] = HEADS
        elif k in EXPERT_KEYS and moe_shaped and any(_is_int(d.get(t)) or t in d for t in TOPK_KEYS):
            d[k] = EXPERTS
        elif k in TOPK_KEYS and (experts or moe_shaped) and k == "num_experts_per_tok":
            d[k] = TOP_K
        elif k in ("n_shared_experts",) and moe_shaped:
            d[k] = 1
    # multi-head latent attention: head_dim read as qk_rope_head_dim, or as nope + rope
    if _is_int(d.get("qk_rope_head_dim")):
        if _is_int(d.get("qk_nope_head_dim")) and original.get("qk_nope_head_dim") == original.get("qk_rope_head_dim"):
            d["qk_nope_head_dim"] = d["qk_rope_head_dim"]  # equal halves stay equal (partial rotary of a head)
        if _is_int(d.get("qk_nope_head_dim")) and "qk_head_dim" in d:
            d["qk_head_dim"] = d["qk_rope_head_dim"] + d["qk_nope_head_dim"]
        if _is_int(d.get("head_dim")) and _is_int(original.get("head_dim")):
            if original.get("head_dim") == original.get("qk_rope_head_dim"):
                d["head_dim"] = d["qk_rope_head_dim"]
            elif _is_int(d.get("qk_nope_head_dim")) and \
                    original["head_dim"] == original.get("qk_rope_head_dim", 0) + original.get("qk_nope_head_dim", 0):
                d["head_dim"] = d["qk_rope_head_dim"] + d["qk_nope_head_dim"]
    # partial rotary given as a width: at most half the head
    head_dim = d["head_dim"] if _is_int(d.get("head_dim")) else HIDDEN // HEADS
    for k in ("rotary_dim", "rotary_emb_dim", "rope_dim", "rotary_ndims"):
        if _is_int(d.get(k)):
            d[k] = min(d[k], head_dim // 2)
    # Mamba-2 heads: num_heads * head_dim == expand * hidden_size
    expand = next((d[k] for k in ("mamba_expand", "expand") if isinstance(d.get(k), (int, float))), None)
    mh = next((k for k in ("mamba_n_heads", "mamba_num_heads") if _is_int(d.get(k))), None)
    md = next((k for k in ("mamba_d_head", "mamba_head_dim", "mamba_headdim") if _is_int(d.get(k))), None)
    if mh is None and md is None and expand is not None and _is_int(d.get("state_size")):
        if _is_int(d.get("num_heads")) and _is_int(d.get("head_dim")):
            mh, md = "num_heads", "head_dim"
    if expand is not None and mh and md:
        inner = int(expand * d.get("hidden_size", HIDDEN))
        d[md] = 16
        d[mh] = max(1, inner // 16)
        if _is_int(d.get("mamba_d_ssm")):
            d["mamba_d_ssm"] = inner
    # expert groups must split the experts (DeepSeek-style group-limited routing)
    ne = next((d[k] for k in EXPERT_KEYS if _is_int(d.get(k))), None)
    for k in ("n_group", "num_group", "num_expert_group", "n_expert_groups", "moe_n_group"):
        if _is_int(d.get(k)) and ne:
            d[k] = 2 if ne % 2 == 0 and d[k] > 1 else 1
            for t in ("topk_group", "num_topk_group", "topk_groups", "moe_topk_group"):
                if _is_int(d.get(t)):
                    d[t] = 1
    # a sliding window left unset while some layers slide (or sliding heads are configured)
    if "sliding_window" in d and d["sliding_window"] is None and any(
            (isinstance(v, (list, tuple)) and any(isinstance(x, str) and "sliding" in x for x in v))
            or ("sliding" in k and k != "sliding_window" and _is_int(v) and v > 0) for k, v in d.items()):
        d["sliding_window"] = SMALL["sliding_window"]
    for rk in ("rope_parameters", "rope_scaling"):
        if isinstance(d.get(rk), dict):
            d[rk] = _shrink_rope(d[rk], d)


def _feature_layers(d: dict) -> None:
    """Vision-layer indices (``vision_feature_layer``, deepstack indexes ...) into the shrunk tower:
    each distinct non-negative index to a distinct layer from the top, order kept."""
    vis = next((v for k, v in d.items() if isinstance(v, dict) and "vision" in k), None)
    n = next((vis[k] for k in LAYER_KEYS if vis is not None and _is_int(vis.get(k))), None)

    def fix(holder):
        for k, v in list(holder.items()):
            if "feature_layer" in k or "deepstack" in k or "visual_index" in k or "vision_layer" in k:
                if n is None:
                    continue
                if _is_int(v) and v >= n:
                    holder[k] = n - 1
                elif isinstance(v, (list, tuple)) and v and all(_is_int(i) for i in v) and any(i >= n for i in v):
                    order = sorted({i for i in v if i >= 0}, reverse=True)
                    holder[k] = type(v)(max(0, n - 1 - order.index(i)) if i >= 0 else i for i in v)
            elif isinstance(v, dict) and "model_type" in v and "vision" not in k:
                fix(v)

    fix(d)


def _rotary_half(d: dict) -> int:
    """Half the rotary width of a (shrunk) text config."""
    if _is_int(d.get("qk_rope_head_dim")):
        return d["qk_rope_head_dim"] // 2
    head_dim = d["head_dim"] if _is_int(d.get("head_dim")) else \
        d.get("hidden_size", HIDDEN) // max(1, d.get("num_attention_heads", HEADS))
    rp = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    prf = rp.get("partial_rotary_factor", d.get("partial_rotary_factor", 1.0)) or 1.0
    return int(head_dim * prf) // 2


def _scaled_sections(sec: list, half: int) -> list:
    total = sum(sec)
    new = [max(1, s * half // total) for s in sec]
    new[-1] += half - sum(new)
    return new


def _shrink_rope(rp: dict, d: dict) -> dict:
    rp = dict(rp)
    sec = rp.get("mrope_section")
    if isinstance(sec, (list, tuple)) and sec and all(_is_int(s) for s in sec):
        rp["mrope_section"] = _scaled_sections(list(sec), _rotary_half(d))
    for k, v in list(rp.items()):
        if isinstance(v, dict):
            rp[k] = _shrink_rope(v, d)
    return rp


def _source_mrope_default(model_type: str) -> Optional[list]:
    """The ``mrope_section`` a model type's modeling code falls back to when the config has none
    (``config.rope_parameters.get("mrope_section", [...])``), read from its source: the modeling
    file next to the model type's config class, then the transformers modeling files its classes
    come from."""
    import importlib
    import inspect
    import re

    from transformers import CONFIG_MAPPING

    pat = re.compile(r"""get\(\s*["']mrope_section["']\s*,\s*\[([0-9,\s]+)\]""")
    try:
        cfg_mod = CONFIG_MAPPING[model_type].__module__
        package, name = cfg_mod.rsplit(".configuration_", 1)
        mod = importlib.import_module(f"{package}.modeling_{name}")
    except Exception:
        return None
    mods = [mod] + sorted({sys.modules[c.__module__] for c in vars(mod).values() if isinstance(c, type)
                           and c.__module__.startswith("transformers.models.") and c.__module__ in sys.modules
                           and c.__module__ != mod.__name__}, key=lambda m: m.__name__)
    for m in mods:
        try:
            hit = pat.search(inspect.getsource(m))
        except Exception:
            continue
        if hit:
            return [int(x) for x in hit.group(1).split(",") if x.strip()]
    return None


def _fill_mrope(d: dict) -> None:
    """Text configs (the config or its sub-configs) whose code falls back to a default
    ``mrope_section``: the default scaled to the shrunk rotary width, written into the config."""
    targets = [v for k, v in d.items() if isinstance(v, dict) and "model_type" in v and "vision" not in k
               and "audio" not in k] + [d]
    for t in targets:
        if not (_is_int(t.get("hidden_size")) or _is_int(t.get("qk_rope_head_dim"))):
            continue
        rp = t.get("rope_parameters")
        if not isinstance(rp, dict) or "mrope_section" in rp or any(isinstance(x, dict) for x in rp.values()):
            continue
        default = _source_mrope_default(t.get("model_type") or "") or (
            _source_mrope_default(d.get("model_type") or "") if t is not d else None)
        if default:
            t["rope_parameters"] = {**rp, "mrope_section": _scaled_sections(default, _rotary_half(t))}


def _remap_special_tokens(d: dict, vocab: int, taken: Optional[set] = None) -> set:
    """Token-id fields at or above the new vocabulary get distinct ids at its top; returns every
    special id (inputs avoid them)."""
    taken = set() if taken is None else taken
    nxt = [vocab - 1]

    def fresh():
        while nxt[0] in taken:
            nxt[0] -= 1
        taken.add(nxt[0])
        return nxt[0]

    for k, v in list(d.items()):
        lk = k.lower()
        if isinstance(v, dict) and "model_type" in v:
            sub_vocab = v.get("vocab_size") if _is_int(v.get("vocab_size")) else vocab
            _remap_special_tokens(v, sub_vocab, taken)
            continue
        if not ("token_id" in lk or "token_index" in lk or lk.endswith("_token") or lk.endswith("_id")):
            continue
        if _is_int(v):
            if v >= vocab:
                d[k] = fresh()
            else:
                taken.add(v)
        elif isinstance(v, (list, tuple)) and v and all(_is_int(i) for i in v):
            new = [fresh() if i >= vocab else i for i in v]
            taken.update(new)
            d[k] = type(v)(new)
    return taken


# Per-family settings, only where the generic shrinking fails; each says why. ``init``: arguments
# of the default config (whose own defaults do not validate); ``layers``: at least this many
# layers; ``set``: fields (dotted paths into sub-configs) after the shrinking; ``model``: a call on
# the built model.
OVERRIDES: dict = {
    "dbrx": dict(set={"attn_config.rope_theta": 10000.0, "attn_config.clip_qkv": 8.0},
                 why="the default attention sub-config has no rope_theta and clip_qkv None, which the model "
                     "reads and clamps by"),
    "cohere_compass_text": dict(set={"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                          "sliding_attention": {"rope_type": "default",
                                                                                "rope_theta": 1e4}}},
                                why="the default rope_parameters are empty; the model reads one entry per layer type"),
    "lfm2_moe": dict(set={"layer_types": lambda d: ["conv"] * (d["num_hidden_layers"] - 1) + ["full_attention"]},
                     why="the default layer_types is None, which the model indexes"),
    "dory": dict(set={"layer_types": None, "num_hidden_layers": 3, "n_input_layers": 1, "n_output_layers": 1,
                      "n_recurrent_layers": None},
                 why="the input, recurrent and output layer counts must add up to the layers; the default "
                     "layer_types lists attention and MLP blocks apart, which the config halves"),
    "zamba": dict(set={"layers_block_type": None, "num_hidden_layers": 5, "attn_layer_period": 2,
                       "attn_layer_offset": 1},
                  why="the shared attention block is tied across hybrid layers: at least two are needed"),
    "deepseek_ocr2": dict(set={"text_config.mlp_layer_types": lambda d: ["dense"] + ["sparse"] * (
        d["text_config"]["num_hidden_layers"] - 1)},
        why="the default mlp_layer_types is None, which the model indexes"),
    "qwen4_exp_text": dict(set={"indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
                                "indexer_budget": 8, "indexer_compress_ratio": 2},
                           why="the default leaves the sparse-attention indexer unset (None), which the model "
                               "divides by"),
    "reformer": dict(set={"is_decoder": True, "axial_pos_embds_dim": [32, 32], "axial_pos_shape": [4, 4],
                          "lsh_attn_chunk_length": 8,
                          "local_attn_chunk_length": 8, "num_buckets": 2},
                     why="the axial position widths must add up to the width and the axial shape multiply to the "
                         "sequence; chunks no longer than it; ReformerModelWithLMHead requires is_decoder"),
    "chameleon": dict(set={"vocabulary_map": {"<image>": 250}}, avoid=[250],
                      why="the default vocabulary map is None, which the model reads the image token from"),
    "qwen2_5_omni_thinker": dict(set={"vision_start_token_id": 250},
                                 why="the thinker's config has no vision_start_token_id, which its position ids read"),
    "molmo2": dict(inputs=lambda b: {"mm_token_type_ids": b["input_ids"] * 0},
                   why="training needs mm_token_type_ids (all text here)"),
    "xmod": dict(model=lambda m: m.set_default_language(m.config.languages[0]),
                 why="the model needs a default language for inputs without language ids"),
}
OVERRIDES["qwen4_exp"] = dict(set={f"text_config.{k}": v for k, v in OVERRIDES["qwen4_exp_text"]["set"].items()},
                              why=OVERRIDES["qwen4_exp_text"]["why"])
OVERRIDES["emu3"] = dict(set={"vocabulary_map": {"<image>": 250}}, avoid=[250],
                         why=OVERRIDES["chameleon"]["why"])
OVERRIDES["qwen3_omni_moe_thinker"] = OVERRIDES["qwen2_5_omni_thinker"]
OVERRIDES["cohere_compass"] = dict(
    set={"text_config.rope_parameters": OVERRIDES["cohere_compass_text"]["set"]["rope_parameters"]},
    why=OVERRIDES["cohere_compass_text"]["why"])


def tiny_config(fam: Family):
    """The family's default config shrunk (see the module docstring); returns (config, the token
    ids inputs must avoid)."""
    from transformers import CONFIG_MAPPING

    cfg_cls = CONFIG_MAPPING[fam.model_type]
    ov = OVERRIDES.get(fam.model_type, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = cfg_cls(**ov.get("init", {}))
    d = _shrink_dict(default.to_dict(), min_layers=ov.get("layers", 2))
    _fill_mrope(d)
    for key, val in ov.get("set", {}).items():
        _set_path(d, key, val(d) if callable(val) else copy.deepcopy(val))
    vocab = d.get("vocab_size") if _is_int(d.get("vocab_size")) else _text_vocab(d)
    special = _remap_special_tokens(d, vocab) | set(ov.get("avoid", ()))
    d.pop("transformers_version", None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = cfg_cls.from_dict(d)
    return cfg, special


def _config_for(cls, cfg):
    """The config the class takes: ``cfg``, or its sub-config of the class's config type (a
    text-only class of a multimodal family, as the auto classes pick it)."""
    want = getattr(cls, "config_class", None)
    if want is None or isinstance(cfg, want):
        return cfg
    for name in getattr(cfg, "sub_configs", {}) or {}:
        sub = getattr(cfg, name, None)
        if isinstance(sub, want):
            return sub
    return cfg


def _text_vocab(d: dict) -> int:
    for k in ("text_config", "decoder", "language_config", "llm_config"):
        v = d.get(k)
        if isinstance(v, dict) and _is_int(v.get("vocab_size")):
            return v["vocab_size"]
    return VOCAB


def _set_path(d: dict, path: str, val) -> None:
    parts = path.split(".")
    for p in parts[:-1]:
        d = d.setdefault(p, {})
    d[parts[-1]] = val


def _vocab_of(model) -> int:
    """Token ids valid both as inputs and as labels: the smaller of the input embedding's rows and
    the LM head's outputs."""
    sizes = []
    for get in ("get_input_embeddings", "get_output_embeddings"):
        try:
            m = getattr(model, get)()
        except Exception:
            m = None
        w = getattr(m, "weight", None)
        if isinstance(w, __import__("torch").Tensor) and w.ndim == 2:
            sizes.append(int(w.shape[0]))
    return min(sizes) if sizes else VOCAB


def build(fam: Family, dtype=None):
    """The family's tiny model (fp32, seed 0, eager attention, training mode, dropout off) and the
    token ids inputs must avoid."""
    import torch
    import transformers

    cfg, special = tiny_config(fam)
    cls = getattr(transformers, fam.cls)
    cfg = _config_for(cls, cfg)
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = cls._from_config(cfg, attn_implementation="eager", dtype=dtype or torch.float32)
        except (ValueError, TypeError) as e:  # a family without the eager attention path
            if "attn" not in str(e).lower() and "attention" not in str(e).lower():
                raise
            model = cls._from_config(cfg, dtype=dtype or torch.float32)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    perturb_constants(model)
    prepare = OVERRIDES.get(fam.model_type, {}).get("model")
    if prepare is not None:
        prepare(model)
    model.train()
    return model, special


def perturb_constants(model, seed: int = 3) -> int:
    """Parameters the init leaves constant (norm weights of ones or zeros, zero biases, learned
    scales) get noise: c * (1 + 0.2 n), or 0.02 n where c is 0, n standard normal. Otherwise a
    patch that drops a weight of ones, confuses w with 1 + w for w = 0, or skips a scale of 1 would
    leave the loss unchanged. Returns how many were perturbed."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = 0
    with torch.no_grad():
        for p in model.parameters():
            if not p.is_floating_point() or p.numel() == 0:
                continue
            flat = p.detach().reshape(-1)
            if bool((flat == flat[0]).all()):
                c = float(flat[0])
                noise = torch.randn(p.shape, generator=g).to(p.device, p.dtype)
                p.copy_(c * (1 + 0.2 * noise) if c != 0 else 0.02 * noise)
                n += 1
    return n


def make_batch(vocab: int, special: set, device, seed: int = 1):
    """Random token ids (no special ids), a right-padded second row, labels -100 on the padding
    and on a few more positions."""
    import torch

    g = torch.Generator().manual_seed(seed)
    allowed = torch.tensor([t for t in range(vocab) if t not in special])
    ids = allowed[torch.randint(len(allowed), (BATCH, SEQ), generator=g)]
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -3:] = 0
    labels = ids.clone()
    labels[mask == 0] = -100
    labels[0, 2] = labels[1, 5] = -100
    return dict(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))


# ---- norms: present, their forms, replaced --------------------------------------------------------


def _is_norm_like(module) -> bool:
    import torch

    if isinstance(module, (torch.nn.LayerNorm, getattr(torch.nn, "RMSNorm", ()))):
        return True
    name = type(module).__name__.lower()
    if "norm" not in name or any(s in name for s in ("batchnorm", "groupnorm", "instancenorm")):
        return False
    # a norm is a leaf with at most a weight and a bias (no child modules holding parameters)
    return not any(True for c in module.children() if any(True for _ in c.parameters())) and \
        len(list(module.parameters(recurse=False))) <= 2


def _eps_of(module) -> float:
    for k in ("variance_epsilon", "eps", "epsilon", "norm_eps", "layer_norm_eps", "rms_norm_eps"):
        v = getattr(module, k, None)
        if isinstance(v, float):
            return v
    return 1e-6


def norm_form(module, width: int, n_tensor_args: int) -> str:
    """What ``module`` computes, read from its outputs on random inputs (never its name): one of
    :data:`RMS_FORMS`, ``layernorm`` or ``other``. The fp32 output tells the normalisation apart
    (mean removed or not, weight, 1 + weight, a gate before or after); for the weighted Llama-like
    form, a bf16 copy tells whether the weight multiplies before or after the cast to the input
    dtype."""
    import torch
    import torch.nn.functional as F

    if isinstance(module, getattr(torch.nn, "RMSNorm", ())):
        return "torch"
    m = copy.deepcopy(module).float()
    g = torch.Generator().manual_seed(7)
    w = getattr(m, "weight", None)
    b = getattr(m, "bias", None)
    with torch.no_grad():
        if isinstance(w, torch.nn.Parameter) and w.ndim == 1 and w.is_floating_point():
            width = w.shape[0]
            w.copy_(0.5 + torch.rand(w.shape, generator=g))
        else:  # no weight, or a buffer standing in for one (a weightless norm)
            w = None
        if isinstance(b, torch.Tensor) and b.is_floating_point():
            b.copy_(torch.rand(b.shape, generator=g) - 0.5)
        else:
            b = None
    dev = next((p.device for p in m.parameters()), torch.device("cpu"))
    x = (torch.randn(3, width, generator=g) + 0.3).to(dev)
    gate = torch.randn(3, width, generator=g).to(dev)
    eps = _eps_of(m)
    gated = n_tensor_args >= 2
    try:
        with torch.no_grad():
            y = (m(x, gate) if gated else m(x)).double()
    except Exception:
        return "other"
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return "other"
    xd, gd = x.double(), gate.double()
    wd = w.detach().double() if w is not None else None

    def rms(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)

    def close(ref):
        return bool(((y - ref).norm() / ref.norm()) < 1e-4)

    scale = wd if wd is not None else torch.ones(1, dtype=torch.float64, device=dev)
    if gated:
        for act in (F.silu, torch.sigmoid):
            if close(scale * rms(xd) * act(gd)):
                return "gated"
            if close(scale * rms(xd * act(gd))):
                return "gated_pre"
        return "other"
    if wd is None:
        if close(rms(xd)):
            return "unweighted"
        return "layernorm" if close(F.layer_norm(xd, (width,), eps=eps)) else "other"
    if close((1 + wd) * rms(xd)):
        return "offset"
    if close(wd * rms(xd)):
        return _rounding_form(module, width, eps)
    ln = F.layer_norm(xd, (width,), eps=eps) * wd + (b.detach().double() if b is not None else 0)
    return "layernorm" if close(ln) else "other"


def _rounding_form(module, width: int, eps: float) -> str:
    """``llama`` or ``weight_before_cast``: the bf16 output of a copy bit-matched against each
    (``other`` when it matches neither)."""
    import torch

    m = copy.deepcopy(module).to(torch.bfloat16)
    g = torch.Generator().manual_seed(11)
    dev = m.weight.device
    with torch.no_grad():
        m.weight.copy_((0.5 + torch.rand(m.weight.shape, generator=g)).to(torch.bfloat16))
        x = (torch.randn(64, width, generator=g) * 3).to(torch.bfloat16).to(dev)
        try:
            y = m(x)
        except Exception:
            return "other"
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        w = m.weight
        cands = {"llama": w * normed.to(torch.bfloat16), "weight_before_cast": (w * normed).to(torch.bfloat16)}
        mism = {k: int((y != v).sum()) for k, v in cands.items()}
    exact = [k for k, v in mism.items() if v == 0]
    return exact[0] if exact else "other"  # Llama-like in fp32, but neither rounding


def norm_inventory(model, calls: dict) -> dict:
    """Norm modules of ``model`` by class: count, forms, how many ran in the forward."""
    import torch

    inv: dict = {}
    for name, m in model.named_modules():
        if not _is_norm_like(m):
            continue
        c = calls.get(name)
        w = getattr(m, "weight", None)
        # width: as called in the forward, else the weight's, else any (an unweighted norm)
        width = c[0] if c else (w.shape[0] if isinstance(w, torch.Tensor) and w.ndim == 1 else HIDDEN)
        form = norm_form(m, int(width), c[1] if c else 1)
        key = (type(m).__name__, form)
        e = inv.setdefault(key, dict(cls=type(m).__name__, form=form, count=0, ran=0, names=[]))
        e["count"] += 1
        e["ran"] += int(bool(c))
        e["names"].append(name)
    return inv


def _record_norm_calls(model):
    """Forward pre-hooks on norm-like modules: name -> (last dim, tensor arguments) of the first call."""
    import torch

    calls, handles = {}, []
    for name, m in model.named_modules():
        if not _is_norm_like(m):
            continue

        def hook(mod, args, kwargs, name=name):
            if name not in calls:
                tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
                if tensors:
                    calls[name] = (int(tensors[0].shape[-1]), len(tensors))

        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    return calls, handles


# ---- counting what ran fused ----------------------------------------------------------------------


class GatherCounter:
    """Counts calls of the MoE row gathers (``deepspeed_fused.ops.moe_reorder``) during one forward
    and backward: evidence that the gathers themselves ran, next to the experts-forward count the
    feature reports. Instrumentation of this harness (a worker process): the feature looks the
    gathers up as module attributes at call time, so a counting wrapper there sees every call."""

    GATHERS = ("route_maps", "route_dispatch", "route_combine", "permute_rows", "unpermute_rows")

    def __init__(self):
        self.counts = collections.Counter()
        self._undo = []

    def __enter__(self):
        from ..ops import moe_reorder as reorder

        for name in self.GATHERS:
            fn = getattr(reorder, name, None)
            if fn is None:
                continue

            def counted(*a, _fn=fn, _name=name, **k):
                self.counts[_name] += 1
                return _fn(*a, **k)

            setattr(reorder, name, counted)
            self._undo.append((reorder, name, fn))
        return self

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self._undo):
            setattr(mod, name, fn)
        self._undo.clear()
        return False


def _calls(report) -> dict:
    """The feature's own count of its patched code's calls (fused / eager) since it was applied."""
    calls = getattr(report, "calls", None)
    return calls.as_dict() if calls is not None else {"fused": 0, "eager": 0}


# ---- one family -----------------------------------------------------------------------------------


def _loss_and_grads(model, batch, seed: int = 2):
    import torch

    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    loss = out.loss if hasattr(out, "loss") else (out[0] if isinstance(out, (tuple, list)) else None)
    if loss is None:
        raise RuntimeError(f"{type(model).__name__} returned no loss for labels")
    loss.backward()
    grads = {n: (p.grad.detach().float().clone() if p.grad is not None else None)
             for n, p in model.named_parameters() if p.requires_grad}
    return float(loss.detach().float()), grads


def _grad_errors(grads: dict, ref: dict, exact: Optional[dict] = None, noise_floor: bool = False) -> tuple:
    """(max relative error, its parameter, parameters whose gradient exists in one run only,
    parameters past the tolerance only by fp32 noise).

    With ``exact`` (an fp64 run of the same model), a gradient past ``FP32_GRAD_RTOL`` of its norm
    is fp32 noise when the patched one is no further from the fp64 gradient than
    ``NOISE_FACTOR`` x the eager fp32 one is, plus ``FP32_GRAD_RTOL`` of the fp64 norm (a
    gradient that is zero in exact arithmetic, e.g. a key bias under softmax, is all noise)."""
    worst, worst_name, mismatched, noise = 0.0, "", [], []
    # the rounding of the gradient's own scale: fp32 epsilon x the norm of the whole gradient (fp64
    # when there is an fp64 run, else the eager one)
    scale_src = exact if exact is not None else (ref if noise_floor else {})
    floor = FP32_EPS * math.sqrt(sum(float(e.double().norm()) ** 2 for e in scale_src.values() if e is not None))
    scale = max((float(g.norm()) for g in ref.values() if g is not None), default=0.0) or 1.0
    for n, r in ref.items():
        g = grads.get(n)
        if (g is None) != (r is None):
            if (g if r is None else r).abs().max() > 0:  # a zero gradient and none are the same
                mismatched.append(n)
            continue
        if g is None:
            continue
        denom = float(r.norm())
        err = float((g - r).norm()) / (denom if denom > 0 else scale)
        if not math.isfinite(err):
            err = float("inf")
        if err > FP32_GRAD_RTOL and exact is not None and exact.get(n) is not None:
            e = exact[n].to(r.device).double()
            to_exact, eager_to_exact = float((g.double() - e).norm()), float((r.double() - e).norm())
            if to_exact <= NOISE_FACTOR * eager_to_exact + FP32_GRAD_RTOL * float(e.norm()) + floor:
                noise.append(dict(param=n, rel=err, norm=denom, patched_vs_fp64=to_exact,
                                  eager_vs_fp64=eager_to_exact))
                continue
        elif err > FP32_GRAD_RTOL and floor and float((g - r).norm()) <= floor:
            # no fp64 run: a difference below the fp32 resolution of the whole gradient
            noise.append(dict(param=n, rel=err, norm=denom, diff=float((g - r).norm()), floor=floor))
            continue
        if err > worst:
            worst, worst_name = err, n
    return worst, worst_name, mismatched, noise


def _fp64_grads(base, batch) -> tuple:
    """The gradients of an fp64 copy of the unpatched model (experts on transformers' eager
    implementation: grouped_mm takes no fp64), or (None, why not)."""
    import torch

    try:
        m = copy.deepcopy(base).double()
        if hasattr(m, "set_experts_implementation"):
            try:
                m.set_experts_implementation("eager")
            except Exception:
                pass
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, grads = _loss_and_grads(m, batch)
        return grads, ""
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    finally:
        torch.set_default_dtype(torch.float32)


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    d = abs(a - b) / max(abs(b), 1e-30)
    return d if math.isfinite(d) else float("inf")


def _lce_info(model, feature_report) -> dict:
    from ..features import linear_cross_entropy as lce

    states = [(type(m).__name__, lce.fused_state(m)) for m in model.modules() if lce.is_patched(m)]
    calls = _calls(feature_report)
    info = dict(patched=sorted({c for c, _ in states}), fused_calls=calls["fused"], eager_calls=calls["eager"],
                fused=calls["fused"] > 0, reason="")
    skipped = (feature_report.details or {}).get("skipped") or {}
    if not states:
        info["reason"] = feature_report.reason or "not applied"
        # the kind of reason, for the summary: the first skipped class's, without its specifics
        info["why"] = next(iter(skipped.values())) if skipped else "no language-model head module in the model"
        info["kind"] = _reason_kind(info["why"])
    elif not calls["fused"]:
        why = "; ".join(sorted({st.unfused_reason for _, st in states if st.unfused_reason}))
        info["reason"] = info["why"] = why or "patched, but the forward did not take the fused path"
        info["kind"] = "patched, not fused in the forward"
    return info


def _reason_kind(why: str) -> str:
    """A reason without its specifics (the class, the code quoted), to group families by."""
    import re

    kind = why.split(":")[0].split(" (")[0]
    return re.sub(r"^self\.[\w.]+ is \w+, ", "the head is ", kind)


def _moe_info(model, feature_report, counts) -> dict:
    from ..features import moe_reorder

    experts = moe_reorder._experts_modules(model)
    calls = _calls(feature_report)
    info = dict(experts_modules=len(experts), experts_classes=sorted({type(m).__name__ for m in experts}),
                applied=bool(feature_report.applied), where=feature_report.where, calls=calls,
                gather_calls=dict(counts), gathers=bool(calls["fused"]) and bool(counts), reason="")
    if not feature_report.applied:
        info["reason"] = feature_report.reason
    elif not info["gathers"]:
        info["reason"] = "applied, but the experts did not run the gathers in the forward/backward"
    return info


def _norm_info(base_inv: dict, patched, feature_report) -> dict:
    from ..features import rms_norm as rms_feature

    replaced = {n: m for n, m in patched.named_modules() if rms_feature.is_replaced(m)}
    present, by_form, left = [], collections.Counter(), []
    for (cls, form), e in sorted(base_inv.items()):
        hit = [n for n in e["names"] if n in replaced]
        # the feature's own reading of the class (the template it matched), next to the form read here
        row = dict(cls=cls, form=form, count=e["count"], ran=e["ran"], replaced=len(hit),
                   feature_form=(rms_feature.replaced_form(replaced[hit[0]]) or "") if hit else "")
        present.append(row)
        if hit:
            by_form[form] += len(hit)
        if form in RMS_FORMS and len(hit) < e["count"]:
            left.append(row)
    calls = _calls(feature_report)
    skipped = (feature_report.details or {}).get("skipped") or {}
    return dict(present=present, replaced_by_form=dict(by_form), replaced=len(replaced),
                rms_present=sum(r["count"] for r in present if r["form"] in RMS_FORMS),
                left_eager=left, fused_calls=calls["fused"], eager_calls=calls["eager"],
                skipped={reason: dict(c) for reason, c in skipped.items()})


def run_family(fam: Family, mode: str = "fp32") -> dict:
    """Build, run unpatched and patched, compare; the record (see the module docstring)."""
    import torch

    from .. import patch_model

    from .. import unpatch_model
    from ..ops._common import reset_fallback_warnings

    reset_fallback_warnings()  # every family sees its own fallback warnings (a worker runs many)
    t0 = time.time()
    patched = None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rec = dict(family=fam.model_type, cls=fam.cls, kind=fam.kind, id=fam.id, mode=mode, device=device,
               run=f"{device} {mode}",
               input="text only (no pixels)" if fam.kind == "image-text-to-text" else "text",
               status="", error="", stage="build")
    try:
        base, special = build(fam)
        rec["params"] = sum(p.numel() for p in base.parameters())
        rec["layers"] = next((getattr(base.config, k) for k in LAYER_KEYS if _is_int(getattr(base.config, k, None))),
                             None)
        base.to(device)
        if mode == "bf16":
            ref = copy.deepcopy(base).to(torch.bfloat16).float()
            eager = copy.deepcopy(base).to(torch.bfloat16)
            patched = copy.deepcopy(base).to(torch.bfloat16)
        else:
            ref, eager, patched = None, base, copy.deepcopy(base)
        batch = make_batch(_vocab_of(base), special, device)
        extra = OVERRIDES.get(fam.model_type, {}).get("inputs")
        if extra is not None:
            batch.update(extra(batch))
        rec["stage"] = "eager run"
        calls, handles = _record_norm_calls(eager)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_e, grads_e = _loss_and_grads(eager, batch)
        for h in handles:
            h.remove()
        rec["loss"] = loss_e
        if not math.isfinite(loss_e):
            raise RuntimeError(f"the unpatched model's loss is {loss_e} (a harness limit: the tiny random model)")
        inv = norm_inventory(base, calls)
        rec["stage"] = "patch"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = patch_model(patched, features_config())
            reports = {f.name: f for f in report.features}
            rec["stage"] = "patched run"
            with GatherCounter() as counter:
                loss_p, grads_p = _loss_and_grads(patched, batch)
        rec["warnings"] = sorted({str(w.message).splitlines()[0][:200] for w in caught
                                  if "deepspeed_fused" in str(w.message)})
        rec["reports"] = {n: dict(applied=r.applied, where=r.where, reason=r.reason, fallback=r.fallback,
                                  calls=_calls(r)) for n, r in reports.items()}
        rec["norms"] = _norm_info(inv, patched, reports["rms_norm"])
        rec["loss_fused"] = _lce_info(patched, reports["linear_cross_entropy"])
        rec["moe"] = _moe_info(patched, reports["moe_reorder"], counter.counts)
        rec["stage"] = "compare"
        if mode == "bf16":
            loss_r, grads_r = _loss_and_grads(ref, batch)
            le, lp = _rel(loss_e, loss_r), _rel(loss_p, loss_r)
            ge, _, _, _ = _grad_errors(grads_e, grads_r)
            gp, gname, mism, _ = _grad_errors(grads_p, grads_r)
            per_param_ok = _bf16_grads_ok(grads_e, grads_p, grads_r)
            rec["diff"] = dict(loss_rel=_rel(loss_p, loss_e), grad_rel=_grad_errors(grads_p, grads_e)[0],
                               loss_err_eager=le, loss_err_patched=lp, grad_err_eager=ge, grad_err_patched=gp,
                               grad_worst=gname, grads_mismatched=mism,
                               loss_tol=BF16_FACTOR * le + BF16_LOSS_FLOOR, bad_params=per_param_ok[:5])
            ok = lp <= BF16_FACTOR * le + BF16_LOSS_FLOOR and not per_param_ok and not mism
        else:
            raw = _grad_errors(grads_p, grads_e)
            exact, why_not = None, ""
            if raw[0] > FP32_GRAD_RTOL:  # past the tolerance: is it fp32 noise? (an fp64 run tells)
                exact, why_not = _fp64_grads(base, batch)
            gp, gname, mism, noise = _grad_errors(grads_p, grads_e, exact, noise_floor=exact is None)
            rec["diff"] = dict(loss_rel=_rel(loss_p, loss_e), grad_rel=gp, grad_worst=gname,
                               grad_rel_raw=raw[0], grad_worst_raw=raw[1], fp32_noise=noise[:8],
                               fp32_noise_params=len(noise), fp64_unavailable=why_not,
                               grads_mismatched=mism, loss_tol=FP32_LOSS_RTOL, grad_tol=FP32_GRAD_RTOL)
            ok = rec["diff"]["loss_rel"] <= FP32_LOSS_RTOL and gp <= FP32_GRAD_RTOL and not mism
        rec["status"] = "ok" if ok else "differs"
        rec["stage"] = "done"
    except Exception as e:
        rec["status"] = "build_failed" if rec["stage"] == "build" else "failed"
        rec["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        rec["traceback"] = traceback.format_exc(limit=-4)[-2000:]
    finally:
        if patched is not None:
            try:
                unpatch_model(patched)  # the class-level patches go with the last patched instance
            except Exception:
                pass
    rec["seconds"] = round(time.time() - t0, 2)
    return rec


def _bf16_grads_ok(grads_e: dict, grads_p: dict, grads_r: dict) -> list:
    """Parameters whose patched bf16 gradient is further from the fp32 one than the rule allows."""
    bad = []
    for n, r in grads_r.items():
        e, p = grads_e.get(n), grads_p.get(n)
        if r is None or e is None or p is None:
            continue
        denom = float(r.norm()) or 1.0
        ee, ep = float((e - r).norm()) / denom, float((p - r).norm()) / denom
        if not ep <= BF16_FACTOR * ee + BF16_GRAD_FLOOR:
            bad.append(dict(param=n, err_patched=ep, err_eager=ee))
    return bad


# ---- running many families ------------------------------------------------------------------------


def _run_one(fam: Family, mode: str) -> str:
    try:
        rec = run_family(fam, mode)
    except BaseException as e:  # pragma: no cover - run_family catches what it can
        rec = dict(family=fam.model_type, cls=fam.cls, kind=fam.kind, id=fam.id, mode=mode, status="failed",
                   error=f"{type(e).__name__}: {e}")
    return json.dumps(rec, default=str)


def _worker(conn, persistent: bool) -> None:
    """A worker process: runs the (family, mode) pairs it is sent, one at a time, and sends each
    record back; a one-shot worker (a fork per family) stops after the first."""
    prepare_environment()
    import torch

    torch.set_num_threads(int(os.environ.get("DEEPSPEED_FUSED_COVERAGE_THREADS", "1")))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        conn.send(_run_one(*task))
        if not persistent:
            return


_PRELOAD = ["torch", "transformers", "deepspeed_fused", "deepspeed_fused.bench.coverage"]


def prepare_environment() -> None:
    """Offline, and kernels under the interpreter when there is no GPU. Triton reads
    TRITON_INTERPRET when the kernels are defined (``import deepspeed_fused`` defines them), so on
    a machine without a GPU it must be in the environment before that: raises if it was not (the
    command line re-executes itself with it, see :func:`main`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if torch.cuda.is_available():
        return
    if "deepspeed_fused.ops._common" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return
    from ..ops import _common

    if not _common._INTERPRET_AT_IMPORT:
        raise RuntimeError(f"coverage on a machine without a GPU runs the kernels under Triton's interpreter: "
                           f"{_common.LATE_INTERPRET}")


class _Slot:
    """One worker process and the task it runs."""

    def __init__(self, ctx, persistent: bool):
        self.ctx, self.persistent = ctx, persistent
        self.proc = self.conn = self.task = None
        self.t0 = 0.0

    def start(self):
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child, self.persistent), daemon=True)
        self.proc.start()
        child.close()

    def submit(self, task):
        if self.proc is None or not self.proc.is_alive():
            self.start()
        self.task, self.t0 = task, time.time()
        self.conn.send((task[0], task[1]))

    def stop(self):
        if self.proc is not None and self.proc.pid is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join()
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    def poll(self, timeout: float):
        """The finished task's record, or None while it runs."""
        rec = None
        if self.conn.poll():
            try:
                rec = json.loads(self.conn.recv())
            except (EOFError, OSError):
                self.proc.join(5)
                rec = dict(status="failed", error=f"the worker died (exit code {self.proc.exitcode}) without a result")
        elif not self.proc.is_alive():
            self.proc.join()
            rec = dict(status="failed", error=f"the worker died (exit code {self.proc.exitcode}) without a result")
        elif time.time() - self.t0 > timeout:
            rec = dict(status="timeout", error=f"no result within {timeout:.0f} s (killed)")
        else:
            return None
        # a fresh worker after one that stops, hung, died or saw anything but a clean run (a
        # failure can leave CUDA or module state behind)
        if not self.persistent or rec.get("status") not in ("ok", "differs"):
            self.stop()
        return rec


def run_many(fams: list, modes: list, timeout: float = 300.0, jobs: int = 1, progress=None,
             spawn: Optional[bool] = None) -> list:
    """Each (family, mode) under ``timeout`` seconds (then its worker is killed and it is recorded
    as a timeout), in worker processes. Without CUDA each family runs in a fork of this process
    made after it imported the heavy modules once; with CUDA in spawned workers (a fork of a
    process that touched the CUDA driver could not use it) that import them once and run family
    after family, a fresh worker after any family that did not run cleanly (``spawn`` forces one
    way or the other)."""
    import importlib
    import multiprocessing as mp

    import torch

    prepare_environment()
    if spawn is None:
        spawn = torch.cuda.is_available() or "fork" not in mp.get_all_start_methods()
    if spawn:
        ctx, persistent = mp.get_context("spawn"), True
    else:
        for name in _PRELOAD:
            importlib.import_module(name)
        from ..features.registry import all_features

        all_features()  # every feature and the ops it calls, imported once before the forks
        ctx, persistent = mp.get_context("fork"), False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pending = [(f, m) for f in fams for m in modes]
    slots = [_Slot(ctx, persistent) for _ in range(max(1, jobs))]
    results = {}
    try:
        while pending or any(s.task for s in slots):
            for s in slots:
                if s.task is None and pending:
                    s.submit(pending.pop(0))
            time.sleep(0.02)
            for s in slots:
                if s.task is None:
                    continue
                rec = s.poll(timeout)
                if rec is None:
                    continue
                fam, mode = s.task
                rec = {**dict(family=fam.model_type, cls=fam.cls, kind=fam.kind, id=fam.id, mode=mode, device=device,
                              run=f"{device} {mode}"), **rec}
                rec.setdefault("seconds", round(time.time() - s.t0, 2))
                results[(fam.id, mode)] = rec
                s.task = None
                if progress:
                    progress(rec)
    finally:
        for s in slots:
            s.stop()
    return [results[(f.id, m)] for f in fams for m in modes]


def expectations(rec: dict) -> dict:
    """What the features covered on one family, in the form the CI test's table keeps: RMSNorm
    forms replaced and forms left eager, whether the loss ran fused, whether the experts ran the
    gathers (None: no experts modules)."""
    n, mo = rec["norms"], rec["moe"]
    return dict(replaced=set(n["replaced_by_form"]), eager={row["form"] for row in n["left_eager"]},
                loss_fused=bool(rec["loss_fused"]["fused"]),
                gathers=(bool(mo["gathers"]) if (mo["experts_modules"] or mo["applied"]) else None))


# ---- outputs --------------------------------------------------------------------------------------


def merge(record_lists: list) -> list:
    """Records of several runs in one list: per (family id, run) the last one given, in order of
    first appearance."""
    out: dict = {}
    for recs in record_lists:
        for r in recs:
            out[(r["id"], run_label(r))] = r
    return list(out.values())


def run_label(rec: dict) -> str:
    """Where and how a record ran: "cpu fp32" (kernels under the interpreter), "cuda fp32", "cuda bf16"."""
    return rec.get("run") or f"{rec.get('device', 'cpu')} {rec['mode']}"


def summarize(records: list) -> dict:
    """Counts per run ("cpu fp32", "cuda bf16", ...): families built and run, covered per feature,
    left eager, differing."""
    out = {}
    for run in sorted({run_label(r) for r in records}):
        rs = [r for r in records if run_label(r) == run]
        ran = [r for r in rs if r["status"] in ("ok", "differs")]
        with_rms = [r for r in ran if r["norms"]["rms_present"]]
        forms_present, forms_replaced = collections.Counter(), collections.Counter()
        for r in ran:  # families per form (a family with two classes of one form counts once)
            forms_present.update({row["form"] for row in r["norms"]["present"] if row["form"] in RMS_FORMS})
            forms_replaced.update({form for form, n in r["norms"]["replaced_by_form"].items() if n})
        moe = [r for r in ran if r["moe"]["experts_modules"]]
        out[run] = dict(
            families=len(rs), ran=len(ran), build_failed=sum(r["status"] == "build_failed" for r in rs),
            failed=sum(r["status"] == "failed" for r in rs), timeout=sum(r["status"] == "timeout" for r in rs),
            differs=sorted(r["id"] for r in rs if r["status"] == "differs"),
            with_rms_norm=len(with_rms),
            rms_norm_all_replaced=sum(not r["norms"]["left_eager"] for r in with_rms),
            rms_norm_some_replaced=sum(bool(r["norms"]["replaced"]) for r in with_rms),
            rms_norm_left_eager=sorted(r["id"] for r in with_rms if r["norms"]["left_eager"]),
            rms_forms_present=dict(forms_present), rms_forms_replaced=dict(forms_replaced),
            rms_left_eager_by_form={form: sorted({r["family"] for r in with_rms
                                                  if any(row["form"] == form for row in r["norms"]["left_eager"])})
                                    for form in RMS_FORMS
                                    if any(row["form"] == form for r in with_rms for row in r["norms"]["left_eager"])},
            loss_fused=sum(r["loss_fused"]["fused"] for r in ran),
            loss_eager=sorted(r["id"] for r in ran if not r["loss_fused"]["fused"]),
            loss_eager_kinds=dict(collections.Counter(
                _reason_kind(r["loss_fused"].get("why") or r["loss_fused"]["reason"])
                for r in ran if not r["loss_fused"]["fused"]).most_common()),
            vlm_ran=sum(r["kind"] == "image-text-to-text" for r in ran),
            vlm_loss_fused=sum(r["kind"] == "image-text-to-text" and r["loss_fused"]["fused"] for r in ran),
            features={name: dict(applied=sum(bool(r["reports"].get(name, {}).get("applied")) for r in ran),
                                 fused=sum(bool((r["reports"].get(name, {}).get("calls") or {}).get("fused"))
                                           for r in ran))
                      for name in dict.fromkeys(n for r in ran for n in r.get("reports", {}))},
            with_experts=len(moe), experts_gathers=sum(r["moe"]["gathers"] for r in moe),
            experts_eager=sorted(r["id"] for r in moe if not r["moe"]["gathers"]),
        )
    return out


def _fmt_e(v) -> str:
    if v is None:
        return ""
    if v == 0:
        return "0"
    return f"{v:.1e}"


def _norm_cell(r: dict) -> str:
    n = r["norms"]
    rms = [row for row in n["present"] if row["form"] in RMS_FORMS]
    if not rms:
        return "none"
    parts = [f"{row['replaced']}/{row['count']} {row['cls']} ({row['form']})" for row in rms]
    return "; ".join(parts)


def _short(s: str, n: int = 110) -> str:
    s = (s or "").replace("|", "/").replace("\n", " ")
    return s if len(s) <= n else s[: n - 3] + "..."


def render_markdown(doc: dict) -> str:
    recs, summ, tol = doc["records"], doc["summary"], doc.get("tolerances", {})
    runs = []
    for run, env in doc.get("envs", {}).items():
        runs.append(f"`{run}`: {env.get('date', '')}, {env.get('gpu', '')}, torch {env.get('torch', '')}, Triton "
                    f"{env.get('triton', '')}, transformers {env.get('transformers', '')}, kernels "
                    + ("under the Triton interpreter" if env.get("interpreter") else "on the GPU")
                    + (f", {env['wall_s'] / 60:.0f} min with {env.get('jobs', 1)} job(s)" if env.get("wall_s") else ""))
    lines = ["# Coverage: every causal-LM and image-text-to-text family", "",
             f"Generated by `{doc['command']}`. Runs: " + "; ".join(runs) + ". Data: "
             "[benchmarks/coverage.json](benchmarks/coverage.json); the suite: `deepspeed_fused/bench/coverage.py` "
             "(`python -m deepspeed_fused.bench coverage`).", "",
             "Each family (a model type of the installed transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` and "
             "`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, with the class the mapping names) is built tiny with "
             "random weights: its default config shrunk field by field (widths 64, FFN 128, 4 heads, 4 experts "
             "with 2 per token, vocabulary 256, the first layer of each kind of layer the full config has and "
             "at least 2; dropout, layer drop and router jitter off; a few per-family settings where "
             "transformers' own defaults do not build, listed below). Parameters the init leaves constant "
             "(norm weights, zero biases, learned scales) get noise, so that a patch that drops one shows in "
             "the loss. The model is deep-copied and both copies run one training forward and backward on the "
             "same batch (2 x 16 random tokens, one row right-padded, some labels -100; image-text models "
             "get text only, no pixels): the unpatched model, and the copy after `patch_model` with every "
             "registered feature on (" + ", ".join(f"`{n}`" for n in doc.get("features", [])) + ").", "",
             f"Target in fp32: the loss within {tol.get('fp32_loss_rtol', FP32_LOSS_RTOL):g} relative and every "
             f"parameter's gradient within {tol.get('fp32_grad_rtol', FP32_GRAD_RTOL):g} of its norm. A gradient "
             "past that is checked against an fp64 run of the unpatched model: it is fp32 noise (and passes) "
             f"when the patched gradient is no further from the fp64 one than {NOISE_FACTOR:g} x the eager fp32 "
             "gradient is, plus fp32 epsilon x the norm of the whole gradient (a gradient that is zero in exact "
             "arithmetic, such as a key bias under softmax, is all noise); where the model does not run in fp64, "
             "a difference below fp32 epsilon x the norm of the whole gradient is noise. The JSON lists those "
             "parameters.",
             "",
             "RMSNorm forms are read from what each norm-named module computes on random inputs (fp32: mean "
             "removed or not, weight or 1 + weight, a gate after or before the normalisation; bf16: whether the "
             "weight multiplies before or after the cast to the input dtype), never from the class name. "
             "Counted: the modules in the model (those of a vision tower too, which text-only inputs do not "
             "run). The loss counts as fused when the fused op ran (calls counted), the experts when the "
             "gathers ran. A family that could not be built or run is listed with the error: a limit of this "
             "harness, not a verdict on the features.", ""]
    if any(k.endswith("bf16") for k in summ):
        lines += [f"bf16 (GPU): both runs in bf16, each compared with an fp32 run of the same bf16-rounded "
                  f"weights; the patched run passes when its error is within {tol.get('bf16_factor', BF16_FACTOR):g}"
                  f" x the eager bf16 run's error plus {tol.get('bf16_loss_floor', BF16_LOSS_FLOOR):g} (loss, "
                  f"relative) or {tol.get('bf16_grad_floor', BF16_GRAD_FLOOR):g} (each gradient, relative to its "
                  "norm).", ""]
    for mode, s in summ.items():
        lines += [f"## Summary ({mode})", "",
                  "| | families |", "|---|---:|",
                  f"| listed | {s['families']} |",
                  f"| built and ran | {s['ran']} |",
                  f"| could not be built (harness limit) | {s['build_failed']} |",
                  f"| built, failed to run (harness limit) | {s['failed']} |",
                  f"| timed out | {s['timeout']} |",
                  f"| **patched loss or gradients beyond tolerance** | **{len(s['differs'])}** |",
                  f"| with RMSNorm modules | {s['with_rms_norm']} |",
                  f"| rms_norm: every RMSNorm module replaced | {s['rms_norm_all_replaced']} |",
                  f"| rms_norm: some replaced | {s['rms_norm_some_replaced']} |",
                  f"| rms_norm: RMSNorm modules left eager | {len(s['rms_norm_left_eager'])} |",
                  f"| linear_cross_entropy: loss fused | {s['loss_fused']} of {s['ran']} |",
                  f"| linear_cross_entropy: image-text models with the loss fused | {s['vlm_loss_fused']} of "
                  f"{s['vlm_ran']} |",
                  f"| with transformers experts modules | {s['with_experts']} |",
                  f"| moe_reorder: experts ran the gathers | {s['experts_gathers']} of {s['with_experts']} |",
                  ""]
        lines += ["Every feature: families where it applied, and where its patched code ran fused (its own call "
                  "count):", "", "| feature | applied | ran fused |", "|---|---:|---:|"]
        for name, c in s.get("features", {}).items():
            lines.append(f"| `{name}` | {c['applied']} of {s['ran']} | {c['fused']} |")
        lines.append("")
        if s["differs"]:
            lines += ["Beyond tolerance: " + ", ".join(f"`{x}`" for x in s["differs"]) + ".", ""]
        lines += ["RMSNorm forms: families where the form is present, and where its modules are replaced:", "",
                  "| form | present | replaced |", "|---|---:|---:|"]
        for form in RMS_FORMS:
            p = s["rms_forms_present"].get(form, 0)
            if p:
                lines.append(f"| {FORM_TEXT[form]} | {p} | {s['rms_forms_replaced'].get(form, 0)} |")
        lines += ["", "Families with RMSNorm modules left eager, by form:", ""]
        for form, fams in s.get("rms_left_eager_by_form", {}).items():
            lines.append(f"- {form} ({len(fams)}): " + ", ".join(fams))
        if not s.get("rms_left_eager_by_form"):
            lines.append("- none")
        lines += ["", "Why the loss stays eager (families):", "", "| reason | families |", "|---|---:|"]
        for why, n in s.get("loss_eager_kinds", {}).items():
            lines.append(f"| {_short(why, 140)} | {n} |")
        lines.append("")
    for mode in summ:
        rs = [r for r in recs if run_label(r) == mode]
        lines += [f"## Families ({mode})", "",
                  "RMSNorm: replaced/present modules per class (form). Loss: fused (op calls) or why not. "
                  "Experts: gathers (calls) or why not; - where there are no experts modules. Differences: "
                  "the loss relative to its value, the largest gradient difference relative to its norm "
                  "(fp32 noise excluded, see above).", "",
                  "| family | class | status | RMSNorm replaced/present | loss | experts | loss diff | grad diff |",
                  "|---|---|---|---|---|---|---:|---:|"]
        for r in rs:
            if r["status"] not in ("ok", "differs"):
                lines.append(f"| {r['family']} | {r['cls']} | {r['status']} (below) | | | | | |")
                continue
            lf = r["loss_fused"]
            loss = f"fused ({lf['fused_calls']})" if lf["fused"] else \
                "eager: " + _short(lf.get("why") or lf["reason"], 90)
            mo = r["moe"]
            if not mo["experts_modules"] and not mo["applied"]:
                experts = "-"
            elif mo["gathers"]:
                experts = f"gathers ({sum(mo['gather_calls'].values())})"
            else:
                experts = "eager: " + _short(mo["reason"], 70)
            status = "**differs**" if r["status"] == "differs" else "ok"
            d = r["diff"]
            lines.append(f"| {r['family']} | {r['cls']} | {status} | {_short(_norm_cell(r), 160)} | {loss} | "
                         f"{experts} | {_fmt_e(d['loss_rel'])} | {_fmt_e(d['grad_rel'])} |")
        lines.append("")
        bad = [r for r in rs if r["status"] not in ("ok", "differs")]
        if bad:
            lines += [f"### Not built or not run ({mode}): harness limits", "",
                      "| family | class | status | error |", "|---|---|---|---|"]
            for r in bad:
                lines.append(f"| {r['family']} | {r['cls']} | {r['status']} | {_short(r.get('error', ''), 200)} |")
            lines.append("")
    ov = doc.get("overrides") or {}
    if ov:
        lines += ["## Per-family settings", "",
                  "Where the generic shrinking alone does not build or run a family:", "",
                  "| family | settings | why |", "|---|---|---|"]
        for fam, o in sorted(ov.items()):
            lines.append(f"| {fam} | {_short(o['settings'], 150)} | {_short(o['why'], 200)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _overrides_doc() -> dict:
    out = {}
    for fam, o in OVERRIDES.items():
        parts = []
        for k in ("init", "layers"):
            if k in o:
                parts.append(f"{k}: {o[k]}")
        for k, v in o.get("set", {}).items():
            parts.append(f"{k} = {'(computed)' if callable(v) else json.dumps(v, default=str)}")
        if "inputs" in o:
            parts.append("extra inputs")
        if "model" in o:
            parts.append("a call on the built model")
        out[fam] = dict(settings="; ".join(parts), why=o.get("why", ""))
    return out


def write(records: list, out_dir: Optional[str] = None, md_path: Optional[str] = None, command: str = "",
          envs: Optional[dict] = None) -> dict:
    """Write coverage.json (under ``out_dir``, default docs/benchmarks/) and coverage.md
    (docs/coverage.md by default, else next to the JSON). ``envs``: run -> the environment it ran
    in (default: this machine's, for every run in ``records``)."""
    out_dir = out_dir or OUT_DIR
    os.makedirs(out_dir, exist_ok=True)
    md_path = md_path or (os.path.join(DOCS_DIR, "coverage.md") if os.path.abspath(out_dir) == os.path.abspath(OUT_DIR)
                          else os.path.join(out_dir, "coverage.md"))
    here = env_fields()
    envs = {run: (envs or {}).get(run, here) for run in sorted({run_label(r) for r in records})}
    doc = dict(command=command, envs=envs, features=list(features_config()), tolerances=dict(
        fp32_loss_rtol=FP32_LOSS_RTOL, fp32_grad_rtol=FP32_GRAD_RTOL, bf16_factor=BF16_FACTOR,
        bf16_loss_floor=BF16_LOSS_FLOOR, bf16_grad_floor=BF16_GRAD_FLOOR, noise_factor=NOISE_FACTOR),
        summary=summarize(records), overrides=_overrides_doc(), records=records)
    paths = dict(json=os.path.join(out_dir, "coverage.json"), md=md_path)
    with open(paths["json"], "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(paths["md"], "w") as f:
        f.write(render_markdown(doc))
    return paths


def _env_extra() -> dict:
    import transformers

    from ..ops._common import interpreter_active

    return dict(transformers=transformers.__version__, interpreter=interpreter_active())


def _reexec_with_interpreter() -> bool:
    """On a machine without a GPU, run again with TRITON_INTERPRET=1 from the start when it was
    not set before ``deepspeed_fused`` defined its kernels (``python -m deepspeed_fused.bench``
    imports the package first). Only for the command line; False when nothing was done."""
    import torch

    from ..ops import _common

    if torch.cuda.is_available() or _common._INTERPRET_AT_IMPORT or os.environ.get("TRITON_INTERPRET") not in (
            None, "", "0") or not sys.argv or not sys.argv[0].endswith(os.path.join("bench", "__main__.py")):
        return False
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "deepspeed_fused.bench"] + sys.argv[1:], env)
    return True  # pragma: no cover


def main(args) -> int:
    p = argparse.ArgumentParser(prog="python -m deepspeed_fused.bench coverage")
    p.add_argument("--families", default="", help="comma-separated model types or model_type/Class ids")
    p.add_argument("--modes", default="fp32", help="fp32 and/or bf16 (bf16 needs a GPU)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--md", default=None)
    p.add_argument("--render", nargs="+", default=None,
                   help="write the outputs from earlier runs' JSON files (records merged: a later file's "
                        "record of the same family and run replaces an earlier one)")
    opts = p.parse_args(getattr(args, "extra", []) or [])
    if not opts.render and _reexec_with_interpreter():
        return 0  # not reached: the process was replaced
    if opts.render:
        docs = []
        for path in opts.render:
            with open(path) as f:
                docs.append(json.load(f))
        records = merge([d["records"] for d in docs])
        out = getattr(args, "out", None)
        envs = {}
        for d in docs:
            envs.update(d.get("envs") or {run_label(r): d.get("env", {}) for r in d["records"]})
        paths = write(records, out, opts.md, " + ".join(dict.fromkeys(d.get("command", "") for d in docs)), envs)
        print("wrote", ", ".join(paths.values()))
        return 0
    prepare_environment()
    import torch

    modes = [m for m in opts.modes.split(",") if m]
    for m in modes:
        if m not in ("fp32", "bf16"):
            raise ValueError(f"--modes: expected fp32 and/or bf16, got {m!r}")
        if m == "bf16" and not torch.cuda.is_available():
            raise ValueError("--modes bf16 needs a CUDA GPU (bf16 under Triton's interpreter is not exact)")
    fams = select([n for n in opts.families.split(",") if n])
    t0 = time.time()

    def progress(r):
        d = r.get("diff") or {}
        print(f"[{time.time() - t0:7.1f}s] {r['id']:60s} {r['mode']} {r['status']:12s} {r.get('seconds', 0):6.1f}s "
              f"loss {_fmt_e(d.get('loss_rel'))} grad {_fmt_e(d.get('grad_rel'))} {r.get('error', '')[:100]}",
              flush=True)

    records = run_many(fams, modes, timeout=opts.timeout, jobs=opts.jobs, progress=progress)
    command = "python -m deepspeed_fused.bench coverage" + (f" --families {opts.families}" if opts.families else "") \
        + (f" --modes {opts.modes}" if opts.modes != "fp32" else "")
    env = {**env_fields(), **_env_extra(), "wall_s": round(time.time() - t0, 1), "jobs": opts.jobs}
    paths = write(records, getattr(args, "out", None), opts.md, command,
                  {run_label(r): env for r in records})
    print(json.dumps(summarize(records), indent=1))
    print("wrote", ", ".join(paths.values()))
    return 0
