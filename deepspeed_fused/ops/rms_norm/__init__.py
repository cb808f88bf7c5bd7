"""Fused RMSNorm in the Hugging Face Llama form, with eager's rounding points.

The Llama-form module computes ``weight * (x.float() * rsqrt(mean(x.float()**2) + eps)).to(x.dtype)``:
FP32 statistics, one rounding of the normalized value to the input dtype, then the multiply by
the weight in the promoted dtype (an FP32 weight with bf16 input gives an FP32 output). The
kernels reproduce those rounding points (``rstd`` itself is formed in FP64 from the row's sum of
squares and rounded once, where eager rounds the mean and then takes an approximate ``rsqrt``)
and the ones eager autograd applies in the backward:

* ``g = dy * w`` is formed in the output dtype and rounded to the input dtype (the gradient of
  the rounded normalized value), then the input gradient is FP32 math on ``g``;
* the weight-gradient product ``dy * normalized`` is rounded to the output dtype before its FP32
  sum over rows, and the sum is rounded to the weight dtype.

Kernels: a forward over ``[BLOCK_R, BLOCK_N]`` tiles (many rows per program for narrow widths,
one row per program for wide ones, looping over column blocks when a row does not fit one
block), and a persistent backward (a bounded grid; each program walks row tiles, writes ``dx``
and keeps its own FP32 weight-gradient partial, stored as its row of a per-stream workspace).
The partials are summed in a fixed order, so results are bitwise repeatable: in the backward's
own launch by its last programs (two levels: per group, then the groups) where that tail is
short, else by a second launch over column strips. Launch plans (configs, grids, compiled
kernels) are cached per shape/stride/dtype/alignment key: a repeated call builds its key,
allocates its outputs and launches through the compiled kernel's C launcher. On CUDA, once a
key with contiguous, aligned inputs has launched its forward and backward (contiguous incoming
gradient) directly, its calls that need a backward go through a C++ autograd node
(``native.py``) that makes the same two launches with no Python in the forward's node or in
the backward (strided rows keep the Python node). Rows may be
strided (last dim contiguous, leading dims collapsing to at most three strided groups, e.g. a
slice of a fused QKV projection viewed as ``[B, S, heads, head_dim]``): no copy is made for them.

The other forms of transformers' RMSNorms (:class:`RMSForm`, :data:`FORMS`: Gemma's ``1 + w``, the
weight multiplied before the cast, T5's, unweighted, gated by ``act(gate)`` after the weight or
before the statistics) run :func:`fused_rms_norm_form`: one more kernel family with the form's
rounding points as constexprs, the same tiling, plans, fast closures and C++ node. With
``group_size`` the statistics are taken over groups of that many columns while the weight spans the
row (Mamba2's gated norm, Falcon-H1's, Qwen4's grouped norm): the kernels see rows of one group each,
row ``r`` taking weight row ``r % (N / group_size)``, and the weight gradient is summed over the
whole width as before.

Files (the kernels know nothing of the plans, the plans nothing of autograd):

* ``kernels.py``: the Triton kernels (one kernel family: the Llama form's and the other forms');
* ``reference.py``: :class:`RMSForm`, :data:`FORMS`, the output dtypes and the PyTorch references;
* ``plans.py``: tuning knobs, configs and grids, the backward's workspace, the named records of
  keys and launch plans, and ``PLANS``, the one object holding every cache (``clear_plans``);
* ``launch.py``: the forward and backward launches from a plan, and the fast closures;
* ``native.py`` (with ``ops/csrc/rms_norm_node.cpp``): the C++ autograd node, its build and the
  hand-over of launch plans to it;
* ``checks.py``: argument checks and whether the kernels take the inputs.
* ``api.py``: the custom ops, the autograd Functions and the public functions.
"""
from __future__ import annotations

from . import api, checks, kernels, launch, native, plans, reference  # noqa: F401  (the parts, for tests and benchmarks)
from .api import (fused_rms_norm, fused_rms_norm_form, rms_norm_form_kernel_ok, rms_norm_kernel_ok,
                  try_fused_rms_norm, try_fused_rms_norm_form)
from .plans import PLANS, clear_plans
from .reference import (FORMS, LLAMA, RMSForm, form_output_dtype, output_dtype, rms_norm_form_reference,
                        rms_norm_reference)

__all__ = ["fused_rms_norm", "try_fused_rms_norm", "rms_norm_reference", "rms_norm_kernel_ok", "output_dtype",
           "RMSForm", "FORMS", "fused_rms_norm_form", "try_fused_rms_norm_form", "rms_norm_form_reference",
           "form_output_dtype", "rms_norm_form_kernel_ok", "LLAMA", "PLANS", "clear_plans"]
