"""The Triton kernels of the fused linear cross-entropy, one kernel family per module:

* :mod:`.row`: the row kernel (the math: partial statistics and ``dL/dlogits`` of a logits chunk);
* :mod:`.gemm`: the Hopper fused GEMMs (the logits GEMM with the row kernel's math in its epilogue);
* :mod:`.scale`: the in-place scaling of forward-formed gradients by the upstream gradient.

Their launches are in :mod:`..launch`. The kernels are defined when these modules are imported, so
``TRITON_INTERPRET`` must be set before (tests/conftest.py does).
"""
