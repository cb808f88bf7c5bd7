"""Fused RoPE on the GPU: every spec in bf16/fp16/fp32 against the reference bitwise (forward
and backward, realistic head counts and dims), every recognised transformers family in bf16
against its own eager code, models in bf16 equal to unpatched, CUDA graphs, torch.compile, no
host syncs, direct launches, 64-bit offsets, another device. Each body runs in a clean worker
(tests/conftest.py): tensors are built inside the bodies."""
from __future__ import annotations

import copy
import importlib

import pytest
import torch

from deepspeed_fused import patch_model, unpatch_model
from deepspeed_fused.features import rope as F
from deepspeed_fused.ops import rope as R
from deepspeed_fused.ops.rope import launch as RL
from tiny_models import build_model
from unit.common import cuda_device_count
from unit.test_rope import SPECS, angle_width, make_inputs
from unit.test_rope_shared_angles import POSITION, check_against_reference, flag, qk, shared_angles
from unit.test_rope_feature import Launches, check_family, modeling_modules

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
SHAPES = [  # d, b, s, q heads, kv heads
    (128, 2, 300, 32, 4),
    (128, 1, 1027, 32, 8),
    (64, 1, 513, 128, 1),
    (256, 3, 17, 5, 1),
    (80, 2, 33, 12, 4),
]


def _check(spec, dtype, shape, angle_dtype=None, seed=0):
    d, b, s, hq, hk = shape
    gen = torch.Generator().manual_seed(seed)
    qb, kb, q, k, cos, sin = make_inputs(spec, dtype, "cuda", d=d, b=b, s=s, hq=hq, hk=hk, gen=gen,
                                         angle_dtype=angle_dtype)
    out = R.fused_rope(q, k, cos, sin, 1, spec)
    ref = R.rope_reference(q, k, cos, sin, 1, spec)
    for o, r in zip(out, ref):
        assert o.dtype == r.dtype and torch.equal(o, r), (o.float() - r.float()).abs().max()
    gs = tuple(torch.randn(o.shape, generator=gen).to("cuda", o.dtype) for o in out)
    got = torch.autograd.grad(out, (qb, kb), gs)
    want = torch.autograd.grad(ref, (qb, kb), gs)
    for a, w in zip(got, want):
        assert a.dtype == w.dtype and torch.equal(a, w), (a.float() - w.float()).abs().max()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SPECS))
def test_specs_against_reference(name, dtype, shape):
    if shape[0] % 4 and SPECS[name].partial:
        pytest.skip("partial specs rotate half the head: needs d % 4 == 0")
    _check(SPECS[name], dtype, shape, seed=shape[0] + shape[2])


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("name", ["llama", "partial", "deinterleave"])
def test_interleaved_q_and_k_tiles(name, shape):
    """The launch knob that orders q's and k's tiles in proportion: the same results, bf16."""
    if shape[0] % 4 and SPECS[name].partial:
        pytest.skip("partial specs rotate half the head: needs d % 4 == 0")
    RL._INTERLEAVE_QK = True
    RL.clear_plans()
    try:
        _check(SPECS[name], torch.bfloat16, shape, seed=shape[2])
    finally:
        RL._INTERLEAVE_QK = False
        RL.clear_plans()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["llama", "deinterleave", "glm-partial", "cast-back", "float32-once", "float32-each"])
def test_float32_angles(name, dtype):
    _check(SPECS[name], dtype, SHAPES[0], angle_dtype=torch.float32, seed=3)


def test_every_family_bf16():
    rows = [r for r in F.coverage(modeling_modules()) if r[2]]
    with Launches() as launches:
        for i, (m, n, _, _) in enumerate(rows):
            fn = getattr(importlib.import_module(m), n)
            form = F.recognise(fn)
            if form.complex or form.x_dim is not None:  # their own inputs: test_rope_forms_gpu.py
                continue
            check_family(fn, form, torch.bfloat16, launches, seed=i, device="cuda", d=128, b=2, s=64, hq=8, hk=2)
            check_family(fn, form, torch.float16, launches, seed=i, device="cuda", d=64, b=1, s=33, hq=4, hk=1)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("name", ["llama-tiny", "qwen3-tiny", "deepseek-v3-tiny"])
def test_models_bf16_equal_unpatched(name, attn):
    """Loss and every gradient bitwise; Llama's q and k gradients in their own layout (no copy),
    Qwen3's (q/k norms before the transpose) contiguous as eager's."""
    from deepspeed_fused.ops.rope import api as RA

    kept, real = [], RA.grad_layout_is_free
    RA.grad_layout_is_free = lambda x: kept.append(real(x)) or kept[-1]
    model = build_model(name, dtype=torch.bfloat16, attn_implementation=attn).cuda().train()
    ref = copy.deepcopy(model)
    assert patch_model(model, {"rope": {"enabled": True}})["rope"].applied
    ids = torch.randint(0, 257, (2, 64), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    losses, grads = [], []
    for m in (model, ref):
        m.zero_grad(set_to_none=True)
        loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad for p in m.parameters()])
    assert torch.equal(*losses)
    assert all(torch.equal(a, b) for a, b in zip(*grads))
    if name != "deepseek-v3-tiny":
        assert kept and all(kept) == (name == "llama-tiny"), kept
    unpatch_model(model)


def test_cuda_graph_and_direct_launches():
    spec = SPECS["llama"]
    gen = torch.Generator().manual_seed(4)
    qb, kb, q, k, cos, sin = make_inputs(spec, torch.bfloat16, "cuda", d=128, b=1, s=512, hq=16, hk=4, gen=gen)
    gq = torch.randn(q.shape, generator=gen).cuda().bfloat16()
    gk = torch.randn(k.shape, generator=gen).cuda().bfloat16()
    R.clear_plans()

    def step(qb=qb, kb=kb):
        # the [B, H, S, D] views are taken inside the step: an autograd node keeps the stream it
        # was built on, and a view built on the default stream before capture would run its
        # backward there (pytorch/pytorch#164302), which no kernel of ours can avoid
        yq, yk = R.fused_rope(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)
        return (yq, yk) + torch.autograd.grad((yq, yk), (qb, kb), (gq, gk))

    first = step()
    second = step()  # through the compiled kernels' C launchers
    assert len(RL._direct) == 2  # forward and backward keys
    assert all(torch.equal(a, b) for a, b in zip(first, second))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    # leaves whose gradient edges are first built inside the capture: the eager steps above built
    # qb's and kb's on the default stream, and the end-of-backward sync with a leaf's stream would
    # tie that legacy stream to the capture (the same holds for any autograd graph, kernels aside)
    qc, kc = qb.detach().clone().requires_grad_(), kb.detach().clone().requires_grad_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step(qc, kc)
    graph.replay()
    torch.cuda.synchronize()
    ref = R.rope_reference(q, k, cos, sin)
    want = ref + torch.autograd.grad(ref, (qb, kb), (gq, gk))
    assert all(torch.equal(a, b) for a, b in zip(captured, want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", POSITION)
def test_shared_angles(name, dtype):
    """Angles built as Hugging Face builds them (the flag set: the second columns not read) at a
    realistic shape, forward and backward bitwise against the reference."""
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(21)
    q, k = qk("cuda", dtype, d=128, b=2, s=257, hq=16, hk=4, gen=gen)
    cos, sin = shared_angles(spec, angle_width(spec, 128), "cuda", b=2, s=257, gen=gen, dtype=dtype)
    assert flag(q, k, cos, sin, spec) == 1
    check_against_reference(q, k, cos, sin, spec, gen)


def test_shared_angles_no_host_sync_and_graph_replay_after_a_write():
    """The flag's device-side check makes no host sync (fresh cos/sin: no cached flag); another
    stream gets a flag of its own; a CUDA graph computes its own flag, so a replay after cos is
    written in place (its halves now differ) gives the new angles' result."""
    spec = SPECS["llama"]
    gen = torch.Generator().manual_seed(22)
    q, k = qk("cuda", torch.bfloat16, d=128, b=1, s=256, hq=8, hk=2, gen=gen)
    cos, sin = shared_angles(spec, 128, "cuda", b=1, s=256, gen=gen, dtype=torch.bfloat16)
    R.fused_rope(q, k, cos, sin, 1, spec)  # plans and compiled kernels
    torch.cuda.synchronize()
    c2, s2 = cos.clone(), sin.clone()
    torch.cuda.set_sync_debug_mode("error")
    try:
        R.fused_rope(q, k, c2, s2, 1, spec)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        R.fused_rope(q, k, c2, s2, 1, spec)
    torch.cuda.current_stream().wait_stream(stream)
    assert sum(1 for rc, *_ in RL._same_cache if rc() is c2) == 2  # a flag per stream
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(graph):
        yq, yk = R.fused_rope(q, k, c2, s2, 1, spec)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip((yq, yk), R.rope_reference(q, k, c2, s2, 1, spec)))
    c2[..., 64:].mul_(0.5)
    s2[..., :64].add_(0.125)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip((yq, yk), R.rope_reference(q, k, c2, s2, 1, spec)))


def test_no_host_sync():
    spec = SPECS["deinterleave"]
    qb, kb, q, k, cos, sin = make_inputs(spec, torch.bfloat16, "cuda", d=64, b=2, s=128, hq=16, hk=1)
    for _ in range(2):
        yq, yk = R.fused_rope(q, k, cos, sin, 1, spec)
        torch.autograd.grad((yq.sum() + yk.sum()), (qb, kb))
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yq, yk = R.fused_rope(q, k, cos, sin, 1, spec)
        torch.autograd.grad((yq, yk), (qb, kb), (torch.ones_like(yq), torch.ones_like(yk)))
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_torch_compile_traces_the_custom_op():
    """The patched forward's call under torch.compile (fullgraph): the custom ops, bitwise equal
    to the family's eager function forward and backward."""
    from transformers.models.qwen3 import modeling_qwen3 as mq

    fn = mq.apply_rotary_pos_emb
    call = F._make_call(vars(mq), "apply_rotary_pos_emb", fn, F.recognise(fn))
    torch._dynamo.reset()
    compiled = torch.compile(call, fullgraph=True, dynamic=False)
    gen = torch.Generator().manual_seed(5)
    qb, kb, q, k, cos, sin = make_inputs(R.LLAMA, torch.bfloat16, "cuda", d=128, b=2, s=64, hq=8, hk=2, gen=gen)
    got = compiled(q, k, cos, sin)
    want = fn(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    gs = tuple(torch.randn(w.shape, generator=gen).cuda().bfloat16() for w in want)
    ga = torch.autograd.grad(got, (qb, kb), gs)
    gb = torch.autograd.grad(want, (qb, kb), gs)
    assert all(torch.equal(a, b) for a, b in zip(ga, gb))


def test_torch_compile_of_a_patched_model():
    model = build_model("qwen3-tiny", dtype=torch.bfloat16).cuda().train()
    patch_model(model, {"rope": {"enabled": True}})
    ids = torch.randint(0, 257, (2, 64), device="cuda")
    torch._dynamo.reset()
    compiled = torch.compile(model)
    loss = compiled(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    unpatch_model(model)


@pytest.mark.gpu_heavy
def test_64bit_offsets():
    """More than 2**31 elements in q: row offsets in 64 bits (checked on the last positions)."""
    b, s, h, d = 1, 131073, 128, 128
    q = torch.randn(b, s, h, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    k = torch.randn(b, s, 1, d, dtype=torch.bfloat16, device="cuda").transpose(1, 2)
    theta = torch.randn(b, s, d, device="cuda")
    cos, sin = theta.cos().bfloat16(), theta.sin().bfloat16()
    with torch.no_grad():
        yq, yk = R.fused_rope(q, k, cos, sin)
        tail = slice(s - 3, s)
        rq, rk = R.rope_reference(q[:, :, tail], k[:, :, tail], cos[:, tail], sin[:, tail])
    assert torch.equal(yq[:, :, tail], rq) and torch.equal(yk[:, :, tail], rk)
    del q, k, yq, yk


@pytest.mark.skipif(cuda_device_count() < 2, reason="needs two GPUs")
def test_tensors_on_another_device():
    spec = SPECS["glm"]
    gen = torch.Generator().manual_seed(6)
    qb, kb, q, k, cos, sin = make_inputs(spec, torch.bfloat16, "cuda:1", d=128, b=1, s=64, hq=8, hk=2, gen=gen)
    assert torch.cuda.current_device() == 0
    for _ in range(2):  # the JIT path, then the direct one
        out = R.fused_rope(q, k, cos, sin, 1, spec)
        ref = R.rope_reference(q, k, cos, sin, 1, spec)
        assert all(torch.equal(a, b) for a, b in zip(out, ref))


@pytest.mark.skipif(cuda_device_count() < 2, reason="needs two GPUs")
def test_data_parallel_replicas_run_fused():
    """nn.DataParallel replicas keep the opt-in (they copy the module's __dict__); each replica's
    thread counts its own calls into the model's counter; results equal the unpatched model's."""
    model = build_model("llama-tiny", attn_implementation="eager").cuda().train()
    ref = copy.deepcopy(model)
    rep = patch_model(model, {"rope": {"enabled": True}})["rope"]
    ids = torch.randint(0, 257, (4, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    results = []
    with Launches() as launches:
        for m in (model, ref):
            dp = torch.nn.DataParallel(m, device_ids=[0, 1])
            m.zero_grad(set_to_none=True)
            loss = dp(input_ids=ids, labels=ids).loss.mean()
            loss.backward()
            results.append((loss.detach(), [p.grad for p in m.parameters()]))
    assert launches.n == 8  # 2 replicas x 2 layers x (forward + backward)
    assert (rep.calls.fused, rep.calls.eager) == (4, 0)
    (la, ga), (lb, gb) = results
    assert torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb))
    unpatch_model(model)
