"""The ``"deepspeed_fused"`` section of ds_config.json, as validated config models.

Each feature declares its own model (a :class:`FeatureConfig` subclass, in the style of
DeepSpeed's ``DeepSpeedConfigModel``: unknown keys forbidden, strict types). The section model
is built from the feature registry, so adding a feature adds its key here. Errors name the
full key path (``deepspeed_fused.rms_norm.enabeld``) and the allowed keys.
"""
from __future__ import annotations

from typing import Any, Mapping

from pydantic import StrictBool, ValidationError, create_model

from deepspeed.runtime.config_utils import DeepSpeedConfigModel

SECTION = "deepspeed_fused"


class FeatureConfig(DeepSpeedConfigModel):
    """Options every feature has. Subclasses add their own fields."""

    enabled: StrictBool = False
    """Turn the feature on. Off by default: an absent section changes nothing."""


class ConfigError(ValueError):
    """A malformed ``deepspeed_fused`` section: names the key path and what was expected."""


_SECTION_MODELS: dict = {}


def _section_model():
    """The section model for the features registered now (cached per registry state)."""
    from .features.registry import all_features

    key = tuple((f.name, f.config_model) for f in all_features())
    if key not in _SECTION_MODELS:
        fields = {name: (cm, cm()) for name, cm in key}
        _SECTION_MODELS[key] = create_model("DeepSpeedFusedConfig", __base__=DeepSpeedConfigModel, **fields)
    return _SECTION_MODELS[key]


def _model_for_path(model: type, path: tuple) -> type | None:
    for part in path:
        field = model.model_fields.get(part) if isinstance(part, str) else None
        if field is None or not isinstance(field.annotation, type):
            return None
        model = field.annotation
    return model


def _format_error(err: ValidationError, model: type) -> str:
    lines = []
    for e in err.errors():
        loc = tuple(p for p in e["loc"])
        path = ".".join([SECTION] + [str(p) for p in loc])
        if e["type"] == "extra_forbidden":
            parent = _model_for_path(model, loc[:-1])
            allowed = sorted(parent.model_fields) if parent is not None else []
            lines.append(f"{path}: unknown key; allowed keys: {', '.join(allowed)}")
        else:
            lines.append(f"{path}: {e['msg']} (got {e.get('input')!r})")
    return "invalid deepspeed_fused config: " + "; ".join(lines)


def parse_config(config: Any) -> Any:
    """Validate a ``deepspeed_fused`` section.

    ``config`` may be the whole ds_config dict (the section is read from its
    ``"deepspeed_fused"`` key), the section itself, ``None`` (every feature off), or an
    already-validated model. Raises :class:`ConfigError` (a ``ValueError``) on a bad section.
    """
    model = _section_model()
    if isinstance(config, model):
        return config
    if config is None:
        section: Mapping = {}
    elif isinstance(config, Mapping):
        section = config.get(SECTION, {}) if _looks_like_ds_config(config, model) else config
        if section is None:
            section = {}
    else:
        raise ConfigError(f"{SECTION}: expected a dict (the ds_config or its section), got {type(config).__name__}")
    if not isinstance(section, Mapping):
        raise ConfigError(f"{SECTION}: expected an object, got {type(section).__name__}")
    for name, value in section.items():
        if name in model.model_fields and not isinstance(value, Mapping):
            raise ConfigError(f"{SECTION}.{name}: expected an object like {{\"enabled\": true}}, "
                              f"got {type(value).__name__}")
    try:
        return model(strict=True, **dict(section))
    except ValidationError as err:
        raise ConfigError(_format_error(err, model)) from None


def _looks_like_ds_config(config: Mapping, model: type) -> bool:
    if SECTION in config:
        return True
    # A section holds only feature names; a ds_config holds DeepSpeed keys.
    return bool(config) and not all(k in model.model_fields for k in config)


def config_reference() -> list[dict]:
    """Every key of every feature: path, type, default, meaning (docs are generated from this)."""
    from .features.registry import all_features

    rows = []
    for f in all_features():
        cm = f.config_model
        docs = _field_docs(cm)
        for name, field in cm.model_fields.items():
            rows.append(dict(key=f"{SECTION}.{f.name}.{name}", type=_type_name(field.annotation),
                             default=field.default, doc=docs.get(name, field.description or "")))
    return rows


def _type_name(ann) -> str:
    """A readable type for the docs: ``int or "auto"``, ``"auto" or "fp32"``, ``bool``."""
    import typing

    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return " or ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in typing.get_args(ann))
    if origin is typing.Union or type(ann).__name__ == "UnionType":
        return " or ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(ann)[0])
    name = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
    return {"StrictBool": "bool", "StrictInt": "int", "StrictFloat": "float", "StrictStr": "str",
            "NoneType": "null"}.get(name, name)


def _field_docs(cls: type) -> dict:
    """Attribute docstrings (a string literal right after a field) of a config class and its bases."""
    import ast
    import inspect
    import textwrap

    out: dict = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, FeatureConfig)):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr) \
                    and isinstance(getattr(b, "value", None), ast.Constant) and isinstance(b.value.value, str):
                out[a.target.id] = " ".join(b.value.value.split())
    return out
