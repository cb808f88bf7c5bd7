"""Suite ``rope``: the fused rotary embedding against its peers, bf16, q and k together.

Inputs as a Hugging Face attention passes them: q and k are ``[B, H, S, D]`` views of the
``[B, S, H, D]`` projections (leaf tensors behind them for the backward), cos/sin ``[B, S, D]``
in the input dtype (the rotary module casts them so). Forward + backward is the forward followed
by ``torch.autograd.grad`` of both outputs. Effective bytes count what an exact implementation
must move: the forward reads q, k, cos and sin and writes both outputs; the backward reads the
two gradients (and cos, sin) and writes two. So with E = bytes of q and k together and A = bytes of
cos and sin together: fwd = 2E + A, fwd+bwd = 4E + 2A.

Implementations (each when it imports and takes the shape):

* ``deepspeed_fused``: the call a patched attention forward makes (the family's function
  recognised, arguments read, the op called), and ``deepspeed_fused op``: ``fused_rope`` itself;
* ``HF eager``: the family's own ``apply_rotary_pos_emb``;
* ``torch.compile(eager)``: the same function compiled (``dynamic=False``);
* ``Liger liger_rotary_pos_emb`` (split-half only; rotates q and k in place, as in Liger's patch);
* ``DeepSpeed 0.19.8 fused_apply_rotary_pos_emb`` (split-half, bf16/fp16).

The partial-rotary (GPT-NeoX form, a quarter of the head rotated) and DeepSeek-V3 interleave
(MLA's 64-wide rope part, one key head) shapes have eager and torch.compile as peers only.

``python -m deepspeed_fused.bench rope --sweep --out DIR`` times the kernel's knobs instead (tile
sizes, warps, q's and k's tiles interleaved or not, the angles' shared halves read once or in full;
CUDA-graph device time of our forward and backward at the Qwen3, Llama and Gemma-3-1B shapes, and
Liger's forward and backward ops there).
"""
from __future__ import annotations

import importlib

import torch

from ..ops.rope import launch as _ops
from ..ops.rope import fused_rope
from .common import Record, add_graph_times, env_fields, graph_ms, loop_ms, measure

SUITE = "rope"
_TITLE = "Fused rotary embedding (q and k) forward and forward+backward"
TITLE = _TITLE
_NOTES = ("Targets (H200, bf16, host-inclusive): forward+backward >= 2x HF eager and >= 1.2x Liger's RoPE at the "
          "Qwen3 and Llama shapes. The fwd and fwd+bwd columns are host-inclusive (do_bench; fwd+bwd: the forward, "
          "then torch.autograd.grad); the note adds the wall-clock loop and, for every implementation that "
          "captures, the CUDA-graph replay (device time alone). Effective bytes: fwd = q, k, cos, sin read + both "
          "outputs written; fwd+bwd twice that.")
NOTES = _NOTES
RESULT = None  # the files' name when not the suite's (the sweep's: rope_sweep.*)
COMMAND = None
METHOD = None
PANELS = None
_SWEEP_TITLE = "the rotary kernel's knobs against Liger's kernel, forward and backward alone"
_SWEEP_NOTES = ("Each row: one setting of the kernel's knobs (`deepspeed_fused/ops/rope/launch.py`), or Liger's "
                "`rope_forward` / `rope_backward` at the same shape. The `fwd ms` column is the forward alone and "
                "the `fwd+bwd ms` column the backward alone (not their sum), CUDA-graph device time; rates: q and k "
                "read and written, and the angles as read (half of cos and sin where the setting reads the shared "
                "halves once and they are equal). Liger's ops write over q and k in place; its backward takes the "
                "gradients as `[B, S, H, D]` and is handed them here contiguous as `[B, H, S, D]`, so its time "
                "includes a copy of each that a model whose attention returns that layout would not make.")
_SWEEP_METHOD = "Medians of CUDA-graph replays (50 each)."
_SWEEP_PANELS = ("forward alone (CUDA graph)", "backward alone (CUDA graph)")

# name, family module, function, B, S, q heads, kv heads, head dim, cos width, form kwargs of fused_rope
SHAPES = [
    ("Qwen3 8192 tok", "qwen3", "apply_rotary_pos_emb", 1, 8192, 32, 4, 128, 128),
    ("Qwen3 2x4096 tok", "qwen3", "apply_rotary_pos_emb", 2, 4096, 32, 4, 128, 128),
    ("Llama 8192 tok", "llama", "apply_rotary_pos_emb", 1, 8192, 32, 8, 128, 128),
    ("Llama 2048 tok", "llama", "apply_rotary_pos_emb", 1, 2048, 32, 8, 128, 128),
    ("NeoX partial 1/4, 8192 tok", "gpt_neox", "apply_rotary_pos_emb", 1, 8192, 32, 32, 128, 32),
    ("DeepSeek-V3 MLA rope 8192 tok", "deepseek_v3", "apply_rotary_pos_emb_interleave", 1, 8192, 128, 1, 64, 64),
]
TARGET_SHAPES = ("Qwen3 8192 tok", "Qwen3 2x4096 tok", "Llama 8192 tok")
# the sweep's shapes: the target shapes, and few wide heads (Gemma-3-1B: the angles as many bytes as k)
SWEEP_SHAPES = [x for x in SHAPES if x[0] in TARGET_SHAPES] + [
    ("Gemma-3-1B 2x4096 tok", "gemma3", "apply_rotary_pos_emb", 2, 4096, 4, 1, 256, 256)]
CPU_SHAPES = [("Llama tiny", "llama", "apply_rotary_pos_emb", 1, 8, 4, 2, 16, 16),
              ("DeepSeek-V3 tiny", "deepseek_v3", "apply_rotary_pos_emb_interleave", 1, 8, 4, 1, 16, 16)]
_LOOPED = ("deepspeed_fused", "HF eager", "Liger liger_rotary_pos_emb", "DeepSpeed 0.19.8 fused_apply_rotary_pos_emb",
           "torch.compile(eager)")


def _family_fn(family: str, name: str):
    mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return mod, getattr(mod, name)


def _ours(mod, fn):
    """What a patched forward calls: the fused call built for the module's recognised function
    (``fn``: the module global; from transformers 5.25 a kernels function module around it)."""
    from ..features import rope as feat

    plain = feat.plain_function(fn)
    form = feat.recognise(plain) if plain is not None else f"not a plain Python function ({type(fn).__name__})"
    if not isinstance(form, feat.Form):
        raise RuntimeError(f"{mod.__name__}: {fn!r} is not recognised: {form}")
    return feat._make_call(vars(mod), plain.__name__, fn, form), form


def _impls(mod, fn, split_half: bool, dev: str, dtype) -> list:
    """(name, fn(q, k, cos, sin), note, ours)."""
    call, form = _ours(mod, fn)
    out = [("deepspeed_fused", call, f"the patched forward's call ({form.describe()})", True),
           ("deepspeed_fused op", lambda q, k, c, s: fused_rope(q, k, c, s, 1, form.spec), "fused_rope directly", True),
           ("HF eager", fn, "", False)]
    if dev == "cuda":
        try:
            torch._dynamo.reset()
            out.append(("torch.compile(eager)", torch.compile(fn, dynamic=False), "", False))
        except Exception:
            pass
    if split_half and dev == "cuda":
        try:
            from liger_kernel.transformers.rope import liger_rotary_pos_emb

            out.append(("Liger liger_rotary_pos_emb", liger_rotary_pos_emb, "in place on q and k", False))
        except Exception:
            pass
        try:
            from deepspeed.ops.triton_ops.fused_rotary_pos_emb import fused_apply_rotary_pos_emb

            if dtype in (torch.bfloat16, torch.float16):
                out.append(("DeepSpeed 0.19.8 fused_apply_rotary_pos_emb", fused_apply_rotary_pos_emb, "", False))
        except Exception:
            pass
    return out


def _inputs(b, s, hq, hk, d, w, dev, dtype, gen):
    qb = (torch.randn(b, s, hq, d, generator=gen)).to(dev, dtype)
    kb = (torch.randn(b, s, hk, d, generator=gen)).to(dev, dtype)
    pos = torch.arange(s, dtype=torch.float32)[None, :, None].expand(b, s, 1)
    inv = 1.0 / (1e6 ** (torch.arange(0, w, 2, dtype=torch.float32) / w))
    freqs = pos * inv[None, None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos().to(dev, dtype), emb.sin().to(dev, dtype)
    gq = torch.randn(b, hq, s, d, generator=gen).to(dev, dtype)
    gk = torch.randn(b, hk, s, d, generator=gen).to(dev, dtype)
    return qb, kb, cos, sin, gq, gk


def _fns(impl, qb, kb, cos, sin, gq, gk):
    qg, kg = qb.detach().clone().requires_grad_(), kb.detach().clone().requires_grad_()

    def fwd():
        with torch.no_grad():
            return impl(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)

    def fwd_bwd():
        yq, yk = impl(qg.transpose(1, 2), kg.transpose(1, 2), cos, sin)
        return torch.autograd.grad((yq, yk), (qg, kg), (gq, gk))

    return fwd, fwd_bwd


def _liger_ops():
    """Liger's rotary forward and backward ops (each in place), or None where it is not installed."""
    try:
        from liger_kernel.ops.rope import rope_backward, rope_forward
    except Exception:
        return None
    return rope_forward, rope_backward


def sweep(args) -> list:
    """Device time (CUDA-graph replay) of our forward and backward under each tile setting."""
    if not torch.cuda.is_available():
        raise SystemExit("the rope sweep needs a GPU (it times CUDA-graph replays)")
    dtype = torch.bfloat16
    knobs = ("_TILE_PAIRS", "_MAX_BLOCK_R", "_NUM_WARPS", "_INTERLEAVE_QK", "_SHARE_HALVES")
    # the default tiles with q's and k's tiles in order and interleaved, each reading the angles'
    # shared halves once and in full; a smaller and a larger tile (tile and warp settings have moved
    # ours by under 1% at the target shapes), interleaved or not, halves read once
    settings = [(2048, 64, 4, i, h) for i in (False, True) for h in (True, False)]
    settings += [(t, r, w, i, True) for t, r, w, i in ((1024, 16, 4, False), (4096, 64, 8, True))]
    saved = {k: getattr(_ops, k) for k in knobs}
    liger = _liger_ops()
    recs = []
    gen = torch.Generator().manual_seed(0)
    try:
        for name, fam, fname, b, s, hq, hk, d, w in SWEEP_SHAPES:
            mod, fn = _family_fn(fam, fname)
            _, form = _ours(mod, fn)
            qb, kb, cos, sin, gq, gk = _inputs(b, s, hq, hk, d, w, "cuda", dtype, gen)
            q, k = qb.transpose(1, 2), kb.transpose(1, 2)
            e = (qb.numel() + kb.numel()) * qb.element_size()
            a = 2 * cos.numel() * cos.element_size()
            for setting in settings:
                for kname, v in zip(knobs, setting):
                    setattr(_ops, kname, v)
                _ops.clear_plans()
                plan = _ops._get_plan(q, k, cos, sin, 1, form.spec)
                # the angles' flag as a model's first layer leaves it for the others (compared once
                # per forward): made before the graphs, which time the rotation alone
                same = _ops._same_halves(plan, cos, sin)
                fms = graph_ms(lambda: _ops._forward(plan, q, k, cos, sin, same=same), rep=50)
                bms = graph_ms(lambda: _ops._backward(plan, (gq, gk), cos, sin, same=same), rep=50)
                label = "tile_pairs/max_block_r/warps/interleave_qk/share_halves " + "/".join(map(str, setting))
                nb = 2 * e + (a // 2 if int(same) else a)
                recs.append(Record(SUITE, label, name, "bfloat16", ours=True, fwd_ms=fms, fwd_bwd_ms=bms, unit="TB/s",
                                   fwd_rate=nb / fms / 1e9, fwd_bwd_rate=nb / bms / 1e9,
                                   note="fwd and bwd (not fwd+bwd) alone, CUDA-graph device time", **env_fields()))
            if liger is not None:  # Liger's kernel at the same shape: in place on q and k, on the gradients
                fwd_op, bwd_op = liger
                fms = graph_ms(lambda: fwd_op(q, k, cos, sin), rep=50)
                bms = graph_ms(lambda: bwd_op(gq, gk, cos, sin), rep=50)
                recs.append(Record(SUITE, "Liger rope_forward / rope_backward", name, "bfloat16", ours=False,
                                   fwd_ms=fms, fwd_bwd_ms=bms, unit="TB/s", fwd_rate=(2 * e + a // 2) / fms / 1e9,
                                   fwd_bwd_rate=(2 * e + a // 2) / bms / 1e9,
                                   note="fwd and bwd (not fwd+bwd) alone, in place, CUDA-graph device time",
                                   **env_fields()))
            del qb, kb, gq, gk
    finally:
        for kname, v in saved.items():
            setattr(_ops, kname, v)
        _ops.clear_plans()
    return recs


def run(args) -> list:
    global RESULT, TITLE, COMMAND, METHOD, NOTES, PANELS
    if "--sweep" in (getattr(args, "extra", None) or []):
        # its own files, so that a sweep written into the results folder leaves the suite's page alone
        RESULT, TITLE, METHOD, NOTES = "rope_sweep", _SWEEP_TITLE, _SWEEP_METHOD, _SWEEP_NOTES
        COMMAND, PANELS = "python -m deepspeed_fused.bench rope --sweep", _SWEEP_PANELS
        return sweep(args)
    RESULT, TITLE, COMMAND, METHOD, PANELS = None, _TITLE, None, None, None
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    quick = getattr(args, "quick", False)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = SHAPES if dev == "cuda" else CPU_SHAPES
    if quick and dev == "cuda":
        shapes = [sh for sh in SHAPES if sh[0] in ("Qwen3 8192 tok", "Llama 8192 tok")]
    rep = 20 if quick else 100
    recs = []
    gen = torch.Generator().manual_seed(0)
    for name, fam, fname, b, s, hq, hk, d, w in shapes:
        mod, fn = _family_fn(fam, fname)
        qb, kb, cos, sin, gq, gk = _inputs(b, s, hq, hk, d, w, dev, dtype, gen)
        e = (qb.numel() + kb.numel()) * qb.element_size()
        a = 2 * cos.numel() * cos.element_size()
        split_half = fam in ("llama", "qwen3")
        for iname, impl, note, ours in _impls(mod, fn, split_half, dev, dtype):
            fwd, fwd_bwd = _fns(impl, qb, kb, cos, sin, gq, gk)
            rec = measure(SUITE, iname, name, dtype, fwd=fwd, fwd_bwd=fwd_bwd, bytes_fwd=2 * e + a,
                          bytes_fwd_bwd=4 * e + 2 * a, ours=ours, note=note, rep=rep,
                          q_heads=hq, kv_heads=hk, head_dim=d, tokens=b * s, cos_width=w)
            if dev == "cuda" and rec.fwd_bwd_ms and iname in _LOOPED:
                rec.extra.update(fwd_loop_ms=round(loop_ms(fwd), 4), fwd_bwd_loop_ms=round(loop_ms(fwd_bwd), 4))
                rec.note = "; ".join(p for p in [rec.note, f"wall-clock loop: fwd {rec.extra['fwd_loop_ms']:.4f} ms, "
                                                 f"fwd+bwd {rec.extra['fwd_bwd_loop_ms']:.4f} ms"] if p)
            if dev == "cuda" and rec.fwd_bwd_ms:
                add_graph_times(rec, fwd, fwd_bwd, rep, 2 * e + a, 4 * e + 2 * a)
            recs.append(rec)
        del qb, kb, gq, gk
        if dev == "cuda":
            torch.cuda.empty_cache()
    NOTES = _NOTES + "\n\n" + summary(recs) if dev == "cuda" else _NOTES
    return recs


def summary(recs) -> str:
    """Ours (the patched forward's call) against HF eager and Liger, fwd+bwd host-inclusive
    (do_bench, then the wall-clock loop) and device time (graph), with the targets."""
    rows = ["| shape | vs HF eager (do_bench / loop / graph) | vs Liger (do_bench / loop / graph) | "
            "vs DeepSpeed (do_bench) | vs torch.compile (do_bench) | ours fwd+bwd TB/s (graph) | targets met |",
            "|---|---|---|---:|---:|---:|---|"]

    def r3(peer, ours):
        if peer is None or ours is None:
            return None, "-"
        vals = [(peer.fwd_bwd_ms, ours.fwd_bwd_ms)] + [(peer.extra.get(f), ours.extra.get(f))
                                                       for f in ("fwd_bwd_loop_ms", "fwd_bwd_graph_ms")]
        txt = " / ".join(f"{p / o:.2f}x" if p and o else "-" for p, o in vals)
        return (vals[0][0] / vals[0][1] if vals[0][0] and vals[0][1] else None), txt

    for shape in dict.fromkeys(r.shape for r in recs):
        rs = {r.impl: r for r in recs if r.shape == shape}
        ours = rs.get("deepspeed_fused")
        if ours is None or not ours.fwd_bwd_ms:
            continue
        v_e, t_e = r3(rs.get("HF eager"), ours)
        v_l, t_l = r3(rs.get("Liger liger_rotary_pos_emb"), ours)
        ds = rs.get("DeepSpeed 0.19.8 fused_apply_rotary_pos_emb")
        tc = rs.get("torch.compile(eager)")
        v_ds = f"{ds.fwd_bwd_ms / ours.fwd_bwd_ms:.2f}x" if ds and ds.fwd_bwd_ms else "-"
        v_tc = f"{tc.fwd_bwd_ms / ours.fwd_bwd_ms:.2f}x" if tc and tc.fwd_bwd_ms else "-"
        tb = ours.extra.get("fwd_bwd_graph_tbps")
        if shape in TARGET_SHAPES:
            met = (f"2x eager {'yes' if v_e and v_e >= 2 else 'NO'}, "
                   f"1.2x Liger {'yes' if v_l and v_l >= 1.2 else ('NO' if v_l else '-')}")
        else:
            met = "-"
        rows.append(f"| {shape} | {t_e} | {t_l} | {v_ds} | {v_tc} | {tb if tb else '-'} | {met} |")
    return "\n".join(rows)
