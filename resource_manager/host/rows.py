"""What host 0 of an island sends the island's other hosts, and what they send back: each row declared once.

Host 0 orders the island's work (``order``); every other host runs the same order from ``Row``s: a client's
``Message`` (which that host decodes itself), a group of them (``Grouped``), the next part of a long call
(``Continue``) or the rest of a parked one (``Resume``). Rows travel as one Ray actor call per batch, signed
with the runtime key over ``signed_parts`` (every field, each row's kind and a group's count, so no other
reading of the same values signs the same); hosts past 0 send ``Landed`` back when a parked receive's data
arrived.

On the actor call a batch is plain tuples (``encode``; ``decode_row`` reads one back): Ray pickles a tuple of
ints, strings and bytes without calling into Python, an instance of a class of ours at a microsecond or more
each, and a multi-host island sends a row per client message to each of its other hosts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pathways.messages import Call
from resource_manager.host.admission import Admitted
from resource_manager.host.scheduler import Continue, Group, Released, Resume

MSG, GROUP, RESUME, PART = "msg", "group", "resume", "part"  # each row's kind on the wire


@dataclass(slots=True)  # one per client message a host past 0 runs: slots, not frozen, to build fast
class Message:
    """One client message as the other hosts get it: they decode ``payload`` once themselves. A refused one carries
    its refusal (kind, message) and the ids ``fail_lo`` to ``fail_hi - 1`` it fails; ``end`` as ``Admitted.end``."""

    client: int
    tenant: str
    payload: bytes
    refusal: tuple[str, str] | None
    fail_lo: int
    fail_hi: int
    end: int | None

    @classmethod
    def of(cls, entry: Admitted) -> Message:
        """The row of an admitted message."""
        return cls(*_message_wire(entry))


@dataclass(slots=True)  # as Message: made for every group a host past 0 runs
class Grouped:
    """A scheduler's group: calls of one template by one tenant, one place in the order."""

    messages: tuple[Message, ...]


Item = Message | Grouped | Resume | Continue


@dataclass(slots=True)  # as Message: made for every row a host past 0 runs
class Row:
    """Place ``seq`` of the island's order and what goes there."""

    seq: int
    item: Item


@dataclass(frozen=True, slots=True)
class Landed:
    """Host ``host`` has the data of these parked receives, as (seq, pc) of the runs parked on them."""

    host: int
    pairs: tuple[tuple[int, int], ...]

    def signed_parts(self) -> list[int]:
        """What the runtime key's MAC over this report covers: every field (TypeError/ValueError for other values)."""
        return [int(x) for pair in self.pairs for x in pair] + [int(self.host)]


def _message_wire(entry: Admitted) -> tuple:
    """A ``Message``'s fields for an admitted message, in order (a call of a merged message goes as the message it
    would be alone)."""
    refusal = None if entry.refusal is None else (entry.refusal.kind, entry.refusal.message)
    payload = entry.payload
    if not payload and type(entry.request) is Call:
        payload = entry.request.encode()
    return entry.client, entry.tenant, payload, refusal, entry.fail_lo, entry.fail_hi, entry.end


def encode(released: Released) -> list[tuple]:
    """The batch of rows other hosts get for the scheduler's released items, as it travels."""
    rows: list[tuple] = []
    for seq, item in released:
        kind = type(item)
        if kind is Group:
            rows.append((seq, GROUP, [_message_wire(entry) for entry in item.entries]))
        elif kind is Resume:
            rows.append((seq, RESUME, item.seq, item.pc))
        elif kind is Continue:
            rows.append((seq, PART, item.seq, item.lo, item.hi))
        else:
            rows.append((seq, MSG, _message_wire(item)))
    return rows


def decode_row(row: tuple) -> Row:
    """One row of a batch from ``encode`` (host 0's, verified), typed."""
    kind = row[1]
    if kind == MSG:
        return Row(row[0], Message(*row[2]))
    if kind == GROUP:
        return Row(row[0], Grouped(tuple(Message(*message) for message in row[2])))
    if kind == RESUME:
        return Row(row[0], Resume(*row[2:]))
    if kind == PART:
        return Row(row[0], Continue(*row[2:]))
    raise ValueError(f"a row of kind {kind!r}, which host 0 never sends")


def _message_parts(message: tuple) -> list:
    client, tenant, payload, refusal, lo, hi, end = message  # ValueError for anything of another length
    if refusal is None:
        return [client, tenant, payload, lo, hi, -1 if end is None else end]
    kind, text = refusal
    return [client, tenant, payload, kind, text, lo, hi, -1 if end is None else end]


def signed_parts(rows: Sequence[tuple]) -> list:
    """What a MAC over a batch from ``encode`` covers: every field, each row's kind, and a group's count. TypeError
    (or ValueError) for anything that is not such a batch (what arrives at a host's actor may come from anyone)."""
    if type(rows) is not list:
        raise TypeError("not a batch of rows")
    parts: list = []
    for row in rows:
        if type(row) is not tuple:
            raise TypeError("not a row")
        kind = row[1]
        if kind == MSG and len(row) == 3:
            parts += [row[0], kind, *_message_parts(row[2])]
        elif kind == GROUP and len(row) == 3 and type(row[2]) is list:
            parts += [row[0], kind, len(row[2])]
            for message in row[2]:
                parts += _message_parts(message)
        elif (kind == RESUME and len(row) == 4) or (kind == PART and len(row) == 5):
            parts += row
        else:
            raise TypeError(f"not a row of a kind host 0 sends: {kind!r}")
    return parts
