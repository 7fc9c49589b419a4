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
import types
import typing
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar


def _inner_type(hint) -> Any:
    """`X` for an optional `X`, written `Optional[X]` (typing.Union) or `X | None`
    (types.UnionType); any other hint as it is."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and len(args) == 1:
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
        meta = dict(f.metadata)
        if meta.get("env"):
            meta["env"] = meta["env"].format(SERVICE=getattr(cls, "SERVICE", "").upper())
        default = f.default if f.default is not dataclasses.MISSING else None
        if meta.get("env") and os.environ.get(meta["env"]) is not None:
            default = _parse(kind, os.environ[meta["env"]])
        required = (
            f.default is dataclasses.MISSING
            and f.default_factory is dataclasses.MISSING
            and default is None
        )
        # argparse formats help with %: a literal one (25% of ...) is written %%.
        help_text = meta.get("help", "").replace("%", "%%") + (
            f" (env {meta['env']})" if meta.get("env") else ""
        )
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:
            parser.add_argument(
                flag, action=argparse.BooleanOptionalAction, default=default, help=help_text
            )
            continue
        choices = meta.get("choices") or (
            typing.get_args(kind) if typing.get_origin(kind) is typing.Literal else None
        )
        parser.add_argument(
            flag,
            type=lambda text, k=kind: _parse(k, text),
            default=default,
            required=required,
            choices=choices,
            help=help_text + ("" if required else " (default: %(default)s)"),
        )


def values(args: argparse.Namespace, cls, skip: Iterable[str] = ()) -> dict:
    """The parsed values of `cls`'s flags, as keyword arguments for its constructor."""
    return {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if f.init and f.name not in skip
    }


@dataclass(frozen=True, kw_only=True)
class ServiceConfig:
    """What every service's config has: where it listens, and flags made from its fields. A
    subclass names its service in SERVICE (`python -m services.<SERVICE>`), which also names
    the variables of these fields: TANDEM_<SERVICE>_HOST, TANDEM_<SERVICE>_PORT."""

    SERVICE: ClassVar[str] = ""
    DESCRIPTION: ClassVar[str] = ""
    host: str = field(
        default="127.0.0.1",
        metadata={"help": "address to listen on", "env": "TANDEM_{SERVICE}_HOST"},
    )
    port: int = field(
        default=0,
        metadata={
            "help": "gRPC port; 0: any free port (printed at start)",
            "env": "TANDEM_{SERVICE}_PORT",
        },
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if (f.name == "port" or f.name.endswith("_port")) and not 0 <= getattr(
                self, f.name
            ) < 65536:
                raise ValueError(
                    f"--{f.name.replace('_', '-')} must be in [0, 65535], not {getattr(self, f.name)}"
                )

    @classmethod
    def from_args(cls, argv: list[str] | None = None):
        parser = argparse.ArgumentParser(
            prog=f"python -m services.{cls.SERVICE}", description=cls.DESCRIPTION
        )
        add_flags(parser, cls)
        return cls(**values(parser.parse_args(argv), cls))
