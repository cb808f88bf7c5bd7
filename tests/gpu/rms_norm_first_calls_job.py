"""Run by tests/gpu/test_rms_norm_first_calls_gpu.py in a fresh process: the first calls of the fused
RMSNorm (forward + backward, one shape) timed one by one, as the process's first CUDA work; writes
the per-call times (ms) and whether the C++ node was built by the end as JSON."""
import argparse
import json
import os
import sys
import time

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")]

import torch  # noqa: E402

from deepspeed_fused.ops import rms_norm as R  # noqa: E402
from deepspeed_fused.ops.rms_norm import native as _native  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--calls", type=int, default=300)
    p.add_argument("--rows", type=int, default=8192)
    p.add_argument("--cols", type=int, default=2048)
    a = p.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(a.rows, a.cols, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_()
    w = (1 + 0.1 * torch.randn(a.cols, device="cuda", generator=gen)).to(torch.bfloat16).requires_grad_()
    dy = torch.randn(a.rows, a.cols, device="cuda", dtype=torch.bfloat16, generator=gen)
    torch.cuda.synchronize()
    times, nodes = [], []
    for _ in range(a.calls):
        t0 = time.perf_counter()
        y = R.fused_rms_norm(x, w, 1e-6)
        y.backward(dy)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        nodes.append(y.grad_fn.name())
        x.grad = w.grad = None
    built = _native._state["mod"] is not None
    building = _native.building()
    t = _native._state["thread"]
    if t is not None:  # the build done (never leave torch's build lock behind), then three more calls
        t.join()
    after = []
    for _ in range(3):
        y = R.fused_rms_norm(x, w, 1e-6)
        y.backward(dy)
        after.append(y.grad_fn.name())
    torch.cuda.synchronize()
    with open(a.out, "w") as f:
        json.dump({"ms": times, "nodes": nodes, "built_during": built, "building_at_end": building,
                   "built": _native._state["mod"] is not None, "error": _native.error(), "after": after}, f)


if __name__ == "__main__":
    main()
