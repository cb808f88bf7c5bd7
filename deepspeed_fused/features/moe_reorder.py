"""Feature "moe_reorder" (stub: filled by its feature issue)."""
from __future__ import annotations

from ..config import FeatureConfig
from .base import Feature
from .registry import register


class MoeReorderConfig(FeatureConfig):
    """Options of the "moe_reorder" feature."""


@register
class MoeReorderFeature(Feature):
    name = "moe_reorder"
    config_model = MoeReorderConfig

    def apply(self, model, engine, cfg):
        raise NotImplementedError("moe_reorder is not implemented yet")

    def revert(self, model):
        return 0
