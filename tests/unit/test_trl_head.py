"""TRL's fused LM head (``add_fused_lm_head``; calls with ``fused_lm_head=True``) served by the
fused op: every field of ``FusedCausalLMOutput`` and the gradients of the loss and of the entropy
equal TRL's own head's (fp32 on CPU, kernels under Triton's interpreter), for ignored rows, an
all-ignored micro-batch, soft cap, temperature, logit scale, bias, ``shift_labels``,
``num_items_in_batch``, fp32 head, tied embeddings, the MoE aux loss and a PEFT model."""
import copy
import dataclasses
import sys

import pytest
import torch

trl_utils = pytest.importorskip("trl.trainer.utils")

from deepspeed_fused.features.linear_cross_entropy import trl as trl_head  # noqa: E402
from deepspeed_fused.features.base import CallCounts  # noqa: E402
from tiny_models import build_model  # noqa: E402

ALL = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
RTOL = 1e-5


def _models(name="llama-tiny", bias=False, seed=0, device="cpu", **cfg):
    m = build_model(name, seed=seed, **cfg).to(device)
    if bias:
        old = m.get_output_embeddings()
        head = torch.nn.Linear(old.in_features, old.out_features, bias=True, device=device)
        with torch.no_grad():
            head.weight.copy_(old.weight)
            head.bias.normal_(0, 0.5)
        m.lm_head = head
    return m, copy.deepcopy(m)


def _add(model, **kw):
    trl_utils.add_fused_lm_head(model, **kw)
    return model


def _serve(model, **kw):
    _add(model, **kw)
    calls = CallCounts()
    ok, why = trl_head.serve(model, calls, {})
    assert ok, why
    return calls


def _inputs(B=2, T=9, V=257, ignore=(), seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    drop = torch.rand(B, T, generator=g) < 0.3
    labels[drop] = -100
    for b, t in ignore:
        labels[b, t] = -100
    return ids.to(device), labels.to(device)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


def _compare(ref, ours, call, ent_weight_seed=3):
    """Run ``call(model)`` on both, compare every field and the gradients of loss + <w, entropy>."""
    outs, grads = [], []
    for m in (ref, ours):
        m.zero_grad(set_to_none=True)
        out = call(m)
        assert isinstance(out, trl_utils.FusedCausalLMOutput)
        total = out.loss
        if out.entropy is not None:
            w = torch.randn(out.entropy.shape, generator=torch.Generator().manual_seed(ent_weight_seed))
            w = w.to(out.entropy.device)
            total = total + (out.entropy * w).sum()
        total.backward()
        outs.append(out)
        grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
    a, b = outs
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        assert (x is None) == (y is None), f.name
        if x is None:
            continue
        assert x.shape == y.shape and x.dtype == y.dtype, (f.name, x.shape, y.shape, x.dtype, y.dtype)
        if x.dtype == torch.bool:
            assert torch.equal(x, y), f.name
        elif x.numel() and x.abs().max() > 0:
            assert _rel(y, x) <= RTOL, (f.name, _rel(y, x))
        else:
            assert torch.equal(x, y), f.name
    if a.label_mask is not None:  # every per-token field is zero where the label is ignored
        for n in ALL:
            v = getattr(b, n)
            if v is not None:
                assert not v[~b.label_mask].any(), n
    assert grads[0].keys() == grads[1].keys()
    for n, g in grads[0].items():
        h = grads[1][n]
        if g.norm() == 0:
            assert h.norm() == 0, n
        else:
            assert (h - g).norm() <= 1e-4 * g.norm(), (n, ((h - g).norm() / g.norm()).item())
    return a, b


def test_all_fields_and_gradients_with_ignored_rows(interpret):
    ref, ours = _models(device=interpret)
    _add(ref, outputs=ALL)
    calls = _serve(ours, outputs=ALL)
    ids, labels = _inputs(ignore=[(0, 1), (1, 8)], device=interpret)
    _compare(ref, ours, lambda m: m(input_ids=ids, labels=labels, fused_lm_head=True))
    assert (calls.fused, calls.eager) == (1, 0)


@pytest.mark.parametrize("outputs", [ALL, ("log_probs", "entropy", "is_top1"), ("log_probs", "mean_logits")])
def test_forward_only_fields_come_from_the_op(interpret, monkeypatch, outputs):
    """is_top1 / mean_logits / log_sum_sq_probs are the op's own (no extra logits pass), in any
    subset TRL asks for; the extra pass runs only for an op given a tp_group."""
    from deepspeed_fused.ops.linear_cross_entropy import api as lce_api

    def no_pass(*a, **k):
        raise AssertionError("the extra logits pass ran")

    monkeypatch.setattr(trl_head, "extra_fields", no_pass)
    asked = []
    real = lce_api.linear_cross_entropy

    def spy(*a, **k):
        asked.append(sorted(n for n, v in k.items() if n.startswith("return_") and v))
        return real(*a, **k)

    monkeypatch.setattr(lce_api, "linear_cross_entropy", spy)
    monkeypatch.setattr(sys.modules["deepspeed_fused.ops.linear_cross_entropy"], "linear_cross_entropy", spy)
    ref, ours = _models(bias=True, final_logit_softcapping=2.5, device=interpret)
    _add(ref, outputs=outputs, temperature=0.7)
    calls = _serve(ours, outputs=outputs, temperature=0.7)
    ids, labels = _inputs(seed=5, ignore=[(0, 2)], device=interpret)
    _compare(ref, ours, lambda m: m(input_ids=ids, labels=labels, fused_lm_head=True))
    want = {"entropy": "return_entropy", "is_top1": "return_is_top1", "mean_logits": "return_mean_logits",
            "log_sum_sq_probs": "return_log_sum_sq"}
    assert asked == [sorted(want[o] for o in outputs if o in want)] and (calls.fused, calls.eager) == (1, 0)


def test_softcap_temperature_logit_scale_bias(interpret):
    ref, ours = _models(bias=True, final_logit_softcapping=2.5, logit_scale=1.7, device=interpret)
    _add(ref, outputs=ALL, temperature=0.7)
    _serve(ours, outputs=ALL, temperature=0.7)
    rec = trl_head.served(ours)
    assert rec.head.logit_scale == 1.7 and rec.head.softcap == 2.5 and rec.head.temperature == 0.7
    ids, labels = _inputs(seed=4, device=interpret)
    _compare(ref, ours, lambda m: m(input_ids=ids, labels=labels, fused_lm_head=True))


def test_logits_scaling_divides(interpret):
    ref, ours = _models(logits_scaling=4.0, device=interpret)
    _add(ref, outputs=("log_probs", "entropy"))
    _serve(ours, outputs=("log_probs", "entropy"))
    assert trl_head.served(ours).head.logit_scale == 0.25
    ids, labels = _inputs(seed=5, device=interpret)
    _compare(ref, ours, lambda m: m(input_ids=ids, labels=labels, fused_lm_head=True))


def test_shift_labels_and_num_items(interpret):
    ref, ours = _models(device=interpret)
    _add(ref, outputs=("log_probs", "entropy", "is_top1"))
    _serve(ours, outputs=("log_probs", "entropy", "is_top1"))
    ids, labels = _inputs(seed=6, device=interpret)
    shift = torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], 1)
    a, _ = _compare(ref, ours, lambda m: m(input_ids=ids, shift_labels=shift, num_items_in_batch=torch.tensor(23, device=interpret),
                                          fused_lm_head=True))
    assert a.log_probs.shape == ids.shape


def test_all_ignored_micro_batch(interpret):
    ref, ours = _models(device=interpret)
    _add(ref, outputs=ALL)
    _serve(ours, outputs=ALL)
    ids, _ = _inputs(seed=7, device=interpret)
    labels = torch.full_like(ids, -100)
    a, b = _compare(ref, ours, lambda m: m(input_ids=ids, labels=labels, fused_lm_head=True))
    assert b.loss.item() == 0.0 and b.loss.grad_fn is not None
    assert all(p.grad is not None and p.grad.abs().max() == 0 for p in ours.parameters() if p.requires_grad
               and p.grad is not None)


def test_default_outputs_and_fp32_head(interpret):
    ref, ours = _models(device=interpret)
    _add(ref, cast_lm_head_to_fp32=True)
    _serve(ours, cast_lm_head_to_fp32=True)
    ids, labels = _inputs(seed=8, device=interpret)
    a, b = _compare(ref, ours, lambda m: m(input_ids=ids, labels=labels, fused_lm_head=True))
    assert b.entropy is None and b.is_top1 is None


def test_tied_embeddings(interpret):
    ref, ours = _models("llama-tied-tiny", device=interpret)
    assert ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    _add(ref, outputs=("log_probs", "entropy"))
    _serve(ours, outputs=("log_probs", "entropy"))
    ids, labels = _inputs(seed=9, device=interpret)
    _compare(ref, ours, lambda m: m(input_ids=ids, labels=labels, fused_lm_head=True))


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_moe_aux_loss(interpret, name):
    ref, ours = _models(name, device=interpret)
    _add(ref, outputs=("log_probs", "entropy"))
    _serve(ours, outputs=("log_probs", "entropy"))
    ids, labels = _inputs(seed=10, device=interpret)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    a, b = _compare(ref, ours, lambda m: m(input_ids=ids, attention_mask=mask, labels=labels, fused_lm_head=True))
    assert b.aux_loss is not None and b.aux_loss.item() > 0


def test_calls_without_the_flag_go_to_trl(interpret):
    ref, ours = _models(device=interpret)
    _add(ref)
    calls = _serve(ours)
    ids, labels = _inputs(seed=11, device=interpret)
    x, y = ref(input_ids=ids, labels=labels), ours(input_ids=ids, labels=labels)
    assert torch.equal(x.logits, y.logits) and torch.equal(x.loss, y.loss)
    assert (calls.fused, calls.eager) == (0, 0)
    assert trl_head.unserve(ours) and trl_head.trl_forward_of(ours) is ours.forward
    assert trl_head.served(ours) is None


def test_peft_base_model(interpret):
    peft = pytest.importorskip("peft")
    ref, ours = _models(seed=2, device=interpret)
    models = []
    for m in (ref, ours):
        pm = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0,
                                                    init_lora_weights=False))
        models.append(pm)
    _add(models[0].get_base_model(), outputs=("log_probs", "entropy"))
    _serve(models[1].get_base_model(), outputs=("log_probs", "entropy"))
    ids, labels = _inputs(seed=12, device=interpret)
    models[1].load_state_dict(models[0].state_dict())
    _compare(models[0], models[1], lambda m: m(input_ids=ids, labels=labels, fused_lm_head=True))


def _model_with_a_newer_output(monkeypatch):
    """A model with TRL's head, TRL's output class given a field the feature does not know."""
    m, _ = _models()
    _add(m)

    @dataclasses.dataclass
    class Newer(trl_utils.FusedCausalLMOutput):
        top_k: torch.Tensor = None

    monkeypatch.setattr(trl_utils, "FusedCausalLMOutput", Newer)
    return m


def test_unknown_protocol_keeps_trl_head(monkeypatch):
    m = _model_with_a_newer_output(monkeypatch)
    ok, why = trl_head.serve(m, CallCounts(), {})
    assert not ok and "top_k" in why and "fields" in why
    assert trl_head.served(m) is None and trl_head.trl_forward_of(m) is m.forward


def test_unknown_argument_keeps_trl_head():
    m, _ = _models()
    _add(m)
    fn = m.forward.__func__

    def newer(self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None,
              completion_mask=None, **kwargs):
        return fn(self, *args, fused_lm_head=fused_lm_head, labels=labels, **kwargs)

    head, why = trl_head.read_trl_head(type(m.forward)(newer, m))
    assert head is None and "completion_mask" in why


def test_non_positive_scale_keeps_trl_head():
    m, _ = _models(logit_scale=-2.0)
    _add(m)
    ok, why = trl_head.serve(m, CallCounts(), {})
    assert not ok and "logit_scale=-2.0" in why


def test_extra_fields_match_float64_reference():
    g = torch.Generator().manual_seed(0)
    h, w, b = torch.randn(13, 16, generator=g), torch.randn(37, 16, generator=g), torch.randn(37, generator=g)
    t = torch.randint(0, 37, (13,), generator=g)
    res = trl_head.extra_fields(h, w, b, t, 0.8, 3.0, ("log_sum_sq_probs", "mean_logits", "is_top1"))
    z = (h.double() @ w.double().t() + b.double()) / 0.8
    z = 3.0 * torch.tanh(z / 3.0)
    p = torch.softmax(z, -1)
    assert _rel(res["log_sum_sq_probs"], torch.log((p * p).sum(-1))) < 1e-6
    assert _rel(res["mean_logits"], z.mean(-1)) < 1e-6
    assert torch.equal(res["is_top1"], z.argmax(-1) == t)


def test_adapter_on_the_head_keeps_trl_head_for_the_call():
    peft = pytest.importorskip("peft")
    m, _ = _models(seed=3)
    pm = peft.get_peft_model(m, peft.LoraConfig(r=4, target_modules=["lm_head", "q_proj"], lora_dropout=0.0))
    calls = _serve(pm.get_base_model(), outputs=("log_probs", "entropy"))
    ids, labels = _inputs(seed=13)
    with pytest.warns(RuntimeWarning, match="TRL's fused LM head kept for this call: the output embedding is"):
        out = pm(input_ids=ids, labels=labels, fused_lm_head=True)
    rec = trl_head.served(pm.get_base_model())
    ref = rec.trl_forward(input_ids=ids, labels=labels, fused_lm_head=True)
    assert torch.equal(out.log_probs, ref.log_probs) and (calls.fused, calls.eager) == (0, 1)


SECTION = {"linear_cross_entropy": {"enabled": True}}


def test_feature_report_serves_and_reverts(interpret):
    from deepspeed_fused.hook import patch_model, unpatch_model

    m, _ = _models(device=interpret)
    _add(m, outputs=("log_probs", "entropy"))
    trl_forward = m.forward
    rep = patch_model(m, SECTION)["linear_cross_entropy"]
    assert rep.applied and rep.where == "1 x LlamaForCausalLM (TRL fused LM head served)", str(rep)
    assert rep.details["trl_served"] == {"LlamaForCausalLM": 1}
    ids, labels = _inputs(seed=14, device=interpret)
    m(input_ids=ids, labels=labels, fused_lm_head=True)
    assert (rep.calls.fused, rep.calls.eager) == (1, 0) and "1 fused, 0 reference, 0 eager" in str(rep)
    assert unpatch_model(m)["linear_cross_entropy"] == 1
    assert m.forward == trl_forward and trl_head.served(m) is None


def test_feature_report_says_why_trl_head_is_kept(monkeypatch):
    from deepspeed_fused.hook import patch_model

    m = _model_with_a_newer_output(monkeypatch)
    with pytest.warns(RuntimeWarning, match="not applied"):
        rep = patch_model(m, SECTION)["linear_cross_entropy"]
    assert not rep.applied and "TRL's fused LM head kept: TRL's FusedCausalLMOutput has fields" in rep.reason
    assert trl_head.served(m) is None


# ---- the gradient formed in the forward for a uniform upstream gradient (SFT's loss) ----------

def _spy_uniform(monkeypatch):
    """Record, per op call, whether the served head asked for ``expect_uniform_grad``."""
    from deepspeed_fused.ops.linear_cross_entropy import api as lce_api

    asked = []
    real = lce_api.linear_cross_entropy

    def spy(*a, **k):
        asked.append(bool(k.get("expect_uniform_grad")))
        return real(*a, **k)

    monkeypatch.setattr(sys.modules["deepspeed_fused.ops.linear_cross_entropy"], "linear_cross_entropy", spy)
    return asked


def _sft_loss(out, _step):
    """TRL's SFTTrainer loss (the metrics read the entropy and is_top1 without gradient)."""
    _ = out.entropy.detach().sum(), out.is_top1.sum()
    return (-out.log_probs).sum() / out.label_mask.sum().clamp(min=1)


def _weighted_loss(out, step):
    """A GRPO-like loss: per-sequence advantages on the per-token log-probs."""
    adv = torch.tensor([1.0 + step, -0.5], device=out.log_probs.device)
    return -(out.log_probs * adv[:, None]).sum() / out.label_mask.sum().clamp(min=1)


def _loop(ref, ours, losses, interpret, frozen_head=False):
    """Training steps on both models (fresh inputs each), comparing the gradients with TRL's head."""
    outputs = ("log_probs", "entropy", "is_top1")
    _add(ref, outputs=outputs)
    calls = _serve(ours, outputs=outputs)
    if frozen_head:
        for m in (ref, ours):
            m.get_output_embeddings().weight.requires_grad_(False)
    for step, loss_fn in enumerate(losses):
        ids, labels = _inputs(seed=20 + step, device=interpret)
        grads = []
        for m in (ref, ours):
            m.zero_grad(set_to_none=True)
            loss_fn(m(input_ids=ids, labels=labels, fused_lm_head=True), step).backward()
            grads.append({n: p.grad for n, p in m.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys()
        for n, g in grads[0].items():
            assert (grads[1][n] - g).norm() <= 1e-4 * g.norm(), (step, n)
    return calls, trl_head.served(ours).grad


def test_sft_loop_switches_to_the_gradient_formed_in_the_forward(interpret, monkeypatch):
    asked = _spy_uniform(monkeypatch)
    ref, ours = _models(bias=True, device=interpret)
    calls, policy = _loop(ref, ours, [_sft_loss] * 3, interpret)
    assert asked == [False, True, True]  # learnt from the first step's backward
    assert (policy.on, policy.formed, policy.recomputed, policy.strikes) == (True, 2, 0, 0)
    assert (calls.fused, calls.eager) == (3, 0)
    assert "gradient formed in the forward" in trl_head.head_text(ours)


def test_weighted_loop_stays_per_token(interpret, monkeypatch):
    """Per-token weights: observed twice, then the model settles on the per-token path (no
    recomputation ever paid, nothing observed any more)."""
    asked = _spy_uniform(monkeypatch)
    ref, ours = _models(device=interpret)
    calls, policy = _loop(ref, ours, [_weighted_loss] * 4, interpret)
    assert asked == [False] * 4
    assert (policy.on, policy.settled, policy.strikes, policy.recomputed) == (False, True, 2, 0)
    assert "per-token gradient" in trl_head.head_text(ours)


def test_uniform_then_weighted_returns_to_per_token(interpret, monkeypatch):
    """A weighted call under the mode recomputes (exact) and turns it off; after two such strikes
    the model stays per-token: the recomputation is paid at most twice."""
    asked = _spy_uniform(monkeypatch)
    ref, ours = _models(device=interpret)
    losses = [_sft_loss, _weighted_loss, _sft_loss, _weighted_loss, _sft_loss, _sft_loss]
    calls, policy = _loop(ref, ours, losses, interpret)
    assert asked == [False, True, False, True, False, False]
    assert (policy.on, policy.settled, policy.strikes, policy.recomputed, policy.formed) == (False, True, 2, 2, 0)


def test_entropy_gradient_keeps_per_token(interpret, monkeypatch):
    asked = _spy_uniform(monkeypatch)
    ref, ours = _models(device=interpret)

    def with_entropy_bonus(out, step):
        return _sft_loss(out, step) - 0.01 * out.entropy.sum()

    _, policy = _loop(ref, ours, [with_entropy_bonus] * 3, interpret)
    assert asked == [False] * 3 and policy.settled and policy.formed == 0


def test_frozen_head_takes_the_mode_for_weighted_losses(interpret, monkeypatch):
    """dhidden alone: the op scales it row by row, exact for per-token weights."""
    asked = _spy_uniform(monkeypatch)
    ref, ours = _models(device=interpret)
    _, policy = _loop(ref, ours, [_weighted_loss] * 3, interpret, frozen_head=True)
    assert asked == [False, True, True] and (policy.formed, policy.recomputed) == (2, 0)
