"""The SiLU forward's fast path for bf16 / fp16 gates (``kernels.silu_select_ptx``), on CPU: the bound
that makes it exact (over every bf16 and fp16 input), the selection as the interpreter runs it, the
exact branch against the PTX Triton compiles for CUDA's ``expf``, the fast kernels built for an H100
(no GPU needed to compile), and the per-device probe that decides whether a GPU takes the path.
The GPU tests run the probe and compare with CUDA eager on every input."""
from __future__ import annotations

import os
import re
import types
import warnings

import numpy as np
import pytest
import torch

from deepspeed_fused.ops import _common
from deepspeed_fused.ops.mlp_act import kernels as K
from deepspeed_fused.ops.mlp_act import launch as L
from unit.test_mlp_act_cuda_math import compile_for_h100

LOG2E = 1.4426950408889634
U = 2.0 ** -24  # an FP32 rounding, relative
# Error bounds assumed of the hardware: ex2.approx.ftz.f32 4 ULP, rcp.approx.ftz.f32 2 ULP, CUDA's expf
# 2 ULP (its documented maximum); launch.fast_silu_ok checks each GPU's own results on every input
EPS_EX2, EPS_RCP, EPS_EXPF = 2.0 ** -21, 2.0 ** -22, 2.0 ** -22


def _every(dtype: str) -> np.ndarray:
    """Every value of the 16-bit type, as float64."""
    bits = np.arange(65536, dtype=np.uint32)
    if dtype == "fp16":
        return bits.astype(np.uint16).view(np.float16).astype(np.float64)
    return (bits << 16).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fast_value_lies_within_the_window_of_the_exact_one(dtype):
    # where the fast path keeps its value (x >= -8, |x| >= 1e-30, finite), the fast and the exact FP32
    # values are at most SELECT_ULPS bit patterns apart; a value kept lies farther than that from every
    # rounding midpoint, so both round to the same 16-bit number
    x = _every(dtype)
    x = x[np.isfinite(x) & (x >= K.SELECT_X_MIN) & (np.abs(x) >= K.SELECT_TINY)]
    e = np.exp(-x)
    d = 1.0 + e
    c = float(np.float32(-LOG2E))
    de = np.log(2.0) * np.abs(x * LOG2E) * (U + abs(-c - LOG2E) / LOG2E) + EPS_EX2  # the fast e, relative
    fast = (e * de + U * d) / d + EPS_RCP + U  # the fast y: 1 + e rounded, rcp, the product
    exact = (e * EPS_EXPF + U * d) / d + U  # the exact y: expf, 1 + e rounded, IEEE division
    tot = (fast + exact) * 1.01  # second-order terms
    y = np.abs(x / d)
    ulp = np.maximum(2.0 ** (np.floor(np.log2(y * (1 - tot))) - 23), 2.0 ** -149)  # the lower binade's
    apart = y * tot / ulp
    assert x.size > 40000
    assert apart.max() < K.SELECT_ULPS, (float(apart.max()), float(x[apart.argmax()]))


@pytest.mark.parametrize("out_bits", [16, 13])
def test_window_arithmetic_is_distance_to_the_midpoint(out_bits):
    # the PTX's add / and / compare: selected iff the low bits are within SELECT_ULPS of the midpoint
    k, (mid, mask) = K.SELECT_ULPS, K.select_window(out_bits)
    assert (mid, mask) == (1 << (out_bits - 1), (1 << out_bits) - 1)
    low = np.arange(1 << out_bits, dtype=np.int64)
    sel = ((low + (k - mid)) & mask) <= 2 * k
    assert np.array_equal(sel, np.abs(low - mid) <= k)
    ptx = K.silu_select_ptx(out_bits)
    assert f"add.s32 b, $0, {k - mid};" in ptx and f"and.b32 b, b, {mask};" in ptx
    assert f"setp.le.u32 p, b, {2 * k};" in ptx
    assert ("0f38800000" in ptx) == (out_bits == 13)  # fp16: a subnormal output takes the exact value


def test_ptx_branches_per_lane_with_scoped_names():
    ptx = K.silu_select_ptx(16)
    assert ptx.startswith("{") and ptx.rstrip().endswith("}")
    assert ptx.count("${:uid}") == 2  # the branch and its label, unique per inlined copy
    lines = ptx.splitlines()
    start = lines.index("@!p bra DSF_SILU_EXACT${:uid};")
    assert tuple(lines[start + 1:start + 1 + len(K.EXPF_PTX)]) == K.EXPF_PTX
    assert lines[start + 1 + len(K.EXPF_PTX)] == "div.rn.f32 $0, $1, d;"


_COMPILE = r"""
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from deepspeed_fused.ops.mlp_act import kernels as K
fn = K._gated_fwd_kernel
out = {}
runs = [("exact_bf16", "*bf16", False, 1)] + [(f"fast_{t}_{n}", f"*{t}", True, n) for t in ("bf16", "fp16")
                                                for n in K.SILU_PACKS]
for name, ptr, fast, pack in runs:
    sig = {n: ("constexpr" if n.isupper() and len(n) > 2 else ptr if n.isupper() else "i32") for n in fn.arg_names}
    const = dict(ACT=0, EXACT_EXP=True, FAST_SILU=fast, SILU_PACK=pack, BLOCK_R=1, BLOCK_C=1024, FLAT=True)
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in ("G", "U", "H", "inter", "n_col_blocks")}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const, attrs=attrs), target=GPUTarget("cuda", 90, 32),
                       options=dict(num_warps=4))
    out[name] = dict(ptx=k.asm["ptx"], cubin=len(k.asm["cubin"]))
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def compiled():
    return compile_for_h100(_COMPILE)  # ptxas builds the cubins too


def _dataflow(lines) -> list:
    """The value each instruction computes, as an expression over ``x`` (the gate in FP32: ``$1``, or
    what ``cvt.f32.bf16`` makes) and constants: (opcode, operands...) trees, in program order. A
    register holding a constant reads as that constant; ``0 - a`` (Triton's negation) as ``neg a``."""
    env, out = {}, []
    for line in lines:
        m = re.match(r"\s*([a-z][\w.]*)\s+([^;{}]*);", line)
        if not m:
            continue
        op, args = m.group(1), [a.strip() for a in m.group(2).split(",")]
        if op.startswith("@") or len(args) < 2:
            continue
        val = [("x" if a == "$1" else env.get(a, a)) for a in args[1:]]
        if op.startswith("cvt.f32.bf16"):
            node = "x"
        elif op == "mov.b32":
            node = val[0]
        elif op == "sub.f32" and val[0] == "0f00000000":
            node = ("neg.f32", val[1])
        else:
            node = (op,) + tuple(val)
        env[args[0]] = node
        out.append(node)
    return out


def test_exact_branch_is_the_compiled_expf(compiled):
    # the exact branch computes x / (1 + expf(-x)) with the very instructions, constants and operand
    # order that the exact kernel compiles for an element (its first division's whole expression)
    ours = [n for n in _dataflow(list(K.EXPF_PTX) + ["div.rn.f32 $0, $1, d;"]) if n[0] == "div.rn.f32"]
    theirs = [n for n in _dataflow(compiled["exact_bf16"]["ptx"].splitlines()) if n[0] == "div.rn.f32"]
    assert len(ours) == 1 and theirs and theirs[0] == ours[0], (ours, theirs[:1])
    assert "ex2.approx.ftz.f32" in repr(ours[0]) and "0f3BBB989D" in repr(ours[0])


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_fast_kernels_build_for_h100_one_branch_per_group(compiled, dtype):
    # 1024 elements over 4 warps: 8 a lane, so 8 / pack groups, each its own label and exact branch
    for pack in K.SILU_PACKS:
        name = f"fast_{dtype}_{pack}"
        ptx = compiled[name]["ptx"]
        assert compiled[name]["cubin"] > 0
        labels = re.findall(r"^\s*(DSF_SILU_EXACT\w*):", ptx, re.M)
        assert len(labels) == 8 // pack and len(set(labels)) == len(labels), (name, labels)
        assert len(re.findall(r"@!%?\w+ bra DSF_SILU_EXACT", ptx)) == 8 // pack, name
        assert ptx.count("rcp.approx.ftz.f32") == 8 and ptx.count("div.rn.f32") == 8, name
        # each dtype's own selection: fp16's also sends subnormal outputs to the exact branch
        assert ptx.count(K._hex32(K.FP16_MIN_NORMAL)) == (8 if dtype == "fp16" else 0), name
    assert "rcp.approx" not in compiled["exact_bf16"]["ptx"]


@pytest.mark.parametrize("out_bits", [16, 13])
def test_group_ptx_fast_values_first_then_one_branch(out_bits):
    one = K.silu_select_ptx(out_bits)
    for pack in K.SILU_PACKS:
        ptx = K.silu_select_ptx(out_bits, pack).splitlines()
        branch = ptx.index("@!p bra DSF_SILU_EXACT${:uid};")
        fast = [ln for ln in ptx[:branch] if ln.startswith(("ex2", "rcp"))]
        assert fast == ["ex2.approx.ftz.f32 t, t;", "rcp.approx.ftz.f32 r, d;"] * pack
        # every element's fast value precedes every test, and each element is tested
        assert max(i for i, ln in enumerate(ptx) if ln.startswith("rcp")) < min(
            i for i, ln in enumerate(ptx) if ln.startswith("setp"))
        for i in range(pack):
            assert f"add.s32 b, ${i}, {K.SELECT_ULPS - K.select_window(out_bits)[0]};" in ptx
            assert f"setp.ltu.or.f32 p, ${pack + i}, {K._hex32(K.SELECT_X_MIN)}, p;" in ptx
            assert f"div.rn.f32 ${i}, ${pack + i}, d;" in ptx[branch:]
        assert sum(ln.startswith("@!p bra") for ln in ptx) == 1
        assert K.silu_constraints(pack) == ",".join(["=r"] * pack + ["r"] * pack)
        if pack == 1:
            assert "\n".join(ptx) == one
    with pytest.raises(ValueError, match="pack"):
        K.silu_select_ptx(out_bits, 3)


def test_group_size_divides_each_lanes_elements(monkeypatch):
    assert L.SILU_PACK in K.SILU_PACKS
    monkeypatch.setattr(L, "SILU_PACK", 4)
    assert [L.silu_pack(b, w) for b, w in ((4096, 8), (1024, 4), (256, 4), (128, 4), (64, 4), (1, 1))] == [
        4, 4, 2, 1, 1, 1]
    monkeypatch.setattr(L, "SILU_PACK", 1)
    assert L.silu_pack(4096, 8) == 1


@pytest.fixture
def interpreted():
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs the kernels interpreted on CPU")


def test_interpreted_fast_forward_equals_exact_on_every_fp16_input(interpreted):
    # the interpreter's exp2 and division stand for ex2.approx and rcp.approx: the selection and the
    # plumbing (bf16 runs in the GPU tests: the interpreter's bf16 is wrong)
    g = L.every_half_value(torch.float16, "cpu")
    u = torch.randn(256, 256).to(torch.float16)
    exact = L.forward_rows(g, u, "silu", fast_silu=False)
    fast = L.forward_rows(g, u, "silu", fast_silu=True)
    assert bool(L.same_bits(exact, fast).all())
    # and with the selection forced off, the interpreter's fast value alone differs somewhere: the
    # selection is what makes them equal
    x = g.float().numpy().ravel()
    with np.errstate(over="ignore", invalid="ignore"):
        yf = (x * (np.float32(1) / (np.float32(1) + np.exp2(x * np.float32(-LOG2E))))).astype(np.float16)
        ye = (x / (np.float32(1) + np.exp(-x))).astype(np.float16)
    ok = np.isfinite(x) & (x >= -8)
    assert (yf[ok].view(np.int16) != ye[ok].view(np.int16)).any()


def test_selection_keeps_the_fast_value_almost_everywhere():
    # the share of bf16 / fp16 gates in [-8, 8] that take the exact branch (so the warps mostly skip it)
    for dtype, bits in (("bf16", 16), ("fp16", 13)):
        x = _every(dtype)
        x = x[np.isfinite(x) & (np.abs(x) <= 8) & (np.abs(x) >= 1e-30)].astype(np.float32)
        y = x / (np.float32(1) + np.exp(-x))
        low = y.view(np.int32).astype(np.int64) & ((1 << bits) - 1)
        share = (np.abs(low - (1 << (bits - 1))) <= K.SELECT_ULPS).mean()
        assert share < (0.001 if bits == 16 else 0.01), (dtype, share)


def test_fast_path_only_for_half_precision_on_a_gpu(monkeypatch):
    monkeypatch.setattr(L, "_FAST_SILU_PROBES", {})
    gpu = types.SimpleNamespace(dtype=torch.bfloat16, is_cuda=True, device=torch.device("cuda", 0))
    assert not L.FAST_SILU and not L.fast_silu_ok(gpu) and L._FAST_SILU_PROBES == {}  # opt-in: no probe
    monkeypatch.setattr(L, "FAST_SILU", True)
    assert not L.fast_silu_ok(torch.ones(2, dtype=torch.bfloat16))  # CPU
    gpu.dtype = torch.float32
    assert not L.fast_silu_ok(gpu)  # FP32 keeps the exact path
    gpu.dtype = torch.bfloat16
    monkeypatch.setattr(L, "_probe_fast_silu", lambda device, dtype: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not L.fast_silu_ok(gpu) and L._FAST_SILU_PROBES == {}  # no probe under graph capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    assert L.fast_silu_ok(gpu) and L._FAST_SILU_PROBES == {(0, torch.bfloat16): True}
    monkeypatch.setattr(L, "FAST_SILU", False)
    assert not L.fast_silu_ok(gpu)


@pytest.mark.parametrize("outcome", ["equal", "one differs", "no build"])
def test_probe_compares_every_input_and_says_why_not(monkeypatch, outcome):
    seen = []

    def fake_forward(g, u, act, exact_exp=True, fast_silu=None):
        seen.append((tuple(g.shape), g.dtype, fast_silu))
        if fast_silu and outcome == "no build":
            raise RuntimeError("PTX not supported")
        out = g.clone()
        if fast_silu and outcome == "one differs":
            out.view(torch.int16)[7, 9] += 1
        return out

    monkeypatch.setattr(L, "forward_rows", fake_forward)
    _common.reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        ok = L._probe_fast_silu(torch.device("cpu"), torch.float16)
    assert seen == [((256, 256), torch.float16, False), ((256, 256), torch.float16, True)]
    assert ok == (outcome == "equal")
    msgs = [str(x.message) for x in w if "fast path" in str(x.message)]
    if outcome == "equal":
        assert not msgs
    else:
        assert len(msgs) == 1 and "the exact forward runs there" in msgs[0], msgs
        assert ("1 of 65536" in msgs[0]) == (outcome == "one differs")


def test_every_half_value_and_same_bits():
    for dtype in (torch.bfloat16, torch.float16):
        g = L.every_half_value(dtype, "cpu")
        assert g.shape == (256, 256) and g.dtype == dtype
        assert g.view(torch.int16).flatten().unique().numel() == 65536
    a = torch.tensor([1.0, float("nan"), 0.0, -0.0, 2.0])
    b = torch.tensor([1.0, float("nan"), -0.0, -0.0, 2.0000002])
    assert L.same_bits(a, b).tolist() == [True, True, False, True, False]
    assert L.same_bits(a.half(), b.half()).tolist() == [True, True, False, True, True]
