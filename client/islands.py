"""The island table of a client session: what the client knows of each island and its connections there.

The resource manager says which islands exist, their hosts, their epoch (restart count) and health; this
client adds the links it opened to their hosts, the islands it saw fail, and which executables it has sent to
each. An island whose epoch grows restarted with new hosts: its links close and its executables must be sent
again. One lock guards the table; it sends nothing itself and tells its caller, by return value, what changed.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

from client.link import Link
from pathways.errors import IslandFailedError
from pathways.ops import Limits
from pathways.topology import Topology


@dataclass
class IslandClient:
    """What a client knows of one island: its index, its hosts (their client addresses), its epoch (restart
    count), and whether the resource manager says it is healthy."""

    index: int
    hosts: list[dict]
    epoch: int
    healthy: bool = True
    links: dict[int, Link] = field(default_factory=dict)


class Islands:
    """The islands as this client knows them; ``islands[k]`` is island ``k``'s ``IslandClient``.

    ``dead`` maps each island seen failed (and not restarted since) to why; ``sent_exes[k]`` names the
    executables island ``k``'s hosts already have.
    """

    def __init__(self, infos: list[dict]) -> None:
        self._lock = threading.Lock()
        self._islands = [IslandClient(i["index"], i["hosts"], i["epoch"], i["healthy"]) for i in infos]
        self.dead: dict[int, str] = {i["index"]: i["reason"] or "unhealthy" for i in infos if not i["healthy"]}
        self.sent_exes: list[set[str]] = [set() for _ in self._islands]

    def __getitem__(self, island: int) -> IslandClient:
        return self._islands[island]

    def __iter__(self) -> Iterator[IslandClient]:
        return iter(list(self._islands))

    def __len__(self) -> int:
        return len(self._islands)

    def restarted(self, info: dict) -> bool:
        """Take what the resource manager says of island ``info["index"]`` now; whether it restarted (its epoch
        grew: new hosts, and this client's buffers there are lost)."""
        with self._lock:
            island = self._islands[info["index"]]
            if info["epoch"] > island.epoch:
                self._renew(info)
                return True
            island.healthy = info["healthy"]
            return False

    def judge(self, info: dict, restarted: bool) -> None:
        """After ``restarted``: an island marked unhealthy is dead here too; a healthy one that restarted, or
        whose links all live, serves again."""
        k = info["index"]
        if info["healthy"] and (restarted or k in self.dead) and not self._links_broken(k):
            self.dead.pop(k, None)
        elif not info["healthy"]:
            self.dead.setdefault(k, info["reason"] or "unhealthy")

    def resumed(self, info: dict) -> bool:
        """A resumed cluster's island ``info``: forget the old hosts' links; whether it is the island this client
        had (same epoch, healthy), so that its messages resume where they stood. Else it is dead or new."""
        k = info["index"]
        with self._lock:
            old = self._islands[k]
            self._renew(info)
            self.dead.pop(k, None)
        if info["epoch"] != old.epoch or not info["healthy"]:
            if not info["healthy"]:
                self.dead[k] = info["reason"] or "unhealthy"
            return False
        return True

    def _renew(self, info: dict) -> None:
        """Island ``info["index"]`` has new hosts (under the lock): close the old links, forget what they had."""
        k = info["index"]
        for link in self._islands[k].links.values():
            link.close()
        self._islands[k] = IslandClient(k, info["hosts"], info["epoch"], info["healthy"])
        self.sent_exes[k] = set()  # the new hosts have none of the executables; sending one again costs little

    def _links_broken(self, island: int) -> bool:
        return any(not link.alive for link in self._islands[island].links.values())

    def live_link(self, island: int, host: int) -> Link | None:
        """The open connection to host ``host`` of ``island``, if there is one."""
        with self._lock:
            found = self._islands[island].links.get(host)
        return found if found is not None and found.alive else None

    def target(self, island: int, host: int) -> tuple[dict, int]:
        """Host ``host`` of ``island`` (its addresses) and the island's epoch, to connect to it."""
        with self._lock:
            isl = self._islands[island]
            return isl.hosts[host], isl.epoch

    def adopt(self, island: int, host: int, epoch: int, made: Link) -> Link:
        """Keep ``made``, a new link to ``host`` of ``island`` at ``epoch``; the link to use (another thread's,
        if it connected first). IslandFailedError, closing ``made``, if the island restarted meanwhile."""
        with self._lock:
            if self._islands[island].epoch != epoch:
                made.close()
                raise IslandFailedError(f"island {island} restarted while this client connected to it")
            old = self._islands[island].links.get(host)
            if old is not None and old.alive:
                made.close()
                return old
            self._islands[island].links[host] = made
        return made

    def limits(self, island: int, topology: Topology) -> Limits:
        """What a host of ``island`` can hold (from the resource manager): arrays larger are refused here."""
        hosts = self._islands[island].hosts
        return Limits(island, topology.islands, topology.hosts_per_island, topology.devices_per_host,
                      min(h["memory_bytes"] for h in hosts), min(h["device_bytes"] for h in hosts))

    def close(self) -> None:
        """Close every link to the islands' hosts."""
        with self._lock:
            links = [link for island in self._islands for link in island.links.values()]
        for link in links:
            link.close()
