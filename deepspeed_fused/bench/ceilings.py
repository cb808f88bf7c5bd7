"""Suite ``ceilings``: bf16 GEMM TFLOP/s and device copy TB/s measured on this machine.

These are the denominators of every efficiency figure in the other suites.
"""
from __future__ import annotations

import torch

from .common import measure

SUITE = "ceilings"


def run(args) -> list:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    small = dev == "cpu"
    recs = []
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    for n in ([256] if small else [4096, 8192]):
        a = torch.randn(n, n, device=dev, dtype=dt)
        b = torch.randn(n, n, device=dev, dtype=dt)
        c = torch.empty(n, n, device=dev, dtype=dt)
        recs.append(measure(SUITE, "cuBLAS GEMM" if dev == "cuda" else "torch.mm", f"GEMM {n}^3", dt,
                            fwd=lambda: torch.mm(a, b, out=c), flops_fwd=2 * n ** 3))
    for mib in ([4] if small else [256, 1024]):
        numel = mib * 2**20 // 2
        x = torch.randn(numel, device=dev, dtype=torch.bfloat16)
        y = torch.empty_like(x)
        r = measure(SUITE, "device copy", f"copy {mib} MiB", torch.bfloat16, fwd=lambda: y.copy_(x),
                    bytes_fwd=2 * x.numel() * x.element_size())
        recs.append(r)
    return recs
