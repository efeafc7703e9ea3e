"""An island: its host actors (one per host, devices set before JAX loads), host 0 holding its scheduler.

Each island's hosts go into the island's placement group
(``resource_manager.nodes``): an island's hosts share a node, and islands
spread over the cluster's nodes unless the topology pins them. The scheduler
lives in host 0 (``resource_manager.host``): a message reaches the executor
of a one-host island in one actor call, and losing an island's node loses
its scheduler only with the island it schedules.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import ray

from pathways import auth
from pathways.topology import Topology
from resource_manager.host.actor import HEALTH, SCHEDULE, HostActor
from resource_manager.nodes import IslandPlacement, alive_nodes, reserve, user_labels


@dataclass
class Island:
    """An island's hosts as started (host 0 holds its scheduler); ``epoch`` counts its restarts."""

    index: int
    hosts: list[Any]
    host_info: list[dict]
    placement: IslandPlacement
    epoch: int = 0

    @property
    def scheduler(self) -> Any:
        """The actor that holds the island's scheduler: host 0."""
        return self.hosts[0]


# Large allocations on transparent huge pages (glibc >= 2.35; ignored by others): XLA's CPU buffers then
# fault in 2 MiB at a time, and a same-node receiver copying a lent shard pins 512x fewer pages, so the copy
# is faster. Only the main arena grows on huge pages: other arenas, and chunks that glibc maps one by one,
# mostly do not once freed memory is reused, so hosts use one arena (computations writing to huge pages run
# faster as well). The arena limit goes as MALLOC_ARENA_MAX because glibc drops it from GLIBC_TUNABLES
# before Ray's worker starts.
HUGE_PAGES = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "MALLOC_ARENA_MAX": "1"}


def host_runtime_env(topology: Topology) -> dict:
    """The ``runtime_env`` of an island's host actors: on CPU, the simulated device count (set before JAX loads)
    and the huge-page malloc settings; on GPU, the CUDA platform and, where the topology sets one (hosts that
    share a GPU), the share of its memory the host's XLA client takes."""
    if topology.platform == "gpu":
        env = {"JAX_PLATFORMS": topology.jax_platform}
        if topology.host_memory_fraction is not None:
            env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{topology.host_memory_fraction:.4g}"
        return {"env_vars": env}
    flags = f"--xla_force_host_platform_device_count={topology.devices_per_host}"
    tunables = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES"), HUGE_PAGES["GLIBC_TUNABLES"]) if t)
    arenas = os.environ.get("MALLOC_ARENA_MAX", HUGE_PAGES["MALLOC_ARENA_MAX"])
    return {"env_vars": {"XLA_FLAGS": flags, "JAX_PLATFORMS": topology.jax_platform, "GLIBC_TUNABLES": tunables,
                         "MALLOC_ARENA_MAX": arenas}}


def start_islands(topology: Topology, runtime_key: bytes, runtime_id: str, op_timeout: float, gap_timeout: float,
                  start_timeout: float) -> list[Island]:
    """Reserve every island's node and start all hosts in parallel (each island a jax.distributed group when
    it has several hosts); host 0 of each island holds its scheduler."""
    placements = reserve(topology, start_timeout)
    started = [_create(topology, p, 0, op_timeout, gap_timeout, runtime_key, runtime_id) for p in placements]
    infos = _start(topology, [(p.island, hosts) for p, hosts in zip(placements, started)], runtime_key, start_timeout)
    return [Island(p.island, hosts, info, p) for p, hosts, info in zip(placements, started, infos)]


def stop_island(island: Island) -> None:
    """Kill an island's hosts (what they held is gone with them)."""
    for host in island.hosts:
        try:
            ray.kill(host, no_restart=True)
        except Exception:  # already dead
            pass


def restart_island(topology: Topology, island: Island, runtime_key: bytes, runtime_id: str, op_timeout: float,
                   gap_timeout: float, timeout: float, epoch: int | None = None) -> Island:
    """New hosts for an island, in its placement group, with empty buffer tables: at a new epoch after a failure,
    or at ``epoch`` (the one it had) when a suspended cluster resumes."""
    stop_island(island)
    epoch = island.epoch + 1 if epoch is None else epoch
    hosts = _create(topology, island.placement, epoch, op_timeout, gap_timeout, runtime_key, runtime_id)
    try:
        (info,) = _start(topology, [(island.index, hosts)], runtime_key, timeout)
    except BaseException:
        for host in hosts:
            ray.kill(host, no_restart=True)
        raise
    return Island(island.index, hosts, info, island.placement, epoch)


def _create(topology: Topology, p: IslandPlacement, epoch: int, op_timeout: float, gap_timeout: float,
            runtime_key: bytes, runtime_id: str) -> list[Any]:
    n = topology.hosts_per_island
    actor = ray.remote(concurrency_groups={SCHEDULE: 1, HEALTH: 1})(HostActor)
    options = {"num_cpus": 0, "num_gpus": topology.gpus_per_host, "max_concurrency": 16,
               "runtime_env": host_runtime_env(topology)}
    return [actor.options(scheduling_strategy=p.strategy_for(h), **options).remote(
                p.island, h, n, epoch, op_timeout, gap_timeout, runtime_key, runtime_id)
            for h in range(n)]


def _start(topology: Topology, islands: list[tuple[int, list[Any]]], runtime_key: bytes,
           timeout: float) -> list[list[dict]]:
    """Start every host of these (island index, hosts) pairs; each call signed for the host it goes to."""
    n = topology.hosts_per_island
    coordinators = ray.get([hs[0].coordinator.remote(auth.sign(runtime_key, "coordinator", i, 0))
                            for i, hs in islands], timeout=timeout) if n > 1 else [None] * len(islands)
    starts = [[h.start.remote(auth.sign(runtime_key, "start", i, k, c or "", topology.islands, topology.platform),
                              c, topology.islands, topology.platform) for k, h in enumerate(hs)]
              for (i, hs), c in zip(islands, coordinators)]
    infos = [ray.get(s, timeout=timeout) for s in starts]
    nodes = alive_nodes()
    for info in infos:
        for host in info:
            host["node_labels"] = user_labels(host["node"], nodes)
    return infos
