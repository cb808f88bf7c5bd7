"""moe_reorder's per-expert bias on expert-sorted rows (CPU: Triton interpreter, fp32 and fp16; bf16
on the GPU): the forward equals eager's ``rows + bias[ids]`` bitwise, the bias gradient is each
expert's own rows summed (float64 oracle, padding rows excluded), poisoned outputs, the checks, the
fallback and the custom ops under torch.compile's fake tensors."""
import importlib
import warnings

import pytest
import torch
from unit.test_rms_norm import ulp

from deepspeed_fused.ops import _common
from deepspeed_fused.ops import moe_reorder as mr

B = importlib.import_module("deepspeed_fused.ops.moe_reorder.expert_bias")


def _case(S, N, E, dtype, device, pad=0, seed=0, id_dtype=torch.int32):
    """Rows sorted by expert (some experts empty), ``pad`` padding rows at the end."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 2 * (S - pad) // E + 1, (E,), generator=gen)
    counts[0] = 0  # an empty first expert
    while counts.sum() > S - pad:
        counts[counts.argmax()] -= 1
    counts[-1] += S - pad - counts.sum()
    offsets = counts.cumsum(0).to(torch.int32)
    experts = torch.repeat_interleave(torch.arange(E), counts)
    experts = torch.cat([experts, torch.full((pad,), E - 1)]).to(id_dtype)  # padding: clamped ids
    rows = (3 * torch.randn(S, N, generator=gen)).to(dtype)
    bias = torch.randn(E, N, generator=gen).to(dtype)
    dy = torch.randn(S, N, generator=gen).to(dtype)
    return [t.to(device) for t in (rows, bias, experts, offsets, dy)]


def _oracle_bound(dy, offsets, dtype):
    """The float64 sums of each expert's rows of ``dy`` and the bound of an FP32 sum rounded once
    to ``dtype``: one ULP plus ``count * 2**-24 * sum |terms|``."""
    ends = offsets.long().tolist()
    starts = [0] + ends[:-1]
    d64 = dy.double()
    oracle = torch.stack([d64[s:e].sum(0) for s, e in zip(starts, ends)])
    absum = torch.stack([d64[s:e].abs().sum(0) for s, e in zip(starts, ends)])
    count = torch.tensor([e - s for s, e in zip(starts, ends)], dtype=torch.float64, device=d64.device)[:, None]
    return oracle, ulp(oracle, dtype) + count * 2.0 ** -24 * absum + 1e-30


def _run(fn, rows, bias, experts, offsets, dy):
    r, b = rows.clone().requires_grad_(), bias.clone().requires_grad_()
    y = fn(r, b, experts, offsets)
    y.backward(dy)
    return y.detach(), r.grad, b.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("S,N,E,pad", [(37, 24, 5, 0), (64, 130, 8, 9), (300, 64, 3, 17), (5, 8, 16, 0)])
def test_expert_bias_matches_eager(interpret, dtype, S, N, E, pad):
    rows, bias, experts, offsets, dy = _case(S, N, E, dtype, interpret, pad=pad)
    y, dr, db = _run(mr.expert_bias, rows, bias, experts, offsets, dy)
    # forward: eager's add (FP32 sum, one rounding) bitwise, padding rows included
    assert torch.equal(y, rows + bias[experts.long()])
    assert dr.dtype == rows.dtype and torch.equal(dr, dy)
    # bias gradient: each expert's own rows, float64 oracle within FP32 summation plus one rounding
    oracle, bound = _oracle_bound(dy, offsets, dtype)
    assert db.dtype == bias.dtype and ((db.double() - oracle).abs() <= bound).all()
    assert (db[0] == 0).all()  # the empty expert's gradient is zero (written, not left)
    # the reference gives the same numbers
    yr, drr, dbr = _run(mr.expert_bias_reference, rows, bias, experts, offsets, dy)
    assert torch.equal(yr, y) and torch.equal(drr, dr)
    assert ((dbr.double() - oracle).abs() <= bound).all()


def test_expert_bias_writes_every_element(interpret, monkeypatch):
    rows, bias, experts, offsets, dy = _case(40, 33, 4, torch.float32, interpret, pad=3)
    real = torch.empty

    def poisoned(*a, **k):
        t = real(*a, **k)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(B.torch, "empty", poisoned)
    y, dr, db = _run(mr.expert_bias, rows, bias, experts, offsets, dy)
    monkeypatch.setattr(B.torch, "empty", real)
    assert torch.isfinite(y).all() and torch.isfinite(db).all()
    assert torch.equal(y, rows + bias[experts.long()])


def test_expert_bias_strided_and_int64(interpret):
    rows, bias, experts, offsets, dy = _case(50, 20, 6, torch.float32, interpret, pad=4, id_dtype=torch.int64)
    wide = torch.randn(50, 48, device=interpret)
    wide[:, 5:25] = rows
    y, _, db = _run(mr.expert_bias, wide[:, 5:25], bias, experts, offsets, dy)
    assert torch.equal(y, rows + bias[experts])
    _, _, db_ref = _run(mr.expert_bias, rows, bias, experts, offsets, dy)
    assert torch.equal(db, db_ref)


def test_expert_bias_grad_only_of_what_needs_it(interpret):
    rows, bias, experts, offsets, dy = _case(20, 16, 4, torch.float32, interpret)
    b = bias.clone().requires_grad_()
    mr.expert_bias(rows, b, experts, offsets).backward(dy)  # rows without grad
    assert b.grad is not None
    with torch.no_grad():
        assert torch.equal(mr.expert_bias(rows, bias, experts, offsets), rows + bias[experts.long()])


def test_expert_bias_checks_and_fallback(monkeypatch):
    rows, bias, experts, offsets, dy = _case(12, 8, 3, torch.float32, "cpu")
    with pytest.raises(TypeError, match="rows"):
        mr.expert_bias(rows.long(), bias, experts, offsets)
    with pytest.raises(ValueError, match="bias"):
        mr.expert_bias(rows, bias[:, :4], experts, offsets)
    with pytest.raises(ValueError, match="experts"):
        mr.expert_bias(rows, bias, experts[:5], offsets)
    with pytest.raises(ValueError, match="offsets"):
        mr.expert_bias(rows, bias, experts, offsets[:2])
    with pytest.raises(TypeError, match="experts"):
        mr.expert_bias(rows, bias, experts.float(), offsets)
    _common.reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y = mr.expert_bias(rows, bias.double(), experts, offsets)  # two dtypes: the reference
    assert any("expert_bias" in str(x.message) and "one dtype" in str(x.message) for x in w)
    assert torch.equal(y, rows + bias.double()[experts.long()])
    monkeypatch.setattr(_common, "interpreter_active", lambda: False)  # a CPU tensor without the interpreter
    _common.reset_fallback_warnings()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        y, _, db = _run(mr.expert_bias, rows, bias, experts, offsets, dy)
    assert torch.equal(y, rows + bias[experts.long()])
    assert len([x for x in w if "expert_bias" in str(x.message)]) == 1


def test_expert_bias_custom_ops(interpret):
    rows, bias, experts, offsets, dy = _case(24, 16, 4, torch.float32, interpret, pad=2)
    torch.library.opcheck(B._bias_op, (rows, bias.requires_grad_(), experts, offsets),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
    torch.library.opcheck(B._bias_grad_op, (dy, offsets, torch.float32), test_utils=("test_schema", "test_faketensor"))
    torch._dynamo.reset()

    def f(r, b):
        return mr.expert_bias(r, b, experts, offsets)

    eager = _run(mr.expert_bias, rows, bias.detach(), experts, offsets, dy)
    compiled = _run(lambda r, b, e, o: torch.compile(f, fullgraph=True, backend="aot_eager")(r, b),
                    rows, bias.detach(), experts, offsets, dy)
    for a, b in zip(eager, compiled):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_oai_gate_with_fused_bias_matches_unfused(interpret, dtype):
    # the bias added as the gate's rows load: the gate of expert_bias's output, bitwise, and the
    # same gradients (gate-up rows bitwise, bias by the same segmented sum)
    rows, bias, experts, offsets, _ = _case(40, 24, 5, dtype, interpret, pad=3)
    dh = torch.randn(40, 12, generator=torch.Generator().manual_seed(2)).to(dtype).to(interpret)
    res = []
    for fused in (True, False):
        r, b = rows.clone().requires_grad_(), bias.clone().requires_grad_()
        if fused:
            y = mr.oai_gate(r, 1.702, 7.0, b, experts, offsets)
        else:
            y = mr.oai_gate(mr.expert_bias(r, b, experts, offsets), 1.702, 7.0)
        y.backward(dh)
        res.append((y.detach(), r.grad, b.grad))
    for a, c in zip(*res):
        assert torch.equal(a, c)
    with pytest.raises(ValueError, match="all three"):
        mr.oai_gate(rows, 1.702, 7.0, bias)


def test_oai_gate_with_bias_custom_op(interpret):
    S = importlib.import_module("deepspeed_fused.ops.moe_reorder.swiglu")
    rows, bias, experts, offsets, _ = _case(24, 16, 4, torch.float32, interpret, pad=2)
    torch.library.opcheck(S._oai_op, (rows.requires_grad_(), 1.702, 7.0, bias.requires_grad_(), experts, offsets),
                          test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))
