"""The resource manager: a named, detached Ray actor that outlives clients, and the runtime's authority.

It starts the islands and keeps them serving: it checks every host's health,
and restarts a failed island's hosts (new actors, empty buffer tables, a new
epoch), saying in the cluster's state what was lost. It holds the tenant
registry, opens a session for each client that proves its tenant (a
credential the admin issued, or a job's one-time ticket), and tells the hosts
each session's key, tenant and weight, so that they believe no name, weight
or id a client's message carries. It places virtual slices within each
tenant's device quota and reclaims everything a client held once its process
is gone (its lease actor dies with it).

Every method answers a msgpack reply: the value, or the error as (kind,
message). A client's requests are signed with its session key; the admin's
carry the admin credential.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from pathways import auth, wire
from pathways.errors import PathwaysError, ResourceError, TenantAccessError, to_wire
from pathways.messages import CLIENT_ID_BITS
from pathways.topology import Topology
from resource_manager.island import Island, restart_island, start_islands
from resource_manager.placement import Allocation, Inventory, place
from resource_manager.registry import Registry, check_name, check_quota, check_weight

PING_TIMEOUT = 2.0
LEASE_PERIOD = 1.0
ISLAND_CHECK_S = 1.0
CENSUS_S = 1.0  # how often the buffers each tenant holds are counted (what a restart says was lost)
STRIKES = 3  # health checks in a row without an answer before a host counts as failed
RESTART_TIMEOUT = 120.0
RESTART_RETRY_S = 15.0
TICKET_TTL_S = 600.0
MAX_CLIENTS = (1 << (63 - CLIENT_ID_BITS)) - 1
log = logging.getLogger(__name__)


@dataclass
class Client:
    """An open client session: its tenant, session key, process id, lease actor, and the job it runs in."""

    tenant: str
    key: bytes
    pid: int
    lease: Any
    job: str
    since: float = field(default_factory=time.time)


@dataclass
class Ticket:
    """A job's single-use ticket, stored under its digest: the tenant it opens a session for, until ``expires``."""

    tenant: str
    job: str
    expires: float
    used: bool = False


def reply(fn):
    """Wrap a method so it answers a msgpack reply, with the error (if any) as (kind, message)."""

    def wrapper(self, *args: Any) -> bytes:
        try:
            with self._lock:
                value = fn(self, *args)
            return wire.encode("reply", {"ok": True, "value": value})
        except PathwaysError as exc:  # a bad request must never take the manager down
            return wire.encode("reply", {"ok": False, "value": list(to_wire(exc))})
        except Exception as exc:
            log.exception("resource manager: %s failed", fn.__name__)
            return wire.encode("reply", {"ok": False, "value": list(to_wire(exc))})

    wrapper.__name__ = fn.__name__
    wrapper.__doc__ = fn.__doc__
    return wrapper


class ResourceManager:
    """The runtime's authority: islands and their health, the tenant registry, sessions, slices, quotas.

    One detached, named actor per Ray cluster (``client.runtime.start_runtime`` creates it). It starts the
    islands, orders their hosts (sessions, grants, weights, the table of peers) with messages signed by
    the runtime key, and watches two things on threads of its own: clients' leases (a client whose
    process is gone is reclaimed) and hosts' health (a failed island is restarted with new hosts). Its
    public methods answer msgpack replies (see ``reply``); a client's are signed with its session key,
    the admin's carry the admin credential.
    """

    def __init__(self, topology: dict, op_timeout: float, gap_timeout: float, start_timeout: float,
                 admin_digest: str | None,
                 registry_path: str | None = None, implicit: dict | None = None,
                 default_quota: int | None = None) -> None:
        self.topology = Topology.from_wire(topology)
        self.op_timeout, self.gap_timeout = op_timeout, gap_timeout
        self.started = time.time()
        self._lock = threading.RLock()
        self._key = auth.new_key()  # the runtime key: known to this actor and its hosts only
        self.registry = Registry(registry_path, admin_digest, default_quota)
        if implicit is not None and self.registry.get(implicit["tenant"]) is None:
            self.registry.add(implicit["tenant"], 1.0, None, digest=implicit["digest"])
        self.islands: list[Island] = start_islands(self.topology, self._key, op_timeout, gap_timeout,
                                                     start_timeout)
        self.inventory = Inventory(self.topology)
        self.clients: dict[int, Client] = {}
        self.tickets: dict[str, Ticket] = {}
        self.reclaimed: list[dict] = []
        self.restarts: list[dict] = []
        self.refusals: list[dict] = []
        self._census: dict[int, dict[str, tuple[int, int]]] = {}
        self._strikes: dict[tuple[int, int], int] = {}
        self._restarting: set[int] = set()
        self._client_ids = itertools.count(1)
        self._slice_ids = itertools.count(1)
        self._order_all(self._peers_message())
        threading.Thread(target=self._watch_leases, name="lease-watch", daemon=True).start()
        threading.Thread(target=self._watch_islands, name="island-watch", daemon=True).start()

    # -- orders to hosts ----------------------------------------------------------------------------------
    def _order(self, hosts: list[Any], kind: str, body: dict, handles: list | None = None,
               wait: bool = True) -> None:
        payload = wire.encode(kind, body)
        mac = auth.sign(self._key, "control", payload)
        refs = [h.control.remote(payload, mac, handles) for h in hosts]
        if not wait:
            return
        for ref in refs:
            try:
                ray.get(ref, timeout=PING_TIMEOUT * 5)
            except Exception as exc:  # a dying host is the health check's to report
                log.warning("a host did not take %s: %s", kind, exc)

    def _healthy(self) -> list[Island]:
        return [i for i in self.islands if i.index not in self.inventory.unhealthy]

    def _order_all(self, order: tuple[str, dict, list | None]) -> None:
        kind, body, handles = order
        self._order([h for i in self._healthy() for h in i.hosts], kind, body, handles)

    def _peers_message(self) -> tuple[str, dict, list]:
        infos = [info for i in self.islands for info in i.host_info]
        hosts = [{"island": h["island"], "host": h["host"], "node": h["node"], "pid": h["pid"],
                  "channel": h["channel"], "data": h["data"]} for h in infos]
        return "peers", {"hosts": hosts}, [h for i in self.islands for h in i.hosts]

    # -- sessions -----------------------------------------------------------------------------------------
    def ready(self) -> bytes:
        """The runtime's topology (public): what a client checks before it opens a session."""
        return wire.encode("reply", {"ok": True, "value": {"topology": self.topology.to_wire(),
                                                           "started": self.started}})

    def open_session(self, payload: bytes, lease: Any = None) -> tuple[bytes, list]:
        """A new client session for the tenant a credential (or a job's ticket) proves: its id, its key, and
        the islands' hosts. Returns (reply, host handles per island)."""
        out = self._open(payload, lease)
        ok = wire.decode(out, "reply")["ok"]
        return out, [i.hosts for i in self.islands] if ok else []

    @reply
    def _open(self, payload: bytes, lease: Any) -> dict:
        msg = wire.decode(payload, "open")
        if msg.get("ticket"):
            tenant = self._redeem(msg["ticket"], msg.get("job") or "")
            record = self.registry.get(tenant)
            if record is None:
                raise TenantAccessError("the ticket's tenant no longer exists")
        else:
            record = self.registry.authenticate(msg["tenant"], msg.get("credential"))
        client = next(self._client_ids)
        if client > MAX_CLIENTS:
            raise ResourceError("this runtime has opened all the sessions it can; restart it")
        key = auth.new_key()
        self.clients[client] = Client(record.name, key, msg["pid"], lease, msg.get("job") or "")
        self._order_all(("session", {"client": client, "tenant": record.name, "key": key,
                                     "weight": record.weight}, None))
        return {"client": client, "key": key, "tenant": record.name, "weight": record.weight,
                "quota": record.quota, "topology": self.topology.to_wire(), "islands": self._islands_public()}

    def _redeem(self, ticket: str, job: str) -> str:
        record = self.tickets.get(auth.digest(ticket)) if isinstance(ticket, str) else None
        if record is None or record.expires < time.time():
            raise TenantAccessError("unknown or expired ticket; submit the job again with `pathways submit`")
        if record.used:
            self.refusals.append({"at": time.time(), "job": record.job, "by_job": job})
            log.warning("refused a second use of the ticket issued for job %s (presented by job %r)", record.job,
                        job)
            raise TenantAccessError(f"the ticket of job {record.job} was already used; a ticket opens one session")
        record.used = True
        return record.tenant

    def issue_ticket(self, payload: bytes) -> bytes:
        """A single-use ticket for one job of a tenant (whose credential the caller holds): the job exchanges
        it for a session, so the credential itself never travels through Ray's job API."""
        return self._issue_ticket(payload)

    @reply
    def _issue_ticket(self, payload: bytes) -> str:
        msg = wire.decode(payload, "ticket")
        record = self.registry.authenticate(msg["tenant"], msg["credential"])
        now = time.time()
        self.tickets = {d: t for d, t in self.tickets.items() if t.expires > now}  # a used one stays, to log reuse
        ticket = auth.new_secret()
        self.tickets[auth.digest(ticket)] = Ticket(record.name, msg["job"], now + TICKET_TTL_S)
        return ticket

    def whoami(self, payload: bytes) -> bytes:
        """Whether a tenant credential (or the admin credential) is valid: what the CLI checks before acting
        on a tenant's jobs."""
        return self._whoami(payload)

    @reply
    def _whoami(self, payload: bytes) -> dict:
        msg = wire.decode(payload, "ticket")
        if self.registry.is_admin(msg["credential"]):
            return {"admin": True, "tenant": None}
        return {"admin": False, "tenant": self.registry.authenticate(msg["tenant"], msg["credential"]).name}

    def request(self, client: int, payload: bytes, mac: bytes) -> bytes:
        """A client's request, signed with its session key: allocate, release, close, state, suspect."""
        return self._request(client, payload, mac)

    @reply
    def _request(self, client: int, payload: bytes, mac: bytes) -> Any:
        session = self.clients.get(client) if isinstance(client, int) else None
        if session is None or not auth.verify(session.key, mac, "rm", payload):
            raise TenantAccessError("the request is not signed by a session this runtime knows (closed, "
                                    "reclaimed, or never opened)")
        msg = wire.decode(payload, "allocate", "release", "close", "state", "suspect")
        kind = msg["kind"]
        if kind == "allocate":
            return self._allocate(client, session.tenant, msg)
        if kind == "release":
            return self._release(session.tenant, msg["slice"])
        if kind == "close":
            self._forget(client, free_buffers=False)
            return None
        if kind == "suspect":
            self._suspect(msg["island"], msg["reason"])
            return None
        return self._state(session.tenant)

    def hosts(self, client: int, mac: bytes) -> tuple[bytes, list]:
        """A reply with each island's epoch, and the islands' host handles (after a restart, clients take the
        new hosts from here)."""
        session = self.clients.get(client) if isinstance(client, int) else None
        if session is None or not auth.verify(session.key, mac, "hosts"):
            refusal = TenantAccessError("the request is not signed by a session this runtime knows")
            return wire.encode("reply", {"ok": False, "value": list(to_wire(refusal))}), []
        with self._lock:
            return (wire.encode("reply", {"ok": True, "value": [i.epoch for i in self.islands]}),
                    [i.hosts for i in self.islands])

    def _forget(self, client: int, free_buffers: bool, why: str = "closed") -> dict:
        info = self.clients.pop(client, None)
        keys = [k for k, a in self.inventory.allocations.items() if a.client == client]
        for key in keys:
            alloc = self.inventory.allocations.pop(key)
            self._order([self.islands[alloc.island].scheduler], "revoke", {"keys": [key]})
        for island in self._healthy():
            self._order(island.hosts, "end_session", {"client": client, "free": free_buffers}, wait=False)
        record = {"client": client, "tenant": info.tenant if info else None, "slices": keys, "why": why,
                  "at": time.time()}
        if info is not None and why != "closed":
            self.reclaimed.append(record)
            self.reclaimed = self.reclaimed[-100:]
        return record

    def _watch_leases(self) -> None:
        """Reclaim the slices and buffers of every client whose process is gone."""
        while True:
            time.sleep(LEASE_PERIOD)
            with self._lock:
                leases = {c: s.lease for c, s in self.clients.items() if s.lease is not None}
            pings = {c: lease.ping.remote() for c, lease in leases.items()}
            ray.wait(list(pings.values()), num_returns=len(pings), timeout=PING_TIMEOUT)
            for client, ref in pings.items():
                try:
                    ray.get(ref, timeout=0)
                except ray.exceptions.GetTimeoutError:
                    continue
                except Exception:  # the lease died with its client process
                    with self._lock:
                        if client in self.clients:
                            record = self._forget(client, free_buffers=True, why="its process ended")
                            log.warning("reclaimed client %s of tenant %s", client, record["tenant"])

    # -- slices -------------------------------------------------------------------------------------------
    def _allocate(self, client: int, tenant: str, msg: dict) -> dict:
        shape, axes = tuple(msg["shape"]), tuple(msg["axes"])
        island, devices = place(self.inventory, shape, axes, msg.get("island"))
        record = self.registry.get(tenant)
        quota = record.quota if record is not None else None
        held = sum(len(a.devices) for a in self.inventory.allocations.values() if a.tenant == tenant)
        if quota is not None and held + len(devices) > quota:
            raise ResourceError(f"tenant {tenant!r} asked for a slice of shape {shape} ({len(devices)} devices) "
                                f"but holds {held} of its quota of {quota} devices; release a slice first")
        alloc = Allocation(f"s{next(self._slice_ids)}", tenant, client, island, shape, axes, devices)
        self._order([self.islands[island].scheduler], "grant", {"slice": alloc.desc().to_wire(), "tenant": tenant})
        self.inventory.allocations[alloc.key] = alloc
        return alloc.to_wire()

    def _release(self, tenant: str, key: str) -> None:
        alloc = self.inventory.allocations.get(key)
        if alloc is None or alloc.tenant != tenant:
            raise ResourceError(f"you hold no slice {key!r}")
        del self.inventory.allocations[key]
        self._order([self.islands[alloc.island].scheduler], "revoke", {"keys": [key]}, wait=False)

    # -- island health ------------------------------------------------------------------------------------
    def _watch_islands(self) -> None:
        last_census = 0.0
        while True:
            time.sleep(ISLAND_CHECK_S)
            try:
                self._check_islands()
                if time.monotonic() - last_census > CENSUS_S:
                    last_census = time.monotonic()
                    self._take_census()
            except Exception:  # the watch must outlive any one mistake
                log.exception("resource manager: checking the islands failed")

    def _check_islands(self, only: int | None = None) -> None:
        with self._lock:
            islands = [i for i in self.islands if i.index not in self._restarting and (only is None or
                                                                                      i.index == only)]
        for island in islands:
            refs = [h.health.remote() for h in island.hosts]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=PING_TIMEOUT)
            reason = None
            for k, ref in enumerate(refs):
                if ref not in ready:
                    strikes = self._strikes[(island.index, k)] = self._strikes.get((island.index, k), 0) + 1
                    if strikes >= STRIKES:
                        reason = f"host {k} did not answer {STRIKES} health checks in a row"
                    continue
                self._strikes.pop((island.index, k), None)
                try:
                    health = ray.get(ref, timeout=0)
                except Exception as exc:  # the actor (or its node) is gone
                    reason = f"host {k} died ({type(exc).__name__})"
                    break
                if not health["ok"]:
                    reason = health["reason"]
                    break
            if reason is not None:
                self._island_failed(island, reason)

    def _suspect(self, island: int, reason: str) -> None:
        """A client saw an island fail: check it now (the client's word alone marks nothing)."""
        if not isinstance(island, int) or not 0 <= island < len(self.islands):
            raise ResourceError(f"no island {island!r}")
        threading.Thread(target=self._check_islands, args=(island,), daemon=True).start()

    def _take_census(self) -> None:
        """What each island holds per tenant, kept so a restart can say what was lost."""
        for island in self._healthy():
            mac = auth.sign(self._key, "census")
            refs = [h.census.remote(mac) for h in island.hosts]
            try:
                counts = ray.get(refs, timeout=PING_TIMEOUT)
            except Exception:  # the health check handles a host that does not answer
                continue
            total: dict[str, tuple[int, int]] = {}
            for by_tenant in counts:
                for tenant, (n, b) in by_tenant.items():
                    old = total.get(tenant, (0, 0))
                    total[tenant] = (old[0] + n, old[1] + b)
            self._census[island.index] = total

    def _island_failed(self, island: Island, reason: str) -> None:
        with self._lock:
            if island.index in self._restarting or self.islands[island.index] is not island:
                return
            self._restarting.add(island.index)
            self.inventory.unhealthy[island.index] = reason
            lost = self._census.pop(island.index, {})
        log.error("island %d failed: %s; restarting it", island.index, reason)
        for other in self._healthy():
            self._order(other.hosts, "island_failed", {"island": island.index}, wait=False)
        threading.Thread(target=self._restart, args=(island, reason, lost), name="island-restart", daemon=True).start()

    def _restart(self, island: Island, reason: str, lost: dict) -> None:
        while True:
            try:
                new = restart_island(self.topology, island, self._key, self.op_timeout, self.gap_timeout,
                                     RESTART_TIMEOUT)
                break
            except Exception as exc:  # no node for it yet: stay unhealthy, try again
                log.error("island %d could not restart: %s", island.index, exc)
                with self._lock:
                    self.inventory.unhealthy[island.index] = f"{reason}; restart failed, retrying: {exc}"
                time.sleep(RESTART_RETRY_S)
        with self._lock:
            self.islands[island.index] = new
            kind, body, handles = self._peers_message()  # every host, the new ones too, learns the new table
            self._order([h for i in self.islands if i.index not in self.inventory.unhealthy or i is new
                         for h in i.hosts], kind, body, handles)
            for client, s in self.clients.items():
                self._order(new.hosts, "session", {"client": client, "tenant": s.tenant, "key": s.key,
                                                   "weight": self._weight(s.tenant)})
            for alloc in self.inventory.allocations.values():
                if alloc.island == island.index:
                    self._order([new.scheduler], "grant", {"slice": alloc.desc().to_wire(), "tenant": alloc.tenant})
            self.inventory.unhealthy.pop(island.index, None)
            self._restarting.discard(island.index)
            self.restarts.append({"island": island.index, "epoch": new.epoch, "at": time.time(), "reason": reason,
                                  "lost": {t: list(v) for t, v in lost.items()}})
            self.restarts = self.restarts[-100:]
        log.warning("island %d restarted (epoch %d) after: %s", island.index, new.epoch, reason)

    def _weight(self, tenant: str) -> float:
        record = self.registry.get(tenant)
        return record.weight if record is not None else 1.0

    # -- the admin ----------------------------------------------------------------------------------------
    def admin(self, payload: bytes) -> bytes:
        """The cluster admin's operations (the admin credential rides in the request): tenants, quotas,
        weights, marking islands, reclaiming sessions, the whole state."""
        return self._admin(payload)

    @reply
    def _admin(self, payload: bytes) -> Any:
        msg = wire.decode(payload, "admin")
        if not self.registry.is_admin(msg["credential"]):
            raise TenantAccessError("this operation needs the cluster's admin credential (the file `pathways up` "
                                    "wrote, readable by its owner only)")
        op, args = msg["op"], msg["args"]
        if op == "tenants":
            return self._tenants()
        if op == "tenant_add":
            return {"credential": self.registry.add(check_name(args.get("name")), args.get("weight", 1.0),
                                                    check_quota(args.get("quota")))}
        if op == "tenant_set":
            quota = check_quota(args["quota"]) if "quota" in args else "keep"
            weight = check_weight(args["weight"]) if args.get("weight") is not None else None
            secret = self.registry.set(args.get("name"), weight, quota, bool(args.get("new_credential")))
            if weight is not None:
                for island in self._healthy():
                    self._order([island.scheduler], "weight", {"tenant": args["name"], "weight": weight})
            return {"credential": secret}
        if op == "tenant_remove":
            name = args.get("name")
            self.registry.remove(name)
            for client in [c for c, s in self.clients.items() if s.tenant == name]:
                self._forget(client, free_buffers=True, why="its tenant was removed")
            return None
        if op == "reclaim":
            clients = [c for c, s in self.clients.items() if s.tenant == args.get("tenant")
                       or c == args.get("client")]
            return [self._forget(c, free_buffers=True, why="reclaimed by the admin") for c in clients]
        if op == "mark":
            island = args.get("island")
            if not isinstance(island, int) or not 0 <= island < len(self.islands):
                raise ResourceError(f"no island {island!r}")
            if args.get("healthy"):
                self.inventory.unhealthy.pop(island, None)
            else:
                self.inventory.unhealthy[island] = str(args.get("reason") or "marked unhealthy by the admin")
            return None
        if op == "state":
            return self._state(None)
        if op == "schedule":
            mac = auth.sign(self._key, "tenant_schedule")
            return [ray.get(i.scheduler.tenant_schedule.remote(mac), timeout=PING_TIMEOUT * 5)
                    for i in self._healthy()]
        if op == "probe_network":
            (si, sh), (di, dh), nbytes = args["src"], args["dst"], args["nbytes"]
            mac = auth.sign(self._key, "probe_network", di, dh, nbytes)
            return ray.get(self.islands[si].hosts[sh].probe_network.remote(mac, di, dh, nbytes), timeout=600)
        if op == "usage":
            self._take_census()
            return {str(i): {t: list(v) for t, v in c.items()} for i, c in self._census.items()}
        raise ResourceError(f"unknown admin operation {op!r}")

    def admin_hosts(self, payload: bytes) -> tuple[bytes, list]:
        """A reply with each island's epoch, and the islands' host handles, for the admin's tools."""
        try:
            msg = wire.decode(payload, "admin")
            if not self.registry.is_admin(msg["credential"]):
                raise TenantAccessError("this operation needs the cluster's admin credential")
        except PathwaysError as exc:
            return wire.encode("reply", {"ok": False, "value": list(to_wire(exc))}), []
        with self._lock:
            return (wire.encode("reply", {"ok": True, "value": [i.epoch for i in self.islands]}),
                    [i.hosts for i in self.islands])

    def _tenants(self) -> list[dict]:
        out = []
        for t in self.registry.listing():
            t["clients"] = sum(1 for s in self.clients.values() if s.tenant == t["name"])
            t["devices"] = sum(len(a.devices) for a in self.inventory.allocations.values() if a.tenant == t["name"])
            out.append(t)
        return out

    # -- state --------------------------------------------------------------------------------------------
    def _islands_public(self) -> list[dict]:
        return [{"index": i.index, "epoch": i.epoch, "healthy": i.index not in self.inventory.unhealthy,
                 "reason": self.inventory.unhealthy.get(i.index, ""),
                 "hosts": [{k: h[k] for k in ("island", "host", "node", "ip", "devices", "node_labels",
                                              "memory_bytes", "device_bytes", "channel", "data")}
                           for h in i.host_info]}
                for i in self.islands]

    def _state(self, tenant: str | None) -> dict:
        """The cluster as ``tenant`` may see it (its own slices, clients and losses by name; others as counts),
        or whole for the admin (``tenant`` None)."""
        def mine(t: str | None) -> bool:
            return tenant is None or t == tenant

        allocs = [a for a in self.inventory.allocations.values() if mine(a.tenant)]
        others = [a for a in self.inventory.allocations.values() if not mine(a.tenant)]
        tenants = {t["name"]: t for t in self._tenants() if mine(t["name"])}
        restarts = [{**r, "lost": {t: v for t, v in r["lost"].items() if mine(t)}} for r in self.restarts]
        return {
            "topology": self.topology.to_wire(), "started": self.started, "islands": self._islands_public(),
            "allocations": [a.to_wire() for a in allocs],
            "others": {"slices": len(others), "devices": sum(len(a.devices) for a in others),
                       "tenants": len({a.tenant for a in others} | ({t for t in self.registry.tenants if not mine(t)}
                                                                     if tenant is not None else set()))},
            "clients": {str(c): {"tenant": s.tenant, "pid": s.pid, "since": s.since, "job": s.job}
                        for c, s in self.clients.items() if mine(s.tenant)},
            "tenants": tenants, "restarts": restarts[-20:],
            "reclaimed": [r for r in self.reclaimed if mine(r["tenant"])][-20:],
            "refusals": self.refusals[-20:] if tenant is None else [],
        }
