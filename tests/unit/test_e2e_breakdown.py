"""The e2e suite's GPU time attribution (deepspeed_fused.bench.breakdown) and its search logic, on CPU.

Synthetic Chrome-trace event lists stand in for a GPU profile: device kernels with correlation ids,
their CUDA launches on host threads, ``record_function`` ranges, autograd ``evaluate_function``
spans and the profiler's forward-backward flows.
"""
import pytest
import torch

from deepspeed_fused.bench import breakdown as bd
from deepspeed_fused.bench.breakdown import attribute

MAIN, BWD = 100, 200  # host thread ids: the forward/main thread and autograd's device thread


class Trace:
    def __init__(self):
        self.events = []
        self.corr = 0

    def range(self, name, ts, dur, tid=MAIN, cat="user_annotation", **args):
        self.events.append(dict(ph="X", cat=cat, name=name, ts=ts, dur=dur, tid=tid, pid=1, args=args))

    def op(self, name, ts, dur, tid=MAIN, **args):
        self.range(name, ts, dur, tid, cat="cpu_op", **args)

    def kernel(self, name, launch_ts, dur, tid=MAIN, launch="cuda_runtime"):
        self.corr += 1
        self.events.append(dict(ph="X", cat=launch, name="cudaLaunchKernel", ts=launch_ts, dur=1, tid=tid, pid=1,
                                args=dict(correlation=self.corr)))
        self.events.append(dict(ph="X", cat="kernel", name=name, ts=launch_ts + 5, dur=dur, tid=7, pid=0,
                                args=dict(correlation=self.corr, stream=7)))

    def flow(self, fid, fwd_ts, bwd_ts, fwd_tid=MAIN, bwd_tid=BWD):
        self.events.append(dict(ph="s", cat="fwdbwd", name="fwdbwd", id=fid, ts=fwd_ts, tid=fwd_tid, pid=1))
        self.events.append(dict(ph="f", cat="fwdbwd", name="fwdbwd", id=fid, ts=bwd_ts, tid=bwd_tid, pid=1, bp="e"))


def _sums_to_total(b):
    assert sum(b["categories"].values()) == pytest.approx(b["total_gpu_ms"], rel=1e-12, abs=1e-12)


def test_norm_two_ops_of_gradient_clipping_is_not_rms_norm():
    t = Trace()
    t.range("e2e::zero_step", 0, 1000)
    t.kernel("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<double, at::native::NormTwoOps<double, "
             "double, double, true>, unsigned int, double, 4, 4> >", 10, 5800)
    t.kernel("void at::native::vectorized_elementwise_kernel<4, rsqrt_kernel_cuda>", 2000, 100)  # no range: other
    b = attribute(t.events)
    assert b["categories"]["rms_norm"] == 0
    assert b["categories"]["zero: step (grad norm, clip, copies)"] == pytest.approx(5.8)
    assert b["categories"]["other"] == pytest.approx(0.1)
    _sums_to_total(b)


def test_optimizer_annotation_row_is_not_counted_again():
    t = Trace()
    t.range("e2e::zero_step", 0, 30000)
    t.range("Optimizer.step#AdamW.step", 100, 25000)
    # the profiler's device-side copy of the annotation: as long as the kernels it encloses
    t.events.append(dict(ph="X", cat="gpu_user_annotation", name="Optimizer.step#AdamW.step", ts=150, dur=25000,
                         tid=7, pid=0, args={}))
    for i in range(5):
        t.kernel("void at::native::multi_tensor_apply_kernel<FusedOptimizerTensorListMetadata<4>, FusedAdamMathFunctor>",
                 200 + i * 10, 5000)
    t.kernel("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda>", 26000, 1000)  # fp32 -> bf16
    b = attribute(t.events)
    assert b["total_gpu_ms"] == pytest.approx(26.0)
    assert b["categories"]["optimizer step"] == pytest.approx(25.0)
    assert b["categories"]["zero: step (grad norm, clip, copies)"] == pytest.approx(1.0)
    assert b["n_kernels"] == 6
    _sums_to_total(b)


def test_backward_kernels_follow_their_forward_op_by_flow_and_by_sequence_number():
    t = Trace()
    t.range("e2e::rms_norm", 0, 100)
    t.op("aten::pow", 10, 5, **{"Sequence number": 41, "Fwd thread id": 0})
    t.kernel("pow_tensor_scalar_kernel", 11, 30)
    t.range("e2e::attention", 200, 100)
    t.op("aten::mm", 210, 5, **{"Sequence number": 42, "Fwd thread id": 0})
    t.kernel("nvjet_sm90_tst_256x128", 211, 70)
    # backward, on autograd's thread: PowBackward0 linked by a flow, MmBackward0 by sequence number only
    t.op("autograd::engine::evaluate_function: PowBackward0", 1000, 50, tid=BWD,
         **{"Sequence number": 41, "Fwd thread id": 1})
    t.op("PowBackward0", 1001, 40, tid=BWD, **{"Sequence number": 41, "Fwd thread id": 1})
    t.flow(1, 10, 1001)
    t.kernel("mul_kernel", 1010, 40, tid=BWD)
    t.op("autograd::engine::evaluate_function: MmBackward0", 1100, 50, tid=BWD,
         **{"Sequence number": 42, "Fwd thread id": 1})
    t.kernel("nvjet_sm90_tst_128x256", 1110, 140, tid=BWD)
    t.op("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 1200, 50, tid=BWD)
    t.kernel("Memcpy DtoD (Device -> Device)", 1210, 20, tid=BWD)
    t.op("autograd::engine::evaluate_function: ViewBackward0", 1300, 50, tid=BWD,
         **{"Sequence number": 7, "Fwd thread id": 1})  # its forward op is outside every range
    t.kernel("copy_kernel", 1310, 10, tid=BWD)
    b = attribute(t.events)
    c = b["categories"]
    assert c["rms_norm"] == pytest.approx(0.07)
    assert c["GEMMs (attention, MLP)"] == pytest.approx(0.21)  # the attention range's GEMMs, forward and backward
    assert c["zero: gradients"] == pytest.approx(0.02)
    assert c["other"] == pytest.approx(0.01)
    assert b["how"]["backward_link"] == pytest.approx(0.04 + 0.14)
    assert b["how"]["backward_unlinked"] == pytest.approx(0.01)  # no forward op carries its number
    assert b["unlinked_nodes"] == {"ViewBackward0": pytest.approx(0.01)}
    _sums_to_total(b)


def test_a_reentrant_checkpoints_recomputed_nodes_link_to_the_recomputation_not_to_the_main_thread():
    """Under reentrant checkpointing the layer's forward runs again on autograd's thread, whose
    sequence numbers are counted apart: the number of a recomputed node can also name an op of the
    main thread, and only the forward-thread id of its backward tells them apart. The recomputed
    nodes outnumber the main thread's (as in a checkpointed model), and the ids are mapped anyway."""
    t = Trace()
    for seq in range(1, 5):  # the main thread runs most of the forward ops
        t.op("aten::view", seq, 1, **{"Sequence number": seq, "Fwd thread id": 0})
    t.range("e2e::mlp", 0, 100)  # the main thread's op 5: inside the MLP
    t.op("aten::mul", 10, 5, **{"Sequence number": 5, "Fwd thread id": 0})
    t.kernel("mul_kernel", 11, 10)
    t.range("e2e::rms_norm", 300, 100)  # the main thread's op 6, forward of a node of the main thread
    t.op("aten::pow", 310, 5, **{"Sequence number": 6, "Fwd thread id": 0})
    t.kernel("pow_kernel", 311, 10)
    # the recomputation on autograd's thread: its op 5 is a norm's, 7 and 8 are its own only
    t.range("e2e::rms_norm", 1000, 100, tid=BWD)
    for seq in (5, 7, 8):
        t.op("aten::rsqrt", 1000 + seq, 1, tid=BWD, **{"Sequence number": seq, "Fwd thread id": 0})
    t.kernel("rsqrt_kernel", 1011, 10, tid=BWD)
    for i, seq in enumerate((5, 7, 8)):
        t.op("autograd::engine::evaluate_function: RsqrtBackward0", 2000 + 10 * i, 5, tid=BWD,
             **{"Sequence number": seq, "Fwd thread id": 2})
        t.kernel("rsqrt_backward_kernel", 2001 + 10 * i, 40, tid=BWD)
    t.op("autograd::engine::evaluate_function: PowBackward0", 2100, 50, tid=BWD,
         **{"Sequence number": 6, "Fwd thread id": 1})  # a node of the main thread
    t.kernel("pow_backward_kernel", 2110, 20, tid=BWD)
    b = attribute(t.events)
    c = b["categories"]
    assert c["rms_norm"] == pytest.approx(0.01 + 0.01 + 3 * 0.04 + 0.02)
    assert c["mlp activation"] == pytest.approx(0.01)
    assert b["how"]["backward_link"] == pytest.approx(0.14)
    _sums_to_total(b)


def test_a_node_without_flow_or_sequence_number_links_to_the_latest_forward_op_of_its_name():
    t = Trace()
    t.range("e2e::rms_norm", 0, 100)
    t.op("_FusedRMSNormFn", 10, 5, **{"Sequence number": 3, "Fwd thread id": 0})
    t.range("e2e::attention", 200, 100)
    t.op("aten::mul", 210, 5, **{"Sequence number": 4, "Fwd thread id": 0})
    t.range("e2e::rms_norm", 400, 100, tid=BWD)  # recomputed on autograd's thread, number unknown
    t.op("_FusedRMSNormFn", 410, 5, tid=BWD)
    # the gradient-accumulation add that autograd runs inside the node's evaluation
    t.op("autograd::engine::evaluate_function: _FusedRMSNormFnBackward", 1000, 50, tid=BWD)
    t.kernel("vectorized_elementwise_kernel<CUDAFunctor_add>", 1010, 30, tid=BWD)
    t.op("autograd::engine::evaluate_function: MulBackward0", 1100, 50, tid=BWD,
         **{"Sequence number": -1, "Fwd thread id": 1})
    t.kernel("mul_kernel", 1110, 20, tid=BWD)
    t.op("autograd::engine::evaluate_function: DivBackward0", 1200, 50, tid=BWD)  # no aten::div anywhere
    t.kernel("div_kernel", 1210, 10, tid=BWD)
    b = attribute(t.events)
    c = b["categories"]
    assert c["rms_norm"] == pytest.approx(0.03)
    assert c["rope + attention elementwise"] == pytest.approx(0.02)  # aten::mul inside the attention range
    assert c["other"] == pytest.approx(0.01) and b["how"]["backward_unlinked"] == pytest.approx(0.01)
    assert list(b["unlinked_nodes"]) == ["DivBackward0"] and b["unlinked_nodes"]["DivBackward0"] == pytest.approx(0.01)
    _sums_to_total(b)


def test_cudnn_attention_kernels_are_attention_not_gemms():
    t = Trace()
    t.range("e2e::attention", 0, 1000)
    t.kernel("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_7_64x128x128_4x1x1_kernel0_0", 10, 300)
    t.kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 20, 200)
    t.kernel("_ZN7cutlass13device_kernelIN5flash20FlashAttnFwdSm90", 30, 100)
    t.kernel("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add>", 40, 10)
    c = attribute(t.events)["categories"]
    assert c["attention"] == pytest.approx(0.4)
    assert c["GEMMs (attention, MLP)"] == pytest.approx(0.2)
    assert c["rope + attention elementwise"] == pytest.approx(0.01)


def test_range_kinds_by_class_name_with_ligers_family_suffixes():
    kinds = {n: bd._range_kind(type(n, (torch.nn.Module,), {})()) for n in (
        "LlamaRMSNorm", "LigerRMSNorm", "LigerRMSNormForGemma3", "LigerGEGLUMLPForGemma4", "LlamaMLP",
        "Gemma3DecoderLayer", "Qwen3MoeSparseMoeBlock", "LlamaAttention", "GemmaForCausalLM", "RMSNormFormatter")}
    assert kinds == {"LlamaRMSNorm": "rms_norm", "LigerRMSNorm": "rms_norm", "LigerRMSNormForGemma3": "rms_norm",
                     "LigerGEGLUMLPForGemma4": "mlp", "LlamaMLP": "mlp", "Gemma3DecoderLayer": "decoder_layer",
                     "Qwen3MoeSparseMoeBlock": "moe", "LlamaAttention": "attention", "GemmaForCausalLM": None,
                     "RMSNormFormatter": None}


def test_our_kernels_by_name_nccl_moe_split_and_innermost_range():
    t = Trace()
    t.range("e2e::moe", 0, 1000)
    t.kernel("_ZN7cutlass13device_kernelIN2at4cuda6detail25enable_3x_kernel_for_sm9xINS_4gemm6kernel13GemmUniversal"
             "INS5_17GroupProblemShape", 10, 500)
    t.kernel("void at::native::index_elementwise_kernel", 20, 100)
    t.kernel("_gather_rows_kernel", 30, 50)
    t.range("e2e::rms_norm", 400, 100)  # a norm inside the MoE block: innermost wins
    t.kernel("some_norm_kernel", 410, 20)
    t.kernel("_rms_bwd_kernel", 5000, 30)  # ours, launched where no range is: by name
    t.kernel("_rms_bwd_form_kernel", 5040, 10)  # the norm forms' (a C++ node's backward has no range)
    t.kernel("_rms_norm_backward_kernel", 5060, 10)  # Liger's, by name too
    t.kernel("ncclDevKernel_AllReduce_Sum_bf16_RING_LL", 5100, 300)
    t.range("e2e::lm_head_loss", 6000, 500)
    t.range("e2e::router_aux_loss", 6100, 100)
    t.kernel("softmax_kernel", 6110, 10)
    t.kernel("_lce_rows_kernel", 6200, 200)
    t.kernel("orphan_kernel_without_launch", 0, 0)
    t.events[-2]["args"]["correlation"] = None  # drop the link of the last kernel
    t.events[-1]["args"]["correlation"] = 10 ** 9
    t.events[-1]["dur"] = 5
    b = attribute(t.events)
    c = b["categories"]
    assert c["moe: expert GEMMs"] == pytest.approx(0.5)
    assert c["moe: router, reorder, combine"] == pytest.approx(0.15)
    assert c["rms_norm"] == pytest.approx(0.07)
    assert c["collectives (nccl)"] == pytest.approx(0.3)
    assert c["router aux loss"] == pytest.approx(0.01)
    assert c["lm_head + loss"] == pytest.approx(0.2)
    assert c["other"] == pytest.approx(0.005)
    assert b["how"]["no_launch"] == pytest.approx(0.005)
    _sums_to_total(b)


def test_a_kernel_without_its_launch_falls_back_to_the_device_side_range():
    t = Trace()
    t.events.append(dict(ph="X", cat="gpu_user_annotation", name="e2e::rms_norm", ts=100, dur=50, tid=7, pid=0,
                         args={}))
    t.events.append(dict(ph="X", cat="kernel", name="some_kernel", ts=110, dur=20, tid=7, pid=0,
                         args=dict(correlation=12345)))
    t.events.append(dict(ph="X", cat="kernel", name="late_kernel", ts=400, dur=30, tid=7, pid=0,
                         args=dict(correlation=12346)))
    b = attribute(t.events)
    assert b["total_gpu_ms"] == pytest.approx(0.05)  # the annotation row itself is not counted
    assert b["categories"]["rms_norm"] == pytest.approx(0.02) and b["how"]["device_range"] == pytest.approx(0.02)
    assert b["categories"]["other"] == pytest.approx(0.03) and b["how"]["no_launch"] == pytest.approx(0.03)


def test_triton_kernels_launched_through_the_driver_api_are_linked():
    t = Trace()
    t.range("e2e::rms_norm", 0, 100)
    t.kernel("_layer_norm_fwd_fused", 10, 40, launch="cuda_driver")  # another Triton kernel: found by range
    b = attribute(t.events)
    assert b["categories"]["rms_norm"] == pytest.approx(0.04) and b["how"]["range"] == pytest.approx(0.04)


def test_real_cpu_trace_of_a_tiny_moe_model():
    """install_ranges on a transformers Qwen3-MoE model, one forward+backward profiled on CPU (leaf
    CPU ops stand for kernels): the replaced modules get their forward and backward time, the
    categories add up, and every hook and wrapper is gone afterwards."""
    pytest.importorskip("transformers")
    from deepspeed_fused.models import build_model

    model = build_model("qwen3-moe-tiny", seed=0)
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(input_ids=ids)  # transformers installs its own output-capturing hooks on the first call
    before = {id(m): (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()}

    def step():
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()

    b = bd.profile_step(step, model, device=False)
    c = b["categories"]
    for cat in ("rms_norm", "lm_head + loss", "rope + attention elementwise", "router aux loss", "residual adds",
                "moe: router, reorder, combine",
                "zero: gradients"):
        assert c[cat] > 0, (cat, c)
    assert b["how"].get("backward_link", 0) > 0
    assert any(k["category"] == "rms_norm" and k["name"] in ("aten::rsqrt", "aten::pow") for k in b["top_kernels"]) \
        or c["rms_norm"] > 0
    _sums_to_total(b)
    after = {id(m): (dict(m._forward_hooks), dict(m._forward_pre_hooks)) for m in model.modules()}
    assert after == before
    import transformers.models.qwen3_moe.modeling_qwen3_moe as mq

    assert not getattr(mq.load_balancing_loss_func, "_e2e_range", False)


def test_micro_step_ranges_split_an_accumulated_step_without_changing_categories():
    """Two micro-steps (``e2e::micro_step`` on the main thread, their backward kernels launched on
    autograd's thread while the main thread waits) and the optimizer step after them: each
    micro-step gets the kernels launched inside it, the rest is outside, and the categories of
    the whole step are those without the windows."""
    def build(windows):
        t = Trace()
        for i, t0 in enumerate((0, 10000)):
            if windows:
                t.range("e2e::micro_step", t0, 5000)
            t.range("e2e::rms_norm", t0 + 10, 100)
            t.op("aten::mul", t0 + 20, 5, **{"Sequence number": 50 + i, "Fwd thread id": 0})
            t.kernel("mul_kernel", t0 + 21, 30 + i)
            t.range("e2e::attention", t0 + 200, 100)
            t.kernel("flash_fwd_kernel", t0 + 210, 300)
            t.range("e2e::zero_backward", t0 + 1000, 3000)
            t.op("autograd::engine::evaluate_function: MulBackward0", t0 + 1100, 50, tid=BWD,
                 **{"Sequence number": 50 + i, "Fwd thread id": 1})
            t.kernel("mul_kernel", t0 + 1110, 40, tid=BWD)
            t.op("autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", t0 + 1200, 50, tid=BWD)
            t.kernel("add_kernel", t0 + 1210, 20, tid=BWD)
        t.range("e2e::zero_step", 20000, 3000)
        t.range("Optimizer.step#AdamW.step", 20100, 2000)
        t.kernel("multi_tensor_apply_kernel", 20200, 900)
        t.kernel("norm_kernel", 22500, 100)  # grad norm, in the ZeRO step outside the optimizer
        return t.events

    b = attribute(build(True))
    plain = attribute(build(False))
    assert b["categories"] == plain["categories"] and b["total_gpu_ms"] == plain["total_gpu_ms"]
    assert "micro_steps" not in plain
    w = b["micro_steps"]
    assert len(w) == 2 and [x["n_kernels"] for x in w] == [4, 4]
    assert w[0]["categories"]["rms_norm"] == pytest.approx(0.03 + 0.04)  # forward and its backward
    assert w[1]["categories"]["rms_norm"] == pytest.approx(0.031 + 0.04)
    assert w[0]["categories"]["attention"] == pytest.approx(0.3)
    assert w[0]["categories"]["zero: gradients"] == pytest.approx(0.02)
    assert w[0]["total_gpu_ms"] == pytest.approx(0.39) and w[1]["total_gpu_ms"] == pytest.approx(0.391)
    out = b["outside_micro_steps"]
    assert out["categories"]["optimizer step"] == pytest.approx(0.9) and out["n_kernels"] == 2
    assert out["categories"]["zero: step (grad norm, clip, copies)"] == pytest.approx(0.1)
    m = b["micro_step_mean"]
    assert m["n_micro_steps"] == 2 and m["total_gpu_ms"] == pytest.approx(0.3905)
    assert m["categories"]["rms_norm"] == pytest.approx(0.0705)
    assert sum(x["total_gpu_ms"] for x in w) + out["total_gpu_ms"] == pytest.approx(b["total_gpu_ms"])
    _sums_to_total(m)


def test_idle_time_splits_each_gap_at_the_next_kernels_launch():
    main, bwd = 1, 2
    timeline = [  # (start us, duration us, category, launch (tid, ts) or None), out of order
        (300.0, 50.0, "rms_norm", (bwd, 240.0)),  # gap 260 -> 300, launched before it began: all "other"
        (100.0, 100.0, "GEMMs (attention, MLP)", (main, 10.0)),
        (150.0, 100.0, "zero: gradients", (bwd, 140.0)),  # overlaps the first on another stream: no gap
        (260.0, 0.0, "other", None),  # zero-length, no launch: gap 250 -> 260 is all "other"
        (500.0, 20.0, "rms_norm", (main, 460.0)),  # gap 350 -> 500: 110 before the launch, 40 after
        (600.0, 10.0, "mlp activation", (bwd, 595.0)),  # gap 520 -> 600: 75 host, 5 latency
    ]
    r = bd.idle_time(timeline, main)
    assert r["span_ms"] == pytest.approx(0.510)
    assert r["busy_ms"] == pytest.approx((150 + 50 + 20 + 10) / 1e3)
    assert r["gaps"] == 4
    assert r["host_ms"] == pytest.approx((110 + 75) / 1e3)
    assert r["other_ms"] == pytest.approx((10 + 40 + 40 + 5) / 1e3)
    assert r["idle_ms"] == pytest.approx(r["span_ms"] - r["busy_ms"])
    assert r["idle_ms"] == pytest.approx(r["host_ms"] + r["other_ms"])
    assert r["host_by_category"] == pytest.approx({"rms_norm": 0.110, "mlp activation": 0.075})
    assert list(r["host_by_category"]) == ["rms_norm", "mlp activation"]  # longest first
    assert r["host_by_thread"] == pytest.approx({bd.MAIN_THREAD: 0.110, bd.AUTOGRAD_THREAD: 0.075})
    assert bd.idle_time([], main)["idle_ms"] == 0
    # a trace without forward ops does not say which thread is the main one
    assert bd.idle_time(timeline)["host_by_thread"] == pytest.approx({bd.UNKNOWN_THREAD: 0.185})


def test_a_gpu_breakdown_says_where_the_gpu_waited_on_the_host():
    t = Trace()
    t.range("e2e::rms_norm", 0, 100)
    t.op("aten::mul", 5, 3, **{"Sequence number": 7})  # a forward op: this is the main thread
    t.kernel("mul_kernel", 10, 40)  # device 15 -> 55
    t.range("e2e::attention", 150, 300)
    t.kernel("flash_fwd_kernel", 200, 100)  # launched at 200, device 205 -> 305: 145 us waited on the host
    t.op("autograd::engine::evaluate_function: MulBackward0", 395, 50, tid=BWD,
         **{"Sequence number": 7, "Fwd thread id": 1})
    t.kernel("mul_kernel", 400, 20, tid=BWD)  # device 405 -> 425: 95 us on autograd's thread
    b = attribute(t.events)
    idle = b["idle"]
    assert idle["span_ms"] == pytest.approx(0.410) and idle["busy_ms"] == pytest.approx(0.160)
    assert idle["host_ms"] == pytest.approx(0.240) and idle["other_ms"] == pytest.approx(0.010)
    assert idle["host_by_category"] == pytest.approx({"attention": 0.145, "rms_norm": 0.095})
    assert idle["host_by_thread"] == pytest.approx({bd.MAIN_THREAD: 0.145, bd.AUTOGRAD_THREAD: 0.095})
    t_cpu = Trace()
    t_cpu.op("aten::mul", 5, 3)
    assert "idle" not in attribute(t_cpu.events, device=False)
