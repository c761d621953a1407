"""Which replica holds each stored Responses API response, so that a continuation
(`previous_response_id`) and `GET/DELETE /v1/responses/{id}` reach the replica whose in-memory
store has it (server/openai/responses/store.py): each replica names the response it made in the
`kvserve-response-id` header, and the router remembers the last MAX_HELD of them."""
from __future__ import annotations

import json
from collections import OrderedDict

from kvserve.server.openai.responses.store import RESPONSE_ID_HEADER

MAX_HELD = 100_000


class ResponseHolders:
    """response id -> replica, least recently used first out."""

    def __init__(self, max_held: int = MAX_HELD):
        self.max_held = max_held
        self._holder: OrderedDict[str, object] = OrderedDict()

    def learn(self, headers, replica) -> None:
        rid = headers.get(RESPONSE_ID_HEADER)
        if rid:
            self._holder[rid] = replica
            self._holder.move_to_end(rid)
            while len(self._holder) > self.max_held:
                self._holder.popitem(last=False)

    def holder(self, response_id: str | None):
        replica = self._holder.get(response_id) if isinstance(response_id, str) else None
        if replica is not None:
            self._holder.move_to_end(response_id)
        return replica

    def holder_of_previous(self, body: bytes):
        """The replica holding the response a POST body continues, if the body names one
        (only a body that mentions the field is parsed)."""
        if b"previous_response_id" not in body:
            return None
        try:
            parsed = json.loads(body)
        except (ValueError, UnicodeDecodeError):
            return None
        return self.holder(parsed.get("previous_response_id")) if isinstance(parsed, dict) else None
