"""The linear cross-entropy op's forward-only per-token fields (``return_mean_logits``,
``return_is_top1``, ``return_log_sum_sq``) on each path that forms the row statistics: the fused
GEMM's epilogue, cuBLAS + the row kernel over token chunks, and over vocabulary chunks (partial
statistics merged). Checked against torch on the materialized logits the op uses (the logits
rounded to the input dtype, then fp32 temperature and soft cap): ``is_top1`` exactly
``z.argmax(-1) == target`` (False on ignored rows), ``mean_logits`` and ``log_sum_sq_probs``
against float64. Triton interpreter on CPU; shapes stay tiny (M <= 16, V <= 300, H = 24).
"""
import pytest
import torch

from deepspeed_fused.ops.linear_cross_entropy import linear_cross_entropy, linear_cross_entropy_reference
from deepspeed_fused.ops.linear_cross_entropy import chunks as lce_chunks, launch as lce_launch
from deepspeed_fused.ops.linear_cross_entropy import single as lce_single, sizing as lce_sizing

FIELDS = dict(return_mean_logits=True, return_is_top1=True, return_log_sum_sq=True)
PATHS = ("gemm", "rows", "vocab_chunks")


def _force_path(monkeypatch, path, V):
    """Make the per-token forward take ``path``; returns the list its spies fill."""
    seen = []
    monkeypatch.setattr(lce_launch, "_GEMM_STATS_OK", [path == "gemm"])
    real_gemm, real_rows = lce_chunks.gemm_stats, lce_single._launch_rows

    def gemm_spy(*a, extras=0, **k):
        seen.append(("gemm", extras))
        return real_gemm(*a, extras=extras, **k)

    def rows_spy(x, *a, extras=0, **k):
        seen.append(("rows" if x.shape[1] == V else "vocab_chunks", extras))
        return real_rows(x, *a, extras=extras, **k)

    monkeypatch.setattr(lce_chunks, "gemm_stats", gemm_spy)
    monkeypatch.setattr(lce_single, "_launch_rows", rows_spy)
    if path == "vocab_chunks":  # a small workspace: 112 + 112 + 76 vocabulary columns per chunk (V=300)
        monkeypatch.setattr(lce_sizing, "DEFAULT_WORKSPACE_BYTES", 5 * V * 4)
    return seen


def _z(h, w, b, temperature, softcap, eager=False, path=None):
    """The transformed logits as the op takes them: rounded to the input dtype, then fp32 (fp32
    logits of half inputs with a soft cap, or with a bias on the fused GEMM's path, unless
    ``eager``: the reference's rounded ones)."""
    fp32 = lce_sizing.fp32_logits(h.dtype, softcap) or (path == "gemm" and b is not None)
    if fp32 and not eager:
        h, w, b = h.float(), w.float(), None if b is None else b.float()
    x = h @ w.t() if b is None else torch.addmm(b, h, w.t())  # the bias added before the rounding
    z = x.float()
    z = z / (temperature[:, None] if isinstance(temperature, torch.Tensor) else temperature)
    if softcap:
        z = softcap * torch.tanh(z / softcap)
    return z


def _expected(z, t, ignore_index=-100):
    z64 = z.double()
    return (z64.mean(-1), (t != ignore_index) & (z.argmax(-1) == t),
            torch.logsumexp(2 * z64, -1) - 2 * torch.logsumexp(z64, -1))


def _check(out, z, t, ignore_index=-100, tol=2e-6):
    mean, top1, sq = out[-3:]
    e_mean, e_top1, e_sq = _expected(z, t, ignore_index)
    assert top1.dtype == torch.bool and torch.equal(top1, e_top1), (top1, e_top1)
    assert mean.dtype == torch.float32 and sq.dtype == torch.float32
    # fp32 sums over V terms: a few ULP of the sum of |z|, relative to it
    # (rows with non-finite values: the same non-finite value as eager)
    fin = torch.isfinite(e_mean)
    assert torch.equal(torch.isfinite(mean), fin)
    assert torch.allclose(mean.double()[~fin], e_mean[~fin], equal_nan=True)
    scale = z.double()[fin].abs().mean(-1).clamp(min=1e-30)
    assert not fin.any() or ((mean.double()[fin] - e_mean[fin]).abs() / scale).max() <= tol, (mean, e_mean)
    assert torch.allclose(sq.double(), e_sq, rtol=1e-5, atol=1e-5, equal_nan=True), (sq, e_sq)


def _inputs(M, H, V, dtype, seed, bias):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(M, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.3
    b = torch.randn(V, generator=g) * 0.5 if bias else None
    t = torch.randint(0, V, (M,), generator=g)
    t[::5] = -100
    cast = lambda x: None if x is None else x.to(dtype)  # noqa: E731
    return cast(h), cast(w), t, cast(b)


@pytest.fixture
def poison(monkeypatch):
    """Fill every fresh float buffer with NaN (the op must write every element it returns)."""
    real = torch.empty

    def empty(*a, **k):
        x = real(*a, **k)
        return x.fill_(float("nan")) if x.is_floating_point() else x

    monkeypatch.setattr(torch, "empty", empty)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("case", ["fp32_plain", "fp16_bias", "fp32_softcap_temp", "fp16_softcap_temp_tensor"])
def test_fields_against_materialized_logits(interpret, monkeypatch, poison, path, case):
    """Every path's fields equal torch's on the same logits; the argmax targets are planted on
    half the labelled rows (True) and the second-largest on some (False); outputs poisoned."""
    dtype = torch.float16 if case.startswith("fp16") else torch.float32
    M, H, V = 13, 24, (300 if path == "vocab_chunks" else 150)
    seen = _force_path(monkeypatch, path, V)
    h, w, t, b = _inputs(M, H, V, dtype, seed=1, bias="bias" in case)
    temperature = 1.0
    if "temp_tensor" in case:
        temperature = torch.rand(M, generator=torch.Generator().manual_seed(2)) + 0.5
    elif "temp" in case:
        temperature = 0.7
    softcap = 2.5 if "softcap" in case else None
    z = _z(h, w, b, temperature, softcap, path=path)
    order = z.argsort(-1, descending=True)
    t[1:6] = order[1:6, 0]  # the row's maximum: True
    t[6:8] = order[6:8, 1]  # the second largest: False
    h, w = h.requires_grad_(), w.requires_grad_()  # the per-token path with gradients (as TRL's)
    out = linear_cross_entropy(h, w, t, bias=b, reduction="none", temperature=temperature, softcap=softcap,
                               return_entropy=True, **FIELDS)
    assert len(out) == 5
    _check(out, z, t)
    assert out[3][1:6].all() and not out[3][6:8].any()
    assert seen and {p for p, _ in seen} == {path} and all(x == 7 for _, x in seen), seen
    # the loss and entropy with the fields asked for are the ones without them, and differentiable
    base = linear_cross_entropy(h, w, t, bias=b, reduction="none", temperature=temperature, softcap=softcap,
                                return_entropy=True)
    assert torch.equal(out[0], base[0]) and torch.equal(out[1], base[1])
    (out[0].sum() + out[1].sum()).backward()
    assert torch.isfinite(h.grad).all() and torch.isfinite(w.grad).all()
    # the reference forms the same fields in torch
    ref = linear_cross_entropy_reference(h.detach(), w.detach(), t, bias=b, reduction="none",
                                         temperature=temperature, softcap=softcap, **FIELDS)
    _check(ref, _z(h.detach(), w.detach(), b, temperature, softcap, eager=True), t)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_ties_take_the_first_maximum(interpret, monkeypatch, path, dtype):
    """Equal largest logits on columns in different GEMM tiles, half-tiles, row-kernel blocks and
    vocabulary chunks: the first is the argmax. Targets on the first (True), on a later one
    (False), on another column (False); an all -inf row of logits takes column 0 (eager's argmax)."""
    M, H, V = 12, 24, (300 if path == "vocab_chunks" else 150)
    seen = _force_path(monkeypatch, path, V)
    # small integers and halves: every logit exact in fp16 and fp32, whatever the summation order
    g = torch.Generator().manual_seed(4)
    h = torch.randint(-3, 4, (M, H), generator=g).float()
    w = torch.randint(-2, 3, (V, H), generator=g).float() / 2
    h[:, 0] = 2.0
    w[:, 0] = 0.0
    tied = [37, 70, 149] if path != "vocab_chunks" else [113, 150, 299]  # across tiles / blocks / chunks
    for c in tied:
        w[c] = w[tied[0]]
        w[c, 0] = 64.0  # the largest logit of every row (> 3 * 24), equal on the three columns
    b = torch.zeros(V)
    b[[5, 6]] = float("-inf")  # a column of -inf (eager: never the argmax while a finite value exists)
    h, w, b = h.to(dtype), w.to(dtype), b.to(dtype)
    t = torch.tensor([tied[0], tied[1], tied[2], 3, tied[0], -100, tied[0], tied[1], 0, 1, tied[0], tied[2]])
    z = _z(h, w, b, 1.0, None)
    assert (z[:, tied] == z.amax(-1, keepdim=True)).all()
    out = linear_cross_entropy(h, w, t, bias=b, reduction="none", **FIELDS)
    e_top1 = (t == tied[0])
    assert torch.equal(out[2], e_top1) and torch.equal(out[2], _expected(z, t)[1])
    _check(out, z, t)
    assert {p for p, _ in seen} == {path}
    # all -inf logits: eager's argmax is column 0 (and the mean -inf, log_sum_sq NaN, as eager)
    b_inf = torch.full((V,), float("-inf"), dtype=dtype)
    t0 = torch.zeros(M, dtype=torch.long)
    t0[1] = 1
    out = linear_cross_entropy(h, w, t0, bias=b_inf, reduction="none", **FIELDS)
    z = _z(h, w, b_inf, 1.0, None)
    assert torch.equal(out[2], z.argmax(-1) == t0) and out[2][0] and not out[2][1]
    assert torch.equal(out[1], z.mean(-1)), out[1]


@pytest.mark.parametrize("path", PATHS)
def test_non_finite_logits(interpret, monkeypatch, path):
    """A NaN logit is eager's argmax (its first index); +inf ties take the first; the mean and
    log_sum_sq are NaN / inf exactly where eager's are."""
    M, H, V = 8, 24, (300 if path == "vocab_chunks" else 150)
    _force_path(monkeypatch, path, V)
    h, w, _, _ = _inputs(M, H, V, torch.float32, seed=5, bias=False)
    b = torch.zeros(V)
    b[[40, 120]] = float("nan")
    t = torch.tensor([40, 120, 0, 40, -100, 7, 40, 120])
    z = _z(h, w, b, 1.0, None)
    out = linear_cross_entropy(h, w, t, bias=b, reduction="none", **FIELDS)
    assert torch.equal(out[2], (t != -100) & (z.argmax(-1) == t)) and out[2][[0, 3, 6]].all()
    assert torch.isnan(out[1]).all() and torch.isnan(out[3]).all()
    b = torch.zeros(V)
    b[[60, 130]] = float("inf")  # +inf on two columns: a tie at inf
    t = torch.tensor([60, 130, 0, 60, -100, 7, 60, 130])
    z = _z(h, w, b, 1.0, None)
    out = linear_cross_entropy(h, w, t, bias=b, reduction="none", **FIELDS)
    e_mean, e_top1, e_sq = _expected(z, t)
    assert torch.equal(out[2], e_top1) and out[2][[0, 3, 6]].all() and not out[2][[1, 7]].any()
    assert torch.equal(out[1].double(), e_mean)  # inf
    assert torch.equal(torch.isnan(out[3]), torch.isnan(e_sq))
    # +inf before a NaN (another tile, block or vocabulary chunk): the NaN is eager's argmax
    b = torch.zeros(V)
    b[10] = float("inf")
    b[V - 7] = float("nan")
    t = torch.tensor([10, V - 7, 0, 10, -100, V - 7, 10, 1])
    z = _z(h, w, b, 1.0, None)
    out = linear_cross_entropy(h, w, t, bias=b, reduction="none", **FIELDS)
    assert torch.equal(out[2], (t != -100) & (z.argmax(-1) == t)) and out[2][[1, 5]].all() and not out[2][0]
    # +inf then a NaN in the same tile / block: the NaN
    b = torch.zeros(V)
    b[20], b[21] = float("inf"), float("nan")
    t = torch.tensor([20, 21, 0, 21, -100, 20, 21, 1])
    z = _z(h, w, b, 1.0, None)
    out = linear_cross_entropy(h, w, t, bias=b, reduction="none", **FIELDS)
    assert torch.equal(out[2], (t != -100) & (z.argmax(-1) == t)) and out[2][[1, 3, 6]].all() and not out[2][0]
    # a NaN in one row only (a NaN hidden state): that row NaN, the others finite and exact
    h2 = h.clone()
    h2[2, 3] = float("nan")
    t = torch.tensor([0, 1, 0, 3, -100, 7, 8, 9])
    z = _z(h2, w, None, 1.0, None)
    out = linear_cross_entropy(h2, w, t, reduction="none", **FIELDS)
    assert torch.equal(out[2], (t != -100) & (z.argmax(-1) == t)) and out[2][2]  # the first NaN: column 0
    assert torch.isnan(out[1][2]) and torch.isfinite(out[1][[0, 1, 3]]).all()


@pytest.mark.parametrize("path", PATHS)
def test_all_ignored_and_subsets(interpret, monkeypatch, path):
    """All targets ignored: is_top1 all False, the other fields formed; any subset of the fields
    comes back in the op's order; a "mean"/"sum" loss with fields takes the per-token path and
    still backpropagates; a positive ignore_index that is a vocabulary column is never top-1."""
    M, H, V = 9, 24, (300 if path == "vocab_chunks" else 150)
    _force_path(monkeypatch, path, V)
    h, w, _, b = _inputs(M, H, V, torch.float32, seed=6, bias=True)
    z = _z(h, w, b, 1.0, None)
    t = torch.full((M,), -100)
    out = linear_cross_entropy(h, w, t, bias=b, reduction="none", **FIELDS)
    assert not out[2].any()
    _check(out, z, t)
    am = z.argmax(-1)
    loss, top1 = linear_cross_entropy(h, w, am, bias=b, reduction="none", return_is_top1=True)
    assert top1.all()
    loss, sq = linear_cross_entropy(h, w, am, bias=b, reduction="none", return_log_sum_sq=True)
    assert torch.allclose(sq.double(), _expected(z, am)[2], rtol=1e-5, atol=1e-5)
    loss, lse, mean = linear_cross_entropy(h, w, am, bias=b, reduction="none", return_lse=True,
                                           return_mean_logits=True)
    assert torch.allclose(lse, torch.logsumexp(z, -1), rtol=1e-6, atol=1e-6)
    assert torch.allclose(mean.double(), z.double().mean(-1), rtol=1e-5, atol=1e-6)
    ign = int(am[0])  # ignore_index a real column: the rows targeting it are ignored, never top-1
    t = am.clone()
    hw = w.clone().requires_grad_()
    loss, top1 = linear_cross_entropy(h, hw, t, bias=b, ignore_index=ign, reduction="mean", return_is_top1=True)
    assert torch.equal(top1, t != ign)
    loss.backward()
    ref = linear_cross_entropy_reference(h, w.clone().requires_grad_(), t, bias=b, ignore_index=ign)
    assert torch.allclose(loss, ref, rtol=1e-5)
    assert torch.isfinite(hw.grad).all() and hw.grad.abs().sum() > 0


def test_no_fields_no_extra_work(interpret, monkeypatch):
    """Without the fields the kernels run without them (the flags are compile-time: nothing
    formed), and the returned value keeps its old arity."""
    seen = _force_path(monkeypatch, "gemm", 150)
    h, w, t, _ = _inputs(7, 24, 150, torch.float32, seed=7, bias=False)
    out = linear_cross_entropy(h, w, t, reduction="none", return_entropy=True)
    assert len(out) == 2 and seen == [("gemm", 0)]


def test_fields_with_a_tp_group_raise(monkeypatch):
    """Over a tensor-parallel group the fields are not formed: a ValueError naming them, before
    anything runs (a group of one rank is the single-device op and forms them)."""
    from deepspeed_fused.ops.linear_cross_entropy import checks

    h, w, t, _ = _inputs(4, 8, 16, torch.float32, seed=8, bias=False)
    monkeypatch.setattr(checks, "tp_setup", lambda group, start, V: object())
    for kw in ({"return_is_top1": True}, {"return_mean_logits": True}, {"return_log_sum_sq": True}):
        with pytest.raises(ValueError, match="return_mean_logits / return_is_top1 / return_log_sum_sq"):
            linear_cross_entropy(h, w, t, reduction="none", **kw)
        with pytest.raises(ValueError, match="tp_group"):
            linear_cross_entropy_reference(h, w, t, reduction="none", **kw)


def test_torch_compile_with_fields(interpret):
    """The fields through torch.compile (the per-token custom op, fullgraph): the same values as
    eager, and the loss and entropy gradients unchanged by them."""
    h, w, t, _ = _inputs(11, 24, 37, torch.float32, seed=9, bias=False)

    def f(h, w, t):
        loss, ent, mean, top1, sq = linear_cross_entropy(h, w, t, reduction="none", return_entropy=True,
                                                         validate_targets=False, **FIELDS)
        return loss.sum() + 0.5 * ent.sum(), mean, top1, sq

    res = []
    for fn in (f, torch.compile(f, fullgraph=True, backend="aot_eager")):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        total, mean, top1, sq = fn(hh, ww, t)
        total.backward()
        assert not (mean.requires_grad or sq.requires_grad)
        res.append((total, mean, top1, sq, hh.grad, ww.grad))
    for a, b in zip(*res):
        assert torch.equal(a, b) if a.dtype == torch.bool else torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    _check(res[0][:4], _z(h, w, None, 1.0, None), t)
