"""The DistributedTest harness on GPUs: the pytest process never initialises CUDA (every gpu
test's body runs in a worker); a worker that has initialised CUDA still starts NCCL ranks that
can use it (forked from a fresh worker server, not from itself); ranks run NCCL on their own GPU,
with NVLink multicast off."""
import os

import pytest
import torch

from unit.common import DistributedTest, cuda_device_count, run_distributed, start_worker_server


def _nccl_all_reduce_on_own_gpu():
    import deepspeed.comm as dist

    rank = dist.get_rank()
    assert torch.cuda.current_device() == rank
    assert os.environ["NCCL_NVLS_ENABLE"] == "0" and os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    t = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(t)
    assert t.tolist() == [3.0] * 4


@pytest.mark.skipif(cuda_device_count() == 0, reason="needs a CUDA GPU")
def test_pytest_process_never_initialised_cuda():
    """Not a gpu test: this runs in the pytest process (or its fork, under --forked, which
    inherits the flags), after the GPU tests this process has run so far."""
    assert not torch.cuda._initialized and not torch.cuda._is_in_bad_fork()


@pytest.mark.gpu
def test_ranks_use_cuda_after_their_caller_did():
    torch.ones(1, device="cuda").sum().item()  # this worker has initialised CUDA
    assert torch.cuda.is_initialized()
    start_worker_server()  # this worker's own server: a fresh interpreter
    run_distributed(_nccl_all_reduce_on_own_gpu, 2, backend="nccl")


@pytest.mark.gpu
class TestNCCLRanks(DistributedTest):
    world_size = 2
    backend = "nccl"

    def test_all_reduce(self):
        _nccl_all_reduce_on_own_gpu()
