"""A float64 MoE model with moe_reorder: torch's grouped_mm takes fp32/bf16/fp16 only (CUDA and CPU),
and transformers' ``_grouped_mm`` calls it whatever the dtype, so the experts' GEMMs go through
transformers' own per-expert fallback op for float64; the loss and gradients equal transformers'
"eager" experts implementation's."""
import copy

import torch

from deepspeed_fused import patch_model, unpatch_model
from tiny_models import build_model


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_float64_experts_use_the_fallback_where_grouped_mm_refuses(interpret):
    model = build_model("qwen3-moe-tiny", dtype=torch.float64).to(interpret)
    ours = copy.deepcopy(model)
    model.set_experts_implementation("eager")  # transformers' per-expert loop: float64 runs there
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.to(interpret)
    want, want_g = _loss_and_grads(model, ids)

    report = patch_model(ours, {"moe_reorder": {"enabled": True}})
    assert report.applied == ["moe_reorder"], str(report)
    got, got_g = _loss_and_grads(ours, ids)
    unpatch_model(ours)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert got_g.keys() == want_g.keys()
    # the reorder ops' backward sums in FP32 (route_combine's one rounding): ~4e-8 of each gradient
    for n, g in want_g.items():
        err = ((got_g[n] - g).norm() / g.norm()).item()
        assert err <= 1e-6, (n, err)
