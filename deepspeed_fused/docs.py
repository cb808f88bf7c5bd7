"""Generate the config reference (README.md and docs/config.md) from the config models.

    python -m deepspeed_fused.docs          # rewrite the generated blocks
    python -m deepspeed_fused.docs --check  # exit 1 if they are stale (a test runs this)
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"
FILES = ["README.md", os.path.join("docs", "config.md")]


def reference_table() -> str:
    from .config import config_reference

    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for r in config_reference():
        default = r["default"]
        default = "true" if default is True else "false" if default is False else default
        doc = r["doc"].replace("|", "\\|")
        typ = str(r["type"]).replace("|", "\\|")
        lines.append(f"| `{r['key']}` | {typ} | `{default}` | {doc} |")
    return "\n".join(lines)


def render(text: str, table: str) -> str:
    pat = re.compile(re.escape(START) + r".*?" + re.escape(END), re.S)
    return pat.sub(START + "\n" + table + "\n" + END, text)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    table = reference_table()
    stale = []
    for rel in FILES:
        path = os.path.join(ROOT, rel)
        with open(path) as f:
            text = f.read()
        if START not in text:
            stale.append(f"{rel}: no {START} block")
            continue
        new = render(text, table)
        if new != text:
            if "--check" in argv:
                stale.append(f"{rel}: config reference is stale (run python -m deepspeed_fused.docs)")
            else:
                with open(path, "w") as f:
                    f.write(new)
                print("updated", rel)
    for s in stale:
        print(s, file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
