"""Reinforcement learning with TRL's GRPOTrainer under DeepSpeed ZeRO-2 with deepspeed_fused.

    deepspeed --num_gpus 1 examples/trl_grpo.py [--model qwen3-tiny] [--steps 2]

A rule-based reward (no reward model, no generation server: the trainer samples the completions
with the policy itself) scores how many digits a completion has. The ds_config
(examples/configs/hf_zero2_fused.json) carries the "deepspeed_fused" section; TRL's fused LM head
computes the completions' log-probabilities and entropies, served by the fused op ("TRL fused LM
head served" in the report). A tiny random model and a character tokenizer are built offline, so
this runs on a CPU in about a minute.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this clone's package

import torch  # noqa: E402

import deepspeed_fused  # noqa: E402,F401  (installs the hook on deepspeed.initialize)
from deepspeed_fused.models import build_model  # noqa: E402
from deepspeed_fused.tiny_tokenizer import tiny_tokenizer  # noqa: E402
from _recipe_common import close_process_group, print_report, recipe_parser  # noqa: E402  (this folder's shared parts)


def digits_reward(completions, **kwargs):
    """The share of digits in each completion (a rule, no model)."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def main():
    p = recipe_parser(__doc__, steps=2)
    p.add_argument("--output_dir", default=os.path.join("runs", "trl_grpo"))
    args, _ = p.parse_known_args()  # the launcher adds --local_rank

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    cuda = torch.cuda.is_available()
    prompts = [f"Count from {i}:" for i in range(32)]
    config = GRPOConfig(output_dir=args.output_dir, deepspeed=args.deepspeed_config, max_steps=args.steps,
                        per_device_train_batch_size=4, num_generations=4, max_completion_length=8,
                        learning_rate=1e-3, logging_steps=1, bf16=cuda, use_cpu=not cuda, save_strategy="no",
                        report_to=[], disable_tqdm=True)
    trainer = GRPOTrainer(model=build_model(args.model, dtype=torch.float32), reward_funcs=digits_reward,
                          args=config, train_dataset=Dataset.from_dict({"prompt": prompts}),
                          processing_class=tiny_tokenizer())
    trainer.train()
    report = trainer.model_wrapped.deepspeed_fused_report
    print_report(report)
    close_process_group()


if __name__ == "__main__":
    main()
