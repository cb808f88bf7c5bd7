"""Fused RoPE op: the kernels under the Triton interpreter on CPU (fp32/fp16, small shapes)
against the torch reference (bitwise, forward and backward), a float64 oracle, and eager
rejections and fallbacks."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not in every forked test: custom ops need it)

from deepspeed_fused.ops import rope as R
from deepspeed_fused.ops.rope import api as RA
from deepspeed_fused.ops.rope import launch as RL
from deepspeed_fused.ops.rope import reference as RR
from deepspeed_fused.ops._common import reset_fallback_warnings
from deepspeed_fused.ops.rope import RopeSpec

# every kind of spec the feature's forms map to
SPECS = {
    "llama": RopeSpec(),
    "llama-neg": RopeSpec(negate=True),
    "interleaved": RopeSpec(pairing="adjacent"),
    "partial": RopeSpec(partial=True),
    "partial-interleaved": RopeSpec(pairing="adjacent", partial=True),
    "glm": RopeSpec(pairing="adjacent", angles="pair_half"),
    "glm-partial": RopeSpec(pairing="adjacent", angles="pair_half", partial=True),
    "deinterleave": RopeSpec(pairing="adjacent", angles="pair_half", output="halves"),
    "half-width": RopeSpec(angles="pair"),
    "half-width-interleaved": RopeSpec(pairing="adjacent", angles="pair"),
    "cast-back": RopeSpec(out_dtype="input"),
    "float32-once": RopeSpec(pairing="adjacent", compute="float32", out_dtype="input", grad_accum="compute"),
    "float32-each": RopeSpec(compute="float32", out_dtype="input"),
    "glm-float32": RopeSpec(pairing="adjacent", angles="pair_half", compute="float32", out_dtype="input"),
}


def angle_width(spec: RopeSpec, d: int) -> int:
    """A cos width each spec takes for head dim d (partial: half the head rotated)."""
    if spec.angles == "position":
        return d // 2 if spec.partial else d
    if spec.angles == "pair_half":
        return d // 2 if spec.partial else d
    return d // 2


def make_inputs(spec, dtype, device, d=8, b=2, s=5, hq=3, hk=2, angle_dtype=None, bshd_views=True, gen=None,
                cos_batch=None):
    """q, k as Hugging Face passes them ([B, H, S, D] views of [B, S, H, D] projections, leaf
    tensors behind them) and cos/sin [B, S, width]."""
    gen = gen or torch.Generator().manual_seed(0)
    angle_dtype = angle_dtype or dtype
    qb = torch.randn(b, s, hq, d, generator=gen).to(device, dtype).requires_grad_()
    kb = torch.randn(b, s, hk, d, generator=gen).to(device, dtype).requires_grad_()
    q, k = (qb.transpose(1, 2), kb.transpose(1, 2)) if bshd_views else (qb, kb)
    w = angle_width(spec, d)
    theta = torch.randn(cos_batch or b, s, w, generator=gen, dtype=torch.float64) * 3
    cos = theta.cos().to(device, angle_dtype)
    sin = theta.sin().to(device, angle_dtype)
    return qb, kb, q, k, cos, sin


def grads_of(outs, leaves, gen, device):
    outs = outs if isinstance(outs, tuple) else (outs,)
    gs = tuple(torch.randn(o.shape, generator=gen).to(device, o.dtype) for o in outs)
    return gs, torch.autograd.grad(outs, leaves, gs)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_reference(interpret, name, dtype):
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(1)
    qb, kb, q, k, cos, sin = make_inputs(spec, dtype, interpret, gen=gen)
    out = R.fused_rope(q, k, cos, sin, 1, spec)
    ref = R.rope_reference(q, k, cos, sin, 1, spec)
    for o, r, x in zip(out, ref, (q, k)):
        assert o.dtype == r.dtype and o.shape == r.shape and o.stride() == torch.empty_like(x).stride()
        assert torch.equal(o, r)
    gs = tuple(torch.randn(o.shape, generator=gen).to(interpret, o.dtype) for o in out)
    got = torch.autograd.grad(out, (qb, kb), gs)
    want = torch.autograd.grad(ref, (qb, kb), gs)
    for a, b_ in zip(got, want):
        assert a.dtype == b_.dtype and torch.equal(a, b_)


@pytest.mark.parametrize("name", ["llama", "deinterleave", "glm-partial", "cast-back", "float32-once"])
def test_mixed_angle_dtype(interpret, name):
    """fp16 q/k with fp32 cos/sin: products in the promoted dtype, then (cast-back) to fp16."""
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(2)
    qb, kb, q, k, cos, sin = make_inputs(spec, torch.float16, interpret, angle_dtype=torch.float32, gen=gen)
    out = R.fused_rope(q, k, cos, sin, 1, spec)
    ref = R.rope_reference(q, k, cos, sin, 1, spec)
    assert out[0].dtype == R.output_dtype(spec, torch.float16, torch.float32)
    assert all(torch.equal(o, r) for o, r in zip(out, ref))
    gs = tuple(torch.randn(o.shape, generator=gen).to(interpret, o.dtype) for o in out)
    got = torch.autograd.grad(out, (qb, kb), gs)
    want = torch.autograd.grad(ref, (qb, kb), gs)
    assert all(a.dtype == torch.float16 and torch.equal(a, b_) for a, b_ in zip(got, want))


def _oracle(x, cos, sin, spec, ud=1):
    """The rotation in float64 (no rounding)."""
    return RR._reference_one(x.detach().double(), cos.double(), sin.double(), ud, spec)


@pytest.mark.parametrize("name", ["llama", "interleaved", "deinterleave", "glm-partial", "half-width"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_against_float64(interpret, name, dtype):
    """Each output is at most one rounding per product and one for the sum away from exact:
    within 1.5 ULP of the larger product's magnitude."""
    spec = SPECS[name]
    _, _, q, k, cos, sin = make_inputs(spec, dtype, interpret, d=16, s=7)
    out = R.fused_rope(q, k, cos, sin, 1, spec)
    eps = torch.finfo(dtype).eps
    for x, y in zip((q, k), out):
        exact = _oracle(x, cos, sin, spec)
        mag = x.detach().double().abs().amax(-1, keepdim=True) * 1.0  # |cos|, |sin| <= 1
        assert ((y.double() - exact).abs() <= 1.5 * eps * mag + 1e-30).all()


def test_poisoned_outputs(interpret):
    """Every output element (forward and backward, incl. the pass-through columns) is written."""
    spec = SPECS["partial"]
    gen = torch.Generator().manual_seed(3)
    _, _, q, k, cos, sin = make_inputs(spec, torch.float16, interpret, d=12, gen=gen)
    plan = RL._get_plan(q, k, cos, sin, 1, spec)
    assert plan.rdim == 6 and plan.head_dim == 12
    outs = [torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))]
    assert outs[0].stride() == plan.geos[0].y_strides
    RL._forward(plan, q.detach(), k.detach(), cos, sin, outs=outs)
    ref = R.rope_reference(q.detach(), k.detach(), cos, sin, 1, spec)
    assert all(torch.equal(o, r) for o, r in zip(outs, ref))
    gq, gk = torch.randn(q.shape, generator=gen).half(), torch.randn(k.shape, generator=gen).half()
    dx = [torch.full(q.shape, float("nan"), dtype=q.dtype), torch.full(k.shape, float("nan"), dtype=k.dtype)]
    assert dx[0].stride() == plan.geos[0].dx_strides
    RL._backward(plan, (gq, gk), cos, sin, outs=dx)
    qq, kk = q.detach().requires_grad_(), k.detach().requires_grad_()
    want = torch.autograd.grad(R.rope_reference(qq, kk, cos, sin, 1, spec), (qq, kk), (gq, gk))
    assert all(torch.equal(a, b_) for a, b_ in zip(dx, want))


@pytest.mark.parametrize("hq,hk,bshd", [(3, 2, True), (4, 1, True), (8, 2, False), (2, 5, True)])
@pytest.mark.parametrize("name", ["llama", "partial"])
def test_interleaved_q_and_k_tiles_write_every_element_as_eager(interpret, monkeypatch, hq, hk, bshd, name):
    """With ``_INTERLEAVE_QK`` the programs take q's and k's tiles in one proportional order (small
    tiles, so each tensor has many, in uneven numbers): every output and gradient element is
    written (poisoned first) and equals eager's, forward and backward."""
    spec = SPECS[name]
    monkeypatch.setattr(RL, "_TILE_PAIRS", 4)  # a few rows per tile: many programs of each tensor
    monkeypatch.setattr(RL, "_INTERLEAVE_QK", True)
    RL.clear_plans()
    try:
        gen = torch.Generator().manual_seed(11)
        _, _, q, k, cos, sin = make_inputs(spec, torch.float32, interpret, d=8, s=7, hq=hq, hk=hk, gen=gen)
        # [B, H, S, D] views of token-major projections (rows token by token), or contiguous (head by head)
        q, k = (q.detach(), k.detach()) if bshd else (q.detach().contiguous(), k.detach().contiguous())
        plan = RL._get_plan(q, k, cos, sin, 1, spec)
        assert plan.common["INTERLEAVE"] and plan.progs[0] > 4 and plan.progs[1] > 4 and plan.progs[0] != plan.progs[1]
        outs = [torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))]
        RL._forward(plan, q, k, cos, sin, outs=outs)
        assert all(torch.equal(o, r) for o, r in zip(outs, R.rope_reference(q, k, cos, sin, 1, spec)))
        gq, gk = torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)
        dx = [torch.full(q.shape, float("nan")), torch.full(k.shape, float("nan"))]
        RL._backward(plan, (gq, gk), cos, sin, outs=dx)
        qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
        want = torch.autograd.grad(R.rope_reference(qq, kk, cos, sin, 1, spec), (qq, kk), (gq, gk))
        assert all(torch.equal(a, b_) for a, b_ in zip(dx, want))
    finally:
        RL.clear_plans()


@pytest.mark.parametrize("layout", ["bhsd-view", "contiguous", "bshd-ud2", "qkv-slice", "cos-batch-1", "3d",
                                    "head-dim-strided"])
def test_layouts(interpret, layout):
    """Strided rows without copies: transposed views, contiguous, [B, S, H, D] with
    unsqueeze_dim=2, slices of a fused QKV projection, cos broadcast over the batch, 3-D
    [S, H, D] with unsqueeze_dim=-2 (vision towers), a strided head dim (ZAYA)."""
    spec = SPECS["llama"]
    gen = torch.Generator().manual_seed(4)
    dt, dev = torch.float16, interpret
    b, s, hq, hk, d = 2, 5, 3, 2, 8
    ud = 1
    cos_b = 1 if layout == "cos-batch-1" else b
    theta = torch.randn(cos_b, s, d, generator=gen, dtype=torch.float64)
    cos, sin = theta.cos().to(dev, dt), theta.sin().to(dev, dt)
    if layout in ("bhsd-view", "cos-batch-1"):
        qb = torch.randn(b, s, hq, d, generator=gen).to(dev, dt).requires_grad_()
        kb = torch.randn(b, s, hk, d, generator=gen).to(dev, dt).requires_grad_()
        q, k = qb.transpose(1, 2), kb.transpose(1, 2)
    elif layout == "contiguous":
        qb = torch.randn(b, hq, s, d, generator=gen).to(dev, dt).requires_grad_()
        kb = torch.randn(b, hk, s, d, generator=gen).to(dev, dt).requires_grad_()
        q, k = qb, kb
    elif layout == "bshd-ud2":
        qb = torch.randn(b, s, hq, d, generator=gen).to(dev, dt).requires_grad_()
        kb = torch.randn(b, s, hk, d, generator=gen).to(dev, dt).requires_grad_()
        q, k, ud = qb, kb, 2
    elif layout == "qkv-slice":
        qb = torch.randn(b, s, hq + 2 * hk, d, generator=gen).to(dev, dt).requires_grad_()
        kb = qb
        q, k = qb[:, :, :hq].transpose(1, 2), qb[:, :, hq:hq + hk].transpose(1, 2)
    elif layout == "head-dim-strided":  # ZAYA: q and k from a [B, C, S] convolution output, transposed
        qb = torch.randn(b, hq * d, s, generator=gen).to(dev, dt).requires_grad_()
        kb = torch.randn(b, hk * d, s, generator=gen).to(dev, dt).requires_grad_()
        q = qb.transpose(1, 2).view(b, s, hq, d).transpose(1, 2)
        k = kb.transpose(1, 2).view(b, s, hk, d).transpose(1, 2)
        assert q.stride(-1) != 1
    else:  # 3d
        qb = torch.randn(s, hq, d, generator=gen).to(dev, dt).requires_grad_()
        kb = torch.randn(s, hk, d, generator=gen).to(dev, dt).requires_grad_()
        q, k, ud = qb, kb, -2
        cos, sin = cos[0], sin[0]
    plan = RL._get_plan(q, k, cos, sin, ud, spec)
    assert isinstance(plan, RL._Plan), plan
    out = R.fused_rope(q, k, cos, sin, ud, spec)
    ref = R.rope_reference(q, k, cos, sin, ud, spec)
    for o, r, x in zip(out, ref, (q, k)):
        assert o.stride() == torch.empty_like(x).stride() and torch.equal(o, r)
        if layout != "qkv-slice":  # eager's elementwise result has the same layout (dense inputs)
            assert o.stride() == (x * cos.unsqueeze(ud)).stride()
    leaves = (qb,) if kb is qb else (qb, kb)
    gs = tuple(torch.randn(o.shape, generator=gen).to(dev, dt) for o in out)
    got = torch.autograd.grad(out, leaves, gs)
    want = torch.autograd.grad(ref, leaves, gs)
    assert all(torch.equal(a, b_) for a, b_ in zip(got, want))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("between", ["none", "norm", "scaled", "two-consumers"])
def test_projection_gradients_keep_the_inputs_layout(interpret, bias, between):
    """q and k straight from a projection (``proj(h).view(b, s, heads, d).transpose(1, 2)``): the
    input gradients come back in q's and k's own layout, so autograd's reshapes view them instead of
    copying, and every gradient of the layers before equals eager's bit for bit. With a norm
    between the projection and the transpose (Qwen3's q/k norms) the gradients stay contiguous, as
    eager's, and so where an op other than a reshape follows the projection; where q has another
    consumer after the transpose, its gradient is the sum autograd forms."""
    spec = SPECS["llama"]
    gen = torch.Generator().manual_seed(11)
    b, s, hq, hk, d, hidden = 2, 5, 4, 2, 8, 12
    dev, dt = interpret, torch.float32
    h = torch.randn(b, s, hidden, generator=gen).to(dev, dt).requires_grad_()
    pq, pk = torch.nn.Linear(hidden, hq * d, bias=bias), torch.nn.Linear(hidden, hk * d, bias=bias)
    pq, pk = pq.to(dev, dt), pk.to(dev, dt)
    theta = torch.randn(b, s, d, generator=gen, dtype=torch.float64)
    cos, sin = theta.cos().to(dev, dt), theta.sin().to(dev, dt)
    gq, gk = torch.randn(b, hq, s, d, generator=gen).to(dev, dt), torch.randn(b, hk, s, d, generator=gen).to(dev, dt)
    norm_w = torch.randn(d, generator=gen).to(dev, dt)
    leaves = (h, pq.weight, pk.weight) + ((pq.bias, pk.bias) if bias else ())

    def step(fn):
        q, k = pq(h), pk(h)
        if between == "scaled":
            q, k = q * 0.5, k * 0.5
        q, k = q.view(b, s, hq, d), k.view(b, s, hk, d)
        if between == "norm":
            q, k = (torch.nn.functional.rms_norm(x, (d,), norm_w) for x in (q, k))
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        seen = {}
        q.register_hook(lambda g: seen.setdefault("q", g.stride()) and None)
        k.register_hook(lambda g: seen.setdefault("k", g.stride()) and None)
        yq, yk = fn(q, k, cos, sin, 1, spec)
        loss = (yq * gq).sum() + (yk * gk).sum()
        if between == "two-consumers":
            loss = loss + (q * gq).sum()
        return torch.autograd.grad(loss, leaves), seen, (q.stride(), k.stride())

    got, seen, strides = step(R.fused_rope)
    want, seen_eager, _ = step(R.rope_reference)
    assert all(torch.equal(a, w) for a, w in zip(got, want))
    contiguous = (torch.empty(b, hq, s, d).stride(), torch.empty(b, hk, s, d).stride())
    if between == "none":
        assert (seen["q"], seen["k"]) == strides != contiguous  # the inputs' own layout
    elif between in ("norm", "scaled"):
        assert (seen["q"], seen["k"]) == contiguous
    else:  # the rope's gradient of q is contiguous; k, read by the rope alone, keeps its layout
        assert seen["k"] == strides[1]


def test_strided_gradient_and_unused_output(interpret):
    """A gradient in another layout than the output (read through its strides), and an unused k
    output: k gets no gradient, as in eager."""
    spec = SPECS["interleaved"]
    gen = torch.Generator().manual_seed(5)
    qb, kb, q, k, cos, sin = make_inputs(spec, torch.float32, interpret, gen=gen)
    yq, yk = R.fused_rope(q, k, cos, sin, 1, spec)
    g = torch.randn(yq.shape[::-1], generator=gen).permute(3, 2, 1, 0)  # a differently strided gradient
    dq, dk = torch.autograd.grad(yq, (qb, kb), g, allow_unused=True)
    assert dk is None
    rq, _ = R.rope_reference(q, k, cos, sin, 1, spec)
    (want,) = torch.autograd.grad(rq, (qb,), g)
    assert torch.equal(dq, want)


def test_single_tensor_and_no_grad(interpret):
    spec = SPECS["llama"]
    _, _, q, _, cos, sin = make_inputs(spec, torch.float16, interpret)
    y = R.fused_rope(q, None, cos, sin, 1, spec)
    assert isinstance(y, torch.Tensor) and y.grad_fn is not None
    assert torch.equal(y, R.rope_reference(q, None, cos, sin, 1, spec))
    with torch.no_grad():
        y2 = R.fused_rope(q, None, cos, sin, 1, spec)
    assert y2.grad_fn is None and torch.equal(y2, y)


def test_double_backward_raises(interpret):
    spec = SPECS["llama"]
    qb, kb, q, k, cos, sin = make_inputs(spec, torch.float32, interpret)
    yq, yk = R.fused_rope(q, k, cos, sin, 1, spec)
    (dq,) = torch.autograd.grad((yq * yq).sum() + yk.sum(), (qb,), create_graph=True)
    with pytest.raises(RuntimeError):
        dq.sum().backward()


def test_zero_rows(interpret):
    spec = SPECS["llama"]
    q = torch.randn(2, 3, 0, 8, requires_grad=True)
    cos = torch.randn(2, 0, 8)
    yq, yk = R.fused_rope(q, q, cos, cos.clone(), 1, spec)
    assert yq.shape == (2, 3, 0, 8)
    (dq,) = torch.autograd.grad(yq.sum() + yk.sum(), (q,))
    assert dq.shape == q.shape


@pytest.mark.parametrize("case, reason", [
    ("float64", "dtype torch.float64"),
    ("cos-grad", "cos/sin require grad"),
    ("cos-sin-dtypes", "different dtypes"),
    ("qk-dtypes", "q (torch.float16) and k (torch.float32)"),
    ("width-1", "width 1"),
    ("grow", "larger shape"),
    ("5d", "5 dims"),
])
def test_fallbacks_warn_and_match_reference(interpret, case, reason):
    """Valid inputs the kernels do not take run the reference, with one warning naming why."""
    spec = SPECS["llama"]
    dt = torch.float16
    q = torch.randn(2, 3, 4, 8, dtype=dt)
    k = torch.randn(2, 2, 4, 8, dtype=dt)
    cos, sin = torch.randn(2, 4, 8, dtype=dt), torch.randn(2, 4, 8, dtype=dt)
    ud = 1
    if case == "float64":
        q, k, cos, sin = q.double(), k.double(), cos.double(), sin.double()
    elif case == "cos-grad":
        cos.requires_grad_()
    elif case == "cos-sin-dtypes":
        sin = sin.float()
    elif case == "qk-dtypes":
        k = k.float()
    elif case == "width-1":
        cos, sin = cos[..., :1].contiguous(), sin[..., :1].contiguous()
    elif case == "grow":
        q, k = q[:1], k[:1]
    elif case == "5d":
        q, k = q[None], k[None]
    reset_fallback_warnings()
    ok, why = R.rope_kernel_ok(q, k, cos, sin, ud, spec)
    assert not ok and reason in why, why
    assert R.try_fused_rope(q, k, cos, sin, ud, spec) is None
    with pytest.warns(RuntimeWarning, match="deepspeed_fused.rope: running the torch reference"):
        out = R.fused_rope(q, k, cos, sin, ud, spec)
    ref = R.rope_reference(q, k, cos, sin, ud, spec)
    assert all(torch.equal(o, r) for o, r in zip(out, ref))


def test_cpu_without_interpreter_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    q = torch.randn(1, 2, 3, 8)
    ok, why = R.rope_kernel_ok(q, q, torch.randn(1, 3, 8), torch.randn(1, 3, 8))
    assert not ok and "cpu" in why


@pytest.mark.parametrize("case, exc, match", [
    ("q-not-tensor", TypeError, "q must be a tensor"),
    ("int-q", TypeError, "floating-point"),
    ("ud-type", TypeError, "unsqueeze_dim must be an int"),
    ("ud-range", ValueError, "out of range"),
    ("width", ValueError, "does not match the head dim"),
    ("broadcast", ValueError, "do not broadcast"),
    ("spec", TypeError, "spec must be a RopeSpec"),
    ("odd", ValueError, "rotary dim must be even"),
])
def test_invalid_inputs_raise(interpret, case, exc, match):
    q = torch.randn(2, 3, 4, 8)
    cos, sin = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    args = [q, q, cos, sin, 1, R.LLAMA]
    if case == "q-not-tensor":
        args[0] = [1.0]
    elif case == "int-q":
        args[0] = args[1] = torch.ones(2, 3, 4, 8, dtype=torch.int32)
    elif case == "ud-type":
        args[4] = 1.0
    elif case == "ud-range":
        args[4] = 7
    elif case == "width":
        args[2], args[3] = cos[..., :6], sin[..., :6]
    elif case == "broadcast":
        args[2], args[3] = torch.randn(3, 4, 8), torch.randn(3, 4, 8)
    elif case == "spec":
        args[5] = "llama"
    elif case == "odd":
        args[0] = args[1] = q[..., :7]
        args[2], args[3] = cos[..., :7].contiguous(), sin[..., :7].contiguous()
    with pytest.raises(exc, match=match):
        R.fused_rope(*args)


def test_spec_codes_round_trip():
    for spec in SPECS.values():
        assert RopeSpec.from_code(spec.code) == spec
    with pytest.raises(ValueError, match="pairing"):
        RopeSpec(pairing="diagonal")
    with pytest.raises(ValueError, match="halves"):
        RopeSpec(output="halves")


def test_custom_op_matches_and_opcheck(interpret):
    """The torch.compile path: the custom ops (forward list output, backward through
    register_autograd) equal the eager kernels; torch.library.opcheck passes."""
    spec = SPECS["glm-partial"]
    gen = torch.Generator().manual_seed(6)
    qb, kb, q, k, cos, sin = make_inputs(spec, torch.float32, interpret, gen=gen)
    yq, yk = RA._rope_fwd_op(q, k, cos, sin, 1, spec.code)
    ref = R.rope_reference(q, k, cos, sin, 1, spec)
    assert torch.equal(yq, ref[0]) and torch.equal(yk, ref[1])
    gs = tuple(torch.randn(o.shape, generator=gen) for o in ref)
    got = torch.autograd.grad((yq, yk), (qb, kb), gs)
    want = torch.autograd.grad(ref, (qb, kb), gs)
    assert all(torch.equal(a, b_) for a, b_ in zip(got, want))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.library.opcheck(RA._rope_fwd_op, (q.detach().requires_grad_(), k.detach().requires_grad_(), cos, sin, 1,
                                               spec.code))
        _, _, q1, _, c1, s1 = make_inputs(R.LLAMA, torch.float32, interpret, gen=gen)
        torch.library.opcheck(RA._rope_fwd_op, (q1.detach().requires_grad_(), None, c1, s1, 1, R.LLAMA.code))


def test_a_cached_plan_never_skips_a_check(interpret):
    """Inputs that differ from a planned call only where the key must tell them apart (sin's
    shape with equal strides) are checked afresh."""
    q = torch.randn(2, 3, 4, 8)
    cos, sin = torch.randn(2, 4, 8), torch.randn(2, 4, 8)
    R.fused_rope(q, q, cos, sin)
    short = torch.randn(1, 4, 8)  # the same strides as sin's
    assert short.stride() == sin.stride()
    ok, why = R.rope_kernel_ok(q, q, cos, short)
    assert not ok and "different shapes" in why


def test_plans_are_reused(interpret):
    spec = SPECS["llama"]
    R.clear_plans()
    _, _, q, k, cos, sin = make_inputs(spec, torch.float32, interpret)
    R.fused_rope(q, k, cos, sin)
    assert len(RL._plans) == 1
    R.fused_rope(q, k, cos, sin)
    assert len(RL._plans) == 1
    R.fused_rope(q.detach().contiguous(), k, cos, sin)
    assert len(RL._plans) == 2
