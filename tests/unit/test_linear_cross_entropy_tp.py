"""Vocabulary-parallel linear cross-entropy over a tensor-parallel group (gloo ranks on CPU; NCCL
at world size 2: tests/gpu/test_linear_cross_entropy_tp_gpu.py).

Every rank holds a shard of the LM-head rows; loss, entropy, lse, dhidden and the shard's
dweight/dbias must equal the single-rank full-vocabulary result (float64 reference). On CPU the
kernels run under Triton's interpreter (conftest), so shapes stay tiny: M <= 16, H <= 16,
V_local <= 64.
"""
import os

import pytest
import torch
import torch.distributed as dist
from unit.common import DistributedTest, cuda_device_count

from deepspeed_fused.ops import _common
from lce_testing import rel, weighted_backward
from deepspeed_fused.ops.linear_cross_entropy import launch as lce_gemm
from deepspeed_fused.ops.linear_cross_entropy import parallel as lce_parallel
from deepspeed_fused.ops.linear_cross_entropy import chunks as lce_chunks
from deepspeed_fused.ops.linear_cross_entropy import group as lce_group
from deepspeed_fused.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

DEV = "cuda" if cuda_device_count() else "cpu"  # NCCL ranks on GPUs (skipped without enough of them)
OUT_TOL, GRAD_TOL = 1e-5, 1e-5  # fp32 against float64 (relative, relative-norm)
_COLLECTIVES = ("all_gather_into_tensor", "all_gather", "all_reduce", "reduce_scatter_tensor", "reduce_scatter",
                "broadcast", "all_to_all_single", "all_to_all", "reduce", "gather", "scatter", "barrier",
                "all_gather_object", "broadcast_object_list", "all_reduce_coalesced")

if _common.interpreter_active():  # pay the first (slow) kernel calls once: the worker server imports this
    # module too (unit/common.py), and its ranks inherit the warm interpreter from there
    _w = torch.randn(5, 4, requires_grad=True)
    linear_cross_entropy(torch.randn(3, 4), _w, torch.tensor([1, 2, 3])).backward()
    linear_cross_entropy(torch.randn(3, 4), _w, torch.tensor([1, 2, 3]), reduction="none")[0].backward()


def _data(M, H, V, seed=0, bias=False, ignore_every=5, target_range=None):
    """The same full-vocabulary inputs on every rank (fixed seed)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.4
    lo, hi = target_range or (0, V)
    t = torch.randint(lo, hi, (M,), generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    return h.to(DEV), w.to(DEV), t.to(DEV), None if b is None else b.to(DEV)


def _shard_bounds(V, size, sizes=None):
    sizes = sizes or [V // size] * size
    starts = [sum(sizes[:r]) for r in range(size)]
    return starts, sizes


def _check_tp(h, w, t, b, start, v_local, group=None, dtype=torch.float32, fn=linear_cross_entropy,
              explicit_start=True, **kw):
    """One rank: TP op on its shard vs the float64 full-vocabulary reference; returns outputs."""
    group = group or dist.group.WORLD
    sl = slice(start, start + v_local)
    out, grads = weighted_backward(fn, h, w[sl], t, None if b is None else b[sl], dtype, tp_group=group,
                      vocab_start=start if explicit_start else None, **kw)
    rout, rgrads = weighted_backward(linear_cross_entropy_reference, h, w, t, b, torch.float64, **kw)
    rgrads = [rgrads[0], rgrads[1][sl]] + ([rgrads[2][sl]] if b is not None else [])
    for o, r in zip(out, rout, strict=True):
        assert torch.isfinite(o).all()
        assert rel(o, r) <= OUT_TOL or (o - r).abs().max() <= OUT_TOL, (kw, o, r)
    for name, g, r in zip(("dhidden", "dweight", "dbias"), grads, rgrads):
        assert torch.isfinite(g).all()
        assert rel(g, r) <= GRAD_TOL or (g - r).abs().max() <= 1e-7, (kw, name, rel(g, r))
    return out, grads


def _same_on_every_rank(tensors, group=None):
    """Bitwise equality of the outputs across the ranks of the group."""
    flat = torch.cat([x.reshape(-1) for x in tensors]).float()
    allv = [torch.empty_like(flat) for _ in range(dist.get_world_size(group))]
    dist.all_gather(allv, flat, group=group)
    for x in allv[1:]:
        assert torch.equal(x, allv[0])


class _Counter:
    """Counts torch.distributed collectives issued while active (monkeypatched functions)."""

    def __init__(self, monkeypatch):
        self.calls = []
        self.on = False
        for name in _COLLECTIVES:
            orig = getattr(dist, name, None)
            if orig is not None:
                monkeypatch.setattr(dist, name, self._wrap(name, orig))

    def _wrap(self, name, orig):
        def f(*a, **k):
            if self.on:
                self.calls.append(name)
            return orig(*a, **k)
        return f


_OPTIONS = {
    "plain": {},
    "all": dict(temperature="tensor", softcap=3.0, z_loss=0.02, label_smoothing=0.1, bias=True),
    "temp_float_smooth": dict(temperature=0.8, label_smoothing=0.2),
}


class TestVocabParallel(DistributedTest):
    world_size = [2, 4]

    def test_matches_full_vocabulary(self):
        """Every reduction x extra output x option set, on equal shards (default vocab_start)."""
        rank, size = dist.get_rank(), dist.get_world_size()
        M, H, V = 12, 16, 16 * size
        starts, sizes = _shard_bounds(V, size)
        for name, opts in _OPTIONS.items():
            kw = dict(opts)
            bias = kw.pop("bias", False)
            if kw.get("temperature") == "tensor":
                kw["temperature"] = (torch.rand(M, generator=torch.Generator().manual_seed(7)) + 0.5).to(DEV)
            h, w, t, b = _data(M, H, V, seed=size, bias=bias)
            combos = [(r, e) for r in ("mean", "sum", "none") for e in ((False, False), (True, True))]
            if name == "temp_float_smooth":
                combos = [("mean", (False, False)), ("none", (False, True))]
            for reduction, extra in combos:
                out, grads = _check_tp(h, w, t, b, starts[rank], sizes[rank], reduction=reduction,
                                       return_entropy=extra[0], return_lse=extra[1], explicit_start=False, **kw)
                _same_on_every_rank(out + grads[:1])

    @pytest.mark.world_size(2)
    def test_fp16_softcap_fp32_logits(self):
        """fp16 with a soft cap (fp32 chunk logits, dlogits in a separate buffer) in the three TP
        passes: within fp16 bounds of the float64 full-vocabulary reference."""
        rank, size = dist.get_rank(), dist.get_world_size()
        M, H, V = 12, 16, 32
        h, w, t, b = _data(M, H, V, seed=4, bias=True)
        for kw in (dict(softcap=3.0, chunk_tokens=5), dict(softcap=2.0, reduction="none", return_lse=True),
                   dict(softcap=2.0, reduction="sum", return_entropy=True, chunk_tokens=4)):
            sl = slice(rank * 16, rank * 16 + 16)
            out, grads = weighted_backward(linear_cross_entropy, h, w[sl], t, b[sl], torch.float16,
                                           tp_group=dist.group.WORLD, **kw)
            rout, rgrads = weighted_backward(linear_cross_entropy_reference, h, w, t, b, torch.float64, **kw)
            rgrads = [rgrads[0], rgrads[1][sl], rgrads[2][sl]]
            for o, r in zip(out, rout, strict=True):
                assert rel(o.double(), r) <= 1e-3, (kw, o, r)
            for g, r in zip(grads, rgrads, strict=True):
                assert torch.isfinite(g).all() and rel(g.double(), r) <= 1e-2, (kw, rel(g.double(), r))

    @pytest.mark.world_size(4)
    def test_ragged_shards_and_edge_targets(self):
        rank, size = dist.get_rank(), dist.get_world_size()
        M, H = 13, 8
        sizes = {2: [43, 1], 4: [13, 1, 30, 6]}[size]  # one shard of a single row (size 2: tests/gpu, NCCL)
        V = sum(sizes)
        order = list(range(size))[::-1]  # shards in reverse rank order: rank r holds shard order[r]
        starts = [sum(sizes[:i]) for i in range(size)]
        start, v_local = starts[order[rank]], sizes[order[rank]]
        temp = (torch.rand(M, generator=torch.Generator().manual_seed(3)) + 0.5).to(DEV)
        h, w, t, b = _data(M, H, V, seed=1, bias=True)
        for kw in (dict(), dict(reduction="none", return_entropy=True, temperature=temp),
                   dict(reduction="sum", return_lse=True, temperature=temp, label_smoothing=0.1, chunk_tokens=5),
                   dict(chunk_tokens=4, z_loss=0.01, softcap=2.0)):
            _check_tp(h, w, t, b, start, v_local, **kw)
        # every target in the first shard: the other ranks' shards receive none
        h, w, t, b = _data(M, H, V, seed=2, target_range=(0, sizes[0]))
        _check_tp(h, w, t, b, start, v_local)
        _check_tp(h, w, t, b, start, v_local, reduction="none", return_entropy=True)
        # every target ignored: loss 0, no NaN, zero gradients (entropy still has gradients)
        t = torch.full((M,), -100, device=DEV)
        out, grads = _check_tp(h, w, t, None, start, v_local, reduction="mean")
        assert (out[0] == 0).all() and all((g == 0).all() for g in grads)
        out, grads = _check_tp(h, w, t, None, start, v_local, reduction="none", return_entropy=True)
        assert (out[1] > 0).all() and grads[0].abs().sum() > 0

    @pytest.mark.world_size(2)
    def test_masked_batch_and_unchecked_targets(self):
        """A fully masked batch over the group: a loss over no labelled token divided by 0 items (an infinite
        upstream gradient) is NaN with every gradient exactly 0, on the scalar path (also
        sequence parallel), the per-token path and the TP reference; with labelled tokens only
        dhidden's ignored rows stay 0. With validate_targets=False a target outside the global
        vocabulary (or negative) has no target logit on any shard: the full-vocabulary reference's
        loss = lse (and smoothing, z-loss terms)."""
        rank, size = dist.get_rank(), dist.get_world_size()
        M, H, V = 10, 8, 32
        sl = slice(rank * 16, (rank + 1) * 16)
        h, w, t, b = _data(M, H, V, seed=30, bias=True, ignore_every=3)
        masked = torch.full_like(t, -100)
        opts = dict(softcap=2.0, z_loss=0.01, label_smoothing=0.1)
        for path in ("kernel", "reference"):
            if path == "reference":  # plain CPU tensors (float64 on GPUs): the TP-aware torch reference
                os.environ["TRITON_INTERPRET"] = "0"
            dt = torch.float64 if path == "reference" and DEV == "cuda" else torch.float32
            for reduction, sp, chunk in (("mean", False, None), ("sum", False, 4), ("none", False, None),
                                         ("sum", True, None)):
                rows = slice(rank * M // size, (rank + 1) * M // size) if sp else slice(None)
                for tt in (masked, t):
                    leaves = [x.to(dt).clone().requires_grad_() for x in (h[rows], w[sl], b[sl])]
                    loss = linear_cross_entropy(leaves[0], leaves[1], tt[rows], bias=leaves[2], reduction=reduction,
                                                tp_group=dist.group.WORLD, sequence_parallel=sp, chunk_tokens=chunk,
                                                **opts)
                    (loss.sum() / torch.tensor(0)).backward()
                    if tt is masked:
                        assert torch.isnan(loss.sum() / 0)
                        for x in leaves:
                            assert torch.equal(x.grad, torch.zeros_like(x)), (path, reduction, sp, x.grad)
                    else:
                        ign = tt[rows] == -100
                        assert torch.equal(leaves[0].grad[ign], torch.zeros_like(leaves[0].grad[ign]))
                        assert not torch.isfinite(leaves[0].grad[~ign]).any()
                        assert not torch.isfinite(leaves[1].grad).any()
            bad = t.clone()
            bad[[1, 4, 7]] = torch.tensor([V, V + 100, -7], device=DEV)
            for kw in (dict(), dict(reduction="none", return_lse=True), dict(reduction="sum", chunk_tokens=3)):
                _check_tp(h, w, bad, b, rank * 16, 16, dtype=dt, validate_targets=False, **opts, **kw)
            os.environ["TRITON_INTERPRET"] = "1" if DEV == "cpu" else "0"

    @pytest.mark.world_size(4)
    def test_subgroups(self):
        """Two TP groups of 2 over non-adjacent ranks (TP x DP), each with its own data."""
        rank = dist.get_rank()
        groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
        group, gi = groups[rank % 2], rank % 2
        trank = dist.get_rank(group)
        M, H, V = 10, 8, 24
        h, w, t, b = _data(M, H, V, seed=10 + gi, bias=True)
        out, _ = _check_tp(h, w, t, b, trank * 12, 12, group=group, reduction="none", return_lse=True,
                           explicit_start=False)
        _same_on_every_rank(out, group)
        _check_tp(h, w, t, b, trank * 12, 12, group=group)

    @pytest.mark.world_size(2)
    def test_reference_path(self):
        """A rank without kernels (plain CPU tensors; float64 on GPUs) runs the TP-aware reference."""
        os.environ["TRITON_INTERPRET"] = "0"
        _common.reset_fallback_warnings()
        rank = dist.get_rank()
        M, H, V = 11, 8, 40
        temp = (torch.rand(M, generator=torch.Generator().manual_seed(4)) + 0.5).to(DEV)
        h, w, t, b = _data(M, H, V, seed=5, bias=True)
        dt = torch.float64 if DEV == "cuda" else torch.float32
        with pytest.warns(RuntimeWarning, match="reference"):
            _check_tp(h, w, t, b, rank * 20, 20, dtype=dt)
        for kw in (dict(reduction="none", return_entropy=True, return_lse=True, temperature=temp, softcap=2.0),
                   dict(reduction="sum", label_smoothing=0.2, z_loss=0.01, chunk_tokens=4),
                   dict(accum_dtype=torch.float32)):
            _check_tp(h, w, t, b, rank * 20, 20, dtype=dt, **kw)
        # the reference itself, called directly with a group, in float64
        _check_tp(h, w, t, b, rank * 20, 20, dtype=torch.float64, fn=linear_cross_entropy_reference,
                  reduction="none", return_entropy=True, label_smoothing=0.1)
        os.environ["TRITON_INTERPRET"] = "1"

    @pytest.mark.world_size(2)
    def test_collectives(self):
        """Forward: the layout all-gather (validate_targets=True, or a layout not seen before),
        then one statistics all-gather per token chunk; backward: one all-reduce of dhidden."""
        mp = pytest.MonkeyPatch()
        counter = _Counter(mp)
        try:
            rank = dist.get_rank()
            M, H, V = 8, 8, 32
            h, w, t, _ = _data(M, H, V, seed=6)
            ws = w[rank * 16:(rank + 1) * 16]
            cases = [(True, kw) for kw in (dict(), dict(reduction="none", return_entropy=True),
                                           dict(reduction="sum", return_lse=True), dict(chunk_tokens=3),
                                           dict(reduction="none", chunk_tokens=3))]
            cases += [(False, dict()), (False, dict(reduction="none", return_lse=True)),
                      (False, dict(chunk_tokens=3)), ("reference", dict()), ("reference", dict(chunk_tokens=3))]
            for validate, kw in cases:
                if validate == "reference":  # plain CPU tensors (float64 on GPUs): the torch reference
                    os.environ["TRITON_INTERPRET"] = "0"
                    h, ws = (h.double(), ws.double()) if DEV == "cuda" else (h, ws)
                hh, ww = h.clone().requires_grad_(), ws.clone().requires_grad_()
                counter.on, counter.calls = True, []
                out = linear_cross_entropy(hh, ww, t, tp_group=dist.group.WORLD, validate_targets=bool(validate),
                                           **kw)
                counter.on = False
                # the reference gathers the statistics of all its tokens at once
                chunks = 1 if validate == "reference" else -(-M // kw.get("chunk_tokens", M))
                expect = ["all_gather_into_tensor"] * ((1 if validate else 0) + chunks)
                assert counter.calls == expect, (validate, kw, counter.calls)
                loss = sum(o.sum() for o in (out if isinstance(out, tuple) else (out,)))
                counter.on = True
                loss.backward()
                counter.on = False
                assert counter.calls == expect + ["all_reduce"], (validate, kw, counter.calls)
            # frozen hidden: no dhidden all-reduce in backward (kernels again)
            os.environ["TRITON_INTERPRET"] = "1" if DEV == "cpu" else "0"
            h, ws = h.float(), ws.float()
            ww = ws.clone().requires_grad_()
            counter.calls, counter.on = [], True
            linear_cross_entropy(h, ww, t, tp_group=dist.group.WORLD).backward()
            counter.on = False
            assert counter.calls == ["all_gather_into_tensor"] * 2
        finally:
            mp.undo()

    @pytest.mark.world_size(2)
    def test_three_gemm_passes_per_chunk(self):
        """The scalar loss forms its gradient from the chunk's logits still in memory: per chunk
        one logits GEMM, one dhidden GEMM and one dweight GEMM (the single-GPU op's three
        passes), with the next chunk's logits GEMM and statistics gather issued before this
        chunk's gradient (overlapping its gather). Per-token outputs: one GEMM per chunk in
        forward, three in backward."""
        mp = pytest.MonkeyPatch()
        events = []

        def wrap(name, fn):
            def f(*a, **k):
                events.append(name)
                return fn(*a, **k)
            return f

        # the logits GEMM: the statistics and per-token passes reach it through chunks._logit_chunks,
        # the scalar-loss pass (two workspaces) directly
        mp.setattr(lce_chunks, "_logits_into", wrap("logits", lce_chunks._logits_into))
        mp.setattr(lce_parallel, "_logits_into", wrap("logits", lce_parallel._logits_into))
        mp.setattr(lce_parallel, "_dhidden_into", wrap("dh", lce_parallel._dhidden_into))
        mp.setattr(lce_parallel._ParamGrads, "add", wrap("dw", lce_parallel._ParamGrads.add))
        mp.setattr(dist, "all_gather_into_tensor", wrap("gather", dist.all_gather_into_tensor))
        mp.setattr(dist, "all_reduce", wrap("all_reduce", dist.all_reduce))
        try:
            rank = dist.get_rank()
            M, H, V = 12, 8, 32
            h, w, t, b = _data(M, H, V, seed=11, bias=True)
            sl = slice(rank * 16, (rank + 1) * 16)
            # scalar loss, 3 chunks
            events.clear()
            out, _ = _check_tp(h, w, t, b, rank * 16, 16, chunk_tokens=4, label_smoothing=0.1, z_loss=0.01)
            fwd = ["gather", "logits", "gather", "logits", "gather", "dh", "dw", "logits", "gather", "dh", "dw", "dh",
                   "dw"]
            assert events == fwd + ["all_reduce"], events
            assert events.count("logits") == 3  # not 4 (no recomputation after the exchange)
            # one chunk (the automatic size at these shapes): one workspace, the same three passes;
            # without validation and with the layout known, no layout gather
            events.clear()
            hh, ww = h.clone().requires_grad_(), w[sl].clone().requires_grad_()
            linear_cross_entropy(hh, ww, t, tp_group=dist.group.WORLD, validate_targets=False).backward()
            assert events == ["logits", "gather", "dh", "dw", "all_reduce"], events
            # per-token outputs, 3 chunks: forward gathers per chunk; backward recomputes the logits.
            # With the fused statistics GEMM (Hopper; here the interpreter) the forward forms no logits
            # and gathers in the same chunks (the same collectives on every rank either way)
            bwd = ["logits", "dh", "dw", "logits", "dh", "dw", "logits", "dh", "all_reduce", "dw"]
            for fused in (False, True):
                mp.setattr(lce_gemm, "_GEMM_STATS_OK", [fused])
                mp.setattr(lce_gemm, "_GEMM_GRAD_OK", [fused])
                events.clear()
                _check_tp(h, w, t, b, rank * 16, 16, chunk_tokens=4, reduction="none", return_entropy=True)
                ran = fused and lce_gemm._gemm_fusable(h, w[sl])  # (on a GPU: Hopper, fp16/bf16 only)
                fwd = ["gather"] + (["gather"] * 3 if ran else ["logits", "gather"] * 3)
                assert events == fwd + bwd, (fused, events)
                assert lce_gemm._GEMM_STATS_OK[0] == fused  # the fused GEMM ran without failing
            # per-token, one chunk: the backward takes the shard as one vocabulary slice (the fused
            # gradient GEMM, else cuBLAS and the row kernel), then the dhidden all-reduce
            for fused in (False, True):
                mp.setattr(lce_gemm, "_GEMM_STATS_OK", [fused])
                mp.setattr(lce_gemm, "_GEMM_GRAD_OK", [fused])
                events.clear()
                _check_tp(h, w, t, b, rank * 16, 16, reduction="none", return_entropy=True, label_smoothing=0.1)
                ran = fused and lce_gemm._gemm_fusable(h, w[sl])
                fwd = ["gather"] + ([] if ran else ["logits"]) + ["gather"]
                assert events == fwd + ([] if ran else ["logits"]) + ["all_reduce"], (fused, events)
                assert lce_gemm._GEMM_STATS_OK[0] == lce_gemm._GEMM_GRAD_OK[0] == fused
        finally:
            mp.undo()

    @pytest.mark.world_size(2)
    def test_group_of_one_is_single_gpu_op(self):
        rank = dist.get_rank()
        groups = [dist.new_group([0]), dist.new_group([1])]
        h, w, t, b = _data(9, 8, 30, seed=8, bias=True)
        for kw in (dict(), dict(reduction="none", return_entropy=True, return_lse=True, temperature=0.7)):
            a = weighted_backward(linear_cross_entropy, h, w, t, b, torch.float32, tp_group=groups[rank], **kw)
            s = weighted_backward(linear_cross_entropy, h, w, t, b, torch.float32, **kw)
            for x, y in zip(a[0] + a[1], s[0] + s[1], strict=True):
                assert torch.equal(x, y)
        with pytest.raises(ValueError, match="vocab_start"):
            linear_cross_entropy(h, w, t, tp_group=groups[rank], vocab_start=5)

    @pytest.mark.world_size(2)
    def test_mismatches_raise(self):
        rank = dist.get_rank()
        g = dist.group.WORLD
        h, w, t, _ = _data(6, 8, 32, seed=9)
        # unequal V_local with the default vocab_start (equal shards assumed)
        with pytest.raises(ValueError, match="vocab_start"):
            linear_cross_entropy(h, w[: 16 - rank], t.clamp(max=10), tp_group=g)
        # overlapping explicit shards
        with pytest.raises(ValueError, match="tile"):
            linear_cross_entropy(h, w[:16], t, tp_group=g, vocab_start=rank * 8)
        # dtypes differ across ranks
        dt = torch.float32 if rank == 0 else torch.float16
        with pytest.raises(TypeError, match="dtype.*float16"):
            linear_cross_entropy(h.to(dt), w[:16].to(dt), t, tp_group=g)
        # the gradient formed in the forward for a uniform upstream gradient is for one device
        for fn in (linear_cross_entropy, linear_cross_entropy_reference):
            with pytest.raises(ValueError, match="expect_uniform_grad.*tp_group"):
                fn(h, w[:16], t, tp_group=g, reduction="none", expect_uniform_grad=True)
        # options differ across ranks
        with pytest.raises(ValueError, match="z_loss"):
            linear_cross_entropy(h, w[:16], t, tp_group=g, z_loss=0.1 * rank)
        # a target outside the global vocabulary (32), though inside neither check of V_local alone
        bad = t.clone()
        bad[1] = 32
        with pytest.raises(ValueError, match=r"target.*\[0, 32\)"):
            linear_cross_entropy(h, w[rank * 16:(rank + 1) * 16], bad, tp_group=g)
        with pytest.raises(ValueError, match="temperature"):
            linear_cross_entropy(h, w[rank * 16:(rank + 1) * 16], t, tp_group=g,
                                 temperature=-torch.ones(6, device=DEV))
        # chunk sizes differ across ranks (the per-chunk gathers would not line up)
        with pytest.raises(ValueError, match="chunk_tokens"):
            linear_cross_entropy(h, w[rank * 16:(rank + 1) * 16], t, tp_group=g, chunk_tokens=2 + rank)
        # no tokens: loss 0, the collectives still line up
        hh = h[:0].clone().requires_grad_()
        out = linear_cross_entropy(hh, w[rank * 16:(rank + 1) * 16], t[:0], tp_group=g)
        out.backward()
        assert out.item() == 0 and hh.grad.shape == (0, 8)
        # the layout check is cached: a valid call still works after all of the above
        linear_cross_entropy(h, w[rank * 16:(rank + 1) * 16], t, tp_group=g, validate_targets=False)
        lce_group._TP_LAYOUTS.clear()


def _check_sp(h, w, t, b, rank, size, fn=linear_cross_entropy, dtype=torch.float32, **kw):
    """One rank, sequence parallel: its token shard and vocabulary shard against the float64
    full-sequence, full-vocabulary reference (outputs of the local tokens, the shard's dweight)."""
    M, V = t.shape[0], w.shape[0]
    ml, vl = M // size, V // size
    rows, sl = slice(rank * ml, (rank + 1) * ml), slice(rank * vl, (rank + 1) * vl)
    temp = kw.pop("temperature", None)
    lkw = dict(kw) if temp is None else dict(kw, temperature=temp[rows])
    out, grads = weighted_backward(fn, h[rows], w[sl], t[rows], None if b is None else b[sl], dtype, tp_group=dist.group.WORLD,
                      sequence_parallel=True, **lkw)
    rkw = dict(kw) if temp is None else dict(kw, temperature=temp)
    hd, wd = h.double().requires_grad_(), w.double().requires_grad_()
    bd = None if b is None else b.double().requires_grad_()
    routs = linear_cross_entropy_reference(hd, wd, t, bias=bd, **{k: (v.double() if isinstance(v, torch.Tensor)
                                                                      else v) for k, v in rkw.items()})
    routs = routs if isinstance(routs, tuple) else (routs,)
    total = 0
    for i, (o, ro) in enumerate(zip(out, routs, strict=True)):
        if ro.dim():  # per token: the same linspace weights as _run, on each rank's rows
            wt = torch.cat([torch.linspace(0.5, 1.5, ml, dtype=torch.float64, device=ro.device)] * size) * (i + 1)
            ro_local = ro[rows]
        else:  # the global scalar: every rank backpropagates it with the same weight (as _run)
            wt = torch.tensor(0.5 * (i + 1), dtype=torch.float64, device=ro.device)
            ro_local = ro
        assert o.shape == ro_local.shape, (kw, o.shape, ro_local.shape)
        assert rel(o, ro_local.detach()) <= OUT_TOL or (o - ro_local).abs().max() <= OUT_TOL, (kw, o, ro_local)
        total = total + (ro * wt).sum()
    total.backward()
    rgrads = [hd.grad[rows], wd.grad[sl]] + ([bd.grad[sl]] if b is not None else [])
    assert len(grads) == len(rgrads)
    for name, g, r in zip(("dhidden", "dweight", "dbias"), grads, rgrads):
        assert g.shape == r.shape and torch.isfinite(g).all()
        assert rel(g, r) <= GRAD_TOL or (g - r).abs().max() <= 1e-7, (kw, name, rel(g, r))
    return out


class TestSequenceParallel(DistributedTest):
    world_size = [2, 4]

    def test_matches_full_sequence(self):
        """Local-shard loss/entropy/lse, dhidden of the local tokens and dweight equal the
        single-rank full-sequence full-vocabulary float64 reference; kernels and reference path."""
        rank, size = dist.get_rank(), dist.get_world_size()
        M, H, V = 4 * size, 8, 8 * size
        h, w, t, b = _data(M, H, V, seed=20 + size, bias=True, ignore_every=3)
        temp = (torch.rand(M, generator=torch.Generator().manual_seed(21)) + 0.5).to(DEV)
        cases = [dict(reduction="mean"), dict(reduction="sum", z_loss=0.01),
                 dict(reduction="none", return_entropy=True, return_lse=True, temperature=temp, softcap=2.0),
                 dict(reduction="mean", return_entropy=True, label_smoothing=0.1, chunk_tokens=3)]
        for kw in cases:
            out = _check_sp(h, w, t, b, rank, size, **kw)
            if out[0].dim() == 0:
                _same_on_every_rank(out[:1])
        # the TP-aware torch reference (called directly, float64) and the kernel op's fallback to it
        _check_sp(h, w, t, b, rank, size, fn=linear_cross_entropy_reference, dtype=torch.float64, **cases[2])
        _check_sp(h, w, t, None, rank, size, fn=linear_cross_entropy_reference, dtype=torch.float64, **cases[1])
        if DEV == "cpu" and size == 2:
            os.environ["TRITON_INTERPRET"] = "0"
            _common.reset_fallback_warnings()
            with pytest.warns(RuntimeWarning, match="reference"):
                _check_sp(h, w, t, b, rank, size, **cases[0])
            _check_sp(h, w, t, b, rank, size, **cases[2])
            os.environ["TRITON_INTERPRET"] = "1"

    @pytest.mark.world_size(2)
    def test_collectives(self):
        """Forward: the layout all-gather, the token all-gather and the statistics all-gather (one
        chunk); backward: one reduce-scatter
        of dhidden (no all-reduce), plus, for per-token outputs, the all-gather of their gradients."""
        mp = pytest.MonkeyPatch()
        counter = _Counter(mp)
        try:
            rank = dist.get_rank()
            h, w, t, _ = _data(8, 8, 32, seed=22)
            hs, ws = h[rank * 4:(rank + 1) * 4], w[rank * 16:(rank + 1) * 16]
            cases = [("kernel", dict(), []), ("kernel", dict(reduction="none", return_entropy=True),
                                              ["all_gather_into_tensor"]),
                     ("reference", dict(), []), ("reference", dict(reduction="none", return_lse=True),
                                                 ["all_gather_into_tensor"])]
            for path, kw, extra in cases:
                if path == "reference":
                    os.environ["TRITON_INTERPRET"] = "0"
                    hs, ws = (hs.double(), ws.double()) if DEV == "cuda" else (hs, ws)
                hh, ww = hs.clone().requires_grad_(), ws.clone().requires_grad_()
                counter.on, counter.calls = True, []
                out = linear_cross_entropy(hh, ww, t[rank * 4:(rank + 1) * 4], tp_group=dist.group.WORLD,
                                           sequence_parallel=True, **kw)
                counter.on = False
                # the layout, the token shards, the statistics (one chunk)
                assert counter.calls == ["all_gather_into_tensor"] * 3, (path, kw, counter.calls)
                loss = sum(o.sum() for o in out) if isinstance(out, tuple) else out
                counter.on, counter.calls = True, []
                loss.backward()
                counter.on = False
                assert counter.calls == extra + ["reduce_scatter_tensor"], (path, kw, counter.calls)
                assert hh.grad.shape == hh.shape
            os.environ["TRITON_INTERPRET"] = "1" if DEV == "cpu" else "0"
        finally:
            mp.undo()

    @pytest.mark.world_size(2)
    def test_needs_a_group(self):
        rank = dist.get_rank()
        groups = [dist.new_group([0]), dist.new_group([1])]
        h, w, t, _ = _data(4, 8, 16, seed=23)
        for fn in (linear_cross_entropy, linear_cross_entropy_reference):
            for group in (None, groups[rank]):  # no group, or a group of one rank
                with pytest.raises(ValueError, match="sequence_parallel"):
                    fn(h, w, t, tp_group=group, sequence_parallel=True)
        with pytest.raises(TypeError, match="sequence_parallel"):
            linear_cross_entropy(h, w[:8], t.clamp(max=7), tp_group=dist.group.WORLD, sequence_parallel=1)
        # token shards of different sizes: the layout exchange raises on every rank before the
        # token all-gather (which would not line up)
        for fn in (linear_cross_entropy, linear_cross_entropy_reference):
            with pytest.raises(ValueError, match="sequence_parallel"):
                fn(h[:3 + rank], w[rank * 8:(rank + 1) * 8], t[:3 + rank], tp_group=dist.group.WORLD,
                   sequence_parallel=True)
