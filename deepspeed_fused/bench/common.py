"""The benchmark harness: time implementations side by side in one process and write results.

A suite module exposes ``run(args) -> list[Record]``. Timings are medians of
``triton.testing.do_bench`` after warm-up (CUDA events when Triton is absent); peak memory is
measured above what was allocated before the call (the inputs). Results go to
``docs/benchmarks/SUITE.json`` under the current directory or ``--out`` (one record per
implementation and shape), ``SUITE.md`` (a table
with each implementation's ratio to the best peer of the same shape) and ``SUITE.png``.
"""
from __future__ import annotations

import dataclasses
import datetime
import gc
import json
import os
import socket
import statistics
import time
from typing import Callable, Optional

import torch

# where results go without --out: relative to the current directory (in a clone's root, its
# docs/benchmarks/); never inside the installed package
OUT_DIR = os.path.join("docs", "benchmarks")


def free_port() -> int:
    """A TCP port free on this host now (for a launcher's ``--master_port``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_json(paths: list) -> list:
    """The documents of JSON files (earlier results, for a suite's ``--render``)."""
    docs = []
    for path in paths:
        with open(path) as f:
            docs.append(json.load(f))
    return docs


@dataclasses.dataclass
class Record:
    suite: str
    impl: str
    shape: str
    dtype: str
    ours: bool = False
    fwd_ms: Optional[float] = None
    fwd_bwd_ms: Optional[float] = None
    unit: str = ""  # "TB/s" or "TFLOP/s"
    fwd_rate: Optional[float] = None  # effective TB/s or TFLOP/s of the forward
    fwd_bwd_rate: Optional[float] = None
    peak_extra_mib: Optional[float] = None
    note: str = ""
    extra: dict = dataclasses.field(default_factory=dict)
    gpu: str = ""
    torch: str = ""
    triton: str = ""
    date: str = ""


def package_version(name: str) -> Optional[str]:
    """The installed version of distribution ``name``, or None where it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def env_fields() -> dict:
    try:
        import triton

        tv = triton.__version__
    except Exception:
        tv = ""
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return dict(gpu=gpu, torch=torch.__version__, triton=tv,
                date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"))


def bench_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100, min_runs: int = 10) -> float:
    """Median milliseconds of ``fn()`` on the GPU (do_bench clears the L2 between runs), over at
    least ``min_runs`` runs: do_bench repeats for ``rep`` milliseconds, which would time a 90 ms
    call once."""
    if not torch.cuda.is_available():
        fn()
        times = []
        for _ in range(max(3, rep // 20)):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e3)
        return statistics.median(times)
    try:
        from triton.testing import do_bench

        fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        est = (time.perf_counter() - t) * 1e3
        return float(do_bench(fn, warmup=warmup, rep=max(rep, int(min_runs * est) + 1), return_mode="median"))
    except ImportError:  # pragma: no cover
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(5):
            fn()
        times = []
        for _ in range(20):
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        return statistics.median(times)


def loop_ms(fn: Callable[[], object], n: int = 200, rounds: int = 7) -> float:
    """Median milliseconds per call of ``fn`` run ``n`` times back to back, synchronised once per
    round: what a user's wall-clock timer sees, host work and device work overlapping as in a
    training loop (each call costs the larger of the two)."""
    import time

    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3 / n)
    return statistics.median(times)


def graph_ms(fn: Callable[[], object], warmup: int = 25, rep: int = 100) -> Optional[float]:
    """Median milliseconds of ``fn`` captured once in a CUDA graph and replayed: the device time
    without the host's launch, dispatch and autograd-thread costs. None without CUDA."""
    if not torch.cuda.is_available():
        return None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):  # warm up (compile, caches) on a side stream, as capture requires
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    torch.cuda.synchronize()
    return bench_ms(g.replay, warmup, rep)


def add_graph_times(rec: "Record", fwd: Callable[[], object], fwd_bwd: Callable[[], object], rep: int,
                    bytes_fwd: Optional[float] = None, bytes_fwd_bwd: Optional[float] = None) -> None:
    """Add the device time of ``fwd`` and ``fwd_bwd`` replayed from CUDA graphs to ``rec``
    (``fwd_graph_ms`` / ``fwd_bwd_graph_ms``, with the bytes also ``fwd_graph_tbps`` /
    ``fwd_bwd_graph_tbps``) and to its note; a capture failure is noted, not fatal."""
    try:
        fms, gms = graph_ms(fwd, rep=rep), graph_ms(fwd_bwd, rep=rep)
        rec.extra.update(fwd_graph_ms=round(fms, 4), fwd_bwd_graph_ms=round(gms, 4))
        if bytes_fwd is not None:
            rec.extra.update(fwd_graph_tbps=round(bytes_fwd / fms / 1e9, 3),
                             fwd_bwd_graph_tbps=round(bytes_fwd_bwd / gms / 1e9, 3))
        rec.note = "; ".join(p for p in [rec.note, f"CUDA graph: fwd {fms:.4f} ms, fwd+bwd {gms:.4f} ms"] if p)
    except Exception as ex:  # reported, not fatal
        torch.cuda.synchronize()
        rec.note = "; ".join(p for p in [rec.note, f"no CUDA graph: {type(ex).__name__}"] if p)


def peak_extra_mib(fn: Callable[[], object]) -> Optional[float]:
    """Peak memory allocated during ``fn()`` above what was allocated before it, in MiB."""
    if not torch.cuda.is_available():
        return None
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    del out
    return (peak - base) / 2**20


def measure(suite: str, impl: str, shape: str, dtype, *, fwd: Optional[Callable] = None,
            fwd_bwd: Optional[Callable] = None, bytes_fwd: Optional[float] = None,
            bytes_fwd_bwd: Optional[float] = None, flops_fwd: Optional[float] = None,
            flops_fwd_bwd: Optional[float] = None, ours: bool = False, note: str = "",
            memory_of: str = "fwd_bwd", warmup: int = 25, rep: int = 100, **extra) -> Record:
    """Time one implementation at one shape; failures become a record with the error as note."""
    rec = Record(suite=suite, impl=impl, shape=shape, dtype=str(dtype).replace("torch.", ""), ours=ours,
                 note=note, extra=extra, **env_fields())
    try:
        if fwd is not None:
            rec.fwd_ms = bench_ms(fwd, warmup, rep)
        if fwd_bwd is not None:
            rec.fwd_bwd_ms = bench_ms(fwd_bwd, warmup, rep)
        mem_fn = fwd_bwd if (memory_of == "fwd_bwd" and fwd_bwd is not None) else fwd
        if mem_fn is not None:
            rec.peak_extra_mib = peak_extra_mib(mem_fn)
    except Exception as e:  # a peer that breaks at a shape is reported, not fatal
        rec.note = (note + "; " if note else "") + f"failed: {type(e).__name__}: {str(e).splitlines()[0][:160]}"
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    if bytes_fwd is not None or bytes_fwd_bwd is not None:
        rec.unit = "TB/s"
        rec.fwd_rate = bytes_fwd / rec.fwd_ms / 1e9 if (bytes_fwd and rec.fwd_ms) else None
        rec.fwd_bwd_rate = bytes_fwd_bwd / rec.fwd_bwd_ms / 1e9 if (bytes_fwd_bwd and rec.fwd_bwd_ms) else None
    elif flops_fwd is not None or flops_fwd_bwd is not None:
        rec.unit = "TFLOP/s"
        rec.fwd_rate = flops_fwd / rec.fwd_ms / 1e9 if (flops_fwd and rec.fwd_ms) else None
        rec.fwd_bwd_rate = flops_fwd_bwd / rec.fwd_bwd_ms / 1e9 if (flops_fwd_bwd and rec.fwd_bwd_ms) else None
    return rec


def _fmt(v, nd=3):
    if v is None:
        return ""
    if isinstance(v, float):
        return f"{v:.{nd}f}"
    return str(v)


def ratios_to_best_peer(records: list[Record]) -> dict:
    """(shape, impl) -> (fwd ratio, fwd_bwd ratio): best peer time / this time (>1 = faster)."""
    out = {}
    shapes = {r.shape for r in records}
    for s in shapes:
        rs = [r for r in records if r.shape == s]
        peers = [r for r in rs if not r.ours]
        best_f = min((r.fwd_ms for r in peers if r.fwd_ms), default=None)
        best_fb = min((r.fwd_bwd_ms for r in peers if r.fwd_bwd_ms), default=None)
        for r in rs:
            out[(s, r.impl)] = (best_f / r.fwd_ms if best_f and r.fwd_ms else None,
                                best_fb / r.fwd_bwd_ms if best_fb and r.fwd_bwd_ms else None)
    return out


DO_BENCH_METHOD = "Medians of `triton.testing.do_bench` (at least 10 runs each)."
PLOT_PANELS = ("forward", "forward + backward")  # what the fwd_ms and fwd_bwd_ms columns usually hold


def write_results(suite: str, records: list[Record], out_dir: Optional[str] = None, title: str = "",
                  notes: str = "", method: Optional[str] = None, command: Optional[str] = None,
                  panels: Optional[tuple] = None) -> dict:
    """Write SUITE.json, SUITE.md and SUITE.png; return the paths. ``method`` says how the times
    were taken (default :data:`DO_BENCH_METHOD`), ``command`` how the suite is run (default
    ``python -m deepspeed_fused.bench SUITE``), ``panels`` what the plot's two panels show (default
    :data:`PLOT_PANELS`)."""
    method = method or DO_BENCH_METHOD
    out_dir = out_dir or OUT_DIR
    os.makedirs(out_dir, exist_ok=True)
    paths = {k: os.path.join(out_dir, f"{suite}.{k}") for k in ("json", "md", "png")}
    with open(paths["json"], "w") as f:
        json.dump([dataclasses.asdict(r) for r in records], f, indent=1)
    ratios = ratios_to_best_peer(records)
    env = env_fields() if not records else dict(gpu=records[0].gpu, torch=records[0].torch,
                                                  triton=records[0].triton, date=records[0].date)
    lines = [f"# Benchmark `{suite}`" + (f": {title}" if title else ""), "",
             f"{env['date']}, {env['gpu']}, torch {env['torch']}, Triton {env['triton']}. {method} "
             "Ratios: fastest peer time / this time (>1 is faster than every peer). Generated by "
             f"`{command or 'python -m deepspeed_fused.bench ' + suite}`.", ""]
    if notes:
        lines += [notes, ""]
    lines.append("| shape | impl | dtype | fwd ms | fwd+bwd ms | fwd rate | fwd+bwd rate | unit | "
                 "fwd vs best peer | fwd+bwd vs best peer | peak extra MiB | note |")
    lines.append("|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---|")
    for r in records:
        rf, rfb = ratios.get((r.shape, r.impl), (None, None))
        name = f"**{r.impl}**" if r.ours else r.impl
        lines.append(f"| {r.shape} | {name} | {r.dtype} | {_fmt(r.fwd_ms)} | {_fmt(r.fwd_bwd_ms)} | "
                     f"{_fmt(r.fwd_rate, 2)} | {_fmt(r.fwd_bwd_rate, 2)} | {r.unit} | {_fmt(rf, 2)} | {_fmt(rfb, 2)} | "
                     f"{_fmt(r.peak_extra_mib, 1)} | {r.note} |")
    with open(paths["md"], "w") as f:
        f.write("\n".join(lines) + "\n")
    try:
        plot(records, paths["png"], f"{suite} ({env['gpu']})", panels)
    except Exception as e:  # matplotlib missing: JSON and MD still written
        paths["png"] = f"not written: {e}"
    return paths


def plot(records: list[Record], path: str, title: str, panels: Optional[tuple] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r.shape for r in records))
    impls = list(dict.fromkeys(r.impl for r in records))
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 1.6 * len(shapes) * 2), 5))
    for ax, attr, label in zip(axes, ("fwd_ms", "fwd_bwd_ms"), panels or PLOT_PANELS):
        width = 0.8 / max(1, len(impls))
        for i, impl in enumerate(impls):
            vals = []
            for s in shapes:
                r = next((r for r in records if r.shape == s and r.impl == impl), None)
                vals.append(getattr(r, attr) if r is not None and getattr(r, attr) else 0.0)
            ax.bar([j + i * width for j in range(len(shapes))], vals, width, label=impl)
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))])
        ax.set_xticklabels(shapes, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("ms (median, lower is better)")
        ax.set_yscale("log")
        ax.set_title(label)
    axes[1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


class GpuSampler:
    """The GPU's SM clock, power, temperature and clock-limit reasons sampled by ``nvidia-smi``
    every ``period_ms`` while a job runs (a context manager around it): on a power- or heat-limited
    GPU the same kernels run slower at lower clocks, so a comparison of runs made one after the
    other says what the clocks were and what held them down. :attr:`summary` (after the block):
    None without ``nvidia-smi``, else :func:`summarize_gpu_samples` of the samples."""

    QUERY = "index,utilization.gpu,clocks.sm,power.draw,temperature.gpu"
    # the reasons the driver lowered the clocks: the software power cap, hardware slowdown (power
    # brake, heat); older drivers name the fields clocks_throttle_reasons, and without either the
    # base query runs alone
    REASONS = ("clocks_event_reasons.sw_power_cap,clocks_event_reasons.hw_slowdown",
               "clocks_throttle_reasons.sw_power_cap,clocks_throttle_reasons.hw_slowdown")

    def __init__(self, period_ms: int = 200):
        self.period_ms = period_ms
        self.summary: Optional[dict] = None
        self._proc = self._file = None

    def __enter__(self):
        import shutil
        import subprocess
        import tempfile
        import time

        exe = shutil.which("nvidia-smi")
        if exe is None:
            return self
        for query in [f"{self.QUERY},{r}" for r in self.REASONS] + [self.QUERY]:
            self._file = tempfile.TemporaryFile(mode="w+")
            try:
                self._proc = subprocess.Popen([exe, f"--query-gpu={query}", "--format=csv,noheader,nounits",
                                               f"-lms={self.period_ms}"], stdout=self._file,
                                              stderr=subprocess.DEVNULL)
            except OSError:
                self._proc = None
                return self
            time.sleep(0.3)  # a field this driver does not know ends the process at once, non-zero
            if self._proc.poll() in (None, 0):
                return self
            self._file.close()
        self._proc = None
        return self

    def __exit__(self, *exc):
        if self._proc is None:
            return False
        self._proc.terminate()
        try:
            self._proc.wait(timeout=5)
        except Exception:  # noqa: BLE001  (a sampler that does not stop is killed; its samples stand)
            self._proc.kill()
        self._file.seek(0)
        self.summary = summarize_gpu_samples(self._file.read())
        self._file.close()
        return False


def summarize_gpu_samples(text: str, busy_pct: float = 90.0) -> Optional[dict]:
    """Per GPU index, from ``nvidia-smi --query-gpu=index,utilization.gpu,clocks.sm,power.draw,
    temperature.gpu[,sw_power_cap,hw_slowdown] --format=csv,noheader,nounits`` lines: the samples
    while the GPU was busy (utilization >= ``busy_pct``; loading and compiling are not), their
    median and lowest SM clock (MHz) and median power (W), the highest temperature (C) of all
    samples, and where the clock-limit reasons were sampled the share of busy samples with the
    software power cap (``power_capped``) and hardware slowdown (``hw_slowdown``) active. None
    without samples."""
    per: dict = {}
    for line in text.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) not in (5, 7):
            continue
        try:
            idx, util, sm, power, temp = int(parts[0]), float(parts[1]), float(parts[2]), float(parts[3]), float(parts[4])
        except ValueError:  # "[N/A]" fields
            continue
        reasons = tuple(p.lower() == "active" if p.lower() in ("active", "not active") else None for p in parts[5:])
        per.setdefault(idx, []).append((util, sm, power, temp, reasons))
    if not per:
        return None
    out = {}
    for idx, rows in sorted(per.items()):
        busy = [r for r in rows if r[0] >= busy_pct]
        rec = dict(samples=len(rows), busy_samples=len(busy),
                   sm_mhz_median=statistics.median(r[1] for r in busy) if busy else None,
                   sm_mhz_min=min(r[1] for r in busy) if busy else None,
                   power_w_median=statistics.median(r[2] for r in busy) if busy else None,
                   temp_c_max=max(r[3] for r in rows))
        for i, name in enumerate(("power_capped", "hw_slowdown")):
            flags = [r[4][i] for r in busy if len(r[4]) > i and r[4][i] is not None]
            if flags:
                rec[name] = sum(flags) / len(flags)
        out[str(idx)] = rec
    return out
