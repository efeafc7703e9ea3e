"""The host's buffer table: waiting for a buffer, and what a wait leaves behind."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import pathways as pw
from resource_manager.buffers import BufferTable


def test_a_wait_returns_the_buffer_once_it_is_written():
    table = BufferTable(threading.Condition())
    threading.Timer(0.1, table.put, args=(7, "a", np.ones(3))).start()
    start = time.monotonic()
    entry = table.wait(7, "a", timeout=10.0)
    assert entry is not None and entry.value.sum() == 3
    assert time.monotonic() - start < 5.0


def test_a_wait_times_out_on_other_writes_and_leaves_no_waiter():
    table = BufferTable(threading.Condition())
    writer = threading.Thread(target=lambda: [table.put(i, "a", np.zeros(i)) for i in range(100)])
    writer.start()
    assert table.wait(1000, "a", timeout=0.3) is None
    writer.join()
    assert table._waiters == {}, "a timed-out wait must not stay registered"
    table.put(1000, "a", np.full(2, 5.0))
    assert table.wait(1000, "a", timeout=0.0).value[0] == 5.0


def test_a_wait_refuses_another_tenants_buffer():
    table = BufferTable(threading.Condition())
    threading.Timer(0.05, table.put, args=(3, "owner", np.zeros(1))).start()
    with pytest.raises(pw.TenantAccessError, match="not owned by tenant 'thief'"):
        table.wait(3, "thief", timeout=10.0)
