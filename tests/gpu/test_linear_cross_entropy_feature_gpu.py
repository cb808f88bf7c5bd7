"""The "linear_cross_entropy" feature on CUDA: HF models train through the Triton kernels with the
loss and gradients of the unpatched model, without materializing the logits; ZeRO-3 on 2 GPUs."""
import copy

import pytest
import torch

from deepspeed_fused.features import linear_cross_entropy as lce
from tiny_models import build_model
from unit.common import DistributedTest
from unit.test_linear_cross_entropy_feature import _apply, _relerr, check_ds_matches_unpatched

pytestmark = pytest.mark.gpu


def _batch(V, B, T, seed, device):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    labels[0, : T // 4] = -100
    return {k: v.to(device) for k, v in dict(input_ids=ids, labels=labels).items()}


def _pair(name, dtype):
    ref = build_model(name, dtype=dtype, seed=0).cuda().train()
    fused = copy.deepcopy(ref)
    _apply(fused)
    return ref, fused


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-moe-tiny", "llama-tied-tiny", "deepseek-v3-tiny"])
def test_tiny_models_match_unpatched(name, dtype):
    ref, fused = _pair(name, dtype)
    loss_tol, grad_tol = (1e-5, 1e-4) if dtype == torch.float32 else (2e-3, 3e-2)
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_f = torch.optim.AdamW(fused.parameters(), lr=1e-3)
    steps = 2 if dtype == torch.float32 else 1  # bf16: later steps may route MoE tokens differently
    for step in range(steps):
        b = _batch(257, 2, 64, step, "cuda")
        out_r, out_f = ref(**b), fused(**b)
        assert out_f.logits is None
        assert abs(out_f.loss.item() - out_r.loss.item()) <= loss_tol * abs(out_r.loss.item())
        out_r.loss.backward()
        out_f.loss.backward()
        rp = dict(ref.named_parameters())
        for n, p in fused.named_parameters():
            if rp[n].grad is not None:
                assert _relerr(p.grad.float(), rp[n].grad.float()) <= grad_tol, (n, step)
        opt_r.step(), opt_f.step(), opt_r.zero_grad(), opt_f.zero_grad()
    assert lce.fused_state(fused).fused_calls == steps


def test_large_vocab_bf16_memory_and_accuracy():
    """Qwen3 vocabulary (151936): the fused loss allocates far less than the logits it avoids."""
    ref, fused = _pair("qwen3-small", torch.bfloat16)
    b = _batch(151936, 2, 2048, 0, "cuda")
    peaks, losses, grads = [], [], []
    for m in (ref, fused):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        out = m(**b, use_cache=False)
        out.loss.backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        losses.append(out.loss.float().item())
        grads.append(m.lm_head.weight.grad.float().clone())
        del out
        m.zero_grad(set_to_none=True)
    logits_bytes = 2 * 2048 * 151936 * 4  # the fp32 logits HF's loss upcasts to
    assert peaks[1] < peaks[0] - logits_bytes // 2, [p / 2**20 for p in peaks]
    assert abs(losses[1] - losses[0]) <= 2e-3 * abs(losses[0])
    assert _relerr(grads[1], grads[0]) <= 3e-2


class TestZeroGPU(DistributedTest):
    """ZeRO-2 and ZeRO-3 with the fused loss on 2 ranks over NCCL."""

    world_size = 2
    backend = "nccl"

    @pytest.mark.parametrize("stage,name", [(2, "qwen3-moe-tiny"), (3, "llama-tiny"), (3, "llama-tied-tiny")])
    def test_matches_unpatched(self, stage, name):
        check_ds_matches_unpatched(name, stage, tol=1e-4)
