"""The RMSNorm's launch plans: the tuning knobs, the configs and grids derived from a call's
shapes, strides, dtypes and alignment, the per-stream workspace of the backward's weight-gradient
partials, the named records of keys and plans, and :data:`PLANS`, the one object holding every
cache (cleared by :func:`clear_plans`)."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch

from .._common import CachedLaunches, _current_device, _stream_capturing, cdiv, next_power_of_2
from .._common import sm_count as _sm_count
from .kernels import _rms_bwd_form_kernel, _rms_bwd_kernel, _rms_bwd_loop_form_kernel, _rms_bwd_loop_kernel
from .reference import _ACTS, _GATES, RMSForm, _form_dtypes


# Tuning knobs (module attributes so tests can force the looping kernels at small widths).
_MAX_FWD_BLOCK = 16384  # widest row the forward holds in one block
_MAX_BWD_BLOCK = 8192  # widest row the backward holds in one block
_LOOP_BLOCK = 4096  # column block of the looping kernels
_FWD_TILE_BYTES = 8192  # input bytes per forward tile (narrow widths: many rows per program; swept)
_BWD_TILE_ELEMS = 4096  # elements per backward tile
_FWD_ELEMS_PER_WARP = 1024  # forward tile elements per warp (sets num_warps)
_BWD_ELEMS_PER_WARP = 512  # backward tile elements per warp
_BWD_PREFETCH = True  # persistent backward: load the next tile before processing the current one
# Gated forms at narrow widths (rows much shorter than a tile): the gate doubles what a tile holds
# live, and smaller tiles with more warps per element were faster on the H200 (swept at 131072 and
# 262144 rows of 128: forward 0.094 -> 0.068 ms, backward 0.127 -> 0.103 ms at 262144 x 128 bf16)
# Grouped statistics' persistent backward with tiles of WG rows (_GROUPED_BY_WEIGHT_ROW False; up
# to 8192 elements): prefetching the next tile costs registers there (H200, 8 groups of 1024, 8192
# rows, bf16 gate first: 0.47 ms with it, 0.34 ms without). By weight row it prefetches as
# _BWD_PREFETCH says.
_BWD_GROUPED_PREFETCH = False
_FWD_GATED_TILE_BYTES = 2048
_FWD_GATED_ELEMS_PER_WARP = 512
_BWD_GATED_TILE_ELEMS = 2048
_BWD_GATED_ELEMS_PER_WARP = 256
_INTERPRET_PROGRAMS = 3  # persistent programs under the CPU interpreter (grouped by weight row: per weight row)


# ----------------------------------------------------------------------------------------------
# Launch helpers
# ----------------------------------------------------------------------------------------------
def _row_layout(t: torch.Tensor) -> Optional[tuple]:
    """(D1, D2, S0, S1, S2) addressing the rows of ``t`` ([..., N], last dim contiguous) as up
    to three strided groups of leading dims, or None when that is not possible."""
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        return None
    groups: list = []  # [size, stride], innermost first
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size == 1:
            continue
        if groups and groups[-1][0] * groups[-1][1] == stride:
            groups[-1][0] *= size
        else:
            groups.append([size, stride])
    if not groups:
        return (1, 1, 0, 0, 0)
    if len(groups) > 3:
        return None
    if len(groups) == 1:
        return (1, 1, groups[0][1], 0, 0)
    if len(groups) == 2:
        (d2, s2), (_, s0) = groups
        return (1, d2, s0, 0, s2)
    (d2, s2), (d1, s1), (_, s0) = groups
    return (d1, d2, s0, s1, s2)


def _device_index(t: torch.Tensor) -> int:
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


def _occupancy(kernel, args: tuple, meta: dict, t: torch.Tensor) -> int:
    """Programs of ``kernel`` (compiled for these args) resident on one SM at once, from its
    register and shared-memory use; computed once per configuration (compiles it if needed)."""
    num_warps = meta["num_warps"]
    key = (id(kernel), _device_index(t), args[0].dtype, args[1].dtype, getattr(args[2], "dtype", None),
           tuple(meta.items()))
    occ = PLANS.occupancy.get(key)
    if occ is None:
        occ = max(1, 32 // num_warps)  # a guess, used if the compiled kernel cannot be inspected
        try:
            compiled = kernel.warmup(*args, grid=(1,), **meta)
            compiled._init_handles()
            props = torch.cuda.get_device_properties(_device_index(t))
            regs_sm = getattr(props, "regs_per_multiprocessor", 65536)
            threads_sm = getattr(props, "max_threads_per_multi_processor", 2048)
            smem_sm = getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)
            regs = max(1, int(compiled.n_regs))
            regs_warp = -(-regs * 32 // 256) * 256  # registers are allocated per warp in 256s
            by_regs = regs_sm // (regs_warp * num_warps)
            by_threads = threads_sm // (32 * num_warps)
            smem = int(getattr(compiled.metadata, "shared", 0) or 0)
            by_smem = smem_sm // (smem + 1024) if smem else by_threads
            occ = max(1, min(by_regs, by_threads, by_smem))
        except Exception:  # pragma: no cover - depends on the Triton version
            pass
        PLANS.occupancy[key] = occ
    return occ


def _persistent_grid(kernel, args: tuple, meta: dict, t: torch.Tensor, work: int, per_sm: int = 64) -> int:
    if not t.is_cuda:
        return max(1, min(work, _INTERPRET_PROGRAMS))
    return max(1, min(work, _sm_count(_device_index(t)) * min(per_sm, _occupancy(kernel, args, meta, t))))


def _prev_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _fwd_config(n_rows: int, N: int, elem: int, cap_rows: int, gated: bool = False) -> tuple:
    if N <= _MAX_FWD_BLOCK:
        block_n, single = next_power_of_2(N), True
    else:
        block_n, single = _LOOP_BLOCK, False
    tile, per_warp = _FWD_TILE_BYTES, _FWD_ELEMS_PER_WARP
    if gated and block_n * elem < _FWD_GATED_TILE_BYTES:
        tile, per_warp = _FWD_GATED_TILE_BYTES, _FWD_GATED_ELEMS_PER_WARP
    block_r = max(1, (tile // elem) // block_n)
    block_r = min(block_r, next_power_of_2(max(n_rows, 1)), 128)
    # keep at least `cap_rows` programs busy when the input is short (decode-like shapes)
    block_r = max(1, min(block_r, _prev_pow2(max(n_rows // max(cap_rows, 1), 1))))
    num_warps = min(16, max(1, (block_r * block_n) // per_warp))
    return block_r, block_n, single, num_warps


def _weight_rows(x: torch.Tensor, w: Optional[torch.Tensor]) -> int:
    """WG: the weight rows of a grouped call (x [..., group_size], w [WG * group_size]; see
    ``api._grouped``), 1 otherwise."""
    N = x.shape[-1]
    return w.shape[0] // N if w is not None and N and w.shape[0] != N else 1


# Grouped statistics' persistent backward takes WG rows of a group at most this many elements (wider:
# the looping kernel); with tiles of WG rows it is the tile (BLOCK_R, a multiple of WG, times BLOCK_N)
_MAX_GROUPED_TILE = 8192
# Grouped statistics' persistent backward by weight row: each program takes one weight row and
# walks only its rows (the kernel's WROW), so a tile need not hold WG rows and carries one weight
# row: the tile, warps and prefetch of an ungrouped call of the group's width. Compiled for sm_90
# these do not spill where tiles of WG rows at 16 warps do (Mamba2's gate first, 8 groups of 1024,
# bf16: 128 registers and a 200-byte stack, without prefetch). False: tiles of a multiple of WG rows.
_GROUPED_BY_WEIGHT_ROW = True


def _bwd_config(n_rows: int, N: int, wg: int = 1, gated: bool = False, esize: tuple = (2, 4)) -> tuple:
    """(BLOCK_R, BLOCK_N, single, num_warps) of the backward. Grouped (``wg`` weight rows, ``wg`` a
    power of two and ``wg`` rows of a group at most _MAX_GROUPED_TILE elements): the persistent
    kernel, its tiles holding a multiple of ``wg`` rows, or with _GROUPED_BY_WEIGHT_ROW those of an
    ungrouped call of the group's width over one weight row's rows; otherwise the looping kernel,
    with column blocks no wider than the group. ``esize``: the smallest and largest element size
    (bytes) of the rows the kernel loads and stores."""
    if wg > 1:
        block_r, block_n, single, num_warps = _bwd_config(n_rows, N)
        if single and wg & (wg - 1) == 0 and wg * block_n <= _MAX_GROUPED_TILE:
            old_r = max(block_r, wg)
            old_warps = min(16, max(1, (old_r * block_n) // _BWD_ELEMS_PER_WARP))
            if not _GROUPED_BY_WEIGHT_ROW:
                return old_r, block_n, True, old_warps
            # The order of a row's FP32 sums follows how the tile spreads the row's columns: a
            # 16-byte vector per thread (fewer elements when a thread holds fewer), 32 lanes, then
            # the warps along the row (at most block_n * size // 512 for `size`-byte elements).
            # Keep the spread of the tiles of wg rows (as many warps along a row, a whole vector per
            # thread), so the row sums, and dx, stay bitwise those of the tiles of wg rows.
            block_r, _, _, num_warps = _bwd_config(cdiv(n_rows, wg), N, 1, gated)
            num_warps = max(num_warps, min(old_warps, max(1, block_n * esize[1] // 512)))
            block_r = min(old_r, max(block_r, 32 * num_warps * (16 // esize[0]) // block_n))
            return block_r, block_n, True, num_warps
        block_n = min(_LOOP_BLOCK, next_power_of_2(N))
        return 1, block_n, False, min(16, max(4, block_n // 512))
    if N <= _MAX_BWD_BLOCK:
        block_n = next_power_of_2(N)
        tile, per_warp = _BWD_TILE_ELEMS, _BWD_ELEMS_PER_WARP
        if gated and block_n < _BWD_GATED_TILE_ELEMS:
            tile, per_warp = _BWD_GATED_TILE_ELEMS, _BWD_GATED_ELEMS_PER_WARP
        block_r = max(1, tile // block_n)
        block_r = min(block_r, next_power_of_2(max(n_rows, 1)))
        num_warps = min(16, max(1, (block_r * block_n) // per_warp))
        return block_r, block_n, True, num_warps
    return 1, _LOOP_BLOCK, False, min(16, max(4, _LOOP_BLOCK // 512))


# Launch plans: everything a call derives from shapes, strides, dtypes, devices and pointer
# alignment (configs, grids, persistent-program counts, workspace sizes, the compiled kernels),
# computed once per such key. A repeated call then builds its key, allocates its outputs and
# launches one kernel through the compiled kernel's C launcher (``CachedLaunches``).
#
# Keys are plain tuples (built on every call: a record's constructor would cost a Python call
# there); the records below name their fields for the code that reads them (``FwdKey._make(k)``).
# Plans are records (tuples: the per-call paths unpack them into locals at once).
class TensorKey(NamedTuple):
    """What a plan depends on of one tensor (``_tkey``)."""
    shape: tuple
    stride: tuple
    dtype: torch.dtype
    device: torch.device
    align: int  # data_ptr() & 15


class FwdKey(NamedTuple):
    """The Llama form's forward key (``_fwd_key``)."""
    x_shape: tuple
    x_stride: tuple
    x_dtype: torch.dtype
    x_device: torch.device
    x_align: int
    w_shape: tuple
    w_stride: tuple
    w_dtype: torch.dtype
    w_device: torch.device
    w_align: int
    write_rstd: bool  # a backward follows


class BwdKey(NamedTuple):
    """The Llama form's backward key (``_bwd_key``)."""
    x_shape: tuple
    x_stride: tuple
    x_dtype: torch.dtype
    x_device: torch.device
    x_align: int
    dy_shape: tuple
    dy_stride: tuple
    dy_dtype: torch.dtype
    dy_device: torch.device
    dy_align: int
    w_stride: tuple
    w_dtype: torch.dtype
    w_align: int
    rstd_align: int


class FormKey(NamedTuple):
    """The other forms' forward key (``_form_key``)."""
    form: "RMSForm"
    x_shape: tuple
    x_stride: tuple
    x_dtype: torch.dtype
    x_device: torch.device
    x_align: int
    w: Optional[tuple]  # TensorKey fields, or None
    g: Optional[tuple]
    write_rstd: bool


class FormBwdKey(NamedTuple):
    """The other forms' backward key (``_form_bwd_key``)."""
    form: "RMSForm"
    x_shape: tuple
    x_stride: tuple
    x_dtype: torch.dtype
    x_device: torch.device
    x_align: int
    dy_shape: tuple
    dy_stride: tuple
    dy_dtype: torch.dtype
    dy_device: torch.device
    dy_align: int
    w: Optional[tuple]
    g: Optional[tuple]
    rstd_align: int


class FastKey(NamedTuple):
    """A backward fast path's key: the forward's key and the incoming gradient's layout (its shape
    and device are the output's, checked by autograd)."""
    key: tuple
    dy_stride: tuple
    dy_dtype: torch.dtype
    dy_align: int


class FormSpec(NamedTuple):
    """What another form changes in a plan: its kernels' constexprs and output dtype (and, for the
    backward, the gate when the kernels read one)."""
    consts: dict
    out_dtype: torch.dtype
    gate: Optional[torch.Tensor] = None


class FwdPlan(NamedTuple):
    """The forward's launch plan (``_fwd_plan``; the other forms' too)."""
    copy: bool  # x's rows cannot be addressed in place: x is copied contiguous first
    wcopy: bool  # the weight is strided: copied
    like: bool  # y is empty_like(x)
    out_dtype: torch.dtype
    rshape: tuple  # rstd's shape
    device: torch.device
    ints: tuple  # the kernel's integer arguments (n_rows, N, D1, D2, S0, S1, S2)
    grid: tuple
    const: dict  # the kernel's constexprs, in its parameter order
    num_warps: int
    dev: Optional[int]  # the CUDA device's index (None: CPU, the interpreter)
    lkey: tuple  # the launch's key in ``_launches``: (kind,) + the plan's key
    gate_copy: bool = False  # other forms: the gate is copied contiguous
    gated: bool = False  # other forms: the kernel reads a gate


class ReducePlan(NamedTuple):
    """The weight-gradient sum's own launch (``_dw_reduce_kernel``)."""
    grid: tuple
    const: dict


class BwdPlan(NamedTuple):
    """The backward's launch plan (``_bwd_plan``; the other forms' too)."""
    convert: bool  # dy is converted to the output dtype
    out_dtype: torch.dtype
    xcopy: bool  # x's rows cannot be addressed in place: copied
    gcopy: bool  # dy's rows cannot be addressed in place: copied
    wcopy: bool
    dx_like: bool  # dx is empty_like(x)
    device: torch.device
    kernel: object  # the persistent or the looping kernel
    ints: tuple  # (n_rows, N[, n_tiles: grouped by weight row, one weight row's]) + x's and dy's row layouts
    progs: int  # persistent programs
    const: dict
    num_warps: int
    ws_numel: int  # workspace floats (weight-gradient partials)
    n_cnt: int  # workspace counters
    red: Optional[ReducePlan]  # the weight-gradient sum's own launch, or None (summed in the launch)
    dev: Optional[int]
    lkey: tuple
    gate_copy: bool = False  # other forms: the gate is copied contiguous
    gated: bool = False  # other forms: the kernels read a gate (and write its gradient)


# A form whose rounding at these dtypes is the Llama form's: its plan entry (the Llama op runs it)
AS_LLAMA = "as llama"


class NativeEntry(NamedTuple):
    """A forward key's C++ node: the extension's function, the plan id it was registered under,
    the CUDA device index."""
    apply: object
    plan_id: int
    dev: int


class NativePending(NamedTuple):
    """A forward key's launches noted for the C++ node until the extension is built."""
    fast_key: tuple
    bplan: BwdPlan
    bfn: object  # the backward's direct launcher


def _key_of(lkey: tuple) -> tuple:
    """The plan key inside a launch key ``(kind,) + key``."""
    return lkey[1:]


class PlanCache:
    """Every cache of the RMSNorm's launch plans, with one clearing path. The dicts are made once
    and only ever cleared in place, so the per-call paths hold them as module globals (one lookup
    fewer than through this object)."""

    MAX_PLANS = 4096

    def __init__(self):
        self.fwd_plans: dict = {}  # FwdKey -> FwdPlan
        self.bwd_plans: dict = {}  # BwdKey -> BwdPlan
        self.form_fwd_plans: dict = {}  # FormKey -> FwdPlan or AS_LLAMA
        self.form_bwd_plans: dict = {}  # FormBwdKey -> BwdPlan or AS_LLAMA
        # fast paths: per key, once its kernel has a direct launcher, a closure that allocates
        # the outputs and makes the one launch (no plan unpacking, no launcher lookup): the
        # backward's runs on autograd's device thread, where every Python step costs more than on
        # the calling thread. The backward's are keyed by FastKey.
        self.fwd_fast: dict = {}
        self.bwd_fast: dict = {}
        self.form_fwd_fast: dict = {}
        self.form_bwd_fast: dict = {}
        # C++ autograd node entries: forward key -> NativeEntry (None: not describable)
        self.native_plans: dict = {}
        self.native_pending: dict = {}  # forward key -> NativePending until the build is done
        # launch descriptions -> the extension's plan id (kept by clear(): the extension keeps them)
        self.native_ids: dict = {}
        # (kernel, device, dtypes, constexprs) -> programs resident on one SM (``_occupancy``)
        self.occupancy: dict = {}
        self.launches = CachedLaunches()

    def _derived(self):
        return (self.fwd_fast, self.bwd_fast, self.form_fwd_fast, self.form_bwd_fast, self.native_plans,
                self.native_pending)

    def clear(self) -> None:
        """Forget every plan, fast path, C++ node entry, occupancy and compiled launch."""
        for d in (self.fwd_plans, self.bwd_plans, self.form_fwd_plans, self.form_bwd_plans,
                  self.occupancy) + self._derived():
            d.clear()
        self.launches.clear()

    def remember(self, plans: dict, key, plan):
        """``plans[key] = plan``; a full dict starts over (shapes that never repeat), with what
        was derived from plans (fast paths, C++ node entries)."""
        if len(plans) >= self.MAX_PLANS:
            plans.clear()
            for d in self._derived():
                d.clear()
        plans[key] = plan
        return plan


PLANS = PlanCache()
_fwd_plans = PLANS.fwd_plans
_bwd_plans = PLANS.bwd_plans
_form_fwd_plans = PLANS.form_fwd_plans
_form_bwd_plans = PLANS.form_bwd_plans
_fwd_fast = PLANS.fwd_fast
_bwd_fast = PLANS.bwd_fast
_form_fwd_fast = PLANS.form_fwd_fast
_form_bwd_fast = PLANS.form_bwd_fast
_native_plans = PLANS.native_plans
_native_pending = PLANS.native_pending
_native_ids = PLANS.native_ids
_launches = PLANS.launches
_F32 = torch.float32


def _contiguous_strides(shape) -> tuple:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(strides))


def clear_plans() -> None:
    """Forget the launch plans (tests that change the tuning knobs call this)."""
    PLANS.clear()


_remember = PLANS.remember


def _cuda_index(t: torch.Tensor) -> Optional[int]:
    return _device_index(t) if t.is_cuda else None


def _current_device_is(dev: int) -> bool:
    return _current_device() == dev


# ---- workspace: the backward's weight-gradient partials and its arrival counters ---------------
# One per (device, stream), grown when a larger one is needed and never freed (a CUDA graph
# captured earlier may still use a smaller one, and kernels in flight may too). The counters
# are zero between launches: each is reset by the program that uses it last. Launches on one
# stream run one after another, so they can share it; launches on another stream get their own.
# While a stream is being captured into a CUDA graph, each call gets a private workspace from
# the graph's pool (zeroed inside the graph), so replays never share one with eager work.
_N_COUNTERS = 1024
_workspaces: dict = {}
_retired: list = []


def _workspace(device: torch.device, dev: Optional[int], stream: int, numel: int, n_cnt: int):
    if dev is not None and _stream_capturing():
        return (torch.empty(numel, dtype=_F32, device=device), torch.zeros(n_cnt, dtype=torch.int32, device=device))
    key = (dev, stream) if dev is not None else (device.type, 0)
    ws = _workspaces.get(key)
    if ws is not None and ws[0].numel() >= numel and ws[1].numel() >= n_cnt:
        return ws
    if ws is not None:
        _retired.append(ws)
        numel = max(numel, 2 * ws[0].numel())
    ws = (torch.empty(numel, dtype=_F32, device=device),
          torch.zeros(max(n_cnt, _N_COUNTERS), dtype=torch.int32, device=device))
    _workspaces[key] = ws
    return ws


_SMALL_ELEMS = 1 << 20  # inputs this small are host-bound: one launch whatever the tail
_MAX_TAIL_BYTES = 65536  # in-launch weight-gradient sum only while its serial tail reads at most this


class ReduceMeta(NamedTuple):
    """The weight-gradient sum's sizes (:func:`_reduce_meta`)."""
    group: int  # GROUP: programs per group of the two-level sum
    rb_p: int  # RB_P: rows per step of a sum
    rb_n: int  # RB_N: columns per step
    ws_rows: int  # workspace rows (the partials and the groups' sums)
    n_cnt: int  # arrival counters
    finish: bool  # FINISH: summed in the backward's own launch


def _reduce_meta(progs: int, N: int, n_rows: int = 0) -> ReduceMeta:
    """The :class:`ReduceMeta` of the weight-gradient sum of ``progs`` partial rows. ``finish``:
    summed in the backward's own launch (the last programs, two levels); otherwise, where the
    serial tail (a group's rows, then the groups' rows, read by one program each) would be
    latency-bound, a second launch sums column strips in parallel. Small inputs (host-bound: the
    device waits for the launches anyway) always sum in the one launch."""
    group = min(64, max(2, next_power_of_2(math.isqrt(max(progs - 1, 0)) + 1)))
    n_groups = cdiv(progs, group)
    rb_p = 16
    rb_n = min(next_power_of_2(N), 256)
    finish = (group + n_groups) * N * 4 <= _MAX_TAIL_BYTES or n_rows * N <= _SMALL_ELEMS
    return ReduceMeta(group, rb_p, rb_n, progs + n_groups, n_groups + 1, finish)


_COL_FINISH = True  # wide sums: finished in the launch by its last programs, a column strip each


def _col_finish_meta(progs: int, N: int, on_gpu: bool, sms: int = 0, rows: Optional[int] = None) -> tuple:
    """(SW, RB_P) of the column-parallel finish: strips of SW columns, one per finisher, at most
    64 finishers, never more than the programs nor half the SMs (the finishers wait for the last
    programs: at least as many programs as finishers must fit on the device at once, even with
    other kernels holding SMs); under the interpreter one finisher (its programs run one after
    another, so none may wait for a later one). ``rows``: the partial rows summed (default: one
    per program)."""
    if on_gpu:
        sw = max(16, next_power_of_2(cdiv(N, max(1, min(64, progs, sms // 2)))))
    else:
        sw = next_power_of_2(N)
    return sw, max(1, min(4096 // sw, next_power_of_2(progs if rows is None else rows)))


# ---- forward ------------------------------------------------------------------------------------
def _fwd_key(x: torch.Tensor, w: torch.Tensor, write_rstd: bool) -> tuple:
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, w.shape, w.stride(), w.dtype, w.device,
            w.data_ptr() & 15, write_rstd)


def _fwd_plan(x: torch.Tensor, w: Optional[torch.Tensor], write_rstd: bool, key,
              form: Optional[FormSpec] = None) -> FwdPlan:
    """The forward's launch plan; ``form``: None (the Llama form) or another form's
    :class:`FormSpec` (its kernel, ``_rms_fwd_form_kernel``, takes the gate pointer after RSTD)."""
    N = x.shape[-1]
    n_rows = x.numel() // N if N else 0
    lay = _row_layout(x)
    copy = lay is None
    if copy:
        lay = (1, 1, N, 0, 0)
    cap = _sm_count(_device_index(x)) if x.is_cuda else 1
    gated = form is not None and form.consts.get("GATE", 0) != 0
    block_r, block_n, single, num_warps = _fwd_config(n_rows, N, x.element_size(), cap, gated)
    grid = (cdiv(n_rows, block_r),)
    const = dict(BLOCK_R=block_r, BLOCK_N=block_n, SINGLE=single, STATS64=x.dtype == torch.float32,
                 WRITE_RSTD=write_rstd)
    if form is None:
        out_dtype = torch.promote_types(x.dtype, w.dtype)
    else:  # the forward kernel's constexprs of the form (QRND is the backward's alone)
        const.update((k, form.consts[k]) for k in _FWD_FORM_CONSTS)
        const.update(WG=_weight_rows(x, w))
        out_dtype = form.out_dtype
    like = out_dtype == x.dtype and (copy or x.is_contiguous())
    wcopy = w is not None and N > 1 and w.stride(0) != 1
    return FwdPlan(copy, wcopy, like, out_dtype, x.shape[:-1], x.device, (n_rows, N) + lay, grid, const, num_warps,
                   _cuda_index(x), ("fwd",) + key)


# ---- backward -----------------------------------------------------------------------------------
def _bwd_inputs(dy: torch.Tensor, x: torch.Tensor, convert: bool, out_dtype, xcopy: bool, gcopy: bool):
    """``dy`` in the output dtype and ``dy``/``x`` copied where the plan says their rows cannot be
    addressed in place."""
    if convert:
        dy = dy.to(out_dtype)
    if gcopy:
        dy = dy.contiguous()
    if xcopy:
        x = x.contiguous()
    return dy, x


def _bwd_key(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor) -> tuple:
    return (x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, dy.shape, dy.stride(), dy.dtype, dy.device,
            dy.data_ptr() & 15, w.stride(), w.dtype, w.data_ptr() & 15, rstd.data_ptr() & 15)


def _bwd_plan(dy: torch.Tensor, x: torch.Tensor, w: Optional[torch.Tensor], rstd: torch.Tensor, key,
              form: Optional[FormSpec] = None) -> BwdPlan:
    """The backward's launch plan; ``form``: None (the Llama form) or another form's
    :class:`FormSpec` (its kernels take the gate and its gradient after DW; without a weight
    there is no weight-gradient sum)."""
    N = x.shape[-1]
    n_rows = x.numel() // N
    wg = 1 if form is None else _weight_rows(x, w)
    NW = wg * N  # the weight's width (the partials' row)
    out_dtype = torch.promote_types(x.dtype, w.dtype) if form is None else form.out_dtype
    convert = dy.dtype != out_dtype
    xl, gl = _row_layout(x), (None if convert else _row_layout(dy))
    xcopy, gcopy = xl is None, gl is None
    xl = (1, 1, N, 0, 0) if xcopy else xl
    gl = (1, 1, N, 0, 0) if gcopy else gl
    wcopy = w is not None and N > 1 and w.stride(0) != 1
    gated = form is not None and form.consts.get("GATE", 0) != 0
    sizes = (x.element_size(), out_dtype.itemsize) + ((form.gate.element_size(),) if gated else ())
    block_r, block_n, single, num_warps = _bwd_config(n_rows, N, wg, gated, (min(sizes), max(sizes)))
    # the call's own arguments (and stand-in outputs) probe the compiled kernel's occupancy,
    # which sizes the grid; the reduction knobs do not change the register use much, so the
    # probe uses those of the largest grid
    gs, xs = _bwd_inputs(dy, x, convert, out_dtype, xcopy, gcopy)
    ws = w.contiguous() if w is not None else None
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    probe = _reduce_meta(2048, NW)
    probe_ws = (torch.empty(1, dtype=_F32, device=x.device), torch.zeros(1, dtype=torch.int32, device=x.device))
    red = dict(GROUP=probe.group, RB_P=probe.rb_p, RB_N=probe.rb_n, FINISH=1)
    pargs = (gs, xs, ws, rstd, dx) + probe_ws + (ws,)
    kernels, fconst = (_rms_bwd_kernel, _rms_bwd_loop_kernel), {}
    if form is not None:
        gate = form.gate.contiguous() if form.gate is not None else None
        pargs += (gate, None if gate is None else torch.empty_like(gate))
        kernels, fconst = (_rms_bwd_form_kernel, _rms_bwd_loop_form_kernel), dict(form.consts, WG=wg)
    # grouped, one weight row per program (the kernel's WROW): wg programs per partial row
    byrow = single and wg > 1 and _GROUPED_BY_WEIGHT_ROW
    wpr = wg if byrow else 1
    if single:
        # byrow: the tiles of one weight row's rows (every wg-th row)
        n_tiles = cdiv(cdiv(n_rows, wg) if byrow else n_rows, block_r)
        kernel = kernels[0]
        ints = (n_rows, N, n_tiles) + xl + gl
        const = dict(BLOCK_R=block_r, BLOCK_N=block_n,
                     PREFETCH=_BWD_PREFETCH if wg == 1 or byrow else _BWD_GROUPED_PREFETCH)
        if form is not None:
            fconst.update(WROW=byrow)
        meta = dict(const, **red, **fconst, num_warps=num_warps)
        if byrow:  # a multiple of wg programs, at most n_tiles per weight row
            progs = wg * (min(n_tiles, _INTERPRET_PROGRAMS) if not x.is_cuda else
                          max(1, _persistent_grid(kernel, pargs + ints, meta, x, n_tiles * wg) // wg))
        else:
            progs = _persistent_grid(kernel, pargs + ints, meta, x, n_tiles)
    else:
        kernel = kernels[1]
        ints = (n_rows, N) + xl + gl
        const = dict(BLOCK_N=block_n)
        # each program read-modify-writes its own partial row: keep their number (and the
        # partial buffer, which stays in L2) small
        progs = _persistent_grid(kernel, pargs + ints, dict(const, **red, **fconst, num_warps=num_warps), x, n_rows,
                                 per_sm=2)
    n_part = progs // wpr  # partial rows of NW columns
    group, rb_p, rb_n, ws_rows, n_cnt, finish = _reduce_meta(n_part, NW, n_rows // wg)
    dx_like = xcopy or x.is_contiguous()
    red = None
    if finish:  # groups of `group` partial rows: group * wpr programs
        const.update(GROUP=group * wpr, RB_P=rb_p, RB_N=rb_n, FINISH=1)
    elif _COL_FINISH:
        sw, rb_p = _col_finish_meta(progs, NW, x.is_cuda, _sm_count(_device_index(x)) if x.is_cuda else 0, n_part)
        const.update(GROUP=group, RB_P=rb_p, RB_N=sw, FINISH=2)
        ws_rows, n_cnt = n_part, 2
    else:  # a second launch; narrow column strips so the partial buffer is read by many programs at once
        const.update(GROUP=group, RB_P=rb_p, RB_N=rb_n, FINISH=0)
        rn = min(next_power_of_2(NW), 32)
        red = ReducePlan((cdiv(NW, rn),), dict(BLOCK_P=min(next_power_of_2(n_part), 128), BLOCK_N=rn,
                                                      WPR=wpr))
    if form is not None:
        const.update(fconst)  # after the reduction's: the kernels' parameter order
        if w is None:  # no weight gradient: no second launch
            red = None
    return BwdPlan(convert, out_dtype, xcopy, gcopy, wcopy, dx_like, x.device, kernel, ints, progs, const, num_warps,
                   ws_rows * NW, n_cnt, red, _cuda_index(x), ("bwd",) + key)


# the form constexprs _rms_fwd_form_kernel takes (Triton on the GPU refuses an unknown keyword; its
# interpreter ignores one)
_FWD_FORM_CONSTS = ("NRND", "WMODE", "PRND", "GATE", "ACT", "RSTD_RND")


@functools.lru_cache(maxsize=None)
def _form_consts(form: RMSForm, xd: torch.dtype, wd: Optional[torch.dtype], gated: bool, grouped: bool = False):
    """(constexprs of the form kernels, output dtype), or None where the form, at these dtypes and
    without a gate, rounds exactly as the Llama form does (the Llama op runs it; never for grouped
    statistics, which only the form kernels take)."""
    nd, dp, dq, out = _form_dtypes(form, xd, wd)

    def code(d):
        return 0 if d == torch.float32 else 1 if d == xd else 2

    gate = _GATES.index(form.gate) if gated else 0
    consts = dict(NRND=code(nd), WMODE=("none", "plain", "offset", "offset_w").index(
        "plain" if form.weight == "fp32" else form.weight) if not form.rstd_cast else 0,
        PRND=code(dp), QRND=code(dq), GATE=gate, ACT=_ACTS.index(form.act), RSTD_RND=bool(form.rstd_cast))
    if not grouped and wd is not None and not form.rstd_cast and gate == 0 and consts["WMODE"] == 1 \
            and consts["NRND"] == 1 \
            and out == torch.promote_types(xd, wd) and dq == out and dp == out:
        return None  # the Llama form: w * n.to(x.dtype) in the promoted dtype
    return tuple(consts.items()), out


# ---- plans and launches (the plan caches are PLANS') ------------------------------------------------
def _tkey(t: Optional[torch.Tensor]):
    return None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() & 15)


def _form_key(x: torch.Tensor, w: Optional[torch.Tensor], g: Optional[torch.Tensor], form: RMSForm,
              write_rstd: bool) -> tuple:
    return (form, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, _tkey(w), _tkey(g), write_rstd)


def _ptr(t: Optional[torch.Tensor]):
    return None if t is None else t.data_ptr()


def _form_fwd_plan(x, w, g, form: RMSForm, write_rstd: bool, key):
    """The form's forward plan (an :class:`FwdPlan`), or :data:`AS_LLAMA`."""
    spec = _form_consts(form, x.dtype, None if w is None else w.dtype, g is not None and form.gate != "none",
                        _weight_rows(x, w) > 1)
    if spec is None:
        return AS_LLAMA
    consts, out_dtype = spec
    plan = _fwd_plan(x, w, write_rstd, key, form=FormSpec(dict(consts), out_dtype))
    return plan._replace(lkey=("form_fwd",) + key, gate_copy=g is not None and not g.is_contiguous(),
                         gated=dict(consts)["GATE"] != 0)


def _form_bwd_key(dy, x, w, g, rstd, form) -> tuple:
    return (form, x.shape, x.stride(), x.dtype, x.device, x.data_ptr() & 15, dy.shape, dy.stride(), dy.dtype,
            dy.device, dy.data_ptr() & 15, _tkey(w), _tkey(g), rstd.data_ptr() & 15)


def _form_bwd_plan(dy, x, w, g, rstd, form: RMSForm, key) -> tuple:
    spec = _form_consts(form, x.dtype, None if w is None else w.dtype, g is not None and form.gate != "none",
                        _weight_rows(x, w) > 1)
    if spec is None:
        return AS_LLAMA
    consts, out_dtype = spec
    gated = dict(consts)["GATE"] != 0
    plan = _bwd_plan(dy, x, w, rstd, key, form=FormSpec(dict(consts), out_dtype, g if gated else None))
    return plan._replace(lkey=("form_bwd",) + key, gate_copy=gated and not g.is_contiguous(), gated=gated)
