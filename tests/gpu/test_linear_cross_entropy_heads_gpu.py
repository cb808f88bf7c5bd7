"""The "linear_cross_entropy" feature on CUDA across head patterns (tests/lce_families.py): heads
not named *ForCausalLM, temperatures from logit scales, soft caps, vision-language models, in
fp32 and bf16 through the Triton kernels, against the unpatched model."""
import copy
import warnings

import pytest
import torch

from lce_families import FAMILIES, image_batch, text_batch
from unit.test_linear_cross_entropy_heads import _apply, _assert_grads_match, _run

pytestmark = pytest.mark.gpu

NAMES = ["gpt2", "opt", "bloom", "cohere", "granitemoe", "falcon-h1", "gemma2", "recurrent-gemma", "mamba",
         "qwen2.5-vl", "llava", "mistral3", "gemma3", "paligemma"]


def _cuda(b):
    return {k: v.cuda() for k, v in b.items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", NAMES)
def test_family_matches_unpatched_on_gpu(name, dtype):
    build, want = FAMILIES[name]
    ref = build().to(device="cuda", dtype=dtype).train()
    fused = copy.deepcopy(ref)
    rep = _apply(fused)
    assert rep.applied, rep.reason
    loss_tol, grad_tol = (1e-5, 1e-3) if dtype == torch.float32 else (2e-3, 3e-2)
    batches = [text_batch(3, B=4, T=32)] + ([image_batch(name, 4)] if image_batch(name, 4) is not None else [])
    for b in map(_cuda, batches):
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=".*running the torch reference.*")  # the kernels ran
            out_f = _run(fused, b)
        out_r = _run(ref, b)
        assert out_f.logits is None
        rel = abs(out_f.loss.item() - out_r.loss.item()) / abs(out_r.loss.item())
        assert rel <= loss_tol, rel
        out_r.loss.backward()
        out_f.loss.backward()
        _assert_grads_match(fused, ref, tol=grad_tol)
        ref.zero_grad(), fused.zero_grad()
