"""The tokenizer endpoints and the small informational routes (vLLM's names and shapes):

    POST /tokenize          {"prompt": text} or {"messages": [...]} -> {"count", "max_model_len",
                            "tokens", "token_strs"}; messages are rendered and encoded exactly as
                            /v1/chat/completions prompts them (the same fields, the same ids)
    POST /detokenize        {"tokens": [ids]} -> {"prompt": text} (special tokens kept)
    GET  /tokenizer_info    the tokenizer's special tokens, BOS rule, vocabulary size, context
                            and chat template (what lm-eval's `tokenizer_backend=remote` reads)
    GET  /version           {"version": kvserve's package version}
    GET  /v1/models/{id}    the /v1/models card of the served name (or the model path); 404
                            `model_not_found` otherwise

With API keys every route but /version needs one (not rate-limited, as /v1/models). Bodies are
read by server/body.py; text is bounded by server/limits.py before it is tokenized, and
tokenizing runs off the event loop. A /tokenize count may exceed max_model_len (the answer says
both): it measures text, it does not admit a prompt.
"""
from __future__ import annotations

from typing import Annotated, Optional

from fastapi import Path, Request
from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from kvserve.config.cli_args import kvserve_version
from kvserve.frontend.processor import ContextLengthError
from kvserve.server.body import parse_body
from kvserve.server.limits import context_error
from kvserve.server.openai.chat import chat_prompt
from kvserve.server.openai.chat_fields import CONTINUE_RULE, ChatTemplateFields
from kvserve.server.openai.protocol import MAX_MESSAGES, APIError, ChatMessageParam, ModelCard, TokenId
from kvserve.server.openai.request_rules import RULE_ERROR, check_rules, rules_schema
from kvserve.server.openai.tool_fields import ToolFields
from kvserve.server.openai.wire_types import Strict, Text

MAX_DETOKENIZE_TOKENS = 1 << 20
INVALID_TOKEN_ID = "invalid_token_id"       # /detokenize: an id the vocabulary does not have
# The fields of the chat form; a request with `prompt` may not send them.
CHAT_ONLY = ("add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools",
             "tool_choice", "parallel_tool_calls")
_RULES = (CONTINUE_RULE,)


def _tokenize_schema(schema: dict, model) -> None:
    rules_schema(_RULES)(schema, model)
    schema["oneOf"] = [{"required": ["prompt"]}, {"required": ["messages"]}]
    schema["allOf"].append({"if": {"required": ["prompt"]},
                            "then": {"not": {"anyOf": [{"required": [f]} for f in CHAT_ONLY]}}})


class TokenizeRequest(ToolFields, ChatTemplateFields):
    """`POST /tokenize`: text (`prompt`) or a chat (`messages` and the chat fields), never both."""
    model_config = ConfigDict(json_schema_extra=_tokenize_schema)

    model: Optional[Text] = None
    prompt: Text = None                             # (absent, never null)
    messages: Annotated[list[ChatMessageParam], Field(min_length=1, max_length=MAX_MESSAGES)] = None
    # (add_special_tokens None: true for a prompt; for messages, what /v1/chat/completions does)
    return_token_strs: bool = False

    @model_validator(mode="after")
    def _one_form(self):
        if self.prompt is None and self.messages is None:
            raise PydanticCustomError(RULE_ERROR, "give either prompt (text) or messages (a chat)",
                                      {"param": "prompt"})
        if self.prompt is not None and self.messages is not None:
            raise PydanticCustomError(RULE_ERROR, "give either prompt or messages, not both",
                                      {"param": "messages"})
        chat_fields = [f for f in CHAT_ONLY if f in self.model_fields_set]
        if self.prompt is not None and chat_fields:
            raise PydanticCustomError(RULE_ERROR, "only a request with messages takes this field "
                                      "(this one sends a prompt)", {"param": chat_fields[0]})
        check_rules(self, _RULES)
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None          # with return_token_strs: the vocabulary's pieces


class DetokenizeRequest(Strict):
    """`POST /detokenize`."""
    model: Optional[Text] = None
    tokens: list[TokenId] = Field(..., max_length=MAX_DETOKENIZE_TOKENS)


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    tokenizer_class: str                # kvserve's tokenizer (model/tokenizers/: tokenizer.py, gguf_tokenizer.py)
    bos_token: Optional[str] = None
    eos_token: Optional[str] = None
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    add_bos_token: bool                 # does add_special_tokens put BOS in front (measured)
    vocab_size: int
    model_max_length: int               # the served max_model_len
    chat_template: Optional[str] = None     # the template chat requests are rendered with


class VersionResponse(BaseModel):
    version: str


# ------------------------------------------------------------------ tokenizer helpers


def _tokenizer(state):
    if state.tokenizer is None:
        raise APIError("this model has no tokenizer, so there is nothing to tokenize with")
    return state.tokenizer


def token_strs(tok, ids: list[int]) -> list[str]:
    """Each id's vocabulary entry as the tokenizer spells it (`Ġthe`, `▁the`, `<0x0A>`)."""
    inner = getattr(tok, "_tok", None)              # a `tokenizers.Tokenizer` (HF, GGUF)
    if inner is not None:
        return [inner.id_to_token(i) for i in ids]
    pieces = getattr(tok, "pieces", None)           # llama2.c's byte strings
    if pieces is not None:
        return [pieces[i].decode("utf-8", "replace") for i in ids]
    return [tok.token_to_text(i) for i in ids]


def unknown_token(tok, ids: list[int]) -> int | None:
    """The first id of `ids` the vocabulary has no entry for, or None."""
    inner = getattr(tok, "_tok", None)
    for t in dict.fromkeys(ids):
        if t >= 2**32 or (inner.id_to_token(t) is None if inner is not None else t >= tok.vocab_size):
            return t
    return None


def _decode(tok, ids: list[int]) -> str:
    bad = unknown_token(tok, ids)
    if bad is not None:
        raise APIError(f"tokens: {bad} is not a token id of this model's vocabulary", param="tokens",
                       code=INVALID_TOKEN_ID)
    return tok.decode(ids, skip_special_tokens=False)


async def prompt_ids(state, req: TokenizeRequest, request=None) -> list[int]:
    """The token ids of the request's prompt, or of its chat as /v1/chat/completions renders it."""
    _tokenizer(state)                   # a 400 when the model has none
    if req.prompt is not None:
        special = True if req.add_special_tokens is None else req.add_special_tokens
        try:
            return (await state.tokenization.encode([req.prompt], special))[0]
        except ContextLengthError as e:
            raise context_error(e) from None
    return (await chat_prompt(state, req, request))[3]


def tokenizer_info(state) -> TokenizerInfoResponse:
    tok = _tokenizer(state)
    with_special, plain = tok.encode("a", add_special_tokens=True), tok.encode("a", add_special_tokens=False)
    bos = tok.bos_token_id
    return TokenizerInfoResponse(
        tokenizer_class=type(tok).__name__, bos_token=tok.bos_token, eos_token=tok.eos_token,
        bos_token_id=bos, eos_token_id=tok.eos_token_id,
        add_bos_token=bos is not None and with_special[:1] == [bos] and plain[:1] != [bos],
        vocab_size=tok.vocab_size, model_max_length=state.max_model_len,
        chat_template=state.chat.source if state.chat is not None else None)


# ------------------------------------------------------------------ routes


def install(app, state) -> None:
    info: list[dict] = []           # /tokenizer_info, made on first use

    @app.post("/tokenize")
    async def tokenize(request: Request):
        state.tenancy.authenticate(request, limit=False)
        req = await parse_body(state, request, TokenizeRequest)
        ids = await prompt_ids(state, req, request)
        strs = (await state.tokenization.call(len(ids), token_strs, state.tokenizer, ids)
                if req.return_token_strs else None)
        return TokenizeResponse(count=len(ids), max_model_len=state.max_model_len, tokens=ids,
                                token_strs=strs).model_dump()

    @app.post("/detokenize")
    async def detokenize(request: Request):
        state.tenancy.authenticate(request, limit=False)
        req = await parse_body(state, request, DetokenizeRequest)
        tok = _tokenizer(state)
        text = await state.tokenization.call(len(req.tokens), _decode, tok, req.tokens)
        return DetokenizeResponse(prompt=text).model_dump()

    @app.get("/tokenizer_info")
    async def get_tokenizer_info(request: Request):
        state.tenancy.authenticate(request, limit=False)
        if not info:
            info.append(tokenizer_info(state).model_dump())
        return info[0]

    @app.get("/version")
    async def version():
        return VersionResponse(version=kvserve_version()).model_dump()

    @app.get("/v1/models/{model_id:path}")
    async def model_card(request: Request, model_id: str = Path(pattern=r"^[^\n]*$")):
        # (the route matches no newline in the id: the schema says so)
        state.tenancy.authenticate(request, limit=False)
        if model_id not in (state.model_name, state.engine.config.model.model):
            raise APIError(f"The model {model_id!r} does not exist; this server serves "
                           f"{state.model_name!r}", 404, param="model", code="model_not_found")
        return ModelCard(id=state.model_name, root=state.engine.config.model.model,
                         max_model_len=state.max_model_len).model_dump()


ROUTES = {      # for server/openapi.py
    ("post", "/tokenize"): (TokenizeRequest, TokenizeResponse, False),
    ("post", "/detokenize"): (DetokenizeRequest, DetokenizeResponse, False),
    ("get", "/tokenizer_info"): (None, TokenizerInfoResponse, False),
    ("get", "/version"): (None, VersionResponse, False),
    ("get", "/v1/models/{model_id}"): (None, ModelCard, False),
}
