"""Non-finite inputs, op by op, against the eager code (CPU: the Triton interpreter, fp32 and fp16):
NaN, +inf and -inf in rows, weights, biases and gates give NaN and infinities in the outputs and
gradients exactly where eager's are (masks compared exactly, finite values within the ops' usual
tolerances). The interpreter's ``tl.maximum``/``tl.minimum`` propagate NaN (numpy), the GPU's drop
it (``max.f32``): every test here runs with the GPU's rule (the ``gpu_nan_rule`` fixture), so a
kernel that leans on either rule fails here. Likewise ``torch.sort`` of floats runs with CUDA's
rule for NaN (a NaN with its sign bit set below -inf; the ``cuda_sort_rule`` fixture), so a
reference that sorts floats to rank NaN fails here as on the GPU. Routers: NaN of either sign above
+inf as torch.topk orders them, equal values the lower expert first (torch.topk's own order among
equal values is its implementation's; the values it selects are checked to be the kernels'); rows
of 8 experts and rows of 64 and 256. Last, a tiny Qwen3-MoE
with a NaN row in its hidden states: loss and every gradient non-finite where the unpatched
model's are."""
import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from unit.nonfinite_common import (INF, NAN, ROW_KINDS, assert_nonfinite_like, cuda_float_sort_rule,
                                   eager_topk_lower_index_first, poison_rows, stable_topk)

from deepspeed_fused.ops import moe_reorder as mr
from deepspeed_fused.ops import rope as RP
from deepspeed_fused.ops import rms_norm as RN
from deepspeed_fused.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
       torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}
DTYPES = [torch.float32, torch.float16]


@pytest.fixture(autouse=True)
def gpu_nan_rule(monkeypatch):
    """The interpreter's tl.maximum / tl.minimum (``propagate_nan`` NONE) as the GPU computes them:
    a NaN operand gives the other operand (PTX max.f32 / min.f32), not NaN (numpy's maximum)."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    from triton.runtime import interpreter as ti
    monkeypatch.setattr(ti.InterpreterBuilder, "create_maxnumf",
                        lambda self, a, b: self.binary_op(a, b, np.fmax), raising=True)
    monkeypatch.setattr(ti.InterpreterBuilder, "create_minnumf",
                        lambda self, a, b: self.binary_op(a, b, np.fmin), raising=True)
    yield


@pytest.fixture(autouse=True)
def cuda_sort_rule():
    """``torch.sort`` of floats under the interpreter as CUDA orders NaN (by its sign bit)."""
    import os
    if os.environ.get("TRITON_INTERPRET") != "1":
        yield
        return
    with cuda_float_sort_rule():
        yield


def test_cuda_sort_rule_is_in_force(interpret):
    x = torch.tensor([1.0, NAN, -INF, 0.0, INF, -0.0, 2.0, NAN]).to(interpret)
    x[1] = -x[1]  # a NaN with its sign bit set
    assert torch.sort(x, descending=True, stable=True)[1].tolist() == [7, 4, 6, 0, 3, 5, 2, 1]
    assert x.argsort(stable=True).tolist() == [1, 2, 3, 5, 0, 6, 4, 7]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_stable_topk_takes_every_nan_as_largest(interpret, dtype):
    """The reference's top-k ranks NaN of either sign above +inf under CUDA's sort rule too (the
    CPU's conversion to bfloat16 sets every NaN's sign bit)."""
    x = torch.tensor([[1.0, NAN, -INF, 0.0, INF, -0.0, NAN, 1.0],
                      [-INF, -INF, -INF, -INF, -INF, -INF, -INF, -INF]], dtype=torch.float64)
    x[0, 6] = -x[0, 6]
    x = x.to(dtype).to(interpret)
    bits = {torch.float64: torch.int64, torch.float32: torch.int32}.get(dtype, torch.int16)
    assert x[0, 6].view(bits).item() < 0
    v, i = stable_topk(x, 6)
    assert i.tolist() == [[1, 6, 4, 0, 7, 3], [0, 1, 2, 3, 4, 5]]
    assert v[0, :2].isnan().all() and torch.equal(v[:, 2:], x.gather(1, i)[:, 2:])
    v, i = stable_topk(x, 3, largest=False)
    assert i.tolist() == [[2, 3, 5], [0, 1, 2]]


def test_gpu_nan_rule_is_in_force(interpret):
    import triton
    import triton.language as tl

    @triton.jit
    def k(X, O):
        c = tl.arange(0, 4)
        x = tl.load(X + c)
        tl.store(O + c, tl.maximum(x, 0.0))
        tl.store(O + 4 + c, tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL))

    x = torch.tensor([1.0, NAN, -1.0, 2.0], device=interpret)
    o = torch.empty(8, device=interpret)
    k[(1,)](x, o)
    assert o[:4].tolist() == [1.0, 0.0, 0.0, 2.0]
    assert o[5].isnan() and o[[4, 6, 7]].tolist() == [1.0, 0.0, 2.0]


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _grads(out, leaves, d):
    leaves = [x for x in leaves if x is not None]
    return torch.autograd.grad(out, leaves, d)


# ---- routers -------------------------------------------------------------------------------------
ROUTER_KINDS = ROW_KINDS + ["ties", "ties_nan", "zeros"]


def _router_logits(dtype, device, T=None, E=8, seed=0):
    kinds = ROUTER_KINDS
    gen = torch.Generator().manual_seed(seed)
    x = 2 * torch.randn(len(kinds) + 2, E, generator=gen)
    x = poison_rows(x, [k if k in ROW_KINDS else "finite" for k in kinds])
    r = kinds.index("ties")
    x[r, [1, 4, 6]] = x[r].max() + 1.0
    r = kinds.index("ties_nan")  # two equal largest values next to two NaN (the second's sign bit set)
    x[r, [0, 7]] = x[r].max() + 1.0
    x[r, [2, 5]] = NAN
    x[r, 5] = -x[r, 5]
    x[kinds.index("zeros")] = torch.tensor([0.0, -0.0, 0.0, -1.0, -0.0, 0.0, -2.0, 0.0])[:E]
    return x.to(dtype).to(device)


def _check_router(fn, ref, logits, k, args, dtype_out, d_seed=1):
    gen = torch.Generator().manual_seed(d_seed)
    x, xr = _leaf(logits), _leaf(logits)
    s, i = fn(x, k, *args)
    with eager_topk_lower_index_first():
        sr, ir = ref(xr, k, *args)
    assert torch.equal(i, ir), (i, ir)
    half = [t for t in (logits.dtype, s.dtype) if t != torch.float32]
    tol = TOL[torch.bfloat16 if torch.bfloat16 in half else (half[0] if half else torch.float32)]
    assert_nonfinite_like(s, sr, what="scores", **tol)
    d = torch.randn(s.shape, generator=gen).to(s.device, s.dtype)
    (g,), (gr,) = _grads(s, [x], d), _grads(sr, [xr], d)
    assert_nonfinite_like(g, gr, what="logits' gradient", **tol)
    return i


def _same_values_as_topk(select, ids, k, *args):
    """torch.topk (its own order of equal values) selects the values the kernels selected: the two
    sets of k values, each put in one order (NaN first, whatever the device's sort does with NaN)."""
    sel = select.detach().double()
    vals, plain = sel.gather(1, ids), sel.gather(1, torch.topk(sel, k, dim=-1)[1])
    vals, plain = stable_topk(vals, k).values, stable_topk(plain, k).values
    assert torch.equal(vals.isnan(), plain.isnan())
    assert torch.equal(vals.nan_to_num(), plain.nan_to_num())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,renorm,out", [(1, False, None), (3, True, None), (2, True, "half"), (8, False, None)])
def test_topk_softmax_nonfinite_rows(interpret, dtype, k, renorm, out):
    logits = _router_logits(dtype, interpret)
    out_dtype = torch.float16 if out else None
    ids = _check_router(mr.topk_softmax, mr.topk_softmax_reference, logits, k, (renorm, out_dtype), out_dtype)
    assert ((ids >= 0) & (ids < logits.shape[1])).all()
    _same_values_as_topk(torch.softmax(logits.float(), -1), ids, k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,sd,out", [(1, None, None), (2, None, None), (4, torch.float32, torch.float16),
                                      (8, None, None)])
def test_topk_logits_softmax_nonfinite_rows(interpret, dtype, k, sd, out):
    logits = _router_logits(dtype, interpret)
    ids = _check_router(mr.topk_logits_softmax, mr.topk_logits_softmax_reference, logits, k, (sd, out), out)
    assert ((ids >= 0) & (ids < logits.shape[1])).all()
    assert len(set(ids[ROUTER_KINDS.index("-inf_row")].tolist())) == k  # never one expert twice
    _same_values_as_topk(logits, ids, k)


def many_expert_logits(E, T=64):
    """Rows of ``E`` experts (one program's tile of 64 to 256) with NaN (either sign), +inf and -inf
    scattered, one all-NaN row and one all -inf row."""
    gen = torch.Generator().manual_seed(E)
    x = 2 * torch.randn(T, E, generator=gen)
    for r in range(0, T, 3):
        x[r, torch.randint(0, E, (r % 5 + 1,), generator=gen)] = [NAN, INF, -INF][(r // 3) % 3]
    for r in range(0, T, 9):
        x[r] = torch.where(x[r].isnan(), -x[r], x[r])  # the NaN's sign bit set
    x[1] = NAN
    x[2] = -INF
    return x


@pytest.mark.parametrize("E,dtype", [(64, torch.float32), (256, torch.float16)])
def test_router_nonfinite_rows_many_experts(interpret, E, dtype):
    logits = many_expert_logits(E, T=24).to(dtype).to(interpret)
    ids = _check_router(mr.topk_softmax, mr.topk_softmax_reference, logits, 8, (True, None), None)
    _same_values_as_topk(torch.softmax(logits.float(), -1), ids, 8)
    ids = _check_router(mr.topk_logits_softmax, mr.topk_logits_softmax_reference, logits, 4, (None, None), None)
    _same_values_as_topk(logits, ids, 4)


@pytest.mark.parametrize("G,TG,k,renorm,scale", [(1, 1, 2, True, 1.0), (4, 2, 3, True, 2.5), (4, 1, 2, False, 1.0),
                                                 (2, 2, 8, True, 1.0)])
def test_group_topk_sigmoid_nonfinite_rows(interpret, G, TG, k, renorm, scale):
    logits = _router_logits(torch.float32, interpret)
    bias = (0.2 * torch.randn(8, generator=torch.Generator().manual_seed(5))).to(interpret)
    x, xr = _leaf(logits), _leaf(logits)
    w, i = mr.group_topk_sigmoid(x, bias, k, G, TG, renorm, scale)
    with eager_topk_lower_index_first():
        wr, ir = mr.group_topk_sigmoid_reference(xr, bias, k, G, TG, renorm, scale)
    assert torch.equal(i, ir), (i, ir)
    assert ((i >= 0) & (i < 8)).all()
    assert_nonfinite_like(w, wr, what="weights", **TOL[torch.float32])
    d = torch.randn(w.shape, generator=torch.Generator().manual_seed(2)).to(interpret)
    (g,), (gr,) = _grads(w, [x], d), _grads(wr, [xr], d)
    assert_nonfinite_like(g, gr, what="logits' gradient", **TOL[torch.float32])
    # eager's own torch.topk (its order of equal values is its own): the same weights as a set in
    # the rows whose choices are all different (NaN counted equal)
    wp, ip = mr.group_topk_sigmoid_reference(logits, bias, k, G, TG, renorm, scale)
    choice = (logits.sigmoid() + bias).nan_to_num(nan=3.0, posinf=4.0, neginf=-4.0)
    distinct = torch.tensor([len(set(r.tolist())) == r.numel() for r in choice])
    assert distinct.sum() >= 4
    # (each side's k in one order, NaN of either sign first: the sign of a NaN is the device's)
    wd, wpd = w[distinct], wp[distinct]
    assert_nonfinite_like(stable_topk(wd, k).values, stable_topk(wpd, k).values, what="weights, eager's order",
                          **TOL[torch.float32])


# ---- the experts' gates --------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate", ["swiglu", "oai"])
def test_gates_nonfinite(interpret, dtype, gate):
    gen = torch.Generator().manual_seed(3)
    gu = torch.randn(len(ROW_KINDS) * 2, 32, generator=gen) * 4
    gu = poison_rows(gu, ROW_KINDS + ROW_KINDS[::-1]).to(dtype).to(interpret)
    if gate == "oai":
        fn, ref = (lambda t: mr.oai_gate(t, 1.702, 7.0)), (lambda t: mr.oai_gate_reference(t, 1.702, 7.0))
    else:
        fn, ref = mr.swiglu, mr.swiglu_reference
    x, xr = _leaf(gu), _leaf(gu)
    y, yr = fn(x), ref(xr)
    assert_nonfinite_like(y, yr, what="output", **TOL[dtype])
    d = torch.randn(y.shape, generator=gen).to(y)
    d[1, 2] = NAN
    (g,), (gr,) = _grads(y, [x], d), _grads(yr, [xr], d)
    assert_nonfinite_like(g, gr, what="gradient", **TOL[dtype])


# ---- the reorder's gathers and combine -------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_gathers_and_combine_nonfinite(interpret, dtype):
    gen = torch.Generator().manual_seed(4)
    T, H, E, k = 8, 16, 4, 2
    x = poison_rows(torch.randn(T, H, generator=gen), ROW_KINDS).to(dtype).to(interpret)
    ids = torch.randint(0, E, (T, k), generator=gen)
    ids[:, 1] = (ids[:, 0] + 1) % E
    rs = mr.route_sort(ids.reshape(-1).to(interpret), E, k)
    w = torch.rand(T, k, generator=gen)
    w[2, 0], w[5, 1] = NAN, INF
    w = w.to(interpret)
    tol = TOL[dtype]
    # dispatch with scores, then combine with weights
    xs, xr = _leaf(x), _leaf(x)
    ws, wr = _leaf(w), _leaf(w)
    y = mr.route_dispatch(xs, rs.maps, ws)
    yr = mr.route_dispatch_reference(xr, rs.maps, wr)
    assert_nonfinite_like(y, yr, what="dispatch", **tol)
    out = mr.route_combine(y, rs.maps, ws)
    outr = mr.route_combine_reference(yr, rs.maps, wr)
    assert_nonfinite_like(out, outr, what="combine", **tol)
    d = torch.randn(out.shape, generator=gen).to(out)
    g, gr = _grads(out, [xs, ws], d), _grads(outr, [xr, wr], d)
    assert_nonfinite_like(g[0], gr[0], what="d hidden", **tol)
    assert_nonfinite_like(g[1], gr[1], what="d weights", **tol)
    # the padded permute and its inverse (padding -1 reads a zero row)
    pidx = torch.cat([torch.randperm(T, generator=gen), torch.tensor([-1, -1])]).to(interpret)
    xs, xr = _leaf(x), _leaf(x)
    p, pr = mr.permute_rows(xs, pidx), mr.permute_rows_reference(xr, pidx)
    assert_nonfinite_like(p, pr, what="permute", rtol=0, atol=0)
    d = torch.randn(p.shape, generator=gen).to(p)
    assert_nonfinite_like(_grads(p, [xs], d)[0], _grads(pr, [xr], d)[0], what="permute grad", rtol=0, atol=0)
    s = poison_rows(torch.randn(T + 2, H, generator=gen), ROW_KINDS + ["nan_row", "inf"]).to(dtype).to(interpret)
    ss, sr = _leaf(s), _leaf(s)
    u, ur = mr.unpermute_rows(ss, pidx, T), mr.unpermute_rows_reference(sr, pidx, T)
    assert_nonfinite_like(u, ur, what="unpermute", rtol=0, atol=0)
    d = torch.randn(u.shape, generator=gen).to(u)
    assert_nonfinite_like(_grads(u, [ss], d)[0], _grads(ur, [sr], d)[0], what="unpermute grad", rtol=0, atol=0)


# ---- RMSNorm -------------------------------------------------------------------------------------
def _norm_inputs(dtype, device, n=64, weight_kind=None, gate=False, seed=6):
    gen = torch.Generator().manual_seed(seed)
    x = poison_rows(torch.randn(len(ROW_KINDS), n, generator=gen), ROW_KINDS).to(dtype).to(device)
    w = (1 + 0.1 * torch.randn(n, generator=gen))
    if weight_kind == "nan":
        w[5] = NAN
    elif weight_kind == "inf":
        w[7] = INF
    w = w.to(dtype).to(device)
    g = None
    if gate:
        g = poison_rows(torch.randn(len(ROW_KINDS), n, generator=gen), ROW_KINDS[::-1]).to(dtype).to(device)
    return x, w, g


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_kind", [None, "nan", "inf"])
def test_rms_norm_llama_nonfinite(interpret, dtype, weight_kind):
    x, w, _ = _norm_inputs(dtype, interpret, weight_kind=weight_kind)
    xs, ws, xr, wr = _leaf(x), _leaf(w), _leaf(x), _leaf(w)
    y, yr = RN.fused_rms_norm(xs, ws, 1e-6), RN.rms_norm_reference(xr, wr, 1e-6)
    assert_nonfinite_like(y, yr, what="output", **TOL[dtype])
    d = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y)
    g, gr = _grads(y, [xs, ws], d), _grads(yr, [xr, wr], d)
    assert_nonfinite_like(g[0], gr[0], what="d hidden", **TOL[dtype])
    assert_nonfinite_like(g[1], gr[1], what="d weight", rtol=TOL[dtype]["rtol"] * 4, atol=TOL[dtype]["atol"] * 4)


@pytest.mark.parametrize("form", sorted(n for n in RN.FORMS if n != "llama"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_forms_nonfinite(interpret, form, dtype):
    f = RN.FORMS[form]
    x, w, g = _norm_inputs(dtype, interpret, weight_kind="nan", gate=f.gate != "none")
    if f.weight == "none":
        w = None
    leaves = [_leaf(t) if t is not None else None for t in (x, w, g)]
    refs = [_leaf(t) if t is not None else None for t in (x, w, g)]
    y = RN.fused_rms_norm_form(leaves[0], leaves[1], 1e-6, form, leaves[2])
    yr = RN.rms_norm_form_reference(refs[0], refs[1], 1e-6, form, refs[2])
    assert_nonfinite_like(y, yr, what="output", **TOL[dtype])
    d = torch.randn(y.shape, generator=torch.Generator().manual_seed(8)).to(y)
    gs, grs = _grads(y, leaves, d), _grads(yr, refs, d)
    for name, a, b in zip(("d hidden", "d weight", "d gate"), gs, grs):
        loose = name == "d weight"
        assert_nonfinite_like(a, b, what=name, rtol=TOL[dtype]["rtol"] * (4 if loose else 1),
                              atol=TOL[dtype]["atol"] * (4 if loose else 1))


# ---- rope ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", [RP.RopeSpec(), RP.RopeSpec(pairing="adjacent"), RP.RopeSpec(partial=True)])
def test_rope_nonfinite(interpret, dtype, spec):
    gen = torch.Generator().manual_seed(9)
    b, s, hq, hk, d = 2, 5, 3, 2, 8
    q = torch.randn(b, hq, s, d, generator=gen)
    k = torch.randn(b, hk, s, d, generator=gen)
    q[0, 1, 2, 3], q[1, 0, 4] = NAN, INF
    k[0, 1, 0, 5], k[1, 1, 3, 1] = -INF, NAN
    w = d // 2 if spec.partial else d
    theta = torch.randn(b, s, w, generator=gen, dtype=torch.float64) * 3
    cos, sin = theta.cos(), theta.sin()
    cos[1, 2, 0] = NAN
    sin[0, 3, 1] = INF
    q, k, cos, sin = (t.to(dtype).to(interpret) for t in (q, k, cos, sin))
    qs, ks, qr, kr = _leaf(q), _leaf(k), _leaf(q), _leaf(k)
    out = RP.fused_rope(qs, ks, cos, sin, 1, spec)
    ref = RP.rope_reference(qr, kr, cos, sin, 1, spec)
    for a, r in zip(out, ref):
        assert_nonfinite_like(a, r, what="rope", **TOL[dtype])
    ds = tuple(torch.randn(o.shape, generator=gen).to(o) for o in out)
    g, gr = _grads(out, [qs, ks], ds), _grads(ref, [qr, kr], ds)
    for a, r in zip(g, gr):
        assert_nonfinite_like(a, r, what="rope grad", **TOL[dtype])


# ---- linear cross-entropy --------------------------------------------------------------------------
def _lce_eager(h, w, b, t, ignore_index=-100):
    """The eager loss head (transformers': logits in the input dtype, ``cross_entropy`` of their FP32
    copy), per token, with the logsumexp and the entropy of the same logits."""
    logits = (h @ w.t() if b is None else h @ w.t() + b).float()
    loss = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="none")
    lse = torch.logsumexp(logits, -1)
    ent = lse - (torch.softmax(logits, -1) * logits).sum(-1)
    return loss, lse, ent


LCE_CASES = ["hidden_rows", "weight_nan_row", "weight_inf", "bias_nan", "bias_inf", "bias_-inf", "ignored_nan"]


def _lce_inputs(case, dtype, device, M=8, H=16, V=40, seed=10):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(M, H, generator=gen)
    w = torch.randn(V, H, generator=gen) / H ** 0.5
    b = 0.1 * torch.randn(V, generator=gen)
    t = torch.randint(0, V, (M,), generator=gen)
    t[3] = -100
    if case == "hidden_rows":
        h = poison_rows(h, ROW_KINDS)
    elif case == "weight_nan_row":
        w[t[1]] = NAN
    elif case == "weight_inf":
        w[t[2], 4] = INF
        w[7, 1] = -INF
    elif case == "bias_nan":
        b[5] = NAN
    elif case == "bias_inf":
        b[t[4]] = INF
    elif case == "bias_-inf":
        b[t[5]] = -INF
        b[2] = -INF
    elif case == "ignored_nan":
        h[3] = NAN  # on the ignored row: its loss is 0, but the weight's gradient takes 0 * NaN
    return h.to(dtype).to(device), w.to(dtype).to(device), b.to(dtype).to(device), t.to(device)


def _lce_gemm_switches():
    """The modules of the linear cross-entropy holding the fused GEMMs' on/off switches."""
    import sys
    return [m for n, m in list(sys.modules.items())
            if n.startswith("deepspeed_fused.ops.linear_cross_entropy") and hasattr(m, "_GEMM_STATS_OK")]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", LCE_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("path", ["fused_gemm", "row_kernel", "reference"])
def test_linear_cross_entropy_nonfinite(interpret, dtype, case, with_bias, path, monkeypatch):
    if case.startswith("bias") and not with_bias:
        pytest.skip("no bias")
    if path == "row_kernel":  # cuBLAS (here torch) logits and the row kernel, not the fused GEMMs
        mods = _lce_gemm_switches()
        assert mods
        for m in mods:
            monkeypatch.setattr(m, "_GEMM_STATS_OK", [False])
            monkeypatch.setattr(m, "_GEMM_GRAD_OK", [False])
    h, w, b, t = _lce_inputs(case, dtype, interpret)
    b = b if with_bias else None
    if path == "fused_gemm" and not all(m.gemm_stats_supported(h, w) and m.gemm_grad_supported(h, w)
                                        for m in _lce_gemm_switches()):
        assert interpret != "cpu", "the interpreter runs the fused GEMMs"
        pytest.skip("the fused GEMMs do not run here (Hopper, fp16/bf16)")
    lce = linear_cross_entropy_reference if path == "reference" else linear_cross_entropy
    tol = {torch.float32: dict(rtol=2e-4, atol=2e-4), torch.float16: dict(rtol=1e-2, atol=1e-2),
           torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}[dtype]
    lv = [_leaf(x) if x is not None else None for x in (h, w, b)]
    rv = [_leaf(x) if x is not None else None for x in (h, w, b)]
    # per token: loss, entropy, lse
    loss, ent, lse = lce(lv[0], lv[1], t, bias=lv[2], reduction="none", return_entropy=True,
                                          return_lse=True)
    loss_r, lse_r, ent_r = _lce_eager(rv[0], rv[1], rv[2], t)
    assert_nonfinite_like(loss, loss_r, what="per-token loss", **tol)
    assert_nonfinite_like(lse, lse_r, what="lse", **tol)
    assert_nonfinite_like(ent, ent_r, what="entropy", **tol)
    gen = torch.Generator().manual_seed(11)
    d = [torch.randn(loss.shape, generator=gen).to(loss) for _ in range(2)]
    g, gr = _grads((loss, lse), lv, d), _grads((loss_r, lse_r), rv, d)
    for name, a, r in zip(("d hidden", "d weight", "d bias"), g, gr):
        assert_nonfinite_like(a, r, what=f"per-token {name}", **tol)
    # the mean loss and its gradients
    lv = [_leaf(x) if x is not None else None for x in (h, w, b)]
    rv = [_leaf(x) if x is not None else None for x in (h, w, b)]
    mean = lce(lv[0], lv[1], t, bias=lv[2])
    logits = (rv[0] @ rv[1].t() if rv[2] is None else rv[0] @ rv[1].t() + rv[2]).float()
    mean_r = F.cross_entropy(logits, t)
    assert_nonfinite_like(mean, mean_r, what="mean loss", **tol)
    g, gr = _grads(mean, lv, torch.ones_like(mean)), _grads(mean_r, rv, torch.ones_like(mean_r))
    for name, a, r in zip(("d hidden", "d weight", "d bias"), g, gr):
        assert_nonfinite_like(a, r, what=f"mean {name}", **tol)


# ---- a whole model ---------------------------------------------------------------------------------
def _model_step(model, ids, row):
    handle = model.model.embed_tokens.register_forward_hook(
        lambda m, i, o: o.index_put((torch.tensor([0], device=o.device), torch.tensor([row], device=o.device)),
                                    torch.tensor(NAN, device=o.device, dtype=o.dtype)))
    try:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    finally:
        handle.remove()
    return out.loss.detach(), {k: p.grad for k, p in model.named_parameters()}


@pytest.mark.parametrize("row", [5, 11])
def test_qwen3_moe_nan_row_masks_match_unpatched(interpret, row, dtype=torch.float32):
    from tiny_models import build_model

    from deepspeed_fused import patch_model

    model = build_model("qwen3-moe-tiny", dtype, seed=0).to(interpret)
    ref, ref_plain = copy.deepcopy(model), copy.deepcopy(model)
    rep = patch_model(model, {"rms_norm": {"enabled": True}, "linear_cross_entropy": {"enabled": True},
                              "moe_reorder": {"enabled": True}, "rope": {"enabled": True}})
    fused = {f.name for f in rep.features if f.details}
    assert "moe_reorder" in fused, rep
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(1)).to(interpret)
    # both under one top-k rule: the load-balancing loss takes its own torch.topk of the router
    # logits (its expert counts include the NaN token's choice and reach every token's gradient)
    with eager_topk_lower_index_first():
        loss, grads = _model_step(model, ids, row)
        loss_r, grads_r = _model_step(ref, ids, row)
    loss_p, grads_p = _model_step(ref_plain, ids, row)
    # values: fp32 close; bf16 its masks only (the MoE integration tests compare its values)
    tol = dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=1.0, atol=1.0)
    assert_nonfinite_like(loss, loss_r, what="loss", **tol)
    assert_nonfinite_like(loss_p, loss_r, what="loss (eager's torch.topk)", rtol=1e-5, atol=1e-6)
    some_nonfinite = False
    for name, gr in grads_r.items():
        g = grads[name]
        assert (g is None) == (gr is None), name
        if gr is None:
            continue
        some_nonfinite |= not gr.isfinite().all().item()
        assert_nonfinite_like(g, gr, what=name, **tol)
        gp = grads_p[name]
        if ".experts." in name or name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
            # eager's torch.topk sends a token whose router row is all NaN to experts of its own
            # choosing (equal values): as many experts get a NaN gradient
            nf = lambda t: sorted((~t.flatten(1).isfinite()).sum(1).tolist())  # noqa: E731
            assert nf(gp) == nf(gr), name
        else:
            assert torch.equal(gp.isnan(), gr.isnan()) and torch.equal(gp.isinf(), gr.isinf()), name
    assert some_nonfinite


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("path", ["fused_gemm", "row_kernel", "reference"])
def test_linear_cross_entropy_nonfinite_z_loss_smoothing(interpret, dtype, path, monkeypatch):
    """z_loss and label smoothing with non-finite hidden rows (an ignored row among them: its
    gradient stays 0 though its lse is infinite)."""
    if path == "row_kernel":
        for m in _lce_gemm_switches():
            monkeypatch.setattr(m, "_GEMM_STATS_OK", [False])
            monkeypatch.setattr(m, "_GEMM_GRAD_OK", [False])
    h, w, b, t = _lce_inputs("hidden_rows", dtype, interpret)
    lce = linear_cross_entropy_reference if path == "reference" else linear_cross_entropy
    tol = {torch.float32: dict(rtol=2e-4, atol=2e-4), torch.float16: dict(rtol=1e-2, atol=1e-2),
           torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}[dtype]
    zl, eps = 1e-2, 0.1
    lv, rv = [_leaf(x) for x in (h, w, b)], [_leaf(x) for x in (h, w, b)]
    loss = lce(lv[0], lv[1], t, bias=lv[2], reduction="none", z_loss=zl, label_smoothing=eps)
    logits = (rv[0] @ rv[1].t() + rv[2]).float()
    valid = t != -100
    lse = torch.logsumexp(logits, -1)
    loss_r = F.cross_entropy(logits, t, reduction="none", label_smoothing=eps)
    loss_r = loss_r + torch.where(valid, zl * lse * lse, torch.zeros_like(lse))
    assert_nonfinite_like(loss, loss_r, what="loss", **tol)
    d = torch.randn(loss.shape, generator=torch.Generator().manual_seed(12)).to(loss)
    for name, a, r in zip(("d hidden", "d weight", "d bias"), _grads(loss, lv, d), _grads(loss_r, rv, d)):
        assert_nonfinite_like(a, r, what=name, **tol)
