"""Suite ``tp_cross_entropy``: the vocabulary-parallel fused linear cross-entropy over a TP group.

    python -m torch.distributed.run --nproc_per_node 2 -m deepspeed_fused.bench tp_cross_entropy --out DIR
    python -m deepspeed_fused.bench tp_cross_entropy --out DIR        # one process: the TP1 rows only

Every process of the run is one rank of the tensor-parallel group (the whole world: TP size =
the number of processes; each process takes the GPU of its ``LOCAL_RANK``). Rank 0 writes
``tp_cross_entropy.{json,md,png}`` under ``--out`` (default ``docs/benchmarks/``).

Shapes (tokens M x hidden H x vocabulary V, bf16, mean loss, every 7th target ignored): M in
{4096, 8192, 16384} at H=4096, V=131072; the Qwen3-30B-A3B head (8192 x 2048 x 151936) and the
Llama-4 head (8192 x 5120 x 202048). ``--quick``: one small shape (2048 x 2048 x 32768) and
fewer repetitions. On a machine without CUDA the shapes are tiny (a smoke run of the logic).

Rows per shape:

* ``ours TP1``: the single-GPU op on the full vocabulary, run by every rank at once, each on
  its own GPU with the full head (no collective inside);
* ``ours TP<n>`` (n > 1): the op with ``tp_group`` (the world), each rank a vocabulary shard;
* ``DeepSpeed vocab_parallel_linear_cross_entropy`` (``deepspeed.sequence.linear_cross_entropy``,
  DeepSpeed's fused vocab-parallel loss), at the run's TP size;
* ``DeepSpeed logits GEMM + vocab_parallel_cross_entropy``: the shard's logits as a DeepSpeed
  user computes them (``hidden @ weight_shard.T``, the GEMM behind an identity whose backward
  all-reduces dhidden, as a column-parallel head does), then DeepSpeed's logits-based
  vocab-parallel loss; GEMM and loss timed together.

Timing: for each call every rank first synchronizes its GPU and meets the others (a one-element
all-reduce), then the host clock runs around the call and a device synchronize (host-inclusive),
and CUDA events on the current stream give the device time of the call. The median over
``--reps`` calls after ``--warmup``; the slowest rank's median is reported. Forward: the loss under
``torch.no_grad()``; forward+backward: the loss and ``backward()`` (gradients of hidden and the
weight, or its shard). Per-GPU TFLOP/s count the useful GEMM work of one GPU: ``2 M H V_local``
forward, three times that forward+backward. Efficiency of a TP<n> row: TP1 time / (n x TP<n> time)
(1.0 = perfect scaling). Peak extra memory: the largest over the ranks of the peak allocated
during one forward+backward above what was allocated before it. Correctness: each row's loss,
dhidden and dweight shard against the TP1 op's on the same inputs (relative norm of the
difference; TP1 is the reference).

Flags after the suite name: ``--reps N`` (default 20; 5 with ``--quick``), ``--warmup N``
(default 3), ``--no-deepspeed`` (only our rows).
"""
from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time
from typing import Callable, Optional

import torch

from ..ops.linear_cross_entropy import linear_cross_entropy
from ..ops.linear_cross_entropy.group import CopyToGroup
from .common import Record, env_fields, write_results

SUITE = "tp_cross_entropy"
TITLE = "vocabulary-parallel fused linear cross-entropy (TP1 vs TP<n>, DeepSpeed's vocab-parallel losses)"
# (label, M, H, V)
SHAPES = [("8192x4096x131072", 8192, 4096, 131072),
          ("4096x4096x131072", 4096, 4096, 131072),
          ("16384x4096x131072", 16384, 4096, 131072),
          ("8192x2048x151936 (Qwen3-30B-A3B head)", 8192, 2048, 151936),
          ("8192x5120x202048 (Llama-4 head)", 8192, 5120, 202048)]
QUICK_SHAPES = [("2048x2048x32768", 2048, 2048, 32768)]
CPU_SHAPES = [("16x8x64", 16, 8, 64)]
# targets: forward+backward efficiency TP1 / (n x TP<n>) and the speed-up over DeepSpeed's fused loss
EFF_TARGET = {"8192x4096x131072": 0.92}
EFF_TARGET_DEFAULT = 0.90
VS_DEEPSPEED_TARGET = 2.0
DS_FUSED = "DeepSpeed vocab_parallel_linear_cross_entropy"
DS_LOGITS = "DeepSpeed logits GEMM + vocab_parallel_cross_entropy"


def ours_name(tp: int) -> str:
    return "ours TP1: single-GPU op, full vocabulary" if tp == 1 else f"ours TP{tp}: tp_group, vocabulary shard"


# ---------------------------------------------------------------------------------------------
# Process group
# ---------------------------------------------------------------------------------------------

def init_group():
    """(the world process group, this rank's device, whether this call created the group): from
    torchrun's environment, else a group of this process alone, unless one exists. DeepSpeed's
    comm layer is initialized on top (its losses call it)."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    created = not dist.is_initialized()
    if created:
        backend = "nccl" if cuda else "gloo"
        timeout = datetime.timedelta(seconds=300)  # a rank stuck in a collective fails instead of hanging
        if "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    try:
        import deepspeed.comm

        deepspeed.comm.init_distributed(dist_backend=dist.get_backend(), verbose=False)
    except Exception as e:  # the DeepSpeed rows then record the failure
        print(f"[tp_cross_entropy] deepspeed.comm not initialized: {type(e).__name__}: {e}")
    return dist.group.WORLD, device, created


# ---------------------------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------------------------

def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _meet(device):
    """Every rank's GPU idle, then every rank here (one-element all-reduce over the world)."""
    import torch.distributed as dist

    _sync(device)
    x = torch.zeros(1, device=device)
    dist.all_reduce(x)
    _sync(device)


def _max_over_ranks(vals: list, device) -> list:
    """Element-wise maximum over the world's ranks (None stays None: encoded as NaN)."""
    import torch.distributed as dist

    t = torch.tensor([float("nan") if v is None else float(v) for v in vals], dtype=torch.float64, device=device)
    t = torch.nan_to_num(t, nan=-1.0)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [None if x < 0 else x for x in t.tolist()]


def time_call(fn: Callable[[], object], device, warmup: int, reps: int) -> tuple:
    """(host-inclusive ms, device ms or None): medians over ``reps`` calls after ``warmup``, each
    call started by every rank together; the slowest rank's medians."""
    for _ in range(warmup):
        fn()
    host, dev = [], []
    cuda = device.type == "cuda"
    for _ in range(reps):
        _meet(device)
        if cuda:
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        if cuda:
            e0.record()
        fn()
        if cuda:
            e1.record()
        _sync(device)
        host.append((time.perf_counter() - t0) * 1e3)
        if cuda:
            dev.append(e0.elapsed_time(e1))
    return tuple(_max_over_ranks([statistics.median(host), statistics.median(dev) if dev else None], device))


def peak_extra(fn: Callable[[], object], device) -> Optional[float]:
    """The largest over the ranks of the peak MiB allocated during ``fn()`` above the allocation
    before it (None without CUDA)."""
    if device.type != "cuda":
        return None
    _meet(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    fn()
    _sync(device)
    mib = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    return _max_over_ranks([mib], device)[0]


# ---------------------------------------------------------------------------------------------
# Implementations
# ---------------------------------------------------------------------------------------------

def implementations(tp: int, group, start: int, end: int, deepspeed_peers: bool = True) -> dict:
    """name -> (loss fn (h, w) -> scalar, uses the full head?, ours?) at TP size ``tp``."""
    impls = {ours_name(1): (lambda h, w, t: linear_cross_entropy(h, w, t), True, True)}
    tpg = group if tp > 1 else None
    if tp > 1:
        impls[ours_name(tp)] = (lambda h, w, t: linear_cross_entropy(h, w, t, tp_group=group, vocab_start=start),
                                False, True)
    if deepspeed_peers:
        def ds_fused(h, w, t):
            from deepspeed.sequence.linear_cross_entropy import vocab_parallel_linear_cross_entropy

            kw = dict(vocab_start_index=start, vocab_end_index=end) if tpg is not None else {}
            return vocab_parallel_linear_cross_entropy(h, w, t, tp_group=tpg, **kw)

        def ds_logits(h, w, t):
            from deepspeed.sequence.cross_entropy import vocab_parallel_cross_entropy

            # identity forward, gradient summed over the TP group (a column-parallel head's input)
            x = CopyToGroup.apply(h, tpg, False) if tpg is not None and h.requires_grad else h
            logits = x @ w.t()
            kw = dict(vocab_start_index=start, vocab_end_index=end) if tpg is not None else {}
            return vocab_parallel_cross_entropy(logits, t, tp_group=tpg, **kw)

        impls[f"{DS_FUSED} (TP{tp})"] = (ds_fused, False, False)
        impls[f"{DS_LOGITS} (TP{tp})"] = (ds_logits, False, False)
    return impls


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


# ---------------------------------------------------------------------------------------------
# The suite
# ---------------------------------------------------------------------------------------------

def run_shape(label: str, M: int, H: int, V: int, group, device, dtype, warmup: int, reps: int,
              deepspeed_peers: bool = True) -> list:
    """Every row of one shape (collective: every rank of ``group`` calls it); identical records on
    every rank."""
    import torch.distributed as dist

    tp, rank = dist.get_world_size(group), dist.get_rank(group)
    v_local = -(-V // tp)
    start, end = min(V, rank * v_local), min(V, (rank + 1) * v_local)  # the last shard may be shorter
    g = torch.Generator(device=device).manual_seed(0)  # the same inputs on every rank
    h = (torch.randn(M, H, device=device, generator=g) * 0.5).to(dtype).requires_grad_()
    w_full = (torch.randn(V, H, device=device, generator=g) * 0.02).to(dtype).requires_grad_()
    t = torch.randint(0, V, (M,), device=device, generator=g)
    t[::7] = -100
    w_shard = w_full.detach()[start:end].clone().requires_grad_()
    env = env_fields()
    recs = []
    ref = None
    for name, (fn, full, ours) in implementations(tp, group, start, end, deepspeed_peers).items():
        w = w_full if full else w_shard
        rec = Record(suite=SUITE, impl=name, shape=label, dtype=str(dtype).replace("torch.", ""), ours=ours,
                     unit="TFLOP/s", **env)
        vl = V if full else end - start
        rec.extra.update(tp=1 if full else tp, V_local=vl)
        flops = 2.0 * M * H * vl

        def fwd():
            with torch.no_grad():
                return fn(h, w, t)

        def fwd_bwd():
            h.grad = w.grad = None
            fn(h, w, t).backward()

        try:
            fwd_bwd()  # correctness (and the first call's compilation) on the same inputs
            dh = h.grad.detach().clone()
            dw = (w.grad.detach()[start:end] if full else w.grad.detach()).clone()
            with torch.no_grad():
                loss = fn(h, w, t).detach().float()
            if name == ours_name(1):  # the TP1 op: the reference of every row
                ref = (loss, dh, dw)
                rec.extra.update(err_loss=0.0, err_dhidden=0.0, err_dweight=0.0, reference=True)
            elif ref is not None:
                rec.extra.update(err_loss=_rel(loss, ref[0]), err_dhidden=_rel(dh, ref[1]),
                                 err_dweight=_rel(dw, ref[2]))
            del dh, dw
            h.grad = w.grad = None
            rec.fwd_ms, rec.extra["fwd_device_ms"] = time_call(fwd, device, warmup, reps)
            rec.fwd_bwd_ms, rec.extra["fwd_bwd_device_ms"] = time_call(fwd_bwd, device, warmup, reps)
            rec.peak_extra_mib = peak_extra(fwd_bwd, device)
            h.grad = w.grad = None
            rec.fwd_rate = flops / rec.fwd_ms / 1e9 if rec.fwd_ms else None
            rec.fwd_bwd_rate = 3 * flops / rec.fwd_bwd_ms / 1e9 if rec.fwd_bwd_ms else None
            rec.extra["fwd_device_rate"] = (flops / rec.extra["fwd_device_ms"] / 1e9
                                            if rec.extra.get("fwd_device_ms") else None)
            rec.extra["fwd_bwd_device_rate"] = (3 * flops / rec.extra["fwd_bwd_device_ms"] / 1e9
                                                if rec.extra.get("fwd_bwd_device_ms") else None)
        except Exception as e:  # a peer that fails at a shape is reported, not fatal
            rec.note = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
            h.grad = w.grad = None
            if device.type == "cuda":
                torch.cuda.empty_cache()
        recs.append(rec)
    # make the records agree across ranks: a row that failed on any rank is failed on every rank,
    # and the errors are the largest over the ranks (each rank checks its own dweight shard)
    keys = ("err_loss", "err_dhidden", "err_dweight")
    vals = _max_over_ranks([x for r in recs for x in [1.0 if r.note.startswith("failed") else 0.0]
                            + [r.extra.get(k) for k in keys]], device)
    for i, r in enumerate(recs):
        f, errs = vals[4 * i], vals[4 * i + 1:4 * i + 4]
        if f and not r.note.startswith("failed"):
            r.note = "failed on another rank"
            r.fwd_ms = r.fwd_bwd_ms = r.fwd_rate = r.fwd_bwd_rate = r.peak_extra_mib = None
        for k, v in zip(keys, errs):
            if v is not None:
                r.extra[k] = v
    _derive(recs, tp)
    del h, w_full, w_shard, t, ref
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return recs


def _derive(recs: list, tp: int) -> None:
    """Efficiency of the TP rows against the TP1 op, our speed-up over each DeepSpeed row, notes."""
    base = recs[0]
    ours_tp = next((r for r in recs if r.ours and r.extra.get("tp", 1) == tp), None)
    for r in recs:
        parts = []
        n = r.extra.get("tp", 1)
        if r.ours and n > 1 and not r.note:
            for key, attr in (("efficiency_fwd_bwd", "fwd_bwd_ms"), ("efficiency_fwd", "fwd_ms")):
                b, x = getattr(base, attr), getattr(r, attr)
                r.extra[key] = b / (n * x) if b and x else None
            dev_b, dev_x = base.extra.get("fwd_bwd_device_ms"), r.extra.get("fwd_bwd_device_ms")
            r.extra["efficiency_fwd_bwd_device"] = dev_b / (n * dev_x) if dev_b and dev_x else None
            if r.extra["efficiency_fwd_bwd"] is not None:
                parts.append(f"efficiency {r.extra['efficiency_fwd_bwd']:.3f} (fwd+bwd)")
        if not r.ours and ours_tp is not None and r.fwd_bwd_ms and ours_tp.fwd_bwd_ms:
            r.extra["ours_speedup_fwd_bwd"] = r.fwd_bwd_ms / ours_tp.fwd_bwd_ms
            parts.append(f"ours TP{tp} {r.extra['ours_speedup_fwd_bwd']:.2f}x faster (fwd+bwd)")
        if "err_loss" in r.extra and not r.extra.get("reference"):
            parts.append(f"rel. err. loss {r.extra['err_loss']:.1e}, dX {r.extra['err_dhidden']:.1e}, "
                         f"dW {r.extra['err_dweight']:.1e}")
        elif r.extra.get("reference"):
            parts.append("reference of the errors")
        if r.note:
            parts.append(r.note)
        r.note = "; ".join(parts)


def summary(records: list, tp: int) -> str:
    """The notes of the markdown: what the rows are, the targets and whether they are met."""
    lines = [f"TP size of this run: {tp} (one process per GPU). Times: host-inclusive medians, each call "
             "started by every rank together, the slowest rank's; device times (CUDA events) are in the JSON "
             "(`fwd_device_ms`, `fwd_bwd_device_ms`). Rates: per-GPU useful GEMM TFLOP/s (2 M H V_local forward, "
             "3x that forward+backward). Efficiency: TP1 time / (TP size x TP time). Errors: relative norm "
             "against the TP1 op on the same inputs (loss, dhidden, this rank's dweight rows). "
             "Ratios 'vs best peer' compare wall times per call across TP sizes as they are.", ""]
    if tp == 1:
        return "\n".join(lines + ["One process: the TP1 rows only (run it under torch.distributed.run for TP > 1)."])
    lines += [f"Targets: forward+backward efficiency >= {EFF_TARGET['8192x4096x131072']} at "
              f"8192x4096x131072 and >= {EFF_TARGET_DEFAULT} at every shape; >= {VS_DEEPSPEED_TARGET}x "
              f"DeepSpeed's vocab_parallel_linear_cross_entropy (forward+backward).", "",
              f"| shape | TP1 fwd+bwd ms | TP{tp} fwd+bwd ms | efficiency fwd+bwd (device) | efficiency fwd | "
              f"vs DeepSpeed fused | vs DeepSpeed logits | rel. err. loss / dX / dW | met |",
              "|---|---:|---:|---:|---:|---:|---:|---|---|"]
    for shape in dict.fromkeys(r.shape for r in records):
        rs = [r for r in records if r.shape == shape]
        base = rs[0]
        ours = next((r for r in rs if r.ours and r.extra.get("tp") == tp), None)
        dsf = next((r for r in rs if r.impl.startswith(DS_FUSED)), None)
        dsl = next((r for r in rs if r.impl.startswith(DS_LOGITS)), None)
        if ours is None:
            continue
        eff = ours.extra.get("efficiency_fwd_bwd")
        effd = ours.extra.get("efficiency_fwd_bwd_device")
        vs_f = dsf.extra.get("ours_speedup_fwd_bwd") if dsf else None
        vs_l = dsl.extra.get("ours_speedup_fwd_bwd") if dsl else None
        goal = EFF_TARGET.get(shape.split()[0], EFF_TARGET_DEFAULT)
        eff_met = "yes" if eff is not None and eff >= goal else "NO"
        ds_met = "yes" if vs_f is not None and vs_f >= VS_DEEPSPEED_TARGET else "NO"
        errs = (f"{ours.extra['err_loss']:.1e} / {ours.extra['err_dhidden']:.1e} / {ours.extra['err_dweight']:.1e}"
                if "err_loss" in ours.extra else "")
        lines.append(f"| {shape} | {_f(base.fwd_bwd_ms)} | {_f(ours.fwd_bwd_ms)} | {_f(eff)} ({_f(effd)}) | "
                     f"{_f(ours.extra.get('efficiency_fwd'))} | {_f(vs_f)} | {_f(vs_l)} | {errs} | "
                     f"efficiency >= {goal}: {eff_met}; >= {VS_DEEPSPEED_TARGET}x DeepSpeed: {ds_met} |")
    return "\n".join(lines)


def _f(v, nd=3):
    return "n/a" if v is None else f"{v:.{nd}f}"


def run_suite(group, device, shapes: list, dtype, warmup: int, reps: int, deepspeed_peers: bool = True) -> list:
    recs = []
    for label, M, H, V in shapes:
        recs += run_shape(label, M, H, V, group, device, dtype, warmup, reps, deepspeed_peers)
    return recs


def write(records: list, tp: int, out_dir: Optional[str]) -> dict:
    """Rank 0: tp_cross_entropy.{json,md,png} (common.write_results) with the summary as notes."""
    cmd = ("python -m torch.distributed.run --nproc_per_node " + str(tp) + " -m deepspeed_fused.bench " + SUITE
           if tp > 1 else "python -m deepspeed_fused.bench " + SUITE)
    return write_results(SUITE, records, out_dir, title=TITLE, notes=summary(records, tp), command=cmd,
                         method="Host-inclusive medians of synchronized calls, every rank starting each call "
                                "together (the slowest rank's median).")


def main(args) -> list:
    import torch.distributed as dist

    p = argparse.ArgumentParser(prog="python -m deepspeed_fused.bench tp_cross_entropy")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--no-deepspeed", action="store_true", help="only our rows")
    o, _ = p.parse_known_args(getattr(args, "extra", []))
    quick = getattr(args, "quick", False)
    group, device, created = init_group()
    cuda = device.type == "cuda"
    shapes = (QUICK_SHAPES if quick else SHAPES) if cuda else CPU_SHAPES
    reps = o.reps or (5 if quick or not cuda else 20)
    dtype = torch.bfloat16 if cuda else torch.float32
    tp = dist.get_world_size(group)
    if dist.get_rank() == 0:
        print(f"[tp_cross_entropy] TP {tp}, {len(shapes)} shape(s), {reps} reps after {o.warmup} warm-up", flush=True)
    records = []
    for label, M, H, V in shapes:
        t0 = time.time()
        records += run_shape(label, M, H, V, group, device, dtype, o.warmup, reps, not o.no_deepspeed)
        if dist.get_rank() == 0:
            print(f"[tp_cross_entropy] {label}: {time.time() - t0:.0f} s", flush=True)
    if dist.get_rank() == 0:
        paths = write(records, tp, getattr(args, "out", None))
        with open(paths["md"]) as f:
            print(f.read())
        print("wrote", ", ".join(str(v) for v in paths.values()))
    _meet(device)
    if created:
        dist.destroy_process_group()  # a clean exit: gloo ranks abort at interpreter exit otherwise
    return records
