"""Prompts of an exact length for the serving benchmark: token ids, or text re-encoded until it fits.

A benchmark that asks for 128-token prompts must send prompts the server counts as 128 tokens.
Decoding random token ids to text is not enough: many tokenizers do not re-encode their own
decoded text to the same ids (a vocabulary without merges spells it out character by character,
byte pieces become replacement characters, neighbouring pieces merge), so the server sees a
different length. Two remedies, in order of preference:

- token ids (`PromptMaker.make_ids`): the completions endpoints of kvserve, vLLM and llama.cpp
  accept a list of ints as `prompt`, which the server counts exactly (no BOS is added);
- text (`PromptMaker.make_text`): decode, re-encode with the tokenizer the server uses (with its
  special tokens: BOS counts), trim or extend the ids and decode again, until the encoded length is
  the requested one (vLLM's `gen_prompt_decode_to_target_len` does the same).

Either way the client reads the server's own `usage.prompt_tokens` and reports it beside the
requested length (bench/report.py). The tokenizer comes from `--tokenizer` (or `--model` when it is
a local path): an HF directory with tokenizer.json, a llama2.c directory with tok*.bin, or a
.gguf file (its `tokenizer.ggml.*` metadata; no weights are read). Without one, prompts are
words from a fixed list, sent as text, and only the server's count is known.
"""
from __future__ import annotations

import os
import random
from pathlib import Path

# A fixed, boring vocabulary for prompts when no tokenizer is available. Common short English
# words are single tokens in nearly every BPE vocabulary, so word count ~ token count.
_WORDS = (
    "the of and to in is was he for it with as his on be at by had are but from or have an they "
    "which one you were her all she there would their we him been has when who will more no if "
    "out so said what up its about into than them can only other new some could time these two "
    "may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those "
    "people how too little state good very make world still own see men work long get here "
    "between both life being under never day same another know while last might us great old "
    "year off come since against go came right used take three little girl boy dog cat tree sun "
    "happy big small red blue green play park ball friend mom dad home school bird fish cake"
).split()

MAX_FIT_ROUNDS = 16     # decode/re-encode rounds before a text prompt is accepted as it is


def load_tokenizer(path: str | None):
    """(kvserve Tokenizer, ordinary token ids) for a model path, or (None, []) when it holds none.

    Ordinary ids are the ones a random prompt may use: no special or control tokens, no byte
    pieces (<0x0A>: they decode to replacement characters), no unused padding entries."""
    if not path:
        return None, []
    p = Path(path)
    if p.is_file() and p.suffix == ".gguf":
        return _gguf_tokenizer(p)
    if p.is_dir():
        if (p / "tokenizer.json").is_file():
            from kvserve.model.tokenizers.tokenizer import HFTokenizer

            tok = HFTokenizer(p)
            vocab = tok._tok.get_vocab()
            return tok, sorted(i for t, i in vocab.items()
                               if i not in tok.special_ids and not _is_byte_piece(t))
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return _gguf_tokenizer(ggufs[0])
        toks = sorted(p.glob("tok*.bin"))
        ckpts = sorted(c for c in p.glob("*.bin") if c not in toks)
        if len(toks) == 1 and len(ckpts) == 1:
            import struct

            from kvserve.model.tokenizers.tokenizer import Llama2cTokenizer

            # llama2.c header: dim, hidden_dim, n_layers, n_heads, n_kv_heads, vocab_size, seq_len
            vocab_size = abs(struct.unpack("<7i", ckpts[0].open("rb").read(28))[5])
            tok = Llama2cTokenizer(toks[0], vocab_size)
            pieces = [tok.decode([i], skip_special_tokens=False) for i in range(tok.vocab_size)]
            return tok, [i for i in range(3, tok.vocab_size) if "\ufffd" not in pieces[i] and pieces[i]]
    return None, []


def _is_byte_piece(token: str) -> bool:
    return token.startswith("<0x") and token.endswith(">")


def _gguf_tokenizer(path: Path):
    from kvserve.model.loaders.gguf import open_gguf, read_metadata
    from kvserve.model.tokenizers.gguf_tokenizer import NORMAL, build_gguf_tokenizer

    meta = read_metadata(open_gguf(path))
    tok = build_gguf_tokenizer(meta)
    if tok is None:
        return None, []
    tokens = meta["tokenizer.ggml.tokens"]
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    return tok, [i for i, (t, k) in enumerate(zip(tokens, types))
                 if k == NORMAL and i not in tok.special_ids and not _is_byte_piece(t)]


class PromptMaker:
    """Random prompts of a requested token count, from a tokenizer when one is available."""

    def __init__(self, tokenizer_path: str | None, rng: random.Random):
        self.rng = rng
        self.tokenizer, self.ids = load_tokenizer(tokenizer_path)
        if self.tokenizer is not None and not self.ids:
            raise ValueError(f"the tokenizer of {tokenizer_path!r} has no ordinary tokens to draw "
                             "random prompts from.")
        self.misfits = 0        # text prompts whose encoded length could not be made exact

    @property
    def can_make_ids(self) -> bool:
        return self.tokenizer is not None

    def make_ids(self, n: int) -> list[int]:
        """`n` random ordinary token ids: a prompt the server counts as exactly `n` tokens."""
        return [self.rng.choice(self.ids) for _ in range(max(1, n))]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids) if self.tokenizer is not None else " ".join(
            _WORDS[i % len(_WORDS)] for i in ids)

    def make_text(self, n: int, with_specials: bool = True) -> str:
        """Text that encodes to `n` tokens: with the server's special tokens (BOS) counted for a
        completion prompt, without them for a chat message (whose template adds its own)."""
        n = max(1, n)
        if self.tokenizer is None:
            return " ".join(self.rng.choice(_WORDS) for _ in range(n))
        text, ok = fit_text(self.tokenizer, self.make_ids, n, with_specials)
        self.misfits += not ok
        return text


def fit_text(tok, draw, n: int, with_specials: bool = True) -> tuple[str, bool]:
    """Decode random ids and re-encode until the text encodes to exactly `n` tokens.

    `draw(k)` gives k random ids. Returns (text, exact): after MAX_FIT_ROUNDS rounds without an
    exact fit, the last text (which the server will count differently) and False."""
    specials = len(tok.encode("a", add_special_tokens=True)) - len(tok.encode("a", add_special_tokens=False)) \
        if with_specials else 0
    want = n - specials                              # content tokens
    if want < 1:                                     # n cannot be reached with any text
        return tok.decode(draw(1)), False
    ids = draw(want)
    text = tok.decode(ids)
    for _ in range(MAX_FIT_ROUNDS):
        counted = len(tok.encode(text, add_special_tokens=with_specials))
        if counted == n:
            return text, True
        content = tok.encode(text, add_special_tokens=False)
        if len(content) > want:
            ids = content[:want]
        elif len(content) < want:
            ids = content + draw(want - len(content))
        else:       # right content length, but specials counted differently: redraw one token
            ids = content[:-1] + draw(1)
        text = tok.decode(ids)
    return text, len(tok.encode(text, add_special_tokens=with_specials)) == n


def tokenizer_source(args) -> str | None:
    """`--tokenizer`, else `--model` when it names a local path (directory or .gguf file)."""
    if getattr(args, "tokenizer", None):
        return args.tokenizer
    model = getattr(args, "model", None)
    if model and (os.path.isdir(model) or (os.path.isfile(model) and model.endswith(".gguf"))):
        return model
    return None
