"""The coverage suite's settings: the comparison's tolerances, the tiny models' sizes, the
features turned on, and the RMSNorm forms it tells apart."""
from __future__ import annotations

import os

from ..common import OUT_DIR

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


# the features turned on: every registered feature that patches a model (rms_norm,
# linear_cross_entropy, moe_reorder, rope, ... as the registry holds them), each with its default
# options; a feature that patches the engine instead (grad_norm: the ZeRO optimizer's gradient norm)
# has no model-family coverage and is tested on DeepSpeed engines
def features_config() -> dict:
    from ...features.registry import all_features

    return {f.name: {"enabled": True} for f in all_features() if not f.needs_engine}


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
