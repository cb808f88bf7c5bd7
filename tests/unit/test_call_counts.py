"""Each feature's call counts say what ran: ``fused`` (our kernels), ``reference`` (the op's torch
reference) or ``eager`` (the model's own code), checked against the kernel launches themselves.

On CPU under Triton's interpreter in fp32 the kernels run; with ``TRITON_INTERPRET=0`` at call
time (the kernels were defined interpreted, but the ops now see CPU tensors and no GPU, as on a
CPU-only machine) no kernel can take the inputs: the loss and the MoE ops run their torch
references, while the RMSNorm and RoPE features hand the call to the module's own code.
"""
import pytest
import torch

from deepspeed_fused.hook import patch_model, unpatch_model
from tiny_models import build_model

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU interpreter test (the GPU runs the kernels)")


class KernelLaunches:
    """Interpreted Triton launches while entered (every launch of every op goes through the JIT's
    interpreter on CPU tensors)."""

    def __init__(self):
        self.n = 0

    def __enter__(self):
        from triton.runtime import interpreter

        self._cls = interpreter.GridExecutor
        self._real = real = self._cls.__call__

        def counted(executor, *args, **kwargs):
            self.n += 1
            return real(executor, *args, **kwargs)

        self._cls.__call__ = counted
        return self

    def __exit__(self, *exc):
        self._cls.__call__ = self._real


def _counts(rep):
    c = rep.calls
    return c.fused, c.reference, c.eager


def _step(model, seq, train=True, labels=True):
    ids = torch.randint(0, model.config.vocab_size, (2, seq), generator=torch.Generator().manual_seed(seq))
    model.train(train)
    with KernelLaunches() as launches, torch.set_grad_enabled(train):
        out = model(input_ids=ids, labels=ids if labels else None)
        if train and labels:
            out.loss.backward()
    return launches.n


def _kernels_off(monkeypatch):
    """As on a machine without a GPU: the ops see CPU tensors and no interpreter (new shapes from here
    on, so that no launch plan of an earlier call is reused)."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.mark.parametrize("feature, model_name, per_forward", [
    ("linear_cross_entropy", "llama-tiny", 1),   # one causal-LM forward
    ("moe_reorder", "qwen3-moe-tiny", 2),        # one experts call per MoE layer
])
def test_op_features_count_fused_then_reference(interpret, monkeypatch, feature, model_name, per_forward):
    """The loss and the MoE experts run our ops: fused while the kernels run, reference when the ops
    choose their torch references; an unpatched call is not counted as fused."""
    import warnings

    model = build_model(model_name, dtype=torch.float32)
    rep = patch_model(model, {feature: {"enabled": True}})[feature]
    assert rep.applied, rep
    assert _step(model, 8) > 0  # the kernels ran
    assert _counts(rep) == (per_forward, 0, 0)
    _kernels_off(monkeypatch)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the ops' one-time reference notices
        assert _step(model, 9) == 0  # no kernel ran
    assert _counts(rep) == (per_forward, per_forward, 0)
    if feature == "linear_cross_entropy":  # eval: the model's own head
        _step(model, 10, train=False)
        assert _counts(rep) == (per_forward, per_forward, 1)
    unpatch_model(model)


@pytest.mark.parametrize("feature, per_forward", [("rms_norm", 5), ("rope", 2)])
def test_module_features_count_fused_then_eager(interpret, monkeypatch, feature, per_forward):
    """RMSNorm and RoPE: fused while the kernels run; where they cannot take the input, the module's
    own code runs (eager), never counted as fused."""
    model = build_model("llama-tiny", dtype=torch.float32)
    rep = patch_model(model, {feature: {"enabled": True}})[feature]
    assert rep.applied, rep
    assert _step(model, 8) > 0
    assert _counts(rep) == (per_forward, 0, 0)
    _kernels_off(monkeypatch)
    with pytest.warns(RuntimeWarning, match="kernels need CUDA"):
        assert _step(model, 9) == 0
    assert _counts(rep) == (per_forward, 0, per_forward)
    unpatch_model(model)


def test_bf16_under_the_interpreter_runs_the_moe_references(interpret):
    """An input the kernels cannot take (bf16 under the interpreter, not exact there): reference."""
    import warnings

    model = build_model("qwen3-moe-tiny", dtype=torch.bfloat16)
    rep = patch_model(model, {"moe_reorder": {"enabled": True}})["moe_reorder"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        _step(model, 8, train=False)
    assert _counts(rep) == (0, 2, 0)
    unpatch_model(model)


def test_counting_reads_no_device_state(interpret):
    """The counting is a thread-local integer read around the op calls: the fused path's count does
    not depend on anything but the ops' own choice."""
    import threading

    from deepspeed_fused.ops._common import note_reference, reference_calls

    before = reference_calls()
    note_reference()
    assert reference_calls() == before + 1
    seen = []
    t = threading.Thread(target=lambda: seen.append(reference_calls()))
    t.start()
    t.join()
    assert seen == [0]  # per thread


LAYER_FEATURES = ("rms_norm", "rope", "mlp_act", "moe_reorder")


@pytest.mark.parametrize("model_name", ["llama-tiny", "qwen3-moe-tiny", "gemma3-tiny"])
def test_checkpoint_recomputation_is_counted(interpret, model_name):
    """Under activation checkpointing every layer's forward runs again in the backward, and each
    recomputed call is counted. Non-reentrant checkpointing ends a recomputation early, inside the
    op that saves the layer's last tensor (the MLP's down projection, the MoE combine, Gemma's
    closing norm): the calls around that op count as in a reentrant run, which recomputes whole."""
    cfg = {k: {"enabled": True} for k in ("rms_norm", "linear_cross_entropy", "rope", "mlp_act", "moe_reorder")}
    counts = {}
    for reentrant in (False, True):
        torch.manual_seed(0)
        model = build_model(model_name).float().train()
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        rep = patch_model(model, cfg)
        ids = torch.randint(0, model.config.vocab_size, (2, 16))
        with KernelLaunches() as launches:
            loss = model(input_ids=ids, labels=ids).loss
            forward = {f.name: f.calls.fused for f in rep.features if f.applied}
            loss.backward()
        after = {f.name: (f.calls.fused, f.calls.reference, f.calls.eager) for f in rep.features if f.applied}
        counts[reentrant] = (forward, after, launches.n)
        for name in LAYER_FEATURES:
            if name in after:  # each layer's calls once more in the backward, all of them fused
                outside = 1 if name == "rms_norm" else 0  # the final norm, after the layers
                assert after[name] == (2 * forward[name] - outside, 0, 0), (reentrant, name, forward, after)
        assert after["linear_cross_entropy"] == (1, 0, 0)  # the head is outside the layers
    # the same calls counted (and about the same kernels launched: the non-reentrant run skips the
    # ops after the region's last saved tensor)
    assert counts[False][:2] == counts[True][:2], counts
    assert 0 < counts[False][2] <= counts[True][2]
