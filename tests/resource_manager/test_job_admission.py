"""A job's archive is admitted before a byte of it is read: anonymous senders, wrong credentials and tenants over
their ``job_disk_bytes`` budget are refused at once, on the session's cluster's resource manager, which allocates
nothing for what they announced and ends the connection."""

from __future__ import annotations

import os

import psutil
import pytest
from conftest import raw_connection, tenant_env
from job_users_env import NEEDS_ROOT, is_root, job_users_machine

import pathways as pw
from command.jobs import Jobs
from command.output import CliError
from pathways import wire
from pathways.protocol import frames
from pathways.requests import Answer, SubmitJob
from resource_manager.jobs import MAX_ARCHIVE


def announce(session, tenant: str, credential: str):
    """A connection that sends a SubmitJob whose head announces a 256 MiB archive, and none of its bytes."""
    conn = raw_connection(session, key=b"")
    payload = SubmitJob(1, tenant, credential, ["python", "train.py"], None).encode()
    conn.sock.sendall(frames.head(None, frames.TO_SERVER, 1, payload, MAX_ARCHIVE) + payload)
    return conn


def refusal(conn) -> str:
    """The answer to the announced archive (it must come without a byte of the archive sent), and the end of the
    connection after it."""
    conn.sock.settimeout(30)
    answer = wire.parse(conn.recv().payload, Answer)
    assert not answer.ok, answer
    assert conn.sock.recv(1) == b""  # the runtime reads nothing more of this connection
    conn.close()
    return str(answer.value)


def test_an_anonymous_archive_is_refused_before_a_byte_of_it_is_read(cluster):
    manager = psutil.Process(pw.admin().state()["cluster"]["pid"])
    before = manager.memory_info().rss
    conns = [announce(cluster, "default", "a guessed credential") for _ in range(4)]
    for conn in conns:
        assert "unknown tenant or wrong credential" in refusal(conn)
    grown = manager.memory_info().rss - before
    assert grown < 64 << 20, f"the resource manager grew by {grown >> 20} MiB for 4 x 256 MiB announced"


def test_an_anonymous_request_that_announces_data_is_refused_and_its_connection_ends(cluster):
    """Only a job's archive follows a request without a session, and only once admitted: anything else announcing
    data (which could trickle in for hours, holding a thread and one of the few anonymous places) is refused."""
    from pathways.requests import WhoAmI

    conn = raw_connection(cluster, key=b"")
    payload = WhoAmI(1, "default", "guess").encode()
    conn.sock.sendall(frames.head(None, frames.TO_SERVER, 1, payload, MAX_ARCHIVE) + payload + b"x")
    assert "carries no data" in refusal(conn)


def test_an_archive_over_the_tenants_disk_budget_is_refused_before_a_byte_of_it_is_read(cluster):
    if not is_root():
        pytest.skip(NEEDS_ROOT)
    env = tenant_env("disk-budget")
    credential = env["PATHWAYS_CREDENTIAL"]
    with job_users_machine():
        pw.admin().set_tenant("disk-budget", budgets={"job_disk_bytes": 1 << 20}, job_user="nobody")
        text = refusal(announce(cluster, "disk-budget", credential))
        # `pathways submit` sending an archive the runtime refuses unread still says why, in one line
        with pytest.raises(CliError, match="over your job_disk_bytes budget"):
            Jobs(cluster.address, "disk-budget", credential).submit(["python", "x.py"], os.urandom(8 << 20))
    assert "over your job_disk_bytes budget" in text and f"needs {MAX_ARCHIVE} bytes more" in text, text
    pw.admin().remove_tenant("disk-budget")
