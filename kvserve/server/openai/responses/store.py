"""The responses kept for `previous_response_id` and `GET /v1/responses/{id}`: in memory, one
tenant's entries apart from another's, the oldest stored evicted first (a get does not refresh
an entry). An entry is one tenant's: another tenant asking for its id gets what an unknown id
gets. An entry holds its conversation's items (every earlier turn's input and output, then its
own), so a continuation needs only its previous response's entry.

Two bounds, each in entries and in bytes (an entry's size: `entry_size`):

- the global bound, every tenant's entries together (`--max-stored-responses` 1,024 and
  `--max-stored-response-bytes` 64 MiB);
- a tenant's quota (`--max-stored-responses-per-tenant`, `--max-stored-response-bytes-per-tenant`;
  by default the global bound): past it, a tenant's put evicts that tenant's own oldest entries.

A put that takes the store over the global bound then evicts, one entry at a time, the oldest
entry of the tenant holding the most -- entries while the count is over, bytes while the bytes
are -- counting the new entry; among tenants holding as much, the one whose oldest entry is the
oldest. So a put evicts another tenant's entry only while that tenant holds at least as much as
the putting tenant then does, its new entry included; and, the store being over its bound, the
tenant evicted from holds more than its fair share (the bound over the number of tenants holding
entries): a tenant within its fair share loses entries only to its own puts, however many
requests another tenant sends. A tenant's burst evicts its own.

A put is refused (False, nothing kept, no entry evicted) when its entry alone is over the tenant's
byte quota, or when the rule would evict the new entry itself (its one entry is over every other
tenant's holding and still cannot fit). Finding the tenant to evict from reads every tenant
holding entries: at most one per entry, linear in the tenants per eviction.
"""
from __future__ import annotations

import itertools
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


class _Held:
    """One tenant's entries, oldest stored first: id -> (store order, entry)."""
    __slots__ = ("entries", "nbytes")

    def __init__(self):
        self.entries: OrderedDict[str, tuple[int, StoredResponse]] = OrderedDict()
        self.nbytes = 0


class ResponseStore:
    def __init__(self, max_entries: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES,
                 tenant_entries: int | None = None, tenant_bytes: int | None = None):
        """`tenant_entries` / `tenant_bytes`: a tenant's quota, None for the global bound's."""
        tenant_entries = max_entries if tenant_entries is None else tenant_entries
        tenant_bytes = max_bytes if tenant_bytes is None else tenant_bytes
        if min(max_entries, max_bytes, tenant_entries, tenant_bytes) < 1:
            raise ValueError("a response store holds at least one entry and one byte, and so does a tenant's quota")
        if tenant_entries > max_entries or tenant_bytes > max_bytes:
            raise ValueError(f"a tenant's quota of stored responses ({tenant_entries} entries, {tenant_bytes} "
                             f"bytes) must be within the store's bound ({max_entries} entries, {max_bytes} bytes)")
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.tenant_entries, self.tenant_bytes = tenant_entries, tenant_bytes
        self._tenants: dict[str, _Held] = {}
        self._order = itertools.count()
        self._count = 0
        self.nbytes = 0

    def __len__(self) -> int:
        return self._count

    def held(self, tenant: str) -> tuple[int, int]:
        """The entries and bytes `tenant` holds."""
        h = self._tenants.get(tenant)
        return (len(h.entries), h.nbytes) if h is not None else (0, 0)

    def put(self, tenant: str, response: dict, items) -> bool:
        """Keep `response` (and its conversation's items) under its id for `tenant`, evicting as
        the module's docstring says; False if it is not kept."""
        entry = StoredResponse(tenant, response, tuple(items), entry_size(response, items))
        if entry.nbytes > self.tenant_bytes:
            return False
        rid = response["id"]
        self.delete(rid, tenant)
        victims = self._victims(tenant, rid, entry.nbytes)
        if victims is None:
            return False
        for name, old in victims:
            self._remove(name, old)
        h = self._tenants.setdefault(tenant, _Held())
        h.entries[rid] = (next(self._order), entry)
        h.nbytes += entry.nbytes
        self._count += 1
        self.nbytes += entry.nbytes
        return True

    def get(self, rid: str, tenant: str) -> StoredResponse | None:
        h = self._tenants.get(tenant)
        found = h.entries.get(rid) if h is not None else None
        return found[1] if found is not None else None

    def delete(self, rid: str, tenant: str) -> bool:
        if self.get(rid, tenant) is None:
            return False
        self._remove(tenant, rid)
        return True

    def _remove(self, tenant: str, rid: str) -> None:
        h = self._tenants[tenant]
        _, entry = h.entries.pop(rid)
        h.nbytes -= entry.nbytes
        self._count -= 1
        self.nbytes -= entry.nbytes
        if not h.entries:
            del self._tenants[tenant]

    def _victims(self, tenant: str, rid: str, nbytes: int) -> list[tuple[str, str]] | None:
        """The (tenant, id) entries that `tenant`'s new entry `rid` of `nbytes` evicts, in order;
        None if the rule would evict the new entry itself. Planned on counts, nothing changed."""
        new = (next(self._order), rid, nbytes)          # stored after every entry now held
        held = {name: [len(h.entries), h.nbytes] for name, h in self._tenants.items()}
        mine = held.setdefault(tenant, [0, 0])
        mine[0] += 1
        mine[1] += nbytes
        queues = {}         # a tenant's entries from its oldest not yet planned out: (order, id, bytes)
        heads = {}

        def head(name):
            if name not in heads:
                if name not in queues:
                    own = self._tenants.get(name)
                    old = ((o, r, e.nbytes) for r, (o, e) in own.entries.items()) if own is not None else ()
                    queues[name] = itertools.chain(old, [new]) if name == tenant else iter(old)
                heads[name] = next(queues[name])
            return heads[name]

        victims: list[tuple[str, str]] = []
        total = [self._count + 1, self.nbytes + nbytes]

        def evict(name) -> bool:
            order, victim, size = head(name)
            if victim == rid and order == new[0]:
                return False
            del heads[name]
            victims.append((name, victim))
            for counts in (held[name], total):
                counts[0] -= 1
                counts[1] -= size
            if held[name][0] == 0:
                del held[name]
            return True

        while mine[0] > self.tenant_entries or mine[1] > self.tenant_bytes:    # never the new entry:
            evict(tenant)                                                   # it fits the quota alone
        for dim, bound in ((0, self.max_entries), (1, self.max_bytes)):
            while total[dim] > bound:
                name = max(held, key=lambda n: (held[n][dim], -head(n)[0]))
                if not evict(name):
                    return None
        return victims
