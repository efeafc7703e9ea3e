"""Reaching the resource manager (client/attach.py): opening a session proves the tenant and seals the link
with the session's key; a reattach connects again with that key, tries until the runtime answers, and gives
up after its bound or when told to stop."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from conftest import tenant_env

from client import attach
from client.runtime import Timeouts
from pathways.errors import PathwaysError, TenantAccessError
from pathways.requests import Close, Renew


def _nothing_listens() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"pathways://127.0.0.1:{port}"


def test_opening_where_nothing_listens_says_so():
    with pytest.raises(PathwaysError, match="nothing answers at"):
        attach.open_session(_nothing_listens(), "t", Timeouts(start=2.0), "secret", None, False, lambda r: None)


def test_a_reattach_gives_up_after_its_bound_and_says_the_session_is_over(monkeypatch, caplog):
    monkeypatch.setattr(attach, "REATTACH_EVERY_S", 0.05)
    address = _nothing_listens()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="client.attach"):
        assert attach.reattach(address, 5, b"k" * 32, 0.3, threading.Event(), lambda r: None) is None
    assert 0.3 <= time.monotonic() - started < 10.0
    assert f"the suspended runtime at {address} was not back within 0s" in caplog.text


def test_a_stopped_reattach_ends_at_once_and_quietly(caplog):
    stop = threading.Event()
    stop.set()
    with caplog.at_level(logging.WARNING, logger="client.attach"):
        assert attach.reattach(_nothing_listens(), 5, b"k" * 32, 60.0, stop, lambda r: None) is None
    assert caplog.text == ""


def test_a_session_opens_as_its_tenant_and_reattaches_with_its_key(cluster):
    env = tenant_env("attach-test")
    timeouts = Timeouts(start=30.0)
    with pytest.raises(TenantAccessError):
        attach.open_session(cluster.address, "attach-test", timeouts, "not-the-credential", None, False, None)
    rm, reply = attach.open_session(cluster.address, "attach-test", timeouts, env["PATHWAYS_CREDENTIAL"], None,
                                    False, None)
    try:
        assert reply["tenant"] == "attach-test" and reply["client"] not in (0, cluster.client_id)
        assert [i["index"] for i in reply["islands"]] == [0, 1] and rm.identity.role == "rm"
        again = attach.reattach(cluster.address, reply["client"], reply["key"], 30.0, threading.Event(), None)
        assert again is not None and again.identity.role == "rm"
        assert [i["index"] for i in again.call(lambda rid: Renew(rid), 30.0)["islands"]] == [0, 1]
        again.call(lambda rid: Close(rid), 30.0)
        again.close()
    finally:
        rm.close()
