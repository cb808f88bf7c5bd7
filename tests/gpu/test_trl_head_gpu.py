"""TRL's fused LM head served by the fused op on CUDA: the fields and gradients of TRL's own head
(its Triton ChunkedLogProbFunction), fp32 tight and bf16 within bf16 bounds, at a vocabulary that
spans several of the op's chunks. (tests/unit/test_trl_head.py runs the exact checks on CPU; on a
machine with CUDA it runs them on the CUDA kernels.)"""
import copy

import pytest
import torch

pytest.importorskip("trl")

from deepspeed_fused.features.linear_cross_entropy import trl as trl_head  # noqa: E402
from deepspeed_fused.features.base import CallCounts  # noqa: E402
from tiny_models import build_model  # noqa: E402

pytestmark = pytest.mark.gpu
ALL = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("softcap", [None, 20.0])
def test_served_head_matches_trl_on_cuda(dtype, tol, softcap):
    from trl.trainer.utils import add_fused_lm_head

    extra = {} if softcap is None else {"final_logit_softcapping": softcap}
    ref = build_model("qwen3-small", dtype=dtype, seed=0, num_hidden_layers=2, **extra).cuda()
    ours = copy.deepcopy(ref)
    add_fused_lm_head(ref, temperature=0.9, outputs=ALL)
    add_fused_lm_head(ours, temperature=0.9, outputs=ALL)
    calls = CallCounts()
    assert trl_head.serve(ours, calls, {})[0]
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, ref.config.vocab_size, (2, 512), generator=g).cuda()
    labels = ids.clone()
    labels[:, :100] = -100
    outs, grads = [], []
    for m in (ref, ours):
        out = m(input_ids=ids, labels=labels, fused_lm_head=True)
        (out.loss + 1e-3 * out.entropy.sum()).backward()
        outs.append(out)
        grads.append({n: p.grad.float() for n, p in m.named_parameters() if p.grad is not None})
    a, b = outs
    assert calls.fused == 1
    for f in ("loss", "log_probs", "entropy", "log_sum_sq_probs"):
        assert _rel(getattr(b, f), getattr(a, f)) <= tol, f
    # mean_logits averages V logits of both signs (~1e-3 where the logits are ~0.3): its error is
    # measured against the logits' own scale, not its cancelled value. Each side's soft cap is an
    # FP32 formula with a few ulp of the cap per logit (TRL's 2 * sigmoid(2x / c) - 1, ours
    # c - 2c / (exp(2x / c) + 1), approximate exp and division on the GPU), ~1e-7 of a mean
    # that is ~1e-3 (the relative 9e-5 seen with a cap of 20).
    with torch.no_grad():
        z = ref.lm_head(ref.model(input_ids=ids).last_hidden_state).float() / 0.9
        if softcap is not None:
            z = softcap / 0.9 * torch.tanh(z / (softcap / 0.9))
        scale = z.pow(2).mean().sqrt().item()
    d = (b.mean_logits.double() - a.mean_logits.double()).norm().item() / a.mean_logits.numel() ** 0.5
    assert d <= tol * scale, ("mean_logits", d, scale)
    agree = (a.is_top1 == b.is_top1).float().mean().item()
    assert agree == 1.0 if dtype == torch.float32 else agree > 0.99
    assert torch.equal(a.label_mask, b.label_mask)
    for n, g_ref in grads[0].items():
        assert _rel(grads[1][n], g_ref) <= (1e-4 if dtype == torch.float32 else 3e-2), n
