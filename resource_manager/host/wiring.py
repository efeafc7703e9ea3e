"""The one place a host's parts are made and wired together: the runtime's hosts and the tests use it alike.

``core`` builds the data plane that needs no Ray (buffer table, executable cache, uploads, receive side, op
handlers, executor, inbox, the island's order, and on host 0 admission and the scheduler); ``build`` adds what
a running host has around it: its devices and limits, its transports (the same-node channel, the network path,
Ray actor calls), the client endpoint and the metrics. Every part gets the narrow things it uses, never the
host: a client's call goes ``clients -> order -> inbox -> executor -> handlers`` and its completion comes back
``executor -> order``; what peers send goes ``transport -> receiver``.
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
from resource_manager.host.executor import Executor
from resource_manager.host.grants import Grants
from resource_manager.host.handlers import Handlers
from resource_manager.host.inbox import Inbox
from resource_manager.host.order import IslandOrder, Uplink
from resource_manager.host.receive import Receiver
from resource_manager.host.reports import Report
from resource_manager.host.scheduler import GROUP, Scheduler
from resource_manager.host.transport.peers import Peers
from resource_manager.host.uploads import Uploads
from resource_manager.host.views import HostViews


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
    order: IslandOrder
    events: EventLog
    views: HostViews | None = None
    scheduler: Scheduler | None = None
    admission: Admission | None = None
    node: str = ""
    clients: Any = None
    metrics: Any = None


def core(island: int, index: int, n_hosts: int, limits: Limits, devices: LocalDevices, peers: Peers,
         op_timeout: float, gap_timeout: float, report: Callable[[Report], None] | None = None,
         grants: Grants | None = None, events: EventLog | None = None, uplink: Uplink | None = None,
         epoch: int = 0) -> Parts:
    """The data plane of host ``index`` of ``island``: its executor reports to the island's order (to ``report``
    instead when given: a test's), which reaches the island's other hosts through ``uplink``."""
    grants = grants or Grants()
    events = events or EventLog()
    table = BufferTable()
    pool = BufferPool()
    exes = ExecutableCache(limits, lambda tenant: grants.budgets(tenant).executable_bytes)
    scheduler = admission = None
    if index == 0:
        scheduler = Scheduler(island, n_hosts, op_cap_ms=lambda tenant: grants.budgets(tenant).op_ms, group=GROUP)
        admission = Admission(limits, grants, exes, gap_timeout)
    order = IslandOrder(island, index, n_hosts, scheduler, admission, uplink)
    wake: list[Callable[[], None]] = []

    def touch() -> None:
        wake[0]()

    uploads = Uploads(2 * op_timeout, touch)
    receiver = Receiver(island, index, table, pool, peers, op_timeout, touch, grants.owner)
    handlers = Handlers(island, index, devices, table, exes, peers, pool, receiver, uploads, events, op_timeout,
                        grants.budgets)
    executor = Executor(island, index, n_hosts > 1, handlers, receiver, table, op_timeout, events,
                        report or order.report)
    wake.append(executor.touch)
    inbox = Inbox(island, index, executor, table, exes, TemplateCache(check=lambda t: t.check(limits)))
    order.feed(inbox)
    parts = Parts(limits, devices, grants, table, pool, exes, uploads, peers, receiver, handlers, executor,
                  inbox, order, events, scheduler=scheduler, admission=admission)
    parts.views = HostViews(island, index, epoch, parts)
    return parts


def build(island: int, index: int, n_hosts: int, epoch: int, op_timeout: float, gap_timeout: float,
          runtime_key: bytes, runtime_id: str, islands: int, platform: str, node: str, ip: str) -> Parts:
    """Every part of host ``index`` of ``island`` (of ``n_hosts``, at restart ``epoch``), on this process's
    devices."""
    from pathways.protocol.handshake import Identity
    from resource_manager.host.clients import ClientService
    from resource_manager.host.memory import host_budget
    from resource_manager.host.metrics import HostMetrics
    from resource_manager.host.transport.channel import open_channel
    from resource_manager.host.transport.network.path import landing_alloc, open_network_path
    from resource_manager.host.transport.ray import RayTransport, RayUplink

    devices = LocalDevices(index)
    memory, per_device = host_budget(platform, devices.local)
    limits = Limits(island, islands, n_hosts, len(devices.local), memory, per_device)
    peers = Peers(island, index, node)
    parts = core(island, index, n_hosts, limits, devices, peers, op_timeout, gap_timeout,
                 uplink=RayUplink(runtime_key, island, n_hosts, peers), epoch=epoch)
    parts.node = node
    receiver = parts.receiver
    peers.use(open_channel(runtime_key, node, peers, peers, receiver),
              open_network_path((island, index), node, ip, runtime_key, landing_alloc(parts.pool.take), receiver,
                                peers.directory, stale_s=op_timeout),
              RayTransport(runtime_key, peers, receiver))
    identity = Identity(runtime_id, "host", island, index, epoch)
    parts.clients = ClientService(parts.order, parts.views, parts, identity, ip)
    parts.metrics = HostMetrics(island, index, parts.views.stats)
    return parts
