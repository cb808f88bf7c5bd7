"""Example training job: a Hugging Face causal LM through deepspeed.initialize, with the plugin.

    deepspeed examples/train.py --deepspeed_config configs/fused_all.json --model qwen3-moe-tiny --steps 20

The model is built from a named config with random weights (no hub access) and fed synthetic
token batches (a learnable bigram-like stream, the same for every run with the same seed). Each
step prints the loss, step time, tokens/s and peak GPU memory; the feature report is shown once,
by the plugin's hook, after initialisation. On a CPU-only machine bf16 is turned off and the fused
paths fall back to eager (the report says so); the first CPU run waits a few minutes, silent,
while DeepSpeed compiles its shm_comm op (said before it starts).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import deepspeed  # noqa: E402

import deepspeed_fused  # noqa: E402,F401  (installs the deepspeed.initialize hook)
from deepspeed_fused.models import MODELS, build_model  # noqa: E402


def synthetic_batch(step: int, batch: int, seq: int, vocab: int, seed: int, device) -> torch.Tensor:
    """Token ids where each next token is a fixed function of the last one 3 times out of 4."""
    g = torch.Generator().manual_seed(seed * 100003 + step)
    ids = torch.empty(batch, seq, dtype=torch.long)
    ids[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
    noise = torch.randint(0, vocab, (batch, seq), generator=g)
    keep = torch.rand(batch, seq, generator=g) < 0.75
    for t in range(1, seq):
        nxt = (ids[:, t - 1] * 7 + 3) % vocab
        ids[:, t] = torch.where(keep[:, t], nxt, noise[:, t])
    return ids.to(device)


# Kernel-name patterns that attribute GPU time to the parts the plugin replaces.
CATEGORIES = [
    ("rms_norm", r"rms|norm|rsqrt|pow_|mean"),
    ("loss (lm head + cross-entropy)", r"cross_entropy|log_softmax|nll|softmax|logsumexp|lce|_ce_|linear_ce"),
    ("moe reorder / gather", r"gather|index|scatter|permute|sort|unpermute|combine|histc|bincount|cumsum"),
    ("gemm", r"gemm|cutlass|sm90|xmma|wgmma|matmul|mm_|nvjet|grouped"),
    ("nccl", r"nccl"),
]


def profile_step(engine, ids) -> dict:
    """One training step under the torch profiler: GPU time per kernel, and per category."""
    import re

    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    rows = []
    for ev in prof.key_averages():
        t = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0)
        if t and getattr(ev, "device_type", None) is not None and "CUDA" in str(ev.device_type):
            rows.append(dict(name=ev.key, ms=t / 1e3, calls=ev.count))
    rows.sort(key=lambda r: -r["ms"])
    cats = {name: 0.0 for name, _ in CATEGORIES}
    cats["other"] = 0.0
    for r in rows:
        for name, pat in CATEGORIES:
            if re.search(pat, r["name"], re.IGNORECASE):
                cats[name] += r["ms"]
                break
        else:
            cats["other"] += r["ms"]
    return dict(total_gpu_ms=sum(r["ms"] for r in rows), categories=cats, top_kernels=rows[:40])


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen3-moe-tiny", choices=sorted(MODELS))
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=0, help="steps excluded from the timing summary")
    p.add_argument("--batch-size", type=int, default=2, help="micro-batch size per rank")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--metrics-out", default=None, help="write per-step metrics as JSON here")
    p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--profile-out", default=None,
                   help="after the timed steps, profile one more step and write a per-kernel breakdown here")
    p = deepspeed.add_config_arguments(p)
    return p.parse_args(argv)


def load_config(path: str, batch_size: int, cuda: bool) -> dict:
    with open(path) as f:
        cfg = json.load(f)
    cfg.pop("train_batch_size", None)
    cfg["train_micro_batch_size_per_gpu"] = batch_size
    if not cuda:
        for key in ("bf16", "fp16"):
            if cfg.get(key, {}).get("enabled"):
                print(f"[train] no GPU: turning {key} off (CPU run in fp32)")
                cfg[key]["enabled"] = False
    return cfg


def note_cpu_op_build() -> None:
    """On CPU, ``deepspeed.init_distributed`` compiles DeepSpeed's shm_comm op the first time
    (about 2.5 minutes without any output): say so before it starts."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        name = "deepspeed_shm_comm"
        built = os.path.exists(os.path.join(_get_build_directory(name, verbose=False), f"{name}.so"))
    except Exception:
        built = False
    if not built and int(os.environ.get("RANK", "0")) == 0:
        print("[train] first CPU run: DeepSpeed now compiles its shm_comm op (about 2-3 minutes without output; "
              "later runs reuse it)", flush=True)


def main(argv=None) -> dict:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank) if cuda else torch.device("cpu")
    if not args.deepspeed_config:
        raise SystemExit("pass --deepspeed_config configs/fused_all.json (or another file in configs/)")
    ds_config = load_config(args.deepspeed_config, args.batch_size, cuda)
    bf16 = ds_config.get("bf16", {}).get("enabled", False)
    dtype = torch.bfloat16 if bf16 else torch.float32

    if not cuda:
        note_cpu_op_build()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = deepspeed.comm.get_rank()
    with torch.device(device):
        model = build_model(args.model, dtype=dtype, seed=args.seed)
    vocab = model.config.vocab_size
    opt_kw = dict(lr=args.lr, weight_decay=0.0, **({"fused": True} if cuda else {}))
    if ds_config.get("expert_parallel", {}).get("enabled"):
        # AutoEP replaces the MoE blocks inside initialize: build the optimizer afterwards, from
        # the new parameters, with the MoE parameter groups ZeRO asks for.
        from deepspeed.moe.utils import configure_moe_param_groups

        optimizer = lambda params: torch.optim.AdamW(configure_moe_param_groups(list(params)), **opt_kw)  # noqa: E731
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **opt_kw)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
    report = getattr(engine, "deepspeed_fused_report", None)
    if rank == 0:
        n_params = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters())
        print(f"[train] model {args.model}: {n_params / 1e6:.1f} M parameters, dtype {dtype}, device {device}, "
              f"ZeRO stage {engine.zero_optimization_stage()}, world size {deepspeed.comm.get_world_size()}")
        if report is None:  # the hook showed the report (unless the section's show_report is false)
            print("[train] deepspeed_fused hook did not run")

    tokens_per_step = args.batch_size * args.seq_len * deepspeed.comm.get_world_size()
    history = []
    try:
        from tqdm import tqdm
        bar = tqdm(total=args.steps, disable=args.no_progress or rank != 0, desc="train", dynamic_ncols=True)
    except ImportError:  # pragma: no cover
        bar = None
    engine.train()
    for step in range(args.steps):
        ids = synthetic_batch(step * deepspeed.comm.get_world_size() + rank, args.batch_size, args.seq_len, vocab,
                              args.seed, device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        out = engine(input_ids=ids, labels=ids)
        engine.backward(out.loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        loss = float(out.loss.detach().float())
        rec = dict(step=step, loss=loss, step_s=dt, tokens_per_s=tokens_per_step / dt,
                   peak_alloc_mib=torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
                   peak_reserved_mib=torch.cuda.max_memory_reserved() / 2**20 if cuda else None)
        history.append(rec)
        if rank == 0:
            mem = f", peak {rec['peak_alloc_mib']:.0f} MiB" if cuda else ""
            msg = f"[train] step {step:4d}  loss {loss:.4f}  {dt * 1e3:8.1f} ms  {rec['tokens_per_s']:9.0f} tok/s{mem}"
            (bar.write(msg) if bar is not None else print(msg))
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    breakdown = None
    if args.profile_out and rank == 0:
        breakdown = profile_step(engine, synthetic_batch(args.steps, args.batch_size, args.seq_len, vocab, args.seed,
                                                         device))
        with open(args.profile_out, "w") as f:
            json.dump(breakdown, f, indent=1)
    timed = history[args.warmup:] or history
    summary = dict(model=args.model, config=args.deepspeed_config, steps=args.steps, warmup=args.warmup,
                   tokens_per_step=tokens_per_step,
                   median_step_s=statistics.median(r["step_s"] for r in timed),
                   median_tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
                   peak_alloc_mib=max((r["peak_alloc_mib"] or 0) for r in history) if cuda else None,
                   peak_reserved_mib=max((r["peak_reserved_mib"] or 0) for r in history) if cuda else None,
                   report=report.to_dict() if report is not None else None, history=history,
                   breakdown=breakdown)
    if rank == 0:
        print(f"[train] done: median step {summary['median_step_s'] * 1e3:.1f} ms, "
              f"{summary['median_tokens_per_s']:.0f} tok/s, final loss {history[-1]['loss']:.4f}")
        if args.metrics_out:
            with open(args.metrics_out, "w") as f:
                json.dump(summary, f, indent=1, default=str)
    return summary


if __name__ == "__main__":
    main()
