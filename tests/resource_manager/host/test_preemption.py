"""What a busy machine takes from a run is not charged to its tenant (resource_manager/host/preemption.py): runs are
measured while other processes keep every core busy, and a run is never charged less than the CPU work it did."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from test_executor import Host, one

from pathways.messages import CLIENT_ID_BITS
from resource_manager.host import preemption
from resource_manager.host.preemption import Preemption

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/task"), reason="reads the kernel's per-thread times")


@contextmanager
def busy_machine() -> Iterator[None]:
    """More processes spinning than the machine has cores: whatever else runs is preempted in the middle."""
    procs = [subprocess.Popen([sys.executable, "-c", "while 1: pass"]) for _ in range((os.cpu_count() or 1) + 2)]
    try:
        time.sleep(0.2)  # they are running
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait(timeout=30)


def spin(cpu_s: float) -> None:
    """Use ``cpu_s`` seconds of this thread's CPU (however long that takes on a busy machine)."""
    end = time.thread_time() + cpu_s
    while time.thread_time() < end:
        pass


def measured(meter: Preemption, work) -> tuple[float, float]:
    """(wall seconds, seconds charged) of ``work`` run on this thread."""
    before = meter.sample()
    start = time.perf_counter()
    work()
    wall = time.perf_counter() - start
    return wall, meter.charge(before, wall)


@pytest.mark.parametrize("cpu_work", [True, False])
def test_a_run_preempted_by_other_processes_is_charged_the_cpu_it_used_not_the_wait(cpu_work):
    meter = Preemption(cpu_work)
    with busy_machine():
        wall, charged = measured(meter, lambda: spin(0.3))
    assert wall > 0.45, f"not preempted ({wall:.2f}s for 0.3s of CPU): the test proves nothing"
    assert 0.3 * 0.9 <= charged <= 0.3 * 1.3, (wall, charged)  # its CPU time, however long the others held it
    assert meter.uncharged_s == pytest.approx(wall - charged)


def test_a_run_that_waits_for_something_else_than_a_cpu_is_charged_its_wall_time():
    """Elsewhere than a one-host CPU island a run may wait for a GPU or a peer host with no CPU of its own: that
    is island time, and no wait in a run queue, so it stays charged; on a one-host CPU island nothing of the kind
    exists, and only its CPU counts."""
    meter = Preemption(cpu_work=False)
    wall, charged = measured(meter, lambda: time.sleep(0.2))
    # the sleep counted; a wait for a CPU on waking would not (a few ms on a loaded machine), and is all it left out
    assert wall >= 0.2 and meter.uncharged_s < 0.1 and charged >= 0.2 * 0.99 - meter.uncharged_s
    wall, charged = measured(Preemption(cpu_work=True), lambda: (time.sleep(0.2), spin(0.05)))
    assert 0.05 * 0.9 <= charged <= 0.05 * 1.5 and wall >= 0.25


def test_garbage_collection_is_no_tenants_work():
    """The interpreter collects garbage on whichever thread allocates past its threshold: a full collection of the
    host's heap in the middle of a run (or of admitting a batch) is the host's work, not the tenant's, and would
    put that tenant behind by tens of milliseconds. ``gc_cpu_s`` counts it per thread; a run is charged without it."""
    import gc

    meter = Preemption(cpu_work=True)
    heap = [[] for _ in range(2_000_000)]  # what a full collection has to walk
    try:
        before, gc_before, cpu = meter.sample(), preemption.gc_cpu_s(), time.thread_time()
        start = time.perf_counter()
        gc.collect()
        spin(0.02)
        wall = time.perf_counter() - start
        collected = preemption.gc_cpu_s() - gc_before
        assert collected > 0.02 and time.thread_time() - cpu >= collected  # counted, and CPU time of this thread
        assert meter.charge(before, wall) == pytest.approx(0.02, rel=0.5)  # the spin, not the collection
    finally:
        del heap


def test_a_run_that_saw_an_xla_thread_start_is_charged_its_wall_time_and_other_threads_change_nothing(monkeypatch):
    """A thread XLA starts may compute for the run while the meter does not read it yet: the run in which the meter
    saw one come is charged all of its wall time, and the next is measured with it. Threads of other names (Ray's
    come and go) leave the measurement as it is."""
    import threading

    def thread(name: str, started: threading.Event, done: threading.Event) -> None:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name)
        started.set()
        done.wait(30)

    monkeypatch.setattr(preemption, "CHECK_S", 0.0)  # count the threads at every run
    meter = Preemption(cpu_work=True)
    measured(meter, lambda: None)  # the meter has read the threads
    done, workers = threading.Event(), []
    try:
        for name, wall_charged in (("ray_worker_io", False), ("tf_compute", True)):
            before, started = meter.sample(), threading.Event()
            workers.append(threading.Thread(target=thread, args=(name, started, done)))
            workers[-1].start()
            assert started.wait(30)
            charged = meter.charge(before, 0.05)
            assert (charged == 0.05) is wall_charged, (name, charged)
            wall, charged = measured(meter, lambda: (time.sleep(0.05), spin(0.02)))
            assert wall >= 0.07 and charged == pytest.approx(0.02, rel=0.5)
    finally:
        done.set()
        for worker in workers:
            worker.join()


def test_the_executor_charges_a_computation_preempted_by_other_processes_its_cpu_time():
    """What a host reports to its island's scheduler for a computation that other processes kept waiting: the CPU
    time its threads used (never more than this process's, whatever the others did meanwhile), not the wall time
    it took."""
    import jax
    import jax.numpy as jnp

    host = Host()
    try:
        loop = host.function(lambda v: jax.lax.fori_loop(0, 300, lambda i, a: jnp.tanh(a @ a) * 0.5,
                                                         jnp.ones((256, 256)) * v[0])[0, :4], 1)  # ~0.1 s
        host.value(100, np.zeros(4, np.float32))
        base = 1 << CLIENT_ID_BITS

        def run(k: int) -> tuple[float, float, float]:
            """(wall seconds, this process's CPU seconds, the island seconds reported) of one computation."""
            start, cpu = time.perf_counter(), time.process_time()
            host.run(one(loop, "loop"), base + 2 * k, (100,))
            host.fetch(base + 2 * k + 1)
            deadline = time.monotonic() + 30
            while len([d for r in host.reports for d in r.done]) <= k and time.monotonic() < deadline:
                time.sleep(0.01)
            done = [d for r in host.reports for d in r.done][k]
            return time.perf_counter() - start, time.process_time() - cpu, done[1]

        run(0)  # compiles
        with busy_machine():
            wall, cpu, busy = run(1)
        assert busy <= cpu * 1.05, (wall, cpu, busy)  # CPU time, of this process's threads only
        assert busy < 0.9 * wall, (wall, cpu, busy)  # not the wall time, which the other processes stretched
        assert host.executor.stats()["uncharged_s"] > 0
    finally:
        host.executor.stop()
