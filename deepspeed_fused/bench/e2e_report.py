"""The e2e suite's report: the comparisons of a pair's arms against its targets, the merge of
result files run in parts, the markdown table and the plots. Reads result dicts only (no run, no
launcher): :mod:`deepspeed_fused.bench.e2e` runs the arms and calls these; ``multi_gpu`` reuses
the comparison and the merge."""
from __future__ import annotations

import json
import math
import os
import re
from typing import Callable, Optional

from .common import read_json
from .breakdown import AUTOGRAD_THREAD, MAIN_THREAD, METHOD_V1, UNKNOWN_THREAD

# the arms, in the order the tables list them (deepspeed_fused.bench.e2e.ARMS defines each)
ARM_ORDER = ("baseline", "liger", "liger_swiglu", "liger_swiglu_noautotune", "fused")
SWIGLU_ARMS = ("liger_swiglu", "liger_swiglu_noautotune")
# targets at the fixed setup: the fused arm's optimizer step against the baseline's and the Liger
# arm's (ZeRO-2 at accumulation 1 and 8, ZeRO-2 on two GPUs), and for the searched throughput
# (SEARCH_TARGET); the losses within LOSS_TARGET of the baseline's in every pair
STEP_TARGETS = {"zero2": dict(vs_baseline=1.30, vs_liger=1.3),
                "zero2_accum8": dict(vs_baseline=1.5, vs_liger=1.3),
                "zero2_2gpu": dict(vs_baseline=1.22, vs_liger=1.2),
                # the dense pairs: full depth, gradient checkpointing, every feature against the
                # family's Liger patch
                "dense_qwen3_1_7b": dict(vs_baseline=1.3, vs_liger=1.1),
                "dense_qwen3_4b": dict(vs_baseline=1.3, vs_liger=1.1),
                "dense_qwen3_4b_bf16_states": dict(vs_baseline=1.3, vs_liger=1.1),
                "dense_gemma3_1b": dict(vs_baseline=1.3, vs_liger=1.1),
                "dense_llama3_3b": dict(vs_baseline=1.3, vs_liger=1.05),
                "dense_llama3_3b_reentrant": dict(vs_baseline=1.3, vs_liger=1.05)}
# a balanced arm's two runs (the same arm early and late in the order) whose median steps differ by
# more than this are flagged: the GPU changed under the run, and its comparisons are not to be trusted
RUNS_AGREE = 0.05
LOSS_TARGET = 0.005
SEARCH_TARGET = 1.3
# the settings of a largest-micro-batch search, recorded in the page's meta and in each searched arm
SEARCH_SETTINGS = ("search_start", "search_max", "search_steps", "search_warmup")


def _ok(a: Optional[dict]) -> bool:
    return bool(a) and "error" not in a


def _losses(a: dict) -> list:
    """An arm's losses step by step: every micro-step's where recorded, else each step's."""
    out = []
    for r in a["history"]:
        out += r.get("micro_losses") or [r["loss"]]
    return out


def max_loss_rel_diff(base: dict, other: dict) -> Optional[float]:
    """The largest relative difference of ``other``'s loss to the baseline's, micro-step by
    micro-step (step by step for results without micro-step losses); None if none to compare."""
    def accum(x):
        return len(x["history"][0].get("micro_losses") or [None]) if x["history"] else 1

    if accum(base) != accum(other):
        return None  # different accumulation: the steps do not line up
    a, b = _losses(base), _losses(other)
    rel = [abs(x - y) / abs(x) for x, y in zip(a, b)]
    return max(rel) if rel else None


def _fb(a: dict) -> Optional[float]:
    return a.get("median_micro_fb_s")


_EXC_LINE = re.compile(r"(?:^|\n)(?:\[rank\d+\]:\s*)?((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception)\b:[^\n]*)")


def error_headline(text: str, limit: int = 300) -> str:
    """A failed arm's error as one line: its ``exit N:`` prefix and the last exception line of the
    job's stderr (``torch.OutOfMemoryError: CUDA out of memory ...``), not the traceback's first
    frames; the text itself where it holds no exception line."""
    found = _EXC_LINE.findall(text or "")
    if not found:
        return (text or "")[:limit].replace("\n", " ")
    m = re.match(r"exit -?\d+: ", text)
    return ((m.group(0) if m else "") + found[-1].strip())[:limit]


def _kernels_by_key(b: dict) -> dict:
    """A breakdown's kept kernels by (name, calls): the same kernel run the same number of times."""
    return {(r["name"], r.get("calls")): r for r in b.get("top_kernels") or []}


def shared_kernels_table(results: dict, top: int = 12) -> list:
    """Markdown lines: per pair, the kernels every arm ran with the same name and call count (from
    each profiled step's ``top_kernels``), the longest first, with each arm's time and each arm's
    time over the first arm's; empty where fewer than two arms have a breakdown. The same work in
    every arm, so a kernel that takes longer in one arm ran slower there."""
    out = []
    for k, v in results.items():
        arms = [a for a in _arms_of(v) if _ok(v[a]) and _attributed(v[a].get("breakdown"))
                and v[a]["breakdown"].get("top_kernels")]
        if len(arms) < 2:
            continue
        rows = [_kernels_by_key(v[a]["breakdown"]) for a in arms]
        same = [key for key in rows[0] if all(key in r for r in rows[1:])]
        same.sort(key=lambda key: -rows[0][key]["ms"])
        if not same:
            continue
        if not out:
            out += ["", "Kernels every arm ran alike (the same kernel and call count in each profiled step; of the "
                    "longest kernels the breakdown keeps), ms per arm and each arm's time over "
                    f"`{arms[0]}`'s: the same work, so a kernel that takes longer in one arm ran slower there.", "",
                    "| pair | kernel | category | calls | " + " | ".join(arms) + " | "
                    + " | ".join(f"{a} / {arms[0]}" for a in arms[1:]) + " |",
                    "|---|---|---|---:|" + "---:|" * (2 * len(arms) - 1)]
        for key in same[:top]:
            ms = [r[key]["ms"] for r in rows]
            name = key[0] if len(key[0]) <= 70 else key[0][:67] + "..."
            out.append(f"| {k} | `{name}` | {rows[0][key].get('category', '')} | {key[1]} | "
                       + " | ".join(f"{m:.2f}" for m in ms) + " | "
                       + " | ".join(f"{m / ms[0]:.3f}" if ms[0] else "-" for m in ms[1:]) + " |")
    return out


def category_vs_liger_table(results: dict, tolerance_ms: float = 0.05) -> list:
    """Markdown lines: per pair with a breakdown in both the ``liger`` and ``fused`` arms, each
    category either arm spends time in: Liger's ms, ours, the difference, and how much of the
    difference is the same kernels (same name and call count among each step's longest kernels)
    running longer in ours, the rest being work that differs (other kernels, other call counts, or
    kernels below the kept list). A category is ``<=`` where ours is at most Liger's plus
    ``tolerance_ms``. Empty where no pair has both arms."""
    out = []
    for k, v in results.items():
        pair = [v.get(a) for a in ("liger", "fused")]
        if not all(a and _ok(a) and _attributed(a.get("breakdown")) for a in pair):
            continue
        lb, fb = (a["breakdown"] for a in pair)
        kept = [_kernels_by_key(b) for b in (lb, fb)]
        if not out:
            out += ["", "Ours against Liger, category by category (ms per profiled optimizer step): the difference, "
                    "and the part of it that is the same kernels (same name and call count among each step's "
                    "longest kernels) taking longer in ours, which is the GPU running them slower (see the clocks "
                    "above), not more work; the rest is work that differs between the arms. `<=`: ours takes at most "
                    f"Liger's time (+{tolerance_ms} ms).", "",
                    "| pair | category | liger | fused | fused - liger | same kernels, slower | other work | fused <= liger |",
                    "|---|---|---:|---:|---:|---:|---:|---|"]
        for c in _categories([lb, fb]):
            lm, fm = lb["categories"].get(c, 0.0), fb["categories"].get(c, 0.0)
            if lm == 0.0 and fm == 0.0:
                continue
            same = [key for key, r in kept[0].items() if r.get("category") == c and key in kept[1]
                    and kept[1][key].get("category") == c]
            slower = sum(kept[1][key]["ms"] - kept[0][key]["ms"] for key in same)
            diff = fm - lm
            verdict = "yes" if diff <= tolerance_ms else ("no: the same kernels, slower" if diff - slower <= tolerance_ms
                                                          else "no")
            out.append(f"| {k} | {c} | {lm:.1f} | {fm:.1f} | {diff:+.1f} | {slower:+.1f} | {diff - slower:+.1f} | "
                       f"{verdict} |")
    return out


def clocks_table(results: dict) -> list:
    """Markdown lines: each arm's GPU clocks while it ran (``gpu_clocks``, sampled by the launcher's
    process; GPU 0 of the job), in the order the arms ran; none when no arm has them (a CPU run, an
    older result)."""
    rows = []
    for k, v in results.items():
        for arm in _arms_of(v):
            for run in v[arm].get("runs") or [v[arm]]:
                g = (run.get("gpu_clocks") or {}).get("0")
                if g:
                    where = "" if run.get("position") is None else f" (run {run['position'] + 1})"
                    rows.append(f"| {k} | {arm}{where} | {_f(run.get('median_step_s') and run['median_step_s'] * 1e3, '{:.1f}')} | "
                                f"{_f(g.get('sm_mhz_median'), '{:.0f}')} | {_f(g.get('sm_mhz_min'), '{:.0f}')} | "
                                f"{_f(g.get('power_w_median'), '{:.0f}')} | {_f(g.get('temp_c_max'), '{:.0f}')} | "
                                f"{_f(g.get('power_capped'), '{:.0%}', '-')} | {_f(g.get('hw_slowdown'), '{:.0%}', '-')} | "
                                f"{g.get('busy_samples')} of {g.get('samples')} |")
    if not rows:
        return []
    return ["", "GPU clocks while each arm ran (`nvidia-smi` every 0.2 s, or 0.5 s in older runs; "
            "clock, power and clock-limit reasons: the samples with the GPU at least 90% busy, so loading and "
            "compiling are left out; power capped / hardware slowdown: the share of those samples in which the "
            "driver held the clock down for the power limit / for power-brake or heat, `-` where not sampled). "
            "The same kernels run slower at lower clocks; the arms ran one after the other (in the order "
            "`--arms` gave: by default baseline, liger, fused).", "",
            "| pair | arm (run: its place in the order) | median step ms | SM clock median MHz | SM clock lowest MHz | "
            "power median W | temperature max C | power capped | hardware slowdown | busy samples |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---|"] + rows


def compare(pair: str, arms: dict) -> dict:
    """Ratios of the fused arm to the baseline and Liger arms (the optimizer step and, where
    recorded, one micro-step's forward+backward), loss differences, and the targets of
    :data:`STEP_TARGETS` both as ``targets`` (name -> met) and ``checks`` (each with the
    measured value and the target)."""
    base, fused, liger = arms.get("baseline"), arms.get("fused"), arms.get("liger")
    out: dict = {}
    if not (_ok(base) and _ok(fused)):
        bad = next((a for a in (base, fused) if a and "error" in a), None)
        return dict(error=error_headline(bad["error"]) if bad else "baseline or fused arm missing",
                    **({"not_run": True} if bad and bad.get("not_run") else {}))

    def reduction(a, key):  # None on a CPU run (no GPU memory figures)
        return 1 - a[key] / base[key] if base.get(key) and a.get(key) is not None else None

    def ratio(x, y):
        return x / y if x and y else None

    lb = _losses(base) + _losses(fused)
    out.update(gradient_accumulation_steps=fused.get("gradient_accumulation_steps"),
               speedup=base["median_step_s"] / fused["median_step_s"],
               fb_speedup=ratio(_fb(base), _fb(fused)),
               peak_alloc_reduction=reduction(fused, "peak_alloc_mib"),
               peak_reserved_reduction=reduction(fused, "peak_reserved_mib"),
               max_loss_rel_diff=max_loss_rel_diff(base, fused), nan=any(math.isnan(x) for x in lb))
    if _ok(liger):
        out.update(speedup_vs_liger=liger["median_step_s"] / fused["median_step_s"],
                   fb_speedup_vs_liger=ratio(_fb(liger), _fb(fused)),
                   liger_speedup=base["median_step_s"] / liger["median_step_s"],
                   liger_peak_alloc_reduction=reduction(liger, "peak_alloc_mib"),
                   liger_max_loss_rel_diff=max_loss_rel_diff(base, liger),
                   liger_nan=any(math.isnan(x) for x in _losses(liger)))
    d = out["max_loss_rel_diff"]
    every = "every micro-step" if all(r.get("micro_losses") for r in base["history"]) else "every step"
    checks = [dict(name="loss_0_5pct", what=f"max loss rel. diff fused vs baseline, {every}",
                   measured=d, target=f"<= {LOSS_TARGET:.1%}", met=d is not None and d <= LOSS_TARGET)]
    if "liger_max_loss_rel_diff" in out:
        d = out["liger_max_loss_rel_diff"]
        checks.append(dict(name="liger_loss_0_5pct", what=f"max loss rel. diff Liger vs baseline, {every}", measured=d,
                           target=f"<= {LOSS_TARGET:.1%}", met=d is not None and d <= LOSS_TARGET))
    t = STEP_TARGETS.get(pair)
    if t:
        checks.append(dict(name=f"speedup_{t['vs_baseline']}", what="optimizer step, fused vs baseline",
                           measured=out["speedup"], target=f">= {t['vs_baseline']}",
                           met=out["speedup"] >= t["vs_baseline"]))
        v = out.get("speedup_vs_liger")
        checks.append(dict(name=f"vs_liger_{t['vs_liger']}", what="optimizer step, fused vs Liger", measured=v,
                           target=f">= {t['vs_liger']}", met=v >= t["vs_liger"] if v is not None else None))
    for name in ARM_ORDER:
        a = arms.get(name)
        steps = [r.get("median_step_s") for r in (a.get("runs") or [])] if _ok(a) else []
        if len(steps) > 1 and all(steps):
            spread = max(steps) / min(steps) - 1
            checks.append(dict(name=f"{name}_runs_agree", what=f"{name}: its runs' median steps, slower over faster",
                               measured=spread, target=f"<= {RUNS_AGREE:.0%}", met=spread <= RUNS_AGREE))
    out["checks"] = checks
    # the fused-vs-baseline loss check and the step targets (the Liger arm's loss is shown, not a
    # target; the runs' agreement says whether the comparison holds, and is shown with the checks)
    out["targets"] = {c["name"]: c["met"] for c in checks
                      if c["name"] != "liger_loss_0_5pct" and not c["name"].endswith("_runs_agree")}
    out["runs_agree"] = all(c["met"] for c in checks if c["name"].endswith("_runs_agree"))
    return out


def _liger_patches(desc: str) -> list:
    """The patches named ``=True`` in train.py's Liger description
    (``liger-kernel V: apply_...(rope=True, rms_norm=True, ..., swiglu=False)``)."""
    return re.findall(r"(\w+)=True", desc or "")


def arm_features(a: dict) -> str:
    """Which features an arm ran, from its run's record: this plugin's features the report says
    were applied (with the fused/eager call counts where the patched code also ran eager, and what
    runs instead of the kernels on this machine where that is not them), those enabled but not
    applied, and the Liger-Kernel patches; ``none`` when nothing was."""
    parts = []
    feats = (a.get("report") or {}).get("features") or []
    on = []
    for f in feats:
        if not f.get("applied"):
            continue
        note = []
        calls = f.get("calls") or {}
        if calls.get("eager"):
            note.append(f"{calls.get('fused', 0)} fused / {calls['eager']} eager calls")
        if f.get("fallback"):
            note.append(f["fallback"])
        on.append(f["name"] + (f" ({'; '.join(note)})" if note else ""))
    if on:
        parts.append("ours: " + ", ".join(on))
    parts += [f"{f['name']} enabled, not applied ({f.get('reason') or 'no reason given'})" for f in feats
              if f.get("enabled") and not f.get("applied")]
    patches = _liger_patches(a.get("liger"))
    if patches:
        parts.append("Liger: " + ", ".join(patches))
    if not parts:
        if "error" in a and not feats:
            return "n/a (not run)" if a.get("not_run") else "n/a (no report: the run failed)"
        return "none"
    return "; ".join(parts)


def search_compare(arms: dict) -> dict:
    """Tokens/s ratios, each arm at its own largest micro-batch; ``largest``: that size per arm;
    ``fused_capped``: the fused arm still fit at the cap, ``fused_unfinished``: its search was
    stopped before it ended (either way its figure is a floor, not a measurement of its largest
    micro-batch)."""
    base, fused, liger = arms.get("baseline"), arms.get("fused"), arms.get("liger")
    out: dict = dict(largest={a: r.get("largest") for a, r in arms.items()})
    if fused:
        out["fused_capped"] = bool(fused.get("capped"))
        out["fused_unfinished"] = bool(fused.get("unfinished"))
    if base and fused and base.get("tokens_per_s") and fused.get("tokens_per_s"):
        out["fused_vs_baseline"] = fused["tokens_per_s"] / base["tokens_per_s"]
        out["target_1_3"] = out["fused_vs_baseline"] >= SEARCH_TARGET
    if liger and fused and liger.get("tokens_per_s") and fused.get("tokens_per_s"):
        out["fused_vs_liger"] = fused["tokens_per_s"] / liger["tokens_per_s"]
    if liger and base and liger.get("tokens_per_s") and base.get("tokens_per_s"):
        out["liger_vs_baseline"] = liger["tokens_per_s"] / base["tokens_per_s"]
    return out


def _floor(arm: Optional[dict]) -> str:
    """Why an arm's searched figure is a floor, not its largest micro-batch: "cap" (it fit at the
    search's cap), "unfinished" (the run ended before its search did), else ""."""
    if not arm:
        return ""
    return "cap" if arm.get("capped") else ("unfinished" if arm.get("unfinished") else "")


def _ratio_note(num: Optional[dict], den: Optional[dict], names: tuple) -> str:
    """What a tokens/s ratio of two searched arms is when either figure is a floor."""
    a, b = _floor(num), _floor(den)
    if a and b:
        why = "at the cap" if a == b == "cap" else "not searched to the end"
        return f" (both floors: {names[0]} and {names[1]} {why})"
    if a:
        return f" ({names[0]} {'at the cap' if a == 'cap' else 'unfinished'}: a floor)"
    if b:
        return f" ({names[1]} {'at the cap' if b == 'cap' else 'unfinished'}: an upper bound)"
    return ""


def _arms_of(v: dict) -> list:
    return [a for a in ARM_ORDER if a in v]


def plots(results: dict, search: dict, out_dir: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = {"baseline": "-", "liger": ":", "liger_swiglu": "-.", "liger_swiglu_noautotune": "-.", "fused": "--"}
    pairs = [k for k in results if any(_ok(results[k].get(a)) for a in ARM_ORDER)]
    if pairs:
        fig, axes = plt.subplots(1, len(pairs), figsize=(5 * len(pairs), 4), squeeze=False)
        for ax, k in zip(axes[0], pairs):
            for arm in _arms_of(results[k]):
                if _ok(results[k][arm]):
                    h = results[k][arm]["history"]
                    ax.plot([r["step"] for r in h], [r["loss"] for r in h], styles.get(arm, "-"), label=arm)
            ax.set_title(f"{k}: loss per step")
            ax.set_xlabel("step")
            ax.set_ylabel("loss")
            ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "e2e_loss.png"), dpi=110)
        plt.close(fig)

        arms = [a for a in ARM_ORDER if any(a in results[k] for k in pairs)]
        fig, axes = plt.subplots(1, 2, figsize=(12, 4))
        w = 0.8 / max(1, len(arms))
        for i, arm in enumerate(arms):
            xs = [j + i * w for j in range(len(pairs))]
            ok = [results[k].get(arm) if _ok(results[k].get(arm)) else None for k in pairs]
            axes[0].bar(xs, [a["median_tokens_per_s"] / 1e3 if a else 0 for a in ok], w, label=arm)
            axes[1].bar(xs, [(a["peak_alloc_mib"] or 0) / 1024 if a else 0 for a in ok], w, label=arm)
        # tokens/s per optimizer step: comparable across pairs of different accumulation
        for ax, lab in ((axes[0], "tokens/s (thousands, median optimizer step)"),
                        (axes[1], "peak allocated GPU memory (GiB)")):
            ax.set_xticks([j + w * (len(arms) - 1) / 2 for j in range(len(pairs))])
            ax.set_xticklabels(pairs, rotation=25, ha="right", fontsize=8)
            ax.set_ylabel(lab)
            ax.legend()
        fig.suptitle(plot_title(results, pairs))
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "e2e_speed_memory.png"), dpi=110)
        plt.close(fig)

        rows = []
        for k in pairs:
            for a in _arms_of(results[k]):
                b = results[k][a].get("breakdown") if _ok(results[k][a]) else None
                if _attributed(b):
                    rows.append((f"{k} {a}", b))
                    if (_accum_of(results[k][a]) or 1) > 1 and b.get("micro_step_mean"):
                        rows.append((f"{k} {a}: one micro-step's fwd+bwd", b["micro_step_mean"]))
        if rows:
            cats = _categories(b for _, b in rows)
            fig, ax = plt.subplots(figsize=(11, 0.45 * len(rows) + 2))
            left = [0.0] * len(rows)
            cmap = plt.get_cmap("tab20")
            for ci, c in enumerate(cats):
                vals = [b["categories"].get(c, 0.0) for _, b in rows]
                ax.barh(range(len(rows)), vals, left=left, color=cmap(ci % 20), label=c)
                left = [x + y for x, y in zip(left, vals)]
            ax.set_yticks(range(len(rows)))
            ax.set_yticklabels([r[0] for r in rows])
            ax.invert_yaxis()
            ax.set_xlabel("kernel time per profiled optimizer step (ms)")
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
            fig.tight_layout()
            fig.savefig(os.path.join(out_dir, "e2e_breakdown.png"), dpi=110)
            plt.close(fig)

    spairs = [k for k in search if search[k].get("arms")]
    if spairs:
        fig, axes = plt.subplots(1, len(spairs), figsize=(5.5 * len(spairs), 4), squeeze=False)
        for ax, k in zip(axes[0], spairs):
            for arm, s in search[k]["arms"].items():
                ok = sorted((t["batch"], t["median_tokens_per_s"]) for t in s.get("trials", []) if t["status"] == "ok")
                if ok:
                    line, = ax.plot([b for b, _ in ok], [v for _, v in ok], styles.get(arm, "-"), marker="o",
                                    label=f"{arm} (largest {s.get('largest')}"
                                    + {"cap": ", the search cap", "unfinished": " so far, search unfinished"}.get(
                                        _floor(s), "") + ")")
                    if s.get("largest") is not None:
                        ax.plot([s["largest"]], [s["tokens_per_s"]], marker="*", markersize=14,
                                color=line.get_color())
                    failed = [t["batch"] for t in s.get("trials", []) if t["status"] == "oom"]
                    if failed:
                        ax.plot(failed, [0] * len(failed), "x", color=line.get_color())
            ax.set_xscale("log", base=2)
            ax.set_xlabel("micro-batch (sequences; x: out of memory)")
            ax.set_ylabel("tokens/s")
            ax.set_title(f"{k}: tokens/s vs micro-batch")
            if ax.get_legend_handles_labels()[0]:  # (no arm of the pair has a size that ran)
                ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "e2e_throughput.png"), dpi=110)
        plt.close(fig)


def plot_title(results: dict, pairs: list) -> str:
    """The speed and memory plot's title: the model the pairs' arms trained (each pair's own)."""
    models = list(dict.fromkeys(a["model"] for k in pairs for a in results[k].values() if (a or {}).get("model")))
    what = f"model {models[0]}" if len(models) == 1 else "each pair's own model (e2e.md names them)"
    return f"end-to-end: {what}, bf16 (0 = failed or not run)"


def _categories(breakdowns) -> list:
    """The categories of several breakdowns, in order of first appearance (runs of different
    versions of the breakdown, merged by --render, may differ in their categories)."""
    return list(dict.fromkeys(c for b in breakdowns for c in b["categories"]))


def _attributed(b) -> bool:
    """A breakdown of deepspeed_fused.bench.breakdown (not the earlier name heuristic)."""
    return bool(b) and "method" in b


def _f(v, fmt="{:.2f}", none="n/a"):
    return none if v is None else fmt.format(v)


def _accum_of(a: dict) -> Optional[int]:
    """An arm's micro-steps per optimizer step (1 for results recorded before accumulation)."""
    if a.get("gradient_accumulation_steps"):
        return a["gradient_accumulation_steps"]
    h = a.get("history") or [{}]
    return len(h[0].get("micro_losses") or [None])


def targets_text(pairs=None, balanced: bool = True) -> str:
    """The targets of :data:`STEP_TARGETS` in words, of ``pairs`` (default every pair with one);
    ``balanced``: with the rule for balanced runs."""
    shown = [p for p in STEP_TARGETS if pairs is None or p in pairs]
    return ("Targets (the fused arm's optimizer step, every feature on): "
            + ", ".join(f"`{pair}` >= {STEP_TARGETS[pair]['vs_baseline']}x the baseline's and >= "
                        f"{STEP_TARGETS[pair]['vs_liger']}x the Liger arm's" for pair in shown)
            + ("; " if shown else "")
            + f"every pair: the loss of every micro-step within {LOSS_TARGET:.1%} of the baseline's."
            + (f" Balanced runs: an arm's two median steps more than {RUNS_AGREE:.0%} apart flag the pair as not "
               "comparable (the GPU changed under the run)." if balanced else ""))


def markdown(results: dict, search: dict, meta: dict) -> str:
    accum = [(k, v[a]) for k, v in results.items() for a in _arms_of(v) if _ok(v[a]) and (_accum_of(v[a]) or 1) > 1]
    lines = ["# Benchmark `e2e`: training step, features off vs Liger-Kernel vs features on", "",
             f"{meta['date']}, "
             + (f"{meta['gpu']}, " if not meta.get("pair_gpus") else "one GPU per pair (below), ")
             + f"torch {meta['torch']}, Triton {meta['triton']}, "
             f"liger-kernel {meta.get('liger_kernel') or 'not installed'}. "
             + ("" if results and all(k in (meta.get("pair_models") or {}) for k in results) else
                f"Model `{meta['model']}` "
                f"({'Qwen3-30B-A3B layer shape, 4 layers, ' if meta['model'] == 'qwen3-moe-30b-a3b-4l' else ''}"
                "random init), ")
             + f"bf16 on GPU, micro-batch {meta['batch']} x {meta['seq']} tokens, "
             f"{meta['steps']} timed optimizer steps after {meta['warmup']} warm-up"
             + ("".join(f" (`{k}`: {_accum_of(a)} micro-steps each, gradient accumulation)" for k, a in accum[:1]))
             + ". Arms: `baseline` (features off), `liger` "
             "(Liger-Kernel RoPE, RMSNorm and fused linear cross-entropy applied before the model is built, features "
             "off), `fused` (the features of the pair's fused config on); the `features` column says what each run "
             "applied (the plugin's report at the end of the run, and the Liger patches). "
             + ("Balanced (`--balanced`): the arms ran in the order given and then reversed; an arm's step, "
                "micro-step and tokens/s are the means of its runs' medians (the clocks table lists each run). "
                if any(v[a].get("runs") for v in results.values() for a in _arms_of(v)) else "")
             + "Generated by `python -m deepspeed_fused.bench e2e`."
             + ("" if not meta.get("pair_dates") else " Merged from runs of several dates (`--render`); measured: "
                + "; ".join(f"`{k}` {d}" for k, d in meta["pair_dates"].items()) + ".")
             + ("" if not meta.get("pair_gpus") else " GPU of each pair (its arms ran on that one GPU, one after "
                "the other; compare figures within a pair, not across pairs of different GPUs): "
                + "; ".join(f"`{k}` {g}" for k, g in meta["pair_gpus"].items()) + ".")
             + ("" if not meta.get("pair_models") else " Dense pairs (their own models, full depth, random init, "
                "ZeRO-2; `liger`: the family's `apply_liger_kernel_to_<family>()` defaults; `fused`: every feature "
                "on, `mlp_act` included): " + "; ".join(
                    f"`{k}`: `{v['model']}`, {v['args']}" + (f", configs {v['configs']}" if v.get("configs") else "")
                    for k, v in meta["pair_models"].items()) + "."), ""]
    if results:
        lines += ["![loss](e2e_loss.png)", "", "![speed and memory](e2e_speed_memory.png)", "",
                  "Step: one optimizer step (all its micro-steps and the optimizer), wall time; tokens/s: the "
                  "tokens of all its micro-batches per second; fwd+bwd: one micro-step's forward and "
                  "`engine.backward` (CUDA events on a GPU, median over the timed steps' micro-steps).", "",
                  "| pair | arm | features | accum | median step ms | p10-p90 ms | tokens/s | fwd+bwd ms per "
                  "micro-step | peak alloc GiB | peak reserved GiB | final loss |",
                  "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
        for k, v in results.items():
            for arm in _arms_of(v):
                a = v[arm]
                if "error" in a:
                    state = "timeout" if a.get("timeout") else "not run" if a.get("not_run") else "failed"
                    lines.append(f"| {k} | {arm} | {arm_features(a)} | | {state} "
                                 f"| | | | | | {error_headline(a['error'], 200).replace('|', '/')} |")
                    continue
                fb = _fb(a)
                lines.append(f"| {k} | {arm} | {arm_features(a)} | {_accum_of(a)} | {a['median_step_s'] * 1e3:.1f} | "
                             f"{a['step_s_p10'] * 1e3:.1f}-{a['step_s_p90'] * 1e3:.1f} | "
                             f"{a['median_tokens_per_s']:.0f} | "
                             f"{_f(fb * 1e3 if fb else None, '{:.1f}')} | "
                             f"{(a['peak_alloc_mib'] or 0) / 1024:.2f} | {(a['peak_reserved_mib'] or 0) / 1024:.2f} | "
                             f"{a['history'][-1]['loss']:.4f} |")
        lines += ["", targets_text(set(results), any(v[a].get("runs") for v in results.values() for a in _arms_of(v))),
                  "",
                  "| pair | accum | fused vs baseline | fused vs Liger | Liger vs baseline | fwd+bwd fused vs "
                  "baseline / Liger | peak alloc reduction fused / Liger | max loss rel. diff fused / Liger | NaN | "
                  "targets met |",
                  "|---|---:|---:|---:|---:|---|---|---|---|---|"]
        for k, v in results.items():
            c = v.get("compare") or {}
            if "error" in c:
                lines.append(f"| {k} | | {'not run' if c.get('not_run') else 'failed'} | | | | | | | |")
                continue
            mem = (f"{_f(c.get('peak_alloc_reduction'), '{:.1%}')} / "
                   f"{_f(c.get('liger_peak_alloc_reduction'), '{:.1%}')}")
            loss = (f"{_f(c.get('max_loss_rel_diff'), '{:.3%}')} / {_f(c.get('liger_max_loss_rel_diff'), '{:.3%}')}")
            tg = ", ".join(f"{n}: {'yes' if ok else ('n/a' if ok is None else 'no')}"
                           for n, ok in c.get("targets", {}).items())
            if c.get("runs_agree") is False:
                tg += "; runs disagree (checks below): not comparable"
            lines.append(f"| {k} | {_f(c.get('gradient_accumulation_steps') or _accum_of(v['fused']), '{}')} | "
                         f"{_f(c.get('speedup'))} | {_f(c.get('speedup_vs_liger'))} | "
                         f"{_f(c.get('liger_speedup'))} | {_f(c.get('fb_speedup'))} / "
                         f"{_f(c.get('fb_speedup_vs_liger'))} | {mem} | {loss} | "
                         f"{c.get('nan')}{' / ' + str(c['liger_nan']) if 'liger_nan' in c else ''} | {tg} |")
        checks = [(k, x) for k, v in results.items() for x in (v.get("compare") or {}).get("checks", [])]
        if checks:
            lines += ["", "Each target with the measured value (`e2e.json`: `results.PAIR.compare.checks`):", "",
                      "| pair | check | measured | target | met |", "|---|---|---:|---|---|"]
            for k, x in checks:
                m = x.get("measured")
                shown = (_f(m, "{:.3%}") if "loss" in x["name"] else _f(m, "{:.1%}") if x["name"].endswith("_runs_agree")
                         else _f(m, "{:.3f}x"))
                met = "yes" if x.get("met") else ("n/a" if x.get("met") is None else "no")
                lines.append(f"| {k} | {x['what']} | {shown} | {x['target']} | {met} |")
        lines += clocks_table(results)
        swiglu = [((k, arm), v[arm]) for k, v in results.items() for arm in SWIGLU_ARMS if arm in v]
        if swiglu:
            lines += ["", "## Liger's SwiGLU experts (`swiglu=True`)", "",
                      "`LigerExperts` (Liger's fused MoE), with its autotuning (`liger_swiglu`) and with "
                      "`LIGER_FUSED_MOE_AUTOTUNE=0` (`liger_swiglu_noautotune`), each under a time limit.", ""]
            for (pair, arm), a in swiglu:
                k = f"{pair}, {arm}"
                if a.get("timeout"):
                    steps = a.get("steps_seen") or []
                    lines.append(f"- {k}: {a['error']}; steps printed: "
                                 + (", ".join(f"{s} ({ms:.0f} ms)" for s, _, ms in steps[:10]) or "none")
                                 + ". Python stacks shortly before the limit are in `e2e.json` "
                                 f"(`results.{pair}.{arm}.stacks`).")
                elif "error" in a:
                    lines.append(f"- {k}: failed: `{error_headline(a['error'])}`")
                else:
                    first = (a.get("history") or [{}])[0].get("step_s")
                    lines.append(f"- {k}: ran, median step {a['median_step_s'] * 1e3:.1f} ms (first step "
                                 f"{_f(first, '{:.1f}')} s, whole run {_f(a.get('wall_s'), '{:.0f}')} s), peak "
                                 f"allocated {(a['peak_alloc_mib'] or 0) / 1024:.2f} GiB.")
        averaged = [k for k, v in results.items()
                    if any((v[arm].get("breakdown") or {}).get("profiled_steps", 1) > 1
                           for arm in _arms_of(v) if _ok(v[arm]))]
        lines += ["", "## GPU time per category (ms per profiled optimizer step)", "",
                  "![breakdown](e2e_breakdown.png)", ""]
        if averaged:
            lines += ["Balanced (" + ", ".join(f"`{k}`" for k in averaged) + "): each arm's figures are the mean "
                      "of its profiled optimizer steps, one in each of its runs (one early and one late in the "
                      "order), so a kernel that runs slower the later it runs weighs on every arm alike. Other "
                      "pairs: one profiled step per arm.", ""]
        lines += [
                  "Device kernels only (kernels, memcpy, memset), each counted once; the profiler's annotation "
                  "rows (such as `Optimizer.step#AdamW.step`) are not kernels and are not counted. A kernel is "
                  "attributed by name when it is one of this plugin's Triton kernels or NCCL's, otherwise by the "
                  "innermost `record_function` range around its launch: ranges the suite puts around the RMSNorm "
                  "modules, the LM head and loss (from the end of the decoder to the end of the model's forward, "
                  "the router's auxiliary loss cut out), the MoE blocks (split by kernel name into the expert GEMMs "
                  "and the rest), attention, DeepSpeed's `engine.step` (gradient norm, clipping, FP32/BF16 copies) "
                  "with the optimizer's own step inside it, `engine.backward` and ZeRO-3's parameter fetch/release. "
                  "The attention range is split by kernel name into the attention kernels (SDPA's flash, cuDNN "
                  "and memory-efficient kernels), the projection GEMMs and the rest; the MLP range into its GEMMs "
                  "and the gated activation. Backward kernels (on autograd's thread) take the category of the "
                  "forward op that created their autograd node (the profiler's forward-backward flow, else the "
                  "node's sequence number on its own forward thread: a reentrant checkpoint recomputes on "
                  "autograd's thread, else the latest forward op of the node's name); `AccumulateGrad` (where "
                  "ZeRO's gradient hooks run) is `zero: gradients`. The categories add up to the total. With "
                  "gradient accumulation the profiled optimizer step has all its micro-steps. See "
                  "`deepspeed_fused/bench/breakdown.py`.", ""]
        v1 = [k for k, v in results.items() if any(_ok(v[arm]) and (v[arm].get("breakdown") or {}).get("method")
                                                   == METHOD_V1 for arm in _arms_of(v))]
        if v1:
            lines += ["Breakdowns of the earlier attribution rules (" + ", ".join(f"`{k}`" for k in v1) + "): "
                      "cuDNN's attention kernels there count as `GEMMs (attention, MLP)`, a backward node "
                      "recomputed by a reentrant checkpoint, or found by neither flow nor sequence number, as "
                      "`other`, and Liger's per-family norms (`LigerRMSNormForGemma3`) had no norm range.", ""]
        cats = _categories(v[arm]["breakdown"] for v in results.values() for arm in _arms_of(v)
                           if _ok(v[arm]) and _attributed(v[arm].get("breakdown")))
        cats, earlier, header = cats or None, False, False
        for k, v in results.items():
            for arm in _arms_of(v):
                b = v[arm].get("breakdown") if _ok(v[arm]) else None
                earlier = earlier or (bool(b) and not _attributed(b))
                if not _attributed(b):
                    continue
                if not header:
                    header = True
                    lines += ["| pair | arm | total | " + " | ".join(cats) + " |",
                              "|---|---|---:|" + "---:|" * len(cats)]
                lines.append(f"| {k} | {arm} | {b['total_gpu_ms']:.1f} | " +
                             " | ".join(f"{b['categories'].get(c, 0.0):.1f}" for c in cats) + " |")
        micro = [(k, arm, v[arm]["breakdown"]) for k, v in results.items() for arm in _arms_of(v)
                 if _ok(v[arm]) and _attributed(v[arm].get("breakdown")) and v[arm]["breakdown"].get("micro_step_mean")]
        if micro:
            mcats = _categories(b["micro_step_mean"] for _, _, b in micro)
            lines += ["", "### Forward+backward of one micro-step (ms)", "",
                      "The kernels launched during one micro-step's forward and `engine.backward` (a range around "
                      "them; autograd's backward runs while the main thread waits in `engine.backward`), by the same "
                      "categories, the mean over the profiled optimizer step's micro-steps; `rest of step`: the "
                      "kernels launched outside every micro-step (the optimizer step at the accumulation boundary).",
                      "", "| pair | arm | micro-steps | total | " + " | ".join(mcats) + " | rest of step |",
                      "|---|---|---:|---:|" + "---:|" * (len(mcats) + 1)]
            for k, arm, b in micro:
                m = b["micro_step_mean"]
                rest = (b.get("outside_micro_steps") or {}).get("total_gpu_ms")
                lines.append(f"| {k} | {arm} | {_f(m.get('n_micro_steps'), '{:.0f}', '')} | {m['total_gpu_ms']:.1f} | "
                             + " | ".join(f"{m['categories'].get(c, 0.0):.1f}" for c in mcats)
                             + f" | {_f(rest, '{:.1f}')} |")
        idle = [(k, arm, v[arm]["breakdown"]["idle"], v[arm].get("median_step_s")) for k, v in results.items()
                for arm in _arms_of(v) if _ok(v[arm]) and (v[arm].get("breakdown") or {}).get("idle")]
        if idle:
            lines += ["", "### Where the GPU sat idle (ms, the profiled step)", "",
                      "From the first kernel's start to the last one's end (`span`), the time no kernel ran "
                      "(`idle` = span - busy), split at each gap's next kernel: the part before that kernel's "
                      "launch call began is the GPU waiting on the host (by the thread that launched it: the main "
                      "thread's forward and optimizer step, or autograd's backward and recomputation; and by the "
                      "kernel's category, the three longest), the rest launch latency and waits on other streams. "
                      "The profiler's own host overhead is in these figures: the profiled step's span exceeds the "
                      "arm's median step unprofiled (`step`, the table above) by about what the profiler costs the "
                      "host, and `step - busy` is what is left of the idle time without it, if the kernels take as "
                      "long there.", "",
                      "| pair | arm | step | step - busy | span | busy | idle | waiting on the host: main thread | "
                      "autograd's thread | by category | other idle |", "|---|---|" + "---:|" * 7 + "---|---:|"]
            for k, arm, d, step_s in idle:
                step, unprofiled = ("", "") if step_s is None else (f"{step_s * 1e3:.1f}",
                                                                     f"{step_s * 1e3 - d['busy_ms']:.1f}")
                th = d.get("host_by_thread") or {}
                cats = sorted((d.get("host_by_category") or {}).items(), key=lambda kv: -kv[1])[:3]
                top = ", ".join(f"{c} {ms:.1f}" for c, ms in cats)
                if th.get(UNKNOWN_THREAD):
                    top += f" (launching thread not known: {th[UNKNOWN_THREAD]:.1f})"
                lines.append(f"| {k} | {arm} | {step} | {unprofiled} | {d['span_ms']:.1f} | {d['busy_ms']:.1f} | "
                             f"{d['idle_ms']:.1f} | {th.get(MAIN_THREAD, 0.0):.1f} | "
                             f"{th.get(AUTOGRAD_THREAD, 0.0):.1f} | {top or '-'} | {d['other_ms']:.1f} |")
        checks = [(k, arm, v[arm]["breakdown"]) for k, v in results.items() for arm in _arms_of(v)
                  if _ok(v[arm]) and _attributed(v[arm].get("breakdown"))]
        if checks:
            ways = ["name", "range", "backward_link", "accumulate_grad", "device_range", "backward_unlinked",
                    "no_launch", "none"]
            lines += ["", "How each arm's kernel time was attributed (ms): by kernel name, by the range around "
                      "the launch, through the autograd node to its forward op, in `AccumulateGrad`, by a "
                      "device-side range (launch missing); and what fell to `other` unattributed (a backward "
                      "node whose forward op was not found, a kernel without its launch, a launch outside "
                      "every range).", "", "| pair | arm | kernels | " + " | ".join(ways) + " |",
                      "|---|---|---:|" + "---:|" * len(ways)]
            for k, arm, b in checks:
                how = b.get("how", {})
                lines.append(f"| {k} | {arm} | {_f(b.get('n_kernels'), '{:.0f}', '')} | "
                             + " | ".join(f"{how.get(w, 0.0):.1f}" for w in ways) + " |")
            unlinked = [(k, arm, b["unlinked_nodes"]) for k, arm, b in checks if b.get("unlinked_nodes")]
            if unlinked:
                lines += ["", "The `backward_unlinked` time by the autograd node it ran in (ms; the six longest):", "",
                          "| pair | arm | nodes |", "|---|---|---|"]
                for k, arm, nodes in unlinked:
                    lines.append(f"| {k} | {arm} | "
                                 + ", ".join(f"`{n or '?'}` {ms:.2f}" for n, ms in list(nodes.items())[:6]) + " |")
        lines += category_vs_liger_table(results)
        lines += shared_kernels_table(results)
        if earlier:
            lines += ["", "Breakdowns written by the earlier kernel-name heuristic (grouping kernels by name) are in "
                      "`e2e.json` but not shown: they counted annotation rows with their kernels and matched "
                      "`NormTwoOps` as a norm."]
    if search:
        lines += ["", "## Memory -> throughput: the largest micro-batch of each arm", "",
                  "![tokens/s vs micro-batch](e2e_throughput.png)", "",
                  f"Micro-batches of {meta.get('seq')}-token sequences doubled from {meta.get('search_start')} up to "
                  f"the cap {meta.get('search_max')}, then searched between the largest that ran and the smallest that "
                  "did not (a memory-based guess first, then bisection) until the two are adjacent; one process walks "
                  "up a chain of sizes and ends at the first that runs out of memory (caught, memory freed), the next "
                  "candidates run in a fresh process"
                  + ("; the smallest size that failed after other sizes in its process was tried again alone in a "
                     "fresh process" if meta.get("search_confirm", False) else "")
                  + f". Each size ran {meta.get('search_steps')} timed steps after {meta.get('search_warmup')} "
                  f"warm-up (tokens/s: their median). `(cap)`: the arm still fit at the cap, so its figure is a floor, "
                  f"not its largest micro-batch"
                  + ("; `(unfinished)`: the run ended before the arm's search did, its figure is the largest size "
                     "that fit so far, also a floor" if any(_floor(r) == "unfinished" for s in search.values()
                                                             for r in s.get("arms", {}).values()) else "")
                  + f". Target: fused >= {SEARCH_TARGET}x the baseline's tokens/s, each at "
                  "its own largest micro-batch."
                  + ("" if not meta.get("search_dates") else " Searched (merged with `--render`): "
                     + "; ".join(f"`{k}` {d}" for k, d in meta["search_dates"].items()) + "."), "",
                  "| pair | arm | features | largest micro-batch that fit | smallest failed | tokens/s at largest | "
                  "step ms | peak alloc GiB | sizes tried (x: out of memory, !: other failure, a: alone in a fresh "
                  "process, e: from an earlier search of the arm) |", "|---|---|---|---:|---:|---:|---:|---:|---|"]
        for k, s in search.items():
            for arm in [a for a in ARM_ORDER if a in s.get("arms", {})]:
                r = s["arms"][arm]
                tried = " ".join(f"{t['batch']}{'' if t['status'] == 'ok' else ('x' if t['status'] == 'oom' else '!')}"
                                 f"{'a' if t.get('alone') else ''}{'e' if t.get('earlier') else ''}"
                                 for t in sorted(r.get("trials", []),
                                                 key=lambda t: (t["batch"], t.get("alone", False))))
                largest = _f(r.get("largest"), "{}", "none") + (f" ({_floor(r)})" if _floor(r) else "")
                tried += _own_search_settings(r, meta)
                lines.append(f"| {k} | {arm} | {r.get('features') or 'not recorded'} | {largest} | "
                             f"{_f(r.get('smallest_failed'), '{}', '-')} | "
                             f"{_f(r.get('tokens_per_s'), '{:.0f}')} | "
                             f"{_f(r['median_step_s'] * 1e3 if r.get('median_step_s') else None, '{:.1f}')} | "
                             f"{_f((r.get('peak_alloc_mib') or 0) / 1024 if r.get('peak_alloc_mib') else None)} | "
                             f"{tried}{' stopped: ' + r['stopped'][:120] if r.get('stopped') else ''} |"
                             .replace("\n", " "))
        lines += ["", "| pair | largest micro-batch that fit | fused vs baseline (target >= 1.3) | fused vs Liger | "
                  "Liger vs baseline |", "|---|---|---:|---:|---:|"]
        for k, s in search.items():
            c = s.get("compare", {})
            arms = s.get("arms", {})
            sizes = ", ".join(f"{a} {_f(arms[a].get('largest'), '{}', 'none')}"
                              + (f" ({_floor(arms[a])})" if _floor(arms[a]) else "")
                              for a in ARM_ORDER if a in arms)

            def ratio(v, num, den):  # a ratio with a floor on either side says which bound it is
                return _f(v) + (_ratio_note(arms.get(num), arms.get(den), (num, den)) if v is not None else "")

            lines.append(f"| {k} | {sizes} | {ratio(c.get('fused_vs_baseline'), 'fused', 'baseline')} | "
                         f"{ratio(c.get('fused_vs_liger'), 'fused', 'liger')} | "
                         f"{ratio(c.get('liger_vs_baseline'), 'liger', 'baseline')} |")
    return "\n".join(lines) + "\n"


def _own_search_settings(arm: dict, meta: dict) -> str:
    """An arm's search settings where they differ from the page's (an arm searched again in a
    later run, merged by ``--render``), else ""."""
    if not all(arm.get(k) is not None for k in SEARCH_SETTINGS) or all(arm[k] == meta.get(k) for k in SEARCH_SETTINGS):
        return ""
    return (f" (this arm: doubled from {arm['search_start']} up to the cap {arm['search_max']}, "
            f"{arm['search_steps']} timed steps after {arm['search_warmup']} warm-up)")


def _continue_search(earlier: Optional[dict], later: dict) -> dict:
    """A later search of an arm replaces the earlier one; where the later one started above sizes
    the earlier one ran, those trials are kept before the later's (marked ``earlier``), so that the
    page and the plot show the whole range of sizes."""
    start = later.get("search_start")
    if not earlier or start is None or any(t["batch"] < start for t in later.get("trials", [])):
        return later  # (the later arm already carries sizes below its start: merged before)
    below = [dict(t, earlier=True) for t in earlier.get("trials", []) if t["batch"] < start]
    return dict(later, trials=below + list(later.get("trials", []))) if below else later


def _measured(doc: dict, key: str, pair: str, per_pair: Optional[str] = None) -> Optional[str]:
    """A pair's ``date`` or ``gpu`` in one result file: the file's per-pair value where it is itself
    a merge of several (``pair_dates``, ``pair_gpus``, ``search_dates``), else its meta's."""
    meta = doc.get("meta", {})
    return (meta.get(per_pair or f"pair_{key}s") or {}).get(pair) or meta.get(key)


def merge(docs: list) -> tuple:
    """Merge e2e.json documents arm by arm (a later file's arm replaces an earlier one's); the
    comparisons are computed again from the merged arms. Meta: the first document that has
    fixed-setup results (else the first), with the search settings of one that ran a search."""
    results, search = {}, {}
    measured = {"date": {}, "gpu": {}}  # meta key -> pair -> arm -> the value of the arm's file
    searched: dict = {}  # pair -> arm -> the date of the file its search came from
    for d in docs:
        for k, v in d.get("results", {}).items():
            results.setdefault(k, {}).update({a: x for a, x in v.items() if a != "compare"})
            for key, per_pair in measured.items():
                per_pair.setdefault(k, {}).update({a: _measured(d, key, k) for a in v if a != "compare"})
        for k, v in (d.get("search") or {}).items():
            arms = search.setdefault(k, {"arms": {}})["arms"]
            for a, x in v.get("arms", {}).items():
                # an arm without its own settings (an older file) ran with its file's
                x = dict({s: d["meta"][s] for s in SEARCH_SETTINGS if s in d.get("meta", {})}, **x)
                arms[a] = _continue_search(arms.get(a), x)
                searched.setdefault(k, {})[a] = _measured(d, "date", k, "search_dates")
    meta = dict(next((d["meta"] for d in docs if d.get("results")), docs[0]["meta"] if docs else {}))
    for key in ("pair_dates", "pair_gpus", "search_dates"):  # that file's own merge's: computed again below
        meta.pop(key, None)
    for d in docs:
        if d.get("search"):
            meta.update({k: v for k, v in d["meta"].items() if k.startswith("search_") and k != "search_dates"})
            break
    models = {k: v for d in docs for k, v in (d.get("meta", {}).get("pair_models") or {}).items()}
    if models:  # the dense pairs' own models, from every file
        meta["pair_models"] = models
    # the date each pair was measured and its GPU (its arms', from their files' meta), where the
    # files differ (a pair's arms compare only on one GPU)
    for key, per_pair in (("pair_dates", measured["date"]), ("pair_gpus", measured["gpu"]),
                          ("search_dates", searched)):
        by_pair = {k: sorted({y for x in a.values() if x for y in x.split(", ")}) for k, a in per_pair.items()}
        if len({x for v in by_pair.values() for x in v}) > 1:  # (a value a merged file names is "a, b")
            meta[key] = {k: ", ".join(v) for k, v in by_pair.items()}
    for k, v in results.items():
        v["compare"] = compare(k, v)
    for k, v in search.items():
        v["compare"] = search_compare(v["arms"])
    return results, search, meta


def render(paths: list, out_dir: str, write: Optional[Callable] = None) -> dict:
    """Merge earlier result files arm by arm (:func:`merge`) and write the outputs with ``write``
    (``(results, search, meta, out_dir)``; default this suite's)."""
    results, search, meta = merge(read_json(paths))
    return (write or _write)(results, search, meta, out_dir)


def _write(results: dict, search: dict, meta: dict, out_dir: str) -> dict:
    with open(os.path.join(out_dir, "e2e.json"), "w") as f:
        json.dump(dict(meta=meta, results=results, search=search), f, indent=1, default=str)
    md = markdown(results, search, meta)
    with open(os.path.join(out_dir, "e2e.md"), "w") as f:
        f.write(md)
    try:
        plots(results, search, out_dir)
    except Exception as e:
        print("[e2e] plots not written:", e)
    print(md)
    return dict(results=results, search=search)
