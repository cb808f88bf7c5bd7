"""Suite ``moe_reorder``: the MoE reorder gathers against their peers, bf16, effective TB/s.

Per model shape (tokens x top-k over experts, hidden H): the AutoEP permute (source rows into the
alignment-padded expert-major buffer) and unpermute, the transformers top-k dispatch, and the
combine (weight + sum over top-k). Effective bandwidth counts bytes read + written by the data
movement an exact implementation needs (rows moved, not index tensors):

* permute fwd: N rows read + NP rows written; its backward (unpermute of the gradient): N + N.
* unpermute fwd: N + N; backward (permute of the gradient): N + NP.
* dispatch fwd: S + S; backward (sum of the k slot gradients per token): S + T.
* combine fwd: S + T; backward: S (gradient gathered) + S (rows, for the weight gradient) + S.

Case ``route_sort`` (also ``--case=route_sort`` alone, files ``moe_reorder_route_sort.*``) times the
transformers path's index build: our :func:`route_sort` (expert order, route maps, grouped_mm
offsets, two launches) against transformers' own ``torch.sort`` + ``histc`` + ``cumsum`` (which
builds no route maps) and against this path's build before ``route_sort`` (that, plus the
sentinels' ``arange().masked_fill`` and ``route_maps``). Expert-parallel rows: the ids of the other
ranks' experts are sentinels (``>= E``, what transformers' expert parallelism passes).

Case ``swiglu`` (``--case=swiglu``, files ``moe_reorder_swiglu.*``) times the experts' fused gate
(:func:`swiglu`) against transformers' eager gate, ``torch.compile`` of it and Liger's SiLU-mul.
Case ``autoep_local`` (``--case=autoep_local`` alone, files ``moe_reorder_autoep_local.*``; also part of the
full suite) times DeepSpeed AutoEP's local token path against DeepSpeed's own (:func:`run_autoep_local`).
Case ``router`` (``--case=router``, files ``moe_reorder_router.*``) times the fused top-k softmax
router selection (:func:`topk_softmax`) against the eager router code and ``torch.compile`` of it.
Case ``block`` (``--case=block``, files ``moe_reorder_block.*``) times one whole transformers MoE
block (router, experts, combine; Qwen3-30B-A3B, Mixtral-8x7B, GPT-OSS-20B at T 8192) forward and
forward+backward (input and every weight's gradient): transformers' ``grouped_mm`` experts
implementation (the baseline), its ``eager`` one (at 8 experts only) and the block with the
moe_reorder feature applied by :func:`~deepspeed_fused.patch_model`; each record notes the parts
that ran fused (from the feature's report) and the relative errors against ``grouped_mm``.

Peers: DeepSpeed <= 0.19.7's vstack+index / zero+index_put (autograd backward: accumulating
index_put / indexing), ``torch.index_select`` (a plain gather: for the permute it reads clamped
indices and leaves padding rows unzeroed, a lower bound), DeepSpeed 0.19.8's Triton
``permute_rows`` / ``unpermute_rows`` when they import, and transformers' grouped_mm data movement
(``hidden[perm // k]``; weight, inverse-permutation gather, ``view(T, k, H).sum(1)``).
"""
from __future__ import annotations

import torch

from ..ops import moe_reorder as reorder
from .common import add_graph_times, measure

SUITE = "moe_reorder"
TITLE = "MoE reorder gathers (AutoEP permute/unpermute, top-k dispatch and combine)"
_CASE_NOTES = {
    "route_sort": "The transformers path's index build (int only): no target of its own; it replaces the sort, "
                  "histogram and cumsum (and the route maps' build) in the MoE routing category (<= 5 ms "
                  "in the e2e fused arm).",
    "swiglu": "The experts' gate silu(gate) * up (bf16): the fused gate faster than the eager gate and torch.compile "
              "host-inclusive, fwd+bwd near the bandwidth of its bytes (fwd 2I read + I written per row; fwd+bwd "
              "9I in all); part of the MoE routing category target (<= 5 ms in the e2e fused arm).",
    "router": "The top-k softmax router selection (bf16 logits): faster than the eager router code and "
              "torch.compile host-inclusive; part of the MoE routing category target (<= 5 ms in the "
              "e2e fused arm).",
    "autoep_local": "DeepSpeed AutoEP's local token path (routed gather, reorder pair, combine; a no-grad forward, "
                    "a grad forward and a backward per iteration): ours >= 1.5x DeepSpeed 0.19.8's path at the "
                    "Qwen3-30B-A3B shape and >= 1.3x elsewhere.",
    "block": "One transformers MoE block (router + experts + combine), bf16, T 8192: fused MoE block forward+backward "
             ">= 2x transformers' grouped_mm path; the ratio per shape is the fused record's extra "
             "vs_grouped_mm_fwd_bwd (host-inclusive; _graph: CUDA-graph replays).",
}
NOTES = _GATHER_NOTES = ("Targets (H200, bf16): every gather >= 3.6 TB/s effective (device copy 4.2 TB/s); permute and "
         "unpermute fwd+bwd >= 1.3x DeepSpeed 0.19.8 and >= 4x the 0.19.7 path; combine >= 2x "
         "transformers gather+sum. Effective bytes are defined in deepspeed_fused/bench/moe_reorder.py.")

SHAPES = [  # name, tokens, top_k, experts, hidden
    ("Qwen3-30B-A3B", 8192, 8, 128, 2048),
    ("Mixtral-8x7B", 8192, 2, 8, 4096),
    ("DeepSeek-V3", 8192, 8, 256, 7168),
]
ALIGN = 8  # DeepSpeed's TOKEN_GROUP_ALIGN_SIZE_M


def _deepspeed_0198():
    try:
        from deepspeed.moe import ep_kernels as ek

        if hasattr(ek, "permute_rows") and hasattr(ek, "unpermute_rows"):
            return ek
    except Exception:
        pass
    return None


def _permute_indices(counts: torch.Tensor, experts: int, alignment: int, device) -> torch.Tensor:
    """DeepSpeed's layout built in torch: each expert's rows in order, groups padded to alignment
    (at least one block), -1 at padding (as ``generate_permute_indices`` produces)."""
    n = int(counts.sum())
    sizes = torch.clamp(counts, min=alignment)
    sizes = (sizes + alignment - 1) // alignment * alignment
    max_len = ((n + experts * alignment + alignment - 1) // alignment) * alignment
    pidx = torch.full((max_len, ), -1, dtype=torch.int32)
    starts = torch.cumsum(counts, 0) - counts
    offs = torch.cumsum(sizes, 0) - sizes
    for e in range(experts):
        c = int(counts[e])
        pidx[int(offs[e]):int(offs[e]) + c] = torch.arange(int(starts[e]), int(starts[e]) + c, dtype=torch.int32)
    return pidx.to(device)


AUTOEP_LOCAL = [  # name, tokens, top_k, experts, hidden, expert-parallel degree
    ("Qwen3-30B-A3B", 8192, 8, 128, 2048, 16),
    ("Qwen3-30B-A3B", 16384, 8, 128, 2048, 16),
    ("Mixtral-8x7B", 8192, 2, 8, 4096, 1),
    ("DeepSeek-V3", 8192, 8, 256, 7168, 16),
]


def _autoep_arms(layer, ek, tokens: int, top_k: int, ep: int, local: int):
    """(name, fn(x, scores, experts) -> out, ours) of the AutoEP local token path: the routed gather,
    the reorder pair and the combine (score_apply "post", combine "weighted_sum"), the all-to-alls as
    the identity and the experts as a scalar multiply. ``ep > 1``: the received rows regroup by
    local expert from ``ep`` sources (counts ``[ep, local]``)."""
    from ..features import moe_reorder as feat

    def counts_of(selected):
        counts = torch.bincount(selected.reshape(-1), minlength=ep * local)
        return counts.view(ep, local) if ep > 1 else counts

    def experts_fn(buf):
        return buf * 1.5

    def shape_of(x):
        return (1, tokens, x.shape[-1])

    def ds(x, scores, selected, permute, unpermute):
        sorted_a = torch.argsort(selected.view(-1), stable=True)
        routed = x[sorted_a // top_k]
        routed, pidx, _, n = permute(routed, counts_of(selected))
        out = unpermute(experts_fn(routed), pidx, n)
        return layer.combine_from_routed(out, top_scores=scores, token_indices_sorted=sorted_a, top_k=top_k,
                                         score_apply="post", combine_impl="weighted_sum", shape=shape_of(x))

    def legacy_permute(t, counts):
        pidx, sizes, n = feat._direct_indices(t, counts)
        return reorder.permute_rows_reference(t, pidx), pidx, sizes, n

    def legacy_unpermute(t, pidx, n):
        return reorder.unpermute_rows_reference(t, pidx, n)

    def ours(x, scores, selected):
        sorted_a = torch.argsort(selected.view(-1), stable=True)
        if ep == 1:
            pidx, _, _ = feat._direct_indices(x.new_empty((sorted_a.numel(), 0)), counts_of(selected))
            maps = reorder.route_maps(sorted_a, top_k, pidx)
            out = experts_fn(reorder.route_dispatch(x, maps))
        else:
            maps = reorder.route_maps(sorted_a, top_k)
            routed = reorder.route_dispatch(x, maps)
            pidx, _, n = feat._direct_indices(routed, counts_of(selected))
            permuted = reorder.permute_rows(routed, pidx)
            out = reorder.unpermute_rows(experts_fn(permuted), pidx, n)
        return reorder.route_combine(out, maps, scores).reshape(shape_of(x))

    arms = [("deepspeed_fused", ours, True)]
    if ek is not None:
        arms.append(("DeepSpeed 0.19.8 AutoEP path",
                     lambda x, s, e: ds(x, s, e, feat._AUTOEP["originals"][0] if feat._AUTOEP["originals"]
                                        else layer.permute_by_local_expert,
                                        feat._AUTOEP["originals"][1] if feat._AUTOEP["originals"]
                                        else layer.unpermute_by_local_expert), False))
    arms.append(("DeepSpeed <= 0.19.7 path", lambda x, s, e: ds(x, s, e, legacy_permute, legacy_unpermute), False))
    return arms


def run_autoep_local(dev, dtype, rep: int, quick: bool) -> list:
    """Case ``autoep_local``: each iteration is a no-grad forward, a grad forward and a backward (as
    under reentrant activation checkpointing); fwd_ms is the no-grad forward alone."""
    try:
        import deepspeed.module_inject.auto_ep_layer as layer
    except Exception:
        return []
    ek = _deepspeed_0198() if dev == "cuda" else None
    shapes = AUTOEP_LOCAL if dev == "cuda" else [("tiny-cpu", 64, 2, 8, 32, 2)]
    if quick:
        shapes = shapes[:1]
    recs = []
    gen = torch.Generator().manual_seed(1)
    for name, tokens, top_k, experts, hidden, ep in shapes:
        local = experts // ep
        x = (0.5 * torch.randn(tokens, hidden, generator=gen)).to(dev, dtype)
        logits = torch.randn(tokens, experts, generator=gen)
        scores, selected = torch.softmax(logits, -1).topk(top_k, dim=-1)
        scores, selected = scores.to(dev), selected.to(dev)
        dy = torch.randn(1, tokens, hidden, generator=gen).to(dev, dtype)
        xg, sg = x.detach().requires_grad_(), scores.detach().requires_grad_()
        tag = f"autoep_local {name} T{tokens} k{top_k} E{experts} H{hidden} EP{ep}"
        outs = {}
        for impl, fn, is_ours in _autoep_arms(layer, ek, tokens, top_k, ep, local):
            def fwd(fn=fn):
                with torch.no_grad():
                    return fn(x, scores, selected)

            def it(fn=fn):
                with torch.no_grad():
                    fn(x, scores, selected)
                xg.grad = sg.grad = None
                out = fn(xg, sg, selected)
                out.backward(dy)
                return out

            out = it()
            outs[impl] = (out.detach().float(), xg.grad.float(), sg.grad.float())
            recs.append(measure(SUITE, impl, tag, dtype, fwd=fwd, fwd_bwd=it, ours=is_ours, rep=rep,
                                note="fwd+bwd column: no-grad forward + grad forward + backward"))
        ref = outs.get("DeepSpeed 0.19.8 AutoEP path") or outs["DeepSpeed <= 0.19.7 path"]
        ours_out = outs["deepspeed_fused"]
        err = [((a - b).norm() / b.norm().clamp_min(1e-30)).item() for a, b in zip(ours_out, ref)]
        for r in recs[-len(outs):]:
            r.extra.update(rel_err_out=err[0], rel_err_dx=err[1], rel_err_dscores=err[2])
        recs[-len(outs)].note += f"; vs DeepSpeed: rel. error out {err[0]:.1e}, dx {err[1]:.1e}, dscores {err[2]:.1e}"
        del x, xg, sg, dy, outs
        if dev == "cuda":
            torch.cuda.empty_cache()
    return recs


ROUTE_SORT = [  # name, tokens, top_k, experts (of the model), expert-parallel degree
    ("Qwen3-30B-A3B", 8192, 8, 128, 1),
    ("Qwen3-30B-A3B", 16384, 8, 128, 1),
    ("Qwen3-30B-A3B", 8192, 8, 128, 8),
    ("DeepSeek-V3", 8192, 8, 256, 1),
    ("DeepSeek-V3", 8192, 8, 256, 16),
    ("Mixtral-8x7B", 8192, 2, 8, 1),
    ("Kimi-K2", 16384, 8, 384, 1),
]


def run_route_sort(dev, rep: int, quick: bool) -> list:
    """Case ``route_sort``: the index build of the transformers experts path, no grad (int only).
    fwd_ms: do_bench (host launch costs included where they dominate); ``graph_ms`` in the note:
    the same calls replayed from a CUDA graph (device time)."""
    from .common import graph_ms

    shapes = ROUTE_SORT if dev == "cuda" else [("tiny-cpu", 64, 2, 8, 1), ("tiny-cpu", 64, 2, 8, 2)]
    if quick:
        shapes = shapes[:1]
    recs = []
    gen = torch.Generator().manual_seed(2)
    for name, tokens, top_k, experts, ep in shapes:
        local = experts // ep
        logits = torch.randn(tokens, experts, generator=gen)
        ids = logits.topk(top_k, dim=-1).indices
        if ep > 1:  # rank 0 of ep: its experts keep their ids, the others' become the sentinel
            ids = torch.where(ids < local, ids, local)
        flat = ids.reshape(-1).to(dev)
        n = flat.numel()

        def transformers_build():
            vals, perm = torch.sort(flat)
            hist_in = vals.float() if dev == "cpu" else vals.int()
            counts = torch.histc(hist_in, bins=local, min=0, max=local - 1)
            return perm, torch.cumsum(counts, dim=0, dtype=torch.int32)

        def previous_build():
            vals, perm = torch.sort(flat)
            positions = torch.arange(n, device=flat.device).masked_fill(vals >= local, -1)
            maps = reorder.route_maps(perm, top_k, positions)
            hist_in = vals.float() if dev == "cpu" else vals.int()
            counts = torch.histc(hist_in, bins=local, min=0, max=local - 1)
            return maps, torch.cumsum(counts, dim=0, dtype=torch.int32)

        def ours():
            return reorder.route_sort(flat, local, top_k)

        ref = reorder.route_sort_reference(flat, local, top_k)
        got = ours()
        exact = all(torch.equal(a, b) for a, b in zip((got.order, *got.maps[:3], got.offsets, got.experts),
                                                       (ref.order, *ref.maps[:3], ref.offsets, ref.experts)))
        tag = f"route_sort {name} T{tokens} k{top_k} E{local}" + (f" (of {experts}, EP{ep})" if ep > 1 else "")
        for impl, fn, is_ours, what in (
                ("deepspeed_fused route_sort", ours, True, "order, route maps, offsets, expert ids; two launches"),
                ("transformers sort+histc+cumsum", transformers_build, False, "order and offsets only, no maps"),
                ("deepspeed_fused before route_sort", previous_build, False,
                 "sort, positions, route_maps, histc, cumsum")):
            try:
                g, why = graph_ms(fn), ""
            except Exception as e:  # a capture failure is reported, not fatal
                g, why = None, f"; graph capture failed: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            note = what + (f"; graph replay {g * 1e3:.1f} us" if g is not None else "") + why
            if is_ours:
                note += "; equal to the torch reference" if exact else "; DIFFERS from the torch reference"
            recs.append(measure(SUITE, impl, tag, torch.int32, fwd=fn, ours=is_ours, rep=rep, note=note,
                                assignments=n, graph_ms=g, exact=exact if is_ours else None))
    return recs


# (name, slots = tokens x top_k, the experts' intermediate size): the gate-up projection's rows
SWIGLU = [("Qwen3-30B-A3B", 8192 * 8, 768), ("Mixtral-8x7B", 8192 * 2, 14336), ("DeepSeek-V3", 8192 * 8, 2048)]


def run_swiglu(dev, dtype, rep: int, quick: bool) -> list:
    """Case ``swiglu``: the experts' gate ``silu(gate) * up`` of a ``[S, 2I]`` gate-up projection,
    forward and forward+backward: ours (one kernel each way) against transformers' eager gate
    (chunk, silu, multiply), ``torch.compile`` of it, and Liger's SiLU-mul where it imports. Bytes
    an exact implementation moves: forward 2I read + I written per row; forward+backward adds 2I
    + I read (the saved input and the gradient) and 2I written."""
    shapes = SWIGLU if dev == "cuda" else [("tiny-cpu", 64, 48)]
    if quick:
        shapes = shapes[:1]
    recs = []
    gen = torch.Generator().manual_seed(3)
    peers = [("transformers eager gate (chunk, silu, mul)", reorder.swiglu_reference, False, "")]
    torch._dynamo.reset()
    peers.append(("torch.compile of the eager gate", torch.compile(reorder.swiglu_reference, dynamic=False),
                  False, ""))
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        peers.append(("Liger SiLU-mul", lambda x: LigerSiLUMulFunction.apply(*x.chunk(2, dim=-1)), False,
                      "Liger's kernel on the two chunk views"))
    except Exception as e:  # reported in the table's notes
        peers.append(("Liger SiLU-mul", None, False, f"not imported: {type(e).__name__}"))
    impls = [("deepspeed_fused swiglu", reorder.swiglu, True, "one kernel forward, one backward")] + peers
    for name, rows, inter in shapes:
        gu = torch.randn(rows, 2 * inter, generator=gen).to(dev, dtype)
        dh = torch.randn(rows, inter, generator=gen).to(dev, dtype)
        e = rows * inter * gu.element_size()
        tag = f"swiglu {name} S{rows} I{inter}"
        ref = reorder.swiglu_reference(gu)
        for impl, fn, ours, note in impls:
            if fn is None:
                continue
            leaf = gu.detach().clone().requires_grad_()

            def fwd(fn=fn):
                with torch.no_grad():
                    return fn(gu)

            def fwd_bwd(fn=fn, leaf=leaf):
                return torch.autograd.grad(fn(leaf), leaf, dh)

            y = fwd()
            same = float((y.float() - ref.float()).abs().max())
            rec = measure(SUITE, impl, tag, dtype, fwd=fwd, fwd_bwd=fwd_bwd, bytes_fwd=3 * e, bytes_fwd_bwd=9 * e,
                          ours=ours, rep=rep, note=note, max_abs_vs_eager=same)
            if dev == "cuda":
                add_graph_times(rec, fwd, fwd_bwd, rep)
            recs.append(rec)
        del gu, dh, ref
    return recs


ROUTER = [("Qwen3-30B-A3B", 8192, 128, 8, "norm_topk_prob", True), ("Mixtral-8x7B", 8192, 8, 2, True, False),
          ("Qwen3.5-MoE", 8192, 512, 10, True, True)]


def _time_router(recs, tag, dtype, logits, d_out, args, impls, dev, rep, reference=None) -> None:
    """Each ``(impl, fn, ours)`` of ``impls`` on ``fn(logits, *args)``: the forward without grad,
    the forward+backward with ``d_out`` as the first output's gradient; ``reference``: the eager
    router whose chosen experts the note compares (None: no note)."""
    for impl, fn, ours in impls:
        leaf = logits.detach().clone().requires_grad_()

        def fwd(fn=fn):
            with torch.no_grad():
                return fn(logits, *args)

        def fwd_bwd(fn=fn, leaf=leaf):
            return torch.autograd.grad(fn(leaf, *args)[0], leaf, d_out)

        kw = {}
        if reference is not None:
            same = bool(torch.equal(fwd()[1], reference(logits, *args)[1]))
            kw["note"] = "same experts as eager" if same else "experts differ from eager (ties)"
        rec = measure(SUITE, impl, tag, dtype, fwd=fwd, fwd_bwd=fwd_bwd, ours=ours, rep=rep, **kw)
        if dev == "cuda":
            add_graph_times(rec, fwd, fwd_bwd, rep)
        recs.append(rec)


def run_router(dev, dtype, rep: int, quick: bool) -> list:
    """Case ``router``: a top-k softmax router's selection from its logits (softmax, top-k,
    renormalisation, cast), forward and forward+backward: ours against the eager router code and
    ``torch.compile`` of it. The logits' GEMM is outside (the same in all)."""
    shapes = ROUTER if dev == "cuda" else [("tiny-cpu", 64, 16, 2, True, True)]
    if quick:
        shapes = shapes[:1]
    recs = []
    gen = torch.Generator().manual_seed(4)
    torch._dynamo.reset()
    ref = reorder.topk_softmax_reference
    comp = torch.compile(ref, dynamic=False)
    for name, tokens, experts, k, renorm, cast in shapes:
        norm = renorm is True or renorm == "norm_topk_prob"  # Qwen3-30B-A3B's config sets it
        out = dtype if cast else None
        logits = torch.randn(tokens, experts, generator=gen).to(dev, dtype)
        ds = torch.randn(tokens, k, generator=gen).to(dev, out or torch.float32)
        _time_router(recs, f"router {name} T{tokens} E{experts} k{k}", dtype, logits, ds, (k, norm, out),
                     (("deepspeed_fused topk_softmax", reorder.topk_softmax, True),
                      ("eager router (softmax, topk, renorm, cast)", ref, False),
                      ("torch.compile of the eager router", comp, False)), dev, rep, reference=ref)
    # GPT-OSS-20B's router (the top-4 of 32 bf16 logits, then their softmax in bf16)
    T, E, k = (8192, 32, 4) if dev == "cuda" else (64, 16, 2)
    logits = torch.randn(T, E, generator=gen).to(dev, dtype)
    ds = torch.randn(T, k, generator=gen).to(dev, dtype)
    ref = reorder.topk_logits_softmax_reference
    _time_router(recs, f"router GPT-OSS-20B T{T} E{E} k{k} (top-k of the logits, then softmax)", dtype, logits, ds,
                 (k,), (("deepspeed_fused topk_logits_softmax", reorder.topk_logits_softmax, True),
                        ("eager router (topk, softmax)", ref, False),
                        ("torch.compile of the eager router", torch.compile(ref, dynamic=False), False)),
                 dev, rep, reference=ref)
    # DeepSeek-V3's grouped sigmoid router (FP32 logits): 256 experts in 8 groups, 4 chosen, top-8
    T, E, G, TG, k = (8192, 256, 8, 4, 8) if dev == "cuda" else (64, 32, 4, 2, 3)
    logits = torch.randn(T, E, generator=gen).to(dev)
    bias = (0.1 * torch.randn(E, generator=gen)).to(dev)
    dw = torch.randn(T, k, generator=gen).to(dev)
    ref = reorder.group_topk_sigmoid_reference
    _time_router(recs, f"router DeepSeek-V3 T{T} E{E} groups {TG} of {G} k{k}", torch.float32, logits, dw,
                 (bias, k, G, TG, True, 2.5),
                 (("deepspeed_fused group_topk_sigmoid", reorder.group_topk_sigmoid, True),
                  ("eager router (sigmoid, group top-k, top-k, gather, renorm, scale)", ref, False),
                  ("torch.compile of the eager router", torch.compile(ref, dynamic=False), False)), dev, rep)
    return recs


# name, transformers model package, block class, its PreTrainedModel, config class, config sizes on the GPU / on CPU
BLOCK = [
    ("Qwen3-30B-A3B", "qwen3_moe", "Qwen3MoeSparseMoeBlock", "Qwen3MoePreTrainedModel", "Qwen3MoeConfig",
     dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True),
     dict(hidden_size=32, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True)),
    ("Mixtral-8x7B", "mixtral", "MixtralSparseMoeBlock", "MixtralPreTrainedModel", "MixtralConfig",
     dict(hidden_size=4096, intermediate_size=14336, num_local_experts=8, num_experts_per_tok=2),
     dict(hidden_size=32, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2)),
    ("GPT-OSS-20B", "gpt_oss", "GptOssMLP", "GptOssPreTrainedModel", "GptOssConfig",
     dict(hidden_size=2880, intermediate_size=2880, num_local_experts=32, num_experts_per_tok=4),
     dict(hidden_size=32, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2)),
]


def _moe_block(package, block_name, model_name, config_name, sizes, dev, dtype, gen):
    """A transformers MoE block as the one child (``.block``) of its family's PreTrainedModel, which
    holds no layers: the model ``set_experts_implementation`` and ``patch_model`` take. Weight
    matrices N(0, 1/fan-in) (activations and router logits of unit scale: transformers initialises
    some routers to zeros, which would tie every expert), biases N(0, 0.02)."""
    import importlib

    import transformers

    modeling = importlib.import_module(f"transformers.models.{package}.modeling_{package}")
    config = getattr(transformers, config_name)(num_hidden_layers=1, **sizes)
    with torch.device(dev):
        holder = getattr(modeling, model_name)(config)
        holder.block = getattr(modeling, block_name)(config)
    holder.to(dtype)
    inter = sizes.get("moe_intermediate_size", sizes.get("intermediate_size"))
    with torch.no_grad():
        for n, p in holder.block.named_parameters():
            std = (inter if "down_proj" in n else sizes["hidden_size"]) ** -0.5 if p.dim() > 1 else 0.02
            p.normal_(0.0, std, generator=gen)
    return holder


def _fused_parts(rep, experts) -> dict:
    """What the feature's report says ran fused: the experts' gathers, the gate (and which form,
    by the feature's own test of the experts module), the routers."""
    from ..features import moe_reorder as feat

    d = rep.details if rep.applied else {}
    gate = ("swiglu" if feat.fused_gate(experts) else "oai" if feat.oai_gate_of(experts) else None) \
        if d.get("fused_gate") else None
    return dict(applied=rep.applied, experts_gathers=d.get("layers", 0), gate_fused=gate,
                routers_fused=d.get("routers", 0))


def run_block(dev, dtype, rep: int, quick: bool) -> list:
    """Case ``block``: one whole MoE block of three families, forward (no grad) and forward+backward
    (the gradients of the input and of every weight). Arms share the weights (one block,
    deep-copied): transformers ``grouped_mm``, ``eager`` (8 experts or fewer: its per-expert loop
    syncs the host per expert) and deepspeed_fused (``patch_model`` with moe_reorder on). On CPU:
    tiny sizes, fp32, every family even with ``quick``."""
    import copy

    from .. import patch_model

    shapes = BLOCK[:1] if quick and dev == "cuda" else BLOCK
    tokens = 8192 if dev == "cuda" else 64
    recs = []
    gen = torch.Generator(dev).manual_seed(5)
    for name, package, block_name, model_name, config_name, gpu_sizes, cpu_sizes in shapes:
        sizes = gpu_sizes if dev == "cuda" else cpu_sizes
        experts = sizes.get("num_experts", sizes.get("num_local_experts"))
        hidden = sizes["hidden_size"]
        tag = (f"block {name} T{tokens} E{experts} k{sizes['num_experts_per_tok']} H{hidden} "
               f"I{sizes.get('moe_intermediate_size', sizes.get('intermediate_size'))}")
        try:
            base = _moe_block(package, block_name, model_name, config_name, sizes, dev, dtype, gen)
        except (ImportError, AttributeError) as e:  # this transformers lacks the family or a class of it
            recs.append(measure(SUITE, "deepspeed_fused", tag, dtype, ours=True,
                                note=f"skipped: {type(e).__name__}: {str(e).splitlines()[0][:120]}"))
            continue
        x = torch.randn(2, tokens // 2, hidden, device=dev, dtype=dtype, generator=gen)
        dy = torch.randn(2, tokens // 2, hidden, device=dev, dtype=dtype, generator=gen)
        xg = x.detach().requires_grad_()
        got, by_impl = {}, {}
        for impl, experts_impl in [("transformers grouped_mm", "grouped_mm")] + (
                [("transformers eager", "eager")] if experts <= 8 else []) + [("deepspeed_fused", None)]:
            holder = copy.deepcopy(base)
            block, extra = holder.block, {}
            weights = [block.experts.gate_up_proj] + [p for p in block.parameters()
                                                      if p is not block.experts.gate_up_proj]

            def fwd(block=block):
                with torch.no_grad():
                    y = block(x)
                return y[0] if isinstance(y, tuple) else y  # GPT-OSS's block also returns the router scores

            def fwd_bwd(block=block, weights=weights):
                y = block(xg)
                return torch.autograd.grad(y[0] if isinstance(y, tuple) else y, [xg, *weights], dy)

            try:
                if experts_impl:
                    holder.set_experts_implementation(experts_impl)
                    note = f"experts implementation {experts_impl!r}"
                else:
                    report = patch_model(holder, {"moe_reorder": {"enabled": True}})
                    r = next(f for f in report.features if f.name == "moe_reorder")
                    extra["fused"] = fused = _fused_parts(r, block.experts)
                    note = ("fused: " + ", ".join(p for p, on in (
                        ("experts gathers", fused["experts_gathers"]),
                        (f"{fused['gate_fused']} gate", fused["gate_fused"]), ("router", fused["routers_fused"]))
                        if on)) if r.applied else f"NOT applied: {r.reason}"
                grads = fwd_bwd()
                got[impl] = (fwd(), grads[0], grads[1])  # output, input gradient, gate_up_proj gradient
                del grads
            except Exception as e:  # an arm that cannot run here (out of memory, ...) is reported
                recs.append(measure(SUITE, impl, tag, dtype, ours=experts_impl is None,
                                    note=f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"))
                continue
            rec = by_impl[impl] = measure(SUITE, impl, tag, dtype, fwd=fwd, fwd_bwd=fwd_bwd,
                                          ours=experts_impl is None, rep=rep, note=note, **extra)
            if experts_impl is None and r.calls is not None:
                rec.extra["experts_calls"] = r.calls.fused  # experts forwards that ran our implementation
            if dev == "cuda":
                try:
                    add_graph_times(rec, fwd, fwd_bwd, rep)
                except Exception as e:  # a failed capture that leaves the next synchronize failing too
                    rec.note += f"; no CUDA graph: {type(e).__name__}"
            recs.append(rec)
        ref = got.pop("transformers grouped_mm", None)
        for impl, vals in got.items() if ref is not None else ():
            err = [((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()
                   for a, b in zip(vals, ref)]
            by_impl[impl].extra.update(rel_err_out=err[0], rel_err_dx=err[1], rel_err_dgate_up=err[2])
            by_impl[impl].note += (f"; vs grouped_mm: rel. error out {err[0]:.1e}, dx {err[1]:.1e}, "
                                   f"d gate_up_proj {err[2]:.1e}")
        ours, hf = by_impl.get("deepspeed_fused"), by_impl.get("transformers grouped_mm")
        if ours is not None and hf is not None:
            for key, a, b in (("vs_grouped_mm_fwd_bwd", hf.fwd_bwd_ms, ours.fwd_bwd_ms),
                              ("vs_grouped_mm_fwd_bwd_graph", hf.extra.get("fwd_bwd_graph_ms"),
                               ours.extra.get("fwd_bwd_graph_ms"))):
                if a and b:
                    ours.extra[key] = round(a / b, 3)
            if "vs_grouped_mm_fwd_bwd" in ours.extra:
                ours.note += f"; fwd+bwd {ours.extra['vs_grouped_mm_fwd_bwd']:.2f}x grouped_mm (target >= 2x)"
        del base, holder, block, weights, fwd, fwd_bwd, x, dy, xg, got, ref
        if dev == "cuda":
            torch.cuda.empty_cache()
    return recs


RESULT = COMMAND = None  # the files' name and command when not the suite's: --case=route_sort, swiglu, router, block


# --case=NAME -> its runner (dev, dtype, rep, quick); each writes moe_reorder_NAME.*
CASES = dict(route_sort=lambda dev, dtype, rep, quick: run_route_sort(dev, rep, quick),
             router=run_router, swiglu=run_swiglu, block=run_block, autoep_local=run_autoep_local)


def run(args) -> list:
    global RESULT, COMMAND, NOTES
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    extra = getattr(args, "extra", None) or []
    quick = getattr(args, "quick", False)
    RESULT = COMMAND = None
    NOTES = _GATHER_NOTES
    for case, runner in CASES.items():
        if f"--case={case}" in extra:
            RESULT, COMMAND = f"moe_reorder_{case}", f"python -m deepspeed_fused.bench moe_reorder --case={case}"
            NOTES = _CASE_NOTES[case]
            return runner(dev, torch.bfloat16 if dev == "cuda" else torch.float32, 20 if quick else 100, quick)
    quick = getattr(args, "quick", False)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    shapes = SHAPES if dev == "cuda" else [("tiny-cpu", 256, 2, 8, 64)]
    if quick:
        shapes = shapes[:1]
    rep = 20 if quick else 100
    ek = _deepspeed_0198() if dev == "cuda" else None
    recs = []
    gen = torch.Generator().manual_seed(0)
    for name, tokens, top_k, experts, hidden in shapes:
        n = tokens * top_k
        ids = torch.randint(0, experts, (tokens, top_k), generator=gen)
        counts = torch.bincount(ids.reshape(-1), minlength=experts)
        pidx = _permute_indices(counts, experts, ALIGN, dev)
        np_ = pidx.numel()
        esz = torch.tensor([], dtype=dtype).element_size()
        row = hidden * esz
        x = torch.randn(n, hidden, device=dev, dtype=dtype)
        s = torch.randn(np_, hidden, device=dev, dtype=dtype)
        g_perm = torch.randn(np_, hidden, device=dev, dtype=dtype)
        g_unperm = torch.randn(n, hidden, device=dev, dtype=dtype)
        inv = reorder.inverse_permutation(pidx, n)
        pidx_long = pidx.long()
        tag = f"{name} T{tokens} k{top_k} E{experts} H{hidden}"

        def m(op, impl, fwd, fwd_bwd, bytes_f, bytes_fb, ours=False, note=""):
            recs.append(measure(SUITE, impl, f"{op} {tag}", dtype, fwd=fwd, fwd_bwd=fwd_bwd, bytes_fwd=bytes_f,
                                bytes_fwd_bwd=bytes_fb, ours=ours, note=note, rep=rep, rows=n, padded_rows=np_))

        def fb(fn, inp, grad):
            def run_fb():
                inp.grad = None
                fn(inp).backward(grad)
            return run_fb

        # ---- permute: [N, H] -> [NP, H] ----
        xr = x.detach().requires_grad_()
        bf, bfb = (n + np_) * row, (n + np_) * row + 2 * n * row
        # ours as the AutoEP layer calls it: the inverse is built by the permute, reused by the unpermute
        m("permute", "deepspeed_fused", lambda: reorder.permute_rows_with_inverse(x, pidx)[0],
          fb(lambda t: reorder.permute_rows_with_inverse(t, pidx)[0], xr, g_perm), bf, bfb, ours=True,
          note="builds the inverse permutation in the same kernel (uncached, as a layer's first call)")
        m("permute", "DeepSpeed 0.19.7 vstack+index", lambda: reorder.permute_rows_reference(x, pidx),
          fb(lambda t: reorder.permute_rows_reference(t, pidx), xr, g_perm), bf, bfb)
        clamped = pidx_long.clamp(min=0)
        m("permute", "torch index_select", lambda: x.index_select(0, clamped),
          fb(lambda t: t.index_select(0, clamped), xr, g_perm), bf, bfb,
          note="padding rows not zeroed (lower bound); backward is index_add")
        if ek is not None:
            m("permute", "DeepSpeed 0.19.8 permute_rows", lambda: ek.permute_rows(x, pidx),
              fb(lambda t: ek.permute_rows(t, pidx), xr, g_perm), bf, bfb)

        # ---- unpermute: [NP, H] -> [N, H] ----
        sr = s.detach().requires_grad_()
        bf, bfb = 2 * n * row, 2 * n * row + (n + np_) * row
        m("unpermute", "deepspeed_fused", lambda: reorder.unpermute_rows(s, pidx, n, inverse=inv),
          fb(lambda t: reorder.unpermute_rows(t, pidx, n, inverse=inv), sr, g_unperm), bf, bfb, ours=True,
          note="inverse reused from the permute (cached per index tensor)")
        m("unpermute", "DeepSpeed 0.19.7 zero+index_put", lambda: reorder.unpermute_rows_reference(s, pidx, n),
          fb(lambda t: reorder.unpermute_rows_reference(t, pidx, n), sr, g_unperm), bf, bfb)
        m("unpermute", "torch index_select", lambda: s.index_select(0, inv),
          fb(lambda t: t.index_select(0, inv), sr, g_unperm), bf, bfb, note="backward is index_add")
        if ek is not None:
            m("unpermute", "DeepSpeed 0.19.8 unpermute_rows", lambda: ek.unpermute_rows(s, pidx, n),
              fb(lambda t: ek.unpermute_rows(t, pidx, n), sr, g_unperm), bf, bfb)

        # ---- transformers top-k dispatch and combine ----
        flat = ids.reshape(-1).to(dev)
        _, perm = torch.sort(flat)
        maps = reorder.route_maps(perm, top_k)  # as the transformers path builds them (no sentinels here)
        slot = maps.slot.view(tokens, top_k)
        tok_of_slot = perm // top_k
        h = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        hr = h.detach().requires_grad_()
        g_disp = torch.randn(n, hidden, device=dev, dtype=dtype)
        bf, bfb = 2 * n * row, 2 * n * row + (n + tokens) * row
        m("dispatch", "deepspeed_fused", lambda: reorder.route_dispatch(h, maps),
          fb(lambda t: reorder.route_dispatch(t, maps), hr, g_disp), bf, bfb, ours=True,
          note="backward: gather + FP32 sum of the k slots")
        m("dispatch", "transformers hidden[perm // k]", lambda: h[tok_of_slot],
          fb(lambda t: t[tok_of_slot], hr, g_disp), bf, bfb, note="backward: accumulating index_put")

        y = torch.randn(n, hidden, device=dev, dtype=dtype)
        w = torch.rand(tokens, top_k, device=dev, dtype=dtype)
        yr = y.detach().requires_grad_()
        wr = w.detach().requires_grad_()
        g_comb = torch.randn(tokens, hidden, device=dev, dtype=dtype)
        inv_perm = slot.reshape(-1).long()
        w_sorted = w.reshape(-1)[perm]

        def hf_combine(t, weights_sorted):
            weighted = t * weights_sorted.unsqueeze(-1)
            return weighted[inv_perm].view(tokens, top_k, hidden).sum(dim=1).to(dtype)

        def fb2(fn):
            def run_fb():
                yr.grad = None
                wr.grad = None
                fn().backward(g_comb)
            return run_fb

        bf, bfb = (n + tokens) * row, (n + tokens) * row + 3 * n * row
        m("combine", "deepspeed_fused", lambda: reorder.route_combine(y, maps, w),
          fb2(lambda: reorder.route_combine(yr, maps, wr)), bf, bfb, ours=True,
          note="weights, inverse gather and sum fused (FP32 sum)")
        m("combine", "transformers gather+sum", lambda: hf_combine(y, w_sorted),
          fb2(lambda: hf_combine(yr, wr.reshape(-1)[perm])), bf, bfb)
        del x, s, g_perm, g_unperm, xr, sr, h, hr, y, yr
        if dev == "cuda":
            torch.cuda.empty_cache()
    recs += run_autoep_local(dev, dtype, rep, quick)
    recs += run_route_sort(dev, rep, quick)
    return recs
