import json
import os

import pytest

from deepspeed_fused.config import ConfigError, parse_config
from deepspeed_fused.docs import config_reference
from deepspeed_fused.features.registry import all_features

FEATURES = ["rms_norm", "linear_cross_entropy", "moe_reorder", "mlp_act", "grad_norm"]
CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


def test_absent_section_means_all_off():
    for cfg in (None, {}, {"train_batch_size": 8, "zero_optimization": {"stage": 2}}):
        parsed = parse_config(cfg)
        assert all(not getattr(parsed, f).enabled for f in FEATURES)


def test_section_from_ds_config_and_bare_section_agree():
    section = {"rms_norm": {"enabled": True}, "moe_reorder": {"enabled": False}}
    a = parse_config({"train_batch_size": 8, "deepspeed_fused": section})
    b = parse_config(section)
    assert a == b
    assert a.rms_norm.enabled and not a.moe_reorder.enabled and not a.linear_cross_entropy.enabled


def test_every_feature_has_enabled_default_false():
    names = [f.name for f in all_features()]
    assert set(FEATURES) <= set(names)
    for f in all_features():
        assert f.config_model().enabled is False


@pytest.mark.parametrize("section, path, expect", [
    ({"rms_norm": {"enabeld": True}}, "deepspeed_fused.rms_norm.enabeld", "allowed keys: enabled"),
    ({"rms_nrom": {"enabled": True}}, "deepspeed_fused.rms_nrom", "allowed keys: grad_norm, linear_cross_entropy, mlp_act, moe_reorder"),
    ({"linear_cross_entropy": {"enabled": True, "bogus": 1}}, "deepspeed_fused.linear_cross_entropy.bogus",
     "unknown key"),
    ({"moe_reorder": {"enable": True}}, "deepspeed_fused.moe_reorder.enable", "allowed keys"),
])
def test_unknown_key_names_full_path_and_allowed_keys(section, path, expect):
    with pytest.raises(ConfigError) as ei:
        parse_config({"deepspeed_fused": section})
    msg = str(ei.value)
    assert path in msg and expect in msg


@pytest.mark.parametrize("feature", FEATURES)
@pytest.mark.parametrize("value", ["true", 1, 0, None, [True], 1.0])
def test_enabled_must_be_a_bool(feature, value):
    with pytest.raises(ConfigError, match=rf"deepspeed_fused\.{feature}\.enabled"):
        parse_config({"deepspeed_fused": {feature: {"enabled": value}}})


@pytest.mark.parametrize("bad, where", [
    ({"rms_norm": True}, "deepspeed_fused.rms_norm"),
    ({"rms_norm": "on"}, "deepspeed_fused.rms_norm"),
    ({"rms_norm": [1]}, "deepspeed_fused.rms_norm"),
])
def test_feature_value_must_be_an_object(bad, where):
    with pytest.raises(ConfigError, match=where):
        parse_config({"deepspeed_fused": bad})


@pytest.mark.parametrize("bad", ["on", 3, [1]])
def test_section_must_be_an_object(bad):
    with pytest.raises(ConfigError, match="deepspeed_fused"):
        parse_config({"deepspeed_fused": bad})


def test_config_error_is_a_value_error():
    assert issubclass(ConfigError, ValueError)


@pytest.mark.parametrize("name", sorted(os.listdir(CONFIGS)))
def test_shipped_configs_parse(name):
    with open(os.path.join(CONFIGS, name)) as f:
        cfg = json.load(f)
    parsed = parse_config(cfg)
    expect_on = "fused" in name
    assert all(getattr(parsed, f).enabled == expect_on for f in FEATURES)


def test_config_reference_lists_every_key():
    rows = config_reference()
    keys = {r["key"] for r in rows}
    for f in all_features():
        for field in f.config_model.model_fields:
            assert f"deepspeed_fused.{f.name}.{field}" in keys
    assert all(r["doc"] for r in rows), [r["key"] for r in rows if not r["doc"]]


# ---- a bare section is read as a section; feature keys are never dropped -------------

def test_bare_section_with_an_unknown_key_raises_naming_it():
    with pytest.raises(ConfigError) as ei:
        parse_config({"rms_norm": {"enabled": True}, "lce": {"enabled": True}})
    msg = str(ei.value)
    assert "deepspeed_fused.lce: unknown key" in msg and "linear_cross_entropy" in msg


@pytest.mark.parametrize("ds_key", ["train_batch_size", "zero_optimization", "bf16", "optimizer"])
def test_feature_keys_at_the_top_of_a_ds_config_raise(ds_key):
    with pytest.raises(ConfigError, match=r'rms_norm: .*nest them under "deepspeed_fused"'):
        parse_config({ds_key: {}, "rms_norm": {"enabled": True}})
    with pytest.raises(ConfigError, match="nest them"):  # also next to a section
        parse_config({ds_key: {}, "deepspeed_fused": {}, "moe_reorder": {"enabled": True}})


def test_ds_config_or_section_can_be_forced():
    assert parse_config({"rms_norm": {"enabled": True}}, ds_config=False).rms_norm.enabled
    with pytest.raises(ConfigError, match="nest them"):
        parse_config({"rms_norm": {"enabled": True}}, ds_config=True)
    assert not parse_config({"train_micro_batch_size_per_gpu": 1}, ds_config=True).rms_norm.enabled


def test_show_report_is_a_section_key():
    assert parse_config(None).show_report is True
    assert parse_config({"show_report": False}).show_report is False
    with pytest.raises(ConfigError, match=r"deepspeed_fused\.show_report"):
        parse_config({"deepspeed_fused": {"show_report": "no"}})


# ---- values the op would reject at its first call fail in the config ----------------------------

@pytest.mark.parametrize("key", ["z_loss", "label_smoothing"])
@pytest.mark.parametrize("value", [float("inf"), float("nan")])
def test_non_finite_loss_options_are_rejected(key, value):
    with pytest.raises(ConfigError, match=rf"deepspeed_fused\.linear_cross_entropy\.{key}: .*finite"):
        parse_config({"deepspeed_fused": {"linear_cross_entropy": {"enabled": True, key: value}}})


# ---- every value of the section is honoured or rejected: "auto" and non-string keys -----------------------

AUTO_CASES = [
    ({"rms_norm": {"enabled": "auto"}}, "deepspeed_fused.rms_norm.enabled"),
    ({"linear_cross_entropy": {"enabled": True, "z_loss": "auto"}}, "deepspeed_fused.linear_cross_entropy.z_loss"),
    ({"rms_norm": {"enabled": True, "match_forms": "auto"}}, "deepspeed_fused.rms_norm.match_forms"),
    ({"moe_reorder": {"enabled": True, "validate": "auto"}}, "deepspeed_fused.moe_reorder.validate"),
    ({"show_report": "auto"}, "deepspeed_fused.show_report"),
]
KEY_CASES = [
    ({"rms_norm": {1: True}}, "deepspeed_fused.rms_norm: key 1 (int)"),
    ({("rms_norm",): {"enabled": True}}, "deepspeed_fused: key ('rms_norm',) (tuple)"),
]


def _initialize_raises(section, match, monkeypatch):
    """deepspeed.initialize with a real model: the hook raises before DeepSpeed does any work (no
    process group, no engine; without the hook this call would build one)."""
    import deepspeed
    import torch
    from deepspeed.runtime.engine import DeepSpeedEngine

    import deepspeed_fused  # noqa: F401  (installs the hook)

    built = []
    monkeypatch.setattr(DeepSpeedEngine, "_do_args_sanity_check", lambda *a: built.append(1))
    monkeypatch.setattr(deepspeed, "init_distributed", lambda *a, **k: built.append(1))
    model = torch.nn.Linear(4, 4)
    cfg = {"train_micro_batch_size_per_gpu": 1, "deepspeed_fused": section}
    with pytest.raises(ConfigError, match=match):
        deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
    assert built == []


@pytest.mark.parametrize("section, path", AUTO_CASES)
def test_auto_is_rejected_naming_the_key(section, path, monkeypatch):
    import re

    import torch

    from deepspeed_fused.hook import patch_model

    match = re.escape(path) + r': "auto" is not a value of this key: the deepspeed_fused section has no "auto" resolution'
    with pytest.raises(ConfigError, match=match):
        parse_config({"deepspeed_fused": section})
    with pytest.raises(ConfigError, match=match):
        parse_config(section)
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ConfigError, match=match):
        patch_model(model, section)
    assert "_deepspeed_fused_applied" not in model.__dict__
    _initialize_raises(section, match, monkeypatch)


def test_auto_is_honoured_where_the_key_says_what_it_means():
    cfg = parse_config({"linear_cross_entropy": {"enabled": True, "chunk_tokens": "auto", "accum_dtype": "auto"}})
    assert cfg.linear_cross_entropy.chunk_tokens == "auto" and cfg.linear_cross_entropy.accum_dtype == "auto"
    cfg = parse_config({"linear_cross_entropy": {"enabled": True, "chunk_tokens": 96, "accum_dtype": "fp32"}})
    assert cfg.linear_cross_entropy.chunk_tokens == 96 and cfg.linear_cross_entropy.accum_dtype == "fp32"


@pytest.mark.parametrize("value", [True, False])
def test_every_given_value_is_kept(value):
    """No value is dropped on the way to the feature's model (each option read back as given)."""
    section = {"rms_norm": {"enabled": value, "match_forms": not value},
               "linear_cross_entropy": {"enabled": value, "z_loss": 1e-4, "label_smoothing": 0.1,
                                        "ignore_index": -1, "validate_targets": not value},
               "moe_reorder": {"enabled": value, "validate": value}, "show_report": value}
    cfg = parse_config(section)
    for name, options in section.items():
        if isinstance(options, dict):
            for key, v in options.items():
                assert getattr(getattr(cfg, name), key) == v, (name, key)
        else:
            assert getattr(cfg, name) == options


@pytest.mark.parametrize("section, where", KEY_CASES)
def test_non_string_keys_are_rejected_naming_the_path(section, where, monkeypatch):
    import re

    import torch

    from deepspeed_fused.hook import patch_model

    match = re.escape(where) + r": keys must be strings"
    with pytest.raises(ConfigError, match=match):
        parse_config(section)
    with pytest.raises(ConfigError, match=match):
        parse_config({"deepspeed_fused": section})
    with pytest.raises(ConfigError, match=match):
        patch_model(torch.nn.Linear(4, 4), section)
    _initialize_raises(section, match, monkeypatch)


def test_deprecated_and_new_name_together_is_a_config_error():
    with pytest.raises(ConfigError, match=r"deepspeed_fused\.rms_norm: Cannot provide deprecated parameter "
                                          r"'match_llama_form' and replacing parameter 'match_forms' together"):
        parse_config({"rms_norm": {"match_forms": True, "match_llama_form": False}})
    assert parse_config({"rms_norm": {"match_llama_form": False}}).rms_norm.match_forms is False
