"""Non-finite inputs on CUDA, op by op, against eager in bf16, fp16 and fp32 (the CPU suite,
tests/unit/test_nonfinite.py, runs the same checks under the interpreter with the GPU's NaN rule of
tl.maximum/tl.minimum; here the compiled kernels): NaN and infinities in the outputs and gradients
exactly where eager's are. Routers against eager with equal values ordered lower index first, and
the values CUDA's own torch.topk selects; a tiny Qwen3-MoE with a NaN row in its hidden states."""
import pytest
import torch

from unit import test_nonfinite as T
from deepspeed_fused.ops import rms_norm as RN

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,renorm,out", [(1, False, None), (3, True, None), (2, True, "half"), (8, False, None)])
def test_topk_softmax_nonfinite_rows_gpu(dtype, k, renorm, out):
    T.test_topk_softmax_nonfinite_rows("cuda", dtype, k, renorm, out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,sd,out", [(1, None, None), (2, None, None), (4, torch.float32, torch.float16),
                                      (8, None, None)])
def test_topk_logits_softmax_nonfinite_rows_gpu(dtype, k, sd, out):
    T.test_topk_logits_softmax_nonfinite_rows("cuda", dtype, k, sd, out)


@pytest.mark.parametrize("G,TG,k,renorm,scale", [(1, 1, 2, True, 1.0), (4, 2, 3, True, 2.5), (4, 1, 2, False, 1.0),
                                                 (2, 2, 8, True, 1.0)])
def test_group_topk_sigmoid_nonfinite_rows_gpu(G, TG, k, renorm, scale):
    T.test_group_topk_sigmoid_nonfinite_rows("cuda", G, TG, k, renorm, scale)


@pytest.mark.parametrize("E", [64, 128, 256])
def test_router_nonfinite_rows_many_experts_gpu(E):
    # wider rows (one program's tile of 64 to 256 experts), NaN (either sign) and infinities scattered
    x = T.many_expert_logits(E)
    for dtype in DTYPES:
        logits = x.to(dtype).cuda()
        ids = T._check_router(T.mr.topk_softmax, T.mr.topk_softmax_reference, logits, 8, (True, None), None)
        T._same_values_as_topk(torch.softmax(logits.float(), -1), ids, 8)
        ids = T._check_router(T.mr.topk_logits_softmax, T.mr.topk_logits_softmax_reference, logits, 4, (None, None),
                              None)
        T._same_values_as_topk(logits, ids, 4)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gate", ["swiglu", "oai"])
def test_gates_nonfinite_gpu(dtype, gate):
    T.test_gates_nonfinite("cuda", dtype, gate)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gathers_and_combine_nonfinite_gpu(dtype):
    T.test_gathers_and_combine_nonfinite("cuda", dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_kind", [None, "nan", "inf"])
def test_rms_norm_llama_nonfinite_gpu(dtype, weight_kind):
    T.test_rms_norm_llama_nonfinite("cuda", dtype, weight_kind)


@pytest.mark.parametrize("form", sorted(n for n in RN.FORMS if n != "llama"))
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_forms_nonfinite_gpu(form, dtype):
    T.test_rms_norm_forms_nonfinite("cuda", form, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", [T.RP.RopeSpec(), T.RP.RopeSpec(pairing="adjacent"), T.RP.RopeSpec(partial=True)])
def test_rope_nonfinite_gpu(dtype, spec):
    T.test_rope_nonfinite("cuda", dtype, spec)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", T.LCE_CASES)
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("path", ["fused_gemm", "row_kernel"])
def test_linear_cross_entropy_nonfinite_gpu(dtype, case, with_bias, path, monkeypatch):
    T.test_linear_cross_entropy_nonfinite("cuda", dtype, case, with_bias, path, monkeypatch)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("row", [5, 11])
def test_qwen3_moe_nan_row_masks_match_unpatched_gpu(row, dtype):
    T.test_qwen3_moe_nan_row_masks_match_unpatched("cuda", row, dtype)
