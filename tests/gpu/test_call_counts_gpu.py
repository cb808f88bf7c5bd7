"""The call counts on the GPU: a bf16 model counts fused (the kernels ran), a float64 model (a
dtype no kernel takes) counts reference for the loss and the MoE layers (their ops' torch
references) and eager for RMSNorm and RoPE (the modules' own code). Each body runs in a clean
worker (tests/conftest.py)."""
from __future__ import annotations

import warnings

import pytest
import torch

from deepspeed_fused import patch_model, unpatch_model
from tiny_models import build_model

pytestmark = pytest.mark.gpu

ALL = {f: {"enabled": True} for f in ("rms_norm", "linear_cross_entropy", "moe_reorder", "rope")}
PER_FORWARD = {"rms_norm": 9, "linear_cross_entropy": 1, "moe_reorder": 2, "rope": 2}  # qwen3-moe-tiny


def _step(model):
    ids = torch.randint(0, model.config.vocab_size, (2, 64), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(0))
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    torch.cuda.synchronize()


def _counts(report):
    return {f.name: (f.calls.fused, f.calls.reference, f.calls.eager) for f in report.features if f.applied}


def test_bf16_counts_fused():
    model = build_model("qwen3-moe-tiny", dtype=torch.bfloat16).cuda()
    report = patch_model(model, ALL)
    assert report.applied == list(ALL), str(report)
    _step(model)
    _step(model)
    assert _counts(report) == {f: (2 * n, 0, 0) for f, n in PER_FORWARD.items()}, str(report)
    unpatch_model(model)


def test_float64_counts_reference_or_eager():
    model = build_model("qwen3-moe-tiny", dtype=torch.float64).cuda()
    report = patch_model(model, ALL)
    assert report.applied == list(ALL), str(report)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the one-time notices of each fallback
        _step(model)
    n = PER_FORWARD
    assert _counts(report) == {"rms_norm": (0, 0, n["rms_norm"]), "linear_cross_entropy": (0, 1, 0),
                               "moe_reorder": (0, n["moe_reorder"], 0), "rope": (0, 0, n["rope"])}, str(report)
    unpatch_model(model)
