"""python -m deepspeed_fused report [--config ds_config.json] [--model NAME]

(or ``deepspeed-fused report ...``, the console script)"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _prog() -> str:
    """How the user called us: ``deepspeed-fused`` (console script) or ``python -m deepspeed_fused``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m deepspeed_fused" if name in ("", "__main__.py", "-c", "-m") else name


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=_prog())
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
    from .config import ConfigError, parse_config
    from .features.registry import all_features

    try:
        cfg = parse_config(ds_config)
    except ConfigError as e:
        print(f"{p.prog}: {args.config}: {e}", file=sys.stderr)
        return 2
    print()
    enabled = [f.name for f in all_features() if getattr(cfg, f.name).enabled]
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
    print("calls: how often each applied feature's fused path and the eager code it falls back to ran since it "
          "was applied; a run's counts are live in engine.deepspeed_fused_report (0 here: the model is built on "
          "the meta device and not run)")
    unpatch_model(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
