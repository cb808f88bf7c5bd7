"""The fused ops. Each module holds Triton kernels, autograd and a plain torch reference
(``linear_cross_entropy`` is a package with one module per part)."""
