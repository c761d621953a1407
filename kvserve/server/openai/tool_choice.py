"""What a chat request's `tools` and `tool_choice` ask of one answer (`ToolPlan`):

    "none"      the tools stay out of the prompt; the answer is content
    "auto"      the tools go into the prompt; the answer is read with `--tool-call-parser`
                (tool_calls/auto.py): calls where it finds them, content otherwise
    "required"  one or more calls (one without `parallel_tool_calls`), enforced by a JSON
                schema built from the functions' parameter schemas (tool_calls/forced.py)
    {"type": "function", "function": {"name": f}}   one call of f, its parameters enforced

The default is "auto" when there are tools, else "none"; "auto" with tools needs a server
started with --enable-auto-tool-choice (vLLM's rule). What the served schema cannot state is
refused here with the code `invalid_tools`: two functions of one name, a tool_choice naming a
function not in `tools` (or forcing a call with no tools), and `strict` functions under "auto"
beside another output constraint. Under "auto" a strict function's calls keep to its schema from
the parser's start marker on (tool_calls/lazy_grammar.py, llama.cpp's lazy grammars).
"""
from __future__ import annotations

from dataclasses import dataclass

from kvserve.server.openai.protocol import INVALID_STRUCTURED_OUTPUT, INVALID_TOOLS, APIError, ChatCompletionRequest
from kvserve.server.openai.tool_fields import NamedToolChoice
from kvserve.tool_calls import tool_parser
from kvserve.tool_calls.auto import AutoCalls
from kvserve.structured.compiler import ll_tokenizer
from kvserve.structured.reasoning_grammar import marker_tokens
from kvserve.tool_calls.forced import NamedCall, RequiredCalls, parameters_of, required_schema
from kvserve.tool_calls.lazy_grammar import MARKERS, lazy_call_grammar


def _refuse(message: str, param: str = "tool_choice") -> APIError:
    return APIError(message, param=param, code=INVALID_TOOLS)


@dataclass(frozen=True)
class ToolPlan:
    choice: str                         # "none", "auto", "required" or "named"
    tools: list[dict]                   # Hugging Face's {"type": "function", "function": {...}}
    parser_name: str | None            # None: no --enable-auto-tool-choice
    parallel: bool = True
    named: str | None = None
    tokenizer: object = None
    strict: bool = False                # some function is strict

    @property
    def template_tools(self) -> list[dict] | None:
        """The tools the chat template (or the default tool prompt) shows the model."""
        return self.tools if self.tools and self.choice != "none" else None

    @property
    def constraint(self) -> dict | None:
        """The `StructuredOutputsParams` keyword enforcing a forced call, or strict functions'
        calls under "auto" (a lazy grammar, tool_calls/lazy_grammar.py), or None."""
        functions = [t["function"] for t in self.tools]
        if self.choice == "named":
            return {"json": parameters_of(next(f for f in functions if f["name"] == self.named))}
        if self.choice == "required":
            return {"json": required_schema(functions, self.parallel)}
        if self.choice == "auto" and self.strict and self.parser_name is not None:
            try:
                tokens = marker_tokens(ll_tokenizer(self.tokenizer), MARKERS[self.parser_name])
            except ValueError as e:         # no tokenizer llguidance reads
                raise APIError(str(e), param="tools", code=INVALID_STRUCTURED_OUTPUT) from None
            return {"grammar": lazy_call_grammar(self.parser_name, functions, self.parallel, tokens)}
        return None

    @property
    def keeps_special_tokens(self) -> bool:
        """The parser's markers may be special tokens ([TOOL_CALLS], <|python_tag|>): keep them."""
        return self.choice == "auto"

    def check_generating(self) -> None:
        """Before generating (a /tokenize renders the prompt without): "auto" with tools needs a
        server started with --enable-auto-tool-choice, as vLLM's does."""
        if self.choice == "auto" and self.tools and self.parser_name is None:
            raise _refuse('tool_choice "auto" needs a server started with --enable-auto-tool-choice (and '
                          '--tool-call-parser): send tool_choice "required", "none" or a named function')

    def reader(self):
        """A fresh reader of one choice's text, or None when the answer is plain content."""
        if self.choice == "auto":
            names = [t["function"]["name"] for t in self.tools]
            return AutoCalls(tool_parser(self.parser_name), names, None if self.parallel else 1)
        if self.choice == "named":
            return NamedCall(self.named)
        if self.choice == "required":
            return RequiredCalls()
        return None


def tool_plan(req: ChatCompletionRequest, parser_name: str | None, tokenizer=None) -> ToolPlan:
    """`parser_name`: --tool-call-parser's, None on a server without --enable-auto-tool-choice;
    `tokenizer`: the model's (strict functions under "auto": its marker tokens)."""
    tools = [t.model_dump(exclude_none=True) for t in req.tools or ()]
    names = [t["function"]["name"] for t in tools]
    dup = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if dup is not None:
        raise _refuse(f"two tools are named {dup!r}: function names must be unique", "tools")
    choice = req.tool_choice if req.tool_choice is not None else ("auto" if tools else "none")
    named = None
    if isinstance(choice, NamedToolChoice):
        named, choice = choice.function.name, "named"
        if named not in names:
            raise _refuse(f"tool_choice names the function {named!r}, which is not in tools"
                          + (f" ({', '.join(names)})" if names else " (there are none)"))
    elif choice == "required" and not tools:
        raise _refuse('tool_choice "required" needs at least one function in tools')
    strict = [n for t, n in zip(tools, names) if t["function"].get("strict")]
    if choice == "auto" and strict and req.given_constraints():
        raise _refuse(f"the function {strict[0]!r} is strict: under tool_choice \"auto\" its calls are "
                      f"constrained, and {req.given_constraints()[0]} cannot constrain the same answer: "
                      "drop one of them", "tools")
    return ToolPlan(choice, tools, parser_name, req.parallel_tool_calls, named, tokenizer, bool(strict))
