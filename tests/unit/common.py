"""A forked DistributedTest harness in the manner of DeepSpeed's tests/unit/common.py.

A test class derives from :class:`DistributedTest` and sets ``world_size`` (an int or a list,
or use ``@pytest.mark.world_size(n)`` on a method). Each test method then runs in
``world_size`` forked processes, each with RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_SIZE and a fresh
rendezvous port set, and a process group initialised through ``deepspeed.comm``: gloo on CPU,
NCCL on GPU. Failures in any rank fail the test with that rank's traceback.
"""
from __future__ import annotations

import glob
import inspect
import multiprocessing as mp
import os
import socket
import traceback

import pytest
import torch

DEFAULT_TIMEOUT = 600


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU shared-memory all-reduce leaves one /dev/shm buffer per rank and rendezvous
    port behind (tens of MiB each); a test-suite of many engines would fill the machine's RAM."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.remove(path)
        except OSError:
            pass


def _backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def _run_rank(rank, world_size, port, fn, kwargs, queue, init_dist):
    try:
        os.environ.update({
            "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CROSS_RANK": "0", "CROSS_SIZE": "1",
        })
        torch.manual_seed(1234)
        if torch.cuda.is_available():
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if init_dist:
            import deepspeed

            deepspeed.init_distributed(dist_backend=_backend(), auto_mpi_discovery=False)
        fn(**kwargs)
        if init_dist:
            import deepspeed.comm as dist

            dist.barrier()
        queue.put((rank, None))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        queue.put((rank, traceback.format_exc()))
    finally:
        if init_dist:
            try:
                import torch.distributed as tdist

                if tdist.is_initialized():
                    tdist.destroy_process_group()
            except Exception:
                pass


def run_distributed(fn, world_size: int, timeout: float = DEFAULT_TIMEOUT, init_dist: bool = True, **kwargs):
    """Run ``fn(**kwargs)`` in ``world_size`` forked ranks; raise if any rank fails."""
    if torch.cuda.is_available() and _backend() == "nccl" and torch.cuda.device_count() < world_size:
        pytest.skip(f"{world_size} GPUs required, {torch.cuda.device_count()} available")
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_run_rank, args=(r, world_size, port, fn, kwargs, queue, init_dist))
             for r in range(world_size)]
    for p in procs:
        p.start()
    errors = {}
    try:
        for _ in procs:
            rank, err = queue.get(timeout=timeout)
            if err:
                errors[rank] = err
    except Exception:
        errors[-1] = f"timed out after {timeout}s waiting for ranks"
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        remove_shm_buffers(port)
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        pytest.fail(f"distributed test failed:\n{msg}", pytrace=False)


class DistributedTest:
    """Base class: every ``test_*`` method runs in forked ranks (see module docstring)."""

    world_size = 2
    init_distributed = True
    timeout = DEFAULT_TIMEOUT

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        ws = cls.world_size
        for name, fn in list(vars(cls).items()):
            if name.startswith("test") and callable(fn) and not getattr(fn, "_dist_wrapped", False):
                many = isinstance(ws, (list, tuple)) and not _marker_world_size(fn)
                wrapped = _wrap(fn, many)
                if many:
                    wrapped = pytest.mark.parametrize("_world_size", list(ws))(wrapped)
                setattr(cls, name, wrapped)


def _marker_world_size(fn):
    for m in getattr(fn, "pytestmark", []):
        if m.name == "world_size":
            return m.args[0]
    return None


def _wrap(fn, parametrized: bool):
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name != "self"]

    def wrapper(self, *args, _world_size=None, **kwargs):
        ws = _world_size or _marker_world_size(wrapper) or self.world_size
        if isinstance(ws, (list, tuple)):
            ws = ws[0]
        bound = {**dict(zip([p.name for p in params], args)), **kwargs}

        def body(**kw):
            fn(self, **kw)

        run_distributed(body, ws, timeout=self.timeout, init_dist=self.init_distributed, **bound)

    new_params = [sig.parameters["self"]] + params
    if parametrized:
        new_params.append(inspect.Parameter("_world_size", inspect.Parameter.KEYWORD_ONLY))
    wrapper.__signature__ = sig.replace(parameters=new_params)
    wrapper.__name__ = fn.__name__
    wrapper.__qualname__ = fn.__qualname__
    wrapper.__doc__ = fn.__doc__
    wrapper.__dict__.update(fn.__dict__)
    wrapper._dist_wrapped = True
    return wrapper
