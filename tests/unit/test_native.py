"""The C++ autograd nodes' Python side on CPU: launch descriptions from compiled-kernel
metadata, when the nodes are used at all, and that the C++ source builds (the launches
themselves are GPU tests: tests/gpu/test_rms_norm_native_gpu.py)."""
from __future__ import annotations

import shutil
import types

import pytest
import torch

from deepspeed_fused.ops.rms_norm import native as _native


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


# ---- the RMSNorm's hand-over of launch plans to the C++ node (the registration logic; the node's
# launches themselves are GPU tests) ----------------------------------------------------------------
class _FakeExtension:
    def __init__(self):
        self.registered = []

    def register_rms_plan(self, *args):
        self.registered.append(args)
        return len(self.registered) - 1

    def rms_norm(self, *args):  # never called here
        raise AssertionError


def _fake_launcher(n_ptrs):
    sig = {f"P{i}": "*fp32" for i in range(n_ptrs)}
    sig.update(n="i32", N="i32")
    if n_ptrs == 4:
        sig["eps"] = "fp32"
    return _fn(sig)


@pytest.fixture
def rms_plans(monkeypatch):
    from deepspeed_fused.ops import rms_norm as R

    ext = _FakeExtension()
    state = {"built": False, "enabled": True}
    monkeypatch.setattr(_native, "get", lambda wait=False: ext if state["built"] else None)
    monkeypatch.setattr(_native, "building", lambda: state["enabled"] and not state["built"])
    monkeypatch.setattr(_native, "enabled", lambda: state["enabled"])
    R.clear_plans()

    def add_key(x, w, dy_stride=None, dy_dtype=None, dy_align=0):
        key = R.plans._fwd_key(x, w, True)
        lkey = ("fwd",) + key
        R.plans._fwd_plans[key] = R.plans.FwdPlan(False, False, True, x.dtype, x.shape[:-1], x.device, (6, 8), (3,), {},
                                                  4, 0, lkey)
        R.plans._fwd_fast[key] = object()
        R.plans._launches._compiled[lkey] = _fake_launcher(4)
        fast_key = (key, dy_stride or x.stride(), dy_dtype or x.dtype, dy_align)
        R.plans._bwd_fast[fast_key] = object()
        bplan = R.plans.BwdPlan(False, x.dtype, False, False, False, True, x.device, None, (6, 8), 5, {}, 4, 1000, 2,
                                None, 0, None)
        return key, fast_key, bplan, _fake_launcher(8)

    yield R, ext, state, add_key
    R.clear_plans()
    R.plans._native_ids.clear()


def test_native_registration_waits_for_the_build_then_reuses_descriptions(rms_plans):
    R, ext, state, add_key = rms_plans
    x, w = torch.randn(6, 8), torch.randn(8)
    key, fast_key, bplan, bfn = add_key(x, w)
    R.native._offer_native(fast_key, bplan, bfn)
    assert key in R.plans._native_pending and key not in R.plans._native_plans  # still building: kept
    assert R.native._register_native(key) is None and key in R.plans._native_pending
    state["built"] = True
    nat = R.native._register_native(key)
    assert nat is not None and nat.plan_id == 0 and nat.dev == 0 and key not in R.plans._native_pending
    assert R.plans._native_plans[key] is nat and R.native._register_native(key) is nat
    args = ext.registered[0]
    assert args[0] == 0xABC and args[4] == (_native.PTR,) * 4 + (_native.I32, _native.I32, _native.EPS_F32)
    assert [a.dtype for a in args[12:15]] == [torch.float32] * 3
    assert args[15:] == (True, 1000, 2)
    # another key (here [3, 2, 8]) with the same launch descriptions gets the same plan id: the
    # extension keeps every plan it is given, so none is registered twice (also after clear_plans)
    key2, fast_key2, bplan2, bfn2 = add_key(torch.randn(3, 2, 8), w)
    assert key2 != key
    R.native._offer_native(fast_key2, bplan2, bfn2)
    assert R.plans._native_plans[key2].plan_id == 0 and len(ext.registered) == 1


def test_native_registration_dropped_when_the_build_fails(rms_plans):
    R, ext, state, add_key = rms_plans
    key, fast_key, bplan, bfn = add_key(torch.randn(6, 8), torch.randn(8))
    R.native._offer_native(fast_key, bplan, bfn)
    assert key in R.plans._native_pending
    state["enabled"] = False  # a failed build switches the nodes off
    assert R.native._register_native(key) is None
    assert key not in R.plans._native_pending and key not in R.plans._native_plans


@pytest.mark.parametrize("case", ["dy_strided", "dy_dtype", "dy_unaligned", "x_unaligned"])
def test_native_only_for_planned_layouts(rms_plans, case):
    R, ext, state, add_key = rms_plans
    state["built"] = True
    x, w = torch.randn(6, 8), torch.randn(8)
    kw = dict(dy_stride=(1, 6)) if case == "dy_strided" else dict(dy_dtype=torch.float16) if case == "dy_dtype" \
        else dict(dy_align=2) if case == "dy_unaligned" else {}
    if case == "x_unaligned":
        x = torch.randn(6 * 8 + 1)[1:].view(6, 8)
    key, fast_key, bplan, bfn = add_key(x, w, **kw)
    R.native._offer_native(fast_key, bplan, bfn)
    assert key not in R.plans._native_pending and key not in R.plans._native_plans and not ext.registered


@pytest.mark.parametrize("case", ["unweighted", "gated", "strided_gate"])
def test_native_registration_of_other_forms(rms_plans, case):
    """The other forms hand the same launches to the extension's ``rms_norm_form`` node: an absent
    weight or gate is a constexpr None (no parameter), the gate's slot follows the outputs."""
    R, ext, state, _ = rms_plans
    ext.register_rms_form_plan = lambda *a: ext.registered.append(a) or len(ext.registered) - 1
    ext.rms_norm_form = object()
    state["built"] = True
    x = torch.randn(6, 8)
    w = None if case == "unweighted" else torch.randn(8)
    g = None if case == "unweighted" else (torch.randn(8, 6).t() if case == "strided_gate" else torch.randn(6, 8))
    form = R.FORMS["unweighted"] if case == "unweighted" else R.FORMS["gated"]
    key = R.plans._form_key(x, w, g, form, True)
    lkey = ("form_fwd",) + key
    R.plans._form_fwd_plans[key] = R.plans.FwdPlan(False, False, True, x.dtype, x.shape[:-1], x.device, (6, 8), (3,),
                                                   {}, 4, 0, lkey, False, g is not None)
    R.plans._form_fwd_fast[key] = object()
    fsig = {"X": "*fp32", "W": "constexpr" if w is None else "*fp32", "Y": "*fp32", "RSTD": "*fp32",
            "G": "constexpr" if g is None else "*fp32", "n": "i32", "N": "i32", "eps": "fp32"}
    R.plans._launches._compiled[lkey] = _fn(fsig)
    fast_key = (key, x.stride(), x.dtype, 0)
    R.plans._form_bwd_fast[fast_key] = object()
    bsig = {"DY": "*fp32", "X": "*fp32", "W": "constexpr" if w is None else "*fp32", "RSTD": "*fp32",
            "DX": "*fp32", "PART": "*fp32", "CNT": "*i32", "DW": "constexpr" if w is None else "*fp32",
            "G": "constexpr" if g is None else "*fp32", "DG": "constexpr" if g is None else "*fp32",
            "n": "i32", "N": "i32"}
    bplan = R.plans.BwdPlan(False, x.dtype, False, False, False, True, x.device, None, (6, 8), 5, {}, 4, 1000, 2,
                            None, 0, None, False, g is not None)
    R.native._offer_native_form(fast_key, bplan, _fn(bsig))
    if case == "strided_gate":  # the node takes contiguous gates only: the Python node keeps the key
        assert key not in R.plans._native_plans and not ext.registered
        return
    nat = R.plans._native_plans[key]
    assert nat.apply is ext.rms_norm_form and nat.plan_id == 0 and key not in R.plans._native_pending
    args = ext.registered[0]
    n_ptr_f, n_ptr_b = (3, 6) if case == "unweighted" else (5, 10)
    assert args[4] == (_native.PTR,) * n_ptr_f + (_native.I32, _native.I32, _native.EPS_F32)
    slots_f = (0, 2, 3) if case == "unweighted" else (0, 1, 2, 3, 4)
    assert args[5][:n_ptr_f] == slots_f
    slots_b = (0, 1, 3, 4, 5, 6) if case == "unweighted" else tuple(range(10))
    assert args[10] == (_native.PTR,) * n_ptr_b + (_native.I32, _native.I32) and args[11][:n_ptr_b] == slots_b
    assert args[15:20] == (True, 1000, 2, case != "unweighted", case != "unweighted")
