"""The linear cross-entropy op's forward-only per-token fields (mean_logits, is_top1,
log_sum_sq_probs) on the GPU, bf16/fp16 at LM-head sizes, through the fused GEMM's epilogue
(Hopper), cuBLAS + the row kernel over token chunks, and over vocabulary chunks: against torch on
the materialized logits (cuBLAS's, rounded to the input dtype as the op takes them)."""
import pytest
import torch

from deepspeed_fused.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference

pytestmark = pytest.mark.gpu
DEV = "cuda"
FIELDS = dict(return_mean_logits=True, return_is_top1=True, return_log_sum_sq=True)


def _data(M, H, V, dtype, seed=0, bias=False):
    g = torch.Generator(device=DEV).manual_seed(seed)
    h = (torch.randn(M, H, device=DEV, generator=g) * 0.5).to(dtype)
    w = (torch.randn(V, H, device=DEV, generator=g) * 0.02).to(dtype)
    b = (torch.randn(V, device=DEV, generator=g) * 0.5).to(dtype) if bias else None
    t = torch.randint(0, V, (M,), device=DEV, generator=g)
    return h, w, t, b


def _z(h, w, b, temperature, softcap):
    x = h @ w.t() if b is None else torch.addmm(b, h, w.t())
    z = x.float() / temperature
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z


def _force(monkeypatch, path):
    """(launch module, keyword arguments) that make the per-token forward take ``path``: the fused
    GEMM; cuBLAS + the row kernel over token chunks (an explicit chunk_tokens: never vocabulary
    chunks); or over vocabulary chunks (fewer tokens than vocabulary rows, a 64 MiB workspace)."""
    from deepspeed_fused.ops.linear_cross_entropy import launch, sizing

    monkeypatch.setattr(launch, "_GEMM_STATS_OK", [path == "gemm"])
    if path == "vocab_chunks":
        monkeypatch.setattr(sizing, "DEFAULT_WORKSPACE_BYTES", 64 << 20)
    return launch, ({"chunk_tokens": 1024} if path == "rows" else {})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("path", ["gemm", "rows", "vocab_chunks"])
@pytest.mark.parametrize("M,H,V", [(4096, 2048, 151936), (2048, 4096, 128256)])
def test_fields_at_lm_head_sizes(monkeypatch, dtype, path, M, H, V):
    launch, kw = _force(monkeypatch, path)
    if path == "vocab_chunks":
        M = 1024  # fewer tokens than vocabulary rows: the vocabulary is split
    h, w, t, b = _data(M, H, V, dtype, bias=path == "rows")
    if path == "gemm":
        assert launch.gemm_stats_supported(h, w), "the fused GEMM does not run on this GPU (Hopper only)"
    z = _z(h, w, b, 1.0, None)
    am = z.argmax(-1)
    t[: M // 2] = am[: M // 2]  # half the rows: the target is the argmax
    t[::9] = -100
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss, ent, mean, top1, sq = linear_cross_entropy(hg, wg, t, bias=b, reduction="none", return_entropy=True,
                                                     **FIELDS, **kw)
    if path == "gemm":
        assert launch._GEMM_STATS_OK[0], "the fused GEMM fell back (see its warning)"
    (loss.sum() + ent.sum()).backward()
    # is_top1: exact where torch's logits have a unique top-1 by more than one 16-bit step (the
    # op's GEMM may round a logit of a different fp32 accumulation to the neighbouring value)
    e_top1 = (t != -100) & (am == t)
    top2 = z.topk(2, -1).values
    step = top2[:, 0].abs().clamp(min=1e-3) * (2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -10)
    near = (top2[:, 0] - top2[:, 1]) <= step
    assert torch.equal(top1[~near], e_top1[~near]), (top1 != e_top1).sum()
    assert (top1 != e_top1).sum() <= near.sum()
    assert top1[: M // 2][(t[: M // 2] != -100) & ~near[: M // 2]].all()
    z64 = z.double()
    scale = z64.abs().mean(-1)
    assert ((mean.double() - z64.mean(-1)).abs() / scale).max() <= 1e-5
    e_sq = torch.logsumexp(2 * z64, -1) - 2 * torch.logsumexp(z64, -1)
    assert (sq.double() - e_sq).abs().max() <= 2e-3  # logits of the op's GEMM vs cuBLAS: a 16-bit step apart at most
    ref = linear_cross_entropy_reference(h, w, t, bias=b, reduction="none", **FIELDS)
    assert (ref[2] != top1).sum() <= near.sum()


@pytest.mark.parametrize("path", ["gemm", "rows", "vocab_chunks"])
def test_ties_and_softcap_bf16(monkeypatch, path):
    """Duplicate largest logits (copied weight rows) across tiles: the first is the argmax; soft
    cap and a per-token temperature."""
    _, kw = _force(monkeypatch, path)
    M, H, V = 1024 if path == "vocab_chunks" else 2048, 2048, 151936
    h, w, t, _ = _data(M, H, V, torch.bfloat16, seed=3)
    tied = [1000, 70000, 151935]
    for c in tied:
        w[c] = w[tied[0]]
    h[:, :64] = 1.0
    w[tied, :64] = 1.0  # the largest logit of every row, on the three columns alike
    temp = torch.rand(M, device=DEV) + 0.5
    z = _z(h, w, None, temp[:, None], 30.0)
    assert (z[:, tied] == z.amax(-1, keepdim=True)).all()
    t[0::3], t[1::3], t[2::3] = tied[0], tied[1], tied[2]
    out = linear_cross_entropy(h, w, t, reduction="none", temperature=temp, softcap=30.0, **FIELDS, **kw)
    assert torch.equal(out[2], t == tied[0])
