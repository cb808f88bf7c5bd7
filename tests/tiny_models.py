"""Tiny HF model builders for the tests (offline, random init)."""
from deepspeed_fused.models import build_model, model_config  # noqa: F401

FAMILIES = ["llama-tiny", "qwen3-tiny", "qwen3-moe-tiny", "mixtral-tiny", "deepseek-v3-tiny"]
MOE_FAMILIES = ["qwen3-moe-tiny", "qwen2-moe-tiny", "mixtral-tiny", "deepseek-v3-tiny"]


def tiny(name="llama-tiny", **kw):
    return build_model(name, **kw)
