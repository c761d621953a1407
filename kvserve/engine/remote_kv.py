"""The engine's part in layer-wise KV streaming between a PD pair (kv/stream_*.py; seed 000,
"Prefill-decode disaggregation"; the state is vLLM's WAITING_FOR_REMOTE_KVS).

Prefill side (`StreamOut`): a request with `kv_transfer_params: {"transfer_id", "stream_to"}`
opens a transfer to that decode instance; before each step the blocks of its prompt that become
full in the step (up to the last block the decode side can take: one token short of the prompt)
are planned with their store keys, the model's layer hook sends each layer's slices of them as
soon as it is written (`KVStreamSender.layer_written`), and the step that ends its prefill ends
the transfer. A request that ends before its prefill does aborts it.

Decode side (`RemoteKVWaits`): a request with `kv_transfer_params: {"transfer_id"}` waits in
WAITING_FOR_REMOTE_KV, off the queue, until its transfer is complete -- its blocks are then a
tier hit the admission loads (kv/stream_receiver.py's inbox) -- or has failed, when it queues
all the same and computes what did not arrive: the answer is the same either way, and
`stats()` counts which (`streamed`, `fallback:<why>`). The transfer is released once the
request holds its blocks, so each streamed block is held twice only between its arrival and
its request's admission.
"""
from __future__ import annotations

import logging
import time
from collections import Counter

from kvserve.engine.request import RequestStatus as S
from kvserve.kv.block_io import store_key
from kvserve.kv.stream_receiver import COMPLETE, FAILED, KVStreamReceiver, StreamInbox
from kvserve.kv.stream_sender import KVStreamSender
from kvserve.kv.stream_wire import parse_address

logger = logging.getLogger(__name__)

IDLE_WAIT_S = 0.005      # an engine with only streams to wait for sleeps this long, not spins


def stream_inbox(tiers) -> StreamInbox | None:
    """A decode instance's inbox of streamed blocks (its top KV tier); None elsewhere."""
    return StreamInbox() if tiers.kv_transfer == "stream" and tiers.kv_role == "decode" else None


def check_kv_transfer_side(side, ktp: dict | None) -> None:
    """A request's kv_transfer_params name the side `side` is (None: no stream), or ValueError."""
    if ktp is not None and getattr(side, "role", None) != ("prefill" if "stream_to" in ktp else "decode"):
        raise ValueError("kv_transfer_params: this engine does not stream KV in that role.")


def kv_stream_side(r, runner, kv, inbox: StreamInbox | None, scope: bytes):
    """The engine's side of the stream under the resolved config `r`: the prefill side's
    StreamOut, the decode side's RemoteKVWaits, or None without --kv-transfer stream. Both sides
    answer the engine's calls: add, take_ready, after_schedule, after_step, discard, close."""
    t, bs = r.tiers, r.cache.block_size
    if t.kv_transfer != "stream":
        return None
    if t.kv_role == "prefill":
        sender = KVStreamSender(bs, scope, t.kv_stream_rate, t.kv_stream_buffer, t.kv_stream_unit,
                                send_timeout=t.kv_stream_timeout)
        sender.bind(runner)
        return StreamOut(sender, kv, bs, scope)
    host, port = parse_address(t.kv_stream_address)
    layers, _ = runner.kv_layer_layout()
    receiver = KVStreamReceiver(host, port, t.kv_stream_buffer, kv.connector.block_bytes, layers, bs, scope,
                                t.kv_stream_timeout, inbox)
    logger.info("KV streams: taken on %s (buffer %d bytes)", receiver.address, t.kv_stream_buffer)
    return RemoteKVWaits(receiver)


class StreamOut:
    role, address = "prefill", None

    def __init__(self, sender: KVStreamSender, kv, block_size: int, scope: bytes):
        self.sender, self.kv, self.block_size, self.scope = sender, kv, block_size, scope
        self.reqs: dict = {}           # request id -> (Request, blocks planned)

    def __len__(self) -> int:
        return 0                       # nobody waits here

    def add(self, request_id: str, seqs: list, params: dict) -> bool:
        """Open the request's transfer; it queues as any request does (False: it does not wait)."""
        self.reqs[seqs[0].request_id] = [seqs[0], 0]
        self.sender.open(seqs[0].request_id, params["transfer_id"], params["stream_to"])
        return False

    def take_ready(self, idle: bool) -> list:
        return []

    def after_schedule(self, scheduled, groups: dict) -> None:
        self.plan(scheduled)

    def plan(self, scheduled) -> None:
        """scheduled: [(Request, new tokens)] of the step about to run."""
        items, bs = [], self.block_size
        for req, n in scheduled:
            entry = self.reqs.get(req.request_id)
            if entry is None:
                continue
            cap = (req.num_prompt_tokens - 1) // bs
            full = min((req.num_computed_tokens + n) // bs, cap)
            if full > entry[1]:
                ids = self.kv.block_ids(req.request_id)[entry[1]:full]
                keys = [store_key(self.scope, h)
                        for h in self.kv.block_hashes(req, full)[entry[1]:full]]
                items.append((req.request_id, ids, keys))
                entry[1] = full
        self.sender.plan(items)

    def after_step(self) -> None:
        """Prefills that ended this step end their transfer; requests that ended before abort."""
        self.sender.end_step()
        for rid, (req, _) in list(self.reqs.items()):
            if req.num_computed_tokens >= req.num_prompt_tokens:
                self.sender.done(rid)
            elif req.is_finished:
                self.sender.abort(rid, f"the request ended ({req.status.value}) before its prefill")
            else:
                continue
            del self.reqs[rid]

    def discard(self, request_id: str) -> None:
        if self.reqs.pop(request_id, None) is not None:
            self.sender.abort(request_id, "the request ended before its prefill")

    def close(self) -> None:
        self.sender.close()

    def stats_dict(self) -> dict:
        return {"role": "prefill", **self.sender.stats_dict()}


class RemoteKVWaits:
    role = "decode"

    def __init__(self, receiver: KVStreamReceiver):
        self.receiver = receiver
        self.waiting: dict[str, tuple[list, str]] = {}    # request id -> (sequences, transfer id)
        self.admitting: dict[str, str] = {}               # request id -> transfer id, until admitted
        self.counts: Counter = Counter()

    def __len__(self) -> int:
        return len(self.waiting)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.waiting

    @property
    def address(self) -> str:
        return self.receiver.address

    def add(self, request_id: str, seqs: list, params: dict) -> bool:
        """The request waits in WAITING_FOR_REMOTE_KV for its transfer (True: off the queue)."""
        self.waiting[request_id] = (seqs, params["transfer_id"])
        return True

    def take_ready(self, idle: bool) -> list[tuple[str, list]]:
        """Requests whose transfer is complete (their blocks wait in the inbox) or failed, their
        live sequences moved out of WAITING_FOR_REMOTE_KV (to WAITING_FOR_GRAMMAR when
        constrained, else WAITING); `idle`: the engine has nothing else to run (it waits a
        little here, not spins)."""
        if idle and self.waiting:
            time.sleep(IDLE_WAIT_S)
        ready = []
        for rid, (seqs, tid) in list(self.waiting.items()):
            state, why = self.receiver.poll(tid)
            if state == COMPLETE:
                self.counts["streamed"] += 1
                self.admitting[rid] = tid
            elif state == FAILED:
                self.counts[f"fallback:{why}"] += 1
                self.receiver.release(tid)
            else:
                continue
            del self.waiting[rid]
            live = [r for r in seqs if not r.is_finished]
            for r in live:
                r.transition(S.WAITING_FOR_GRAMMAR if r.params.structured_outputs is not None else S.WAITING)
            if live:
                ready.append((rid, live))
        return ready

    def after_step(self) -> None:
        pass

    def close(self) -> None:
        self.receiver.close()

    def after_schedule(self, scheduled, groups: dict) -> None:
        """Release the transfers of requests that now hold their blocks (or are gone)."""
        for rid, tid in list(self.admitting.items()):
            seqs = groups.get(rid)
            if seqs is None or any(r.status.holds_blocks or r.is_finished for r in seqs):
                self.receiver.release(tid)
                del self.admitting[rid]

    def discard(self, request_id: str) -> None:
        got = self.waiting.pop(request_id, None)
        tid = got[1] if got is not None else self.admitting.pop(request_id, None)
        if tid is not None:
            self.receiver.release(tid)

    def stats_dict(self) -> dict:
        return {"role": "decode", "waiting": len(self.waiting), **dict(self.counts),
                "receiver": self.receiver.stats_dict()}
