"""The DistributedTest harness on GPUs: ranks start clean after the test's own process initialised
CUDA (forked ranks would die with "Cannot re-initialize CUDA in forked subprocess"), run NCCL on
their own GPU, with NVLink multicast off."""
import os

import pytest
import torch

from unit.common import DistributedTest, run_distributed

pytestmark = pytest.mark.gpu


def _nccl_all_reduce_on_own_gpu():
    import deepspeed.comm as dist

    rank = dist.get_rank()
    assert torch.cuda.current_device() == rank
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4


def test_ranks_use_cuda_after_the_parent_did():
    torch.ones(1, device="cuda").sum().item()  # this process has initialised CUDA
    assert torch.cuda.is_initialized()
    run_distributed(_nccl_all_reduce_on_own_gpu, 2, backend="nccl")


class TestNCCLRanks(DistributedTest):
    world_size = 2
    backend = "nccl"

    def test_all_reduce(self):
        _nccl_all_reduce_on_own_gpu()
