"""The RMSNorm's launches: the forward and backward of the Llama form and of the other forms, from
their launch plans (``plans.py``), through the compiled kernels' C launchers once a plan has
launched (``_common.CachedLaunches``), and the fast closures that make a repeated call's one launch
with the plan unpacked into the closure's locals. ``native=True`` (the autograd Functions pass
``api.NATIVE``) offers a key's launches to the C++ node (``native.py``) once both directions have
launched directly."""
from __future__ import annotations

from typing import Optional

import torch

from .._common import _current_device, _launch_hooks, _raw_stream, _stream_capturing, launch_binding
from .._common import on_device as _on_device
from . import native as _native
from .kernels import _dw_reduce_kernel, _rms_fwd_form_kernel, _rms_fwd_kernel
from .plans import (_F32, AS_LLAMA, BwdKey, FormBwdKey, _bwd_fast, _bwd_inputs, _bwd_key, _bwd_plan, _bwd_plans,
                    _current_device_is, _form_bwd_fast, _form_bwd_key, _form_bwd_plan, _form_bwd_plans,
                    _form_fwd_fast, _form_fwd_plan, _form_fwd_plans, _form_key, _fwd_fast, _fwd_key, _fwd_plan,
                    _fwd_plans, _key_of, _launches, _ptr, _remember, _tkey, _workspace, _workspaces)
from .reference import RMSForm, form_output_dtype, output_dtype


def _make_fwd_fast(plan, fn):
    copy, wcopy, like, out_dtype, rshape, device, ints, grid, const, num_warps, dev, lkey, _, _ = plan
    parts = getattr(fn, "parts", None)
    if copy or wcopy or dev is None or parts is None:
        return None
    launch, grid3, fixed, tail = launch_binding(parts)
    write_rstd = const["WRITE_RSTD"]
    empty, empty_like, get_device, raw_stream, hooks = torch.empty, torch.empty_like, _current_device, _raw_stream, _launch_hooks

    def run(x, w, eps):
        if get_device() != dev or hooks():
            return None
        y = empty_like(x) if like else empty(x.shape, dtype=out_dtype, device=device)
        rstd = empty(rshape, dtype=_F32, device=device) if write_rstd else None
        launch(*grid3, raw_stream(dev), *fixed,
               x.data_ptr(), w.data_ptr(), y.data_ptr(), (rstd if write_rstd else y).data_ptr(), *ints, eps, *tail)
        return y, rstd

    return run


def _make_bwd_fast(plan, fn):
    (convert, out_dtype, xcopy, gcopy, wcopy, dx_like, device, kernel, ints, progs, const, num_warps, ws_numel,
     n_cnt, red, dev, lkey, _, _) = plan
    parts = getattr(fn, "parts", None)
    if convert or xcopy or gcopy or wcopy or not dx_like or dev is None or red is not None or parts is None:
        return None
    launch, grid3, fixed, tail = launch_binding(parts)
    rest = tuple(ints) + tuple(tail)
    empty_like, get_device, raw_stream, capturing, hooks = torch.empty_like, _current_device, _raw_stream, _stream_capturing, _launch_hooks
    workspaces = _workspaces
    k = BwdKey._make(_key_of(lkey))
    x_dtype, x_align, w_dtype, w_align = k.x_dtype, k.x_align, k.w_dtype, k.w_align

    def run(dy, x, w, rstd):
        if capturing() or get_device() != dev or hooks():
            return None
        # saved-tensor hooks may hand back other dtypes or layouts than the key's: the plan path then
        if (x.dtype != x_dtype or w.dtype != w_dtype or (x.data_ptr() & 15) != x_align
                or (w.data_ptr() & 15) != w_align or not x.is_contiguous() or rstd.data_ptr() & 15):
            return None
        stream = raw_stream(dev)
        ws = workspaces.get((dev, stream))
        if ws is None or ws[0].numel() < ws_numel or ws[1].numel() < n_cnt:
            ws = _workspace(device, dev, stream, ws_numel, n_cnt)
        dx = empty_like(x)
        dw = empty_like(w)
        launch(*grid3, stream, *fixed,
               dy.data_ptr(), x.data_ptr(), w.data_ptr(), rstd.data_ptr(), dx.data_ptr(), ws[0].data_ptr(),
               ws[1].data_ptr(), dw.data_ptr(), *rest)
        return dx, dw, None, None, None

    return run


def _forward_impl(x: torch.Tensor, w: torch.Tensor, eps: float, y: Optional[torch.Tensor] = None,
                  rstd: Optional[torch.Tensor] = None, write_rstd: bool = True, key=None):
    """Forward into fresh (or given, contiguous: tests poison them) ``y`` and ``rstd`` (``rstd``
    is None when ``write_rstd`` is False: no backward follows)."""
    if key is None:
        key = _fwd_key(x, w, write_rstd)
    plan = _fwd_plans.get(key)
    if plan is None:
        if x.numel() == 0:
            y = y if y is not None else torch.empty(x.shape, dtype=output_dtype(x, w), device=x.device)
            if write_rstd and rstd is None:
                rstd = torch.empty(x.shape[:-1], dtype=_F32, device=x.device)
            return y, rstd
        plan = _remember(_fwd_plans, key, _fwd_plan(x, w, write_rstd, key))
    copy, wcopy, like, out_dtype, rshape, device, ints, grid, const, num_warps, dev, lkey, _, _ = plan
    if copy:
        x = x.contiguous()
    if wcopy:
        w = w.contiguous()
    given = y is not None or rstd is not None
    if y is None:
        y = torch.empty_like(x) if like else torch.empty(x.shape, dtype=out_dtype, device=device)
    if write_rstd and rstd is None:
        rstd = torch.empty(rshape, dtype=_F32, device=device)
    r = rstd if write_rstd else y  # not written without WRITE_RSTD
    if dev is not None and not given and _current_device_is(dev):
        fn = _launches.get(lkey)
        if fn is not None:
            fn(_raw_stream(dev), x.data_ptr(), w.data_ptr(), y.data_ptr(), r.data_ptr(),
               *ints, eps)
            if key not in _fwd_fast:
                _fwd_fast[key] = _make_fwd_fast(plan, fn)
            return y, rstd
    args = (x, w, y, r) + ints + (float(eps),)
    with _on_device(x):
        if given:  # outputs of any alignment: not a cached launch
            _rms_fwd_kernel[grid](*args, **const, num_warps=num_warps)
        else:
            _launches.launch(_rms_fwd_kernel, lkey, grid, args, const, num_warps, dev)
    return y, rstd


def _backward_impl(dy: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rstd: torch.Tensor,
                   dx: Optional[torch.Tensor] = None, dw: Optional[torch.Tensor] = None, fast_key=None,
                   native: bool = False):
    """Backward into fresh (or given, contiguous: tests poison them) ``dx`` and ``dw``: one
    launch, the weight-gradient sum included. ``fast_key``: the autograd Function's key for
    this call's fast path (registered once the launch is direct)."""
    key = _bwd_key(dy, x, w, rstd)
    plan = _bwd_plans.get(key)
    if plan is None:
        if rstd.numel() == 0:
            dx = dx if dx is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
            dw = dw if dw is not None else torch.empty(w.shape, dtype=w.dtype, device=w.device)
            return dx, dw.zero_()
        plan = _remember(_bwd_plans, key, _bwd_plan(dy, x, w, rstd, key))
    (convert, out_dtype, xcopy, gcopy, wcopy, dx_like, device, kernel, ints, progs, const, num_warps, ws_numel,
     n_cnt, red, dev, lkey, _, _) = plan
    if convert or xcopy or gcopy:
        dy, x = _bwd_inputs(dy, x, convert, out_dtype, xcopy, gcopy)
    if wcopy:
        w = w.contiguous()
    given = dx is not None or dw is not None
    if dx is None:
        dx = torch.empty_like(x) if dx_like else torch.empty(x.shape, dtype=x.dtype, device=device)
    if dw is None:
        dw = torch.empty_like(w)
    if dev is not None:
        stream = _raw_stream(dev)
        part, cnt = _workspace(device, dev, stream, ws_numel, n_cnt)
        if not given and _current_device_is(dev):
            fn = _launches.get(lkey)
            fn_red = _launches.get(("red",) + lkey) if red is not None else True
            if fn is not None and fn_red is not None:
                fn(stream, dy.data_ptr(), x.data_ptr(), w.data_ptr(), rstd.data_ptr(), dx.data_ptr(), part.data_ptr(),
                   cnt.data_ptr(), dw.data_ptr(), *ints)
                if red is not None:
                    fn_red(stream, part.data_ptr(), dw.data_ptr(), progs, x.shape[-1])
                if fast_key is not None and fast_key not in _bwd_fast:
                    _bwd_fast[fast_key] = _make_bwd_fast(plan, fn)
                    if native and _native.enabled():
                        _native._offer_native(fast_key, plan, fn)
                return dx, dw
    else:
        part, cnt = _workspace(device, None, 0, ws_numel, n_cnt)
    args = (dy, x, w, rstd, dx, part, cnt, dw) + ints
    with _on_device(x):
        if given:
            kernel[(progs,)](*args, **const, num_warps=num_warps)
            if red is not None:
                _dw_reduce_kernel[red.grid](part, dw, progs, x.shape[-1], **red.const, num_warps=4)
        else:
            _launches.launch(kernel, lkey, (progs,), args, const, num_warps, dev)
            if red is not None:
                _launches.launch(_dw_reduce_kernel, ("red",) + lkey, red.grid, (part, dw, progs, x.shape[-1]),
                                 red.const, 4, dev)
    return dx, dw


def _form_forward_impl(x, w, g, eps: float, form: RMSForm, y=None, rstd=None, write_rstd: bool = True, key=None):
    """The form's forward into fresh (or given, contiguous: tests poison them) ``y`` and ``rstd``."""
    if key is None:
        key = _form_key(x, w, g, form, write_rstd)
    plan = _form_fwd_plans.get(key)
    if plan is None:
        if x.numel() == 0:
            out = form_output_dtype(form, x.dtype, None if w is None else w.dtype)
            y = y if y is not None else torch.empty(x.shape, dtype=out, device=x.device)
            if write_rstd and rstd is None:
                rstd = torch.empty(x.shape[:-1], dtype=_F32, device=x.device)
            return y, rstd
        plan = _remember(_form_fwd_plans, key, _form_fwd_plan(x, w, g, form, write_rstd, key))
    if plan is AS_LLAMA:  # rounds as the Llama form
        return _forward_impl(x, w, eps, y=y, rstd=rstd, write_rstd=write_rstd)
    copy, wcopy, like, out_dtype, rshape, device, ints, grid, const, num_warps, dev, lkey, gcopy, gated = plan
    if copy:
        x = x.contiguous()
    if wcopy:
        w = w.contiguous()
    if not gated:
        g = None
    elif gcopy:
        g = g.contiguous()
    given = y is not None or rstd is not None
    if y is None:
        y = torch.empty_like(x) if like else torch.empty(x.shape, dtype=out_dtype, device=device)
    if write_rstd and rstd is None:
        rstd = torch.empty(rshape, dtype=_F32, device=device)
    r = rstd if write_rstd else y
    if dev is not None and not given and _current_device_is(dev):
        fn = _launches.get(lkey)
        if fn is not None:
            fn(_raw_stream(dev), x.data_ptr(), _ptr(w), y.data_ptr(), r.data_ptr(), _ptr(g), *ints, eps)
            if key not in _form_fwd_fast:
                _form_fwd_fast[key] = _make_form_fwd_fast(plan, fn)
            return y, rstd
    args = (x, w, y, r, g) + ints + (float(eps),)
    with _on_device(x):
        if given:
            _rms_fwd_form_kernel[grid](*args, **const, num_warps=num_warps)
        else:
            _launches.launch(_rms_fwd_form_kernel, lkey, grid, args, const, num_warps, dev)
    return y, rstd


def _make_form_fwd_fast(plan, fn):
    copy, wcopy, like, out_dtype, rshape, device, ints, grid, const, num_warps, dev, lkey, gcopy, gated = plan
    parts = getattr(fn, "parts", None)
    if copy or wcopy or gcopy or dev is None or parts is None:
        return None
    launch, grid3, fixed, tail = launch_binding(parts)
    write_rstd = const["WRITE_RSTD"]
    empty, empty_like, get_device, raw_stream, hooks = torch.empty, torch.empty_like, _current_device, _raw_stream, _launch_hooks

    def run(x, w, g, eps):
        if get_device() != dev or hooks():
            return None
        y = empty_like(x) if like else empty(x.shape, dtype=out_dtype, device=device)
        rstd = empty(rshape, dtype=_F32, device=device) if write_rstd else None
        launch(*grid3, raw_stream(dev), *fixed,
               x.data_ptr(), None if w is None else w.data_ptr(), y.data_ptr(), (rstd if write_rstd else y).data_ptr(),
               g.data_ptr() if gated else None, *ints, eps, *tail)
        return y, rstd

    return run


def _form_backward_impl(dy, x, w, g, rstd, form: RMSForm, dx=None, dw=None, dg=None, fast_key=None,
                        native: bool = False):
    """The form's backward: (dx, dw or None, dgate or None), into fresh or given (contiguous) tensors."""
    key = _form_bwd_key(dy, x, w, g, rstd, form)
    plan = _form_bwd_plans.get(key)
    if plan is None:
        if rstd.numel() == 0:
            dx = dx if dx is not None else torch.empty(x.shape, dtype=x.dtype, device=x.device)
            if w is not None:
                dw = (dw if dw is not None else torch.empty(w.shape, dtype=w.dtype, device=w.device)).zero_()
            if g is not None:
                dg = dg if dg is not None else torch.empty(g.shape, dtype=g.dtype, device=g.device)
            return dx, dw, dg
        plan = _remember(_form_bwd_plans, key, _form_bwd_plan(dy, x, w, g, rstd, form, key))
    if plan is AS_LLAMA:
        dx, dw = _backward_impl(dy, x, w, rstd, dx=dx, dw=dw)
        return dx, dw, (None if g is None else torch.zeros_like(g) if dg is None else dg.zero_())
    (convert, out_dtype, xcopy, gcopy, wcopy, dx_like, device, kernel, ints, progs, const, num_warps, ws_numel,
     n_cnt, red, dev, lkey, g_copy, gated) = plan
    if convert or xcopy or gcopy:
        dy, x = _bwd_inputs(dy, x, convert, out_dtype, xcopy, gcopy)
    if wcopy:
        w = w.contiguous()
    gk = None
    if gated:
        gk = g.contiguous() if g_copy else g
    given = dx is not None or dw is not None or dg is not None
    if dx is None:
        dx = torch.empty_like(x) if dx_like else torch.empty(x.shape, dtype=x.dtype, device=device)
    if w is not None and dw is None:
        dw = torch.empty_like(w)
    if gated and dg is None:
        dg = torch.empty(g.shape, dtype=g.dtype, device=device)
    dgk = dg if gated else None
    if dev is not None:
        stream = _raw_stream(dev)
        part, cnt = _workspace(device, dev, stream, ws_numel, n_cnt)
        if not given and _current_device_is(dev):
            fn = _launches.get(lkey)
            fn_red = _launches.get(("red",) + lkey) if red is not None else True
            if fn is not None and fn_red is not None:
                fn(stream, dy.data_ptr(), x.data_ptr(), _ptr(w), rstd.data_ptr(), dx.data_ptr(), part.data_ptr(),
                   cnt.data_ptr(), _ptr(dw), _ptr(gk), _ptr(dgk), *ints)
                if red is not None:
                    fn_red(stream, part.data_ptr(), dw.data_ptr(), progs, dw.shape[0])
                if fast_key is not None and fast_key not in _form_bwd_fast:
                    _form_bwd_fast[fast_key] = _make_form_bwd_fast(plan, fn)
                    if native and _native.enabled():
                        _native._offer_native_form(fast_key, plan, fn)
                return dx, dw, (dg if g is not None else None)
    else:
        part, cnt = _workspace(device, None, 0, ws_numel, n_cnt)
    args = (dy, x, w, rstd, dx, part, cnt, dw, gk, dgk) + ints
    with _on_device(x):
        if given:
            kernel[(progs,)](*args, **const, num_warps=num_warps)
            if red is not None:
                _dw_reduce_kernel[red.grid](part, dw, progs, dw.shape[0], **red.const, num_warps=4)
        else:
            _launches.launch(kernel, lkey, (progs,), args, const, num_warps, dev)
            if red is not None:
                _launches.launch(_dw_reduce_kernel, ("red",) + lkey, red.grid, (part, dw, progs, dw.shape[0]),
                                 red.const, 4, dev)
    if g is not None and not gated:  # a gate the form did not use ("before" forms never get here without one)
        dg = torch.zeros_like(g) if dg is None else dg.zero_()
    return dx, dw, dg


def _make_form_bwd_fast(plan, fn):
    (convert, out_dtype, xcopy, gcopy, wcopy, dx_like, device, kernel, ints, progs, const, num_warps, ws_numel,
     n_cnt, red, dev, lkey, g_copy, gated) = plan
    parts = getattr(fn, "parts", None)
    if convert or xcopy or gcopy or wcopy or g_copy or not dx_like or dev is None or red is not None or parts is None:
        return None
    launch, grid3, fixed, tail = launch_binding(parts)
    rest = tuple(ints) + tuple(tail)
    empty_like, get_device, raw_stream, capturing, hooks = torch.empty_like, _current_device, _raw_stream, _stream_capturing, _launch_hooks
    workspaces = _workspaces
    k = FormBwdKey._make(_key_of(lkey))
    x_dtype, x_align, wk, gk = k.x_dtype, k.x_align, k.w, k.g

    def run(dy, x, w, g, rstd):
        if capturing() or get_device() != dev or hooks():
            return None
        # saved-tensor hooks may hand back other dtypes or layouts than the key's: the plan path then
        if (x.dtype != x_dtype or (x.data_ptr() & 15) != x_align or not x.is_contiguous() or rstd.data_ptr() & 15
                or _tkey(w) != wk or _tkey(g) != gk):
            return None
        stream = raw_stream(dev)
        ws = workspaces.get((dev, stream))
        if ws is None or ws[0].numel() < ws_numel or ws[1].numel() < n_cnt:
            ws = _workspace(device, dev, stream, ws_numel, n_cnt)
        dx = empty_like(x)
        dw = None if w is None else empty_like(w)
        dg = empty_like(g) if gated else None
        launch(*grid3, stream, *fixed,
               dy.data_ptr(), x.data_ptr(), None if w is None else w.data_ptr(), rstd.data_ptr(), dx.data_ptr(),
               ws[0].data_ptr(), ws[1].data_ptr(), None if dw is None else dw.data_ptr(),
               g.data_ptr() if gated else None, dg.data_ptr() if gated else None, *rest)
        return dx, dw, dg, None, None, None, None

    return run
