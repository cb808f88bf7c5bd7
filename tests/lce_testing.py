"""Helpers shared by the fused linear cross-entropy tests (single-GPU and tensor-parallel)."""
import torch


def weighted_backward(fn, h, w, t, b, dtype=None, **kw):
    """Forward + backward of a weighted sum of every output of ``fn(h, w, t, bias=b, **kw)``.

    Fresh leaves of ``h``, ``w``, ``b`` (cast to ``dtype`` when given, as are floating-point
    tensors in ``kw``); returns the outputs and the leaves' gradients, both in float64."""
    def leaf(x):
        return None if x is None else x.detach().to(dtype or x.dtype).clone().requires_grad_()

    h, w, b = leaf(h), leaf(w), leaf(b)
    if dtype is not None:
        kw = {k: (v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in kw.items()}
    out = fn(h, w, t, bias=b, **kw)
    outs = out if isinstance(out, tuple) else (out,)
    total = 0
    for i, o in enumerate(outs):
        wt = torch.linspace(0.5, 1.5, o.numel(), dtype=torch.float64, device=o.device).reshape(o.shape) * (i + 1)
        total = total + (o.double() * wt).sum()
    total.backward()
    grads = [x.grad.double() for x in (h, w, b) if x is not None]
    return [o.detach().double() for o in outs], grads


def rel(a, b):
    """Relative norm error of ``a`` against ``b``."""
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def confident_inputs(gen, M=64, V=32):
    """(hidden, weight, target, bias) in fp32 whose labelled targets are predicted confidently:
    head rows near the identity, each row's target logit 12 and the others near 0 (p - 1 ~ -2e-4
    at the target, probabilities ~e^-12 elsewhere), every seventh target ignored. ``gen`` is
    advanced as the callers' later draws expect."""
    t = torch.randint(0, V, (M,), generator=gen)
    h = torch.randn(M, V, generator=gen) * 0.3
    h[torch.arange(M), t] = 12.0
    w = torch.eye(V) + torch.randn(V, V, generator=gen) * 0.01
    t[::7] = -100
    b = torch.randn(V, generator=gen) * 0.1
    return h, w, t, b
