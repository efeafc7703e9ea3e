"""The one place a host's parts are made and wired together: the runtime's hosts and the tests use it alike.

``core`` builds the data plane that needs no Ray (buffer table, executable cache, uploads, receive side, op
handlers, executor, inbox, and on host 0 admission and the scheduler); ``build`` adds what a running host
has around it: its devices and limits, the same-node channel, the network path, the client endpoint and the
metrics.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pathways.events import EventLog
from pathways.ops import Limits, TemplateCache
from resource_manager.host.admission import Admission
from resource_manager.host.buffer_pool import BufferPool
from resource_manager.host.buffers import BufferTable
from resource_manager.host.devices import LocalDevices
from resource_manager.host.executables import ExecutableCache
from resource_manager.host.executor import Executor, Report
from resource_manager.host.grants import Grants
from resource_manager.host.handlers import Handlers
from resource_manager.host.inbox import Inbox
from resource_manager.host.receive import Receiver
from resource_manager.host.scheduler import GROUP, Scheduler
from resource_manager.host.transport.peers import Peers
from resource_manager.host.uploads import Uploads


@dataclass
class Parts:
    """Everything one host is made of (``scheduler`` and ``admission`` on host 0 only)."""

    limits: Limits
    devices: LocalDevices
    grants: Grants
    table: BufferTable
    pool: BufferPool
    exes: ExecutableCache
    uploads: Uploads
    peers: Peers
    receiver: Receiver
    handlers: Handlers
    executor: Executor
    inbox: Inbox
    events: EventLog
    scheduler: Scheduler | None = None
    admission: Admission | None = None
    node: str = ""
    channel: Any = None
    network: Any = None
    clients: Any = None
    metrics: Any = None

    def touch(self) -> None:
        """Something the executor may wait for changed: wake it."""
        self.executor.touch()


def core(island: int, index: int, n_hosts: int, limits: Limits, devices: LocalDevices, peers: Peers,
         op_timeout: float, gap_timeout: float, report: Callable[[Report], None], grants: Grants | None = None,
         events: EventLog | None = None) -> Parts:
    """The data plane of host ``index`` of ``island``: reports of its executor go to ``report``."""
    grants = grants or Grants()
    events = events or EventLog()
    table = BufferTable()
    pool = BufferPool()
    exes = ExecutableCache(limits, lambda tenant: grants.budgets(tenant).executable_bytes)
    holder: list[Parts] = []

    def touch() -> None:
        holder[0].touch()

    uploads = Uploads(2 * op_timeout, touch)
    receiver = Receiver(island, index, table, pool, peers, op_timeout, touch, grants.owner)
    handlers = Handlers(island, index, devices, table, exes, peers, pool, receiver, uploads, events, op_timeout,
                        grants.budgets)
    executor = Executor(island, index, n_hosts > 1, handlers, receiver, table, op_timeout, events, report)
    inbox = Inbox(island, index, executor, table, exes, TemplateCache(check=lambda t: t.check(limits)))
    parts = Parts(limits, devices, grants, table, pool, exes, uploads, peers, receiver, handlers, executor,
                  inbox, events)
    if index == 0:
        parts.scheduler = Scheduler(island, n_hosts, op_cap_ms=lambda tenant: grants.budgets(tenant).op_ms,
                                    group=GROUP)
        parts.admission = Admission(limits, grants, exes, gap_timeout)
    holder.append(parts)
    return parts


def build(host: Any, runtime_key: bytes, runtime_id: str, islands: int, platform: str, node: str, ip: str) -> Parts:
    """Every part of a running ``host`` (a ``resource_manager.host.host.Host``), on this process's devices."""
    from pathways.protocol.handshake import Identity
    from resource_manager.host.clients import ClientService
    from resource_manager.host.memory import host_budget
    from resource_manager.host.metrics import HostMetrics
    from resource_manager.host.transport.channel import open_channel
    from resource_manager.host.transport.network.path import landing_alloc, open_network_path

    devices = LocalDevices(host.index)
    memory, per_device = host_budget(platform, devices.local)
    limits = Limits(host.island, islands, host.n_hosts, len(devices.local), memory, per_device)
    channel = open_channel(host.on_frame, host.allowed_peer)
    peers = Peers(host.island, host.index, node, channel, runtime_key)
    parts = core(host.island, host.index, host.n_hosts, limits, devices, peers, host.op_timeout, host.gap_timeout,
                 host.on_report)
    parts.node, parts.channel = node, channel
    parts.network = open_network_path((host.island, host.index), node, ip, runtime_key, landing_alloc(parts.pool.take),
                                      host.on_network_piece, peers.directory, stale_s=host.op_timeout)
    peers.network = parts.network
    identity = Identity(runtime_id, "host", host.island, host.index, host.epoch)
    parts.clients = ClientService(host, parts, identity, ip)
    parts.metrics = HostMetrics(host.island, host.index, host.stats)
    return parts
