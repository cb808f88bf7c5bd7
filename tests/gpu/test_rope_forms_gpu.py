"""The rope forms of tests/unit/test_rope_forms.py on the GPU: each transformers function against
the fused call (bf16/fp16/fp32, forward and backward, bitwise, realistic shapes, pair counts that
are not multiples of 16 included: CUDA's complex multiply rounds every element alike), CUDA's
complex multiply against the kernel's FMA formula element for element, the tail and complex
specs against the reference, and tiny models of the families in bf16/fp16/fp32 equal to unpatched.
Each body runs in a clean worker (tests/conftest.py): tensors are built inside the bodies."""
from __future__ import annotations

import copy

import pytest
import torch

from deepspeed_fused import patch_model, unpatch_model
from deepspeed_fused.features import rope as F
from deepspeed_fused.ops import rope as R
from unit.test_rope_feature import Launches
from unit.test_rope_forms import COMPLEX, FUNCTIONS, TAIL, _call_and_eager, _fn, _tiny

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [  # b, s, q heads, kv heads, head dim
    dict(b=2, s=300, hq=8, hk=2, d=128),
    dict(b=1, s=513, hq=16, hk=1, d=64),
    dict(b=3, s=17, hq=5, hk=1, d=74),  # 37 pairs
]


@pytest.mark.parametrize("shape", range(len(SHAPES)))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family, name, form_name", FUNCTIONS)
def test_function_equals_its_eager_code(family, name, form_name, dtype, shape):
    sh = dict(SHAPES[shape])
    if family in ("deepseek_v4", "qwen4_exp") and sh["d"] % 4:
        pytest.skip("a quarter of the head: needs d % 4 == 0")
    with Launches() as launches:
        leaves, got, want, gen = _call_and_eager(family, name, dtype, launches, seed=shape, device="cuda", **sh)
        got = got if isinstance(got, tuple) else (got,)
        want = want if isinstance(want, tuple) else (want,)
        for a, b in zip(got, want):
            assert (a is None) == (b is None)
            if b is not None:
                assert a.dtype == b.dtype and a.shape == b.shape
                assert torch.equal(a, b), (a.float() - b.float()).abs().max()
        got = [t for t in got if t is not None]
        want = [t for t in want if t is not None]
        gs = tuple(torch.randn(w.shape, generator=gen).to("cuda", w.dtype) for w in want)
        before = launches.n
        ga = torch.autograd.grad(got, leaves, gs)
        assert launches.n == before + 1
    gb = torch.autograd.grad(want, leaves, gs)
    for a, b in zip(ga, gb):
        assert a.dtype == b.dtype and torch.equal(a, b), (a.float() - b.float()).abs().max()


def test_complex_rounding_probe_passes():
    """The probe that lets the complex forms run on this device passes (else they run eager)."""
    from deepspeed_fused.ops.rope import launch as RL

    assert RL._complex_rounding(torch.device("cuda", torch.cuda.current_device())) == ""


def test_cuda_complex_multiply_is_the_kernels_formula():
    """CUDA's complex64 multiply (forward, and the backward's gradient times the conjugate) gives
    fma(a, c, -(b * d)) and fma(a, d, b * c) for every element; the formula is emulated here in
    float64 (a * c is exact there; the float64 sum and its rounding to float32 agree with one fused
    rounding except in double-rounding cases, which the count allows)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 300, 8, 37, 2, generator=gen).cuda()
    w = torch.randn(4, 300, 1, 37, 2, generator=gen).cuda()
    xc = torch.view_as_complex(x).requires_grad_()
    y = torch.view_as_real(xc * torch.view_as_complex(w))
    g = torch.randn(y.shape, generator=gen).cuda()
    y.backward(g)
    gx = torch.view_as_real(xc.grad)
    a, b = x[..., 0].double(), x[..., 1].double()
    c, d = w[..., 0].double().expand_as(a), w[..., 1].double().expand_as(a)

    def fma(p, q, r):  # p * q + r with one rounding to float32 (emulated)
        return (p * q + r.double()).float()

    n = a.numel()
    bad_re = (fma(a, c, -(b * d).float()) != y[..., 0]).sum().item()
    bad_im = (fma(a, d, (b * c).float()) != y[..., 1]).sum().item()
    assert bad_re <= n * 1e-5 and bad_im <= n * 1e-5, (bad_re, bad_im, n)
    gr, gi = g[..., 0].double(), g[..., 1].double()
    bad_re = (fma(gr, c, (gi * d).float()) != gx[..., 0]).sum().item()
    bad_im = (fma(gr, -d, (gi * c).float()) != gx[..., 1]).sum().item()
    assert bad_re <= n * 1e-5 and bad_im <= n * 1e-5, (bad_re, bad_im, n)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", [TAIL, COMPLEX], ids=["tail", "complex"])
def test_specs_against_reference(spec, dtype):
    gen = torch.Generator().manual_seed(1)
    d = 128
    qb = torch.randn(2, 300, 8, d, generator=gen).to("cuda", dtype).requires_grad_()
    kb = torch.randn(2, 300, 1, d, generator=gen).to("cuda", dtype).requires_grad_()
    q, k = qb.transpose(1, 2), kb.transpose(1, 2)
    theta = torch.randn(2, 300, d // 2 if spec.contract == "complex" else d // 4, generator=gen).cuda()
    if spec.contract == "complex":
        ri = torch.view_as_real(torch.polar(torch.ones_like(theta), theta))
        cos, sin = ri[..., 0], ri[..., 1]
    else:
        cos, sin = theta.cos().to(dtype), theta.sin().to(dtype)
    out = R.fused_rope(q, k, cos, sin, 1, spec)
    ref = R.rope_reference(q, k, cos, sin, 1, spec)
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype == dtype and torch.equal(o, r), (o.float() - r.float()).abs().max()
    gs = tuple(torch.randn(o.shape, generator=gen).to("cuda", dtype) for o in out)
    for a, b in zip(torch.autograd.grad(out, (qb, kb), gs), torch.autograd.grad(ref, (qb, kb), gs)):
        assert torch.equal(a, b), (a.float() - b.float()).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", ["llama4", "deepseek_v2", "gptj", "codegen"])
def test_models_equal_unpatched(family, dtype):
    model = _tiny(family, dtype).cuda()
    ref = copy.deepcopy(model)
    rep = patch_model(model, {"rope": {"enabled": True}})["rope"]
    assert rep.applied, rep
    ids = torch.randint(0, 64, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def step(m):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), [p.grad for p in m.parameters()]

    loss, grads = step(model)
    assert rep.calls.fused > 0 and rep.calls.eager == 0
    rloss, rgrads = step(ref)
    assert torch.equal(loss, rloss)
    for a, b in zip(grads, rgrads):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b))
    assert unpatch_model(model)["rope"] > 0


def test_recognised():
    for family, name, form_name in FUNCTIONS:
        assert F.recognise(_fn(family, name)[1]).name == form_name
