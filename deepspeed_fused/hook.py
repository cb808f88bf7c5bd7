"""The ``deepspeed.initialize`` hook and the public patch/unpatch entry points.

``install()`` wraps ``deepspeed.initialize`` once. After DeepSpeed builds the engine, the wrapper
reads the ``deepspeed_fused`` section from the engine's config, applies each enabled feature to
``engine.module``, attaches the report as ``engine.deepspeed_fused_report`` and shows it on rank 0
(``"show_report": false`` in the section keeps it quiet).
An enabled feature that cannot apply warns and leaves the model as it was; a malformed section
raises before the engine is built, however the config is given (a dict or a file, through
``config=``, ``config_params=`` or ``args.deepspeed_config``).
"""
from __future__ import annotations

import copy
import functools
import inspect
import warnings
from typing import Any, Mapping, Optional

import torch

from .config import SECTION, parse_config
from .features.base import Environment, FeatureReport
from .features.registry import all_features, get_feature
from .report import Report

_APPLIED_ATTR = "_deepspeed_fused_applied"  # the model's _Record: what the hook applied to it, with which options


class _Record(dict):
    """feature name -> (the feature config it was applied with, its FeatureReport), in the model's
    ``__dict__``. Deep copies carry it (the copy's own state is checked against it); a pickled
    model loads without it (``torch.save``/``torch.load`` in a fresh process: nothing is patched
    there until ``patch_model`` runs again)."""

    def __reduce__(self):
        return (_Record, ())

    def __copy__(self):
        return _Record(self)

    def __deepcopy__(self, memo):
        return _Record({k: copy.deepcopy(v, memo) for k, v in self.items()})


def _record(model: torch.nn.Module) -> _Record:
    rec = model.__dict__.get(_APPLIED_ATTR)
    if not isinstance(rec, _Record):
        rec = model.__dict__[_APPLIED_ATTR] = _Record()
    return rec


def _is_applied(feature, model, rec: _Record) -> bool:
    """Whether ``feature`` runs on ``model`` now: the feature's own reading of the model's state,
    or (features that cannot tell) the record of what was applied to this model object."""
    state = feature.is_applied(model)
    return (feature.name in rec) if state is None else bool(state)


def _rank() -> int:
    try:
        import deepspeed.comm as dist

        return dist.get_rank() if dist.is_initialized() else 0
    except Exception:
        return 0


_LOGGER = None


def report_logger():
    """The ``deepspeed_fused`` logger: DeepSpeed's format, to stdout, at INFO (DeepSpeed's own
    logger shows only warnings, so a report logged there at INFO is never seen)."""
    global _LOGGER
    if _LOGGER is None:
        import logging

        from deepspeed.utils.logging import LoggerFactory

        existing = logging.getLogger("deepspeed_fused")
        _LOGGER = existing if existing.handlers else LoggerFactory.create_logger(name="deepspeed_fused",
                                                                                level=logging.INFO)
    return _LOGGER


def _show(report: Report) -> None:
    """The report on rank 0: one table, as a warning when an enabled feature is not applied."""
    if _rank() != 0:
        return
    problem = any(f.enabled and not f.applied for f in report.features)
    (report_logger().warning if problem else report_logger().info)(str(report))


def patch_model(model: torch.nn.Module, config: Any = None, engine: Any = None,
                env: Optional[Environment] = None) -> Report:
    """Make ``model`` match ``config`` (a ds_config dict, its ``deepspeed_fused`` section, or a
    parsed config): each enabled feature is applied with the config's options, each feature that
    is off is reverted if it was applied. Returns the :class:`Report`.

    A feature already applied with the same options is left as it is; one applied with other
    options is reverted and applied again with the new ones. What counts as applied is read from
    the model's state (a model loaded from a pickle, or a copy whose patch was undone, is patched
    afresh). A feature that fails to apply is rolled back and reported; it never raises (a
    malformed config does)."""
    cfg = parse_config(config)
    env = env or Environment.detect()
    rec = _record(model)
    reports = []
    for feature in all_features():
        fcfg = getattr(cfg, feature.name)
        prev = rec.get(feature.name)
        active = _is_applied(feature, model, rec)
        if active and fcfg.enabled and prev is not None and prev[0] == fcfg:
            reports.append(prev[1])  # applied with these options: installing twice is a no-op
            continue
        note = ""
        if active:  # turned off, options changed, or applied outside this record: undo first
            feature.revert(model)
            note = "re-applied with the new options" if prev is not None else ""
        rec.pop(feature.name, None)
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
            else:
                rep.fallback = feature.fallback(env)
                if note:
                    rep.reason = f"{rep.reason}; {note}" if rep.reason else note
                rec[feature.name] = (fcfg, rep)
        reports.append(rep)
    if not rec:
        model.__dict__.pop(_APPLIED_ATTR, None)
    return Report(env=env, features=reports)


def unpatch_model(model: torch.nn.Module) -> dict:
    """Revert every feature applied to ``model`` (in reverse order). Returns {feature: count}."""
    rec = model.__dict__.get(_APPLIED_ATTR)
    rec = rec if isinstance(rec, _Record) else _Record()
    counts = {}
    for feature in reversed(all_features()):
        if _is_applied(feature, model, rec):
            counts[feature.name] = feature.revert(model)
    model.__dict__.pop(_APPLIED_ATTR, None)
    return counts


def _engine_config_dict(engine) -> dict:
    cfg = getattr(engine, "_config", None)
    pd = getattr(cfg, "_param_dict", None)
    if isinstance(pd, dict):
        return pd
    raw = getattr(engine, "config", None)
    return raw if isinstance(raw, dict) else {}


def _config_from_call(original, args, kwargs) -> Optional[Mapping]:
    """The ds_config given to ``deepspeed.initialize`` (``config=`` or ``config_params=``, a dict
    or a path or base64 string, or ``args.deepspeed_config``) as a dict, read as DeepSpeed reads
    it; None when there is none or it does not load (DeepSpeed then reports that itself)."""
    try:
        bound = inspect.signature(original).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = kwargs
    config = bound.get("config")
    if config is None:
        config = bound.get("config_params")
    if config is None:
        a = bound.get("args")
        config = getattr(a, "deepspeed_config", None) or getattr(a, "deepscale_config", None)
    if isinstance(config, Mapping) or config is None:
        return config
    try:
        from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

        loaded = load_ds_config(config)
    except Exception:
        return None
    return loaded if isinstance(loaded, Mapping) else None


def _after_initialize(engine) -> Optional[Report]:
    model = getattr(engine, "module", None)
    if model is None:
        return None
    cfg = parse_config(_engine_config_dict(engine), ds_config=True)
    report = patch_model(model, cfg, engine=engine)
    engine.deepspeed_fused_report = report
    if cfg.show_report and any(f.enabled or f.applied for f in report.features):
        _show(report)
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
        early = _config_from_call(original, args, kwargs)
        if early is not None:
            parse_config(early, ds_config=True)  # a malformed section fails before the engine is built
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
