"""deepspeed_fused: fused Triton kernels for DeepSpeed training of large language models.

``import deepspeed_fused`` wraps ``deepspeed.initialize``: after the engine is built, the
``"deepspeed_fused"`` section of the ds_config says which features patch ``engine.module``
(``rms_norm``, ``linear_cross_entropy``, ``moe_reorder``). Users who build engines themselves
call :func:`patch_model` and :func:`unpatch_model`.
"""
__version__ = "0.1.0"

from .config import ConfigError, parse_config  # noqa: E402,F401
from .hook import install, patch_model, uninstall, unpatch_model  # noqa: E402,F401

install()

__all__ = ["__version__", "ConfigError", "parse_config", "install", "uninstall", "patch_model", "unpatch_model"]
