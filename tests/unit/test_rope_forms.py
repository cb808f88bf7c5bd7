"""The rope forms of Llama 4 / DeepSeek-V2 (complex multiply by ``freqs_cis``), GPT-J / CodeGen
(``rotate_every_two``), DeepSeek-V4 (the last columns, in float32), Qwen4-Exp (partial, k optional)
and Mistral Large 4 (DeepSeek's interleave form, k optional): each transformers function against
the fused call a patched forward makes (fp32 and fp16, forward and backward, bitwise), the op's
new spec fields against the reference and float64, poisoned outputs, fallbacks; then tiny models
of those families patched against unpatched (loss and every gradient bitwise).

The complex multiply is rounded as CUDA rounds it (``fma(a, c, -(b * d))``, see
``RopeSpec.contract``); on the CPU, ATen rounds its vectorized body without FMA and the
interpreter's ``tl.fma`` is unfused too, so the CPU comparisons use pair counts that are multiples
of 16 (the checks leave other CPU calls to eager, tested below); the GPU test compares with CUDA.
"""
from __future__ import annotations

import copy
import importlib
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not in every forked test: custom ops need it)

from deepspeed_fused.features import rope as F
from deepspeed_fused.ops import rope as R
from deepspeed_fused.ops.rope import launch as RL
from deepspeed_fused.ops.rope import reference as RR
from deepspeed_fused.ops._common import reset_fallback_warnings
from deepspeed_fused.ops.rope import RopeSpec
from unit.test_rope_feature import Launches

FUNCTIONS = [  # (family, function name, form name)
    ("llama4", "apply_rotary_emb", "complex"),
    ("deepseek_v2", "apply_rotary_emb", "complex"),
    ("gptj", "apply_rotary_pos_emb", "every-two"),
    ("codegen", "apply_rotary_pos_emb", "every-two"),
    ("deepseek_v4", "apply_rotary_pos_emb", "tail-float32"),
    ("qwen4_exp", "apply_rotary_pos_emb", "partial-optional-k"),
    ("mistral_large4", "apply_rotary_pos_emb_interleave", "deinterleave-optional-k"),
]


def _fn(family, name):
    try:
        mod = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        return mod, F.plain_function(getattr(mod, name))
    except (ImportError, AttributeError):  # an older transformers (5.17, the GPU tests' version)
        pytest.skip(f"this transformers has no {family}.{name}")


@pytest.fixture
def launches():
    with Launches() as counter:
        yield counter


def _inputs(family, dtype, gen, b=2, s=3, hq=2, hk=1, d=32, angle_dtype=None, device="cpu"):
    """(leaves, the views the function takes, its angle arguments, kwargs) in the layout its model
    passes them. d = 32: 16 pairs (the complex multiply's CPU rounding, see the module docstring)."""
    leaves, views, angles, kw = _inputs_cpu(family, dtype, gen, b, s, hq, hk, d, angle_dtype)
    if device == "cpu":
        return leaves, views, angles, kw
    transposed = views[0] is not leaves[0]  # the family's layout, read before the leaves are replaced
    leaves = [x.detach().to(device).requires_grad_() for x in leaves]
    views = [x.transpose(1, 2) for x in leaves] if transposed else leaves
    return leaves, views, tuple(a.to(device) for a in angles), kw


def _inputs_cpu(family, dtype, gen, b, s, hq, hk, d, angle_dtype):
    angle_dtype = angle_dtype or dtype
    leaves = [torch.randn(b, s, h, d, generator=gen).to(dtype).requires_grad_() for h in (hq, hk)]
    theta = torch.randn(b, s, d // 2, generator=gen, dtype=torch.float64) * 3
    if family == "llama4":  # [B, S, H, D], freqs_cis [B, S, D/2] (complex64, times the attention scaling)
        cis = torch.polar(torch.ones_like(theta), theta).to(torch.complex64) * 1.25
        return leaves, leaves, (cis,), {}
    views = [x.transpose(1, 2) for x in leaves]  # [B, H, S, D] views of [B, S, H, D]
    if family == "deepseek_v2":
        cis = torch.polar(torch.ones_like(theta), theta).to(torch.complex64)
        return leaves, views, (cis,), {}
    cos, sin = theta.cos().to(angle_dtype), theta.sin().to(angle_dtype)
    if family in ("gptj", "codegen"):  # one [B, S, H, D] tensor, (sin, cos) of [B, S, D/2]
        if family == "codegen":  # CodeGen's sin/cos stay float32
            cos, sin = theta.cos().float(), theta.sin().float()
        return leaves[:1], leaves[:1], (sin, cos), {}
    if family == "deepseek_v4":  # one tensor, half-width cos/sin: the last columns rotated
        w = d // 4
        return leaves[:1], views[:1], (cos[..., :w].contiguous(), sin[..., :w].contiguous()), {}
    if family == "qwen4_exp":  # partial: the first half of the head
        full = torch.cat([theta[..., : d // 4]] * 2, dim=-1)
        return leaves, views, (full.cos().to(angle_dtype), full.sin().to(angle_dtype)), {}
    full = torch.cat([theta] * 2, dim=-1)  # mistral_large4: cat(freqs, freqs)
    return leaves, views, (full.cos().to(angle_dtype), full.sin().to(angle_dtype)), {}


def _call_and_eager(family, name, dtype, launches, seed=0, k=True, device="cpu", **shape):
    gen = torch.Generator().manual_seed(seed)
    mod, fn = _fn(family, name)
    form = F.recognise(fn)
    assert isinstance(form, F.Form), form
    g = vars(mod)
    call = F._make_call(g, name, g[name], form)
    leaves, views, angles, kw = _inputs(family, dtype, gen, device=device, **shape)
    if form.complex and leaves[0].is_cuda:  # the device's rounding probe launches the kernel: not counted
        RL._complex_rounding(leaves[0].device)
    args = list(views) + list(angles)
    if not k:  # a call without the key
        leaves, args = leaves[:1], [views[0], None] + list(angles)
    before = launches.n
    reset_fallback_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = call(*args, **kw)
    assert launches.n == before + 1, f"{family}.{name}: the kernel did not run"
    want = fn(*args, **kw)
    return leaves, got, want, gen


def _assert_same(got, want):
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (a.double() - b.double()).abs().max()
    return [t for t in want if t is not None], [t for t in got if t is not None]


@pytest.mark.parametrize("family, name, form_name", FUNCTIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_function_equals_its_eager_code(interpret, launches, family, name, form_name, dtype):
    """The fused call equals the family's own function bitwise: outputs and the gradients of q and
    k (one launch each way)."""
    _, fn = _fn(family, name)
    assert F.recognise(fn).name == form_name
    leaves, got, want, gen = _call_and_eager(family, name, dtype, launches, seed=hash(family) % 1000)
    want_t, got_t = _assert_same(got, want)
    gs = tuple(torch.randn(w.shape, generator=gen).to(w.dtype) for w in want_t)
    before = launches.n
    ga = torch.autograd.grad(got_t, leaves, gs)
    gb = torch.autograd.grad(want_t, leaves, gs)
    assert launches.n == before + 1
    for a, b in zip(ga, gb):
        assert a.dtype == b.dtype and torch.equal(a, b), (a.double() - b.double()).abs().max()


@pytest.mark.parametrize("family, name", [("qwen4_exp", "apply_rotary_pos_emb"),
                                          ("mistral_large4", "apply_rotary_pos_emb_interleave")])
def test_optional_k_returns_what_eager_returns(interpret, launches, family, name):
    """Without k: Qwen4-Exp's returns q's result alone, Mistral Large 4's (q's result, None)."""
    leaves, got, want, gen = _call_and_eager(family, name, torch.float16, launches, k=False)
    if family == "mistral_large4":
        assert isinstance(want, tuple) and want[1] is None
    else:
        assert isinstance(want, torch.Tensor)
    _assert_same(got, want)


def test_qwen4_keyword_call(interpret, launches):
    """Qwen4-Exp's indexer calls ``apply_rotary_pos_emb(q, cos=..., sin=..., unsqueeze_dim=2)``."""
    mod, fn = _fn("qwen4_exp", "apply_rotary_pos_emb")
    call = F._make_call(vars(mod), "apply_rotary_pos_emb", vars(mod)["apply_rotary_pos_emb"], F.recognise(fn))
    gen = torch.Generator().manual_seed(5)
    q = torch.randn(2, 3, 2, 16, generator=gen, dtype=torch.float16)
    theta = torch.randn(2, 3, 4, generator=gen)
    cos, sin = torch.cat([theta.cos()] * 2, -1).half(), torch.cat([theta.sin()] * 2, -1).half()
    before = launches.n
    got = call(q, cos=cos, sin=sin, unsqueeze_dim=2)
    assert launches.n == before + 1
    assert torch.equal(got, fn(q, cos=cos, sin=sin, unsqueeze_dim=2))


@pytest.mark.parametrize("case", ["odd-pairs", "freqs-complex128", "freqs-2d", "q-5d", "fp32-odd-offset",
                                  "fp16-strided-head", "no-k"])
def test_complex_inputs_eager_decides(interpret, launches, case):
    """Inputs the complex form's kernels cannot take as eager takes them run eager (which computes
    them, or raises its own error), with a warning."""
    mod, fn = _fn("llama4", "apply_rotary_emb")
    call = F._make_call(vars(mod), "apply_rotary_emb", vars(mod)["apply_rotary_emb"], F.recognise(fn))
    gen = torch.Generator().manual_seed(7)
    b, s, h, d = 2, 3, 2, 32
    q = torch.randn(b, s, h, d, generator=gen)
    k = torch.randn(b, s, 1, d, generator=gen)
    cis = torch.polar(torch.ones(b, s, d // 2), torch.randn(b, s, d // 2, generator=gen))
    if case == "odd-pairs":  # 5 pairs: ATen's CPU remainder rounds with FMA
        q, k, cis = q[..., :10].contiguous(), k[..., :10].contiguous(), cis[..., :5].contiguous()
    elif case == "freqs-complex128":
        cis = cis.to(torch.complex128)
    elif case == "freqs-2d":
        cis = cis[0]
    elif case == "q-5d":
        q, k = q[None], k[None]
    elif case == "fp32-odd-offset":
        q = torch.randn(b * s * h * d + 1, generator=gen)[1:].view(b, s, h, d)
    elif case == "fp16-strided-head":  # .float() keeps the permuted layout: eager's view refuses it
        q = torch.randn(b, s, d, h, generator=gen).half().transpose(-1, -2)
        k = k.half()
    elif case == "no-k":  # eager's xk.float() raises
        k = None
    reset_fallback_warnings()
    before = launches.n
    try:
        want = fn(q, k, cis)
    except Exception as e:  # eager raises: so must the call
        with pytest.warns(RuntimeWarning), pytest.raises(type(e)):
            call(q, k, cis)
    else:
        with pytest.warns(RuntimeWarning, match="runs eager"):
            got = call(q, k, cis)
        _assert_same(got, want)
    assert launches.n == before


def test_every_two_needs_its_dims(interpret, launches):
    """GPT-J's rotate_every_two slices the fourth dim and its sin/cos are indexed as 3-D: other
    dims run eager (which raises or computes its own result)."""
    mod, fn = _fn("gptj", "apply_rotary_pos_emb")
    call = F._make_call(vars(mod), "apply_rotary_pos_emb", vars(mod)["apply_rotary_pos_emb"], F.recognise(fn))
    x = torch.randn(2, 3, 2, 8)
    sin, cos = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    reset_fallback_warnings()
    with pytest.warns(RuntimeWarning, match="dims"), pytest.raises(IndexError):
        call(x[0], sin, cos)  # 3-D x: eager's x[:, :, :, ::2] raises
    before = launches.n
    with pytest.warns(RuntimeWarning, match="angles of other than 3 dims"), pytest.raises(RuntimeError):
        call(x, sin[None], cos[None])  # 4-D sin: eager interleaves another dim, then fails to broadcast
    assert launches.n == before


@pytest.mark.parametrize("family, name, form_name", FUNCTIONS)
def test_device_inputs_keep_the_family_layout(family, name, form_name):
    """The inputs the GPU test builds (moved to the device) have the shapes and strides the CPU
    ones have: each family's own layout ([B, S, H, D] for Llama 4, GPT-J and CodeGen)."""
    _fn(family, name)
    cpu = _inputs(family, torch.float16, torch.Generator().manual_seed(0))
    dev = _inputs(family, torch.float16, torch.Generator().manual_seed(0), device="meta")
    for a, b in zip(list(cpu[1]) + list(cpu[2]), list(dev[1]) + list(dev[2])):
        assert b.device.type == "meta" and a.shape == b.shape and a.stride() == b.stride(), (a.shape, b.shape)


@pytest.mark.parametrize("family", ["gptj", "codegen"])
def test_every_two_other_layout_runs_eager(interpret, launches, family):
    """q as [B, H, S, D] where the form takes [B, S, H, D]: the shapes do not broadcast; the call
    warns and runs eager, which raises its own error (never the checks' exception)."""
    mod, fn = _fn(family, "apply_rotary_pos_emb")
    call = F._make_call(vars(mod), "apply_rotary_pos_emb", vars(mod)["apply_rotary_pos_emb"], F.recognise(fn))
    x = torch.randn(2, 6, 4, 8).transpose(1, 2)  # [B, H=4, S=6, D]
    sin, cos = torch.randn(2, 6, 4), torch.randn(2, 6, 4)
    with pytest.raises(RuntimeError) as want:
        fn(x, sin, cos)
    reset_fallback_warnings()
    with pytest.warns(RuntimeWarning, match="do not broadcast.*runs eager"), pytest.raises(RuntimeError) as got:
        call(x, sin, cos)
    assert not isinstance(got.value, R.RopeInputError) and str(got.value) == str(want.value)
    assert launches.n == 0


# ---- the op's new spec fields ---------------------------------------------------------------------
TAIL = RopeSpec(pairing="adjacent", angles="pair", partial=True, tail=True, compute="float32", out_dtype="input")
COMPLEX = RopeSpec(pairing="adjacent", angles="pair", compute="float32", out_dtype="input", grad_accum="compute",
                   contract="complex")


def test_spec_fields_validate_and_round_trip():
    for spec in (TAIL, COMPLEX, RopeSpec(partial=True, tail=True)):
        assert RopeSpec.from_code(spec.code) == spec
    with pytest.raises(ValueError, match="tail needs partial"):
        RopeSpec(tail=True)
    with pytest.raises(ValueError, match="contract='complex'"):
        RopeSpec(contract="complex")
    with pytest.raises(ValueError, match="contract"):
        RopeSpec(contract="fma")
    with pytest.raises(TypeError, match="tail must be a bool"):
        RopeSpec(partial=True, tail=1)


def _complex_angles(b, s, p, gen):
    theta = torch.randn(b, s, p, generator=gen)
    ri = torch.view_as_real(torch.polar(torch.ones_like(theta), theta))
    return ri[..., 0], ri[..., 1]  # step-2 views of one complex64 tensor, as the patched call passes them


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_complex_spec_against_reference_and_real_arithmetic(interpret, dtype):
    """The complex spec: the reference (torch's own complex multiply) bitwise, and the real
    arithmetic that ATen's CPU vector body and the interpreter do, (a*c - b*d, a*d + b*c) with every
    product rounded to float32, element for element; the backward (the gradient times the
    conjugate) likewise."""
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(2, 3, 4, 32, generator=gen).to(dtype).requires_grad_()
    k = torch.randn(2, 3, 1, 32, generator=gen).to(dtype).requires_grad_()
    cos, sin = _complex_angles(2, 3, 16, gen)
    assert cos.stride(-1) == 2
    out = R.fused_rope(q, k, cos, sin, 2, COMPLEX)
    ref = R.rope_reference(q, k, cos, sin, 2, COMPLEX)
    for o, r, x in zip(out, ref, (q, k)):
        assert o.dtype == dtype and torch.equal(o, r)
        a, b = x.detach().float()[..., 0::2], x.detach().float()[..., 1::2]
        c, d = cos[:, :, None], sin[:, :, None]
        assert torch.equal(o[..., 0::2], (a * c - b * d).to(dtype))
        assert torch.equal(o[..., 1::2], (a * d + b * c).to(dtype))
    gs = tuple(torch.randn(o.shape, generator=gen).to(dtype) for o in out)
    got = torch.autograd.grad(out, (q, k), gs)
    want = torch.autograd.grad(ref, (q, k), gs)
    for a_, b_, g in zip(got, want, gs):
        assert a_.dtype == dtype and torch.equal(a_, b_)
        gr, gi = g.float()[..., 0::2], g.float()[..., 1::2]
        c, d = cos[:, :, None], sin[:, :, None]
        assert torch.equal(a_[..., 0::2], (gr * c + gi * d).to(dtype))
        assert torch.equal(a_[..., 1::2], (gi * c - gr * d).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_tail_spec_against_reference_and_float64(interpret, dtype):
    gen = torch.Generator().manual_seed(12)
    xb = torch.randn(2, 5, 3, 24, generator=gen).to(dtype).requires_grad_()
    x = xb.transpose(1, 2)
    theta = torch.randn(2, 5, 4, generator=gen, dtype=torch.float64)
    cos, sin = theta.cos().to(dtype), theta.sin().to(dtype)
    y = R.fused_rope(x, None, cos, sin, 1, TAIL)
    yr = R.rope_reference(x, None, cos, sin, 1, TAIL)
    assert y.dtype == dtype and torch.equal(y, yr)
    assert torch.equal(y[..., :16], x[..., :16])  # the leading columns pass through
    exact = RR._reference_one(x.detach().double(), cos.double(), sin.double(), 1, TAIL)
    eps = torch.finfo(dtype).eps
    assert ((y.double() - exact).abs() <= 1.5 * eps * x.detach().double().abs().amax(-1, keepdim=True)).all()
    g = torch.randn(y.shape, generator=gen).to(dtype)
    assert torch.equal(torch.autograd.grad(y, xb, g)[0], torch.autograd.grad(yr, xb, g)[0])


@pytest.mark.parametrize("spec", [TAIL, COMPLEX], ids=["tail", "complex"])
def test_poisoned_outputs_are_fully_written(interpret, spec):
    gen = torch.Generator().manual_seed(13)
    d = 32
    q = torch.randn(2, 4, 3, d, generator=gen).half()
    k = torch.randn(2, 4, 1, d, generator=gen).half()
    if spec.contract == "complex":
        cos, sin = _complex_angles(2, 4, d // 2, gen)
    else:
        theta = torch.randn(2, 4, d // 4, generator=gen)
        cos, sin = theta.cos().half(), theta.sin().half()
    plan = RL._get_plan(q, k, cos, sin, 2, spec)
    outs = [torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))]
    RL._forward(plan, q, k, cos, sin, outs=outs)
    ref = R.rope_reference(q, k, cos, sin, 2, spec)
    assert all(torch.equal(o, r) for o, r in zip(outs, ref))
    gq, gk = torch.randn(q.shape, generator=gen).half(), torch.randn(k.shape, generator=gen).half()
    dx = [torch.full(q.shape, float("nan"), dtype=q.dtype), torch.full(k.shape, float("nan"), dtype=k.dtype)]
    RL._backward(plan, (gq, gk), cos, sin, outs=dx)
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    want = torch.autograd.grad(R.rope_reference(qq, kk, cos, sin, 2, spec), (qq, kk), (gq, gk))
    assert all(torch.equal(a, b) for a, b in zip(dx, want))


def test_angles_with_a_step_of_two_and_other_steps(interpret):
    """cos/sin read with a step of 2 (the halves of a complex tensor), 3, or steps that differ give
    what contiguous copies give (more steps: test_rope_freqs_layout.py)."""
    gen = torch.Generator().manual_seed(14)
    q = torch.randn(2, 3, 4, 16, generator=gen)
    both = torch.randn(2, 4, 16, 2, generator=gen)
    cos, sin = both[..., 0], both[..., 1]
    want = R.fused_rope(q, q, cos.contiguous(), sin.contiguous(), 1, R.LLAMA)[0]
    assert torch.equal(R.fused_rope(q, q, cos, sin, 1, R.LLAMA)[0], want)
    three = torch.randn(2, 4, 16, 3, generator=gen)
    three[..., 0], three[..., 1] = cos, sin
    assert R.rope_kernel_ok(q, q, three[..., 0], three[..., 1], 1, R.LLAMA) == (True, "")
    assert torch.equal(R.fused_rope(q, q, three[..., 0], three[..., 1], 1, R.LLAMA)[0], want)
    assert torch.equal(R.fused_rope(q, q, cos, sin.contiguous(), 1, R.LLAMA)[0], want)


def test_nonfinite_inputs_where_eager_has_them(interpret, launches):
    """inf and nan in q give non-finite results exactly where Llama 4's eager complex multiply does."""
    mod, fn = _fn("llama4", "apply_rotary_emb")
    call = F._make_call(vars(mod), "apply_rotary_emb", vars(mod)["apply_rotary_emb"], F.recognise(fn))
    gen = torch.Generator().manual_seed(15)
    q = torch.randn(1, 2, 2, 32, generator=gen)
    k = torch.randn(1, 2, 1, 32, generator=gen)
    q[0, 0, 0, 3] = float("inf")
    q[0, 1, 1, 8] = float("nan")
    k[0, 1, 0, 0] = float("-inf")
    cis = torch.polar(torch.ones(1, 2, 16), torch.randn(1, 2, 16, generator=gen))
    got, want = call(q, k, cis), fn(q, k, cis)
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.isinf(), b.isinf())
        fin = b.isfinite()
        assert torch.equal(a[fin], b[fin])


# ---- tiny models of the families ------------------------------------------------------------------
def _tiny(family, dtype=torch.float32):
    """A tiny model of the family (fp32, eager attention, two or three layers, head dim 32: the
    complex multiply's 16 pairs)."""
    import transformers as tf

    if family == "llama4":
        cfg = tf.Llama4TextConfig(vocab_size=64, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                  num_local_experts=2, num_experts_per_tok=1, interleave_moe_layer_step=2,
                                  no_rope_layers=[1, 1], attention_chunk_size=8, max_position_embeddings=64)
        cls = tf.Llama4ForCausalLM
    elif family == "deepseek_v2":
        cfg = tf.DeepseekV2Config(vocab_size=64, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                  num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                                  kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=32, qk_nope_head_dim=16,
                                  v_head_dim=16, n_routed_experts=2, num_experts_per_tok=1, first_k_dense_replace=1,
                                  n_shared_experts=1, max_position_embeddings=64)
        cls = tf.DeepseekV2ForCausalLM
    elif family == "gptj":
        cfg = tf.GPTJConfig(vocab_size=64, n_embd=64, n_layer=2, n_head=2, rotary_dim=16, n_positions=64,
                            attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
        cls = tf.GPTJForCausalLM
    elif family == "codegen":
        # four heads: CodeGen splits the projections into four groups (transformers 5.17: heads // 4 each)
        cfg = tf.CodeGenConfig(vocab_size=64, n_embd=64, n_layer=2, n_head=4, rotary_dim=16, n_positions=64,
                               n_ctx=64, attn_pdrop=0.0, embd_pdrop=0.0, resid_pdrop=0.0)
        cls = tf.CodeGenForCausalLM
    else:
        raise ValueError(family)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return cls(cfg).to(dtype).train()


@pytest.mark.parametrize("family, expected", [
    ("llama4", "Llama4TextAttention.apply_rotary_emb: complex (interleaved, pair angles, complex multiply, float32)"),
    ("deepseek_v2", "DeepseekV2Attention.apply_rotary_emb: complex (interleaved, pair angles, complex multiply, "
                    "float32)"),
    ("gptj", "GPTJAttention.apply_rotary_pos_emb: every-two (interleaved, pair angles)"),
    ("codegen", "CodeGenAttention.apply_rotary_pos_emb: every-two (interleaved, pair angles)"),
])
def test_model_equals_unpatched(interpret, launches, monkeypatch, family, expected):
    """Loss and every parameter gradient bitwise equal to the unpatched model; the fused rotation
    ran in every attention layer (forward and backward). A freqs_cis whose pairs are not adjacent
    (transformers 5.17 builds it from a transposed product) runs the way the GPU runs it: eager's
    strided CPU loop rounds with FMA, as CUDA does, and the interpreter's tl.fma is given the GPU's
    single rounding (test_rope_freqs_layout.py)."""
    from deepspeed_fused import patch_model, unpatch_model

    model = _tiny(family)
    if family in ("llama4", "deepseek_v2"):
        cis = model.model.rotary_emb(torch.zeros(1, 16, 64), torch.arange(16)[None])
        if cis.stride(-1) != 1:
            from unit.test_rope_freqs_layout import emulate_cuda_rounding

            emulate_cuda_rounding(monkeypatch)
    ref = copy.deepcopy(model)
    rep = patch_model(model, {"rope": {"enabled": True}})["rope"]
    assert rep.applied and expected in rep.details["forms"], rep
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad for p in m.parameters()]

    before = launches.n
    loss, grads = step(model)
    assert rep.calls.fused > 0 and rep.calls.eager == 0, (rep.calls.fused, rep.calls.eager)
    assert launches.n - before == 2 * rep.calls.fused
    rloss, rgrads = step(ref)
    assert torch.equal(loss, rloss), (loss, rloss)
    for (n, _), a, b in zip(model.named_parameters(), grads, rgrads):
        assert (a is None) == (b is None), n
        assert a is None or torch.equal(a, b), n
    assert unpatch_model(model)["rope"] > 0


def test_complex_rounding_probe(interpret, monkeypatch):
    """The per-device probe that lets the complex forms run on a device: the kernel against that
    device's own complex multiply, forward and backward (CPU under the interpreter: 16 pairs, its
    vectorized body); a kernel that rounds otherwise is caught."""
    assert RL._probe_complex(torch.device("cpu"), p=16, layouts=("contiguous",)) == ""
    # 37 pairs: CPU's remainder rounds with FMA
    assert "rounds otherwise" in RL._probe_complex(torch.device("cpu"), layouts=("contiguous",))
    real = RL._forward

    def off_by_one_ulp(plan, q, k, cos, sin, outs=None):
        y, yk = real(plan, q, k, cos, sin, outs)
        return torch.nextafter(y, torch.full_like(y, float("inf"))), yk

    monkeypatch.setattr(RL, "_forward", off_by_one_ulp)
    assert "rounds otherwise" in RL._probe_complex(torch.device("cpu"), p=16, layouts=("contiguous",))
