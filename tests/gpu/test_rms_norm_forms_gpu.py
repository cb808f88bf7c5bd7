"""The other RMSNorm forms on the GPU: bf16/fp16/fp32 at the widths of Gemma 3, Qwen3.5 and GPT-OSS
against eager CUDA, fp32 weights with bf16 activations, poisoned outputs, the C++ node (bitwise the
Python node), CUDA graphs, torch.compile, torch.nn.RMSNorm and whole models of the forms' families."""
from __future__ import annotations

import copy
import warnings

import pytest
import torch

from deepspeed_fused.features import rms_norm as F
from deepspeed_fused.ops.rms_norm import native as _native
from deepspeed_fused.ops import rms_norm as R
from unit.test_rms_norm_forms import (EPS, FORM_MODELS, FORM_NAMES, _TINY, _module_step, _randomize, check_form,
                                      form_inputs)

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Gemma 3 head_dim 256 and hidden 2560 / 3840 / 5376, Qwen3.5's gated norm at its linear-attention
# head dim 128, GPT-OSS 2880, a width past the one-block forward (streamed rows)
WIDTHS = [128, 256, 2560, 2880, 3840, 5376, 8192, 20000]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", WIDTHS)
@pytest.mark.parametrize("rows", [1, 67, 1025])
@pytest.mark.parametrize("form", FORM_NAMES)
def test_form_matrix(form, dtype, n, rows):
    f = R.FORMS[form]
    x, w, g, dy = form_inputs(f, (rows, n), dtype, seed=n + rows, device="cuda")
    check_form(f, x, w, g, dy)


@pytest.mark.parametrize("form", ["offset", "weight_first", "weight_first_fp32", "gated", "gated_weight_first",
                                  "gate_first", "t5"])
@pytest.mark.parametrize("n", [128, 2880])
def test_fp32_weight_with_bf16_input(form, n):
    # DeepSeek-V4 keeps some norms in fp32 while activations are bf16: each form's own promotion
    f = R.FORMS[form]
    x, w, g, dy = form_inputs(f, (513, n), torch.bfloat16, torch.float32, seed=n, device="cuda")
    y, dx, dw, dg = check_form(f, x, w, g, dy)
    assert y.dtype == R.form_output_dtype(f, torch.bfloat16, torch.float32) and dw.dtype == torch.float32


@pytest.mark.parametrize("form", FORM_NAMES)
@pytest.mark.parametrize("shape", [(4099, 128), (2, 300, 16, 256), (1025, 2880), (67, 20000)])
def test_form_large_shapes_and_poison(form, shape):
    f = R.FORMS[form]
    x, w, g, dy = form_inputs(f, shape, torch.bfloat16, seed=len(shape), device="cuda")
    check_form(f, x, w, g, dy)
    y0, r0 = R.launch._form_forward_impl(x, w, g, EPS, f)
    y, r = torch.full_like(y0, float("nan")), torch.full_like(r0, float("nan"))
    R.launch._form_forward_impl(x, w, g, EPS, f, y=y, rstd=r)
    assert torch.equal(y, y0) and torch.equal(r, r0)
    dx0, dw0, dg0 = R.launch._form_backward_impl(dy, x, w, g, r0, f)
    nan = (lambda t: None if t is None else torch.full_like(t, float("nan")))
    dx, dw, dg = nan(dx0), nan(dw0), nan(dg0)
    R.launch._form_backward_impl(dy, x, w, g, r0, f, dx=dx, dw=dw, dg=dg)
    for a, b in ((dx, dx0), (dw, dw0), (dg, dg0)):
        assert (a is None and b is None) or torch.equal(a, b)


def _call(f, x, w, g, dy):
    ins = [None if t is None else t.detach().clone().requires_grad_() for t in (x, w, g)]
    y = R.fused_rms_norm_form(ins[0], ins[1], EPS, f, ins[2])
    node = y.grad_fn.name()
    y.backward(dy)
    return (y.detach(),) + tuple(None if t is None else t.grad for t in ins), node


@pytest.mark.parametrize("form", FORM_NAMES)
@pytest.mark.parametrize("shape", [(1025, 128), (8192, 2880), (67, 20000)])
def test_form_native_node_equals_python_node(form, shape):
    assert _native.get(wait=True) is not None, _native.error()
    f = R.FORMS[form]
    x, w, g, dy = form_inputs(f, shape, torch.bfloat16, seed=sum(shape), device="cuda")
    R.clear_plans()
    first, n1 = _call(f, x, w, g, dy)
    _, n2 = _call(f, x, w, g, dy)
    second, n3 = _call(f, x, w, g, dy)
    R.api.NATIVE = False
    try:
        third, n4 = _call(f, x, w, g, dy)
    finally:
        R.api.NATIVE = True
    # the third call runs the C++ node (a form whose math is the Llama form's, T5 with a half
    # weight, runs the Llama node); the first two and the one with the switch off, the Python node
    assert ["CppNode" in n for n in (n1, n2, n3, n4)] == [False, False, True, False], (n1, n2, n3, n4)
    for a, b, c in zip(first, second, third):
        assert (a is None and b is None and c is None) or (torch.equal(a, b) and torch.equal(b, c))


@pytest.mark.parametrize("form", ["gated", "unweighted", "offset"])
def test_form_cuda_graph_capture(form):
    f = R.FORMS[form]
    x, w, g, dy = form_inputs(f, (4096, 256), torch.bfloat16, seed=4, device="cuda")
    ins = [None if t is None else t.clone().requires_grad_() for t in (x, w, g)]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            for t in ins:
                if t is not None:
                    t.grad = None
            R.fused_rms_norm_form(ins[0], ins[1], EPS, f, ins[2]).backward(dy)
    torch.cuda.current_stream().wait_stream(s)
    for t in ins:
        if t is not None:
            t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = R.fused_rms_norm_form(ins[0], ins[1], EPS, f, ins[2])
        sy.backward(dy)
    x2, w2, g2, _ = form_inputs(f, (4096, 256), torch.bfloat16, seed=40, device="cuda")
    with torch.no_grad():
        for t, v in zip(ins, (x2, w2, g2)):
            if t is not None:
                t.copy_(v)
    graph.replay()
    want, _ = _call(f, x2, w2, g2, dy)
    assert torch.equal(sy, want[0])
    for t, v in zip(ins, want[1:]):
        assert (t is None and v is None) or torch.equal(t.grad, v)


@pytest.mark.parametrize("form", ["gated", "offset", "unweighted_rstd_cast"])
def test_form_torch_compile_inductor(form):
    torch._dynamo.reset()
    f = R.FORMS[form]
    x, w, g, dy = form_inputs(f, (4096, 256), torch.bfloat16, seed=6, device="cuda")
    lin = torch.nn.Linear(256, 256, device="cuda", dtype=torch.bfloat16)

    def fn(x, w, g):
        return R.fused_rms_norm_form(lin(x), w, EPS, f, g).float().sin()

    a = [None if t is None else t.clone().requires_grad_() for t in (x, w, g)]
    b = [None if t is None else t.clone().requires_grad_() for t in (x, w, g)]
    yc = torch.compile(fn, fullgraph=True)(*a)
    yc.backward(dy.float())
    ye = fn(*b)
    ye.backward(dy.float())
    torch.testing.assert_close(yc, ye, rtol=2e-2, atol=2e-2)
    for p, q in zip(a, b):
        if p is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=2e-2, atol=2e-1)


def test_no_host_sync_gated():
    f = R.FORMS["gated"]
    x, w, g, dy = form_inputs(f, (8192, 128), torch.bfloat16, seed=2, device="cuda")
    _call(f, x, w, g, dy)
    _call(f, x, w, g, dy)
    torch.cuda.set_sync_debug_mode("error")
    try:
        _call(f, x, w, g, dy)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_torch_rmsnorm_module_matches_its_cuda_forward(affine, dtype):
    # torch.nn.RMSNorm on CUDA (torch's fused kernel): the op's weight-first form reproduces it
    m = _randomize(torch.nn.RMSNorm(2880, eps=None, elementwise_affine=affine)).to("cuda", dtype)
    ref = copy.deepcopy(m)
    assert F.replace_rms_norm(torch.nn.ModuleList([m])) == 1
    x = torch.randn(1025, 2880, device="cuda", dtype=dtype)
    dy = torch.randn_like(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        y, grads = _module_step(m, x, None, dy)
    y_r, grads_r = _module_step(ref, x, None, dy)
    assert y.dtype == y_r.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y, y_r, rtol=1e-5, atol=1e-5)
    else:
        assert (y.float() - y_r.float()).abs().max() <= 2 * 2.0 ** -8 * y_r.float().abs().max()
    for a, b in zip(grads, grads_r):
        rel = (a.double() - b.double()).norm() / b.double().norm()
        assert rel < (1e-5 if dtype == torch.float32 else 1e-2), rel.item()


@pytest.mark.parametrize("family", sorted(FORM_MODELS))
def test_form_family_bf16_training_step(family):
    import transformers

    cls_name, kw, expected = FORM_MODELS[family]
    if not hasattr(transformers, cls_name):
        pytest.skip(f"transformers {transformers.__version__} has no {cls_name}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cfg = getattr(transformers, cls_name)(**{**_TINY, **kw})
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(cfg).to("cuda", torch.bfloat16)
    _randomize(torch.nn.ModuleList([m for m in model.modules() if F.recognise(type(m)) is not None]))
    ref = copy.deepcopy(model)
    rep = F.RmsNormFeature().apply(model, None, F.RmsNormConfig(enabled=True))
    assert rep.details["replaced"] == expected, rep
    ids = torch.randint(0, 257, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def step(m):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="deepspeed_fused", category=RuntimeWarning)
        loss, grads = step(model)
    loss_r, grads_r = step(ref)
    # an MoE router's weight: a last-bit difference of the normalized hidden state can flip a
    # bf16 top-k choice, which changes the router's gradient wholesale; the experts and everything
    # else are still compared
    routers = {n for n, mod in model.named_modules() if any(hasattr(mod, a) for a in ("top_k", "topk"))
               and isinstance(getattr(mod, "weight", None), torch.nn.Parameter)}
    routers = {n + ".weight" for n in routers}
    torch.testing.assert_close(loss.float(), loss_r.float(), rtol=1e-2, atol=1e-2)
    for k in grads:
        if k in routers:
            continue
        a, b = grads[k].float(), grads_r[k].float()
        rel = (a - b).norm() / b.norm().clamp_min(1e-12)
        assert rel < 5e-2, (k, rel.item())
