"""The ready ds_configs shipped inside the package (``deepspeed_fused/configs/``; in a clone, a link
to the top-level ``configs/``), and how a path given by a user resolves to one of them.

Shared by the example job (``--deepspeed_config``) and the report CLI (``--config``): a path that
exists is read as it is; one that does not but names a shipped config (``configs/fused_all.json``,
``fused_all.json`` or ``fused_all``) is that config, so the README's commands work from any
directory once the package is installed.
"""
from __future__ import annotations

import os

CONFIGS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def shipped_configs() -> list:
    """The names of the shipped configs."""
    try:
        return sorted(f for f in os.listdir(CONFIGS_DIR) if f.endswith(".json"))
    except OSError:
        return []


def resolve_config(path: str) -> str:
    """``path`` if it exists, else the shipped config of that name; FileNotFoundError (one line,
    naming ``path`` and the shipped configs) otherwise."""
    if os.path.exists(path):
        return path
    name = os.path.basename(path)
    for candidate in (name, name + ".json"):
        shipped = os.path.join(CONFIGS_DIR, candidate)
        if name and os.path.isfile(shipped):
            return shipped
    raise FileNotFoundError(f"{path}: no such file, nor a shipped config of that name "
                            f"({', '.join(shipped_configs()) or 'none shipped'})")
