"""Feature "rms_norm" (stub: filled by its feature issue)."""
from __future__ import annotations

from ..config import FeatureConfig
from .base import Feature
from .registry import register


class RmsNormConfig(FeatureConfig):
    """Options of the "rms_norm" feature."""


@register
class RmsNormFeature(Feature):
    name = "rms_norm"
    config_model = RmsNormConfig

    def apply(self, model, engine, cfg):
        raise NotImplementedError("rms_norm is not implemented yet")

    def revert(self, model):
        return 0
