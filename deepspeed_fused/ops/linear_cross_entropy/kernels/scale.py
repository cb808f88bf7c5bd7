"""The in-place scaling of the scalar loss's forward-formed gradients by the upstream gradient:
``_scale_unless_one_kernel`` reads and writes nothing when the upstream gradient is 1, without a
host sync to find out (ignored rows and gated tensors left as formed). Launched by
:func:`..launch._scale_unless_one_`; :func:`..launch._scale_masked_torch_` is the same in torch ops.
"""
from ..._common import HAS_TRITON, tl, triton


if HAS_TRITON:

    @triton.jit
    def _scale_unless_one_kernel(x_ptr, n, g_ptr, gate_ptr, tgt_ptr, ignore_index,
                                 GATE: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        # x *= g in place, the product in fp32 with g as given (fp32) and one rounding, unless
        # g == 1: then no program reads or writes x. g is read on the device, so the host never
        # waits for it. ROWS: program (r, j) takes block j of row r (n elements a row), left as
        # it is where the row's target is ignore_index. GATE: nothing is scaled where the flag at
        # gate_ptr is 0.
        g = tl.load(g_ptr).to(tl.float32)
        go = g != 1.0
        if GATE:
            go = go & (tl.load(gate_ptr) != 0)
        base = 0
        if ROWS:
            row = tl.program_id(0).to(tl.int64)
            go = go & (tl.load(tgt_ptr + row) != ignore_index)
            base = row * n
            blk = tl.program_id(1).to(tl.int64)
        else:
            blk = tl.program_id(0).to(tl.int64)
        if go:
            offs = blk * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            x = tl.load(x_ptr + base + offs, mask=mask, other=0.0)
            tl.store(x_ptr + base + offs, (x.to(tl.float32) * g).to(x_ptr.dtype.element_ty), mask=mask)
