"""Feature "linear_cross_entropy" (stub: filled by its feature issue)."""
from __future__ import annotations

from ..config import FeatureConfig
from .base import Feature
from .registry import register


class LinearCrossEntropyConfig(FeatureConfig):
    """Options of the "linear_cross_entropy" feature."""


@register
class LinearCrossEntropyFeature(Feature):
    name = "linear_cross_entropy"
    config_model = LinearCrossEntropyConfig

    def apply(self, model, engine, cfg):
        raise NotImplementedError("linear_cross_entropy is not implemented yet")

    def revert(self, model):
        return 0
