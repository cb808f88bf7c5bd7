"""Suite ``e2e``: a real MoE training run, features off vs Liger-Kernel vs features on.

Runs the example job (``deepspeed_fused.train``, the module ``examples/train.py`` wraps) through
the deepspeed launcher with the configs shipped in the package, a fresh process per run (memory
figures are not polluted): the Qwen3-30B-A3B layer shape cut to 4 layers, bf16, 4096-token
sequences of synthetic tokens (same seed and data in every arm).

Arms of each pair (``--arms``, default ``baseline,liger,fused``):

* ``baseline``: every feature off (``configs/*baseline.json``);
* ``liger``: the baseline config with ``liger_kernel.transformers.apply_liger_kernel_to_qwen3_moe(
  rope=True, rms_norm=True, fused_linear_cross_entropy=True, swiglu=False)`` applied before the
  model is built;
* ``liger_swiglu``: the same with ``swiglu=True`` (Liger's fused-MoE experts); not in the default
  list; it runs under ``--liger-swiglu-timeout`` and a run that does not finish is recorded as a
  timeout, with the steps it printed and the Python stacks dumped shortly before the limit;
* ``liger_swiglu_noautotune``: as ``liger_swiglu`` with ``LIGER_FUSED_MOE_AUTOTUNE=0`` (Liger's
  switch for one fixed kernel configuration instead of autotuning each GEMM kernel over 32 on its
  first call), same time limit;
* ``fused``: every feature on (``configs/*fused*.json``).

The fused configs turn every feature on (``rms_norm``, ``linear_cross_entropy``, ``moe_reorder``,
``rope``, ``mlp_act``); each arm's row says which features ran, from the plugin's report at the end of the run
(the features applied, with their fused/eager call counts where an eager call happened) and the
Liger patches applied.

Dense pairs (:data:`DENSE_PAIRS`; ``--pairs dense`` for the four non-reentrant ones): full-depth
models of the Llama-3.2-3B, Qwen3-1.7B, Qwen3-4B and Gemma-3-1B shapes (random weights), ZeRO-2
(on one GPU; Qwen3-4B on two, :data:`DENSE_GPUS`: its training state does not fit one 80 GB GPU; on one
where that is all the host has and it holds 120 GiB, an H200),
Hugging Face gradient checkpointing (non-reentrant; ``dense_llama3_3b_reentrant`` the reentrant
variant; ``dense_qwen3_4b_bf16_states`` the Qwen3-4B shape on one 80 GB GPU with ZeRO-2's master
weights, gradients and AdamW moments in bf16, ``configs/bf16_states_*.json``), the same three
arms at the same micro-batch, the liger arm with the family's patch function's defaults (its
SwiGLU/GeGLU MLP included) and the fused arm with every feature on, ``mlp_act`` included
(``configs/fused_all.json``). ``--dense-model NAME`` runs them all on another model (a tiny
stand-in for a quick check).

Pairs (``--pairs``, default ``zero2,zero2_accum8,autoep,zero3``; ``none`` for none): ZeRO-2,
``zero2_accum8`` (ZeRO-2 with ``gradient_accumulation_steps`` 8: ``configs/accum8_*.json``, the
ZeRO-2 configs with that one key changed), AutoEP (autoep_size 1, ZeRO-2), ZeRO-3 on one GPU, and
``zero2_2gpu`` (ZeRO-2 on two GPUs of one host). Each arm runs ``--steps`` timed optimizer steps
after ``--warmup`` at micro-batch ``--batch-size`` x ``--seq-len`` (with accumulation, each step
is that many micro-steps: tokens/s counts the tokens of all of them per optimizer step, and the
forward+backward time of each micro-step is timed with CUDA events), then profiles one more
optimizer step: its kernel time per category, each kernel once (``deepspeed_fused.bench.breakdown``:
ranges around the modules the features replace and around DeepSpeed's work, our kernels by name;
the categories add up to the arm's kernel time), and the same per micro-step (the kernels launched
during its forward+backward; the mean over the step's micro-steps). Every run has a time limit
(``--arm-timeout``); a run over it is recorded as a timeout, not waited for. A pair that needs more
GPUs than the host has (:func:`host_shortfall`) is recorded as not run, with the reason, and the
other pairs run.

Micro-batch search (``--search PAIRS``, e.g. ``--search zero2,zero3``; ``dense`` for the dense
pairs one GPU of this host runs; arms ``--search-arms``): for each arm, on one GPU, the largest
micro-batch of ``--seq-len``-token sequences that trains without running out of memory, and the
tokens/s at that size. Sizes double from ``--search-start`` up to
``--search-max`` (default 64, so that the fused arm runs out of memory inside the search and its
figure is a measurement; an arm that still fits at the cap is marked ``(cap)``: its figure is a
floor); then, between the largest size that fit and the smallest that did not, the sizes around a
guess from the peak memory of the sizes that ran come first and a bisection of the rest after,
until the two are adjacent. One process runs an ascending chain of sizes (``train.py
--batch-sizes``: ``--search-steps`` timed steps after ``--search-warmup``, memory freed between
sizes); an out-of-memory size (``torch.OutOfMemoryError`` caught, the step's tensors released,
the cache emptied) is recorded and ends that process, and the next, smaller, candidates run in a
fresh process. The smallest size that failed after other sizes in its process is tried once more
alone in a fresh process (``--no-search-confirm`` skips it), so that memory the earlier sizes left
fragmented does not decide the answer; if it fits there, the search goes on above it. A failed
size is a result, not an error of the suite.

Outputs (under ``--out``, default ``docs/benchmarks/``): ``e2e.json``, ``e2e.md``,
``e2e_loss.png``, ``e2e_speed_memory.png``, ``e2e_breakdown.png`` and, with a search,
``e2e_throughput.png`` (tokens/s against micro-batch). ``--render A/e2e.json B/e2e.json ...``
merges earlier runs (arm by arm, searches too) and writes the outputs without running anything,
so the suite can be run in parts, each under a machine's per-command time limit; ``e2e.json`` is
also written after every run and after every process of a search (marked ``partial``), so a part
stopped from outside keeps the runs that finished and the sizes a search measured (its arm marked
``unfinished``: the largest size that fit so far, a floor; ``(unfinished)`` on the page).

Targets (:data:`.e2e_report.STEP_TARGETS`, printed with the measured values in ``e2e.md`` and stored under
``compare.checks`` in ``e2e.json``): for ZeRO-2 with every feature on, >= 1.30x the baseline's
optimizer step at accumulation 1 and >= 1.5x at accumulation 8, >= 1.3x the Liger arm at both; for
ZeRO-2 on two GPUs >= 1.22x the baseline's and >= 1.2x the Liger arm's; the losses of every
micro-step within 0.5% of the baseline's in every pair.

While each arm runs, the launching process samples the GPU's SM clock, power and temperature with
``nvidia-smi`` (:class:`.common.GpuSampler`; ``gpu_clocks`` in each arm's record, a table in
``e2e.md``): arms run one after the other, and a GPU that warms up or hits its power limit runs the
same kernels slower in the later ones.

Flags: ``--model --steps --warmup --batch-size --seq-len`` (the fixed setup), ``--pairs --arms``,
``--arm-timeout`` (s per run, default 600), ``--liger-swiglu-timeout`` (default 420),
``--keep-traces DIR`` (each profiled step's Chrome trace), ``--search PAIRS --search-arms
--search-start --search-max --search-steps --search-warmup --search-timeout`` (s per search
process), ``--no-search-confirm``, ``--search-resume E2E_JSON`` (continue the searches a stopped
run left unfinished in that file), ``--include HOST:IDS`` (the launcher's ``--include``: e.g.
``localhost:1`` runs on the second GPU, so two single-GPU parts can run side by side on a two-GPU
host), ``--render FILES``; the bench's ``--out DIR`` and ``--quick`` (defaults of 3 steps and 512 tokens;
flags given explicitly win).

    python -m deepspeed_fused.bench e2e                                   # the four pairs, three arms
    python -m deepspeed_fused.bench e2e --pairs zero2,zero2_accum8 --out /tmp/e2e_z2
    python -m deepspeed_fused.bench e2e --pairs zero2 --arms liger_swiglu --out /tmp/e2e_swiglu
    python -m deepspeed_fused.bench e2e --pairs none --search zero2 --out /tmp/e2e_search_z2
    python -m deepspeed_fused.bench e2e --render /tmp/e2e_*/e2e.json      # merge into docs/benchmarks/
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Optional

from .common import OUT_DIR, GpuSampler, env_fields, free_port, package_version
from .e2e_report import ARM_ORDER, SEARCH_SETTINGS, SWIGLU_ARMS, _write, arm_features, compare, render, search_compare

PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the folder that holds this deepspeed_fused package (a clone's root, or site-packages): the runs
# import the same copy
ROOT = os.path.dirname(PACKAGE)
# pair -> (baseline config, fused config, GPUs)
PAIRS = {
    "zero2": ("configs/baseline.json", "configs/fused_all.json", 1),
    # the ZeRO-2 configs with gradient_accumulation_steps 8 (and nothing else changed)
    "zero2_accum8": ("configs/accum8_baseline.json", "configs/accum8_fused.json", 1),
    "autoep": ("configs/autoep_baseline.json", "configs/autoep_fused.json", 1),
    "zero3": ("configs/zero3_baseline.json", "configs/zero3_fused.json", 1),
    "zero2_2gpu": ("configs/baseline.json", "configs/fused_all.json", 2),
}
# arm -> (which config of the pair, extra train.py arguments, extra environment)
ARMS = {
    "baseline": ("baseline", [], {}),
    "liger": ("baseline", ["--liger"], {}),
    "liger_swiglu": ("baseline", ["--liger", "--liger-swiglu"], {}),
    # Liger's fused MoE autotunes each GEMM kernel over 32 configurations on its first call;
    # LIGER_FUSED_MOE_AUTOTUNE=0 (liger's own switch) takes one fixed configuration instead
    "liger_swiglu_noautotune": ("baseline", ["--liger", "--liger-swiglu"], {"LIGER_FUSED_MOE_AUTOTUNE": "0"}),
    "fused": ("fused", [], {}),
}
assert tuple(ARMS) == ARM_ORDER  # the report lists the arms in this order
DEFAULT_PAIRS = "zero2,zero2_accum8,autoep,zero3"

# The dense pairs: pair -> (model, train.py arguments). Full-depth models of published shapes
# (random weights), ZeRO-2 on one GPU, Hugging Face gradient checkpointing (non-reentrant; the
# ``_reentrant`` pair the reentrant variant); the fused arm turns every feature on, ``mlp_act``
# included (``configs/fused_all.json``, as the MoE pairs); the liger arm applies the family's
# ``apply_liger_kernel_to_<family>()`` with its own defaults (its SwiGLU or GeGLU MLP included).
DENSE_PAIRS = {
    "dense_llama3_3b": ("llama-3.2-3b", ["--grad-ckpt", "non-reentrant"]),
    "dense_qwen3_1_7b": ("qwen3-1.7b", ["--grad-ckpt", "non-reentrant"]),
    "dense_qwen3_4b": ("qwen3-4b", ["--grad-ckpt", "non-reentrant"]),
    "dense_gemma3_1b": ("gemma3-1b", ["--grad-ckpt", "non-reentrant"]),
    "dense_llama3_3b_reentrant": ("llama-3.2-3b", ["--grad-ckpt", "reentrant"]),
    # the Qwen3-4B shape on one 80 GB GPU: ZeRO-2 keeping its master weights, gradients and AdamW
    # moments in bf16 (DeepSpeed's bf16_master_weights_and_grads and bf16_optimizer_states), about
    # 10 bytes a parameter instead of 16; the same config in all three arms
    "dense_qwen3_4b_bf16_states": ("qwen3-4b", ["--grad-ckpt", "non-reentrant"]),
}
# the configs of a dense pair that are not the ZeRO-2 pair's (baseline, fused)
DENSE_CONFIGS = {"dense_qwen3_4b_bf16_states": ("configs/bf16_states_baseline.json", "configs/bf16_states_fused.json")}
# GPUs of each dense pair: one, but two for the Qwen3-4B shape, whose bf16 weights, gradients, fp32
# master weights and AdamW moments (about 16 bytes a parameter, 64 GB) leave no room for the
# activations on one 80 GB GPU in any arm; on two, ZeRO-2 halves the optimizer's share.
DENSE_GPUS = {"dense_qwen3_4b": 2}
# ... unless one GPU has this much memory (GiB): the Qwen3-4B pair fits one 141 GB H200
ONE_GPU_FITS_GIB = {"dense_qwen3_4b": 120}
PAIRS.update({p: DENSE_CONFIGS.get(p, ("configs/baseline.json", "configs/fused_all.json")) + (DENSE_GPUS.get(p, 1),)
              for p in DENSE_PAIRS})


def gpu_memory_gib() -> list:
    """Each visible GPU's total memory in GiB, from ``nvidia-smi`` (no CUDA context in this
    process, which would hold memory on the jobs' GPU); [] without it."""
    import shutil

    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    try:
        out = subprocess.run([exe, "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    mem = [float(x) / 1024 for x in out.split() if x.strip().replace(".", "", 1).isdigit()]
    if vis:
        idx = [int(i) for i in vis.split(",") if i.strip().isdigit()]
        mem = [mem[i] for i in idx if i < len(mem)]
    return mem


def pair_gpus(pair: str, default: int, memory: Optional[list] = None) -> int:
    """The GPUs a pair's arms run on: its own count, or one where a pair that needs several fits one
    GPU of this host (:data:`ONE_GPU_FITS_GIB`) and the host has fewer GPUs than it asks for."""
    need = ONE_GPU_FITS_GIB.get(pair)
    if default <= 1 or need is None:
        return default
    memory = gpu_memory_gib() if memory is None else memory
    if memory and len(memory) < default and memory[0] >= need:
        return 1
    return default


def host_shortfall(pair: str, memory: Optional[list] = None, gpus: Optional[int] = None) -> Optional[str]:
    """Why ``pair`` (of ``gpus`` GPUs: default its :data:`PAIRS` entry's) cannot run on this host,
    which has fewer GPUs than :func:`pair_gpus` asks for; else None. None as well where the GPUs
    are unknown (no ``nvidia-smi``) or chosen with ``--include``: the launcher decides then."""
    memory = gpu_memory_gib() if memory is None else memory
    if not memory or INCLUDE:
        return None
    need = pair_gpus(pair, PAIRS[pair][2] if gpus is None else gpus, memory)
    if len(memory) >= need:
        return None
    one = ONE_GPU_FITS_GIB.get(pair)
    sizes = ", ".join(f"{m:.0f}" for m in memory)
    return (f"not run: {pair} needs {need} GPUs" + (f" or one of at least {one} GiB" if one else "")
            + f"; this host has {len(memory)} ({sizes} GiB)")


# ``--pairs dense``: the four dense pairs with non-reentrant checkpointing and the ZeRO-2 pair's configs
DENSE_ALIAS = [p for p in DENSE_PAIRS if not p.endswith("_reentrant") and p not in DENSE_CONFIGS]


def pair_setup(pair: str, o, extra: list) -> tuple:
    """(model, extra train.py arguments) of an arm of ``pair``: the suite's ``--model`` and the arm's
    own arguments, or a dense pair's model (``--dense-model`` in its place when given: a stand-in for
    quick runs) and its arguments, with ``--liger-defaults`` for a Liger arm."""
    if pair not in DENSE_PAIRS:
        return o.model, list(extra)
    model, args = DENSE_PAIRS[pair]
    args = list(extra) + list(args) + (["--liger-defaults"] if "--liger" in extra else [])
    return getattr(o, "dense_model", None) or model, args


# ---------------------------------------------------------------------------------------------
# Running train.py with a time limit
# ---------------------------------------------------------------------------------------------

def config_file(config: str) -> str:
    """A pair's config (``configs/NAME.json``, the configs shipped in the package, or a path of its
    own) as an absolute path."""
    return config if os.path.isabs(config) else os.path.join(PACKAGE, config)


# ``--include`` of the command line (e.g. ``localhost:1``): which GPUs the launcher gives the runs,
# so that two jobs can share a host with one GPU each; None: the first ``num_gpus``
INCLUDE: Optional[str] = None


def launch(train_args: list, num_gpus: int, timeout: float, tmp: str, env_extra: Optional[dict] = None) -> dict:
    """Run the example job (``deepspeed_fused.train``) under the deepspeed launcher with a time
    limit (:func:`run_limited`), in ``tmp``."""
    port = free_port()
    where = ["--include", INCLUDE] if INCLUDE else ["--num_gpus", str(num_gpus)]
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", *where, "--master_port",
           str(port), "--module", "deepspeed_fused.train", *train_args]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env_extra or {}))
    print("[e2e] running", " ".join(f"{k}={v}" for k, v in (env_extra or {}).items()), " ".join(cmd[5:]),
          f"(limit {timeout:.0f} s)", flush=True)
    try:
        return run_limited(cmd, timeout, tmp, env, cwd=tmp)
    finally:
        # a CPU run's shared-memory all-reduce leaves a /dev/shm buffer per rank and port behind
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
            try:
                os.remove(path)
            except OSError:
                pass


def run_limited(cmd: list, timeout: float, tmp: str, env: Optional[dict] = None, cwd: Optional[str] = None) -> dict:
    """Run ``cmd`` (in ``cwd``) in its own process group; past ``timeout`` seconds the whole group
    (the launcher and the ranks it started) gets SIGTERM, then SIGKILL. Returns rc (None on
    timeout), stdout, stderr, wall seconds and the GPU's clocks while it ran (``gpu_clocks``:
    :class:`.common.GpuSampler`'s summary, None without ``nvidia-smi``)."""
    fd_out, out_path = tempfile.mkstemp(dir=tmp, suffix=".out")
    fd_err, err_path = tempfile.mkstemp(dir=tmp, suffix=".err")
    t0 = time.time()
    with os.fdopen(fd_out, "w") as fo, os.fdopen(fd_err, "w") as fe, GpuSampler() as clocks:
        p = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=fo, stderr=fe, start_new_session=True)
        try:
            rc = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = None
        # the group goes either way: ranks a finished or timed-out launcher left behind hold the GPU
        for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 20)):
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                break
            if rc is None:
                try:
                    p.wait(timeout=wait)
                except subprocess.TimeoutExpired:
                    continue
            deadline = time.time() + wait
            while time.time() < deadline and _group_alive(p.pid):
                time.sleep(0.2)
            if not _group_alive(p.pid):
                break
    wall = time.time() - t0
    with open(out_path, errors="replace") as f:
        stdout = f.read()
    with open(err_path, errors="replace") as f:
        stderr = f.read()
    os.remove(out_path)
    os.remove(err_path)
    return dict(rc=rc, stdout=stdout, stderr=stderr, wall_s=wall, gpu_clocks=clocks.summary)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


STEP_LINE = re.compile(r"\[train\] step +(\d+) +loss ([0-9.naif]+) +([0-9.]+) ms")


def steps_seen(stdout: str) -> list:
    """The per-step lines a run printed: [(step, loss, ms)]."""
    return [(int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in STEP_LINE.finditer(stdout)]


def _stack_dump(stderr: str) -> str:
    """The Python stacks faulthandler printed (``--dump-stacks-after``), trimmed."""
    i = stderr.find("Thread 0x")
    if i < 0:
        i = stderr.find("Current thread 0x")
    return stderr[i:i + 6000] if i >= 0 else ""


def run_arm(pair: str, arm: str, o, tmp: str, pairs: Optional[dict] = None) -> dict:
    """One arm of a pair (``pairs``: name -> (baseline config, fused config, GPUs); default
    :data:`PAIRS`): train.py under the launcher with a time limit; its metrics, or the error.
    ``o.profile`` (default on) profiles one more step for the kernel-time breakdown."""
    base_cfg, fused_cfg, asked = (pairs or PAIRS)[pair]
    memory = gpu_memory_gib()
    gpus = pair_gpus(pair, asked, memory)
    which, extra, env_extra = ARMS[arm]
    config = base_cfg if which == "baseline" else fused_cfg
    short = host_shortfall(pair, memory, asked)
    if short:  # launching would start more ranks than GPUs: each fails on a device it does not have
        print(f"[e2e] {pair}.{arm}: {short}", flush=True)
        return dict(config=config, arm=arm, env=env_extra, not_run=True, wall_s=0.0, error=short)
    tag = f"{pair}.{arm}"
    metrics = os.path.join(tmp, tag + ".metrics.json")
    timeout = o.liger_swiglu_timeout if arm in SWIGLU_ARMS else o.arm_timeout
    model, extra = pair_setup(pair, o, extra)
    args = ["--deepspeed_config", config_file(config), "--model", model, "--steps", str(o.steps + o.warmup),
            "--warmup", str(o.warmup), "--batch-size", str(o.batch_size), "--seq-len", str(o.seq_len),
            "--no-progress", "--metrics-out", metrics, "--dump-stacks-after", str(max(10.0, timeout - 45)), *extra]
    if getattr(o, "profile", True):
        args += ["--profile-out", os.path.join(tmp, tag + ".profile.json")]
    if getattr(o, "keep_traces", None):
        os.makedirs(o.keep_traces, exist_ok=True)
        args += ["--trace-out", os.path.abspath(os.path.join(o.keep_traces, tag + ".trace.json"))]
    r = launch(args, gpus, timeout, tmp, env_extra)
    sys.stdout.write(r["stdout"][-3000:])
    seen = steps_seen(r["stdout"])
    if r["rc"] is None:
        return dict(config=config, arm=arm, env=env_extra, timeout=True, wall_s=r["wall_s"],
                    error=f"timeout: no result within {timeout:.0f} s ({len(seen)} steps printed)",
                    steps_seen=seen, stacks=_stack_dump(r["stderr"]), output_tail=r["stdout"][-2000:])
    if r["rc"] != 0 or not os.path.exists(metrics):
        sys.stdout.write(r["stderr"][-6000:])
        return dict(config=config, arm=arm, env=env_extra, wall_s=r["wall_s"], steps_seen=seen,
                    error=f"exit {r['rc']}: {r['stderr'][-1500:]}")
    with open(metrics) as f:
        out = json.load(f)
    times = sorted(x["step_s"] for x in out["history"][o.warmup:])
    out.update(arm=arm, env=env_extra, wall_s=r["wall_s"], steps_seen=seen if arm in SWIGLU_ARMS else None,
               gpu_clocks=r.get("gpu_clocks"))
    out["step_s_p10"] = times[max(0, int(0.1 * len(times)) - 1)] if times else None
    out["step_s_p90"] = times[min(len(times) - 1, int(0.9 * len(times)))] if times else None
    out["step_s_stdev"] = statistics.pstdev(times) if len(times) > 1 else 0.0
    return out


def combine_runs(runs: list) -> dict:
    """One arm's record from its runs (``--balanced``: two, at mirrored places in the order). One run:
    itself. Several: the first run's record (losses, memory, report) with the step, the micro-step
    and tokens/s replaced by the mean of the runs' medians, the kernel-time breakdown by the mean of
    the runs' profiled steps (:func:`mean_breakdown`: a kernel that runs slower later in the order
    weighs on every arm alike), and ``runs`` listing each run's place in the order, medians and
    clocks; the first failed run where one failed."""
    if len(runs) == 1:
        return runs[0]
    bad = next((r for r in runs if "error" in r), None)
    if bad is not None:
        return bad
    out = dict(runs[0])
    out["runs"] = [dict(position=r.get("position"), median_step_s=r["median_step_s"],
                        median_tokens_per_s=r["median_tokens_per_s"], median_micro_fb_s=r.get("median_micro_fb_s"),
                        gpu_clocks=r.get("gpu_clocks")) for r in runs]
    out["median_step_s"] = statistics.fmean(r["median_step_s"] for r in runs)
    out["median_tokens_per_s"] = statistics.fmean(r["median_tokens_per_s"] for r in runs)
    fbs = [r.get("median_micro_fb_s") for r in runs]
    out["median_micro_fb_s"] = statistics.fmean(fbs) if all(f is not None for f in fbs) else None
    bds = [r.get("breakdown") for r in runs]
    if all(isinstance(b, dict) and "categories" in b for b in bds):
        out["breakdown"] = mean_breakdown(bds)
    return out


def mean_breakdown(bds: list) -> dict:
    """The mean of several profiled steps' breakdowns (:mod:`deepspeed_fused.bench.breakdown`'s
    records, one per run of an arm): every number the mean over the runs (a category or kernel a
    run lacks counts 0 there), the per-kernel rows merged by name and category and sorted again,
    the micro-steps averaged position by position; ``profiled_steps`` says how many went in."""
    n = len(bds)

    def mean(vals):
        vals = [v for v in vals if v is not None]
        if not vals:
            return None
        if all(isinstance(v, bool) for v in vals) or not all(isinstance(v, (int, float)) for v in vals):
            return vals[0]
        if all(isinstance(v, int) for v in vals) and len(vals) == n:  # counts stay whole
            return round(sum(vals) / n)
        return sum(vals) / n

    def merge(ds):
        ds = [d for d in ds if isinstance(d, dict)]
        keys = list(dict.fromkeys(k for d in ds for k in d))
        out = {}
        for k in keys:
            vals = [d.get(k) for d in ds]
            present = [v for v in vals if v is not None]
            if k == "top_kernels":
                rows = {}
                for lst in present:
                    for row in lst:
                        key = (row.get("name"), row.get("category"))
                        acc = rows.setdefault(key, dict(row, ms=0.0, calls=0))
                        acc["ms"] += row.get("ms", 0.0) / n
                        acc["calls"] = max(acc["calls"], row.get("calls", 0))
                out[k] = sorted(rows.values(), key=lambda r: -r["ms"])[:max(len(x) for x in present)]
            elif present and all(isinstance(v, dict) for v in present):
                out[k] = merge(vals)
            elif present and all(isinstance(v, list) for v in present):
                width = min(len(v) for v in present)
                out[k] = [merge([v[i] for v in present]) if isinstance(present[0][i], dict) else present[0][i]
                          for i in range(width)]
            else:
                out[k] = mean(vals)
        return out

    out = merge(bds)
    out["profiled_steps"] = n
    return out


# ---------------------------------------------------------------------------------------------
# Micro-batch search
# ---------------------------------------------------------------------------------------------

def bisect_chain(lo: int, hi: int) -> list:
    """The ascending candidates between a size that fit (``lo``, 0 for none) and one that did
    not (``hi``), if each candidate fits: a bisection that one process can walk upwards."""
    chain = []
    while hi - lo > 1:
        lo = (lo + hi) // 2
        chain.append(lo)
    return chain


def predict_largest(trials: list, margin: float = 1.0) -> Optional[int]:
    """A guess at the largest micro-batch from the peak memory of the two largest sizes that ran
    (allocated memory taken as linear in the micro-batch) and the device's memory
    (``device_total_mib``); None without two such sizes. Only orders the candidates: the answer
    is still what runs and what does not."""
    ok = sorted((t["batch"], t.get("peak_alloc_mib"), t.get("device_total_mib")) for t in trials
                if t["status"] == "ok" and t.get("peak_alloc_mib"))
    if len(ok) < 2 or not ok[-1][2]:
        return None
    (b0, m0, _), (b1, m1, total) = ok[-2], ok[-1]
    slope = (m1 - m0) / (b1 - b0)
    if slope <= 0:
        return None
    return int((margin * total - (m1 - slope * b1)) // slope)


def _next_chain(trials: list, good: Optional[int], bad: int) -> list:
    """The next process's ascending sizes between the largest size that ran (``good``) and the
    smallest that did not (``bad``): the sizes around the memory-based guess, then a bisection of
    the rest; sizes tried before left out."""
    lo = good or 0
    guess = predict_largest(trials)
    if guess is not None:
        guess = min(max(guess, lo + 1), bad - 1)
    # the caching allocator cannot use all of the device: the guess errs high more often than low
    near = [b for b in range(guess - 2, guess + 2) if lo < b < bad] if guess is not None else []
    chain = near + bisect_chain(near[-1] if near else lo, bad)
    return [b for b in chain if not any(t["batch"] == b for t in trials)]


def _bounds(trials: list) -> tuple:
    """(the largest size that ran, the smallest that ran out of memory above it) of ``trials``;
    None for either where there is none."""
    fit = [t["batch"] for t in trials if t["status"] == "ok"]
    good = max(fit) if fit else None
    above = [t["batch"] for t in trials if t["status"] == "oom" and (good is None or t["batch"] > good)]
    return good, (min(above) if above else None)


def _chain_after(trials: list, doubling: list, good: Optional[int], bad: Optional[int]) -> list:
    """The next process's sizes from the bounds so far: between ``good`` and ``bad``
    (:func:`_next_chain`), or, with no size above ``good`` out of memory yet, the doubling's sizes
    above it not yet tried."""
    if bad is not None:
        return _next_chain(trials, good, bad)
    tried = {t["batch"] for t in trials}
    return [b for b in doubling if (good is None or b > good) and b not in tried]


def _search_summary(trials: list, good: Optional[int], bad: Optional[int], stopped: Optional[str], proc: int,
                    confirmed: set) -> dict:
    best = next((t for t in reversed(trials) if t["status"] == "ok" and t["batch"] == good), None)
    return dict(trials=trials, largest=good, smallest_failed=bad, capped=bad is None and good is not None,
                stopped=stopped, processes=proc, confirmed_alone=sorted(confirmed),
                tokens_per_s=best["median_tokens_per_s"] if best else None,
                median_step_s=best["median_step_s"] if best else None,
                peak_alloc_mib=best.get("peak_alloc_mib") if best else None,
                peak_reserved_mib=best.get("peak_reserved_mib") if best else None)


def search_largest(run_sizes: Callable[[list], list], start: int = 1, max_size: int = 64,
                   confirm: bool = True, progress: Optional[Callable[[dict], None]] = None,
                   earlier: Optional[list] = None) -> dict:
    """The largest micro-batch that runs: doubling from ``start`` to ``max_size``, then a search
    between the largest size that ran and the smallest that ran out of memory.

    ``run_sizes(chain)`` runs an ascending chain of sizes in one fresh process and returns one
    trial per size it reached (``dict(batch, status="ok"|"oom"|"error"|"timeout", ...)``), stopping
    after the first that is not ok. An out-of-memory size bounds the search; any other failure
    ends it (``stopped``). After the doubling, each process walks upwards through the sizes
    around the memory-based guess (:func:`predict_largest`) and then a bisection of the rest of
    the interval; the search ends when the largest size that ran and the smallest that did not
    are adjacent, so the guess only saves processes, it never decides the answer.

    ``confirm``: when the smallest size that ran out of memory did so after other sizes in its
    process (whose memory may have been left fragmented), it runs once more alone in a fresh
    process (its trial marked ``alone``); if it fits there, the search goes on above it. Each
    trial gets ``process`` (the process's number) and ``position`` (its place in that chain).

    ``progress(result)``, if given, is called after every process with the search as it stands
    (marked ``unfinished``: the largest size that fit so far, ``capped`` False), so that a run
    stopped from outside keeps the sizes it measured.

    ``earlier``: the trials of an unfinished search of the same arm (its ``progress``), which this
    one continues: the largest size that fit and the smallest that did not above it are taken
    from them, sizes that ran alone count as confirmed, and the next process is the one the
    search would have run next, so an interrupted search and its continuation run the processes
    of one uninterrupted search."""
    doubling, size = [], start
    while size <= max_size:
        doubling.append(size)
        size *= 2
    chain = list(doubling)
    trials, good, bad, stopped, proc = [], None, None, None, 0
    confirmed = set()
    if earlier:
        trials = [dict(t) for t in earlier]
        proc = max(t.get("process", 0) for t in trials)
        confirmed = {t["batch"] for t in trials if t.get("alone")}
        good, bad = _bounds(trials)
        chain = _chain_after(trials, doubling, good, bad)

    def run(sizes, alone=False):
        nonlocal proc
        proc += 1
        res = run_sizes(sizes)
        for k, t in enumerate(res):
            t["process"], t["position"] = proc, k
            if alone:
                t["alone"] = True
        trials.extend(res)
        if progress is not None:
            progress(dict(_search_summary(list(trials), *_bounds(trials), None, proc, confirmed),
                          capped=False, unfinished=True))
        return res

    while True:
        while chain:
            res = run(chain)
            for t in res:
                if t["status"] == "ok":
                    good = max(good or 0, t["batch"])
            failed = [t for t in res if t["status"] != "ok"]
            if failed:
                f = failed[0]
                if f["status"] != "oom":
                    stopped = f"{f['status']} at micro-batch {f['batch']}: {f.get('error', '')[:300]}"
                    break
                bad = f["batch"] if bad is None else min(bad, f["batch"])
            elif len(res) < len(chain):
                stopped = f"the process ended after micro-batch {res[-1]['batch'] if res else None} without a record"
                break
            if bad is None:
                break  # every size up to max_size fit
            chain = _next_chain(trials, good, bad)
        if stopped or bad is None or not confirm or bad in confirmed:
            break
        f = next(t for t in reversed(trials) if t["batch"] == bad and t["status"] == "oom")
        if f["position"] == 0:
            break  # it ran out of memory first in its process: nothing before it
        confirmed.add(bad)
        res = run([bad], alone=True)
        if not res:
            stopped = f"the process ended before micro-batch {bad} without a record"
            break
        if res[0]["status"] == "oom":
            break
        if res[0]["status"] != "ok":
            stopped = f"{res[0]['status']} at micro-batch {bad}: {res[0].get('error', '')[:300]}"
            break
        good, bad = _bounds(trials)  # it fits alone (now the largest that ran): the search goes on above it
        chain = _chain_after(trials, doubling, good, bad)
        # (an empty chain: the next failed size is adjacent; it is confirmed in the next round)
    return _search_summary(trials, good, bad, stopped, proc, confirmed)


def run_search(pair: str, arm: str, o, tmp: str, progress: Optional[Callable[[dict], None]] = None,
               earlier: Optional[dict] = None) -> dict:
    """One arm's micro-batch search (:func:`search_largest`); ``progress(result)`` after every
    process, with the unfinished search described as the finished one is; ``earlier``: the arm's
    unfinished search to continue (:func:`resumable`)."""
    base_cfg, fused_cfg, gpus = PAIRS[pair]
    gpus = pair_gpus(pair, gpus)
    which, extra, env_extra = ARMS[arm]
    config = base_cfg if which == "baseline" else fused_cfg
    count = [0]
    seen: dict = {}  # what the first process's metrics say about the arm: its features
    model, extra = pair_setup(pair, o, extra)

    def run_sizes(chain: list) -> list:
        count[0] += 1
        metrics = os.path.join(tmp, f"{pair}.{arm}.search{count[0]}.json")
        args = ["--deepspeed_config", config_file(config), "--model", model,
                "--steps", str(o.search_steps + o.search_warmup), "--warmup", str(o.search_warmup),
                "--seq-len", str(o.seq_len), "--batch-sizes", ",".join(map(str, chain)), "--no-progress",
                "--metrics-out", metrics, "--dump-stacks-after", str(max(10.0, o.search_timeout - 45)), *extra]
        r = launch(args, gpus, o.search_timeout, tmp, env_extra)
        sys.stdout.write(r["stdout"][-1500:])
        trials = []
        if os.path.exists(metrics):
            with open(metrics) as f:
                doc = json.load(f)
            trials = doc["trials"]
            if not seen:
                seen.update(report=doc.get("report"), liger=doc.get("liger"))
        for t in trials:  # keep the JSON small: step times only
            if "history" in t:
                t["step_ms"] = [round(x["step_s"] * 1e3, 2) for x in t.pop("history")]
        if len(trials) < len(chain) and (not trials or trials[-1]["status"] == "ok"):
            nxt = chain[len(trials)]
            if r["rc"] is None:
                trials.append(dict(batch=nxt, status="timeout", error=f"no result within {o.search_timeout:.0f} s",
                                   stacks=_stack_dump(r["stderr"])))
            elif r["rc"] != 0:
                oom = "out of memory" in r["stderr"].lower()
                trials.append(dict(batch=nxt, status="oom" if oom else "error",
                                   error=f"exit {r['rc']}: {r['stderr'][-800:]}"))
        return trials

    def describe(res: dict) -> dict:
        res.update(config=config, arm=arm, seq_len=o.seq_len, model=model, features=arm_features(dict(seen, arm=arm)),
                   **{k: getattr(o, k) for k in SEARCH_SETTINGS})
        return res

    return describe(search_largest(run_sizes, o.search_start, o.search_max,
                                   confirm=getattr(o, "search_confirm", True),
                                   progress=None if progress is None else (lambda r: progress(describe(r))),
                                   earlier=(earlier or {}).get("trials")))


RESUME_KEYS = ("model", "seq_len", "search_steps", "search_warmup", "search_start", "search_max")


def resumable(doc: dict, pair: str, arm: str, o) -> Optional[dict]:
    """The unfinished search of ``pair``/``arm`` in an e2e.json document (``--search-resume``), or
    None where it has none (a finished arm is searched again). SystemExit where the earlier search
    ran with other settings than this run's: its sizes would not compare."""
    r = ((doc.get("search") or {}).get(pair) or {}).get("arms", {}).get(arm)
    if not r or not r.get("unfinished"):
        return None
    now = dict(model=pair_setup(pair, o, [])[0], seq_len=o.seq_len, **{k: getattr(o, k) for k in SEARCH_SETTINGS})
    differ = [f"{k} {r.get(k)!r} (this run {now[k]!r})" for k in RESUME_KEYS if r.get(k) != now[k]]
    if differ:
        raise SystemExit(f"e2e: --search-resume: the unfinished search of {pair} / {arm} ran with other settings: "
                         + ", ".join(differ) + "; expected the same as this run's")
    return r


# ---------------------------------------------------------------------------------------------
# Outputs
# ---------------------------------------------------------------------------------------------


def parse_options(args):
    """The suite's options from the bench's namespace (``args.extra``: this suite's flags,
    ``args.quick``): the parsed flags with the lists ``pair_list``, ``arm_list``,
    ``search_list``, ``search_arm_list`` checked; SystemExit naming what is wrong."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m deepspeed_fused.bench e2e")
    p.add_argument("--model", default="qwen3-moe-30b-a3b-4l")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--pairs", default=DEFAULT_PAIRS,
                   help=f"of {', '.join(PAIRS)}; 'dense' for {', '.join(DENSE_ALIAS)}; 'none' for none")
    p.add_argument("--dense-model", default=None,
                   help="run every dense pair with this model instead of its own (a stand-in for quick runs)")
    p.add_argument("--arms", default="baseline,liger,fused", help=f"of {', '.join(ARMS)}")
    p.add_argument("--arm-timeout", type=float, default=600.0, help="seconds per arm run")
    p.add_argument("--balanced", action="store_true",
                   help="run the arms twice, in the given order and then reversed, and report each arm's mean "
                        "of its two median steps (a drift of the GPU's clocks over the run cancels)")
    p.add_argument("--liger-swiglu-timeout", type=float, default=420.0, help="seconds for the liger_swiglu arm")
    p.add_argument("--keep-traces", default=None, metavar="DIR", help="keep each profiled step's Chrome trace here")
    p.add_argument("--search", default="", help="pairs to run the micro-batch search for (e.g. zero2,zero3)")
    p.add_argument("--search-arms", default="baseline,liger,fused")
    p.add_argument("--search-start", type=int, default=1)
    p.add_argument("--search-max", type=int, default=64,
                   help="the largest micro-batch tried (the cap: an arm that fits there is reported as '(cap)')")
    p.add_argument("--search-steps", type=int, default=5)
    p.add_argument("--search-warmup", type=int, default=2)
    p.add_argument("--search-timeout", type=float, default=600.0, help="seconds per search process")
    p.add_argument("--no-search-confirm", dest="search_confirm", action="store_false",
                   help="do not try the smallest failed size again alone in a fresh process")
    p.add_argument("--search-resume", default=None, metavar="E2E_JSON",
                   help="continue the searches this file holds unfinished (a run stopped from outside), "
                        "with the same settings; finished arms and arms it lacks are searched from the start")
    p.add_argument("--include", default=None, metavar="HOST:IDS",
                   help="the deepspeed launcher's --include for every run (e.g. localhost:1: the second GPU), "
                        "so two jobs can share a host; its GPU count must match the pairs'")
    p.add_argument("--render", nargs="+", default=None, metavar="E2E_JSON",
                   help="do not run: merge the results of earlier runs (e2e.json files) and write the outputs")
    if getattr(args, "quick", False):  # smaller defaults; a flag given explicitly still wins
        p.set_defaults(steps=3, warmup=1, seq_len=512, search_steps=2, search_warmup=1)
    o = p.parse_args(getattr(args, "extra", []))
    o.pair_list = [y for x in o.pairs.split(",") if x and x != "none" for y in (DENSE_ALIAS if x == "dense" else [x])]
    o.arm_list = [x for x in o.arms.split(",") if x]
    # (pair, from the ``dense`` alias)
    searched = [(z, y == "dense") for y in o.search.split(",") if y for z in (DENSE_ALIAS if y == "dense" else [y])]
    o.search_arm_list = [y for y in o.search_arms.split(",") if y]
    for x in o.pair_list + [z for z, _ in searched]:
        if x not in PAIRS:
            raise SystemExit(f"e2e: unknown pair {x!r}; expected one of {', '.join(PAIRS)}")
    o.search_list = []
    for x, alias in searched:  # the search runs on one GPU: the alias takes the pairs one GPU here runs
        if pair_gpus(x, PAIRS[x][2]) == 1:
            o.search_list.append(x)
        elif alias:
            print(f"e2e: --search dense leaves out {x}: the search runs on one GPU, {x} needs {PAIRS[x][2]} here",
                  flush=True)
        else:
            raise SystemExit(f"e2e: the micro-batch search runs on one GPU; {x} uses {PAIRS[x][2]} here")
    if o.dense_model is not None:
        from ..models import MODELS

        if o.dense_model not in MODELS:
            raise SystemExit(f"e2e: --dense-model {o.dense_model!r}: expected one of {', '.join(sorted(MODELS))}")
    for x in o.arm_list + o.search_arm_list:
        if x not in ARMS:
            raise SystemExit(f"e2e: unknown arm {x!r}; expected one of {', '.join(ARMS)}")
    if o.search_list and not 1 <= o.search_start <= o.search_max:
        raise SystemExit(f"e2e: --search-start {o.search_start} / --search-max {o.search_max}: expected "
                         "1 <= start <= max")
    o.resume_doc = None
    if o.search_resume is not None:
        try:
            with open(o.search_resume) as f:
                o.resume_doc = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"e2e: --search-resume {o.search_resume!r}: expected a readable e2e.json ({e})")
        if not isinstance(o.resume_doc, dict) or not isinstance(o.resume_doc.get("search", {}), dict):
            raise SystemExit(f"e2e: --search-resume {o.search_resume!r}: expected an e2e.json document")
    return o


def main(args) -> dict:
    o = parse_options(args)
    out_dir = getattr(args, "out", None) or OUT_DIR
    os.makedirs(out_dir, exist_ok=True)
    if o.render:
        return render(o.render, out_dir)
    global INCLUDE
    INCLUDE = o.include
    pairs, arms = o.pair_list, o.arm_list
    results, search = {}, {}
    meta = dict(env_fields(), liger_kernel=package_version("liger_kernel"), model=o.model, batch=o.batch_size, seq=o.seq_len,
                steps=o.steps, warmup=o.warmup, search_confirm=o.search_confirm,
                **{k: getattr(o, k) for k in SEARCH_SETTINGS})
    dense = [p for p in dict.fromkeys(pairs + o.search_list) if p in DENSE_PAIRS]
    if dense:  # each dense pair's own model and checkpointing
        meta["pair_models"] = {p: dict(model=pair_setup(p, o, [])[0], args=" ".join(DENSE_PAIRS[p][1]),
                                       **({"configs": " / ".join(DENSE_CONFIGS[p])} if p in DENSE_CONFIGS else {}))
                               for p in dense}

    # the unfinished searches to continue, checked before anything runs
    resume = {(k, a): resumable(o.resume_doc, k, a, o) for k in o.search_list for a in o.search_arm_list
              if o.resume_doc}

    def partial():  # e2e.json after every run: a job stopped from outside keeps what finished
        with open(os.path.join(out_dir, "e2e.json"), "w") as f:
            json.dump(dict(meta=meta, results=results, search=search, partial=True), f, indent=1, default=str)

    with tempfile.TemporaryDirectory() as tmp:
        for name in pairs:
            results[name], runs = {}, {}
            order = arms + (arms[::-1] if o.balanced else [])
            for position, arm in enumerate(order):
                r = run_arm(name, arm, o, tmp)
                r["position"] = position
                runs.setdefault(arm, []).append(r)
                results[name][arm] = combine_runs(runs[arm])
                partial()
            results[name]["compare"] = compare(name, results[name])
        for name in o.search_list:
            search[name] = dict(arms={})
            for arm in o.search_arm_list:
                def progress(r, name=name, arm=arm):  # the arm's search as it stands, after each process
                    search[name]["arms"][arm] = r
                    partial()

                search[name]["arms"][arm] = run_search(name, arm, o, tmp, progress, resume.get((name, arm)))
                partial()
            search[name]["compare"] = search_compare(search[name]["arms"])
    return _write(results, search, meta, out_dir)


