"""The e2e suite's driver logic on CPU: micro-batch search, time limits, comparisons, merged outputs."""
import json
import os
import sys
import time

import pytest
import torch

from deepspeed_fused.bench import e2e
from deepspeed_fused.bench import e2e_report


def fake_runner(fits: int, fail_other_at=None, lose_after=None):
    """run_sizes stand-in: sizes <= fits run, the first larger one is out of memory."""
    calls = []

    def run_sizes(chain):
        calls.append(list(chain))
        out = []
        for b in chain:
            if fail_other_at is not None and b == fail_other_at:
                out.append(dict(batch=b, status="error", error="boom"))
                break
            if lose_after is not None and b > lose_after:
                break
            if b > fits:
                out.append(dict(batch=b, status="oom", error="OutOfMemoryError"))
                break
            out.append(dict(batch=b, status="ok", median_tokens_per_s=1000.0 * b, median_step_s=0.1 * b,
                            peak_alloc_mib=100.0 * b))
        return out

    return run_sizes, calls


@pytest.mark.parametrize("fits", [1, 2, 3, 5, 8, 11, 13, 24, 63])
def test_search_finds_the_largest_size_that_fits(fits):
    run, calls = fake_runner(fits)
    r = e2e.search_largest(run, start=1, max_size=64)
    assert r["largest"] == fits and r["smallest_failed"] == fits + 1
    assert r["tokens_per_s"] == 1000.0 * fits and r["stopped"] is None and not r["capped"]
    assert calls[0] == [1, 2, 4, 8, 16, 32, 64]  # doubling first, one process
    for chain in calls:
        assert chain == sorted(chain)  # each process walks upwards
    sizes = [t["batch"] for t in r["trials"] if not t.get("alone")]
    assert len(sizes) == len(set(sizes))  # no size twice, but for the confirmation
    # the smallest failed size ran out of memory first in a process: by itself, or tried once more
    # alone after it failed behind other sizes
    bound = [t for t in r["trials"] if t["batch"] == fits + 1]
    assert all(t["status"] == "oom" for t in bound) and any(t["position"] == 0 for t in bound)
    confirmed = bound[0]["position"] > 0
    assert r["confirmed_alone"] == ([fits + 1] if confirmed else [])
    if confirmed:
        assert len(bound) == 2 and bound[1]["alone"] and calls[-1] == [fits + 1]
    assert r["processes"] == len(calls) <= 1 + 6 + 1  # one per out-of-memory size at most, and the confirmation
    assert [t["process"] for t in r["trials"]] == sorted(t["process"] for t in r["trials"])
    plain = e2e.search_largest(fake_runner(fits)[0], start=1, max_size=64, confirm=False)
    assert plain["largest"] == fits and plain["processes"] == r["processes"] - confirmed
    assert not any(t.get("alone") for t in plain["trials"])


def fragmenting_runner(fits_alone: int, fits_after_others: int):
    """run_sizes stand-in where memory left by earlier sizes of a process costs room: a size fits
    up to ``fits_alone`` when it is the first of its process, up to ``fits_after_others`` after."""
    calls = []

    def run_sizes(chain):
        calls.append(list(chain))
        out = []
        for i, b in enumerate(chain):
            if b > (fits_alone if i == 0 else fits_after_others):
                out.append(dict(batch=b, status="oom", error="torch.OutOfMemoryError: CUDA out of memory"))
                break
            out.append(dict(batch=b, status="ok", median_tokens_per_s=100.0 * b, median_step_s=0.1,
                            peak_alloc_mib=1.0))
        return out

    return run_sizes, calls


@pytest.mark.parametrize("alone, after", [(40, 31), (9, 8), (64, 20), (23, 22)])
def test_the_smallest_failed_size_is_confirmed_alone_and_the_search_goes_on_above_it(alone, after):
    run, calls = fragmenting_runner(alone, after)
    r = e2e.search_largest(run, start=1, max_size=64)
    assert r["largest"] == alone and r["stopped"] is None
    assert r["smallest_failed"] == (None if alone == 64 else alone + 1) and r["capped"] == (alone == 64)
    assert r["tokens_per_s"] == 100.0 * alone
    for chain in calls:
        assert chain == sorted(chain)
    # every out-of-memory trial that bounds the answer ran first in its process
    if alone < 64:
        bound = [t for t in r["trials"] if t["batch"] == alone + 1 and t["status"] == "oom"]
        assert any(t["position"] == 0 for t in bound)
    # without the confirmation the fragmented answer stands
    plain = e2e.search_largest(fragmenting_runner(alone, after)[0], start=1, max_size=64, confirm=False)
    assert plain["largest"] < alone or alone == after + 1 and plain["largest"] in (after, alone)


def test_a_confirmation_that_fails_otherwise_stops_the_search():
    # fits 13: 16 out of memory after 1..8, then 12 fits and 14 does not after it, 13 fits: 14 is
    # run again alone (the only chain [14])
    def run(chain):
        if chain == [14]:
            return [dict(batch=14, status="error", error="RuntimeError: boom")]
        return fake_runner(13)[0](chain)

    r = e2e.search_largest(run, 1, 64)
    assert r["largest"] == 13 and r["stopped"].startswith("error at micro-batch 14")
    r = e2e.search_largest(lambda c: [] if c == [14] else fake_runner(13)[0](c), 1, 64)
    assert r["largest"] == 13 and "ended before micro-batch 14" in r["stopped"]


@pytest.mark.parametrize("static, per_sample", [(50000, 8000), (60000, 3000), (20000, 20000), (90000, 700)])
def test_search_with_the_memory_guess_takes_two_processes_and_finds_the_same_size(static, per_sample):
    """Peak memory linear in the micro-batch, as on a GPU: the guess from the doubling run's two
    largest sizes lands on the answer, so one more process settles it; without the device's
    memory in the trials the plain bisection finds the same size."""
    total = 143000.0

    def run_sizes(chain, with_total=True):
        out = []
        for b in chain:
            peak = static + per_sample * b
            if peak > total:
                out.append(dict(batch=b, status="oom"))
                break
            out.append(dict(batch=b, status="ok", median_tokens_per_s=10.0 * b, median_step_s=0.1,
                            peak_alloc_mib=peak, device_total_mib=total if with_total else None))
        return out

    fits = int((total - static) // per_sample)
    r = e2e.search_largest(run_sizes, 1, 256, confirm=False)
    assert r["largest"] == fits and r["smallest_failed"] == fits + 1 and r["processes"] <= 2
    plain = e2e.search_largest(lambda c: run_sizes(c, False), 1, 256, confirm=False)
    assert plain["largest"] == fits and plain["processes"] >= r["processes"]
    confirmed = e2e.search_largest(run_sizes, 1, 256)  # at most one more process
    assert confirmed["largest"] == fits and confirmed["processes"] <= r["processes"] + 1


def test_a_wrong_guess_costs_processes_not_the_answer(monkeypatch):
    monkeypatch.setattr(e2e, "predict_largest", lambda trials: 3)  # far too small
    run, _ = fake_runner(21)
    assert e2e.search_largest(run, 1, 64)["largest"] == 21
    monkeypatch.setattr(e2e, "predict_largest", lambda trials: 1000)  # far too large
    run, _ = fake_runner(21)
    assert e2e.search_largest(run, 1, 64)["largest"] == 21


def test_search_out_of_memory_first_in_its_process_is_not_run_again():
    run, calls = fake_runner(0)
    r = e2e.search_largest(run, start=1, max_size=16)
    assert r["largest"] is None and r["smallest_failed"] == 1 and calls == [[1, 2, 4, 8, 16]]
    assert r["confirmed_alone"] == []


def test_search_capped_nothing_fits_and_other_failures():
    r = e2e.search_largest(fake_runner(100)[0], start=1, max_size=16)
    assert r["largest"] == 16 and r["capped"] and r["smallest_failed"] is None
    r = e2e.search_largest(fake_runner(0)[0], start=1, max_size=16)
    assert r["largest"] is None and r["smallest_failed"] == 1 and r["tokens_per_s"] is None
    r = e2e.search_largest(fake_runner(10, fail_other_at=8)[0], start=1, max_size=64)
    assert r["largest"] == 4 and r["stopped"].startswith("error at micro-batch 8")
    r = e2e.search_largest(fake_runner(10, lose_after=4)[0], start=1, max_size=64)
    assert r["largest"] == 4 and "ended after micro-batch 4" in r["stopped"]


def test_search_progress_reports_the_search_as_it_stands_after_every_process():
    """After each process, the sizes measured so far, marked unfinished with the largest that fit
    so far; the finished result is not marked."""
    run, calls = fragmenting_runner(20, 16)
    seen = []
    r = e2e.search_largest(run, start=1, max_size=64, progress=lambda x: seen.append(x))
    assert len(seen) == r["processes"] == len(calls) > 2
    for k, x in enumerate(seen):
        assert x["unfinished"] and not x["capped"] and x["stopped"] is None and x["processes"] == k + 1
        fit = [t["batch"] for t in x["trials"] if t["status"] == "ok"]
        assert x["largest"] == max(fit) and x["tokens_per_s"] == 100.0 * max(fit)
        oom_above = [t["batch"] for t in x["trials"] if t["status"] == "oom" and t["batch"] > max(fit)]
        assert x["smallest_failed"] == (min(oom_above) if oom_above else None)
    assert seen[-1]["largest"] == r["largest"] == 20 and "unfinished" not in r
    assert [x["largest"] for x in seen] == sorted(x["largest"] for x in seen)


def test_a_stopped_search_leaves_its_arm_unfinished_in_the_partial_file(tmp_path, monkeypatch):
    """The suite writes e2e.json after every process of a search: a run stopped from outside
    keeps the arm's sizes so far, marked unfinished, and the page calls the figure a floor."""
    def stopped_search(pair, arm, o, tmp, progress=None, earlier=None):
        run, _ = fake_runner(5)
        calls = []

        def run_sizes(chain):
            calls.append(chain)
            if len(calls) == 2:
                raise KeyboardInterrupt  # the run stopped from outside while its second process ran
            return run(chain)

        def describe(r):
            return dict(r, arm=arm, features="none", **{k: getattr(o, k) for k in e2e_report.SEARCH_SETTINGS})

        return e2e.search_largest(run_sizes, o.search_start, o.search_max, progress=lambda r: progress(describe(r)))

    monkeypatch.setattr(e2e, "run_search", stopped_search)
    args = type("A", (), dict(extra=["--pairs", "none", "--search", "zero2", "--search-arms", "liger,fused"],
                              quick=False, out=str(tmp_path)))()
    with pytest.raises(KeyboardInterrupt):
        e2e.main(args)
    doc = json.loads((tmp_path / "e2e.json").read_text())
    assert doc["partial"]
    liger = doc["search"]["zero2"]["arms"]["liger"]
    assert liger["unfinished"] and liger["largest"] == 4 and liger["smallest_failed"] == 8
    assert [t["batch"] for t in liger["trials"]] == [1, 2, 4, 8] and "fused" not in doc["search"]["zero2"]["arms"]
    out = tmp_path / "page"
    out.mkdir()
    e2e_report.render([str(tmp_path / "e2e.json")], str(out))
    md = (out / "e2e.md").read_text()
    assert "| zero2 | liger | none | 4 (unfinished) | 8 |" in md
    assert "`(unfinished)`: the run ended before the arm's search did" in md


class _Stop(Exception):
    pass


@pytest.mark.parametrize("runner", [lambda: fake_runner(13), lambda: fake_runner(63), lambda: fake_runner(100),
                                    lambda: fragmenting_runner(40, 31), lambda: fragmenting_runner(23, 22),
                                    lambda: fragmenting_runner(64, 20)])
def test_a_resumed_search_runs_the_processes_the_uninterrupted_one_would(runner):
    """Stopped after any process and continued from what ``progress`` kept, the search runs the
    remaining processes of the uninterrupted search and ends with its answer."""
    run, calls = runner()
    whole = e2e.search_largest(run, start=1, max_size=64)
    for k in range(1, whole["processes"]):
        run, calls2 = runner()
        seen = []

        def stop_after_k(chain, run=run, calls2=calls2):
            if len(calls2) == k:
                raise _Stop
            return run(chain)

        with pytest.raises(_Stop):
            e2e.search_largest(stop_after_k, 1, 64, progress=seen.append)
        assert seen[-1]["unfinished"] and seen[-1]["processes"] == k
        run, calls3 = runner()
        r = e2e.search_largest(run, 1, 64, earlier=seen[-1]["trials"])
        assert calls2[:k] + calls3 == calls, k
        for key in ("largest", "smallest_failed", "capped", "processes", "confirmed_alone", "tokens_per_s"):
            assert r[key] == whole[key], (k, key)
        assert [(t["batch"], t["status"], t["process"], t.get("alone", False)) for t in r["trials"]] == \
            [(t["batch"], t["status"], t["process"], t.get("alone", False)) for t in whole["trials"]]
    # a finished search continued runs nothing
    run, calls4 = runner()
    assert e2e.search_largest(run, 1, 64, earlier=whole["trials"])["largest"] == whole["largest"] and not calls4


def _search_opts(*extra):
    return e2e.parse_options(type("A", (), dict(extra=["--pairs", "none", "--search", "zero2", *extra],
                                                quick=False))())


def test_resumable_takes_an_unfinished_arm_with_the_same_settings(tmp_path):
    o = _search_opts("--search-start", "4")
    same = dict(model=e2e.pair_setup("zero2", o, [])[0], seq_len=o.seq_len,
                **{k: getattr(o, k) for k in e2e_report.SEARCH_SETTINGS})
    arm = dict(same, trials=[dict(batch=4, status="ok")], unfinished=True)
    doc = dict(search=dict(zero2=dict(arms=dict(fused=arm, liger=dict(same, trials=[])))))
    assert e2e.resumable(doc, "zero2", "fused", o) is arm
    assert e2e.resumable(doc, "zero2", "liger", o) is None  # finished: searched from the start
    assert e2e.resumable(doc, "zero2", "baseline", o) is None and e2e.resumable({}, "zero2", "fused", o) is None
    with pytest.raises(SystemExit, match=r"search_steps 5 \(this run 3\)"):
        e2e.resumable(doc, "zero2", "fused", _search_opts("--search-start", "4", "--search-steps", "3"))
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    for path, what in ((bad, "expected an e2e.json document"), (tmp_path / "none.json", "expected a readable")):
        with pytest.raises(SystemExit, match=what):
            _search_opts("--search-resume", str(path))


def test_the_suite_continues_the_unfinished_arms_of_the_resume_file(tmp_path, monkeypatch):
    o = _search_opts()
    same = dict(model=e2e.pair_setup("zero2", o, [])[0], seq_len=o.seq_len,
                **{k: getattr(o, k) for k in e2e_report.SEARCH_SETTINGS})
    unfinished = dict(same, trials=[dict(batch=1, status="ok", process=1, position=0)], unfinished=True)
    path = tmp_path / "stopped.json"
    path.write_text(json.dumps(dict(meta={}, results={}, search=dict(zero2=dict(arms=dict(
        liger=unfinished, fused=dict(same, trials=[])))))))
    got = {}

    def fake_search(pair, arm, o, tmp, progress=None, earlier=None):
        got[arm] = earlier
        return dict(trials=[], largest=None, smallest_failed=None, capped=False, tokens_per_s=None)

    monkeypatch.setattr(e2e, "run_search", fake_search)
    args = type("A", (), dict(extra=["--pairs", "none", "--search", "zero2", "--search-arms", "baseline,liger,fused",
                                     "--search-resume", str(path)], quick=False, out=str(tmp_path / "out")))()
    e2e.main(args)
    assert got == dict(baseline=None, liger=unfinished, fused=None)


def test_search_ratios_say_which_bound_a_floor_makes():
    def arm(largest, **flags):
        return dict(trials=[dict(batch=largest, status="ok", median_tokens_per_s=10.0 * largest, median_step_s=1.0)],
                    largest=largest, tokens_per_s=10.0 * largest, median_step_s=1.0,
                    **dict(dict(capped=False), **flags))

    meta = dict(date="d", gpu="g", torch="t", triton="tr", model="m", batch=2, seq=4096, steps=2, warmup=0,
                search_start=4, search_max=64, search_steps=3, search_warmup=1, search_confirm=True)
    search = dict(a=dict(arms=dict(baseline=arm(4), liger=arm(64, capped=True), fused=arm(64, capped=True))),
                  b=dict(arms=dict(baseline=arm(4), liger=arm(28), fused=arm(32, unfinished=True))),
                  c=dict(arms=dict(baseline=arm(4), liger=arm(30, unfinished=True), fused=arm(25))))
    for v in search.values():
        v["compare"] = e2e_report.search_compare(v["arms"])
    rows = {x.split("|")[1].strip(): x for x in e2e_report.markdown({}, search, meta).splitlines()
            if x.count("|") == 6 and "," in x}
    assert "| 16.00 (fused at the cap: a floor) | 1.00 (both floors: fused and liger at the cap) | " \
           "16.00 (liger at the cap: a floor) |" in rows["a"]
    assert "fused 32 (unfinished)" in rows["b"] and "| 8.00 (fused unfinished: a floor) | 1.14 (fused unfinished: a " \
           "floor) | 7.00 |" in rows["b"]
    assert "| 6.25 | 0.83 (liger unfinished: an upper bound) | 7.50 (liger unfinished: a floor) |" in rows["c"]
    assert e2e_report.search_compare(search["b"]["arms"])["fused_unfinished"]


def test_bisect_chain():
    assert e2e.bisect_chain(8, 16) == [12, 14, 15]
    assert e2e.bisect_chain(0, 1) == [] and e2e.bisect_chain(4, 5) == []
    assert e2e.bisect_chain(0, 2) == [1]


def test_run_limited_times_out_and_ends_the_whole_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = ("import subprocess, sys, time\n"
              "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
              f"open({str(pidfile)!r}, 'w').write(str(c.pid))\n"
              "print('[train] step    0  loss 12.3000     250.0 ms', flush=True)\n"
              "time.sleep(120)\n")
    t = time.time()
    r = e2e.run_limited([sys.executable, "-c", script], timeout=5, tmp=str(tmp_path))
    assert r["rc"] is None and time.time() - t < 60
    assert e2e.steps_seen(r["stdout"]) == [(0, 12.3, 250.0)]
    child = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        pytest.fail("the grandchild outlived the time limit")
    r = e2e.run_limited([sys.executable, "-c", "print('hi')"], timeout=60, tmp=str(tmp_path))
    assert r["rc"] == 0 and r["stdout"] == "hi\n"


def _arm(step_s, losses, mem=1000.0, breakdown=None):
    h = [dict(step=i, loss=x, step_s=step_s, tokens_per_s=8192 / step_s, peak_alloc_mib=mem, peak_reserved_mib=mem)
         for i, x in enumerate(losses)]
    return dict(history=h, median_step_s=step_s, median_tokens_per_s=8192 / step_s, peak_alloc_mib=mem,
                peak_reserved_mib=mem, step_s_p10=step_s, step_s_p90=step_s, breakdown=breakdown)


def test_compare_targets():
    arms = dict(baseline=_arm(0.2, [12.0, 11.0]), liger=_arm(0.19, [12.0, 11.01], 900.0),
                fused=_arm(0.15, [12.0, 11.02], 800.0))
    c = e2e_report.compare("zero2", arms)
    assert c["speedup"] == pytest.approx(0.2 / 0.15) and c["speedup_vs_liger"] == pytest.approx(0.19 / 0.15)
    assert c["liger_speedup"] == pytest.approx(0.2 / 0.19)
    assert c["peak_alloc_reduction"] == pytest.approx(0.2)
    # ZeRO-2: 1.30x the baseline, 1.3x Liger; ZeRO-2 on two GPUs: 1.22x the baseline, 1.2x Liger
    assert c["targets"] == {"loss_0_5pct": True, "speedup_1.3": True, "vs_liger_1.3": False}
    assert e2e_report.compare("zero2_2gpu", arms)["targets"] == {"loss_0_5pct": True, "speedup_1.22": True,
                                                          "vs_liger_1.2": True}
    arms["liger"] = dict(error="timeout: no result", timeout=True)
    c = e2e_report.compare("zero2", arms)
    assert c["targets"]["vs_liger_1.3"] is None and "speedup_vs_liger" not in c
    assert set(e2e_report.compare("zero3", arms)["targets"]) == {"loss_0_5pct"}
    assert "error" in e2e_report.compare("zero2", dict(baseline=dict(error="exit 1"), fused=arms["fused"]))


def test_compare_dense_targets_and_balanced_runs_that_disagree():
    def balanced(a, *steps):
        return dict(a, runs=[dict(position=i, median_step_s=s) for i, s in enumerate(steps)])

    arms = dict(baseline=balanced(_arm(0.64, [12.0, 11.0]), 0.643, 0.637),
                liger=balanced(_arm(0.523, [12.0, 11.0]), 0.518, 0.529),
                fused=balanced(_arm(0.453, [12.0, 11.0]), 0.452, 0.453))
    c = e2e_report.compare("dense_llama3_3b", arms)
    # Llama-3.2-3B: 1.3x eager and 1.05x Liger; the Qwen3 and Gemma 3 shapes: 1.1x Liger
    assert c["targets"] == {"loss_0_5pct": True, "speedup_1.3": True, "vs_liger_1.05": True}
    assert c["runs_agree"] is True
    assert {x["name"] for x in c["checks"]} >= {"baseline_runs_agree", "liger_runs_agree", "fused_runs_agree"}
    assert e2e_report.compare("dense_qwen3_1_7b", arms)["targets"]["vs_liger_1.1"] is True
    arms["liger"] = balanced(arms["liger"], 0.436, 0.574)  # one run 32% over the other
    c = e2e_report.compare("dense_qwen3_1_7b", arms)
    assert c["runs_agree"] is False and "liger_runs_agree" not in c["targets"]
    spread = next(x for x in c["checks"] if x["name"] == "liger_runs_agree")
    assert spread["measured"] == pytest.approx(0.574 / 0.436 - 1) and spread["met"] is False
    md = e2e_report.markdown(dict(dense_qwen3_1_7b=dict(arms, compare=c)), {},
                             dict(date="d", gpu="g", torch="t", triton="tr", model="m", batch=2, seq=4096, steps=8,
                                  warmup=2))
    assert "runs disagree (checks below): not comparable" in md
    assert "| dense_qwen3_1_7b | liger: its runs' median steps, slower over faster | 31.7% | <= 5% | no |" in md


def test_render_merges_parts_and_writes_every_output(tmp_path):
    pytest.importorskip("matplotlib")
    cats = {"rms_norm": 1.0, "lm_head + loss": 2.0, "other": 3.0}
    bk = dict(total_gpu_ms=6.0, categories=cats, method="kernels once each")
    meta = dict(date="d", gpu="g", torch="t", triton="tr", liger_kernel="0.8.5", model="m", batch=2, seq=4096,
                steps=2, warmup=0, search_start=1, search_max=64, search_steps=5, search_warmup=2)
    part1 = dict(meta=meta, results=dict(zero2=dict(baseline=_arm(0.2, [12, 11], breakdown=bk),
                                                    fused=_arm(0.15, [12, 11], breakdown=bk))))
    part2 = dict(meta=meta, results=dict(zero2=dict(
        liger=_arm(0.19, [12, 11], breakdown=bk),
        liger_swiglu=dict(error="timeout: no result within 420 s (0 steps printed)", timeout=True, steps_seen=[],
                          stacks="Thread 0x1 ..."))))
    trials = [dict(batch=b, status="ok", median_tokens_per_s=100.0 * b, median_step_s=0.1, peak_alloc_mib=1.0)
              for b in (1, 2, 4)] + [dict(batch=8, status="oom", error="OOM")]
    sarm = dict(trials=trials, largest=4, smallest_failed=8, tokens_per_s=400.0, median_step_s=0.1,
                peak_alloc_mib=1.0, stopped=None, capped=False)
    part3 = dict(meta=dict(meta, search_max=32), results={},
                 search=dict(zero2=dict(arms=dict(baseline=sarm, fused=dict(sarm, tokens_per_s=600.0)))))
    paths = []
    for i, d in enumerate((part1, part2, part3)):
        paths.append(tmp_path / f"p{i}.json")
        paths[-1].write_text(json.dumps(d))
    out = tmp_path / "out"
    out.mkdir()
    e2e_report.render([str(p) for p in paths], str(out))
    d = json.loads((out / "e2e.json").read_text())
    assert set(d["results"]["zero2"]) == {"baseline", "fused", "liger", "liger_swiglu", "compare"}
    assert d["results"]["zero2"]["compare"]["speedup_vs_liger"] == pytest.approx(0.19 / 0.15)
    assert d["search"]["zero2"]["compare"]["fused_vs_baseline"] == pytest.approx(1.5)
    assert d["meta"]["search_max"] == 32
    md = (out / "e2e.md").read_text()
    assert "| zero2 | liger | none | 1 | 190.0 |" in md and "timeout" in md
    assert "| zero2 | fused | not recorded | 4 | 8 | 600 |" in md
    for png in ("e2e_loss.png", "e2e_speed_memory.png", "e2e_breakdown.png", "e2e_throughput.png"):
        assert (out / png).stat().st_size > 0


def test_render_reads_the_earlier_format(tmp_path):
    """An e2e.json written before Liger and the search (two arms, no search key) still renders."""
    meta = dict(date="d", gpu="g", torch="t", triton="tr", model="m", batch=2, seq=4096, steps=2, warmup=0)
    old = dict(meta=meta, results=dict(zero2=dict(baseline=_arm(0.2, [12, 11]), fused=_arm(0.16, [12, 11]),
                                                  compare=dict(speedup=1.25))))
    p = tmp_path / "old.json"
    p.write_text(json.dumps(old))
    out = tmp_path / "out"
    out.mkdir()
    r = e2e_report.render([str(p)], str(out))
    assert r["results"]["zero2"]["compare"]["speedup"] == pytest.approx(1.25)
    md = (out / "e2e.md").read_text()
    assert "liger-kernel not installed" in md
    old["results"]["zero2"]["baseline"]["breakdown"] = dict(total_gpu_ms=1.0, categories={"gemm": 1.0})
    p.write_text(json.dumps(old))
    e2e_report.render([str(p)], str(out))
    md = (out / "e2e.md").read_text()
    assert "earlier kernel-name heuristic" in md and "| gemm |" not in md


def test_merge_names_each_pairs_date_when_the_files_differ():
    meta = dict(date="2026-11-30", gpu="g", torch="t", triton="tr", model="m", batch=2, seq=4096, steps=2, warmup=0)
    old = dict(meta=meta, results=dict(zero2=dict(baseline=_arm(0.2, [12, 11]), liger_swiglu=_arm(0.2, [12, 11])),
                                       zero3=dict(baseline=_arm(0.2, [12, 11]))))
    new = dict(meta=dict(meta, date="2026-12-02"), results=dict(zero2=dict(baseline=_arm(0.19, [12, 11]))))
    _, _, m = e2e_report.merge([old, new])
    assert m["pair_dates"] == {"zero2": "2026-11-30, 2026-12-02", "zero3": "2026-11-30"}
    md = e2e_report.markdown(*e2e_report.merge([old, new]))
    assert "measured: `zero2` 2026-11-30, 2026-12-02; `zero3` 2026-11-30." in md
    _, _, m = e2e_report.merge([old, old])
    assert "pair_dates" not in m


def test_merge_keeps_each_pairs_date_through_a_second_merge():
    """A merged file merged again with a later one keeps the dates it names per pair, for results
    and for searches, instead of taking its own meta's date for every pair."""
    meta = dict(date="2026-12-06", gpu="g", torch="t", triton="tr", model="m", batch=2, seq=4096, steps=2, warmup=0,
                search_start=2, search_max=16, search_steps=3, search_warmup=1)
    arm = dict(trials=[dict(batch=2, status="ok", median_tokens_per_s=1.0, median_step_s=0.1)], largest=2,
               smallest_failed=None, capped=True, tokens_per_s=1.0, median_step_s=0.1)
    a = dict(meta=meta, results=dict(p=dict(baseline=_arm(0.2, [12, 11]))), search=dict(s=dict(arms=dict(liger=arm))))
    b = dict(meta=dict(meta, date="2026-12-07"), results=dict(q=dict(baseline=_arm(0.2, [12, 11]))),
             search=dict(t=dict(arms=dict(liger=arm))))
    res, search, m = e2e_report.merge([a, b])
    assert m["pair_dates"] == {"p": "2026-12-06", "q": "2026-12-07"}
    assert m["search_dates"] == {"s": "2026-12-06", "t": "2026-12-07"}
    assert "Searched (merged with `--render`): `s` 2026-12-06; `t` 2026-12-07." in e2e_report.markdown(res, search, m)
    merged = dict(meta=m, results=res, search=search)
    c = dict(meta=dict(meta, date="2026-12-08"), results={}, search=dict(u=dict(arms=dict(liger=arm))))
    _, _, m2 = e2e_report.merge([merged, c])
    assert m2["pair_dates"] == {"p": "2026-12-06", "q": "2026-12-07"}
    assert m2["search_dates"] == {"s": "2026-12-06", "t": "2026-12-07", "u": "2026-12-08"}
    _, _, m3 = e2e_report.merge([a, a])
    assert "search_dates" not in m3 and "pair_dates" not in m3
    # a later file that replaces every arm of the merged one leaves one date: none named per pair
    d = dict(meta=dict(meta, date="2026-12-09"), results=dict(p=dict(baseline=_arm(0.2, [12, 11])),
                                                            q=dict(baseline=_arm(0.2, [12, 11]))),
             search=dict(s=dict(arms=dict(liger=arm)), t=dict(arms=dict(liger=arm))))
    _, _, m5 = e2e_report.merge([merged, d])
    assert "pair_dates" not in m5 and "search_dates" not in m5, (m5.get("pair_dates"), m5.get("search_dates"))
    # an arm stored without its own settings keeps its file's, and says so beside a later file's page
    c = dict(meta=dict(meta, date="2026-12-08", search_start=4, search_max=64), results={},
             search=dict(u=dict(arms=dict(liger=arm))))
    res, search, m4 = e2e_report.merge([c, a])
    assert search["s"]["arms"]["liger"]["search_start"] == 2 and m4["search_start"] == 4
    row = next(x for x in e2e_report.markdown(res, search, m4).splitlines() if x.startswith("| s | liger |"))
    assert "(this arm: doubled from 2 up to the cap 16, 3 timed steps after 1 warm-up)" in row


def test_the_targets_line_names_the_pages_pairs_and_the_balanced_rule_only_when_used():
    text = e2e_report.targets_text({"zero2", "dense_gemma3_1b"}, balanced=False)
    assert "`zero2` >= 1.3x the baseline's" in text and "`dense_gemma3_1b` >= 1.3x the baseline's and >= 1.1x" in text
    assert "zero2_accum8" not in text and "dense_llama3_3b" not in text and "Balanced runs" not in text
    assert "Balanced runs: an arm's two median steps more than 5% apart" in e2e_report.targets_text({"zero2"})
    assert e2e_report.targets_text(set(), balanced=False).endswith(
        "every feature on): every pair: the loss of every micro-step within 0.5% of the baseline's.")


def test_merge_names_each_pairs_gpu_when_the_files_differ():
    meta = dict(date="2026-12-06", gpu="NVIDIA H100 80GB HBM3", torch="t", triton="tr", model="m", batch=2,
                seq=4096, steps=2, warmup=0)
    h100 = dict(meta=meta, results=dict(zero2=dict(baseline=_arm(0.2, [12, 11]), fused=_arm(0.16, [12, 11]))))
    h200 = dict(meta=dict(meta, gpu="NVIDIA H200"), results=dict(zero3=dict(baseline=_arm(0.2, [12, 11]))))
    res, search, m = e2e_report.merge([h100, h200])
    assert m["pair_gpus"] == {"zero2": "NVIDIA H100 80GB HBM3", "zero3": "NVIDIA H200"}
    md = e2e_report.markdown(res, search, m)
    assert "one GPU per pair (below)" in md and "NVIDIA H100 80GB HBM3, torch" not in md
    assert "`zero2` NVIDIA H100 80GB HBM3; `zero3` NVIDIA H200." in md
    _, _, m = e2e_report.merge([h100, h100])
    assert "pair_gpus" not in m
    assert "NVIDIA H100 80GB HBM3, torch" in e2e_report.markdown(*e2e_report.merge([h100]))


def _run_suite(tmp_path, *args):
    import subprocess

    env = dict(os.environ, PYTHONPATH=e2e.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "deepspeed_fused.bench", "e2e", "--quick", "--out", str(tmp_path),
                        "--model", "qwen3-moe-tiny", "--arm-timeout", "400", *args], cwd=e2e.ROOT, env=env,
                       capture_output=True, text=True, timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads((tmp_path / "e2e.json").read_text()), (tmp_path / "e2e.md").read_text()


# The suite end to end through the deepspeed launcher on the tiny model, in two tests (two pytest
# workers run them side by side): the first pair and the search, then the accumulation pair.
def test_suite_smoke_on_cpu(tmp_path):
    """Two arms that run, a Liger arm that fails here (its Triton kernels need a GPU) and is
    recorded, not raised, and a micro-batch search that reaches its cap."""
    d, md = _run_suite(tmp_path, "--pairs", "zero2", "--arms", "baseline,liger,fused", "--search", "zero2",
                       "--search-arms", "fused", "--search-max", "2", "--search-timeout", "400")
    z = d["results"]["zero2"]
    for arm in ("baseline", "fused"):
        assert "error" not in z[arm], z[arm].get("error")
        b = z[arm]["breakdown"]
        assert sum(b["categories"].values()) == pytest.approx(b["total_gpu_ms"])
        assert b["categories"]["rms_norm"] > 0 and b["categories"]["optimizer step"] > 0
    if not torch.cuda.is_available():
        assert "error" in z["liger"]  # recorded, the suite went on
    assert z["compare"]["max_loss_rel_diff"] <= 0.005
    assert z["fused"]["gradient_accumulation_steps"] == 1 and z["fused"]["median_micro_fb_s"] > 0
    assert len(z["fused"]["breakdown"]["micro_steps"]) == 1
    s = d["search"]["zero2"]["arms"]["fused"]
    assert s["largest"] == 2 and s["capped"] and [t["batch"] for t in s["trials"]] == [1, 2]
    assert s["features"].startswith("ours: linear_cross_entropy")  # on CPU only the loss applies
    assert "| zero2 | fused | ours: linear_cross_entropy (torch reference: no GPU)" in md


def test_suite_smoke_accumulation_on_cpu(tmp_path):
    """The accumulation pair: 8 micro-steps per optimizer step, each timed and profiled."""
    d, md = _run_suite(tmp_path, "--pairs", "zero2_accum8", "--arms", "baseline,fused", "--steps", "1",
                       "--seq-len", "128")
    a = d["results"]["zero2_accum8"]
    for arm in ("baseline", "fused"):
        assert "error" not in a[arm], a[arm].get("error")
        r = a[arm]
        assert r["gradient_accumulation_steps"] == 8 and len(r["history"]) == 2  # 1 timed + 1 warm-up
        assert all(len(h["micro_losses"]) == 8 and len(h["micro_fb_s"]) == 8 for h in r["history"])
        assert r["tokens_per_step"] == 8 * 2 * 128 and r["median_micro_fb_s"] > 0
        b = r["breakdown"]
        assert len(b["micro_steps"]) == 8 and b["micro_step_mean"]["n_micro_steps"] == 8
        assert b["outside_micro_steps"]["categories"]["optimizer step"] > 0  # the step at the boundary
        assert b["micro_step_mean"]["categories"]["optimizer step"] == 0
        assert sum(w["total_gpu_ms"] for w in b["micro_steps"]) + b["outside_micro_steps"]["total_gpu_ms"] == \
            pytest.approx(b["total_gpu_ms"])
    # the loss head's op in every micro-step: on a CPU-only run it runs its torch reference (no GPU)
    assert a["fused"]["report"]["features"][1]["calls"]["reference"] >= 2 * 8
    c = a["compare"]
    assert c["gradient_accumulation_steps"] == 8 and c["max_loss_rel_diff"] <= 0.005 and c["fb_speedup"] > 0
    assert {x["name"] for x in c["checks"]} >= {"loss_0_5pct", "speedup_1.5", "vs_liger_1.3"}
    assert "| zero2_accum8 | fused | ours: linear_cross_entropy (torch reference: no GPU)" in md
    assert "### Forward+backward of one micro-step (ms)" in md and "| zero2_accum8 | fused | 8 |" in md


# ---------------------------------------------------------------------------------------------
# The accumulation pair, the search cap, the features of each arm
# ---------------------------------------------------------------------------------------------

def _opts(*extra, quick=False):
    import argparse

    return e2e.parse_options(argparse.Namespace(extra=list(extra), quick=quick))


def test_options_defaults_and_checks():
    o = _opts()
    assert o.pair_list == ["zero2", "zero2_accum8", "autoep", "zero3"]  # the accumulation pair beside the others
    assert o.arm_list == ["baseline", "liger", "fused"] and o.search_list == []
    assert o.search_max == 64 and o.search_confirm  # the cap: the fused arm runs out of memory below it
    o = _opts("--pairs", "zero2_accum8", "--arms", "baseline,fused", "--search", "zero2,zero2_accum8",
              "--search-arms", "fused", "--search-start", "2", "--no-search-confirm", quick=True)
    assert o.pair_list == ["zero2_accum8"] and o.search_list == ["zero2", "zero2_accum8"]
    assert o.search_arm_list == ["fused"] and o.search_start == 2 and not o.search_confirm
    assert (o.steps, o.warmup, o.seq_len) == (3, 1, 512)
    o = _opts("--steps", "1", "--seq-len", "128", quick=True)  # --quick's sizes are defaults only
    assert (o.steps, o.warmup, o.seq_len) == (1, 1, 128)
    assert _opts("--pairs", "none").pair_list == []
    for bad, msg in ((("--pairs", "zero2_accum4"), "unknown pair 'zero2_accum4'"),
                     (("--arms", "fused,ours"), "unknown arm 'ours'"),
                     (("--search", "zero2_2gpu"), "runs on one GPU"),
                     (("--search", "zero2", "--search-start", "8", "--search-max", "4"), "1 <= start <= max"),
                     (("--search", "zero2", "--search-start", "0"), "1 <= start <= max")):
        with pytest.raises(SystemExit, match=msg):
            _opts(*bad)


def _config(path):
    with open(e2e.config_file(path)) as f:
        return json.load(f)


def test_the_accumulation_pair_is_zero2_with_8_micro_steps_and_every_feature_on():
    from deepspeed_fused.features import all_features

    base, fused, gpus = e2e.PAIRS["zero2_accum8"]
    z_base, z_fused, _ = e2e.PAIRS["zero2"]
    assert gpus == 1
    for acc, ref in ((base, z_base), (fused, z_fused)):
        a, r = _config(acc), _config(ref)
        assert a["gradient_accumulation_steps"] == 8 and r["gradient_accumulation_steps"] == 1
        assert a["zero_optimization"]["stage"] == 2
        a["gradient_accumulation_steps"] = 1
        assert a == r  # nothing else differs from the ZeRO-2 pair
    names = [f.name for f in all_features()]
    assert "rope" in names
    for pair, (b, f, _) in e2e.PAIRS.items():  # every fused config of the suite: every registered feature on
        section = _config(f)["deepspeed_fused"]
        assert all(section[n]["enabled"] for n in names), (pair, f)
        assert not any(v.get("enabled") for v in _config(b)["deepspeed_fused"].values()), (pair, b)
    # the shipped copies (the package's configs/) are the same files
    from deepspeed_fused.train import find_config

    assert os.path.samefile(find_config("configs/accum8_fused.json"), e2e.config_file(fused))


def _feature_report(on: bool, rope_eager: int = 0):
    feats = []
    for n in ("rms_norm", "linear_cross_entropy", "moe_reorder", "rope"):
        calls = dict(fused=100, eager=rope_eager if n == "rope" else 0) if on else None
        feats.append(dict(name=n, enabled=on, applied=on, where="x" if on else "", reason="", fallback="",
                          calls=calls))
    return dict(features=feats)


def test_arm_features_say_what_ran():
    assert e2e_report.arm_features(dict(report=_feature_report(False))) == "none"
    assert e2e_report.arm_features(dict(report=_feature_report(True))) == \
        "ours: rms_norm, linear_cross_entropy, moe_reorder, rope"
    assert e2e_report.arm_features(dict(report=_feature_report(True, rope_eager=3))).endswith(
        "rope (100 fused / 3 eager calls)")
    rep = _feature_report(True)
    rep["features"][3].update(applied=False, reason="no rotary embedding found")
    rep["features"][0]["fallback"] = "torch reference: no GPU"
    assert e2e_report.arm_features(dict(report=rep)) == ("ours: rms_norm (torch reference: no GPU), linear_cross_entropy, "
                                                  "moe_reorder; rope enabled, not applied (no rotary embedding found)")
    liger = ("liger-kernel 0.8.5: apply_liger_kernel_to_qwen3_moe(rope=True, rms_norm=True, "
             "fused_linear_cross_entropy=True, swiglu=False)")
    assert e2e_report.arm_features(dict(report=_feature_report(False), liger=liger)) == \
        "Liger: rope, rms_norm, fused_linear_cross_entropy"
    assert e2e_report.arm_features(dict(error="timeout")).startswith("n/a")


def _accum_arm(step_s, fb_s, losses, accum=8, mem=1000.0, liger=None, on=False, breakdown=None):
    """An arm's record as train.py writes it with ``accum`` micro-steps per optimizer step."""
    h = [dict(step=i, loss=sum(ml) / len(ml), step_s=step_s, tokens_per_s=2 * 4096 * accum / step_s,
              peak_alloc_mib=mem, peak_reserved_mib=mem, micro_fb_s=[fb_s] * accum, micro_losses=list(ml))
         for i, ml in enumerate(losses)]
    return dict(history=h, median_step_s=step_s, median_tokens_per_s=2 * 4096 * accum / step_s,
                median_micro_fb_s=fb_s, gradient_accumulation_steps=accum, peak_alloc_mib=mem,
                peak_reserved_mib=mem, step_s_p10=step_s, step_s_p90=step_s, breakdown=breakdown,
                report=_feature_report(on), liger=liger)


def test_compare_the_accumulation_pair_micro_step_losses_and_step_targets():
    ml = [[12.0 - 0.01 * m for m in range(8)], [11.9 - 0.01 * m for m in range(8)]]
    off = [[x * 1.001 for x in s] for s in ml]
    off[1][5] = ml[1][5] * 1.006  # one micro-step past 0.5%: the mean of its step is within
    arms = dict(baseline=_accum_arm(1.2, 0.13, ml), liger=_accum_arm(1.15, 0.125, ml),
                fused=_accum_arm(0.78, 0.085, off, on=True))
    c = e2e_report.compare("zero2_accum8", arms)
    assert c["gradient_accumulation_steps"] == 8
    assert c["speedup"] == pytest.approx(1.2 / 0.78) and c["speedup_vs_liger"] == pytest.approx(1.15 / 0.78)
    assert c["fb_speedup"] == pytest.approx(0.13 / 0.085) and c["fb_speedup_vs_liger"] == pytest.approx(0.125 / 0.085)
    assert c["max_loss_rel_diff"] == pytest.approx(0.006)  # micro-step by micro-step
    assert c["targets"] == {"loss_0_5pct": False, "speedup_1.5": True, "vs_liger_1.3": True}
    checks = {x["name"]: x for x in c["checks"]}
    assert checks["speedup_1.5"]["measured"] == pytest.approx(1.2 / 0.78) and checks["speedup_1.5"]["target"] == ">= 1.5"
    assert checks["loss_0_5pct"]["what"].endswith("every micro-step")
    assert checks["liger_loss_0_5pct"]["met"]
    arms["fused"] = _accum_arm(0.9, 0.09, ml, on=True)
    c = e2e_report.compare("zero2_accum8", arms)
    assert c["targets"] == {"loss_0_5pct": True, "speedup_1.5": False, "vs_liger_1.3": False}
    # at accumulation 1 the ZeRO-2 targets: 1.30x the baseline, 1.3x Liger
    one = dict(baseline=_accum_arm(0.2, 0.12, [[12.0], [11.0]], accum=1),
               liger=_accum_arm(0.19, 0.11, [[12.0], [11.0]], accum=1),
               fused=_accum_arm(0.15, 0.08, [[12.0], [11.0]], accum=1, on=True))
    assert e2e_report.compare("zero2", one)["targets"] == {"loss_0_5pct": True, "speedup_1.3": True, "vs_liger_1.3": False}
    # arms of different accumulation do not line up: no loss comparison, the target not met
    mixed = dict(baseline=one["baseline"], fused=arms["fused"])
    assert e2e_report.compare("zero2", mixed)["max_loss_rel_diff"] is None


def test_run_arm_launches_the_accumulation_configs(tmp_path, monkeypatch):
    seen = []

    def launch(train_args, num_gpus, timeout, tmp, env_extra=None):
        a = {k: train_args[i + 1] for i, k in enumerate(train_args[:-1]) if k.startswith("--")}
        seen.append(a)
        fused = "fused" in os.path.basename(a["--deepspeed_config"])
        accum = _config(a["--deepspeed_config"])["gradient_accumulation_steps"]
        rec = _accum_arm(0.8 if fused else 1.2, 0.09 if fused else 0.13, [[12.0] * accum] * int(a["--steps"]),
                         accum=accum, on=fused)
        with open(a["--metrics-out"], "w") as f:
            json.dump(rec, f)
        return dict(rc=0, stdout="", stderr="", wall_s=1.0)

    monkeypatch.setattr(e2e, "launch", launch)
    o = _opts("--pairs", "zero2_accum8", "--arms", "baseline,fused", "--steps", "4", "--warmup", "1")
    arms = {arm: e2e.run_arm("zero2_accum8", arm, o, str(tmp_path)) for arm in ("baseline", "fused")}
    assert [os.path.basename(a["--deepspeed_config"]) for a in seen] == ["accum8_baseline.json", "accum8_fused.json"]
    assert all(a["--steps"] == "5" and "--profile-out" in a for a in seen)  # optimizer steps, timed + warm-up
    c = e2e_report.compare("zero2_accum8", arms)
    assert c["speedup"] == pytest.approx(1.5) and c["fb_speedup"] == pytest.approx(0.13 / 0.09)


def _bk(total, cats, micro=None, n=8, rest=0.0):
    b = dict(total_gpu_ms=total, categories=cats, method="kernels once each", how={"range": total}, n_kernels=10)
    if micro is not None:
        b.update(micro_step_mean=dict(total_gpu_ms=sum(micro.values()), categories=micro, n_micro_steps=n),
                 outside_micro_steps=dict(total_gpu_ms=rest, categories={}, n_kernels=1))
    return b


def test_render_the_accumulation_rows_targets_and_search_sizes(tmp_path):
    meta = dict(date="d", gpu="g", torch="t", triton="tr", liger_kernel="0.8.5", model="m", batch=2, seq=4096,
                steps=2, warmup=0, search_start=2, search_max=64, search_steps=5, search_warmup=2,
                search_confirm=True)
    ml = [[12.0] * 8, [11.9] * 8]
    liger = "liger-kernel 0.8.5: apply_liger_kernel_to_qwen3_moe(rope=True, rms_norm=True, swiglu=False)"
    results = dict(zero2_accum8=dict(
        baseline=_accum_arm(1.2, 0.13, ml, breakdown=_bk(1150.0, {"rms_norm": 110.0, "other": 1040.0},
                                                         {"rms_norm": 13.75, "other": 120.0}, rest=80.0)),
        liger=_accum_arm(1.15, 0.125, ml, liger=liger),
        fused=_accum_arm(0.78, 0.085, ml, on=True, breakdown=_bk(760.0, {"rms_norm": 8.0, "other": 752.0},
                                                                 {"rms_norm": 1.0, "other": 84.0}, rest=80.0))))
    fits = [dict(batch=b, status="ok", median_tokens_per_s=1000.0 * b, median_step_s=0.1, peak_alloc_mib=1.0,
                 position=i, process=1) for i, b in enumerate((2, 4, 8, 16, 32))]
    fused_s = dict(trials=fits + [dict(batch=64, status="oom", position=5, process=1),
                                  dict(batch=37, status="ok", median_tokens_per_s=40000.0, median_step_s=0.1,
                                       peak_alloc_mib=1.0, position=0, process=2),
                                  dict(batch=38, status="oom", position=1, process=2),
                                  dict(batch=38, status="oom", position=0, process=3, alone=True)],
                   largest=37, smallest_failed=38, capped=False, tokens_per_s=40000.0, median_step_s=0.1,
                   peak_alloc_mib=1.0, features="ours: rms_norm, linear_cross_entropy, moe_reorder, rope")
    base_s = dict(trials=fits[:3] + [dict(batch=16, status="oom")], largest=8, smallest_failed=9, capped=False,
                  tokens_per_s=8000.0, median_step_s=0.1, peak_alloc_mib=1.0, features="none")
    p = tmp_path / "in.json"
    p.write_text(json.dumps(dict(meta=meta, results=results,
                                 search=dict(zero2=dict(arms=dict(baseline=base_s, fused=fused_s))))))
    out = tmp_path / "out"
    out.mkdir()
    d = e2e_report.render([str(p)], str(out))
    md = (out / "e2e.md").read_text()
    assert ("| zero2_accum8 | fused | ours: rms_norm, linear_cross_entropy, moe_reorder, rope | 8 | 780.0 | "
            "780.0-780.0 | 84021 | 85.0 |") in md
    assert "| zero2_accum8 | baseline | none | 8 | 1200.0 |" in md
    assert "| zero2_accum8 | liger | Liger: rope, rms_norm | 8 |" in md
    assert "(`zero2_accum8`: 8 micro-steps each, gradient accumulation)" in md
    assert "| zero2_accum8 | 8 | 1.54 | 1.47 | 1.04 | 1.53 / 1.47 |" in md
    assert "| zero2_accum8 | optimizer step, fused vs baseline | 1.538x | >= 1.5 | yes |" in md
    assert "| zero2_accum8 | max loss rel. diff fused vs baseline, every micro-step | 0.000% | <= 0.5% | yes |" in md
    assert "`zero2_accum8` >= 1.5x the baseline's and >= 1.3x the Liger arm's" in md
    assert "### Forward+backward of one micro-step (ms)" in md
    assert "| zero2_accum8 | fused | 8 | 85.0 | 1.0 |" in md and "| 80.0 |" in md
    assert "| zero2 | fused | ours: rms_norm, linear_cross_entropy, moe_reorder, rope | 37 | 38 | 40000 |" in md
    assert "2 4 8 16 32 37 38x 38xa 64x" in md
    assert "| zero2 | baseline 8, fused 37 | 5.00 |" in md and "a floor" not in md.split("| zero2 | baseline 8")[1]
    assert d["search"]["zero2"]["compare"]["largest"] == dict(baseline=8, fused=37)
    assert d["search"]["zero2"]["compare"]["fused_capped"] is False
    assert "this arm:" not in md  # neither arm records settings of its own

    # the fused arm still fitting at the cap: said, and its ratio marked as a floor
    fused_s.update(largest=64, smallest_failed=None, capped=True)
    p.write_text(json.dumps(dict(meta=meta, results={}, search=dict(zero2=dict(arms=dict(baseline=base_s,
                                                                                         fused=fused_s))))))
    e2e_report.render([str(p)], str(out))
    md = (out / "e2e.md").read_text()
    assert "| zero2 | baseline 8, fused 64 (cap) | 5.00 (fused at the cap: a floor) |" in md


class _FakeEngine:
    """Stands in for a DeepSpeed engine in train.py's loops: counts the micro-steps, the
    optimizer steps (every ``accum``-th ``step()``, as DeepSpeed does) and the batches it saw."""

    def __init__(self, accum, oom_above=None):
        self.accum, self.oom_above = accum, oom_above
        self.micro, self.optimizer_steps, self.seen, self.zeroed, self.sizes = 0, 0, [], 0, []

    def gradient_accumulation_steps(self):
        return self.accum

    def set_train_micro_batch_size(self, b):
        self.sizes.append(b)

    def __call__(self, input_ids, labels):
        import types

        if self.oom_above is not None and input_ids.shape[0] > self.oom_above:
            self.big = torch.empty(1000)  # what a failed step leaves behind
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        self.seen.append(input_ids.clone())
        w = torch.ones((), requires_grad=True)
        return types.SimpleNamespace(loss=w * (10.0 + 0.001 * len(self.seen)))

    def backward(self, loss):
        loss.backward()

    def step(self):
        self.micro += 1
        if self.micro % self.accum == 0:
            self.optimizer_steps += 1

    def zero_grad(self):
        self.zeroed += 1


def _train_args(**kw):
    import argparse

    d = dict(seq_len=8, seed=3, batch_sizes=None, steps=3, warmup=1)
    d.update(kw)
    return argparse.Namespace(**d)


def test_render_names_an_arm_searched_with_other_settings(tmp_path):
    """An arm searched again with another start and cap (merged from a later run) says so in its
    row; an arm with the page's settings does not."""
    meta = dict(date="d", gpu="g", torch="t", triton="tr", liger_kernel="0.8.5", model="m", batch=2, seq=4096,
                steps=2, warmup=0, search_start=2, search_max=16, search_steps=3, search_warmup=1,
                search_confirm=True)
    same = dict(search_start=2, search_max=16, search_steps=3, search_warmup=1)

    def arm(sizes, largest, capped, **settings):
        trials = [dict(batch=b, status="ok", median_tokens_per_s=1000.0 * b, median_step_s=0.1, peak_alloc_mib=1.0,
                       position=i, process=1) for i, b in enumerate(sizes)]
        return dict(trials=trials, largest=largest, smallest_failed=None, capped=capped,
                    tokens_per_s=1000.0 * largest, median_step_s=0.1, peak_alloc_mib=1.0, features="none",
                    **settings)

    first = dict(meta=meta, results={}, search=dict(p=dict(arms=dict(baseline=arm((2, 4), 4, False, **same),
                                                                    fused=arm((2, 4, 8, 16), 16, True, **same)))))
    later = dict(meta=dict(meta, search_start=16, search_max=64), results={},
                 search=dict(p=dict(arms=dict(fused=arm((16, 32, 64), 64, True, search_start=16, search_max=64,
                                                        search_steps=3, search_warmup=1)))))
    paths = []
    for i, doc in enumerate((first, later)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(doc))
    out = tmp_path / "out"
    out.mkdir()
    e2e_report.render([str(x) for x in paths], str(out))
    md = (out / "e2e.md").read_text()
    assert "doubled from 2 up to the cap 16" in md
    row = next(x for x in md.splitlines() if x.startswith("| p | fused |"))
    # the earlier search's sizes below the later start are kept, marked; its 16 gives way to the later 16
    assert "| 64 (cap) |" in row
    assert "| 2e 4e 8e 16 32 64 (this arm: doubled from 16 up to the cap 64, 3 timed steps" in row
    base = next(x for x in md.splitlines() if x.startswith("| p | baseline |"))
    assert "this arm:" not in base and "e " not in base.split("|")[-2]
    merged = json.loads((out / "e2e.json").read_text())["search"]["p"]["arms"]["fused"]
    assert [t["batch"] for t in merged["trials"]] == [2, 4, 8, 16, 32, 64]
    assert [t.get("earlier", False) for t in merged["trials"]] == [True] * 3 + [False] * 3
    assert merged["largest"] == 64 and merged["capped"]
    # the merged page merged again, with itself: no size twice
    again = tmp_path / "again"
    again.mkdir()
    e2e_report.render([str(out / "e2e.json"), str(out / "e2e.json")], str(again))
    twice = json.loads((again / "e2e.json").read_text())["search"]["p"]["arms"]["fused"]
    assert [t["batch"] for t in twice["trials"]] == [2, 4, 8, 16, 32, 64]


def test_train_steps_with_accumulation_time_each_micro_step(monkeypatch):
    from deepspeed_fused import train

    monkeypatch.setattr(train.deepspeed.comm, "get_world_size", lambda: 1)
    eng = _FakeEngine(accum=4)
    args = _train_args()
    hist = train.run_steps(eng, args, batch=2, steps=3, rank=0, device=torch.device("cpu"), vocab=50)
    assert eng.micro == 12 and eng.optimizer_steps == 3 and len(hist) == 3
    for i, r in enumerate(hist):
        assert len(r["micro_fb_s"]) == 4 and all(x > 0 for x in r["micro_fb_s"])
        assert r["micro_losses"] == pytest.approx([10.0 + 0.001 * (4 * i + m + 1) for m in range(4)])
        assert r["loss"] == pytest.approx(sum(r["micro_losses"]) / 4)
        assert r["tokens_per_s"] == pytest.approx(2 * 8 * 4 / r["step_s"])  # every micro-batch's tokens
        assert sum(r["micro_fb_s"]) <= r["step_s"]
    # micro-batch k of the run is the synthetic batch with index k (world size 1): distinct data
    for k, ids in enumerate(eng.seen):
        assert torch.equal(ids, train.synthetic_batch(k, 2, 8, 50, 3, "cpu"))
    s = train.summarize(hist, warmup=1)
    import statistics

    # over every micro-step of the timed steps (8 of them: the mean of the middle two)
    assert s["median_micro_fb_s"] == statistics.median(x for r in hist[1:] for x in r["micro_fb_s"])
    # one micro-step: the batch index each step always had
    eng1 = _FakeEngine(accum=1)
    train.run_steps(eng1, args, batch=2, steps=2, rank=0, device=torch.device("cpu"), vocab=50)
    assert torch.equal(eng1.seen[1], train.synthetic_batch(1, 2, 8, 50, 3, "cpu"))


def test_train_search_catches_out_of_memory_and_frees_it(monkeypatch):
    import sys as _sys

    from deepspeed_fused import train

    monkeypatch.setattr(train.deepspeed.comm, "get_world_size", lambda: 1)
    freed = []

    def free_memory(engine):
        freed.append(_sys.exc_info()[0])  # None: no exception (and its frames) alive any more
        engine.zero_grad()

    monkeypatch.setattr(train, "free_memory", free_memory)
    eng = _FakeEngine(accum=2, oom_above=3)
    written = []
    r = train.search(eng, _train_args(batch_sizes="1,2,3,4,8", steps=2, warmup=1), 0, torch.device("cpu"), 50,
                     write=lambda t: written.append(len(t)))
    t = r["trials"]
    assert [x["batch"] for x in t] == [1, 2, 3, 4] and [x["status"] for x in t] == ["ok"] * 3 + ["oom"]
    assert t[-1]["error"].startswith("OutOfMemoryError: CUDA out of memory")
    assert all(x["gradient_accumulation_steps"] == 2 and x["median_micro_fb_s"] > 0 for x in t[:3])
    assert t[0]["median_tokens_per_s"] > 0 and len(t[0]["history"]) == 2
    assert eng.sizes == [1, 2, 3, 4]  # 8 never tried: the process ends at the first failure
    assert freed == [None] * 4 and written[-1] == 4
    # any other failure is recorded as one, not as out of memory
    class Broken(_FakeEngine):
        def __call__(self, input_ids, labels):
            raise RuntimeError("shape mismatch")

    r = train.search(Broken(accum=1), _train_args(batch_sizes="1,2"), 0, torch.device("cpu"), 50)
    assert r["trials"] == [dict(batch=1, status="error", error="RuntimeError: shape mismatch",
                                allocated_after_mib=None)]  # (None: no GPU memory on CPU)


def test_the_page_shows_where_the_gpu_sat_idle_and_balanced_runs_average_it():
    from deepspeed_fused.bench.breakdown import AUTOGRAD_THREAD, MAIN_THREAD, UNKNOWN_THREAD

    def bk(host_main, host_bwd, cats):
        host = host_main + host_bwd
        idle = dict(span_ms=300.0, busy_ms=300.0 - host - 2.0, idle_ms=host + 2.0, host_ms=host, other_ms=2.0, gaps=10,
                    host_by_category=cats, host_by_thread={MAIN_THREAD: host_main, AUTOGRAD_THREAD: host_bwd})
        return dict(total_gpu_ms=300.0 - host - 2.0, categories={"other": 300.0 - host - 2.0}, idle=idle)

    runs = [dict(_arm(0.3, [12.0, 11.0], breakdown=bk(30.0, 10.0, {"rms_norm": 25.0, "mlp activation": 15.0})),
                 position=0),
            dict(_arm(0.3, [12.0, 11.0], breakdown=bk(50.0, 30.0, {"mlp activation": 70.0, "attention": 10.0})),
                 position=1)]
    fused = e2e.combine_runs(runs)
    idle = fused["breakdown"]["idle"]
    assert idle["host_ms"] == pytest.approx(60.0) and idle["host_by_thread"][MAIN_THREAD] == pytest.approx(40.0)
    # a category one run lacks counts 0 there
    assert idle["host_by_category"] == pytest.approx({"rms_norm": 12.5, "mlp activation": 42.5, "attention": 5.0})
    arms = dict(baseline=_arm(0.4, [12.0, 11.0], breakdown=dict(total_gpu_ms=1.0, categories={"other": 1.0})),
                fused=fused)
    md = e2e_report.markdown(dict(zero2=arms), {}, dict(date="d", gpu="g", torch="t", triton="tr", model="m", batch=2,
                                                        seq=4096, steps=8, warmup=2))
    assert "### Where the GPU sat idle" in md
    # longest first, after averaging; the baseline arm has no idle record and no row
    # the median step unprofiled (300 ms) and what it leaves idle beside the profiled step's busy time
    assert "| zero2 | fused | 300.0 | 62.0 | 300.0 | 238.0 | 62.0 | 40.0 | 20.0 | mlp activation 42.5, " \
           "rms_norm 12.5, attention 5.0 | 2.0 |" in md
    assert "| zero2 | baseline | 400.0" not in md
    unknown = bk(4.0, 0.0, {"rms_norm": 4.0})  # 4 ms waited on the host, its thread not known
    unknown["idle"]["host_by_thread"] = {UNKNOWN_THREAD: 4.0}
    arms["liger"] = _arm(0.35, [12.0, 11.0], breakdown=unknown)
    md = e2e_report.markdown(dict(zero2=arms), {}, dict(date="d", gpu="g", torch="t", triton="tr", model="m", batch=2,
                                                        seq=4096, steps=8, warmup=2))
    assert "| zero2 | liger | 350.0 | 56.0 | 300.0 | 294.0 | 6.0 | 0.0 | 0.0 | rms_norm 4.0 (launching thread " \
           "not known: 4.0) |" in md


def test_plot_title_names_the_model_each_pair_trained():
    moe = {"zero2": {"baseline": {"model": "qwen3-moe-30b-a3b-4l"}, "fused": {"model": "qwen3-moe-30b-a3b-4l"},
                     "compare": {}}}
    title = e2e_report.plot_title(moe, ["zero2"])
    assert title == "end-to-end: model qwen3-moe-30b-a3b-4l, bf16 (0 = failed or not run)"
    dense = dict(moe, dense_qwen3_4b={"liger": {"model": "qwen3-4b"}, "fused": {"error": "oom"}})
    title = e2e_report.plot_title(dense, ["zero2", "dense_qwen3_4b"])
    assert "each pair's own model" in title and "qwen3-moe" not in title
