"""The exact (erf) GELU of ``mlp_act`` as CUDA eager computes it, checked on CPU: the kernels' erf is
CUDA's ``erff`` (libdevice of CUDA 12.6 to 13.0, which nvcc builds ATen's GELU with), not the older
``__nv_erff`` of the libdevice bundled with Triton; the backward's ``cdf + x * pdf`` contracts as
nvcc contracts it. Two views: the PTX that Triton compiles for an H100 (no GPU needed to compile),
and the interpreted kernels against a step-by-step model of that arithmetic. The launch plan
(flat row-major launches) is checked here too."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch

from deepspeed_fused.ops import mlp_act as M
from deepspeed_fused.ops.mlp_act import kernels as K
from deepspeed_fused.ops.mlp_act import launch as L

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
F32 = np.float32


def _hex(v: float) -> str:
    return "0f%08X" % int(np.array(v, dtype=F32).view(np.uint32))


# the far-branch coefficients of the older __nv_erff in Triton 3.6's bundled libdevice
_OLD_ERF_Q = ("0f3789CA3C", "0fB9F560B9", "0f3BAC840B", "0fBD0C8162", "0f3E1CF906", "0f3F6A937E", "0f3F20D842")

_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepspeed_fused.ops.mlp_act import kernels as K
out = {}
for name, fn in (("fwd", K._gated_fwd_kernel), ("bwd", K._gated_bwd_kernel)):
    sig = {n: ("constexpr" if n.isupper() and len(n) > 2 else "*fp32" if n.isupper() else "i32") for n in fn.arg_names}
    const = dict(ACT=2, EXACT_EXP=True, BLOCK_R=1, BLOCK_C=128, FLAT=True)
    if name == "fwd":
        const.update(FAST_SILU=False, SILU_PACK=1)
    src = ASTSource(fn=fn, signature=sig, constexprs=const)
    out[name] = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=1)).asm["ptx"]
json.dump(out, sys.stdout)
"""


def compile_for_h100(script: str):
    """What ``script`` (Python that compiles kernels for sm_90 and prints JSON) prints, run in a fresh
    process without the interpreter: this one defined the kernels for it."""
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def ptx():
    return compile_for_h100(_COMPILE)


def _ops(text: str) -> list:
    return [ln.strip() for ln in text.splitlines() if re.match(r"\s*(fma|mul|add|sub|ex2|selp)\.", ln)]


def test_compiled_erf_is_cuda_erff(ptx):
    for name, text in ptx.items():
        lits = set(re.findall(r"0f[0-9A-F]{8}", text))
        wanted = {_hex(c) for c in K.ERF_P + K.ERF_Q} | {_hex(K.ERF_SPLIT)}
        assert wanted <= lits, (name, sorted(wanted - lits))
        assert not lits & set(_OLD_ERF_Q), (name, sorted(lits & set(_OLD_ERF_Q)))
        ops = _ops(text)
        assert any(op.startswith("ex2.approx.ftz.f32") for op in ops), name
        # nvcc builds erff without flushing subnormals: fma.rn.f32, 7 per erf (6 Horner steps, 1 final)
        polys = [op for op in ops if op.startswith("fma.rn.f32")]
        assert len(polys) >= 7, (name, polys)


def test_compiled_gelu_contractions_are_nvccs(ptx):
    # forward x * 0.5 * (1 + erf): no FMA outside the erf; backward cdf + x * pdf: nvcc contracts
    # 0.5 * (1 + erf) into the sum, x * pdf stays a product of its own
    half = [op for op in _ops(ptx["fwd"]) if op.startswith("fma") and "0f3F000000" in op]
    assert not half, half
    half = [op for op in _ops(ptx["bwd"]) if op.startswith("fma") and "0f3F000000" in op]
    assert half and all(op.startswith("fma.rn.f32") for op in half), half


@pytest.fixture
def interpreted():
    # the model stands for the interpreter's arithmetic (exp2 for ex2.approx); on a GPU the GPU tests
    # compare with CUDA eager itself
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs the kernels interpreted on CPU")
    return "cpu"


def _fma(a, b, c):
    # FP32 a * b + c rounded once (FP64 holds the product exactly), as the interpreted kernels do
    return (a.astype(np.float64) * b.astype(np.float64) + c.astype(np.float64)).astype(F32)


def _erf_model(a: np.ndarray) -> np.ndarray:
    """CUDA's erff step for step; ex2.approx as numpy's exp2 (as the interpreter runs it)."""
    ax = np.abs(a)
    far = ax >= F32(K.ERF_SPLIT)
    t = np.where(far, ax, a * a)
    p = np.where(far, F32(K.ERF_Q[0]), F32(K.ERF_P[0])).astype(F32)
    for q, s in zip(K.ERF_Q[1:], K.ERF_P[1:]):
        p = _fma(p, t, np.where(far, F32(q), F32(s)).astype(F32))
    s = np.where(far, -ax, a)
    r = _fma(p, s, s)
    with np.errstate(over="ignore"):
        e = F32(1) - np.exp2(r)
    return np.where(far, np.copysign(e, a), r)


def _points():
    rng = np.random.default_rng(3)
    x = np.concatenate([rng.uniform(-6, 6, 6000), rng.normal(0, 1, 3000), rng.uniform(-1.5, 1.5, 3000),
                        np.linspace(1.4, 1.44, 500), -np.linspace(1.4, 1.44, 500),
                        [0.0, -0.0, 1e-30, -1e-30, 15.0, -15.0, 1e30, -1e30]]).astype(F32)
    return x


def test_erf_model_is_erf():
    # the coefficients read from libdevice: the model is erf within 2 FP32 ULP everywhere
    x = _points()
    ref = np.array([math.erf(float(v)) for v in x])
    got = _erf_model(x).astype(np.float64)
    ulps = np.abs(got - ref) / np.spacing(np.abs(ref).astype(F32)).astype(np.float64).clip(min=1e-45)
    assert ulps.max() <= 2, (float(ulps.max()), float(x[ulps.argmax()]))


def test_interpreted_gelu_is_the_model_bit_for_bit(interpreted):
    # act(gate) * 1 is act(gate); its gate gradient for dh = 1, up = 1 is gelu'(gate): both are the
    # model's arithmetic exactly (the interpreter's exp2/exp stand for ex2.approx/expf)
    x = _points()
    g = torch.from_numpy(x).reshape(1, -1).to(interpreted)
    u = torch.ones_like(g)
    gr, ur = g.clone().requires_grad_(), u.clone().requires_grad_()
    y = M.mlp_act(gr, ur, "gelu")
    (dg, _) = torch.autograd.grad(y, (gr, ur), torch.ones_like(g))
    xs = x * F32(K.K_ALPHA)
    erf = _erf_model(xs)
    want = (x * F32(0.5)) * (F32(1) + erf)
    assert np.array_equal(y.detach().numpy().ravel(), want.astype(F32))
    with np.errstate(over="ignore"):
        pdf = np.exp(F32(-0.5) * x * x) * F32(K.K_BETA_ERF)
    dwant = _fma(F32(1) + erf, np.full_like(x, 0.5), x * pdf)
    assert np.array_equal(dg.numpy().ravel(), dwant)


def test_plan_flat_for_row_contiguous_tensors():
    g = torch.empty(4096, 14336)
    scalars, grid, const, warps = L.plan(*g.shape, g, g, g)
    assert scalars == (1, 4096 * 14336, 4096 * 14336 // 2048, 0, 0, 0)
    assert grid == (4096 * 14336 // 2048,) and const == dict(BLOCK_R=1, BLOCK_C=2048, FLAT=True) and warps == 8
    # the forward's flat blocks are twice as long
    scalars, grid, const, warps = L.plan(*g.shape, g, g, g, flat_block=L.FLAT_BLOCK_FWD)
    assert L.FLAT_BLOCK_FWD == 4096 and scalars == (1, 4096 * 14336, 4096 * 14336 // 4096, 0, 0, 0)
    assert grid == (4096 * 14336 // 4096,) and const == dict(BLOCK_R=1, BLOCK_C=4096, FLAT=True) and warps == 8
    # a gate-up projection's halves are rows 2 I apart: the rows as they are, column block fastest
    gu = torch.empty(100, 2 * 6912)
    gate, up = L.halves(gu, True)
    h = torch.empty(100, 6912)
    scalars, grid, const, warps = L.plan(100, 6912, gate, up, h)
    n_cb = -(-6912 // const["BLOCK_C"])
    assert const["FLAT"] is False
    assert scalars == (100, 6912, n_cb, 2 * 6912, 2 * 6912, 6912)
    assert grid == (-(-100 // const["BLOCK_R"]) * n_cb,)
    # small: one program of a power of two
    g = torch.empty(3, 24)
    scalars, grid, const, warps = L.plan(3, 24, g)
    assert scalars == (1, 72, 1, 0) and const["BLOCK_C"] == 128 and const["FLAT"] and warps == 1
