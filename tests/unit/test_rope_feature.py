"""Feature "rope": recognition of every transformers family's rotary function (each recognised
one equal to its own eager code, forward and backward, under the interpreter), refusals with
reasons, the per-instance opt-in on tiny models (loss and gradients equal to unpatched, revert,
copies and pickles), and the hook."""
from __future__ import annotations

import copy
import functools
import io
import os
import types
import warnings

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not in every forked test: custom ops need it)

from deepspeed_fused.features import rope as F
from deepspeed_fused.ops import rope as R
from deepspeed_fused.ops.rope import launch as RL
from deepspeed_fused.ops._common import reset_fallback_warnings


@pytest.fixture
def launches():
    with Launches() as counter:
        yield counter


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


def form_inputs(form: F.Form, dtype, gen, d=8, b=2, s=3, hq=2, hk=1, device="cpu"):
    """Inputs in the shapes the family's attention passes: [B, H, S, D] views of [B, S, H, D]
    leaves (vision towers: [S, H, D] with cos [S, width]), cos/sin [B, S, width]."""
    w = _width(form.spec, d)
    if form.unsqueeze_dim == -2:
        leaves = [torch.randn(s, h, d, generator=gen).to(device, dtype).requires_grad_() for h in (hq, hk)]
        views = leaves
        theta = torch.randn(s, w, generator=gen, dtype=torch.float64) * 3
    else:
        leaves = [torch.randn(b, s, h, d, generator=gen).to(device, dtype).requires_grad_() for h in (hq, hk)]
        views = [x.transpose(1, 2) for x in leaves]
        theta = torch.randn(b, s, w, generator=gen, dtype=torch.float64) * 3
    if form.single:
        leaves, views = leaves[:1], views[:1]
    return leaves, views, theta.cos().to(device, dtype), theta.sin().to(device, dtype)


class Launches:
    """Counts the op's kernel launches while entered (a fallback would compare eager with eager)."""

    def __init__(self):
        self.n = 0
        self._real = None

    def __enter__(self):
        self._real = real = RL._launch

        def counted(*a, **kw):
            self.n += 1
            return real(*a, **kw)

        RL._launch = counted
        return self

    def __exit__(self, *exc):
        RL._launch = self._real


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


def check_family(fn, form, dtype, launches, seed=0, device="cpu", **shape):
    """The fused call a patched forward makes equals ``fn`` (the family's own function): outputs,
    gradients and the gradients' layout, bitwise; the kernel ran (one launch each way)."""
    gen = torch.Generator().manual_seed(seed)
    leaves, views, cos, sin = form_inputs(form, dtype, gen, device=device, **shape)
    g = vars(__import__(fn.__module__, fromlist=["_"]))
    # the module's global: fn itself, or (transformers >= 5.25) the kernels function module around it
    original = g[fn.__name__]
    assert F.plain_function(original) is fn
    call = F._make_call(g, fn.__name__, original, form)
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
    gs = tuple(torch.randn(w.shape, generator=gen).to(device, w.dtype) for w in want)
    ga = _grads_with_layout(got, leaves, views, gs)
    gb = _grads_with_layout(want, leaves, views, gs)
    for (a, sa), (b, sb) in zip(ga, gb):
        assert a.dtype == b.dtype and torch.equal(a, b), (a - b).abs().max()
        assert sa == sb, f"gradient layout {sa}, eager's {sb}"
    assert launches.n == before + 2  # the backward: one launch for q and k


def test_every_family(interpret, launches):
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
    import importlib

    skipped = 0
    for i, (m, n, _) in enumerate(recognised):
        fn = F.plain_function(getattr(importlib.import_module(m), n))
        form = F.recognise(fn)
        if form.complex or form.x_dim is not None:  # their own inputs: tests/unit/test_rope_forms.py
            skipped += 1
            continue
        check_family(fn, form, torch.float16, launches, seed=i)
        if (form.name, form.spec) not in seen_specs:  # fp32 once per distinct computation (interpreter time)
            seen_specs.add((form.name, form.spec))
            check_family(fn, form, torch.float32, launches, seed=i)
    assert launches.n >= 2 * (len(recognised) - skipped) and skipped <= 6


def test_every_attention_class_can_be_patched():
    """Every module class of every transformers family whose forward calls a recognised function
    can have its forward copied (plain or deprecate_kwarg-decorated); the others are refused with
    the function and the reason. The copy's code differs from the forward's only in the renamed
    global."""
    import importlib

    ok, refused = 0, []
    for m in modeling_modules():
        try:
            mod = importlib.import_module(m)
        except Exception:
            continue
        for cname, cls in vars(mod).items():
            if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module) and cls.__module__ == m):
                continue
            kind, info = F._analyse_forward(cls.forward)
            if kind == "ignore":
                continue
            if kind == "skip":
                assert ": " in info, info
                refused.append((cname, info))
                continue
            forms, _ = info
            renames = {n: F.PREFIX + n for n in forms}
            copy_ = F._copy_forward(cls.forward, renames)
            assert not isinstance(copy_, str), (cname, copy_)
            inner, _ = F._innermost(cls.forward)
            body, _ = F._innermost(copy_)
            assert body.__code__.co_code == inner.__code__.co_code
            assert body.__code__.co_names == tuple(renames.get(n, n) for n in inner.__code__.co_names)
            ok += 1
    assert ok > 200 and len(refused) < 40, (ok, len(refused))


@pytest.mark.parametrize("mod, name, reason", [
    ("llama4", "vision_apply_rotary_emb", "complex multiply (view_as_complex) in no known form"),
    ("dinov3_vit", "apply_rotary_pos_emb", "**kwargs"),
    ("sam3", "apply_rotary_pos_emb_2d", "matches no known RoPE form"),
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


# ---- the feature on models ---------------------------------------------------------------------
from deepspeed_fused import patch_model, unpatch_model  # noqa: E402
from tiny_models import build_model  # noqa: E402
from unit.test_rope import make_inputs  # noqa: E402

ON = {"rope": {"enabled": True}}




def _ids(seed=0):
    return torch.randint(0, 257, (2, 6), generator=torch.Generator().manual_seed(seed))


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


@pytest.mark.parametrize("name, dtype, where, forms", [
    ("llama-tiny", torch.float32, "2 x LlamaAttention", ["LlamaAttention.apply_rotary_pos_emb: llama (split-half)"]),
    ("llama-tiny", torch.float16, "2 x LlamaAttention", None),
    ("qwen3-tiny", torch.float32, "2 x Qwen3Attention", ["Qwen3Attention.apply_rotary_pos_emb: llama (split-half)"]),
    ("deepseek-v3-tiny", torch.float32, "2 x DeepseekV3Attention",
     ["DeepseekV3Attention.apply_rotary_pos_emb: llama (split-half)",
      "DeepseekV3Attention.apply_rotary_pos_emb_interleave: deinterleave (interleaved, pair angles, de-interleaving)"]),
])
def test_model_equals_unpatched(interpret, launches, name, dtype, where, forms):
    """Loss and every parameter gradient bitwise equal to the unpatched model (the fused rotation
    runs: one forward and one backward launch per attention layer)."""
    model = build_model(name, dtype=dtype).train()
    ref = copy.deepcopy(model)
    rep = patch_model(model, ON)["rope"]
    assert rep.applied and rep.where == where, rep
    if forms:
        assert rep.details["forms"] == forms
    ids = _ids()
    before = launches.n
    loss, grads = _loss_and_grads(model, ids)
    assert launches.n - before == 4  # 2 layers x (forward + backward)
    assert (rep.calls.fused, rep.calls.eager) == (2, 0)
    rloss, rgrads = _loss_and_grads(ref, ids)
    assert torch.equal(loss, rloss)
    for p, (a, b) in zip(model.parameters(), zip(grads, rgrads)):
        assert torch.equal(a, b)
    assert unpatch_model(model) == {"rope": 2}
    before = launches.n
    assert torch.equal(_loss_and_grads(model, ids)[0], rloss) and launches.n == before


def test_gradient_checkpointing(interpret, launches):
    """The recomputed forward runs the fused rotation too (its saved tensors match), and the
    gradients equal the unpatched model's with checkpointing."""
    model = build_model("qwen3-tiny").train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ref = copy.deepcopy(model)
    patch_model(model, ON)
    ids = _ids(1)
    before = launches.n
    loss, grads = _loss_and_grads(model, ids)
    assert launches.n - before == 6  # forward, recomputed forward and backward, per layer
    rloss, rgrads = _loss_and_grads(ref, ids)
    assert torch.equal(loss, rloss) and all(torch.equal(a, b) for a, b in zip(grads, rgrads))
    unpatch_model(model)


def test_opt_in_is_per_instance(interpret, launches):
    """Module globals are process-wide, the opt-in is not: a second model of the same classes,
    never patched, runs eager."""
    a = build_model("llama-tiny")
    b = build_model("llama-tiny", seed=1)
    patch_model(a, ON)
    ids = _ids()
    before = launches.n
    with torch.no_grad():
        b(input_ids=ids)
    assert launches.n == before
    with torch.no_grad():
        a(input_ids=ids)
    assert launches.n == before + 2
    assert F.is_replaced(a.model.layers[0].self_attn) and not F.is_replaced(b.model.layers[0].self_attn)
    unpatch_model(a)


def test_copies_pickles_and_repatch(interpret, launches):
    """A deepcopy keeps running fused when the original is unpatched; a pickled model loads
    eager (and reported so) until patched again."""
    model = build_model("llama-tiny")
    patch_model(model, ON)
    clone = copy.deepcopy(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    assert unpatch_model(model) == {"rope": 2}
    ids = _ids()
    before = launches.n
    with torch.no_grad():
        model(input_ids=ids)
    assert launches.n == before
    with torch.no_grad():
        clone(input_ids=ids)
    assert launches.n == before + 2 and F.RopeFeature().is_applied(clone)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert not F.RopeFeature().is_applied(loaded)
    with torch.no_grad():
        loaded(input_ids=ids)
    assert launches.n == before + 2
    rep = patch_model(loaded, ON)["rope"]
    assert rep.applied and rep.where == "2 x LlamaAttention"
    with torch.no_grad():
        loaded(input_ids=ids)
    assert launches.n == before + 4
    rep = F.RopeFeature().apply(loaded, None, F.RopeConfig(enabled=True))  # applying again changes nothing
    assert rep.applied and rep.where == "2 x LlamaAttention" and rep.details["replaced"] == {}
    assert "already replaced: 2 x LlamaAttention" in rep.reason
    assert unpatch_model(loaded) == {"rope": 2} and unpatch_model(clone) == {"rope": 2}


def test_module_global_replaced_after_patching(interpret, launches):
    """Another library replacing the module's apply_rotary_pos_emb later is honoured (the
    forward calls what the original forward would) and the feature no longer reports itself."""
    from transformers.models.llama import modeling_llama as ml

    model = build_model("llama-tiny")
    rep = patch_model(model, ON)["rope"]
    original = ml.apply_rotary_pos_emb
    calls = []

    def other(*a, **kw):
        calls.append(1)
        return original(*a, **kw)

    ml.apply_rotary_pos_emb = other
    try:
        before = launches.n
        with torch.no_grad():
            model(input_ids=_ids())
        assert calls == [1, 1] and launches.n == before and (rep.calls.fused, rep.calls.eager) == (0, 2)
        assert not F.RopeFeature().is_applied(model)
        rep = patch_model(build_model("llama-tiny"), ON)["rope"]
        assert not rep.applied and "not a known form" not in rep.reason and "replaced" in rep.reason
    finally:
        ml.apply_rotary_pos_emb = original
    assert F.RopeFeature().is_applied(model)
    unpatch_model(model)


@pytest.mark.parametrize("patched_before", [False, True])
def test_deepspeed_replace_rotary_pos_emb_is_left_to_it(interpret, patched_before):
    """DeepSpeed's replacement of the module's function is left to it, and the reason names it, also
    where another model of the class was patched before (its attention class already dispatches)."""
    from deepspeed.ops.triton_ops import fused_rotary_pos_emb as ds

    from transformers.models.qwen3 import modeling_qwen3 as mq

    if patched_before:
        assert patch_model(build_model("qwen3-tiny"), ON)["rope"].applied
    model = build_model("qwen3-tiny")
    original = mq.apply_rotary_pos_emb
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        n = ds.replace_rotary_pos_emb(model)
    if n == 0:
        # transformers >= 5.25 wraps the function in a kernels function module, whose code
        # DeepSpeed 0.19.8's installer does not take: install its replacement as it would for the
        # plain function
        assert F.plain_function(original) is not original
        mq.apply_rotary_pos_emb = ds._make_fused(F.plain_function(original))
    try:
        rep = patch_model(model, ON)["rope"]
        assert not rep.applied and "DeepSpeed's replace_rotary_pos_emb" in rep.reason, rep.reason
    finally:
        ds.restore_rotary_pos_emb()
        mq.apply_rotary_pos_emb = original
    rep = patch_model(model, ON)["rope"]
    assert rep.applied
    unpatch_model(model)


def test_fallback_inside_a_model_warns_and_runs_eager(interpret, launches):
    """Inputs the kernels do not take (float64 here) run the family's own function, warning once
    with the reason and the function."""
    model = build_model("llama-tiny", dtype=torch.float64)
    ref = copy.deepcopy(model)
    rep = patch_model(model, ON)["rope"]
    reset_fallback_warnings()
    ids = _ids()
    before = launches.n
    with pytest.warns(RuntimeWarning, match=r"float64.*modeling_llama\.apply_rotary_pos_emb runs eager"):
        with torch.no_grad():
            out = model(input_ids=ids).logits
    assert launches.n == before and (rep.calls.fused, rep.calls.eager) == (0, 2)
    with torch.no_grad():
        assert torch.equal(out, ref(input_ids=ids).logits)
    unpatch_model(model)


# ---- forwards the copy cannot be made of -------------------------------------------------------
def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin)
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


def apply_rotary_pos_emb_scaled(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (rotate_half(q) * sin) * 2
    k_embed = (k * cos) + (rotate_half(k) * sin)
    return q_embed, k_embed


_REGISTRY = {}


def opaque(fn):
    """A decorator that keeps the function outside its closure."""
    name = fn.__qualname__
    _REGISTRY[name] = fn

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        return _REGISTRY[name](*a, **kw)

    return wrapper


def keeps(fn):
    @functools.wraps(fn)
    def wrapper(*a, **kw):
        return fn(*a, **kw)

    return wrapper


class Rotating(torch.nn.Module):
    @keeps
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)


class Opaque(torch.nn.Module):
    @opaque
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)


class Scaled(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return apply_rotary_pos_emb_scaled(q, k, cos, sin)


class Nested(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        return (lambda: apply_rotary_pos_emb(q, k, cos, sin))()


class Both(torch.nn.Module):
    def forward(self, q, k, cos, sin):
        a = apply_rotary_pos_emb(q, k, cos, sin)
        b = apply_rotary_pos_emb_scaled(q, k, cos, sin)
        return a[0] + b[0], a[1] + b[1]


def test_own_modules_and_refusals(interpret, launches):
    """Any module class whose forward calls a recognised function by its global name, decorated
    or not; forwards that cannot be copied exactly, and unknown forms, are reported."""
    model = torch.nn.ModuleDict(dict(rot=Rotating(), opaque=Opaque(), scaled=Scaled(), nested=Nested(), both=Both()))
    rep = patch_model(model, ON)["rope"]
    assert rep.applied and rep.where == "1 x Both, 1 x Rotating", rep
    assert "1 x Opaque: forward is wrapped by a decorator that does not hold it in its closure" in rep.reason
    assert "apply_rotary_pos_emb_scaled: its bytecode matches no known RoPE form" in rep.reason
    assert "1 x Nested: forward calls apply_rotary_pos_emb from a nested function" in rep.reason
    assert "Both also calls apply_rotary_pos_emb_scaled, left eager" in rep.reason
    gen = torch.Generator().manual_seed(0)
    _, _, q, k, cos, sin = make_inputs(R.LLAMA, torch.float32, interpret, gen=gen)
    before = launches.n
    for name in ("rot", "both"):
        got = model[name](q, k, cos, sin)
        F.restore_rope(model[name])
        want = model[name](q, k, cos, sin)
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert launches.n == before + 2
    unpatch_model(model)


def test_torch_compile_traces_the_patched_call(interpret):
    """The call a patched forward makes traces under torch.compile with no graph break (the
    custom ops; aot_eager, so no C++ compiler is needed) and equals the family's eager function,
    forward and backward."""
    from transformers.models.qwen3 import modeling_qwen3 as mq

    fn = mq.apply_rotary_pos_emb  # transformers >= 5.25: a kernels function module around the function
    call = F._make_call(vars(mq), "apply_rotary_pos_emb", fn, F.recognise(F.plain_function(fn)))
    torch._dynamo.reset()
    compiled = torch.compile(call, backend="aot_eager", fullgraph=True)
    gen = torch.Generator().manual_seed(5)
    qb, kb, q, k, cos, sin = make_inputs(R.LLAMA, torch.float16, interpret, gen=gen)
    got = compiled(q, k, cos, sin)
    want = fn(q, k, cos, sin)
    assert all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(got, want))
    gs = tuple(torch.randn(w.shape, generator=gen).half() for w in want)
    ga = torch.autograd.grad(got, (qb, kb), gs)
    gb = torch.autograd.grad(want, (qb, kb), gs)
    assert all(torch.equal(a, b) for a, b in zip(ga, gb))


def test_kernels_function_modules(interpret, launches):
    """transformers >= 5.25 declares apply_rotary_pos_emb for the kernels package's hub kernels: the
    module global is a function module and the attention class routes calls through a private one
    per instance. The function it wraps is what is recognised; a module whose private function
    module runs a hub kernel (kernelize; here its forward replaced on the instance, as kernelize
    does) runs its own forward, before or after the patch; the rest stay fused and equal eager."""
    kernels = pytest.importorskip("kernels")
    from transformers.models.llama import modeling_llama as ml

    plain = F.plain_function(ml.apply_rotary_pos_emb)
    assert isinstance(F.recognise(plain), F.Form)
    wrapped = kernels.use_kernel_forward_from_hub("RotaryEmbeddingForTest")(plain)
    assert isinstance(wrapped, torch.nn.Module) and F.plain_function(wrapped) is plain
    assert F.plain_function(torch.nn.Linear(2, 2)) is None and F.plain_function(len) is None
    if plain is ml.apply_rotary_pos_emb:
        pytest.skip("this transformers declares no kernels function modules")
    model = build_model("llama-tiny")
    ref = copy.deepcopy(model)
    attn = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    hub_calls = []
    key = ml.apply_rotary_pos_emb.kernel_layer_name  # the private function modules' key
    private = attn[0]._kernel_funcs[key]

    def hub_kernel(self, *a, **kw):  # stands for a kernel kernelize selected (bound as kernelize binds it)
        hub_calls.append(1)
        return plain(*a, **kw)

    private.forward = types.MethodType(hub_kernel, private)
    rep = patch_model(model, ON)["rope"]
    assert rep.applied and rep.where == "1 x LlamaAttention", rep.where
    assert "hub kernel" in rep.reason, rep.reason
    ids = _ids()
    before = launches.n
    with torch.no_grad():
        out, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
    assert torch.equal(out, want) and launches.n == before + 1 and hub_calls == [1]
    assert not F.is_replaced(attn[0]) and F.is_replaced(attn[1])
    del private.forward  # kernelize's revert
    assert F.is_replaced(attn[0]) is False  # not opted in at apply time
    private2 = attn[1]._kernel_funcs[key]
    private2.forward = types.MethodType(hub_kernel, private2)  # kernelized after the patch: its own forward runs
    assert not F.is_replaced(attn[1])
    before = launches.n
    with torch.no_grad():
        out = model(input_ids=ids).logits
    assert torch.equal(out, want) and launches.n == before and hub_calls == [1, 1]  # attn[1] only
    unpatch_model(model)


def test_hub_kernel_instance_skipped_when_the_class_was_patched_for_another_model(interpret, launches):
    """The class already carries the dispatcher (another model was patched in this process): an
    instance whose kernels function module runs a hub kernel is still reported as left to it, not
    counted as replaced, and runs the hub kernel."""
    pytest.importorskip("kernels")
    from transformers.models.llama import modeling_llama as ml

    plain = F.plain_function(ml.apply_rotary_pos_emb)
    if plain is ml.apply_rotary_pos_emb:
        pytest.skip("this transformers declares no kernels function modules")
    first = build_model("llama-tiny")
    assert patch_model(first, ON)["rope"].where == "2 x LlamaAttention"
    model = build_model("llama-tiny")
    ref = copy.deepcopy(model)
    attn = [m for m in model.modules() if type(m).__name__ == "LlamaAttention"]
    private = attn[0]._kernel_funcs[ml.apply_rotary_pos_emb.kernel_layer_name]
    hub_calls = []

    def hub_kernel(self, *a, **kw):
        hub_calls.append(1)
        return plain(*a, **kw)

    private.forward = types.MethodType(hub_kernel, private)
    try:
        rep = patch_model(model, ON)["rope"]
        assert rep.applied and rep.where == "1 x LlamaAttention", rep.where
        assert "hub kernel" in rep.reason, rep.reason
        assert not F.is_replaced(attn[0]) and F.is_replaced(attn[1])
        ids = _ids()
        before = launches.n
        with torch.no_grad():
            out, want = model(input_ids=ids).logits, ref(input_ids=ids).logits
        assert torch.equal(out, want) and launches.n == before + 1 and hub_calls == [1]
    finally:
        unpatch_model(model)
        unpatch_model(first)
