"""TRL's trainers (SFT, DPO, GRPO) under DeepSpeed ZeRO-2 with the linear_cross_entropy section:
TRL's fused LM head is served by the fused op (the report says so, with the live counts) and the
first step is the one without the section: fp32 loss within 1e-5 relative, every parameter's
update (plain SGD, lr 1: the gradient) within 1e-3 of its norm. TRL 0.29 (no fused head; its
SFTTrainer reads the training logits) trains through the eager head with one warning.
CPU, gloo, one rank, tiny models, kernels under Triton's interpreter."""
import os
import subprocess
import sys
import warnings

import pytest
import torch

pytest.importorskip("trl")

from deepspeed_fused.models import build_model  # noqa: E402
from deepspeed_fused.tiny_tokenizer import tiny_tokenizer  # noqa: E402
from unit.common import DistributedTest  # noqa: E402

SECTION = {"linear_cross_entropy": {"enabled": True}}
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-3


def ds_config(section=None):
    cfg = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**6}
    if section is not None:
        cfg["deepspeed_fused"] = section
    return cfg


def common_args(tmp_path, key, section):
    return dict(output_dir=str(tmp_path / key), deepspeed=ds_config(section), per_device_train_batch_size=2,
                max_steps=1, learning_rate=1.0, optim="sgd", max_grad_norm=0.0, use_cpu=True, report_to=[],
                save_strategy="no", logging_steps=1, seed=0, disable_tqdm=True, bf16=False)


def run_pair(make_trainer, tmp_path):
    """Train one step without and with the section; returns {key: (first log, updates, trainer)}."""
    out = {}
    for key, section in (("off", None), ("on", SECTION)):
        model = build_model("llama-tiny")
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        trainer = make_trainer(model, key, section)
        trainer.train()
        updates = {n: before[n] - p.detach() for n, p in trainer.model.named_parameters()}
        out[key] = (trainer.state.log_history[0], updates, trainer)
    return out


def check_pair(out, loss_key="loss", expect_fused=1):
    (log_off, up_off, _), (log_on, up_on, trainer) = out["off"], out["on"]
    a, b = log_off[loss_key], log_on[loss_key]
    assert abs(a - b) <= LOSS_RTOL * max(abs(a), 1e-6), (a, b)
    assert up_off.keys() == up_on.keys()
    moved = 0
    for n, g in up_off.items():
        h = up_on[n]
        assert (h - g).norm() <= GRAD_RTOL * g.norm() + 1e-12, (n, (h - g).norm().item(), g.norm().item())
        moved += int(g.norm() > 0)
    assert moved > 0
    rep = trainer.model_wrapped.deepspeed_fused_report
    f = next(f for f in rep.features if f.name == "linear_cross_entropy")
    assert f.applied and "TRL fused LM head served" in f.where, str(rep)
    assert f.calls.fused >= expect_fused and f.calls.eager == 0, str(rep)
    return f


class TestTrlTrainers(DistributedTest):
    world_size = 1
    init_distributed = False  # the Trainer sets up the process group

    def test_sft_first_step(self, tmp_path):
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        data = Dataset.from_dict({"text": [f"The quick brown fox {i} jumps over {i * 7}." for i in range(4)]})

        def make(model, key, section):
            return SFTTrainer(model=model, args=SFTConfig(max_length=32, **common_args(tmp_path, key, section)),
                              train_dataset=data, processing_class=tiny_tokenizer())

        out = run_pair(make, tmp_path)
        f = check_pair(out)
        assert f.calls.fused == 1
        for k in ("entropy", "mean_token_accuracy"):
            assert abs(out["off"][0][k] - out["on"][0][k]) <= 1e-5 * max(1.0, abs(out["off"][0][k])), k

    def test_sft_steps_take_the_gradient_formed_in_the_forward(self, tmp_path):
        """After its first backward (a uniform upstream gradient seen) the served head asks the op for
        the gradient formed in the forward; three steps stay those of TRL's own head."""
        from datasets import Dataset
        from trl import SFTConfig, SFTTrainer

        from deepspeed_fused.features.linear_cross_entropy import trl as trl_head

        data = Dataset.from_dict({"text": [f"The quick brown fox {i} jumps over {i * 7}." for i in range(6)]})
        runs = {}
        for key, section in (("off", None), ("on", SECTION)):
            model = build_model("llama-tiny")
            args = SFTConfig(max_length=32, **{**common_args(tmp_path, key, section), "max_steps": 3,
                                               "learning_rate": 0.1})
            trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tiny_tokenizer())
            trainer.train()
            runs[key] = ([r["loss"] for r in trainer.state.log_history if "loss" in r],
                         {n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer)
        (loss_off, p_off, _), (loss_on, p_on, trainer) = runs["off"], runs["on"]
        assert len(loss_off) == len(loss_on) == 3
        for a, b in zip(loss_off, loss_on):
            assert abs(a - b) <= 1e-4 * max(abs(a), 1e-6), (loss_off, loss_on)
        for n, p in p_off.items():
            assert (p_on[n] - p).norm() <= 1e-4 * p.norm() + 1e-12, n
        policy = trl_head.served(trainer.model).grad
        assert (policy.on, policy.formed, policy.recomputed) == (True, 2, 0), policy

    def test_dpo_first_step(self, tmp_path):
        import copy

        from datasets import Dataset
        from trl import DPOConfig, DPOTrainer

        data = Dataset.from_dict({"prompt": [f"Q{i}: 2+{i}=" for i in range(4)],
                                  "chosen": [f" {2 + i}." for i in range(4)],
                                  "rejected": [f" {3 * i + 1} maybe" for i in range(4)]})

        def make(model, key, section):
            args = DPOConfig(max_length=32, **common_args(tmp_path, key, section))
            return DPOTrainer(model=model, ref_model=copy.deepcopy(model), args=args, train_dataset=data,
                              processing_class=tiny_tokenizer())

        out = run_pair(make, tmp_path)
        check_pair(out)
        # the reference model's forwards are served too (its own engine, the same section)
        ref = out["on"][2].ref_model
        rep = ref.deepspeed_fused_report
        f = next(f for f in rep.features if f.name == "linear_cross_entropy")
        assert f.applied and "TRL fused LM head served" in f.where and f.calls.fused >= 1, str(rep)

    def test_grpo_first_step(self, tmp_path):
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        data = Dataset.from_dict({"prompt": [f"Count {i}:" for i in range(4)]})

        def reward(completions, **kw):
            return [sum(map(ord, c)) % 97 / 97.0 for c in completions]

        def make(model, key, section):
            args = GRPOConfig(num_generations=2, max_completion_length=6, **common_args(tmp_path, key, section))
            return GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                               processing_class=tiny_tokenizer())

        out = run_pair(make, tmp_path)
        f = check_pair(out)


def _trl029_path():
    """TRL 0.29.1 installed with pip --target into a temporary folder (no network: None)."""
    target = os.environ.get("DSF_TRL029_DIR") or os.path.join(os.environ.get("TMPDIR", "/tmp"), "dsf-trl029")
    if os.path.isfile(os.path.join(target, "trl", "__init__.py")):
        return target
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", target,
                        "trl==0.29.1"], capture_output=True, text=True, timeout=300)
    return target if r.returncode == 0 else None


_SFT029 = r'''
import json, os, sys, warnings
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                  MASTER_PORT=sys.argv[2])
import torch
import deepspeed_fused
import trl
from datasets import Dataset
from trl import SFTConfig, SFTTrainer
from deepspeed_fused.models import build_model
from deepspeed_fused.tiny_tokenizer import tiny_tokenizer
sys.path.insert(0, os.path.dirname(sys.argv[1]))
from test_trl_trainers import common_args
import pathlib
assert trl.__version__ == "0.29.1", trl.__version__
tmp = pathlib.Path(sys.argv[3])
data = Dataset.from_dict({"text": [f"The quick brown fox {i} jumps over {i * 7}." for i in range(4)]})
res = {}
for key, section in (("off", None), ("on", {"linear_cross_entropy": {"enabled": True}})):
    args = common_args(tmp, key, section)
    args["max_steps"] = 2
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        tr = SFTTrainer(model=build_model("llama-tiny"), args=SFTConfig(max_length=32, **args), train_dataset=data,
                        processing_class=tiny_tokenizer())
        tr.train()
    msgs = [str(x.message) for x in w if "deepspeed_fused.linear_cross_entropy" in str(x.message)]
    rep = tr.model_wrapped.deepspeed_fused_report
    f = next(f for f in rep.features if f.name == "linear_cross_entropy")
    res[key] = {"losses": [h["loss"] for h in tr.state.log_history if "loss" in h], "warnings": msgs,
                "calls": [f.calls.fused, f.calls.eager] if f.calls else None}
print("RESULT" + json.dumps(res), flush=True)
# the process group DeepSpeed opened is closed here, and the interpreter's teardown skipped: threads
# of the libraries above that are still running at exit can abort it after the results are printed
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
sys.stderr.flush()
os._exit(0)
'''


def test_trl029_sft_reads_logits_runs_eager(tmp_path):
    """TRL 0.29.1's SFTTrainer reads outputs.logits in its compute_loss: the eager head runs for it
    (one warning naming it) and the losses are those without the section."""
    import json

    target = _trl029_path()
    if target is None:
        pytest.skip("trl==0.29.1 could not be installed (no package index reachable)")
    script = tmp_path / "sft029.py"
    script.write_text(_SFT029)
    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.dirname(os.path.dirname(here))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([target, repo, os.path.dirname(here), here]),
           "TRITON_INTERPRET": "1"}
    from unit.common import _free_port

    port = str(_free_port())
    r = subprocess.run([sys.executable, str(script), os.path.abspath(__file__), port, str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    res = json.loads(r.stdout.split("RESULT", 1)[1].strip().splitlines()[0])
    off, on = res["off"], res["on"]
    assert len(off["losses"]) == len(on["losses"]) == 2
    for a, b in zip(off["losses"], on["losses"]):
        assert abs(a - b) <= LOSS_RTOL * abs(a), (off, on)
    assert on["calls"] == [0, 2], on
    assert len(on["warnings"]) == 1 and "SFTTrainer.compute_loss" in on["warnings"][0], on["warnings"]
    assert "logits" in on["warnings"][0]


def _ids(n, seq=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (seq,), generator=g) for _ in range(n)]


class TestTrlHeadOrder(DistributedTest):
    """TRL's head added before Accelerate's prepare (ZeRO-3: the partitioned head is gathered), or
    after deepspeed.initialize: served either way, the losses those of TRL's own head."""
    world_size = 1
    init_distributed = False

    def test_accelerate_zero3_head_added_first(self):
        from accelerate import Accelerator
        from accelerate.state import AcceleratorState
        from accelerate.utils import DeepSpeedPlugin
        from trl.trainer.utils import add_fused_lm_head

        losses = {}
        for key, section in (("off", None), ("on", SECTION)):
            cfg = ds_config(section)
            cfg["zero_optimization"]["stage"] = 3
            cfg.update(gradient_accumulation_steps=1, gradient_clipping=1.0, train_micro_batch_size_per_gpu=2,
                       train_batch_size=2)
            cfg["bf16"] = {"enabled": False}
            acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=cfg))
            model = build_model("llama-tied-tiny")
            add_fused_lm_head(model, outputs=("log_probs", "entropy"))
            opt = torch.optim.SGD(model.parameters(), lr=0.5)
            loader = torch.utils.data.DataLoader(_ids(6), batch_size=2)
            engine, opt, loader = acc.prepare(model, opt, loader)
            engine.train()
            losses[key] = []
            for ids in loader:
                out = engine(input_ids=ids, labels=ids, fused_lm_head=True)
                acc.backward(out.loss + 0.01 * out.entropy.sum())
                opt.step()
                opt.zero_grad()
                losses[key].append(out.loss.item())
            rep = engine.deepspeed_fused_report
            AcceleratorState._reset_state(True)
        f = rep["linear_cross_entropy"]
        assert f.applied and "TRL fused LM head served" in f.where and (f.calls.fused, f.calls.eager) == (3, 0), str(rep)
        for a, b in zip(losses["on"], losses["off"]):
            assert abs(a - b) <= LOSS_RTOL * abs(b), losses

    def test_head_added_after_initialize(self):
        import deepspeed
        from trl.trainer.utils import add_fused_lm_head

        import deepspeed_fused  # noqa: F401

        losses = {}
        for key, section in (("off", None), ("on", SECTION)):
            cfg = ds_config(section)
            cfg.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=1, gradient_clipping=0.0,
                       train_batch_size=2, bf16={"enabled": False})
            model = build_model("llama-tiny")
            engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.5),
                                              config=cfg)
            add_fused_lm_head(engine.module, temperature=0.8, outputs=("log_probs", "entropy", "is_top1"))
            losses[key] = []
            for ids in _ids(6, seed=3)[::2]:
                ids = ids[None].repeat(2, 1)
                out = engine(input_ids=ids, labels=ids, fused_lm_head=True)
                engine.backward(out.loss)
                engine.step()
                losses[key].append((out.loss.item(), out.is_top1.sum().item()))
        rep = engine.deepspeed_fused_report
        f = rep["linear_cross_entropy"]
        assert (f.calls.fused, f.calls.eager) == (3, 0) and f.details["trl_served"] == {"LlamaForCausalLM": 1}, str(rep)
        for (a, ta), (b, tb) in zip(losses["on"], losses["off"]):
            assert abs(a - b) <= LOSS_RTOL * abs(b) and ta == tb, losses


def _logits_metric_trainer():
    from transformers import Trainer

    class LogitsMetricTrainer(Trainer):
        """A client that reads the training logits (an accuracy metric from outputs.logits)."""

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                                 num_items_in_batch=num_items_in_batch)
            self.last_accuracy = (outputs.logits[:, :-1].argmax(-1) == inputs["labels"][:, 1:]).float().mean()
            return (loss, outputs) if return_outputs else loss

    return LogitsMetricTrainer


class TestTrainingLogitsClient(DistributedTest):
    """A Trainer whose compute_loss reads the outputs' logits in training: the eager head runs for
    it, one warning names it, the losses are those without the section."""
    world_size = 1
    init_distributed = False

    def test_compute_loss_reading_logits(self, tmp_path):
        from transformers import TrainingArguments

        cls = _logits_metric_trainer()
        data = [{"input_ids": ids, "labels": ids} for ids in _ids(6)]
        res = {}
        for key, section in (("off", None), ("on", SECTION)):
            args = TrainingArguments(**{**common_args(tmp_path, key, section), "max_steps": 3, "learning_rate": 0.1})
            trainer = cls(model=build_model("llama-tiny"), args=args, train_dataset=data)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                trainer.train()
            res[key] = ([h["loss"] for h in trainer.state.log_history if "loss" in h],
                        [str(w.message) for w in caught if "deepspeed_fused.linear_cross_entropy" in str(w.message)])
        f = trainer.model_wrapped.deepspeed_fused_report["linear_cross_entropy"]
        assert (f.calls.fused, f.calls.eager) == (0, 3), str(f)
        warned = res["on"][1]
        assert len(warned) == 1 and "LogitsMetricTrainer.compute_loss" in warned[0] and "logits" in warned[0], warned
        for a, b in zip(res["on"][0], res["off"][0]):
            assert abs(a - b) <= LOSS_RTOL * abs(b), res


def test_logits_client_reading():
    from deepspeed_fused.features.linear_cross_entropy.clients import _reads_logits
    from transformers import Trainer

    assert _reads_logits(_logits_metric_trainer().compute_loss.__code__)
    assert not _reads_logits(Trainer.compute_loss.__code__)

    def keyed(outputs):
        return outputs["logits"]

    assert _reads_logits(keyed.__code__)


def test_trl_sft_e2e_pair_runs_tiny(tmp_path):
    """The end-to-end pair's code path (two launcher jobs, tiny model, CPU): both arms train, the
    plugin's arm serves TRL's head, the losses agree, the files are written."""
    import argparse
    import json

    from deepspeed_fused.bench import trl_e2e

    doc = trl_e2e.main(argparse.Namespace(out=str(tmp_path), quick=False, extra=[
        "--tiny", "--steps", "2", "--warmup", "1", "--seq-len", "32", "--batch-size", "2", "--arms", "trl,lce"]))
    arms = doc["arms"]
    assert "error" not in arms["trl"] and "error" not in arms["lce"], arms
    assert arms["lce"]["calls"]["linear_cross_entropy"]["fused"] == 3, arms["lce"]
    assert "TRL fused LM head served" in arms["lce"]["report"]
    for a, b in zip(arms["lce"]["losses"], arms["trl"]["losses"]):
        assert abs(a - b) <= LOSS_RTOL * abs(b)
    assert json.load(open(tmp_path / "e2e_trl_sft.json"))["arms"].keys() == {"trl", "lce"}
    assert "| lce |" in (tmp_path / "e2e_trl_sft.md").read_text()
    try:
        import matplotlib  # noqa: F401  (optional: without it the page has no plot)
    except ImportError:
        assert not (tmp_path / "e2e_trl_sft.png").exists()
    else:
        assert (tmp_path / "e2e_trl_sft.png").stat().st_size > 0
    # --render writes the same page from the JSON alone
    again = tmp_path / "again"
    trl_e2e.main(argparse.Namespace(out=str(again), quick=False, extra=["--render", str(tmp_path / "e2e_trl_sft.json")]))
    assert (again / "e2e_trl_sft.md").read_text() == (tmp_path / "e2e_trl_sft.md").read_text()


def test_trl_sft_e2e_page_names_a_failed_arm_by_its_exception():
    """A failed arm's row carries its exit code and the last exception line of its stderr, not the
    traceback's last frame; a timeout says so."""
    import tempfile

    from deepspeed_fused.bench import trl_e2e

    tb = ("exit 1: Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n"
          "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB\n[rank0]: exiting\n")
    doc = {"suite": trl_e2e.RESULT, "date": "d", "gpu": "g", "torch": "t", "options": dict(
        batch_size=1, seq_len=8, steps=2, warmup=1), "arms": {
        "trl": {"arm": "trl", "error": tb}, "lce": {"arm": "lce", "error": "timeout: no result within 60 s"}}}
    with tempfile.TemporaryDirectory() as d:
        paths = trl_e2e.render(doc, d)
        md = open(paths["md"] if isinstance(paths, dict) else f"{d}/e2e_trl_sft.md").read()
    assert "| trl | failed: exit 1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB |" in md
    assert "| lce | failed: timeout: no result within 60 s |" in md
