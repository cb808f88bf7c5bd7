"""Fused rotary position embedding (RoPE), forward and backward, with eager's rounding points.

One kernel applies the rotation to q and k in one launch (and a second launch of it, with the
transposed rotation, gives both gradients). What it computes is described by a
:class:`RopeSpec`, which covers the Hugging Face ``apply_rotary_pos_emb`` spellings. Outputs equal
eager's element for element (as ``torch.equal`` compares: ``-0.0`` and ``+0.0`` are not told
apart).

Parts:

* ``spec``: :class:`RopeSpec` (pairing, angles, output placement, rounding dtypes), ``LLAMA``;
* ``reference``: :func:`rope_reference`, the plain torch form;
* ``kernels``: the Triton kernel;
* ``checks``: input validation (:class:`RopeInputError` for inputs eager rejects, a reason for
  inputs only the reference takes) and each tensor's row geometry;
* ``launch``: cached launch plans, the launches, the tuning knobs;
* ``api``: :func:`fused_rope`, :func:`try_fused_rope`, :func:`rope_kernel_ok`, the autograd
  Function and the custom ops ``deepspeed_fused::rope_fwd`` / ``rope_bwd``.
"""
from .api import fused_rope, rope_kernel_ok, try_fused_rope
from .checks import RopeInputError
from .launch import clear_plans
from .reference import rope_reference
from .spec import LLAMA, RopeSpec, compute_dtype, output_dtype

__all__ = ["RopeSpec", "LLAMA", "fused_rope", "try_fused_rope", "rope_reference", "rope_kernel_ok", "output_dtype",
           "RopeInputError", "compute_dtype", "clear_plans"]
