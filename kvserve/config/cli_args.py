"""Command-line flags generated from dataclass fields: a field's default, its type and its
`metadata` (help, choices, metavar, aliases: `flag(...)`) are the one place a flag is defined.

    block_size: int = field(default=16, metadata=flag("tokens per KV cache block"))
        -> --block-size N (type int, default 16)

A bool field becomes `--x/--no-x` (argparse.BooleanOptionalAction), or a plain `--x` switch when
its default is False; `int | None` parses as int; anything else (str, a JSON dict, a list given
comma-separated) parses as the string the dataclass itself validates. A field without a default
gets the flag default None (the caller fills it in: `--model`).
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any


class ArgumentParser(argparse.ArgumentParser):
    """Every kvserve parser (sub-commands inherit the class): no abbreviated options, so an
    unknown flag is an error, never a prefix of another one (argparse's default read llama-server's
    `-t 2` as `-tp 2` and `--max-model 100` as `--max-model-len 100`)."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)


def flag(help: str, *, choices: typing.Sequence[str] | None = None, metavar: str | None = None,
         aliases: tuple[str, ...] = ()) -> dict:
    """The `metadata` of a dataclass field that is also a command-line flag."""
    return {"help": help, "choices": choices, "metavar": metavar, "aliases": aliases}


def option_name(field: dataclasses.Field) -> str:
    return "--" + field.name.replace("_", "-")


def cli_default(field: dataclasses.Field) -> Any:
    """The flag's default: the field's (a default_factory is called), None without one."""
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return None


def _scalar_type(hint) -> type:
    args = [a for a in (typing.get_args(hint) or (hint,)) if a is not type(None)]
    for t in (bool, int, float):
        if t in args:
            return t
    return str


def flag_fields(cls) -> list[dataclasses.Field]:
    """The fields of `cls` that are flags (every init field with `flag(...)` metadata)."""
    return [f for f in dataclasses.fields(cls) if f.init and "help" in f.metadata]


def add_dataclass_args(parser, cls) -> None:
    """Add one flag per field of the dataclass `cls` to `parser` (or an argument group)."""
    hints = typing.get_type_hints(cls)
    for f in flag_fields(cls):
        meta, default = f.metadata, cli_default(f)
        kw: dict[str, Any] = {"dest": f.name, "default": default, "help": meta["help"]}
        kind = _scalar_type(hints[f.name])
        if kind is bool:
            kw["action"] = "store_true" if default is False else argparse.BooleanOptionalAction
        else:
            if kind is not str:
                kw["type"] = kind
            if meta.get("choices") is not None:
                kw["choices"] = list(meta["choices"])
            if meta.get("metavar") is not None:
                kw["metavar"] = meta["metavar"]
        parser.add_argument(option_name(f), *meta.get("aliases", ()), **kw)


def dataclass_kwargs(cls, args: argparse.Namespace) -> dict:
    """The values of `cls`'s flags in parsed `args` (flags `args` lacks are left out)."""
    return {f.name: getattr(args, f.name) for f in flag_fields(cls) if hasattr(args, f.name)}
