"""The "linear_cross_entropy" feature across head patterns: every family whose head is a
vocabulary projection followed by transformers' ForCausalLMLoss (vision-language models, heads
not named *ForCausalLM, scalar logit scales, final soft caps, heads under other names) trains
through the op with the unpatched model's loss (1e-5 relative) and gradients (1e-3 relative to
each gradient's norm, fp32); families that cannot be fused are refused with the reason.
(CPU: the op's torch reference.)"""
import copy
import math
import textwrap
import warnings

import pytest
import torch

import deepspeed_fused.ops.linear_cross_entropy as lce_op
from deepspeed_fused.config import parse_config
from deepspeed_fused.features import linear_cross_entropy as lce
from deepspeed_fused.features.linear_cross_entropy import recognition as lce_recognition
from deepspeed_fused.features.registry import get_feature
from lce_families import FAMILIES, V, image_batch, text_batch
from unit.common import DistributedTest

import transformers  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedModel  # noqa: E402
from transformers.modeling_outputs import CausalLMOutputWithPast  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _clean_classes():
    yield
    for cls in list(lce._PATCHED_CLASSES):
        lce._unpatch_class(cls)


@pytest.fixture
def op_calls(monkeypatch):
    calls = []
    real = lce_op.linear_cross_entropy

    def spy(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(lce_op, "linear_cross_entropy", spy)
    return calls


def _cfg(**kw):
    return getattr(parse_config({"linear_cross_entropy": {"enabled": True, **kw}}), "linear_cross_entropy")


def _apply(model, **kw):
    return get_feature("linear_cross_entropy").apply(model, None, _cfg(**kw))


def _run(model, batch, **kw):
    torch.manual_seed(1234)  # the same dropout masks in both models
    return model(**batch, **kw)


def _assert_grads_match(fused, ref, tol=1e-3):
    """Every gradient within ``tol`` of the unpatched model's, relative to its norm. A gradient
    that is zero in exact arithmetic (an attention key bias: softmax ignores a shift) is rounding
    noise in both runs; it is held to ``tol`` of 1e-6 of the whole gradient's norm instead."""
    ref_params = dict(ref.named_parameters())
    total = math.sqrt(sum(q.grad.double().norm().item() ** 2 for q in ref.parameters() if q.grad is not None))
    n = 0
    for name, p in fused.named_parameters():
        q = ref_params[name]
        if q.grad is None:
            assert p.grad is None or p.grad.abs().max() == 0, name
            continue
        assert p.grad is not None, f"{name}: no gradient on the fused model"
        err = (p.grad.double() - q.grad.double()).norm().item() / max(q.grad.double().norm().item(), 1e-6 * total)
        assert err <= tol, f"{name}: gradient error {err:.2e} relative to its norm"
        n += 1
    return n


def _check_family(ref, batch, op_calls, want=None):
    fused = copy.deepcopy(ref)
    ref.train(), fused.train()
    rep = _apply(fused)
    cls = type(fused).__name__
    assert rep.applied, rep.reason
    assert rep.details["patched"] == {cls: 1} and cls in rep.where
    out_r, out_f = _run(ref, batch), _run(fused, batch)
    assert type(out_f) is type(out_r)
    assert out_f.logits is None and out_r.logits is not None
    rel = abs(out_f.loss.item() - out_r.loss.item()) / abs(out_r.loss.item())
    assert rel <= 1e-5, f"loss relative error {rel:.2e}"
    out_r.loss.backward()
    out_f.loss.backward()
    n = _assert_grads_match(fused, ref)
    assert len(op_calls) == 1 and lce.fused_state(fused).fused_calls == 1
    want = {"temperature": 1.0, "softcap": None, **(want or {})}
    for k, v in want.items():
        got = op_calls[0][k]
        assert (got is None and v is None) or got == pytest.approx(v, rel=1e-12), (k, got, v)
    return fused, n


# ---------------------------------------------------------------------------------------------
# Families whose head is a vocabulary projection into ForCausalLMLoss: fused, same training.


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_matches_unpatched(name, op_calls):
    build, want = FAMILIES[name]
    _check_family(build(), text_batch(3), op_calls, want)


@pytest.mark.parametrize("name", ["llava", "qwen2.5-vl"])
def test_vlm_with_an_image_matches_unpatched(name, op_calls):
    """With an image the vision tower and projector take gradients through the fused loss too."""
    build, want = FAMILIES[name]
    ref = build()
    fused, n = _check_family(ref, image_batch(name, 4), op_calls, want)
    vision = [n_ for n_, p in fused.named_parameters() if ("visual" in n_ or "vision" in n_ or "projector" in n_)
              and p.grad is not None and p.grad.abs().max() > 0]
    assert len(vision) >= 4, vision  # (checked against the unpatched gradients above)


@pytest.mark.parametrize("name", ["bloom", "mamba"])
def test_tuple_branch_is_not_taken(name, op_calls):
    """`if not return_dict: output = (logits,) + ...` reads the logits after the loss; the fused
    forward asks for a ModelOutput, and a caller's return_dict=False gets the tuple with the
    logits' slot None."""
    build, _ = FAMILIES[name]
    ref = build().train()
    fused = copy.deepcopy(ref)
    assert _apply(fused).applied
    b = text_batch(5)
    t_r, t_f = _run(ref, b, return_dict=False), _run(fused, b, return_dict=False)
    assert isinstance(t_f, tuple) and t_f[1] is None and t_r[1].shape[-1] == V
    torch.testing.assert_close(t_f[0], t_r[0], rtol=1e-5, atol=0)
    assert len(op_calls) == 1


def test_scalars_are_read_per_call(op_calls):
    """Cohere's `self.logit_scale` changed after patching: the op's temperature follows it."""
    build, _ = FAMILIES["cohere"]
    ref = build().train()
    fused = copy.deepcopy(ref)
    assert _apply(fused).applied
    ref.logit_scale = fused.logit_scale = 0.125
    b = text_batch(6)
    out_r, out_f = _run(ref, b), _run(fused, b)
    torch.testing.assert_close(out_f.loss, out_r.loss, rtol=1e-5, atol=0)
    assert op_calls[-1]["temperature"] == 8.0


def test_gemma_generations():
    """Every Gemma causal LM soft-caps with config.final_logit_softcapping (the op's softcap);
    the multimodal Gemma 3 forward applies none, Gemma 3n's and PaliGemma's do."""
    for n in ["Gemma2ForCausalLM", "Gemma3ForCausalLM", "Gemma3nForCausalLM", "Gemma3nForConditionalGeneration",
              "PaliGemmaForConditionalGeneration", "RecurrentGemmaForCausalLM", "VaultGemmaForCausalLM"]:
        spec, why = lce._analyze(getattr(transformers, n))
        assert spec is not None, (n, why)
        assert [op for _, op, _ in spec.steps] == ["div", "tanh", "mul"], n
    for n in ["GemmaForCausalLM", "Gemma3ForConditionalGeneration"]:
        spec, why = lce._analyze(getattr(transformers, n))
        assert spec is not None and spec.steps == (), (n, why)


# ---------------------------------------------------------------------------------------------
# Refused, with the reason.


@pytest.mark.parametrize("cls_name,reason", [
    ("T5ForConditionalGeneration", "forward computes its loss itself (`CrossEntropyLoss(ignore_index=-100)`)"),
    ("BartForConditionalGeneration", "forward computes its loss itself (`CrossEntropyLoss()`)"),
    ("WhisperForConditionalGeneration", "forward computes its loss itself"),
    ("Qwen2AudioForConditionalGeneration", "forward computes its loss itself (`nn.CrossEntropyLoss()`)"),
    ("ChameleonForConditionalGeneration",
     "forward changes the logits before the loss: `logits[:, :, image_tokens] = torch.finfo(logits.dtype).min`"),
    ("GitForCausalLM", "`shifted_logits = logits[:, num_image_tokens:-1, :].contiguous()`"),
    ("Blip2ForConditionalGeneration", "`logits = outputs[0]`"),
    ("CsmDepthDecoderForCausalLM", "self.codebooks_head(hidden_states[:, slice_indices, :]"),
    ("xLSTMForCausalLM", "forward changes the logits before the loss: `with torch.no_grad():`"),
    ("LlamaModel", "forward does not call self.loss_function"),
])
def test_refused_classes_name_the_reason(cls_name, reason):
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        pytest.skip(f"{cls_name} is not in this transformers")
    ok, why = lce.causal_lm_support(cls)
    assert not ok and reason in why, why


def test_head_that_is_not_a_projection_is_refused():
    """BERT's LM head transforms the hidden states (dense, activation, LayerNorm) before its
    decoder: self.cls is not a vocabulary projection."""
    cfg = transformers.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=64, is_decoder=True)
    model = transformers.BertLMHeadModel(cfg)
    fwd = type(model).forward
    rep = _apply(model)
    assert not rep.applied and "BertLMHeadModel: self.cls is BertOnlyMLMHead, not nn.Linear" in rep.reason
    assert type(model).forward is fwd and not lce.is_patched(model)


def test_linear_subclass_with_its_own_forward_is_refused():
    """An nn.Linear subclass that computes something else (a quantized layer, say) is no plain
    projection: the op would read its weight as one."""
    class Scaled(torch.nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    build, _ = FAMILIES["gpt2"]
    model = build().train()
    old = model.lm_head
    model.lm_head = Scaled(old.in_features, old.out_features, bias=False)
    rep = _apply(model)
    assert not rep.applied and "self.lm_head is Scaled, an nn.Linear with its own forward" in rep.reason


def test_seq2seq_with_its_own_loss_is_reported():
    cfg = transformers.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=64, num_layers=1, num_heads=4)
    model = transformers.T5ForConditionalGeneration(cfg)
    rep = _apply(model)
    assert not rep.applied and rep.reason.startswith("no supported language-model head found; "
                                                     "T5ForConditionalGeneration: forward computes its loss itself")


def test_logits_needed_after_the_loss_refuse_only_when_that_code_runs(op_calls):
    """Bamba adds a z-loss from the logits when config z_loss_coefficient > 0: refused then
    (with the statement), fused at 0; switched on after patching, the call runs eager (warned)."""
    build, _ = FAMILIES["bamba"]
    model = build(z_loss_coefficient=0.1).train()
    rep = _apply(model)
    assert not rep.applied
    assert "forward uses `logits` after the loss other than in its output: `z_loss = logits.logsumexp" in rep.reason
    assert "(`self.z_loss_coefficient > 0` holds)" in rep.reason
    ref = build().train()
    fused = copy.deepcopy(ref)
    assert _apply(fused).applied
    ref.z_loss_coefficient = fused.z_loss_coefficient = 0.1
    b = text_batch(7)
    with pytest.warns(RuntimeWarning, match="z_loss_coefficient"):
        out_f = _run(fused, b)
    out_r = _run(ref, b)
    assert out_f.logits is not None and op_calls == []
    torch.testing.assert_close(out_f.loss, out_r.loss)


def test_negative_scale_is_refused():
    build, _ = FAMILIES["cohere"]
    model = build(logit_scale=-0.5).train()
    rep = _apply(model)
    assert not rep.applied and "is not a positive temperature" in rep.reason


# ---------------------------------------------------------------------------------------------
# The reading of forwards, on synthetic ones (subclasses of a tiny Llama with their own forward).


def _tiny_llama_cfg(**kw):
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, max_position_embeddings=64, **kw)
    cfg._attn_implementation = "eager"
    return cfg


class _Scaled(LlamaForCausalLM):
    """A multiplier, then a soft cap written as three statements, under a walrus condition."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden_states) * self.config.output_multiplier
        if (cap := getattr(self.config, "final_cap", None)) is not None:
            logits = logits / cap
            logits = torch.tanh(logits)
            logits = logits * cap
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


class _OddCap(LlamaForCausalLM):
    """A tanh whose outer and inner scales differ: 2 * tanh(z / 3) / 0.5, in place."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        hidden_states = self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        logits = self.lm_head(hidden_states).float()
        logits = torch.tanh(logits / 3.0) * 2.0
        logits /= 0.5
        loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits)


@pytest.mark.parametrize("cls,cfg_kw,want", [
    (_Scaled, dict(output_multiplier=0.5, final_cap=2.0), {"temperature": 2.0, "softcap": 2.0}),
    (_Scaled, dict(output_multiplier=4.0), {"temperature": 0.25}),  # the condition is false: no cap
    (_OddCap, {}, {"temperature": 0.75, "softcap": 4.0}),  # 4 tanh(z / 3) = 4 tanh((z / 0.75) / 4)
])
def test_composed_transformations(cls, cfg_kw, want, op_calls):
    torch.manual_seed(0)
    ref = cls(_tiny_llama_cfg(**cfg_kw))
    _check_family(ref, text_batch(8), op_calls, want)


class _Wrapper(PreTrainedModel):
    """Llama 4's multimodal pattern: the logits are those of a causal LM called without labels."""

    config_class = LlamaConfig

    def __init__(self, config):
        super().__init__(config)
        self.language_model = LlamaForCausalLM(config)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, labels=None, logits_to_keep=0, **kwargs):
        outputs = self.language_model(input_ids=input_ids, attention_mask=attention_mask,
                                      logits_to_keep=logits_to_keep, **kwargs)
        logits = outputs[0]
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, hidden_states=outputs.hidden_states)


def test_logits_of_an_inner_model(op_calls):
    torch.manual_seed(0)
    ref = _Wrapper(_tiny_llama_cfg())
    spec, why = lce._analyze(_Wrapper)
    assert spec is not None and spec.via == "language_model", why
    fused = copy.deepcopy(ref)
    ref.train(), fused.train()
    rep = _apply(fused)
    assert rep.details["patched"] == {"_Wrapper": 1, "LlamaForCausalLM": 1}  # the inner one on its own too
    b = text_batch(9)
    out_r = _run(ref, b)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # the inner model's no-label call is part of the fused one
        warnings.filterwarnings("ignore", message=".*running the torch reference.*")
        out_f = _run(fused, b)
    assert out_f.logits is None
    inner = lce.fused_state(fused.language_model)
    # one counter per apply: one fused forward, and the inner model's call not counted as eager
    assert (inner.calls.fused, inner.calls.eager) == (1, 0) and not inner.warned_no_labels
    torch.testing.assert_close(out_f.loss, out_r.loss, rtol=1e-5, atol=0)
    out_r.loss.backward()
    out_f.loss.backward()
    _assert_grads_match(fused, ref)
    assert len(op_calls) == 1 and lce.fused_state(fused).fused_calls == 1
    assert "lm_head" not in fused.language_model.__dict__  # the capture is gone


def _read(src):
    import ast

    return lce_recognition.read_forward(ast.parse(textwrap.dedent(src)).body[0])


@pytest.mark.parametrize("body,reason", [
    ("logits = self.lm_head(h)\nextra = logits.mean()\nloss = self.loss_function(logits, labels, 7)\n"
     "return Out(loss=loss + extra, logits=logits)", "forward reads the logits before the loss: `extra = "),
    ("logits = self.lm_head(h)\nloss = self.loss_function(logits, labels, 7)\nloss = loss + logits.mean()\n"
     "return Out(loss=loss, logits=logits)", "forward uses `logits` after the loss other than in its output"),
    ("logits = self.lm_head(h)\nlogits = logits / temperature\nloss = self.loss_function(logits, labels, 7)\n"
     "return Out(loss=loss, logits=logits)", "`logits = logits / temperature`"),  # a forward argument
    ("logits = self.lm_head(h)\nif temperature is not None:\n    logits = logits / self.config.t\n"
     "loss = self.loss_function(logits, labels, 7)\nreturn Out(loss=loss, logits=logits)",
     "under a condition read from `temperature`, not from the model"),
    ("logits = self.lm_head(h)\nlogits = torch.tanh(torch.tanh(logits))\nloss = self.loss_function(logits, labels, 7)\n"
     "return Out(loss=loss, logits=logits)", "tanh to the logits more than once"),
    ("if labels is None:\n    logits = self.lm_head(h)\nloss = self.loss_function(logits, labels, 7)\n"
     "return Out(loss=loss, logits=logits)", "self.lm_head is called under a condition"),
    ("logits = self.lm_head(h)\nloss = self.loss_function(logits, labels, logits.shape[-1])\n"
     "return Out(loss=loss, logits=logits)", "the loss call reads the logits beyond passing them (`logits.shape[-1]`)"),
    ("logits = self.lm_head(h)\nlogits2 = self.lm_head(h)\nloss = self.loss_function(logits, labels, 7)\n"
     "return Out(loss=loss, logits=logits)", "forward calls self.lm_head more than once"),
    ("logits = self.lm_head(h)\nout = Out(loss=None, logits=logits)\nloss = self.loss_function(logits, labels, 7)\n"
     "return out", "forward reads the logits before the loss: `out = Out(loss=None, logits=logits)`"),
])
def test_refused_forward_patterns(body, reason):
    src = "def forward(self, h, labels=None, temperature=None):\n" + textwrap.indent(body, "    ")
    spec, why = _read(src)
    assert spec is None and reason in why, why


def test_accepted_forward_patterns():
    src = """
    def forward(self, h, labels=None, return_dict=None):
        cfg = self.get_decoder().config
        logits = self.lm_head(h.to(self.lm_head.weight.dtype)).float().contiguous()
        logits = self.config.get_text_config().mult * logits
        if cfg.cap is not None and self.use_cap:
            logits = cfg.cap * torch.tanh(logits / cfg.cap)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.lm_head.out_features)
        if not return_dict:
            return (loss, logits)
        if self.config.z > 0:
            loss = loss + logits.sum()
        return Out(loss=loss, logits=logits)
    """
    spec, why = _read(src)
    assert spec is not None, why
    assert spec.head == "lm_head" and [op for _, op, _ in spec.steps] == ["mul", "div", "tanh", "mul"]
    assert len(spec.blockers) == 1  # `if not return_dict:` never runs on the fused path: not a blocker

    class Cfg:
        def __init__(self, **kw):
            self.__dict__.update(kw)

        def get_text_config(self):
            return self

    class M:
        def __init__(self, cap, use_cap=True, z=0):
            self.config = Cfg(mult=0.5, z=z)
            self.use_cap = use_cap
            self._cap = cap

        def get_decoder(self):
            return type("D", (), {"config": Cfg(cap=self._cap)})()

    chain = ((spec, M(3.0)),)
    assert lce_recognition.logit_transform(chain) == (2.0, 3.0) and lce_recognition.blocked(chain) == ""
    assert lce_recognition.logit_transform(((spec, M(None)),)) == (2.0, None)
    assert lce_recognition.logit_transform(((spec, M(3.0, use_cap=False)),)) == (2.0, None)
    why = lce_recognition.blocked(((spec, M(3.0, z=1)),))
    assert "loss = loss + logits.sum()" in why and "`self.config.z > 0` holds" in why
    with pytest.raises(lce_recognition.Unsupported, match="cannot evaluate the logits' scale `self.config.get_text_config"):
        lce_recognition.logit_transform(((spec, object()),))
    m = M(3.0)
    m.config.mult = torch.tensor(0.5)  # a tensor (a learnt scale would need its gradient): not a number
    with pytest.raises(lce_recognition.Unsupported, match="as a number .Tensor, not a number"):
        lce_recognition.logit_transform(((spec, m),))


# ---------------------------------------------------------------------------------------------
# Through deepspeed.initialize, ZeRO-3, on two forked CPU ranks: a tied LMHeadModel (GPT-2), a
# temperature (Cohere) and a multimodal wrapper (Llava).


def _ds_run(name, fused, steps=3):
    import deepspeed
    import deepspeed.comm as dist

    torch.set_num_threads(1)
    model = FAMILIES[name][0]()
    # SGD: Adam would turn the rounding noise of gradients that are zero in exact arithmetic (GPT-2's
    # key bias) into full-size steps, and the parameters would differ by the learning rate.
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                 "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
                 "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=ds_config)
    if fused:
        rep = get_feature("linear_cross_entropy").apply(engine.module, engine, _cfg())
        assert rep.applied, rep.reason
    head = lce._head_module(engine.module) if fused else None
    assert head is None or head.weight.numel() == 0  # partitioned outside forward
    engine.train()
    losses = []
    for step in range(steps):
        batch = {k: v.to(engine.device) for k, v in text_batch(100 * step + dist.get_rank()).items()}
        torch.manual_seed(step)
        out = engine(**batch)
        assert (out.logits is None) == fused
        losses.append(out.loss.detach().clone())
        engine.backward(out.loss)
        engine.step()
    if fused:
        assert lce.fused_state(engine.module).fused_calls == steps
        ext = [p for m in engine.module.modules() for p in getattr(m, "_external_params", {}).values()]
        assert not any(p is head.weight for p in ext)
    params = {}
    for n, p in engine.module.named_parameters():
        with deepspeed.zero.GatheredParameters([p]):
            params[n] = p.detach().float().cpu().clone()
    return torch.stack(losses).float().cpu(), params


class TestZero3Heads(DistributedTest):
    world_size = 2

    @pytest.mark.parametrize("name", ["gpt2", "cohere", "llava"])
    def test_matches_unpatched(self, name):
        tol = 1e-4 if torch.cuda.is_available() else 1e-5
        ref_losses, ref_params = _ds_run(name, fused=False)
        losses, params = _ds_run(name, fused=True)
        torch.testing.assert_close(losses, ref_losses, rtol=tol, atol=0)
        assert ref_losses[0] != ref_losses[-1]
        for n, p in params.items():
            if p.numel():
                err = ((p - ref_params[n]).norm() / ref_params[n].norm().clamp_min(1e-30)).item()
                assert err <= tol, (n, err)
