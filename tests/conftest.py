"""The two tiers of the suite, and the embedded cluster the cluster tier shares.

A test is in the **cluster tier** (marker ``cluster``) when it needs a live Ray cluster: it uses the
``cluster`` fixture below (one embedded cluster, 2 islands x 1 host x 4 CPU devices, shared by the whole
session), directly or through another fixture, or its module starts its own cluster or client processes and
says so with ``pytestmark = pytest.mark.cluster``. Every other test is in the **unit tier**, which
``python -m pytest -m "not cluster"`` runs without Ray; a unit test that starts Ray fails.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time

# Tests sit in folders by the code they test; the modules they share and the scripts they run by path are in
# tests/support, importable from every folder.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "support"))
pytest_plugins = ("palm_fixtures",)
# The client needs no devices, but the pure-JAX model tests shard over 4: give this process 4 CPU devices
# before JAX loads (island hosts set their own through their runtime_env).
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
# The suite keeps its state, credentials and published addresses to itself: a developer's login or a runtime
# `pathways up` started on this machine is never the suite's, and the suite's never theirs.
_PRIVATE = tempfile.mkdtemp(prefix="pathways-tests-")
os.environ["PATHWAYS_HOME"] = os.path.join(_PRIVATE, "home")
os.environ["PATHWAYS_TMPDIR"] = os.path.join(_PRIVATE, "tmp")
for _name in ("PATHWAYS_ADDRESS", "PATHWAYS_TENANT", "PATHWAYS_CREDENTIAL", "RAY_ADDRESS"):
    os.environ.pop(_name, None)  # a Ray cluster named by RAY_ADDRESS would host the suite's runtime otherwise
# One JAX compilation cache for the whole run, made by the process that starts it and inherited by the workers, the
# island hosts of every cluster and the scripts tests start: the suite's clusters compile the same executables
# (PaLM's step, the RL policy, the MoE layer) again and again; each is compiled once (docs/performance.md has what
# that saves). A wrong executable would fail the bitwise comparisons. Tenants' jobs get none of it. Every executable
# is kept, however quickly it compiled: most of the suite's are small (a program's fragments, the tests' references),
# and each cluster's hosts, both islands of a cluster and the two workers compile the same ones again and again
# (reading one back costs a few ms; a module of session-cluster tests ran 15% faster on them).
_JAX_CACHE = None if "JAX_COMPILATION_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="pathways-tests-jax-")
if _JAX_CACHE is not None:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _JAX_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")

import numpy as np  # noqa: E402 - after the environment above is set
import psutil  # noqa: E402
import pytest  # noqa: E402

import pathways as pw  # noqa: E402

RAY_DAEMONS = ("raylet", "gcs_server")


def pytest_unconfigure(config):
    """Remove the folders this process made for the run (each worker its own state; the first process the cache)."""
    for folder in (_PRIVATE, _JAX_CACHE):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """Mark every test that needs the session's cluster (directly or through another fixture) as ``cluster``, and
    give the cluster tier its pytest-xdist groups (the suite runs ``-n 2 --dist loadgroup``, see pyproject.toml).
    One worker runs the ``serial`` group in order: the tests of the session's one embedded cluster, and those that
    make OS users or open folders to them (``os_users``: the machine's users and folder modes are one state for
    every process). The tests that start clusters of their own (``own_cluster``) are the ``own`` group, which the
    other worker runs beside it, with the rest of the unit tier."""
    for item in items:
        if "cluster" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.cluster)
        group = xdist_group(item)
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(group))


def xdist_group(item) -> str | None:
    """The pytest-xdist group a test runs in (None: any worker, beside anything). A test that says it starts its
    own cluster but also asks for the session's is in the serial group: it would start a second session cluster."""
    if item.get_closest_marker("own_cluster") is not None and "cluster" not in getattr(item, "fixturenames", ()):
        return "own"
    if item.get_closest_marker("cluster") is not None or item.get_closest_marker("os_users") is not None:
        return "serial"
    return None


@pytest.hookimpl(tryfirst=True)  # before the test's fixtures: the cluster, OS users
def pytest_runtest_setup(item):
    """On a pytest-xdist worker of ``--dist loadgroup``: a cluster-tier test that did not get its group would run
    beside the other worker's (each starting a session cluster of its own, both making and removing OS users):
    fail it instead."""
    group = xdist_group(item)
    if getattr(item.config.option, "loadgroup", False) and group is not None and not item.nodeid.endswith(f"@{group}"):
        pytest.fail(f"pytest-xdist did not put this cluster-tier test in its group ({group}) with pytest "
                    f"{pytest.__version__}: install the [test] extra's pytest (below 9.2), or run with -n 0",
                    pytrace=False)


def ray_daemons() -> list[str]:
    """The Ray daemons this process started (directly or through its children) that still run."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.name() in RAY_DAEMONS:
                out.append(f"{child.name()} (pid {child.pid})")
        except psutil.Error:  # gone meanwhile
            pass
    return out


@pytest.fixture(autouse=True)
def unit_tests_start_no_ray(request, monkeypatch):
    """A unit test (not marked ``cluster``) may not start a cluster: starting an embedded one raises, and a Ray
    daemon left running by the test fails it. When a cluster test already started one in this session, there
    is nothing to compare against, and the test runs as it is."""
    if request.node.get_closest_marker("cluster") is not None or ray_daemons():
        yield
        return
    name = request.node.nodeid

    def refuse(*args, **kwargs):
        raise RuntimeError(f"{name} is in the unit tier but starts a cluster: mark it pytest.mark.cluster")

    import client.runtime

    monkeypatch.setattr(client.runtime.Embedded, "__init__", refuse)
    yield
    started = ray_daemons()
    assert not started, f"{name} is in the unit tier but started Ray ({', '.join(started)}): mark it cluster"


@pytest.fixture
def restored_environ():
    """This process's environment as it was before the test: the CLI sets RAY_ADDRESS & co. in its own
    process, and in-process tests of it must not leak them to later tests."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def cluster():
    session = pw.init(topology=pw.Topology(islands=2, hosts_per_island=1, devices_per_host=4),
                      timeouts=pw.Timeouts(fetch=60.0, op=30.0, gap=5.0, grace=2.0))
    yield session
    pw.shutdown()


def lower_graph(graph):
    """Lower a traced program as the client does, to read its fragments' ops (the executables' bytes, which
    only travel with the fragments, are left empty)."""
    from client.lowering import lower
    from pathways.graph import Compute

    return lower(graph, {n.exe: b"" for n in graph.nodes if isinstance(n, Compute)})


def on_island(array) -> np.ndarray:
    """What ``array``'s island holds for it now: an identity computation reads the resident buffer, where a
    fetch of ``array`` itself may answer from the copy its handle already fetched."""
    return pw.jit(lambda v: v, slice=array.slice, in_specs=array.spec)(array).fetch(timeout=30)


def assert_spmd_checks(checks: dict) -> None:
    """What multihost_client.spmd computed on a 2-host island, against numpy: exact where data only moved,
    within float32 rounding where it was computed; slices placed and transfers routed host i to host i."""
    exact = ("roundtrip", "matching_transfer")
    close = ("spmd", "reshard_transfer", "single_host_slice", "within_island", "to_one_host")
    assert set(checks) == {"small_hosts", "wide_hosts", "routes", *exact, *close}, sorted(checks)
    assert checks["small_hosts"] in ([0], [1]) and checks["wide_hosts"] == [0, 1], checks
    for name in exact:
        np.testing.assert_array_equal(checks[name]["got"], checks[name]["want"], err_msg=name)
    for name in close:
        np.testing.assert_allclose(checks[name]["got"], checks[name]["want"], rtol=1e-5, atol=1e-8, err_msg=name)
    assert checks["routes"] == [[0, 0], [1, 1]]  # PaLM's host i -> host i


def host_stats(session, island: int, host: int = 0) -> dict:
    return session.host_stats(island, host)


def compile_cache_env() -> dict[str, str]:
    """The environment that gives a scenario's processes (its client, and the hosts of the cluster it starts, which
    inherit it) the run's JAX compilation cache, keeping every executable they compile: an island restarted after its
    host was killed compiles the executables its first hosts compiled, and reads them from there instead, and the
    scenario reads what the run's other clusters compiled before it (PaLM's tiny step, the RL policy), as they read
    what it compiled (what the restart proves is unchanged; a wrong executable would fail the bitwise comparisons)."""
    return {"JAX_COMPILATION_CACHE_DIR": os.environ["JAX_COMPILATION_CACHE_DIR"],
            "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"}


def await_line(proc, word: str, timeout: float) -> None:
    """Wait, at most ``timeout`` seconds, for a client process to print ``word`` on a line of its own (it is ready:
    started, attached, compiled); kill it and fail with what it printed otherwise."""
    seen: list[str] = []

    def read() -> None:
        for line in proc.stdout:
            seen.append(line)
            if line.strip() == word:
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout)
    if not seen or seen[-1].strip() != word:
        proc.kill()
        reader.join(10)
        pytest.fail(f"the client did not say {word} within {timeout:.0f}s:\n{''.join(seen)[-1000:]}\n"
                    f"{proc.stderr.read()[-3000:]}")


def tenant_env(tenant: str, weight: float = 1.0, quota: int | None = None) -> dict:
    """The environment of a client process acting as ``tenant`` on this session's cluster: the tenant is
    registered (or re-keyed) by this process, which started the runtime and so is its admin."""
    admin = pw.admin()
    if any(t["name"] == tenant for t in admin.tenants()):
        credential = admin.set_tenant(tenant, weight=weight, quota=quota, new_credential=True)
    else:
        credential = admin.add_tenant(tenant, weight=weight, quota=quota)
    return dict(os.environ, PATHWAYS_ADDRESS=pw.init().address, PATHWAYS_TENANT=tenant, PATHWAYS_CREDENTIAL=credential)


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


def raw_connection(session, island: int | None = None, host: int = 0, key: bytes | None = None,
                   client: int | None = None):
    """A bare protocol connection, as any process could open one: to host ``host`` of ``island`` (or, with
    ``island`` None, to the resource manager), proving ``client``'s session with ``key`` (default: this
    session's own; ``key`` b"" for an anonymous one)."""
    from pathways.protocol.connection import connect

    key = session._key if key is None else key
    client = session.client_id if client is None else client
    address = session.address if island is None else session.islands[island].hosts[host]["client"]
    return connect(address, client if key else 0, key or None, lambda identity: None, 1 << 30, 1 << 30)


def answer_to(conn, payload: bytes, data=()):
    """Send one request on a bare connection and read the endpoint's answer (skipping any data after it)."""
    from pathways import wire
    from pathways.requests import Answer

    conn.send(payload, data)
    frame = conn.recv()
    conn.skip(frame.data)
    return wire.parse(frame.payload, Answer)
