"""What the moe_reorder feature takes: router classes whose forward is a template's bytecode
(:func:`router_form`), experts modules whose gate the fused ops compute (:func:`fused_gate`,
:func:`oai_gate_of`), and whether the installed DeepSpeed's AutoEP code is the code the fused local
token path replaces (:func:`_local_path_mismatch`, by source hash)."""
from __future__ import annotations

import functools
from typing import Any

import torch

from ..base import global_names
from .templates import _LOCAL_SOURCES, _ROUTER_FORMS, _gate_oai

_TORCH_GLOBALS = {"F": torch.nn.functional, "torch": torch, "nn": torch.nn}


def _code_key(fn) -> tuple:
    co = fn.__code__
    return (co.co_code, co.co_names, co.co_consts, co.co_varnames, co.co_argcount)


def router_form(cls) -> Any:
    """``(renormalise, cast)`` when ``cls.forward`` is one of transformers' top-k softmax router
    forwards, ``("grouped", None)`` for DeepSeek-V3's grouped sigmoid router, ``("logits_first",
    variant)`` for the routers that take the top-k of the logits before the softmax (bytecode equal
    to a template above, each of ``F`` / ``torch`` / ``nn`` it names torch's own), else None."""
    fwd = getattr(cls, "forward", None)
    fwd = getattr(fwd, "__deepspeed_fused_original__", fwd)
    if not hasattr(fwd, "__code__"):
        return None
    g = fwd.__globals__
    if any(name in global_names(fwd.__code__) and g.get(name) is not obj for name, obj in _TORCH_GLOBALS.items()):
        return None
    key = _code_key(fwd)
    for template, renorm, cast in _ROUTER_FORMS:
        if _code_key(template) == key:
            return renorm, cast
    return None


def _source_hash(fn) -> str:
    import hashlib
    import inspect
    import textwrap

    return hashlib.sha256(textwrap.dedent(inspect.getsource(fn)).encode()).hexdigest()[:16]


def _local_path_mismatch(layer) -> str:
    """Empty when this DeepSpeed's AutoEP code is the code the local path replaces; else why not."""
    try:
        cls = layer.AutoEPMoELayer
        found = {"AutoEPMoELayer._forward": getattr(cls, "_forward", None), "AutoEPMoELayer.forward": cls.forward,
                 "combine_from_routed": layer.combine_from_routed,
                 "apply_scores_before_experts_if_enabled": layer.apply_scores_before_experts_if_enabled}
        for name, fn in found.items():
            if fn is None:
                return f"DeepSpeed has no {name}"
            if _source_hash(fn) != _LOCAL_SOURCES[name]:
                return f"DeepSpeed's {name} differs from the 0.19.8 code this path replaces"
        return ""
    except Exception as e:  # source not readable (zipped install, ...)
        return f"DeepSpeed's AutoEP source could not be checked ({type(e).__name__})"


@functools.lru_cache(maxsize=None)
def _silu_forwards() -> tuple:
    fns = [torch.nn.SiLU.forward]
    try:
        from transformers.activations import SiLUActivation

        fns.append(SiLUActivation.forward)
    except ImportError:  # pragma: no cover - transformers without it
        pass
    return tuple(fns)


def fused_gate(experts: torch.nn.Module) -> bool:
    """Whether an experts module's gate is transformers' default, ``act_fn(gate) * up`` of the
    chunked gate-up projection (the class keeps ``_default_apply_gate``: a family with its own
    gate, GPT-OSS's clamped one or a soft-capped one, does not), with SiLU as ``act_fn`` (the
    forward of ``torch.nn.SiLU`` or of transformers' ``SiLUActivation``, not a hub kernel's):
    then :func:`~deepspeed_fused.ops.moe_reorder.swiglu` computes it."""
    if _gate_form(getattr(type(experts), "_apply_gate", None)) != "default" or "_apply_gate" in experts.__dict__:
        return False
    act = getattr(experts, "act_fn", None)
    return (isinstance(act, torch.nn.Module) and getattr(type(act), "forward", None) in _silu_forwards()
            and not (act._forward_hooks or act._forward_pre_hooks))



@functools.lru_cache(maxsize=None)
def _gate_form(fn) -> Any:
    """What an experts class's ``_apply_gate`` is: ``"default"`` (transformers'
    ``_default_apply_gate`` itself), ``"oai"`` (the bytecode of :func:`_gate_oai`, its module's
    ``torch`` torch's own) or None. Read once per function (the experts forward asks per call)."""
    try:
        from transformers.integrations.moe import _default_apply_gate
    except ImportError:  # pragma: no cover - transformers without the experts interface
        _default_apply_gate = None
    if fn is not None and fn is _default_apply_gate:
        return "default"
    if hasattr(fn, "__code__") and fn.__globals__.get("torch") is torch and _code_key(fn) == _code_key(_gate_oai):
        return "oai"
    return None


def oai_gate_of(experts: torch.nn.Module) -> bool:
    """Whether an experts module's gate is GPT-OSS's clamped gate (its class's ``_apply_gate`` has
    the bytecode of :func:`_gate_oai`, its module's ``torch`` is torch, ``alpha`` and ``limit`` are
    Python numbers): then :func:`~deepspeed_fused.ops.moe_reorder.oai_gate` computes it."""
    if _gate_form(getattr(type(experts), "_apply_gate", None)) != "oai" or "_apply_gate" in experts.__dict__:
        return False
    return all(isinstance(getattr(experts, a, None), (int, float)) and not isinstance(getattr(experts, a), bool)
               for a in ("alpha", "limit"))
