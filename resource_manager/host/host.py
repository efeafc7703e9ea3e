"""An island host's construction: a plain object that builds the host's parts and that Ray cannot call.

``HostActor`` (``actor``) is the only way Ray reaches it, for the runtime's own calls, each checked against
the runtime key; clients reach the host through its client endpoint (``clients``), after proving their
session. ``Host`` builds the parts (``wiring.build``), starts their background threads, and carries out the
resource manager's orders; it is on no data path. A client's batch goes ``clients -> order -> inbox -> executor
-> handlers`` and its completion comes back ``executor -> order`` (host 0 of each island holds the island's
admission and scheduler, in ``order``); what peers send goes from each transport straight to the receive side.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from pathways import wire
from pathways.budgets import Budgets
from pathways.errors import PathwaysError
from pathways.messages import (
    CONTROL,
    EndSession,
    Grant,
    IslandFailed,
    OpenSession,
    PeerTable,
    ReleaseTenant,
    Revoke,
    SetBudgets,
    SetWeight,
    client_of,
)
from resource_manager.host import wiring

MAINTENANCE_S = 0.5
log = logging.getLogger(__name__)


class Host:
    """Host ``index`` of island ``island`` (of ``n_hosts``), at restart ``epoch``.

    ``start`` brings up JAX (a jax.distributed group on a multi-host island) and the parts beneath the host
    (``wiring.build``), which reach the other hosts of the runtime through their actors, signed with the runtime
    key and bound to the receiving host.
    """

    def __init__(self, island: int, index: int, n_hosts: int, epoch: int, op_timeout: float,
                 gap_timeout: float) -> None:
        self.island, self.index, self.n_hosts, self.epoch = island, index, n_hosts, epoch
        self.op_timeout, self.gap_timeout = op_timeout, gap_timeout
        self.parts: wiring.Parts | None = None

    # -- start-up ---------------------------------------------------------------------------------------
    def start(self, runtime_key: bytes, runtime_id: str, coordinator: str | None, islands: int, platform: str,
              node: str, ip: str) -> dict:
        """Bring up JAX and the data plane; returns what the resource manager records of this host."""
        if self.parts is not None:
            raise PathwaysError("this host has already started")
        import jax

        if self.n_hosts > 1:
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(coordinator, num_processes=self.n_hosts, process_id=self.index,
                                       initialization_timeout=120)
        self.parts = p = wiring.build(self.island, self.index, self.n_hosts, self.epoch, self.op_timeout,
                                      self.gap_timeout, runtime_key, runtime_id, islands, platform, node, ip)
        threading.Thread(target=self._maintain, name="host-maintenance", daemon=True).start()
        if p.scheduler is not None:
            threading.Thread(target=self._release_held, name="host-held", daemon=True).start()
        channel, network = p.peers.transports.get("channel"), p.peers.transports.get("network")
        return {"island": self.island, "host": self.index, "pid": p.peers.pid, "ip": ip, "node": node,
                "devices": p.devices.describe(), "channel": channel.address if channel is not None else "",
                "data": network.address if network is not None else "", "client": p.clients.address,
                "memory_bytes": p.limits.memory_bytes, "device_bytes": p.limits.device_bytes}

    @staticmethod
    def coordinator(ip: str) -> str:
        """A free address for this island's jax.distributed coordinator (asked of host 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            return f"{ip}:{s.getsockname()[1]}"

    # -- the resource manager's orders --------------------------------------------------------------------
    def control(self, payload: bytes, handles: list | None) -> None:
        """An order of the resource manager (already verified): one handler per order class."""
        order = wire.parse(payload, *CONTROL)
        handler: dict[type, Callable[[Any], None]] = {
            OpenSession: self._open_session, EndSession: self._end_session, Grant: self._grant,
            Revoke: lambda o: self.parts.grants.revoke(o.keys), SetWeight: self._set_weight,
            SetBudgets: lambda o: self.parts.grants.set_budgets(o.tenant, Budgets.from_wire(o.budgets)),
            IslandFailed: self._island_failed, ReleaseTenant: lambda o: self.parts.table.free_tenant(o.tenant),
            PeerTable: lambda o: self._peers(o, handles or []),
        }
        handler[type(order)](order)

    def _open_session(self, order: OpenSession) -> None:
        self.parts.grants.add_session(order.client, order.tenant, order.key, Budgets.from_wire(order.budgets))
        if self.parts.scheduler is not None:
            self.parts.scheduler.set_weight(order.tenant, order.weight)

    def _set_weight(self, order: SetWeight) -> None:
        if self.parts.scheduler is not None:
            self.parts.scheduler.set_weight(order.tenant, order.weight)

    def _grant(self, order: Grant) -> None:
        self.parts.grants.grant(order.slice["key"], order.tenant, order.desc)

    def _island_failed(self, order: IslandFailed) -> None:
        p = self.parts
        p.peers.drop_island(order.island)
        p.receiver.island_failed(order.island)

    def _peers(self, order: PeerTable, handles: list) -> None:
        from resource_manager.host.transport.peers import PeerInfo

        infos = [PeerInfo(h["island"], h["host"], h["node"], h["pid"], h["channel"], h["data"], handle)
                 for h, handle in zip(order.hosts, handles)]
        for island in self.parts.peers.set_hosts(infos):
            self.parts.receiver.island_restored(island)

    def _end_session(self, order: EndSession) -> None:
        p = self.parts
        session = p.grants.remove_session(order.client)
        p.clients.close_session(order.client)
        p.uploads.drop_client(client_of, order.client)
        if session is None:
            return
        p.order.end_session(order.client, session.tenant, order.free)  # in the island's order, after its messages
        if session.tenant not in p.grants.tenants():  # its last session here: forget what it sent
            p.exes.drop_tenant(session.tenant)
            p.inbox.templates.forget(session.tenant)
            if p.admission is not None:
                p.admission.templates.forget(session.tenant)

    # -- background work ----------------------------------------------------------------------------------
    def _maintain(self) -> None:
        """Skip clients' stream gaps that never fill, drop uploads no put claimed, fail the host if its own order
        or executor stopped."""
        p = self.parts
        while p.executor.dead is None:
            time.sleep(MAINTENANCE_S)
            try:
                p.order.expire()
                p.uploads.expire()
                if p.inbox.stuck_for() > self.op_timeout:
                    p.executor.die(f"island {self.island} host {self.index} waited {self.op_timeout:.0f}s for "
                                   f"sequence {p.inbox.next_seq} from host 0; the island's order is broken")
            except Exception:  # the maintenance thread must outlive any one mistake
                log.exception("island %d host %d: maintenance failed", self.island, self.index)

    def _release_held(self) -> None:
        """Host 0: a throttled tenant's work goes out when its hold ends, even if nothing else happens on the island
        then (the scheduler's op_ms rule)."""
        p = self.parts
        while p.executor.dead is None:
            try:
                p.order.release_due(MAINTENANCE_S)
            except Exception:  # this thread must outlive any one mistake
                log.exception("island %d host %d: releasing held work failed", self.island, self.index)
                time.sleep(MAINTENANCE_S)

    # -- suspend and resume -----------------------------------------------------------------------------
    def save(self, directory: str) -> dict:
        """Write this host's part of a suspended cluster into ``directory`` (the host is quiet)."""
        from pathways.snapshot import Store
        from resource_manager.host import snapshot

        return snapshot.save(self.parts, Store(directory), self.island, self.index)

    def restore(self, directory: str, part: dict) -> dict:
        """Read this host's part of a suspended cluster back (the sessions it keeps are open already)."""
        from pathways.snapshot import Store
        from resource_manager.host import snapshot

        return snapshot.restore(self.parts, Store(directory), part, self.island, self.index)

    # -- probes of the data plane -------------------------------------------------------------------------
    def probe_direct(self, node: str, pid: int, addr: int, expected: bytes) -> str:
        """This host's channel address if it can copy lent shards out of runtime host ``pid`` (same node, and
        the kernel permits it), else ""."""
        from resource_manager.host.transport.direct import can_read

        p = self.parts
        channel = p.peers.transports.get("channel")
        ok = (channel is not None and node == p.node and p.peers.on_this_node(pid) is not None
              and can_read(pid, addr, expected))
        return channel.address if ok else ""

    def probe_network(self, island: int, host: int, nbytes: int) -> float:
        """Seconds to push ``nbytes`` raw bytes to a peer over one plain connection of the network path."""
        network = self.parts.peers.network
        if network is None:
            raise PathwaysError("this host runs no network data path")
        if not 0 < int(nbytes) <= 2**31:
            raise PathwaysError(f"a probe moves 1 byte to 2 GiB, not {nbytes}")
        return network.probe(int(island), int(host), int(nbytes))

    @property
    def dead(self) -> str | None:
        """Why this host can no longer run (its executor died), or None."""
        return self.parts.executor.dead if self.parts is not None else None
