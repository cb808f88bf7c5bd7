"""Features: one file (or package) each. The package registers the built-in ones, in this order."""
from .base import Environment, Feature, FeatureConfig, FeatureReport  # noqa: F401
from .registry import all_features, get_feature, register, unregister  # noqa: F401
from .rms_norm import RmsNormFeature
from .linear_cross_entropy import LinearCrossEntropyFeature
from .moe_reorder import MoeReorderFeature
from .rope import RopeFeature
from .mlp_act import MlpActFeature
from .grad_norm import GradNormFeature

for _feature in (RmsNormFeature, LinearCrossEntropyFeature, MoeReorderFeature, RopeFeature, MlpActFeature, GradNormFeature):
    register(_feature)
del _feature
