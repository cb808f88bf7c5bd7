"""The report CLI and the example training job under the deepspeed launcher (CPU)."""
import json
import os
import re
import subprocess
import sys

import pytest
import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def _env():
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("TRITON_INTERPRET", None)  # the job as a user runs it: eager fallbacks on CPU
    return env


def _run(cmd, timeout=600):
    p = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout + p.stderr


def test_cli_report_environment():
    out = _run([sys.executable, "-m", "deepspeed_fused", "report"])
    for key in ("torch:", "triton:", "deepspeed:", "transformers:", "GPU:", "AutoEP:"):
        assert key in out


def test_cli_report_config_and_model():
    out = _run([sys.executable, "-m", "deepspeed_fused", "report", "--config", "configs/fused_all.json",
                "--model", "qwen3-moe-tiny"])
    assert "enabled features: rms_norm, linear_cross_entropy, moe_reorder" in out
    assert "model qwen3-moe-tiny (Qwen3MoeForCausalLM)" in out
    for name in ("rms_norm", "linear_cross_entropy", "moe_reorder"):
        line = next(line for line in out.splitlines() if line.startswith(name))
        assert "yes" in line  # enabled; applied or the reason it is not
    line = next(line for line in out.splitlines() if line.startswith("linear_cross_entropy"))
    if not torch.cuda.is_available():  # the loss is patched in, but the op runs its torch reference here
        assert "applied (torch reference: no GPU)" in line
    header = next(line for line in out.splitlines() if line.startswith("feature "))
    assert header.split() == ["feature", "enabled", "status", "fused", "reference", "eager", "where", "/", "why"]
    assert re.search(r" 0 +0 +0 +1 x Qwen3MoeForCausalLM", line), line  # not run: no calls
    assert "fused / reference / eager: the calls of each applied feature's patched code" in out


def _cli(args, cwd=ROOT, env=None):
    return subprocess.run([sys.executable, "-m", "deepspeed_fused", "report", *args], cwd=cwd, env=env or _env(),
                          capture_output=True, text=True, timeout=300)


def _one_line_error(p, *expect):
    """A bad input: exit status 2, one line on stderr naming it, no traceback anywhere."""
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("python -m deepspeed_fused report: "), lines
    assert "Traceback" not in p.stdout + p.stderr
    for e in expect:
        assert e in lines[0], (e, lines[0])
    return lines[0]


def test_cli_rejects_a_bare_section_with_an_unknown_key(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rms_norm": {"enabled": True}, "lce": {"enabled": True}}))
    _one_line_error(_cli(["--config", str(bad)]), str(bad), "deepspeed_fused.lce: unknown key")


@pytest.mark.parametrize("case", ["missing", "not_json", "auto", "bad_value", "unknown_model", "folder_without_config"])
def test_cli_bad_input_is_one_line_and_exit_status_2(tmp_path, case):
    bad = tmp_path / "ds_config.json"
    if case == "missing":
        args, expect = ["--config", str(tmp_path / "nope.json")], [str(tmp_path / "nope.json"), "no such file",
                                                                   "fused_all.json"]
    elif case == "not_json":
        bad.write_text('{"deepspeed_fused": {"rms_norm": {"enabled": true,}}}')
        args, expect = ["--config", str(bad)], [str(bad), "not JSON", "line 1"]
    elif case == "auto":
        bad.write_text(json.dumps({"deepspeed_fused": {"rms_norm": {"enabled": "auto"}}}))
        args, expect = ["--config", str(bad)], [str(bad), "deepspeed_fused.rms_norm.enabled", '"auto" resolution']
    elif case == "bad_value":
        bad.write_text(json.dumps({"deepspeed_fused": {"linear_cross_entropy": {"enabled": True, "z_loss": -1.0}}}))
        args, expect = ["--config", str(bad), "--model", "llama-tiny"], [str(bad),
                                                                         "deepspeed_fused.linear_cross_entropy.z_loss"]
    elif case == "unknown_model":
        args, expect = ["--model", "llama-huge"], ["--model llama-huge", "not a named model", "qwen3-moe-tiny"]
    else:
        args, expect = ["--model", str(tmp_path)], [f"--model {tmp_path}", "no config.json in this folder"]
    p = _cli(args)
    _one_line_error(p, *expect)
    assert "deepspeed_fused environment" not in p.stdout  # inputs are checked before anything is printed


def test_cli_model_from_a_hugging_face_config_outside_a_clone(tmp_path):
    """--model takes a local model folder or its config.json (built on the meta device, no download);
    --config configs/fused_all.json outside a clone is the shipped config; --model alone enables
    every feature."""
    from deepspeed_fused.models import model_config

    cfg = model_config("qwen3-moe-tiny", num_hidden_layers=3)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(tmp_path / "my-model")
    for model in (str(tmp_path / "my-model"), str(tmp_path / "my-model" / "config.json")):
        p = _cli(["--config", "configs/fused_all.json", "--model", model], cwd=tmp_path)
        assert p.returncode == 0, p.stderr[-3000:]
        out = p.stdout
        assert re.search(r"config configs/fused_all.json \(the shipped .*fused_all.json\): enabled features: "
                         r"rms_norm, linear_cross_entropy, moe_reorder", out), out
        assert f"model {model} (Qwen3MoeForCausalLM):" in out
        for name in ("rms_norm", "linear_cross_entropy", "moe_reorder", "rope"):
            line = next(line for line in out.splitlines() if line.startswith(name + " "))
            assert line.split()[1] == "yes", line
    p = _cli(["--model", str(tmp_path / "my-model")], cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "config: none given; every feature enabled" in p.stdout
    rows = [line for line in p.stdout.splitlines() if line.split()[:1] in (["rms_norm"], ["linear_cross_entropy"],
                                                                           ["moe_reorder"], ["rope"])]
    assert len(rows) == 4 and all(r.split()[1] == "yes" for r in rows), p.stdout


def test_model_from_a_config_is_built_on_the_meta_device(tmp_path):
    """A model far larger than this machine's memory is cheap: built from its config on meta."""
    import torch

    from deepspeed_fused.models import build_model_from_path, model_config

    cfg = model_config("qwen3-moe-30b-a3b-4l", num_hidden_layers=48)
    cfg.architectures = ["Qwen3MoeForCausalLM"]
    cfg.save_pretrained(tmp_path)
    model = build_model_from_path(str(tmp_path / "config.json"))
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and len(model.model.layers) == 48
    assert all(p.device == torch.device("meta") for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) > 2e10
    (tmp_path / "config.json").write_text('{"model_type": "no-such-model"}')
    with pytest.raises(ValueError, match=re.escape(str(tmp_path)) + ".*not a readable Hugging Face config"):
        build_model_from_path(str(tmp_path))


@pytest.mark.parametrize("argv0, prog", [("/usr/local/bin/deepspeed-fused", "deepspeed-fused"),
                                         ("/x/deepspeed_fused/__main__.py", "python -m deepspeed_fused")])
def test_cli_usage_names_how_it_was_called(monkeypatch, capsys, argv0, prog):
    from deepspeed_fused.__main__ import main

    monkeypatch.setattr(sys, "argv", [argv0, "--help"])
    with pytest.raises(SystemExit):
        main(["--help"])
    assert capsys.readouterr().out.startswith(f"usage: {prog} ")


def test_cli_rejects_bad_config(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"deepspeed_fused": {"rms_norm": {"enabeld": True}}}))
    _one_line_error(_cli(["--config", str(bad)]), str(bad), "deepspeed_fused.rms_norm.enabeld")


def test_example_job_runs_under_launcher(tmp_path):
    # `python -m deepspeed.launcher.runner` is what the `deepspeed` command runs.
    from unit.common import _free_port, remove_shm_buffers

    metrics = tmp_path / "metrics.json"
    profile = tmp_path / "profile.json"
    port = _free_port()
    try:
        out = _run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(port),
                    "examples/train.py", "--deepspeed_config", "configs/fused_all.json", "--model", "qwen3-moe-tiny",
                    "--steps", "3", "--seq-len", "32", "--no-progress", "--metrics-out", str(metrics),
                    "--profile-out", str(profile)])
    finally:
        remove_shm_buffers(port)
    assert "[train] step    2" in out
    assert out.count("deepspeed_fused report") == 1  # shown once, by the hook
    for name in ("rms_norm", "linear_cross_entropy", "moe_reorder", "rope"):  # each feature's status once
        assert len(re.findall(rf"^{name} +yes ", out, flags=re.M)) == 1, out[-3000:]
    assert "is enabled but not applied" not in out
    assert re.search(r"\] deepspeed_fused report \(torch ", out)  # on the log line itself, no empty first line
    if not torch.cuda.is_available():
        assert re.search(r"linear_cross_entropy +yes +applied \(torch reference: no GPU\)", out), out[-3000:]
    summary = json.loads(metrics.read_text())
    assert len(summary["history"]) == 3
    assert all(r["loss"] == r["loss"] and r["loss"] > 0 for r in summary["history"])  # finite, positive
    names = [f["name"] for f in summary["report"]["features"]]
    assert names[:3] == ["rms_norm", "linear_cross_entropy", "moe_reorder"]
    assert all(f["enabled"] for f in summary["report"]["features"][:3])
    # the counts at the end of the run: every training step ran the op, its kernels on a GPU, its
    # torch reference on CPU (this job runs without the interpreter); none the model's own head
    lce = summary["report"]["features"][1]
    ran, other = ("fused", "reference") if torch.cuda.is_available() else ("reference", "fused")
    assert lce["applied"] and lce["calls"][ran] >= 3 and lce["calls"][other] == 0 and lce["calls"]["eager"] == 0, lce
    c = lce["calls"]
    assert (f"[train] deepspeed_fused calls: linear_cross_entropy {c['fused']} fused, {c['reference']} reference, "
            "0 eager") in out
    assert "linear_cross_entropy: running the torch reference" not in out  # the report row said it
    gn = summary["report"]["features"][5]
    assert gn["name"] == "grad_norm" and gn["applied"] and gn["calls"][ran] >= 3 and gn["calls"]["eager"] == 0, gn
    if not torch.cuda.is_available():
        assert re.search(r"grad_norm +yes +applied \(torch reference: no GPU\)", out), out[-3000:]
        assert "grad_norm: running the torch reference" not in out
    # one more step profiled (on CPU the leaf CPU ops stand for kernels): every category of the
    # e2e breakdown is filled where this job has that work, and they add up to the total
    b = json.loads(profile.read_text())
    assert b == summary["breakdown"]
    assert sum(b["categories"].values()) == pytest.approx(b["total_gpu_ms"])
    for cat in ("rms_norm", "lm_head + loss", "optimizer step", "zero: step (grad norm, clip, copies)",
                "zero: gradients"):
        assert b["categories"][cat] > 0, (cat, b["categories"])
    # the attention ranges' work, split by kernel name into its GEMMs, the attention kernels and the rest
    from deepspeed_fused.bench import breakdown

    attention_parts = (breakdown.GEMMS, breakdown.ATTN_CORE, breakdown.ATTN_REST)
    assert sum(b["categories"].get(c, 0.0) for c in attention_parts) > 0, b["categories"]


@pytest.mark.parametrize("config", ["autoep_fused.json", "autoep_baseline.json"])
def test_example_job_with_autoep_under_launcher(tmp_path, config):
    """The README job with the AutoEP configs on CPU (bf16 turned off by the job): DeepSpeed's AutoEP
    builds its layers with the transformers installed here (the plugin's compatibility fix applied
    by the hook where this transformers needs it, and named in the report), and trains."""
    from deepspeed_fused import compat
    from unit.common import _free_port, remove_shm_buffers

    needs_fix = compat.output_capture_needs_fix()
    metrics = tmp_path / "metrics.json"
    port = _free_port()
    try:
        out = _run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(port),
                    "examples/train.py", "--deepspeed_config", f"configs/{config}", "--model", "qwen3-moe-tiny",
                    "--steps", "2", "--seq-len", "16", "--metrics-out", str(metrics)])
    finally:
        remove_shm_buffers(port)
    assert "[train] step    1" in out and "TypeError" not in out
    assert "it/s" not in out  # stderr is not a terminal: no progress bar between the step lines
    summary = json.loads(metrics.read_text())
    assert len(summary["history"]) == 2 and all(r["loss"] > 0 for r in summary["history"])
    report = summary["report"]
    assert (len(report["notes"]) == 1 and "AutoEP compatibility" in report["notes"][0]) if needs_fix \
        else report["notes"] == []
    assert out.count("deepspeed_fused report") == (1 if needs_fix or "fused" in config else 0)
    if needs_fix:
        assert out.count("AutoEP compatibility: transformers") == 1
    fused = "fused" in config
    every = ("rms_norm", "linear_cross_entropy", "moe_reorder", "rope", "mlp_act", "grad_norm")
    for f in report["features"]:
        assert f["enabled"] == (fused and f["name"] in every)
    if fused:  # each feature's status once: its row of the report (no warning besides it)
        for name in every:
            assert len(re.findall(rf"^{name} +yes ", out, flags=re.M)) == 1, out[-3000:]
        assert "is enabled but not applied" not in out


def test_example_job_search_mode_records_each_size(tmp_path):
    """--batch-sizes: the sizes in ascending order in one process, one record each (the job run as
    the module ``deepspeed --module deepspeed_fused.train`` runs; examples/train.py wraps it)."""
    from unit.common import _free_port, remove_shm_buffers

    metrics = tmp_path / "metrics.json"
    port = _free_port()
    try:
        out = _run([sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(port),
                    "--module", "deepspeed_fused.train", "--deepspeed_config", "configs/baseline.json", "--model",
                    "qwen3-moe-tiny", "--steps", "2", "--warmup", "1", "--seq-len", "16", "--batch-sizes", "1,3",
                    "--no-progress",
                    "--metrics-out", str(metrics)])
    finally:
        remove_shm_buffers(port)
    assert "micro-batch 3:" in out
    trials = json.loads(metrics.read_text())["trials"]
    assert [t["batch"] for t in trials] == [1, 3] and all(t["status"] == "ok" for t in trials)
    assert all(len(t["history"]) == 2 and t["median_tokens_per_s"] > 0 for t in trials)


def test_example_job_finds_the_shipped_configs(tmp_path, monkeypatch):
    """``--deepspeed_config configs/NAME.json`` outside a clone runs the config shipped in the
    package (deepspeed_fused/configs, in a clone a link to configs/); a file that exists wins."""
    from deepspeed_fused.train import CONFIGS_DIR, find_config

    monkeypatch.chdir(tmp_path)
    shipped = os.path.join(CONFIGS_DIR, "fused_all.json")
    with open(shipped) as f, open(os.path.join(ROOT, "configs", "fused_all.json")) as g:
        assert json.load(f) == json.load(g)
    for name in ("configs/fused_all.json", "fused_all.json", "fused_all"):
        assert find_config(name) == shipped
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "fused_all.json").write_text("{}")
    assert find_config("configs/fused_all.json") == "configs/fused_all.json"
    with pytest.raises(SystemExit, match="no such file, nor a shipped config of that name .*zero3_fused.json"):
        find_config("nope.json")
