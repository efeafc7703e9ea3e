"""What the resource manager has granted an island: client sessions (tenant, key, budgets) and slices.

Hosts never believe a tenant, weight, budget or slice that a client's message names: they learn them here,
from the resource manager (whose orders are signed with the runtime key), and a client's connection is
attributed to the session whose key it proved in its handshake.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from pathways.budgets import Budgets
from pathways.messages import client_of
from pathways.ops import SliceDesc

DEFAULT_BUDGETS = Budgets()


@dataclass(frozen=True)
class Session:
    """A client session as the resource manager announced it: client id, tenant, and session key."""

    client: int
    tenant: str
    key: bytes


class Grants:
    """Sessions by client id, each tenant's budgets, and slices by key; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._sessions: dict[int, Session] = {}
        self._budgets: dict[str, Budgets] = {}
        self._slices: dict[str, tuple[str, SliceDesc]] = {}
        self.version = 0  # grows with every change of the slices, so a check of them can be remembered

    def add_session(self, client: int, tenant: str, key: bytes, budgets: Budgets | None = None) -> None:
        """Accept connections proven with ``key`` as client ``client`` of ``tenant`` (whose budgets these are)."""
        with self._lock:
            self._sessions[client] = Session(client, tenant, key)
            if budgets is not None:
                self._budgets[tenant] = budgets

    def remove_session(self, client: int) -> Session | None:
        """Forget a client's session; returns it (None if it was unknown)."""
        with self._lock:
            return self._sessions.pop(client, None)

    def session(self, client: int) -> Session | None:
        """The session of client ``client``, or None."""
        return self._sessions.get(client)

    def set_budgets(self, tenant: str, budgets: Budgets) -> None:
        """The admin changed ``tenant``'s budgets."""
        with self._lock:
            self._budgets[tenant] = budgets

    def budgets(self, tenant: str) -> Budgets:
        """``tenant``'s budgets on this host: the one place a host looks them up (the defaults until told)."""
        return self._budgets.get(tenant) or DEFAULT_BUDGETS

    def owner(self, buffer_id: int) -> tuple[str, Budgets] | None:
        """The tenant whose session minted ``buffer_id``, with its budgets; None when no session here did."""
        session = self._sessions.get(client_of(buffer_id))
        return None if session is None else (session.tenant, self.budgets(session.tenant))

    def grant(self, key: str, tenant: str, desc: SliceDesc) -> None:
        """``tenant`` holds slice ``key`` on the devices ``desc`` names."""
        with self._lock:
            self._slices[key] = (tenant, desc)
            self.version += 1

    def revoke(self, keys: list[str]) -> None:
        """The slices ``keys`` are released: programs and puts on them are refused from now on."""
        with self._lock:
            for key in keys:
                self._slices.pop(key, None)
            self.version += 1

    def owns(self, tenant: str, desc: SliceDesc) -> bool:
        """Whether ``tenant`` holds slice ``desc.key`` on exactly these devices."""
        held = self._slices.get(desc.key)
        return held is not None and held[0] == tenant and held[1].devices == desc.devices

    def tenants(self) -> set[str]:
        """The tenants with at least one open session."""
        with self._lock:
            return {s.tenant for s in self._sessions.values()}
