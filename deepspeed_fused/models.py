"""Named Hugging Face causal-LM configs built offline with random weights.

Used by the example job (``deepspeed_fused.train --model NAME``), the end-to-end benchmark and the
tests. No hub access: every model is built from a config.
"""
from __future__ import annotations

import torch

_COMMON = dict(tie_word_embeddings=False, max_position_embeddings=8192, rms_norm_eps=1e-6)

# name -> (transformers config class name, kwargs)
MODELS = {
    # tiny: for CPU tests and the CPU example run
    "llama-tiny": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, vocab_size=257)),
    "qwen3-tiny": ("Qwen3Config", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                                       vocab_size=257)),
    "qwen3-moe-tiny": ("Qwen3MoeConfig", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=128, num_experts=8, num_experts_per_tok=2,
                                              decoder_sparse_step=1, vocab_size=257,
                                              output_router_logits=True, router_aux_loss_coef=0.01)),
    "qwen2-moe-tiny": ("Qwen2MoeConfig", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, num_experts=8,
                                              num_experts_per_tok=2, decoder_sparse_step=1, vocab_size=257,
                                              output_router_logits=True)),
    "mixtral-tiny": ("MixtralConfig", dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2, vocab_size=257, output_router_logits=True)),
    "deepseek-v3-tiny": ("DeepseekV3Config", dict(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                                  num_hidden_layers=2, first_k_dense_replace=1,
                                                  num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                                                  n_shared_experts=1, num_experts_per_tok=2, n_group=2,
                                                  topk_group=1, kv_lora_rank=16, q_lora_rank=32,
                                                  qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                                                  vocab_size=257)),
    "llama-tied-tiny": ("LlamaConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=257,
                                            tie_word_embeddings=True)),
    "gemma3-tiny": ("Gemma3TextConfig", dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                             vocab_size=257, sliding_window=16, tie_word_embeddings=True,
                                             hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16)),
    # small: one GPU, quick
    "llama-small": ("LlamaConfig", dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
                                        num_attention_heads=16, num_key_value_heads=4, vocab_size=32000)),
    "qwen3-small": ("Qwen3Config", dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=4,
                                        num_attention_heads=16, num_key_value_heads=4, head_dim=128,
                                        vocab_size=151936)),
    "qwen3-moe-small": ("Qwen3MoeConfig", dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=384,
                                               num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=4,
                                               head_dim=128, num_experts=32, num_experts_per_tok=4,
                                               decoder_sparse_step=1, vocab_size=151936,
                                               output_router_logits=True, router_aux_loss_coef=0.001)),
    # the end-to-end benchmark: Qwen3-30B-A3B layer shape cut to 4 layers (about 3 B parameters)
    "qwen3-moe-30b-a3b-4l": ("Qwen3MoeConfig", dict(hidden_size=2048, intermediate_size=6144,
                                                    moe_intermediate_size=768, num_hidden_layers=4,
                                                    num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                                                    num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
                                                    vocab_size=151936, output_router_logits=True,
                                                    router_aux_loss_coef=0.001)),
    # the dense end-to-end pairs: full depth, the published shapes (random weights)
    "llama-3.2-3b": ("LlamaConfig", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                         num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                                         vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True)),
    "qwen3-1.7b": ("Qwen3Config", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                       num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                                       vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen3-4b": ("Qwen3Config", dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                                     vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True)),
    "gemma3-1b": ("Gemma3TextConfig", dict(hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
                                           num_attention_heads=4, num_key_value_heads=1, head_dim=256,
                                           vocab_size=262144, sliding_window=512, query_pre_attn_scalar=256,
                                           hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
                                           max_position_embeddings=32768)),
}


def model_config(name: str, **overrides):
    """The transformers config object of a named model."""
    import transformers

    if name not in MODELS:
        raise ValueError(f"model: unknown name {name!r}; expected one of {', '.join(sorted(MODELS))}")
    cls_name, kwargs = MODELS[name]
    kw = {**_COMMON, **kwargs, **overrides}
    cfg = getattr(transformers, cls_name)(**kw)
    return cfg


def build_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0, attn_implementation="sdpa",
                **overrides):
    """A randomly initialised ``AutoModelForCausalLM`` of a named config (offline)."""
    from transformers import AutoModelForCausalLM

    cfg = model_config(name, **overrides)
    cfg._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model


def is_model_path(path: str) -> bool:
    """Whether ``path`` is a local Hugging Face model folder (with a ``config.json``) or a config file."""
    import os

    return os.path.isfile(path) or os.path.isfile(os.path.join(path, "config.json"))


def build_model_from_path(path: str, dtype: torch.dtype = torch.float32, device="meta"):
    """A model of a local Hugging Face model folder or ``config.json``, built from its config with
    random weights (the folder's weights are not read, nothing is downloaded; no remote code runs),
    by default on the meta device (no memory, so a model of any size is cheap). The class is the
    first of the config's ``architectures`` that transformers has, else ``AutoModelForCausalLM``'s
    (then ``AutoModel``'s) class for the config. Raises ValueError naming ``path`` when the config
    cannot be read or no class takes it."""
    import transformers
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    try:
        cfg = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - any unreadable config is the user's input
        raise ValueError(f"{path}: not a readable Hugging Face config ({_first_line(e)})") from None
    classes = [getattr(transformers, a, None) for a in (getattr(cfg, "architectures", None) or [])]
    cls = next((c for c in classes if isinstance(c, type) and hasattr(c, "_from_config")), None)
    errors = []
    with torch.device(device):
        for build in ([cls._from_config] if cls is not None else []) + [AutoModelForCausalLM.from_config,
                                                                         AutoModel.from_config]:
            try:
                return build(cfg, dtype=dtype)
            except Exception as e:  # noqa: BLE001 - the next class, then one error naming the config
                errors.append(_first_line(e))
    raise ValueError(f"{path}: no transformers model class builds from this config ({errors[0]})")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__
