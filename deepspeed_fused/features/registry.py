"""The feature registry: the hook and the config section know features only through it."""
from __future__ import annotations

from .base import Feature

_FEATURES: dict[str, Feature] = {}


def register(feature_cls: type) -> type:
    """Register a :class:`Feature` subclass (usable as a class decorator)."""
    _load_builtin()  # built-in features first, so the registry order is stable
    if not feature_cls.name:
        raise ValueError(f"{feature_cls.__name__}.name must be set")
    if feature_cls.config_model is None or "enabled" not in feature_cls.config_model.model_fields:
        raise ValueError(f"{feature_cls.__name__}.config_model must be a FeatureConfig subclass")
    _FEATURES[feature_cls.name] = feature_cls()
    return feature_cls


def unregister(name: str) -> None:
    _FEATURES.pop(name, None)


_BUILTIN = ("rms_norm", "linear_cross_entropy", "moe_reorder", "rope")


def all_features() -> list[Feature]:
    """Registered features: the built-in ones in a fixed order (whatever order their modules
    were imported in), then others in registration order."""
    _load_builtin()
    names = [n for n in _BUILTIN if n in _FEATURES] + [n for n in _FEATURES if n not in _BUILTIN]
    return [_FEATURES[n] for n in names]


def get_feature(name: str) -> Feature:
    _load_builtin()
    return _FEATURES[name]


_loaded = False


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        from . import rms_norm, linear_cross_entropy, moe_reorder, rope  # noqa: F401  (each registers itself)
