"""Incremental detokenization never emits a broken character, on byte-fallback tokens too."""
from __future__ import annotations

from kvserve.frontend.detokenizer import IncrementalDetokenizer, held_back
from kvserve.model.loaders.checkpoint import load_model_dir
from tests.conftest import STORIES_C, STORIES_HF


def stream(tok, prompt, ids):
    d = IncrementalDetokenizer(tok, prompt, skip_special_tokens=True)
    pieces = [d.add(t) for t in ids]
    return pieces, d.text


def test_multibyte_utf8_is_streamed_whole():
    for path in (STORIES_HF, STORIES_C):
        _, _, tok = load_model_dir(str(path))
        text = "Lily saw a café, a 猫 and a 🐱 smile."
        ids = tok.encode(text)
        prompt, out = ids[:2], ids[2:]
        pieces, full = stream(tok, prompt, out)
        assert all("\ufffd" not in p for p in pieces)
        assert tok.decode(prompt) + full == text
        # The cat emoji is four byte-fallback tokens: it appears in one piece, in one go.
        assert any("🐱" in p for p in pieces)


def test_held_back_is_longest_stop_prefix():
    assert held_back("hello wor", ["world"]) == 3
    assert held_back("hello", ["xyz"]) == 0
    assert held_back("ab", ["abc", "b!"]) == 2


def test_logprob_token_text_keeps_its_leading_space():
    for path in (STORIES_HF, STORIES_C):
        _, _, tok = load_model_dir(str(path))
        ids = tok.encode("Tom had a red ball", add_special_tokens=False)
        assert "".join(tok.token_to_text(t) for t in ids) == " Tom had a red ball"
