"""Cases for tests/unit/test_cuda_free_parent.py, run in a pytest subprocess on a CPU machine made
to look like a machine with a GPU (tests/unit/fake_gpu). Not a test_*.py file: the suite itself does not
collect it.

Importing every tests/gpu module here makes the DistributedTest worker server, which preloads
the modules of the tests that run in workers (this one), import them too."""
import glob
import importlib
import os

import pytest
import torch

from unit.common import DistributedTest

GPU_MODULES = sorted("tests.gpu." + os.path.basename(p)[:-3]
                     for p in glob.glob(os.path.join(os.path.dirname(__file__), "..", "gpu", "test_*.py")))
for _name in GPU_MODULES:
    importlib.import_module(_name)


def _ask_for_cuda():
    try:
        torch.empty(1, device="cuda")
    except (AssertionError, RuntimeError):  # the CPU build (or the conftest's refusal)
        pass


@pytest.mark.gpu
@pytest.mark.parametrize("value", [1, 2])
def test_plain_gpu_function(value, device, tmp_path, monkeypatch):
    """In one worker, with its parameter and fixtures: asks for CUDA there."""
    assert os.environ["RANK"] == "0" and os.environ["WORLD_SIZE"] == "1"
    assert value in (1, 2) and device == "cuda" and tmp_path.is_dir()
    monkeypatch.setenv("DSF_PROBE", "set in the worker")
    _ask_for_cuda()


@pytest.mark.gpu
class TestWorldSizeOne(DistributedTest):
    world_size = 1
    init_distributed = False

    def test_method(self):
        assert os.environ["RANK"] == "0"
        _ask_for_cuda()


class TestPlainClass:
    @pytest.mark.gpu
    @pytest.mark.parametrize("value", ["a"])
    def test_method_in_worker(self, value):
        assert os.environ["RANK"] == "0" and value == "a" and isinstance(self, TestPlainClass)
        _ask_for_cuda()


@pytest.fixture
def cuda_in_parent():
    _ask_for_cuda()  # catches the refusal: the conftest fails the test all the same


@pytest.mark.gpu
def test_gpu_fixture_asking_for_cuda(cuda_in_parent):
    """Expected to error: its fixture asks for CUDA in the pytest process."""


def test_not_gpu_asking_for_cuda_here():
    """Not a gpu test: runs in the pytest process (its fork under --forked), where it may ask; the
    log must show this request (the recorder sees the pytest process)."""
    assert "RANK" not in os.environ
    _ask_for_cuda()
