"""How a client reaches the resource manager: the first attach opens a session; after a suspended runtime came
back (on this cluster or a new one, serving the same session keys) the session reattaches with its key.

Only the protocol (``client.link``) is used: the resource manager proves it is one (its role), and the client
proves its tenant (credential or a job's one-time ticket) before it gets a session id and key.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from client.link import Link, expect_role
from client.runtime import Timeouts
from pathways.errors import PathwaysError
from pathways.names import JOB_ENV
from pathways.requests import Open, Ready

ATTACH_S = 5.0  # connecting to a running runtime (an embedded one may take timeouts.start to come up)
REATTACH_EVERY_S = 1.0  # how often a reattach tries again
log = logging.getLogger(__name__)


def open_session(address: str, tenant: str, timeouts: Timeouts, credential: str | None, ticket: str | None,
                 embedded: bool, broken: Callable[[str], None]) -> tuple[Link, dict]:
    """Attach to the resource manager at ``address`` and open a session as ``tenant``: the link (sealed with the
    session's key from now on) and the manager's answer (``client``, ``key``, ``tenant``, ``weight``,
    ``budgets``, ``topology``, ``islands``). ``broken(reason)`` hears the link end."""
    rm = Link(address, 0, None, expect_role(None, "rm"), "the resource manager", broken,
              timeout=timeouts.start if embedded else ATTACH_S)
    rm.call(lambda rid: Ready(rid), timeouts.start)
    job = os.environ.get(JOB_ENV) or None
    reply = rm.call(lambda rid: Open(rid, tenant, None if ticket else credential, ticket, os.getpid(), job),
                    timeouts.start)
    rm.conn.upgrade(reply["client"], reply["key"])
    return rm, reply


def reattach(address: str, client: int, key: bytes, within: float, stop: threading.Event,
             broken: Callable[[str], None]) -> Link | None:
    """Connect to the resource manager at ``address`` again as session ``client`` (with its ``key``), trying
    every second until it answers; None (the session is over) once ``within`` seconds passed or ``stop`` is
    set."""
    deadline = time.monotonic() + within
    while not stop.wait(REATTACH_EVERY_S):
        try:
            rm = Link(address, client, key, expect_role(None, "rm"), "the resource manager", broken, timeout=ATTACH_S)
        except PathwaysError:
            if time.monotonic() >= deadline:
                break
            continue
        log.warning("reattached to the runtime at %s", address)
        return rm
    if not stop.is_set():
        log.error("the suspended runtime at %s was not back within %.0fs (pw.Timeouts.reattach); this session is "
                  "over: call pw.init() again", address, within)
    return None
