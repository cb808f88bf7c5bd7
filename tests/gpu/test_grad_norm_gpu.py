"""The ``grad_norm`` op and feature on the GPU: per-tensor float64 norms of bf16/fp16/fp32 gradients
(views of one flat buffer, as ZeRO-1/2 keeps them, and separate tensors) against the float64 copy
DeepSpeed takes, the same bits from run to run, non-finite elements, every output written; and
DeepSpeed's ZeRO-2 engine in bf16 (one rank, and two over NCCL) with the feature on against the
same run without it: the same losses, global norms and weights. Each body runs in a clean worker
(tests/conftest.py)."""
from __future__ import annotations

import math

import pytest
import torch

import deepspeed
from deepspeed_fused.ops.grad_norm import launch, tensor_norms, tensor_norms_reference
from tiny_models import build_model
from unit.common import DistributedTest

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _views(dtype, sizes, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    flat = (torch.randn(sum(sizes), generator=gen, device="cuda") * 0.01).to(dtype)
    out, at = [], 0
    for n in sizes:
        out.append(flat[at:at + n])
        at += n
    return flat, out


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_of_a_flat_buffer_match_the_float64_copy(dtype):
    # an embedding-sized view, MLP- and norm-sized ones, odd sizes, an empty one, chunk boundaries
    c = launch.CHUNK
    sizes = [128256 * 3072, 3072, 8192 * 3072, 1, 0, c - 1, c, c + 1, 3 * c + 5, 1000003]
    _, views = _views(dtype, sizes)
    got = tensor_norms(views)
    ref = tensor_norms_reference(views)
    assert got.dtype == torch.float64 and got.shape == (len(sizes),)
    rel = ((got - ref).abs() / ref.clamp_min(1e-300)).max().item()
    assert rel <= 1e-13, rel
    assert got[4].item() == 0.0
    assert torch.equal(tensor_norms(views), got)  # the same bits on every call
    # every entry written: a reused output buffer never shows through
    torch.cuda.empty_cache()
    assert torch.equal(tensor_norms(views), got)


def test_separate_tensors_mixed_dtypes_and_non_contiguous():
    gen = torch.Generator(device="cuda").manual_seed(1)
    ts = [torch.randn(5000, 77, generator=gen, device="cuda").to(torch.bfloat16),
          torch.randn(123457, generator=gen, device="cuda"),
          torch.randn(300, 200, generator=gen, device="cuda").half().t(),
          torch.randn(999, generator=gen, device="cuda", dtype=torch.float64)]
    with pytest.warns(RuntimeWarning, match="deepspeed_fused.grad_norm"):
        got = tensor_norms(ts)
    ref = tensor_norms_reference(ts)
    assert ((got - ref).abs() / ref).max().item() <= 1e-13


def test_non_finite_gradients_where_the_reference_has_them():
    _, views = _views(torch.bfloat16, [70000, 70000, 70000, 500])
    views[0][12345] = float("inf")
    views[1][69999] = float("nan")
    views[2][0], views[2][1] = float("-inf"), float("nan")
    got, ref = tensor_norms(views), tensor_norms_reference(views)
    assert got[0].item() == math.inf and math.isnan(got[1].item()) and math.isnan(got[2].item())
    assert math.isfinite(got[3].item())
    # the largest finite bf16 everywhere: its squares' float64 sum stays finite (no false overflow)
    big = torch.full((3_000_000,), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16, device="cuda")
    assert math.isfinite(tensor_norms([big])[0].item())
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.isinf(), ref.isinf())


def _train(on, steps=3, name="llama-small"):
    torch.manual_seed(0)
    model = build_model(name)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 0.5,
           "bf16": {"enabled": True}, "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
           "steps_per_print": 10**6, "deepspeed_fused": {"show_report": False, "grad_norm": {"enabled": on}}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    gen = torch.Generator(device="cuda").manual_seed(10 + deepspeed.comm.get_rank())
    losses, norms = [], []
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 256), generator=gen, device="cuda")
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    weights = [p.detach().clone() for p in model.parameters()]
    return engine, losses, norms, weights


class TestZero2Engine(DistributedTest):
    world_size = [1, 2]
    backend = "nccl"

    def test_bf16_run_equals_deepspeeds(self):
        _, l0, n0, w0 = _train(False)
        engine, l1, n1, w1 = _train(True)
        rep = {f.name: f for f in engine.deepspeed_fused_report.features}["grad_norm"]
        # bf16: the overflow check runs before each norm, both fused
        assert rep.applied and rep.calls.fused == 6 and rep.calls.reference == 0 and rep.calls.eager == 0, \
            (rep.reason, rep.calls)
        assert "has_overflow_partitioned_grads_serial" in rep.where
        # one table, built at the first step: the gradients keep their layout from step to step
        # (DeepSpeed may hand them in a buffer at another address; the table does not depend on it)
        assert len(launch._PLANS) == 1
        assert l1 == l0
        assert n1 == n0, (n1, n0)
        assert all(torch.equal(a, b) for a, b in zip(w1, w0))
