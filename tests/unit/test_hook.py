"""The deepspeed.initialize hook, patch_model/unpatch_model and the report."""
import contextlib
import importlib

import pytest
import torch

import deepspeed
import deepspeed_fused
from deepspeed_fused.config import ConfigError, FeatureConfig
from deepspeed_fused.features.base import Feature, FeatureReport
from deepspeed_fused.features.registry import register, unregister
from deepspeed_fused.hook import install, patch_model, unpatch_model
from tiny_models import build_model
from unit.common import DistributedTest

OFF = {"rms_norm": {"enabled": False}, "linear_cross_entropy": {"enabled": False},
       "moe_reorder": {"enabled": False}}


class DummyConfig(FeatureConfig):
    """Options of the test feature."""

    supported: bool = True
    """Whether the support check passes."""

    explode: bool = False
    """Raise in apply after touching the model."""


class DummyFeature(Feature):
    """A feature that tags every Linear module (so tests can see what was applied)."""

    name = "dummy"
    config_model = DummyConfig
    applies = 0

    def is_supported(self, env):
        return (True, "") if _STATE["supported"] else (False, "dummy support check failed (no widget)")

    def apply(self, model, engine, cfg):
        DummyFeature.applies += 1
        n = 0
        for m in model.modules():
            if isinstance(m, torch.nn.Linear):
                m._dummy_tag = True
                n += 1
        if cfg.explode:
            raise RuntimeError("boom")
        return FeatureReport(self.name, True, applied=True, where=f"{n} x Linear")

    def revert(self, model):
        n = 0
        for m in model.modules():
            if m.__dict__.pop("_dummy_tag", None):
                n += 1
        return n


_STATE = {"supported": True}


@contextlib.contextmanager
def dummy_registered():
    """The test feature registered (in the process that runs the test: a rank registers its own)."""
    _STATE["supported"] = True
    DummyFeature.applies = 0
    register(DummyFeature)
    try:
        yield DummyFeature
    finally:
        unregister("dummy")


@pytest.fixture
def dummy():
    with dummy_registered() as feature:
        yield feature


def ds_config(stage, section=None):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10**6}
    if section is not None:
        cfg["deepspeed_fused"] = section
    return cfg


def train_steps(model, config, steps=2, seed=0):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    g = torch.Generator().manual_seed(seed + deepspeed.comm.get_rank())
    losses = []
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    return engine, torch.stack(losses)


def test_install_is_idempotent():
    assert install() is False  # importing deepspeed_fused already installed it
    wrapped = deepspeed.initialize
    importlib.reload(deepspeed_fused)
    assert deepspeed.initialize is wrapped
    assert not getattr(wrapped._deepspeed_fused_original, "_deepspeed_fused_hook", False)


class TestHookOffIsInvisible(DistributedTest):
    world_size = [1, 2]

    @pytest.mark.parametrize("stage", [0, 1, 2, 3])
    def test_features_off_change_nothing(self, stage):
        from deepspeed_fused.hook import uninstall

        uninstall()
        try:
            _, ref = train_steps(build_model("llama-tiny"), ds_config(stage))
        finally:
            install()
        for section in (None, OFF):
            model = build_model("llama-tiny")
            forwards = {id(m): type(m).forward for m in model.modules()}
            instance_fwd = [m for m in model.modules() if "forward" in m.__dict__]
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
            engine, losses = train_steps(model, ds_config(stage, section))
            assert torch.equal(losses, ref), (section, losses, ref)
            report = engine.deepspeed_fused_report
            assert [f.status for f in report.features] == ["off"] * len(report.features)
            assert all(type(m).forward is forwards[id(m)] for m in model.modules())
            assert [m for m in model.modules() if "forward" in m.__dict__] == instance_fwd
            assert set(n for n, _ in model.named_parameters()) == set(params)


class TestHookApplies(DistributedTest):
    world_size = 1

    def test_unsupported_feature_warns_and_leaves_model(self):
        with dummy_registered():
            _STATE["supported"] = False
            model = build_model("llama-tiny")
            with pytest.warns(RuntimeWarning, match="dummy support check failed"):
                engine, _ = train_steps(model, ds_config(0, {"dummy": {"enabled": True}}), steps=1)
            rep = engine.deepspeed_fused_report["dummy"]
            assert rep.enabled and not rep.applied and "no widget" in rep.reason
            assert not any(hasattr(m, "_dummy_tag") for m in model.modules())
            assert "dummy support check failed" in str(engine.deepspeed_fused_report)

    def test_failing_apply_is_rolled_back(self):
        with dummy_registered():
            model = build_model("llama-tiny")
            with pytest.warns(RuntimeWarning, match="failed to apply"):
                engine, _ = train_steps(model, ds_config(0, {"dummy": {"enabled": True, "explode": True}}), steps=1)
            assert not engine.deepspeed_fused_report["dummy"].applied
            assert not any(hasattr(m, "_dummy_tag") for m in model.modules())

    def test_applied_feature_reported_once_per_model(self):
        with dummy_registered():
            model = build_model("llama-tiny")
            cfg = ds_config(0, {"dummy": {"enabled": True}})
            engine, _ = train_steps(model, cfg, steps=1)
            rep = engine.deepspeed_fused_report
            assert rep["dummy"].applied and rep["dummy"].where == "15 x Linear"
            assert rep.applied == ["dummy"]
            table = rep.table()
            assert "dummy" in table and "applied" in table and "15 x Linear" in table
            # initialize again on the same model: not applied twice
            deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=cfg)
            assert DummyFeature.applies == 1
            assert unpatch_model(model) == {"dummy": 15}
            assert not any(hasattr(m, "_dummy_tag") for m in model.modules())

    def test_bad_section_raises_before_engine(self):
        model = build_model("llama-tiny")
        with pytest.raises(ConfigError, match=r"deepspeed_fused\.rms_norm\.enabeld"):
            train_steps(model, ds_config(0, {"rms_norm": {"enabeld": True}}))


def test_patch_model_without_engine(dummy):
    model = build_model("llama-tiny")
    rep = patch_model(model, {"deepspeed_fused": {"dummy": {"enabled": True}}})
    assert rep["dummy"].applied and rep["rms_norm"].status == "off"
    again = patch_model(model, {"dummy": {"enabled": True}})
    assert again["dummy"].applied and DummyFeature.applies == 1
    assert unpatch_model(model) == {"dummy": 15}
    assert unpatch_model(model) == {}


def test_report_to_dict_and_text(dummy):
    model = build_model("llama-tiny")
    rep = patch_model(model, {"dummy": {"enabled": True}})
    d = rep.to_dict()
    assert d["env"]["torch_version"] == torch.__version__
    assert [f["name"] for f in d["features"]][-1] == "dummy"
    text = str(rep)
    assert text.startswith("deepspeed_fused report") and "feature" in text and "enabled" in text
    unpatch_model(model)
