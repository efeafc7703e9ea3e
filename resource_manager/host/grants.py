"""What the resource manager has granted an island: client sessions (tenant and key) and slices.

Hosts never believe a tenant, weight or slice that a client's message names:
they learn them here, from the resource manager (whose own messages are signed
with the runtime key), and a client's message is attributed to the session
whose key signed it.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pathways import auth
from pathways.budgets import Budgets
from pathways.errors import TenantAccessError
from pathways.ops import SliceDesc

REFUSED = "the message is not signed by a session this island knows (closed, reclaimed, or never opened)"
DEFAULT_BUDGETS = Budgets()


@dataclass(frozen=True)
class Session:
    """A client session as the resource manager announced it: client id, tenant, and session key."""

    client: int
    tenant: str
    key: bytes


class Grants:
    """Sessions by client id and slices by key; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[int, Session] = {}
        self._slices: dict[str, tuple[str, SliceDesc]] = {}

    def add_session(self, client: int, tenant: str, key: bytes) -> None:
        """Accept messages signed with ``key`` as client ``client`` of ``tenant``."""
        with self._lock:
            self._sessions[client] = Session(client, tenant, key)

    def remove_session(self, client: int) -> Session | None:
        """Forget a client's session; returns it (None if it was unknown)."""
        with self._lock:
            return self._sessions.pop(client, None)

    def session(self, client: int) -> Session | None:
        """The session of client ``client``, or None."""
        return self._sessions.get(client)

    def budgets(self, tenant: str) -> Budgets:
        """``tenant``'s budgets on this island: the one place a host looks them up. Until the resource manager
        tells hosts each tenant's own with its sessions, every tenant has the defaults."""
        return DEFAULT_BUDGETS

    def verify(self, client: int, mac: bytes, purpose: str, *parts: bytes | str | int) -> Session:
        """The session whose key signed these parts; TenantAccessError (naming nobody) otherwise."""
        session = self._sessions.get(client) if isinstance(client, int) else None
        if session is None or not auth.verify(session.key, mac, purpose, *parts):
            raise TenantAccessError(REFUSED)
        return session

    def grant(self, key: str, tenant: str, desc: SliceDesc) -> None:
        """``tenant`` holds slice ``key`` on the devices ``desc`` names."""
        with self._lock:
            self._slices[key] = (tenant, desc)

    def revoke(self, keys: list[str]) -> None:
        """The slices ``keys`` are released: programs and puts on them are refused from now on."""
        with self._lock:
            for key in keys:
                self._slices.pop(key, None)

    def owns(self, tenant: str, desc: SliceDesc) -> bool:
        """Whether ``tenant`` holds slice ``desc.key`` on exactly these devices."""
        held = self._slices.get(desc.key)
        return held is not None and held[0] == tenant and held[1].devices == desc.devices

    def tenants(self) -> set[str]:
        """The tenants with at least one open session."""
        with self._lock:
            return {s.tenant for s in self._sessions.values()}
