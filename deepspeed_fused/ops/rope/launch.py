"""Launch plans and launches of the rotation kernel.

Everything a call derives from its inputs' metadata (geometry, block sizes, program counts, the
kernel's arguments) is a :class:`_Plan`, cached per shape/stride/dtype/device/alignment key. The
first launch of a key goes through Triton's JIT; later ones through the compiled kernel's C
launcher. The tuning knobs are this module's attributes (the benchmark's sweep sets them, then
calls :func:`clear_plans`).
"""
from __future__ import annotations

import weakref
from typing import Optional

import torch

from .._common import on_device as _on_device
from .._common import _current_device, _launch_hooks, _raw_stream, cdiv, direct_launcher, next_power_of_2
from .checks import _GRAD_REASON, _check, _check_types, _InvalidType
from .kernels import _CODE
from . import kernels as _kernels
from .spec import RopeSpec, compute_dtype

# Tuning knobs (module attributes: the benchmark's sweep sets them).
_TILE_PAIRS = 2048  # rows x pairs per program
_MAX_BLOCK_R = 64
_NUM_WARPS = 4
# q's and k's tiles in one proportional order instead of all of q's first (see the kernel); off until
# the sweep (``bench rope --sweep``) shows it pays
_INTERLEAVE_QK = False
# per-position angles: read each pair's second column only where it differs from the first (a flag
# computed on the device once per cos/sin tensor, see :func:`_same_halves`)
_SHARE_HALVES = True


class _Plan:
    """Everything a call derives from its inputs' metadata (one per key): the geometry of q and k,
    block sizes, program counts, the forward's kernel arguments; the backward's per gradient
    layout (``bwd``)."""

    __slots__ = ("key", "spec", "rdim", "head_dim", "geos", "x_dtype", "prod", "acc_bwd", "common", "tail", "progs",
                 "dev", "fwd_args", "fwd_const", "bwd")

    def __init__(self, key, spec: RopeSpec, x: torch.Tensor, x_dtype: torch.dtype, angle_dtype: torch.dtype,
                 checked: tuple, angle_steps: tuple = (1, 1)):
        rdim, pairs, geos = checked
        self.key, self.spec, self.rdim, self.geos, self.x_dtype = key, spec, rdim, geos, x_dtype
        self.head_dim = d = x.shape[-1]
        ct = compute_dtype(spec, x_dtype, angle_dtype)
        self.prod = _CODE[ct]
        self.acc_bwd = _CODE[x_dtype if spec.grad_accum == "input" else ct]
        block_h = next_power_of_2(pairs)
        n_max = max(g.n_rows for g in geos)
        cap = _MAX_BLOCK_R if x.is_cuda else 4096  # the interpreter: few programs
        block_r = max(1, min(max(1, _TILE_PAIRS // block_h), cap, next_power_of_2(max(n_max, 1))))
        rest = d - rdim
        self.common = dict(BLOCK_R=block_r, BLOCK_H=block_h,
                           BLOCK_P=next_power_of_2(min(rest, 128)) if rest else 1,
                           PAIRS=spec.pairing == "adjacent", ANGLE_PAIR=spec.angles != "position",
                           HALVES=spec.output == "halves", NEG=spec.negate, CONTRACT=spec.contract == "complex",
                           INTERLEAVE=bool(_INTERLEAVE_QK))
        # the rotated columns' offset and the pass-through columns [ps, pe): after the rotated ones,
        # or before them (tail); then the steps of cos's and sin's last dims
        self.tail = ((pairs, rest, 0, rest) if spec.tail else (pairs, 0, rdim, d)) + tuple(angle_steps)
        self.progs = tuple(cdiv(g.n_rows, block_r) for g in geos)
        self.dev = x.device.index if x.is_cuda else None
        self.bwd = {}
        self.fwd_args = self.fwd_const = None

    def set_forward(self, q: torch.Tensor, k: Optional[torch.Tensor]) -> None:
        ints = tuple(g.ints(x.stride(), g.y_strides) for g, x in zip(self.geos, (q, k)))
        if len(ints) == 1:
            ints = ints * 2
        self.fwd_args = ints[0] + ints[1] + self.tail
        self.fwd_const = dict(self.common, BACKWARD=False, PROD=self.prod, ACC=self.prod,
                              PASS=self.rdim < self.head_dim, TWO=len(self.geos) == 2)

    def dx_strides(self, i: int, keep: tuple) -> tuple:
        """The strides of input ``i``'s gradient: contiguous, or the input's own layout where
        ``keep[i]`` (see :func:`api.grad_layout_is_free`)."""
        return self.geos[i].y_strides if keep[i] else self.geos[i].dx_strides

    def backward_entry(self, present: tuple, grads: tuple, keep: tuple = (False, False)):
        """(args, programs of the first tensor, all programs, constexprs, launch key) of the backward
        launch for the gradients ``grads`` of the outputs ``present`` (indices into geos), each
        written with :meth:`dx_strides`."""
        bkey = tuple((i, g.stride(), g.dtype, g.data_ptr() & 15, keep[i]) for i, g in zip(present, grads))
        entry = self.bwd.get(bkey)
        if entry is None:
            ints = tuple(self.geos[i].ints(g.stride(), self.dx_strides(i, keep)) for i, g in zip(present, grads))
            if len(ints) == 1:
                ints = ints * 2
            np0 = self.progs[present[0]]
            total = np0 + (self.progs[present[1]] if len(present) == 2 else 0)
            const = dict(self.common, BACKWARD=True, PROD=self.prod, ACC=self.acc_bwd, PASS=self.rdim < self.head_dim,
                         TWO=len(present) == 2)
            entry = self.bwd[bkey] = (ints[0] + ints[1] + self.tail, np0, total, const, (self.key, "bwd", bkey))
        return entry


_MAX_PLANS = 1024
_plans: dict = {}
_direct: dict = {}  # launch key -> the compiled kernel's direct launcher


def clear_plans() -> None:
    """Forget the launch plans, direct launchers and angle flags (the benchmark's sweep changes the
    knobs)."""
    _plans.clear()
    _direct.clear()
    _same_cache.clear()


def _key(q, k, cos, sin, ud, spec, tag=None):
    """Everything the checks and the plan read: shapes, strides, dtypes, devices, 16-byte alignment."""
    return (spec, ud, q.shape, q.stride(), q.dtype, q.device, q.data_ptr() & 15,
            None if k is None else (k.shape, k.stride(), k.dtype, k.device, k.data_ptr() & 15),
            cos.shape, cos.stride(), cos.dtype, cos.device, cos.data_ptr() & 15,
            sin.shape, sin.stride(), sin.dtype, sin.device, sin.data_ptr() & 15, tag)


def _get_plan(q, k, cos, sin, ud, spec, key=None, x_dtype=None):
    """The plan of these inputs, or a str saying why the kernels do not take them; raises a
    :class:`RopeInputError` for inputs eager rejects too. ``x_dtype``: the backward-only plans of
    the custom op (q and k are then the gradients, x_dtype the inputs' dtype)."""
    if not isinstance(spec, RopeSpec):
        raise _InvalidType(f"rope: spec must be a RopeSpec, got {type(spec).__name__}")
    if key is None:
        _check_types(q, k, cos, sin, ud)
        key = _key(q, k, cos, sin, ud, spec, x_dtype)
    plan = _plans.get(key)
    if plan is not None:
        if cos.requires_grad or sin.requires_grad:
            return _GRAD_REASON
        return plan
    checked = _check(q, k, cos, sin, ud, spec)
    if isinstance(checked, str):
        return checked  # not cached: some reasons (grad) depend on more than the key
    if spec.contract == "complex" and q.is_cuda:
        why = _complex_rounding(q.device)
        if why:
            return why
    if len(_plans) >= _MAX_PLANS:  # shapes that never repeat: start over rather than grow
        _plans.clear()
        _direct.clear()
    steps = (cos.stride(-1), sin.stride(-1)) if cos.shape[-1] > 1 else (1, 1)
    plan = _Plan(key, spec, q, x_dtype or q.dtype, cos.dtype, checked, steps)
    if x_dtype is None:
        plan.set_forward(q, k)
    _plans[key] = plan
    return plan



_COMPLEX_PROBES: dict = {}  # CUDA device index -> "" (the kernel rounds as its complex multiply) or why not


def _complex_rounding(device: torch.device) -> str:
    """"" when this device's complex64 multiply (forward, and autograd's gradient times the
    conjugate) equals the kernel's ``contract="complex"`` formula bit for bit on a probe of random
    pairs; otherwise why not (then the complex forms run eager here). Probed once per device."""
    why = _COMPLEX_PROBES.get(device.index)
    if why is None:
        why = _COMPLEX_PROBES[device.index] = _probe_complex(device)
    return why


def _probe_complex(device: torch.device, p: int = 37, layouts: tuple = ("contiguous", "transposed")) -> str:
    """The probe: ``p`` pairs per head (37, odd: no vectorized path of any width covers it exactly),
    ``freqs_cis`` laid out contiguously and as the product of a transposed matrix product (its
    pairs ``s`` apart: the layout some Hugging Face rotary embeddings build, which their eager
    multiply reads through its strided loop)."""
    spec = RopeSpec(pairing="adjacent", angles="pair", compute="float32", out_dtype="input", grad_accum="compute",
                    contract="complex")
    gen = torch.Generator().manual_seed(0)
    b, s, h = 2, 64, 4
    x = torch.randn(b, s, h, 2 * p, generator=gen).to(device)
    g = torch.randn(b, s, h, 2 * p, generator=gen).to(device)
    for layout in layouts:
        if layout == "contiguous":
            theta = torch.randn(b, s, p, generator=gen).to(device)
        else:
            theta = torch.randn(b, p, s, generator=gen).to(device).transpose(1, 2)
        cis = torch.polar(torch.full_like(theta, 1.25), theta)
        ri = torch.view_as_real(cis)
        cos, sin = ri[..., 0], ri[..., 1]
        checked = _check(x, None, cos, sin, 2, spec, cpu_rule=False)
        if isinstance(checked, str):  # pragma: no cover - the probe's inputs are the kernels'
            return checked
        plan = _Plan(("complex probe", device, layout), spec, x, x.dtype, cos.dtype, checked,
                     (cos.stride(-1), sin.stride(-1)))
        plan.set_forward(x, None)
        with torch.enable_grad():
            xc = torch.view_as_complex(x.reshape(b, s, h, p, 2)).detach().requires_grad_()
            want = xc * cis[:, :, None, :]
            (want_dx,) = torch.autograd.grad(want, xc, torch.view_as_complex(g.reshape(b, s, h, p, 2)))
        got = _forward(plan, x, None, cos, sin)[0]
        got_dx = _backward(plan, (g, None), cos, sin)[0]
        if not (torch.equal(got, torch.view_as_real(want.detach()).flatten(3))
                and torch.equal(got_dx, torch.view_as_real(want_dx).flatten(3))):
            return (f"complex multiply: {device}'s complex64 multiply ({layout} freqs_cis) rounds otherwise than "
                    "the kernel's fma(a, c, -(b * d)), fma(a, d, b * c)")
    return ""


_ZEROS: dict = {}  # device -> an int32 zero (the flag of angles read in full)
_SAME_MAX = 4
_same_cache: list = []  # (weakref to cos, to sin, (their versions, the stream), the flag), most recent first


def _zero_flag(device: torch.device) -> torch.Tensor:
    flag = _ZEROS.get(device)
    if flag is None:
        flag = _ZEROS[device] = torch.zeros((), dtype=torch.int32, device=device)
    return flag


def _same_halves(plan: _Plan, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The kernel's ``SAME`` flag: an int32 on the device, 1 when the per-position angles hold in
    each pair's second column the very bits of its first (cos's and sin's columns ``[h, 2h)`` equal
    to ``[0, h)``, or the odd columns to the even ones for adjacent pairs), else 0. Then the kernel
    reads only the first columns and computes what it computes from both. Compared on the device
    (no host sync) and kept per cos/sin tensor, version and stream, so the model's layers, which
    share one cos/sin, compare once per forward."""
    if plan.common["ANGLE_PAIR"] or not _SHARE_HALVES:
        return _zero_flag(cos.device)
    versions = None
    # under CUDA-graph capture the graph keeps a flag of its own (a cached one may be freed before
    # the graph's last replay)
    if not (cos.is_cuda and torch.cuda.is_current_stream_capturing()):
        try:
            # the stream too: a flag is read only on the stream that wrote it (and that the
            # allocator orders its reuse on)
            versions = (cos._version, sin._version, _raw_stream(cos.device.index) if cos.is_cuda else None)
        except RuntimeError:  # inference tensors keep no version: compare on every call
            pass
    if versions is not None:
        for rc, rs, v, flag in tuple(_same_cache):
            if rc() is cos and rs() is sin and v == versions:
                return flag
    h = plan.rdim // 2
    ints = {2: torch.int16, 4: torch.int32}[cos.element_size()]

    def halves(t):
        t = t[..., :2 * h].view(ints)  # the bits: -0.0 and +0.0 differ, a NaN equals its own bits
        return (t[..., 0::2], t[..., 1::2]) if plan.common["PAIRS"] else (t[..., :h], t[..., h:])

    (c0, c1), (s0, s1) = halves(cos), halves(sin)
    flag = torch.logical_and(torch.eq(c0, c1).all(), torch.eq(s0, s1).all()).to(torch.int32)
    if versions is not None:
        _same_cache.insert(0, (weakref.ref(cos), weakref.ref(sin), versions, flag))
        del _same_cache[_SAME_MAX:]
    return flag


def _launch(plan: _Plan, lkey, x0, y0, x1, y1, cos, sin, np0: int, total: int, args: tuple, const: dict,
            same: Optional[torch.Tensor] = None) -> None:
    """One launch: programs [0, np0) rotate x0 into y0, the rest x1 into y1. The first launch of a
    key goes through Triton's JIT (which compiles), later ones through the compiled kernel's C
    launcher (pointers as ints; the key fixes everything the JIT specializes on)."""
    if total == 0:
        return
    if same is None:
        same = _same_halves(plan, cos, sin)
    dev = plan.dev
    direct = dev is not None and not _launch_hooks() and _current_device() == dev
    if direct:
        fn = _direct.get(lkey)
        if fn is not None:
            fn(_raw_stream(dev), x0.data_ptr(), y0.data_ptr(), x1.data_ptr(), y1.data_ptr(), cos.data_ptr(),
               sin.data_ptr(), same.data_ptr(), np0, *args)
            return
    grid = (total,)
    with _on_device(x0):
        compiled = _kernels._rope_kernel[grid](x0, y0, x1, y1, cos, sin, same, np0, *args, **const,
                                               num_warps=_NUM_WARPS, enable_fp_fusion=False)
    if direct:
        fn = direct_launcher(compiled, grid, tuple(const.values()))
        if fn is not None:
            _direct[lkey] = fn


def _forward(plan: _Plan, q, k, cos, sin, outs=None, same=None):
    """The outputs, fresh (or ``outs``, in the plan's layout: tests poison them); ``same``: the
    kernel's angle flag where the caller holds it (else :func:`_same_halves`)."""
    g0 = plan.geos[0]
    yq = torch.empty_strided(q.shape, g0.y_strides, dtype=g0.out_dtype, device=q.device) if outs is None else outs[0]
    if outs is not None and any(o.stride() != g.y_strides for o, g in zip(outs, plan.geos)):
        raise ValueError("rope: outs must have the plan's output strides")
    if k is None:
        _launch(plan, plan.key, q, yq, q, yq, cos, sin, plan.progs[0], plan.progs[0], plan.fwd_args, plan.fwd_const,
                same)
        return yq, None
    g1 = plan.geos[1]
    yk = torch.empty_strided(k.shape, g1.y_strides, dtype=g1.out_dtype, device=k.device) if outs is None else outs[1]
    _launch(plan, plan.key, q, yq, k, yk, cos, sin, plan.progs[0], plan.progs[0] + plan.progs[1], plan.fwd_args,
            plan.fwd_const, same)
    return yq, yk


def _backward(plan: _Plan, grads: tuple, cos, sin, outs=None, keep: tuple = (False, False), same=None) -> list:
    """Input gradients of the outputs whose gradients ``grads`` holds (None: no gradient), in the
    inputs' dtype, contiguous as eager autograd leaves them, or in the input's own layout where
    ``keep`` says so (or into ``outs``); one launch for both."""
    present = tuple(i for i, g in enumerate(grads) if g is not None)
    out = [None] * len(grads)
    if not present:
        return out
    gs = tuple(grads[i] for i in present)
    args, np0, total, const, lkey = plan.backward_entry(present, gs, keep)
    dxs = [torch.empty_strided(g.shape, plan.dx_strides(i, keep), dtype=plan.x_dtype, device=g.device)
           if outs is None else outs[i] for i, g in zip(present, gs)]
    if outs is not None and any(dx.stride() != plan.dx_strides(i, keep) for i, dx in zip(present, dxs)):
        raise ValueError("rope: outs must have the plan's gradient strides")
    x1, y1 = (gs[1], dxs[1]) if len(gs) == 2 else (gs[0], dxs[0])
    _launch(plan, lkey, gs[0], dxs[0], x1, y1, cos, sin, np0, total, args, const, same)
    for i, dx in zip(present, dxs):
        out[i] = dx
    return out
