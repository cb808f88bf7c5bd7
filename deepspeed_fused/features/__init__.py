"""Features: one file each, registered in :mod:`.registry`."""
from .base import Environment, Feature, FeatureReport  # noqa: F401
from .registry import all_features, get_feature, register  # noqa: F401
