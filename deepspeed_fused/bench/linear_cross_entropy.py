"""Suite ``linear_cross_entropy``: fused LM head + cross-entropy against its peers (bf16).

Every figure is also given as a ratio to T, the time of the cuBLAS logits GEMM alone at the
same shape in the same run (the floor of any forward). Peak extra memory of forward+backward
rows excludes the inputs and their gradients: memory is measured after the timed runs, which
leave the inputs' gradients allocated, and each run drops them before making new ones, so the
peak above the allocation at its start is net of both.

``python -m deepspeed_fused.bench linear_cross_entropy --sweep --out DIR`` times our forward
(per-token loss + lse) and forward+backward (mean loss) at several ``chunk_tokens`` instead (the
automatic size and smaller chunks whose logits fit in L2), with the target check on and off, and
T beside them: to see what the chunk size and the check cost before changing the defaults.

``--case trl`` runs only TRL's fused LM head against ours for the field sets of its SFT, GRPO and
DPO trainers (:mod:`.lce_trl`; files ``linear_cross_entropy_trl.*``).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..ops.linear_cross_entropy import linear_cross_entropy
from .common import measure

SUITE = "linear_cross_entropy"
TITLE = "fused linear cross-entropy (LM head + CE)"
NOTES = ""
RESULT = None  # the files' name when not the suite's (a case)
COMMAND = None  # the command line the files name, when not the suite's
SHAPES = [(4096, 4096, 131072), (8192, 2048, 151936), (8192, 4096, 128256), (16384, 4096, 131072)]
TARGETS = {"fwd": 1.05, "fb_mean": 3.35, "fb_token": 4.25, "mib": 512, "tp1": 1.02}
CCE = "Apple CCE (filtered)"
GEMM = "cuBLAS logits GEMM (T)"


def _verl_chunked(h, w, t, chunk=512):
    """verl-style fallback: 512-token chunks of fp32 logits, NLL and entropy, plain autograd."""
    nll, ent = [], []
    for s in range(0, h.shape[0], chunk):
        logits = (h[s:s + chunk] @ w.t()).float()
        tc = t[s:s + chunk]
        lse = torch.logsumexp(logits, -1)
        valid = tc != -100
        zt = logits.gather(1, torch.where(valid, tc, 0)[:, None]).squeeze(1)
        nll.append(torch.where(valid, lse - zt, 0.0))
        ent.append(lse - (torch.softmax(logits, -1) * logits).sum(-1))
    return torch.cat(nll), torch.cat(ent)


def _peers():
    """name -> fn(h, w, t) returning a loss (scalar) for each peer that imports."""
    out = {"torch eager (fp32 logits)": lambda h, w, t: F.cross_entropy((h @ w.t()).float(), t)}
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

        liger = LigerFusedLinearCrossEntropyLoss()
        out["Liger FLCE"] = lambda h, w, t: liger(w, h, t)
        try:
            liger32 = LigerFusedLinearCrossEntropyLoss(accum_dtype=torch.float32)
            out["Liger FLCE fp32 accum"] = lambda h, w, t: liger32(w, h, t)
        except TypeError:
            pass
    except Exception:
        pass
    try:
        from cut_cross_entropy import linear_cross_entropy as cce

        out["Apple CCE (filtered)"] = lambda h, w, t: cce(h, w, t)
        out["Apple CCE filter_eps=None (exact)"] = lambda h, w, t: cce(h, w, t, filter_eps=None)
    except Exception:
        pass
    try:
        from deepspeed.sequence.linear_cross_entropy import vocab_parallel_linear_cross_entropy as dslce

        out["DeepSpeed vocab_parallel_linear_cross_entropy"] = lambda h, w, t: dslce(h, w, t)
    except Exception:
        pass

    def verl(h, w, t):
        nll, ent = _verl_chunked(h, w, t)
        return nll.sum() + ent.sum()

    out["verl-style 512-token chunked torch (nll+entropy)"] = verl
    return out


def _fb(fn, h, w, t):
    def run():
        h.grad = w.grad = None
        fn(h, w, t).backward()
    return run


def _one_rank_group():
    """A tensor-parallel group of one rank (this process), or None without torch.distributed."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    if not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1)
    return dist.new_group([0])


TP1 = "ours: mean loss, tp_group of 1 rank"


def _ours(group=None):
    """name -> (fwd fn or None, loss fn for fwd+bwd, kind for the targets)."""
    def fwd_token(h, w, t):
        return linear_cross_entropy(h, w, t, reduction="none", return_lse=True)

    def token_ent(h, w, t):
        loss, ent = linear_cross_entropy(h, w, t, reduction="none", return_entropy=True)
        return loss.sum() + 0.1 * ent.sum()

    rows = {
        "ours: per-token loss+lse": (fwd_token, None, "fwd"),
        "ours: mean loss": (None, lambda h, w, t: linear_cross_entropy(h, w, t), "fb_mean"),
        "ours: per-token loss+entropy": (lambda h, w, t: linear_cross_entropy(
            h, w, t, reduction="none", return_entropy=True), token_ent, "fb_token"),
        "ours: mean loss, accum_dtype=fp32": (None, lambda h, w, t: linear_cross_entropy(
            h, w, t, accum_dtype=torch.float32), "fb_fp32"),
    }
    if group is not None:  # the vocabulary-parallel entry point with a group of one rank
        rows[TP1] = (None, lambda h, w, t: linear_cross_entropy(h, w, t, tp_group=group), "tp1")
    return rows


def _shape_setup(M, H, V, dev, dt, rep):
    """The suite's inputs at one shape (hidden and weight as leaves, every 7th target ignored),
    the measure() keywords, and the record of T, the cuBLAS logits GEMM alone."""
    shape = f"{M}x{H}x{V}"
    g = torch.Generator(device=dev).manual_seed(0)
    h = (torch.randn(M, H, device=dev, generator=g) * 0.5).to(dt).requires_grad_()
    w = (torch.randn(V, H, device=dev, generator=g) * 0.02).to(dt).requires_grad_()
    t = torch.randint(0, V, (M,), device=dev, generator=g)
    t[::7] = -100
    flops = 2.0 * M * H * V
    kw = dict(flops_fwd=flops, flops_fwd_bwd=3 * flops, rep=rep)
    buf = torch.empty(M, V, device=dev, dtype=dt)
    hd, wd = h.detach(), w.detach()
    T = measure(SUITE, GEMM, shape, dt, fwd=lambda: torch.mm(hd, wd.t(), out=buf), memory_of="fwd", **kw)
    return shape, h, w, t, kw, T


def _over_T(rec, T):
    """The record's forward and forward+backward times as ratios to T (extra fwd_over_T, fb_over_T)."""
    rec.extra["fwd_over_T"] = round(rec.fwd_ms / T, 3) if rec.fwd_ms else None
    rec.extra["fb_over_T"] = round(rec.fwd_bwd_ms / T, 3) if rec.fwd_bwd_ms else None


SWEEP_CHUNKS = (128, 256, 512, 1024, 2048, None)


def sweep(args) -> list:
    """Records ``chunk=C[, no check]``: forward (per-token loss + lse) and forward+backward (mean)
    host-inclusive, at each of SWEEP_CHUNKS (None: automatic), per shape; T first."""
    cuda = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    shapes = SHAPES if cuda else [(24, 16, 120)]  # CPU: a check of the logic (the interpreter is slow)
    chunks = SWEEP_CHUNKS if cuda else (8, None)
    rep = 30 if getattr(args, "quick", False) else 60
    recs = []
    for M, H, V in shapes:
        shape, h, w, t, kw, T = _shape_setup(M, H, V, dev, dt, rep)
        recs.append(T)
        for chunk in chunks:
            for check in (True, False):
                opts = dict(chunk_tokens=chunk, validate_targets=check)
                name = f"chunk={chunk or 'auto'}" + ("" if check else ", no check")
                rec = measure(SUITE, name, shape, dt, ours=True,
                              fwd=lambda o=opts: linear_cross_entropy(h, w, t, reduction="none", return_lse=True, **o),
                              fwd_bwd=_fb(lambda a, b, c, o=opts: linear_cross_entropy(a, b, c, **o), h, w, t), **kw)
                if T.fwd_ms:
                    _over_T(rec, T.fwd_ms)
                    rec.note = f"fwd {rec.extra['fwd_over_T']} T, fwd+bwd (mean) {rec.extra['fb_over_T']} T"
                recs.append(rec)
        del h, w, t
        torch.cuda.empty_cache() if cuda else None
    return recs


CASES = ("trl",)


def _case(args):
    extra = list(getattr(args, "extra", None) or [])
    if "--case" not in extra:
        return None
    i = extra.index("--case")
    case = extra[i + 1] if i + 1 < len(extra) else None
    if case not in CASES:
        raise ValueError(f"--case: expected one of {', '.join(CASES)}, got {case!r}")
    return case


def run(args) -> list:
    global NOTES, RESULT, TITLE, COMMAND
    if _case(args) == "trl":
        from . import lce_trl

        recs = lce_trl.run(args)
        NOTES, RESULT, TITLE = lce_trl.NOTES, lce_trl.RESULT, lce_trl.TITLE
        COMMAND = "python -m deepspeed_fused.bench linear_cross_entropy --case trl"
        return recs
    if "--sweep" in (getattr(args, "extra", None) or []):
        return sweep(args)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dt = torch.bfloat16 if cuda else torch.float32
    quick = getattr(args, "quick", False)
    shapes = SHAPES[:1] if quick else SHAPES
    if not cuda:
        shapes = [(256, 64, 1000)]
    rep = 30 if quick else 100
    recs, summary = [], []
    group = _one_rank_group()
    for M, H, V in shapes:
        shape, h, w, t, kw, gemm = _shape_setup(M, H, V, dev, dt, rep)
        shape_recs = [gemm]
        for name, (fwd, loss_fn, kind) in _ours(group).items():
            rec = measure(SUITE, name, shape, dt, ours=True, fwd=(lambda f=fwd: f(h, w, t)) if fwd else None,
                          fwd_bwd=_fb(loss_fn, h, w, t) if loss_fn else None,
                          memory_of="fwd_bwd" if loss_fn else "fwd", **kw)
            rec.extra["target"] = kind
            shape_recs.append(rec)
        for name, fn in _peers().items():
            if "eager" in name and cuda and M * V * 6 > 60 * 2**30:  # would not fit next to the others
                continue
            shape_recs.append(measure(SUITE, name, shape, dt, fwd=lambda f=fn: f(h, w, t), fwd_bwd=_fb(fn, h, w, t),
                                      **kw))
            torch.cuda.empty_cache() if cuda else None
        T = shape_recs[0].fwd_ms
        cce = next((r for r in shape_recs if r.impl == CCE), None)
        for r in shape_recs:
            if T:
                _over_T(r, T)
                parts = [f"{k} {v:.2f} T" for k, v in (("fwd", r.extra["fwd_over_T"]), ("fb", r.extra["fb_over_T"]))
                         if v]
                r.note = "; ".join(p for p in [", ".join(parts), r.note] if p)
            if r.ours and r.extra["target"] == "tp1":
                base = next(b for b in shape_recs if b.impl == "ours: mean loss").fwd_bwd_ms
                ratio = round(r.fwd_bwd_ms / base, 3)
                r.extra["over_single_gpu_op"] = ratio
                r.note = "; ".join(p for p in [f"{ratio:.3f}x the single-GPU op", r.note] if p)
                summary.append(f"| {shape} | {r.impl} | {ratio} (to the single-GPU op) | {TARGETS['tp1']} | "
                               f" | {_fmt_mib(r.peak_extra_mib)} | {'yes' if ratio <= TARGETS['tp1'] else 'NO'} |")
            elif r.ours and T:
                kind = r.extra["target"]
                val = r.extra["fwd_over_T"] if kind == "fwd" else r.extra["fb_over_T"]
                goal = TARGETS.get(kind)
                mib_ok = kind == "fb_fp32" or (r.peak_extra_mib is not None and r.peak_extra_mib <= TARGETS["mib"])
                vs_cce, cce_ok = "", True
                if kind == "fb_mean" and cce is not None and cce.fwd_bwd_ms and r.fwd_bwd_ms:
                    # forward+backward at least as fast as Apple CCE with its (approximate) filtering
                    ratio = round(cce.fwd_bwd_ms / r.fwd_bwd_ms, 3)
                    r.extra["vs_cce_filtered"] = ratio
                    vs_cce, cce_ok = f"{ratio:.3f}x", ratio >= 1.0
                summary.append(f"| {shape} | {r.impl} | {val if val is not None else 'n/a'} | "
                               f"{goal or '-'} | {vs_cce} | {_fmt_mib(r.peak_extra_mib)} | "
                               f"{'yes' if (goal is None or (val is not None and val <= goal)) and mib_ok and cce_ok else 'NO'} |")
        recs += shape_recs
        del h, w, t
        torch.cuda.empty_cache() if cuda else None
    NOTES = (f"Targets (ratios to T, the cuBLAS logits GEMM of the same shape): forward <= {TARGETS['fwd']} T, "
             f"forward+backward mean loss <= {TARGETS['fb_mean']} T and at least as fast as {CCE} (the "
             f"'vs CCE' column: its time / ours), per-token upstream gradients with entropy <= "
             f"{TARGETS['fb_token']} T, peak extra memory <= {TARGETS['mib']} MiB in the default mode; the "
             "vocabulary-parallel entry point with a tensor-parallel group of one rank within 2% of the "
             "single-GPU op. Our calls use the defaults (validate_targets=True: the target check is "
             "read after the kernels are queued).\n\n"
             "| shape | ours | ratio to T | target | vs CCE | extra MiB | met |\n|---|---|---:|---:|---:|---:|---|\n"
             + "\n".join(summary))
    return recs


def _fmt_mib(v):
    return "" if v is None else f"{v:.0f}"
