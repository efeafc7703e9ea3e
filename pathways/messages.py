"""The runtime's messages, each defined once: its fields, its wire schema, and its typed form.

A client sends an island's scheduler these kinds, in its numbered stream:
``Call`` (run a fragment template with these buffer ids), ``Calls`` (calls of one
template sent back to back, merged), ``Put`` (place a host value on a slice) and
``Free`` (drop buffers). Hosts send each other ``Deliver``
(shards for a receive) and ``Returned`` (leases of lent shards coming back).
The resource manager's orders to its hosts are declared at the end; the client
protocol's requests live in ``pathways.requests``.

Who sent a message is never a field: a client's stream and requests are
signed with its session key (``pathways.auth``), so the island knows the
client, and from the resource manager its tenant.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pathways import wire
from pathways.errors import WireFormatError
from pathways.ops import MAX_SHARDS, Aval, Region, SliceDesc, WireSpec, region_of, spec_of, spec_to_list
from pathways.wire import declare

CLIENT_ID_BITS = 40  # buffer ids are (client id << 40) | counter, minted by the client
MAX_CALLS = 256  # calls one ``Calls`` message may merge
MAX_BATCH = 1 << 16  # messages in one batch of a client's stream, and calls, merged ones counted one by one
MAX_ID = (1 << 63) - 1


def client_of(buffer_id: int) -> int:
    """The client whose id space a buffer id belongs to."""
    return buffer_id >> CLIENT_ID_BITS


@dataclass(slots=True)  # decoded once per call on every host: a frozen dataclass takes five times as long to build
class Call:
    """Run the fragment ``template`` once: ``inputs`` are the ids of its input slots, and slot ``s`` of
    everything it produces gets id ``base + s``. ``exes`` carries executables the island has not seen
    from this client yet (by content hash); ``frees`` are ids the client dropped meanwhile."""

    template: bytes
    base: int
    inputs: tuple[int, ...]
    exes: Mapping[str, bytes]
    frees: tuple[int, ...]

    def encode(self) -> bytes:
        """The message's wire bytes (a client sends one per call: the island validates it, not the sender)."""
        return wire.pack("call", self.template, self.base, self.inputs, self.exes, self.frees)


@dataclass(slots=True)
class Calls:
    """Calls of one fragment template that a client sent back to back, as one message: what each ``Call`` says,
    without the template again. A client's outbox merges calls that wait for the island together (``merge``);
    the island checks each call alone (``split``). ``inputs`` holds every call's input ids in turn, as many per
    call as the template takes; ``frees`` every call's frees in turn, ``free_counts[k]`` of them for call ``k``."""

    template: bytes
    bases: list[int]
    inputs: list[int]
    frees: list[int]
    free_counts: list[int]

    @classmethod
    def merge(cls, calls: list[Call]) -> Calls:
        """Calls of one template carrying no executables, as one message."""
        return cls(calls[0].template, [c.base for c in calls], [i for c in calls for i in c.inputs],
                   [i for c in calls for i in c.frees], [len(c.frees) for c in calls])

    def encode(self) -> bytes:
        """The message's wire bytes."""
        return wire.pack("calls", self.template, self.bases, self.inputs, self.frees, self.free_counts)

    def split(self) -> list[Call]:
        """Each call as if sent alone; WireFormatError when the lists do not add up (at most ``MAX_CALLS`` calls)."""
        n = len(self.bases)
        if not 0 < n <= MAX_CALLS:
            raise WireFormatError(f"calls: {n} calls in one message; a message merges 1 to {MAX_CALLS}")
        counts = self.free_counts
        if len(self.inputs) % n or len(counts) != n or sum(counts) != len(self.frees) or min(counts) < 0:
            raise WireFormatError(f"calls: {len(self.inputs)} input ids, {len(counts)} free counts adding up to "
                                  f"{sum(counts)} and {len(self.frees)} frees do not make {n} calls")
        width, inputs, frees, template = len(self.inputs) // n, self.inputs, self.frees, self.template
        out, at = [], 0
        for k, base in enumerate(self.bases):
            count = counts[k]
            out.append(Call(template, base, tuple(inputs[k * width:(k + 1) * width]), {},
                            tuple(frees[at:at + count]) if count else ()))
            at += count
        return out


@dataclass(frozen=True)
class Put:
    """Place a host value on a slice as buffer ``id``: each host of the slice takes its own shards of the value,
    which the client uploaded to it directly (``pathways.requests.PutData``)."""

    id: int
    slice: SliceDesc
    spec: WireSpec
    aval: Aval

    def encode(self) -> bytes:
        """The message's wire bytes."""
        return wire.encode("put", {"id": self.id, "slice": self.slice.to_wire(), "spec": spec_to_list(self.spec),
                                   "aval": self.aval.to_wire()})


@dataclass(frozen=True)
class Free:
    """Drop buffers (once the ops admitted before this message are done with them); ``everything`` drops
    every buffer of the sending client."""

    ids: tuple[int, ...]
    everything: bool = False

    def encode(self) -> bytes:
        """The message's wire bytes."""
        return wire.encode("free", {"ids": list(self.ids), "everything": self.everything})


Request = Call | Calls | Put | Free


def decode_request(payload: bytes) -> Request:
    """A client's message to an island, typed; raises WireFormatError when it is not one."""
    kind, values = wire.decode_values(payload, "call", "calls", "put", "free")
    if kind == "call":
        template, base, inputs, exes, frees = values
        return Call(template, base, tuple(inputs), exes, tuple(frees))
    if kind == "calls":
        return Calls(*values)
    if kind == "put":
        id_, desc, spec, aval = values
        return Put(id_, SliceDesc.from_wire(desc), spec_of(spec), Aval.from_wire(aval))
    ids, everything = values
    return Free(tuple(ids), bool(everything))


@dataclass(frozen=True)
class Lending:
    """Shards a same-node sender keeps in its own memory for the receiver to copy: its lease and addresses."""

    lease: int
    addrs: tuple[int, ...]
    channel: str  # where the lease goes back


@dataclass(frozen=True)
class Deliver:
    """Shards sent by host ``host`` of island ``src`` for receive id ``key`` (or the failure that replaced
    them). The arrays travel beside the message, lent in the sender's memory (``direct``), or back to back
    in a socket frame (``dtype`` given)."""

    key: int
    src: int
    host: int
    shards: tuple[Region, ...]
    failure: tuple[str, str] | None = None
    direct: Lending | None = None
    dtype: str | None = None

    def encode(self) -> bytes:
        """The message's wire bytes."""
        body: dict[str, Any] = {"key": self.key, "src": self.src, "host": self.host,
                                "shards": [[list(r) for r in s] for s in self.shards]}
        if self.failure is not None:
            body["failure"] = list(self.failure)
        if self.direct is not None:
            body["direct"] = {"lease": self.direct.lease, "addrs": list(self.direct.addrs),
                              "channel": self.direct.channel}
        if self.dtype is not None:
            body["dtype"] = self.dtype
        return wire.encode("deliver", body)

    @classmethod
    def from_wire(cls, msg: Mapping) -> Deliver:
        """A delivery from its decoded message; WireFormatError on too many shards or a malformed failure."""
        if len(msg["shards"]) > MAX_SHARDS:
            raise WireFormatError(f"deliver: {len(msg['shards'])} shards, over the limit of {MAX_SHARDS}")
        failure = msg.get("failure")
        if failure is not None and len(failure) != 2:
            raise WireFormatError("deliver.failure must be [kind, message]")
        d = msg.get("direct")
        direct = None if d is None else Lending(d["lease"], tuple(d["addrs"]), d["channel"])
        return cls(msg["key"], msg["src"], msg["host"], tuple(region_of(s) for s in msg["shards"]),
                   None if failure is None else (failure[0], failure[1]), direct, msg.get("dtype"))


wire.register("call", {"template": bytes, "base": int, "inputs": ("list", int), "exes": ("map", bytes),
                       "frees": ("list", int)})
wire.register("calls", {"template": bytes, "bases": ("list", int), "inputs": ("list", int), "frees": ("list", int),
                        "free_counts": ("list", int)})
wire.register("put", {"id": int, "slice": wire.SLICE, "spec": wire.SPEC, "aval": wire.AVAL})
wire.register("free", {"ids": ("list", int), "everything": ("opt", bool)})
wire.register("deliver", {"key": int, "src": int, "host": int, "shards": ("list", ("list", ("list", int))),
                          "failure": ("opt", ("list", str)),
                          "direct": ("opt", {"lease": int, "addrs": ("list", int), "channel": str}),
                          "dtype": ("opt", str)})


@declare("returned", {"leases": ("list", int)})
class Returned:
    """Leases of lent shards coming back to the host that lent them: its receiver copied them, or never will."""

    leases: tuple[int, ...]


# -- the resource manager's orders to its hosts (signed with the runtime key, bound to the host) ------------

@declare("session", {"client": int, "tenant": str, "key": bytes, "weight": float, "budgets": ("map", int)})
class OpenSession:
    """Accept connections proven with ``key`` as client ``client`` of ``tenant``, whose weight and budgets
    (``pathways.budgets.Budgets.to_wire``) the registry holds."""

    client: int
    tenant: str
    key: bytes
    weight: float
    budgets: dict


@declare("end_session", {"client": int, "free": bool})
class EndSession:
    """Client ``client``'s session ended: close its connections and forget it (``free``: drop its buffers)."""

    client: int
    free: bool


@declare("grant", {"slice": wire.SLICE, "tenant": str})
class Grant:
    """``tenant`` holds the slice (its key, mesh and devices)."""

    slice: dict
    tenant: str

    @property
    def desc(self) -> SliceDesc:
        """The granted slice."""
        return SliceDesc.from_wire(self.slice)


@declare("revoke", {"keys": ("list", str)})
class Revoke:
    """The slices ``keys`` were released: programs and puts on them are refused from now on."""

    keys: list


@declare("weight", {"tenant": str, "weight": float})
class SetWeight:
    """The admin changed ``tenant``'s weight."""

    tenant: str
    weight: float


@declare("budgets", {"tenant": str, "budgets": ("map", int)})
class SetBudgets:
    """The admin changed ``tenant``'s budgets."""

    tenant: str
    budgets: dict


@declare("island_failed", {"island": int})
class IslandFailed:
    """``island`` failed: receives from it stop waiting."""

    island: int


@declare("release_tenant", {"tenant": str})
class ReleaseTenant:
    """``tenant`` was removed: drop every buffer it holds."""

    tenant: str


@declare("peers", {"hosts": ("list", {"island": int, "host": int, "node": str, "pid": int, "channel": str,
                                       "data": str})})
class PeerTable:
    """Every host of the runtime (after a start or an island's restart): who a host may talk to, and how."""

    hosts: list


CONTROL = (OpenSession, EndSession, Grant, Revoke, SetWeight, SetBudgets, IslandFailed, ReleaseTenant, PeerTable)
