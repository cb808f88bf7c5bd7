"""Compatibility fixes between the libraries the plugin runs with, applied only where needed.

DeepSpeed's AutoEP (0.19.x) retargets the router-logit recorders of a Hugging Face model through
transformers' output-capture registry (``transformers.utils.output_capturing._CAN_RECORD_REGISTRY``),
treating it as a plain ``dict`` keyed by the string of a module class: ``registry.get(key)``,
``registry.get(key, default)`` and ``registry[key] = entry``. Newer transformers 5.x releases make
the registry a ``dict`` subclass whose ``get`` and ``__setitem__`` take a *model* (the key is
derived from its class) and whose ``get`` takes no default, so ``deepspeed.initialize`` with AutoEP
fails with ``TypeError: get() takes 2 positional arguments but 3 were given`` (and a string key
would be looked up and restored under the wrong name).

:func:`fix_autoep_output_capture` detects that behaviour (not a version list) on a fresh registry
object and, where found, makes the registry class take string keys as a plain dict does; a model
key (transformers' own calls) goes to transformers' methods unchanged. The hook applies it before
DeepSpeed builds an engine whose config enables AutoEP; the report names it.
"""
from __future__ import annotations

from typing import Mapping, Optional

_MARK = "_deepspeed_fused_compat"
_STATE = {"autoep_output_capture": None}  # the note of the fix once applied


def _registry_class():
    try:
        from transformers.utils import output_capturing
    except Exception:  # noqa: BLE001 - no transformers, or one without output capture: nothing to fix
        return None, None
    registry = getattr(output_capturing, "_CAN_RECORD_REGISTRY", None)
    cls = type(registry)
    if registry is None or cls is dict or not issubclass(cls, dict):
        return None, None
    return cls, output_capturing


def output_capture_needs_fix() -> bool:
    """Whether transformers' output-capture registry does not behave as the str-keyed dict DeepSpeed
    uses: on a fresh, empty registry object, ``get(key, default)`` must return the default, and an
    entry stored under a string key must be found by ``get(key)`` and ``in``."""
    cls, _ = _registry_class()
    if cls is None or getattr(cls.get, _MARK, False):
        return False
    missing, key, entry = object(), "<class 'deepspeed_fused.probe'>", {"probe": None}
    try:
        probe = cls()
        if probe.get(key, missing) is not missing:
            return True
        probe[key] = entry
        return probe.get(key) is not entry or key not in probe
    except TypeError:
        return True


def fix_autoep_output_capture() -> Optional[str]:
    """Make the registry class take string keys as a plain dict does, where it does not (see the
    module docstring). Returns the note of the fix (also when applied earlier), or None when
    nothing needs fixing."""
    if _STATE["autoep_output_capture"] is not None:
        return _STATE["autoep_output_capture"]
    if not output_capture_needs_fix():
        return None
    cls, _ = _registry_class()
    own_get, own_set = cls.get, cls.__setitem__

    def get(self, key, *default):
        if isinstance(key, str):  # DeepSpeed's lookup by class string
            return dict.get(self, key, *default)
        return own_get(self, key, *default)

    def __setitem__(self, key, value):
        if isinstance(key, str):
            dict.__setitem__(self, key, value)
        else:
            own_set(self, key, value)

    for fn, own in ((get, own_get), (__setitem__, own_set)):
        setattr(fn, _MARK, own)
        fn.__doc__ = own.__doc__
    cls.get, cls.__setitem__ = get, __setitem__
    try:
        from importlib.metadata import version

        tv = version("transformers")
    except Exception:  # noqa: BLE001
        tv = "?"
    _STATE["autoep_output_capture"] = (
        f"AutoEP compatibility: transformers {tv}'s output-capture registry takes string keys for DeepSpeed's "
        f"router-logit retargeting (its get() takes no default)")
    return _STATE["autoep_output_capture"]


def undo_autoep_output_capture() -> bool:
    """Take the fix out again (tests use this). Returns True if it was in place."""
    cls, _ = _registry_class()
    _STATE["autoep_output_capture"] = None
    if cls is None or not getattr(cls.get, _MARK, False):
        return False
    cls.get, cls.__setitem__ = getattr(cls.get, _MARK), getattr(cls.__setitem__, _MARK)
    return True


def notes() -> list:
    """One line per compatibility fix in force in this process."""
    return [n for n in _STATE.values() if n]


def autoep_enabled(ds_config) -> bool:
    """Whether a ds_config dict enables DeepSpeed's AutoEP (``expert_parallel.enabled``)."""
    ep = ds_config.get("expert_parallel") if isinstance(ds_config, Mapping) else None
    return isinstance(ep, Mapping) and ep.get("enabled") is True


def autoep_status() -> str:
    """For the environment report: whether the AutoEP fix is in force, would be applied, or is not needed."""
    if _STATE["autoep_output_capture"] is not None:
        return "applied (transformers' output-capture registry takes DeepSpeed's string keys)"
    if output_capture_needs_fix():
        return ("needed by this transformers (its output-capture registry's get() takes no default); the hook "
                "applies it before DeepSpeed builds an engine with AutoEP enabled")
    return "not needed"
