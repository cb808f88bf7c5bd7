"""Imports a DistributedTest rank would otherwise pay for again and again (seconds each on a small
CPU machine): the worker server imports this module once, and every rank is forked from it (see
unit/common.py). Only imports: no tensors, no threads, no CUDA (the server refuses CUDA while it
imports this; the ranks would then fail saying so)."""
import importlib

import deepspeed  # noqa: F401
import deepspeed.comm  # noqa: F401
import deepspeed.runtime.engine  # noqa: F401
import transformers

import deepspeed_fused  # noqa: F401  (installs the deepspeed.initialize hook, as in the tests)
import tiny_models  # noqa: F401

for _cls in ("AutoModelForCausalLM", "LlamaForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
             "Qwen2MoeForCausalLM", "MixtralForCausalLM", "DeepseekV3ForCausalLM"):
    getattr(transformers, _cls)

# Imported by deepspeed.initialize (ZeRO's optimizer check), through torch.compile: seconds.
for _mod in ("deepspeed.runtime.zero.stage3", "deepspeed.runtime.zero.stage_1_and_2",
             "deepspeed.runtime.zero.muon.muon_optimizer", "torch._inductor.compile_fx"):
    try:
        importlib.import_module(_mod)
    except Exception:  # noqa: BLE001 - another DeepSpeed or torch version: only slower
        pass
