"""The deepspeed.initialize hook, patch_model/unpatch_model and the report."""
import argparse
import base64
import contextlib
import copy
import dataclasses
import importlib
import io
import json
import logging
import os
import subprocess
import sys

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
    engines = []  # the engine each apply was given
    built = []  # for each apply: whether the engine's subclass __init__ had finished (None: no such subclass)

    def is_supported(self, env):
        return (True, "") if _STATE["supported"] else (False, "dummy support check failed (no widget)")

    def apply(self, model, engine, cfg):
        DummyFeature.applies += 1
        DummyFeature.engines.append(engine)
        DummyFeature.built.append(getattr(engine, "subclass_init_done", None))
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
    DummyFeature.engines, DummyFeature.built = [], []
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

    @staticmethod
    @contextlib.contextmanager
    def _logged():
        """The records of the package logger, and the warnings raised, while the block runs."""
        import warnings

        from deepspeed_fused.hook import report_logger

        records = []
        catch = logging.Handler()
        catch.emit = records.append
        logger = report_logger()
        logger.addHandler(catch)
        try:
            with warnings.catch_warnings(record=True) as warned:
                warnings.simplefilter("always")
                yield records, warned
        finally:
            logger.removeHandler(catch)

    def test_unsupported_feature_is_reported_once_and_leaves_model(self):
        with dummy_registered(), self._logged() as (records, warned):
            _STATE["supported"] = False
            model = build_model("llama-tiny")
            engine, _ = train_steps(model, ds_config(0, {"dummy": {"enabled": True}}), steps=1)
            rep = engine.deepspeed_fused_report["dummy"]
            assert rep.enabled and not rep.applied and "no widget" in rep.reason
            assert not any(hasattr(m, "_dummy_tag") for m in model.modules())
            assert "dummy support check failed" in str(engine.deepspeed_fused_report)
            # one notice: the report, logged as a warning; no RuntimeWarning besides it
            notices = [r for r in records if "dummy support check failed" in r.getMessage()]
            assert len(notices) == 1 and notices[0].levelno == logging.WARNING, records
            assert not [w for w in warned if "dummy" in str(w.message)], [str(w.message) for w in warned]
            # not recorded as applied: once supported, the next patch applies it
            assert "dummy" not in model.__dict__.get("_deepspeed_fused_applied", {})
            _STATE["supported"] = True
            assert patch_model(model, {"dummy": {"enabled": True}})["dummy"].applied
            assert DummyFeature.applies == 1

    def test_failing_apply_is_rolled_back(self):
        with dummy_registered(), self._logged() as (records, warned):
            model = build_model("llama-tiny")
            engine, _ = train_steps(model, ds_config(0, {"dummy": {"enabled": True, "explode": True}}), steps=1)
            assert not engine.deepspeed_fused_report["dummy"].applied
            assert not any(hasattr(m, "_dummy_tag") for m in model.modules())
            notices = [r for r in records if "failed to apply" in r.getMessage()]
            assert len(notices) == 1 and notices[0].levelno == logging.WARNING, records
            assert not [w for w in warned if "failed to apply" in str(w.message)]

    def test_applied_feature_reported_once_per_model(self):
        with dummy_registered():
            model = build_model("llama-tiny")
            cfg = ds_config(0, {"dummy": {"enabled": True}})
            engine, _ = train_steps(model, cfg, steps=1)
            assert DummyFeature.applies == 1 and DummyFeature.engines == [engine]  # once, by the engine hook
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

    def test_report_is_shown_on_rank0_unless_silenced(self):
        from deepspeed_fused.hook import report_logger

        with dummy_registered():
            records = []
            catch = logging.Handler()
            catch.emit = records.append
            logger = report_logger()
            logger.addHandler(catch)
            try:
                train_steps(build_model("llama-tiny"), ds_config(0, {"dummy": {"enabled": True}}), steps=1)
                shown = [r for r in records if "deepspeed_fused report" in r.getMessage()]
                assert len(shown) == 1 and shown[0].levelno == logging.INFO, records
                text = shown[0].getMessage()
                assert text.startswith("deepspeed_fused report") and "15 x Linear" in text  # no empty first line
                # printed, not filtered: DeepSpeed's own logger drops INFO (its handler is at WARNING)
                own = [h for h in logger.handlers if h is not catch]
                assert logger.isEnabledFor(logging.INFO) and own and all(h.level <= logging.INFO for h in own)
                records.clear()
                train_steps(build_model("llama-tiny"), ds_config(0, {"dummy": {"enabled": True}, "show_report": False}),
                            steps=1)
                assert not [r for r in records if "deepspeed_fused report" in r.getMessage()]
            finally:
                logger.removeHandler(catch)

    def test_bad_section_raises_before_engine(self):
        model = build_model("llama-tiny")
        with pytest.raises(ConfigError, match=r"deepspeed_fused\.rms_norm\.enabeld"):
            train_steps(model, ds_config(0, {"rms_norm": {"enabeld": True}}))


    def test_engine_subclass_built_directly(self):
        """An engine class of the user's (defined after the import) built without deepspeed.initialize:
        the section is checked before DeepSpeed's __init__ runs, the features apply once, after the
        subclass's own __init__ finished."""
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.runtime.engine import DeepSpeedEngine

        class MyEngine(DeepSpeedEngine):
            def __init__(self, *args, **kwargs):
                super().__init__(*args, **kwargs)
                self.subclass_init_done = True

        def build(section):
            cfg = ds_config(0, section)
            model = build_model("llama-tiny")
            return MyEngine(args=None, model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                            config=cfg, config_class=DeepSpeedConfig(cfg))

        with dummy_registered():
            sanity = []
            real = DeepSpeedEngine._do_args_sanity_check
            DeepSpeedEngine._do_args_sanity_check = lambda engine, args: (sanity.append(1), real(engine, args))[1]
            try:
                with pytest.raises(ConfigError, match=r"deepspeed_fused\.dummy\.enabeld"):
                    build({"dummy": {"enabeld": True}})
                assert sanity == [] and DummyFeature.applies == 0  # nothing of the engine was built
                engine = build({"dummy": {"enabled": True}})
            finally:
                DeepSpeedEngine._do_args_sanity_check = real
            assert sanity == [1] and DummyFeature.applies == 1 and DummyFeature.built == [True]
            assert engine.deepspeed_fused_report["dummy"].applied
            assert "_deepspeed_fused_building" not in engine.__dict__

    def test_deepspeed_engine_classes_are_hooked(self):
        from deepspeed.runtime.engine import DeepSpeedEngine
        from deepspeed.runtime.hybrid_engine import DeepSpeedHybridEngine
        from deepspeed.runtime.pipe.engine import PipelineEngine

        for cls in (DeepSpeedEngine, DeepSpeedHybridEngine, PipelineEngine):
            assert getattr(cls.__dict__["__init__"], "_deepspeed_fused_hook", False), cls


_BOUND_EARLY = """
import os, sys
sys.path.insert(0, {tests!r})
from deepspeed import initialize            # bound before the plugin is imported
from deepspeed.runtime.engine import DeepSpeedEngine
import deepspeed_fused
import torch
from deepspeed_fused.config import ConfigError
from deepspeed_fused.features.registry import get_feature
from tiny_models import build_model

applies = []
feature_cls = type(get_feature("linear_cross_entropy"))
real_apply = feature_cls.apply
feature_cls.apply = lambda self, *a, **k: (applies.append(1), real_apply(self, *a, **k))[1]
sanity = []
real_sanity = DeepSpeedEngine._do_args_sanity_check
DeepSpeedEngine._do_args_sanity_check = lambda self, args: (sanity.append(1), real_sanity(self, args))[1]

def config(section):
    return {{"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10**6, "deepspeed_fused": section}}

model = build_model("llama-tiny").train()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
try:
    initialize(model=model, optimizer=opt, config=config({{"linear_cross_entropy": {{"enabeld": True}}}}))
except ConfigError as e:
    print("REJECTED", e)
print("SANITY_BEFORE", len(sanity))
engine, *_ = initialize(model=model, optimizer=opt, config=config({{"linear_cross_entropy": {{"enabled": True}}}}))
rep = engine.deepspeed_fused_report
ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
for _ in range(2):
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
print("APPLIES", len(applies), "SANITY", len(sanity))
print("APPLIED", rep["linear_cross_entropy"].applied, "CALLS", rep["linear_cross_entropy"].calls)
"""


def test_initialize_bound_before_the_import(tmp_path):
    """`from deepspeed import initialize` before `import deepspeed_fused`: the engine is still
    patched (once) and has its report, and an invalid section still fails before the engine is built."""
    from unit.common import _free_port, remove_shm_buffers

    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    script = tmp_path / "bound_early.py"
    script.write_text(_BOUND_EARLY.format(tests=os.path.join(root, "tests")))
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""), RANK="0",
               WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               OMP_NUM_THREADS="1")
    try:
        p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=500)
    finally:
        remove_shm_buffers(port)
    out = p.stdout
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-3000:]
    assert "REJECTED invalid deepspeed_fused config: deepspeed_fused.linear_cross_entropy.enabeld" in out, out
    assert "SANITY_BEFORE 0" in out  # DeepSpeedEngine.__init__ did not get to its own work
    assert "APPLIES 1 SANITY 1" in out, out  # applied once, for the one engine built
    assert "APPLIED True CALLS 2 fused, 0 reference, 0 eager" in out, out


# ---- live counts of the fused and eager calls ------------------------------------------

def test_report_counts_fused_and_eager_calls_live(interpret):
    model = build_model("llama-tiny").train()
    rep = patch_model(model, CFG)
    norms, lce = rep["rms_norm"], rep["linear_cross_entropy"]
    assert (norms.calls.fused, norms.calls.eager, lce.calls.fused, lce.calls.eager) == (0, 0, 0, 0)
    ids = _ids()
    model(input_ids=ids, labels=ids).loss.backward()
    model(input_ids=ids, labels=ids)
    with pytest.warns(RuntimeWarning, match="without labels"):
        model(input_ids=ids)  # training, no labels: the eager head
    model.eval()
    with torch.no_grad():
        model(input_ids=ids, labels=ids)  # eval: eager
    assert (lce.calls.fused, lce.calls.reference, lce.calls.eager) == (2, 0, 2)
    assert (norms.calls.fused, norms.calls.reference, norms.calls.eager) == (5 * 4, 0, 0)  # 5 norms per forward
    # the report reads them when it is printed (the same objects the engine holds)
    table = rep.table()
    assert table.splitlines()[0].split()[3:6] == ["fused", "reference", "eager"]
    assert next(r for r in table.splitlines() if r.startswith("linear_cross_entropy")).split()[3:6] == ["2", "0", "2"]
    assert next(r for r in table.splitlines() if r.startswith("rms_norm")).split()[3:6] == ["20", "0", "0"]
    d = rep.to_dict()
    assert d["features"][1]["calls"] == {"fused": 2, "reference": 0, "eager": 2}
    json.dumps(d)  # plain data
    # the same report object comes back while the options are unchanged, and keeps counting
    assert patch_model(model, CFG)["linear_cross_entropy"] is lce
    unpatch_model(model)


def test_counts_of_a_deep_copy_are_its_own(interpret):
    from deepspeed_fused.hook import _APPLIED_ATTR

    model = build_model("llama-tiny").train()
    rep = patch_model(model, CFG)
    clone = copy.deepcopy(model)
    clone_rep = {name: r for name, (_, r) in clone.__dict__[_APPLIED_ATTR].items()}
    ids = _ids()
    clone(input_ids=ids, labels=ids)
    assert (clone_rep["linear_cross_entropy"].calls.fused, clone_rep["rms_norm"].calls.fused) == (1, 5)
    assert (rep["linear_cross_entropy"].calls.fused, rep["rms_norm"].calls.fused) == (0, 0)
    model(input_ids=ids, labels=ids)
    assert rep["linear_cross_entropy"].calls.fused == 1 and clone_rep["linear_cross_entropy"].calls.fused == 1
    unpatch_model(model)
    unpatch_model(clone)


def test_rms_norm_counts_eager_fallbacks(interpret):
    model = build_model("llama-tiny")
    calls = patch_model(model, {"rms_norm": {"enabled": True}})["rms_norm"].calls
    norm = model.model.norm
    norm(torch.randn(2, 3, 64))
    norm(torch.randn(2, 3, 64, dtype=torch.float64))  # a dtype the kernel does not take: eager, with a warning
    assert (calls.fused, calls.eager) == (1, 1)
    unpatch_model(model)
    norm(torch.randn(2, 3, 64))
    assert (calls.fused, calls.eager) == (1, 1)  # reverted: no longer counted


def test_patch_model_without_engine(dummy):
    model = build_model("llama-tiny")
    rep = patch_model(model, {"deepspeed_fused": {"dummy": {"enabled": True}}})
    assert rep["dummy"].applied and rep["rms_norm"].status == "off"
    again = patch_model(model, {"dummy": {"enabled": True}})
    assert again["dummy"].applied and DummyFeature.applies == 1
    assert unpatch_model(model) == {"dummy": 15}
    assert unpatch_model(model) == {}


def test_patch_model_called_directly_warns(dummy):
    """Without an engine (no report shown), each enabled feature that is not applied warns once,
    pointing at the caller; with warn=False it is only in the returned report."""
    _STATE["supported"] = False
    with pytest.warns(RuntimeWarning, match="dummy support check failed") as warned:
        rep = patch_model(build_model("llama-tiny"), {"dummy": {"enabled": True}})
    mine = [w for w in warned if "dummy" in str(w.message)]
    assert len(mine) == 1 and mine[0].filename == __file__
    import warnings

    model = build_model("llama-tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        quiet = patch_model(model, {"dummy": {"enabled": True}}, warn=False)
    assert quiet["dummy"].reason == rep["dummy"].reason and not quiet["dummy"].applied
    assert "dummy" not in model.__dict__.get("_deepspeed_fused_applied", {})  # not recorded as applied
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


# ---- what is applied is read from the model, not from what was pickled or copied -----

CFG = {"rms_norm": {"enabled": True}, "linear_cross_entropy": {"enabled": True}}


def _ids():
    return torch.randint(0, 257, (2, 8), generator=torch.Generator().manual_seed(0))


def _fused_norms(model):
    from deepspeed_fused.features.rms_norm import is_replaced

    return sum(is_replaced(m) for m in model.modules())


def test_pickled_model_is_patched_afresh(interpret):
    model = build_model("llama-tiny").train()
    assert patch_model(model, CFG).applied == ["rms_norm", "linear_cross_entropy"]
    buf = io.BytesIO()
    torch.save(model, buf)
    unpatch_model(model)  # as in a fresh process: no class is patched for this model any more
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False).train()
    ids = _ids()
    assert loaded(input_ids=ids, labels=ids).logits is not None and _fused_norms(loaded) == 0  # eager
    rep = patch_model(loaded, CFG)
    assert rep.applied == ["rms_norm", "linear_cross_entropy"]
    assert rep["rms_norm"].where == "5 x LlamaRMSNorm" and rep["linear_cross_entropy"].where == "1 x LlamaForCausalLM"
    assert loaded(input_ids=ids, labels=ids).logits is None and _fused_norms(loaded) == 5  # really fused
    assert unpatch_model(loaded) == {"linear_cross_entropy": 1, "rms_norm": 5}


def test_deepcopy_stays_fused_when_the_original_is_unpatched(interpret):
    model = build_model("llama-tiny").train()
    patch_model(model, CFG)
    clone = copy.deepcopy(model)  # before any forward
    assert unpatch_model(model) == {"linear_cross_entropy": 1, "rms_norm": 5}
    ids = _ids()
    assert model(input_ids=ids, labels=ids).logits is not None
    assert clone(input_ids=ids, labels=ids).logits is None and _fused_norms(clone) == 5
    assert patch_model(clone, CFG).applied == ["rms_norm", "linear_cross_entropy"]
    assert unpatch_model(clone) == {"linear_cross_entropy": 1, "rms_norm": 5}
    assert clone(input_ids=ids, labels=ids).logits is not None


def test_report_does_not_claim_a_revoked_shallow_copy():
    model = build_model("llama-tiny").train()
    patch_model(model, {"linear_cross_entropy": {"enabled": True}})
    shallow = copy.copy(model)  # shares the original's per-instance state
    unpatch_model(model)
    ids = _ids()
    assert shallow(input_ids=ids, labels=ids).logits is not None
    assert unpatch_model(shallow) == {}  # nothing is running there, nothing to undo


# ---- re-patching applies the new options, or unpatches -------------------------------------------

def test_repatch_applies_new_options_or_unpatches():
    from deepspeed_fused.features import linear_cross_entropy as lce

    model = build_model("llama-tiny").train()
    patch_model(model, {"linear_cross_entropy": {"enabled": True}})
    assert lce.fused_state(model).z_loss == 0.0
    rep = patch_model(model, {"linear_cross_entropy": {"enabled": True, "z_loss": 0.5}})
    assert rep["linear_cross_entropy"].applied and lce.fused_state(model).z_loss == 0.5
    ids = _ids()
    ref = build_model("llama-tiny").train()
    patch_model(ref, {"linear_cross_entropy": {"enabled": True, "z_loss": 0.5}})
    torch.testing.assert_close(model(input_ids=ids, labels=ids).loss, ref(input_ids=ids, labels=ids).loss)
    rep = patch_model(model, {"linear_cross_entropy": {"enabled": False}})
    assert rep["linear_cross_entropy"].status == "off" and rep.applied == [] and not lce.is_patched(model)
    assert model(input_ids=ids, labels=ids).logits is not None
    unpatch_model(ref)


def test_repatch_rms_norm_off_and_on(interpret):
    model = build_model("llama-tiny")
    patch_model(model, {"rms_norm": {"enabled": True}})
    assert _fused_norms(model) == 5
    rep = patch_model(model, {"rms_norm": {"enabled": False}})
    assert rep["rms_norm"].status == "off" and _fused_norms(model) == 0
    assert patch_model(model, {"rms_norm": {"enabled": True}}).applied == ["rms_norm"] and _fused_norms(model) == 5
    assert unpatch_model(model) == {"rms_norm": 5}


# ---- the section is checked before the engine is built, however the config arrives ---------------

@pytest.fixture
def fake_engine_builder():
    """deepspeed.initialize replaced by a stand-in that records that DeepSpeed would build an engine."""
    from deepspeed_fused.hook import uninstall

    built = []

    def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None,
                   lr_scheduler=None, distributed_port=29500, mpu=None, dist_init_required=None, collate_fn=None,
                   config=None, mesh_param=None, config_params=None):
        built.append(True)
        return (None, None, None, None)

    uninstall()
    real = deepspeed.initialize
    deepspeed.initialize = initialize
    install()
    yield built
    uninstall()
    deepspeed.initialize = real
    install()


@pytest.mark.parametrize("bad", [{"rms_norm": {"enabeld": True}}, {"rms_norm": {"enabled": "yes"}},
                                 {"linear_cross_entropy": {"enabled": True, "z_loss": float("inf")}}])
@pytest.mark.parametrize("how", ["dict", "path", "base64", "config_params", "args", "positional_args"])
def test_bad_section_fails_before_the_engine_for_every_config_form(fake_engine_builder, tmp_path, bad, how):
    if how not in ("dict", "config_params") and "z_loss" in bad.get("linear_cross_entropy", {}):
        pytest.skip("a non-finite number cannot be written in a file DeepSpeed reads (hjson)")
    cfg = {"train_micro_batch_size_per_gpu": 1, "deepspeed_fused": bad}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(cfg))
    calls = {
        "dict": lambda: deepspeed.initialize(model=None, config=cfg),
        "path": lambda: deepspeed.initialize(model=None, config=str(path)),
        "base64": lambda: deepspeed.initialize(model=None, config=base64.urlsafe_b64encode(
            json.dumps(cfg).encode()).decode()),
        "config_params": lambda: deepspeed.initialize(model=None, config_params=cfg),
        "args": lambda: deepspeed.initialize(args=argparse.Namespace(deepspeed_config=str(path)), model=None),
        "positional_args": lambda: deepspeed.initialize(argparse.Namespace(deepspeed_config=str(path))),
    }
    with pytest.raises(ConfigError, match=r"deepspeed_fused\.(rms_norm|linear_cross_entropy)\."):
        calls[how]()
    assert fake_engine_builder == []
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"train_micro_batch_size_per_gpu": 1, "deepspeed_fused": {}}))
    deepspeed.initialize(args=argparse.Namespace(deepspeed_config=str(good)), model=None)
    assert fake_engine_builder == [True]


def test_late_triton_interpret_says_what_to_do(tmp_path):
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    script = tmp_path / "late.py"
    script.write_text("import os, torch\n"
                      "from deepspeed_fused.ops.rms_norm import fused_rms_norm\n"
                      "os.environ['TRITON_INTERPRET'] = '1'  # too late: the kernels are defined\n"
                      "y = fused_rms_norm(torch.randn(4, 64), torch.ones(64), 1e-6)\n"
                      "print('shape', tuple(y.shape))\n")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    p = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "shape (4, 64)" in p.stdout
    assert "TRITON_INTERPRET=1 was set after deepspeed_fused defined its Triton kernels" in p.stderr
    assert "before the program starts" in p.stderr


# ---- the report says when the torch reference runs in place of the kernels ----------------------

def test_report_says_when_the_torch_reference_runs():
    from deepspeed_fused.features.base import Environment

    cpu = dataclasses.replace(Environment.detect(), cuda_available=False, gpu_name=None, interpreter=False)
    model = build_model("llama-tiny")
    rep = patch_model(model, {"linear_cross_entropy": {"enabled": True}}, env=cpu)
    assert rep["linear_cross_entropy"].status == "applied (torch reference: no GPU)"
    assert "applied (torch reference: no GPU)" in rep.table()
    unpatch_model(model)
    interpreted = dataclasses.replace(cpu, interpreter=True)
    assert patch_model(model, {"linear_cross_entropy": {"enabled": True}}, env=interpreted)[
        "linear_cross_entropy"].status == "applied"
    unpatch_model(model)
