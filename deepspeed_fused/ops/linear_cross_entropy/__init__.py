"""Fused linear cross-entropy: ``loss = CE(hidden @ weight.T + bias, target)`` without the logits.

The tokens are processed in chunks. Per chunk, cuBLAS writes the chunk's logits into one
reused workspace (``chunk_tokens x V`` in the input dtype, <= 480 MiB by default), and one
Triton kernel walks each row once in fp32: online max / sum-of-exp, the target logit, the
entropy term and the label-smoothing sum. Nothing of size ``tokens x V`` is ever allocated.

The package, one module per part (each imports only those above it in this list):

* :mod:`.kernels`: the Triton row kernel (the math) and its launch helper.
* :mod:`.stats`: per-token partial statistics: merge over vocabulary shards, finalize into
  loss / lse / entropy, pack the returned value.
* :mod:`.single`: the single-GPU chunk drivers, the ``deepspeed_fused::lce_*`` custom ops and
  the eager autograd function (the two gradient strategies).
* :mod:`.parallel`: the vocabulary-parallel (``tp_group``) and sequence-parallel forms.
* :mod:`.checks`: argument checks and input flattening.
* :mod:`.reference`: the plain torch reference and the token chunk sizing.
* :mod:`.api`: :func:`linear_cross_entropy`, the entry point that dispatches to the above.

This module re-exports the public API: :func:`linear_cross_entropy`,
:func:`linear_cross_entropy_reference`, :func:`merge_partial_stats`, and
:func:`auto_chunk_tokens` with its default budget ``DEFAULT_WORKSPACE_BYTES``.
"""
from .api import linear_cross_entropy
from .reference import linear_cross_entropy_reference
from .sizing import DEFAULT_WORKSPACE_BYTES, auto_chunk_tokens
from .stats import merge_partial_stats

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "merge_partial_stats"]
