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


# llama-server's and vLLM's flags that kvserve spells another way (or has no use for): the
# refusal of one names what to give instead.
FOREIGN_FLAGS = {
    ("-b", "--batch-size", "-ub", "--ubatch-size"): "--max-num-batched-tokens N",
    ("-tb", "--threads-batch", "--threads-http"): "--engine-threads N (-t)",
    ("-ctk", "--cache-type-k", "-ctv", "--cache-type-v"): "--kv-cache-dtype auto|float32|bfloat16|int8|fp8_e4m3|fp8_e5m2",
    ("-fa", "--flash-attn"): "--attention-backend NAME",
    ("-a", "--alias"): "--served-model-name NAME",
    ("--chat-template-file",): "--chat-template FILE",
    ("--no-webui",): "--no-ui",
    ("-md", "--model-draft", "--draft-max", "--draft-min", "--draft"): "--speculative-config JSON",
    ("-sm", "--split-mode", "-ts", "--tensor-split"): "--tensor-parallel-size N",
    ("-hf", "--hf-repo", "-hff", "--hf-file"): "--model PATH (kvserve downloads nothing; the default model comes from PyPI)",
    ("-s",): "--seed N",
    ("--temp", "--top-k", "--top-p", "--min-p", "--repeat-penalty"):
        "the request's own field (temperature, top_k, ...), or --generation-config DIR for server defaults",
    ("-cb", "--cont-batching"): "nothing: kvserve always batches continuously",
    ("--mlock", "--no-mmap", "--numa"): "nothing: kvserve has no such setting",
    ("--props", "--slot-save-path"): "nothing: kvserve's settings are fixed at start and it pins no "
                                     "request to a slot (POST /props and POST /slots/ID answer 501)",
}

_FOREIGN_NAMES = frozenset(name for names in FOREIGN_FLAGS for name in names)


def kvserve_version() -> str:
    """The installed package's version (pyproject.toml's), or "unknown" when run uninstalled."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvserve")
    except PackageNotFoundError:
        return "unknown"


class ArgumentParser(argparse.ArgumentParser):
    """Every kvserve parser (sub-commands inherit the class): no abbreviated options, so an
    unknown flag is an error, never a prefix of another one (argparse's default read llama-server's
    `-t 2` as `-tp 2` and `--max-model 100` as `--max-model-len 100`); an unknown flag that is
    llama-server's or vLLM's is refused with the kvserve flag to give instead (FOREIGN_FLAGS)."""

    def __init__(self, *args, **kwargs):
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        # Ahead of argparse, which reads "-hf" as "-h f" and "-sm" as "-s m" before any error.
        import sys

        known = None
        for arg in (sys.argv[1:] if args is None else args):
            name = arg.split("=")[0] if isinstance(arg, str) else None
            if name in _FOREIGN_NAMES:
                known = self._all_option_strings() if known is None else known
                if name not in known:           # (`kvserve bench serve` has a --seed of its own)
                    self.error(f"unrecognized arguments: {name}")
        return super().parse_known_args(args, namespace)

    def _all_option_strings(self) -> set[str]:
        """The options of this parser and of every sub-command's, all the way down."""
        names = set(self._option_string_actions)
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    names |= sub._all_option_strings() if isinstance(sub, ArgumentParser) else set(sub._option_string_actions)
        return names

    def error(self, message: str):
        prefix = "unrecognized arguments: "
        if message.startswith(prefix):
            hints = [f"{arg} is not kvserve's: give {instead}" for arg in message[len(prefix):].split()
                     for names, instead in FOREIGN_FLAGS.items() if arg.split("=")[0] in names]
            if hints:
                message += "\n  " + "\n  ".join(hints)
        super().error(message)


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
