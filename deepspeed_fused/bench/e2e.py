"""Suite ``e2e``: a real MoE training run with every feature off vs on, one GPU.

Runs ``examples/train.py`` through the deepspeed launcher for each arm (a fresh process per arm,
so memory figures are not polluted): the Qwen3-30B-A3B layer shape cut to 4 layers, bf16, batches
of 2 x 4096 synthetic tokens (same seed and data in both arms). Pairs: ZeRO-2, AutoEP
(autoep_size 1) and ZeRO-3. Writes ``docs/benchmarks/e2e.json``, ``e2e.md``, ``e2e_loss.png``
and ``e2e_speed_memory.png``, with a per-kernel-category GPU time breakdown of one profiled step.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile

from .common import OUT_DIR, env_fields

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAIRS = [
    ("zero2", "configs/baseline.json", "configs/fused_all.json"),
    ("autoep", "configs/autoep_baseline.json", "configs/autoep_fused.json"),
    ("zero3", "configs/zero3_baseline.json", "configs/zero3_fused.json"),
]


def run_arm(config: str, model: str, steps: int, warmup: int, batch: int, seq: int, tmp: str) -> dict:
    metrics = os.path.join(tmp, os.path.basename(config) + ".metrics.json")
    prof = os.path.join(tmp, os.path.basename(config) + ".profile.json")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port",
           str(29500 + abs(hash(config)) % 1000), os.path.join(ROOT, "examples", "train.py"),
           "--deepspeed_config", os.path.join(ROOT, config), "--model", model, "--steps", str(steps + warmup),
           "--warmup", str(warmup), "--batch-size", str(batch), "--seq-len", str(seq), "--no-progress",
           "--metrics-out", metrics, "--profile-out", prof]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    print("[e2e] running", " ".join(cmd[3:]), flush=True)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    sys.stdout.write(p.stdout[-4000:])
    if p.returncode != 0 or not os.path.exists(metrics):
        sys.stdout.write(p.stderr[-6000:])
        return dict(config=config, error=f"exit {p.returncode}: {p.stderr[-1500:]}")
    with open(metrics) as f:
        out = json.load(f)
    times = [r["step_s"] for r in out["history"][warmup:]]
    out["step_s_p10"] = sorted(times)[max(0, int(0.1 * len(times)) - 1)] if times else None
    out["step_s_p90"] = sorted(times)[min(len(times) - 1, int(0.9 * len(times)))] if times else None
    out["step_s_stdev"] = statistics.pstdev(times) if len(times) > 1 else 0.0
    return out


def compare(base: dict, fused: dict, warmup: int) -> dict:
    if "error" in base or "error" in fused:
        return dict(error=base.get("error") or fused.get("error"))
    lb = [r["loss"] for r in base["history"]]
    lf = [r["loss"] for r in fused["history"]]
    rel = [abs(a - b) / abs(a) for a, b in zip(lb, lf)]

    def reduction(key):  # None on a CPU run (no GPU memory figures)
        return 1 - fused[key] / base[key] if base.get(key) and fused.get(key) is not None else None

    speedup = base["median_step_s"] / fused["median_step_s"]
    mem = reduction("peak_alloc_mib")
    return dict(
        speedup=speedup, peak_alloc_reduction=mem, peak_reserved_reduction=reduction("peak_reserved_mib"),
        max_loss_rel_diff=max(rel), nan=any(math.isnan(x) for x in lb + lf),
        targets=dict(speedup_1_25=speedup >= 1.25, memory_20pct=mem is not None and mem >= 0.20,
                     loss_0_5pct=max(rel) <= 0.005),
    )


def plots(results: dict, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pairs = [k for k in results if "error" not in results[k]["compare"]]
    fig, axes = plt.subplots(1, max(1, len(pairs)), figsize=(5 * max(1, len(pairs)), 4), squeeze=False)
    for ax, k in zip(axes[0], pairs):
        for arm, style in (("baseline", "-"), ("fused", "--")):
            h = results[k][arm]["history"]
            ax.plot([r["step"] for r in h], [r["loss"] for r in h], style, label=arm)
        ax.set_title(f"{k}: loss per step")
        ax.set_xlabel("step")
        ax.set_ylabel("loss")
        ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "e2e_loss.png"), dpi=110)
    plt.close(fig)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    x = range(len(pairs))
    w = 0.38
    for i, arm in enumerate(("baseline", "fused")):
        axes[0].bar([j + i * w for j in x], [results[k][arm]["median_step_s"] * 1e3 for k in pairs], w, label=arm)
        axes[1].bar([j + i * w for j in x], [(results[k][arm]["peak_alloc_mib"] or 0) / 1024 for k in pairs], w,
                    label=arm)
    for ax, lab in ((axes[0], "median step time (ms)"), (axes[1], "peak allocated GPU memory (GiB)")):
        ax.set_xticks([j + w / 2 for j in x])
        ax.set_xticklabels(pairs)
        ax.set_ylabel(lab)
        ax.legend()
    fig.suptitle("end-to-end: Qwen3-30B-A3B shape, 4 layers, 2 x 4096 tokens, bf16")
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "e2e_speed_memory.png"), dpi=110)
    plt.close(fig)


def markdown(results: dict, meta: dict) -> str:
    lines = ["# Benchmark `e2e`: training step, every feature off vs on", "",
             f"{meta['date']}, {meta['gpu']}, torch {meta['torch']}, Triton {meta['triton']}. Model "
             f"`{meta['model']}` (Qwen3-30B-A3B layer shape, 4 layers, random init), bf16, micro-batch "
             f"{meta['batch']} x {meta['seq']} tokens, {meta['steps']} timed steps after {meta['warmup']} warm-up. "
             "Generated by `python -m deepspeed_fused.bench e2e`.", "",
             "![loss](e2e_loss.png)", "", "![speed and memory](e2e_speed_memory.png)", "",
             "| pair | arm | median step ms | p10-p90 ms | tokens/s | peak alloc GiB | peak reserved GiB | final loss |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for k, v in results.items():
        for arm in ("baseline", "fused"):
            a = v[arm]
            if "error" in a:
                lines.append(f"| {k} | {arm} | failed | | | | | {a['error'][:200]!r} |")
                continue
            lines.append(f"| {k} | {arm} | {a['median_step_s'] * 1e3:.1f} | {a['step_s_p10'] * 1e3:.1f}-"
                         f"{a['step_s_p90'] * 1e3:.1f} | {a['median_tokens_per_s']:.0f} | "
                         f"{(a['peak_alloc_mib'] or 0) / 1024:.2f} | {(a['peak_reserved_mib'] or 0) / 1024:.2f} | "
                         f"{a['history'][-1]['loss']:.4f} |")
    lines += ["", "| pair | speed-up (target >= 1.25) | peak alloc reduction (target >= 20%) | "
              "max loss rel. diff (target <= 0.5%) | NaN |", "|---|---:|---:|---:|---|"]
    for k, v in results.items():
        c = v["compare"]
        if "error" in c:
            lines.append(f"| {k} | failed | | | |")
            continue
        mem = "n/a" if c["peak_alloc_reduction"] is None else f"{100 * c['peak_alloc_reduction']:.1f}%"
        lines.append(f"| {k} | {c['speedup']:.2f} | {mem} | "
                     f"{100 * c['max_loss_rel_diff']:.3f}% | {c['nan']} |")
    lines += ["", "## GPU time per category (one profiled step, ms)", "",
              "Categories are matched on kernel names (a heuristic; see `examples/train.py`).", ""]
    cats = None
    for k, v in results.items():
        for arm in ("baseline", "fused"):
            b = v[arm].get("breakdown") if "error" not in v[arm] else None
            if not b:
                continue
            if cats is None:
                cats = list(b["categories"])
                lines += ["| pair | arm | total | " + " | ".join(cats) + " |",
                          "|---|---|---:|" + "---:|" * len(cats)]
            lines.append(f"| {k} | {arm} | {b['total_gpu_ms']:.1f} | " +
                         " | ".join(f"{b['categories'][c]:.1f}" for c in cats) + " |")
    return "\n".join(lines) + "\n"


def main(args) -> dict:
    import argparse

    p = argparse.ArgumentParser(prog="python -m deepspeed_fused.bench e2e")
    p.add_argument("--model", default="qwen3-moe-30b-a3b-4l")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--pairs", default="zero2,autoep,zero3")
    p.add_argument("--render", nargs="+", default=None, metavar="E2E_JSON",
                   help="do not run: merge the results of earlier runs (e2e.json files) and write the outputs")
    o = p.parse_args(getattr(args, "extra", []))
    if getattr(args, "quick", False):
        o.steps, o.warmup, o.seq_len = 3, 1, 512
    out_dir = getattr(args, "out", None) or OUT_DIR
    os.makedirs(out_dir, exist_ok=True)
    if o.render:
        results, meta = {}, None
        for path in o.render:
            with open(path) as f:
                d = json.load(f)
            results.update(d["results"])
            meta = meta or d["meta"]
        return _write(results, meta, out_dir)
    wanted = o.pairs.split(",")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, base_cfg, fused_cfg in PAIRS:
            if name not in wanted:
                continue
            base = run_arm(base_cfg, o.model, o.steps, o.warmup, o.batch_size, o.seq_len, tmp)
            fused = run_arm(fused_cfg, o.model, o.steps, o.warmup, o.batch_size, o.seq_len, tmp)
            results[name] = dict(baseline=base, fused=fused, compare=compare(base, fused, o.warmup))
    meta = dict(env_fields(), model=o.model, batch=o.batch_size, seq=o.seq_len, steps=o.steps, warmup=o.warmup)
    return _write(results, meta, out_dir)


def _write(results: dict, meta: dict, out_dir: str) -> dict:
    with open(os.path.join(out_dir, "e2e.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1, default=str)
    with open(os.path.join(out_dir, "e2e.md"), "w") as f:
        f.write(markdown(results, meta))
    try:
        plots(results, out_dir)
    except Exception as e:
        print("[e2e] plots not written:", e)
    print(markdown(results, meta))
    return results
