"""A plain training loop with Hugging Face Accelerate and its DeepSpeed plugin (ZeRO-2), with
deepspeed_fused.

    accelerate launch --num_processes 1 --use_deepspeed \
        --deepspeed_config_file examples/configs/accelerate_zero2_fused.json examples/accelerate_train.py

(or ``deepspeed --num_gpus 1 examples/accelerate_train.py``: the script then builds the plugin from
the same file.) ``accelerator.prepare`` calls ``deepspeed.initialize``, which applies the features of
the config's "deepspeed_fused" section; ``import deepspeed_fused`` is all the script adds. A tiny
random model is built offline, so this runs on a CPU in about a minute.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this clone's package

import torch  # noqa: E402

import deepspeed_fused  # noqa: E402,F401  (installs the hook on deepspeed.initialize)
from deepspeed_fused.models import build_model  # noqa: E402
from _recipe_common import close_process_group, print_report, recipe_parser  # noqa: E402  (this folder's shared parts)


def main():
    p = recipe_parser(__doc__, steps=4, config="accelerate_zero2_fused.json")
    p.add_argument("--seq-len", type=int, default=64)
    args, _ = p.parse_known_args()  # the launcher adds --local_rank

    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin

    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        accelerator = Accelerator()  # accelerate launch --use_deepspeed: the plugin is configured
    else:
        accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=args.deepspeed_config))
    model = build_model(args.model, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (4 * args.steps, args.seq_len), generator=g)
    loader = torch.utils.data.DataLoader(ids, batch_size=4)
    engine, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    engine.train()
    for step, batch in enumerate(loader):
        loss = engine(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        accelerator.print(f"step {step} loss {loss.item():.4f}")
    report = engine.deepspeed_fused_report
    print_report(report, out=accelerator.print)
    close_process_group()


if __name__ == "__main__":
    main()
