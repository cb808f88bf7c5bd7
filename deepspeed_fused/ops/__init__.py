"""The fused ops. Each module holds Triton kernels, autograd and a plain torch reference."""
