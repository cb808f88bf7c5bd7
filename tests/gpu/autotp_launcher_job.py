"""Run by tests/gpu/test_linear_cross_entropy_autotp_gpu.py under the deepspeed launcher (one
process per GPU): every AutoTP case of tests/unit/test_linear_cross_entropy_autotp.py, fused
against unfused, with that test's own check; rank 0 writes the cases it checked."""
import argparse
import json
import os
import sys

sys.path[:0] = [os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")]  # tests/: unit, tiny_models

import deepspeed  # noqa: E402
import deepspeed.comm as dist  # noqa: E402
import torch  # noqa: E402

from unit.test_linear_cross_entropy_autotp import CASES, check_matches_unfused  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)  # the launcher may pass it
    args = parser.parse_args()
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")  # gloo: a CPU try
    assert dist.get_world_size() == 2, dist.get_world_size()
    done = []
    for case, (name, tp_extra) in CASES.items():
        torch.manual_seed(1234)
        check_matches_unfused(name, tp_extra)
        done.append(case)
        print(f"[autotp job] rank {dist.get_rank()}: {case} matches", flush=True)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump({"cases": done, "world_size": dist.get_world_size()}, f)


if __name__ == "__main__":
    main()
