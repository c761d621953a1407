"""Layer-wise KV streaming between a prefill and a decode engine (kv/stream_*.py,
engine/remote_kv.py), in one process: the decode engine's greedy tokens and logprobs equal a
collocated engine's under chunked prefill, tiny blocks, preemption in both modes and n > 1, its
prompt tokens came from the stream; every way a transfer fails (unknown id, stall, another
layout, the sender's buffer full, a corrupt frame, a cancel) ends in a recompute with the same
answer, counted by reason, with no block or buffer byte leaked; a full receiver refuses before
any prefill work. Flags and fields that cannot stream are refused."""
from __future__ import annotations

import socket
import threading
import uuid

import pytest

from kvserve import LLM, SamplingParams
from kvserve.kv.stream_wire import LAYER, OPEN, REPLY, cancel, frame, json_frame, read_json, reserve
from tests.conftest import STORIES_HF

PROMPTS = ["Once upon a time, there was a little girl named Lily. She loved to play outside in the sun",
           "Tom had a big red ball. He liked to throw it to his dog, Max, in the park every day",
           "Once upon a time, there was a little girl named Lily. She had a cat called Mittens"]
COMMON = dict(model=str(STORIES_HF), dtype="float32", block_size=2, enable_prefix_caching=True,
              prefix_cache="hash", max_num_batched_tokens=8, max_num_seqs=8)   # chunked prefill, tiny blocks
GREEDY = dict(temperature=0.0, max_tokens=12, logprobs=0, ignore_eos=True)


@pytest.fixture(scope="module")
def want():
    ref = LLM(model=str(STORIES_HF), dtype="float32")
    return ref.generate(PROMPTS, SamplingParams(**GREEDY))


@pytest.fixture(scope="module")
def prefill():
    llm = LLM(kv_role="prefill", kv_transfer="stream", **COMMON)
    yield llm
    llm.engine.core.shutdown()


def decode_engine(**kw) -> LLM:
    return LLM(kv_role="decode", kv_transfer="stream", **{**COMMON, **kw})


def receiver(dec: LLM):
    return dec.engine.core.kv_stream.receiver


def pair(prefill: LLM, dec: LLM, prompts: list[str], n: int = 1, send: bool = True):
    """Reserve, start the decode requests, run the prefills: the decode outputs."""
    addr = receiver(dec).address
    tids = [uuid.uuid4().hex for _ in prompts]
    for t in tids:
        assert reserve(addr, t, 200) == (True, "")
    out = {}
    th = threading.Thread(target=lambda: out.setdefault("d", dec.generate(
        prompts, [SamplingParams(**GREEDY, n=n, kv_transfer_params={"transfer_id": t}) for t in tids])))
    th.start()
    if send:
        prefill.generate(prompts, [SamplingParams(temperature=0.0, max_tokens=1,
                                                  kv_transfer_params={"transfer_id": t, "stream_to": addr})
                                   for t in tids])
    th.join(120)
    assert not th.is_alive(), "the decode engine hung"
    return out["d"]


def check(outs, want):
    for o, w in zip(outs, want):
        for s in o.outputs:
            assert s.token_ids == w.outputs[0].token_ids
            for a, b, t in zip(s.logprobs, w.outputs[0].logprobs, s.token_ids):
                assert abs(a[t].logprob - b[t].logprob) < 1e-4


def clean(dec: LLM):
    core = dec.engine.core
    core.check_integrity()
    assert receiver(dec).used() == 0 and receiver(dec).inbox.usage() == (0, 0)
    assert not core.kv_stream.waiting and not core.kv_stream.admitting


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_streamed_prompts_decode_exactly_under_preemption(prefill, want, mode):
    # a pool of 40 two-token blocks for three sequences of ~34 tokens, n=2: preemption happens
    dec = decode_engine(num_kv_blocks=40, preemption_mode=mode, swap_space=1 << 20)
    try:
        outs = pair(prefill, dec, PROMPTS, n=2)
        check(outs, want)
        for o in outs:          # every full block but the last partial one came over the stream
            assert o.num_cached_tokens >= len(o.prompt_token_ids) - 2
        st = dec.engine.core.stats()
        assert st.kv_stream["streamed"] == 3 and not any(k.startswith("fallback") for k in st.kv_stream)
        assert st.num_preemptions_total > 0
        clean(dec)
    finally:
        dec.engine.core.shutdown()


def test_every_failed_transfer_is_recomputed_and_counted(prefill, want):
    dec = decode_engine(kv_stream_timeout=0.5)
    addr = receiver(dec).address
    try:
        # an id nobody reserved; a reservation no prefill sends (stalls); one the proxy cancels
        stalled, cancelled = uuid.uuid4().hex, uuid.uuid4().hex
        assert reserve(addr, stalled, 200)[0] and reserve(addr, cancelled, 200)[0]
        cancel(addr, cancelled, "no prefill instance took the request")
        outs = dec.generate(PROMPTS, [SamplingParams(**GREEDY, kv_transfer_params={"transfer_id": t})
                                      for t in ("never-reserved", stalled, cancelled)])
        check(outs, want)
        ev = dec.engine.core.stats().kv_stream
        assert ev["fallback:unknown transfer id"] == 1 and ev["fallback:stalled"] == 1
        assert ev["fallback:cancelled: no prefill instance took the request"] == 1
        # a corrupt LAYER frame: the connection drops, the transfer fails, the prompt is recomputed
        bad = uuid.uuid4().hex
        assert reserve(addr, bad, 200)[0]
        r = receiver(dec)
        with socket.create_connection((r.host, r.port)) as s:
            s.sendall(b"".join(json_frame(OPEN, {"transfer_id": bad, "num_layers": r.num_layers,
                                                 "layer_bytes": r.layer_bytes, "block_size": 2,
                                                 "scope": r.scope.hex()})))
            assert read_json(s, REPLY)["ok"]
            parts = frame(LAYER, b"\0" * 8)
            s.sendall(parts[0] + parts[1] + b"\xff\xff\xff\xff")          # a wrong checksum
        out = dec.generate(PROMPTS[:1], SamplingParams(**GREEDY, kv_transfer_params={"transfer_id": bad}))
        check(out, want[:1])
        assert dec.engine.core.stats().kv_stream["fallback:connection lost"] == 1
        clean(dec)
    finally:
        dec.engine.core.shutdown()


def test_another_layout_and_a_full_sender_fall_back(want):
    dec = decode_engine()
    other = LLM(kv_role="prefill", kv_transfer="stream", **{**COMMON, "block_size": 4})     # another layout
    slow = LLM(kv_role="prefill", kv_transfer="stream", kv_stream_rate="4KiB", kv_stream_buffer="4KiB",
               **COMMON)                          # a link slower than the prefill, a small send buffer
    try:
        check(pair(other, dec, PROMPTS[:1]), want[:1])
        check(pair(slow, dec, PROMPTS[1:2]), want[1:2])
        ev = dec.engine.core.stats().kv_stream
        assert ev["fallback:another model or KV layout"] == 1
        assert any(k.startswith("fallback:aborted by the sender: the sender's buffer is full") for k in ev), ev
        assert slow.engine.core.stats().kv_stream["opened"] == 1
        clean(dec)
    finally:
        for llm in (dec, other, slow):
            llm.engine.core.shutdown()


def test_a_full_receiver_refuses_before_the_prefill():
    dec = decode_engine(kv_stream_buffer="64KiB")
    addr = receiver(dec).address
    try:
        per_block = receiver(dec).block_bytes
        assert reserve(addr, "a", 64 * 1024 // per_block * 2 + 1) == (True, "")   # exactly fills it
        ok, why = reserve(addr, "b", 8)
        assert not ok and "full" in why
        ok, why = reserve(addr, "c", 10 ** 6)
        assert not ok and "larger than this decode instance's stream buffer" in why
        ok, why = reserve(addr, "a", 8)
        assert not ok and "in use" in why
        st = receiver(dec).stats_dict()
        assert st["refused:full"] == 1 and st["refused:too large"] == 1 and st["reserved"] == 1
    finally:
        dec.engine.core.shutdown()


def test_what_cannot_stream_is_refused(prefill):
    with pytest.raises(ValueError, match="PD pair"):
        LLM(kv_transfer="stream", **COMMON)
    with pytest.raises(ValueError, match="hash prefix cache"):
        LLM(kv_role="decode", kv_transfer="stream", **{**COMMON, "prefix_cache": "radix"})
    with pytest.raises(ValueError, match="kv_stream_rate is not read on the decode side"):
        LLM(kv_role="decode", kv_transfer="stream", kv_stream_rate="1MB", **COMMON)
    with pytest.raises(ValueError, match="kv_stream_address is not read on the prefill side"):
        LLM(kv_role="prefill", kv_transfer="stream", kv_stream_address="127.0.0.1:9", **COMMON)
    with pytest.raises(ValueError, match="kv_stream_buffer is not read here"):
        LLM(kv_stream_buffer="1MiB", **COMMON)
    with pytest.raises(ValueError, match="host:port"):
        LLM(kv_role="decode", kv_transfer="stream", kv_stream_address="nowhere", **COMMON)
    with pytest.raises(ValueError, match="--kv-role decode --kv-transfer stream"):
        prefill.generate("Hi", SamplingParams(kv_transfer_params={"transfer_id": "x"}))
    with pytest.raises(ValueError, match="beam search"):
        SamplingParams(use_beam_search=True, n=2, kv_transfer_params={"transfer_id": "x"})
    with pytest.raises(ValueError, match="must be an object"):
        SamplingParams(kv_transfer_params={"transfer_id": "x", "remote_host": "h"})
