"""Launches of the gated-activation kernels on ``[rows, I]`` views: the tile, the grid, the
outputs. Every layout goes through :func:`forward_rows` and :func:`backward_rows`: two separate
tensors, or the two halves of one gate-up projection (gate first or up first).

The kernels number their programs with the column block fastest, so the programs the GPU runs
together sweep memory in order (a grid with the rows fastest puts them a row apart, each reading a
few KiB of a different row). Where every tensor of a launch is row-contiguous (two separate
tensors, the usual case) the launch is one row of ``rows * I`` elements in blocks of
:data:`FLAT_BLOCK_FWD` (forward) or :data:`FLAT_BLOCK_BWD` (backward) over :data:`FLAT_WARPS` warps,
the shape of a flat elementwise kernel (DeepSpeed's Triton swiglu, torch.compile's pointwise
kernels): no masked lanes but in the last block. The two halves of a gate-up projection
(rows ``2 I`` apart) take the experts' tile (:data:`TILE`) in the same order."""
from __future__ import annotations

from typing import Optional

import torch

from .._common import cdiv, next_power_of_2, warn_fallback
from .kernels import ACT_CODES, SILU_PACKS

# Tiles: (outputs per program, widest column block), the experts' gate's (an H100 sweep,
# 2026-12-05, bf16: 2048 outputs per program served widths 768 to 14336).
TILE = (2048, 2048)


# Flat launches (an H100 sweep, 2026-12-06, bf16, 8192-16384 tokens x 6144-9728 columns): the
# forward's two reads and one write ran 2-4% faster in blocks of 4096 (16 elements a thread, two
# 16-byte accesses per tensor) than of 2048; the backward's five tensors ran fastest at 2048 (by
# 0.3%); 16 warps were slower for either.
FLAT_BLOCK_FWD, FLAT_BLOCK_BWD, FLAT_WARPS = 4096, 2048, 8


def tile(n_rows: int, inter: int, sizes: tuple = TILE) -> tuple:
    """(grid, constexprs, warps) of a ``[n_rows, inter]`` launch."""
    outputs, widest = sizes
    block_c = min(widest, next_power_of_2(max(inter, 1)))
    block_r = max(1, min(outputs // block_c, next_power_of_2(max(n_rows, 1))))
    grid = (cdiv(n_rows, block_r), cdiv(inter, block_c))
    return grid, dict(BLOCK_R=block_r, BLOCK_C=block_c), 4 if block_r * block_c >= 1024 else 2


def plan(n_rows: int, inter: int, *tensors: torch.Tensor, flat_block: int = FLAT_BLOCK_BWD) -> tuple:
    """(scalars, grid, constexprs, warps) of a launch of the gated kernels over ``tensors``
    (``[n_rows, inter]`` views, unit column stride); scalars: rows, width, column blocks, then each
    tensor's row stride. One row of ``n_rows * inter`` where each tensor is row-contiguous (or
    there is one row; its strides passed as 0, so the JIT knows every row offset 16-aligned), in
    blocks of ``flat_block`` (``FLAT``: the program is the column block), else the rows as they are;
    a 1-D grid, the column block fastest."""
    if n_rows == 1 or all(t.stride(0) == inter for t in tensors):
        n_rows, inter, strides = 1, n_rows * inter, (0,) * len(tensors)
        block = min(flat_block, next_power_of_2(inter))
        const, warps = dict(BLOCK_R=1, BLOCK_C=block, FLAT=True), max(1, min(FLAT_WARPS, block // 256))
    else:
        strides = tuple(t.stride(0) for t in tensors)
        _, const, warps = tile(n_rows, inter)
        const = dict(const, FLAT=False)
    n_cb = cdiv(inter, const["BLOCK_C"])
    return (n_rows, inter, n_cb) + strides, (cdiv(n_rows, const["BLOCK_R"]) * n_cb,), const, warps


def rows2d(t: torch.Tensor) -> torch.Tensor:
    """``t`` as ``[rows, width]`` with unit column stride (a copy only where that needs one)."""
    t2 = t.reshape(-1, t.shape[-1])
    if t2.stride(-1) != 1 or (t2.shape[0] > 1 and t2.stride(0) < t2.shape[1]):
        t2 = t2.contiguous()
    return t2


def halves(gate_up2: torch.Tensor, gate_first: bool) -> tuple:
    """(gate, up) ``[rows, I]`` views of a ``[rows, 2 I]`` gate-up projection."""
    inter = gate_up2.shape[1] // 2
    a, b = gate_up2[:, :inter], gate_up2[:, inter:]
    return (a, b) if gate_first else (b, a)


def forward_rows(g: torch.Tensor, u: torch.Tensor, act: str, exact_exp: bool = True,
                 fast_silu: Optional[bool] = None) -> torch.Tensor:
    """``act(g) * u`` of two ``[rows, I]`` views (unit column stride) into a fresh ``[rows, I]``.
    ``fast_silu``: the SiLU forward's fast path for bf16 / fp16 (see :func:`fast_silu_ok`; None:
    where :data:`FAST_SILU` is on and this device's probe found it exact)."""
    from .kernels import launch_forward

    if fast_silu is None:
        fast_silu = exact_exp and act == "silu" and fast_silu_ok(g)
    fast = bool(fast_silu) and act == "silu" and g.dtype in _HALF
    h = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    if h.numel():
        scalars, grid, const, warps = plan(*g.shape, g, u, h, flat_block=FLAT_BLOCK_FWD)
        pack = silu_pack(const["BLOCK_R"] * const["BLOCK_C"], warps) if fast else 1
        launch_forward(grid, (g, u, h) + scalars,
                       dict(ACT=ACT_CODES[act], EXACT_EXP=exact_exp, FAST_SILU=fast, SILU_PACK=pack, **const), warps)
    return h


# The fast path's group: the elements of a lane whose approximations run side by side before one
# branch to the exact value (kernels.silu_select_ptx). One element a group puts 16 dependent
# ex2 / rcp chains and 16 branches in a row per lane at 4096-element blocks; four a group compile
# to 15.9 instructions an element against 18.1 (bf16, SASS for an H100; the same device time on an
# H100, 2026-12-08, where the forward is at the memory's rate either way).
SILU_PACK = 4


def silu_pack(block: int, warps: int) -> int:
    """The group size of a forward launch of ``block`` elements over ``warps`` warps: :data:`SILU_PACK`,
    or fewer where a lane holds fewer elements (a power of two, so it divides the lane's count)."""
    per_lane = max(1, block // (32 * warps))
    return max(n for n in SILU_PACKS if n <= min(SILU_PACK, per_lane))


# The SiLU forward's fast path (kernels.silu_select_ptx): its activation of every bf16 / fp16 gate
# value is the exact one's by construction, and a probe checks it on each device before it is taken.
# Off by default: on an H100 (2026-12-08) the forward is at the memory's rate with or without it
# (docs/mlp_act.md); True takes it wherever the device's probe passes.
FAST_SILU = False
_HALF = (torch.bfloat16, torch.float16)
_FAST_SILU_PROBES: dict = {}  # (CUDA device index, dtype) -> whether every activation came out equal


def fast_silu_ok(g: torch.Tensor) -> bool:
    """Whether the SiLU forward of ``g`` (bf16 or fp16, on a GPU) may take the fast path: on each
    device and dtype once, a probe runs both forwards over every one of the 65536 bit patterns of
    the gate and compares the outputs bit for bit (NaN with NaN); a difference, or a kernel that does
    not build, leaves the exact forward there, with one warning. Not probed while a CUDA graph is
    being captured (the exact forward runs then)."""
    if not FAST_SILU or g.dtype not in _HALF or not g.is_cuda:
        return False
    key = (g.device.index, g.dtype)
    ok = _FAST_SILU_PROBES.get(key)
    if ok is None:
        if torch.cuda.is_current_stream_capturing():
            return False
        ok = _FAST_SILU_PROBES[key] = _probe_fast_silu(g.device, g.dtype)
    return ok


def every_half_value(dtype: torch.dtype, device) -> torch.Tensor:
    """All 65536 bit patterns of a 16-bit float dtype, as a ``[256, 256]`` tensor."""
    return torch.arange(-32768, 32768, dtype=torch.int32, device=device).to(torch.int16).view(dtype).view(256, 256)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise: ``a`` and ``b`` hold the same bits, or both a NaN."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return (a.view(ints) == b.view(ints)) | (a.isnan() & b.isnan())


def _probe_fast_silu(device: torch.device, dtype: torch.dtype) -> bool:
    g = every_half_value(dtype, device)
    u = torch.ones_like(g)
    try:
        exact = forward_rows(g, u, "silu", fast_silu=False)
        fast = forward_rows(g, u, "silu", fast_silu=True)
        n_diff = int((~same_bits(exact, fast)).sum())  # the one host synchronisation
    except Exception as e:  # noqa: BLE001 - a PTX this device or driver does not take: the exact forward
        warn_fallback("mlp_act", f"the SiLU forward's fast path was not probed on {device} ({type(e).__name__}: "
                      f"{str(e)[:200]}); the exact forward runs there", reference=False)
        return False
    if n_diff:
        warn_fallback("mlp_act", f"the SiLU forward's fast path differs from the exact one on {n_diff} of 65536 "
                      f"{dtype} inputs on {device}; the exact forward runs there", reference=False)
    return n_diff == 0


def backward_rows(g: torch.Tensor, u: torch.Tensor, dh: torch.Tensor, dg: torch.Tensor, du: torch.Tensor, act: str,
                  exact_exp: bool = True) -> None:
    """The gradients of ``act(g) * u`` for ``dh`` (``[rows, I]`` each), written into ``dg`` and
    ``du`` (views of one buffer or two)."""
    from .kernels import launch_backward

    if g.numel():
        scalars, grid, const, warps = plan(*g.shape, g, u, dh, dg, du, flat_block=FLAT_BLOCK_BWD)
        launch_backward(grid, (g, u, dh, dg, du) + scalars, dict(ACT=ACT_CODES[act], EXACT_EXP=exact_exp, **const),
                        warps)


def split_forward(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    h = forward_rows(rows2d(gate), rows2d(up), act)
    return h.view(gate.shape)


def split_backward(gate: torch.Tensor, up: torch.Tensor, dh: torch.Tensor, act: str, in_place: bool = False) -> tuple:
    """The gradients of ``act(gate) * up``; ``in_place``: written over ``gate`` and ``up`` (each
    element read before it is written, by the same program) where both are views the kernel can
    write without a copy and do not share memory, else into fresh tensors."""
    g, u, d = rows2d(gate), rows2d(up), rows2d(dh.to(gate.dtype))
    if in_place and _writable_over(gate, g) and _writable_over(up, u) and not _share_memory(gate, up):
        backward_rows(g, u, d, g, u, act)
        return gate, up
    dg = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    du = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    backward_rows(g, u, d, dg, du, act)
    return dg.view(gate.shape), du.view(gate.shape)


def _writable_over(t: torch.Tensor, t2: torch.Tensor) -> bool:
    """Whether ``t2`` (``rows2d(t)``) is a view of ``t``'s own elements, so that writing it writes
    ``t`` (:func:`rows2d` copies where a reshape cannot view ``t`` or its rows would overlap)."""
    return t.numel() > 0 and t2.data_ptr() == t.data_ptr()


def _share_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def fused_forward(gate_up: torch.Tensor, act: str, gate_first: bool = True, exact_exp: bool = True) -> torch.Tensor:
    gu = rows2d(gate_up)
    g, u = halves(gu, gate_first)
    h = forward_rows(g, u, act, exact_exp)
    return h.view(*gate_up.shape[:-1], g.shape[1])


def fused_backward(gate_up: torch.Tensor, dh: torch.Tensor, act: str, gate_first: bool = True,
                   exact_exp: bool = True, in_place: bool = False) -> torch.Tensor:
    """The gradient of the gate-up projection; ``in_place``: written over ``gate_up`` where the
    kernel can write it without a copy (see :func:`split_backward`)."""
    gu, d = rows2d(gate_up), rows2d(dh.to(gate_up.dtype))
    if in_place and _writable_over(gate_up, gu):
        g, u = halves(gu, gate_first)
        backward_rows(g, u, d, g, u, act, exact_exp)
        return gate_up
    dgu = torch.empty((gu.shape[0], gu.shape[1]), dtype=gu.dtype, device=gu.device)
    g, u = halves(gu, gate_first)
    dg, du = halves(dgu, gate_first)
    backward_rows(g, u, d, dg, du, act, exact_exp)
    return dgu.view(gate_up.shape)
