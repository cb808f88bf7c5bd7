"""Feature "rope": recognition of every transformers family's rotary function (each recognised
one equal to its own eager code, forward and backward, under the interpreter), refusals with
reasons, the per-instance opt-in on tiny models (loss and gradients equal to unpatched, revert,
copies and pickles), and the hook."""
from __future__ import annotations

import copy
import functools
import io
import os
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not in every forked test: custom ops need it)

from deepspeed_fused.features import rope as F
from deepspeed_fused.ops import rope as R
from deepspeed_fused.ops._common import reset_fallback_warnings


@functools.lru_cache(maxsize=None)
def modeling_modules() -> tuple:
    """Every transformers modeling module whose source mentions a rotary embedding."""
    import transformers.models as tm

    root = os.path.dirname(tm.__file__)
    out = []
    for d in sorted(os.listdir(root)):
        p = os.path.join(root, d)
        if not os.path.isdir(p):
            continue
        for f in sorted(os.listdir(p)):
            if f.startswith("modeling_") and f.endswith(".py"):
                with open(os.path.join(p, f)) as fh:
                    text = fh.read()
                if "def apply_rotary" in text or "def apply_rope" in text:
                    out.append(f"transformers.models.{d}.{f[:-3]}")
    return tuple(out)


def _width(spec, d):
    if spec.angles == "pair" or (spec.partial and spec.angles in ("position", "pair_half")):
        return d // 2
    return d


def form_inputs(form: F.Form, dtype, gen, d=8, b=2, s=3, hq=2, hk=1):
    """Inputs in the shapes the family's attention passes: [B, H, S, D] views of [B, S, H, D]
    leaves (vision towers: [S, H, D] with cos [S, width]), cos/sin [B, S, width]."""
    w = _width(form.spec, d)
    if form.unsqueeze_dim == -2:
        leaves = [torch.randn(s, h, d, generator=gen).to(dtype).requires_grad_() for h in (hq, hk)]
        views = leaves
        theta = torch.randn(s, w, generator=gen, dtype=torch.float64) * 3
    else:
        leaves = [torch.randn(b, s, h, d, generator=gen).to(dtype).requires_grad_() for h in (hq, hk)]
        views = [x.transpose(1, 2) for x in leaves]
        theta = torch.randn(b, s, w, generator=gen, dtype=torch.float64) * 3
    if form.single:
        leaves, views = leaves[:1], views[:1]
    return leaves, views, theta.cos().to(dtype), theta.sin().to(dtype)


class _Launches:
    """Counts the op's kernel launches (a fallback would compare eager with eager)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = R._launch

        def counted(*a, **kw):
            self.n += 1
            return real(*a, **kw)

        monkeypatch.setattr(R, "_launch", counted)


def _grads_with_layout(outs, leaves, views, gs):
    """Gradients of the leaves, with the strides of the gradient reaching each view (what the
    layers before the rotation see)."""
    strides = {}
    hooks = [v.register_hook(functools.partial(lambda i, g: strides.__setitem__(i, g.stride()), i))
             for i, v in enumerate(views) if v is not leaves[i]]
    try:
        grads = torch.autograd.grad(outs, leaves, gs)
    finally:
        for h in hooks:
            h.remove()
    return [(g, strides.get(i, g.stride())) for i, g in enumerate(grads)]


def _check_family(fn, form, dtype, launches, seed=0):
    gen = torch.Generator().manual_seed(seed)
    leaves, views, cos, sin = form_inputs(form, dtype, gen)
    g = vars(__import__(fn.__module__, fromlist=["_"]))
    call = F._make_call(g, fn.__name__, fn, form)
    before = launches.n
    reset_fallback_warnings()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = call(*views, cos, sin)
    assert launches.n == before + 1, f"{fn.__module__}.{fn.__name__}: the kernel did not run"
    want = fn(*views, cos, sin)
    got = got if isinstance(got, tuple) else (got,)
    want = want if isinstance(want, tuple) else (want,)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(a, b), (a - b).abs().max()
    gs = tuple(torch.randn(w.shape, generator=gen).to(w.dtype) for w in want)
    ga = _grads_with_layout(got, leaves, views, gs)
    gb = _grads_with_layout(want, leaves, views, gs)
    for (a, sa), (b, sb) in zip(ga, gb):
        assert a.dtype == b.dtype and torch.equal(a, b), (a - b).abs().max()
        assert sa == sb, f"gradient layout {sa}, eager's {sb}"
    assert launches.n == before + 2  # the backward: one launch for q and k


def test_every_family(interpret, monkeypatch):
    """Every transformers function that looks like a rotary embedding is either recognised, and
    then equal to its own eager code bitwise (fp16 and fp32, forward and backward, through the call
    the patched forward makes), or refused with a reason. At least the major families are
    recognised."""
    rows = F.coverage(modeling_modules())
    recognised = [(m, n, d) for m, n, d, why in rows if d]
    refused = [(m, n, why) for m, n, d, why in rows if not d]
    assert len(recognised) > 150, len(recognised)
    for m, n, why in refused:
        assert why, (m, n)
    names = {(m.split(".")[-1], n) for m, n, _ in recognised}
    for fam in ("llama", "qwen2", "qwen3", "qwen3_moe", "mistral", "mixtral", "gemma", "gemma2", "gemma3", "phi3",
                "gpt_neox", "glm", "glm4", "cohere", "olmo2", "stablelm", "persimmon", "gpt_oss", "granite",
                "qwen2_vl", "qwen2_5_vl"):
        assert (f"modeling_{fam}", "apply_rotary_pos_emb") in names, fam
    assert ("modeling_deepseek_v3", "apply_rotary_pos_emb_interleave") in names
    seen_specs = set()
    launches = _Launches(monkeypatch)
    import importlib

    for i, (m, n, _) in enumerate(recognised):
        fn = getattr(importlib.import_module(m), n)
        form = F.recognise(fn)
        _check_family(fn, form, torch.float16, launches, seed=i)
        if (form.name, form.spec) not in seen_specs:  # fp32 once per distinct computation (interpreter time)
            seen_specs.add((form.name, form.spec))
            _check_family(fn, form, torch.float32, launches, seed=i)
    assert launches.n >= 2 * len(recognised)


@pytest.mark.parametrize("mod, name, reason", [
    ("llama4", "apply_rotary_emb", "complex multiply"),
    ("deepseek_v2", "apply_rotary_emb", "complex multiply"),
    ("gptj", "apply_rotary_pos_emb", "rotate_every_two is not a known rotation"),
    ("dinov3_vit", "apply_rotary_pos_emb", "**kwargs"),
    ("qwen4_exp", "apply_rotary_pos_emb", "matches no known RoPE form"),
])
def test_refusals(mod, name, reason):
    import importlib

    fn = getattr(importlib.import_module(f"transformers.models.{mod}.modeling_{mod}"), name)
    why = F.recognise(fn)
    assert isinstance(why, str) and reason in why, why


def test_recognition_is_exact_about_the_math():
    """A function that differs from a form in one operation, constant or helper is refused."""
    rotate_half = F._rh_half
    g = {"torch": torch, "rotate_half": rotate_half}
    src = {
        "llama": "def f(q, k, cos, sin, unsqueeze_dim=1):\n    cos = cos.unsqueeze(unsqueeze_dim)\n"
                 "    sin = sin.unsqueeze(unsqueeze_dim)\n    q_embed = (q * cos) + (rotate_half(q) * sin)\n"
                 "    k_embed = (k * cos) + (rotate_half(k) * sin)\n    return q_embed, k_embed\n",
    }
    ns = dict(g)
    exec(src["llama"], ns)
    assert isinstance(F.recognise(ns["f"]), F.Form)
    variants = [
        src["llama"].replace("(q * cos) + (rotate_half(q) * sin)", "(q * cos) - (rotate_half(q) * sin)"),
        src["llama"].replace("(k * cos) + (rotate_half(k) * sin)", "(k * sin) + (rotate_half(k) * cos)"),
        src["llama"].replace("unsqueeze_dim=1", "unsqueeze_dim=2"),
        src["llama"].replace("return q_embed, k_embed", "return k_embed, q_embed"),
        src["llama"].replace("sin = sin.unsqueeze(unsqueeze_dim)", "sin = sin.unsqueeze(unsqueeze_dim) * 2"),
    ]
    for v in variants:
        ns = dict(g)
        exec(v, ns)
        assert isinstance(F.recognise(ns["f"]), str), v
    # the same function with another rotate_half
    for rh in ("def rotate_half(x):\n    x1 = x[..., : x.shape[-1] // 2]\n    x2 = x[..., x.shape[-1] // 2 :]\n"
               "    return torch.cat((-x1, x2), dim=-1)\n",
               "def rotate_half(x):\n    x1 = x[..., : x.shape[-1] // 3]\n    x2 = x[..., x.shape[-1] // 3 :]\n"
               "    return torch.cat((-x2, x1), dim=-1)\n",
               "def rotate_half(x):\n    x1 = x[..., 0::2]\n    x2 = x[..., 1::2]\n"
               "    return torch.stack((x2, -x1), dim=-1).flatten(-2)\n"):
        ns = {"torch": torch}
        exec(rh, ns)
        exec(src["llama"], ns)
        assert isinstance(F.recognise(ns["f"]), str), rh
    # an unused position_ids parameter and other local names are fine; a used one is not
    ok = ("def f(query, key, c, s, position_ids=None, unsqueeze_dim=1):\n    c = c.unsqueeze(unsqueeze_dim)\n"
          "    s = s.unsqueeze(unsqueeze_dim)\n    a = (query * c) + (rotate_half(query) * s)\n"
          "    b = (key * c) + (rotate_half(key) * s)\n    return a, b\n")
    ns = dict(g)
    exec(ok, ns)
    assert isinstance(F.recognise(ns["f"]), F.Form)
    ns = dict(g)
    exec(ok.replace("unsqueeze(unsqueeze_dim)\n    s", "unsqueeze(position_ids)\n    s"), ns)
    assert isinstance(F.recognise(ns["f"]), str)
