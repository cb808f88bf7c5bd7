"""Helpers shared by the ops: where kernels may run, warn-once fallbacks, the SM count, and
launches through Triton's C launcher.

The ops never import DeepSpeed. A kernel runs on CUDA tensors when Triton imports, and on
CPU tensors only under Triton's interpreter (``TRITON_INTERPRET=1`` set before the kernels
are defined), which is how the CPU test-suite exercises the kernels themselves.
"""
from __future__ import annotations

import functools
import os
import threading
import warnings
from typing import Optional

import torch

try:  # Triton is optional: without it every op runs its torch reference.
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAS_TRITON = True
except Exception:  # pragma: no cover - depends on the machine
    triton = None
    tl = None
    HAS_TRITON = False


def interpreter_active() -> bool:
    """True when Triton kernels are interpreted on the CPU (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Triton reads TRITON_INTERPRET when a kernel is defined (``@triton.jit``, at the import of the op
# modules, which import this one first): kernels defined without it are compiled for a GPU driver
# and fail on CPU tensors with "0 active drivers", whatever the variable says later.
_INTERPRET_AT_IMPORT = interpreter_active()
LATE_INTERPRET = ("TRITON_INTERPRET=1 was set after deepspeed_fused defined its Triton kernels (Triton reads it "
                  "when a kernel is defined); set it in the environment before the program starts "
                  "(TRITON_INTERPRET=1 python ...) or at least before deepspeed_fused.ops is imported")


if HAS_TRITON:
    if _INTERPRET_AT_IMPORT:  # the interpreter has no libdevice; its exp is numpy's

        @triton.jit
        def exp_cuda(v):
            return tl.exp(v)
    else:
        from triton.language.extra.cuda import libdevice

        @triton.jit
        def exp_cuda(v):
            # CUDA's expf (what eager's softmax, sigmoid and silu call), not tl.exp's ex2.approx of
            # v * log2(e), whose error grows with |v|: where a kernel must land on eager's FP32 value
            return libdevice.exp(v)


def kernel_device_ok(t: torch.Tensor) -> tuple[bool, str]:
    """Whether a Triton kernel can take tensor ``t`` because of where it lives."""
    if not HAS_TRITON:
        return False, "Triton is not installed"
    if t.device.type == "cpu" and interpreter_active() and not _INTERPRET_AT_IMPORT:
        return False, LATE_INTERPRET
    if t.is_cuda:
        if interpreter_active():
            return False, "TRITON_INTERPRET=1 with CUDA tensors"
        return True, ""
    if t.device.type == "cpu" and interpreter_active():
        return True, ""
    return False, device_reason(t.device.type)


FLOAT_KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def float_kernel_ok(t: torch.Tensor) -> tuple[bool, str]:
    """Whether a kernel over floating-point elements can take tensor ``t`` because of where it
    lives (:func:`kernel_device_ok`) and its dtype (float16, bfloat16, float32; not bfloat16 under
    the interpreter, which does not round it as a GPU does), and why not."""
    ok, reason = kernel_device_ok(t)
    if ok and t.dtype not in FLOAT_KERNEL_DTYPES:
        ok, reason = False, f"dtype {t.dtype} (kernels take float16, bfloat16, float32)"
    if ok and t.dtype == torch.bfloat16 and t.device.type == "cpu":
        ok, reason = False, "bfloat16 under the Triton interpreter (not exact there)"
    return ok, reason


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host code. Triton's ``triton.cdiv`` and ``triton.next_power_of_2`` are
    constexpr functions: each host call goes through their wrapper (about 2 us), and a launch plan
    makes several per call."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= ``n`` (0 for 0), as ``triton.next_power_of_2`` for host code."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


@functools.lru_cache(maxsize=None)
def sm_count(device_index: int) -> int:
    """The streaming multiprocessors of CUDA device ``device_index`` (read once per device)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


class _ReferenceCalls(threading.local):
    count = 0  # per thread (each nn.DataParallel replica runs its forward in its own)


_REFERENCE_CALLS = _ReferenceCalls()


def note_reference() -> None:
    """Record that an op chose its torch reference over its kernels for this call. Called by the
    ops where they choose (:func:`warn_fallback` does it), counted per thread. A caller that
    reports what ran (a feature's call counts) compares :func:`reference_calls` before and after
    an op call: a plain Python read, no device work or sync on the kernels' path."""
    _REFERENCE_CALLS.count += 1


def reference_calls() -> int:
    """How many op calls of this thread ran their torch reference so far (see :func:`note_reference`)."""
    return _REFERENCE_CALLS.count


_warned: set[tuple[str, str]] = set()


def warn_fallback(op: str, reason: str, reference: bool = True) -> None:
    """Warn once per (op, reason) that the torch reference runs instead of the kernel, and count the
    call as one that ran the reference (:func:`note_reference`). ``reference=False``: the message
    is about the caller's own fallback (a feature running the model's eager code), not counted."""
    if reference:
        _REFERENCE_CALLS.count += 1
    key = (op, reason)
    if key in _warned:
        return
    _warned.add(key)
    what = "running the torch reference: " if reference else ""
    warnings.warn(f"deepspeed_fused.{op}: {what}{reason}", RuntimeWarning, stacklevel=3)


def fallback_reported(op: str, reason: str) -> None:
    """The user has been told (a report row) that ``op`` runs its torch reference for ``reason``:
    :func:`warn_fallback` does not warn about it again (the calls are still counted)."""
    _warned.add((op, reason))


def device_reason(device_type: str) -> str:
    """The reason an op gives for tensors on ``device_type`` that no kernel can take (no GPU)."""
    return f"tensors on {device_type} (kernels need CUDA)"


def reset_fallback_warnings() -> None:
    """Forget which fallbacks have warned (tests use this)."""
    _warned.clear()


class CachedLaunches:
    """Launches Triton kernels for keys seen before without the JIT's per-call work.

    ``kernel[grid](...)`` binds and specializes every argument on every call (tens of
    microseconds of Python for kernels with many arguments), which is on the critical path of
    short kernels and of autograd backwards. Callers give a ``key`` that fixes everything the
    JIT specializes on for that call site (shapes and strides, dtypes, device, pointer
    alignment, grid): the first launch of a key goes through the JIT, which compiles if needed;
    later launches of the key call the compiled kernel's C launcher directly with the same
    argument list. Pointers may be passed as integers (``t.data_ptr()``), which also skips the
    launcher's per-pointer driver query. Under the interpreter, on CPU tensors, or while Triton
    launch hooks are installed (profilers), every launch goes through the JIT.
    """

    def __init__(self):
        self._compiled: dict = {}

    def get(self, key):
        """The direct launcher of ``key`` (``fn(stream, *args)``) or None; None as well while
        Triton launch hooks are installed."""
        fn = self._compiled.get(key)
        if fn is not None and _launch_hooks():
            return None
        return fn

    def launch(self, kernel, key, grid: tuple, args: tuple, constexprs: dict, num_warps: int,
               device_index: Optional[int]) -> None:
        """``kernel[grid](*args, **constexprs, num_warps=num_warps)``; ``constexprs`` in the
        kernel's parameter order (they follow ``args`` in its signature). ``grid`` must be fixed
        by ``key``."""
        fn = self.get(key) if device_index is not None else None
        if fn is not None:
            fn(_raw_stream(device_index), *args)
            return
        compiled = kernel[grid](*args, **constexprs, num_warps=num_warps)
        if device_index is not None:
            fn = direct_launcher(compiled, grid, tuple(constexprs.values()))
            if fn is not None:
                self._compiled[key] = fn

    def clear(self) -> None:
        self._compiled.clear()


def direct_launcher(compiled, grid: tuple, constexpr_values: tuple):
    """``fn(stream, *args)`` launching ``compiled`` (what ``kernel[grid](...)`` returned) on
    ``grid`` through its C launcher, or None when this Triton's launcher is not the one known
    here (then callers keep using the JIT)."""
    run = getattr(compiled, "run", None)
    launch = getattr(run, "launch", None)
    function = getattr(compiled, "function", None)
    meta = getattr(compiled, "packed_metadata", None)
    if launch is None or function is None or meta is None or not _known_launcher(run):
        return None
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return None  # the launcher would allocate scratch per call: keep the JIT's path
    g0 = grid[0]
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    coop, pdl = bool(getattr(run, "launch_cooperative_grid", False)), bool(getattr(run, "launch_pdl", False))
    tail = tuple(constexpr_values)
    parts = (launch, g0, g1, g2, function, coop, pdl, meta, tail)
    launch, grid3, fixed, tail = launch_binding(parts)

    def fn(stream, *args):
        launch(*grid3, stream, *fixed, *args, *tail)

    fn.parts = parts  # for callers that bind the launch into their own closure (launch_binding)
    fn.compiled = compiled  # for launch descriptions handed to the C++ node (ops/rms_norm/native.py)
    return fn


def launch_binding(parts: tuple) -> tuple:
    """``(launch, grid, fixed, tail)`` of a direct launcher's ``parts`` (``fn.parts`` of
    :func:`direct_launcher`): ``launch(*grid, stream, *fixed, *args, *tail)`` launches the
    compiled kernel on ``stream`` with runtime arguments ``args`` (integer pointers, ints,
    floats). The one spelling of the C launcher's argument layout (grid, stream, function,
    cooperative, PDL, two scratch pointers, the packed metadata, three hooks; then the arguments
    and the constexpr values): callers that make the launch in their own closure (the RMSNorm's
    fast paths) bind these once and make one C call per launch, with no Python call between;
    :class:`DirectKernel` binds ``fixed`` and ``tail`` and passes each call's own grid."""
    launch, g0, g1, g2, function, coop, pdl, meta, tail = parts
    return launch, (g0, g1, g2), (function, coop, pdl, None, None, meta, None, None, None), tail


def _spec(a):
    """What Triton's JIT specializes a runtime argument on (dtype and 16-byte alignment of a
    tensor; an int's type range, equality to 1 and divisibility by 16); other values exactly. A
    tensor's CUDA-ness too: a CPU tensor gets its own key, so its first launch goes through the
    JIT, which rejects it (an integer pointer would skip that check)."""
    if isinstance(a, torch.Tensor):
        return (a.dtype, not a.data_ptr() & 15, a.is_cuda)
    t = type(a)
    if t is int:
        return (a == 1, not a & 15, -0x80000000 <= a < 0x80000000, a < 0x8000000000000000)
    if t is float:
        return t
    return (t, a)


class DirectKernel:
    """``kernel[grid](*args, **constexprs, num_warps=num_warps)`` for call sites whose sizes (and
    so grids) change from call to call: the first call of a specialization goes through the JIT
    (which compiles), later ones call the compiled kernel's C launcher with integer pointers and
    this call's grid. The key is what the JIT specializes on (:func:`_spec` of each runtime
    argument) plus the constexprs, warps and device. CPU tensors (the interpreter), launch hooks,
    a current device other than the tensors' and unknown launchers take the JIT path."""

    _MAX = 1024

    def __init__(self, kernel, **options):
        # options: Triton compile options fixed for this kernel (enable_fp_fusion=False where a
        # kernel must round every step as eager does: a contracted a * b + c skips a rounding)
        self.kernel = kernel
        self.options = options
        self._parts: dict = {}

    def __call__(self, grid: tuple, args: tuple, constexprs: dict, num_warps: int) -> None:
        t = args[0]
        if t.is_cuda and not _launch_hooks():
            dev = t.device.index
            if dev is not None and _current_device() == dev:
                key = (tuple(map(_spec, args)), tuple(constexprs.values()), num_warps, dev)
                parts = self._parts.get(key)
                if parts is not None:
                    launch, fixed, tail = parts
                    g1 = grid[1] if len(grid) > 1 else 1
                    g2 = grid[2] if len(grid) > 2 else 1
                    launch(grid[0], g1, g2, _raw_stream(dev), *fixed,
                           *[a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args], *tail)
                    return
                compiled = self.kernel[grid](*args, **constexprs, num_warps=num_warps, **self.options)
                fn = direct_launcher(compiled, grid, tuple(constexprs.values()))
                if fn is not None:
                    if len(self._parts) >= self._MAX:
                        self._parts.clear()
                    launch, _, fixed, tail = launch_binding(fn.parts)  # this call's grid is given per call
                    self._parts[key] = (launch, fixed, tail)
                return
        self.kernel[grid](*args, **constexprs, num_warps=num_warps, **self.options)

    def clear(self) -> None:
        self._parts.clear()


_KNOWN_LAUNCHER: list = []


def _known_launcher(run) -> bool:
    """Whether ``run`` is the NVIDIA launcher with the argument layout ``direct_launcher`` passes
    (grid, stream, function, cooperative, pdl, two scratch pointers, metadata, hooks, args)."""
    if type(run).__name__ != "CudaLauncher":
        return False
    if not _KNOWN_LAUNCHER:
        try:
            from triton.backends.nvidia import driver

            _KNOWN_LAUNCHER.append(getattr(driver, "_BASE_ARGS_FORMAT", None) == "iiiKKppOOOOOO")
        except Exception:  # pragma: no cover - depends on the Triton version
            _KNOWN_LAUNCHER.append(False)
    return _KNOWN_LAUNCHER[0]


# The CUDA state the direct launches read, bound once (None in torch builds without CUDA, where
# no caller reaches them): the current device, a device's current raw stream, whether the current
# stream is being captured into a CUDA graph.
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
_stream_capturing = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


try:
    from triton import knobs as _knobs

    _RUNTIME_KNOBS = _knobs.runtime
except Exception:  # pragma: no cover - Triton absent or older
    _RUNTIME_KNOBS = None


# DEEPSPEED_FUSED_JIT_LAUNCH=1 (read at import): every launch goes through Triton's JIT, as while
# launch hooks are installed (for debugging the direct launches).
_JIT_ONLY = os.environ.get("DEEPSPEED_FUSED_JIT_LAUNCH", "0") not in ("", "0")


def _launch_hooks() -> bool:
    """Whether Triton launch hooks are installed (then the JIT path runs them), or the JIT is
    forced for every launch (``DEEPSPEED_FUSED_JIT_LAUNCH``)."""
    rt = _RUNTIME_KNOBS
    if rt is None or _JIT_ONLY:
        return _JIT_ONLY
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    return bool(getattr(enter, "calls", enter)) or bool(getattr(leave, "calls", leave))


class on_device:
    """Launch on the tensor's CUDA device (a context manager) (Triton launches on the current one)."""

    def __init__(self, t: torch.Tensor):
        self.ctx = None
        if t.is_cuda and t.device.index is not None and t.device.index != torch.cuda.current_device():
            self.ctx = torch.cuda.device(t.device.index)

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()

    def __exit__(self, *a):
        if self.ctx is not None:
            self.ctx.__exit__(*a)
