"""What is cheap to bound in a structured-outputs spec, refused before any compiler sees it.

The grammar compiler recurses along chains of rules and of JSON-schema references (a chain of
2,700 Lark rules overflows an 8 MiB stack), so a spec is refused here, with a message saying
what to shrink, when it defines more than MAX_GRAMMAR_RULES rules (Lark or GBNF), holds more
than MAX_SCHEMA_REFS `$ref`s, or nests deeper than MAX_SCHEMA_DEPTH. These bounds sit far
below what crashes; the worker process (sandbox.py) guards whatever passes them.
"""
from __future__ import annotations

import json
import re

MAX_GRAMMAR_RULES = 1000
MAX_SCHEMA_REFS = 500
MAX_SCHEMA_DEPTH = 128

# A rule or terminal definition at the start of a line: Lark `name:` / `?name:` / `NAME.2:`,
# GBNF `name ::=`.
_LARK_RULE = re.compile(r"^[ \t]*[?!]?[A-Za-z_][A-Za-z0-9_]*(?:\.-?\d+)?[ \t]*:(?!:)", re.M)
_GBNF_RULE = re.compile(r"^[ \t]*[A-Za-z_][A-Za-z0-9_-]*[ \t]*::=", re.M)


def check_bounds(kind: str, fmt: str, text: str) -> None:
    """ValueError naming structured_outputs.<kind> when the canonical spec (fmt, text) is past
    a bound above."""
    if fmt == "json_schema":
        depth, refs = _json_shape(json.loads(text))
        if depth > MAX_SCHEMA_DEPTH:
            raise ValueError(f"structured_outputs.{kind} nests {depth} levels deep; the limit is "
                             f"{MAX_SCHEMA_DEPTH}: flatten the schema.")
        if refs > MAX_SCHEMA_REFS:
            raise ValueError(f"structured_outputs.{kind} holds {refs} $refs; the limit is "
                             f"{MAX_SCHEMA_REFS}: give a schema with fewer references.")
    elif fmt in ("lark", "grammar"):
        rules = max(len(_LARK_RULE.findall(text)), len(_GBNF_RULE.findall(text)))
        if rules > MAX_GRAMMAR_RULES:
            raise ValueError(f"structured_outputs.{kind} defines {rules} rules; the limit is "
                             f"{MAX_GRAMMAR_RULES}: give a smaller grammar.")
        refs = text.count('"$ref"')            # JSON schemas inside a Lark grammar (%json {...})
        if refs > MAX_SCHEMA_REFS:
            raise ValueError(f"structured_outputs.{kind} holds {refs} $refs; the limit is "
                             f"{MAX_SCHEMA_REFS}: give a grammar with fewer references.")


def _json_shape(value) -> tuple[int, int]:
    """(nesting depth, number of "$ref" keys) of a JSON value, without recursion."""
    depth, refs, stack = 0, 0, [(value, 1)]
    while stack:
        v, d = stack.pop()
        depth = max(depth, d)
        if isinstance(v, dict):
            refs += "$ref" in v
            stack.extend((x, d + 1) for x in v.values())
        elif isinstance(v, list):
            stack.extend((x, d + 1) for x in v)
    return depth, refs
