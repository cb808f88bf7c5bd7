"""The compatibility fix for DeepSpeed AutoEP and transformers' output-capture registry."""
import pytest
import torch

import deepspeed
from deepspeed_fused import compat
from deepspeed_fused.hook import install, patch_model, uninstall

oc = pytest.importorskip("transformers.utils.output_capturing")


class ModelKeyedRegistry(dict):
    """A registry keyed by a model's class, whose get takes no default (as in transformers 5.25)."""

    def __setitem__(self, model, value):
        super().__setitem__(str(model.__class__), value)

    def get(self, model):
        return super().get(str(model.__class__)) or {}


class KeyedWithDefault(dict):
    """A dict subclass that behaves as the plain dict DeepSpeed expects."""

    def get(self, key, default=None):
        return super().get(key, default)


@pytest.fixture
def registry(monkeypatch):
    """Swap in a registry of a given class for the test; the fix is taken out after it."""
    def use(cls):
        compat.undo_autoep_output_capture()
        reg = cls()
        monkeypatch.setattr(oc, "_CAN_RECORD_REGISTRY", reg)
        return reg

    original = oc._CAN_RECORD_REGISTRY
    yield use
    monkeypatch.setattr(oc, "_CAN_RECORD_REGISTRY", original)
    compat.undo_autoep_output_capture()


def test_detected_by_behaviour(registry):
    registry(ModelKeyedRegistry)
    assert compat.output_capture_needs_fix()
    registry(KeyedWithDefault)
    assert not compat.output_capture_needs_fix()
    registry(dict)
    assert not compat.output_capture_needs_fix()


def test_fix_takes_deepspeeds_string_keys_and_keeps_model_keys(registry):
    reg = registry(ModelKeyedRegistry)
    model = torch.nn.Linear(2, 2)
    reg[model] = {"hidden_states": 1}
    with pytest.raises(TypeError):  # DeepSpeed's call, unfixed
        reg.get("<class 'x'>", None)
    note = compat.fix_autoep_output_capture()
    assert note and "AutoEP compatibility" in note and compat.notes() == [note]
    assert compat.fix_autoep_output_capture() == note  # once
    missing = object()
    key = str(torch.nn.Linear)
    assert reg.get(key, missing) == {"hidden_states": 1}  # the entry stored by model, found by its string key
    assert reg.get("<class 'x'>", missing) is missing
    reg[key] = {"router_logits": 2}  # DeepSpeed's restore by string key lands on that key
    assert reg.get(model) == {"router_logits": 2} and dict.get(reg, key) == {"router_logits": 2}
    reg[torch.nn.ReLU()] = {"a": 3}  # transformers' own calls unchanged
    assert reg.get(torch.nn.ReLU()) == {"a": 3} and reg.get(torch.nn.Tanh()) == {}
    assert compat.undo_autoep_output_capture() and not compat.notes()
    with pytest.raises(TypeError):
        reg.get("<class 'x'>", None)


def test_fix_is_not_applied_where_not_needed(registry):
    registry(KeyedWithDefault)
    assert compat.fix_autoep_output_capture() is None and compat.notes() == []
    assert "get" in KeyedWithDefault.__dict__ and not hasattr(KeyedWithDefault.get, "_deepspeed_fused_compat")


@pytest.fixture
def stub_initialize():
    """deepspeed.initialize replaced by a stand-in (DeepSpeed builds nothing), under the hook."""
    def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                   lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None,
                   config=None, mesh_param=None, config_params=None):
        return (None, None, None, None)

    uninstall()
    real = deepspeed.initialize
    deepspeed.initialize = initialize
    install()
    yield
    uninstall()
    deepspeed.initialize = real
    install()


@pytest.mark.parametrize("autoep", [True, False])
def test_hook_applies_it_before_the_engine_when_autoep_is_enabled(registry, stub_initialize, autoep):
    registry(ModelKeyedRegistry)
    cfg = {"train_micro_batch_size_per_gpu": 1, "expert_parallel": {"enabled": autoep, "autoep_size": 1}}
    deepspeed.initialize(model=None, config=cfg)
    assert compat.output_capture_needs_fix() is not autoep
    assert bool(compat.notes()) is autoep
    report = patch_model(torch.nn.Linear(2, 2), None)
    assert report.notes == compat.notes() and report.to_dict()["notes"] == report.notes
    assert ("AutoEP compatibility" in str(report)) is autoep
