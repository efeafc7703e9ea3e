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

from pathways.names import host_name
from pathways.topology import Topology
from resource_manager.host import SCHEDULE, Host
from resource_manager.nodes import IslandPlacement, alive_nodes, reserve, user_labels


@dataclass
class Island:
    index: int
    scheduler: Any  # host 0's handle, which serves the scheduler's methods
    hosts: list[Any]
    host_info: list[dict]
    placement: IslandPlacement


# Large allocations on transparent huge pages (glibc >= 2.35; ignored by others): XLA's CPU buffers then
# fault in 2 MiB at a time, and a same-node receiver copying a lent shard pins 512x fewer pages (64 MiB in
# 3.6 ms instead of 10 ms here). Only the main arena grows on huge pages: other arenas, and chunks that
# glibc maps one by one, mostly do not once freed memory is reused, so hosts use one arena (computations
# writing to huge pages run faster as well: 64 MiB times 2 in 3.8 ms instead of 6.3 ms). The arena limit
# goes as MALLOC_ARENA_MAX because glibc drops it from GLIBC_TUNABLES before Ray's worker starts.
HUGE_PAGES = {"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1", "MALLOC_ARENA_MAX": "1"}


def host_runtime_env(topology: Topology) -> dict:
    if topology.platform == "gpu":
        return {"env_vars": {"JAX_PLATFORMS": "cuda"}}
    flags = f"--xla_force_host_platform_device_count={topology.devices_per_host}"
    tunables = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES"), HUGE_PAGES["GLIBC_TUNABLES"]) if t)
    arenas = os.environ.get("MALLOC_ARENA_MAX", HUGE_PAGES["MALLOC_ARENA_MAX"])
    return {"env_vars": {"XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu", "GLIBC_TUNABLES": tunables,
                         "MALLOC_ARENA_MAX": arenas}}


def start_islands(topology: Topology, namespace: str, op_timeout: float, start_timeout: float,
                  network_secret: bytes | None = None) -> list[Island]:
    """Reserve every island's node, start all hosts in parallel (each island a jax.distributed group when
    it has several hosts); host 0 of each island holds its scheduler. ``network_secret``: what the hosts
    authenticate each other with on the network data path (none: that path stays off)."""
    placements = reserve(topology, start_timeout)
    n = topology.hosts_per_island
    gpus = topology.devices_per_host if topology.platform == "gpu" else 0
    actor = ray.remote(concurrency_groups={SCHEDULE: 1})(Host)
    options = {"num_cpus": 0, "num_gpus": gpus, "max_concurrency": 64, "namespace": namespace,
               "runtime_env": host_runtime_env(topology)}
    hosts = [[actor.options(name=host_name(p.island, h), scheduling_strategy=p.strategy_for(h), **options)
              .remote(p.island, h, n, namespace, op_timeout) for h in range(n)] for p in placements]
    coordinators = ray.get([hs[0].coordinator.remote() for hs in hosts], timeout=start_timeout) if n > 1 \
        else [None] * topology.islands
    starts = [[h.start.remote(c, network_secret) for h in hs] for hs, c in zip(hosts, coordinators)]
    infos = [ray.get(s, timeout=start_timeout) for s in starts]
    nodes = alive_nodes()
    islands = []
    for p, hs, info in zip(placements, hosts, infos):
        for host in info:
            host["node_labels"] = user_labels(host["node"], nodes)
        islands.append(Island(p.island, hs[0], hs, info, p))
    return islands
