"""One family: built, run unpatched and patched, compared; what each feature covered, counted."""
from __future__ import annotations

import collections
import copy
import math
import time
import traceback
import warnings
from typing import Optional

from .families import OVERRIDES, Family, _vocab_of, build, make_batch
from .norms import _record_norm_calls, norm_inventory
from .settings import (BF16_FACTOR, BF16_GRAD_FLOOR, BF16_LOSS_FLOOR, FP32_EPS, FP32_GRAD_RTOL, FP32_LOSS_RTOL,
                       NOISE_FACTOR, RMS_FORMS, features_config)
from .shrink import LAYER_KEYS, _is_int

# ---- counting what ran fused ----------------------------------------------------------------------


class GatherCounter:
    """Counts calls of the MoE row gathers (``deepspeed_fused.ops.moe_reorder``) during one forward
    and backward: evidence that the gathers themselves ran, next to the experts-forward count the
    feature reports. Instrumentation of this harness (a worker process): the feature looks the
    gathers up as module attributes at call time, so a counting wrapper there sees every call."""

    GATHERS = ("route_maps", "route_dispatch", "route_combine", "permute_rows", "unpermute_rows")

    def __init__(self):
        self.counts = collections.Counter()
        self._undo = []

    def __enter__(self):
        from ...ops import moe_reorder as reorder

        for name in self.GATHERS:
            fn = getattr(reorder, name, None)
            if fn is None:
                continue

            def counted(*a, _fn=fn, _name=name, **k):
                self.counts[_name] += 1
                return _fn(*a, **k)

            setattr(reorder, name, counted)
            self._undo.append((reorder, name, fn))
        return self

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self._undo):
            setattr(mod, name, fn)
        self._undo.clear()
        return False


def _calls(report) -> dict:
    """The feature's own count of its patched code's calls (fused / reference / eager) since it was applied."""
    calls = getattr(report, "calls", None)
    return calls.as_dict() if calls is not None else {"fused": 0, "reference": 0, "eager": 0}


# ---- one family -----------------------------------------------------------------------------------


def _loss_and_grads(model, batch, seed: int = 2):
    import torch

    torch.manual_seed(seed)
    model.zero_grad(set_to_none=True)
    out = model(**batch)
    loss = out.loss if hasattr(out, "loss") else (out[0] if isinstance(out, (tuple, list)) else None)
    if loss is None:
        raise RuntimeError(f"{type(model).__name__} returned no loss for labels")
    loss.backward()
    grads = {n: (p.grad.detach().float().clone() if p.grad is not None else None)
             for n, p in model.named_parameters() if p.requires_grad}
    return float(loss.detach().float()), grads


def _grad_errors(grads: dict, ref: dict, exact: Optional[dict] = None, noise_floor: bool = False) -> tuple:
    """(max relative error, its parameter, parameters whose gradient exists in one run only,
    parameters past the tolerance only by fp32 noise).

    With ``exact`` (an fp64 run of the same model), a gradient past ``FP32_GRAD_RTOL`` of its norm
    is fp32 noise when the patched one is no further from the fp64 gradient than
    ``NOISE_FACTOR`` x the eager fp32 one is, plus ``FP32_GRAD_RTOL`` of the fp64 norm (a
    gradient that is zero in exact arithmetic, e.g. a key bias under softmax, is all noise)."""
    worst, worst_name, mismatched, noise = 0.0, "", [], []
    # the rounding of the gradient's own scale: fp32 epsilon x the norm of the whole gradient (fp64
    # when there is an fp64 run, else the eager one)
    scale_src = exact if exact is not None else (ref if noise_floor else {})
    floor = FP32_EPS * math.sqrt(sum(float(e.double().norm()) ** 2 for e in scale_src.values() if e is not None))
    scale = max((float(g.norm()) for g in ref.values() if g is not None), default=0.0) or 1.0
    for n, r in ref.items():
        g = grads.get(n)
        if (g is None) != (r is None):
            if (g if r is None else r).abs().max() > 0:  # a zero gradient and none are the same
                mismatched.append(n)
            continue
        if g is None:
            continue
        denom = float(r.norm())
        err = float((g - r).norm()) / (denom if denom > 0 else scale)
        if not math.isfinite(err):
            err = float("inf")
        if err > FP32_GRAD_RTOL and exact is not None and exact.get(n) is not None:
            e = exact[n].to(r.device).double()
            to_exact, eager_to_exact = float((g.double() - e).norm()), float((r.double() - e).norm())
            if to_exact <= NOISE_FACTOR * eager_to_exact + FP32_GRAD_RTOL * float(e.norm()) + floor:
                noise.append(dict(param=n, rel=err, norm=denom, patched_vs_fp64=to_exact,
                                  eager_vs_fp64=eager_to_exact))
                continue
        elif err > FP32_GRAD_RTOL and floor and float((g - r).norm()) <= floor:
            # no fp64 run: a difference below the fp32 resolution of the whole gradient
            noise.append(dict(param=n, rel=err, norm=denom, diff=float((g - r).norm()), floor=floor))
            continue
        if err > worst:
            worst, worst_name = err, n
    return worst, worst_name, mismatched, noise


def _fp64_grads(base, batch) -> tuple:
    """The gradients of an fp64 copy of the unpatched model (experts on transformers' eager
    implementation: grouped_mm takes no fp64), or (None, why not)."""
    import torch

    try:
        m = copy.deepcopy(base).double()
        if hasattr(m, "set_experts_implementation"):
            try:
                m.set_experts_implementation("eager")
            except Exception:
                pass
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            _, grads = _loss_and_grads(m, batch)
        return grads, ""
    except Exception as e:
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    finally:
        torch.set_default_dtype(torch.float32)


def _rel(a: float, b: float) -> float:
    if a == b:
        return 0.0
    d = abs(a - b) / max(abs(b), 1e-30)
    return d if math.isfinite(d) else float("inf")


def _lce_info(model, feature_report) -> dict:
    from ...features import linear_cross_entropy as lce

    states = [(type(m).__name__, lce.fused_state(m)) for m in model.modules() if lce.is_patched(m)]
    calls = _calls(feature_report)
    info = dict(patched=sorted({c for c, _ in states}), fused_calls=calls["fused"], eager_calls=calls["eager"],
                fused=calls["fused"] > 0, reason="")
    skipped = (feature_report.details or {}).get("skipped") or {}
    if not states:
        info["reason"] = feature_report.reason or "not applied"
        # the kind of reason, for the summary: the first skipped class's, without its specifics
        info["why"] = next(iter(skipped.values())) if skipped else "no language-model head module in the model"
        info["kind"] = _reason_kind(info["why"])
    elif not calls["fused"]:
        why = "; ".join(sorted({st.unfused_reason for _, st in states if st.unfused_reason}))
        info["reason"] = info["why"] = why or "patched, but the forward did not take the fused path"
        info["kind"] = "patched, not fused in the forward"
    return info


def _reason_kind(why: str) -> str:
    """A reason without its specifics (the class, the code quoted), to group families by."""
    import re

    kind = why.split(":")[0].split(" (")[0]
    return re.sub(r"^self\.[\w.]+ is \w+, ", "the head is ", kind)


def _moe_info(model, feature_report, counts) -> dict:
    from ...features import moe_reorder

    experts = moe_reorder._experts_modules(model)
    calls = _calls(feature_report)
    info = dict(experts_modules=len(experts), experts_classes=sorted({type(m).__name__ for m in experts}),
                applied=bool(feature_report.applied), where=feature_report.where, calls=calls,
                gather_calls=dict(counts), gathers=bool(calls["fused"]) and bool(counts), reason="")
    if not feature_report.applied:
        info["reason"] = feature_report.reason
    elif not info["gathers"]:
        info["reason"] = "applied, but the experts did not run the gathers in the forward/backward"
    return info


def _mlp_info(patched, feature_report) -> dict:
    """The gated MLPs: modules whose forward is a recognised gated form (whatever their activation),
    those the feature replaced, its call counts, and why the others stayed eager."""
    from ...features import mlp_act as mlp_feature

    gated = [m for m in patched.modules() if mlp_feature.form_of(type(m)) is not None]
    replaced = [m for m in gated if mlp_feature.is_replaced(m)]
    calls = _calls(feature_report)
    skipped = (feature_report.details or {}).get("skipped") or {}
    info = dict(gated=len(gated), replaced=len(replaced), classes=sorted({type(m).__name__ for m in gated}),
                forms=list((feature_report.details or {}).get("forms") or []), fused_calls=calls["fused"],
                eager_calls=calls["eager"], skipped={reason: dict(c) for reason, c in skipped.items()}, reason="")
    if gated and not replaced:
        info["reason"] = feature_report.reason
    elif replaced and not calls["fused"]:
        info["reason"] = "applied, but no replaced MLP ran the fused op in the forward/backward"
    return info


def _norm_info(base_inv: dict, patched, feature_report) -> dict:
    from ...features import rms_norm as rms_feature

    replaced = {n: m for n, m in patched.named_modules() if rms_feature.is_replaced(m)}
    present, by_form, left = [], collections.Counter(), []
    for (cls, form), e in sorted(base_inv.items()):
        hit = [n for n in e["names"] if n in replaced]
        # the feature's own reading of the class (the template it matched), next to the form read here
        row = dict(cls=cls, form=form, count=e["count"], ran=e["ran"], replaced=len(hit),
                   feature_form=(rms_feature.replaced_form(replaced[hit[0]]) or "") if hit else "")
        present.append(row)
        if hit:
            by_form[form] += len(hit)
        if form in RMS_FORMS and len(hit) < e["count"]:
            left.append(row)
    calls = _calls(feature_report)
    skipped = (feature_report.details or {}).get("skipped") or {}
    return dict(present=present, replaced_by_form=dict(by_form), replaced=len(replaced),
                rms_present=sum(r["count"] for r in present if r["form"] in RMS_FORMS),
                left_eager=left, fused_calls=calls["fused"], eager_calls=calls["eager"],
                skipped={reason: dict(c) for reason, c in skipped.items()})


def run_family(fam: Family, mode: str = "fp32") -> dict:
    """Build, run unpatched and patched, compare; the record (see the package's docstring)."""
    import torch

    from ... import patch_model

    from ... import unpatch_model
    from ...ops._common import reset_fallback_warnings

    reset_fallback_warnings()  # every family sees its own fallback warnings (a worker runs many)
    t0 = time.time()
    patched = None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rec = dict(family=fam.model_type, cls=fam.cls, kind=fam.kind, id=fam.id, mode=mode, device=device,
               run=f"{device} {mode}",
               input="text only (no pixels)" if fam.kind == "image-text-to-text" else "text",
               status="", error="", stage="build")
    try:
        base, special = build(fam)
        rec["params"] = sum(p.numel() for p in base.parameters())
        rec["layers"] = next((getattr(base.config, k) for k in LAYER_KEYS if _is_int(getattr(base.config, k, None))),
                             None)
        base.to(device)
        if mode == "bf16":
            ref = copy.deepcopy(base).to(torch.bfloat16).float()
            eager = copy.deepcopy(base).to(torch.bfloat16)
            patched = copy.deepcopy(base).to(torch.bfloat16)
        else:
            ref, eager, patched = None, base, copy.deepcopy(base)
        batch = make_batch(_vocab_of(base), special, device)
        extra = OVERRIDES.get(fam.model_type, {}).get("inputs")
        if extra is not None:
            batch.update(extra(batch))
        rec["stage"] = "eager run"
        calls, handles = _record_norm_calls(eager)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            loss_e, grads_e = _loss_and_grads(eager, batch)
        for h in handles:
            h.remove()
        rec["loss"] = loss_e
        if not math.isfinite(loss_e):
            raise RuntimeError(f"the unpatched model's loss is {loss_e} (a harness limit: the tiny random model)")
        inv = norm_inventory(base, calls)
        rec["stage"] = "patch"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            report = patch_model(patched, features_config())
            reports = {f.name: f for f in report.features}
            rec["stage"] = "patched run"
            with GatherCounter() as counter:
                loss_p, grads_p = _loss_and_grads(patched, batch)
        rec["warnings"] = sorted({str(w.message).splitlines()[0][:200] for w in caught
                                  if "deepspeed_fused" in str(w.message)})
        # the features the suite turned on (not those that patch an engine, off here)
        rec["reports"] = {n: dict(applied=r.applied, where=r.where, reason=r.reason, fallback=r.fallback,
                                  calls=_calls(r)) for n, r in reports.items() if r.enabled}
        rec["norms"] = _norm_info(inv, patched, reports["rms_norm"])
        rec["loss_fused"] = _lce_info(patched, reports["linear_cross_entropy"])
        rec["moe"] = _moe_info(patched, reports["moe_reorder"], counter.counts)
        if "mlp_act" in reports:
            rec["mlp_act"] = _mlp_info(patched, reports["mlp_act"])
        rec["stage"] = "compare"
        if mode == "bf16":
            loss_r, grads_r = _loss_and_grads(ref, batch)
            le, lp = _rel(loss_e, loss_r), _rel(loss_p, loss_r)
            ge, _, _, _ = _grad_errors(grads_e, grads_r)
            gp, gname, mism, _ = _grad_errors(grads_p, grads_r)
            per_param_ok = _bf16_grads_ok(grads_e, grads_p, grads_r)
            rec["diff"] = dict(loss_rel=_rel(loss_p, loss_e), grad_rel=_grad_errors(grads_p, grads_e)[0],
                               loss_err_eager=le, loss_err_patched=lp, grad_err_eager=ge, grad_err_patched=gp,
                               grad_worst=gname, grads_mismatched=mism,
                               loss_tol=BF16_FACTOR * le + BF16_LOSS_FLOOR, bad_params=per_param_ok[:5])
            ok = lp <= BF16_FACTOR * le + BF16_LOSS_FLOOR and not per_param_ok and not mism
        else:
            raw = _grad_errors(grads_p, grads_e)
            exact, why_not = None, ""
            if raw[0] > FP32_GRAD_RTOL:  # past the tolerance: is it fp32 noise? (an fp64 run tells)
                exact, why_not = _fp64_grads(base, batch)
            gp, gname, mism, noise = _grad_errors(grads_p, grads_e, exact, noise_floor=exact is None)
            rec["diff"] = dict(loss_rel=_rel(loss_p, loss_e), grad_rel=gp, grad_worst=gname,
                               grad_rel_raw=raw[0], grad_worst_raw=raw[1], fp32_noise=noise[:8],
                               fp32_noise_params=len(noise), fp64_unavailable=why_not,
                               grads_mismatched=mism, loss_tol=FP32_LOSS_RTOL, grad_tol=FP32_GRAD_RTOL)
            ok = rec["diff"]["loss_rel"] <= FP32_LOSS_RTOL and gp <= FP32_GRAD_RTOL and not mism
        rec["status"] = "ok" if ok else "differs"
        rec["stage"] = "done"
    except Exception as e:
        rec["status"] = "build_failed" if rec["stage"] == "build" else "failed"
        rec["error"] = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}"
        rec["traceback"] = traceback.format_exc(limit=-4)[-2000:]
    finally:
        if patched is not None:
            try:
                unpatch_model(patched)  # the class-level patches go with the last patched instance
            except Exception:
                pass
    rec["seconds"] = round(time.time() - t0, 2)
    return rec


def _bf16_grads_ok(grads_e: dict, grads_p: dict, grads_r: dict) -> list:
    """Parameters whose patched bf16 gradient is further from the fp32 one than the rule allows."""
    bad = []
    for n, r in grads_r.items():
        e, p = grads_e.get(n), grads_p.get(n)
        if r is None or e is None or p is None:
            continue
        denom = float(r.norm()) or 1.0
        ee, ep = float((e - r).norm()) / denom, float((p - r).norm()) / denom
        if not ep <= BF16_FACTOR * ee + BF16_GRAD_FLOOR:
            bad.append(dict(param=n, err_patched=ep, err_eager=ee))
    return bad
