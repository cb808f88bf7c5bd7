"""The engine hook and the public patch/unpatch entry points.

``install()`` wraps the ``__init__`` of ``DeepSpeedEngine`` and of each of its subclasses (those
defined later too), so every engine is caught however it is built: through ``deepspeed.initialize``
bound before or after ``import deepspeed_fused``, by the HF Trainer or Accelerate, or by a
subclass's constructor. The outermost ``__init__`` of an engine checks the ``deepspeed_fused``
section before the engine's own code runs; when the engine is built it applies each enabled feature
to ``engine.module`` once, attaches the report as ``engine.deepspeed_fused_report`` and shows it on
rank 0 (``"show_report": false`` in the section keeps it quiet). ``deepspeed.initialize`` is also
wrapped, to check the section before DeepSpeed does any work.
An enabled feature that cannot apply leaves the model as it was and is named in the report (logged
as a warning then, at INFO otherwise); a malformed section
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

from . import compat
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
    """The report on rank 0: one table, logged at INFO, or as a warning when an enabled feature
    failed or did not apply (the one notice of it: ``patch_model`` does not warn here)."""
    if _rank() != 0:
        return
    problem = any(f.enabled and not f.applied for f in report.features)
    (report_logger().warning if problem else report_logger().info)(str(report))


def patch_model(model: torch.nn.Module, config: Any = None, engine: Any = None,
                env: Optional[Environment] = None, warn: bool = True) -> Report:
    """Make ``model`` match ``config`` (a ds_config dict, its ``deepspeed_fused`` section, or a
    parsed config): each enabled feature is applied with the config's options, each feature that
    is off is reverted if it was applied. Returns the :class:`Report`.

    A feature already applied with the same options is left as it is; one applied with other
    options is reverted and applied again with the new ones. What counts as applied is read from
    the model's state (a model loaded from a pickle, or a copy whose patch was undone, is patched
    afresh). A feature that fails to apply is rolled back and reported; it never raises (a
    malformed config does). With ``warn`` each enabled feature that is not applied also warns
    (RuntimeWarning, once per feature and call); the engine hook and the report CLI pass False: the
    report they show is the one notice."""
    cfg = parse_config(config)
    env = env or Environment.detect()
    rec = _record(model)
    reports = []
    for feature in all_features():
        fcfg = getattr(cfg, feature.name)
        prev = rec.get(feature.name)
        active = _is_applied(feature, model, rec)
        if active and fcfg.enabled and prev is not None and prev[0] == fcfg and feature.serves(model, engine):
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
                if warn:
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
    return Report(env=env, features=reports, notes=compat.notes())


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


def _bound(fn, args, kwargs) -> dict:
    """The arguments of a call of ``fn`` by name, with those caught by ``**kwargs`` merged in (a
    subclass engine's ``__init__(self, ..., **super_kwargs)`` passes DeepSpeed's on that way)."""
    try:
        sig = inspect.signature(fn)
        bound = sig.bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        return dict(kwargs)
    out = dict(bound)
    for name, p in sig.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD and isinstance(bound.get(name), Mapping):
            out.pop(name)
            out.update({k: v for k, v in bound[name].items() if k not in out})
    return out


def _config_from_call(fn, args, kwargs) -> Optional[Mapping]:
    """The ds_config given to ``deepspeed.initialize`` or an engine's ``__init__`` (``config_class``,
    a parsed ``DeepSpeedConfig``; ``config=`` or ``config_params=``, a dict or a path or base64
    string; or ``args.deepspeed_config``) as a dict, read as DeepSpeed reads it; None when there is
    none or it does not load (DeepSpeed then reports that itself)."""
    bound = _bound(fn, args, kwargs)
    parsed = getattr(bound.get("config_class"), "_param_dict", None)
    if isinstance(parsed, Mapping):
        return parsed
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


def _validate_call(fn, args, kwargs) -> None:
    """A malformed section raises here, before the call builds anything; with AutoEP enabled, the
    compatibility fix it needs is applied (:mod:`deepspeed_fused.compat`)."""
    early = _config_from_call(fn, args, kwargs)
    if early is not None:
        parse_config(early, ds_config=True)
        if compat.autoep_enabled(early):
            compat.fix_autoep_output_capture()  # where this transformers needs it, before DeepSpeed's AutoEP runs


def _after_initialize(engine) -> Optional[Report]:
    model = getattr(engine, "module", None)
    if model is None:
        return None
    cfg = parse_config(_engine_config_dict(engine), ds_config=True)
    report = patch_model(model, cfg, engine=engine, warn=False)  # the report shown below is the notice
    engine.deepspeed_fused_report = report
    if cfg.show_report and (report.notes or any(f.enabled or f.applied for f in report.features)):
        _show(report)
    return report


# ---- the engine hook: every DeepSpeedEngine (and subclass) however it is built ---------------------

_BUILDING = "_deepspeed_fused_building"  # in the engine's __dict__ while its (nested) __init__s run


def _engine_base():
    from deepspeed.runtime.engine import DeepSpeedEngine

    return DeepSpeedEngine


def _engine_classes() -> list:
    base = _engine_base()
    seen, todo = [], [base]
    while todo:
        cls = todo.pop()
        if cls not in seen:
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return seen


def _wrap_engine_init(cls) -> bool:
    """Wrap the ``__init__`` that ``cls`` defines itself (once). The outermost wrapped ``__init__``
    of an engine checks the section before the engine's own code runs and applies the features
    after all of it (a subclass's work after ``super().__init__`` included)."""
    init = cls.__dict__.get("__init__")
    if init is None or getattr(init, "_deepspeed_fused_hook", False):
        return False

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        d = self.__dict__
        outer = _BUILDING not in d
        if outer:
            _validate_call(init, (self,) + args, kwargs)  # a malformed section fails before the engine is built
            d[_BUILDING] = True
        try:
            init(self, *args, **kwargs)
        finally:
            if outer:
                d.pop(_BUILDING, None)
        if outer:
            _after_initialize(self)

    __init__._deepspeed_fused_hook = True
    __init__._deepspeed_fused_original = init
    cls.__init__ = __init__
    return True


def _on_engine_subclass(cls, **kwargs):
    super(_engine_base(), cls).__init_subclass__(**kwargs)
    _wrap_engine_init(cls)


def _install_engine_hook() -> bool:
    base = _engine_base()
    wrapped = [_wrap_engine_init(cls) for cls in _engine_classes()]
    if "__init_subclass__" not in base.__dict__:  # engine classes defined later (a user's subclass)
        hook = classmethod(_on_engine_subclass)
        hook.__func__._deepspeed_fused_hook = True
        base.__init_subclass__ = hook
        wrapped.append(True)
    return any(wrapped)


def _uninstall_engine_hook() -> bool:
    base = _engine_base()
    done = False
    for cls in _engine_classes():
        init = cls.__dict__.get("__init__")
        if getattr(init, "_deepspeed_fused_hook", False):
            cls.__init__ = init._deepspeed_fused_original
            done = True
    hook = base.__dict__.get("__init_subclass__")
    if getattr(getattr(hook, "__func__", None), "_deepspeed_fused_hook", False):
        del base.__init_subclass__
        done = True
    return done


def install() -> bool:
    """Install the hook (once): every ``DeepSpeedEngine`` built from now on (by
    ``deepspeed.initialize`` however it was imported, by the HF Trainer, Accelerate, or a subclass's
    constructor) checks its ``deepspeed_fused`` section before it is built and applies the features
    to ``engine.module`` once after. ``deepspeed.initialize`` is also wrapped, to check the section
    before DeepSpeed does any work (process group, config parsing). Returns True if this call
    installed anything."""
    import deepspeed

    engine_hooked = _install_engine_hook()
    current = deepspeed.initialize
    if getattr(current, "_deepspeed_fused_hook", False):
        return engine_hooked
    original = current

    @functools.wraps(original)
    def initialize(*args, **kwargs):
        _validate_call(original, args, kwargs)  # before DeepSpeed's process group and config parsing
        result = original(*args, **kwargs)
        engine = result[0] if isinstance(result, tuple) else result
        if engine is not None and "deepspeed_fused_report" not in getattr(engine, "__dict__", {}):
            _after_initialize(engine)  # an engine the engine hook did not see (not a DeepSpeedEngine)
        return result

    initialize._deepspeed_fused_hook = True
    initialize._deepspeed_fused_original = original
    deepspeed.initialize = initialize
    return True


def uninstall() -> bool:
    """Take the hook out again: the original ``deepspeed.initialize`` and engine ``__init__``s (tests
    use this)."""
    import deepspeed

    done = _uninstall_engine_hook()
    current = deepspeed.initialize
    if getattr(current, "_deepspeed_fused_hook", False):
        deepspeed.initialize = current._deepspeed_fused_original
        done = True
    return done


__all__ = ["install", "uninstall", "patch_model", "unpatch_model", "SECTION"]
