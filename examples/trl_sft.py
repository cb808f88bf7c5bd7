"""Supervised fine-tuning with TRL's SFTTrainer under DeepSpeed ZeRO-2 with deepspeed_fused.

    deepspeed --num_gpus 1 examples/trl_sft.py [--model qwen3-tiny] [--steps 4]

The ds_config (examples/configs/hf_zero2_fused.json, Hugging Face style with "auto" values) carries
the "deepspeed_fused" section; ``import deepspeed_fused`` is all the script adds. TRL installs its
fused LM head on the model; the linear_cross_entropy feature serves its calls with the fused op
("TRL fused LM head served" in the report). A tiny random model and a character tokenizer are built
offline, so this runs on a CPU in about a minute; give a real model and tokenizer for real work.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this clone's package

import torch  # noqa: E402

import deepspeed_fused  # noqa: E402,F401  (installs the hook on deepspeed.initialize)
from deepspeed_fused.models import build_model  # noqa: E402
from deepspeed_fused.tiny_tokenizer import tiny_tokenizer  # noqa: E402
from _recipe_common import close_process_group, print_report, recipe_parser  # noqa: E402  (this folder's shared parts)


def main():
    p = recipe_parser(__doc__, steps=4)
    p.add_argument("--output_dir", default=os.path.join("runs", "trl_sft"))
    args, _ = p.parse_known_args()  # the launcher adds --local_rank

    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    texts = [f"Question {i}: what is {i} plus {i + 1}? Answer: {2 * i + 1}." for i in range(64)]
    config = SFTConfig(output_dir=args.output_dir, deepspeed=args.deepspeed_config, max_steps=args.steps,
                       per_device_train_batch_size=4, learning_rate=1e-3, max_length=64, logging_steps=1,
                       bf16=cuda, use_cpu=not cuda, save_strategy="no", report_to=[], disable_tqdm=True)
    trainer = SFTTrainer(model=build_model(args.model, dtype=torch.float32), args=config,
                         train_dataset=Dataset.from_dict({"text": texts}), processing_class=tiny_tokenizer())
    trainer.train()
    report = trainer.model_wrapped.deepspeed_fused_report
    print_report(report)
    close_process_group()


if __name__ == "__main__":
    main()
