"""The e2e suite's driver logic on CPU: micro-batch search, time limits, comparisons, merged outputs."""
import json
import os
import sys
import time

import pytest

from deepspeed_fused.bench import e2e


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
    sizes = [t["batch"] for t in r["trials"]]
    assert len(sizes) == len(set(sizes))  # no size twice
    assert r["processes"] == len(calls) <= 1 + 6  # one per out-of-memory size at most
    assert [t["process"] for t in r["trials"]] == sorted(t["process"] for t in r["trials"])


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
    r = e2e.search_largest(run_sizes, 1, 256)
    assert r["largest"] == fits and r["smallest_failed"] == fits + 1 and r["processes"] <= 2
    plain = e2e.search_largest(lambda c: run_sizes(c, False), 1, 256)
    assert plain["largest"] == fits and plain["processes"] >= r["processes"]


def test_a_wrong_guess_costs_processes_not_the_answer(monkeypatch):
    monkeypatch.setattr(e2e, "predict_largest", lambda trials: 3)  # far too small
    run, _ = fake_runner(21)
    assert e2e.search_largest(run, 1, 64)["largest"] == 21
    monkeypatch.setattr(e2e, "predict_largest", lambda trials: 1000)  # far too large
    run, _ = fake_runner(21)
    assert e2e.search_largest(run, 1, 64)["largest"] == 21


def test_search_capped_nothing_fits_and_other_failures():
    r = e2e.search_largest(fake_runner(100)[0], start=1, max_size=16)
    assert r["largest"] == 16 and r["capped"] and r["smallest_failed"] is None
    r = e2e.search_largest(fake_runner(0)[0], start=1, max_size=16)
    assert r["largest"] is None and r["smallest_failed"] == 1 and r["tokens_per_s"] is None
    r = e2e.search_largest(fake_runner(10, fail_other_at=8)[0], start=1, max_size=64)
    assert r["largest"] == 4 and r["stopped"].startswith("error at micro-batch 8")
    r = e2e.search_largest(fake_runner(10, lose_after=4)[0], start=1, max_size=64)
    assert r["largest"] == 4 and "ended after micro-batch 4" in r["stopped"]


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
    c = e2e.compare("zero2", arms)
    assert c["speedup"] == pytest.approx(0.2 / 0.15) and c["speedup_vs_liger"] == pytest.approx(0.19 / 0.15)
    assert c["liger_speedup"] == pytest.approx(0.2 / 0.19)
    assert c["peak_alloc_reduction"] == pytest.approx(0.2)
    assert c["targets"] == {"loss_0_5pct": True, "speedup_1.22": True, "vs_liger_1.2": True}
    arms["liger"] = dict(error="timeout: no result", timeout=True)
    c = e2e.compare("zero2", arms)
    assert c["targets"]["vs_liger_1.2"] is None and "speedup_vs_liger" not in c
    assert "speedup_1.22" not in e2e.compare("zero3", arms)["targets"]
    assert "error" in e2e.compare("zero2", dict(baseline=dict(error="exit 1"), fused=arms["fused"]))


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
    e2e.render([str(p) for p in paths], str(out))
    d = json.loads((out / "e2e.json").read_text())
    assert set(d["results"]["zero2"]) == {"baseline", "fused", "liger", "liger_swiglu", "compare"}
    assert d["results"]["zero2"]["compare"]["speedup_vs_liger"] == pytest.approx(0.19 / 0.15)
    assert d["search"]["zero2"]["compare"]["fused_vs_baseline"] == pytest.approx(1.5)
    assert d["meta"]["search_max"] == 32
    md = (out / "e2e.md").read_text()
    assert "| zero2 | liger | 190.0 |" in md and "timeout" in md and "| zero2 | fused | 4 | 8 | 600 |" in md
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
    r = e2e.render([str(p)], str(out))
    assert r["results"]["zero2"]["compare"]["speedup"] == pytest.approx(1.25)
    md = (out / "e2e.md").read_text()
    assert "liger-kernel not installed" in md
    old["results"]["zero2"]["baseline"]["breakdown"] = dict(total_gpu_ms=1.0, categories={"gemm": 1.0})
    p.write_text(json.dumps(old))
    e2e.render([str(p)], str(out))
    md = (out / "e2e.md").read_text()
    assert "earlier kernel-name heuristic" in md and "| gemm |" not in md


def test_suite_smoke_on_cpu(tmp_path):
    """The suite end to end through the deepspeed launcher on the tiny model: two arms that run, a
    Liger arm that fails here (its Triton kernels need a GPU) and is recorded, not raised, and a
    micro-batch search that reaches its cap."""
    import subprocess

    env = dict(os.environ, PYTHONPATH=e2e.ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-m", "deepspeed_fused.bench", "e2e", "--quick", "--out", str(tmp_path),
                        "--model", "qwen3-moe-tiny", "--pairs", "zero2", "--arms", "baseline,liger,fused",
                        "--search", "zero2", "--search-arms", "fused", "--search-max", "2", "--arm-timeout", "400",
                        "--search-timeout", "400"], cwd=e2e.ROOT, env=env, capture_output=True, text=True,
                       timeout=1500)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    d = json.loads((tmp_path / "e2e.json").read_text())
    z = d["results"]["zero2"]
    for arm in ("baseline", "fused"):
        assert "error" not in z[arm], z[arm].get("error")
        b = z[arm]["breakdown"]
        assert sum(b["categories"].values()) == pytest.approx(b["total_gpu_ms"])
        assert b["categories"]["rms_norm"] > 0 and b["categories"]["optimizer step"] > 0
    if not __import__("torch").cuda.is_available():
        assert "error" in z["liger"]  # recorded, the suite went on
    assert z["compare"]["max_loss_rel_diff"] <= 0.005
    s = d["search"]["zero2"]["arms"]["fused"]
    assert s["largest"] == 2 and s["capped"] and [t["batch"] for t in s["trials"]] == [1, 2]
    assert (tmp_path / "e2e.md").exists()
