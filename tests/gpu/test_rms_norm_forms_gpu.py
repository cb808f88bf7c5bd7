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
                                      form_inputs, replaced_names)

_TF_VERSION = tuple(int(p) for p in __import__("transformers").__version__.split(".")[:2])

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
    ref32 = copy.deepcopy(model).float()
    rep = F.RmsNormFeature().apply(model, None, F.RmsNormConfig(enabled=True))
    if _TF_VERSION >= (5, 24):
        assert rep.details["replaced"] == replaced_names(model, expected), rep
    else:
        # the forms are recognised by their forward's bytecode as transformers 5.24 writes them; an
        # older release's norm may be written otherwise (then skipped, with the reason) or be another
        # class: every norm module is still either replaced or reported
        skipped = sum(n for by in rep.details["skipped"].values() for n in by.values())
        assert sum(rep.details["replaced"].values()) + skipped == sum(expected.values()), rep
    ids = torch.randint(0, 257, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))

    def step(m):
        out = m(input_ids=ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}

    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="deepspeed_fused", category=RuntimeWarning)
        loss, grads = step(model)
    loss_r, grads_r = step(ref)
    _, grads32 = step(ref32)
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
        a, b, c = grads[k].float(), grads_r[k].float(), grads32[k].float()
        rel = (a - b).norm() / b.norm().clamp_min(1e-12)
        # an ill-conditioned parameter (DeepSeek-V4's hyper-connection scales) moves far under any
        # bf16 rounding: then ours must be no farther from the FP32 model's gradient than eager's
        e_ours = (a - c).norm() / c.norm().clamp_min(1e-12)
        e_eager = (b - c).norm() / c.norm().clamp_min(1e-12)
        assert rel < 5e-2 or e_ours <= 2 * e_eager + 1e-2, (k, rel.item(), e_ours.item(), e_eager.item())


# ---- grouped statistics (group_size) at real widths: Mamba2 / NemotronH (d_inner 4096..8192 in 8
# groups), Falcon-H1 (its gate after or before), Qwen4's hyper-connection norm (4 groups of hidden) ----
_FALCON_BEFORE = R.RMSForm(norm_cast="none", weight="plain", gate="before", out_cast=True)
GROUPED_FORMS = {"gate_first": R.FORMS["gate_first"], "offset": R.FORMS["offset"],
                 "falcon_after": R.RMSForm(norm_cast="none", weight="plain", gate="after", out_cast=True),
                 "falcon_before": _FALCON_BEFORE, "weight_first": R.FORMS["weight_first"]}
# (width, group size): 8 groups of 512 / 1024 (persistent backward), 8 of 768 (not a power of two
# wide), 4 of 2048, 4 of 4096 (the looping backward), 3 of 512 (a group count not a power of two)
GROUPED_SHAPES = [(4096, 512), (8192, 1024), (6144, 768), (8192, 2048), (16384, 4096), (1536, 512)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n,gs", GROUPED_SHAPES)
@pytest.mark.parametrize("rows", [1, 67, 1025])
@pytest.mark.parametrize("form", sorted(GROUPED_FORMS))
def test_grouped_matrix(form, dtype, n, gs, rows):
    f = GROUPED_FORMS[form]
    x, w, g, dy = form_inputs(f, (rows, n), dtype, seed=n + rows + gs, device="cuda")
    check_form(f, x, w, g, dy, group_size=gs)


@pytest.mark.parametrize("form", sorted(GROUPED_FORMS))
@pytest.mark.parametrize("shape,gs", [((2, 2048, 8192), 1024), ((4099, 4096), 512), ((67, 16384), 4096)])
def test_grouped_large_shapes_and_poison(form, shape, gs):
    f = GROUPED_FORMS[form]
    x, w, g, dy = form_inputs(f, shape, torch.bfloat16, seed=len(shape) + gs, device="cuda")
    check_form(f, x, w, g, dy, group_size=gs)
    groups = (shape[-1] // gs, gs)
    x, g, dy = (None if t is None else t.unflatten(-1, groups) for t in (x, g, dy))
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


def _call_grouped(f, x, w, g, dy, gs):
    ins = [None if t is None else t.detach().clone().requires_grad_() for t in (x, w, g)]
    y = R.fused_rms_norm_form(ins[0], ins[1], EPS, f, ins[2], group_size=gs)
    node = y.grad_fn.next_functions[0][0].name()  # below the view back to [..., N]
    y.backward(dy)
    return (y.detach(),) + tuple(None if t is None else t.grad for t in ins), node


@pytest.mark.parametrize("form", sorted(GROUPED_FORMS))
@pytest.mark.parametrize("shape,gs", [((1025, 8192), 1024), ((8192, 4096), 512), ((67, 16384), 4096)])
def test_grouped_native_node_equals_python_node(form, shape, gs):
    assert _native.get(wait=True) is not None, _native.error()
    f = GROUPED_FORMS[form]
    x, w, g, dy = form_inputs(f, shape, torch.bfloat16, seed=sum(shape), device="cuda")
    R.clear_plans()
    first, n1 = _call_grouped(f, x, w, g, dy, gs)
    _, n2 = _call_grouped(f, x, w, g, dy, gs)
    second, n3 = _call_grouped(f, x, w, g, dy, gs)
    R.api.NATIVE = False
    try:
        third, n4 = _call_grouped(f, x, w, g, dy, gs)
    finally:
        R.api.NATIVE = True
    assert ["RmsNormFormFn" in n for n in (n1, n2, n3, n4)] == [False, False, True, False], (n1, n2, n3, n4)
    for a, b, c in zip(first, second, third):
        assert (a is None and b is None and c is None) or (torch.equal(a, b) and torch.equal(b, c))


@pytest.mark.parametrize("model,name,kw,gated", [
    ("mamba2", "MambaRMSNormGated", dict(group_size=1024), True),
    ("nemotron_h", "NemotronHRMSNormGated", dict(group_size=1024), True),
    ("falcon_h1", "FalconH1RMSNormGated", dict(n_groups=8), True),
    ("falcon_h1", "FalconH1RMSNormGated", dict(n_groups=8, norm_before_gate=False), True),
    ("qwen4_exp", "Qwen4ExpTextRMSNorm", dict(group_size=2048), False),
    ("xlstm", "xLSTMRMSNorm", {}, False),
])
def test_grouped_classes_bf16_match_their_cuda_forward(model, name, kw, gated):
    from unit.test_rms_norm_forms import _cls

    n = 8192
    cls = _cls(model, name)
    if _TF_VERSION < (5, 24):
        # the grouped classes as transformers 5.24 writes them; an older release's class may take
        # other arguments or compute otherwise: it must then be left eager, never patched wrongly
        try:
            m = cls(n, **kw)
        except TypeError as e:
            pytest.skip(f"transformers {_TF_VERSION}: {name}(**{kw}): {e}")
        if F.recognise(cls) is None:
            assert F.replace_rms_norm(torch.nn.ModuleList([m])) == 0
            pytest.skip(f"transformers {_TF_VERSION}: {name}'s forward is not a known form there (left eager)")
    m = _randomize(cls(n, **kw)).to("cuda", torch.bfloat16)
    ref = copy.deepcopy(m)
    assert F.replace_rms_norm(torch.nn.ModuleList([m])) == 1
    x = torch.randn(2, 513, n, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn_like(x) if gated else None
    dy = torch.randn_like(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        y, grads = _module_step(m, x, gate, dy)
    assert m.__dict__.get(F.CALLS) is None or m.__dict__[F.CALLS].eager == 0
    y_r, grads_r = _module_step(ref, x, gate, dy)
    assert y.dtype == y_r.dtype
    assert (y.float() - y_r.float()).abs().max() <= 2 * 2.0 ** -8 * y_r.float().abs().max()
    for a, b in zip(grads, grads_r):
        rel = (a.double() - b.double()).norm() / b.double().norm()
        assert rel < 1e-2, rel.item()
