"""The example training job, as a script in a clone: the job itself is ``deepspeed_fused.train``.

    deepspeed examples/train.py --deepspeed_config configs/fused_all.json --model qwen3-moe-tiny --steps 20

(installed, from any directory: ``deepspeed --module deepspeed_fused.train ...``, same flags).
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this clone's package

from deepspeed_fused.train import main  # noqa: E402

if __name__ == "__main__":
    main()
