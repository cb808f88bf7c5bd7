"""The ``"deepspeed_fused"`` section of ds_config.json, as validated config models.

Each feature declares its own model (a :class:`~deepspeed_fused.features.base.FeatureConfig`
subclass, in the style of DeepSpeed's ``DeepSpeedConfigModel``: unknown keys forbidden, strict
types). The section model is built from the feature registry, so adding a feature adds its key
here. Errors name the full key path (``deepspeed_fused.rms_norm.enabeld``) and the allowed keys.
The config reference in the docs is generated from these models by :mod:`deepspeed_fused.docs`.
"""
from __future__ import annotations

import typing
from typing import Any, Mapping, Optional

from pydantic import StrictBool, ValidationError, create_model

from deepspeed.runtime.config_utils import DeepSpeedConfigModel

from .features.base import FeatureConfig  # noqa: F401  (importable from here too)
from .features.registry import all_features

SECTION = "deepspeed_fused"

# Top-level keys of a DeepSpeed config (DeepSpeed's documented ones, current and recently removed).
# A dict holding any of them, or the "deepspeed_fused" key, is a whole ds_config; any other dict is
# the section itself.
DEEPSPEED_TOP_LEVEL_KEYS = frozenset("""
    train_batch_size train_micro_batch_size_per_gpu gradient_accumulation_steps optimizer scheduler
    fp16 bf16 bfloat16 amp torch_autocast zero_optimization zero_allow_untested_optimizer
    zero_force_ds_cpu_optimizer gradient_clipping prescale_gradients gradient_predivide_factor
    gradient_allreduce_op communication_data_type seq_parallel_communication_data_type grad_accum_dtype
    steps_per_print wall_clock_breakdown memory_breakdown dump_state disable_allgather disable_python_gc
    activation_checkpointing flops_profiler comms_logger tensorboard wandb csv_monitor comet monitor_config
    elasticity pipeline checkpoint data_types data_efficiency curriculum_learning compression_training
    autotuning aio nebula sparse_attention sparse_gradients hybrid_engine expert_parallel tensor_parallel
    sequence_parallel_size dataloader_drop_last weight_quantization compile timers graph_harvesting
    use_node_local_storage load_universal eigenvalue quantize_training progressive_layer_drop log_level
    use_data_before_expert_parallelism managed_gradient_accumulation zenflow
    """.split())


class SectionConfig(DeepSpeedConfigModel):
    """Options of the section itself (next to the features' keys)."""

    show_report: StrictBool = True
    """Print the feature report (one table: each feature, whether it is applied, where or why not)
    on rank 0 after ``deepspeed.initialize`` (false: print nothing; ``engine.deepspeed_fused_report``
    still holds it)."""


class ConfigError(ValueError):
    """A malformed ``deepspeed_fused`` section: names the key path and what was expected."""


_SECTION_MODELS: dict = {}


def _section_model():
    """The section model for the features registered now (cached per registry state)."""
    key = tuple((f.name, f.config_model) for f in all_features())
    if key not in _SECTION_MODELS:
        fields = {name: (cm, cm()) for name, cm in key}
        _SECTION_MODELS[key] = create_model("DeepSpeedFusedConfig", __base__=SectionConfig, **fields)
    return _SECTION_MODELS[key]


def _model_for_path(model: type, path: tuple) -> type | None:
    for part in path:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type):
            return None
        model = field.annotation
    return model


def _error_lines(err: ValidationError, model: type, prefix: tuple = ()) -> list:
    """One line per error of ``err``, raised by ``model`` for the part of the section at ``prefix``."""
    lines = []
    for e in err.errors():
        loc = tuple(prefix) + tuple(p for p in e["loc"])
        path = ".".join([SECTION] + [str(p) for p in loc])
        if e["type"] == "extra_forbidden":
            parent = _model_for_path(model, loc[len(prefix):-1])
            allowed = sorted(parent.model_fields) if parent is not None else []
            lines.append(f"{path}: unknown key; allowed keys: {', '.join(allowed)}")
        else:
            lines.append(f"{path}: {e['msg']} (got {e.get('input')!r})")
    return lines


AUTO = "auto"


def _admits_auto(annotation: Any) -> bool:
    """Whether a field's type lists ``"auto"`` as one of its values (``Literal["auto", ...]``, alone
    or in a union): the key documents what "auto" means for it."""
    if typing.get_origin(annotation) is typing.Literal:
        return AUTO in typing.get_args(annotation)
    return any(_admits_auto(a) for a in typing.get_args(annotation))


def _auto_keys() -> list:
    """The section's keys whose type admits ``"auto"`` (each documents what it means)."""
    out = []

    def walk(model, path):
        for name, field in model.model_fields.items():
            ann = field.annotation
            if isinstance(ann, type) and issubclass(ann, DeepSpeedConfigModel):
                walk(ann, path + (name,))
            elif _admits_auto(ann):
                out.append(".".join((SECTION,) + path + (name,)))

    walk(_section_model(), ())
    return out


def _check_keys_and_auto(value: Any, model: Optional[type], path: tuple) -> None:
    """A pre-pass over the section before DeepSpeed's config models read it: every key is a string
    (a Python dict can hold others; JSON cannot) and ``"auto"`` appears only where the key's type
    admits it. DeepSpeed's ``DeepSpeedConfigModel`` drops ``"auto"`` values of nested models before
    validation (they would silently become the defaults), so they are refused here, by key path."""
    where = ".".join((SECTION,) + path)
    if isinstance(value, Mapping):
        for k in value:
            if not isinstance(k, str):
                raise ConfigError(f"{where}: key {k!r} ({type(k).__name__}): keys must be strings, "
                                  f"as in JSON")
        for k, v in value.items():
            field = model.model_fields.get(k) if model is not None else None
            sub = field.annotation if field is not None and isinstance(field.annotation, type) and \
                issubclass(field.annotation, DeepSpeedConfigModel) else None
            _check_keys_and_auto(v, sub, path + (k,))
            if isinstance(v, str) and v == AUTO and field is not None and not _admits_auto(field.annotation):
                takers = ", ".join(_auto_keys()) or "none"
                raise ConfigError(
                    f"{where}.{k}: \"auto\" is not a value of this key: the {SECTION} section has no \"auto\" "
                    f"resolution (neither DeepSpeed nor the Hugging Face Trainer fills it in here); give the value "
                    f"itself (keys that say what \"auto\" means for them: {takers})")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_keys_and_auto(v, None, path + (str(i),))


def parse_config(config: Any, ds_config: Optional[bool] = None) -> Any:
    """Validate a ``deepspeed_fused`` section.

    ``config`` may be the whole ds_config dict (the section is read from its
    ``"deepspeed_fused"`` key), the section itself, ``None`` (every feature off), or an
    already-validated model. A dict is read as a whole ds_config when it has the
    ``"deepspeed_fused"`` key or any DeepSpeed top-level key (``train_batch_size``,
    ``zero_optimization``, ``bf16``, ...), else as the section (``ds_config`` True or False says
    which, without looking). Raises :class:`ConfigError` (a ``ValueError``) on a bad section, and
    on a ds_config with feature keys at its top level (they belong under ``"deepspeed_fused"``).
    """
    model = _section_model()
    if isinstance(config, model):
        return config
    bare = False
    if config is None:
        section: Mapping = {}
    elif isinstance(config, Mapping):
        whole = _is_ds_config(config) if ds_config is None else ds_config
        if whole:
            stray = [k for k in config if k in model.model_fields]
            if stray:
                raise ConfigError(
                    f"{', '.join(stray)}: deepspeed_fused keys at the top level of a ds_config are not read; "
                    f"nest them under \"{SECTION}\": {{\"{SECTION}\": {{\"{stray[0]}\": ...}}}}")
            section = config.get(SECTION, {})
        else:
            section, bare = config, True
        if section is None:
            section = {}
    else:
        raise ConfigError(f"{SECTION}: expected a dict (the ds_config or its section), got {type(config).__name__}")
    if not isinstance(section, Mapping):
        raise ConfigError(f"{SECTION}: expected an object, got {type(section).__name__}")
    _check_keys_and_auto(section, model, ())
    features = _feature_names(model)
    for name, value in section.items():
        if name in features and not isinstance(value, Mapping):
            raise ConfigError(f"{SECTION}.{name}: expected an object like {{\"enabled\": true}}, "
                              f"got {type(value).__name__}")
    # Each feature's options are validated by its own model, built strict (DeepSpeed's non-strict
    # construction, which pydantic uses for a nested model, drops "auto" values): a value is
    # honoured or rejected, never dropped.
    values, errors = {}, []
    for name, value in section.items():
        if name in features:
            try:
                values[name] = model.model_fields[name].annotation(strict=True, **dict(value))
            except ValidationError as err:
                errors += _error_lines(err, model.model_fields[name].annotation, (name,))
            except AssertionError as err:  # DeepSpeed's deprecated-field check (old and new name given together)
                errors.append(f"{SECTION}.{name}: {err}")
        else:
            values[name] = value
    try:
        if not errors:
            return model(strict=True, **values)
        model(strict=True, **{k: v for k, v in values.items() if k not in features})  # its own errors too
        raise ConfigError("invalid deepspeed_fused config: " + "; ".join(errors))
    except (ValidationError, ConfigError) as err:
        if isinstance(err, ValidationError):
            errors += _error_lines(err, model)
        msg = "invalid deepspeed_fused config: " + "; ".join(errors)
        if bare and any(k not in model.model_fields for k in section):
            msg += (" (read as a bare deepspeed_fused section: the dict has no DeepSpeed top-level key such as "
                    "train_batch_size or zero_optimization; a whole ds_config holds the features under "
                    f"\"{SECTION}\")")
        raise ConfigError(msg) from None


def _feature_names(model: type) -> set:
    return {n for n in model.model_fields if n not in SectionConfig.model_fields}


def _is_ds_config(config: Mapping) -> bool:
    """A whole ds_config (it has the section key or a DeepSpeed top-level key), not a section."""
    return SECTION in config or any(k in DEEPSPEED_TOP_LEVEL_KEYS for k in config)
