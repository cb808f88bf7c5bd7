"""The config reference, generated from the config models (the section's and each feature's).

    python -m deepspeed_fused.docs                                 # print the reference table
    python -m deepspeed_fused.docs --write docs/config.md   # rewrite its generated block
    python -m deepspeed_fused.docs --check docs/config.md   # exit 1 if the block is stale

It writes only the files it is given (in a clone: ``docs/config.md``, between the
``config-reference`` markers; a test checks it is current), never into the package.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import re
import sys
import textwrap
import typing

from .config import SECTION, SectionConfig
from .features.base import FeatureConfig
from .features.registry import all_features

START, END = "<!-- config-reference:start -->", "<!-- config-reference:end -->"


def config_reference() -> list[dict]:
    """Every key of the section and of every registered feature: path, type, default, meaning."""
    rows = []
    docs = _field_docs(SectionConfig)
    for name, field in SectionConfig.model_fields.items():
        rows.append(dict(key=f"{SECTION}.{name}", type=_type_name(field.annotation), default=field.default,
                         doc=docs.get(name, field.description or "")))
    for f in all_features():
        cm = f.config_model
        docs = _field_docs(cm)
        for name, field in cm.model_fields.items():
            rows.append(dict(key=f"{SECTION}.{f.name}.{name}", type=_type_name(field.annotation),
                             default=field.default, doc=docs.get(name, field.description or "")))
    return rows


def _type_name(ann) -> str:
    """A readable type for the docs: ``int or "auto"``, ``"auto" or "fp32"``, ``bool``."""
    origin = typing.get_origin(ann)
    if origin is typing.Literal:
        return " or ".join(f'"{a}"' if isinstance(a, str) else str(a) for a in typing.get_args(ann))
    if origin is typing.Union or type(ann).__name__ == "UnionType":
        return " or ".join(_type_name(a) for a in typing.get_args(ann))
    if origin is typing.Annotated:
        return _type_name(typing.get_args(ann)[0])
    name = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
    return {"StrictBool": "bool", "StrictInt": "int", "StrictFloat": "float", "StrictStr": "str",
            "NoneType": "null"}.get(name, name)


def _field_docs(cls: type) -> dict:
    """Attribute docstrings (a string literal right after a field) of a config class and its bases."""
    out: dict = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, (FeatureConfig, SectionConfig))):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for a, b in zip(body, body[1:]):
            if isinstance(a, ast.AnnAssign) and isinstance(a.target, ast.Name) and isinstance(b, ast.Expr) \
                    and isinstance(getattr(b, "value", None), ast.Constant) and isinstance(b.value.value, str):
                out[a.target.id] = " ".join(b.value.value.split())
    return out


def reference_table() -> str:
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
    p = argparse.ArgumentParser(prog="python -m deepspeed_fused.docs", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", nargs="+", metavar="FILE", help="rewrite the generated block of these files")
    mode.add_argument("--check", nargs="+", metavar="FILE", help="exit 1 if the block of any of these is stale")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    table = reference_table()
    if not (args.write or args.check):
        print(table)
        return 0
    stale = []
    for path in args.write or args.check:
        with open(path) as f:
            text = f.read()
        if START not in text:
            stale.append(f"{path}: no {START} block")
            continue
        new = render(text, table)
        if new == text:
            continue
        if args.check:
            stale.append(f"{path}: config reference is stale (python -m deepspeed_fused.docs --write {path})")
        else:
            with open(path, "w") as f:
                f.write(new)
            print("updated", path)
    for s in stale:
        print(s, file=sys.stderr)
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
