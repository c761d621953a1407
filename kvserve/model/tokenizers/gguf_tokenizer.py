"""A `tokenizers` tokenizer rebuilt from GGUF metadata (`tokenizer.ggml.*`), which stores the
vocabulary, not a tokenizer.json.

- `llama` (SentencePiece BPE): merges are recovered from the piece scores (a pair merges at the
  score of the piece it makes, best first), `▁` stands for a space and, as llama.cpp does, one
  is prepended to every run of text between special tokens (`add_space_prefix`); unknown
  characters fall back to `<0xXX>` byte pieces. (transformers' GGUF tokenizer prepends only at
  the start and not before an existing space; the model's own tokenizer.json agrees with us.)
- `gpt2` (byte-level BPE): the file's merges; text is split by the regex `tokenizer.ggml.pre`
  names (llama.cpp's pre-tokenizer types), then spelled as bytes.
Control tokens (token_type 3, and the unknown token) become special added tokens matched whole
in text; user-defined ones (4) become plain added tokens.
"""
from __future__ import annotations

import warnings

from kvserve.model.tokenizers.tokenizer import TokenizersBacked

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2_SPLIT = None   # ByteLevel's own regex (GPT-2's)
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_DIGITS_THEN_GPT2 = "digits"   # every digit alone, then GPT-2's regex (StarCoder lineage)

# tokenizer.ggml.pre -> how text is split before byte-level BPE (after llama.cpp's table)
PRE_TOKENIZERS = {
    "default": _GPT2_SPLIT, "gpt-2": _GPT2_SPLIT, "gpt2": _GPT2_SPLIT, "mpt": _GPT2_SPLIT,
    "olmo": _GPT2_SPLIT, "jais": _GPT2_SPLIT,
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "stablelm2": _QWEN2_SPLIT,
    "smollm": _DIGITS_THEN_GPT2, "starcoder": _DIGITS_THEN_GPT2, "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2, "command-r": _DIGITS_THEN_GPT2,
}


class GGUFTokenizer(TokenizersBacked):
    """kvserve's Tokenizer interface over a `tokenizers.Tokenizer` built from GGUF metadata."""

    fim_ids: tuple[int, int, int] | None = None     # (prefix, suffix, middle), when the file names them

    def __init__(self, tok, tokens: list[str], special_ids: set[int], bos_id: int | None,
                 eos_id: int | None, add_bos: bool, chat_template: str | None):
        self._tok = tok
        self._size = len(tokens)
        self.special_ids = frozenset(special_ids)
        self.bos_token_id, self.eos_token_id = bos_id, eos_id
        self.bos_token = tokens[bos_id] if bos_id is not None else None
        self.eos_token = tokens[eos_id] if eos_id is not None else None
        self.add_bos_token = add_bos
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True,
               split_special_tokens: bool = False) -> list[int]:
        return self._inner(split_special_tokens).encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    @property
    def vocab_size(self) -> int:
        return self._size


def build_gguf_tokenizer(meta: dict) -> GGUFTokenizer | None:
    """The tokenizer `meta` (GGUF key-values) describes; None when it stores no vocabulary."""
    from tokenizers import AddedToken, Tokenizer as _Tok

    kind = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if kind is None or not tokens:
        return None
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)

    def token_id(name):
        i = meta.get(f"tokenizer.ggml.{name}_token_id")
        return i if i is not None and 0 <= i < len(tokens) else None

    bos, eos, unk = token_id("bos"), token_id("eos"), token_id("unknown")
    tok_normalizer = tok_pre = None
    if kind == "llama":
        model, tok_normalizer, decoder = _sentencepiece_parts(meta, tokens, types, unk)
        add_bos = meta.get("tokenizer.ggml.add_bos_token", True)
    elif kind == "gpt2":
        model, tok_pre, decoder = _byte_level_parts(meta, tokens, types)
        add_bos = meta.get("tokenizer.ggml.add_bos_token", False)
    else:
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported; kvserve builds 'llama' "
                         "(SentencePiece) and 'gpt2' (byte-level BPE) tokenizers.")
    tok = _Tok(model)
    if tok_normalizer is not None:
        tok.normalizer = tok_normalizer
    if tok_pre is not None:
        tok.pre_tokenizer = tok_pre
    tok.decoder = decoder
    special = {i for i, t in enumerate(types) if t == CONTROL or i == unk}
    tok.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                            for i in sorted(special)])
    tok.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                    for i, t in enumerate(types) if t == USER_DEFINED])
    add_eos = meta.get("tokenizer.ggml.add_eos_token", False)
    tok.post_processor = _bos_eos_template(tokens, bos if add_bos else None, eos if add_eos else None)
    out = GGUFTokenizer(tok, tokens, special, bos, eos, bool(add_bos and bos is not None),
                        meta.get("tokenizer.chat_template"))
    for names in (("fim_pre", "fim_suf", "fim_mid"), ("prefix", "suffix", "middle")):   # llama.cpp's keys, new and old
        fim = tuple(token_id(n) for n in names)
        if None not in fim:
            out.fim_ids = fim           # fill-in-the-middle (the server's /infill)
            break
    return out


def _sentencepiece_parts(meta, tokens, types, unk):
    from tokenizers import decoders, models, normalizers

    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        raise ValueError("a 'llama' GGUF tokenizer needs tokenizer.ggml.scores, one per token; "
                         "the file's tokenizer metadata is incomplete.")
    model = models.BPE(vocab=first_ids(tokens), merges=sentencepiece_merges(tokens, scores, types),
                       unk_token=tokens[unk] if unk is not None else None,
                       fuse_unk=True, byte_fallback=True)
    # llama.cpp: every run of text between special tokens gets the space prefix, spaces -> ▁
    prefix = meta.get("tokenizer.ggml.add_space_prefix", True)
    spaces = normalizers.Replace(" ", "▁")
    norm = normalizers.Sequence([normalizers.Prepend("▁"), spaces]) if prefix else spaces
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(" ", 1, 0))   # the space the prefix added
    return model, norm, decoders.Sequence(steps)


def sentencepiece_merges(tokens: list[str], scores: list[float],
                         types: list[int]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored SentencePiece vocabulary: every split of a normal piece
    into two pieces of the vocabulary, ranked by the made piece's score (highest first), then
    longer left part, longer right part, piece order, part ids."""
    vocab = first_ids(tokens)
    ranked = []
    for i, piece in enumerate(tokens):
        if types[i] not in (NORMAL, USER_DEFINED):
            continue
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in vocab and right in vocab:
                ranked.append((-scores[i], -len(left), -len(right), i, vocab[left], vocab[right],
                               left, right))
    ranked.sort(key=lambda r: r[:6])
    return [(r[6], r[7]) for r in ranked]


def first_ids(tokens: list[str]) -> dict[str, int]:
    """token -> id; a token listed twice keeps its first id (llama.cpp files may repeat one)."""
    ids: dict[str, int] = {}
    for i, t in enumerate(tokens):
        ids.setdefault(t, i)
    return ids


def _byte_level_parts(meta, tokens, types):
    from tokenizers import Regex, decoders, models, pre_tokenizers

    merges = meta.get("tokenizer.ggml.merges")
    if not merges:
        raise ValueError("a 'gpt2' GGUF tokenizer needs tokenizer.ggml.merges; the file's "
                         "tokenizer metadata is incomplete.")
    spell = _byte_alphabet()
    alphabet = set(spell.values())
    vocab = {}
    for i, t in enumerate(tokens):   # normal tokens stored as raw text get the byte spelling
        if types[i] == NORMAL and not set(t) <= alphabet:
            t = "".join(spell[b] for b in t.encode("utf-8"))
        vocab.setdefault(t, i)
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    model = models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False)
    name = meta.get("tokenizer.ggml.pre", "default")
    if name not in PRE_TOKENIZERS:
        warnings.warn(f"GGUF pre-tokenizer {name!r} is unknown to kvserve; splitting text like "
                      "GPT-2, which may tokenize some text differently from llama.cpp.")
    split = PRE_TOKENIZERS.get(name, _GPT2_SPLIT)
    gpt2 = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split is _GPT2_SPLIT:
        pre = gpt2
    elif split == _DIGITS_THEN_GPT2:
        pre = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), gpt2])
    else:
        pre = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return model, pre, decoders.ByteLevel()


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table: printable Latin-1 bytes stand for themselves,
    the other 68 bytes take the characters from U+0100 on, in byte order."""
    keep = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in keep}
    spare = 0x100
    for b in range(256):
        if b not in table:
            table[b] = chr(spare)
            spare += 1
    return table


def _bos_eos_template(tokens, bos: int | None, eos: int | None):
    """A post-processor that puts BOS before and/or EOS after a single text."""
    from tokenizers import processors

    pre = [tokens[bos]] if bos is not None else []
    post = [tokens[eos]] if eos is not None else []
    specials = [(tokens[i], i) for i in dict.fromkeys(x for x in (bos, eos) if x is not None)]
    return processors.TemplateProcessing(single=pre + ["$A"] + post,
                                         pair=pre + ["$A"] + post + pre + ["$B:1"] + post,
                                         special_tokens=specials)
