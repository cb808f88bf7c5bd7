"""The fused linear cross-entropy's per-token lse on CUDA is never less accurate than eager's, row
by row (tests/unit/test_lce_lse_accuracy.py at LM-head sizes, bf16 and fp16): against the float64
lse of the exact logits, our error is at most eager's plus 1e-5 where our logits are FP32 (the
fused GEMM with a bias or a soft cap; a soft cap on the cuBLAS path), and plus one rounding step of
the most probable logit where they are rounded to the input dtype as eager's are (no bias, no cap:
another GEMM's accumulator may round a logit the other way).

The tensor cores' FP32 accumulation of half-precision products is not IEEE round-to-nearest: the
running sum is truncated (rounded toward zero) at each block of the reduction, so every FP32 logit
of such a GEMM (cuBLAS's with ``out_dtype=float32`` as well as our fused GEMM's) is biased toward
zero, ~1.5e-5 in the lse at H = 4096 (a CPU emulation of truncated accumulation gives 1.8e-5 to
2e-5; round-to-nearest 1e-7). Eager's logits carry the same bias before their rounding to the input
dtype, which on some rows cancels it by chance. So the row-by-row comparison takes, per row, the
larger of eager's error and that of the hardware's own FP32 logits (their lse in float64): our
kernels' arithmetic (epilogue, soft cap, exp2/log2, merges) may add at most the bound to it."""
import pytest
import torch

from unit.test_lce_lse_accuracy import _gemm_modules, lse_errors

pytestmark = pytest.mark.gpu


def _ulp(z, dtype):
    """One unit in the last place of ``dtype`` at |z| (float64)."""
    mant = {torch.float16: 10, torch.bfloat16: 7}[dtype]
    e = torch.floor(torch.log2(z.abs().clamp(min=2.0 ** -14)))
    return torch.exp2(e - mant)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V,H", [(32000, 2048), (151936, 4096)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("cap", [None, 30.0])
@pytest.mark.parametrize("path", ["fused_gemm", "row_kernel"])
def test_lse_never_less_accurate_than_eager_gpu(dtype, V, H, bias, cap, path, monkeypatch):
    mods = _gemm_modules()
    if path == "row_kernel":
        for m in mods:
            monkeypatch.setattr(m, "_GEMM_STATS_OK", [False])
            monkeypatch.setattr(m, "_GEMM_GRAD_OK", [False])
    torch.backends.cuda.matmul.allow_tf32 = False
    gen = torch.Generator(device="cuda").manual_seed(V + H)
    M = 1024
    h = torch.randn(M, H, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(V, H, device="cuda", generator=gen) * 2 / H ** 0.5).to(dtype)
    b = (torch.randn(V, device="cuda", generator=gen) * 2).to(dtype) if bias else None
    t = torch.randint(0, V, (M,), device="cuda", generator=gen)
    fused = path == "fused_gemm" and all(m.gemm_stats_supported(h, w) for m in mods)
    if path == "fused_gemm" and not fused:
        pytest.skip("the fused GEMMs run on Hopper only")
    ours, eager, ref = lse_errors(h, w, b, cap, t)
    z32 = torch.mm(h, w.t(), torch.float32)  # the tensor cores' FP32 logits, as our op takes them
    if b is not None:
        z32 = z32 + b.float()
    z32 = z32.double()
    if cap:
        z32 = cap * torch.tanh(z32 / cap)
    gemm = (torch.logsumexp(z32, -1) - ref).abs()
    del z32
    fp32_logits = bool(cap) or (fused and bias)
    bound = torch.full_like(ours, 1e-5)
    if not fp32_logits:
        exact = h.double() @ w.double().t() + (0 if b is None else b.double())
        p = torch.softmax(exact, -1)
        bound = bound + (p * _ulp(exact, dtype)).amax(-1)
    worse = ours > torch.maximum(eager, gemm) + bound
    print(f"{dtype} V={V} bias={bias} cap={cap} {path}: ours max {ours.max():.2e} mean {ours.mean():.2e}, "
          f"eager max {eager.max():.2e} mean {eager.mean():.2e}, fp32 GEMM logits max {gemm.max():.2e} "
          f"mean {gemm.mean():.2e}, rows worse {int(worse.sum())}")
    assert not worse.any(), (f"{int(worse.sum())} rows: ours {ours[worse][:5].tolist()} eager "
                             f"{eager[worse][:5].tolist()} fp32 GEMM {gemm[worse][:5].tolist()}")
    if fp32_logits:
        assert ours.mean() <= eager.mean()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [16, None])
def test_per_token_gradient_of_confident_tokens_gpu(dtype, bias, chunk):
    """The CPU test on the GPU (the fused GEMMs on Hopper): confidently predicted tokens get
    gradients as accurate as eager's, token chunks or not, with and without a bias."""
    from unit.test_lce_lse_accuracy import test_per_token_gradient_of_confident_tokens_as_accurate_as_eager as t

    t("cuda", bias, chunk, dtype)
