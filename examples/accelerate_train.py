"""A plain training loop with Hugging Face Accelerate and its DeepSpeed plugin (ZeRO-2), with
deepspeed_fused.

    accelerate launch --num_processes 1 --use_deepspeed \
        --deepspeed_config_file examples/configs/accelerate_zero2_fused.json examples/accelerate_train.py

(or ``deepspeed --num_gpus 1 examples/accelerate_train.py``: the script then builds the plugin from
the same file.) ``accelerator.prepare`` calls ``deepspeed.initialize``, which applies the features of
the config's "deepspeed_fused" section; ``import deepspeed_fused`` is all the script adds. A tiny
random model is built offline, so this runs on a CPU in about a minute.
"""
import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this clone's package

import torch  # noqa: E402

import deepspeed_fused  # noqa: E402,F401  (installs the hook on deepspeed.initialize)
from deepspeed_fused.models import build_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-tiny", help="a model name of deepspeed_fused.models")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--deepspeed_config", default=os.path.join(HERE, "configs", "accelerate_zero2_fused.json"))
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
    accelerator.print(report)
    for f in report.features:
        if f.applied and f.calls is not None:
            accelerator.print(f"deepspeed_fused calls: {f.name} {f.calls}")


if __name__ == "__main__":
    main()
