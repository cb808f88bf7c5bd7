"""The ``grad_norm`` op: the L2 norm of each tensor of a list, accumulated in float64.

DeepSpeed's ZeRO-1/2 optimizer measures the gradients' global norm every step (for clipping and
for the logged norm) as ``torch.linalg.vector_norm(g.to(torch.float64))`` per gradient: each
gradient is first copied to float64 (four times its bf16 size written, then read again), one pair
of launches per gradient. Here one kernel reads every tensor of the list once, in its own dtype,
and adds the squares in float64 (the square of a float16, bfloat16 or float32 value is exact in
float64, so only the order of the additions differs from torch's); a second kernel adds each
tensor's partial sums in a fixed order, so a result does not change from run to run.

One module per part: :mod:`.kernels` (Triton), :mod:`.launch` (the chunk tables, cached per list
of tensors), :mod:`.reference` (torch), :mod:`.checks` (arguments, which tensors the kernels take),
:mod:`.api` (:func:`tensor_norms`, custom op ``deepspeed_fused::tensor_norms``). Contiguous float16,
bfloat16 and float32 tensors on a CUDA device (CPU ones under ``TRITON_INTERPRET=1``) run the
kernels; any other tensor its torch reference, with one warning per reason.
"""
from .api import tensor_norms
from .checks import kernels_take
from .reference import tensor_norms_reference

__all__ = ["tensor_norms", "tensor_norms_reference", "kernels_take"]
