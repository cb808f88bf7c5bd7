"""A fully masked accumulated step through DeepSpeed (two gloo ranks on CPU).

HF's ``ForCausalLMLoss`` divides the summed loss by ``num_items_in_batch``; an SFT step whose
every answer was truncated away has 0 of them. Eager then gives a NaN loss and zero gradients,
so the optimizer step leaves the parameters finite. The fused LM-head loss (patched through
``deepspeed.initialize``'s config section) must do the same on its kernel path (Triton's
interpreter on CPU) and on its torch reference, at ZeRO 0, 2 and 3: the same NaN loss, every
gradient exactly 0, the parameters after the step equal to eager's, and a normal step after it
finite.
"""
import pytest
import torch

from unit.common import DistributedTest

_ARMS = ("eager", "kernel", "reference")


def _batch(vocab, rank, masked, B=2, T=8):
    g = torch.Generator().manual_seed(40 + rank)
    ids = torch.randint(0, vocab, (B, T), generator=g)
    labels = torch.full_like(ids, -100) if masked else ids.clone()
    return dict(input_ids=ids, labels=labels)


def _run(arm, stage):
    """One masked step (num_items_in_batch = 0) and one normal step through an engine; returns the
    masked loss, the full gradients of that step, the parameters after it and the next loss."""
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_grad

    from deepspeed_fused.features import linear_cross_entropy as lce_feature
    from deepspeed_fused.ops.linear_cross_entropy import api as lce_api
    from tiny_models import build_model

    model = build_model("llama-tiny", seed=0)
    vocab = model.config.vocab_size
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    if arm != "eager":
        config["deepspeed_fused"] = {"linear_cross_entropy": {"enabled": True}}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=config)
    if arm != "eager":
        assert engine.deepspeed_fused_report["linear_cross_entropy"].applied
    engine.train()
    calls = {"ref": 0}
    real_ok, real_ref = lce_api.kernel_device_ok, lce_api.run_reference

    def ref(*a, **k):
        calls["ref"] += 1
        return real_ref(*a, **k)

    lce_api.run_reference = ref
    if arm == "reference":  # the op's fallback to its torch reference, as on a device without kernels
        lce_api.kernel_device_ok = lambda t: (False, "test: the torch reference path")
    try:
        rank = dist.get_rank()
        batch = _batch(vocab, rank, masked=True)
        out = engine(**batch, num_items_in_batch=torch.tensor(0))
        assert (out.logits is None) == (arm != "eager")
        loss = out.loss.detach().clone()
        engine.backward(out.loss)
        grads = {n: safe_get_full_grad(p) for n, p in engine.module.named_parameters()}
        grads = {n: (None if g is None else g.detach().float().cpu().clone()) for n, g in grads.items()}
        engine.step()
        params = {}
        for n, p in engine.module.named_parameters():
            with deepspeed.zero.GatheredParameters([p], enabled=stage == 3):
                params[n] = p.detach().float().cpu().clone()
        out = engine(**_batch(vocab, rank, masked=False))
        engine.backward(out.loss)
        engine.step()
        nxt = out.loss.detach().clone()
        if arm != "eager":
            assert lce_feature.fused_state(engine.module).fused_calls == 2
        # the kernel arm ran the kernels (no fallback), the reference arm the reference
        assert calls["ref"] == {"eager": 0, "kernel": 0, "reference": 2}[arm], calls
    finally:
        lce_api.kernel_device_ok, lce_api.run_reference = real_ok, real_ref
        if arm != "eager":
            from deepspeed_fused import unpatch_model

            unpatch_model(engine.module)
    return loss, grads, params, nxt


class TestFullyMaskedStep(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage", [0, 2, 3])
    def test_masked_step_keeps_parameters_finite(self, stage):
        torch.set_num_threads(1)
        runs = {arm: _run(arm, stage) for arm in _ARMS}
        e_loss, e_grads, e_params, _ = runs["eager"]
        for arm, (loss, grads, params, nxt) in runs.items():
            assert torch.isnan(loss), (arm, loss)
            assert e_grads.keys() == grads.keys()
            for n, g in grads.items():
                assert g is not None and torch.equal(g, torch.zeros_like(g)), (arm, n, g)
            for n, p in params.items():
                assert torch.isfinite(p).all(), (arm, n)
                # zero gradients: the step is AdamW's weight decay alone, bitwise eager's
                assert torch.equal(p, e_params[n]), (arm, n)
            assert torch.isfinite(nxt), (arm, nxt)
