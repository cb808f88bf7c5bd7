"""The feature registry: the hook and the config section know features only through it.

The built-in features are registered by their package (``deepspeed_fused.features``, in a fixed
order); another feature registers itself with :func:`register` and follows them, in registration
order. The registry imports no feature.
"""
from __future__ import annotations

from .base import Feature

_FEATURES: dict[str, Feature] = {}


def register(feature_cls: type) -> type:
    """Register a :class:`Feature` subclass (usable as a class decorator); registering a name
    again replaces the earlier feature of that name, in its place."""
    if not feature_cls.name:
        raise ValueError(f"{feature_cls.__name__}.name must be set")
    if feature_cls.config_model is None or "enabled" not in feature_cls.config_model.model_fields:
        raise ValueError(f"{feature_cls.__name__}.config_model must be a FeatureConfig subclass")
    _FEATURES[feature_cls.name] = feature_cls()
    return feature_cls


def unregister(name: str) -> None:
    _FEATURES.pop(name, None)


def all_features() -> list[Feature]:
    """Registered features, in registration order (the built-in ones first)."""
    return list(_FEATURES.values())


def get_feature(name: str) -> Feature:
    return _FEATURES[name]
