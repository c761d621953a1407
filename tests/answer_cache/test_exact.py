"""The exact answer cache: keys cover every output-changing field and the tenant; TTL; LRU."""
from __future__ import annotations

from kvserve.answer_cache.exact import ExactCache, cacheable, request_key
from kvserve.server.openai.protocol import CompletionRequest


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def fields(**kw):
    return CompletionRequest(prompt="x", **kw).model_dump(exclude={"prompt"})


def test_only_deterministic_requests_are_cacheable():
    assert cacheable(fields(temperature=0))
    assert cacheable(fields(temperature=0.8, seed=3))
    assert not cacheable(fields(temperature=0.8))
    assert not cacheable(fields())                 # the default temperature samples


def test_key_changes_with_every_output_field_and_tenant():
    base = request_key("m", "completion", "p", fields(temperature=0), "alice")
    assert base == request_key("m", "completion", "p", fields(temperature=0), "alice")
    # Delivery, identity and scheduling fields do not change the answer.
    for same in ({"stream": True}, {"user": "u"}, {"cache_salt": "s"}, {"priority": 3},
                 {"semantic_cache": False}, {"model": "m"}):
        assert request_key("m", "completion", "p", fields(temperature=0, **same), "alice") == base, same
    for change in ({"max_tokens": 3}, {"top_p": 0.5}, {"top_k": 2}, {"min_p": 0.1}, {"seed": 1},
                   {"stop": "x"}, {"stop_token_ids": [1]}, {"presence_penalty": 0.5},
                   {"frequency_penalty": 0.5}, {"repetition_penalty": 1.1}, {"min_tokens": 1},
                   {"ignore_eos": True}, {"n": 2}, {"skip_special_tokens": False},
                   {"include_stop_str_in_output": True}):
        assert request_key("m", "completion", "p", fields(temperature=0, **change), "alice") != base, change
    assert request_key("m", "completion", "p", fields(temperature=0), "bob") != base
    assert request_key("m", "chat", "p", fields(temperature=0), "alice") != base
    assert request_key("m2", "completion", "p", fields(temperature=0), "alice") != base
    assert request_key("m", "completion", "q", fields(temperature=0), "alice") != base


def test_ttl_and_lru():
    clock = Clock()
    c = ExactCache(max_entries=2, ttl=10.0, clock=clock)
    c.put("a", 1)
    clock.t = 9.9
    assert c.get("a") == 1
    clock.t = 10.0
    assert c.get("a") is None and c.expirations == 1
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1            # a is now the most recent
    c.put("c", 3)                     # b goes
    assert c.get("b") is None and c.get("a") == 1 and c.get("c") == 3 and c.evictions == 1
