"""Top-k route ops (dispatch into slots, combine back) against DeepSpeed's eager formulation:
``x[sorted // k]`` (scores pre-applied), the padded permute, and the zero/scatter/weighted-sum
combine; first and second order gradients. Kernels under the interpreter (fp32, fp16)."""
from __future__ import annotations

import pytest
import torch

from deepspeed_fused.ops import moe_reorder as mr


def _case(T, K, E, H, dtype, seed, pad):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g).to(dtype)
    experts = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    scores = torch.rand(T, K, generator=g)
    sorted_a = torch.argsort(experts.view(-1), stable=True)
    perm = None
    if pad:  # per expert: its sorted positions, then up to 3 padding slots (index N)
        counts = torch.bincount(experts.view(-1), minlength=E).tolist()
        n, pos, out = T * K, 0, []
        for c in counts:
            out += list(range(pos, pos + c)) + [n] * ((-c) % 4)
            pos += c
        perm = torch.tensor(out, dtype=torch.int32)
    return x, scores, sorted_a, perm


def _eager(x, scores, sorted_a, perm, K, pre, post, y_fn):
    """DeepSpeed's AutoEP local path in eager torch (identity all-to-all)."""
    routed = x[sorted_a // K]
    if pre:
        routed = (routed.to(torch.float32) * scores.view(-1)[sorted_a].reshape(-1, 1)).to(x.dtype)
    if perm is not None:
        padded = torch.vstack((routed, routed.new_zeros((routed.shape[-1],))))
        buf = padded[perm.long()]
    else:
        buf = routed
    y = y_fn(buf)
    if perm is not None:
        un = y.new_zeros((routed.shape[0] + 1, y.shape[-1]))
        un[perm.long()] = y
        y = un[:-1]
    out = torch.zeros(x.shape[0] * K, y.shape[-1], dtype=y.dtype, device=y.device)
    out[sorted_a] = y
    out = out.reshape(x.shape[0], K, -1)
    if post:
        return (out * scores.reshape(x.shape[0], K, 1).float()).sum(dim=1).to(y.dtype), buf
    return out.sum(dim=1), buf


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("pad", [False, True])
@pytest.mark.parametrize("mode", ["pre", "post"])
def test_route_matches_deepspeed_eager(interpret, dtype, pad, mode):
    T, K, E, H = 13, 3, 5, 40
    x, scores, sorted_a, perm = _case(T, K, E, H, dtype, seed=7 + pad, pad=pad)
    x, scores, sorted_a = x.to(interpret), scores.to(interpret), sorted_a.to(interpret)
    perm = perm.to(interpret) if perm is not None else None
    maps = mr.route_maps(sorted_a, K, perm)
    ref = mr.route_maps_reference(sorted_a, K, perm)
    assert all(torch.equal(a, b) for a, b in zip(maps[:3], ref[:3]))
    scale = torch.linspace(0.5, 1.5, H, dtype=dtype, device=interpret)
    y_fn = lambda b: b * scale  # noqa: E731  (a stand-in for the experts)
    xr, sr = x.clone().requires_grad_(), scores.clone().requires_grad_()
    out_r, buf_r = _eager(xr, sr, sorted_a, perm, K, mode == "pre", mode == "post", y_fn)
    xf, sf = x.clone().requires_grad_(), scores.clone().requires_grad_()
    buf = mr.route_dispatch(xf, maps, sf if mode == "pre" else None)
    assert torch.equal(buf, buf_r)  # only data moves (and the same FP32 multiply)
    out = mr.route_combine(y_fn(buf), maps, sf if mode == "post" else None)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(out, out_r, **tol)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(dtype).to(interpret)
    gr = torch.autograd.grad(out_r, (xr, sr), dy)
    gf = torch.autograd.grad(out, (xf, sf), dy)
    for a, b in zip(gf, gr):
        torch.testing.assert_close(a, b, **(dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else
                                            dict(rtol=1e-2, atol=1e-2)))


@pytest.mark.parametrize("mode", ["pre", "post"])
def test_route_double_backward(interpret, mode):
    T, K, E, H = 7, 2, 3, 24
    x, scores, sorted_a, perm = _case(T, K, E, H, torch.float32, seed=11, pad=True)
    x, scores, sorted_a, perm = (t.to(interpret) for t in (x, scores, sorted_a, perm))
    maps = mr.route_maps(sorted_a, K, perm)
    y_fn = lambda b: b * b  # noqa: E731  (nonlinear, so second derivatives are not trivial)
    res = []
    for fused in (False, True):
        xg, sg = x.clone().requires_grad_(), scores.clone().requires_grad_()
        if fused:
            buf = mr.route_dispatch(xg, maps, sg if mode == "pre" else None)
            out = mr.route_combine(y_fn(buf), maps, sg if mode == "post" else None)
        else:
            out, _ = _eager(xg, sg, sorted_a, perm, K, mode == "pre", mode == "post", y_fn)
        gx, gs = torch.autograd.grad(out.pow(2).sum(), (xg, sg), create_graph=True)
        res.append(torch.autograd.grad(gx.sum() + gs.pow(2).sum(), (xg, sg)))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_route_maps_poisoned_and_checked(interpret):
    x, scores, sorted_a, perm = _case(9, 2, 4, 8, torch.float32, seed=2, pad=True)
    maps = mr.route_maps(sorted_a.to(interpret), 2, perm.to(interpret))
    assert (maps.slot >= 0).all() and maps.slot.unique().numel() == maps.slot.numel()
    assert int((maps.token >= 0).sum()) == 18 and int((maps.assignment < 0).sum()) == perm.numel() - 18
    with pytest.raises(ValueError, match="top_k"):
        mr.route_maps(sorted_a, 0)
    with pytest.raises(ValueError, match="T \\* top_k"):
        mr.route_maps(sorted_a, 4)
    with pytest.raises(ValueError, match="x: expected 9 token rows"):
        mr.route_dispatch(torch.randn(8, 8, device=interpret), maps)
