"""Suite ``rms_norm``: the fused RMSNorm against its peers, bf16 (weight bf16, eps 1e-6).

Effective bandwidth counts the bytes an exact implementation must move: the forward reads x and
writes y; forward + backward adds reading x and dy and writing dx (the weight and its gradient
are negligible). So with E = rows x width x element size: fwd = 2E, fwd+bwd = 5E.

Peers: Hugging Face eager (``LlamaRMSNorm``), ``torch.nn.functional.rms_norm``, ``torch.compile``
of the eager form, Liger-Kernel ``LigerRMSNorm`` (llama casting, not in place) and DeepSpeed
0.19.8 ``fused_rms_norm`` (widths up to 2048), each when it imports. Forward + backward is timed
as the forward followed by ``torch.autograd.grad`` for x and the weight.

``python -m deepspeed_fused.bench rms_norm --sweep`` times the kernels' tile knobs instead (one
record per setting and shape) to tune the defaults in ``deepspeed_fused/ops/rms_norm.py``.
"""
from __future__ import annotations

import torch

from ..ops import rms_norm as _ops
from ..ops.rms_norm import fused_rms_norm, rms_norm_reference
from .common import graph_ms, measure

SUITE = "rms_norm"
TITLE = "Fused RMSNorm (Llama form) forward and forward+backward"
NOTES = ("Targets (H200, bf16): on shapes with >= 32 MiB per tensor, fwd >= 3.4 TB/s and fwd+bwd >= 3.0 TB/s "
         "effective and fwd+bwd >= 1.5x the fastest peer; short inputs (16 rows) fwd+bwd within 1.2x of the "
         "fastest peer. Effective bytes: fwd = x read + y written; fwd+bwd adds x and dy read and dx written. The fwd+bwd column is host-inclusive: "
         "forward then torch.autograd.grad, so autograd's hand-over to its device thread and any Python in "
         "the backward count. The note gives, for ours, torch F.rms_norm and HF eager, the same "
         "forward+backward replayed from a CUDA graph (device time alone).")

# implementations also timed as a CUDA-graph replay of forward+backward (device time alone)
GRAPHED = ("deepspeed_fused", "torch F.rms_norm", "HF eager LlamaRMSNorm")
SHAPES = [(8192, 2048), (8192, 4096), (8192, 8192), (262144, 128), (32768, 128), (524288, 128), (16, 128),
          (16, 4096)]
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


SWEEP = [  # (fwd tile bytes, fwd elems/warp, bwd tile elems, bwd elems/warp, bwd prefetch)
    (16384, 1024, 4096, 512, True), (16384, 1024, 4096, 512, False), (8192, 1024, 2048, 512, True),
    (8192, 1024, 2048, 512, False), (32768, 2048, 8192, 1024, True), (16384, 512, 4096, 256, True),
    (8192, 512, 8192, 512, False), (32768, 1024, 2048, 256, True), (16384, 2048, 4096, 1024, False),
]
_KNOBS = ("_FWD_TILE_BYTES", "_FWD_ELEMS_PER_WARP", "_BWD_TILE_ELEMS", "_BWD_ELEMS_PER_WARP", "_BWD_PREFETCH")


def sweep(args) -> list:
    """Time our kernels under each knob setting of SWEEP (defaults restored afterwards)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = [(8192, 2048), (8192, 4096), (8192, 8192), (262144, 128), (524288, 128), (16, 4096)] \
        if dev == "cuda" else [(64, 128)]
    saved = {k: getattr(_ops, k) for k in _KNOBS}
    recs = []
    gen = torch.Generator().manual_seed(0)
    try:
        for rows, width in shapes:
            x = (0.5 * torch.randn(rows, width, generator=gen)).to(dev, dtype)
            w = (1 + 0.02 * torch.randn(width, generator=gen)).to(dev, dtype)
            dy = torch.randn(rows, width, generator=gen).to(dev, dtype)
            e = rows * width * x.element_size()
            for setting in SWEEP:
                for k, v in zip(_KNOBS, setting):
                    setattr(_ops, k, v)
                _ops._occupancy_cache.clear()
                _ops.clear_plans()
                fwd, fwd_bwd = _fns(lambda x, w: fused_rms_norm(x, w, EPS), x, w, dy)
                recs.append(measure(SUITE, "ours " + "/".join(str(v) for v in setting), f"{rows}x{width}",
                                    dtype, fwd=fwd, fwd_bwd=fwd_bwd, bytes_fwd=2 * e, bytes_fwd_bwd=5 * e,
                                    ours=True, rep=50))
    finally:
        for k, v in saved.items():
            setattr(_ops, k, v)
        _ops._occupancy_cache.clear()
        _ops.clear_plans()
    return recs


def run(args) -> list:
    if "--sweep" in (getattr(args, "extra", None) or []):
        return sweep(args)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    quick = getattr(args, "quick", False)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = SHAPES if dev == "cuda" else [(64, 128), (8, 256)]
    if quick:
        shapes = [(8192, 4096), (262144, 128), (16, 4096)] if dev == "cuda" else shapes[:1]
    rep = 20 if quick else 100
    recs = []
    gen = torch.Generator().manual_seed(0)
    for rows, width in shapes:
        x = (0.5 * torch.randn(rows, width, generator=gen)).to(dev, dtype)
        w = (1 + 0.02 * torch.randn(width, generator=gen)).to(dev, dtype)
        dy = torch.randn(rows, width, generator=gen).to(dev, dtype)
        e = rows * width * x.element_size()
        shape = f"{rows}x{width}"
        impls = [("deepspeed_fused", lambda x, w: fused_rms_norm(x, w, EPS), "", True)]
        impls += [(n, f, note, False) for n, f, note in _peers(width, dtype)]
        for name, fn, note, ours in impls:
            fwd, fwd_bwd = _fns(fn, x, w, dy)
            rec = measure(SUITE, name, shape, dtype, fwd=fwd, fwd_bwd=fwd_bwd, bytes_fwd=2 * e,
                          bytes_fwd_bwd=5 * e, ours=ours, note=note, rep=rep, tensor_mib=round(e / 2**20, 1))
            if dev == "cuda" and name in GRAPHED and rec.fwd_bwd_ms:
                try:
                    gms = graph_ms(fwd_bwd, rep=rep)
                    rec.extra["fwd_bwd_graph_ms"] = round(gms, 4)
                    rec.extra["fwd_bwd_graph_tbps"] = round(5 * e / gms / 1e9, 3)
                    rec.note = "; ".join(p for p in [rec.note, f"CUDA graph fwd+bwd {gms:.4f} ms "
                                                     f"({5 * e / gms / 1e9:.2f} TB/s)"] if p)
                except Exception as ex:  # reported, not fatal
                    rec.extra["fwd_bwd_graph_ms"] = None
                    rec.note = "; ".join(p for p in [rec.note, f"no CUDA graph: {type(ex).__name__}"] if p)
            recs.append(rec)
        del x, w, dy
        if dev == "cuda":
            torch.cuda.empty_cache()
    return recs
