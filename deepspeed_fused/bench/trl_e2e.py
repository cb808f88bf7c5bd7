"""End-to-end pair ``trl_sft_e2e``: TRL's SFTTrainer with DeepSpeed ZeRO-2 on a full-depth
Qwen3-1.7B-shaped dense model (random weights, bf16, gradient checkpointing, packed batches of
4 x 4096 tokens), with TRL's own fused LM head alone against the same job with deepspeed_fused.

    python -m deepspeed_fused.bench trl_sft_e2e [--out DIR] [--steps 20] [--warmup 3] [--arms trl,lce,all]

Arms: ``trl`` (no deepspeed_fused section: TRL's ChunkedLogProbFunction head), ``lce`` (the
linear_cross_entropy feature only: TRL's head served by the fused op), ``all`` (rms_norm,
linear_cross_entropy and rope). Each arm is one ``deepspeed`` launcher job (``--job``) that trains
``warmup + steps`` steps and reports tokens/s (median step after the warmup), the peak GPU memory
after the warmup, the losses and the plugin's report. Writes ``e2e_trl_sft.{json,md,png}``;
``--render JSON`` writes the markdown and plot of an earlier run's JSON without running.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

MODEL = "qwen3-small"
# Qwen3-1.7B's shape (28 layers, tied embeddings) on the qwen3-small config
QWEN3_1_7B = dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                  num_key_value_heads=8, head_dim=128, vocab_size=151936, tie_word_embeddings=True)
ARMS = {"trl": None, "lce": {"linear_cross_entropy": {"enabled": True}},
        "all": {"rms_norm": {"enabled": True}, "linear_cross_entropy": {"enabled": True}, "rope": {"enabled": True}}}
RESULT = "e2e_trl_sft"


def _ds_config(section):
    import torch

    cfg = {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto", "gradient_accumulation_steps": "auto",
           "gradient_clipping": "auto", "bf16": {"enabled": "auto"}, "zero_optimization": {"stage": 2},
           "zero_allow_untested_optimizer": True, "steps_per_print": 10**6}
    if section is not None:
        cfg["deepspeed_fused"] = section
    return cfg if torch.cuda.is_available() else {**cfg, "bf16": {"enabled": False}}


def job(argv) -> int:
    """One arm: train under the launcher, print ``[train] step`` lines, write the metrics JSON."""
    p = argparse.ArgumentParser(prog="trl_e2e --job")
    p.add_argument("--arm", choices=sorted(ARMS), required=True)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--tiny", action="store_true", help="a tiny model (a CPU check of the job)")
    p.add_argument("--metrics-out", required=True)
    o, _ = p.parse_known_args(argv)  # the launcher adds --local_rank

    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    import deepspeed_fused  # noqa: F401  (the hook)
    from deepspeed_fused.models import build_model
    from deepspeed_fused.tiny_tokenizer import tiny_tokenizer

    cuda = torch.cuda.is_available()
    if o.tiny:
        model = build_model("qwen3-tiny", dtype=torch.float32)
    else:
        model = build_model(MODEL, dtype=torch.bfloat16 if cuda else torch.float32, **QWEN3_1_7B)
    vocab = model.config.vocab_size
    total = o.batch_size * o.seq_len * (o.steps + o.warmup + 1)
    g = torch.Generator().manual_seed(0)
    docs, n = [], 0
    while n < total:  # documents of 200..3000 tokens, packed ("wrapped") into rows of seq_len
        k = int(torch.randint(200, 3000, (1,), generator=g)) if not o.tiny else 24
        docs.append(torch.randint(4, vocab, (k,), generator=g).tolist())
        n += k
    times, mem = [], {}

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
                if state.global_step == o.warmup:
                    torch.cuda.reset_peak_memory_stats()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if cuda:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - self.t0) * 1e3)
            if cuda and state.global_step > o.warmup:
                mem["peak_mib"] = torch.cuda.max_memory_allocated() / 2**20

    args = SFTConfig(output_dir=os.path.join(tempfile.gettempdir(), f"trl_e2e_{o.arm}"), deepspeed=_ds_config(ARMS[o.arm]),
                     max_steps=o.steps + o.warmup, per_device_train_batch_size=o.batch_size, max_length=o.seq_len,
                     packing=True, packing_strategy="wrapped", gradient_checkpointing=True, bf16=cuda,
                     use_cpu=not cuda, learning_rate=1e-5, logging_steps=1, save_strategy="no", report_to=[],
                     disable_tqdm=True, seed=0)
    trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": docs}),
                         processing_class=tiny_tokenizer(), callbacks=[Timer()])
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    for i, (loss, ms) in enumerate(zip(losses, times)):
        print(f"[train] step {i:4d} loss {loss:.4f} {ms:.1f} ms", flush=True)
    after = times[o.warmup:] or times
    step_ms = statistics.median(after)
    rep = getattr(trainer.model_wrapped, "deepspeed_fused_report", None)
    calls = {f.name: f.calls.as_dict() for f in rep.features if f.applied and f.calls is not None} if rep else {}
    out = {"arm": o.arm, "losses": losses, "step_ms": times, "median_step_ms": step_ms,
           "tokens_per_s": o.batch_size * o.seq_len / (step_ms / 1e3), "peak_mib": mem.get("peak_mib"),
           "report": str(rep) if rep is not None else "", "calls": calls,
           "model": "qwen3-tiny" if o.tiny else "Qwen3-1.7B shape (28 layers, tied, random weights)",
           "batch": f"{o.batch_size}x{o.seq_len}", "warmup": o.warmup, "steps": o.steps}
    with open(o.metrics_out, "w") as f:
        json.dump(out, f, indent=1)
    return 0


def _options(extra):
    p = argparse.ArgumentParser(prog="python -m deepspeed_fused.bench trl_sft_e2e")
    p.add_argument("--arms", default="trl,lce,all")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--arm-timeout", type=float, default=1500.0)
    p.add_argument("--render", default=None, metavar="JSON",
                   help="write the markdown and plot of an earlier run's e2e_trl_sft.json (runs nothing)")
    return p.parse_args(extra)


def main(args) -> dict:
    from .common import env_fields, free_port
    from .e2e import ROOT, run_limited

    o = _options(getattr(args, "extra", None) or [])
    if getattr(args, "quick", False):
        o.steps, o.warmup = min(o.steps, 5), min(o.warmup, 2)
    out_dir = args.out or os.path.join(os.getcwd(), "docs", "benchmarks")
    os.makedirs(out_dir, exist_ok=True)
    if o.render:
        with open(o.render) as f:
            doc = json.load(f)
        render(doc, out_dir)
        return doc
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in o.arms.split(","):
            metrics = os.path.join(tmp, f"{arm}.json")
            cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port",
                   str(free_port()), "--module", "deepspeed_fused.bench.trl_e2e", "--job", "--arm", arm,
                   "--steps", str(o.steps), "--warmup", str(o.warmup), "--batch-size", str(o.batch_size),
                   "--seq-len", str(o.seq_len), "--metrics-out", metrics] + (["--tiny"] if o.tiny else [])
            env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            print("[trl_e2e] running arm", arm, flush=True)
            r = run_limited(cmd, o.arm_timeout, tmp, env, cwd=tmp)
            if r["rc"] == 0 and os.path.exists(metrics):
                with open(metrics) as f:
                    results[arm] = json.load(f)
                results[arm]["gpu_clocks"] = r["gpu_clocks"]
            else:
                why = (f"timeout: no result within {o.arm_timeout:.0f} s" if r["rc"] is None
                       else f"exit {r['rc']}: " + (r["stderr"] or r["stdout"])[-2000:])
                results[arm] = {"arm": arm, "error": why}
    doc = {"suite": RESULT, **env_fields(), **_versions(), "options": vars(o), "arms": results}
    render(doc, out_dir)
    return doc


def _versions() -> dict:
    from .common import package_version

    return {name: package_version(name) or "" for name in ("transformers", "trl", "deepspeed")}


def render(doc: dict, out_dir: str) -> dict:
    """Write ``e2e_trl_sft.{json,md,png}`` of a result ``doc`` (as :func:`main` builds it) under
    ``out_dir``; returns the paths. The plot needs matplotlib (without it: JSON and markdown)."""
    from .e2e_report import error_headline

    o, results = argparse.Namespace(**doc["options"]), doc["arms"]
    base = results.get("trl", {})
    versions = ", ".join(f"{k} {doc[k]}" for k in ("transformers", "trl", "deepspeed") if doc.get(k))
    lines = ["# TRL SFTTrainer end to end: TRL's fused head alone against deepspeed_fused", "",
             f"{doc.get('date', '')}, {doc.get('gpu', '')}, torch {doc.get('torch', '')}"
             + (f", {versions}" if versions else "") + ". "
             f"{(base or next(iter(results.values()), {})).get('model', '')}, ZeRO-2, bf16 on GPU (fp32 on CPU), gradient checkpointing, "
             f"packed {o.batch_size}x{o.seq_len}, median of {o.steps} steps after {o.warmup} warm-up steps. "
             "Arms: `trl` (no `deepspeed_fused` section: TRL's own fused LM head), `lce` (the "
             "`linear_cross_entropy` feature alone, serving TRL's head), `all` (`rms_norm`, "
             "`linear_cross_entropy` and `rope`). Generated by `python -m deepspeed_fused.bench trl_sft_e2e`.", "",
             "![TRL SFT end to end](e2e_trl_sft.png)", "",
             "| arm | tokens/s | vs trl | peak MiB | max loss rel. diff to trl | lce calls | SM clock median MHz (busy) |",
             "|---|---:|---:|---:|---:|---|---:|"]
    for arm, m in results.items():
        if "error" in m:
            lines.append(f"| {arm} | failed: {error_headline(m['error'], 160).replace('|', '/')} | | | | | |")
            continue
        vs = (f"{m['tokens_per_s'] / base['tokens_per_s']:.3f}x" if base.get("tokens_per_s") else "")
        diff = ""
        if base.get("losses") and arm != "trl":
            diff = f"{max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(m['losses'], base['losses'])):.2e}"
        lce = m["calls"].get("linear_cross_entropy")
        peak = "" if m["peak_mib"] is None else f"{m['peak_mib']:.0f}"
        calls = "" if lce is None else f"{lce['fused']} fused, {lce.get('reference', 0)} reference, {lce['eager']} eager"
        sm = ((m.get("gpu_clocks") or {}).get("0") or {}).get("sm_mhz_median")
        lines.append(f"| {arm} | {m['tokens_per_s']:.0f} | {vs} | {peak} | {diff} | {calls} | "
                     f"{'' if sm is None else f'{sm:.0f}'} |")
    md = "\n".join(lines) + "\n"
    paths = {k: os.path.join(out_dir, f"{RESULT}.{k}") for k in ("json", "md", "png")}
    with open(paths["json"], "w") as f:
        json.dump(doc, f, indent=1)
    with open(paths["md"], "w") as f:
        f.write(md)
    try:
        _plot(results, paths["png"], lines[2])
    except ImportError:
        paths.pop("png")
    print(md)
    return paths


def _plot(results: dict, path: str, subtitle: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = {a: m for a, m in results.items() if "error" not in m}
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9, 3.6))
    names = list(ok)
    ax1.bar(names, [ok[a]["tokens_per_s"] for a in names], color="tab:blue")
    ax1.set_ylabel("tokens/s (higher is better)")
    ax2.bar(names, [(ok[a]["peak_mib"] or 0) / 1024 for a in names], color="tab:gray")
    ax2.set_ylabel("peak GPU memory, GiB")
    for ax in (ax1, ax2):
        for c in ax.containers:
            ax.bar_label(c, fmt="%.0f" if ax is ax1 else "%.1f", fontsize=8)
    fig.suptitle("TRL SFTTrainer step: TRL's fused head alone vs deepspeed_fused", fontsize=10)
    fig.text(0.5, 0.01, subtitle.split(". ")[0], ha="center", fontsize=7)
    fig.tight_layout(rect=(0, 0.04, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)

if __name__ == "__main__":
    if "--job" in sys.argv[1:]:
        sys.exit(job([a for a in sys.argv[1:] if a != "--job"]))
    sys.exit(0 if main(argparse.Namespace(extra=sys.argv[1:], out=None, quick=False)) else 1)
