import os

import pytest
import torch

from unit.common import DistributedTest


class TestHarnessWorld2(DistributedTest):
    world_size = 2

    def test_ranks_and_allreduce(self):
        import deepspeed.comm as dist

        assert dist.get_world_size() == 2
        assert os.environ["LOCAL_SIZE"] == "2"
        t = torch.tensor([float(dist.get_rank() + 1)])
        dist.all_reduce(t)
        assert t.item() == 3.0

    @pytest.mark.parametrize("value", [1, 2])
    def test_params_reach_ranks(self, value):
        assert value in (1, 2)


class TestHarnessFailure:
    def test_rank_failure_is_reported(self):
        from unit.common import run_distributed

        def boom():
            if int(os.environ["RANK"]) == 1:
                raise RuntimeError("rank one failed")

        with pytest.raises(pytest.fail.Exception, match="rank one failed"):
            run_distributed(boom, 2, init_dist=False)
