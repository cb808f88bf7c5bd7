"""The RMSNorm's C++ autograd node: its build (once, with torch's ``cpp_extension``) and the
hand-over of launch plans to it.

A Python ``autograd.Function`` costs each call a Python context in the forward and, in the
backward, a hand-over from autograd's device thread to Python; for short kernels that is more
host time than the kernels take on the device. ``ops/csrc/rms_norm_node.cpp`` is the same node in
C++: Python registers a launch plan once per input layout (the compiled Triton kernel's CUfunction,
grid, block, shared memory and parameter list, see :func:`describe`), and later calls allocate
and launch without Python in between. The node knows nothing of Triton; it packs parameters as
Triton's launcher does and calls ``cuLaunchKernel``.

The extension is built the first time a CUDA op asks for it, in a child process (the Python
node serves meanwhile), into ``TORCH_EXTENSIONS_DIR`` (cached across runs), like DeepSpeed's own
JIT-built ops; a later call that finds the child done imports the built library (a ``dlopen``).
The build runs in another process, not in a thread of this one: importing ``cpp_extension`` (and
setuptools) and loading even a cached build is seconds of Python holding the GIL, which a thread
here would take from the calls running meanwhile. ``get(wait=True)`` builds (or waits) before
returning, for an explicit warm-up. ``DEEPSPEED_FUSED_NATIVE=0`` switches it off; so does a failed
build (one warning).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
import warnings
from typing import Optional

import torch

from .._common import interpreter_active
from .plans import (AS_LLAMA, FormKey, FwdKey, NativeEntry, NativePending, TensorKey, _bwd_fast, _contiguous_strides,
                    _form_bwd_fast, _form_fwd_fast, _form_fwd_plans, _fwd_fast, _fwd_plans, _launches, _native_ids,
                    _native_pending, _native_plans)

ENV = "DEEPSPEED_FUSED_NATIVE"
_SOURCE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "csrc", "rms_norm_node.cpp")
# torch's extension cache keys a build on its sources and flags, not on torch's version: the name
# carries it, so a torch upgrade builds afresh instead of loading a library built for another ABI
_NAME = "deepspeed_fused_rms_norm_node_" + re.sub(r"[^0-9A-Za-z]", "_", torch.__version__)

_lock = threading.Lock()
_state: dict = {"mod": None, "thread": None, "error": None}

# parameter kinds (csrc/rms_norm_node.cpp's ``Kind``)
PTR, I32, I64, U32, U64, EPS_F32 = range(6)
EPS = object()  # in a template: the call's eps, a float32 parameter
_INT_KINDS = {"i32": I32, "i64": I64, "u32": U32, "u64": U64}


def enabled() -> bool:
    """Whether the native nodes may be used here (CUDA present, not the interpreter, not
    switched off with ``DEEPSPEED_FUSED_NATIVE=0``, no failed build)."""
    if os.environ.get(ENV, "1").strip().lower() in ("0", "false", "off", "no"):
        return False
    if _state["error"] is not None or interpreter_active():
        return False
    if _state.get("cuda") is None:  # asked once (with NVML-based checks each query is a driver call)
        _state["cuda"] = torch.cuda.is_available()
    return _state["cuda"]


def compile_extension():
    """Build (or load the cached build of) the extension; it needs a C++ compiler and ninja, not
    CUDA. Its ``init_driver()`` then says whether the CUDA driver could be loaded."""
    from torch.utils.cpp_extension import load

    return load(name=_NAME, sources=[_SOURCE], extra_cflags=["-O2"], extra_ldflags=["-ldl"], verbose=False)


def _check_driver(mod):
    if not mod.init_driver():
        raise RuntimeError("libcuda.so.1 (cuLaunchKernel, cuStreamIsCapturing) could not be loaded")
    return mod


def _build():
    return _check_driver(compile_extension())


# the child: torch's cpp_extension build (or cached load) of the node; prints the library's path
_CHILD = ("import sys\n"
          "from torch.utils.cpp_extension import load\n"
          "m = load(name=sys.argv[1], sources=[sys.argv[2]], extra_cflags=['-O2'], extra_ldflags=['-ldl'], "
          "verbose=False)\n"
          "print(m.__file__)\n")


class _BuildProcess:
    """The build in a child process, with a thread's ``is_alive``/``join`` (the test harness waits
    on either before a rank exits). Its output goes to temporary files (a pipe could fill up)."""

    def __init__(self):
        self.out = tempfile.TemporaryFile(mode="w+")
        self.err = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, _NAME, _SOURCE], stdin=subprocess.DEVNULL,
                                     stdout=self.out, stderr=self.err, close_fds=True)
        self.pid = self.proc.pid

    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def join(self, timeout=None) -> None:
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def result(self):
        """The built module (imported here: a dlopen), or an exception with the child's output."""
        self.out.seek(0)
        self.err.seek(0)
        lines = self.out.read().strip().splitlines()
        if self.proc.returncode != 0 or not lines:
            tail = self.err.read()[-2000:].strip()
            raise RuntimeError(f"the build process exited with {self.proc.returncode}: {tail}")
        import importlib.util

        spec = importlib.util.spec_from_file_location(_NAME, lines[-1])
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        return mod


def _failed(e: Exception) -> None:
    # no compiler, no headers, ...: the Python path keeps running
    _state["error"] = f"{type(e).__name__}: {e}"
    warnings.warn(f"deepspeed_fused: the C++ autograd nodes could not be built ({_state['error'][:400]}); "
                  f"the Python autograd path runs (set {ENV}=0 to skip the build)", RuntimeWarning, stacklevel=3)


def _build_into_state():
    try:
        _state["mod"] = _build()
    except Exception as e:
        _failed(e)


def _collect(t) -> None:
    """Take the finished child's module into the state (under ``_lock``)."""
    if _state["mod"] is not None or _state["error"] is not None:
        return
    try:
        _state["mod"] = _check_driver(t.result())
    except Exception as e:
        _failed(e)


def get(wait: bool = False):
    """The extension module, or None (not enabled, failed, or still building). The first call
    starts the build in a child process and returns None; a later call after the child is done
    imports its library. ``wait=True`` builds here (or waits for the child) before returning."""
    mod = _state["mod"]
    if mod is not None or not enabled():
        return mod
    t = _state["thread"]
    if t is not None and not wait and t.is_alive():  # the hot path while the build runs: one waitpid
        return None
    with _lock:
        if _state["mod"] is None and _state["error"] is None:
            t = _state["thread"]
            if t is None:
                if wait:
                    _build_into_state()
                    return _state["mod"]
                try:
                    _state["thread"] = _BuildProcess()
                except Exception as e:  # no interpreter to start (an embedded Python): build on demand
                    _failed(e)
                return _state["mod"]
            if wait:
                t.join()
            if not t.is_alive() and isinstance(t, _BuildProcess):
                _collect(t)
    return _state["mod"]


def building() -> bool:
    """Whether the background build is running."""
    t = _state["thread"]
    return t is not None and t.is_alive()


def error() -> Optional[str]:
    """Why the build failed, or None."""
    return _state["error"]


def describe(fn, template: list) -> Optional[tuple]:
    """``(function, grid, threads, shared, kinds, values)`` of a direct launcher ``fn`` (from
    ``_common.direct_launcher``) called with ``template`` (its runtime arguments: ``(PTR, slot)``
    for a tensor's pointer, an int, or :data:`EPS`), for ``register_*`` in the extension; None
    when the compiled kernel's signature does not match or needs what the node does not do
    (cooperative or PDL launches, clusters, scratch memory, argument types other than pointers,
    integers and eps)."""
    compiled = getattr(fn, "compiled", None)
    parts = getattr(fn, "parts", None)
    sig = getattr(getattr(compiled, "src", None), "signature", None)
    md = getattr(compiled, "metadata", None)
    if compiled is None or parts is None or not isinstance(sig, dict) or md is None:
        return None
    _launch, g0, g1, g2, function, coop, pdl, _meta, tail = parts
    if coop or pdl or getattr(md, "num_ctas", 1) != 1:
        return None
    if getattr(md, "global_scratch_size", 0) or getattr(md, "profile_scratch_size", 0):
        return None
    values = list(template) + list(tail)
    types = list(sig.values())
    if len(values) != len(types):
        return None
    kinds, vals = [], []
    for v, ty in zip(values, types):
        if ty == "constexpr":
            continue
        if not isinstance(ty, str):
            return None
        if ty.startswith("*"):
            if not (isinstance(v, tuple) and len(v) == 2 and v[0] == PTR):
                return None
            kinds.append(PTR)
            vals.append(int(v[1]))
        elif ty == "fp32" and v is EPS:
            kinds.append(EPS_F32)
            vals.append(0)
        elif ty in _INT_KINDS and type(v) is int:
            kinds.append(_INT_KINDS[ty])
            vals.append(v)
        else:
            return None
    return int(function), (int(g0), int(g1), int(g2)), 32 * int(md.num_warps), int(md.shared), tuple(kinds), tuple(vals)


# ---- the hand-over: a forward key's launch descriptions, registered once the extension is built ----
def _offer_native(fast_key, bplan, bfn) -> None:
    """Note this key's launches for the C++ node when its inputs are aligned and the backward's
    incoming gradient is the planned one (contiguous, the output dtype, aligned), and register
    them if the extension is ready (else the forward's hot path registers them once it is)."""
    fkey, dstride, ddtype, dalign = fast_key
    fplan = _fwd_plans.get(fkey)
    k = FwdKey._make(fkey)
    if fkey in _native_plans or dalign or k.x_align or k.w_align or fplan is None:
        return
    if ddtype != fplan.out_dtype or dstride != _contiguous_strides(k.x_shape):
        return
    _native_pending[fkey] = NativePending(fast_key, bplan, bfn)
    _register_native(fkey)


def _register_native(fkey):
    """The C++ node's entry for forward key ``fkey`` (registered now if pending and the extension
    is built), or None. Safe to call from the forward's thread and autograd's device thread at once:
    the pending entry is taken by one of them."""
    pending = _native_pending.pop(fkey, None)
    if pending is None:
        return _native_plans.get(fkey)
    mod = get()
    if mod is None:
        if enabled():  # still building: ask again on a later call
            _native_pending.setdefault(fkey, pending)
        return None
    fast_key, bplan, bfn = pending
    fplan = _fwd_plans.get(fkey)
    ffn = _launches.get(fplan.lkey) if fplan is not None else None
    if ffn is None or _fwd_fast.get(fkey) is None or _bwd_fast.get(fast_key) is None:
        return None
    P = PTR
    fdesc = describe(ffn, [(P, 0), (P, 1), (P, 2), (P, 3)] + list(fplan.ints) + [EPS])
    ws_numel, n_cnt = bplan.ws_numel, bplan.n_cnt
    bdesc = describe(bfn, [(P, i) for i in range(8)] + list(bplan.ints))
    if fdesc is None or bdesc is None:
        _native_plans[fkey] = None  # not describable: this key keeps the Python node
        return None
    k = FwdKey._make(fkey)
    like = fplan.like
    dtypes = (k.x_dtype, k.w_dtype, fplan.out_dtype)
    ident = (fdesc, bdesc, dtypes, bool(like), int(ws_numel), int(n_cnt))
    plan_id = _native_ids.get(ident)
    if plan_id is None:  # the extension keeps every plan: one per distinct description
        plan_id = _native_ids[ident] = mod.register_rms_plan(
            *fdesc, *bdesc, *(torch.empty(0, dtype=d) for d in dtypes), bool(like), int(ws_numel), int(n_cnt))
    nat = _native_plans[fkey] = NativeEntry(mod.rms_norm, plan_id, fplan.dev)
    return nat


def _offer_native_form(fast_key, bplan, bfn) -> None:
    """:func:`_offer_native` for the other forms: x, the weight and the gate contiguous and aligned,
    the incoming gradient the planned one."""
    fkey, dstride, ddtype, dalign = fast_key
    fplan = _form_fwd_plans.get(fkey)
    k = FormKey._make(fkey)
    if fkey in _native_plans or dalign or k.x_align or fplan is None or fplan is AS_LLAMA:
        return
    wk = None if k.w is None else TensorKey._make(k.w)
    gk = None if k.g is None else TensorKey._make(k.g)
    if (wk is not None and wk.align) or (gk is not None and (gk.align or gk.stride != _contiguous_strides(gk.shape))):
        return
    if ddtype != fplan.out_dtype or dstride != _contiguous_strides(k.x_shape):
        return
    _native_pending[fkey] = NativePending(fast_key, bplan, bfn)
    _register_native_form(fkey)


def _register_native_form(fkey):
    """:func:`_register_native` for the other forms (the extension's ``rms_norm_form`` node)."""
    pending = _native_pending.pop(fkey, None)
    if pending is None:
        return _native_plans.get(fkey)
    mod = get()
    if mod is None:
        if enabled():
            _native_pending.setdefault(fkey, pending)
        return None
    fast_key, bplan, bfn = pending
    fplan = _form_fwd_plans.get(fkey)
    ffn = _launches.get(fplan.lkey) if fplan is not None else None
    if ffn is None or _form_fwd_fast.get(fkey) is None or _form_bwd_fast.get(fast_key) is None:
        return None
    k = FormKey._make(fkey)
    like, gated, out_dtype = fplan.like, fplan.gated, fplan.out_dtype
    has_w = k.w is not None
    P = PTR
    fdesc = describe(ffn, [(P, 0), (P, 1) if has_w else None, (P, 2), (P, 3), (P, 4) if gated else None]
                             + list(fplan.ints) + [EPS])
    ws_numel, n_cnt = bplan.ws_numel, bplan.n_cnt
    bdesc = describe(bfn, [(P, 0), (P, 1), (P, 2) if has_w else None, (P, 3), (P, 4), (P, 5), (P, 6),
                                   (P, 7) if has_w else None, (P, 8) if gated else None, (P, 9) if gated else None]
                             + list(bplan.ints))
    if fdesc is None or bdesc is None:
        _native_plans[fkey] = None
        return None
    xd = k.x_dtype
    dtypes = (xd, TensorKey._make(k.w).dtype if has_w else xd, out_dtype, TensorKey._make(k.g).dtype if gated else xd)
    ident = ("form", fdesc, bdesc, dtypes, bool(like), int(ws_numel), int(n_cnt), has_w, gated)
    plan_id = _native_ids.get(ident)
    if plan_id is None:
        e = [torch.empty(0, dtype=d) for d in dtypes]
        plan_id = _native_ids[ident] = mod.register_rms_form_plan(
            *fdesc, *bdesc, e[0], e[1], e[2], bool(like), int(ws_numel), int(n_cnt), has_w, gated, e[3])
    nat = _native_plans[fkey] = NativeEntry(mod.rms_norm_form, plan_id, fplan.dev)
    return nat
