"""Suite ``mlp_act``: the fused gated activation ``act(gate) * up`` against its peers, bf16.

Inputs as a gated MLP makes them: ``gate`` and ``up`` ``[tokens, I]`` (the two projections'
outputs), the output's gradient ``[tokens, I]``; forward + backward is the forward followed by
``torch.autograd.grad`` of both inputs. Shapes: the MLP widths of Llama-3.2-3B (8192), Llama-3-8B
(14336), Qwen3-1.7B (6144) and Qwen3-4B (9728) with SiLU at 8192 and 16384 tokens, Gemma-3-1B's
(6912) with tanh GELU, and Phi-3-mini's fused gate-up projection (8192, the gate its first half).
Effective bytes count what an exact implementation must move: the forward reads gate and up and
writes the output (3 T I elements); the backward reads gate, up and the gradient and writes two
gradients (5 T I), so fwd+bwd = 8 T I elements.

Implementations (each when it imports and takes the shape):

* ``deepspeed_fused``: :func:`~deepspeed_fused.ops.mlp_act.mlp_act` (what a patched MLP calls;
  :func:`~deepspeed_fused.ops.mlp_act.mlp_act_fused` for the gate-up layout);
* ``HF eager``: transformers' activation module then the product (``act_fn(gate) * up``; for the
  gate-up layout the chunk first);
* ``torch.compile(eager)``: the same, compiled (``dynamic=False``);
* ``Liger LigerSiLUMulFunction`` (SiLU) / ``Liger LigerGELUMulFunction`` (tanh GELU): Liger's
  SwiGLU/GeGLU, whose backward writes the gradients into its inputs' storage (as in its MLP, where
  they are intermediates): here the inputs' values change from call to call, which does not change
  an elementwise kernel's time;
* ``DeepSpeed swiglu (Triton)``: ``deepspeed.ops.triton_ops.swiglu`` (SiLU; ``swiglu_packed`` for
  the gate-up layout);
* ``deepspeed_fused, fast SiLU forward`` (SiLU): ours with the forward's opt-in fast path on
  (``launch.FAST_SILU``; off by default, when every activation is computed with CUDA's ``expf`` and
  IEEE division): what the path saves on this GPU. Ours, not a peer: the ratios to the best peer
  leave it out.

The fwd and fwd+bwd columns are host-inclusive (do_bench); the note adds the CUDA-graph replay
(device time alone) for every implementation that captures. On a GPU each implementation is timed
in rounds at each shape (two by default, ``--rounds N``), every other one in the reverse order, and
keeps its fastest medians. ``--tokens N`` runs only the shapes of N tokens.
"""
from __future__ import annotations

import argparse

import torch

from ..ops.mlp_act import mlp_act, mlp_act_fused
from .common import add_graph_times, measure

SUITE = "mlp_act"
TITLE = "Fused gated activation act(gate) * up, forward and forward+backward"
_NOTES = ("Host-inclusive fwd and fwd+bwd (do_bench; fwd+bwd: the forward, then torch.autograd.grad of gate and "
          "up); the note adds the CUDA-graph replay (device time alone). Effective bytes: fwd = gate, up read + "
          "output written (3 T I elements); fwd+bwd = 8 T I. On a GPU each implementation is timed in rounds at "
          "each shape (two unless said), every other one in the reverse order, and keeps its fastest host-inclusive "
          "median. deepspeed_fused "
          "is checked bitwise against HF eager (tests/gpu/test_mlp_act_gpu.py); the peers' numerics are not checked "
          "here.")
NOTES = _NOTES

# name, tokens, intermediate width, activation, layout ("split" or "gate_up")
SHAPES = [
    ("Llama-3.2-3B 8192 tok", 8192, 8192, "silu", "split"),
    ("Llama-3.2-3B 16384 tok", 16384, 8192, "silu", "split"),
    ("Llama-3-8B 8192 tok", 8192, 14336, "silu", "split"),
    ("Llama-3-8B 16384 tok", 16384, 14336, "silu", "split"),
    ("Qwen3-1.7B 8192 tok", 8192, 6144, "silu", "split"),
    ("Qwen3-1.7B 16384 tok", 16384, 6144, "silu", "split"),
    ("Qwen3-4B 8192 tok", 8192, 9728, "silu", "split"),
    ("Qwen3-4B 16384 tok", 16384, 9728, "silu", "split"),
    ("Gemma-3-1B GeGLU 16384 tok", 16384, 6912, "gelu_tanh", "split"),
    ("Phi-3-mini gate_up 8192 tok", 8192, 8192, "silu", "gate_up"),
]
QUICK = ("Llama-3.2-3B 16384 tok", "Qwen3-4B 8192 tok", "Gemma-3-1B GeGLU 16384 tok", "Phi-3-mini gate_up 8192 tok")
CPU_SHAPES = [("tiny silu", 64, 96, "silu", "split"), ("tiny gelu_tanh gate_up", 32, 48, "gelu_tanh", "gate_up")]
_HF_ACT = {"silu": "silu", "gelu_tanh": "gelu_pytorch_tanh", "gelu": "gelu"}


def _impls(act: str, layout: str, dev: str) -> list:
    """(name, fn(x) -> output, ours) where x is (gate, up) or (gate_up,)."""
    from transformers.activations import ACT2FN

    act_mod = ACT2FN[_HF_ACT[act]]
    if layout == "split":
        def eager(g, u):
            return act_mod(g) * u

        out = [("deepspeed_fused", lambda g, u: mlp_act(g, u, act), True), ("HF eager", eager, False)]
    else:
        def eager(gu):
            gate, up = gu.chunk(2, dim=-1)
            return act_mod(gate) * up

        out = [("deepspeed_fused", lambda gu: mlp_act_fused(gu, act, True), True), ("HF eager", eager, False)]
    if dev != "cuda":
        return out
    if act == "silu":
        # ours too (not a peer): the "vs best peer" ratios compare with the peers alone
        out.append(("deepspeed_fused, fast SiLU forward", _fast_silu_forward(out[0][1]), True))
    # dynamo's caches start empty at each shape: every shape and grad mode is a recompile, and past
    # dynamo's recompile limit a compiled function runs eager (which earlier rows of this suite did)
    torch._dynamo.reset()
    out.append(("torch.compile(eager)", torch.compile(eager, dynamic=False), False))
    try:
        if act == "silu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction as Fn
        elif act == "gelu_tanh":
            from liger_kernel.ops.geglu import LigerGELUMulFunction as Fn
        else:
            Fn = None
        if Fn is not None:
            name = f"Liger {Fn.__name__}"
            if layout == "split":
                out.append((name, Fn.apply, False))
            else:
                out.append((name, lambda gu: Fn.apply(*gu.chunk(2, dim=-1)), False))
    except Exception:
        pass
    if act == "silu":
        try:
            from deepspeed.ops.triton_ops import swiglu_triton as ds

            if ds._TRITON_AVAILABLE:
                out.append(("DeepSpeed swiglu (Triton)", ds.swiglu if layout == "split" else ds.swiglu_packed, False))
        except Exception:
            pass
    return out


def _fast_silu_forward(fn):
    """``fn`` with the SiLU forward's fast path on while it runs."""
    from ..ops.mlp_act import launch

    def run(*xs):
        saved, launch.FAST_SILU = launch.FAST_SILU, True
        try:
            return fn(*xs)
        finally:
            launch.FAST_SILU = saved

    return run


def _inputs(tokens, inter, layout, dev, dtype, gen):
    if layout == "split":
        xs = [torch.randn(tokens, inter, generator=gen).to(dev, dtype) for _ in range(2)]
    else:
        xs = [torch.randn(tokens, 2 * inter, generator=gen).to(dev, dtype)]
    dh = torch.randn(tokens, inter, generator=gen).to(dev, dtype)
    return xs, dh


def _fns(impl, xs, dh):
    leaves = [x.detach().clone().requires_grad_() for x in xs]

    def fwd():
        with torch.no_grad():
            return impl(*xs)

    def fwd_bwd():
        return torch.autograd.grad(impl(*leaves), leaves, dh)

    return fwd, fwd_bwd


def faster_of(a, b):
    """The record of two rounds of one implementation at one shape with the lower forward and
    forward+backward medians (each taken on its own, the rates with them); ``rounds`` counts them."""
    if a is None or ("failed" in a.note and "failed" not in b.note):  # a round that failed gives way
        b.extra["rounds"] = 1 if a is None else a.extra.get("rounds", 1) + 1
        return b
    out = a
    for t, rate in (("fwd_ms", "fwd_rate"), ("fwd_bwd_ms", "fwd_bwd_rate")):
        x, y = getattr(a, t), getattr(b, t)
        if y is not None and (x is None or y < x):
            setattr(out, t, y)
            setattr(out, rate, getattr(b, rate))
    if b.peak_extra_mib is not None:
        out.peak_extra_mib = b.peak_extra_mib if out.peak_extra_mib is None else max(out.peak_extra_mib,
                                                                                    b.peak_extra_mib)
    out.extra["rounds"] = a.extra.get("rounds", 1) + 1
    return out


def round_orders(impls: list, rounds: int) -> list:
    """The implementations' order in each of ``rounds`` rounds: as listed, then reversed, and so on."""
    return [impls if i % 2 == 0 else impls[::-1] for i in range(rounds)]


def run(args) -> list:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    quick = getattr(args, "quick", False)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = SHAPES if dev == "cuda" else CPU_SHAPES
    if quick and dev == "cuda":
        shapes = [s for s in SHAPES if s[0] in QUICK]
    p = argparse.ArgumentParser(prog="python -m deepspeed_fused.bench mlp_act", exit_on_error=False)
    p.add_argument("--tokens", type=int, default=None, help="only the shapes of this many tokens")
    p.add_argument("--rounds", type=int, default=2, help="timed rounds per implementation and shape (GPU)")
    try:
        o, _ = p.parse_known_args(list(getattr(args, "extra", None) or []))
    except argparse.ArgumentError as e:
        raise SystemExit(f"mlp_act: {e} (e.g. --tokens 8192, --rounds 3)") from None
    if o.rounds < 1:
        raise SystemExit(f"mlp_act: --rounds: expected a positive count, got {o.rounds}")
    if o.tokens is not None:
        shapes = [s for s in shapes if s[1] == o.tokens]
        if not shapes:
            raise SystemExit(f"mlp_act: no shape of {o.tokens} tokens (have "
                             f"{sorted({s[1] for s in SHAPES + CPU_SHAPES})})")
    rep = 20 if quick else 100
    recs = []
    gen = torch.Generator().manual_seed(0)
    for name, tokens, inter, act, layout in shapes:
        xs, dh = _inputs(tokens, inter, layout, dev, dtype, gen)
        n = tokens * inter * xs[0].element_size()
        impls = _impls(act, layout, dev)
        shape_recs = {}
        # rounds in alternating order: each implementation keeps its fastest host-inclusive
        # median, so none is timed only right after the inputs were made
        for order in round_orders(impls, o.rounds if dev == "cuda" else 1):
            for iname, impl, ours in order:
                fwd, fwd_bwd = _fns(impl, xs, dh)
                rec = measure(SUITE, iname, name, dtype, fwd=fwd, fwd_bwd=fwd_bwd, bytes_fwd=3 * n,
                              bytes_fwd_bwd=8 * n, ours=ours, rep=rep, tokens=tokens, intermediate=inter, act=act,
                              layout=layout)
                shape_recs[iname] = faster_of(shape_recs.get(iname), rec)
        for iname, impl, _ in impls:
            rec = shape_recs[iname]
            if dev == "cuda" and rec.fwd_bwd_ms:
                fwd, fwd_bwd = _fns(impl, xs, dh)
                add_graph_times(rec, fwd, fwd_bwd, rep, 3 * n, 8 * n)
            recs.append(rec)
        del xs, dh
        if dev == "cuda":
            torch.cuda.empty_cache()
    global NOTES
    NOTES = _NOTES + "\n\n" + summary(recs) if dev == "cuda" else _NOTES
    return recs


def summary(recs) -> str:
    """Ours against each peer, forward+backward host-inclusive (do_bench) and device time (graph)."""
    peers = list(dict.fromkeys(r.impl for r in recs if not r.ours))
    rows = ["| shape | " + " | ".join(f"vs {p} (fwd+bwd do_bench / graph)" for p in peers) + " | ours fwd+bwd TB/s "
            "(graph) |", "|---|" + "---|" * len(peers) + "---:|"]
    for shape in dict.fromkeys(r.shape for r in recs):
        rs = {r.impl: r for r in recs if r.shape == shape}
        ours = rs.get("deepspeed_fused")
        if ours is None or not ours.fwd_bwd_ms:
            continue
        cells = []
        for p in peers:
            r = rs.get(p)
            if r is None or not r.fwd_bwd_ms:
                cells.append("-")
                continue
            g, og = r.extra.get("fwd_bwd_graph_ms"), ours.extra.get("fwd_bwd_graph_ms")
            cells.append(f"{r.fwd_bwd_ms / ours.fwd_bwd_ms:.2f}x / " + (f"{g / og:.2f}x" if g and og else "-"))
        rows.append(f"| {shape} | " + " | ".join(cells) + f" | {ours.extra.get('fwd_bwd_graph_tbps', '-')} |")
    return "\n".join(rows)
