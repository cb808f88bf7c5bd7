"""moe_reorder's fused experts gate, silu(gate) * up (CPU: Triton interpreter, fp32 and fp16; bf16 on
the GPU): forward and backward against eager's own rounding and float64, poisoned outputs, strided
rows, the fallback, the custom op under torch.compile's fake tensors, and the experts integration."""
import copy
import importlib
import warnings

import pytest
import torch
import transformers
from tiny_models import build_model
from unit.test_rms_norm import ulp

from deepspeed_fused import patch_model, unpatch_model
from deepspeed_fused.features import moe_reorder
from deepspeed_fused.ops import _common
from deepspeed_fused.ops import moe_reorder as mr
from deepspeed_fused.ops.mlp_act.launch import same_bits

S = importlib.import_module("deepspeed_fused.ops.moe_reorder.swiglu")  # the module (the package exports the function)
FLOATS = [torch.float32, torch.float16]


def _grads(fn, gu, dh):
    x = gu.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(dh)
    return y.detach(), x.grad


def _oracle(gu):
    g, u = gu.double().chunk(2, -1)
    return g * torch.sigmoid(g) * u


def _inputs(shape, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    gu = (2 * torch.randn(shape, generator=gen)).to(dtype).to(device)
    dh = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(dtype).to(device)
    return gu, dh


def _check(gu, dh):
    y, dgu = _grads(mr.swiglu, gu, dh)
    yr, dgur = _grads(mr.swiglu_reference, gu, dh)
    assert y.dtype == yr.dtype == gu.dtype and y.shape == yr.shape and dgu.shape == gu.shape
    if gu.is_cuda:  # the forward is the dense mlp_act's: CUDA eager's bits in every dtype
        assert bool(same_bits(y, yr).all())
    if gu.dtype == torch.float32:
        # no narrowing rounding: within a few FP32 ULP of eager (exp differs in the last bits)
        y64 = _oracle(gu)
        assert ((y.double() - y64).abs() <= 4 * ulp(y64, torch.float32) + 1e-30).all()
        torch.testing.assert_close(dgu, dgur, rtol=1e-6, atol=1e-6)
        return
    # half precision: eager's roundings at the same points; a flip of act's rounding (our exp vs
    # torch's) moves the output by at most one ULP of act times |up|, plus the output's own ULP
    g, u = gu.double().chunk(2, -1)
    act_ulp = ulp(g * torch.sigmoid(g), gu.dtype)
    allow = ulp(yr, gu.dtype) + act_ulp * u.abs()
    assert ((y.double() - yr.double()).abs() <= allow).all()
    assert (y == yr).double().mean() >= 0.99
    dg, du = dgu.double().chunk(2, -1)
    dgr, dur = dgur.double().chunk(2, -1)
    assert ((du - dur).abs() <= ulp(dur, gu.dtype) + act_ulp * dh.double().abs()).all()
    # the gate's gradient: silu'(g) * round(dh * up), the same rounded factor, FP32 math then one rounding
    s = torch.sigmoid(g)
    deriv = (s * (1 + g * (1 - s))).abs()
    assert ((dg - dgr).abs() <= ulp(dgr, gu.dtype) + 8 * 2.0 ** -24 * deriv * (dh.double() * u).abs()).all()
    assert (dgu == dgur).double().mean() >= 0.99


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(37, 2 * 48), (5, 3, 2 * 20), (64, 2 * 1100), (1, 2)])
def test_swiglu_matches_eager(interpret, dtype, shape):
    gu, dh = _inputs(shape, dtype, interpret, seed=sum(shape))
    _check(gu, dh)


def test_swiglu_writes_every_element(interpret, monkeypatch):
    # poison the outputs: every element of h and of the input gradient is written by the kernels
    gu, dh = _inputs((33, 2 * 70), torch.float32, interpret, seed=3)
    real_empty = torch.empty

    def poisoned(*a, **k):
        return real_empty(*a, **k).fill_(float("nan"))

    monkeypatch.setattr(S.torch, "empty", poisoned)
    y, dgu = _grads(mr.swiglu, gu, dh)
    assert torch.isfinite(y).all() and torch.isfinite(dgu).all()


def test_swiglu_strided_rows(interpret):
    # a [S, 2I] view with a row stride (a slice of a wider buffer): no copy needed, same results
    base, dh = _inputs((19, 2 * 40 + 24), torch.float16, interpret, seed=4)
    gu = base[:, :80]
    dh = dh[:, :40].contiguous()
    assert not gu.is_contiguous()
    _check(gu, dh)


def test_swiglu_checks_and_fallback(monkeypatch):
    with pytest.raises(ValueError, match="gate_up"):
        mr.swiglu(torch.randn(3, 5))
    with pytest.raises(TypeError, match="gate_up"):
        mr.swiglu(torch.ones(3, 4, dtype=torch.int32))
    _common.reset_fallback_warnings()
    x = torch.randn(4, 8, dtype=torch.float64)  # not a kernel dtype: the reference, one warning
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y1, y2 = mr.swiglu(x), mr.swiglu(x)
    assert sum("swiglu" in str(m.message) for m in w) == 1
    torch.testing.assert_close(y1, mr.swiglu_reference(x))


def test_swiglu_custom_op_fake_and_autograd(interpret):
    # the ops torch.compile traces: opcheck (schema, fake tensors, autograd registration)
    gu, dh = _inputs((6, 2 * 16), torch.float32, interpret, seed=5)
    torch.library.opcheck(S._swiglu_op, (gu.requires_grad_(),))
    torch.library.opcheck(S._swiglu_backward_op, (gu.detach(), dh))
    x = gu.detach().clone().requires_grad_()
    (g1,) = torch.autograd.grad(S._swiglu_op(x), x, dh)
    (g2,) = torch.autograd.grad(mr.swiglu_reference(x), x, dh)
    torch.testing.assert_close(g1, g2, rtol=1e-6, atol=1e-6)


# ---- the experts integration ------------------------------------------------------------------
def _experts(model):
    return [m for m in model.modules() if hasattr(m, "gate_up_proj")]


def test_fused_gate_recognition():
    from transformers.integrations.moe import _default_apply_gate

    experts = _experts(build_model("qwen3-moe-tiny", torch.float32, seed=0))
    assert experts and all(type(m)._apply_gate is _default_apply_gate for m in experts)
    assert all(moe_reorder.fused_gate(m) for m in experts)
    m = copy.deepcopy(experts[0])
    m.act_fn = torch.nn.GELU()  # another activation: kept
    assert not moe_reorder.fused_gate(m)
    m.act_fn = torch.nn.SiLU()
    assert moe_reorder.fused_gate(m)
    h = m.act_fn.register_forward_hook(lambda *a: None)  # a hook on the activation would be skipped
    assert not moe_reorder.fused_gate(m)
    h.remove()

    class OwnGate(type(m)):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            return self.act_fn(gate) * up * 2

    m.__class__ = OwnGate
    assert not moe_reorder.fused_gate(m)


def _gpt_oss_cfg():
    return transformers.GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
                                     num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                     vocab_size=64, layer_types=["full_attention"] * 2)


def test_gpt_oss_gate_recognition():
    from transformers.models.gpt_oss import modeling_gpt_oss

    m = modeling_gpt_oss.GptOssExperts(_gpt_oss_cfg())
    assert not moe_reorder.fused_gate(m) and moe_reorder.oai_gate_of(m)  # its clamped gate, recognised
    m.alpha = torch.tensor(1.702)  # not a Python number: kept
    assert not moe_reorder.oai_gate_of(m)


def test_gpt_oss_model_with_fused_gate_matches_eager(interpret, monkeypatch):
    cfg = _gpt_oss_cfg()
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(cfg).float()
    for p in model.parameters():  # the init leaves biases zero and some weights constant: noise
        p.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    ref = copy.deepcopy(model)
    calls = []
    real = mr.oai_gate
    monkeypatch.setattr(mr, "oai_gate", lambda *a: calls.append(1) or real(*a))
    rep = patch_model(model, {"moe_reorder": {"enabled": True}})
    r = rep.features[[f.name for f in rep.features].index("moe_reorder")]
    assert r.details["fused_gate"] == r.details["layers"] == 2, r
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))

    def step(m):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {k: p.grad for k, p in m.named_parameters() if p.grad is not None}

    loss, grads = step(model)
    assert len(calls) == 2
    loss_r, grads_r = step(ref)
    torch.testing.assert_close(loss, loss_r, rtol=1e-6, atol=1e-6)
    for k in grads_r:
        torch.testing.assert_close(grads[k], grads_r[k], rtol=1e-5, atol=1e-6, msg=k)
    unpatch_model(model)


@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "mixtral-tiny"])
def test_experts_run_the_fused_gate(interpret, name, monkeypatch):
    # the numbers against grouped_mm are test_moe_reorder's (every gradient, rtol 1e-5); here: the
    # fused gate is what runs, once per experts forward, and the report says so
    model = build_model(name, torch.float32, seed=0)
    calls = []
    real = mr.swiglu
    monkeypatch.setattr(mr, "swiglu", lambda x: calls.append(tuple(x.shape)) or real(x))
    rep = patch_model(model, {"moe_reorder": {"enabled": True}})
    try:
        r = rep.features[[f.name for f in rep.features].index("moe_reorder")]
        n = r.details["layers"]
        assert r.details["fused_gate"] == n and f"fused in {n} of {n}" in r.reason, r
        ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(1))
        model(input_ids=ids, labels=ids).loss.backward()
        assert len(calls) == n
    finally:
        unpatch_model(model)


# ---- GPT-OSS's clamped gate -------------------------------------------------------------------
ALPHA, LIMIT = 1.702, 7.0


def check_oai(gu, dh):
    y, dgu = _grads(lambda x: mr.oai_gate(x, ALPHA, LIMIT), gu, dh)
    yr, dgur = _grads(lambda x: mr.oai_gate_reference(x, ALPHA, LIMIT), gu, dh)
    assert y.dtype == yr.dtype == gu.dtype and y.shape == yr.shape and dgu.shape == gu.shape
    if gu.dtype == torch.float32:
        torch.testing.assert_close(y, yr, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dgu, dgur, rtol=1e-5, atol=1e-6)
        return
    # half precision: eager's roundings at every step (the sigmoid's backward d * (1 - s) * s in
    # the half type's arithmetic, each operation rounded, as ATen writes it on CPU and CUDA); our
    # exp against torch's can move the sigmoid's rounding to its neighbour, which then moves what
    # depends on it by an ULP or so
    for a, b in ((y, yr), (dgu[..., 1::2], dgur[..., 1::2]), (dgu, dgur)):
        assert (a == b).double().mean() >= 0.99
        rel = (a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)
        assert rel < 2e-3, rel.item()
    g, u = gu.double()[..., ::2].clamp(max=LIMIT), gu.double()[..., 1::2].clamp(-LIMIT, LIMIT)
    sg = torch.sigmoid(g * ALPHA)
    d_t = (dh.double() * (u + 1) * g * sg * (1 - sg)).abs()
    dg, dgr = dgu[..., ::2].double(), dgur[..., ::2].double()
    bound = ulp(dgr, gu.dtype) + 4 * ALPHA * ulp(d_t, gu.dtype) + 2 * ulp(dh.double() * (u + 1) * sg, gu.dtype)
    assert ((dg - dgr).abs() <= bound).all(), ((dg - dgr).abs() / bound).max().item()
    # the clamps' masks: gradients exactly zero where eager's are (inputs beyond the limit)
    beyond = (gu[..., ::2].double() > LIMIT)
    assert (dgu[..., ::2][beyond] == 0).all() and (dgur[..., ::2][beyond] == 0).all()


@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("shape", [(37, 2 * 48), (64, 2 * 1100), (1, 2)])
def test_oai_gate_matches_eager(interpret, dtype, shape):
    gen = torch.Generator().manual_seed(sum(shape))
    gu = (5 * torch.randn(shape, generator=gen)).to(dtype).to(interpret)  # beyond the limit at times
    edges = torch.tensor([LIMIT, -LIMIT, LIMIT + 1, -LIMIT - 1], dtype=dtype)  # the clamps' edges
    n = min(4, gu.numel())
    gu.view(-1)[:n] = edges[:n].to(gu.device)
    dh = torch.randn(*shape[:-1], shape[-1] // 2, generator=gen).to(dtype).to(interpret)
    check_oai(gu, dh)


def test_oai_gate_checks_and_ops(interpret):
    with pytest.raises(TypeError, match="alpha"):
        mr.oai_gate(torch.randn(2, 4), torch.tensor(1.0), 7.0)
    gen = torch.Generator().manual_seed(7)
    gu = (5 * torch.randn(6, 32, generator=gen)).to(interpret)
    torch.library.opcheck(S._oai_op, (gu.requires_grad_(), ALPHA, LIMIT))
    torch.library.opcheck(S._oai_backward_op, (gu.detach(), torch.randn(6, 16, generator=gen).to(interpret), ALPHA,
                                               LIMIT))
