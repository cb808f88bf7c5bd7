"""Feature "mlp_act": gated MLPs recognised from their forward's bytecode in several families (Llama,
Qwen3, Gemma's tanh GELU, Phi-3's and GLM's fused gate-up projection, Granite's shared MLP, exact
GELU), model-level loss and gradients equal to unpatched under the interpreter, the report's counts,
refusals with reasons, fallbacks, revert, copies, and the coverage listing of transformers' MLPs."""
from __future__ import annotations

import copy
import glob
import os
import pickle
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401

from deepspeed_fused import patch_model, unpatch_model
from deepspeed_fused.features import mlp_act as F
from deepspeed_fused.features.mlp_act import recognition as R
from deepspeed_fused.ops._common import reset_fallback_warnings

SECTION = {"mlp_act": {"enabled": True}}
_SMALL = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=97, max_position_embeddings=64)

# family -> (config class, overrides, expected activation, expected layout)
FAMILIES = {
    "llama": ("LlamaConfig", {}, "silu", "split"),
    "qwen3": ("Qwen3Config", dict(head_dim=8), "silu", "split"),
    "gemma": ("GemmaConfig", dict(head_dim=8, hidden_activation="gelu_pytorch_tanh"), "gelu_tanh", "split"),
    "gemma3": ("Gemma3TextConfig", dict(head_dim=8, sliding_window=8), "gelu_tanh", "split"),
    "phi3": ("Phi3Config", dict(pad_token_id=0), "silu", "gate_up"),
    "glm": ("GlmConfig", dict(head_dim=8, pad_token_id=0, eos_token_id=1, bos_token_id=2), "silu", "gate_up"),
    "llama-gelu": ("LlamaConfig", dict(hidden_act="gelu"), "gelu", "split"),
    "mistral": ("MistralConfig", dict(head_dim=8), "silu", "split"),
}


def build(family, dtype=torch.float32, seed=0):
    import transformers

    cls_name, kw, _, _ = FAMILIES[family]
    cfg = getattr(transformers, cls_name)(**{**_SMALL, **kw})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)


def _loss_grads(model, seed=1):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 97, (2, 12), generator=gen)
    labels = ids.clone()
    labels[0, :3] = -100
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _mlps(model):
    return [m for m in model.modules() if isinstance(R.recognise(type(m).forward), R.Form)
            or F.is_replaced(m)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_loss_and_grads_equal_unpatched(interpret, family):
    reset_fallback_warnings()
    base = build(family)
    patched = copy.deepcopy(base)
    _, _, act, layout = FAMILIES[family]
    loss_e, grads_e = _loss_grads(base)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = patch_model(patched, SECTION)
        rep = next(f for f in report.features if f.name == "mlp_act")
        loss_p, grads_p = _loss_grads(patched)
    assert not [w for w in caught if "mlp_act" in str(w.message)], [str(w.message) for w in caught]
    layers = base.config.num_hidden_layers
    mlps = [m for m in patched.modules() if F.is_replaced(m)]
    assert rep.applied and len(mlps) == layers, rep
    assert rep.where == f"{layers} x {type(mlps[0]).__name__}"
    assert rep.calls.fused == layers and rep.calls.eager == 0  # one forward; the backward is not a call
    form = F.form_of(type(mlps[0]))
    assert form.layout == layout and any(act in f for f in rep.details["forms"]), rep.details["forms"]
    assert R.activation_of(getattr(mlps[0], form.attr("act"))) == act
    # fp32 under the interpreter: the kernels' exp/tanh/erf differ from CPU eager's in the last bits
    assert abs(float(loss_p - loss_e)) <= 1e-6 * abs(float(loss_e))
    assert grads_p.keys() == grads_e.keys()
    for n, g in grads_e.items():
        assert float((grads_p[n] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-12, n
    unpatch_model(patched)
    assert not any(F.is_replaced(m) for m in patched.modules())
    loss_r, grads_r = _loss_grads(patched)
    assert torch.equal(loss_r, loss_e)  # eager again: bit for bit


def test_fp16_model_matches_unpatched(interpret):
    base = build("gemma", dtype=torch.float16)
    patched = copy.deepcopy(base)
    loss_e, grads_e = _loss_grads(base)
    patch_model(patched, SECTION)
    loss_p, grads_p = _loss_grads(patched)
    assert abs(float(loss_p - loss_e)) <= 2e-3 * abs(float(loss_e))
    for n, g in grads_e.items():
        assert float((grads_p[n].float() - g.float()).norm()) <= 2e-2 * float(g.float().norm()) + 1e-6, n


def test_skips_with_reasons_and_unknown_forms(interpret):
    model = build("llama")
    model.model.layers[0].mlp.act_fn = torch.nn.ReLU()  # a recognised form, an activation not fused
    rep = next(f for f in patch_model(model, SECTION).features if f.name == "mlp_act")
    assert rep.where == "1 x LlamaMLP"
    assert any("ReLU" in reason for reason in rep.details["skipped"]), rep.details["skipped"]
    assert "ReLU" in rep.reason

    class BitNetLike(torch.nn.Module):  # a norm between the product and the down projection: not a form
        def __init__(self):
            super().__init__()
            self.gate_proj = torch.nn.Linear(4, 6)
            self.up_proj = torch.nn.Linear(4, 6)
            self.down_proj = torch.nn.Linear(6, 4)
            self.norm = torch.nn.LayerNorm(6)
            self.act_fn = torch.nn.SiLU()

        def forward(self, x):
            return self.down_proj(self.norm(self.act_fn(self.gate_proj(x)) * self.up_proj(x)))

    assert isinstance(R.recognise(BitNetLike.forward), str)
    m = BitNetLike()
    rep = next(f for f in patch_model(m, SECTION).features if f.name == "mlp_act")
    assert not rep.applied and "no MLP" in rep.reason


def test_renamed_attributes_are_recognised(interpret):
    class Renamed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = torch.nn.Linear(8, 12, bias=False)
            self.w3 = torch.nn.Linear(8, 12, bias=False)
            self.w2 = torch.nn.Linear(12, 8, bias=False)
            self.act = torch.nn.GELU(approximate="tanh")

        def forward(self, h):
            return self.w2(self.act(self.w1(h)) * self.w3(h))

    form = R.recognise(Renamed.forward)
    assert isinstance(form, R.Form) and dict(form.roles) == dict(down="w2", act="act", gate="w1", up="w3")
    m = Renamed()
    x = torch.randn(3, 8, requires_grad=True)
    ref = m(x)
    assert F.replace_mlp_act(m) == 1
    y = m(x)
    torch.testing.assert_close(y, ref, rtol=1e-6, atol=1e-6)


def test_fallbacks_run_eager_math_with_one_warning(interpret):
    reset_fallback_warnings()
    model = build("phi3", dtype=torch.float64)  # not a kernel dtype: the form's own math, one warning
    base = copy.deepcopy(model)
    rep = next(f for f in patch_model(model, SECTION).features if f.name == "mlp_act")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_p, _ = _loss_grads(model)
        _loss_grads(model)
    loss_e, _ = _loss_grads(base)
    assert torch.equal(loss_p, loss_e)
    assert sum("mlp_act" in str(w.message) and "float64" in str(w.message) for w in caught) == 1
    assert rep.calls.eager == 4 and rep.calls.fused == 0
    # an activation replaced after the patch: that module runs its eager forward
    model = build("llama")
    base = copy.deepcopy(model)
    patch_model(model, SECTION)
    for m in (model, base):
        m.model.layers[1].mlp.act_fn = torch.nn.Tanh()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss_p, _ = _loss_grads(model)
    assert any("Tanh" in str(w.message) for w in caught)
    loss_e, _ = _loss_grads(base)
    assert abs(float(loss_p - loss_e)) <= 1e-6 * abs(float(loss_e))


def test_copies_pickles_and_other_instances(interpret):
    model = build("qwen3")
    other = build("qwen3")  # same class, not patched: runs the class's previous forward
    patch_model(model, SECTION)
    assert all(not F.is_replaced(m) for m in other.modules())
    dup = copy.deepcopy(model)
    assert sum(F.is_replaced(m) for m in dup.modules()) == 2
    loaded = pickle.loads(pickle.dumps(model.model.layers[0].mlp))
    assert not F.is_replaced(loaded)  # a pickle loads opted out


def test_activation_reading():
    import functools

    import transformers.activations as A

    assert R.activation_of(A.SiLUActivation()) == "silu"
    assert R.activation_of(A.GELUTanh()) == "gelu_tanh"
    assert R.activation_of(A.GELUActivation()) == "gelu"
    assert R.activation_of(torch.nn.GELU()) == "gelu"
    assert R.activation_of(torch.nn.functional.silu) == "silu"
    assert R.activation_of(functools.partial(torch.nn.functional.gelu, approximate="tanh")) == "gelu_tanh"
    for other in (A.GELUTanh(use_gelu_tanh_python=True), A.GELUActivation(use_gelu_python=True),
                  A.NewGELUActivation(), A.QuickGELUActivation(), torch.nn.ReLU(), torch.relu):
        assert not isinstance(R.activation_of(other), str), other
    hooked = torch.nn.SiLU()
    hooked.register_forward_hook(lambda *a: None)
    assert not isinstance(R.activation_of(hooked), str)


def test_coverage_of_transformers_mlps():
    wanted = {"llama": "LlamaMLP", "qwen3": "Qwen3MLP", "gemma": "GemmaMLP", "gemma3": "Gemma3MLP",
              "phi3": "Phi3MLP", "glm": "GlmMLP", "qwen2": "Qwen2MLP", "granitemoeshared": "GraniteMoeSharedMLP",
              "moonshine": "MoonshineDecoderMLP", "mistral": "MistralMLP"}
    rows = R.coverage([f"transformers.models.{m}.modeling_{m}" for m in wanted])
    got = {cls: desc for _, cls, desc, _ in rows if cls in wanted.values()}
    assert set(got) == set(wanted.values()) and all(got.values()), got
    assert "chunk" in got["Phi3MLP"] and "up, gate" in got["MoonshineDecoderMLP"]
    # every module of the installed transformers: the listing runs, and most gated MLPs are recognised
    import transformers

    root = os.path.dirname(transformers.__file__)
    mods = sorted(f"transformers.models.{p.split(os.sep)[-2]}.{os.path.basename(p)[:-3]}"
                  for p in glob.glob(os.path.join(root, "models", "*", "modeling_*.py")))
    rows = R.coverage(mods)
    assert sum(desc is not None for _, _, desc, _ in rows) >= 100


def test_torch_compile_traces_the_patched_mlp_in_one_graph(interpret):
    model = build("gemma3")
    ref = copy.deepcopy(model)
    patch_model(model, SECTION)
    mlp, mlp_ref = model.model.layers[0].mlp, ref.model.layers[0].mlp
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    explained = torch._dynamo.explain(mlp)(x)
    assert explained.graph_count == 1 and explained.graph_break_count == 0
    torch._dynamo.reset()
    compiled = torch.compile(mlp)
    a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya, yb = compiled(a), mlp_ref(b)
    ya.sum().backward()
    yb.sum().backward()
    torch.testing.assert_close(ya, yb, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["non-reentrant", "reentrant"])
def test_gradient_checkpointing(interpret, mode):
    # Hugging Face gradient checkpointing recomputes each layer in the backward: the patched MLPs run
    # again there (fused), and loss and gradients stay those of the unpatched model
    from deepspeed_fused import train

    base = build("qwen3")
    patched = copy.deepcopy(base)
    for m in (base, patched):
        m.train()
        train.enable_grad_ckpt(m, mode)
    rep = patch_model(patched, SECTION)["mlp_act"]
    loss_e, grads_e = _loss_grads(base)
    loss_p, grads_p = _loss_grads(patched)
    # the forward's calls and the recomputation's (a non-reentrant recomputation stops, by an exception,
    # once the tensors the backward needs are saved again: in the down projection, after the fused
    # activation has run and been counted)
    layers = base.config.num_hidden_layers
    assert rep.calls.eager == 0
    assert rep.calls.fused == 2 * layers
    assert abs(float(loss_p - loss_e)) <= 1e-6 * abs(float(loss_e))
    for n, g in grads_e.items():
        assert float((grads_p[n] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-12, n


@pytest.mark.parametrize("family", ["llama", "phi3"])
def test_gradients_over_the_projections_only_where_no_hook_sees_them(interpret, monkeypatch, family):
    """The backward writes the activation's input gradients over the projections' outputs only where
    they are plain ``nn.Linear`` outputs that no forward hook (the module's own or a global one) could
    have kept; a hooked projection's output is left as the hook saw it (with a global hook the MLPs
    run eager altogether). Loss and gradients stay the unpatched model's either way."""
    from deepspeed_fused.ops.mlp_act import launch as L

    split = FAMILIES[family][3] == "split"
    name = "split_backward" if split else "fused_backward"
    real = getattr(L, name)
    seen = []

    def spy(*args, in_place=False, **kw):
        if split and len(args) > 4:
            in_place = args[4]
            args = args[:4]
        seen.append(in_place)
        return real(*args, in_place=in_place, **kw)

    monkeypatch.setattr(L, name, spy)
    base = build(family)
    patched = copy.deepcopy(base)
    patch_model(patched, SECTION)
    loss_e, grads_e = _loss_grads(base)
    layers = base.config.num_hidden_layers

    def check():
        loss_p, grads_p = _loss_grads(patched)
        assert abs(float(loss_p - loss_e)) <= 1e-6 * abs(float(loss_e))
        for n, g in grads_e.items():
            assert float((grads_p[n] - g).norm()) <= 1e-5 * float(g.norm()) + 1e-12, n

    check()
    assert seen == [True] * layers
    # a hook keeping the first layer's projection output: that layer's gradients are fresh buffers
    proj = patched.model.layers[0].mlp.gate_proj if split else patched.model.layers[0].mlp.gate_up_proj
    kept = []
    handle = proj.register_forward_hook(lambda m, i, o: kept.append((o, o.detach().clone())))
    seen.clear()
    check()
    handle.remove()
    assert sorted(seen) == [False] + [True] * (layers - 1)
    assert kept and all(torch.equal(o, c) for o, c in kept)
    # a global forward hook: the MLPs run their eager forward (as the fallback test shows), no kernel
    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        seen.clear()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            check()
        assert seen == []
    finally:
        handle.remove()
    assert not _private_output_with_global_hook(proj)


def _private_output_with_global_hook(proj):
    from deepspeed_fused.features.mlp_act.patch import _private_output

    handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: None)
    try:
        return _private_output(proj)
    finally:
        handle.remove()
