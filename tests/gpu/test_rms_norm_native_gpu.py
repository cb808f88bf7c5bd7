"""The RMSNorm's C++ autograd node (ops/rms_norm/native.py) on the GPU: it is taken from a key's second
call on, and its outputs and gradients equal the Python node's bitwise; the edges (other
gradient layouts and dtypes, saved-tensor hooks, create_graph, streams, CUDA graphs, launch
hooks, poisoned memory, no host sync)."""
from __future__ import annotations

import pytest
import torch

from deepspeed_fused.ops.rms_norm import native as _native
from deepspeed_fused.ops import rms_norm as R
from unit.test_rms_norm import EPS, check_against_eager, make_inputs, on_streams_bitwise

pytestmark = pytest.mark.gpu


def _built():
    """Each test first builds the C++ node (or loads torch's cached build) in its worker."""
    mod = _native.get(wait=True)
    assert mod is not None, f"the C++ node did not build: {_native.error()}"


def _call(x, w, dy, eps=EPS, grad_x=True):
    xr = x.detach().clone().requires_grad_(grad_x)
    wr = w.detach().clone().requires_grad_()
    y = R.fused_rms_norm(xr, wr, eps)
    node = y.grad_fn.name()
    y.backward(dy)
    return (y.detach(), xr.grad, wr.grad), node


def _native_node(name: str) -> bool:
    return "RmsNormFn" in name


def _warm(x, w, dy, grad_x=True):
    """Two calls through the Python node: the first compiles (JIT launches), the second makes the
    direct launches, whose backward registers the key with the C++ node. The first's results."""
    first, n1 = _call(x, w, dy, grad_x=grad_x)
    _, n2 = _call(x, w, dy, grad_x=grad_x)
    return first


def _three_ways(x, w, dy):
    """Python node (first calls), C++ node (third call), then the C++ node switched off."""
    R.clear_plans()
    first, n1 = _call(x, w, dy)
    _, n2 = _call(x, w, dy)
    second, n3 = _call(x, w, dy)
    R.api.NATIVE = False
    try:
        third, n4 = _call(x, w, dy)
    finally:
        R.api.NATIVE = True
    assert [_native_node(n) for n in (n1, n2, n3, n4)] == [False, False, True, False], (n1, n2, n3, n4)
    return first, second, third


def _equal(a, b):
    return all(u is None and v is None or torch.equal(u, v) for u, v in zip(a, b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1025, 128), (2, 300, 32, 128), (67, 2048), (8192, 2048), (1025, 4096),
                                   (513, 8192), (300, 16384), (16, 4096), (7, 130)])
def test_native_equals_python_node(shape, dtype):
    _built()
    x, w, dy = make_inputs(shape, dtype, seed=sum(shape), device="cuda")
    first, second, third = _three_ways(x, w, dy)
    assert _equal(first, second) and _equal(second, third)


@pytest.mark.parametrize("n", [128, 4096])
def test_native_fp32_weight_promotes(n):
    _built()
    x, w, dy = make_inputs((513, n), torch.bfloat16, torch.float32, seed=n, device="cuda")
    first, second, third = _three_ways(x, w, dy)
    assert second[0].dtype == torch.float32 and second[1].dtype == torch.bfloat16
    assert _equal(first, second) and _equal(second, third)


def test_native_against_eager():
    _built()
    x, w, dy = make_inputs((4099, 2048), torch.bfloat16, seed=3, device="cuda")
    _warm(x, w, dy)
    check_against_eager(x, w, dy)  # its fused call runs the C++ node


def test_native_other_gradient_layouts_and_dtypes():
    _built()
    x, w, dy = make_inputs((1024, 2048), torch.bfloat16, seed=4, device="cuda")
    want = _warm(x, w, dy)
    # a transposed (non-contiguous) gradient, an fp32 gradient, an unaligned one
    dy_t = dy.t().contiguous().t()
    dy_f = dy.float()
    buf = torch.empty(dy.numel() + 1, dtype=dy.dtype, device="cuda")
    dy_u = buf[1:].view_as(dy).copy_(dy)
    for g in (dy_t, dy_f, dy_u):
        got, node = _call(x, w, g)
        assert _native_node(node)
        ref, _ = _call(x, w, g.to(dy.dtype).contiguous())
        assert _equal(got, ref) and _equal(got, want)


def test_native_saved_tensor_hooks():
    _built()
    x, w, dy = make_inputs((1024, 2048), torch.bfloat16, seed=5, device="cuda")
    want = _warm(x, w, dy)
    # offloading to the host and back, and a pack hook that hands back a strided copy
    with torch.autograd.graph.save_on_cpu():
        got, node = _call(x, w, dy)
    assert _native_node(node) and _equal(got, want)

    def pack(t):
        return torch.cat([t, t], dim=-1) if t.dim() == 2 else t

    def unpack(t):
        return t[..., : t.shape[-1] // 2] if t.dim() == 2 and t.shape[-1] == 2 * x.shape[-1] else t

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        got, node = _call(x, w, dy)
    assert _native_node(node) and _equal(got, want)
    # a hook that hands back another dtype (losslessly here: bf16 -> fp32): converted back
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t.float(), lambda t: t):
        got, node = _call(x, w, dy)
    assert _native_node(node) and _equal(got, want)
    R.api.NATIVE = False
    try:  # the Python node's fast backward leaves such tensors to the plan path
        with torch.autograd.graph.saved_tensors_hooks(lambda t: t.float(), lambda t: t):
            got, node = _call(x, w, dy)
    finally:
        R.api.NATIVE = True
    assert not _native_node(node) and got[0].dtype == torch.bfloat16
    torch.testing.assert_close(got[1].float(), want[1].float(), rtol=2e-2, atol=2e-2)


def test_native_create_graph_is_first_order_only():
    _built()
    x, w, dy = make_inputs((64, 2048), torch.float32, seed=6, device="cuda")
    _warm(x, w, dy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = R.fused_rms_norm(xr, wr, EPS)
    assert _native_node(y.grad_fn.name())
    dx, dw = torch.autograd.grad(y, (xr, wr), dy, create_graph=True)
    assert torch.equal(dx, _call(x, w, dy)[0][1])
    with pytest.raises(RuntimeError, match="not differentiable again|differentiate"):
        torch.autograd.grad(dx.sum(), xr)


def test_native_only_weight_requires_grad():
    _built()
    x, w, dy = make_inputs((300, 4096), torch.bfloat16, seed=7, device="cuda")
    want = _warm(x, w, dy, grad_x=False)
    got, node = _call(x, w, dy, grad_x=False)
    assert _native_node(node) and got[1] is None and _equal(got, want)


def test_native_chain_equals_python_chain():
    _built()
    x, _, dy = make_inputs((2048, 2048), torch.bfloat16, seed=8, device="cuda")
    ws = [make_inputs((1, 2048), torch.bfloat16, seed=80 + i, device="cuda")[1] for i in range(8)]

    def chain():
        xr = x.clone().requires_grad_()
        wr = [w.clone().requires_grad_() for w in ws]
        h = xr
        for wi in wr:
            h = R.fused_rms_norm(h, wi, EPS)
        names = h.grad_fn.name()
        return [h.detach()] + list(torch.autograd.grad(h, [xr] + wr, dy)), names

    first, _ = chain()
    chain()
    second, name = chain()
    R.api.NATIVE = False
    try:
        third, name3 = chain()
    finally:
        R.api.NATIVE = True
    assert _native_node(name) and not _native_node(name3)
    assert _equal(first, second) and _equal(second, third)


def test_native_two_streams_and_repeats():
    _built()
    shapes = [(8192, 2048), (16384, 1024)]
    ins = [make_inputs(s, torch.bfloat16, seed=30 + i, device="cuda") for i, s in enumerate(shapes)]
    ref = [_warm(*i) for i in ins]

    def native_call(x, w, dy):
        got, node = _call(x, w, dy)
        assert _native_node(node)
        return got

    on_streams_bitwise(ins, native_call, ref)


def test_native_cuda_graph_capture():
    _built()
    x, w, dy = make_inputs((4096, 4096), torch.bfloat16, seed=9, device="cuda")
    want = _warm(x, w, dy)
    sx, sw = x.clone().requires_grad_(), w.clone().requires_grad_()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            y = R.fused_rms_norm(sx, sw, EPS)
            y.backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    assert _native_node(y.grad_fn.name())
    g = torch.cuda.CUDAGraph()
    sx.grad = sw.grad = None
    with torch.cuda.graph(g, stream=s):
        y = R.fused_rms_norm(sx, sw, EPS)
        y.backward(dy)
    assert _native_node(y.grad_fn.name())
    for _ in range(3):
        g.replay()
        torch.cuda.synchronize()
        assert torch.equal(y, want[0]) and torch.equal(sx.grad, want[1]) and torch.equal(sw.grad, want[2])
        got, _ = _call(x, w, dy)  # eager work between replays on the default stream
        assert _equal(got, want)


def test_native_outputs_fully_written():
    _built()
    x, w, dy = make_inputs((4097, 4096), torch.bfloat16, seed=10, device="cuda")
    want = _warm(x, w, dy)
    for _ in range(3):
        # poison freed blocks of every size the call allocates, so its outputs land on NaNs
        junk = [torch.full((x.numel(),), float("nan"), dtype=x.dtype, device="cuda") for _ in range(4)]
        junk += [torch.full((4096,), float("nan"), dtype=torch.float32, device="cuda") for _ in range(4)]
        del junk
        got, node = _call(x, w, dy)
        assert _native_node(node) and _equal(got, want)


def test_native_no_host_sync():
    _built()
    x, w, dy = make_inputs((8192, 2048), torch.bfloat16, seed=11, device="cuda")
    _warm(x, w, dy)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = R.fused_rms_norm(xr, wr, EPS)
        torch.autograd.grad(y, (xr, wr), dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert _native_node(y.grad_fn.name())


def test_launch_hooks_take_the_python_path():
    _built()
    from triton import knobs

    x, w, dy = make_inputs((256, 2048), torch.bfloat16, seed=12, device="cuda")
    _warm(x, w, dy)
    seen = []

    def hook(*a, **k):
        seen.append(1)

    knobs.runtime.launch_enter_hook.add(hook)
    try:
        got, node = _call(x, w, dy)
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert not _native_node(node) and seen


def test_switch_off_by_flag():
    _built()
    x, w, dy = make_inputs((256, 2048), torch.bfloat16, seed=13, device="cuda")
    _warm(x, w, dy)
    R.api.NATIVE = False
    try:
        _, node = _call(x, w, dy)
    finally:
        R.api.NATIVE = True
    assert not _native_node(node)


@pytest.mark.parametrize("form_name", [None, "offset"])
def test_checkpoint_recomputation_across_the_switch(form_name):
    """Under non-reentrant activation checkpointing the original forward may run the Python node and
    the recomputation the C++ node (it becomes available while training runs), or the reverse: both
    save the same tensors, so the step trains as with one node, bitwise."""
    from torch.utils.checkpoint import checkpoint

    _built()
    R.clear_plans()
    x, w, dy = make_inputs((2, 512, 1152), torch.bfloat16, seed=11, device="cuda")
    if form_name is None:
        def norm(h, wt):
            return R.fused_rms_norm(h, wt, EPS)
    else:
        def norm(h, wt):
            return R.fused_rms_norm_form(h, wt, EPS, R.FORMS[form_name])
    for _ in range(3):  # the second call's backward offers the key to the C++ node
        xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        norm(xr, wr).backward(dy)
    assert any(v is not None for v in R.api._native_plans.values()), "no key reached the C++ node"

    def step(native_forward, native_recompute):
        xr, wr = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        R.api.NATIVE = native_forward
        try:
            y = checkpoint(lambda h, wt: norm(h, wt) * 1.0, xr * 1.0, wr, use_reentrant=False)
            R.api.NATIVE = native_recompute
            y.backward(dy)
        finally:
            R.api.NATIVE = True
        return xr.grad, wr.grad

    want = step(True, True)
    for a, b in ((False, True), (True, False), (False, False)):
        got = step(a, b)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1]), (a, b)
