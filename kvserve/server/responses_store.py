"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory,
bounded in entries and in bytes, the oldest evicted first (a response whose entry alone is over
the byte bound is not kept). An entry is one tenant's: another tenant asking for its id gets
what an unknown id gets. An entry holds its conversation's items (every earlier turn's input
and output, then its own), so a continuation needs only its previous response's entry."""
from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass

RESPONSE_ID_HEADER = "kvserve-response-id"     # names a new response, for a router (fleet/response_holders.py)

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class StoredResponse:
    tenant: str
    response: dict          # the response object, as it was sent
    items: tuple            # the conversation's input items, this response's output last
    nbytes: int


def entry_size(response: dict, items) -> int:
    """The entry's size: its JSON's UTF-8 bytes (what the objects hold, give or take)."""
    body = json.dumps([response, [i.model_dump(by_alias=True) for i in items]], ensure_ascii=False)
    return len(body.encode("utf-8", "surrogatepass"))


class ResponseStore:
    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES):
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("a response store holds at least one entry and one byte")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.nbytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, tenant: str, response: dict, items) -> bool:
        """Keep `response` (and its conversation's items) under its id; False if too big to keep."""
        entry = StoredResponse(tenant, response, tuple(items), entry_size(response, items))
        if entry.nbytes > self.max_bytes:
            return False
        self.delete(response["id"], tenant)
        self._entries[response["id"]] = entry
        self.nbytes += entry.nbytes
        while len(self._entries) > self.max_entries or self.nbytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.nbytes -= old.nbytes
        return True

    def get(self, rid: str, tenant: str) -> StoredResponse | None:
        entry = self._entries.get(rid)
        return entry if entry is not None and entry.tenant == tenant else None

    def delete(self, rid: str, tenant: str) -> bool:
        entry = self.get(rid, tenant)
        if entry is None:
            return False
        del self._entries[rid]
        self.nbytes -= entry.nbytes
        return True
