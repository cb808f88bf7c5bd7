"""Norm modules: which are present, the form each computes (read from its outputs, never its
name), which ran in the forward."""
from __future__ import annotations

import copy

from .settings import HIDDEN

# ---- norms: present, their forms, replaced --------------------------------------------------------


def _is_norm_like(module) -> bool:
    import torch

    if isinstance(module, (torch.nn.LayerNorm, getattr(torch.nn, "RMSNorm", ()))):
        return True
    name = type(module).__name__.lower()
    if "norm" not in name or any(s in name for s in ("batchnorm", "groupnorm", "instancenorm")):
        return False
    # a norm is a leaf with at most a weight and a bias (no child modules holding parameters)
    return not any(True for c in module.children() if any(True for _ in c.parameters())) and \
        len(list(module.parameters(recurse=False))) <= 2


def _eps_of(module) -> float:
    for k in ("variance_epsilon", "eps", "epsilon", "norm_eps", "layer_norm_eps", "rms_norm_eps"):
        v = getattr(module, k, None)
        if isinstance(v, float):
            return v
    return 1e-6


def norm_form(module, width: int, n_tensor_args: int) -> str:
    """What ``module`` computes, read from its outputs on random inputs (never its name): one of
    :data:`RMS_FORMS`, ``layernorm`` or ``other``. The fp32 output tells the normalisation apart
    (mean removed or not, weight, 1 + weight, a gate before or after); for the weighted Llama-like
    form, a bf16 copy tells whether the weight multiplies before or after the cast to the input
    dtype."""
    import torch
    import torch.nn.functional as F

    if isinstance(module, getattr(torch.nn, "RMSNorm", ())):
        return "torch"
    m = copy.deepcopy(module).float()
    g = torch.Generator().manual_seed(7)
    w = getattr(m, "weight", None)
    b = getattr(m, "bias", None)
    with torch.no_grad():
        if isinstance(w, torch.nn.Parameter) and w.ndim == 1 and w.is_floating_point():
            width = w.shape[0]
            w.copy_(0.5 + torch.rand(w.shape, generator=g))
        else:  # no weight, or a buffer standing in for one (a weightless norm)
            w = None
        if isinstance(b, torch.Tensor) and b.is_floating_point():
            b.copy_(torch.rand(b.shape, generator=g) - 0.5)
        else:
            b = None
    dev = next((p.device for p in m.parameters()), torch.device("cpu"))
    x = (torch.randn(3, width, generator=g) + 0.3).to(dev)
    gate = torch.randn(3, width, generator=g).to(dev)
    eps = _eps_of(m)
    gated = n_tensor_args >= 2
    try:
        with torch.no_grad():
            y = (m(x, gate) if gated else m(x)).double()
    except Exception:
        return "other"
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        return "other"
    xd, gd = x.double(), gate.double()
    wd = w.detach().double() if w is not None else None

    def rms(t):
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps)

    def close(ref):
        return bool(((y - ref).norm() / ref.norm()) < 1e-4)

    scale = wd if wd is not None else torch.ones(1, dtype=torch.float64, device=dev)
    if gated:
        for act in (F.silu, torch.sigmoid):
            if close(scale * rms(xd) * act(gd)):
                return "gated"
            if close(scale * rms(xd * act(gd))):
                return "gated_pre"
        return "other"
    if wd is None:
        if close(rms(xd)):
            return "unweighted"
        return "layernorm" if close(F.layer_norm(xd, (width,), eps=eps)) else "other"
    if close((1 + wd) * rms(xd)):
        return "offset"
    if close(wd * rms(xd)):
        return _rounding_form(module, width, eps)
    ln = F.layer_norm(xd, (width,), eps=eps) * wd + (b.detach().double() if b is not None else 0)
    return "layernorm" if close(ln) else "other"


def _rounding_form(module, width: int, eps: float) -> str:
    """``llama`` or ``weight_before_cast``: the bf16 output of a copy bit-matched against each
    (``other`` when it matches neither)."""
    import torch

    m = copy.deepcopy(module).to(torch.bfloat16)
    g = torch.Generator().manual_seed(11)
    dev = m.weight.device
    with torch.no_grad():
        m.weight.copy_((0.5 + torch.rand(m.weight.shape, generator=g)).to(torch.bfloat16))
        x = (torch.randn(64, width, generator=g) * 3).to(torch.bfloat16).to(dev)
        try:
            y = m(x)
        except Exception:
            return "other"
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        w = m.weight
        cands = {"llama": w * normed.to(torch.bfloat16), "weight_before_cast": (w * normed).to(torch.bfloat16)}
        mism = {k: int((y != v).sum()) for k, v in cands.items()}
    exact = [k for k, v in mism.items() if v == 0]
    return exact[0] if exact else "other"  # Llama-like in fp32, but neither rounding


def norm_inventory(model, calls: dict) -> dict:
    """Norm modules of ``model`` by class: count, forms, how many ran in the forward."""
    import torch

    inv: dict = {}
    for name, m in model.named_modules():
        if not _is_norm_like(m):
            continue
        c = calls.get(name)
        w = getattr(m, "weight", None)
        # width: as called in the forward, else the weight's, else any (an unweighted norm)
        width = c[0] if c else (w.shape[0] if isinstance(w, torch.Tensor) and w.ndim == 1 else HIDDEN)
        form = norm_form(m, int(width), c[1] if c else 1)
        key = (type(m).__name__, form)
        e = inv.setdefault(key, dict(cls=type(m).__name__, form=form, count=0, ran=0, names=[]))
        e["count"] += 1
        e["ran"] += int(bool(c))
        e["names"].append(name)
    return inv


def _record_norm_calls(model):
    """Forward pre-hooks on norm-like modules: name -> (last dim, tensor arguments) of the first call."""
    import torch

    calls, handles = {}, []
    for name, m in model.named_modules():
        if not _is_norm_like(m):
            continue

        def hook(mod, args, kwargs, name=name):
            if name not in calls:
                tensors = [a for a in list(args) + list(kwargs.values()) if isinstance(a, torch.Tensor)]
                if tensors:
                    calls[name] = (int(tensors[0].shape[-1]), len(tensors))

        handles.append(m.register_forward_pre_hook(hook, with_kwargs=True))
    return calls, handles
