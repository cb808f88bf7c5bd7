"""The outputs: records merged and summarised, coverage.json and coverage.md written."""
from __future__ import annotations

import collections
import json
import os
from typing import Optional

from ..common import OUT_DIR, env_fields
from .compare import _reason_kind
from .families import OVERRIDES
from .settings import (BF16_FACTOR, BF16_GRAD_FLOOR, BF16_LOSS_FLOOR, DOCS_DIR, FORM_TEXT, FP32_GRAD_RTOL,
                       FP32_LOSS_RTOL, NOISE_FACTOR, RMS_FORMS, features_config)

# ---- outputs --------------------------------------------------------------------------------------


def merge(record_lists: list) -> list:
    """Records of several runs in one list: per (family id, run) the last one given, in order of
    first appearance."""
    out: dict = {}
    for recs in record_lists:
        for r in recs:
            out[(r["id"], run_label(r))] = r
    return list(out.values())


def run_label(rec: dict) -> str:
    """Where and how a record ran: "cpu fp32" (kernels under the interpreter), "cuda fp32", "cuda bf16"."""
    return rec.get("run") or f"{rec.get('device', 'cpu')} {rec['mode']}"


def summarize(records: list) -> dict:
    """Counts per run ("cpu fp32", "cuda bf16", ...): families built and run, covered per feature,
    left eager, differing."""
    out = {}
    for run in sorted({run_label(r) for r in records}):
        rs = [r for r in records if run_label(r) == run]
        ran = [r for r in rs if r["status"] in ("ok", "differs")]
        with_rms = [r for r in ran if r["norms"]["rms_present"]]
        forms_present, forms_replaced = collections.Counter(), collections.Counter()
        for r in ran:  # families per form (a family with two classes of one form counts once)
            forms_present.update({row["form"] for row in r["norms"]["present"] if row["form"] in RMS_FORMS})
            forms_replaced.update({form for form, n in r["norms"]["replaced_by_form"].items() if n})
        moe = [r for r in ran if r["moe"]["experts_modules"]]
        out[run] = dict(
            families=len(rs), ran=len(ran), build_failed=sum(r["status"] == "build_failed" for r in rs),
            failed=sum(r["status"] == "failed" for r in rs), timeout=sum(r["status"] == "timeout" for r in rs),
            differs=sorted(r["id"] for r in rs if r["status"] == "differs"),
            with_rms_norm=len(with_rms),
            rms_norm_all_replaced=sum(not r["norms"]["left_eager"] for r in with_rms),
            rms_norm_some_replaced=sum(bool(r["norms"]["replaced"]) for r in with_rms),
            rms_norm_left_eager=sorted(r["id"] for r in with_rms if r["norms"]["left_eager"]),
            rms_forms_present=dict(forms_present), rms_forms_replaced=dict(forms_replaced),
            rms_left_eager_by_form={form: sorted({r["family"] for r in with_rms
                                                  if any(row["form"] == form for row in r["norms"]["left_eager"])})
                                    for form in RMS_FORMS
                                    if any(row["form"] == form for r in with_rms for row in r["norms"]["left_eager"])},
            loss_fused=sum(r["loss_fused"]["fused"] for r in ran),
            loss_eager=sorted(r["id"] for r in ran if not r["loss_fused"]["fused"]),
            loss_eager_kinds=dict(collections.Counter(
                _reason_kind(r["loss_fused"].get("why") or r["loss_fused"]["reason"])
                for r in ran if not r["loss_fused"]["fused"]).most_common()),
            vlm_ran=sum(r["kind"] == "image-text-to-text" for r in ran),
            vlm_loss_fused=sum(r["kind"] == "image-text-to-text" and r["loss_fused"]["fused"] for r in ran),
            features={name: dict(applied=sum(bool(r["reports"].get(name, {}).get("applied")) for r in ran),
                                 fused=sum(bool((r["reports"].get(name, {}).get("calls") or {}).get("fused"))
                                           for r in ran))
                      for name in dict.fromkeys(n for r in ran for n in r.get("reports", {}))},
            with_gated_mlp=sum(bool((r.get("mlp_act") or {}).get("gated")) for r in ran),
            mlp_act_fused=sum(bool((r.get("mlp_act") or {}).get("fused_calls")) for r in ran),
            mlp_act_all_replaced=sum(bool(r.get("mlp_act", {}).get("gated"))
                                     and r["mlp_act"]["replaced"] == r["mlp_act"]["gated"] for r in ran),
            mlp_act_eager=sorted(r["id"] for r in ran if (r.get("mlp_act") or {}).get("gated")
                                 and not r["mlp_act"]["fused_calls"]),
            with_experts=len(moe), experts_gathers=sum(r["moe"]["gathers"] for r in moe),
            experts_eager=sorted(r["id"] for r in moe if not r["moe"]["gathers"]),
        )
    return out


def _fmt_e(v) -> str:
    if v is None:
        return ""
    if v == 0:
        return "0"
    return f"{v:.1e}"


def _norm_cell(r: dict) -> str:
    n = r["norms"]
    rms = [row for row in n["present"] if row["form"] in RMS_FORMS]
    if not rms:
        return "none"
    parts = [f"{row['replaced']}/{row['count']} {row['cls']} ({row['form']})" for row in rms]
    return "; ".join(parts)


def _mlp_cell(r: dict) -> str:
    """The gated-MLP column: replaced/recognised (fused calls), or why eager; "" for a record of a run
    before the feature existed."""
    m = r.get("mlp_act")
    if m is None:
        return ""
    if not m["gated"]:
        return "-"
    if m["fused_calls"]:
        return f"{m['replaced']}/{m['gated']} ({m['fused_calls']})"
    return "eager: " + _short(m["reason"] or "; ".join(m["skipped"]), 70)


def _rope_cell(r: dict) -> str:
    """The rope column: fused calls, eager calls with the first reason the feature warned, or why the
    feature did not apply; "" for a record without the feature's report."""
    rep = (r.get("reports") or {}).get("rope")
    if not rep:
        return ""
    if not rep.get("applied"):
        return "not applied: " + _short(rep.get("reason") or "", 70)
    calls = rep.get("calls") or {}
    fused, other = calls.get("fused", 0), calls.get("eager", 0) + calls.get("reference", 0)
    parts = [f"fused ({fused})"] if fused else []
    if other:
        why = next((w.split(":", 1)[1].strip() for w in r.get("warnings", [])
                    if w.startswith("deepspeed_fused.rope:")), "")
        parts.append(f"eager ({other})" + (": " + _short(why, 80) if why else ""))
    return "; ".join(parts) or "applied, not called"


def _short(s: str, n: int = 110) -> str:
    s = (s or "").replace("|", "/").replace("\n", " ")
    return s if len(s) <= n else s[: n - 3] + "..."


def render_markdown(doc: dict) -> str:
    recs, summ, tol = doc["records"], doc["summary"], doc.get("tolerances", {})
    runs = []
    for run, env in doc.get("envs", {}).items():
        runs.append(f"`{run}`: {env.get('date', '')}, {env.get('gpu', '')}, torch {env.get('torch', '')}, Triton "
                    f"{env.get('triton', '')}, transformers {env.get('transformers', '')}, kernels "
                    + ("under the Triton interpreter" if env.get("interpreter") else "on the GPU")
                    + (f", {env['wall_s'] / 60:.0f} min with {env.get('jobs', 1)} job(s)" if env.get("wall_s") else ""))
    lines = ["# Coverage: every causal-LM and image-text-to-text family", "",
             "Generated by " + ", then ".join(f"`{c}`" for c in dict.fromkeys(
                 c.strip() for c in doc["command"].split(" + ") if c.strip())) + ". Runs: " + "; ".join(runs) + ". Data: "
             "[benchmarks/coverage.json](benchmarks/coverage.json); the suite: `deepspeed_fused/bench/coverage/` "
             "(`python -m deepspeed_fused.bench coverage`).", "",
             "Each family (a model type of the installed transformers' `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES` and "
             "`MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES`, with the class the mapping names) is built tiny with "
             "random weights: its default config shrunk field by field (widths 64, FFN 128, 4 heads, 4 experts "
             "with 2 per token, vocabulary 256, the first layer of each kind of layer the full config has and "
             "at least 2; dropout, layer drop and router jitter off; a few per-family settings where "
             "transformers' own defaults do not build, listed below). Parameters the init leaves constant "
             "(norm weights, zero biases, learned scales) get noise, so that a patch that drops one shows in "
             "the loss. The model is deep-copied and both copies run one training forward and backward on the "
             "same batch (2 x 16 random tokens, one row right-padded, some labels -100; image-text models "
             "get text only, no pixels): the unpatched model, and the copy after `patch_model` with every "
             "registered feature that patches a model on (" + ", ".join(f"`{n}`" for n in doc.get("features", []))
             + "; `grad_norm` patches the engine's ZeRO optimizer and is tested on DeepSpeed engines, "
             "tests/unit/test_grad_norm.py).", "",
             f"Target in fp32: the loss within {tol.get('fp32_loss_rtol', FP32_LOSS_RTOL):g} relative and every "
             f"parameter's gradient within {tol.get('fp32_grad_rtol', FP32_GRAD_RTOL):g} of its norm. A gradient "
             "past that is checked against an fp64 run of the unpatched model: it is fp32 noise (and passes) "
             f"when the patched gradient is no further from the fp64 one than {NOISE_FACTOR:g} x the eager fp32 "
             "gradient is, plus fp32 epsilon x the norm of the whole gradient (a gradient that is zero in exact "
             "arithmetic, such as a key bias under softmax, is all noise); where the model does not run in fp64, "
             "a difference below fp32 epsilon x the norm of the whole gradient is noise. The JSON lists those "
             "parameters.",
             "",
             "RMSNorm forms are read from what each norm-named module computes on random inputs (fp32: mean "
             "removed or not, weight or 1 + weight, a gate after or before the normalisation; bf16: whether the "
             "weight multiplies before or after the cast to the input dtype), never from the class name. "
             "Counted: the modules in the model (those of a vision tower too, which text-only inputs do not "
             "run). The loss counts as fused when the fused op ran (calls counted), the experts when the "
             "gathers ran. A family that could not be built or run is listed with the error: a limit of this "
             "harness, not a verdict on the features.", ""]
    if any(k.endswith("bf16") for k in summ):
        lines += [f"bf16 (GPU): both runs in bf16, each compared with an fp32 run of the same bf16-rounded "
                  f"weights; the patched run passes when its error is within {tol.get('bf16_factor', BF16_FACTOR):g}"
                  f" x the eager bf16 run's error plus {tol.get('bf16_loss_floor', BF16_LOSS_FLOOR):g} (loss, "
                  f"relative) or {tol.get('bf16_grad_floor', BF16_GRAD_FLOOR):g} (each gradient, relative to its "
                  "norm).", ""]
    mlp_col = any("mlp_act" in r for r in recs)
    for mode, s in summ.items():
        lines += [f"## Summary ({mode})", "",
                  "| | families |", "|---|---:|",
                  f"| listed | {s['families']} |",
                  f"| built and ran | {s['ran']} |",
                  f"| could not be built (harness limit) | {s['build_failed']} |",
                  f"| built, failed to run (harness limit) | {s['failed']} |",
                  f"| timed out | {s['timeout']} |",
                  f"| **patched loss or gradients beyond tolerance** | **{len(s['differs'])}** |",
                  f"| with RMSNorm modules | {s['with_rms_norm']} |",
                  f"| rms_norm: every RMSNorm module replaced | {s['rms_norm_all_replaced']} |",
                  f"| rms_norm: some replaced | {s['rms_norm_some_replaced']} |",
                  f"| rms_norm: RMSNorm modules left eager | {len(s['rms_norm_left_eager'])} |",
                  f"| linear_cross_entropy: loss fused | {s['loss_fused']} of {s['ran']} |",
                  f"| linear_cross_entropy: image-text models with the loss fused | {s['vlm_loss_fused']} of "
                  f"{s['vlm_ran']} |",
                  f"| with transformers experts modules | {s['with_experts']} |",
                  f"| moe_reorder: experts ran the gathers | {s['experts_gathers']} of {s['with_experts']} |"]
        if mlp_col:  # records of runs with the mlp_act feature
            lines += [f"| with gated MLPs of a recognised form | {s.get('with_gated_mlp', 0)} |",
                      f"| mlp_act: gated activation fused | {s.get('mlp_act_fused', 0)} of "
                      f"{s.get('with_gated_mlp', 0)} |",
                      f"| mlp_act: every gated MLP replaced | {s.get('mlp_act_all_replaced', 0)} of "
                      f"{s.get('with_gated_mlp', 0)} |"]
        lines.append("")
        lines += ["Every feature: families where it applied, and where its patched code ran fused (its own call "
                  "count):", "", "| feature | applied | ran fused |", "|---|---:|---:|"]
        for name, c in s.get("features", {}).items():
            lines.append(f"| `{name}` | {c['applied']} of {s['ran']} | {c['fused']} |")
        lines.append("")
        if s["differs"]:
            lines += ["Beyond tolerance: " + ", ".join(f"`{x}`" for x in s["differs"]) + ".", ""]
        lines += ["RMSNorm forms: families where the form is present, and where its modules are replaced:", "",
                  "| form | present | replaced |", "|---|---:|---:|"]
        for form in RMS_FORMS:
            p = s["rms_forms_present"].get(form, 0)
            if p:
                lines.append(f"| {FORM_TEXT[form]} | {p} | {s['rms_forms_replaced'].get(form, 0)} |")
        lines += ["", "Families with RMSNorm modules left eager, by form:", ""]
        for form, fams in s.get("rms_left_eager_by_form", {}).items():
            lines.append(f"- {form} ({len(fams)}): " + ", ".join(fams))
        if not s.get("rms_left_eager_by_form"):
            lines.append("- none")
        lines += ["", "Why the loss stays eager (families):", "", "| reason | families |", "|---|---:|"]
        for why, n in s.get("loss_eager_kinds", {}).items():
            lines.append(f"| {_short(why, 140)} | {n} |")
        lines.append("")
    for mode in summ:
        rs = [r for r in recs if run_label(r) == mode]
        lines += [f"## Families ({mode})", "",
                  "RMSNorm: replaced/present modules per class (form). Loss: fused (op calls) or why not. "
                  "Experts: gathers (calls) or why not; - where there are no experts modules. "
                  "Rope: fused calls, eager calls and the reason, or why it did not apply. "
                  + ("Gated MLP: replaced/recognised gated MLPs (fused calls) or why not; - where there is none. "
                     if mlp_col else "") + "Differences: "
                  "the loss relative to its value, the largest gradient difference relative to its norm "
                  "(fp32 noise excluded, see above).", "",
                  "| family | class | status | RMSNorm replaced/present | loss | experts | rope | "
                  + ("gated MLP | " if mlp_col else "") + "loss diff | grad diff |",
                  "|---|---|---|---|---|---|---|" + ("---|" if mlp_col else "") + "---:|---:|"]
        for r in rs:
            if r["status"] not in ("ok", "differs"):
                lines.append(f"| {r['family']} | {r['cls']} | {r['status']} (below) | | | | | | |"
                             + (" |" if mlp_col else ""))
                continue
            lf = r["loss_fused"]
            loss = f"fused ({lf['fused_calls']})" if lf["fused"] else \
                "eager: " + _short(lf.get("why") or lf["reason"], 90)
            mo = r["moe"]
            if not mo["experts_modules"] and not mo["applied"]:
                experts = "-"
            elif mo["gathers"]:
                experts = f"gathers ({sum(mo['gather_calls'].values())})"
            else:
                experts = "eager: " + _short(mo["reason"], 70)
            status = "**differs**" if r["status"] == "differs" else "ok"
            d = r["diff"]
            lines.append(f"| {r['family']} | {r['cls']} | {status} | {_short(_norm_cell(r), 160)} | {loss} | "
                         f"{experts} | {_rope_cell(r)} | " + (f"{_mlp_cell(r)} | " if mlp_col else "")
                         + f"{_fmt_e(d['loss_rel'])} | {_fmt_e(d['grad_rel'])} |")
        lines.append("")
        bad = [r for r in rs if r["status"] not in ("ok", "differs")]
        if bad:
            lines += [f"### Not built or not run ({mode}): harness limits", "",
                      "| family | class | status | error |", "|---|---|---|---|"]
            for r in bad:
                lines.append(f"| {r['family']} | {r['cls']} | {r['status']} | {_short(r.get('error', ''), 200)} |")
            lines.append("")
    ov = doc.get("overrides") or {}
    if ov:
        lines += ["## Per-family settings", "",
                  "Where the generic shrinking alone does not build or run a family:", "",
                  "| family | settings | why |", "|---|---|---|"]
        for fam, o in sorted(ov.items()):
            lines.append(f"| {fam} | {_short(o['settings'], 150)} | {_short(o['why'], 200)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def _overrides_doc() -> dict:
    out = {}
    for fam, o in OVERRIDES.items():
        parts = []
        for k in ("init", "layers"):
            if k in o:
                parts.append(f"{k}: {o[k]}")
        for k, v in o.get("set", {}).items():
            parts.append(f"{k} = {'(computed)' if callable(v) else json.dumps(v, default=str)}")
        if "inputs" in o:
            parts.append("extra inputs")
        if "model" in o:
            parts.append("a call on the built model")
        out[fam] = dict(settings="; ".join(parts), why=o.get("why", ""))
    return out


def write(records: list, out_dir: Optional[str] = None, md_path: Optional[str] = None, command: str = "",
          envs: Optional[dict] = None) -> dict:
    """Write coverage.json (under ``out_dir``, default docs/benchmarks/) and coverage.md
    (docs/coverage.md by default, else next to the JSON). ``envs``: run -> the environment it ran
    in (default: this machine's, for every run in ``records``)."""
    out_dir = out_dir or OUT_DIR
    os.makedirs(out_dir, exist_ok=True)
    md_path = md_path or (os.path.join(DOCS_DIR, "coverage.md") if os.path.abspath(out_dir) == os.path.abspath(OUT_DIR)
                          else os.path.join(out_dir, "coverage.md"))
    here = env_fields()
    envs = {run: (envs or {}).get(run, here) for run in sorted({run_label(r) for r in records})}
    doc = dict(command=command, envs=envs, features=list(features_config()), tolerances=dict(
        fp32_loss_rtol=FP32_LOSS_RTOL, fp32_grad_rtol=FP32_GRAD_RTOL, bf16_factor=BF16_FACTOR,
        bf16_loss_floor=BF16_LOSS_FLOOR, bf16_grad_floor=BF16_GRAD_FLOOR, noise_factor=NOISE_FACTOR),
        summary=summarize(records), overrides=_overrides_doc(), records=records)
    paths = dict(json=os.path.join(out_dir, "coverage.json"), md=md_path)
    with open(paths["json"], "w") as f:
        json.dump(doc, f, indent=1, default=str)
    with open(paths["md"], "w") as f:
        f.write(render_markdown(doc))
    return paths
