"""Test-suite setup.

On a machine without CUDA, Triton kernels run under the interpreter: ``TRITON_INTERPRET=1``
must be in the environment before any module that defines kernels is imported, so it is set
here, at collection time, before the test modules import ``deepspeed_fused.ops``.
"""
import os
import sys

import pytest

try:
    import torch

    _CUDA = torch.cuda.is_available()
except Exception:  # pragma: no cover
    _CUDA = False

if not _CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("DS_ACCELERATOR", "cuda" if _CUDA else "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

sys.path.insert(0, os.path.dirname(__file__))  # tests/ helpers: tiny_models, unit.common


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped on CPU-only machines)")
    config.addinivalue_line("markers", "world_size(n): ranks a DistributedTest runs (int or list)")
    config.addinivalue_line("markers", "slow: long CPU test")


def pytest_collection_finish(session):
    """Start the server DistributedTest ranks are forked from, here in the process whose forks
    (``--forked``) run the tests, importing the modules of the collected distributed tests in it
    once (see unit/common.py)."""
    from unit.common import DistributedTest, start_worker_server

    if session.config.option.collectonly:
        return
    modules = []
    for item in session.items:
        cls = getattr(item, "cls", None)
        if cls is not None and issubclass(cls, DistributedTest) and not item.get_closest_marker("skip") \
                and cls.__module__ not in modules:
            modules.append(cls.__module__)
    if modules:
        start_worker_server(["worker_warmup"] + modules)


def pytest_collection_modifyitems(config, items):
    if _CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
