"""Fused RMSNorm on the GPU: full dtype/shape matrix against eager CUDA, torch.compile, CUDA
graphs, no host syncs, DataParallel, and the installer on each model family in bf16."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from deepspeed_fused.features import rms_norm as F
from deepspeed_fused.features.rms_norm import patch as FP
from deepspeed_fused.ops import rms_norm as R
from deepspeed_fused.ops._common import reset_fallback_warnings
from unit.common import NCCL_ENV, cuda_device_count
from unit.test_rms_norm import (EPS, _norms, _randomize_norms, _step, assert_dw_close, check_against_eager,
                                dw_flip_allowance, eager_normalized,
                                fused_grads, make_inputs, on_streams_bitwise, oracle_forward)

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
WIDTHS = [15, 16, 127, 128, 129, 130, 256, 2048, 2880, 4096, 5120, 7168, 8192, 16384]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("rows", [0, 1, 7, 67, 1025])
def test_matrix(dtype, n, rows):
    x, w, dy = make_inputs((rows, n), dtype, seed=n * 7 + rows, device="cuda")
    check_against_eager(x, w, dy)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4099, 128), (2, 300, 32, 128), (262144 + 17, 128), (8192, 4096)])
def test_large_shapes(dtype, shape):
    x, w, dy = make_inputs(shape, dtype, seed=len(shape), device="cuda")
    check_against_eager(x, w, dy)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [64, 128, 4096, 16384])
def test_fp32_weight_promotes(dtype, n):
    x, w, dy = make_inputs((513, n), dtype, torch.float32, seed=n, device="cuda")
    y, dx, dw = check_against_eager(x, w, dy)
    assert y.dtype == torch.float32 and dx.dtype == dtype and dw.dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_width_one_against_float64_oracle(dtype):
    eps = 0.25
    x, w, dy = make_inputs((1031, 1), dtype, seed=1, device="cuda")
    y, dx, dw = fused_grads(x, w, eps, dy)
    x64 = x.double().requires_grad_()
    w64 = w.double().requires_grad_()
    oracle_forward(x64, w64, eps).backward(dy.double())
    assert x64.grad.abs().min() > 0
    tol = {torch.float32: 1e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(y.double(), oracle_forward(x, w, eps), rtol=tol, atol=tol)
    torch.testing.assert_close(dx.double(), x64.grad, rtol=tol, atol=tol)
    torch.testing.assert_close(dw.double(), w64.grad, rtol=tol, atol=tol * 1031 ** 0.5)
    check_against_eager(x, w, dy, eps)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_strided_q_and_k_views(dtype):
    B, S, H, KV, hd = 4, 512, 32, 8, 128
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(B, S, (H + 2 * KV) * hd, generator=g).to("cuda", dtype)
    q = qkv[..., : H * hd].view(B, S, H, hd)
    k = qkv[..., H * hd: (H + KV) * hd].view(B, S, KV, hd)
    w = (1 + 0.1 * torch.randn(hd, generator=g)).to("cuda", dtype)
    for t, heads in ((q, H), (k, KV)):
        assert R.plans._row_layout(t) is not None
        dy = torch.randn(B, heads, S, hd, generator=g).to("cuda", dtype).transpose(1, 2)
        check_against_eager(t, w, dy)


@pytest.mark.parametrize("shape", [(262144, 128), (8192, 4096), (4096, 16384), (33, 2880)])
def test_repeated_runs_bitwise_identical(shape):
    x, w, dy = make_inputs(shape, torch.bfloat16, seed=3, device="cuda")
    first = fused_grads(x, w, EPS, dy)
    for _ in range(3):
        again = fused_grads(x, w, EPS, dy)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.parametrize("shape", [(4099, 128), (1025, 2880), (67, 16384), (7, 1)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_poisoned_outputs_fully_written(shape, dtype):
    x, w, dy = make_inputs(shape, dtype, seed=5, device="cuda")
    y0, r0 = R.launch._forward_impl(x, w, EPS)
    y, r = torch.full_like(y0, float("nan")), torch.full_like(r0, float("nan"))
    R.launch._forward_impl(x, w, EPS, y=y, rstd=r)
    dx0, dw0 = R.launch._backward_impl(dy, x, w, r0)
    dx, dw = torch.full_like(dx0, float("nan")), torch.full_like(dw0, float("nan"))
    R.launch._backward_impl(dy, x, w, r0, dx=dx, dw=dw)
    assert torch.equal(y, y0) and torch.equal(r, r0) and torch.equal(dx, dx0) and torch.equal(dw, dw0)


def test_no_host_sync():
    x, w, dy = make_inputs((8192, 128), torch.bfloat16, seed=2, device="cuda")
    fused_grads(x, w, EPS, dy)  # compile and inspect the kernels first
    x.requires_grad_()
    w = w.clone().requires_grad_()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = R.fused_rms_norm(x, w, EPS)
        y.backward(dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("shape", [(8192, 128), (1024, 4096), (64, 16384)])
def test_cuda_graph_capture(shape):
    x, w, dy = make_inputs(shape, torch.bfloat16, seed=4, device="cuda")
    sx, sw, sdy = x.clone().requires_grad_(), w.clone().requires_grad_(), dy.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):  # warm up on a side stream, as capture requires
            sx.grad = sw.grad = None
            R.fused_rms_norm(sx, sw, EPS).backward(sdy)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    sx.grad = sw.grad = None
    with torch.cuda.graph(g):
        sy = R.fused_rms_norm(sx, sw, EPS)
        sy.backward(sdy)
    x2, w2, dy2 = make_inputs(shape, torch.bfloat16, seed=40, device="cuda")
    with torch.no_grad():
        sx.copy_(x2)
        sw.copy_(w2)
        sdy.copy_(dy2)
    g.replay()
    y, dx, dw = fused_grads(x2, w2, EPS, dy2)
    assert torch.equal(sy, y) and torch.equal(sx.grad, dx) and torch.equal(sw.grad, dw)


def test_torch_compile_inductor():
    torch._dynamo.reset()
    x, w, dy = make_inputs((4096, 128), torch.bfloat16, seed=6, device="cuda")
    lin = torch.nn.Linear(128, 128, device="cuda", dtype=torch.bfloat16)

    def f(x, w):
        return R.fused_rms_norm(lin(x).view(-1, 4, 32, 128), w, EPS).float().sin()

    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    yc = torch.compile(f, fullgraph=True)(xc, wc)
    yc.backward(dy.view(-1, 4, 32, 128).float())
    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    ye = f(xe, we)
    ye.backward(dy.view(-1, 4, 32, 128).float())
    torch.testing.assert_close(yc, ye, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(xc.grad, xe.grad, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(wc.grad, we.grad, rtol=2e-2, atol=2e-1)


def test_torch_compile_model_with_fused_norm():
    from tiny_models import build_model

    torch._dynamo.reset()
    model = _randomize_norms(build_model("qwen3-tiny", dtype=torch.bfloat16)).cuda()
    ref = copy.deepcopy(model)
    assert F.replace_rms_norm(model) == 9
    ids = torch.randint(0, 257, (2, 16), device="cuda")
    compiled = torch.compile(model)
    out = compiled(input_ids=ids, labels=ids)
    out.loss.backward()
    loss_r, _ = _step(ref, ids)
    torch.testing.assert_close(out.loss.float(), loss_r.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny", "qwen3-moe-tiny", "mixtral-tiny", "deepseek-v3-tiny"])
def test_installer_bf16_training_step(name):
    from tiny_models import build_model

    model = _randomize_norms(build_model(name, dtype=torch.bfloat16)).cuda()
    ref = copy.deepcopy(model)
    n = len(_norms(model))
    assert F.replace_rms_norm(model) == n
    ids = torch.randint(0, 257, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    loss, grads = _step(model, ids)
    loss_r, grads_r = _step(ref, ids)
    torch.testing.assert_close(loss.float(), loss_r.float(), rtol=1e-2, atol=1e-2)
    for k in grads:
        a, b = grads[k].float(), grads_r[k].float()
        rel = (a - b).norm() / b.norm().clamp_min(1e-12)
        assert rel < 5e-2, (k, rel.item())


@pytest.mark.skipif(cuda_device_count() < 2, reason="needs 2 GPUs")
def test_data_parallel_replicas_use_own_device(monkeypatch):
    """nn.DataParallel on 2 GPUs: each replica keeps the opt-in and runs the fused op with its own
    weights on its own device; outputs and gradients equal the single-GPU fused model's."""
    from tiny_models import build_model

    for k, v in NCCL_ENV.items():  # DataParallel broadcasts the replicas' parameters through NCCL
        monkeypatch.setenv(k, v)
    devices = []
    real = FP.try_fused_rms_norm

    def spy(h, w, eps):
        devices.append((h.device, w.device))
        return real(h, w, eps)

    monkeypatch.setattr(FP, "try_fused_rms_norm", spy)
    model = _randomize_norms(build_model("llama-tiny")).cuda()
    single = copy.deepcopy(model)
    assert F.replace_rms_norm(model) == F.replace_rms_norm(single) == 5
    replicas = torch.nn.parallel.replicate(model, [0, 1])
    for dev, rep in enumerate(replicas):
        norms = _norms(rep)
        assert len(norms) == 5 and all(F.is_replaced(m) for m in norms)
        assert all(m.weight.device == torch.device("cuda", dev) for m in norms)
    del replicas
    dp = torch.nn.DataParallel(model, device_ids=[0, 1])
    ids = torch.randint(0, 257, (4, 16), device="cuda")
    out = dp(input_ids=ids)
    assert sorted(d.index for d, _ in devices) == [0] * 5 + [1] * 5  # every norm of both replicas fused
    assert all(a == b for a, b in devices)
    devices.clear()
    ref = single(input_ids=ids)
    assert len(devices) == 5
    torch.testing.assert_close(out.logits, ref.logits, rtol=1e-4, atol=1e-4)
    out.logits.float().pow(2).mean().backward()
    ref.logits.float().pow(2).mean().backward()
    grads = dict(single.named_parameters())
    for n, p in model.named_parameters():
        assert p.grad is not None, n
        torch.testing.assert_close(p.grad, grads[n].grad, rtol=1e-3, atol=1e-5, msg=n)


def test_bad_inputs_and_fallbacks():
    x = torch.randn(4, 8, device="cuda")
    with pytest.raises(ValueError, match="weight must be on"):
        R.fused_rms_norm(x, torch.ones(8), EPS)
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="weight must be on"):
            R.fused_rms_norm(x, torch.ones(8, device="cuda:1"), EPS)
    reset_fallback_warnings()
    x64 = x.double()
    with pytest.warns(RuntimeWarning, match="float64"):
        y = R.fused_rms_norm(x64, torch.ones(8, device="cuda", dtype=torch.float64), EPS)
    assert y.dtype == torch.float64
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        R.fused_rms_norm(x64, torch.ones(8, device="cuda", dtype=torch.float64), EPS)


def test_dw_is_close_for_long_columns():
    # 262144 rows summed into one weight gradient: the FP32 partial sums stay within bounds
    x, w, dy = make_inputs((262144, 128), torch.bfloat16, seed=9, device="cuda")
    _, _, dw = fused_grads(x, w, EPS, dy)
    xr = x.clone().requires_grad_()
    wr = w.clone().requires_grad_()
    R.rms_norm_reference(xr, wr, EPS).backward(dy)
    xn = eager_normalized(x, EPS)
    assert_dw_close(dw, wr.grad, w.dtype, (dy.float() * xn.float()).abs().sum(0),
                    dw_flip_allowance(x, w, EPS, dy))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cached_launches_follow_alignment_and_strides(dtype):
    # the second call of a key launches the compiled kernel directly: the same shape at an
    # unaligned offset, or with other strides, must get its own plan and stay right
    R.clear_plans()
    base, w, dyb = make_inputs((4097, 256), dtype, seed=12, device="cuda")
    for _ in range(2):
        for x, dy in ((base[1:], dyb[1:]), (base[:-1], dyb[:-1]), (base.flatten()[3:3 + 4096 * 255].view(4096, 255),
                                                                    dyb[:-1, :255])):
            ww = w[: x.shape[-1]].contiguous()
            check_against_eager(x, ww, dy)
    assert len(R.plans._launches._compiled) >= 3


# ---- the one-launch backward's workspace (per device and stream) ------------------------------
def test_two_norms_in_flight_on_different_streams():
    # each stream gets its own workspace: concurrent backwards must not share partials/counters
    shapes = [(8192, 2048), (16384, 1024)]
    ins = [make_inputs(s, torch.bfloat16, seed=30 + i, device="cuda") for i, s in enumerate(shapes)]
    ref = [fused_grads(*i[:2], EPS, i[2]) for i in ins]
    on_streams_bitwise(ins, lambda x, w, dy: fused_grads(x, w, EPS, dy), ref)


def test_workspace_shared_by_norms_of_different_shapes():
    # one stream, shapes interleaved (the workspace grows and is reused; counters stay zero)
    shapes = [(67, 128), (8192, 4096), (1025, 16384), (300, 130), (262144, 128), (16, 4096)]
    ins = [make_inputs(s, torch.bfloat16, seed=50 + i, device="cuda") for i, s in enumerate(shapes)]
    first = [fused_grads(x, w, EPS, dy) for x, w, dy in ins]
    for _ in range(3):
        for (x, w, dy), want in zip(reversed(ins), reversed(first)):
            got = fused_grads(x, w, EPS, dy)
            assert all(torch.equal(a, b) for a, b in zip(got, want))
    for (x, w, dy) in ins[:2]:
        check_against_eager(x, w, dy)
    assert all(int(ws[1].abs().sum()) == 0 for ws in R.plans._workspaces.values())


def test_cuda_graph_then_eager_on_the_capture_stream():
    # a graph's backward uses a private workspace; eager work after it, on any stream, stays right
    x, w, dy = make_inputs((4096, 2048), torch.bfloat16, seed=60, device="cuda")
    sx, sw = x.clone().requires_grad_(), w.clone().requires_grad_()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        R.fused_rms_norm(sx, sw, EPS).backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    sx.grad = sw.grad = None
    with torch.cuda.graph(g, stream=s):
        R.fused_rms_norm(sx, sw, EPS).backward(dy)
    want = fused_grads(x, w, EPS, dy)
    for _ in range(3):
        g.replay()
        with torch.cuda.stream(s):
            got = fused_grads(x, w, EPS, dy)
        torch.cuda.current_stream().wait_stream(s)
        assert torch.equal(sx.grad, want[1]) and torch.equal(sw.grad, want[2])
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_no_grad_forward_skips_rstd_and_matches():
    x, w, _ = make_inputs((1024, 4096), torch.bfloat16, seed=70, device="cuda")
    with torch.no_grad():
        y = R.fused_rms_norm(x, w, EPS)
    y2, _ = R.launch._forward_impl(x, w, EPS)
    assert torch.equal(y, y2)
