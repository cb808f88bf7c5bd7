"""The fused linear cross-entropy's per-token lse is never less accurate than eager's, row by row:
against the float64 lse of the exact logits (``hidden @ weight.T + bias`` in float64 from the
half-precision operands), our error is at most eager's (``F.linear`` in the input dtype, then
``logsumexp`` of the FP32 copy, as transformers' loss takes it) plus a bound of FP32 arithmetic,
with and without a bias and a soft cap, on both paths (the fused GEMM's epilogue and cuBLAS (here
torch) + the row kernel). CPU: the Triton interpreter in fp16; tests/gpu/test_lce_lse_accuracy_gpu.py
runs the same in bf16 and fp16 at LM-head sizes."""
import sys

import pytest
import torch
import torch.nn.functional as F

from deepspeed_fused.ops.linear_cross_entropy import linear_cross_entropy
from lce_testing import confident_inputs


def _gemm_modules():
    return [m for n, m in list(sys.modules.items())
            if n.startswith("deepspeed_fused.ops.linear_cross_entropy") and hasattr(m, "_GEMM_STATS_OK")]


def lse_errors(h, w, b, cap, t):
    """Per-row |lse - exact| of ours and of eager (float64)."""
    exact = h.double() @ w.double().t() + (0 if b is None else b.double())
    eager = F.linear(h, w, b).float()
    if cap:
        exact = cap * torch.tanh(exact / cap)
        eager = cap * torch.tanh(eager / cap)
    ref = torch.logsumexp(exact, -1)
    _, lse = linear_cross_entropy(h, w, t, bias=b, reduction="none", return_lse=True, softcap=cap)
    return (lse.double() - ref).abs(), (torch.logsumexp(eager.double(), -1) - ref).abs(), ref


def fp32_bound(ref, h, w):
    """What FP32 arithmetic alone may add: the dot products' accumulation over H terms and the
    lse's own sums, a few units of FP32 rounding of the largest magnitudes involved."""
    H = h.shape[-1]
    scale = (h.double().abs() @ w.double().abs().t()).amax(-1) + ref.abs()
    return 8 * H ** 0.5 * 2.0 ** -24 * scale + 1e-6


@pytest.mark.parametrize("path", ["fused_gemm", "row_kernel"])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cap", [None, 15.0])
def test_lse_never_less_accurate_than_eager(interpret, monkeypatch, path, bias, cap):
    if path == "row_kernel":
        for m in _gemm_modules():
            monkeypatch.setattr(m, "_GEMM_STATS_OK", [False])
            monkeypatch.setattr(m, "_GEMM_GRAD_OK", [False])
    gen = torch.Generator().manual_seed(3)
    M, H, V = 64, 64, 400
    h = torch.randn(M, H, generator=gen).half().to(interpret)
    w = (torch.randn(V, H, generator=gen) * 0.4).half().to(interpret)
    b = (torch.randn(V, generator=gen) * 2).half().to(interpret) if bias else None
    t = torch.randint(0, V, (M,), generator=gen).to(interpret)
    if path == "fused_gemm":
        assert all(m.gemm_stats_supported(h, w) for m in _gemm_modules()) or interpret != "cpu"
    ours, eager, ref = lse_errors(h, w, b, cap, t)
    bound = fp32_bound(ref, h, w)
    worse = ours > eager + bound
    assert not worse.any(), (f"{int(worse.sum())} rows less accurate than eager: ours {ours[worse][:5].tolist()} "
                             f"eager {eager[worse][:5].tolist()} bound {bound[worse][:5].tolist()}")
    if cap or (bias and path == "fused_gemm"):
        # FP32 logits (a soft cap; a bias in the fused GEMM): FP32 arithmetic's error only, far below
        # the half-precision rounding that eager's carries
        assert eager.max() > 1e-4 and ours.max() < 1e-5, (ours.max(), eager.max())


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [16, None])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_per_token_gradient_of_confident_tokens_as_accurate_as_eager(interpret, bias, chunk, dtype):
    """Confidently predicted targets (logit 12, the others near 0): the gradient there is
    p - 1 ~ -2e-4, so the backward's probabilities must come from the very logits the forward's
    log-sum-exp came from. With token chunks the backward once took cuBLAS's rounded logits while
    the forward's fused GEMM kept fp32 ones (with a bias): gradients 12x off in relative norm. Each
    gradient's error against float64 is at most 1.5x eager's own (fp16) or eager's plus fp32 noise."""
    h, w, t, b = confident_inputs(torch.Generator().manual_seed(11))

    def grads(fn, dt):
        leaves = [x.to(dt).to(interpret).detach().requires_grad_() for x in (h, w, b)]
        fn(*leaves).backward()
        return [x.grad.double().cpu() for x in (leaves if bias else leaves[:2])]

    tt = t.to(interpret)
    ref = grads(lambda hh, ww, bb: F.cross_entropy(F.linear(hh, ww, bb if bias else None), tt, reduction="sum"),
                torch.float64)
    eager = grads(lambda hh, ww, bb: F.cross_entropy(F.linear(hh, ww, bb if bias else None).float(), tt,
                                                     reduction="sum"), dtype)
    ours = grads(lambda hh, ww, bb: linear_cross_entropy(hh, ww, tt, bias=bb if bias else None, reduction="none",
                                                         chunk_tokens=chunk).sum(), dtype)
    # fp32: the backward forms p = exp(z - lse) from the stored fp32 lse (~12 here, a rounding step of
    # 1e-6), eager from z - max and log(sum): for p ~ 1 ours is a few times less accurate there
    # (0.1-0.3% against 0.04%); the mismatched logits gave 1000x
    factor = 10.0 if dtype == torch.float32 else 1.5
    for name, o, e, r in zip(("dhidden", "dweight", "dbias"), ours, eager, ref):
        err, eerr = float((o - r).norm() / r.norm()), float((e - r).norm() / r.norm())
        assert err <= factor * eerr + 1e-5, (name, err, eerr)
