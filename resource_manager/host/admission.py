"""Admission on an island's host 0: each client's numbered stream put back in order, and every message
decoded once and checked in meaning before it may take a place in the island's order.

Each client numbers its messages, and a batch that overtook an earlier one
waits here until the gap is filled, counted against its tenant's
``ahead_batches`` and ``ahead_bytes`` budgets (over them, the batch is refused
whole). A gap that is never filled (its sender died mid-send) is skipped once
the resource manager revokes that client, or after ``gap_timeout`` seconds; it
only ever holds back that client's own later messages.

Anything wrong with one message (it does not decode, names a slice its tenant
does not hold, ids outside its client's space, an executable it never sent, a
shape no host can hold) refuses that message alone: it still takes its place
in the order, and its outputs' ids are failed with the reason on every host,
so the client's fetch says what was wrong while everyone else's work runs.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

from pathways.budgets import over
from pathways.errors import PathwaysError, ProgramError, TenantAccessError, WireFormatError, to_wire
from pathways.messages import (
    CLIENT_ID_BITS,
    MAX_BATCH,
    Call,
    Calls,
    Free,
    Put,
    Request,
    client_of,
    decode_request,
)
from pathways.ops import Limits, Template, TemplateCache, check_fits, declared_ops, declared_values
from resource_manager.host.buffers import Failure
from resource_manager.host.executables import ExecutableCache
from resource_manager.host.grants import Grants

VERIFIED = 4096  # templates whose slice and executable checks are remembered
log = logging.getLogger(__name__)


@dataclass(slots=True)  # made for every message: a frozen dataclass takes five times as long to build
class Admitted:
    """A client's message after admission: typed and checked, or the failure that replaces it (then the ids
    ``fail_lo`` to ``fail_hi - 1`` fail with it). ``end``: a long call runs only its ops before ``end`` in this
    place of the order, the rest in places of their own (the scheduler's ``Continue``); None runs them all."""

    client: int
    tenant: str
    payload: bytes
    request: Request | None
    template: Template | None = None
    refusal: Failure | None = None
    fail_lo: int = 0
    fail_hi: int = 0
    end: int | None = None

    @property
    def counts(self) -> bool:
        """Whether it runs computations (charged to its tenant's share of island time)."""
        return self.refusal is None and isinstance(self.request, Call)


def _within(ids: tuple[int, ...], floor: int, hi: int) -> bool:
    """Whether every id is in [floor, hi): one comparison for the usual one id, no min and max."""
    if len(ids) == 1:
        return floor <= ids[0] < hi
    return not ids or floor <= min(ids) and max(ids) < hi


class Admission:
    """Host 0's per-client streams and message checks. Thread-safe."""

    def __init__(self, limits: Limits, grants: Grants, exes: ExecutableCache, gap_timeout: float) -> None:
        self.limits, self.grants, self.exes = limits, grants, exes
        self.gap_timeout = gap_timeout
        self.templates = TemplateCache(check=lambda t: t.check(limits))
        self._lock = threading.Lock()
        self._next: dict[int, int] = {}  # client -> number of its next message
        # client -> first -> (arrived, tenant, items, bytes counted against the tenant's ahead budgets or -1)
        self._early: dict[int, dict[int, tuple[float, str, list, int]]] = {}
        self._ahead: dict[str, tuple[int, int]] = {}  # tenant -> (batches, bytes) waiting for an earlier one
        # a template whose slices its tenant held and whose executables it had sent, as of (grants, executables)
        # versions: a program called again is not checked again until either changes
        self._verified: dict[Template, tuple[int, int]] = {}
        self.skipped = 0

    def accept(self, client: int, tenant: str, first: int, items: Any) -> list[Admitted]:
        """Messages ``first``, ``first + 1``, ... of ``client``'s stream (their payloads); returns what
        is now in order (this batch and any that waited for it), admitted or refused one by one."""
        if not isinstance(items, list) or not 0 < len(items) <= MAX_BATCH or not isinstance(first, int):
            raise WireFormatError(f"a batch is a list of 1 to {MAX_BATCH} messages with the number of the first")
        with self._lock:
            expected = self._next.get(client, 0)
            if first < expected or first in self._early.get(client, ()):
                raise WireFormatError(f"island {self.limits.island} already has message {first} of your stream; a "
                                      "message is sent once")
            counted = -1 if first == expected else self._hold_ahead(tenant, items)
            self._early.setdefault(client, {})[first] = (time.monotonic(), tenant, items, counted)
            return self._drain(client)

    def _hold_ahead(self, tenant: str, items: list) -> int:
        """Count a batch that must wait for an earlier one against its tenant's ``ahead_batches`` and ``ahead_bytes``
        budgets (an honest client's batches arrive in order; only a lost or withheld one leaves others waiting);
        ResourceError naming the budget if it does not fit. Returns the bytes counted."""
        budgets = self.grants.budgets(tenant)
        nbytes = sum(len(m) for m in items if isinstance(m, bytes | bytearray))
        batches, held = self._ahead.get(tenant, (0, 0))
        if batches + 1 > budgets.ahead_batches:
            raise over("ahead_batches", batches, 1, budgets.ahead_batches, "batches")
        if held + nbytes > budgets.ahead_bytes:
            raise over("ahead_bytes", held, nbytes, budgets.ahead_bytes, "bytes")
        self._ahead[tenant] = (batches + 1, held + nbytes)
        return nbytes

    def _let_go(self, tenant: str, counted: int) -> None:
        if counted < 0:
            return
        batches, held = self._ahead[tenant]
        if batches > 1:
            self._ahead[tenant] = (batches - 1, held - counted)
        else:
            del self._ahead[tenant]

    def _drain(self, client: int) -> list[Admitted]:
        expected = self._next.get(client, 0)
        early = self._early.get(client, {})
        out: list[Admitted] = []
        while expected in early:
            _, tenant, items, counted = early.pop(expected)
            self._let_go(tenant, counted)
            room = MAX_BATCH  # calls a batch may carry, merged ones counted one by one
            for item in items:
                checked = self.check(client, tenant, item, room)
                room -= len(checked)
                out += checked
            expected += len(items)
        self._next[client] = expected
        if not early:
            self._early.pop(client, None)
        return out

    def expire(self) -> list[Admitted]:
        """Skip gaps older than ``gap_timeout``: the messages that never came are given up on."""
        horizon = time.monotonic() - self.gap_timeout
        out: list[Admitted] = []
        with self._lock:
            for client in list(self._early):
                early = self._early[client]
                if min(arrived for arrived, *_ in early.values()) < horizon:
                    resume_at = min(early)
                    missing = resume_at - self._next.get(client, 0)
                    self.skipped += missing
                    log.warning("island %d: messages %d to %d of client %d never arrived within %.0fs; skipped",
                                self.limits.island, self._next.get(client, 0), resume_at - 1, client,
                                self.gap_timeout)
                    self._next[client] = resume_at
                    out += self._drain(client)
        return out

    def revoke(self, client: int) -> None:
        """The client's session ended: forget its stream, gaps included."""
        with self._lock:
            self._next.pop(client, None)
            for _, tenant, _, counted in self._early.pop(client, {}).values():
                self._let_go(tenant, counted)

    def positions(self) -> dict[int, int]:
        """The number of the next message of each client's stream: what a snapshot saves."""
        with self._lock:
            return dict(self._next)

    def position(self, client: int) -> int:
        """The number of the next message this island takes from ``client`` (a resumed client sends from there)."""
        with self._lock:
            return self._next.get(client, 0)

    def restore(self, positions: dict[int, int]) -> None:
        """Streams saved by a snapshot continue where they stopped; batches waiting for a gap are dropped (their
        clients send them again)."""
        with self._lock:
            self._next = dict(positions)
            self._early.clear()
            self._ahead.clear()

    def waiting(self) -> int:
        """Batches waiting for an earlier message of their client's stream."""
        with self._lock:
            return sum(len(e) for e in self._early.values())

    def ahead(self, tenant: str) -> tuple[int, int]:
        """(batches, bytes) of ``tenant``'s that wait here for an earlier message of their client's stream."""
        with self._lock:
            return self._ahead.get(tenant, (0, 0))

    # -- one message ----------------------------------------------------------------------------------------
    def check(self, client: int, tenant: str, payload: Any, room: int = MAX_BATCH) -> list[Admitted]:
        """Decode and check one message of ``client``: what it asks, one entry per call (``Calls`` merges several, at
        most ``room``); a problem refuses that message, or that call of it, alone."""
        try:
            request = decode_request(payload)
        except PathwaysError as exc:
            return [Admitted(client, tenant, payload, None, None, Failure(*to_wire(exc)))]
        if type(request) is not Calls:
            return [self._check_one(client, tenant, payload, request)]
        try:
            calls = request.split()
            if len(calls) > room:
                raise WireFormatError(f"a batch carries more than {MAX_BATCH} calls, merged ones counted one by one")
        except PathwaysError as exc:
            return [Admitted(client, tenant, b"", request, None, Failure(*to_wire(exc)))]
        return [self._check_one(client, tenant, b"", call) for call in calls]

    def _check_one(self, client: int, tenant: str, payload: bytes, request: Request) -> Admitted:
        """One decoded message (or one call of a merged one: ``payload`` empty) checked in meaning."""
        lo = hi = 0
        try:
            if isinstance(request, Call):
                template = self._check_call(client, tenant, request)
                return Admitted(client, tenant, payload, request, template)
            if isinstance(request, Put):
                lo, hi = request.id, request.id + 1
                self._check_put(client, tenant, request)
                return Admitted(client, tenant, payload, request)
            own = tuple(i for i in request.ids if client_of(i) == client)
            return Admitted(client, tenant, payload, Free(own, request.everything))
        except PathwaysError as exc:
            if isinstance(request, Call):  # read only now: a good call's template is decoded once, cached
                lo, hi = request.base, request.base + declared_values(request.template)
            if client_of(lo) != client or client_of(max(hi - 1, lo)) != client:
                lo = hi = 0  # never fail ids outside the sender's own space
            return Admitted(client, tenant, payload, request, None, Failure(*to_wire(exc)), lo, hi)

    def _own(self, client: int, ids: Any, what: str) -> None:
        lo, hi = client << CLIENT_ID_BITS, (client + 1) << CLIENT_ID_BITS
        for i in ids:
            if not (lo <= i < hi and i > 0):
                raise TenantAccessError(f"{what} names buffer id {i}, which is not one of your client's ids")

    def _check_call(self, client: int, tenant: str, call: Call) -> Template:
        budgets = self.grants.budgets(tenant)
        template = self.templates.cached(call.template, tenant)
        if template is None:
            def count_ops(blob: bytes) -> None:  # before the costly decode of a template never seen
                ops = declared_ops(blob)
                if ops > budgets.program_ops:
                    raise over("program_ops", 0, ops, budgets.program_ops, "ops")

            template = self.templates.get(call.template, tenant, budgets.templates, count_ops)
        if len(template.ops) > budgets.program_ops:  # the budget shrank since it was decoded
            raise over("program_ops", 0, len(template.ops), budgets.program_ops, "ops")
        if len(call.inputs) != template.n_inputs:
            raise ProgramError(f"program {template.program!r} takes {template.n_inputs} inputs; the call names "
                               f"{len(call.inputs)}")
        lo, hi = client << CLIENT_ID_BITS, (client + 1) << CLIENT_ID_BITS
        floor = lo or 1  # id 0 is no one's
        base = call.base
        last = base + template.n_values - 1 if template.n_values else base
        inputs, frees = call.inputs, call.frees
        if not (floor <= base and last < hi and _within(inputs, floor, hi) and _within(frees, floor, hi)):
            self._own(client, (call.base, last), "a call's output block")  # says which id was wrong
            self._own(client, call.inputs, f"program {template.program!r}")
            self._own(client, call.frees, "a free")
        if not call.exes and self._verified.get(template) == (self.grants.version, self.exes.version):
            return template
        for desc in template.slices.values():
            if not self.grants.owns(tenant, desc):
                raise TenantAccessError(f"slice {desc.key} on island {self.limits.island} is not yours; a program "
                                        "may only run on its own slices")
        for exe_hash, blob in call.exes.items():
            if not isinstance(blob, bytes):
                raise WireFormatError(f"executable {exe_hash[:12]}… is not bytes")
            self.exes.add(tenant, exe_hash, blob)
        for exe in template.executables:
            if exe not in call.exes and not self.exes.has(tenant, exe):
                name = next(op.label() for op in template.ops if exe in op.executables())
                raise ProgramError(f"{name}: executable {exe[:12]}… was never sent to island "
                                   f"{self.limits.island} by your clients")
        if len(self._verified) >= VERIFIED:
            self._verified.clear()
        self._verified[template] = (self.grants.version, self.exes.version)
        return template

    def _check_put(self, client: int, tenant: str, put: Put) -> None:
        self._own(client, [put.id], "pw.put")
        if not self.grants.owns(tenant, put.slice):
            raise TenantAccessError(f"slice {put.slice.key} on island {self.limits.island} is not yours; a put "
                                    "may only place values on its own slices")
        put.slice.check(self.limits)
        put.aval.check("pw.put")
        put.slice.check_spec(put.spec, put.aval.shape, "pw.put")
        check_fits(put.aval, put.spec, put.slice, self.limits, "pw.put")
