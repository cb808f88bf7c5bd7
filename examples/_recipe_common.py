"""What the recipes in this folder share: their common flags and the closing report lines.

A recipe runs as a script from this folder (the deepspeed launcher, ``accelerate launch``), so this
folder is first on ``sys.path`` and ``import _recipe_common`` finds this file from any directory.
"""
import argparse
import os

HERE = os.path.dirname(os.path.abspath(__file__))


def recipe_parser(doc, steps, config="hf_zero2_fused.json"):
    """The flags every recipe takes: --model, --steps (default ``steps``) and --deepspeed_config
    (default ``configs/<config>`` of this folder); the recipe adds its own."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--model", default="qwen3-tiny", help="a model name of deepspeed_fused.models")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--deepspeed_config", default=os.path.join(HERE, "configs", config))
    return p


def print_report(report, out=print):
    """The engine's deepspeed_fused report, then one line per counted feature:
    ``deepspeed_fused calls: NAME N fused, N reference, N eager``."""
    out(report)
    for f in report.features:
        if f.applied and f.calls is not None:
            out(f"deepspeed_fused calls: {f.name} {f.calls}")


def close_process_group():
    """Destroy the default process group before the interpreter exits, as a training script should:
    a group left to the exit's teardown can abort the process after a finished run."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
