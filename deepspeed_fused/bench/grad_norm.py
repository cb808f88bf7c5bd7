"""Suite ``grad_norm``: the global gradient norm of a ZeRO-1/2 step, bf16 gradients.

Inputs as DeepSpeed's ZeRO-1/2 optimizer holds them on one GPU: every parameter's gradient a view
of one flat bf16 buffer, in the order of ``model.parameters()``, for the full models of the dense
suite's shapes (Llama-3.2-3B, Qwen3-1.7B, Qwen3-4B, Gemma-3-1B; parameter shapes read from a model
built on the meta device). Each implementation is called as the optimizer calls it and returns
the float32 global norm; deepspeed.comm runs with one rank (its all-reduce included). Effective
bytes: the gradients read once (2 bytes an element).

Implementations, each inside DeepSpeed's method (the same gradients picked, the same float32
total, all-reduce and masking; only the per-gradient norms differ):

* ``deepspeed_fused``: the ``grad_norm`` feature's method (one
  :func:`~deepspeed_fused.ops.grad_norm.tensor_norms` call);
* ``DeepSpeed get_grad_norm_direct``: DeepSpeed's own method (a float64 copy and a
  ``vector_norm`` per gradient);
* ``torch _foreach_norm(dtype=float64)``: torch's multi-tensor norm (what ``clip_grad_norm_`` and
  ``get_total_norm`` use) asked for float64 results;
* ``torch _foreach_norm(dtype=float32)``: the same in float32 (not DeepSpeed's total).

The per-gradient norms are also timed alone (host-inclusive and as CUDA-graph replays), with the
float64 copy and ``vector_norm`` per gradient that DeepSpeed's method takes.

The overflow check DeepSpeed runs before the norm in bf16 and fp16 runs is timed the same way:
the feature's method against DeepSpeed's ``has_overflow_partitioned_grads_serial``.

Host-inclusive (do_bench); the extra columns give each result's float32 total and whether it equals
DeepSpeed's bit for bit, and the peak memory each call adds.
"""
from __future__ import annotations

import os
import types

import torch

from ..ops.grad_norm import tensor_norms, tensor_norms_reference
from .common import free_port, graph_ms, measure

SUITE = "grad_norm"
TITLE = "Global gradient norm of a ZeRO-1/2 step (bf16 gradients of full models), host-inclusive"
_NOTES = ("Host-inclusive (do_bench) time of one call as DeepSpeed's ZeRO-1/2 optimizer makes it at each step, on "
         "every gradient of the model (views of one flat bf16 buffer, one rank). Effective bytes: the gradients "
         "read once. `total` is each call's float32 global norm; `equals DeepSpeed` whether it is DeepSpeed's bit "
         "for bit. Peak MiB: memory the call allocates beyond the gradients.")
NOTES = _NOTES
MODELS = ["llama-3.2-3b", "qwen3-1.7b", "qwen3-4b", "gemma3-1b"]
CPU_MODELS = ["llama-tiny", "gemma3-tiny"]


def _init_comm(dev: str) -> None:
    import deepspeed

    if deepspeed.comm.is_initialized():
        return
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    deepspeed.init_distributed(dist_backend="nccl" if dev == "cuda" else "gloo", verbose=False)


def gradients_of(name: str, dev: str, seed: int = 0) -> tuple:
    """(flat buffer, [gradient views]) for model ``name``: one view per parameter, in order."""
    from ..models import build_model

    with torch.device("meta"):
        shapes = [p.shape for p in build_model(name).parameters()]
    total = sum(s.numel() for s in shapes)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    gen = torch.Generator(device=dev).manual_seed(seed)
    flat = torch.empty(total, dtype=dtype, device=dev)
    step = 1 << 26
    for i in range(0, total, step):  # in pieces: no float32 copy of the whole buffer
        n = min(step, total - i)
        flat[i:i + n] = (1e-3 * torch.randn(n, generator=gen, device=dev)).to(dtype)
    views, at = [], 0
    for s in shapes:
        views.append(flat[at:at + s.numel()].view(s))
        at += s.numel()
    return flat, views


def _stand_in():
    """The optimizer's state that its gradient-norm method reads, for one rank without model
    parallelism."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    opt = types.SimpleNamespace(model_parallel_rank=0, model_parallel_group=None, dp_process_group=None,
                                device=torch.cuda.current_device() if torch.cuda.is_available() else "cpu")
    opt._model_parallel_all_reduce = types.MethodType(DeepSpeedZeroOptimizer._model_parallel_all_reduce, opt)
    opt._has_inf_or_nan = DeepSpeedZeroOptimizer._has_inf_or_nan
    opt.bit16_groups = [None]
    return opt, DeepSpeedZeroOptimizer.get_grad_norm_direct


def _overflow_impls(opt) -> list:
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from ..features.base import CallCounts
    from ..features.grad_norm.patch import make_fused_overflow

    original = DeepSpeedZeroOptimizer.has_overflow_partitioned_grads_serial
    fused = make_fused_overflow(original, CallCounts())
    return [("deepspeed_fused", lambda: fused(opt), True),
            ("DeepSpeed has_overflow_partitioned_grads_serial", lambda: original(opt), False)]


def _foreach(dtype):
    """torch's multi-tensor norm of a list, results (and accumulation) in ``dtype``, as float64."""
    def norms(ts):
        return torch.stack(torch._foreach_norm(ts, 2, dtype=dtype)).to(torch.float64)
    return norms


def _impls(opt, original) -> list:
    """(name, fn(gradients, params) -> float32 norm, ours): DeepSpeed's method, and the method with
    each implementation of the per-gradient norms in its place (the same gradients picked, the same
    total, all-reduce and masking), so that only the per-gradient norms differ."""
    from ..features.base import CallCounts
    from ..features.grad_norm.patch import make_fused

    out = [("deepspeed_fused", make_fused(original, CallCounts()), True),
           ("DeepSpeed get_grad_norm_direct", original, False),
           ("torch _foreach_norm(dtype=float64)", make_fused(original, CallCounts(), _foreach(torch.float64)), False),
           ("torch _foreach_norm(dtype=float32)", make_fused(original, CallCounts(), _foreach(torch.float32)), False)]
    return [(name, (lambda g, p, f=f: f(opt, g, p)), ours) for name, f, ours in out]


def _op_impls() -> list:
    """The per-gradient norms alone: (name, fn(gradients) -> norms, ours)."""
    return [("deepspeed_fused", tensor_norms, True),
            ("torch _foreach_norm(dtype=float64)", _foreach(torch.float64), False),
            ("torch _foreach_norm(dtype=float32)", _foreach(torch.float32), False),
            ("float64 copy + vector_norm per gradient (DeepSpeed's)", tensor_norms_reference, False)]


def run(args) -> list:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    quick = getattr(args, "quick", False)
    names = MODELS if dev == "cuda" else CPU_MODELS
    if quick and dev == "cuda":
        names = names[:1]
    _init_comm(dev)
    opt, original = _stand_in()
    recs = []
    for name in names:
        flat, grads = gradients_of(name, dev)
        params = list(grads)  # plain tensors: not model-parallel, counted once on rank 0
        nbytes = flat.numel() * flat.element_size()
        n = flat.numel()
        shape = f"{name}: {len(grads)} gradients, " + (f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e3:.0f} K") + \
            " elements"
        ref = None
        impls = _impls(opt, original)
        for iname, fn, ours in impls:
            try:
                total = fn(grads, params)
                total = float(total.item() if isinstance(total, torch.Tensor) else total)
            except Exception as e:  # a peer this torch lacks is reported, not fatal
                total, err = None, f"failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            else:
                err = ""
            if iname.startswith("DeepSpeed"):
                ref = total
            rec = measure(SUITE, iname, shape, flat.dtype, fwd=(lambda f=fn: f(grads, params)) if total is not None
                          else None, bytes_fwd=nbytes, ours=ours, note=err, rep=20 if quick else 100,
                          model=name, gradients=len(grads), elements=flat.numel(), total=total)
            recs.append(rec)
        for r in recs[-len(impls):]:
            r.extra["equals DeepSpeed"] = None if r.extra["total"] is None or ref is None else \
                r.extra["total"] == ref
        # the per-gradient norms alone, with their device time (CUDA graphs)
        exact = tensor_norms_reference(grads)
        for iname, fn, ours in _op_impls():
            rel = ((fn(grads) - exact).abs() / exact.clamp_min(1e-300)).max().item()
            rec = measure(SUITE, iname, shape + ", norms alone", flat.dtype, fwd=lambda f=fn: f(grads),
                          bytes_fwd=nbytes, ours=ours, rep=20 if quick else 100, model=name, gradients=len(grads),
                          elements=flat.numel(), total=None, check="norms", max_rel_err=rel)
            try:
                rec.extra["graph_ms"] = graph_ms(lambda f=fn: f(grads))
            except Exception as e:  # reported, not fatal
                rec.note = f"no CUDA graph: {type(e).__name__}"
            recs.append(rec)
        del exact
        # the overflow check DeepSpeed runs before the norm in bf16 and fp16 (one answer: any non-finite)
        opt.averaged_gradients = {0: grads}
        for iname, fn, ours in _overflow_impls(opt):
            recs.append(measure(SUITE, iname, shape + ", overflow check", flat.dtype, fwd=fn, bytes_fwd=nbytes,
                                ours=ours, rep=20 if quick else 100, model=name, gradients=len(grads),
                                elements=flat.numel(), total=bool(fn().item()), check="overflow"))
        opt.averaged_gradients = {}
        del flat, grads, params
        if dev == "cuda":
            torch.cuda.empty_cache()
    global NOTES
    NOTES = _NOTES + "\n\n" + summary(recs)
    return recs


def summary(recs) -> str:
    """Per model: each implementation's time against DeepSpeed's, its float32 total, and whether that
    total is DeepSpeed's bit for bit."""
    rows = ["| model | implementation | ms | vs DeepSpeed | float32 total | equals DeepSpeed |", "|---|---|---:|---:|---:|---|"]
    for model in dict.fromkeys(r.extra["model"] for r in recs):
        rs = [r for r in recs if r.extra["model"] == model and "check" not in r.extra]
        ds = next((r.fwd_ms for r in rs if r.impl.startswith("DeepSpeed")), None)
        for r in rs:
            speed = f"{ds / r.fwd_ms:.2f}x" if ds and r.fwd_ms else "-"
            total = "-" if r.extra["total"] is None else repr(r.extra["total"])
            same = {True: "yes", False: "no", None: "-"}[r.extra["equals DeepSpeed"]]
            ms = f"{r.fwd_ms:.3f}" if r.fwd_ms else "-"
            rows.append(f"| {model} | {r.impl} | {ms} | {speed} | {total} | {same} |")
    rows += ["", "The per-gradient norms alone (host-inclusive, and device time from CUDA graphs; the largest "
             "relative difference from the float64 copy's norms):", "",
             "| model | implementation | ms | device ms | vs DeepSpeed's copies | largest rel. difference |",
             "|---|---|---:|---:|---:|---:|"]
    for model in dict.fromkeys(r.extra["model"] for r in recs):
        rs = [r for r in recs if r.extra["model"] == model and r.extra.get("check") == "norms"]
        ds = next((r.fwd_ms for r in rs if r.impl.startswith("float64 copy")), None)
        for r in rs:
            speed = f"{ds / r.fwd_ms:.2f}x" if ds and r.fwd_ms else "-"
            ms = f"{r.fwd_ms:.3f}" if r.fwd_ms else "-"
            g = r.extra.get("graph_ms")
            rows.append(f"| {model} | {r.impl} | {ms} | {g:.3f} | {speed} | {r.extra['max_rel_err']:.1e} |" if g else
                        f"| {model} | {r.impl} | {ms} | - | {speed} | {r.extra['max_rel_err']:.1e} |")
    rows += ["", "The overflow check (bf16 and fp16 runs, before the norm):", "",
             "| model | implementation | ms | vs DeepSpeed | overflow found |", "|---|---|---:|---:|---|"]
    for model in dict.fromkeys(r.extra["model"] for r in recs):
        rs = [r for r in recs if r.extra["model"] == model and r.extra.get("check") == "overflow"]
        ds = next((r.fwd_ms for r in rs if not r.ours), None)
        for r in rs:
            speed = f"{ds / r.fwd_ms:.2f}x" if ds and r.fwd_ms else "-"
            ms = f"{r.fwd_ms:.3f}" if r.fwd_ms else "-"
            rows.append(f"| {model} | {r.impl} | {ms} | {speed} | {r.extra['total']} |")
    return "\n".join(rows)
