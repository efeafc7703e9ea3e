"""A host's inbox: the island's ordered stream, admitted into the executor strictly by sequence number.

Host 0 hands its own share over typed (it decoded and checked each message
once, at admission); other hosts receive host 0's rows (``rows``, signed with
the runtime key) and decode each payload once. Whatever arrives, the stream moves
on: a message that fails here fails its own outputs, a put whose value never
arrives fails that put when it runs, and nothing raises out of admission
with the sequence counter stuck. Only a sequence number that never arrives
(host 0 is gone) stops the stream, and that fails the island.
"""

from __future__ import annotations

import logging
import threading
import time

from pathways.errors import PathwaysError, to_wire
from pathways.messages import CLIENT_ID_BITS, Call, Free, Put, client_of, decode_request
from pathways.ops import TemplateCache
from resource_manager.host.admission import Admitted
from resource_manager.host.buffers import BufferTable, Failure
from resource_manager.host.executables import ExecutableCache
from resource_manager.host.executor import Executor
from resource_manager.host.rows import Grouped, Message, decode_row
from resource_manager.host.run import Place, Run
from resource_manager.host.scheduler import Continue, Group, Item, Resume

log = logging.getLogger(__name__)


class Inbox:
    """Admits sequenced items in order. ``accept`` may be called from several threads: the inbox owns the lock
    that keeps its order, and hands each item to the executor under it."""

    def __init__(self, island: int, host: int, executor: Executor, table: BufferTable, exes: ExecutableCache,
                 templates: TemplateCache) -> None:
        self.island, self.host = island, host
        self.executor, self.table, self.exes, self.templates = executor, table, exes, templates
        self._lock = threading.Lock()
        self._pending: dict[int, Item] = {}
        self._split: dict[int, Run] = {}  # a long fragment's first part, by its seq, until its last part is admitted
        self._next_seq = 0
        self._gap_since: float | None = None

    def accept(self, items: list[tuple[int, Item]]) -> None:
        """Sequenced items from this island's scheduler (host 0's own share, already checked)."""
        with self._lock:
            for seq, item in items:
                if seq >= self._next_seq and seq not in self._pending:
                    self._pending[seq] = item
            self._admit_ready()

    def accept_rows(self, rows: list[tuple]) -> None:
        """Sequenced rows from host 0 (``rows.encode``), each read here (``rows.decode_row``) and each client message
        decoded once."""
        items: list[tuple[int, Item]] = []
        for raw in rows:
            try:
                row = decode_row(raw)
                item = row.item
                if type(item) is Message:
                    items.append((row.seq, self._from_row(item)))
                elif type(item) is Grouped:
                    items.append((row.seq, Group(tuple(self._from_row(message) for message in item.messages))))
                else:  # Resume, Continue: as the scheduler released them
                    items.append((row.seq, item))
            except Exception as exc:  # host 0 is trusted, so this is a bug: say it, keep the order moving
                log.exception("island %d host %d: an unreadable row from host 0", self.island, self.host)
                if isinstance(raw, tuple) and raw and isinstance(raw[0], int):
                    items.append((raw[0], Admitted(0, "", b"", None, refusal=Failure(*to_wire(exc)))))
        self.accept(items)

    def _from_row(self, row: Message) -> Admitted:
        if row.refusal is not None:  # the request only for the frees it carries, when it reads (as on host 0)
            try:
                request = decode_request(row.payload)
            except Exception:
                request = None
            return Admitted(row.client, row.tenant, row.payload, request, None, Failure(*row.refusal), row.fail_lo,
                            row.fail_hi)
        request = decode_request(row.payload)
        template = self.templates.get(request.template, row.tenant) if isinstance(request, Call) else None
        return Admitted(row.client, row.tenant, row.payload, request, template, end=row.end)

    def _admit_ready(self) -> None:
        while self._next_seq in self._pending:
            item = self._pending.pop(self._next_seq)
            try:
                self._admit(self._next_seq, item)
            except Exception:  # never leave the order stuck behind one item
                log.exception("island %d host %d: admitting sequence %d failed", self.island, self.host,
                              self._next_seq)
                if isinstance(item, (Continue, Group)) or isinstance(item, Admitted) and item.counts:
                    self._ran_nothing(self._next_seq)
            self._next_seq += 1
        self._gap_since = (self._gap_since or time.monotonic()) if self._pending else None

    def _admit(self, seq: int, item: Item) -> None:
        if type(item) is Group:
            self._group(seq, item)
            return
        if isinstance(item, Resume):
            self.executor.resume(item.seq, item.pc)
            return
        if isinstance(item, Continue):
            first = self._split.get(item.seq)
            if first is None:  # its first part never ran here (it failed at admission): its outputs say why
                self._ran_nothing(seq)
                return
            if item.hi >= len(first.ops):
                del self._split[item.seq]
            self.executor.admit(first.part(seq, item.lo, item.hi))
            return
        if item.refusal is not None:
            self._refuse(item)
            return
        request = item.request
        if isinstance(request, Free):
            self.table.free(list(request.ids), item.tenant)
            if request.everything:
                self.table.free_client(item.client, item.tenant, CLIENT_ID_BITS)
            return
        if isinstance(request, Put):
            self.executor.admit(self._put_run(seq, item, request))
            return
        run = self._call(seq, item)
        if run is None:
            self._ran_nothing(seq)
            return
        if run.end < len(run.ops):
            self._split[seq] = run
        self.executor.admit(run)

    def _group(self, seq: int, group: Group) -> None:
        """A group's calls as one run that takes them in turn. Each call's frees apply after the uses of the calls
        before it are counted and before its own are, as if it came alone."""
        run: Run | None = None
        calls: list[tuple[int, tuple[int, ...], list[int] | None]] = []
        use = self.table.free_then_use
        for entry in group.entries:
            if not self._takes(entry):
                continue
            if run is None:
                if entry.request.frees:
                    self.table.free(entry.request.frees, entry.tenant)
                run = self._run(seq, entry)
                self.executor.count_uses(run)
                one = len(run.ops) == 1
                continue
            request = entry.request
            touched = run.call_touches(request.base, request.inputs)
            use(request.frees, entry.tenant, touched)
            calls.append((request.base, request.inputs, touched if one else None))
        if run is None:
            self._ran_nothing(seq)
            return
        if calls:
            calls.reverse()  # taken from the end
            run.more, run.calls = calls, 1 + len(calls)
        self.executor.admit(run, counted=True)

    def _call(self, seq: int, item: Admitted) -> Run | None:
        """The run a checked call (or, on a host past 0, a refused one) becomes; None if it runs nothing here
        (refused, or an executable it carries is refused: its outputs say why)."""
        if not self._takes(item):
            return None
        if item.request.frees:
            self.table.free(item.request.frees, item.tenant)
        return self._run(seq, item)

    def _takes(self, item: Admitted) -> bool:
        """Whether a call runs here: a refused one, or one carrying a refused executable, fails its outputs with
        the reason instead (and its frees apply now); the caller applies a call that runs' frees."""
        if item.refusal is not None:
            self._refuse(item)
            return False
        request = item.request
        if request.exes:
            try:
                for exe_hash, blob in request.exes.items():
                    self.exes.add(item.tenant, exe_hash, blob)
            except PathwaysError as exc:
                template = item.template
                self.table.fail_range(request.base, request.base + template.n_values, item.tenant,
                                      Failure(*to_wire(exc)))
                if request.frees:
                    self.table.free(request.frees, item.tenant)
                return False
        return True

    def _run(self, seq: int, item: Admitted) -> Run:
        template, request = item.template, item.request
        return Run(seq, item.tenant, item.client, template.program, template.ops, template, template.n_inputs,
                   request.base, request.inputs, end=-1 if item.end is None else item.end)

    def _refuse(self, item: Admitted) -> None:
        """A refused message: its outputs fail with the reason, and the arrays it frees are dropped all the same."""
        if item.fail_hi > item.fail_lo:
            self.table.fail_range(item.fail_lo, item.fail_hi, item.tenant, item.refusal)
        if isinstance(item.request, Call):
            self.table.free([i for i in item.request.frees if client_of(i) == item.client], item.tenant)

    def _ran_nothing(self, seq: int) -> None:
        """A call (or part) in place ``seq`` that will not run here: an empty run, so that its completion is
        reported like any other and the scheduler's window does not keep its place for ever."""
        self.executor.admit(Run(seq, "", 0, "nothing", ()))

    def _put_run(self, seq: int, item: Admitted, put: Put) -> Run:
        return Run(seq, item.tenant, item.client, "put", (Place(put.slice, put.spec, put.aval),), base=put.id)

    def stuck_for(self) -> float:
        """Seconds a sequence number has been missing while later ones wait (0 when the stream flows)."""
        since = self._gap_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def next_seq(self) -> int:
        """The sequence number admitted next."""
        return self._next_seq

    def held(self) -> int:
        """How many items wait for an earlier sequence number."""
        return len(self._pending)
