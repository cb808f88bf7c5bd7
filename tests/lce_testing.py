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
