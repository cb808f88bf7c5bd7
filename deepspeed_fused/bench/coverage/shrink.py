"""Shrinking a config: every field of a default config (and its sub-configs') walked and made
small, as few layers as cover every kind of layer, the rotary sections and special tokens kept
consistent."""
from __future__ import annotations

import sys
from typing import Optional

from .settings import EXPERTS, FFN, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, MAX_LAYERS, MOE_FFN, TOP_K, VOCAB

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


def derived_layer_kinds(cfg) -> dict:
    """The per-layer lists a config object computes but does not store (properties such as
    RecurrentGemma's ``layers_block_type``, a pattern of ``block_types`` repeated over the layers,
    or Jamba's, from ``attn_layer_period`` / ``attn_layer_offset``), with its sub-configs':
    ``{"kinds": {name: list}, "subs": {key: the same for that sub-config}}``. The shrunk config
    must keep the rule that makes them, so the layers kept are a prefix (see :func:`_layer_plan`)."""
    import inspect

    d = cfg.to_dict()
    n0 = next((d[k] for k in LAYER_KEYS if _is_int(d.get(k))), None)
    kinds = {}
    if n0:
        for name in dir(type(cfg)):
            if name.startswith("_") or name in d or not isinstance(inspect.getattr_static(type(cfg), name, None),
                                                                  property):
                continue
            try:
                v = getattr(cfg, name)
            except Exception:  # a property the default config cannot compute
                continue
            if isinstance(v, (list, tuple)) and len(v) == n0 and len({repr(x) for x in v}) > 1:
                kinds[name] = list(v)
    subs = {}
    for k in d:  # only the sub-configs' keys are read: reading another key can raise (transformers
        # raises for a per-layer attribute read globally, e.g. Gemma 4's head_dim)
        if isinstance(d[k], dict) and "model_type" in d[k]:
            sub = getattr(cfg, k, None)
            if hasattr(sub, "to_dict"):
                subs[k] = derived_layer_kinds(sub)
    return {"kinds": kinds, "subs": subs}


def _layer_plan(d: dict, n0: int, min_layers: int = 2, derived: Optional[dict] = None) -> tuple:
    """The layers to keep: the first layer of each distinct kind (a kind is the layer's entries in
    every per-layer list and its membership of every layer-index list), at least 2. Where the
    config computes some of its per-layer lists (``derived``: name -> list, from
    :func:`derived_layer_kinds`), the kept layers are the shortest prefix holding every kind (the
    rule that computes them still holds on a prefix), when that prefix has at most MAX_LAYERS."""
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
    derived = {k: v for k, v in (derived or {}).items() if len(v) == n0}

    def first_of_each_kind(lists: tuple) -> list:
        keep, kinds = [], set()
        for i in range(n0):
            kind = (tuple(repr(v[i]) for v in per_layer.values()) + tuple(i in v for v in index_lists.values())
                    + tuple(repr(next((x for j, x in v.items() if _layer_key(j) == i), None))
                            for v in index_dicts.values())
                    + tuple(repr(v[i]) for v in lists))
            if kind not in kinds:
                kinds.add(kind)
                keep.append(i)
        return keep

    keep = first_of_each_kind(tuple(derived.values())) if derived else []
    if keep and keep[-1] < MAX_LAYERS:
        keep = list(range(keep[-1] + 1))  # a prefix: the computed kinds follow the config's own rule
    else:  # none computed, or no prefix of at most MAX_LAYERS holds them all: the stored lists alone
        keep = first_of_each_kind(())[:MAX_LAYERS]
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


def _shrink_dict(d: dict, min_layers: int = 2, derived: Optional[dict] = None) -> dict:
    """``d`` (a config's ``to_dict()``) shrunk; ``derived``: :func:`derived_layer_kinds` of the config."""
    d = dict(d)
    derived = derived or {}
    n0 = next((d[k] for k in LAYER_KEYS if _is_int(d.get(k))), None)
    if n0 is not None and n0 > 0:
        keep, per_layer, index_lists, index_dicts = _layer_plan(d, n0, min_layers, derived.get("kinds"))
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
            d[k] = _shrink_dict(v, derived=derived.get("subs", {}).get(k))
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
