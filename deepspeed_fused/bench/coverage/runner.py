"""Running many families, each in a worker process under a time limit."""
from __future__ import annotations

import json
import os
import sys
import time
from typing import Optional

from .compare import run_family
from .families import Family

# ---- running many families ------------------------------------------------------------------------


def _run_one(fam: Family, mode: str) -> str:
    try:
        rec = run_family(fam, mode)
    except BaseException as e:  # pragma: no cover - run_family catches what it can
        rec = dict(family=fam.model_type, cls=fam.cls, kind=fam.kind, id=fam.id, mode=mode, status="failed",
                   error=f"{type(e).__name__}: {e}")
    return json.dumps(rec, default=str)


def _worker(conn, persistent: bool) -> None:
    """A worker process: runs the (family, mode) pairs it is sent, one at a time, and sends each
    record back; a one-shot worker (a fork per family) stops after the first."""
    prepare_environment()
    import torch

    torch.set_num_threads(int(os.environ.get("DEEPSPEED_FUSED_COVERAGE_THREADS", "1")))
    while True:
        try:
            task = conn.recv()
        except EOFError:
            return
        if task is None:
            return
        conn.send(_run_one(*task))
        if not persistent:
            return


_PRELOAD = ["torch", "transformers", "deepspeed_fused", "deepspeed_fused.bench.coverage"]


def prepare_environment() -> None:
    """Offline, and kernels under the interpreter when there is no GPU. Triton reads
    TRITON_INTERPRET when the kernels are defined (``import deepspeed_fused`` defines them), so on
    a machine without a GPU it must be in the environment before that: raises if it was not (the
    command line re-executes itself with it, see :func:`main`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch

    if torch.cuda.is_available():
        return
    if "deepspeed_fused.ops._common" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return
    from ...ops import _common

    if not _common._INTERPRET_AT_IMPORT:
        raise RuntimeError(f"coverage on a machine without a GPU runs the kernels under Triton's interpreter: "
                           f"{_common.LATE_INTERPRET}")


class _Slot:
    """One worker process and the task it runs."""

    def __init__(self, ctx, persistent: bool):
        self.ctx, self.persistent = ctx, persistent
        self.proc = self.conn = self.task = None
        self.t0 = 0.0

    def start(self):
        self.conn, child = self.ctx.Pipe()
        self.proc = self.ctx.Process(target=_worker, args=(child, self.persistent), daemon=True)
        self.proc.start()
        child.close()

    def submit(self, task):
        if self.proc is None or not self.proc.is_alive():
            self.start()
        self.task, self.t0 = task, time.time()
        self.conn.send((task[0], task[1]))

    def stop(self):
        if self.proc is not None and self.proc.pid is not None:
            if self.proc.is_alive():
                self.proc.kill()
            self.proc.join()
        if self.conn is not None:
            self.conn.close()
        self.proc = self.conn = None

    def poll(self, timeout: float):
        """The finished task's record, or None while it runs."""
        rec = None
        if self.conn.poll():
            try:
                rec = json.loads(self.conn.recv())
            except (EOFError, OSError):
                self.proc.join(5)
                rec = dict(status="failed", error=f"the worker died (exit code {self.proc.exitcode}) without a result")
        elif not self.proc.is_alive():
            self.proc.join()
            rec = dict(status="failed", error=f"the worker died (exit code {self.proc.exitcode}) without a result")
        elif time.time() - self.t0 > timeout:
            rec = dict(status="timeout", error=f"no result within {timeout:.0f} s (killed)")
        else:
            return None
        # a fresh worker after one that stops, hung, died or saw anything but a clean run (a
        # failure can leave CUDA or module state behind)
        if not self.persistent or rec.get("status") not in ("ok", "differs"):
            self.stop()
        return rec


def run_many(fams: list, modes: list, timeout: float = 300.0, jobs: int = 1, progress=None,
             spawn: Optional[bool] = None) -> list:
    """Each (family, mode) under ``timeout`` seconds (then its worker is killed and it is recorded
    as a timeout), in worker processes. Without CUDA each family runs in a fork of this process
    made after it imported the heavy modules once; with CUDA in spawned workers (a fork of a
    process that touched the CUDA driver could not use it) that import them once and run family
    after family, a fresh worker after any family that did not run cleanly (``spawn`` forces one
    way or the other)."""
    import importlib
    import multiprocessing as mp

    import torch

    prepare_environment()
    if spawn is None:
        spawn = torch.cuda.is_available() or "fork" not in mp.get_all_start_methods()
    if spawn:
        ctx, persistent = mp.get_context("spawn"), True
    else:
        for name in _PRELOAD:
            importlib.import_module(name)
        from ...features.registry import all_features

        all_features()  # every feature and the ops it calls, imported once before the forks
        ctx, persistent = mp.get_context("fork"), False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pending = [(f, m) for f in fams for m in modes]
    slots = [_Slot(ctx, persistent) for _ in range(max(1, jobs))]
    results = {}
    try:
        while pending or any(s.task for s in slots):
            for s in slots:
                if s.task is None and pending:
                    s.submit(pending.pop(0))
            time.sleep(0.02)
            for s in slots:
                if s.task is None:
                    continue
                rec = s.poll(timeout)
                if rec is None:
                    continue
                fam, mode = s.task
                rec = {**dict(family=fam.model_type, cls=fam.cls, kind=fam.kind, id=fam.id, mode=mode, device=device,
                              run=f"{device} {mode}"), **rec}
                rec.setdefault("seconds", round(time.time() - s.t0, 2))
                results[(fam.id, mode)] = rec
                s.task = None
                if progress:
                    progress(rec)
    finally:
        for s in slots:
            s.stop()
    return [results[(f.id, m)] for f in fams for m in modes]


def expectations(rec: dict) -> dict:
    """What the features covered on one family, in the form the CI test's table keeps: RMSNorm
    forms replaced and forms left eager, whether the loss ran fused, whether the experts ran the
    gathers (None: no experts modules)."""
    n, mo = rec["norms"], rec["moe"]
    return dict(replaced=set(n["replaced_by_form"]), eager={row["form"] for row in n["left_eager"]},
                loss_fused=bool(rec["loss_fused"]["fused"]),
                gathers=(bool(mo["gathers"]) if (mo["experts_modules"] or mo["applied"]) else None))
