"""The ``deepspeed.initialize`` hook and the public patch/unpatch entry points.

``install()`` wraps ``deepspeed.initialize`` once. After DeepSpeed builds the engine, the wrapper
reads the ``deepspeed_fused`` section from the engine's config, applies each enabled feature to
``engine.module``, attaches the report as ``engine.deepspeed_fused_report`` and logs it on rank 0.
An enabled feature that cannot apply warns and leaves the model as it was; a malformed section
raises before the engine is built.
"""
from __future__ import annotations

import functools
import warnings
from typing import Any, Optional

import torch

from .config import SECTION, parse_config
from .features.base import Environment, FeatureReport
from .features.registry import all_features, get_feature
from .report import Report

_APPLIED_ATTR = "_deepspeed_fused_applied"  # names of the features applied to a model, in order
_REPORT_ATTR = "_deepspeed_fused_report"


def _log(msg: str, warning: bool = False) -> None:
    from deepspeed.utils import logger

    try:
        import deepspeed.comm as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
    except Exception:
        rank = 0
    if rank == 0:
        (logger.warning if warning else logger.info)(msg)


def patch_model(model: torch.nn.Module, config: Any = None, engine: Any = None,
                env: Optional[Environment] = None) -> Report:
    """Apply the enabled features of ``config`` (a ds_config dict, its ``deepspeed_fused``
    section, or a parsed config) to ``model``. Returns the :class:`Report`.

    Features already applied to this model are not applied again. A feature that fails to apply
    is rolled back and reported; it never raises (a malformed config does)."""
    cfg = parse_config(config)
    env = env or Environment.detect()
    applied: list = getattr(model, _APPLIED_ATTR, None) or []
    previous = getattr(model, _REPORT_ATTR, None)
    reports = []
    for feature in all_features():
        fcfg = getattr(cfg, feature.name)
        if feature.name in applied and previous is not None:
            reports.append(previous[feature.name])  # already applied: installing twice is a no-op
            continue
        rep = FeatureReport(name=feature.name, enabled=bool(fcfg.enabled))
        if fcfg.enabled:
            ok, reason = feature.is_supported(env)
            if not ok:
                rep.reason = reason
            else:
                try:
                    rep = feature.apply(model, engine, fcfg)
                    rep.enabled = True
                except NotImplementedError as e:
                    rep.reason = f"not implemented: {e}"
                except Exception as e:  # never crash the run: roll back and report
                    rep.reason = f"failed to apply ({type(e).__name__}: {e}); model left unchanged"
                    try:
                        feature.revert(model)
                    except Exception:
                        pass
            if not rep.applied:
                warnings.warn(f"deepspeed_fused: feature {feature.name!r} is enabled but not applied: "
                              f"{rep.reason}", RuntimeWarning, stacklevel=2)
            elif feature.name not in applied:
                applied.append(feature.name)
        reports.append(rep)
    if applied:
        model.__dict__[_APPLIED_ATTR] = applied
    report = Report(env=env, features=reports)
    model.__dict__[_REPORT_ATTR] = report
    return report


def unpatch_model(model: torch.nn.Module) -> dict:
    """Revert every feature applied to ``model`` (in reverse order). Returns {feature: count}."""
    applied = model.__dict__.pop(_APPLIED_ATTR, None) or []
    model.__dict__.pop(_REPORT_ATTR, None)
    counts = {}
    for name in reversed(applied):
        counts[name] = get_feature(name).revert(model)
    return counts


def _engine_config_dict(engine) -> dict:
    cfg = getattr(engine, "_config", None)
    pd = getattr(cfg, "_param_dict", None)
    if isinstance(pd, dict):
        return pd
    raw = getattr(engine, "config", None)
    return raw if isinstance(raw, dict) else {}


def _config_from_call(args, kwargs) -> Optional[dict]:
    """The ds_config dict passed to ``deepspeed.initialize``, when it is a dict (to fail fast)."""
    for key in ("config", "config_params"):
        v = kwargs.get(key)
        if isinstance(v, dict):
            return v
    return None


def _after_initialize(engine) -> Optional[Report]:
    model = getattr(engine, "module", None)
    if model is None:
        return None
    report = patch_model(model, _engine_config_dict(engine), engine=engine)
    engine.deepspeed_fused_report = report
    if any(f.enabled for f in report.features):
        _log("\n" + str(report), warning=any(f.enabled and not f.applied for f in report.features))
    return report


def install() -> bool:
    """Wrap ``deepspeed.initialize`` (once). Returns True if it was wrapped by this call."""
    import deepspeed

    current = deepspeed.initialize
    if getattr(current, "_deepspeed_fused_hook", False):
        return False
    original = current

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        early = _config_from_call(args, kwargs)
        if early is not None:
            parse_config(early)  # a malformed section fails before the engine is built
        result = original(*args, **kwargs)
        engine = result[0] if isinstance(result, tuple) else result
        _after_initialize(engine)
        return result

    initialize._deepspeed_fused_hook = True
    initialize._deepspeed_fused_original = original
    deepspeed.initialize = initialize
    return True


def uninstall() -> bool:
    """Put the original ``deepspeed.initialize`` back (tests use this)."""
    import deepspeed

    current = deepspeed.initialize
    if not getattr(current, "_deepspeed_fused_hook", False):
        return False
    deepspeed.initialize = current._deepspeed_fused_original
    return True


__all__ = ["install", "uninstall", "patch_model", "unpatch_model", "SECTION"]
