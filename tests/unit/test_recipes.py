"""The recipes in examples/ run as a user runs them (the deepspeed launcher, or accelerate launch),
on CPU with a tiny model: each finishes and prints the feature counts, with the fused (or, for
TRL's head, served) linear cross-entropy calls > 0 and no eager ones. Kernels run under Triton's
interpreter here (TRITON_INTERPRET=1), so a "fused" count means the kernels ran."""
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _env(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["TRITON_INTERPRET"] = "1"
    env.pop("ACCELERATE_USE_DEEPSPEED", None)
    env["HF_HOME"] = str(tmp_path / "hf")
    return env


def _run(cmd, tmp_path, timeout=600):
    p = subprocess.run(cmd, cwd=str(tmp_path), env=_env(tmp_path), capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{out[-5000:]}"
    return out


def _counts(out):
    """{feature: (fused, reference, eager)} from the recipe's closing lines."""
    return {m.group(1): (int(m.group(2)), int(m.group(3)), int(m.group(4)))
            for m in re.finditer(r"^deepspeed_fused calls: (\w+) (\d+) fused, (\d+) reference, (\d+) eager$",
                                 out, re.M)}


def _launcher(script, tmp_path, *args):
    from unit.common import _free_port, remove_shm_buffers

    port = _free_port()
    try:
        return _run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(port),
                     os.path.join(ROOT, "examples", script), *args], tmp_path)
    finally:
        remove_shm_buffers(port)


@pytest.mark.parametrize("script, served, args", [("trl_sft.py", True, ()), ("trl_grpo.py", True, ()),
                                                   ("hf_trainer.py", False, ()),
                                                   ("hf_trainer.py", False, ("--gradient-checkpointing",))])
def test_recipe_under_deepspeed_launcher(script, served, args, tmp_path):
    if script.startswith("trl"):
        pytest.importorskip("trl")
    out = _launcher(script, tmp_path, "--steps", "2", *args)
    counts = _counts(out)
    fused, reference, eager = counts["linear_cross_entropy"]
    assert fused >= 2 and reference == 0 and eager == 0, counts
    # the dense model's other features: kernels in every call (grad_norm: one norm per parameter
    # group and step, the overflow check only in fp16/bf16)
    for name in ("rms_norm", "rope", "mlp_act", "grad_norm"):
        assert counts[name][0] > 0 and counts[name][1:] == (0, 0), (name, counts)
    assert ("TRL fused LM head served" in out) == served
    if script == "hf_trainer.py":  # one forward a step, each layer's again in the backward when checkpointed
        from deepspeed_fused.models import model_config

        layers = model_config("qwen3-tiny").num_hidden_layers
        per_step = layers * (2 if args else 1)
        assert counts["mlp_act"][0] == counts["rope"][0] == 2 * per_step, counts


def test_accelerate_recipe(tmp_path):
    accelerate = shutil.which("accelerate", path=os.path.dirname(sys.executable)) or shutil.which("accelerate")
    if accelerate is None:
        pytest.skip("the accelerate command is not installed")
    from unit.common import _free_port

    out = _run([accelerate, "launch", "--num_processes", "1", "--main_process_port", str(_free_port()),
                "--use_deepspeed", "--deepspeed_config_file",
                os.path.join(ROOT, "examples", "configs", "accelerate_zero2_fused.json"),
                os.path.join(ROOT, "examples", "accelerate_train.py"), "--steps", "2", "--seq-len", "16"], tmp_path)
    counts = _counts(out)
    assert counts["linear_cross_entropy"] == (2, 0, 0), counts
    assert counts["rms_norm"][0] > 0, counts
