"""The host's buffer table (resource_manager/buffers.py): waiting for a buffer, frees deferred until the last
pending use, refused id ranges, a dead host, and bytes and peaks per tenant."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import pathways as pw
from resource_manager.host.buffers import BufferTable, Failure


def test_a_wait_returns_the_buffer_once_it_is_written():
    table = BufferTable()
    threading.Timer(0.1, table.put, args=(7, "a", np.ones(3))).start()
    start = time.monotonic()
    entry = table.wait(7, "a", timeout=10.0)
    assert entry is not None and entry.value.sum() == 3
    assert time.monotonic() - start < 5.0


def test_a_wait_times_out_on_other_writes_and_leaves_no_waiter():
    table = BufferTable()
    writer = threading.Thread(target=lambda: [table.put(i, "a", np.zeros(i)) for i in range(100)])
    writer.start()
    assert table.wait(1000, "a", timeout=0.3) is None
    writer.join()
    assert table._waiters == {}, "a timed-out wait must not stay registered"
    table.put(1000, "a", np.full(2, 5.0))
    assert table.wait(1000, "a", timeout=0.0).value[0] == 5.0


def test_a_wait_refuses_another_tenants_buffer():
    table = BufferTable()
    threading.Timer(0.05, table.put, args=(3, "owner", np.zeros(1))).start()
    with pytest.raises(pw.TenantAccessError, match="not owned by tenant 'thief'"):
        table.wait(3, "thief", timeout=10.0)


# -- uses and frees ------------------------------------------------------------------------------------------

def table_with(*entries: tuple[int, str, int]) -> BufferTable:
    """A table holding (id, tenant, bytes) entries."""
    table = BufferTable()
    for buffer_id, tenant, nbytes in entries:
        table.put(buffer_id, tenant, np.zeros(nbytes, np.uint8))
    return table


def test_a_free_while_an_op_still_uses_the_buffer_waits_for_the_last_use():
    table = table_with((1, "a", 8))
    table.add_uses([1, 1])  # two pending ops read it
    table.free([1], "a")
    assert 1 in table
    table.done_using([1])
    assert 1 in table and table.used_elsewhere(1) is False
    table.done_using([1])
    assert 1 not in table and table.nbytes == 0


def test_a_buffer_without_pending_uses_is_freed_at_once_and_uses_after_a_drop_free_nothing():
    table = table_with((1, "a", 8), (2, "a", 8))
    table.free([1], "a")
    assert 1 not in table
    table.add_uses([2])
    table.done_using([2])  # no free came: the buffer stays
    assert 2 in table


def test_a_send_holding_a_buffer_keeps_it_past_a_free():
    table = table_with((1, "a", 8))
    table.hold([1])
    table.add_uses([1])
    assert table.used_elsewhere(1)  # the running op is not the only user: it may not donate it
    table.done_using([1])
    table.free([1], "a")
    assert 1 in table
    table.release([1])
    assert 1 not in table


def test_a_free_of_another_tenants_buffer_is_ignored_silently():
    table = table_with((1, "owner", 8))
    table.free([1], "thief")
    assert 1 in table and table.lookup(1, "owner") is not None


def test_a_tenant_cannot_overwrite_another_tenants_buffer():
    table = table_with((1, "owner", 8))
    with pytest.raises(pw.TenantAccessError, match="refusing to write it"):
        table.put(1, "thief", np.ones(8, np.uint8))
    assert table.lookup(1, "owner").value.sum() == 0


def test_take_removes_a_buffer_even_if_a_free_was_pending():
    table = table_with((1, "a", 8))
    table.add_uses([1])
    table.free([1], "a")
    value = table.take(1, "a")
    assert value.nbytes == 8 and 1 not in table
    table.done_using([1])  # the doomed mark went with it: nothing else is dropped
    assert len(table) == 0 and table.take(1, "a") is None


def test_free_client_frees_only_that_clients_ids_of_its_tenant():
    bits = 40
    table = table_with(((3 << bits) + 1, "a", 1), ((3 << bits) + 2, "a", 1), ((4 << bits) + 1, "a", 1),
                       ((3 << bits) + 3, "b", 1))
    assert table.free_client(3, "a", bits) == 2
    assert sorted(table.by_tenant().items()) == [("a", (1, 1)), ("b", (1, 1))]
    assert table.free_tenant("b") == 1 and (3 << bits) + 3 not in table


# -- refused messages and a dead host ------------------------------------------------------------------------

def test_ids_of_a_refused_message_fail_for_their_tenant_only():
    table = BufferTable()
    failure = Failure("ProgramError", "refused: bad template")
    table.fail_range(100, 110, "a", failure)
    assert table.lookup(100, "a").value == failure and table.lookup(109, "a").value == failure
    assert table.lookup(110, "a") is None and table.lookup(99, "a") is None
    assert table.lookup(105, "b") is None  # another tenant's id space says nothing
    assert len(table) == 0


def test_a_wait_for_a_refused_id_returns_its_failure_at_once():
    table = BufferTable()
    failure = Failure("ProgramError", "refused")
    threading.Timer(0.05, table.fail_range, args=(100, 110, "a", failure)).start()
    start = time.monotonic()
    assert table.wait(105, "a", timeout=10.0).value == failure
    assert time.monotonic() - start < 5.0


def test_a_dead_host_fails_every_present_and_future_wait():
    table = table_with((1, "a", 8))
    dead = Failure("IslandFailedError", "the executor died")
    results = []
    waiter = threading.Thread(target=lambda: results.append(table.wait(2, "a", timeout=10.0)))
    waiter.start()
    time.sleep(0.05)
    table.die(dead)
    waiter.join(5.0)
    assert [r.value for r in results] == [dead]
    assert table.wait(3, "b", timeout=10.0).value == dead  # at once, for anyone
    assert table.lookup(1, "a").value.nbytes == 8  # what exists stays readable


# -- accounting -----------------------------------------------------------------------------------------------

def test_bytes_and_peaks_are_counted_per_tenant_and_for_the_host():
    table = table_with((1, "a", 100), (2, "a", 50), (3, "b", 30))
    assert table.nbytes == 180 and table.peak_bytes == 180
    assert table.tenant_usage("a") == {"buffers": 2, "buffer_bytes": 150, "peak_buffer_bytes": 150}
    table.free([1], "a")
    assert table.tenant_usage("a") == {"buffers": 1, "buffer_bytes": 50, "peak_buffer_bytes": 150}
    assert table.nbytes == 80 and table.peak_bytes == 180
    table.put(2, "a", np.zeros(70, np.uint8))  # rewritten larger: counted once, at its new size
    assert table.tenant_usage("a")["buffer_bytes"] == 70 and table.nbytes == 100
    assert table.tenant_usage("nobody") == {"buffers": 0, "buffer_bytes": 0, "peak_buffer_bytes": 0}


def test_a_peak_restarts_at_the_current_bytes_per_tenant_or_for_the_host():
    table = table_with((1, "a", 100), (2, "b", 10))
    table.free([1], "a")
    table.put(3, "a", np.zeros(20, np.uint8))
    assert table.reset_peak("a") == 100
    assert table.tenant_usage("a")["peak_buffer_bytes"] == 20
    assert table.tenant_usage("b")["peak_buffer_bytes"] == 10  # another tenant's peak is its own
    assert table.reset_peak() == 110 and table.peak_bytes == 30


def test_a_failure_takes_no_bytes():
    table = table_with((1, "a", 8))
    table.put(2, "a", Failure("ProgramError", "x"))
    assert table.nbytes == 8 and table.tenant_usage("a") == {"buffers": 2, "buffer_bytes": 8,
                                                            "peak_buffer_bytes": 8}
