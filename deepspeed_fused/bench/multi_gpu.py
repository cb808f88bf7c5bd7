"""Suite ``multi_gpu``: the example training job on several GPUs of one host, features off vs on.

    python -m deepspeed_fused.bench multi_gpu --out DIR                         # 3 pairs x 2 arms, 2 GPUs
    python -m deepspeed_fused.bench multi_gpu --pairs zero3 --out DIR2
    python -m deepspeed_fused.bench multi_gpu --render DIR/multi_gpu.json DIR2/multi_gpu.json --out DIR3

Runs the example job (``deepspeed_fused.train``) through the DeepSpeed launcher (``python -m deepspeed.launcher.runner
--num_gpus N``), a fresh job per run, with the machinery of the ``e2e`` suite
(:func:`deepspeed_fused.bench.e2e.run_arm`: the launch, its time limit, the metrics file, the
comparison of the arms). Model: the Qwen3-30B-A3B layer shape cut to 4 layers (a MoE model), bf16,
synthetic tokens, the same seed and data in every arm.

Pairs (``--pairs``, default ``zero2,zero3,autoep2``), each with the arms ``baseline`` (every
feature off) and ``fused`` (every feature on):

* ``zero2``: ZeRO-2 data parallel (``configs/baseline.json`` / ``configs/fused_all.json``);
* ``zero3``: ZeRO-3 (``configs/zero3_baseline.json`` / ``configs/zero3_fused.json``);
* ``autoep2``: DeepSpeed AutoEP with ``autoep_size`` 2, the experts split over two GPUs, ZeRO-2
  (``configs/autoep2_baseline.json`` / ``configs/autoep2_fused.json``; with ``--num-gpus`` other
  than 2 a copy with ``autoep_size`` = the GPU count is written for the run).

Per arm: median step time over ``--steps`` timed steps after ``--warmup`` (default 10 after 2),
tokens/s (all ranks' tokens), the peak allocated / reserved memory of rank 0, the final loss and
the plugin's feature report; per pair: the fused arm's speed-up, its peak-memory reduction and the
largest relative loss difference from the baseline over the steps (the same data and seed: a
numerics check). Every run has a time limit (``--arm-timeout``, default 240 s) and the suite as a
whole one (``--total-timeout``, default 450 s): a run that would start with less than a minute
left is recorded as skipped, so the suite ends within the limit plus the last run's teardown.
``--profile`` also profiles one more step per run (the e2e kernel-time breakdown, stored in the
JSON). ``multi_gpu.json`` is written after every run (a job stopped from outside keeps the runs
that finished); ``--render`` merges earlier files (arm by arm) and writes the outputs without
running anything. ``--quick``: 3 steps after 1, 512-token sequences.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from typing import Optional

from . import e2e
from . import e2e_report
from .common import OUT_DIR, env_fields

SUITE = "multi_gpu"
PAIRS = {
    "zero2": ("configs/baseline.json", "configs/fused_all.json"),
    "zero3": ("configs/zero3_baseline.json", "configs/zero3_fused.json"),
    "autoep2": ("configs/autoep2_baseline.json", "configs/autoep2_fused.json"),
}
ARMS = ("baseline", "fused")
MODEL = "qwen3-moe-30b-a3b-4l"  # the e2e suite's model: Qwen3-30B-A3B layer shape, 4 layers
MIN_LEFT_S = 60.0  # a run is not started with less time left in the suite than this


def _pair_configs(pair: str, gpus: int, tmp: str) -> tuple:
    """(baseline config, fused config, GPUs) of a pair on ``gpus`` GPUs. AutoEP's ``autoep_size``
    must divide the ranks: for other GPU counts than the shipped configs' 2, a copy with
    ``autoep_size`` = ``gpus`` is written under ``tmp``."""
    base, fused = PAIRS[pair]
    if pair != "autoep2" or gpus == 2:
        return base, fused, gpus
    out = []
    for path in (base, fused):
        with open(e2e.config_file(path)) as f:
            cfg = json.load(f)
        cfg["expert_parallel"]["autoep_size"] = gpus
        dst = os.path.join(tmp, os.path.basename(path).replace("autoep2", f"autoep{gpus}"))
        with open(dst, "w") as f:
            json.dump(cfg, f, indent=1)
        out.append(dst)
    return out[0], out[1], gpus


def run(o, out_dir: str) -> dict:
    """Every pair and arm under the suite's time limit; writes the outputs; returns the document."""
    pairs = [x for x in o.pairs.split(",") if x and x != "none"]
    for x in pairs:
        if x not in PAIRS:
            raise SystemExit(f"multi_gpu: unknown pair {x!r}; expected one of {', '.join(PAIRS)}")
    meta = dict(env_fields(), model=o.model, batch=o.batch_size, seq=o.seq_len, steps=o.steps, warmup=o.warmup,
                num_gpus=o.num_gpus, arm_timeout=o.arm_timeout, total_timeout=o.total_timeout)
    results: dict = {}
    deadline = time.time() + o.total_timeout
    arm_timeout = o.arm_timeout

    def partial():
        with open(os.path.join(out_dir, f"{SUITE}.json"), "w") as f:
            json.dump(dict(meta=meta, results=results, partial=True), f, indent=1, default=str)

    with tempfile.TemporaryDirectory() as tmp:
        table = {p: _pair_configs(p, o.num_gpus, tmp) for p in pairs}
        for pair in pairs:
            results[pair] = {}
            for arm in ARMS:
                left = deadline - time.time()
                if left < MIN_LEFT_S:
                    results[pair][arm] = dict(config=table[pair][0 if arm == "baseline" else 1], arm=arm,
                                              skipped=True, error=f"skipped: {left:.0f} s left of the suite's "
                                                                  f"{o.total_timeout:.0f} s (--total-timeout)")
                    continue
                o.arm_timeout = min(arm_timeout, left)
                results[pair][arm] = e2e.run_arm(pair, arm, o, tmp, pairs=table)
                results[pair][arm]["time_limit_s"] = o.arm_timeout
                partial()
            results[pair]["compare"] = e2e_report.compare(pair, results[pair])
    o.arm_timeout = arm_timeout
    return write(results, meta, out_dir)


def write(results: dict, meta: dict, out_dir: str) -> dict:
    os.makedirs(out_dir, exist_ok=True)
    doc = dict(meta=meta, results=results)
    with open(os.path.join(out_dir, f"{SUITE}.json"), "w") as f:
        json.dump(doc, f, indent=1, default=str)
    md = markdown(results, meta)
    with open(os.path.join(out_dir, f"{SUITE}.md"), "w") as f:
        f.write(md)
    print(md)
    return doc


def render(paths: list, out_dir: str) -> dict:
    """Merge earlier multi_gpu.json files arm by arm (e2e's render) and write the outputs."""
    return e2e_report.render(paths, out_dir, write=lambda results, search, meta, out: write(results, meta, out))


def _report_lines(report: Optional[dict]) -> list:
    if not report:
        return ["no feature report (the run failed, or the hook did not run)"]
    out = []
    for feat in report.get("features", []):
        state = "applied" if feat.get("applied") else ("not applied" if feat.get("enabled") else "off")
        where = f": {feat['where']}" if feat.get("where") else ""
        reason = f" ({feat['reason']})" if feat.get("reason") else ""
        out.append(f"`{feat.get('name')}` {state}{where}{reason}")
    return out or ["no features in the report"]


def markdown(results: dict, meta: dict) -> str:
    _f, _ok = e2e_report._f, e2e_report._ok
    shape = " (Qwen3-30B-A3B layer shape, 4 layers, MoE, random init)" if meta.get("model") == MODEL else ""
    lines = [f"# Benchmark `{SUITE}`: the example job on {meta.get('num_gpus')} GPUs, features off vs on", "",
             f"{meta.get('date')}, {meta.get('gpu')}, torch {meta.get('torch')}, Triton {meta.get('triton')}. "
             f"Model `{meta.get('model')}`{shape}"
             f", bf16, micro-batch {meta.get('batch')} x {meta.get('seq')} tokens per GPU, {meta.get('steps')} timed "
             f"steps after {meta.get('warmup')} warm-up, through `python -m deepspeed.launcher.runner --num_gpus "
             f"{meta.get('num_gpus')}` (each run limited to {_f(meta.get('arm_timeout'), '{:.0f}')} s, the suite to "
             f"{_f(meta.get('total_timeout'), '{:.0f}')} s). Arms: `baseline` (every feature off), `fused` (every "
             f"feature on). Tokens/s count every rank's tokens; memory is rank 0's. Generated by "
             f"`python -m deepspeed_fused.bench {SUITE}`.", "",
             "| pair | arm | config | median step ms | p10-p90 ms | tokens/s | peak alloc GiB | peak reserved GiB | "
             "final loss |", "|---|---|---|---:|---|---:|---:|---:|---:|"]
    for k, v in results.items():
        for arm in [a for a in ARMS if a in v]:
            a = v[arm]
            cfg = os.path.basename(str(a.get("config", "")))
            if "error" in a:
                status = "skipped" if a.get("skipped") else ("timeout" if a.get("timeout") else "failed")
                lines.append(f"| {k} | {arm} | {cfg} | {status} | | | | | {a['error'][:200]!r} |".replace("\n", " "))
                continue
            lines.append(f"| {k} | {arm} | {cfg} | {a['median_step_s'] * 1e3:.1f} | {a['step_s_p10'] * 1e3:.1f}-"
                         f"{a['step_s_p90'] * 1e3:.1f} | {a['median_tokens_per_s']:.0f} | "
                         f"{_f((a.get('peak_alloc_mib') or 0) / 1024)} | "
                         f"{_f((a.get('peak_reserved_mib') or 0) / 1024)} | "
                         f"{a['history'][-1]['loss']:.4f} |")
    lines += ["", "| pair | fused speed-up | peak alloc reduction | peak reserved reduction | max loss rel. diff "
              f"(target <= {e2e_report.LOSS_TARGET:.1%}) | NaN |", "|---|---:|---:|---:|---:|---|"]
    for k, v in results.items():
        c = v.get("compare") or {}
        if "error" in c:
            lines.append(f"| {k} | n/a ({c['error'][:120]}) | | | | |".replace("\n", " "))
            continue
        lines.append(f"| {k} | {_f(c.get('speedup'))} | {_f(c.get('peak_alloc_reduction'), '{:.1%}')} | "
                     f"{_f(c.get('peak_reserved_reduction'), '{:.1%}')} | {_f(c.get('max_loss_rel_diff'), '{:.3%}')} | "
                     f"{c.get('nan')} |")
    lines += ["", "## Feature reports", "", "What the plugin's hook reported in each run (rank 0):", ""]
    for k, v in results.items():
        for arm in [a for a in ARMS if a in v]:
            a = v[arm]
            rep = a.get("report") if _ok(a) else None
            lines.append(f"- {k}, {arm}: " + "; ".join(_report_lines(rep)))
    return "\n".join(lines) + "\n"


def main(args) -> dict:
    p = argparse.ArgumentParser(prog=f"python -m deepspeed_fused.bench {SUITE}")
    p.add_argument("--pairs", default="zero2,zero3,autoep2", help=f"of {', '.join(PAIRS)}")
    p.add_argument("--num-gpus", type=int, default=2)
    p.add_argument("--model", default=MODEL)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=2, help="micro-batch per GPU")
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--arm-timeout", type=float, default=240.0, help="seconds per run")
    p.add_argument("--total-timeout", type=float, default=450.0, help="seconds for the whole suite")
    p.add_argument("--profile", action="store_true", help="profile one more step per run (kernel-time breakdown)")
    p.add_argument("--render", nargs="+", default=None, metavar="MULTI_GPU_JSON",
                   help="do not run: merge earlier multi_gpu.json files and write the outputs")
    o = p.parse_args(getattr(args, "extra", []))
    if getattr(args, "quick", False):
        o.steps, o.warmup, o.seq_len = 3, 1, 512
    o.keep_traces = None
    o.liger_swiglu_timeout = o.arm_timeout  # not used: no Liger arms here
    out_dir = getattr(args, "out", None) or OUT_DIR
    os.makedirs(out_dir, exist_ok=True)
    if o.render:
        return render(o.render, out_dir)
    return run(o, out_dir)
