"""The complex rope forms (Llama 4's and DeepSeek-V2's ``view_as_complex`` multiply by
``freqs_cis``) with the angles laid out as the models build them, and cos/sin of any last-dim
step.

Transformers 5.17's rotary embeddings of these families build ``freqs_cis`` from a transposed
matrix product: its pairs are ``seq_len`` apart, so cos and sin (the real and imaginary halves
viewed as real) have a last-dim step of ``2 * seq_len``. The kernels read cos and sin with steps of
their own. On CUDA every element of eager's complex multiply rounds with FMA (as the kernels there
do; the per-device probe checks it); on the CPU, ATen's strided loop rounds with FMA but its
vectorized body does not, and the interpreter's ``tl.fma`` is unfused, so the checks leave such CPU
calls to eager. To run on the CPU the path the GPU takes, :func:`as_on_cuda` gives the
interpreter a correctly rounded float32 FMA (as ``fma.rn.f32``) and lifts the CPU rule: the
fused call then equals eager's strided loop bit for bit, as it equals CUDA's.
"""
from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from deepspeed_fused.features import rope as F
from deepspeed_fused.ops import rope as R
from deepspeed_fused.ops._common import reset_fallback_warnings
from deepspeed_fused.ops.rope import checks as RC
from deepspeed_fused.ops.rope import launch as RL
from unit.test_rope_feature import Launches
from unit.test_rope_forms import COMPLEX, _fn


def _fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """x * y + z with one rounding to float32 (float32 inputs): the product is exact in float64,
    the float64 sum's error is kept (TwoSum), and a sum that lands exactly on a float32 midpoint is
    rounded toward that error (the one case where rounding the float64 sum again is wrong)."""
    with np.errstate(all="ignore"):
        p = x.astype(np.float64) * y.astype(np.float64)
        z64 = z.astype(np.float64)
        s = p + z64
        bp = s - p
        e = (p - (s - bp)) + (z64 - bp)
        r = s.astype(np.float32)
        r64 = r.astype(np.float64)
        other = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32))
        mid = np.isfinite(s) & np.isfinite(e) & (r64 != s) & ((r64 + other.astype(np.float64)) / 2 == s) & (e != 0)
        up = np.maximum(r, other)
        down = np.minimum(r, other)
        return np.where(mid & (e > 0), up, np.where(mid & (e < 0), down, r)).astype(np.float32)


def emulate_cuda_rounding(monkeypatch) -> None:
    """The interpreter's ``tl.fma`` rounded once, as the GPU's ``fma.rn.f32``; the CPU's complex
    rule lifted (the kernels take the complex calls the GPU takes)."""
    from triton.runtime import interpreter as ti

    real = ti.InterpreterBuilder.create_fma

    def create_fma(self, x, y, z):
        if x.data.dtype == y.data.dtype == z.data.dtype == np.float32:
            return ti.TensorHandle(_fma32(x.data, y.data, z.data), z.dtype.scalar)
        return real(self, x, y, z)

    monkeypatch.setattr(ti.InterpreterBuilder, "create_fma", create_fma)
    monkeypatch.setattr(RC, "_cpu_complex_reason", lambda pairs, cos, sin: "")


@pytest.fixture
def as_on_cuda(monkeypatch):
    emulate_cuda_rounding(monkeypatch)
    yield


def test_fma32_is_one_rounding():
    """The emulated FMA against exact rational arithmetic, midpoint cases included."""
    from fractions import Fraction

    gen = np.random.default_rng(0)
    x = gen.standard_normal(4000).astype(np.float32)
    y = gen.standard_normal(4000).astype(np.float32)
    z = (-(x.astype(np.float64) * y.astype(np.float64))).astype(np.float32)  # heavy cancellation
    z[::2] = gen.standard_normal(2000).astype(np.float32)
    # midpoints: x * y exactly half a float32 ulp off a float32, plus a tiny z pushing either way
    x[:4] = np.float32(1 + 2.0 ** -23)
    y[:4] = np.float32(1 + 2.0 ** -23)  # x * y = 1 + 2^-22 + 2^-46
    z[:4] = np.float32([2.0 ** -60, -(2.0 ** -60), 0.0, -(2.0 ** -47)])
    got = _fma32(x, y, z)

    def exact(a, b, c):
        v = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
        r = np.float32(float(v))  # float(v) is correctly rounded; ties below resolved exactly
        cands = [r, np.nextafter(r, np.float32(np.inf)), np.nextafter(r, np.float32(-np.inf))]
        best = min(cands, key=lambda t: (abs(Fraction(float(t)) - v), int(np.frombuffer(t.tobytes(), np.int32)[0]) & 1))
        return best

    for i in range(len(x)):
        assert got[i] == exact(x[i], y[i], z[i]), (i, x[i], y[i], z[i], got[i])


def test_fma_emulation_is_in_force(interpret, as_on_cuda):
    import triton
    import triton.language as tl

    @triton.jit
    def k(X, Y, Z, O):
        c = tl.arange(0, 4)
        tl.store(O + c, tl.fma(tl.load(X + c), tl.load(Y + c), tl.load(Z + c)))

    x = torch.full((4,), 1 + 2.0 ** -23)
    z = torch.full((4,), -(1 + 2.0 ** -22))
    o = torch.empty(4)
    k[(1,)](x, x, z, o)
    assert o.tolist() == [2.0 ** -46] * 4  # unfused: x * x rounds to 1 + 2^-22 first, giving 0


def _strided_cis(b, s, p, gen, scale=1.0):
    """freqs_cis as transformers 5.17 builds it: polar of a transposed [b, p, s] product."""
    theta = (torch.randn(b, p, s, generator=gen) * 3).transpose(1, 2)
    return torch.polar(torch.ones_like(theta), theta) * scale


def _family_inputs(family, gen, dtype, b=2, s=5, hq=3, hk=1, p=16):
    d = 2 * p
    qb = torch.randn(b, s, hq, d, generator=gen).to(dtype).requires_grad_()
    kb = torch.randn(b, s, hk, d, generator=gen).to(dtype).requires_grad_()
    if family == "llama4":  # [B, S, H, D], freqs_cis [B, S, P] times the attention scaling
        return (qb, kb), (qb, kb), _strided_cis(b, s, p, gen, 1.25)
    return (qb, kb), (qb.transpose(1, 2), kb.transpose(1, 2)), _strided_cis(b, s, p, gen)


def _call(family):
    mod, fn = _fn(family, "apply_rotary_emb")
    form = F.recognise(fn)
    assert isinstance(form, F.Form) and form.complex
    return F._make_call(vars(mod), "apply_rotary_emb", vars(mod)["apply_rotary_emb"], form), fn


@pytest.mark.parametrize("family", ["llama4", "deepseek_v2"])
def test_strided_freqs_on_the_cpu_run_eager(interpret, family):
    """On the CPU (without the GPU's rounding) such a freqs_cis runs eager, saying why."""
    call, fn = _call(family)
    leaves, views, cis = _family_inputs(family, torch.Generator().manual_seed(1), torch.float32)
    assert cis.stride(-1) != 1
    reset_fallback_warnings()
    with Launches() as launches, pytest.warns(RuntimeWarning, match="pairs are not adjacent.*runs eager"):
        got = call(*views, cis)
    assert launches.n == 0
    for a, b in zip(got, fn(*views, cis)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("p", [16, 48])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("family", ["llama4", "deepseek_v2"])
def test_strided_freqs_fused_as_on_cuda(interpret, as_on_cuda, family, dtype, p):
    """The path the GPU takes: the fused call with a strided freqs_cis equals eager's strided
    complex multiply bit for bit (outputs, their layout, and the gradients of q and k, one launch
    each way). Pair counts that are multiples of 16: ATen's strided CPU loop rounds a remainder
    past its unrolling without FMA (CUDA rounds every element alike)."""
    call, fn = _call(family)
    gen = torch.Generator().manual_seed(2 + p)
    leaves, views, cis = _family_inputs(family, gen, dtype, p=p)
    reset_fallback_warnings()
    with Launches() as launches, warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = call(*views, cis)
        assert launches.n == 1
        want = fn(*views, cis)
        for a, b in zip(got, want):
            assert a.dtype == b.dtype == dtype and torch.equal(a, b), (a.double() - b.double()).abs().max()
            assert [st for st, n in zip(a.stride(), a.shape) if n > 1] == \
                [st for st, n in zip(b.stride(), b.shape) if n > 1]
        gs = tuple(torch.randn(w.shape, generator=gen).to(dtype) for w in want)
        ga = torch.autograd.grad(got, leaves, gs)
        assert launches.n == 2
    gb = torch.autograd.grad(want, leaves, gs)
    for a, b in zip(ga, gb):
        assert torch.equal(a, b), (a.double() - b.double()).abs().max()


def test_strided_freqs_equal_contiguous_freqs(interpret, as_on_cuda):
    """The kernel reads a strided freqs_cis as its contiguous copy (the same numbers, any step)."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 7, 3, 32, generator=gen)
    cis = _strided_cis(2, 7, 16, gen)
    ri, rc = torch.view_as_real(cis), torch.view_as_real(cis.contiguous())
    assert ri[..., 0].stride(-1) == 14 and rc[..., 0].stride(-1) == 2
    a = R.fused_rope(x, None, ri[..., 0], ri[..., 1], 2, COMPLEX)
    b = R.fused_rope(x, None, rc[..., 0], rc[..., 1], 2, COMPLEX)
    assert torch.equal(a, b)


def test_probe_sees_both_layouts(interpret, monkeypatch):
    """The per-device probe checks a contiguous and a transposed freqs_cis: on the CPU the first
    matches the unfused kernel and the second does not (ATen's strided loop uses FMA); with the
    GPU's rounding it is the other way round."""
    cpu = torch.device("cpu")
    assert RL._probe_complex(cpu, p=16, layouts=("contiguous",)) == ""
    assert "transposed freqs_cis" in RL._probe_complex(cpu, p=16)
    assert "contiguous freqs_cis) rounds otherwise" in RL._probe_complex(cpu)  # 37 pairs: CPU's remainder


def test_probe_with_the_gpu_rounding(interpret, as_on_cuda):
    cpu = torch.device("cpu")
    assert RL._probe_complex(cpu, p=16, layouts=("transposed",)) == ""  # ATen's strided loop: FMA
    assert "contiguous freqs_cis" in RL._probe_complex(cpu, p=16)  # the CPU's vector body is unfused


@pytest.mark.parametrize("steps", [(3, 3), (1, 2), (5, 1), (0, 0)])
def test_angles_of_any_step(interpret, steps):
    """cos and sin with last-dim steps of their own (a zero step: one angle broadcast over the
    columns) give the reference's result, forward and backward."""
    gen = torch.Generator().manual_seed(4)
    qb = torch.randn(2, 4, 3, 16, generator=gen, dtype=torch.float16).requires_grad_()
    q = qb.transpose(1, 2)

    def angles(step):
        if step == 0:
            return torch.randn(2, 4, 1, generator=gen, dtype=torch.float16).expand(2, 4, 16)
        return torch.randn(2, 4, 16 * step, generator=gen, dtype=torch.float16)[..., ::step]

    cos, sin = angles(steps[0]), angles(steps[1])
    assert (cos.stride(-1), sin.stride(-1)) == steps
    assert R.rope_kernel_ok(q, q, cos, sin, 1, R.LLAMA) == (True, "")
    with Launches() as launches:
        out = R.fused_rope(q, None, cos, sin, 1, R.LLAMA)
        assert launches.n == 1
    ref = R.rope_reference(q, None, cos, sin, 1, R.LLAMA)
    assert torch.equal(out, ref)
    g = torch.randn(out.shape, generator=gen, dtype=torch.float16)
    assert torch.equal(torch.autograd.grad(out, qb, g)[0], torch.autograd.grad(ref, qb, g)[0])
