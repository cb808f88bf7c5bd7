"""Suite ``rms_norm``: the fused RMSNorm against its peers, bf16 (weight bf16, eps 1e-6).

Effective bandwidth counts the bytes an exact implementation must move: the forward reads x and
writes y; forward + backward adds reading x and dy and writing dx (the weight and its gradient
are negligible). So with E = rows x width x element size: fwd = 2E, fwd+bwd = 5E.

Peers: Hugging Face eager (``LlamaRMSNorm``), ``torch.nn.functional.rms_norm``, ``torch.compile``
of the eager form, Liger-Kernel ``LigerRMSNorm`` (llama casting, not in place) and DeepSpeed
0.19.8 ``fused_rms_norm`` (widths up to 2048), each when it imports. Forward + backward is timed
as the forward followed by ``torch.autograd.grad`` for x and the weight.

The other forms (``ops.rms_norm.RMSForm``) are timed beside it at their models' widths: Gemma 3's
``1 + w`` (hidden 2560 / 3840 / 5376, head_dim 256 q/k norms), Qwen3.5's gated output norm of its
linear attention (head dim 128, with its gate) and GPT-OSS's weight-before-the-cast (hidden 2880):
ours, eager (the form's torch formulation, the ops the HF modules run) and ``torch.compile`` of it,
each with the Llama form's device time at the same shape beside it. ``--forms`` runs only those.

``python -m deepspeed_fused.bench rms_norm --sweep --out DIR`` times the kernels' tile knobs instead
(CUDA-graph device time, one record per setting and shape) to tune the defaults in
``deepspeed_fused/ops/rms_norm/plans.py``.
"""
from __future__ import annotations

import torch

from ..ops.rms_norm import native as _native
from ..ops import rms_norm as _ops
from ..ops.rms_norm import FORMS, fused_rms_norm, fused_rms_norm_form, rms_norm_form_reference, rms_norm_reference
from .common import Record, add_graph_times, env_fields, graph_ms, loop_ms, measure

SUITE = "rms_norm"
TITLE = "Fused RMSNorm (Llama form) forward and forward+backward"
_NOTES = ("Targets (H200, bf16): on shapes with >= 32 MiB per tensor, fwd >= 3.4 TB/s and fwd+bwd >= 3.0 TB/s "
          "effective and fwd+bwd >= 1.5x the fastest peer; short inputs (16 rows) fwd+bwd within 1.2x of the "
          "fastest peer. Effective bytes: fwd = x read + y written; fwd+bwd adds x and dy read and dx written. "
          "The fwd and fwd+bwd columns are host-inclusive (fwd+bwd: the forward, then torch.autograd.grad, so "
          "autograd's hand-over to its device thread and any Python in a backward count). The note gives, for "
          "every implementation that captures, the same forward and forward+backward replayed from a CUDA "
          "graph: device time alone. The table below compares both ways.")
NOTES = _NOTES

SHAPES = [(8192, 2048), (8192, 4096), (8192, 8192), (4096, 4096), (262144, 128), (32768, 128), (524288, 128),
          (16, 128), (16, 4096)]
CHAIN_SHAPES = {(8192, 2048), (8192, 4096), (8192, 8192), (4096, 4096), (262144, 128), (524288, 128)}
_PY_NODE = "deepspeed_fused (Python node)"
_LOOPED = ("deepspeed_fused", _PY_NODE, "torch F.rms_norm", "torch.compile(eager)", "Liger LigerRMSNorm")


def _python_node(x, w):
    """Ours with the Python autograd node (the C++ node switched off for the call)."""
    _ops.api.NATIVE = False
    try:
        return fused_rms_norm(x, w, EPS)
    finally:
        _ops.api.NATIVE = True
EPS = 1e-6


def _peers(width: int, dtype) -> list:
    """(name, fn(x, w) -> y, note) of the peers that import and take this width."""
    peers = []
    try:
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        fwd = LlamaRMSNorm.forward

        class _Holder:  # the module's own forward on our weight tensor
            def __init__(self, w):
                self.weight, self.variance_epsilon = w, EPS

        peers.append(("HF eager LlamaRMSNorm", lambda x, w: fwd(_Holder(w), x), ""))
    except Exception:
        peers.append(("HF eager (form)", lambda x, w: rms_norm_reference(x, w, EPS), "transformers missing"))
    if hasattr(torch.nn.functional, "rms_norm"):
        peers.append(("torch F.rms_norm", lambda x, w: torch.nn.functional.rms_norm(x, (width,), w, EPS), ""))
    try:
        torch._dynamo.reset()  # one shape at a time: stay under dynamo's recompile limit
        compiled = torch.compile(lambda x, w: rms_norm_reference(x, w, EPS), dynamic=False)
        peers.append(("torch.compile(eager)", compiled, ""))
    except Exception:
        pass
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        # X, W, eps, offset, casting_mode, in_place (Liger's RMSNorm with Llama casting)
        peers.append(("Liger LigerRMSNorm",
                      lambda x, w: LigerRMSNormFunction.apply(x, w, EPS, 0.0, "llama", False), ""))
    except Exception:
        pass
    try:
        from deepspeed.ops.triton_ops.fused_rms_norm import _MAX_FORWARD_BLOCK
        from deepspeed.ops.triton_ops.fused_rms_norm import fused_rms_norm as ds_rms

        if width <= _MAX_FORWARD_BLOCK and dtype in (torch.bfloat16, torch.float16):
            peers.append(("DeepSpeed 0.19.8 fused_rms_norm", lambda x, w: ds_rms(x, w, EPS), ""))
    except Exception:
        pass
    return peers


CHAIN = 8  # norms in a chain: each with its own weight, one backward through all of them


def _chain_fns(impl, x, w, dy):
    xg = x.detach().requires_grad_()
    ws = [(w + 0.001 * i).detach().requires_grad_() for i in range(CHAIN)]

    def fwd():
        with torch.no_grad():
            h = x
            for wi in ws:
                h = impl(h, wi)
            return h

    def fwd_bwd():
        h = xg
        for wi in ws:
            h = impl(h, wi)
        return torch.autograd.grad(h, [xg] + ws, dy)

    return fwd, fwd_bwd


def _fns(impl, x, w, dy):
    xg = x.detach().requires_grad_()
    wg = w.detach().requires_grad_()

    def fwd():
        with torch.no_grad():
            return impl(x, w)

    def fwd_bwd():
        y = impl(xg, wg)
        return torch.autograd.grad(y, (xg, wg), dy)

    return fwd, fwd_bwd


FWD_SWEEP = [(t, e) for t in (8192, 16384, 32768, 65536) for e in (256, 512, 1024, 2048)]
BWD_SWEEP = [(t, e, p) for t in (2048, 4096, 8192, 16384) for e in (256, 512, 1024) for p in (True, False)]
_FWD_KNOBS = ("_FWD_TILE_BYTES", "_FWD_ELEMS_PER_WARP")
_BWD_KNOBS = ("_BWD_TILE_ELEMS", "_BWD_ELEMS_PER_WARP", "_BWD_PREFETCH")


def sweep(args) -> list:
    """Device time (CUDA-graph replay) of our forward under each FWD_SWEEP setting and of our
    backward alone under each BWD_SWEEP setting; defaults restored afterwards. Records put the
    forward in ``fwd_ms`` and the backward in ``fwd_bwd_ms`` (backward only, see the note)."""
    if not torch.cuda.is_available():
        raise SystemExit("the rms_norm sweep needs a GPU (it times CUDA-graph replays)")
    dtype = torch.bfloat16
    shapes = [(8192, 2048), (8192, 4096), (8192, 8192), (262144, 128), (524288, 128)]
    saved = {k: getattr(_ops.plans, k) for k in _FWD_KNOBS + _BWD_KNOBS}
    recs = []
    gen = torch.Generator().manual_seed(0)

    def apply(knobs, setting):
        for k, v in zip(knobs, setting):
            setattr(_ops.plans, k, v)
        _ops.clear_plans()  # the plans and the kernels' occupancy

    try:
        for rows, width in shapes:
            x = (0.5 * torch.randn(rows, width, generator=gen)).to("cuda", dtype)
            w = (1 + 0.02 * torch.randn(width, generator=gen)).to("cuda", dtype)
            dy = torch.randn(rows, width, generator=gen).to("cuda", dtype)
            e = rows * width * x.element_size()
            shape = f"{rows}x{width}"
            for setting in FWD_SWEEP:
                apply(_FWD_KNOBS, setting)
                ms = graph_ms(lambda: _ops.launch._forward_impl(x, w, EPS), rep=50)
                recs.append(Record(SUITE, "fwd tile_bytes/elems_per_warp " + "/".join(map(str, setting)), shape,
                                   "bfloat16", ours=True, fwd_ms=ms, unit="TB/s", fwd_rate=2 * e / ms / 1e9,
                                   note="CUDA-graph device time", **env_fields()))
            apply(_FWD_KNOBS, [saved[k] for k in _FWD_KNOBS])
            _, rstd = _ops.launch._forward_impl(x, w, EPS)
            for setting in BWD_SWEEP:
                apply(_BWD_KNOBS, setting)
                ms = graph_ms(lambda: _ops.launch._backward_impl(dy, x, w, rstd), rep=50)
                recs.append(Record(SUITE, "bwd tile_elems/elems_per_warp/prefetch " + "/".join(map(str, setting)),
                                   shape, "bfloat16", ours=True, fwd_bwd_ms=ms, unit="TB/s",
                                   fwd_bwd_rate=3 * e / ms / 1e9,
                                   note="backward alone (x, dy read, dx written), CUDA-graph device time",
                                   **env_fields()))
            apply(_BWD_KNOBS, [saved[k] for k in _BWD_KNOBS])
            del x, w, dy, rstd
    finally:
        apply(tuple(saved), tuple(saved.values()))
    return recs


# (form, model, rows, width): the forms at their models' widths (8192 tokens; q/k norms: 8192 x 8 heads)
FORM_SHAPES = [("offset", "Gemma 3 4B", 8192, 2560), ("offset", "Gemma 3 12B", 8192, 3840),
               ("offset", "Gemma 3 27B", 8192, 5376), ("offset", "Gemma 3 q/k norm", 65536, 256),
               ("gated", "Qwen3.5 linear-attention output norm", 8192 * 32, 128),
               ("gated", "Qwen3.5 linear-attention output norm", 8192 * 16, 128),
               ("weight_first", "GPT-OSS", 8192, 2880),
               # grouped statistics (the group size last): Mamba2 / NemotronH's gated norm (d_inner 8192,
               # 8 groups), Qwen4's hyper-connection norm (4 groups of the hidden size)
               ("gate_first", "Mamba2 / NemotronH gated norm, 8 groups", 8192, 8192, 1024),
               ("offset", "Qwen4 hyper-connection norm, 4 groups", 8192, 8192, 2048)]


def _form_fns(impl, x, w, g, dy):
    leaves = [t.detach().requires_grad_() for t in (x, w, g) if t is not None]

    def call(*ts):
        it = iter(ts)
        return impl(next(it), next(it) if w is not None else None, next(it) if g is not None else None)

    def fwd():
        with torch.no_grad():
            return impl(x, w, g)

    def fwd_bwd():
        return torch.autograd.grad(call(*leaves), leaves, dy)

    return fwd, fwd_bwd


def run_forms(dev: str, dtype, rep: int, native: bool, quick: bool) -> list:
    """The other forms at their models' widths: ours, eager and torch.compile of the form's torch
    formulation, and the Llama form (ours) at the same shape for its device time."""
    recs = []
    gen = torch.Generator().manual_seed(1)
    shapes = FORM_SHAPES if dev == "cuda" else [("offset", "smoke", 64, 256), ("gated", "smoke", 64, 128),
                                                ("weight_first", "smoke", 16, 256),
                                                ("gate_first", "smoke, 4 groups", 16, 128, 32)]
    if quick and dev == "cuda":
        shapes = [FORM_SHAPES[0], FORM_SHAPES[4], FORM_SHAPES[6], FORM_SHAPES[7]]
    for fname, model, rows, width, *groups in shapes:
        form = FORMS[fname]
        gs = groups[0] if groups else None
        x = (0.5 * torch.randn(rows, width, generator=gen)).to(dev, dtype)
        w = ((0.0 if fname == "offset" else 1.0) + 0.02 * torch.randn(width, generator=gen)).to(dev, dtype)
        g = torch.randn(rows, width, generator=gen).to(dev, dtype) if form.gate != "none" else None
        dy = torch.randn(rows, width, generator=gen).to(dev, dtype)
        e = rows * width * x.element_size()
        # bytes an exact implementation moves: x (and the gate) read, y written; the backward reads
        # x, dy (and the gate), writes dx (and the gate's gradient)
        n_in = 2 if g is not None else 1
        b_fwd, b_fwd_bwd = (n_in + 1) * e, (n_in + 1 + n_in + 1 + n_in) * e
        shape = f"{rows}x{width} {fname}{f' groups of {gs}' if gs else ''} ({model})"
        torch._dynamo.reset()
        compiled = torch.compile(lambda a, b, c: rms_norm_form_reference(a, b, EPS, form, c, gs), dynamic=False)
        impls = [(f"deepspeed_fused {fname}", lambda a, b, c: fused_rms_norm_form(a, b, EPS, form, c, gs), True,
                  "C++ autograd node" if native else "Python node", b_fwd, b_fwd_bwd),
                 (f"eager {fname} (HF form)", lambda a, b, c: rms_norm_form_reference(a, b, EPS, form, c, gs), False,
                  "", b_fwd, b_fwd_bwd),
                 (f"torch.compile {fname}", compiled, False, "", b_fwd, b_fwd_bwd),
                 ("deepspeed_fused llama form (same shape)", lambda a, b, c: fused_rms_norm(a, b, EPS), False,
                  "the Llama form's op at this shape (no gate): its device time is the form's target", 2 * e, 5 * e)]
        for name, fn, ours, note, bf, bfb in impls:
            gg = None if name.endswith("(same shape)") else g
            fwd, fwd_bwd = _form_fns(fn, x, w, gg, dy)
            rec = measure(SUITE, name, shape, dtype, fwd=fwd, fwd_bwd=fwd_bwd, bytes_fwd=bf, bytes_fwd_bwd=bfb,
                          ours=ours, note=note, rep=rep, tensor_mib=round(e / 2**20, 1), form=fname)
            if dev == "cuda" and rec.fwd_bwd_ms:
                add_graph_times(rec, fwd, fwd_bwd, rep, bf, bfb)
            recs.append(rec)
        del x, w, g, dy
        if dev == "cuda":
            torch.cuda.empty_cache()
    return recs


def _forms_summary(recs) -> str:
    """Targets of the forms: fwd+bwd device time within 10% of the Llama form's at the same shape
    (per byte too, since a gated norm moves more), faster than eager and torch.compile
    host-inclusive."""
    rows = ["The other forms (fwd+bwd; device time from CUDA graphs, host-inclusive from do_bench):", "",
            "| shape | ours device ms | Llama form device ms | ratio | ratio per byte | vs eager (host) | "
            "vs torch.compile (host) | targets |", "|---|---:|---:|---:|---:|---:|---:|---|"]
    for shape in dict.fromkeys(r.shape for r in recs if "form" in r.extra):
        rs = {r.impl.split(" ")[0] + (" llama" if "llama form" in r.impl else ""): r for r in recs if r.shape == shape}
        ours, llama = rs.get("deepspeed_fused"), rs.get("deepspeed_fused llama")
        eager, comp = rs.get("eager"), rs.get("torch.compile")
        if ours is None or llama is None:
            continue
        og, lg = ours.extra.get("fwd_bwd_graph_ms"), llama.extra.get("fwd_bwd_graph_ms")
        ratio = og / lg if og and lg else None
        per_byte = (ours.extra.get("fwd_bwd_graph_tbps") and llama.extra.get("fwd_bwd_graph_tbps")
                    and llama.extra["fwd_bwd_graph_tbps"] / ours.extra["fwd_bwd_graph_tbps"])
        ve = eager.fwd_bwd_ms / ours.fwd_bwd_ms if eager and eager.fwd_bwd_ms and ours.fwd_bwd_ms else None
        vc = comp.fwd_bwd_ms / ours.fwd_bwd_ms if comp and comp.fwd_bwd_ms and ours.fwd_bwd_ms else None
        met = [ratio is not None and ratio <= 1.10, ve is not None and ve > 1, vc is not None and vc > 1]
        verdict = ", ".join(f"{n} {'yes' if m else 'NO'}" for n, m in zip(("<=1.1x Llama", "> eager", "> compile"),
                                                                             met))
        f = (lambda v, d=2: f"{v:.{d}f}" if v else "-")
        rows.append(f"| {shape} | {f(og, 4)} | {f(lg, 4)} | {f(ratio)} | {f(per_byte)} | {f(ve)}x | {f(vc)}x | "
                    f"{verdict} |")
    return "\n".join(rows)


RESULT = COMMAND = None  # the files' name and command when not the suite's: rms_norm_forms with --forms


def run(args) -> list:
    global NOTES, RESULT, COMMAND
    extra = getattr(args, "extra", None) or []
    RESULT, COMMAND = ("rms_norm_forms", "python -m deepspeed_fused.bench rms_norm --forms") if "--forms" in extra \
        else (None, None)
    if "--sweep" in extra:
        return sweep(args)
    if "--forms" in extra:
        dev = "cuda" if torch.cuda.is_available() else "cpu"
        native = _native.get(wait=True) is not None if dev == "cuda" else False
        recs = run_forms(dev, torch.bfloat16 if dev == "cuda" else torch.float32, 20 if getattr(args, "quick", False)
                         else 100, native, getattr(args, "quick", False))
        NOTES = _NOTES + "\n\n" + _forms_summary(recs) if dev == "cuda" else _NOTES
        return recs
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    quick = getattr(args, "quick", False)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = SHAPES if dev == "cuda" else [(64, 128), (8, 256)]
    if quick:
        shapes = [(8192, 4096), (262144, 128), (16, 4096)] if dev == "cuda" else shapes[:1]
    rep = 20 if quick else 100
    recs = []
    native = _native.get(wait=True) is not None if dev == "cuda" else False  # built before timing
    gen = torch.Generator().manual_seed(0)
    for rows, width in shapes:
        x = (0.5 * torch.randn(rows, width, generator=gen)).to(dev, dtype)
        w = (1 + 0.02 * torch.randn(width, generator=gen)).to(dev, dtype)
        dy = torch.randn(rows, width, generator=gen).to(dev, dtype)
        e = rows * width * x.element_size()
        shape = f"{rows}x{width}"
        chain = []
        impls = [("deepspeed_fused", lambda x, w: fused_rms_norm(x, w, EPS),
                  "C++ autograd node" if native else f"Python node (C++ node unavailable: {_native.error()})", True)]
        if native:
            impls.append((_PY_NODE, _python_node, "the same kernels through the Python autograd.Function", True))
        impls += [(n, f, note, False) for n, f, note in _peers(width, dtype)]
        for name, fn, note, ours in impls:
            if name == "HF eager LlamaRMSNorm" and rows * width > 2**24:
                continue  # slow and far behind at these sizes (see earlier results); keeps the run short
            fwd, fwd_bwd = _fns(fn, x, w, dy)
            rec = measure(SUITE, name, shape, dtype, fwd=fwd, fwd_bwd=fwd_bwd, bytes_fwd=2 * e,
                          bytes_fwd_bwd=5 * e, ours=ours, note=note, rep=rep, tensor_mib=round(e / 2**20, 1))
            if dev == "cuda" and rec.fwd_bwd_ms and name in _LOOPED:
                rec.extra.update(fwd_loop_ms=round(loop_ms(fwd), 4), fwd_bwd_loop_ms=round(loop_ms(fwd_bwd), 4))
                rec.note = "; ".join(p for p in [rec.note, f"wall-clock loop: fwd {rec.extra['fwd_loop_ms']:.4f} ms, "
                                                 f"fwd+bwd {rec.extra['fwd_bwd_loop_ms']:.4f} ms"] if p)
            if (rows, width) in CHAIN_SHAPES and name in _LOOPED:
                chain.append((name, fn, note, ours))
            if dev == "cuda" and rec.fwd_bwd_ms:  # every implementation that captures
                try:
                    fms, gms = graph_ms(fwd, rep=rep), graph_ms(fwd_bwd, rep=rep)
                    rec.extra.update(fwd_graph_ms=round(fms, 4), fwd_graph_tbps=round(2 * e / fms / 1e9, 3),
                                     fwd_bwd_graph_ms=round(gms, 4), fwd_bwd_graph_tbps=round(5 * e / gms / 1e9, 3))
                    rec.note = "; ".join(p for p in [rec.note, f"CUDA graph: fwd {fms:.4f} ms ({2 * e / fms / 1e9:.2f} "
                                                     f"TB/s), fwd+bwd {gms:.4f} ms ({5 * e / gms / 1e9:.2f} TB/s)"]
                                         if p)
                except Exception as ex:  # reported, not fatal
                    torch.cuda.synchronize()
                    rec.extra["fwd_bwd_graph_ms"] = None
                    rec.note = "; ".join(p for p in [rec.note, f"no CUDA graph: {type(ex).__name__}"] if p)
            recs.append(rec)
        for name, fn, note, ours in chain:  # per norm in a chain of CHAIN, one backward
            fwd, fwd_bwd = _chain_fns(fn, x, w, dy)
            rec = measure(SUITE, name, shape + " chain8", dtype, fwd=fwd, fwd_bwd=fwd_bwd, ours=ours, note=note,
                          rep=rep, tensor_mib=round(e / 2**20, 1))
            rec.fwd_ms = rec.fwd_ms / CHAIN if rec.fwd_ms else None
            rec.fwd_bwd_ms = rec.fwd_bwd_ms / CHAIN if rec.fwd_bwd_ms else None
            rec.peak_extra_mib = None
            rec.unit, rec.fwd_rate = "TB/s", (2 * e / rec.fwd_ms / 1e9 if rec.fwd_ms else None)
            rec.fwd_bwd_rate = 5 * e / rec.fwd_bwd_ms / 1e9 if rec.fwd_bwd_ms else None
            if dev == "cuda" and rec.fwd_bwd_ms:
                rec.extra.update(fwd_loop_ms=round(loop_ms(fwd) / CHAIN, 4),
                                 fwd_bwd_loop_ms=round(loop_ms(fwd_bwd) / CHAIN, 4))
            rec.note = "; ".join(p for p in [rec.note, "per norm in a chain of 8 (each its own weight, one backward)"]
                                 + ([f"wall-clock loop per norm: fwd {rec.extra['fwd_loop_ms']:.4f} ms, fwd+bwd "
                                     f"{rec.extra['fwd_bwd_loop_ms']:.4f} ms"] if "fwd_loop_ms" in rec.extra else [])
                                 if p)
            recs.append(rec)
        del x, w, dy
        if dev == "cuda":
            torch.cuda.empty_cache()
    forms = run_forms(dev, dtype, rep, native, quick)
    NOTES = (_NOTES + "\n\n" + _summary(recs) + "\n\n" + _host_summary(recs) + "\n\n" + _forms_summary(forms)
             if dev == "cuda" else _NOTES)
    recs += forms
    return recs


def _summary(recs) -> str:
    """Our figures against the targets, from device time (CUDA graphs) and host-inclusive time."""
    rows = ["| shape | MiB per tensor | ours fwd TB/s (graph) | ours fwd+bwd TB/s (graph) | fastest peer fwd+bwd "
            "(graph) | ours vs it (graph) | ours vs fastest peer (host-inclusive) | targets met (graph) |",
            "|---|---:|---:|---:|---|---:|---:|---|"]
    for shape in dict.fromkeys(r.shape for r in recs):
        rs = [r for r in recs if r.shape == shape]
        ours = next((r for r in rs if r.ours), None)
        if ours is None or not ours.extra.get("fwd_bwd_graph_ms"):
            continue
        peers = [r for r in rs if not r.ours and r.extra.get("fwd_bwd_graph_ms")]
        best = min(peers, key=lambda r: r.extra["fwd_bwd_graph_ms"], default=None)
        host_best = min((r.fwd_bwd_ms for r in rs if not r.ours and r.fwd_bwd_ms), default=None)
        vs = best.extra["fwd_bwd_graph_ms"] / ours.extra["fwd_bwd_graph_ms"] if best else None
        vs_host = host_best / ours.fwd_bwd_ms if host_best and ours.fwd_bwd_ms else None
        mib = ours.extra.get("tensor_mib", 0)
        if mib >= 32:
            met = (ours.extra["fwd_graph_tbps"] >= 3.4, ours.extra["fwd_bwd_graph_tbps"] >= 3.0,
                   vs is not None and vs >= 1.5)
            verdict = ", ".join(f"{n} {'yes' if m else 'NO'}" for n, m in zip(("fwd", "fwd+bwd", "1.5x"), met))
        else:
            verdict = f"within 1.2x: {'yes' if vs is not None and vs >= 1 / 1.2 else 'NO'}" if mib < 1 else "-"
        head = f"| {shape} | {mib} | {ours.extra['fwd_graph_tbps']:.2f} | {ours.extra['fwd_bwd_graph_tbps']:.2f} | "
        if vs and vs_host:
            rows.append(head + f"{best.impl} | {vs:.2f}x | {vs_host:.2f}x | {verdict} |")
        else:
            rows.append(head + "- | - | - | - |")
    return "\n".join(rows)


def _host_summary(recs) -> str:
    """Host-inclusive targets against ``F.rms_norm``: one call and chain fwd+bwd >= 1.3x,
    forward >= 1x at 8 MiB or more per tensor, 16-row forward within 1.2x. Both timers: do_bench
    (the table's columns) and the wall-clock loop."""
    rows = ["Against `torch.nn.functional.rms_norm`, host-inclusive (F.rms_norm time / ours; do_bench, then the "
            "wall-clock loop):", "",
            "| shape | MiB per tensor | fwd+bwd | fwd+bwd (loop) | fwd | fwd (loop) | target |",
            "|---|---:|---:|---:|---:|---:|---|"]

    def ratio(a, b):
        return f"{a / b:.2f}x" if a and b else "-"

    for shape in dict.fromkeys(r.shape for r in recs):
        ours = next((r for r in recs if r.shape == shape and r.ours), None)
        peer = next((r for r in recs if r.shape == shape and r.impl == "torch F.rms_norm"), None)
        if ours is None or peer is None:
            continue
        mib = ours.extra.get("tensor_mib", 0)
        fb, fbl = ratio(peer.fwd_bwd_ms, ours.fwd_bwd_ms), ratio(peer.extra.get("fwd_bwd_loop_ms"),
                                                                   ours.extra.get("fwd_bwd_loop_ms"))
        f, fl = ratio(peer.fwd_ms, ours.fwd_ms), ratio(peer.extra.get("fwd_loop_ms"), ours.extra.get("fwd_loop_ms"))
        if shape.startswith("16x"):
            target = "fwd >= 0.83x (within 1.2x)"
        elif "chain" in shape or mib >= 8:
            target = "fwd+bwd >= 1.3x" + ("" if "chain" in shape else "; fwd >= 1x")
        else:
            target = "-"
        rows.append(f"| {shape} | {mib} | {fb} | {fbl} | {f} | {fl} | {target} |")
    return "\n".join(rows)
