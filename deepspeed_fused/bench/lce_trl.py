"""Case ``trl`` of the linear_cross_entropy suite: TRL's fused LM head against ours, per trainer.

``python -m deepspeed_fused.bench linear_cross_entropy --case trl [--out DIR]`` writes
``linear_cross_entropy_trl.{json,md,png}``. At each shape (tokens x hidden x vocab, bf16, every
seventh target ignored) and for the field set of each TRL trainer:

* SFT: log_probs, entropy, is_top1 (the loss is the mean negative log-prob: uniform weights)
* GRPO: log_probs, entropy (per-token weights on the log-probs)
* DPO: log_probs, entropy, mean_logits, is_top1 (per-token weights on the log-probs)

the rows are forward+backward time and peak extra memory of

* ``TRL ChunkedLogProbFunction``: TRL's kernel as its head calls it (only the labelled rows, TRL's
  vocabulary chunk), the gradient through the log-probs only;
* ``ours: served head``: what the linear_cross_entropy feature runs for TRL's head in steady state
  (the labelled rows; log-probs and entropy per token, with is_top1 / mean_logits formed in the
  same pass when asked): for SFT with ``expect_uniform_grad`` (the gradient formed in the forward,
  3 GEMMs, what the feature asks for once it has seen SFT's uniform upstream gradient; its one
  host read per backward included), for GRPO/DPO the op's per-token path;
* ``ours: served head, per-token path`` (SFT only): the same call without ``expect_uniform_grad``
  (what the feature runs on the first call, before it has seen a backward; 4 GEMMs);
* ``ours: op`` (the op on all rows with ignored targets): SFT on the mean-loss path (gradient formed
  in the forward, no per-token fields), GRPO/DPO per-token loss and entropy;

with T, the cuBLAS logits GEMM of the same shape, first.
"""
from __future__ import annotations

import torch

from ..ops.linear_cross_entropy import linear_cross_entropy
from .common import measure

RESULT = "linear_cross_entropy_trl"
TITLE = "TRL's fused LM head (ChunkedLogProbFunction) against the fused linear cross-entropy"
SHAPES = [(4096, 4096, 131072), (8192, 2048, 151936), (8192, 4096, 128256), (8192, 4096, 151936)]
CASES = {"SFT": ("log_probs", "entropy", "is_top1"), "GRPO": ("log_probs", "entropy"),
         "DPO": ("log_probs", "entropy", "mean_logits", "is_top1")}
GEMM = "cuBLAS logits GEMM (T)"


def _trl_fn():
    """(ChunkedLogProbFunction, TRL's vocabulary chunk) or (None, why)."""
    try:
        import trl.trainer.utils as tu
        from trl.kernels import ChunkedLogProbFunction
    except Exception as e:
        return None, f"trl not importable ({type(e).__name__}: {e})"
    return (ChunkedLogProbFunction, getattr(tu, "_CHUNKED_LOGPROB_CHUNK_SIZE", 32768)), ""


def _served(h, w, t, outputs, uniform=False):
    """The feature's computation for TRL's head on labelled rows: (log_probs, entropy, extras);
    ``uniform``: with the gradient formed in the forward (the feature's steady state for SFT)."""
    names = [n for n in ("mean_logits", "is_top1", "log_sum_sq_probs") if n in outputs]  # the op's order
    out = linear_cross_entropy(h, w, t, reduction="none", return_entropy=True,
                               return_mean_logits="mean_logits" in names, return_is_top1="is_top1" in names,
                               return_log_sum_sq="log_sum_sq_probs" in names, expect_uniform_grad=uniform)
    return -out[0], out[1], dict(zip(names, out[2:]))


def run(args) -> list:
    cuda = torch.cuda.is_available()
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    quick = getattr(args, "quick", False)
    shapes = (SHAPES[:1] if quick else SHAPES) if cuda else [(48, 32, 100)]
    rep = (30 if quick else 60) if cuda else 3
    trl, why = _trl_fn()
    recs, notes = [], []
    for M, H, V in shapes:
        shape = f"{M}x{H}x{V}"
        g = torch.Generator(device=dev).manual_seed(0)
        h = (torch.randn(M, H, device=dev, generator=g) * 0.5).to(dt).requires_grad_()
        w = (torch.randn(V, H, device=dev, generator=g) * 0.02).to(dt).requires_grad_()
        t = torch.randint(0, V, (M,), device=dev, generator=g)
        t[::7] = -100
        mask = t != -100
        n = int(mask.sum())
        hl = h.detach()[mask].clone().requires_grad_()  # the labelled rows, as TRL's head gathers them
        tl = t[mask].contiguous()
        wts = torch.rand(M, device=dev, generator=g)
        wts_l = wts[mask].contiguous()
        flops = 2.0 * M * H * V
        kw = dict(flops_fwd=flops, flops_fwd_bwd=3 * flops, rep=rep, warmup=min(25, rep))
        buf = torch.empty(M, V, device=dev, dtype=dt)
        hd, wd = h.detach(), w.detach()
        T = measure("linear_cross_entropy", GEMM, shape, dt, fwd=lambda: torch.mm(hd, wd.t(), out=buf),
                    memory_of="fwd", **kw)
        del buf
        recs.append(T)
        for case, outputs in CASES.items():
            sft = case == "SFT"

            def trl_step(outputs=outputs, sft=sft):
                hl.grad = w.grad = None
                fn, chunk = trl
                lp, ent, lssp, mean, top1 = fn.apply(hl, w, None, tl, 1.0, chunk, None, 1.0, outputs)
                loss = -lp.sum() / n if sft else -(lp * wts_l).sum()
                loss.backward()

            def served_step(outputs=outputs, sft=sft, uniform=sft):
                hl.grad = w.grad = None
                lp, ent, extra = _served(hl, w, tl, outputs, uniform)
                loss = -lp.sum() / n if sft else -(lp * wts_l).sum()
                loss.backward()

            def op_step(sft=sft):
                h.grad = w.grad = None
                if sft:
                    linear_cross_entropy(h, w, t).backward()
                else:
                    loss, ent = linear_cross_entropy(h, w, t, reduction="none", return_entropy=True)
                    (loss * wts).sum().backward()

            rows = []
            if trl is not None:
                rows.append((f"TRL ChunkedLogProbFunction ({case}: {', '.join(outputs)})", trl_step, False))
            rows.append((f"ours: served head ({case}: {', '.join(outputs)})", served_step, True))
            if sft:
                rows.append((f"ours: served head, per-token path ({case}: {', '.join(outputs)})",
                             lambda step=served_step: step(uniform=False), True))
            rows.append((f"ours: op ({case}: " + ("mean loss, gradient in forward)" if sft else
                                                   "per-token loss + entropy)"), op_step, True))
            case_recs = []
            for name, step, ours in rows:
                rec = measure("linear_cross_entropy", name, shape, dt, ours=ours, fwd_bwd=step, memory_of="fwd_bwd",
                              case=case, **kw)
                if T.fwd_ms and rec.fwd_bwd_ms:
                    rec.extra["fb_over_T"] = round(rec.fwd_bwd_ms / T.fwd_ms, 3)
                case_recs.append(rec)
                torch.cuda.empty_cache() if cuda else None
            base = case_recs[0] if trl is not None else None
            for rec in case_recs[1:] if base is not None else case_recs:
                if base is not None and base.fwd_bwd_ms and rec.fwd_bwd_ms:
                    rec.extra["speedup_vs_trl"] = round(base.fwd_bwd_ms / rec.fwd_bwd_ms, 3)
                    rec.note = f"{rec.extra['speedup_vs_trl']:.2f}x TRL's time"
                    notes.append(f"| {shape} | {case} | {rec.impl.split(' (')[0]} | {rec.extra['speedup_vs_trl']} | "
                                 f"{_mib(rec.peak_extra_mib)} | {_mib(base.peak_extra_mib)} |")
            recs += case_recs
        del h, w, t, hl
        torch.cuda.empty_cache() if cuda else None
    global NOTES
    NOTES = ("TRL's head gets only the labelled rows (as its fused head passes them); gradients flow through the "
             "log-probs only (the trainers use entropy, is_top1 and mean_logits as metrics). The served head for SFT "
             "forms the gradient in the forward (expect_uniform_grad, as the feature does once it has seen SFT's "
             "uniform upstream gradient); its per-token path is the row after it. "
             + (f"TRL peer missing: {why}. " if trl is None else "")
             + "\n\n| shape | trainer | ours | TRL time / ours | ours extra MiB | TRL extra MiB |\n"
             "|---|---|---|---:|---:|---:|\n" + "\n".join(notes))
    return recs


NOTES = ""


def _mib(v):
    return "" if v is None else f"{v:.0f}"
