"""HF Trainer and Accelerate call ``deepspeed.initialize`` themselves: with the section in their
DeepSpeed config (HF style, ``"auto"`` values), the features apply, the report is shown once on
rank 0, and the losses match a run without the section (CPU, gloo, one rank, a few steps)."""
import logging

import pytest
import torch

from deepspeed_fused.features import linear_cross_entropy as lce
from deepspeed_fused.hook import report_logger
from deepspeed_fused.train import trainer_grad_ckpt_args
from tiny_models import build_model
from unit.common import DistributedTest

SECTION = {"rms_norm": {"enabled": True}, "linear_cross_entropy": {"enabled": True},
           "moe_reorder": {"enabled": True}}
STEPS = 3
RTOL = 1e-6  # fp32 on CPU; measured differences are about 2e-7


def hf_ds_config(stage, section=None):
    cfg = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": stage},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**6}
    if section is not None:
        cfg["deepspeed_fused"] = section
    return cfg


def _batches(n, seq=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (seq,), generator=g) for _ in range(n)]


class _Shown:
    """Records what the plugin's logger shows."""

    def __init__(self):
        self.records = []
        self.handler = logging.Handler()
        self.handler.emit = self.records.append

    def __enter__(self):
        report_logger().addHandler(self.handler)
        return self

    def __exit__(self, *exc):
        report_logger().removeHandler(self.handler)

    def reports(self):
        return [r.getMessage() for r in self.records if "deepspeed_fused report" in r.getMessage()]


def _check(engine, shown, losses, ref, expect_applied):
    from deepspeed_fused.features.moe_reorder import _CALLS_ATTR
    from deepspeed_fused.features.rms_norm import is_replaced

    rep = engine.deepspeed_fused_report
    assert [f.name for f in rep.features if f.applied] == expect_applied, str(rep)
    assert len(shown.reports()) == 1 and "linear_cross_entropy" in shown.reports()[0]
    assert lce.fused_state(engine.module).fused_calls == STEPS
    # the report's live counts: every training forward ran the fused paths, none the eager ones
    calls = {f.name: (f.calls.fused, f.calls.eager) for f in rep.features if f.applied}
    assert all(f.calls.reference == 0 for f in rep.features if f.applied), str(rep)  # the kernels ran
    norms = sum(is_replaced(m) for m in engine.module.modules())
    assert calls["linear_cross_entropy"] == (STEPS, 0) and calls["rms_norm"] == (norms * STEPS, 0), calls
    if "moe_reorder" in calls:
        experts = sum(_CALLS_ATTR in m.__dict__ for m in engine.module.modules())
        assert experts and calls["moe_reorder"] == (experts * STEPS, 0), calls
    row = next(r for r in str(rep).splitlines() if r.startswith("linear_cross_entropy"))
    assert row.split()[3:6] == [str(STEPS), "0", "0"], row  # fused, reference, eager
    assert len(losses) == len(ref) == STEPS
    for a, b in zip(losses, ref):
        assert abs(a - b) <= RTOL * abs(b), (losses, ref)


class TestTrainer(DistributedTest):
    world_size = 1
    init_distributed = False  # the Trainer sets up the process group, as in a user's script

    def test_trainer_applies_and_matches(self, tmp_path):
        from transformers import Trainer, TrainingArguments

        data = [{"input_ids": ids, "labels": ids} for ids in _batches(2 * STEPS)]
        losses = {}
        for key, section in (("off", None), ("on", SECTION)):
            args = TrainingArguments(output_dir=str(tmp_path / key), deepspeed=hf_ds_config(2, section),
                                     per_device_train_batch_size=2, max_steps=STEPS, logging_steps=1, report_to=[],
                                     save_strategy="no", learning_rate=1e-3, use_cpu=True, disable_tqdm=True, seed=0)
            trainer = Trainer(model=build_model("llama-tiny"), args=args, train_dataset=data)
            with _Shown() as shown:
                trainer.train()
            losses[key] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
            if section is None:
                assert shown.reports() == []  # no section: nothing shown, nothing patched
                assert trainer.model_wrapped.deepspeed_fused_report.applied == []
        # the on-run's engine (the section survived the Trainer's "auto" resolution)
        _check(trainer.model_wrapped, shown, losses["on"], losses["off"], ["rms_norm", "linear_cross_entropy"])


def _shifted_ce(outputs, labels, num_items_in_batch=None):
    """A user's compute_loss_func: cross-entropy from the logits."""
    logits = outputs["logits"][..., :-1, :].float()
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[..., 1:].reshape(-1))


class TestTrainerLabelsTakenOut(DistributedTest):
    """The Trainer's label smoothing and compute_loss_func take the labels out before the forward:
    the fused loss cannot run there, and one warning says why and what to do."""
    world_size = 1
    init_distributed = False

    def _train(self, tmp_path, key, section, **kw):
        import warnings

        from transformers import Trainer, TrainingArguments

        data = [{"input_ids": ids, "labels": ids} for ids in _batches(2 * STEPS)]
        loss_func = kw.pop("compute_loss_func", None)
        args = TrainingArguments(output_dir=str(tmp_path / key), deepspeed=hf_ds_config(2, section),
                                 per_device_train_batch_size=2, max_steps=STEPS, logging_steps=1, report_to=[],
                                 save_strategy="no", learning_rate=1e-3, use_cpu=True, disable_tqdm=True, seed=0, **kw)
        trainer = Trainer(model=build_model("llama-tiny"), args=args, train_dataset=data,
                          compute_loss_func=loss_func)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.train()
        ours = [str(w.message) for w in caught if "deepspeed_fused.linear_cross_entropy" in str(w.message)]
        losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
        return trainer.model_wrapped.deepspeed_fused_report["linear_cross_entropy"], ours, losses

    def test_label_smoothing_factor_warns_and_the_section_option_fuses(self, tmp_path):
        lce_on = {"linear_cross_entropy": {"enabled": True}}
        rep, warned, _ = self._train(tmp_path, "hf", lce_on, label_smoothing_factor=0.1)
        assert rep.applied and (rep.calls.fused, rep.calls.eager) == (0, STEPS)  # applied, never fused
        assert len(warned) == 1, warned
        assert "label_smoothing_factor=0.1" in warned[0] and '"label_smoothing": 0.1' in warned[0]
        assert "materialized (2x16x257 float32" in warned[0]
        # the remedy: the section's own option, the Trainer's off; the same loss as the Trainer's smoothing
        _, _, ref = self._train(tmp_path, "ref", None, label_smoothing_factor=0.1)
        section = {"linear_cross_entropy": {"enabled": True, "label_smoothing": 0.1}}
        rep, warned, losses = self._train(tmp_path, "fused", section)
        assert warned == [] and (rep.calls.fused, rep.calls.eager) == (STEPS, 0)
        assert len(losses) == len(ref) == STEPS
        for a, b in zip(losses, ref):
            assert abs(a - b) <= 1e-5 * abs(b), (losses, ref)

    def test_compute_loss_func_warns_with_its_cost(self, tmp_path):
        rep, warned, losses = self._train(tmp_path, "clf", {"linear_cross_entropy": {"enabled": True}},
                                          compute_loss_func=_shifted_ce)
        assert rep.applied and (rep.calls.fused, rep.calls.eager) == (0, STEPS) and len(losses) == STEPS
        assert len(warned) == 1, warned
        assert "compute_loss_func (_shifted_ce)" in warned[0] and "0.0314 MiB per forward" in warned[0]
        assert "label_smoothing_factor" not in warned[0]


class TestAccelerate(DistributedTest):
    world_size = 1
    init_distributed = False

    def test_accelerate_applies_and_matches(self):
        pytest.importorskip("accelerate")
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import DeepSpeedPlugin

        losses = {}
        for key, section in (("off", None), ("on", SECTION)):
            cfg = hf_ds_config(3, section)
            cfg["gradient_accumulation_steps"], cfg["gradient_clipping"] = 1, 1.0
            acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
            model = build_model("qwen3-moe-tiny")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            loader = torch.utils.data.DataLoader(_batches(2 * STEPS), batch_size=2)
            with _Shown() as shown:
                engine, opt, loader = acc.prepare(model, opt, loader)
            engine.train()
            losses[key] = []
            for ids in loader:
                out = engine(input_ids=ids, labels=ids)
                acc.backward(out.loss)
                opt.step()
                opt.zero_grad()
                losses[key].append(out.loss.item())
            AcceleratorState._reset_state(True)
        _check(engine, shown, losses["on"], losses["off"], ["rms_norm", "linear_cross_entropy", "moe_reorder"])


class TestTrainerGradNorm(DistributedTest):
    """The HF Trainer logs DeepSpeed's global gradient norm and clips with it (``max_grad_norm`` into
    ``gradient_clipping: "auto"``): with ``grad_norm`` on, the logged norms and the losses are the
    same as without it, and the report counts every step's norm (one per parameter group)."""
    world_size = 1
    init_distributed = False

    def test_logged_norms_and_losses_equal(self, tmp_path):
        from transformers import Trainer, TrainingArguments

        data = [{"input_ids": ids, "labels": ids} for ids in _batches(2 * STEPS)]
        logs = {}
        for key, section in (("off", None), ("on", {"grad_norm": {"enabled": True}})):
            args = TrainingArguments(output_dir=str(tmp_path / key), deepspeed=hf_ds_config(2, section),
                                     per_device_train_batch_size=2, max_steps=STEPS, logging_steps=1, report_to=[],
                                     save_strategy="no", learning_rate=1e-3, use_cpu=True, disable_tqdm=True, seed=0,
                                     max_grad_norm=0.05)
            trainer = Trainer(model=build_model("llama-tiny"), args=args, train_dataset=data)
            trainer.train()
            logs[key] = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
        rep = trainer.model_wrapped.deepspeed_fused_report["grad_norm"]
        groups = len(trainer.model_wrapped.optimizer.bit16_groups)  # the Trainer's decay / no-decay groups
        assert groups == 2
        assert rep.applied and rep.calls.fused == STEPS * groups and rep.calls.reference == 0, (rep.reason, rep.calls)
        assert len(logs["on"]) == STEPS and logs["on"] == logs["off"], logs
        assert all(n > 0.05 for _, n in logs["on"])  # clipped at every step: the norm scaled the update


DENSE_SECTION = {"rms_norm": {"enabled": True}, "linear_cross_entropy": {"enabled": True}, "rope": {"enabled": True},
                 "mlp_act": {"enabled": True}, "grad_norm": {"enabled": True}}


class TestTrainerGradientCheckpointing(DistributedTest):
    """A dense model trained as users train one: the HF Trainer with ``gradient_checkpointing``
    (non-reentrant and reentrant), ZeRO-2, clipping on, every dense feature in the section. Each
    feature's kernels run in every forward, the recomputed ones included, none falls back, and the
    logged losses and gradient norms are those of the same run without the section."""
    world_size = 1
    init_distributed = False

    @pytest.mark.parametrize("reentrant", [False, True])
    def test_losses_and_norms_match_with_every_dense_feature(self, tmp_path, reentrant):
        from transformers import Trainer, TrainingArguments

        data = [{"input_ids": ids, "labels": ids} for ids in _batches(2 * STEPS)]
        logs, calls = {}, {}
        ckpt = trainer_grad_ckpt_args("reentrant" if reentrant else "non-reentrant")
        flag = next(k for k in ckpt if not k.endswith("_kwargs"))  # the Trainer's name for it
        for key, section in (("off", None), ("on", DENSE_SECTION)):
            args = TrainingArguments(output_dir=str(tmp_path / key), deepspeed=hf_ds_config(2, section),
                                     per_device_train_batch_size=2, max_steps=STEPS, logging_steps=1, report_to=[],
                                     save_strategy="no", learning_rate=1e-3, use_cpu=True, disable_tqdm=True, seed=0,
                                     max_grad_norm=0.05, **ckpt)
            model = build_model("llama-tiny")
            trainer = Trainer(model=model, args=args, train_dataset=data)
            trainer.train()
            assert getattr(model, f"is_{flag}")
            logs[key] = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
            rep = trainer.model_wrapped.deepspeed_fused_report
            calls[key] = {f.name: (f.calls.fused, f.calls.reference, f.calls.eager) for f in rep.features
                          if f.applied}
        assert set(calls["on"]) == set(DENSE_SECTION), calls
        for name, (fused, reference, eager) in calls["on"].items():
            assert fused > 0 and reference == 0 and eager == 0, (name, calls)
        # checkpointing runs each layer's forward again in the backward: the norms, rope and the
        # activation count both passes; the head (outside the layers) and the norm once a step
        layers = build_model("llama-tiny").config.num_hidden_layers
        assert calls["on"]["mlp_act"][0] == 2 * layers * STEPS, calls
        assert calls["on"]["rope"][0] == 2 * layers * STEPS, calls
        assert calls["on"]["linear_cross_entropy"][0] == STEPS, calls
        assert len(logs["on"]) == len(logs["off"]) == STEPS
        for (la, na), (lb, nb) in zip(logs["on"], logs["off"]):
            assert abs(la - lb) <= RTOL * abs(lb) and abs(na - nb) <= 1e-5 * abs(nb), logs
        assert all(n > 0.05 for _, n in logs["on"])  # clipped at every step
