"""Fused linear cross-entropy: ``loss = CE(hidden @ weight.T + bias, target)`` without the logits.

The tokens are processed in chunks. Per chunk, cuBLAS writes the chunk's logits into one
reused workspace (``chunk_tokens x V`` in the input dtype, <= 480 MiB by default), and one
Triton kernel walks each row once in fp32: online max / sum-of-exp, the target logit, the
entropy term and the label-smoothing sum. Nothing of size ``tokens x V`` is ever allocated.

The package, one module per part; each imports only modules listed above it:

* :mod:`.options`: the call's options as one frozen record (:class:`~.options.LCEOptions`), and
  the flattening of its loss part for the custom ops.
* :mod:`.kernels`: the Triton kernels, one family per module: :mod:`.kernels.row` (the row kernel,
  the math), :mod:`.kernels.gemm` (the Hopper fused GEMMs: the logits GEMM with the row kernel's
  statistics or gradient in its epilogue), :mod:`.kernels.scale` (the in-place scaling of
  forward-formed gradients by the upstream gradient).
* :mod:`.launch`: the kernels' configurations, support checks and launches.
* :mod:`.stats`: per-token partial statistics: merge over vocabulary shards, finalize into
  loss / lse / entropy, pack the returned value.
* :mod:`.sizing`: chunk sizing for every path (token and vocabulary chunks, the reference's).
* :mod:`.chunks`: the chunk loops shared by the single-GPU and TP forms (workspace, cuBLAS
  GEMMs, row-kernel and fused-GEMM passes, the per-token backward over vocabulary chunks).
* :mod:`.single`: the single-GPU passes, the ``deepspeed_fused::lce_*`` custom ops and the eager
  autograd function (the two gradient strategies); :func:`.single.run_single`.
* :mod:`.group`: the tensor-parallel group: setup, layout exchange and checks, collectives,
  sequence parallelism (shared by the TP form and the reference over a group).
* :mod:`.checks`: argument checks, building the options record, input flattening.
* :mod:`.parallel`: the vocabulary-parallel (``tp_group``) form; :func:`.parallel.run_tp`.
* :mod:`.reference`: the plain torch reference (:func:`.reference.run_reference` on checked inputs).
* :mod:`.api`: :func:`linear_cross_entropy`, the entry point: checks once, then one of the three.

This module re-exports the public API: :func:`linear_cross_entropy`,
:func:`linear_cross_entropy_reference`, :func:`merge_partial_stats`, and
:func:`auto_chunk_tokens` with its default budget ``DEFAULT_WORKSPACE_BYTES``.
"""
from .api import linear_cross_entropy
from .reference import linear_cross_entropy_reference
from .sizing import DEFAULT_WORKSPACE_BYTES, auto_chunk_tokens
from .stats import merge_partial_stats

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "merge_partial_stats"]
