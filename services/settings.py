"""Command-line flags generated from a config dataclass, so each setting is defined once.

A field becomes `--field-name`; its default, type and help come from the field itself
(`metadata={"help": ..., "env": "TANDEM_...", "choices": (...)}`). An `env` variable, when
set, replaces the default. Optional scalars take their inner type; booleans take
`--flag/--no-flag`; tuples of strings take a comma-separated list.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import typing
from typing import Any, Iterable


def _inner_type(hint) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) is typing.Union and len(args) == 1:
        return args[0]
    return hint


def _parse(kind, text: str):
    if kind is bool:
        return text.lower() in ("1", "true", "yes", "on")
    if typing.get_origin(kind) is tuple:
        return tuple(a.strip() for a in text.split(",") if a.strip())
    if typing.get_origin(kind) is typing.Literal:
        return text
    return kind(text)


def add_flags(parser: argparse.ArgumentParser, cls, skip: Iterable[str] = ()) -> None:
    """Adds one flag per field of `cls` that has a default (fields without one are required)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        kind = _inner_type(hints[f.name])
        meta = f.metadata
        default = f.default if f.default is not dataclasses.MISSING else None
        if meta.get("env") and os.environ.get(meta["env"]) is not None:
            default = _parse(kind, os.environ[meta["env"]])
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING and default is None
        help_text = meta.get("help", "") + (f" (env {meta['env']})" if meta.get("env") else "")
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
            continue
        choices = meta.get("choices") or (typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None)
        parser.add_argument(flag, type=lambda text, k=kind: _parse(k, text), default=default, required=required,
                            choices=choices, help=help_text + ("" if required else " (default: %(default)s)"))


def values(args: argparse.Namespace, cls, skip: Iterable[str] = ()) -> dict:
    """The parsed values of `cls`'s flags, as keyword arguments for its constructor."""
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.init and f.name not in skip}
