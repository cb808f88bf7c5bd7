"""Vocabulary- and sequence-parallel linear cross-entropy on NCCL at world size 2 (2 GPUs): every
gloo test of tests/unit/test_linear_cross_entropy_tp.py (equal and ragged shards, per-token
outputs, sequence_parallel, the collective counts, the reference path, the checks) re-run by
subclasses with ``backend = "nccl"``; the test bodies are the unit tests' own."""
import pytest

from unit import test_linear_cross_entropy_tp as tp  # the module, not its classes: pytest collects those

pytestmark = pytest.mark.gpu


class TestVocabParallelNCCL(tp.TestVocabParallel):
    world_size = 2
    backend = "nccl"
    test_subgroups = None  # two TP groups of two ranks: 4 GPUs (the unit test runs it on NCCL where there are)


class TestSequenceParallelNCCL(tp.TestSequenceParallel):
    world_size = 2
    backend = "nccl"


class TestVocabParallelFusedNCCL(tp.DistributedTest):
    """The TP per-token path through the fused GEMMs (Hopper, bf16/fp16): each rank's statistics
    GEMM over its shard and, with one chunk, the shard's gradient GEMM, against the same call with
    cuBLAS + row kernel and against the single-GPU op on the full vocabulary."""
    world_size = 2
    backend = "nccl"

    @pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
    def test_per_token_fused_gemms(self, dtype):
        import torch
        import torch.distributed as dist
        from lce_testing import rel, weighted_backward
        from deepspeed_fused.ops.linear_cross_entropy import chunks as single, launch as kernels, linear_cross_entropy

        dt = getattr(torch, dtype)
        rank = dist.get_rank()
        M, H, V = 1000, 1024, 2 * 24000  # ragged tokens; each shard 24000 rows (8-aligned columns)
        g = torch.Generator(device="cuda").manual_seed(3)
        h = (torch.randn(M, H, device="cuda", generator=g) * 0.5).to(dt)
        w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).to(dt)
        t = torch.randint(0, V, (M,), device="cuda", generator=g)
        t[::7] = -100
        t[1:5] = torch.tensor([23999, 24000, 0, V - 1])  # the shard edges
        temp = torch.rand(M, device="cuda", generator=g) + 0.5
        sl = slice(rank * 24000, (rank + 1) * 24000)
        if not kernels._gemm_fusable(h, w[sl]):
            pytest.skip("the fused GEMMs need a Hopper GPU")
        kw = dict(reduction="none", return_entropy=True, return_lse=True, temperature=temp, label_smoothing=0.1)
        calls, real = [], single.gemm_grad
        single.gemm_grad = lambda *a, **k: (calls.append(k["vocab_start"]), real(*a, **k))[1]
        try:
            fused = weighted_backward(linear_cross_entropy, h, w[sl], t, None, tp_group=dist.group.WORLD, **kw)
        finally:
            single.gemm_grad = real
        assert kernels._GEMM_STATS_OK[0] and kernels._GEMM_GRAD_OK[0], "a fused GEMM fell back (see its warning)"
        assert calls == [rank * 24000], calls  # one slice: the whole shard, at its offset
        kernels._GEMM_STATS_OK[0] = kernels._GEMM_GRAD_OK[0] = False
        try:
            rows = weighted_backward(linear_cross_entropy, h, w[sl], t, None, tp_group=dist.group.WORLD, **kw)
        finally:
            kernels._GEMM_STATS_OK[0] = kernels._GEMM_GRAD_OK[0] = True
        full = weighted_backward(linear_cross_entropy, h, w, t, None, **kw)
        full_grads = [full[1][0], full[1][1][sl]]
        for a, r, f in zip(fused[0] + fused[1], rows[0] + rows[1], full[0] + full_grads, strict=True):
            assert torch.isfinite(a).all()
            assert rel(a, r) <= 2e-3, rel(a, r)  # fused vs row kernel: the same rounded logits
            assert rel(a, f) <= 5e-3, rel(a, f)  # TP vs the single-GPU op (dhidden: a 16-bit all-reduce)
