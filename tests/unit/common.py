"""A DistributedTest harness in the manner of DeepSpeed's tests/unit/common.py.

A test class derives from :class:`DistributedTest` and sets ``world_size`` (an int or a list,
or use ``@pytest.mark.world_size(n)`` on a method). Each test method then runs in
``world_size`` worker processes, each with RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_SIZE and a fresh
rendezvous port set, and a process group initialised through ``deepspeed.comm`` over a
``file://`` store: gloo on CPU, NCCL on GPU (or the class's ``backend``). Failures in any rank
fail the test with that rank's traceback; a rank that hangs is killed after ``timeout`` seconds.

Workers start clean: they are forked from a forkserver (a fresh interpreter started once, not
the test process), or spawned where there is no forkserver. A parent that has initialised CUDA
(or anything else fork-unsafe) therefore does not hand that state to its ranks. What a worker
needs comes through pickles: the test class by reference (its module is imported in the worker),
the parameters and fixture values by value, and the parent's environment, applied before the
test module is imported (``TRITON_INTERPRET`` decides at import whether kernels are interpreted).
A ``pytest.skip`` in the ranks skips the test.

GPU tests (marker ``gpu``, tests/gpu) run their bodies in workers too: a plain test function
marked ``gpu`` runs in one worker (:func:`run_test_function`, called by tests/conftest.py), a
``DistributedTest`` at its ``world_size``. The pytest process and the worker server never
initialise CUDA (:func:`cuda_device_count` counts GPUs through NVML; :func:`guard_cuda_init`
refuses an initialisation where it must not happen), so ``pytest --forked`` and ``pytest -n``
work on GPUs as on CPU. NCCL ranks see the GPUs in ``CUDA_VISIBLE_DEVICES`` order rotated by the
xdist worker's number (as DeepSpeed's harness does), rank r on the r-th of them.

Speed: the forkserver imports the heavy modules once (:func:`start_worker_server`, called by
tests/conftest.py after collection with the test modules that hold DistributedTest classes; on
CPU it imports those modules too, so their module-level warm-ups are paid once). Under
``pytest --forked`` every test runs in a fork of the pytest process, and each one reuses the
forkserver that process started.
"""
from __future__ import annotations

import ast
import contextlib
import fcntl
import glob
import importlib.abc
import importlib.machinery
import inspect
import json
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

import pytest
import torch

DEFAULT_TIMEOUT = 600
GRACE_AFTER_FAILURE = 10.0  # seconds the other ranks get to report once one rank failed
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}  # NVLink multicast off
_PRELOAD_ENV = "DSF_TEST_WORKER_PRELOAD"  # set only in the forkserver's environment
_SERVER_TRITON_INTERPRET = os.environ.get("TRITON_INTERPRET")  # as this interpreter imported kernels


def _free_port() -> int:
    from deepspeed_fused.bench.common import free_port  # one helper for the suites and the tests

    return free_port()


def remove_shm_buffers(port: int) -> None:
    """DeepSpeed's CPU shared-memory all-reduce leaves one /dev/shm buffer per rank and rendezvous
    port behind (tens of MiB each); a test-suite of many engines would fill the machine's RAM."""
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*"):
        try:
            os.remove(path)
        except OSError:
            pass


def _backend() -> str:
    return "nccl" if cuda_device_count() else "gloo"


# ---- CUDA, never initialised in the pytest process or the worker server -------------------------

_DEVICE_COUNT: dict = {}  # CUDA_VISIBLE_DEVICES -> count


def cuda_device_count() -> int:
    """How many GPUs the tests may use, found without initialising CUDA in this process.

    A fork of a process that has initialised CUDA cannot use CUDA, and even the CUDA runtime's
    device count initialises the driver (``torch.cuda.is_available()`` without
    ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, ``torch.cuda.device_count()`` where NVML fails). This asks
    NVML (as torch does) and, where NVML cannot answer, a fresh interpreter."""
    if torch.cuda.is_initialized():
        return torch.cuda.device_count()
    key = os.environ.get("CUDA_VISIBLE_DEVICES")
    if key not in _DEVICE_COUNT:
        n = 0
        if torch.backends.cuda.is_built():
            nvml = getattr(torch.cuda, "_device_count_nvml", None)
            n = nvml() if nvml is not None else -1
            if n < 0:
                p = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.device_count())"],
                                   capture_output=True, text=True, timeout=300)
                n = int(p.stdout.split()[-1]) if p.returncode == 0 and p.stdout.split() else 0
        _DEVICE_COUNT[key] = n
    return _DEVICE_COUNT[key]


def _cuda_entry_points():
    """(module, attribute) of every function through which torch initialises CUDA here: the lazy
    initialisation (CUDA tensors, streams, device queries and torch.cuda.init go through
    ``torch.cuda._lazy_init``, which the submodules of torch.cuda imported by name), the C
    initialisation it calls, and the CUDA runtime's device count (cuInit)."""
    lazy = getattr(torch.cuda, "_lazy_init", None)
    points = [(m, "_lazy_init") for name, m in list(sys.modules.items())
              if m is not None and (name == "torch.cuda" or name.startswith("torch.cuda."))
              and lazy is not None and getattr(m, "_lazy_init", None) is lazy]
    points += [(torch._C, a) for a in ("_cuda_init", "_cuda_getDeviceCount") if hasattr(torch._C, a)]
    return points


def guard_cuda_init(check):
    """Call ``check(what)`` before torch initialises CUDA in this process (``what`` names the entry
    point); ``check`` raises to refuse. Returns a function that removes the guard."""
    undo = []
    for mod, attr in _cuda_entry_points():
        orig = getattr(mod, attr)

        def guarded(*args, _orig=orig, _what=f"{mod.__name__}.{attr}", **kwargs):
            check(_what)
            return _orig(*args, **kwargs)

        guarded.__wrapped__ = orig
        setattr(mod, attr, guarded)
        undo.append((mod, attr, orig))

    def release():
        for mod, attr, orig in reversed(undo):
            setattr(mod, attr, orig)
        undo.clear()

    return release


def _caller() -> str:
    """Where the code that asked for CUDA is (the innermost frames outside torch and this module)."""
    frames = [f for f in traceback.extract_stack()[:-3]
              if os.sep + "torch" + os.sep not in f.filename and f.filename != __file__]
    return "".join(traceback.format_list(frames[-4:])) or "(inside torch)"


_SERVER_REFUSALS: list = []  # in the worker server: the imports that asked for CUDA (the ranks report them)


def _refuse_in_server(what):
    _SERVER_REFUSALS.append(f"{what} from\n{_caller()}")
    raise RuntimeError(f"the DistributedTest worker server must not initialise CUDA ({what}): its forks, the ranks, "
                       f"could not use it")


@contextlib.contextmanager
def gpu_heavy_lock(heavy: bool, gpu: bool = False):
    """Held around a GPU test under ``pytest -n``: a lock file that the xdist workers of one run
    share. A ``gpu_heavy`` test (tens of GiB) holds it exclusively, every other ``gpu`` test holds
    it shared: a heavy test runs alone on the GPU, the small ones side by side (on an 80 GiB H100
    a heavy test beside three small ones ran out of memory). CPU tests take no lock. Linux's
    flock gives a waiting exclusive holder no priority, so a heavy test waits until no small test
    is running at that moment: under -n 8 that is often near the end of the run."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not (heavy or gpu) or run is None:
        yield
        return
    with open(os.path.join(tempfile.gettempdir(), f"deepspeed_fused-gpu-heavy-{run}.lock"), "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX if heavy else fcntl.LOCK_SH)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _visible_devices() -> str:
    """The GPUs of an NCCL test's ranks: CUDA_VISIBLE_DEVICES (or all) rotated by the xdist worker's
    number, so that parallel pytest workers start on different GPUs."""
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in vis.split(",") if d.strip()] if vis is not None else \
        [str(i) for i in range(cuda_device_count())]
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")[2:]
    k = int(worker) % len(ids) if ids and worker.isdigit() else 0
    return ",".join(ids[k:] + ids[:k])


# ---- the worker server ------------------------------------------------------------------------

def _start_method() -> str:
    return "forkserver" if "forkserver" in mp.get_all_start_methods() else "spawn"


def _adopt_inherited_forkserver() -> None:
    """Let a plain fork of the process that started the forkserver (``pytest --forked``) use it.

    The stdlib checks its server with ``waitpid``, which fails with ChildProcessError in a fork
    (the server is its parent's child, not its own); the server itself would serve this process
    as well as any other. Here liveness is checked with a signal 0 instead; a dead server is
    forgotten, so the stdlib starts a fresh one."""
    from multiprocessing import forkserver

    srv = getattr(forkserver, "_forkserver", None)
    pid = getattr(srv, "_forkserver_pid", None)
    if pid is None or "ensure_running" in vars(srv):
        return
    try:
        os.waitpid(pid, os.WNOHANG)
        return  # our own child: the stdlib's check works
    except ChildProcessError:
        pass
    stdlib_ensure_running = srv.ensure_running

    def ensure_running():
        try:
            os.kill(pid, 0)
        except OSError:
            srv._forkserver_pid = None
            srv._forkserver_address = None
            srv._forkserver_alive_fd = None
            del srv.ensure_running
            return stdlib_ensure_running()
        from multiprocessing import resource_tracker

        resource_tracker.ensure_running()

    srv.ensure_running = ensure_running


def start_worker_server(modules=()) -> None:
    """Start the forkserver the ranks are forked from, importing ``modules`` there once.

    Call it in the process whose forks run the tests (conftest does, after collection). The
    server imports them with CUDA initialisation refused (:func:`guard_cuda_init`): a server that
    had initialised CUDA would hand a CUDA its forks cannot use; a module that asks for CUDA at
    import is imported by each rank instead, and the ranks fail the test saying so."""
    if _start_method() != "forkserver":
        return
    from multiprocessing import forkserver

    if getattr(forkserver._forkserver, "_forkserver_pid", None) is not None:
        return
    names = [m for m in modules if m]
    mp.set_forkserver_preload([__name__])
    # The server starts with the interpreter's default sys.path (Python < 3.13 ignores the
    # parent's): PYTHONPATH finds this module, which then takes the parent's sys.path.
    saved = {k: os.environ.get(k) for k in (_PRELOAD_ENV, "PYTHONPATH")}
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the folder holding unit/
    os.environ[_PRELOAD_ENV] = json.dumps({"modules": names, "sys_path": sys.path, "pythonpath": saved["PYTHONPATH"]})
    os.environ["PYTHONPATH"] = here + (os.pathsep + saved["PYTHONPATH"] if saved["PYTHONPATH"] else "")
    try:
        forkserver.ensure_running()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _RewritingLoader(importlib.machinery.SourceFileLoader):
    """Compiles a test module with pytest's assertion rewriting (as pytest does in its own process),
    so that a failing ``assert`` in a rank reports its operands. Never writes bytecode caches."""

    def get_code(self, fullname):
        from _pytest.assertion.rewrite import rewrite_asserts

        path = self.get_filename(fullname)
        source = self.get_data(path)
        tree = ast.parse(source, filename=path)
        rewrite_asserts(tree, source, path, None)
        return compile(tree, path, "exec", dont_inherit=True)


class _RewriteTestModules(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        base = name.rpartition(".")[2]
        if not (base.startswith("test_") or base == "conftest"):
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or not (spec.origin or "").endswith(".py"):
            return None
        spec.loader = _RewritingLoader(name, spec.origin)
        return spec


def _rewrite_asserts_in_test_modules() -> None:
    """In a worker (or its server): test modules imported from now on get pytest's rewriting."""
    if not any(isinstance(f, _RewriteTestModules) for f in sys.meta_path):
        sys.meta_path.insert(0, _RewriteTestModules())


def _preload_from_env() -> None:
    """In the forkserver: import the modules the parent asked for (their failures are the test's
    to report, in the worker that imports them again, not the server's)."""
    if _PRELOAD_ENV not in os.environ:
        return
    spec = json.loads(os.environ.pop(_PRELOAD_ENV))
    sys.path[:] = spec["sys_path"]
    if spec["pythonpath"] is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = spec["pythonpath"]
    _rewrite_asserts_in_test_modules()
    release = guard_cuda_init(_refuse_in_server)
    try:
        for name in spec["modules"]:
            try:
                __import__(name)
            except BaseException:  # noqa: BLE001
                traceback.print_exc()
    finally:
        release()


# ---- one rank ---------------------------------------------------------------------------------

def _run_rank(rank, world_size, port, payload, env, backend, store, log_path, queue, init_dist):
    """A worker: redirect output, take the parent's environment, then import and run the test."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    try:
        os.environ.clear()
        os.environ.update(env)
        os.environ.update({
            "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "CROSS_RANK": "0", "CROSS_SIZE": "1",
        })
        if backend == "nccl":
            for k, v in NCCL_ENV.items():
                os.environ.setdefault(k, v)
        if _SERVER_REFUSALS:
            raise RuntimeError("the worker server refused to initialise CUDA while importing the test modules (a "
                               "module asks for CUDA at import):\n" + "\n".join(_SERVER_REFUSALS))
        interp = env.get("TRITON_INTERPRET")
        if interp != _SERVER_TRITON_INTERPRET and any(m.startswith("deepspeed_fused.ops") for m in sys.modules):
            raise RuntimeError(f"the worker server imported the kernels with TRITON_INTERPRET="
                               f"{_SERVER_TRITON_INTERPRET!r}, the test's process has {interp!r}")
        _rewrite_asserts_in_test_modules()
        fn, kwargs = pickle.loads(payload)  # imports the test's module here, under the parent's env
        torch.manual_seed(1234)
        if backend != "nccl":  # the ranks share the CPU's cores: no oversubscribed thread pools
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world_size))
        if backend == "nccl" and world_size > 1:  # rank 0: device 0, the default
            torch.cuda.set_device(rank % torch.cuda.device_count())
        if init_dist:
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend, auto_mpi_discovery=False, init_method=store,
                                       rank=rank, world_size=world_size)
        try:
            fn(**kwargs)
        finally:
            _finish_background_builds()
        if init_dist:
            import deepspeed.comm as dist

            dist.barrier()
        queue.put((rank, None))
    except pytest.skip.Exception as e:
        queue.put((rank, ("skip", str(e.msg))))
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
        sys.stdout.flush(), sys.stderr.flush()


def _finish_background_builds():
    """Wait for the background build (or cached load) of deepspeed_fused's C++ node if the test
    started one: torch's extension build holds a lock file while it runs, and a rank that exited
    in the middle would leave it behind for every later build or load to wait on forever."""
    native = sys.modules.get("deepspeed_fused.ops.rms_norm.native")
    if native is not None and native.building():
        native._state["thread"].join()


def _tail(path, lines=30):
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def run_distributed(fn, world_size: int, timeout: float = DEFAULT_TIMEOUT, init_dist: bool = True,
                    backend: str | None = None, **kwargs):
    """Run ``fn(**kwargs)`` in ``world_size`` clean worker processes; raise if any rank fails.

    ``fn`` and ``kwargs`` must pickle: a module-level function or :class:`_Method`, and values
    (the worker imports ``fn``'s module; nothing else of this process reaches it)."""
    backend = backend or _backend()
    if backend == "nccl" and cuda_device_count() < world_size:
        pytest.skip(f"{world_size} GPUs required, {cuda_device_count()} available")
    try:
        payload = pickle.dumps((fn, kwargs))
    except Exception as e:  # noqa: BLE001
        pytest.fail(f"a distributed test's function and arguments must pickle (workers start clean): {e!r}",
                    pytrace=False)
    method = _start_method()
    if method == "forkserver":
        _adopt_inherited_forkserver()
    ctx = mp.get_context(method)
    queue = ctx.Queue()
    port = _free_port()
    tmp = tempfile.mkdtemp(prefix="dsf_dist_")
    store = "file://" + os.path.join(tmp, "store")
    logs = [os.path.join(tmp, f"rank{r}.log") for r in range(world_size)]
    env = dict(os.environ)
    if backend == "nccl":
        env["CUDA_VISIBLE_DEVICES"] = _visible_devices()
    procs = [ctx.Process(target=_run_rank,
                         args=(r, world_size, port, payload, env, backend, store, logs[r], queue, init_dist))
             for r in range(world_size)]
    errors, skips, done = {}, {}, set()
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        while len(done) < world_size:
            now = time.monotonic()
            if now >= deadline:
                why = "killed after another rank failed" if errors else f"timed out after {timeout}s"
                for r in sorted(set(range(world_size)) - done):
                    errors[r] = f"{why}; its last output:\n{_tail(logs[r])}"
                break
            try:
                rank, err = queue.get(timeout=min(0.5, deadline - now))
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
                if not dead:
                    continue
                try:  # its report may still be in the pipe
                    rank, err = queue.get(timeout=2)
                except queue_mod.Empty:
                    for r in dead:
                        errors[r] = (f"exited with code {procs[r].exitcode} without reporting; "
                                     f"its last output:\n{_tail(logs[r])}")
                        done.add(r)
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE)
                    continue
            done.add(rank)
            if isinstance(err, tuple):  # ("skip", reason)
                skips[rank] = err[1]
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE)
            elif err:
                errors[rank] = err
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE)
    finally:
        for p in procs:  # a rank that reported exits by itself; the others are killed
            if p.pid is not None:
                if errors or len(done) < world_size:
                    p.kill()
                p.join(timeout=30)
                if p.is_alive():
                    p.kill()
                    p.join(timeout=10)
        queue.close()
        queue.join_thread()
        for p in procs:
            if p.exitcode is not None:
                p.close()
        del procs, p, queue  # the queue's semaphores are unlinked now, not leaked by a forked test's exit
        for r, path in enumerate(logs):  # pytest shows this with a failing test's captured output
            out = _tail(path, 200)
            if out:
                print(f"----- rank {r} output -----\n{out}", end="" if out.endswith("\n") else "\n")
        remove_shm_buffers(port)
        shutil.rmtree(tmp, ignore_errors=True)
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        msg += "".join(f"\n--- rank {r} ---\nskipped: {m}" for r, m in sorted(skips.items()))
        pytest.fail(f"distributed test failed ({backend}, world size {world_size}):\n{msg}", pytrace=False)
    if skips:
        pytest.skip(skips[min(skips)])


# ---- the test classes -------------------------------------------------------------------------

class _Method:
    """A DistributedTest method as a worker calls it: the class by reference, the method by name."""

    def __init__(self, cls, name):
        self.cls, self.name = cls, name

    def __call__(self, **kwargs):
        getattr(self.cls, self.name)._dist_fn(self.cls(), **kwargs)


class _Function:
    """A plain test function, or a method of a plain test class, as a worker calls it: by module
    and names (the worker imports the module)."""

    def __init__(self, module, cls, name):
        self.module, self.cls, self.name = module, cls, name

    def __call__(self, **kwargs):
        obj = importlib.import_module(self.module)
        if self.cls is not None:
            for part in self.cls.split("."):
                obj = getattr(obj, part)
            obj = obj()
        getattr(obj, self.name)(**kwargs)


def run_test_function(item, timeout: float = DEFAULT_TIMEOUT) -> None:
    """Run a collected test function's body in one clean worker (no process group), with the
    values pytest resolved for its arguments (parameters and fixtures, computed here, pickled
    there), and its outcome (pass, failure with the worker's traceback, ``pytest.skip``) here.
    tests/conftest.py calls it for the tests marked ``gpu``."""
    args = {name: item.funcargs[name] for name in item._fixtureinfo.argnames}
    cls = item.cls.__qualname__ if item.cls is not None else None
    run_distributed(_Function(item.module.__name__, cls, item.originalname), 1, timeout=timeout, init_dist=False,
                    backend="nccl" if cuda_device_count() else "gloo", **args)


class DistributedTest:
    """Base class: every ``test_*`` method runs in clean worker ranks (see module docstring).

    ``world_size``: an int or a list (one test per size); a method's ``world_size`` marker
    overrides it. A subclass that sets ``world_size`` or ``backend`` re-runs the inherited tests
    with them (the subclass's ``world_size`` then overrides the markers too). ``backend``: None
    (NCCL on GPUs, else gloo), "gloo" or "nccl"."""

    world_size = 2
    backend = None
    init_distributed = True
    timeout = DEFAULT_TIMEOUT

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        own = vars(cls)
        for name, fn in list(own.items()):
            if name.startswith("test") and callable(fn):
                orig = getattr(fn, "_dist_fn", fn)
                setattr(cls, name, _wrap(orig, _marker_world_size(orig) or cls.world_size, name))
        if "world_size" in own or "backend" in own:
            for name in dir(cls):
                if name.startswith("test") and name not in own:
                    fn = getattr(cls, name)
                    if callable(fn) and hasattr(fn, "_dist_fn"):
                        ws = cls.world_size if "world_size" in own else fn._dist_world_size
                        setattr(cls, name, _wrap(fn._dist_fn, ws, name))


def _marker_world_size(fn):
    for m in getattr(fn, "pytestmark", []):
        if m.name == "world_size":
            return m.args[0]
    return None


def _wrap(fn, world_size, name):
    """The method ``name`` as pytest calls it in the parent: runs ``fn`` in ``world_size`` ranks
    (a list: one parametrized test per size)."""
    many = isinstance(world_size, (list, tuple)) and len(world_size) > 1
    fixed = world_size[0] if isinstance(world_size, (list, tuple)) else world_size
    sig = inspect.signature(fn)
    params = [p for p in sig.parameters.values() if p.name != "self"]
    names = [p.name for p in params]

    def wrapper(self, *args, _world_size=None, **kwargs):
        bound = {**dict(zip(names, args)), **kwargs}
        run_distributed(_Method(type(self), name), _world_size or fixed, timeout=self.timeout,
                        init_dist=self.init_distributed, backend=self.backend, **bound)

    new_params = [sig.parameters["self"]] + params
    if many:
        new_params.append(inspect.Parameter("_world_size", inspect.Parameter.KEYWORD_ONLY))
    wrapper.__signature__ = sig.replace(parameters=new_params)
    wrapper.__name__ = fn.__name__
    wrapper.__qualname__ = fn.__qualname__
    wrapper.__doc__ = fn.__doc__
    wrapper.__module__ = fn.__module__
    wrapper.__dict__.update({k: v for k, v in fn.__dict__.items() if k != "pytestmark"})
    marks = [m for m in getattr(fn, "pytestmark", []) if m.name != "world_size" or not many]
    if marks:
        wrapper.pytestmark = marks
    if many:
        wrapper = pytest.mark.parametrize("_world_size", list(world_size))(wrapper)
    wrapper._dist_fn = fn
    wrapper._dist_world_size = world_size
    wrapper.__wrapped__ = fn  # pytest reports the test's own file and line
    return wrapper


if getattr(mp.current_process(), "_inheriting", False):  # a spawned rank importing: before any test module
    _rewrite_asserts_in_test_modules()
_preload_from_env()
