"""The ops of the ``moe_reorder`` feature: the MoE token reorder as Triton row gathers.

A MoE layer moves token rows into an expert-major buffer and back. All of it is done with one
kind of kernel, a padded row gather (``out[i] = src[index[i]]``, a zero row where the index is
padding), whose backward is again a gather: no scatter-add, no atomics. One module per part:

* :mod:`.kernels`: the Triton kernels (one family: gather, combine, combine backward, route
  maps, and the expert sort that builds route maps from expert ids);
* :mod:`.launch`: their launches (the only way the other modules start them);
* :mod:`.checks`: argument checks and where the kernels run (:func:`kernels_take`);
* :mod:`.reference`: the torch references (the eager formulations) and :class:`RouteMaps`;
* :mod:`.api`: the reorder's own autograd Functions, custom ops and public functions: DeepSpeed
  AutoEP's padded permute and its inverse (:func:`permute_rows`, :func:`unpermute_rows`,
  :func:`inverse_permutation`, :func:`validate_permutation`); the sub-ops below each keep their
  kernel, its launch, autograd and custom ops in their own module;
* :mod:`.route`: the routed dispatch and combine of a top-k layer (:func:`route_maps`,
  :func:`route_dispatch`, :func:`route_combine`), the one API of both integrations, and
  :func:`route_sort` (expert ids -> expert order, route maps and grouped GEMM offsets);
* :mod:`.router`: a top-k softmax router's selection from its logits (:func:`topk_softmax`:
  softmax, top-k, renormalisation, cast) and DeepSeek-V3's grouped sigmoid selection
  (:func:`group_topk_sigmoid`), and the routers that take the top-k of the logits before their
  softmax (:func:`topk_logits_softmax`: GPT-OSS, Aria, Cohere2-MoE), one kernel forward and one
  backward each;
* :mod:`.swiglu`: the experts' gated activation ``silu(gate) * up`` of a gate-up projection
  (:func:`swiglu`) and GPT-OSS's clamped gate (:func:`oai_gate`), one kernel forward and one
  backward each, with eager's rounding;
* :mod:`.expert_bias`: a per-expert bias on expert-sorted rows (:func:`expert_bias`: one kernel
  forward, the bias's gradient a segmented FP32 sum of each expert's rows, no index-put).

The kernels run on CUDA tensors (and on CPU tensors under ``TRITON_INTERPRET=1``); anything
else runs the torch reference with one warning per reason. Index validity is not checked on
the hot path (that would need a host sync); ``validate=True`` checks it. Eager calls run
autograd Functions, ``torch.compile`` traces custom ops (``deepspeed_fused::moe_*``) over the
same kernels. This module is the public API.
"""
from .checks import kernels_take
from .expert_bias import expert_bias, expert_bias_reference
from .api import inverse_permutation, permute_rows, permute_rows_with_inverse, unpermute_rows, validate_permutation
from .reference import (RouteMaps, RouteSort, combine_reference, permute_rows_reference, route_combine_reference,
                        route_dispatch_reference, route_maps_reference, route_sort_reference,
                        unpermute_rows_reference)
from .route import route_combine, route_dispatch, route_maps, route_sort
from .router import (group_topk_sigmoid, group_topk_sigmoid_reference, topk_logits_softmax,
                     topk_logits_softmax_reference, topk_softmax, topk_softmax_reference)
from .swiglu import oai_gate, oai_gate_reference, swiglu, swiglu_reference

__all__ = [
    "permute_rows", "unpermute_rows", "permute_rows_with_inverse", "inverse_permutation", "validate_permutation",
    "RouteMaps", "route_maps", "route_dispatch", "route_combine", "RouteSort", "route_sort", "kernels_take",
    "permute_rows_reference", "unpermute_rows_reference", "route_maps_reference", "route_dispatch_reference",
    "route_combine_reference", "combine_reference", "route_sort_reference", "swiglu", "swiglu_reference",
    "oai_gate", "oai_gate_reference",
    "topk_softmax", "topk_softmax_reference", "group_topk_sigmoid", "group_topk_sigmoid_reference",
    "topk_logits_softmax", "topk_logits_softmax_reference", "expert_bias", "expert_bias_reference",
]
