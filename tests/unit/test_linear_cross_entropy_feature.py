"""The "linear_cross_entropy" feature: HF causal LMs train through the fused op with the same loss
and gradients as the unpatched model (CPU: the op's torch reference, fp32)."""
import copy

import pytest
import torch

import deepspeed_fused.ops.linear_cross_entropy as lce_op
from deepspeed_fused.config import ConfigError, parse_config
from deepspeed_fused.features import linear_cross_entropy as lce
from deepspeed_fused.features.registry import get_feature
from tiny_models import build_model
from unit.common import DistributedTest

# Import the model classes here, in the parent process: each forked test would pay seconds for it.
from transformers import (AutoModelForCausalLM, CohereForCausalLM, DeepseekV2ForCausalLM,  # noqa: F401,E402
                          DeepseekV3ForCausalLM, Gemma2ForCausalLM, GraniteForCausalLM, LlamaForCausalLM,
                          MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM,
                          Qwen2MoeForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM)

V = 257


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models: intra-op threads only contend on a shared 2-core machine (100x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _cfg(**kw):
    return getattr(parse_config({"linear_cross_entropy": {"enabled": True, **kw}}), "linear_cross_entropy")


def _apply(model, **kw):
    rep = get_feature("linear_cross_entropy").apply(model, None, _cfg(**kw))
    assert rep.applied, rep.reason
    return rep


def _batch(seed=0, B=2, T=16, pad=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    labels = ids.clone()
    labels[0, :4] = -100  # a prompt that is not trained on
    mask = torch.ones(B, T, dtype=torch.long)
    if pad:
        mask[-1, -pad:] = 0
        labels[-1, -pad:] = -100
    return dict(input_ids=ids, attention_mask=mask, labels=labels)


def _pair(name, **kw):
    ref = build_model(name, seed=0, **kw)
    fused = copy.deepcopy(ref)
    ref.train()
    fused.train()
    return ref, fused


def _relerr(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _assert_grads_match(fused, ref, tol=1e-4):
    rp = dict(ref.named_parameters())
    for n, p in fused.named_parameters():
        q = rp[n]
        if q.grad is None:
            assert p.grad is None or p.grad.abs().max() == 0, n
            continue
        assert p.grad is not None, f"{n}: no gradient on the fused model"
        assert _relerr(p.grad, q.grad) <= tol, f"{n}: grad rel err {_relerr(p.grad, q.grad):.2e}"


@pytest.fixture
def op_calls(monkeypatch):
    """Record every call of the op (the feature looks it up at call time)."""
    calls = []
    real = lce_op.linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append({**kwargs, "hidden": args[0], "weight": args[1], "target": args[2]})
        return real(*args, **kwargs)

    monkeypatch.setattr(lce_op, "linear_cross_entropy", spy)
    return calls


@pytest.fixture(autouse=True)
def _clean_classes():
    yield
    for cls in list(lce._PATCHED_CLASSES):  # a failed test must not leave classes patched for the next
        lce._unpatch_class(cls)


# ---------------------------------------------------------------------------------------------
# Training through the fused op matches the unpatched model.

MODELS = ["llama-tiny", "qwen3-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny", "llama-tied-tiny"]


@pytest.mark.parametrize("name", MODELS)
def test_training_matches_unpatched(name, op_calls):
    ref, fused = _pair(name)
    rep = _apply(fused)
    assert rep.details["patched"] == {type(fused).__name__: 1}
    assert type(fused).__name__ in rep.where
    if name == "llama-tied-tiny":
        assert fused.lm_head.weight is fused.model.embed_tokens.weight
    opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    opt_f = torch.optim.AdamW(fused.parameters(), lr=1e-3)
    for step in range(3):
        b = _batch(step)
        out_r, out_f = ref(**b), fused(**b)
        assert type(out_f) is type(out_r)
        assert out_f.logits is None and out_r.logits is not None
        assert abs(out_f.loss.item() - out_r.loss.item()) <= 1e-5 * abs(out_r.loss.item()), step
        if name == "qwen3-moe-tiny":  # router aux loss: present, equal, added to the loss by the model
            assert out_r.aux_loss is not None and out_f.router_logits is not None
            torch.testing.assert_close(out_f.aux_loss, out_r.aux_loss, rtol=1e-6, atol=1e-7)
            assert len(out_f.router_logits) == len(out_r.router_logits)
        out_r.loss.backward()
        out_f.loss.backward()
        _assert_grads_match(fused, ref)
        opt_r.step(), opt_f.step(), opt_r.zero_grad(), opt_f.zero_grad()
    assert len(op_calls) == 3 and lce.fused_state(fused).fused_calls == 3
    assert op_calls[0]["reduction"] == "mean" and op_calls[0]["ignore_index"] == -100
    for p, q in zip(fused.parameters(), ref.parameters()):  # the optimizer saw the same gradients
        assert _relerr(p.detach(), q.detach()) <= 1e-5


def test_moe_aux_loss_really_added(op_calls):
    """With a large router_aux_loss_coef the aux term dominates: the fused loss must carry it."""
    ref, fused = _pair("qwen3-moe-tiny", router_aux_loss_coef=10.0)
    _apply(fused)
    b = _batch(7)
    out_r, out_f = ref(**b), fused(**b)
    torch.testing.assert_close(out_f.loss, out_r.loss, rtol=1e-5, atol=0)
    out_r.loss.backward()
    out_f.loss.backward()
    _assert_grads_match(fused, ref)
    ref.zero_grad(), fused.zero_grad()
    out_r, out_f = ref(**b, output_router_logits=False), fused(**b, output_router_logits=False)
    assert out_f.aux_loss is None and out_f.router_logits is None
    torch.testing.assert_close(out_f.loss, out_r.loss, rtol=1e-5, atol=0)


@pytest.mark.parametrize("name,kw", [
    ("mixtral-tiny", {}),
    ("qwen2-moe-tiny", {}),
])
def test_other_families(name, kw, op_calls):
    ref, fused = _pair(name, **kw)
    _apply(fused)
    b = _batch(3)
    out_r, out_f = ref(**b), fused(**b)
    torch.testing.assert_close(out_f.loss, out_r.loss, rtol=1e-5, atol=0)
    out_r.loss.backward()
    out_f.loss.backward()
    _assert_grads_match(fused, ref)
    assert len(op_calls) == 1


def _tiny_from_config(cls_name, **kw):
    import transformers

    cfg = getattr(transformers, cls_name)(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
                                          max_position_embeddings=256, **kw)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg)


@pytest.mark.parametrize("cls_name,kw,arg", [
    ("Gemma2Config", dict(head_dim=16, final_logit_softcapping=3.0), "softcap"),  # soft-capped logits
    ("GraniteConfig", dict(logits_scaling=4.0), "temperature"),  # logits divided by a config scalar
])
def test_logit_transforms_map_to_op_options(cls_name, kw, arg, op_calls):
    ref = _tiny_from_config(cls_name, **kw).train()
    fused = copy.deepcopy(ref)
    _apply(fused)
    b = _batch(5)
    out_r, out_f = ref(**b), fused(**b)
    assert out_f.logits is None
    torch.testing.assert_close(out_f.loss, out_r.loss, rtol=1e-5, atol=0)
    out_r.loss.backward()
    out_f.loss.backward()
    _assert_grads_match(fused, ref)
    assert op_calls[0][arg] == list(kw.values())[-1]


def test_supported_and_unsupported_classes():
    import transformers

    for n in ["LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "Qwen2ForCausalLM",
              "Qwen2MoeForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "DeepseekV2ForCausalLM",
              "DeepseekV3ForCausalLM"]:
        ok, why = lce.causal_lm_support(getattr(transformers, n))
        assert ok, (n, why)
    ok, why = lce.causal_lm_support(transformers.CohereForCausalLM)  # logits * self.logit_scale: a temperature
    assert ok, why
    ok, why = lce.causal_lm_support(transformers.T5ForConditionalGeneration)  # its own CrossEntropyLoss
    assert not ok and "computes its loss itself" in why
    ok, why = lce.causal_lm_support(transformers.LlamaModel)
    assert not ok


def test_unsupported_model_not_patched():
    import transformers

    # a negative logit scale is no temperature: checked per instance, before anything is patched
    cfg = transformers.CohereConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=V, logit_scale=-0.0625)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    fwd = type(model).forward
    rep = get_feature("linear_cross_entropy").apply(model, None, _cfg())
    assert not rep.applied and "CohereForCausalLM" in rep.reason and "not a positive temperature" in rep.reason
    assert type(model).forward is fwd and not lce.is_patched(model)


class _ScaledHead(torch.nn.Linear):
    """An nn.Linear whose class has its own forward: a learned per-token logit scale after the GEMM
    (as transformers' DoryLMHead)."""

    def __init__(self, hidden, vocab):
        super().__init__(hidden, vocab, bias=False)
        self.logit_scale = torch.nn.Parameter(torch.rand(vocab) + 0.5)

    def forward(self, x):
        return super().forward(x).float() * self.logit_scale


def test_linear_head_with_its_own_forward_is_not_fused(op_calls):
    """The op computes x @ W.T + b only: a head subclass that does more keeps the eager loss
    (fusing it would drop the scale from the loss and its gradient)."""
    b = _batch(10)
    ref, fused = _pair("llama-tiny")
    for m in (ref, fused):
        torch.manual_seed(1)
        m.lm_head = _ScaledHead(m.config.hidden_size, m.config.vocab_size)
    rep = get_feature("linear_cross_entropy").apply(fused, None, _cfg())
    assert not rep.applied and "_ScaledHead" in rep.reason and "own forward" in rep.reason
    assert not lce.is_patched(fused)
    out_r, out_f = ref(**b), fused(**b)
    assert out_f.logits is not None and op_calls == []
    torch.testing.assert_close(out_f.loss, out_r.loss)


# ---------------------------------------------------------------------------------------------
# The ForCausalLMLoss contract.


def _check_same(ref, fused, kwargs, op_calls=None, grads=True):
    out_r, out_f = ref(**kwargs), fused(**kwargs)
    assert out_f.logits is None
    torch.testing.assert_close(out_f.loss, out_r.loss, rtol=1e-5, atol=1e-7)
    if grads:
        out_r.loss.backward()
        out_f.loss.backward()
        _assert_grads_match(fused, ref)
        ref.zero_grad(), fused.zero_grad()
    return out_r, out_f


def test_shift_labels_used_as_given(op_calls):
    ref, fused = _pair("llama-tiny")
    _apply(fused)
    b = _batch(1)
    g = torch.Generator().manual_seed(11)
    shift = torch.randint(0, V, b["labels"].shape, generator=g)
    shift[:, -2:] = -100
    _check_same(ref, fused, {**b, "shift_labels": shift})
    assert torch.equal(op_calls[-1]["target"], shift.reshape(-1))  # no second shift
    fused(**b)  # without shift_labels: labels padded with ignore_index and shifted left
    want = torch.cat([b["labels"][:, 1:], torch.full((2, 1), -100)], 1).reshape(-1)
    assert torch.equal(op_calls[-1]["target"], want)


@pytest.mark.parametrize("kind", ["int", "tensor"])
def test_num_items_in_batch(kind, op_calls):
    ref, fused = _pair("qwen3-moe-tiny")
    _apply(fused)
    b = _batch(2)
    n = 37 if kind == "int" else torch.tensor(37)
    _check_same(ref, fused, {**b, "num_items_in_batch": n})
    assert op_calls[-1]["reduction"] == "sum"


def test_ignore_index_from_call_and_config(op_calls):
    ref, fused = _pair("llama-tiny")
    _apply(fused, ignore_index=-1)
    b = _batch(4)
    labels = b["labels"].masked_fill(b["labels"] == -100, -1)
    # the model is called with ignore_index (as ForCausalLMLoss takes it); and the config default
    _check_same(ref, fused, {**b, "labels": labels, "ignore_index": -1})
    assert op_calls[-1]["ignore_index"] == -1
    out_f = fused(**{**b, "labels": labels})
    out_r = ref(**{**b, "labels": labels, "ignore_index": -1})
    torch.testing.assert_close(out_f.loss, out_r.loss, rtol=1e-5, atol=0)


def test_logits_to_keep(op_calls):
    from transformers import modeling_utils

    ref, fused = _pair("llama-tiny")
    _apply(fused)
    b = _batch(6)
    k = 5
    # an int: the last k positions (labels given for them)
    _check_same(ref, fused, {**b, "labels": b["labels"][:, -k:], "logits_to_keep": k})
    assert op_calls[-1] is not None and len(op_calls) == 1
    # a 1-D tensor of positions
    pos = torch.tensor([1, 4, 9, 15])
    _check_same(ref, fused, {**b, "labels": b["labels"][:, pos], "logits_to_keep": pos})
    # labels that do not cover the kept positions: a clear error
    with pytest.raises(ValueError, match="logits_to_keep"):
        fused(**b, logits_to_keep=k)
    if hasattr(modeling_utils, "slice_logits_to_keep"):  # transformers >= 5.2x: 2-D forms
        mask = torch.zeros_like(b["labels"], dtype=torch.bool)
        mask[0, 3:9] = True
        mask[1, 10:] = True
        shift = torch.randint(0, V, (int(mask.sum()),))
        _check_same(ref, fused, {**b, "logits_to_keep": mask, "shift_labels": shift})
        idx = torch.tensor([[0, 2, 5], [7, 8, 15]])
        _check_same(ref, fused, {**b, "labels": torch.gather(b["labels"], 1, idx), "logits_to_keep": idx})


def test_return_dict_false(op_calls):
    ref, fused = _pair("qwen3-moe-tiny")
    _apply(fused)
    b = _batch(8)
    t_r, t_f = ref(**b, return_dict=False, use_cache=False), fused(**b, return_dict=False, use_cache=False)
    # (loss, aux_loss, logits, router_logits) as eager's, the logits' slot None (never formed)
    assert isinstance(t_f, tuple) and len(t_f) == len(t_r) and t_f[2] is None
    torch.testing.assert_close(t_f[0], t_r[0], rtol=1e-5, atol=0)
    torch.testing.assert_close(t_f[1], t_r[1])
    t_f[0].backward()
    t_r[0].backward()
    _assert_grads_match(fused, ref)


def test_eval_generation_and_no_labels_are_unchanged(op_calls):
    ref, fused = _pair("llama-tiny")
    _apply(fused)
    b = _batch(9)
    no_labels = {k: v for k, v in b.items() if k != "labels"}
    with pytest.warns(RuntimeWarning, match="without labels"):  # training, no labels: said once
        torch.testing.assert_close(fused(**no_labels).logits, ref(**no_labels).logits)
    ref.eval(), fused.eval()
    out_r, out_f = ref(**b), fused(**b)  # eval with labels: real logits and the HF loss
    torch.testing.assert_close(out_f.logits, out_r.logits)
    torch.testing.assert_close(out_f.loss, out_r.loss)
    gen_r = ref.generate(b["input_ids"][:1, :6], max_new_tokens=4, do_sample=False)
    gen_f = fused.generate(b["input_ids"][:1, :6], max_new_tokens=4, do_sample=False)
    assert torch.equal(gen_r, gen_f)
    assert op_calls == []
    fused.train()
    assert fused(**b).logits is None and len(op_calls) == 1


def test_training_without_labels_warns_once_per_model(op_calls):
    import warnings

    _, fused = _pair("llama-tiny")
    rep = _apply(fused)
    other = build_model("llama-tiny").train()
    _apply(other)
    ids = _batch(11)["input_ids"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert fused(input_ids=ids).logits is not None
        fused(input_ids=ids, return_dict=False)
        other(input_ids=ids)
    msgs = [str(w.message) for w in caught if "without labels" in str(w.message)]
    assert len(msgs) == 2, msgs  # one per model
    msg = msgs[0]
    assert msg.startswith("deepspeed_fused.linear_cross_entropy: LlamaForCausalLM ran in training mode without "
                          "labels, so the fused loss did not run")
    assert "(2x16x257 float32, 0.0314 MiB per forward" in msg and "Pass labels=" in msg
    assert "logits are None" in msg and "Trainer's label_smoothing_factor" not in msg
    assert (rep.calls.fused, rep.calls.eager) == (0, 4) and op_calls == []
    fused(**_batch(11))
    assert (rep.calls.fused, rep.calls.eager) == (1, 4) and len(op_calls) == 1


def test_report_says_training_outputs_have_no_logits():
    _, fused = _pair("llama-tiny")
    rep = _apply(fused)
    assert "training forwards with labels return logits=None" in rep.reason


class _Lora(torch.nn.Module):
    """The shape of peft's LoRA layer (peft.tuners.lora.layer.Linear): a base nn.Linear and adapters."""

    def __init__(self, base, r=4):
        super().__init__()
        self.base_layer = base
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(base.in_features, r, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(r, base.out_features, bias=False)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


_Lora.__name__ = _Lora.__qualname__ = "Linear"
_Lora.__module__ = "peft.tuners.lora.layer"


def test_lora_head_reason_names_peft():
    _, model = _pair("llama-tiny")
    model.lm_head = _Lora(model.lm_head)
    rep = get_feature("linear_cross_entropy").apply(model, None, _cfg())
    assert not rep.applied and "lm_head is peft's LoRA layer peft.tuners.lora.layer.Linear around nn.Linear" \
        in rep.reason, rep.reason
    assert "target_modules" in rep.reason


def test_lora_head_reason_names_peft_with_peft():
    peft = pytest.importorskip("peft")
    _, model = _pair("llama-tiny")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["lm_head", "q_proj"]))
    rep = get_feature("linear_cross_entropy").apply(model, None, _cfg())
    assert not rep.applied and "lm_head is peft's LoRA layer peft.tuners.lora" in rep.reason, rep.reason


def test_user_loss_function_is_not_fused(op_calls):
    from transformers.loss.loss_utils import ForCausalLMLoss

    def my_loss(logits, labels, vocab_size, **kw):
        return 2.0 * ForCausalLMLoss(logits, labels, vocab_size, **kw)

    b = _batch(10)
    # set before apply: skipped and reported
    ref, fused = _pair("llama-tiny")
    fused.loss_function = my_loss
    rep = get_feature("linear_cross_entropy").apply(fused, None, _cfg())
    assert not rep.applied and "loss_function" in rep.reason and not lce.is_patched(fused)
    # set after apply: falls through to the original forward with a warning
    ref, fused = _pair("llama-tiny")
    _apply(fused)
    fused.loss_function = my_loss
    with pytest.warns(RuntimeWarning, match="loss_function"):
        out = fused(**b)
    assert out.logits is not None and op_calls == []
    torch.testing.assert_close(out.loss, 2.0 * ref(**b).loss)
    del fused._loss_function  # back to transformers' loss: fused again
    assert fused(**b).logits is None and len(op_calls) == 1


def test_revert_restores_and_patch_is_per_instance(op_calls):
    from transformers import LlamaForCausalLM

    orig = LlamaForCausalLM.forward
    a, b_model = _pair("llama-tiny")
    feat = get_feature("linear_cross_entropy")
    _apply(a)
    assert LlamaForCausalLM.forward is not orig and lce.is_patched(a) and not lce.is_patched(b_model)
    b = _batch(12)
    assert b_model(**b).logits is not None and op_calls == []  # another instance of the class: untouched
    rep = feat.apply(a, None, _cfg())  # applying twice does not patch twice
    assert rep.details["patched"] == {"LlamaForCausalLM": 1} and rep.details["modules"] == []
    assert feat.revert(a) == 1
    assert LlamaForCausalLM.forward is orig and not lce.is_patched(a)
    out = a(**b)
    assert out.logits is not None and op_calls == []
    assert feat.revert(a) == 0


def test_through_patch_model(op_calls):
    from deepspeed_fused import patch_model, unpatch_model

    ref, fused = _pair("qwen3-tiny")
    report = patch_model(fused, {"deepspeed_fused": {"linear_cross_entropy": {"enabled": True, "z_loss": 0.0}}})
    rep = report["linear_cross_entropy"]
    assert rep.applied and rep.where == "1 x Qwen3ForCausalLM"
    _check_same(ref, fused, _batch(16), grads=False)
    assert unpatch_model(fused) == {"linear_cross_entropy": 1}
    assert not lce.is_patched(fused) and fused(**_batch(16)).logits is not None


def test_nested_causal_lm_is_found(op_calls):
    class Wrapper(torch.nn.Module):
        def __init__(self, lm):
            super().__init__()
            self.lm = lm

        def forward(self, **kw):
            return self.lm(**kw)

    ref, fused = _pair("llama-tiny")
    w = Wrapper(fused)
    rep = _apply(w)
    assert rep.details["modules"] == ["lm"]
    b = _batch(13)
    out_r, out_f = ref(**b), w(**b)
    assert out_f.logits is None
    torch.testing.assert_close(out_f.loss, out_r.loss, rtol=1e-5, atol=0)


def test_config_options_reach_op(op_calls):
    import torch.nn.functional as F

    ref, fused = _pair("llama-tiny")
    _apply(fused, chunk_tokens=8, accum_dtype="fp32", z_loss=1e-3, label_smoothing=0.1, validate_targets=False)
    b = _batch(14)
    out_f = fused(**b)
    kw = op_calls[-1]
    assert kw["chunk_tokens"] == 8 and kw["accum_dtype"] is torch.float32 and kw["validate_targets"] is False
    # the loss the options ask for, from the unpatched model's logits
    logits = ref(**b).logits[:, :-1].reshape(-1, V).float()
    tgt = b["labels"][:, 1:].reshape(-1)
    valid = tgt != -100
    lse = torch.logsumexp(logits, -1)
    want = F.cross_entropy(logits, tgt, label_smoothing=0.1) + 1e-3 * (lse[valid] ** 2).mean()
    torch.testing.assert_close(out_f.loss, want, rtol=1e-5, atol=0)
    fused_defaults = copy.deepcopy(ref)
    _apply(fused_defaults)
    fused_defaults(**b)
    kw = op_calls[-1]
    assert kw["chunk_tokens"] is None and kw["accum_dtype"] is None and kw["validate_targets"] is True
    assert kw["z_loss"] == 0.0 and kw["label_smoothing"] == 0.0


def test_bad_targets_raise():
    _, fused = _pair("llama-tiny")
    _apply(fused)
    b = _batch(15)
    b["labels"][0, 5] = V + 3
    with pytest.raises(ValueError):
        fused(**b)


@pytest.mark.parametrize("key,value", [
    ("chunk_tokens", 0), ("chunk_tokens", "big"), ("chunk_tokens", True), ("accum_dtype", "bf16"),
    ("z_loss", -1.0), ("z_loss", "0.1"), ("label_smoothing", 1.0), ("validate_targets", "yes"),
    ("ignore_index", 1.5), ("enabeld", True),
])
def test_bad_config_values_raise_with_key_path(key, value):
    with pytest.raises(ConfigError, match=rf"deepspeed_fused\.linear_cross_entropy\.{key}"):
        parse_config({"deepspeed_fused": {"linear_cross_entropy": {"enabled": True, key: value}}})


def test_config_defaults_and_docs():
    from deepspeed_fused.docs import config_reference

    c = _cfg()
    assert (c.ignore_index, c.chunk_tokens, c.accum_dtype, c.z_loss, c.label_smoothing, c.validate_targets) == \
        (-100, "auto", "auto", 0.0, 0.0, True)
    assert _cfg(z_loss=0).z_loss == 0.0 and _cfg(chunk_tokens=4096).chunk_tokens == 4096
    rows = {r["key"]: r for r in config_reference() if ".linear_cross_entropy." in r["key"]}
    for k in ["enabled", "ignore_index", "chunk_tokens", "accum_dtype", "z_loss", "label_smoothing",
              "validate_targets"]:
        assert rows[f"deepspeed_fused.linear_cross_entropy.{k}"]["doc"], k


# ---------------------------------------------------------------------------------------------
# Through deepspeed.initialize: ZeRO 0, 2, 3 on two forked CPU ranks.


def _ds_run(name, stage, fused, steps=3):
    import deepspeed
    import deepspeed.comm as dist

    torch.set_num_threads(1)
    model = build_model(name, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
                 "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    if fused:
        rep = get_feature("linear_cross_entropy").apply(engine.module, engine, _cfg())
        assert rep.applied, rep.reason
    if stage == 3:
        assert hasattr(engine.module.lm_head.weight, "ds_status")
        assert engine.module.lm_head.weight.numel() == 0  # partitioned outside forward
    engine.train()
    losses = []
    for step in range(steps):
        batch = {k: v.to(engine.device) for k, v in _batch(100 * step + dist.get_rank()).items()}
        out = engine(**batch)
        assert (out.logits is None) == fused
        losses.append(out.loss.detach().clone())
        engine.backward(out.loss)
        engine.step()
    if fused:
        assert lce.fused_state(engine.module).fused_calls == steps
    if stage == 3:
        # lm_head's own ZeRO-3 hooks gathered its weight: DeepSpeed did not have to fall back to
        # registering it as a dangling (external) parameter of an enclosing module.
        ext = [p for m in engine.module.modules() for p in getattr(m, "_external_params", {}).values()]
        assert not any(p is engine.module.lm_head.weight for p in ext)
    params = {}
    for n, p in engine.module.named_parameters():
        if stage == 3:
            with deepspeed.zero.GatheredParameters([p]):
                params[n] = p.detach().float().cpu().clone()
        else:
            params[n] = p.detach().float().cpu().clone()
    if fused:
        get_feature("linear_cross_entropy").revert(engine.module)
    return torch.stack(losses).float().cpu(), params


class TestDeepSpeedZero(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("stage,name", [(0, "llama-tiny"), (2, "qwen3-moe-tiny"), (3, "llama-tiny"),
                                            (3, "llama-tied-tiny")])
    def test_matches_unpatched(self, stage, name):
        check_ds_matches_unpatched(name, stage, tol=1e-4 if torch.cuda.is_available() else 1e-5)


def check_ds_matches_unpatched(name, stage, tol=1e-5):
    """Three ZeRO steps with and without the feature: same losses, same parameters after."""
    ref_losses, ref_params = _ds_run(name, stage, fused=False)
    losses, params = _ds_run(name, stage, fused=True)
    torch.testing.assert_close(losses, ref_losses, rtol=tol, atol=0)
    assert ref_losses[0] != ref_losses[-1]
    for n, p in params.items():
        assert p.numel() > 0 and _relerr(p, ref_params[n]) <= tol, (n, _relerr(p, ref_params[n]))


# ---------------------------------------------------------------------------------------------
# The edge cases of eager's contract.


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-moe-tiny"])
def test_every_label_ignored_gives_nan_like_eager(name, op_calls):
    """Eager's mean over no labelled token is NaN (0/0) with zero gradients; so is the fused loss."""
    ref, fused = _pair(name)
    _apply(fused)
    b = _batch(21)
    b["labels"] = torch.full_like(b["labels"], -100)
    out_r, out_f = ref(**b), fused(**b)
    assert out_f.logits is None and len(op_calls) == 1
    assert torch.isnan(out_r.loss) and torch.isnan(out_f.loss)
    out_r.loss.backward()
    out_f.loss.backward()
    for (n, p), q in zip(fused.named_parameters(), ref.parameters()):
        gp = torch.zeros_like(p) if p.grad is None else p.grad
        gq = torch.zeros_like(q) if q.grad is None else q.grad
        assert torch.equal(torch.isnan(gp), torch.isnan(gq)), n
        torch.testing.assert_close(gp.nan_to_num(), gq.nan_to_num(), msg=n)
    # one labelled token is enough for a finite loss again
    b["labels"][0, 5] = 3
    _check_same(ref, fused, b)


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-moe-tiny"])
def test_return_dict_false_keeps_the_tuple_positions(name, op_calls):
    ref, fused = _pair(name)
    _apply(fused)
    b = _batch(22)
    out_r = ref(**b, return_dict=False)
    out_f = fused(**b, return_dict=False)
    assert isinstance(out_f, tuple) and len(out_f) == len(out_r) and len(op_calls) == 1
    logits_at = 2 if name == "qwen3-moe-tiny" else 1  # (loss, aux_loss, logits, ...) for MoE outputs
    assert out_f[logits_at] is None and out_r[logits_at].shape[-1] == V
    for i, (a, r) in enumerate(zip(out_f, out_r)):
        if i != logits_at:
            assert type(a) is type(r), (i, type(a), type(r))
    torch.testing.assert_close(out_f[0], out_r[0], rtol=1e-5, atol=1e-7)
    if name == "qwen3-moe-tiny":
        torch.testing.assert_close(out_f[1], out_r[1])  # aux_loss in its slot
