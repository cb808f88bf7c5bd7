"""Test-suite setup.

On a machine without CUDA, Triton kernels run under the interpreter: ``TRITON_INTERPRET=1``
must be in the environment before any module that defines kernels is imported, so it is set
here, at collection time, before the test modules import ``deepspeed_fused.ops``.

The pytest process never initialises CUDA (so that ``pytest --forked`` and ``pytest -n`` work on
GPUs): GPUs are counted through NVML (``unit.common.cuda_device_count``), and a test marked
``gpu`` runs its body in a clean worker process (``unit.common``'s DistributedTest harness; a plain
test function in one worker, a ``DistributedTest`` at its world size). A request to initialise
CUDA in this process while test modules are imported and collected, or on behalf of a ``gpu``
test (its fixtures, or a body that did not go to a worker), fails that collection or test.
"""
import os
import sys

import pytest

os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # torch.cuda.is_available(): NVML, not cuInit
sys.path.insert(0, os.path.dirname(__file__))  # tests/ helpers: tiny_models, unit.common

from unit.common import (DistributedTest, cuda_device_count, gpu_heavy_lock, guard_cuda_init,  # noqa: E402
                         run_test_function)

_CUDA = cuda_device_count() > 0

if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DS_ACCELERATOR", "cuda" if _CUDA else "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

_GUARD = {"phase": "collection", "item": None, "refused": []}


def _no_cuda_here(what):
    """This process may not initialise CUDA while collecting, nor for a ``gpu`` test."""
    if _GUARD["phase"] == "collection":
        why = "while the test modules are imported and collected"
    elif _GUARD["item"] is not None:
        why = f"for the gpu test {_GUARD['item']} (its fixtures or a body that ran here, not in a worker)"
    else:
        return
    msg = (f"CUDA initialisation ({what}) requested in the pytest process {why}: a fork of a process that has "
           f"initialised CUDA cannot use it. GPU test bodies run in DistributedTest workers (mark the test `gpu`, "
           f"see docs/architecture.md, Tests); count GPUs with unit.common.cuda_device_count().")
    _GUARD["refused"].append(msg)
    raise RuntimeError(msg)


guard_cuda_init(_no_cuda_here)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU-only machines); the body runs in a "
                                       "clean worker process, never in the pytest process")
    config.addinivalue_line("markers", "gpu_heavy: needs a large part of a GPU's memory (tens of GiB): under "
                                       "pytest -n such tests run one at a time")
    config.addinivalue_line("markers", "world_size(n): ranks a DistributedTest runs (int or list)")
    config.addinivalue_line("markers", "slow: long CPU test")
    config.pluginmanager.register(_SkipWithoutFork(), "deepspeed-fused-skip-without-fork")


class _SkipWithoutFork:
    """Under ``--forked``, a test skipped by a mark (every ``gpu`` test on a CPU-only machine: two
    thousand of them) is reported here without a fork: its setup only raises the skip, and a
    fork of this process (torch, transformers, Triton imported) costs tens of milliseconds."""

    @pytest.hookimpl(tryfirst=True)  # registered after pytest-forked, so called before its hook
    def pytest_runtest_protocol(self, item, nextitem):
        if not item.config.getvalue("forked") or item.get_closest_marker("skip") is None:
            return None
        from _pytest.runner import runtestprotocol

        item.ihook.pytest_runtest_logstart(nodeid=item.nodeid, location=item.location)
        runtestprotocol(item, nextitem=nextitem, log=True)
        item.ihook.pytest_runtest_logfinish(nodeid=item.nodeid, location=item.location)
        return True


def _is_distributed(item) -> bool:
    cls = getattr(item, "cls", None)
    return cls is not None and issubclass(cls, DistributedTest)


def _in_worker(item) -> bool:
    """A plain test function (not a DistributedTest method) whose body runs in one worker."""
    return item.get_closest_marker("gpu") is not None and not _is_distributed(item) \
        and hasattr(item, "funcargs")


def pytest_collection_finish(session):
    """Start the server DistributedTest ranks are forked from, here in the process whose forks
    (``--forked``) run the tests, importing the modules of the collected tests that run in
    workers in it once (see unit/common.py)."""
    from unit.common import start_worker_server

    refused, _GUARD["refused"] = _GUARD["refused"], []
    _GUARD["phase"] = "tests"
    if refused:  # a module caught the refusal and went on: its CUDA-dependent state would be wrong
        raise pytest.UsageError(refused[0])
    if session.config.option.collectonly:
        return
    modules = []
    for item in session.items:
        if item.get_closest_marker("skip"):
            continue
        name = item.cls.__module__ if _is_distributed(item) else item.module.__name__ if _in_worker(item) else None
        if name is not None and name not in modules:
            modules.append(name)
    if modules:
        start_worker_server(["worker_warmup"] + modules)


def pytest_collection_modifyitems(config, items):
    if _CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Around the whole test (under ``--forked`` in the fork as well): a ``gpu`` test's fixtures and
    hooks may not initialise CUDA here."""
    _GUARD["item"] = item.nodeid if item.get_closest_marker("gpu") is not None else None
    _GUARD["refused"].clear()
    try:
        return (yield)
    finally:
        _GUARD["item"] = None


def _check_refusals():
    refused, _GUARD["refused"] = _GUARD["refused"], []
    if refused:  # raised inside code that caught it
        raise RuntimeError(refused[0])


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    res = yield
    _check_refusals()
    return res


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item):
    res = yield
    _check_refusals()
    return res


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """GPU tests take a lock that the xdist workers of this run share: shared, or exclusive for a
    ``gpu_heavy`` one."""
    with gpu_heavy_lock(item.get_closest_marker("gpu_heavy") is not None,
                        gpu=item.get_closest_marker("gpu") is not None):
        res = yield
    _check_refusals()
    return res


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A ``gpu`` test function runs its body in one clean worker (DistributedTest methods do
    already, through their wrapper)."""
    if not _in_worker(pyfuncitem):
        return None
    run_test_function(pyfuncitem)
    return True


@pytest.fixture
def device():
    """Where kernel tests run: CUDA when present, else CPU under Triton's interpreter."""
    return "cuda" if _CUDA else "cpu"


@pytest.fixture
def interpret():
    """Kernel tests on CPU: asserts the interpreter is on (set by this conftest) and
    yields the device kernel tensors should live on."""
    if _CUDA:
        yield "cuda"
        return
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest must set TRITON_INTERPRET before kernels load"
    yield "cpu"
