"""python -m deepspeed_fused report [--config ds_config.json] [--model NAME]"""
from __future__ import annotations

import argparse
import json
import sys


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepspeed_fused")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="environment, and what each feature would do for a config and model")
    r.add_argument("--config", help="a ds_config.json with a deepspeed_fused section")
    r.add_argument("--model", help="a named model of deepspeed_fused.models (built on the meta device)")
    args = p.parse_args(argv)

    from .features.base import Environment
    from .report import environment_text

    env = Environment.detect()
    print("deepspeed_fused environment")
    print(environment_text(env))
    if args.config is None:
        return 0
    with open(args.config) as f:
        ds_config = json.load(f)
    from .config import parse_config

    cfg = parse_config(ds_config)
    print()
    enabled = [n for n, v in cfg if v.enabled]
    print(f"config {args.config}: enabled features: {', '.join(enabled) or 'none'}")
    if args.model is None:
        return 0
    import torch

    from .hook import patch_model, unpatch_model
    from .models import build_model

    with torch.device("meta"):
        model = build_model(args.model)
    report = patch_model(model, cfg, env=env)
    print(f"model {args.model} ({type(model).__name__}):")
    print(report.table())
    unpatch_model(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
