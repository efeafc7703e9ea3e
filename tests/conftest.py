"""One embedded cluster (2 islands x 1 host x 4 CPU devices) shared by the whole test session."""

from __future__ import annotations

import os
import time

# The client needs no devices, but the pure-JAX model tests shard over 4: give this process 4 CPU devices
# before JAX loads (island hosts set their own through their runtime_env).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")

import pytest
import ray

import pathways as pw


@pytest.fixture(scope="session")
def cluster():
    session = pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=4),
                      timeouts=pw.Timeouts(fetch=60.0, op=30.0, gap=5.0))
    yield session
    pw.shutdown()


def host_stats(session, island: int, host: int = 0) -> dict:
    return ray.get(session.islands[island].hosts[host].stats.remote(), timeout=30)


def tenant_env(tenant: str, weight: float = 1.0, quota: int | None = None) -> dict:
    """The environment of a client process acting as ``tenant`` on this session's cluster: the tenant is
    registered (or re-keyed) by this process, which started the runtime and so is its admin."""
    admin = pw.admin()
    if any(t["name"] == tenant for t in admin.tenants()):
        credential = admin.set_tenant(tenant, weight=weight, quota=quota, new_credential=True)
    else:
        credential = admin.add_tenant(tenant, weight=weight, quota=quota)
    return dict(os.environ, RAY_ADDRESS=ray.get_runtime_context().gcs_address, PATHWAYS_TENANT=tenant,
                PATHWAYS_CREDENTIAL=credential)


def settle(session, islands=(0, 1), expect=None, timeout: float = 10.0) -> list[int]:
    """Buffer counts per island once the batched frees have landed: until they equal ``expect``, or without
    one, until two readings in a row agree (frees still on their way would make a first reading too high)."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        session.frees.flush()
        time.sleep(0.2)
        counts = [host_stats(session, i)["buffers"] for i in islands]
        if counts == list(expect if expect is not None else last or []) or time.monotonic() > deadline:
            return counts
        last = counts
