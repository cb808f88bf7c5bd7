"""python -m deepspeed_fused report [--config ds_config.json] [--model NAME | PATH]

(or ``deepspeed-fused report ...``, the console script)

``--config`` is read as the example job reads ``--deepspeed_config``: a file, or the name of a
config shipped with the package (``configs/fused_all.json``). ``--model`` is a named model of
``deepspeed_fused.models``, a local Hugging Face model folder or its ``config.json`` (built from the
config with random weights on the meta device: nothing is downloaded or allocated); without
``--config`` every feature is enabled. A bad input (a missing or non-JSON file, a bad section
value, an unknown model) prints one line naming it and exits with status 2."""
from __future__ import annotations

import argparse
import json
import os
import sys


class InputError(Exception):
    """A bad command-line input: one line, naming the file, key or model."""


def _prog() -> str:
    """How the user called us: ``deepspeed-fused`` (console script) or ``python -m deepspeed_fused``."""
    name = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else ""
    return "python -m deepspeed_fused" if name in ("", "__main__.py", "-c", "-m") else name


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _load_config(given: str):
    """(path, parsed section) of ``--config``; InputError naming the file or the key."""
    from .config import ConfigError, parse_config
    from .shipped import resolve_config

    try:
        path = resolve_config(given)
    except FileNotFoundError as e:
        raise InputError(f"--config {e}") from None
    try:
        with open(path) as f:
            ds_config = json.load(f)
    except json.JSONDecodeError as e:
        raise InputError(f"--config {path}: not JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except UnicodeDecodeError:
        raise InputError(f"--config {path}: not JSON (not UTF-8 text)") from None
    except OSError as e:
        raise InputError(f"--config {path}: cannot read it ({e.strerror or e})") from None
    try:
        return path, parse_config(ds_config)
    except (ConfigError, TypeError, ValueError) as e:
        raise InputError(f"--config {path}: {e}") from None


def _build_model(given: str):
    """The model of ``--model`` on the meta device; InputError naming it."""
    import torch

    from .models import MODELS, build_model, build_model_from_path, is_model_path

    if given in MODELS:
        with torch.device("meta"):
            return build_model(given)
    if is_model_path(given):
        try:
            return build_model_from_path(given)
        except ValueError as e:
            raise InputError(f"--model {e}") from None
    kind = "no config.json in this folder" if os.path.isdir(given) else "no such file or folder"
    raise InputError(f"--model {given}: not a named model ({', '.join(sorted(MODELS))}) nor a local Hugging Face "
                     f"model folder or config.json ({kind})")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog=_prog())
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("report", help="environment, and what each feature would do for a config and model")
    r.add_argument("--config", help="a ds_config.json with a deepspeed_fused section, or the name of a shipped "
                                    "config (configs/fused_all.json)")
    r.add_argument("--model", help="a named model of deepspeed_fused.models, a local Hugging Face model folder or "
                                   "its config.json (built from the config on the meta device; no download); "
                                   "without --config every feature is enabled")
    args = p.parse_args(argv)
    try:
        return _report(args)
    except InputError as e:
        print(f"{p.prog} {args.cmd}: {_one_line(e)}", file=sys.stderr)
        return 2


def _report(args) -> int:
    from .features.base import Environment
    from .features.registry import all_features
    from .report import environment_text

    cfg = None
    if args.config is not None:
        path, cfg = _load_config(args.config)
    model = _build_model(args.model) if args.model is not None else None

    env = Environment.detect()
    print("deepspeed_fused environment")
    print(environment_text(env))
    if cfg is None and model is None:
        return 0
    print()
    if cfg is None:
        from .config import parse_config

        cfg = parse_config({f.name: {"enabled": True} for f in all_features()})
        print("config: none given; every feature enabled")
    else:
        shipped = f" (the shipped {path})" if path != args.config else ""
        enabled = [f.name for f in all_features() if getattr(cfg, f.name).enabled]
        print(f"config {args.config}{shipped}: enabled features: {', '.join(enabled) or 'none'}")
    if model is None:
        return 0
    from .hook import patch_model, unpatch_model
    from .report import CALLS_NOTE

    report = patch_model(model, cfg, env=env, warn=False)  # the table is the notice
    print(f"model {args.model} ({type(model).__name__}):")
    print(report.table())
    print(CALLS_NOTE + " (0 here: the model is built on the meta device and not run)")
    unpatch_model(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
