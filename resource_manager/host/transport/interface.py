"""The one interface every way of moving shards between hosts implements, and what the receive side offers them.

A ``Transport`` carries a delivery (a ``pathways.messages.Deliver`` and its arrays) to one peer host, or says it
cannot (``PASSED``), and carries leases of lent shards back to the host that lent them. ``peers.Peers`` tries its
transports in the order of one table (``peers.ROUTE``); the first that carries a delivery wins. Every transport
hands what it receives to the receive side through ``Inbound.deliver`` (one typed delivery: the message, its
pieces, and the sender the transport authenticated), and leases that come back to the sender's ``LeasePool``.
No transport knows the host that owns it.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from pathways.messages import Deliver

Peer = tuple[int, int]  # (island, host)


class Sent(enum.Enum):
    """What a transport did with a delivery."""

    PASSED = 0  # not carried: the next transport of the route takes it
    SENT = 1  # carried, its arrays copied or streamed (the sender may reuse them at once)
    LENT = 2  # carried, its arrays lent: they stay alive here until their lease comes back


class Inbound(Protocol):
    """The receive side, as a transport sees it: one way in."""

    def deliver(self, msg: Deliver, pieces: Sequence[Any], sender: Peer) -> None:
        """File ``pieces`` (arrays, or ``direct.Lent`` shards) that ``sender`` sent for receive ``msg.key``."""


class LeasePool(Protocol):
    """The sender's side of lent shards, as a transport sees it: arrays kept alive under a lease until it comes back."""

    def keep(self, arrays: list[np.ndarray], island: int) -> int:
        """Keep ``arrays`` alive for a reader on ``island``; the lease that names them."""

    def release(self, leases: Sequence[int]) -> None:
        """Let go of the arrays lent under ``leases``."""


class Transport(ABC):
    """One way to reach peer hosts. ``name`` is its key in the route table."""

    name: str

    @abstractmethod
    def send(self, peer: Peer, msg: Deliver, arrays: list[np.ndarray], timeout: float) -> Sent:
        """Carry ``msg`` and its ``arrays`` to ``peer``, or say ``PASSED`` (this transport does not reach it now)."""

    def give_back(self, peer: Peer, reply: str, leases: list[int]) -> bool:
        """Return ``leases`` to ``peer``, which lent them (``reply``: where it takes them on this transport, "" for
        none); False: this transport cannot, the next one of the route tries."""
        return False

    def stats(self) -> dict:
        """This transport's counters (no tenant named)."""
        return {}

    @abstractmethod
    def close(self) -> None:
        """Stop serving and let go of connections."""
