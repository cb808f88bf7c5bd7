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


def _float_keys(x, nan_largest):
    """int64 keys of a floating tensor's values in their numeric order (-0.0 equal to 0.0), compared as
    integers: every NaN the largest key where ``nan_largest``, else a NaN ordered by its bits (its sign
    bit set: below -inf, clear: above +inf, as a radix sort of the bit patterns orders it)."""
    d = x.detach().double()  # exact for every float dtype; a NaN keeps its sign bit
    d = torch.where(d == 0, torch.zeros_like(d), d)
    b = d.view(torch.int64)
    k = torch.where(b < 0, b ^ 0x7FFFFFFFFFFFFFFF, b)
    return torch.where(d.isnan(), torch.full_like(k, 0x7FFFFFFFFFFFFFFF), k) if nan_largest else k


def stable_topk(x, k, dim=-1, largest=True, sorted=True):
    """torch.topk with the order of equal values fixed (the lower index first; NaN of either sign the
    largest, every NaN equal), as a stable sort of torch.topk's ranking gives it. torch.topk's order
    among equal values is its own (on CPU a partial sort's: an all-NaN row of 8 gives experts 6 and 5
    for k = 2), so the kernels' rule is checked against this, and the values torch.topk selects
    against the kernels' values. The order is a stable sort of integer keys: a sort of the floating
    values themselves would bring in the device's rule for NaN (CUDA's ``torch.sort``, torch 2.11,
    one H100: a NaN with its sign bit set below -inf; see :func:`cuda_float_sort_rule`)."""
    if not x.is_floating_point():
        v, i = torch.sort(x, dim=dim, descending=largest, stable=True)
        return torch.return_types.topk((v.narrow(dim, 0, k), i.narrow(dim, 0, k)))
    i = torch.sort(_float_keys(x, nan_largest=True), dim=dim, descending=largest, stable=True)[1].narrow(dim, 0, k)
    return torch.return_types.topk((x.gather(dim, i), i))


@contextlib.contextmanager
def cuda_float_sort_rule():
    """``torch.sort`` / ``torch.argsort`` (function and method) of floating tensors as CUDA's sorts
    order them (torch 2.11, one H100): by the values' bit patterns, a NaN with its sign bit set below
    -inf and one with it clear above +inf (-0.0 equal to 0.0), stable. CPU's sorts take every NaN as
    the largest, so a reference that sorts floats passes on CPU and fails on CUDA for NaN with the
    sign bit set (the CPU's float-to-bfloat16 conversion gives every NaN that sign). torch.topk's own
    selection takes every NaN as the largest on both devices and is left as it is."""
    real = {name: getattr(owner, name) for owner, name in ((torch, "sort"), (torch, "argsort"))}
    real_methods = {"sort": torch.Tensor.sort, "argsort": torch.Tensor.argsort}

    def _sorted(input, dim=-1, descending=False, stable=False, **kw):
        if not input.is_floating_point() or kw:
            return real["sort"](input, dim=dim, descending=descending, stable=stable, **kw)
        i = real["sort"](_float_keys(input, nan_largest=False), dim=dim, descending=descending, stable=True)[1]
        return torch.return_types.sort((input.gather(dim, i), i))

    def _argsorted(input, dim=-1, descending=False, stable=False, **kw):
        if not input.is_floating_point() or kw:
            return real["argsort"](input, dim=dim, descending=descending, stable=stable, **kw)
        return _sorted(input, dim=dim, descending=descending)[1]

    torch.sort, torch.argsort = _sorted, _argsorted
    torch.Tensor.sort, torch.Tensor.argsort = _sorted, _argsorted
    try:
        yield
    finally:
        torch.sort, torch.argsort = real["sort"], real["argsort"]
        torch.Tensor.sort, torch.Tensor.argsort = real_methods["sort"], real_methods["argsort"]


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
