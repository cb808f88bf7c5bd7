"""The Hugging Face Trainer under DeepSpeed ZeRO-2 with deepspeed_fused.

    deepspeed --num_gpus 1 examples/hf_trainer.py [--model qwen3-tiny] [--steps 4] [--gradient-checkpointing]

The Trainer's ``deepspeed=`` config (examples/configs/hf_zero2_fused.json, "auto" values resolved
by the Trainer) carries the "deepspeed_fused" section; ``import deepspeed_fused`` is all the script
adds. The model's own loss runs fused (linear_cross_entropy: the [tokens, vocab] logits are never
formed), with the fused RMSNorm, rope, MLP activation and DeepSpeed's gradient norm (the MoE
reorder too, for an MoE model). ``--gradient-checkpointing`` trains as full-depth models are
usually trained, with the Trainer's gradient checkpointing (non-reentrant; ``reentrant`` for the
other kind): the recomputed layers run the same fused kernels. A tiny random model is built
offline, so this runs on a CPU in about a minute.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this clone's package

import torch  # noqa: E402

import deepspeed_fused  # noqa: E402,F401  (installs the hook on deepspeed.initialize)
from deepspeed_fused.models import build_model  # noqa: E402
from deepspeed_fused.train import trainer_grad_ckpt_args  # noqa: E402
from _recipe_common import close_process_group, print_report, recipe_parser  # noqa: E402  (this folder's shared parts)


def main():
    p = recipe_parser(__doc__, steps=4)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--gradient-checkpointing", nargs="?", default="off", const="non-reentrant",
                   choices=["off", "non-reentrant", "reentrant"],
                   help="the Trainer's gradient checkpointing (given alone: non-reentrant)")
    p.add_argument("--output_dir", default=os.path.join("runs", "hf_trainer"))
    args, _ = p.parse_known_args()  # the launcher adds --local_rank

    from transformers import Trainer, TrainingArguments

    cuda = torch.cuda.is_available()
    model = build_model(args.model, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (64, args.seq_len), generator=g)]
    targs = TrainingArguments(output_dir=args.output_dir, deepspeed=args.deepspeed_config, max_steps=args.steps,
                              per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, bf16=cuda,
                              use_cpu=not cuda, save_strategy="no", report_to=[], disable_tqdm=True,
                              **trainer_grad_ckpt_args(args.gradient_checkpointing))
    trainer = Trainer(model=model, args=targs, train_dataset=data)
    trainer.train()
    report = trainer.model_wrapped.deepspeed_fused_report
    print_report(report)
    close_process_group()


if __name__ == "__main__":
    main()
