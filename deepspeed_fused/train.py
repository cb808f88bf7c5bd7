"""The example training job: a Hugging Face causal LM through deepspeed.initialize, with the plugin.

    deepspeed --module deepspeed_fused.train --deepspeed_config configs/fused_all.json --model qwen3-moe-tiny --steps 20
    deepspeed examples/train.py ...   # the same job from a clone (a wrapper of this module)

``--deepspeed_config`` is a file; a path that does not exist but names one of the configs shipped
with the package (``configs/fused_all.json``, ``baseline.json``, ...: ``deepspeed_fused/configs/``)
runs that one, so the command above works from any directory once the package is installed.

The model is built from a named config with random weights (no hub access) and fed synthetic
token batches (a learnable bigram-like stream, the same for every run with the same seed). Each
step prints the loss, step time, tokens/s and peak GPU memory (with ``gradient_accumulation_steps``
above 1 in the config, a step is one optimizer step of that many micro-steps: the mean of their
losses, the tokens of all of them, and the median forward+backward time of one); the feature report is shown once,
by the plugin's hook, after initialisation, and the calls of each feature (fused, torch reference,
eager) at the end. On a CPU-only machine bf16 is turned off, the features that need the kernels
are not applied and the loss runs the op's torch reference (the report says so); the first CPU run
waits a few minutes, silent, while DeepSpeed compiles its shm_comm op (said before it starts).
A progress bar is shown only on a terminal.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Optional

import deepspeed
import torch

import deepspeed_fused  # noqa: F401  (installs the deepspeed.initialize hook)
from deepspeed_fused.models import MODELS, build_model
from deepspeed_fused.shipped import CONFIGS_DIR, resolve_config  # noqa: F401  (CONFIGS_DIR: importable here too)


def find_config(path: str) -> str:
    """``path`` if it exists, else the shipped config of that name (``configs/fused_all.json``,
    ``fused_all.json`` or ``fused_all``); SystemExit naming the shipped ones otherwise."""
    try:
        return resolve_config(path)
    except FileNotFoundError as e:
        raise SystemExit(f"--deepspeed_config {e}") from None


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


def profile_step(engine, batches, trace_out=None) -> dict:
    """One optimizer step under the torch profiler (``batches``: its micro-batches, one per
    gradient-accumulation micro-step): kernel time per category, each kernel once
    (``deepspeed_fused.bench.breakdown``: ranges around the modules the features replace and
    around DeepSpeed's work, our kernels by name), and per micro-step the kernel time launched
    during its forward+backward. On CPU, leaf CPU ops stand for kernels."""
    from deepspeed_fused.bench.breakdown import micro_step_range
    from deepspeed_fused.bench.breakdown import profile_step as run

    def step():
        for ids in batches:
            with micro_step_range():
                out = engine(input_ids=ids, labels=ids)
                engine.backward(out.loss)
            engine.step()

    return run(step, engine, device=torch.cuda.is_available(), trace_out=trace_out)


def accumulation_steps(engine) -> int:
    """The engine's ``gradient_accumulation_steps`` (micro-steps per optimizer step)."""
    fn = getattr(engine, "gradient_accumulation_steps", None)
    return int(fn()) if callable(fn) else 1


def micro_batches(step: int, accum: int, batch: int, args, world: int, rank: int, vocab: int, device) -> list:
    """The ``accum`` micro-batches of optimizer step ``step`` on this rank: micro-batch index
    ``(step * accum + m) * world + rank`` (with one micro-step, the index each step always had)."""
    return [synthetic_batch((step * accum + m) * world + rank, batch, args.seq_len, vocab, args.seed, device)
            for m in range(accum)]


def apply_liger(model_name: str, swiglu: bool, defaults: bool = False) -> str:
    """Liger-Kernel's patches for the model's type, before the model is built: RoPE, RMSNorm and
    the fused linear cross-entropy; its SwiGLU/experts only with ``swiglu``; with ``defaults`` the
    patch function's own defaults (``apply_liger_kernel_to_<family>()``: for the dense families
    also its SwiGLU or GeGLU MLP). Returns a description."""
    from importlib.metadata import version

    from liger_kernel.transformers import monkey_patch

    from deepspeed_fused.models import model_config

    model_type = model_config(model_name).model_type
    fn = monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if fn is None:
        raise SystemExit(f"liger-kernel {version('liger_kernel')} has no patch for {model_type}")
    if defaults:
        fn()
        return f"liger-kernel {version('liger_kernel')}: {fn.__name__}() (its defaults)"
    kw = dict(rope=True, rms_norm=True, fused_linear_cross_entropy=True, swiglu=swiglu)
    fn(**kw)
    return f"liger-kernel {version('liger_kernel')}: {fn.__name__}({', '.join(f'{k}={v}' for k, v in kw.items())})"


def enable_grad_ckpt(model, mode: str) -> None:
    """Hugging Face gradient checkpointing (``mode``: "off", "non-reentrant", "reentrant"): each
    decoder layer's activations recomputed in the backward, through transformers' own
    ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` in transformers before 5.25)
    with ``torch.utils.checkpoint``'s ``use_reentrant`` false or true."""
    if not _grad_ckpt_on(mode):
        return
    model.config.use_cache = False
    kw = {"use_reentrant": mode == "reentrant"}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kw)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kw)


def _grad_ckpt_on(mode: str) -> bool:
    if mode not in ("off", "non-reentrant", "reentrant"):
        raise ValueError(f"grad_ckpt: expected off, non-reentrant or reentrant, got {mode!r}")
    return mode != "off"


def trainer_grad_ckpt_args(mode: str) -> dict:
    """The Hugging Face Trainer's arguments for gradient checkpointing ``mode`` (as
    :func:`enable_grad_ckpt`), under the names the installed transformers takes
    (``activation_checkpointing`` from 5.25 on, ``gradient_checkpointing`` before)."""
    import dataclasses

    from transformers import TrainingArguments

    on = _grad_ckpt_on(mode)
    name = "activation_checkpointing" if "activation_checkpointing" in {
        f.name for f in dataclasses.fields(TrainingArguments)} else "gradient_checkpointing"
    return {name: on, f"{name}_kwargs": {"use_reentrant": mode == "reentrant"}}


def is_oom(e: BaseException) -> bool:
    return isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower()


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
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (there is none either when stderr is not a terminal, e.g. a log file)")
    p.add_argument("--profile-out", default=None,
                   help="after the timed steps, profile one more step and write its GPU time per category here")
    p.add_argument("--trace-out", default=None, help="keep the profiled step's Chrome trace here")
    p.add_argument("--liger", action="store_true",
                   help="apply Liger-Kernel (RoPE, RMSNorm, fused linear cross-entropy) before building the model")
    p.add_argument("--liger-swiglu", action="store_true", help="with --liger: also Liger's SwiGLU/experts")
    p.add_argument("--liger-defaults", action="store_true",
                   help="with --liger: the patch function's own defaults (apply_liger_kernel_to_<family>())")
    p.add_argument("--grad-ckpt", default="off", choices=("off", "non-reentrant", "reentrant"),
                   help="Hugging Face gradient checkpointing of the decoder layers "
                        "(model.gradient_checkpointing_enable, use_reentrant false or true)")
    p.add_argument("--batch-sizes", default=None,
                   help="search mode: comma-separated ascending micro-batch sizes, each run for --steps steps "
                        "(--warmup of them untimed) in this process; the first that runs out of memory is "
                        "recorded and ends the run (exit code 0)")
    p.add_argument("--dump-stacks-after", type=float, default=None,
                   help="print every thread's Python stack to stderr after this many seconds (for a job that "
                        "may hang under a time limit)")
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


def progress_bar(args, rank: int):
    """The progress bar of rank 0 on a terminal, else None (a log file gets the per-step lines only:
    a bar redrawn with carriage returns between them would garble it). While the bar is shown the
    per-step lines go through ``tqdm.write``, above it."""
    import sys

    if args.no_progress or rank != 0 or not (sys.stderr.isatty() and sys.stdout.isatty()):
        return None
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        return None
    return tqdm(total=args.steps, desc="train", dynamic_ncols=True)


def run_steps(engine, args, batch: int, steps: int, rank: int, device, vocab: int, bar=None) -> list:
    """``steps`` optimizer steps of micro-batch ``batch``, each ``gradient_accumulation_steps``
    micro-steps (forward, ``engine.backward``, ``engine.step``: DeepSpeed steps the optimizer at
    the last); one record per optimizer step: its wall time (synchronized at both ends), the
    tokens/s of all its micro-batches, the mean loss of its micro-steps and, per micro-step, the
    loss and the forward+backward time (on a GPU: CUDA events on the current stream around the
    forward and ``engine.backward``, no synchronization between micro-steps)."""
    cuda = device.type == "cuda"
    world = deepspeed.comm.get_world_size()
    accum = accumulation_steps(engine)
    tokens_per_step = batch * args.seq_len * world * accum
    history = []
    for step in range(steps):
        batches = micro_batches(step, accum, batch, args, world, rank, vocab, device)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        marks, losses = [], []
        t0 = time.perf_counter()
        for ids in batches:
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                start = time.perf_counter()
            out = engine(input_ids=ids, labels=ids)
            engine.backward(out.loss)
            if cuda:
                end.record()
            else:
                end = time.perf_counter()
            marks.append((start, end))
            losses.append(out.loss.detach())
            del out
            engine.step()
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        fb = [s.elapsed_time(e) / 1e3 if cuda else e - s for s, e in marks]
        micro_losses = [float(x.float()) for x in losses]
        loss = sum(micro_losses) / len(micro_losses)
        del batches, losses
        rec = dict(step=step, loss=loss, step_s=dt, tokens_per_s=tokens_per_step / dt,
                   peak_alloc_mib=torch.cuda.max_memory_allocated() / 2**20 if cuda else None,
                   peak_reserved_mib=torch.cuda.max_memory_reserved() / 2**20 if cuda else None,
                   micro_fb_s=fb, micro_losses=micro_losses)
        history.append(rec)
        if rank == 0:
            mem = f", peak {rec['peak_alloc_mib']:.0f} MiB" if cuda else ""
            acc = f"  ({accum} micro-steps, fwd+bwd {statistics.median(fb) * 1e3:.1f} ms each)" if accum > 1 else ""
            msg = (f"[train] step {step:4d}  loss {loss:.4f}  {dt * 1e3:8.1f} ms  {rec['tokens_per_s']:9.0f} tok/s{mem}"
                   + acc + (f"  (micro-batch {batch})" if args.batch_sizes else ""))
            (bar.write(msg) if bar is not None else print(msg, flush=True))
            if bar is not None:
                bar.update(1)
    return history


def summarize(history: list, warmup: int) -> dict:
    """Medians over the timed steps (after ``warmup``): the optimizer step's time and tokens/s,
    the forward+backward time of one micro-step (over every micro-step of those steps); peaks over
    all steps."""
    timed = history[warmup:] or history
    cuda = history and history[0]["peak_alloc_mib"] is not None
    fb = [x for r in timed for x in r.get("micro_fb_s") or []]
    return dict(median_step_s=statistics.median(r["step_s"] for r in timed),
                median_tokens_per_s=statistics.median(r["tokens_per_s"] for r in timed),
                median_micro_fb_s=statistics.median(fb) if fb else None,
                peak_alloc_mib=max((r["peak_alloc_mib"] or 0) for r in history) if cuda else None,
                peak_reserved_mib=max((r["peak_reserved_mib"] or 0) for r in history) if cuda else None)


def free_memory(engine) -> None:
    """What a step that ran out of memory left behind: gradients and cached blocks."""
    import gc

    try:
        engine.zero_grad()
    except Exception:
        pass
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _allocated_mib(device) -> Optional[float]:
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None


def search(engine, args, rank: int, device, vocab: int, write=None) -> dict:
    """Search mode: the listed micro-batch sizes in ascending order, in this process, until one
    runs out of memory (recorded, memory freed, the run ends) or fails otherwise (recorded).
    Each trial records ``allocated_after_mib``, the GPU memory still allocated once its memory
    was freed (the model and optimizer state: no more after an out-of-memory size than after
    one that ran). ``write(trials)`` is called after each size, so a crash still leaves the sizes
    before it."""
    sizes = [int(x) for x in args.batch_sizes.split(",") if x.strip()]
    accum = accumulation_steps(engine)
    trials = []
    for b in sizes:
        if write is not None:
            write(trials)
        if hasattr(engine, "set_train_micro_batch_size"):
            engine.set_train_micro_batch_size(b)
        failed = None
        try:
            history = run_steps(engine, args, b, args.steps, rank, device, vocab)
        except Exception as e:  # noqa: BLE001 - an OOM is a result of the search, not an error
            failed = dict(batch=b, status="oom" if is_oom(e) else "error",
                          error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}")
        if failed is not None:
            # outside the except block: the exception, its frames and their tensors are gone now
            trials.append(failed)
            free_memory(engine)
            failed["allocated_after_mib"] = _allocated_mib(device)
            if rank == 0:
                print(f"[train] micro-batch {b}: {'out of memory' if failed['status'] == 'oom' else 'failed'} "
                      f"({failed['error']})", flush=True)
            break
        total = torch.cuda.get_device_properties(device).total_memory / 2**20 if device.type == "cuda" else None
        trials.append(dict(batch=b, status="ok", gradient_accumulation_steps=accum, **summarize(history, args.warmup),
                           final_loss=history[-1]["loss"], device_total_mib=total, history=history))
        del history
        if rank == 0:
            t = trials[-1]
            print(f"[train] micro-batch {b}: median {t['median_step_s'] * 1e3:.1f} ms, "
                  f"{t['median_tokens_per_s']:.0f} tok/s", flush=True)
        free_memory(engine)
        trials[-1]["allocated_after_mib"] = _allocated_mib(device)
    if write is not None:
        write(trials)
    return dict(trials=trials)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.dump_stacks_after:
        import faulthandler

        faulthandler.dump_traceback_later(args.dump_stacks_after, exit=False)
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(args.local_rank)
    device = torch.device("cuda", args.local_rank) if cuda else torch.device("cpu")
    if not args.deepspeed_config:
        raise SystemExit("pass --deepspeed_config configs/fused_all.json (or another file in configs/)")
    config_path = find_config(args.deepspeed_config)
    if config_path != args.deepspeed_config and int(os.environ.get("RANK", "0")) == 0:
        print(f"[train] {args.deepspeed_config}: the shipped {config_path}", flush=True)
    sizes = [int(x) for x in args.batch_sizes.split(",")] if args.batch_sizes else None
    ds_config = load_config(config_path, sizes[0] if sizes else args.batch_size, cuda)
    bf16 = ds_config.get("bf16", {}).get("enabled", False)
    dtype = torch.bfloat16 if bf16 else torch.float32

    liger = apply_liger(args.model, args.liger_swiglu, args.liger_defaults) if args.liger else None
    if not cuda:
        note_cpu_op_build()
    deepspeed.init_distributed(dist_backend="nccl" if cuda else "gloo")
    rank = deepspeed.comm.get_rank()
    if liger and rank == 0:
        print(f"[train] {liger}", flush=True)
    with torch.device(device):
        model = build_model(args.model, dtype=dtype, seed=args.seed)
    enable_grad_ckpt(model, args.grad_ckpt)
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
              f"ZeRO stage {engine.zero_optimization_stage()}, world size {deepspeed.comm.get_world_size()}",
              flush=True)
        if report is None:  # the hook showed the report (unless the section's show_report is false)
            print("[train] deepspeed_fused hook did not run")
    engine.train()
    common = dict(model=args.model, config=args.deepspeed_config, liger=liger, seq_len=args.seq_len,
                  grad_ckpt=args.grad_ckpt,
                  world_size=deepspeed.comm.get_world_size(), report=report.to_dict() if report is not None else None)

    if sizes:
        def write(trials):
            if rank == 0 and args.metrics_out:
                with open(args.metrics_out + ".tmp", "w") as f:
                    json.dump(dict(common, steps=args.steps, warmup=args.warmup, trials=trials), f, indent=1,
                              default=str)
                os.replace(args.metrics_out + ".tmp", args.metrics_out)

        return dict(common, steps=args.steps, warmup=args.warmup, **search(engine, args, rank, device, vocab, write))

    accum = accumulation_steps(engine)
    tokens_per_step = args.batch_size * args.seq_len * deepspeed.comm.get_world_size() * accum
    bar = progress_bar(args, rank)
    history = run_steps(engine, args, args.batch_size, args.steps, rank, device, vocab, bar)
    if bar is not None:
        bar.close()
    breakdown = None
    if args.profile_out:  # every rank steps (collectives), rank 0's profile is written
        batches = micro_batches(args.steps, accum, args.batch_size, args, deepspeed.comm.get_world_size(), rank,
                                vocab, device)
        breakdown = profile_step(engine, batches, args.trace_out if rank == 0 else None)
        if rank == 0:
            with open(args.profile_out, "w") as f:
                json.dump(breakdown, f, indent=1)
    summary = dict(common, steps=args.steps, warmup=args.warmup, tokens_per_step=tokens_per_step,
                   gradient_accumulation_steps=accum,
                   **summarize(history, args.warmup), history=history, breakdown=breakdown)
    if report is not None:
        summary["report"] = report.to_dict()  # with the call counts of the run
    if rank == 0:
        print(f"[train] done: median step {summary['median_step_s'] * 1e3:.1f} ms, "
              f"{summary['median_tokens_per_s']:.0f} tok/s, final loss {history[-1]['loss']:.4f}"
              + (f"; {accum} micro-steps per optimizer step, fwd+bwd {summary['median_micro_fb_s'] * 1e3:.1f} ms "
                 "each (median)" if accum > 1 else ""))
        counted = [f"{f.name} {f.calls}" for f in (report.features if report is not None else [])
                   if f.applied and f.calls is not None]
        if counted:  # what ran: our kernels (fused), the ops' torch references, the model's own code (eager)
            print(f"[train] deepspeed_fused calls: {'; '.join(counted)}")
        if args.metrics_out:
            with open(args.metrics_out, "w") as f:
                json.dump(summary, f, indent=1, default=str)
    return summary


if __name__ == "__main__":
    main()
