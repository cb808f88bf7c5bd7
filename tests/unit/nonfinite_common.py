"""Shared by the non-finite tests (CPU: tests/unit/test_nonfinite.py; CUDA: tests/gpu/test_nonfinite_gpu.py):
inputs with NaN and infinite entries, the mask comparison against eager, and eager's top-k with its
order of equal values made explicit."""
import contextlib

import torch

NAN, INF = float("nan"), float("inf")


def assert_nonfinite_like(out, ref, rtol, atol, what=""):
    """``out`` non-finite exactly where ``ref`` is (the NaN masks equal, the infinities equal with
    their signs), and the finite values within ``rtol``/``atol``."""
    assert out.shape == ref.shape, f"{what}: shape {tuple(out.shape)} != {tuple(ref.shape)}"
    o, r = out.detach().double(), ref.detach().double()
    on, rn = o.isnan(), r.isnan()
    bad = (on != rn).nonzero()
    assert not len(bad), (f"{what}: NaN where eager has none or the reverse at {bad[:8].tolist()} "
                          f"(ours {o[on != rn][:8].tolist()}, eager {r[on != rn][:8].tolist()})")
    oi, ri = o.isinf(), r.isinf()
    assert torch.equal(oi, ri), f"{what}: infinities at {(oi != ri).nonzero()[:8].tolist()} differ"
    assert torch.equal(o[oi], r[ri]), f"{what}: infinities of other signs"
    fin = o.isfinite()
    if fin.any():
        torch.testing.assert_close(o[fin], r[fin], rtol=rtol, atol=atol, msg=lambda m: f"{what}: {m}")


def stable_topk(x, k, dim=-1, largest=True, sorted=True):
    """torch.topk with the order of equal values fixed (the lower index first; NaN the largest, every
    NaN equal), as a stable sort gives it. torch.topk's order among equal values is its own (on CPU
    a partial sort's: an all-NaN row of 8 gives experts 6 and 5 for k = 2), so the kernels' rule is
    checked against this, and the values torch.topk selects against the kernels' values."""
    v, i = torch.sort(x, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))


@contextlib.contextmanager
def eager_topk_lower_index_first():
    """Eager code run under this context takes :func:`stable_topk` for ``torch.topk`` / ``Tensor.topk``."""
    real_fn, real_method = torch.topk, torch.Tensor.topk
    torch.topk = stable_topk
    torch.Tensor.topk = stable_topk
    try:
        yield
    finally:
        torch.topk, torch.Tensor.topk = real_fn, real_method


def poison_rows(x, kinds, gen=None):
    """A copy of ``x`` ([rows, N], rows >= len(kinds)) with row i made non-finite as ``kinds[i]`` says:
    'nan_row', 'nan' (one element), 'inf', '-inf', 'inf_row', '-inf_row', 'mixed' (NaN, +inf, -inf),
    'finite'."""
    x = x.clone()
    n = x.shape[-1]
    for r, kind in enumerate(kinds):
        c = (3 * r + 1) % n
        if kind == "nan_row":
            x[r] = NAN
        elif kind == "nan":
            x[r, c] = NAN
        elif kind == "inf":
            x[r, c] = INF
        elif kind == "-inf":
            x[r, c] = -INF
        elif kind == "inf_row":
            x[r] = INF
        elif kind == "-inf_row":
            x[r] = -INF
        elif kind == "mixed":
            x[r, c], x[r, (c + 1) % n], x[r, (c + 2) % n] = NAN, INF, -INF
        else:
            assert kind == "finite", kind
    return x


ROW_KINDS = ["nan_row", "nan", "inf", "-inf", "finite", "inf_row", "-inf_row", "mixed"]
