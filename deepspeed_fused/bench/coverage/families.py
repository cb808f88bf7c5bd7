"""The families of the installed transformers and their tiny models: the auto mappings' families,
the per-family settings, the shrunk config, the built model, its batch."""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Optional

from .settings import BATCH, SEQ, VOCAB
from .shrink import _fill_mrope, _is_int, _remap_special_tokens, _shrink_dict, derived_layer_kinds

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
    """The family's default config shrunk (see the package's docstring); returns (config, the token
    ids inputs must avoid)."""
    from transformers import CONFIG_MAPPING

    cfg_cls = CONFIG_MAPPING[fam.model_type]
    ov = OVERRIDES.get(fam.model_type, {})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        default = cfg_cls(**ov.get("init", {}))
    d = _shrink_dict(default.to_dict(), min_layers=ov.get("layers", 2), derived=derived_layer_kinds(default))
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
