"""The e2e suite's dense pairs on CPU (no GPU): options, what each arm launches (model, gradient
checkpointing, Liger's defaults, the config with mlp_act), the report's line of the pairs' models,
train.py's gradient checkpointing, and the breakdown's dense categories (GEMMs, attention, rope and
elementwise, MLP activation, residual adds) on synthetic traces and a real CPU trace."""
from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
from unit.test_e2e_breakdown import BWD, Trace, _sums_to_total

from deepspeed_fused.bench import breakdown as bd
from deepspeed_fused.bench import e2e, e2e_report


def _opts(*extra):
    return e2e.parse_options(argparse.Namespace(extra=list(extra), quick=False))


def test_dense_options():
    o = _opts("--pairs", "dense", "--search", "dense_qwen3_1_7b")
    assert o.pair_list == ["dense_llama3_3b", "dense_qwen3_1_7b", "dense_qwen3_4b", "dense_gemma3_1b"]
    assert o.search_list == ["dense_qwen3_1_7b"]
    assert _opts("--pairs", "dense_llama3_3b_reentrant,zero2").pair_list == ["dense_llama3_3b_reentrant", "zero2"]
    with pytest.raises(SystemExit, match="dense-model"):
        _opts("--pairs", "dense", "--dense-model", "no-such-model")
    for pair, (model, args) in e2e.DENSE_PAIRS.items():
        assert model in __import__("deepspeed_fused.models", fromlist=["MODELS"]).MODELS
        assert args[:1] == ["--grad-ckpt"] and args[1] == ("reentrant" if pair.endswith("_reentrant") else "non-reentrant")


def test_dense_fused_config_turns_every_feature_on():
    from deepspeed_fused.config import parse_config
    from deepspeed_fused.features import all_features

    def load(name):
        with open(e2e.config_file(name)) as f:
            return json.load(f)

    for pair in e2e.DENSE_PAIRS:
        base, fused, gpus = e2e.PAIRS[pair]
        assert gpus == (2 if pair == "dense_qwen3_4b" else 1)  # Qwen3-4B's fp32 training state needs two
        if pair in e2e.DENSE_CONFIGS:
            # the zero2 pair's configs with bf16 master weights, gradients and optimizer states
            for mine, theirs in zip((base, fused), e2e.PAIRS["zero2"][:2]):
                a, b = load(mine), load(theirs)
                assert a.pop("bf16") == dict(enabled=True, bf16_master_weights_and_grads=True,
                                             bf16_optimizer_states=True)
                b.pop("bf16")
                assert a == b
        else:
            assert (base, fused) == e2e.PAIRS["zero2"][:2]  # ZeRO-2, as the MoE pair
        parsed = parse_config(load(fused))
        assert parsed.mlp_act.enabled and all(getattr(parsed, f.name).enabled for f in all_features())
        assert not any(getattr(parse_config(load(base)), f.name).enabled for f in all_features())


def _flags(train_args):
    return {k: train_args[i + 1] for i, k in enumerate(train_args[:-1]) if k.startswith("--")}


def _job_metrics(train_args, step_s, tokens_per_s, breakdown=None):
    """What the example job writes to its --metrics-out: every step ``step_s`` long, loss 10."""
    a = _flags(train_args)
    hist = [dict(step=i, loss=10.0, step_s=step_s, tokens_per_s=tokens_per_s) for i in range(int(a["--steps"]))]
    rec = dict(median_step_s=step_s, median_tokens_per_s=tokens_per_s, peak_alloc_mib=1.0, peak_reserved_mib=1.0,
               history=hist, model=a["--model"])
    if breakdown is not None:
        rec["breakdown"] = breakdown
    with open(a["--metrics-out"], "w") as f:
        json.dump(rec, f)


def test_run_arm_launches_each_dense_arm(tmp_path, monkeypatch):
    seen = []

    def launch(train_args, num_gpus, timeout, tmp, env_extra=None):
        seen.append(list(train_args))
        _job_metrics(train_args, 1.0, 100.0)
        return dict(rc=0, stdout="", stderr="", wall_s=1.0)

    monkeypatch.setattr(e2e, "launch", launch)
    o = _opts("--pairs", "dense_gemma3_1b", "--steps", "2", "--warmup", "1")
    for arm in ("baseline", "liger", "fused"):
        assert "error" not in e2e.run_arm("dense_gemma3_1b", arm, o, str(tmp_path))
    base, liger, fused = seen
    for args in seen:
        assert args[args.index("--model") + 1] == "gemma3-1b"
        assert args[args.index("--grad-ckpt") + 1] == "non-reentrant"
    assert os.path.basename(base[base.index("--deepspeed_config") + 1]) == "baseline.json"
    assert os.path.basename(fused[fused.index("--deepspeed_config") + 1]) == "fused_all.json"
    assert "--liger" in liger and "--liger-defaults" in liger and "--liger-defaults" not in base
    # a pair with configs of its own launches them, the same model and checkpointing
    seen.clear()
    o = _opts("--pairs", "dense_qwen3_4b_bf16_states", "--steps", "2", "--warmup", "1")
    for arm in ("baseline", "liger", "fused"):
        assert "error" not in e2e.run_arm("dense_qwen3_4b_bf16_states", arm, o, str(tmp_path))
    names = [os.path.basename(a[a.index("--deepspeed_config") + 1]) for a in seen]
    assert names == ["bf16_states_baseline.json", "bf16_states_baseline.json", "bf16_states_fused.json"]
    assert all(a[a.index("--model") + 1] == "qwen3-4b" for a in seen)
    # a stand-in model for every dense pair; the MoE pairs keep the suite's model
    o = _opts("--pairs", "dense_qwen3_4b", "--dense-model", "llama-tiny")
    assert e2e.pair_setup("dense_qwen3_4b", o, []) == ("llama-tiny", ["--grad-ckpt", "non-reentrant"])
    assert e2e.pair_setup("zero2", o, ["--liger"]) == (o.model, ["--liger"])


def test_report_names_each_dense_pairs_model(tmp_path):
    meta = dict(date="2026-12-05", gpu="cpu", torch=torch.__version__, triton="-", model="qwen3-moe-30b-a3b-4l",
                batch=2, seq=4096, steps=2, warmup=1,
                pair_models={"dense_qwen3_1_7b": dict(model="qwen3-1.7b", args="--grad-ckpt non-reentrant")})
    md = e2e_report.markdown({}, {}, meta)
    assert "`dense_qwen3_1_7b`: `qwen3-1.7b`, --grad-ckpt non-reentrant" in md
    # a pair with configs of its own names them
    four = dict(model="qwen3-4b", args="--grad-ckpt non-reentrant", configs="a.json / b.json")
    md = e2e_report.markdown({}, {}, dict(meta, pair_models={"dense_qwen3_4b_bf16_states": four}))
    assert "`dense_qwen3_4b_bf16_states`: `qwen3-4b`, --grad-ckpt non-reentrant, configs a.json / b.json" in md
    a = dict(meta=meta, results={}, search={})
    b = dict(meta=dict(meta, pair_models={"dense_gemma3_1b": dict(model="gemma3-1b", args="x")}), results={},
             search={})
    _, _, merged = e2e_report.merge([a, b])
    assert set(merged["pair_models"]) == {"dense_qwen3_1_7b", "dense_gemma3_1b"}


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_train_grad_ckpt_recomputes_and_keeps_the_gradients(mode):
    from deepspeed_fused import train
    from deepspeed_fused.models import build_model

    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(0))
    grads = []
    for m in ("off", mode):
        model = build_model("llama-tiny", seed=0)
        model.train()
        train.enable_grad_ckpt(model, m)
        assert model.is_gradient_checkpointing == (m != "off")
        calls = []
        h = model.model.layers[0].mlp.gate_proj.register_forward_hook(lambda *a: calls.append(1))
        model(input_ids=ids, labels=ids).loss.backward()
        h.remove()
        # the layer's forward again in the backward (non-reentrant stops once the tensors it needs exist)
        assert len(calls) == (2 if m != "off" else 1)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for n, g in grads[0].items():
        torch.testing.assert_close(grads[1][n], g, rtol=1e-5, atol=1e-7)
    with pytest.raises(ValueError, match="grad_ckpt"):
        train.enable_grad_ckpt(build_model("llama-tiny"), "sometimes")
    args = train.parse_args(["--grad-ckpt", "reentrant", "--liger", "--liger-defaults"])
    assert args.grad_ckpt == "reentrant" and args.liger_defaults


def test_breakdown_dense_categories_on_a_synthetic_trace():
    t = Trace()
    t.range("e2e::decoder_layer", 0, 3000)
    t.kernel("vectorized_elementwise_kernel<add>", 5, 7)  # the residual add: in the layer, no range inside
    t.range("e2e::attention", 100, 1000)
    t.kernel("nvjet_sm90_tst_128x256", 110, 50)  # q/k/v/o projections
    t.kernel("_rope_kernel", 120, 4)  # ours, by name
    t.kernel("pytorch_flash::flash_fwd_kernel", 130, 60)
    t.kernel("elementwise_kernel<copy>", 140, 3)  # a transpose's copy
    t.range("e2e::mlp", 2000, 500)
    t.kernel("nvjet_sm90_tst_256x128", 2010, 80)
    t.kernel("_gated_fwd_kernel", 2020, 9)  # ours in a dense MLP
    t.kernel("_swiglu_forward_kernel", 2030, 8)  # Liger's, by name
    t.kernel("silu_kernel", 2040, 6)  # eager's
    t.range("e2e::moe", 5000, 500)
    t.kernel("_gated_bwd_kernel", 5010, 5)  # the experts' gate: the MoE block's
    # backward of the MLP activation on autograd's thread, linked to its forward op
    t.op("aten::silu", 2041, 2, **{"Sequence number": 9, "Fwd thread id": 0})
    t.op("autograd::engine::evaluate_function: SiluBackward0", 9000, 20, tid=BWD,
         **{"Sequence number": 9, "Fwd thread id": 1})
    t.kernel("silu_backward_kernel", 9001, 11, tid=BWD)
    b = bd.attribute(t.events)
    c = b["categories"]
    assert c["residual adds"] == pytest.approx(0.007)
    assert c["GEMMs (attention, MLP)"] == pytest.approx(0.13)
    assert c["rope + attention elementwise"] == pytest.approx(0.007)
    assert c["attention"] == pytest.approx(0.06)
    assert c["mlp activation"] == pytest.approx(0.009 + 0.008 + 0.006 + 0.011)
    assert c["moe: router, reorder, combine"] == pytest.approx(0.005)
    _sums_to_total(b)


def test_breakdown_real_cpu_trace_of_a_tiny_dense_model():
    from deepspeed_fused.models import build_model

    model = build_model("llama-tiny", seed=0)
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)

    def step():
        model(input_ids=ids, labels=ids).loss.backward()

    b = bd.profile_step(step, model, device=False)
    c = b["categories"]
    for cat in ("rms_norm", "lm_head + loss", "rope + attention elementwise", "mlp activation", "residual adds"):
        assert c[cat] > 0, (cat, c)
    assert any(k["category"] == "mlp activation" and k["name"] in ("aten::silu", "aten::mul", "aten::silu_backward")
               for k in b["top_kernels"])
    _sums_to_total(b)


def test_ranges_close_when_checkpointing_stops_a_recomputation_early(monkeypatch):
    """Non-reentrant checkpointing ends a layer's recomputation with an exception once it has what it
    needs: the ranges opened in that layer close all the same (no range left open on the thread)."""
    from deepspeed_fused import train
    from deepspeed_fused.models import build_model

    model = build_model("llama-tiny", seed=0)
    model.train()
    train.enable_grad_ckpt(model, "non-reentrant")
    ids = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    events = []

    class Counting:
        def __init__(self, name):
            self.name = name

        def __enter__(self):
            events.append(("open", self.name))

        def __exit__(self, *exc):
            events.append(("close", self.name))

    monkeypatch.setattr(torch.profiler, "record_function", Counting)
    with bd.install_ranges(model):
        model(input_ids=ids, labels=ids).loss.backward()
    for name in ("e2e::mlp", "e2e::decoder_layer", "e2e::attention", "e2e::rms_norm"):
        opened, closed = events.count(("open", name)), events.count(("close", name))
        assert opened == closed > 0, (name, opened, closed)
    assert events.count(("open", "e2e::mlp")) > 2  # the forward and the recomputations


def test_dense_suite_smoke_on_cpu(tmp_path):
    """A dense pair through the deepspeed launcher on a tiny stand-in (Qwen3 shape, gradient
    checkpointing): both arms run, with the dense categories in their breakdowns."""
    import subprocess
    import sys

    env = dict(os.environ, PYTHONPATH=e2e.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "deepspeed_fused.bench", "e2e", "--quick", "--out", str(tmp_path),
                        "--pairs", "dense_qwen3_1_7b", "--dense-model", "qwen3-tiny", "--arms", "baseline,fused",
                        "--arm-timeout", "400"], cwd=e2e.ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads((tmp_path / "e2e.json").read_text())
    z = d["results"]["dense_qwen3_1_7b"]
    for arm in ("baseline", "fused"):
        assert "error" not in z[arm], z[arm].get("error")
        assert z[arm]["model"] == "qwen3-tiny" and z[arm]["grad_ckpt"] == "non-reentrant"
        c = z[arm]["breakdown"]["categories"]
        assert c["mlp activation"] > 0 and c["rope + attention elementwise"] > 0 and c["rms_norm"] > 0
    assert z["compare"]["max_loss_rel_diff"] <= 0.005
    assert d["meta"]["pair_models"]["dense_qwen3_1_7b"]["model"] == "qwen3-tiny"
    assert "`dense_qwen3_1_7b`: `qwen3-tiny`" in (tmp_path / "e2e.md").read_text()


def _page_arm(breakdown):
    """An arm as the e2e page reads it: one step, every figure 1, the given breakdown."""
    hist = [dict(step=0, loss=1.0, step_s=1.0, tokens_per_s=1.0)]
    return dict(median_step_s=1.0, step_s_p10=1.0, step_s_p90=1.0, median_tokens_per_s=1.0,
                peak_alloc_mib=1.0, peak_reserved_mib=1.0, history=hist, breakdown=breakdown)


_PAGE_META = dict(date="2026-12-05", gpu="cpu", torch="-", triton="-", model="m", batch=2, seq=8, steps=1, warmup=0)


def test_report_breakdown_columns_are_the_union_of_the_arms_categories():
    old = dict(total_gpu_ms=3.0, categories={"rms_norm": 1.0, "attention": 2.0}, how={}, n_kernels=2,
               method="kernels once each, by name/range (deepspeed_fused.bench.breakdown)")
    new = dict(total_gpu_ms=6.0, categories={"rms_norm": 1.0, "attention": 1.0, "residual adds": 4.0}, how={},
               n_kernels=3, method=old["method"])

    results = {"zero2": {"fused": _page_arm(old)}, "dense_qwen3_1_7b": {"fused": _page_arm(new)}}
    md = e2e_report.markdown(results, {}, _PAGE_META)
    assert "| pair | arm | total | rms_norm | attention | residual adds |" in md
    assert "| dense_qwen3_1_7b | fused | 6.0 | 1.0 | 1.0 | 4.0 |" in md
    assert "| zero2 | fused | 3.0 | 1.0 | 2.0 | 0.0 |" in md


def test_report_names_the_backward_nodes_whose_time_was_left_unlinked():
    def arm(unlinked):
        return _page_arm(dict(total_gpu_ms=3.0, categories={"rms_norm": 1.0, "other": 2.0},
                              how={"range": 1.0, "backward_unlinked": 2.0 if unlinked else 0.0}, n_kernels=2,
                              method=bd.METHOD, unlinked_nodes=unlinked))

    results = {"dense_qwen3_1_7b": {"liger": arm({}), "fused": arm({"_FusedRMSNormFnBackward": 1.5, "": 0.5})}}
    md = e2e_report.markdown(results, {}, _PAGE_META)
    assert "| dense_qwen3_1_7b | fused | `_FusedRMSNormFnBackward` 1.50, `?` 0.50 |" in md
    assert "| dense_qwen3_1_7b | liger |" not in md.split("by the autograd node it ran in")[1]
    # a breakdown without the field (written before it existed) adds no table
    del results["dense_qwen3_1_7b"]["fused"]["breakdown"]["unlinked_nodes"]
    assert "by the autograd node it ran in" not in e2e_report.markdown(results, {}, _PAGE_META)


def test_failed_arm_is_reported_by_its_exception_line():
    from deepspeed_fused.bench.e2e_report import error_headline

    err = ('exit 1: ed_fused/train.py", line 248, in run_steps\n[rank0]:     engine.step()\n'
           '[rank0]:   File "engine.py", line 3615, in step\n[rank0]: torch.OutOfMemoryError: CUDA out of memory. '
           'Tried to allocate 14.99 GiB.\n[rank0]:[W1206 ProcessGroupNCCL.cpp:1575] Warning: destroy_process_group()\n')
    assert error_headline(err) == "exit 1: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 14.99 GiB."
    assert error_headline("timeout: no result within 170 s (3 steps printed)") == \
        "timeout: no result within 170 s (3 steps printed)"
    assert error_headline("exit 1: ValueError: a\nRuntimeError: b") == "exit 1: RuntimeError: b"


def _fake_nvidia_smi(tmp_path, monkeypatch, body: str) -> None:
    """An ``nvidia-smi`` stand-in (a shell script of ``body``) first on PATH."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text("#!/bin/sh\n" + body)
    (fake / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake}:{os.environ['PATH']}")


def test_gpu_clocks_are_sampled_while_an_arm_runs(tmp_path, monkeypatch):
    """The launcher's sampler runs nvidia-smi beside the job (a stand-in script here) and keeps the
    busy samples' clocks; the report lists them per arm."""
    from deepspeed_fused.bench.common import GpuSampler, summarize_gpu_samples
    from deepspeed_fused.bench.e2e_report import clocks_table

    text = "0, 100, 1755, 690.5, 71\n0, 3, 345, 80.0, 40\n0, 98, 1620, 700.1, 75\n1, 100, 1980, 500, 60\n0, [N/A], 1, 1, 1\n"
    s = summarize_gpu_samples(text)
    assert s["0"] == dict(samples=3, busy_samples=2, sm_mhz_median=1687.5, sm_mhz_min=1620.0, power_w_median=695.3,
                          temp_c_max=75.0)
    assert s["1"]["sm_mhz_median"] == 1980.0 and summarize_gpu_samples("") is None
    _fake_nvidia_smi(tmp_path, monkeypatch, "while true; do echo '0, 100, 1500, 650.0, 70'; sleep 0.05; done\n")
    import time

    with GpuSampler(period_ms=50) as g:
        time.sleep(0.5)
    assert g.summary["0"]["sm_mhz_median"] == 1500.0 and g.summary["0"]["busy_samples"] >= 2
    lines = clocks_table({"dense_x": {"baseline": {"gpu_clocks": g.summary}, "fused": {"gpu_clocks": None}}})
    assert any(line.startswith("| dense_x | baseline | n/a | 1500 | 1500 | 650 | 70 |") for line in lines)
    assert clocks_table({"dense_x": {"baseline": {}}}) == []


def test_gpu_sampler_reads_the_clock_limit_reasons_or_does_without(tmp_path, monkeypatch):
    """With the reasons fields the summary has the share of busy samples power-capped and slowed;
    a driver that rejects both field spellings (exits at once) still gives the base samples."""
    from deepspeed_fused.bench.common import GpuSampler, summarize_gpu_samples
    from deepspeed_fused.bench.e2e_report import clocks_table
    import time

    s = summarize_gpu_samples("0, 100, 1600, 690, 70, Active, Not Active\n0, 99, 1700, 600, 70, Not Active, "
                              "Not Active\n0, 5, 300, 80, 40, Active, Active\n0, 100, 1650, 650, 71, [N/A], [N/A]\n")
    assert s["0"]["power_capped"] == 0.5 and s["0"]["hw_slowdown"] == 0.0 and s["0"]["busy_samples"] == 3
    line = next(x for x in clocks_table({"dense_x": {"fused": {"gpu_clocks": s}}}) if x.startswith("| dense_x"))
    assert "| 50% | 0% | 3 of 4 |" in line
    _fake_nvidia_smi(tmp_path, monkeypatch, "case \"$1\" in *reasons*) echo 'not a valid field' >&2; exit 2;; esac\n"
                     "while true; do echo '0, 100, 1500, 650.0, 70'; sleep 0.05; done\n")
    with GpuSampler(period_ms=50) as g:
        time.sleep(0.4)
    assert g.summary["0"]["sm_mhz_median"] == 1500.0 and "power_capped" not in g.summary["0"]


def test_balanced_runs_each_arm_twice_in_mirrored_order(tmp_path, monkeypatch):
    """--balanced: baseline, liger, fused, then fused, liger, baseline; each arm's step is the mean
    of its two runs' medians, the runs are listed with their places, the report says so."""
    order, step = [], {"baseline.json": [3.0, 5.0], "fused_all.json": [1.0, 2.0]}

    def launch(train_args, num_gpus, timeout, tmp, env_extra=None):
        a = _flags(train_args)
        arm = "liger" if "--liger" in train_args else os.path.basename(a["--deepspeed_config"])
        order.append(arm)
        s = step[arm].pop(0) if arm in step else 4.0
        gemm = 100.0 + 10 * len(order)  # the same GEMMs, slower the later they run
        _job_metrics(train_args, s, 8.0 / s, breakdown=dict(
            total_gpu_ms=gemm + 5.0, categories={"GEMMs (attention, MLP)": gemm, "rms_norm": 5.0},
            top_kernels=[dict(name="gemm", category="GEMMs (attention, MLP)", ms=gemm, calls=7)]))
        return dict(rc=0, stdout="", stderr="", wall_s=1.0, gpu_clocks={"0": dict(
            samples=4, busy_samples=3, sm_mhz_median=1700.0 - 10 * len(order), sm_mhz_min=1600.0,
            power_w_median=600.0, temp_c_max=70.0)})

    monkeypatch.setattr(e2e, "launch", launch)
    doc = e2e.main(argparse.Namespace(out=str(tmp_path), quick=False, extra=[
        "--pairs", "dense_gemma3_1b", "--steps", "2", "--warmup", "1", "--balanced"]))
    assert order == ["baseline.json", "liger", "fused_all.json", "fused_all.json", "liger", "baseline.json"]
    r = doc["results"]["dense_gemma3_1b"] if "results" in doc else json.load(open(tmp_path / "e2e.json"))["results"][
        "dense_gemma3_1b"]
    assert r["baseline"]["median_step_s"] == 4.0 and r["fused"]["median_step_s"] == 1.5
    assert [x["position"] for x in r["baseline"]["runs"]] == [0, 5]
    assert r["compare"]["speedup"] == pytest.approx(4.0 / 1.5)
    md = (tmp_path / "e2e.md").read_text()
    assert "Balanced (`--balanced`)" in md and "| dense_gemma3_1b | fused (run 4) | 2000.0 | 1660 |" in md
    # each arm's breakdown is the mean of its two profiled steps: places 1+6, 2+5, 3+4 give one GEMM time
    for arm in ("baseline", "liger", "fused"):
        b = r[arm]["breakdown"]
        assert b["categories"]["GEMMs (attention, MLP)"] == pytest.approx(135.0) and b["profiled_steps"] == 2
        assert b["top_kernels"] == [dict(name="gemm", category="GEMMs (attention, MLP)", ms=pytest.approx(135.0),
                                         calls=7)]
    assert "Balanced (`dense_gemma3_1b`): each arm's figures are the mean of its profiled optimizer steps" in md


def test_mean_breakdown_counts_a_missing_category_or_kernel_as_zero():
    """A category or kernel only one profiled step has is halved, not taken whole; micro-steps are
    averaged position by position; strings come from the first record."""
    a = dict(total_gpu_ms=10.0, method="m", n_kernels=7, categories={"x": 4.0, "y": 6.0},
             top_kernels=[dict(name="k1", category="x", ms=4.0, calls=2), dict(name="k2", category="y", ms=6.0, calls=1)],
             micro_steps=[dict(total_gpu_ms=10.0, categories={"x": 4.0})])
    b = dict(total_gpu_ms=20.0, method="m2", n_kernels=8, categories={"x": 8.0, "z": 12.0},
             top_kernels=[dict(name="k1", category="x", ms=8.0, calls=2), dict(name="k3", category="z", ms=12.0, calls=3)],
             micro_steps=[dict(total_gpu_ms=20.0, categories={"x": 8.0}), dict(total_gpu_ms=1.0, categories={})])
    m = e2e.mean_breakdown([a, b])
    assert m["total_gpu_ms"] == 15.0 and m["method"] == "m" and m["profiled_steps"] == 2
    assert m["n_kernels"] == 8 and isinstance(m["n_kernels"], int)  # a count stays whole (7.5 rounds to 8)
    assert m["categories"] == {"x": 6.0, "y": 3.0, "z": 6.0}
    assert [(k["name"], k["ms"]) for k in m["top_kernels"]] == [("k1", 6.0), ("k3", 6.0)]
    assert m["micro_steps"] == [dict(total_gpu_ms=15.0, categories={"x": 6.0})]


def test_shared_kernels_table_lists_the_kernels_every_arm_ran_alike():
    """Only kernels with the same name and call count in every arm, longest first, with each arm's
    time over the first arm's; a pair with one breakdown gives no table."""
    from deepspeed_fused.bench.e2e_report import shared_kernels_table

    def arm(rows):
        return dict(breakdown=dict(method="m", top_kernels=[dict(name=n, category=c, ms=ms, calls=k)
                                                            for n, c, ms, k in rows]))

    results = {"dense_x": {
        "baseline": arm([("gemm", "GEMMs", 10.0, 4), ("add", "adds", 3.0, 2), ("mine", "x", 1.0, 1)]),
        "liger": arm([("gemm", "GEMMs", 10.5, 4), ("add", "adds", 3.0, 3)]),
        "fused": arm([("gemm", "GEMMs", 11.0, 4), ("add", "adds", 3.0, 2)])}}
    lines = shared_kernels_table(results)
    rows = [line for line in lines if line.startswith("| dense_x")]
    assert rows == ["| dense_x | `gemm` | GEMMs | 4 | 10.00 | 10.50 | 11.00 | 1.050 | 1.100 |"]
    assert "liger / baseline" in "".join(lines)
    assert shared_kernels_table({"dense_x": {"baseline": results["dense_x"]["baseline"], "liger": {"error": "x"}}}) == []


def test_category_vs_liger_table_splits_each_difference_into_slower_kernels_and_other_work():
    """Per category: Liger's and our ms, the difference, the part of it that the same kernels (name and
    call count) took longer in ours, and the verdict; a pair without both arms gives no table."""
    from deepspeed_fused.bench.e2e_report import category_vs_liger_table

    def arm(cats, rows):
        return dict(breakdown=dict(method="m", categories=cats, top_kernels=[
            dict(name=n, category=c, ms=ms, calls=k) for n, c, ms, k in rows]))

    results = {"dense_x": {
        "liger": arm({"GEMMs": 10.0, "norm": 3.0, "act": 1.0, "moe": 0.0},
                     [("gemm", "GEMMs", 10.0, 4), ("liger_norm", "norm", 3.0, 2), ("swiglu", "act", 1.0, 2)]),
        "fused": arm({"GEMMs": 10.5, "norm": 2.0, "act": 1.2, "moe": 0.0},
                     [("gemm", "GEMMs", 10.5, 4), ("our_norm", "norm", 2.0, 2), ("gated", "act", 1.2, 2)])}}
    rows = [line for line in category_vs_liger_table(results) if line.startswith("| dense_x")]
    assert rows == ["| dense_x | GEMMs | 10.0 | 10.5 | +0.5 | +0.5 | +0.0 | no: the same kernels, slower |",
                    "| dense_x | norm | 3.0 | 2.0 | -1.0 | +0.0 | -1.0 | yes |",
                    "| dense_x | act | 1.0 | 1.2 | +0.2 | +0.0 | +0.2 | no |"]
    assert category_vs_liger_table({"dense_x": {"liger": results["dense_x"]["liger"], "fused": {"error": "x"}}}) == []


def test_qwen3_4b_pair_runs_on_one_gpu_only_where_one_holds_it(monkeypatch):
    """The Qwen3-4B pair asks for two GPUs; a host with one GPU of 120 GiB or more (an H200) runs
    it on that one, a host with two GPUs or one smaller GPU keeps two; other pairs keep their own."""
    assert e2e.pair_gpus("dense_qwen3_4b", 2, memory=[139.8]) == 1
    assert e2e.pair_gpus("dense_qwen3_4b", 2, memory=[139.8, 139.8]) == 2
    assert e2e.pair_gpus("dense_qwen3_4b", 2, memory=[79.6]) == 2
    assert e2e.pair_gpus("dense_qwen3_4b", 2, memory=[]) == 2
    assert e2e.pair_gpus("dense_llama3_3b", 1, memory=[139.8]) == 1
    assert e2e.pair_gpus("zero2_2gpu", 2, memory=[139.8]) == 2
    seen = []
    monkeypatch.setattr(e2e, "gpu_memory_gib", lambda: [141.0])

    def launch(train_args, num_gpus, timeout, tmp, env_extra=None):
        seen.append(num_gpus)
        return dict(rc=1, stdout="", stderr="x", wall_s=1.0)

    monkeypatch.setattr(e2e, "launch", launch)
    e2e.run_arm("dense_qwen3_4b", "baseline", _opts("--pairs", "dense_qwen3_4b"), "/tmp")
    assert seen == [1]


def test_a_pair_that_needs_more_gpus_than_the_host_has_is_not_launched(tmp_path, monkeypatch):
    """The Qwen3-4B pair on one 80 GB GPU, or a two-GPU pair on one GPU: each arm is recorded as
    not run with the reason (no launch: the launcher would start a rank per GPU asked for, each
    beyond the host's failing on a device it does not have); the pages say "not run", not
    "failed". Where the host holds the pair, or its GPUs are unknown, it is launched as before."""
    short = e2e.host_shortfall("dense_qwen3_4b", [79.6])
    assert short == "not run: dense_qwen3_4b needs 2 GPUs or one of at least 120 GiB; this host has 1 (80 GiB)"
    assert e2e.host_shortfall("zero2_2gpu", [139.8]) == "not run: zero2_2gpu needs 2 GPUs; this host has 1 (140 GiB)"
    assert e2e.host_shortfall("dense_qwen3_4b", [139.8]) is None
    assert e2e.host_shortfall("dense_qwen3_4b", [79.6, 79.6]) is None
    assert e2e.host_shortfall("dense_qwen3_4b", []) is None  # no nvidia-smi: left to the launcher
    assert e2e.host_shortfall("dense_llama3_3b", [79.6]) is None
    assert e2e.host_shortfall("custom", [79.6], gpus=2) == "not run: custom needs 2 GPUs; this host has 1 (80 GiB)"
    launched = []
    monkeypatch.setattr(e2e, "gpu_memory_gib", lambda: [79.6])
    monkeypatch.setattr(e2e, "launch", lambda *a, **k: launched.append(a) or dict(rc=1, stdout="", stderr="x",
                                                                                  wall_s=1.0))
    doc = e2e.main(argparse.Namespace(out=str(tmp_path), quick=False, extra=[
        "--pairs", "dense_qwen3_4b", "--steps", "2", "--warmup", "1", "--balanced"]))
    assert launched == []
    r = doc["results"]["dense_qwen3_4b"] if "results" in doc else json.load(open(tmp_path / "e2e.json"))["results"][
        "dense_qwen3_4b"]
    for arm in ("baseline", "liger", "fused"):
        assert r[arm]["not_run"] and r[arm]["error"] == short
    assert r["compare"]["not_run"]
    md = (tmp_path / "e2e.md").read_text()
    assert "| dense_qwen3_4b | fused | n/a (not run) | | not run |" in md
    assert "| dense_qwen3_4b | | not run |" in md and "failed" not in md


def test_search_dense_takes_the_dense_pairs_one_gpu_holds(monkeypatch, capsys):
    """``--search dense``: the dense pairs a one-GPU search can run on this host (Qwen3-4B with fp32
    states only where one GPU holds it, an H200), the others left out with a line saying why; a
    pair named alone that needs several GPUs here is refused before anything runs."""
    monkeypatch.setattr(e2e, "gpu_memory_gib", lambda: [79.6])
    assert _opts("--search", "dense").search_list == ["dense_llama3_3b", "dense_qwen3_1_7b", "dense_gemma3_1b"]
    assert "--search dense leaves out dense_qwen3_4b: the search runs on one GPU" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="the micro-batch search runs on one GPU; dense_qwen3_4b uses 2 here"):
        _opts("--search", "dense_qwen3_4b")
    with pytest.raises(SystemExit, match="zero2_2gpu uses 2 here"):
        _opts("--search", "zero2_2gpu")
    monkeypatch.setattr(e2e, "gpu_memory_gib", lambda: [139.8])
    assert _opts("--search", "dense").search_list == ["dense_llama3_3b", "dense_qwen3_1_7b", "dense_qwen3_4b",
                                                      "dense_gemma3_1b"]
    assert _opts("--search", "dense_qwen3_4b,zero2").search_list == ["dense_qwen3_4b", "zero2"]
