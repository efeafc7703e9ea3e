"""An island's scheduler: one total order over every client's fragments, handed to every host.

It is a plain (single-threaded) Ray actor, so messages from one client keep
their order; it validates each message, stamps it with the next sequence
number, and forwards it to all hosts of the island without waiting. Hosts
admit messages strictly by that number, so collectives launched by two
clients on the same hosts can never interleave differently on two hosts.
"""

from __future__ import annotations

from typing import Any

from pathways import wire

TEMPLATE_CACHE = 256


class Scheduler:
    def __init__(self, island: int, hosts: list[Any]) -> None:
        self.island = island
        self._hosts = hosts
        self._seq = 0
        self._templates: dict[bytes, None] = {}
        self._by_tenant: dict[str, int] = {}

    def submit(self, payload: bytes, refs: list | None = None) -> int:
        """Order one message (fragment call, put or free); returns its sequence number."""
        msg = wire.decode(payload, "call", "put", "free")
        if msg["kind"] == "call" and msg["template"] not in self._templates:
            wire.decode(msg["template"], "template")
            if len(self._templates) >= TEMPLATE_CACHE:
                self._templates.pop(next(iter(self._templates)))
            self._templates[msg["template"]] = None
        seq = self._seq
        self._seq += 1
        tenant = msg["tenant"]
        self._by_tenant[tenant] = self._by_tenant.get(tenant, 0) + 1
        for host in self._hosts:
            host.enqueue.remote(seq, payload, refs)
        return seq

    def warm(self) -> None:
        """Resolve the host handles once, so the first real message is not delayed."""
        import ray

        ray.get([h.ping.remote() for h in self._hosts])

    def stats(self) -> dict:
        return {"island": self.island, "sequenced": self._seq, "by_tenant": dict(self._by_tenant)}
