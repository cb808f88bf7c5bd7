"""Per-position angles built as Hugging Face builds them (each pair's two columns the same value)
are read once: the kernel's ``SAME`` flag, compared on the device, cached per cos/sin tensor and
version. Under the Triton interpreter on CPU (fp32/fp16): results equal the reference bit for bit
with the flag on and off, the flag never claims halves that differ (signed zeros, NaNs, an
in-place write after a call), and with the flag on the second columns are not read."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from deepspeed_fused.ops import rope as R
from deepspeed_fused.ops.rope import launch as RL
from deepspeed_fused.ops.rope import RopeSpec

from unit.test_rope import SPECS, angle_width

# the specs whose angles are per position (a cos column per rotated column)
POSITION = [n for n, s in SPECS.items() if s.angles == "position"]


def shared_angles(spec: RopeSpec, width: int, device, b=2, s=5, gen=None, dtype=torch.float32):
    """cos/sin [b, s, width] on ``device`` whose pairs share their angle: halves concatenated
    (rotate_half forms), or each angle repeated in place (adjacent pairs)."""
    theta = torch.randn(b, s, width // 2, generator=gen, dtype=torch.float64) * 3
    full = theta.repeat_interleave(2, dim=-1) if spec.pairing == "adjacent" else torch.cat([theta, theta], -1)
    return full.cos().to(device, dtype), full.sin().to(device, dtype)


def qk(device, dtype, d=8, b=2, s=5, hq=3, hk=2, gen=None):
    qb = torch.randn(b, s, hq, d, generator=gen).to(device, dtype)
    kb = torch.randn(b, s, hk, d, generator=gen).to(device, dtype)
    return qb.transpose(1, 2), kb.transpose(1, 2)


def check_against_reference(q, k, cos, sin, spec, gen):
    """fused_rope's outputs and input gradients equal the reference's, bit for bit (NaN where it
    has NaN)."""
    qq, kk = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    out = R.fused_rope(qq, kk, cos, sin, 1, spec)
    qr, kr = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
    ref = R.rope_reference(qr, kr, cos, sin, 1, spec)
    for o, r in zip(out, ref):
        torch.testing.assert_close(o, r, rtol=0, atol=0, equal_nan=True)
    gs = tuple(torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in out)
    got = torch.autograd.grad(out, (qq, kk), gs)
    want = torch.autograd.grad(ref, (qr, kr), gs)
    for a, b_ in zip(got, want):
        torch.testing.assert_close(a, b_, rtol=0, atol=0, equal_nan=True)


def flag(q, k, cos, sin, spec) -> int:
    return int(RL._same_halves(RL._get_plan(q, k, cos, sin, 1, spec), cos, sin))


@pytest.mark.parametrize("name", POSITION)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_shared_angles_set_the_flag_and_match_the_reference(interpret, name, dtype):
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(5)
    q, k = qk(interpret, dtype, gen=gen)
    cos, sin = shared_angles(spec, angle_width(spec, 8), interpret, gen=gen, dtype=dtype)
    assert flag(q, k, cos, sin, spec) == 1
    check_against_reference(q, k, cos, sin, spec, gen)


@pytest.mark.parametrize("name", ["llama", "interleaved", "partial"])
def test_flag_on_reads_only_the_first_columns(interpret, name):
    """The second column of each pair poisoned (NaN): with the flag forced on the results are
    those of angles whose second columns copy the first; forced off, the poison reaches them (so
    the flag is what decides which columns are read)."""
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(6)
    q, k = qk(interpret, torch.float32, gen=gen)
    cos, sin = shared_angles(spec, angle_width(spec, 8), interpret, gen=gen)
    second = slice(1, None, 2) if spec.pairing == "adjacent" else slice(cos.shape[-1] // 2, None)
    pc, ps = cos.clone(), sin.clone()
    pc[..., second] = float("nan")
    ps[..., second] = float("nan")
    plan = RL._get_plan(q, k, pc, ps, 1, spec)
    assert RL._same_halves(plan, pc, ps).item() == 0  # the poisoned halves differ
    on = torch.ones((), dtype=torch.int32, device=interpret)
    off = torch.zeros((), dtype=torch.int32, device=interpret)
    want = R.rope_reference(q, k, cos, sin, 1, spec)
    got = RL._forward(plan, q, k, pc, ps, same=on)
    assert all(torch.equal(a, b_) for a, b_ in zip(got, want))
    gq, gk = torch.randn(q.shape, generator=gen), torch.randn(k.shape, generator=gen)
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    want_dx = torch.autograd.grad(R.rope_reference(qq, kk, cos, sin, 1, spec), (qq, kk), (gq, gk))
    got_dx = RL._backward(plan, (gq, gk), pc, ps, same=on)
    assert all(torch.equal(a, b_) for a, b_ in zip(got_dx, want_dx))
    assert all(torch.isnan(o).any() for o in RL._forward(plan, q, k, pc, ps, same=off))
    assert all(torch.isnan(o).any() for o in RL._backward(plan, (gq, gk), pc, ps, same=off))


def test_halves_differing_only_in_the_sign_of_zero_are_not_shared(interpret):
    """-0.0 and +0.0 compare equal but round products differently: the flag compares bits."""
    spec = SPECS["llama"]
    gen = torch.Generator().manual_seed(7)
    q, k = qk(interpret, torch.float32, gen=gen)
    cos, sin = shared_angles(spec, 8, interpret, gen=gen)
    cos[..., 0], cos[..., 4] = 0.0, -0.0
    sin[..., 1], sin[..., 5] = -0.0, 0.0
    assert flag(q, k, cos, sin, spec) == 0
    check_against_reference(q, k, cos, sin, spec, gen)


def test_non_finite_shared_angles_give_eagers_non_finite_results(interpret):
    """The same NaN/inf bits in both halves: shared, and the results are non-finite exactly where
    eager's are."""
    spec = SPECS["llama"]
    gen = torch.Generator().manual_seed(8)
    q, k = qk(interpret, torch.float32, gen=gen)
    cos, sin = shared_angles(spec, 8, interpret, gen=gen)
    cos[0, 1, [2, 6]] = float("nan")
    sin[1, 3, [0, 4]] = float("inf")
    q[0, 1, 2, 3] = float("inf")
    assert flag(q, k, cos, sin, spec) == 1
    check_against_reference(q, k, cos, sin, spec, gen)


def test_an_in_place_write_after_a_call_is_seen(interpret):
    """The flag is kept per tensor and version: writing cos in place (its halves now differ)
    makes the next call compare again."""
    spec = SPECS["llama"]
    gen = torch.Generator().manual_seed(9)
    q, k = qk(interpret, torch.float32, gen=gen)
    cos, sin = shared_angles(spec, 8, interpret, gen=gen)
    RL.clear_plans()
    check_against_reference(q, k, cos, sin, spec, gen)
    assert flag(q, k, cos, sin, spec) == 1
    cos[..., 5:].mul_(0.5)
    assert flag(q, k, cos, sin, spec) == 0
    check_against_reference(q, k, cos, sin, spec, gen)
    sin[..., :3].add_(0.25)  # sin's own version counts too
    cos[..., 5:].mul_(2.0)
    assert flag(q, k, cos, sin, spec) == 0
    check_against_reference(q, k, cos, sin, spec, gen)


def test_the_cache_is_small_and_keeps_no_tensor_alive(interpret):
    spec = SPECS["llama"]
    gen = torch.Generator().manual_seed(10)
    q, k = qk(interpret, torch.float32, gen=gen)
    RL.clear_plans()
    for _ in range(RL._SAME_MAX + 3):
        cos, sin = shared_angles(spec, 8, interpret, gen=gen)
        assert flag(q, k, cos, sin, spec) == 1
    assert len(RL._same_cache) == RL._SAME_MAX
    del cos, sin
    assert all(rc() is None for rc, *_ in RL._same_cache)
    RL.clear_plans()
    assert not RL._same_cache


def test_inference_tensors_and_the_knob(interpret, monkeypatch):
    """Inference tensors (no version counter) compare on every call; with ``_SHARE_HALVES`` off
    the flag is the zero one and the second columns are read."""
    spec = SPECS["llama"]
    gen = torch.Generator().manual_seed(12)
    q, k = qk(interpret, torch.float32, gen=gen)
    with torch.inference_mode():
        cos, sin = shared_angles(spec, 8, interpret, gen=gen)
        n = len(RL._same_cache)
        assert flag(q, k, cos, sin, spec) == 1 and len(RL._same_cache) == n
        out = R.fused_rope(q, k, cos, sin, 1, spec)
        assert all(torch.equal(a, b_) for a, b_ in zip(out, R.rope_reference(q, k, cos, sin, 1, spec)))
    monkeypatch.setattr(RL, "_SHARE_HALVES", False)
    cos, sin = shared_angles(spec, 8, interpret, gen=gen)
    assert flag(q, k, cos, sin, spec) == 0
    check_against_reference(q, k, cos, sin, spec, gen)


def test_pair_angles_take_the_zero_flag(interpret):
    """Angles per pair (half-width cos) have no second column: the flag is the zero one."""
    spec = SPECS["half-width"]
    gen = torch.Generator().manual_seed(13)
    q, k = qk(interpret, torch.float32, gen=gen)
    theta = torch.randn(2, 5, 4, generator=gen)
    cos, sin = theta.cos().to(interpret), theta.sin().to(interpret)
    assert flag(q, k, cos, sin, spec) == 0
    check_against_reference(q, k, cos, sin, spec, gen)


_COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepspeed_fused.ops.rope import kernels as K
fn = K._rope_kernel
ptrs = {"X0": "*bf16", "Y0": "*bf16", "X1": "*bf16", "Y1": "*bf16", "C": "*bf16", "S": "*bf16", "SAME": "*i32"}
for pairs in (False, True):
    for bwd in (False, True):
        const = dict(BLOCK_R=16, BLOCK_H=64, BLOCK_P=1, PAIRS=pairs, ANGLE_PAIR=False, HALVES=False, NEG=False,
                     BACKWARD=bwd, PROD=2, ACC=2, PASS=False, TWO=True, CONTRACT=False, INTERLEAVE=False)
        sig = {n: ("constexpr" if n in const else ptrs.get(n, "i32")) for n in fn.arg_names}
        out = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                             options=dict(num_warps=4, enable_fp_fusion=False))
        assert ".entry _rope_kernel" in out.asm["ptx"]
print("ok")
"""


def test_the_flag_path_compiles_for_an_h100():
    """The kernel with the flag (bf16, both pairings, forward and backward) compiles to sm90 PTX
    (no GPU needed; a fresh process without the interpreter)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    res = subprocess.run([sys.executable, "-c", _COMPILE], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
