"""The C++ autograd nodes' Python side on CPU: launch descriptions from compiled-kernel
metadata, when the nodes are used at all, and that the C++ source builds (the launches
themselves are GPU tests: tests/gpu/test_rms_norm_native_gpu.py)."""
from __future__ import annotations

import shutil
import types

import pytest
import torch

from deepspeed_fused.ops import _native


def _fn(signature: dict, tail=(), grid=(7, 1, 1), **md):
    meta = dict(num_warps=4, num_ctas=1, shared=1024, global_scratch_size=0, profile_scratch_size=0)
    meta.update(md)
    compiled = types.SimpleNamespace(src=types.SimpleNamespace(signature=signature),
                                     metadata=types.SimpleNamespace(**meta))
    fn = types.SimpleNamespace(compiled=compiled,
                               parts=(None, grid[0], grid[1], grid[2], 0xABC, False, False, None, tuple(tail)))
    return fn


P = _native.PTR


def test_describe_packs_pointers_ints_eps_and_skips_constexprs():
    sig = {"X": "*bf16", "W": "*bf16", "n": "i32", "one": "constexpr", "big": "i64", "eps": "fp32",
           "BLOCK": "constexpr"}
    d = _native.describe(_fn(sig, tail=(128,)), [(P, 0), (P, 1), 4096, 1, 2 ** 40, _native.EPS])
    function, grid, threads, shared, kinds, values = d
    assert function == 0xABC and grid == (7, 1, 1) and threads == 128 and shared == 1024
    assert kinds == (P, P, _native.I32, _native.I64, _native.EPS_F32)
    assert values == (0, 1, 4096, 2 ** 40, 0)
    hash(d)  # descriptions key the plan ids


@pytest.mark.parametrize("case", ["length", "scratch", "clusters", "type", "ptr_not_slot", "eps_not_fp32", "coop"])
def test_describe_refuses_what_the_node_cannot_launch(case):
    sig = {"X": "*fp32", "n": "i32", "eps": "fp32"}
    template = [(P, 0), 5, _native.EPS]
    kw = {}
    if case == "length":
        template = template[:2]
    elif case == "scratch":
        kw = dict(global_scratch_size=64)
    elif case == "clusters":
        kw = dict(num_ctas=2)
    elif case == "type":
        sig = {"X": "*fp32", "n": "fp16", "eps": "fp32"}
    elif case == "ptr_not_slot":
        template = [3, 5, _native.EPS]
    elif case == "eps_not_fp32":
        sig = {"X": "*fp32", "n": "i32", "eps": "i32"}
    fn = _fn(sig, **kw)
    if case == "coop":
        fn.parts = fn.parts[:5] + (True,) + fn.parts[6:]
    assert _native.describe(fn, template) is None


def test_describe_without_compiled_metadata():
    assert _native.describe(types.SimpleNamespace(parts=None), []) is None


def test_not_enabled_on_cpu_or_when_switched_off(monkeypatch):
    if not torch.cuda.is_available():
        assert not _native.enabled() and _native.get() is None
    monkeypatch.setenv(_native.ENV, "0")
    assert not _native.enabled() and _native.get(wait=True) is None


def test_cpp_source_builds():
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None or shutil.which("c++") is None:
        pytest.skip("no C++ compiler or ninja")
    try:
        cpp_extension.verify_ninja_availability()
    except RuntimeError:
        pytest.skip("ninja not usable")
    mod = _native.compile_extension()
    assert isinstance(mod.init_driver(), bool)
    for name in ("register_rms_plan", "rms_norm"):
        assert callable(getattr(mod, name))
