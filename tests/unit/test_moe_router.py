"""moe_reorder's fused top-k softmax router (CPU: Triton interpreter, fp32 and fp16 logits; bf16 on
the GPU): selection, scores and the logits' gradient against eager, ties, the fallback, the custom
ops, and the router integration (every gradient of a patched MoE model equal to the unpatched one)."""
import importlib
import warnings

import pytest
import torch
import torch.nn.functional as F

from unit.test_rms_norm import ulp

from deepspeed_fused.ops import _common
from deepspeed_fused.ops import moe_reorder as mr

R = importlib.import_module("deepspeed_fused.ops.moe_reorder.router")


def _logits(T, E, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(T, E, generator=gen)).to(dtype).to(device)


def _run(fn, logits, k, renorm, out_dtype, d):
    x = logits.detach().clone().requires_grad_()
    s, i = fn(x, k, renorm, out_dtype)
    s.backward(d)
    return s.detach(), i, x.grad


def _check(logits, k, renorm, out_dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    d = torch.randn(logits.shape[0], k, generator=gen).to(out_dtype or torch.float32).to(logits.device)
    s, i, g = _run(mr.topk_softmax, logits, k, renorm, out_dtype, d)
    sr, ir, gr = _run(mr.topk_softmax_reference, logits, k, renorm, out_dtype, d)
    assert s.dtype == sr.dtype and i.dtype == ir.dtype == torch.int64 and g.dtype == logits.dtype
    # the same probabilities in the same order; experts may differ only among equal probabilities
    # (half-precision logits repeat values; the order of equal values is ours: the lower id first)
    pr = torch.softmax(logits.detach().float(), -1)
    assert torch.equal(pr.gather(1, i), pr.gather(1, ir))
    same = (i == ir).all(-1)
    # half-precision logits repeat values; CUDA's topk orders equal values its own way
    assert same.double().mean() >= (0.99 if logits.dtype == torch.float32 else 0.5)
    chosen = torch.zeros_like(g, dtype=torch.bool).scatter_(1, i, True)[same]
    s, sr, g, gr, d = s[same], sr[same], g[same], gr[same], d[same]

    _scores_close(s, sr, lambda r, c: tuple(fn(logits.detach(), k, renorm, None)[0][same][r, c].item()
                                            for fn in (mr.topk_softmax, mr.topk_softmax_reference)))
    # the gradient's terms are of the size of the scores' gradient d (times p / sum p): a row whose
    # gradient cancels to far below that (k = 2, renormalised) keeps FP32 noise of that size, and
    # with renormalisation the experts not chosen get p * (a sum that is 0 in exact arithmetic):
    # noise in both eager's and ours, compared by size only
    _grads_close(g, gr, d, chosen if renorm else torch.ones_like(chosen))


def _scores_close(s, sr, fp32_of):
    """Scores against eager's: FP32 within 4 ULP; half precision one rounding of values a few FP32
    ULP apart (exp, the sums' order), so at most one ULP apart and 99% equal. ``fp32_of(r, c)``:
    both FP32 values of an element, named when the check fails (for diagnosis on the GPU)."""
    if s.dtype == torch.float32:
        torch.testing.assert_close(s, sr, rtol=4 * 2.0 ** -23, atol=1e-30)
        return
    far = (s.double() - sr.double()).abs() / ulp(sr, s.dtype)
    if (far > 1).any():
        r, c = divmod(int(far.argmax()), far.shape[-1])
        raise AssertionError(f"{int((far > 1).sum())} scores more than one ULP from eager's in "
                             f"{int((far > 1).any(-1).sum())} rows; worst {far.max().item():.2f} ULP: "
                             f"{s[r, c].item()!r} vs {sr[r, c].item()!r} (FP32 %r vs %r)" % fp32_of(r, c))
    assert (s == sr).double().mean() >= 0.99


def _grads_close(g, gr, d, exact):
    """Logits' gradients against eager's, relative to the size of their terms (the largest of the
    row's gradient and of the scores' gradient ``d``); ``exact``: the elements 99% equal in half
    precision."""
    scale = torch.maximum(gr.double().abs().amax(-1, keepdim=True), d.double().abs().amax(-1, keepdim=True))
    err = (g.double() - gr.double()).abs()
    if g.dtype == torch.float32:
        assert (err <= 1e-6 * scale).all()
    else:
        # both round once from FP32 values a few ULP apart (the sums' order differs): where that
        # value sits near a rounding midpoint the two land on neighbours, one ULP of the element
        assert (err <= 2.0 ** -12 * scale + ulp(gr, g.dtype)).all()
        assert (g == gr)[exact].double().mean() >= 0.99

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,E,k", [(37, 128, 8), (5, 8, 2), (64, 60, 4), (3, 256, 8), (1, 2, 1)])
@pytest.mark.parametrize("renorm,cast", [(True, True), (False, True), (True, False)])
def test_topk_softmax_matches_eager(interpret, dtype, T, E, k, renorm, cast):
    logits = _logits(T, E, dtype, interpret, seed=T + E + k)
    _check(logits, k, renorm, dtype if cast else None)


def test_ties_take_the_lower_expert(interpret):
    # equal logits (bf16 logits are often equal): the lower expert id first, as torch.topk on CPU here
    logits = torch.zeros(4, 16, device=interpret)
    logits[:, [3, 7, 11]] = 1.0
    s, i = mr.topk_softmax(logits, 2, True)
    assert i.tolist() == [[3, 7]] * 4 and torch.allclose(s, torch.full_like(s, 0.5))


def test_every_output_written(interpret, monkeypatch):
    real = torch.empty

    def poisoned(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    monkeypatch.setattr(R.torch, "empty", poisoned)
    logits = _logits(33, 40, torch.float32, interpret, seed=5).requires_grad_()
    s, i = mr.topk_softmax(logits, 3, True, torch.float32)
    s.sum().backward()
    assert torch.isfinite(s).all() and (i >= 0).all() and torch.isfinite(logits.grad).all()


def test_checks_and_fallback():
    with pytest.raises(ValueError, match="top_k"):
        mr.topk_softmax(torch.randn(3, 4), 5, True)
    with pytest.raises(ValueError, match="logits"):
        mr.topk_softmax(torch.randn(3), 1, True)
    with pytest.raises(TypeError, match="out_dtype"):
        mr.topk_softmax(torch.randn(3, 4), 1, True, torch.int32)
    _common.reset_fallback_warnings()
    x = torch.randn(4, 2048)  # more experts than the kernel holds: the reference, one warning
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a, b = mr.topk_softmax(x, 2, True), mr.topk_softmax(x, 2, True)
    assert sum("topk_softmax" in str(m.message) for m in w) == 1
    ref = mr.topk_softmax_reference(x, 2, True)
    assert torch.equal(a[1], ref[1]) and torch.allclose(a[0], ref[0])


def test_custom_ops(interpret):
    logits = _logits(6, 16, torch.float32, interpret, seed=6)
    torch.library.opcheck(R._topk_softmax_op, (logits.requires_grad_(), 3, True, torch.float32))
    s, i = R._topk_softmax_op(logits, 3, True, torch.float32)
    torch.library.opcheck(R._topk_softmax_backward_op, (logits.detach(), i, torch.randn_like(s), True))


# ---- the router integration (moe_reorder's transformers path) -----------------------------------
@pytest.mark.parametrize("name", ["qwen3-moe-tiny", "mixtral-tiny", "deepseek-v3-tiny", "deepseek-v3-groups"])
def test_router_integration(interpret, name, monkeypatch):
    import copy

    from tiny_models import build_model

    from deepspeed_fused import patch_model, unpatch_model

    if name == "deepseek-v3-groups":  # 8 experts in 4 groups, 2 groups chosen, renormalised and scaled
        model = build_model("deepseek-v3-tiny", torch.float32, seed=0, n_routed_experts=8, n_group=4, topk_group=2,
                            num_experts_per_tok=3, norm_topk_prob=True, routed_scaling_factor=2.5)
        for m in model.modules():  # a correction bias that changes the choice
            if hasattr(m, "e_score_correction_bias"):
                m.e_score_correction_bias.normal_(0, 0.2, generator=torch.Generator().manual_seed(3))
    else:
        model = build_model(name, torch.float32, seed=0)
    ref = copy.deepcopy(model)
    calls = []
    op = "group_topk_sigmoid" if name.startswith("deepseek") else "topk_softmax"
    real = getattr(mr, op)
    monkeypatch.setattr(mr, op, lambda *a: calls.append(a[1:]) or real(*a))
    rep = patch_model(model, {"moe_reorder": {"enabled": True}})
    r = rep.features[[f.name for f in rep.features].index("moe_reorder")]
    n = r.details["layers"]
    ids = torch.randint(0, 257, (2, 12), generator=torch.Generator().manual_seed(1))

    def step(m):
        out = m(input_ids=ids, labels=ids)
        loss = out.loss + (out.aux_loss if getattr(out, "aux_loss", None) is not None else 0)
        loss.backward()
        return loss.detach(), {k: p.grad for k, p in m.named_parameters() if p.grad is not None}

    assert r.details["routers"] == n and f"routers fused: {n}" in r.reason, r
    loss, grads = step(model)
    assert len(calls) == r.details["routers"]
    loss_r, grads_r = step(ref)
    torch.testing.assert_close(loss, loss_r, rtol=1e-6, atol=1e-6)
    for k in grads_r:  # the router weights' gradients included (the aux loss's path too)
        torch.testing.assert_close(grads[k], grads_r[k], rtol=1e-5, atol=1e-6, msg=k)
    twin = copy.deepcopy(model)  # a copy keeps the opt-in
    calls.clear()
    twin(input_ids=ids)
    assert len(calls) == r.details["routers"]
    unpatch_model(model)  # reverted: the routers run their own forward again
    calls.clear()
    model(input_ids=ids)
    assert not calls


def test_router_opt_in_after_pickle_and_repatch(interpret, monkeypatch):
    # a pickled model loads with its routers' opt-in off (they run their own forward); patching it
    # again turns them on again
    import pickle

    from tiny_models import build_model

    from deepspeed_fused import patch_model

    model = build_model("qwen3-moe-tiny", torch.float32, seed=0)
    patch_model(model, {"moe_reorder": {"enabled": True}})
    loaded = pickle.loads(pickle.dumps(model))
    calls = []
    real = mr.topk_softmax
    monkeypatch.setattr(mr, "topk_softmax", lambda *a: calls.append(1) or real(*a))
    ids = torch.randint(0, 257, (1, 8), generator=torch.Generator().manual_seed(2))
    loaded(input_ids=ids)
    assert not calls
    rep = patch_model(loaded, {"moe_reorder": {"enabled": True}})
    r = rep.features[[f.name for f in rep.features].index("moe_reorder")]
    assert r.applied and "routers fused: 2" in r.reason, r
    loaded(input_ids=ids)
    assert calls


def test_router_opt_in_when_already_applied(interpret):
    # the feature's own "already applied" path (a loaded model's record is in force) opts the
    # routers in again
    import pickle

    from tiny_models import build_model

    from deepspeed_fused.features import moe_reorder

    model = build_model("qwen3-moe-tiny", torch.float32, seed=0)
    feat = moe_reorder.MoeReorderFeature()
    cfg = moe_reorder.MoeReorderConfig(enabled=True)
    feat.apply(model, None, cfg)
    loaded = pickle.loads(pickle.dumps(model))
    gates = [m.gate for m in loaded.modules() if hasattr(m, "experts") and hasattr(m, "gate")]
    assert gates and not any(moe_reorder._ROUTER_OPT_IN.holds(g) for g in gates)
    rep = feat.apply(loaded, None, cfg)
    assert rep.reason.startswith("already applied") and "routers fused: 2" in rep.reason, rep
    assert all(moe_reorder._ROUTER_OPT_IN.holds(g) for g in gates)



def _sorted_pairs(w, i):
    order = i.argsort(-1)
    return w.gather(1, order), i.gather(1, order)


@pytest.mark.parametrize("T,E,G,TG,k", [(37, 256, 8, 4, 8), (16, 64, 1, 1, 6), (9, 32, 4, 2, 3), (5, 8, 2, 1, 2)])
@pytest.mark.parametrize("renorm", [True, False])
def test_group_topk_sigmoid_matches_eager(interpret, T, E, G, TG, k, renorm):
    gen = torch.Generator().manual_seed(T + E)
    logits = (2 * torch.randn(T, E, generator=gen)).to(interpret)
    bias = (0.3 * torch.randn(E, generator=gen)).to(interpret)
    d = torch.randn(T, k, generator=gen).to(interpret)
    args = (k, G, TG, renorm, 2.5)
    x1, x2 = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    w, i = mr.group_topk_sigmoid(x1, bias, *args)
    wr, ir = mr.group_topk_sigmoid_reference(x2, bias, *args)
    # transformers' top-k is unsorted: compare the chosen experts as sets, their weights by expert
    ws, is_ = _sorted_pairs(w, i)
    wrs, irs = _sorted_pairs(wr, ir)
    assert torch.equal(is_, irs)
    torch.testing.assert_close(ws, wrs, rtol=4 * 2.0 ** -23, atol=1e-30)
    # the same upstream gradient per expert: permute d to each side's order
    dr = d.gather(1, i.argsort(-1)).gather(1, ir.argsort(-1).argsort(-1))
    w.backward(d)
    wr.backward(dr)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-7)
    assert w.dtype == torch.float32 and i.dtype == torch.int64


def test_group_topk_sigmoid_checks():
    x, b = torch.randn(3, 8), torch.zeros(8)
    with pytest.raises(ValueError, match="n_group"):
        mr.group_topk_sigmoid(x, b, 2, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="topk_group"):
        mr.group_topk_sigmoid(x, b, 2, 2, 3, True, 1.0)
    with pytest.raises(ValueError, match="bias"):
        mr.group_topk_sigmoid(x, torch.zeros(7), 2, 2, 1, True, 1.0)
    with pytest.raises(ValueError, match="top_k"):
        mr.group_topk_sigmoid(x, b, 5, 2, 1, True, 1.0)


def test_group_custom_ops(interpret):
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(6, 32, generator=gen).to(interpret)
    bias = (0.1 * torch.randn(32, generator=gen)).to(interpret)
    torch.library.opcheck(R._group_op, (logits.requires_grad_(), bias, 3, 4, 2, True, 2.5))
    w, i = R._group_op(logits, bias, 3, 4, 2, True, 2.5)
    torch.library.opcheck(R._group_backward_op, (logits.detach(), i, torch.randn_like(w), True, 2.5))


# ---- the routers that take the top-k of the logits first (GPT-OSS, Aria, Cohere2-MoE) ------------
def _check_logits_first(logits, k, sd, out, seed=1):
    gen = torch.Generator().manual_seed(seed)
    want_dtype = out or sd or logits.dtype
    d = torch.randn(logits.shape[0], k, generator=gen).to(want_dtype).to(logits.device)
    s, i, g = _run(lambda x, *a: mr.topk_logits_softmax(x, k, sd, out), logits, k, None, None, d)
    sr, ir, gr = _run(lambda x, *a: mr.topk_logits_softmax_reference(x, k, sd, out), logits, k, None, None, d)
    assert s.dtype == sr.dtype == want_dtype and i.dtype == ir.dtype == torch.int64 and g.dtype == logits.dtype
    # the same logits chosen in the same order (equal logits: ours the lower expert first)
    assert torch.equal(logits.gather(1, i), logits.gather(1, ir))
    same = (i == ir).all(-1)
    assert same.double().mean() >= (0.99 if logits.dtype == torch.float32 else 0.5)
    s, sr, g, gr, d = s[same], sr[same], g[same], gr[same], d[same]
    _scores_close(s, sr, lambda r, c: tuple(fn(logits.detach(), k, torch.float32)[0][same][r, c].item()
                                            for fn in (mr.topk_logits_softmax, mr.topk_logits_softmax_reference)))
    # the gradient: exactly zero off the chosen experts; there, the softmax backward of size |d|
    chosen = torch.zeros_like(g, dtype=torch.bool).scatter_(1, i[same], True)
    assert (g[~chosen] == 0).all() and (gr[~chosen] == 0).all()
    if logits.is_cuda or want_dtype == torch.float32 or sd is not None:
        _grads_close(g, gr, d, chosen)
        return
    # a softmax in half precision: the kernel computes its backward as CUDA's eager does (t = g * y
    # rounded to the softmax's dtype by its own kernel, then t - y * sum(t)); CPU's eager rounds
    # once, so here the kernel is held to CUDA's formula written out, and to CPU's eager within the
    # rounding of t (at most one ULP of the row's scale in all, plus the final rounding)
    y = sr.float()
    t = (d.float() * y).to(want_dtype).float()
    dv = (t - y * t.sum(-1, keepdim=True)).to(want_dtype)
    gc = torch.zeros_like(g).scatter_(1, i[same], dv)
    _grads_close(g, gc, d, chosen)
    scale = torch.maximum(gr.double().abs().amax(-1, keepdim=True), d.double().abs().amax(-1, keepdim=True))
    assert ((g.double() - gr.double()).abs() <= 2 * ulp(scale, g.dtype) + ulp(gr, g.dtype)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("T,E,k", [(37, 32, 4), (5, 8, 2), (64, 128, 8), (1, 2, 1)])
@pytest.mark.parametrize("sd,out", [(None, None), ("fp32", "same"), ("fp32", None)])
def test_topk_logits_softmax_matches_eager(interpret, dtype, T, E, k, sd, out):
    # (None, None): GPT-OSS and Aria (the softmax in the logits' dtype); ("fp32", "same"): Cohere2-MoE
    # (an FP32 softmax cast back); ("fp32", None): FP32 scores
    sd_ = torch.float32 if sd == "fp32" else None
    out_ = dtype if out == "same" else None
    _check_logits_first(_logits(T, E, dtype, interpret, seed=T + E + k), k, sd_, out_)


def test_topk_logits_softmax_ties_poison_checks(interpret, monkeypatch):
    logits = torch.zeros(4, 16, device=interpret)
    logits[:, [3, 7, 11]] = 1.0
    s, i = mr.topk_logits_softmax(logits, 2)
    assert i.tolist() == [[3, 7]] * 4 and torch.allclose(s, torch.full_like(s, 0.5))
    real = torch.empty

    def poisoned(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t.fill_(-7)

    monkeypatch.setattr(R.torch, "empty", poisoned)
    x = _logits(33, 40, torch.float32, interpret, seed=5).requires_grad_()
    s, i = mr.topk_logits_softmax(x, 3)
    s.square().sum().backward()
    assert torch.isfinite(s).all() and (i >= 0).all() and torch.isfinite(x.grad).all()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="top_k"):
        mr.topk_logits_softmax(torch.randn(3, 4), 5)
    with pytest.raises(TypeError, match="softmax_dtype"):
        mr.topk_logits_softmax(torch.randn(3, 4), 2, torch.int32)
    with pytest.raises(TypeError, match="out_dtype"):
        mr.topk_logits_softmax(torch.randn(3, 4), 2, None, torch.int32)
    _common.reset_fallback_warnings()
    x = torch.randn(4, 2048)  # more experts than the kernel holds: the reference, one warning
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        a = mr.topk_logits_softmax(x.to(interpret), 2)
        mr.topk_logits_softmax(x.to(interpret), 2)
    assert len([m for m in w if "topk_logits_softmax" in str(m.message)]) == 1
    ref = mr.topk_logits_softmax_reference(x.to(interpret), 2)
    assert torch.equal(a[1], ref[1]) and torch.equal(a[0], ref[0])


def test_topk_logits_softmax_custom_ops(interpret):
    logits = _logits(6, 16, torch.float32, interpret, seed=6)
    torch.library.opcheck(R._kl_op, (logits.requires_grad_(), 3, 0, torch.float32))
    s, i = R._kl_op(logits, 3, 0, torch.float32)
    torch.library.opcheck(R._kl_backward_op, (logits.detach(), i, torch.randn_like(s), 0))


def _logits_first_model(name):
    import transformers

    small = dict(hidden_size=32, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=16, vocab_size=64)
    if name == "gpt_oss":
        cfg = transformers.GptOssConfig(**small, num_local_experts=4, num_experts_per_tok=2,
                                        layer_types=["full_attention"] * 2)
        model = transformers.GptOssForCausalLM(cfg)
    elif name.startswith("cohere2_moe"):
        cfg = transformers.Cohere2MoeConfig(**small, num_experts=4, num_experts_per_tok=2,
                                            expert_selection_fn=name.split("-")[1])
        model = transformers.Cohere2MoeForCausalLM(cfg)
    else:
        cfg = transformers.AriaTextConfig(**small, moe_num_experts=4, moe_topk=2)
        model = transformers.AriaTextForCausalLM(cfg)
    model = model.float()
    for p in model.parameters():  # the init leaves biases zero and some weights constant: noise
        p.data.normal_(0, 0.3, generator=torch.Generator().manual_seed(p.numel()))
    return model


@pytest.mark.parametrize("name", ["gpt_oss", "cohere2_moe-softmax", "cohere2_moe-sigmoid", "aria_text"])
def test_logits_first_router_integration(interpret, name, monkeypatch):
    import copy

    from deepspeed_fused import patch_model, unpatch_model

    model = _logits_first_model(name)
    ref = copy.deepcopy(model)
    calls = []
    real = mr.topk_logits_softmax
    monkeypatch.setattr(mr, "topk_logits_softmax", lambda *a: calls.append(a[1:]) or real(*a))
    rep = patch_model(model, {"moe_reorder": {"enabled": True}})
    r = rep.features[[f.name for f in rep.features].index("moe_reorder")]
    n = r.details["layers"]
    fused = 0 if name.endswith("sigmoid") else n  # Cohere2's sigmoid selection keeps its router
    assert n == 2 and r.details["routers"] == fused and f"routers fused: {fused}" in r.reason, r
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(1))

    def step(m):
        out = m(input_ids=ids, labels=ids)
        loss = out.loss + (out.aux_loss if getattr(out, "aux_loss", None) is not None else 0)
        loss.backward()
        return loss.detach(), {k: p.grad for k, p in m.named_parameters() if p.grad is not None}

    loss, grads = step(model)
    assert len(calls) == fused
    if name.startswith("cohere2_moe-softmax"):
        assert all(c[1:] == (torch.float32, torch.float32) for c in calls)
    loss_r, grads_r = step(ref)
    torch.testing.assert_close(loss, loss_r, rtol=1e-6, atol=1e-6)
    for k in grads_r:  # the router weights' (and GPT-OSS's router bias's) gradients included
        torch.testing.assert_close(grads[k], grads_r[k], rtol=1e-5, atol=1e-6, msg=k)
    unpatch_model(model)
    calls.clear()
    model(input_ids=ids)
    assert not calls


def test_logits_first_router_templates_are_exact():
    # a router whose forward differs by anything (here: the softmax over the experts, not the k)
    # is not taken
    from deepspeed_fused.features import moe_reorder

    class Same(torch.nn.Module):  # GPT-OSS's forward, written here (this module's F and torch)
        def forward(self, hidden_states):
            router_logits = F.linear(hidden_states, self.weight, self.bias)  # (num_tokens, num_experts)
            router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)  # (num_tokens, top_k)
            router_scores = torch.nn.functional.softmax(router_top_value, dim=1, dtype=router_top_value.dtype)
            return router_logits, router_scores, router_indices

    class Other(torch.nn.Module):
        def forward(self, hidden_states):
            router_logits = F.linear(hidden_states, self.weight, self.bias)  # (num_tokens, num_experts)
            router_top_value, router_indices = torch.topk(router_logits, self.top_k, dim=-1)  # (num_tokens, top_k)
            router_scores = torch.nn.functional.softmax(router_logits, dim=1, dtype=router_top_value.dtype)
            return router_logits, router_scores, router_indices

    assert moe_reorder.router_form(Same) == ("logits_first", "bias")
    assert moe_reorder.router_form(Other) is None
    from transformers.models.gpt_oss import modeling_gpt_oss

    assert moe_reorder.router_form(modeling_gpt_oss.GptOssTopKRouter) == ("logits_first", "bias")
