"""The ``grad_norm`` op (per-tensor float64 norms, one read of each tensor) and feature (DeepSpeed's
ZeRO-1/2 gradient norm with those norms), on CPU: the kernels under Triton's interpreter at small
chunk sizes, the feature on DeepSpeed engines (one and two ranks) against the same run without it."""
from __future__ import annotations

import math
import types
import warnings

import pytest
import torch

import deepspeed
from deepspeed_fused import unpatch_model
from deepspeed_fused.features.grad_norm import GradNormFeature, recognise
from deepspeed_fused.features.grad_norm import patch as P
from deepspeed_fused.features.grad_norm.recognition import Form
from deepspeed_fused.ops._common import reset_fallback_warnings
from deepspeed_fused.ops.grad_norm import launch, tensor_norms, tensor_norms_reference
from tiny_models import build_model
from unit.common import DistributedTest


@pytest.fixture
def small_chunks(monkeypatch, interpret):
    """Chunks of 48 elements read in blocks of 16 (and partial sums added 4 at a time), so that
    small tensors cross chunk and block boundaries under the interpreter."""
    monkeypatch.setattr(launch, "CHUNK", 48)
    monkeypatch.setattr(launch, "BLOCK", 16)
    monkeypatch.setattr(launch, "SEG_BLOCK", 4)
    launch.clear_plans()
    reset_fallback_warnings()
    yield interpret
    launch.clear_plans()


def _exact_norms(tensors):
    """Each tensor's norm from an exactly rounded float64 sum of its squares (math.fsum)."""
    return [math.sqrt(math.fsum(v * v for v in t.detach().double().flatten().tolist())) for t in tensors]


def _our_warnings(record):
    return [str(w.message) for w in record if "deepspeed_fused.grad_norm" in str(w.message)]


def _poisoned_empty(monkeypatch):
    """torch.empty as the launch sees it: float64 buffers filled with NaN (every element must be written)."""
    real = torch.empty

    def empty(*a, **k):
        t = real(*a, **k)
        if t.dtype == torch.float64:
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(launch.torch, "empty", empty)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_views_of_one_buffer_match_float64_within_rounding(small_chunks, monkeypatch, dtype):
    _poisoned_empty(monkeypatch)
    g = torch.Generator().manual_seed(1)
    flat = (3 * torch.randn(1000, generator=g)).to(dtype).to(small_chunks)
    # sizes across the chunk (48) and block (16) boundaries, an empty view, offsets not 16-byte aligned
    bounds = [0, 1, 17, 17, 65, 113, 400, 401, 1000]
    views = [flat[a:b] for a, b in zip(bounds, bounds[1:])]
    views[4] = views[4].view(6, 8)
    got = tensor_norms(views)
    assert got.dtype == torch.float64 and got.shape == (len(views),)
    exact = torch.tensor(_exact_norms(views), dtype=torch.float64)
    ref = tensor_norms_reference(views)
    assert torch.allclose(got, exact, rtol=4e-16 * 8, atol=0), (got, exact)
    assert torch.allclose(ref, exact, rtol=4e-16 * 8, atol=0)
    assert got[2].item() == 0.0
    assert torch.equal(tensor_norms(views), got)  # the same bits again (fixed order of additions)


def test_separate_tensors_mixed_dtypes_and_what_the_kernels_leave(small_chunks):
    dev = small_chunks
    g = torch.Generator().manual_seed(2)
    ts = [torch.randn(70, generator=g).half().to(dev), torch.randn(200, generator=g).to(dev),
          torch.randn(9, 11, generator=g).to(dev).t(), torch.randn(30, generator=g, dtype=torch.float64).to(dev),
          torch.randn(5, generator=g).to(dev)]
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        got = tensor_norms(ts)
        again = tensor_norms(ts)
    exact = torch.tensor(_exact_norms(ts), dtype=torch.float64)
    assert torch.allclose(got, exact, rtol=1e-15, atol=0)
    assert torch.equal(got, again)
    msgs = _our_warnings(rec)
    assert len(msgs) == 2, msgs  # one per reason, once
    assert any("non-contiguous" in m for m in msgs) and any("torch.float64" in m for m in msgs)


def test_non_finite_elements_give_the_reference_result(small_chunks):
    dev = small_chunks
    a, b, c, d = (torch.randn(100).to(dev) for _ in range(4))
    a[57] = float("inf")
    b[3] = float("nan")
    c[10], c[90] = float("-inf"), float("nan")
    d[99] = 1e30  # its square overflows float32, not float64
    got, ref = tensor_norms([a, b, c, d]), tensor_norms_reference([a, b, c, d])
    assert got[0].item() == math.inf and math.isnan(got[1].item()) and math.isnan(got[2].item())
    assert torch.equal(got.isnan(), ref.isnan()) and torch.equal(got.isinf(), ref.isinf())
    assert math.isclose(got[3].item(), ref[3].item(), rel_tol=1e-15)


def test_all_empty_and_cache_reuse(small_chunks):
    dev = small_chunks
    flat = torch.randn(300).to(dev)
    assert torch.equal(tensor_norms([flat[:0], flat[5:5]]), torch.zeros(2, dtype=torch.float64))
    views = [flat[:100], flat[100:300]]
    tensor_norms(views)
    n = len(launch._PLANS)
    tensor_norms([flat[:100], flat[100:300]])  # new view objects, same memory: the same table
    assert len(launch._PLANS) == n
    tensor_norms([flat[:150], flat[150:300]])
    assert len(launch._PLANS) == n + 1


@pytest.mark.parametrize("bad, exc, match", [
    (torch.ones(3), TypeError, r"tensors: expected a list or tuple"),
    ([], ValueError, r"tensors: expected at least one tensor"),
    ([torch.ones(2), 3.0], TypeError, r"tensors\[1\]: expected a torch.Tensor"),
    ([torch.ones(2), torch.ones(2, dtype=torch.int64)], TypeError, r"tensors\[1\]: expected a floating-point"),
    ([torch.ones(2), torch.ones(2, device="meta")], ValueError, r"tensors\[1\]: expected a tensor on cpu"),
])
def test_wrong_arguments_name_the_argument(bad, exc, match):
    with pytest.raises(exc, match=match):
        tensor_norms(bad)


def test_custom_op_for_torch_compile(small_chunks):
    from deepspeed_fused.ops.grad_norm.api import _tensor_norms_op

    ts = [torch.randn(50).to(small_chunks), torch.randn(7).to(small_chunks)]
    torch.library.opcheck(_tensor_norms_op, (ts,), test_utils=("test_schema", "test_faketensor"))


# ---- recognition ------------------------------------------------------------------------------------

def test_deepspeeds_zero_1_2_method_is_recognised_and_stage_3_is_not():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    form = recognise(DeepSpeedZeroOptimizer.get_grad_norm_direct)
    assert isinstance(form, Form), form
    why = recognise(DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct)
    assert why.startswith("DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct (deepspeed.runtime.zero.stage3), "
                          "wrapped by ") and "is not a known form" in why, why


def _copy_of(fn, **globals_):
    g = dict(fn.__globals__)
    g.update(globals_)
    return types.FunctionType(fn.__code__, g, fn.__name__, fn.__defaults__, fn.__closure__)


def test_changed_method_or_module_is_not_recognised():
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    orig = DeepSpeedZeroOptimizer.get_grad_norm_direct
    assert isinstance(recognise(_copy_of(orig)), Form)
    assert "binds torch" in recognise(_copy_of(orig, torch=types.SimpleNamespace()))
    assert "binds inf" in recognise(_copy_of(orig, inf=1e300))

    def get_grad_norm_direct(self, gradients, params, norm_type=2):  # the norm taken in float32
        return torch.stack([g.float().norm() for g in gradients]).pow(2).sum().sqrt()

    assert "not a known form" in recognise(get_grad_norm_direct)
    other_default = _copy_of(orig)
    other_default.__defaults__ = (1,)
    assert "its defaults are (1,)" in recognise(other_default)


# ---- the feature on DeepSpeed engines --------------------------------------------------------------

def _config(stage, on, clip=1.0):
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, "steps_per_print": 10**6,
           "deepspeed_fused": {"show_report": False, "grad_norm": {"enabled": on}}}
    return cfg


def _train(stage, on, steps=3):
    torch.manual_seed(0)
    model = build_model("llama-tiny")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=_config(stage, on))
    g = torch.Generator().manual_seed(10 + deepspeed.comm.get_rank())
    losses, norms = [], []
    for _ in range(steps):
        ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        norms.append(engine.get_global_grad_norm())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return engine, losses, norms, params


class TestFeatureOnEngines(DistributedTest):
    world_size = [1, 2]

    @pytest.mark.parametrize("stage", [1, 2])
    def test_same_run_as_deepspeed_and_kernels_counted(self, stage):
        _, losses0, norms0, params0 = _train(stage, False)
        engine, losses1, norms1, params1 = _train(stage, True)
        rep = {f.name: f for f in engine.deepspeed_fused_report.features}["grad_norm"]
        assert rep.applied, rep.reason
        assert rep.where == (f"DeepSpeedZeroOptimizer.get_grad_norm_direct, has_overflow_partitioned_grads_serial "
                             f"(ZeRO stage {stage})")
        # fp32 here: DeepSpeed checks for overflow only in bf16 and fp16, so the norm's calls alone
        assert rep.calls.fused == 3 and rep.calls.reference == 0 and rep.calls.eager == 0, rep.calls
        assert losses1 == losses0
        assert norms1 == norms0 and all(n > 0 for n in norms1)
        # one table, built at the first step: the gradients keep their layout from step to step
        # (DeepSpeed may hand them in a buffer at another address; the table does not depend on it)
        assert len(launch._PLANS) == 1
        assert all(torch.equal(params1[n], params0[n]) for n in params0)
        assert GradNormFeature().is_applied(engine.module) is True
        assert unpatch_model(engine.module) == {"grad_norm": 1}
        assert "get_grad_norm_direct" not in engine.optimizer.__dict__
        assert GradNormFeature().is_applied(engine.module) is False


class TestFeatureOneRank(DistributedTest):
    world_size = 1

    def test_fused_method_equals_the_original_on_the_same_gradients(self):
        engine, *_ = _train(2, True, steps=1)
        opt = engine.optimizer
        ids = torch.randint(0, 100, (2, 16))
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        grads, params = opt.averaged_gradients[0], opt.params_in_partition[0]
        orig = type(opt).get_grad_norm_direct
        assert torch.equal(opt.get_grad_norm_direct(grads, params), orig(opt, grads, params))
        # a norm other than 2 runs the original method, counted as eager
        rep = {f.name: f for f in engine.deepspeed_fused_report.features}["grad_norm"]
        eager = rep.calls.eager
        assert torch.equal(opt.get_grad_norm_direct(grads, params, norm_type=float("inf")),
                           orig(opt, grads, params, norm_type=float("inf")))
        assert rep.calls.eager == eager + 1
        # the overflow check, fused and DeepSpeed's, on finite gradients
        check = type(opt).has_overflow_partitioned_grads_serial
        fused = rep.calls.fused
        a, b = opt.has_overflow_partitioned_grads_serial(), check(opt)
        assert a.dtype == b.dtype == torch.bool and a.shape == b.shape == (1,) and not a.item() and not b.item()
        assert rep.calls.fused == fused + 1
        # a non-finite gradient (inf, then NaN): the norm masked to -1 by both, an overflow for both
        for bad in (float("inf"), float("nan")):
            grads[-1].view(-1)[3] = bad
            a, b = opt.get_grad_norm_direct(grads, params), orig(opt, grads, params)
            assert a.item() == b.item() == -1.0
            assert opt.has_overflow_partitioned_grads_serial().item() is True and check(opt).item() is True
        grads[-1].view(-1)[3] = 1e30  # large, finite: no overflow in either (its square fits float64)
        assert opt.has_overflow_partitioned_grads_serial().item() is False and check(opt).item() is False

    @pytest.mark.parametrize("stage", [0, 3])
    def test_other_optimizers_stay_with_the_reason(self, stage):
        engine, *_ = _train(stage, True, steps=1)
        rep = {f.name: f for f in engine.deepspeed_fused_report.features}["grad_norm"]
        assert not rep.applied
        assert ("has no get_grad_norm_direct" in rep.reason if stage == 0 else
                rep.reason.startswith("DeepSpeedZeroOptimizer_Stage3.get_grad_norm_direct (")
                and "not a known form" in rep.reason), rep.reason
        assert "get_grad_norm_direct" not in getattr(engine.optimizer, "__dict__", {})


def test_without_an_engine_it_says_why(interpret):
    from deepspeed_fused import patch_model

    model = build_model("llama-tiny")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        rep = {f.name: f for f in patch_model(model, {"grad_norm": {"enabled": True}}).features}["grad_norm"]
    assert not rep.applied and "needs the DeepSpeed engine" in rep.reason


def test_the_link_does_not_survive_a_deep_copy_or_a_pickle():
    import copy
    import pickle

    class Opt:
        pass

    opt, model = Opt(), torch.nn.Linear(2, 2)
    model.__dict__[P.LINK] = P.OptimizerLink(opt)
    assert P.linked_optimizer(model) is opt
    assert P.linked_optimizer(copy.deepcopy(model)) is None
    assert P.linked_optimizer(pickle.loads(pickle.dumps(model))) is None


def test_the_benchmark_suite_runs_every_implementation_on_cpu(interpret, monkeypatch):
    import argparse

    import torch.distributed as tdist

    from deepspeed_fused.bench import grad_norm as suite

    monkeypatch.setattr(suite, "CPU_MODELS", ["llama-tiny"])
    for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    try:
        recs = suite.run(argparse.Namespace(quick=True, extra=[]))
    finally:
        if tdist.is_initialized():
            tdist.destroy_process_group()
    checks = [r for r in recs if r.extra.get("check") == "overflow"]
    assert [r.impl for r in checks] == ["deepspeed_fused", "DeepSpeed has_overflow_partitioned_grads_serial"]
    assert all(r.extra["total"] is False and r.fwd_ms > 0 for r in checks)
    alone = [r for r in recs if r.extra.get("check") == "norms"]
    assert [r.impl for r in alone][0] == "deepspeed_fused" and all(r.extra["max_rel_err"] < 1e-13 for r in alone
                                                                    if "float32" not in r.impl)
    by = {r.impl: r for r in recs if r.extra.get("check") is None}
    assert list(by) == ["deepspeed_fused", "DeepSpeed get_grad_norm_direct", "torch _foreach_norm(dtype=float64)",
                        "torch _foreach_norm(dtype=float32)"]
    assert by["deepspeed_fused"].ours and by["deepspeed_fused"].fwd_ms > 0
    assert by["deepspeed_fused"].extra["total"] == by["DeepSpeed get_grad_norm_direct"].extra["total"] > 0
    assert by["deepspeed_fused"].extra["equals DeepSpeed"] is True
    assert "| llama-tiny | deepspeed_fused |" in suite.NOTES


def test_a_table_serves_the_same_layout_at_another_address(small_chunks):
    dev = small_chunks
    a, b = torch.randn(500).to(dev), torch.randn(500).to(dev)
    na = tensor_norms([a[:100], a[100:350], a[350:]])
    nb = tensor_norms([b[:100], b[100:350], b[350:]])
    assert len(launch._PLANS) == 1
    assert torch.allclose(nb, tensor_norms_reference([b[:100], b[100:350], b[350:]]), rtol=1e-15, atol=0)
    assert not torch.equal(na, nb)


def test_the_overflow_check_is_recognised_with_the_functions_it_calls():
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from deepspeed_fused.features.grad_norm.recognition import recognise_overflow

    assert isinstance(recognise_overflow(DeepSpeedZeroOptimizer), Form)
    assert "not a known form" in recognise_overflow(DeepSpeedZeroOptimizer_Stage3)

    class OwnCheck(DeepSpeedZeroOptimizer):  # an override that also looks at the gradient's size
        @staticmethod
        def _has_inf_or_nan(x, j=None):
            return x.numel() > 10**9 or not torch.isfinite(x).all()

    assert "OwnCheck._has_inf_or_nan" in recognise_overflow(OwnCheck)

    class NotStatic(DeepSpeedZeroOptimizer):
        def _has_inf_or_nan(self, x, j=None):
            return False

    assert "is not a staticmethod" in recognise_overflow(NotStatic)


class TestSecondEngine(DistributedTest):
    world_size = 1

    def test_a_model_initialized_again_gets_its_new_optimizer_patched(self):
        engine1, *_ = _train(2, True, steps=1)
        model = engine1.module
        opt2 = torch.optim.AdamW(model.parameters(), lr=1e-2)
        engine2, *_ = deepspeed.initialize(model=model, optimizer=opt2, config=_config(2, True))
        assert engine2.optimizer is not engine1.optimizer
        assert "get_grad_norm_direct" in engine2.optimizer.__dict__
        assert "get_grad_norm_direct" not in engine1.optimizer.__dict__  # one engine at a time
        rep = {f.name: f for f in engine2.deepspeed_fused_report.features}["grad_norm"]
        ids = torch.randint(0, 100, (2, 16))
        engine2.backward(engine2(input_ids=ids, labels=ids).loss)
        engine2.step()
        assert rep.applied and rep.calls.fused == 1, rep.calls


class TestOtherCodeFirst(DistributedTest):
    world_size = 1

    def test_a_method_replaced_by_other_code_is_left_with_the_reason(self):
        from deepspeed_fused import patch_model

        engine, *_ = _train(2, False, steps=1)
        opt = engine.optimizer
        theirs = types.MethodType(lambda self, *a, **k: torch.tensor(1.0), opt)
        opt.__dict__["has_overflow_partitioned_grads_serial"] = theirs
        rep = {f.name: f for f in patch_model(engine.module, _config(2, True), engine=engine).features}["grad_norm"]
        assert rep.applied and "overflow check left as it is" in rep.reason and "already replaced" in rep.reason
        assert opt.__dict__["has_overflow_partitioned_grads_serial"] is theirs
        assert rep.where.endswith("get_grad_norm_direct (ZeRO stage 2)")
        unpatch_model(engine.module)
        assert opt.__dict__["has_overflow_partitioned_grads_serial"] is theirs  # theirs stays
        opt.__dict__["get_grad_norm_direct"] = theirs
        rep = {f.name: f for f in patch_model(engine.module, _config(2, True), engine=engine).features}["grad_norm"]
        assert not rep.applied and "already replaced on this optimizer by other code" in rep.reason
