"""The ops of a fragment, defined once: what each reads and writes, its wire form, and its validation.

Lowering (client side) builds these; an island decodes a fragment's template
once into them, checks it against what the island can hold (``Template.check``),
and its scheduler and executor use the same objects. Ops name values by *slot*
(a position in the program); each call supplies the buffer ids: its inputs,
and a block of fresh ids minted by the client for everything it produces.

A template that passes ``check`` cannot name a slot out of range, read a value
that no earlier op (or input) wrote, write an input, free a value it does not
own, name a slice, host or island that does not exist, or announce an array
larger than an island host's memory.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from pathways import op_wire, wire
from pathways.errors import ProgramError, ResourceError, WireFormatError
from pathways.op_wire import FREES, INT, SLOTS, TEXT, Codec, many, on_wire, optional
from pathways.sharding import check_spec, dtype_from_wire, spec_from_wire

WireSpec = tuple  # a PartitionSpec's wire form: entries None | axis name | tuple of axis names
Region = tuple[tuple[int, int], ...]  # (start, stop) per dimension

MAX_OPS = 1 << 17
MAX_VALUES = 1 << 24
MAX_SHARDS = 1 << 14
MAX_RANK = 64
_HASH = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class Limits:
    """What one island can hold; every template and put is checked against it before it is admitted."""

    island: int
    islands: int
    hosts: int
    devices_per_host: int
    memory_bytes: int  # per host: what arrays landing on one host may take in all
    device_bytes: int  # per device: what one device's shard may take


def spec_of(entries: Sequence) -> WireSpec:
    """A hashable wire spec from its msgpack form."""
    return tuple(tuple(e) if isinstance(e, list) else e for e in entries)


def spec_to_list(spec: WireSpec) -> list:
    """A wire spec in its msgpack form (tuples of axis names as lists)."""
    return [list(e) if isinstance(e, tuple) else e for e in spec]


def spec_axes(spec: WireSpec) -> list[str]:
    """Every mesh axis a wire spec names, in order."""
    return [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]


def dtype_of(name: str) -> np.dtype:
    """A dtype from its wire name (JAX's extended ones included), or WireFormatError."""
    try:
        return dtype_from_wire(name)
    except TypeError:
        raise WireFormatError(f"unknown dtype {name!r}") from None


@dataclass(frozen=True)
class Aval:
    """An array's global shape and dtype."""

    shape: tuple[int, ...]
    dtype: str

    @classmethod
    def from_wire(cls, d: Mapping) -> Aval:
        """An aval from its msgpack form."""
        return cls(tuple(d["shape"]), d["dtype"])

    def to_wire(self) -> dict:
        """The aval's msgpack form."""
        return {"shape": list(self.shape), "dtype": self.dtype}

    @property
    def nbytes(self) -> int:
        """The array's size in bytes."""
        return math.prod(self.shape) * dtype_of(self.dtype).itemsize

    def check(self, what: str) -> None:
        """ProgramError unless the shape is a valid array shape; WireFormatError for an unknown dtype."""
        if len(self.shape) > MAX_RANK or any(n < 0 for n in self.shape):
            raise ProgramError(f"{what}: shape {self.shape} is not a valid array shape")
        dtype_of(self.dtype)

    def describe(self) -> str:
        """Dtype and shape, e.g. ``float32[4, 4]``."""
        return f"{self.dtype}{list(self.shape)}"


@dataclass(frozen=True)
class SliceDesc:
    """A virtual slice as placed on an island: its mesh and the (host, local device) of each mesh device."""

    key: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    devices: tuple[tuple[int, int], ...]

    @classmethod
    def from_wire(cls, d: Mapping) -> SliceDesc:
        """A slice description from its msgpack form."""
        return cls(d["key"], tuple(d["shape"]), tuple(d["axes"]), tuple(tuple(x) for x in d["devices"]))

    def to_wire(self) -> dict:
        """The slice description's msgpack form."""
        return {"key": self.key, "shape": list(self.shape), "axes": list(self.axes),
                "devices": [list(x) for x in self.devices]}

    @property
    def hosts(self) -> tuple[int, ...]:
        """The island's hosts this slice spans, in order."""
        return tuple(sorted({h for h, _ in self.devices}))

    def check(self, limits: Limits) -> None:
        """ProgramError unless the mesh matches its devices and its axis names are distinct; ResourceError when a
        device does not exist on the island ``limits`` describes."""
        what = f"slice {self.key!r}"
        if (not self.shape or len(self.shape) != len(self.axes) or any(n < 1 for n in self.shape)
                or math.prod(self.shape) != len(self.devices)):
            raise ProgramError(f"{what}: mesh {self.shape} over axes {self.axes} does not match its "
                               f"{len(self.devices)} devices")
        if len(set(self.axes)) != len(self.axes) or not all(self.axes):
            raise ProgramError(f"{what}: axis names {self.axes} must be distinct and non-empty")
        if len(set(self.devices)) != len(self.devices):
            raise ProgramError(f"{what}: a device appears twice")
        for h, d in self.devices:
            if not (0 <= h < limits.hosts and 0 <= d < limits.devices_per_host):
                raise ResourceError(f"{what}: device (host {h}, device {d}) does not exist on island "
                                    f"{limits.island} ({limits.hosts} host(s) x {limits.devices_per_host} devices)")

    def check_spec(self, spec: WireSpec, shape: Sequence[int] | None, what: str) -> None:
        """The spec names only this slice's axes, each once; with ``shape``, it also divides the array."""
        if not isinstance(spec, tuple):
            raise ProgramError(f"{what}: a sharding spec must be a list, got {spec!r}")
        axes = spec_axes(spec)
        unknown = [a for a in axes if a not in self.axes]
        if unknown or len(set(axes)) != len(axes):
            raise ProgramError(f"{what}: spec {list(spec)} must name each of the slice's axes {self.axes} at "
                               "most once")
        if shape is not None:
            check_spec(spec_from_wire(spec), shape, self.shape, self.axes, what)


class Op:
    """Base of the fragment ops: which slots it reads, writes, and frees right after it runs.

    An op kind is declared once, as its class: ``@op_wire.declare(kind)``, each field ``on_wire`` (its wire name
    and codec), ``reads``/``writes`` (and ``other_slots``), and ``check``, its meaning against an island. What a
    host does with it is declared once too: its handler, on the host side."""

    KIND: ClassVar[str]
    RECEIVES: ClassVar[bool] = False  # it takes a value another island sends (a fragment holding one may park)
    frees: tuple[int, ...]

    def reads(self) -> tuple[int, ...]:
        """The slots the op reads."""
        return ()

    def writes(self) -> tuple[int, ...]:
        """The slots the op writes."""
        return ()

    def other_slots(self) -> tuple[int, ...]:
        """Slots the op names but neither reads nor writes here (a send's receive slot): checked in range too."""
        return ()

    def executables(self) -> tuple[str, ...]:
        """The content hashes of the executables the op runs."""
        return ()

    def touches(self) -> tuple[int, ...]:
        """Every slot the op reads or writes (worked out once: an executor asks twice per op it runs)."""
        touched = self.__dict__.get("_touches")
        if touched is None:
            touched = self.reads() + self.writes()
            object.__setattr__(self, "_touches", touched)  # a frozen op: a cache, not a field
        return touched

    def label(self) -> str:
        """The op's name in traces and errors."""
        return self.KIND

    def check(self, template: Template, limits: Limits) -> None:
        """Meaning beyond the schema, once the template's slot bookkeeping has been checked."""


SPEC = Codec(wire.SPEC, spec_of, spec_to_list)
SPECS = many(SPEC)
AVAL = Codec(wire.AVAL, Aval.from_wire, Aval.to_wire)


@op_wire.declare("exec")
class Exec(Op):
    """Run compiled function ``exe`` on a slice: inputs and outputs by slot, with their shardings."""

    exe: str = on_wire(TEXT)
    slice: str = on_wire(TEXT)
    inputs: tuple[int, ...] = on_wire(SLOTS, "in")
    outputs: tuple[int, ...] = on_wire(SLOTS, "out")
    in_specs: tuple[WireSpec, ...] = on_wire(SPECS)
    out_specs: tuple[WireSpec, ...] = on_wire(SPECS)
    name: str = on_wire(TEXT)
    frees: tuple[int, ...] = on_wire(FREES, default=())
    donate: tuple[int, ...] = on_wire(optional(SLOTS), default=())  # positions in ``inputs`` XLA may reuse

    def reads(self) -> tuple[int, ...]:
        """The input slots."""
        return self.inputs

    def writes(self) -> tuple[int, ...]:
        """The output slots."""
        return self.outputs

    def executables(self) -> tuple[str, ...]:
        """The one it runs."""
        return (self.exe,)

    def label(self) -> str:
        """The compiled function's name."""
        return self.name

    def check(self, template: Template, limits: Limits) -> None:
        """The executable hash is a sha256 digest, the slice is the fragment's, one valid spec per input and output,
        and the donated positions are distinct inputs."""
        what = f"op exec {self.name!r}"
        if not _HASH.match(self.exe):
            raise WireFormatError(f"{what}: executable hash {self.exe[:80]!r} is not a sha256 hex digest")
        desc = template.slice(self.slice, what)
        if len(self.in_specs) != len(self.inputs) or len(self.out_specs) != len(self.outputs):
            raise ProgramError(f"{what}: {len(self.inputs)} inputs and {len(self.outputs)} outputs but "
                               f"{len(self.in_specs)} and {len(self.out_specs)} specs")
        for k, spec in enumerate(self.in_specs + self.out_specs):
            desc.check_spec(spec, None, f"{what} spec {k}")
        if len(set(self.donate)) != len(self.donate) or not all(0 <= d < len(self.inputs) for d in self.donate):
            raise ProgramError(f"{what}: donated positions {list(self.donate)} are not distinct positions of its "
                               f"{len(self.inputs)} inputs")


@dataclass(frozen=True)
class Route:
    """The shards one source host sends to one destination host."""

    host: int
    to: int
    shards: tuple[Region, ...]

    @classmethod
    def from_wire(cls, d: Mapping) -> Route:
        """A route from its msgpack form; WireFormatError on a malformed region."""
        return cls(d["host"], d["to"], tuple(region_of(s) for s in d["shards"]))

    def to_wire(self) -> dict:
        """The route's msgpack form."""
        return {"host": self.host, "to": self.to, "shards": [[list(r) for r in s] for s in self.shards]}


def region_of(shard: Sequence[Sequence[int]]) -> Region:
    """A region from its wire form; raises WireFormatError unless it is (start, stop) pairs, start <= stop."""
    out = []
    for pair in shard:
        if len(pair) != 2 or not 0 <= pair[0] <= pair[1]:
            raise WireFormatError(f"a shard region is (start, stop) pairs with 0 <= start <= stop, got {pair!r}")
        out.append((int(pair[0]), int(pair[1])))
    if len(out) > MAX_RANK:
        raise WireFormatError(f"a shard region of rank {len(out)} is over the limit of {MAX_RANK}")
    return tuple(out)


ROUTES = many(Codec({"host": int, "to": int, "shards": ("list", ("list", ("list", int)))}, Route.from_wire,
                    Route.to_wire))


@op_wire.declare("send")
class Send(Op):
    """Send a value's shards to island ``island``'s hosts (another island's, or other hosts of this one), where a
    Recv with receive slot ``key`` takes them."""

    source: int = on_wire(INT, "in")
    key: int = on_wire(INT)
    island: int = on_wire(INT)
    routes: tuple[Route, ...] = on_wire(ROUTES)
    frees: tuple[int, ...] = on_wire(FREES, default=())

    def reads(self) -> tuple[int, ...]:
        """The value sent."""
        return (self.source,)

    def other_slots(self) -> tuple[int, ...]:
        """The receive slot (a value of this call, written on the receiving side)."""
        return (self.key,)

    def check(self, template: Template, limits: Limits) -> None:
        """The target island exists, the receive slot is a value of this call, and each route names hosts that exist.
        """
        if not 0 <= self.island < limits.islands:
            raise ResourceError(f"op send: island {self.island} is not an island of this cluster "
                                f"({limits.islands} islands)")
        if not template.n_inputs <= self.key < template.n_values:
            raise ProgramError(f"op send: receive slot {self.key} is not a value of this call")
        check_routes(self.routes, limits, "op send", min_shards=0)


@dataclass(frozen=True)
class Expect:
    """What destination host ``host`` of a receive waits for: ``count`` pieces, from these source hosts
    (each sending the shards its route names)."""

    host: int
    count: int
    senders: tuple[int, ...]
    shards: dict[int, frozenset[Region]]  # source host -> the shards it sends here


@op_wire.declare("recv")
class Recv(Op):
    """Take the shards island ``src`` sends for slot ``out`` and land them as an array on a slice; ``routes`` is
    the transfer's plan (which source host sends which shards to which host here), the same as the Send's."""

    RECEIVES: ClassVar[bool] = True
    out: int = on_wire(INT)
    slice: str = on_wire(TEXT)
    spec: WireSpec = on_wire(SPEC)
    aval: Aval = on_wire(AVAL)
    src: int = on_wire(INT)
    routes: tuple[Route, ...] = on_wire(ROUTES)
    frees: tuple[int, ...] = on_wire(FREES, default=())

    def writes(self) -> tuple[int, ...]:
        """The slot the landed array fills."""
        return (self.out,)

    def expected(self, host: int) -> Expect | None:
        """What lands on ``host`` (None: nothing of this receive does)."""
        mine = [r for r in self.routes if r.to == host]
        if not mine:
            return None
        return Expect(host, sum(len(r.shards) for r in mine), tuple(r.host for r in mine),
                      {r.host: frozenset(r.shards) for r in mine})

    def check(self, template: Template, limits: Limits) -> None:
        """The array fits the slice and its hosts, the source island exists, and each route names hosts that exist
        and regions of the array."""
        what = f"op recv of {self.aval.describe()}"
        self.aval.check(what)
        desc = template.slice(self.slice, what)
        desc.check_spec(self.spec, self.aval.shape, what)
        check_fits(self.aval, self.spec, desc, limits, what)
        if not 0 <= self.src < limits.islands:
            raise ResourceError(f"{what}: source island {self.src} is not an island of this cluster "
                                f"({limits.islands} islands)")
        check_routes(self.routes, limits, what, min_shards=1)
        for r in self.routes:
            for shard in r.shards:
                if len(shard) != len(self.aval.shape) or any(b > n for (_, b), n in zip(shard, self.aval.shape)):
                    raise ProgramError(f"{what}: shard {shard} is not a region of an array of shape {self.aval.shape}")


@op_wire.declare("reshard")
class Reshard(Op):
    """Reshard a value to another spec on the same host (no transfer)."""

    source: int = on_wire(INT, "in")
    out: int = on_wire(INT)
    slice: str = on_wire(TEXT)
    spec: WireSpec = on_wire(SPEC)
    frees: tuple[int, ...] = on_wire(FREES, default=())

    def reads(self) -> tuple[int, ...]:
        """The value resharded."""
        return (self.source,)

    def writes(self) -> tuple[int, ...]:
        """The resharded value's slot."""
        return (self.out,)

    def check(self, template: Template, limits: Limits) -> None:
        """The slice is the fragment's and the spec names only its axes."""
        template.slice(self.slice, "op reshard").check_spec(self.spec, None, "op reshard")


def check_routes(routes: Sequence[Route], limits: Limits, what: str, min_shards: int) -> None:
    """ProgramError unless each route joins hosts that exist, with ``min_shards`` to MAX_SHARDS shards, and
    there are no more routes than host pairs."""
    if len(routes) > limits.hosts * limits.hosts:
        raise ProgramError(f"{what}: {len(routes)} routes between {limits.hosts}-host islands")
    for r in routes:
        if not (0 <= r.host < limits.hosts and 0 <= r.to < limits.hosts and min_shards <= len(r.shards) <= MAX_SHARDS):
            raise ProgramError(f"{what}: route host {r.host} -> host {r.to} with {len(r.shards)} shards does not "
                               f"fit {limits.hosts}-host islands")


def check_fits(aval: Aval, spec: WireSpec, desc: SliceDesc, limits: Limits, what: str) -> None:
    """ResourceError unless an array of ``aval`` sharded by ``spec`` on ``desc`` fits each host it lands on
    (on CPU a host's devices share its memory, so a replicated array counts once per device)."""
    sizes = dict(zip(desc.axes, desc.shape))
    parts = math.prod(sizes.get(a, 1) for a in spec_axes(spec))
    shard = aval.nbytes // max(parts, 1)
    per_host = max(sum(1 for h, _ in desc.devices if h == host) for host in desc.hosts)
    need = shard * per_host
    if shard > limits.device_bytes or need > limits.memory_bytes:
        raise ResourceError(f"{what}: {aval.describe()} needs {need / 2**30:.3g} GiB on a host of island "
                            f"{limits.island}, which holds at most {limits.memory_bytes / 2**30:.3g} GiB "
                            f"({limits.device_bytes / 2**30:.3g} GiB per device)")


@dataclass(frozen=True, eq=False)
class Template:
    """One island's share of a program, the same on every call: ops by slot, and the slices they run on.

    Compared and hashed by identity: an island keeps one per distinct encoding (``TemplateCache``), and
    host-local state about its ops is keyed by it.
    """

    program: str
    n_inputs: int
    n_values: int
    slices: Mapping[str, SliceDesc]
    ops: tuple[Op, ...]

    @functools.cached_property
    def executables(self) -> frozenset[str]:
        """The content hashes of the executables its ops run (what an island checks a tenant has sent)."""
        return frozenset(exe for op in self.ops for exe in op.executables())

    @functools.cached_property
    def touched(self) -> tuple[int, ...]:
        """The slots its ops read or write, op after op (an island counts a call's pending uses of them at once)."""
        return tuple(slot for op in self.ops for slot in op.touches())

    @functools.cached_property
    def receives(self) -> bool:
        """Whether an op of it receives a value from another island (such a fragment may park on the way)."""
        return any(op.RECEIVES for op in self.ops)

    def slice(self, key: str, what: str) -> SliceDesc:
        """The fragment's slice ``key``; ProgramError (prefixed by ``what``) when the fragment has none by that name."""
        desc = self.slices.get(key)
        if desc is None:
            raise ProgramError(f"{what}: slice {key!r} is not one of this fragment's slices")
        return desc

    def encode(self) -> bytes:
        """The template's wire bytes."""
        return wire.encode("template", {"program": self.program, "n_inputs": self.n_inputs, "n_values": self.n_values,
                                        "slices": {k: s.to_wire() for k, s in self.slices.items()},
                                        "ops": [op_wire.to_wire(op) for op in self.ops]})

    @classmethod
    def decode(cls, blob: bytes) -> Template:
        """Decode and check the template's structure: slots in range, reads after writes, frees of its own."""
        msg = wire.decode(blob, "template")
        ops = [op_wire.decode(d, f"template.ops[{i}]") for i, d in enumerate(msg["ops"])]
        slices = {k: SliceDesc.from_wire(v) for k, v in msg["slices"].items()}
        template = cls(msg["program"][:200], msg["n_inputs"], msg["n_values"], slices, tuple(ops))
        template._check_slots()
        return template

    def _check_slots(self) -> None:
        if not 0 <= self.n_inputs <= self.n_values <= MAX_VALUES:
            raise ProgramError(f"fragment of {self.program!r}: {self.n_inputs} inputs of {self.n_values} values is "
                               f"not a valid program (at most {MAX_VALUES} values)")
        if len(self.ops) > MAX_OPS:
            raise ProgramError(f"fragment of {self.program!r}: {len(self.ops)} ops, over the limit of {MAX_OPS}")
        written: set[int] = set()
        freed: set[int] = set()
        for i, op in enumerate(self.ops):
            where = f"fragment of {self.program!r}, op {i} ({op.KIND})"
            slots = op.reads() + op.writes() + op.frees + op.other_slots()
            bad = [s for s in slots if not 0 <= s < self.n_values]
            if bad:
                raise ProgramError(f"{where}: slot(s) {bad} out of range for {self.n_values} values")
            for s in op.reads():
                if s in freed:
                    raise ProgramError(f"{where}: reads slot {s} after an earlier op freed it")
                if s >= self.n_inputs and s not in written:
                    raise ProgramError(f"{where}: reads slot {s}, which no earlier op wrote and is not an input")
            for s in op.writes():
                if s < self.n_inputs or s in written:
                    raise ProgramError(f"{where}: writes slot {s}, which is an input or was already written")
                written.add(s)
            if len(set(op.writes())) != len(op.writes()):
                raise ProgramError(f"{where}: writes a slot twice")
            for s in op.frees:
                if s not in written or s in freed:
                    raise ProgramError(f"{where}: frees slot {s}, which is not a value this fragment produced")
                freed.add(s)

    def check(self, limits: Limits) -> None:
        """Meaning against an island: slices, hosts, islands and sizes exist and fit (ProgramError/ResourceError)."""
        for desc in self.slices.values():
            desc.check(limits)
        for i, op in enumerate(self.ops):
            try:
                op.check(self, limits)
            except (ProgramError, ResourceError, WireFormatError) as exc:
                raise type(exc)(f"fragment of {self.program!r}, op {i}: {exc}") from None


wire.register("template", {"program": str, "n_inputs": int, "n_values": int, "slices": ("map", wire.SLICE),
                           "ops": ("list", dict)})


class TemplateCache:
    """Decoded and checked templates by their bytes: a program's template arrives with every call, so each
    process decodes and checks it once (``check`` is the island's meaning check, e.g. ``Template.check``).
    Each tenant's templates are kept apart, at most ``per_tenant`` of them (its ``templates`` budget, when the
    caller names one), oldest first out: a tenant sending endless new templates only evicts its own. A template
    that failed is remembered as the error it raised."""

    def __init__(self, check: Callable[[Template], None] | None = None, size: int = 256) -> None:
        self._check = check
        self._size = size
        self._decoded: dict[str, dict[bytes, Template | Exception]] = {}

    def get(self, blob: bytes, tenant: str = "", per_tenant: int | None = None,
            before_decode: Callable[[bytes], None] | None = None) -> Template:
        """The checked template ``blob`` encodes, decoded on first sight (after ``before_decode``, a cheap check
        that may refuse it first); raises the error it failed with, every time."""
        template = self.cached(blob, tenant)
        if template is not None:
            return template
        if before_decode is not None:
            before_decode(blob)
        try:
            template = Template.decode(blob)
            if self._check is not None:
                self._check(template)
        except (ProgramError, ResourceError, WireFormatError) as exc:
            template = exc
        cache = self._decoded.setdefault(tenant, {})
        limit = max(1, self._size if per_tenant is None else per_tenant)
        while len(cache) >= limit:
            cache.pop(next(iter(cache)))
        cache[blob] = template
        if isinstance(template, Exception):
            raise type(template)(str(template))
        return template

    def cached(self, blob: bytes, tenant: str = "") -> Template | None:
        """The checked template ``blob`` encodes if it was decoded before (raising the error it failed with), else
        None: a call's fast path."""
        cache = self._decoded.get(tenant)
        template = None if cache is None else cache.get(blob)
        if isinstance(template, Exception):
            raise type(template)(str(template))
        return template

    def forget(self, tenant: str) -> None:
        """Drop a tenant's templates (its last session here ended)."""
        self._decoded.pop(tenant, None)


def declared_ops(blob: bytes) -> int:
    """How many ops a template's bytes hold, counted without decoding them: what an island checks against the
    sender's ``program_ops`` budget before the costly decode. -1 if unreadable (the full decode says why)."""
    try:
        unpacker = _seek(blob, "ops")
        return 0 if unpacker is None else unpacker.read_array_header()
    except Exception:  # not a map, or "ops" not a list
        return -1


def _seek(blob: bytes, field: str) -> Any:
    """A msgpack unpacker of ``blob`` (a template message) standing at the value of ``field``, having skipped
    what comes before it without building it; None when the message is too short to have it. Raises on bytes
    that are not a msgpack array."""
    unpacker = wire.msgpack.Unpacker(raw=False, strict_map_key=False, max_buffer_size=max(len(blob), 1))
    unpacker.feed(blob)
    position = wire.position("template", field)
    if unpacker.read_array_header() <= position:
        return None
    for _ in range(position):
        unpacker.skip()
    return unpacker


def declared_values(blob: bytes) -> int:
    """How many values a template says it has, even when it is otherwise malformed (1 when unreadable): the
    id range a refused call's outputs occupy."""
    try:
        unpacker = _seek(blob, "n_values")
        n = None if unpacker is None else unpacker.unpack()
    except Exception:  # a template that is not even a map
        return 1
    return n if isinstance(n, int) and 0 < n <= MAX_VALUES else 1
