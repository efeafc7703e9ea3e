"""A host's executable cache: serialized StableHLO per tenant, compiled once per content hash and device set.

Each tenant sees only the executables its own clients sent (another tenant can
neither use nor detect them), and pays for them: its serialized executables
have a byte budget, its ``executable_bytes`` (a message that would go over it
is refused), and compiled
executables are charged to it against a budget of their own, the least
recently used evicted first (they compile again on their next use).

Before anything compiles, its shapes are checked: XLA aborts the whole
process on a shape whose size overflows, so an executable naming one is
refused, and one whose inputs or outputs cannot fit the host is a
ResourceError, never an allocation. After compiling, the outputs and
temporaries XLA plans for must fit what the machine has free.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from pathways.budgets import over
from pathways.errors import ProgramError, ResourceError, WireFormatError
from pathways.ops import Aval, Limits, SliceDesc, WireSpec, check_fits
from pathways.sharding import spec_from_wire
from resource_manager.host.memory import fits_now

BLOB_BUDGET = 512 << 20  # serialized executables one tenant may keep on a host
COMPILED_BUDGET = 2 << 30  # estimated bytes of compiled executables one tenant may keep on a host
COMPILED_ENTRIES = 4096  # compiled executables one tenant may keep on a host
_TENSOR = re.compile(r"tensor<((?:\d+x)+)[a-z]")
_OVERFLOW = 1 << 62


def content_hash(blob: bytes) -> str:
    """The sha256 hex digest that names an executable (the client computes the same)."""
    return hashlib.sha256(blob).hexdigest()


@dataclass
class Compiled:
    """A compiled executable: its callable, its estimated size, what one run allocates (outputs and temporaries,
    checked against free memory), and what stays resident after it (its outputs, on this host)."""

    call: Any
    nbytes: int
    out_bytes: int
    resident_bytes: int
    out_nbytes: tuple[int | None, ...] = ()  # each output's ``jax.Array.nbytes``, known without asking it


class ExecutableCache:
    """Blobs (verified, per tenant) and compiled executables (per tenant, LRU within a byte budget).

    ``compiles`` only grows on a miss, which is what lets a test prove that a second call with the same
    shapes does not recompile.
    """

    def __init__(self, limits: Limits, blob_budget: int | Callable[[str], int] = BLOB_BUDGET,
                 compiled_budget: int = COMPILED_BUDGET) -> None:
        self.limits = limits
        # per tenant: the admin's ``executable_bytes`` budget, or one number for every tenant
        self._blob_budget = blob_budget if callable(blob_budget) else (lambda tenant: blob_budget)
        self.compiled_budget = compiled_budget
        self._lock = threading.Lock()
        self._exported: dict[str, Any] = {}  # hash -> jax.export.Exported, shared by the tenants that sent it
        self._blobs: dict[str, dict[str, int]] = {}  # tenant -> {hash: blob bytes}
        self.version = 0  # grows whenever blobs are forgotten, so a check that a tenant has some can be remembered
        self._bytes: dict[str, bytes] = {}  # hash -> the blob itself (what a snapshot saves)
        self._compiled: dict[str, OrderedDict[tuple, Compiled]] = {}
        self.compiles = 0
        self.hits = 0
        self.evictions = 0

    # -- blobs --------------------------------------------------------------------------------------------
    def add(self, tenant: str, exe_hash: str, blob: bytes) -> None:
        """Keep ``blob`` for ``tenant``; WireFormatError if it does not match its hash, ProgramError if it
        names an impossible shape, ResourceError if the tenant's budget is full."""
        held = self._blobs.setdefault(tenant, {})
        if exe_hash in held:
            return
        if content_hash(blob) != exe_hash:
            raise WireFormatError(f"executable bytes do not match their hash {exe_hash[:12]}…; refusing them")
        limit = self._blob_budget(tenant)
        if sum(held.values()) + len(blob) > limit:
            raise over("executable_bytes", sum(held.values()), len(blob), limit, "bytes")
        exported = self._exported.get(exe_hash)
        if exported is None:
            exported = _deserialize(exe_hash, blob)
        with self._lock:
            self._exported[exe_hash] = exported
            self._bytes[exe_hash] = bytes(blob)
            held[exe_hash] = len(blob)

    def has(self, tenant: str, exe_hash: str) -> bool:
        """Whether ``tenant``'s clients sent the executable ``exe_hash`` to this host."""
        return exe_hash in self._blobs.get(tenant, {})

    def drop_tenant(self, tenant: str) -> None:
        """Forget everything a tenant sent and compiled (the last of its sessions on this host ended)."""
        with self._lock:
            self.version += 1
            self._blobs.pop(tenant, None)
            self._compiled.pop(tenant, None)
            used = {h for blobs in self._blobs.values() for h in blobs}
            for h in [h for h in self._exported if h not in used]:
                del self._exported[h]
                self._bytes.pop(h, None)

    def blobs(self) -> dict[str, dict[str, bytes]]:
        """Every tenant's executables as sent, by hash: what a snapshot saves."""
        with self._lock:
            return {t: {h: self._bytes[h] for h in held} for t, held in self._blobs.items()}

    # -- compiled -----------------------------------------------------------------------------------------
    @staticmethod
    def key(exe_hash: str, desc: SliceDesc, in_specs: Sequence[WireSpec], out_specs: Sequence[WireSpec]) -> tuple:
        """What a compiled executable is kept by, but for its donated inputs: a caller running the same op again
        makes it once (``get``'s ``key``)."""
        return exe_hash, desc.devices, desc.shape, desc.axes, tuple(in_specs), tuple(out_specs)

    def cached(self, tenant: str, key: tuple, donate: tuple[int, ...] = ()) -> Compiled | None:
        """The compiled executable ``get`` would give, if it is compiled already (``key``: ``ExecutableCache.key``);
        None on a miss. ResourceError as ``get`` if a run cannot fit this host now."""
        per_tenant = self._compiled.get(tenant)
        full = key + (donate,)
        entry = None if per_tenant is None else per_tenant.get(full)
        if entry is None:
            return None
        per_tenant.move_to_end(full)
        self.hits += 1
        return self._fits(entry)

    def get(self, tenant: str, exe_hash: str, mesh: Mesh, desc: SliceDesc, in_specs: Sequence[WireSpec],
            out_specs: Sequence[WireSpec], donate: tuple[int, ...] = (), key: tuple | None = None) -> Any:
        """The compiled executable (compiling it on a miss); ResourceError if its outputs and temporaries
        cannot fit this host now. ``key``: ``ExecutableCache.key`` of the other arguments, when the caller kept it."""
        key = key or self.key(exe_hash, desc, in_specs, out_specs)
        entry = self.cached(tenant, key, donate)
        if entry is not None:
            return entry
        entry = self._compile(tenant, exe_hash, mesh, desc, in_specs, out_specs, donate)
        with self._lock:
            per_tenant = self._compiled.setdefault(tenant, OrderedDict())
            per_tenant[key + (donate,)] = entry
            self.compiles += 1
            self._evict(per_tenant)
        return self._fits(entry)

    def _fits(self, entry: Compiled) -> Compiled:
        if not fits_now(entry.out_bytes):
            raise ResourceError(f"a run of this computation allocates {entry.out_bytes / 2**30:.3g} GiB on island "
                                f"{self.limits.island}, more than the host has free now; try again later or "
                                "use a smaller shape")
        return entry

    def _compile(self, tenant: str, exe_hash: str, mesh: Mesh, desc: SliceDesc, in_specs: Sequence[WireSpec],
                 out_specs: Sequence[WireSpec], donate: tuple[int, ...]) -> Compiled:
        if not self.has(tenant, exe_hash):
            raise ProgramError(f"executable {exe_hash[:12]}… was never sent to island {self.limits.island} by "
                               "your clients; the client includes it with the first fragment that uses it")
        exported = self._exported[exe_hash]
        if len(in_specs) != len(exported.in_avals) or len(out_specs) != len(exported.out_avals):
            raise ProgramError(f"executable {exe_hash[:12]}… takes {len(exported.in_avals)} inputs and gives "
                               f"{len(exported.out_avals)} outputs, but the op names {len(in_specs)} and "
                               f"{len(out_specs)}")
        for k, (aval, spec) in enumerate(zip(exported.out_avals, out_specs)):
            check_fits(Aval(tuple(aval.shape), np.dtype(aval.dtype).name), spec, desc, self.limits,
                       f"output {k} of executable {exe_hash[:12]}…")
        in_sh = tuple(NamedSharding(mesh, spec_from_wire(s)) for s in in_specs)
        out_sh = tuple(NamedSharding(mesh, spec_from_wire(s)) for s in out_specs)
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(exported.in_avals, in_sh)]
        with warnings.catch_warnings():  # a donated input no output can reuse is simply not reused
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            compiled = jax.jit(exported.call, in_shardings=in_sh, out_shardings=out_sh,
                               donate_argnums=donate).lower(*avals).compile()
        stats = compiled.memory_analysis()
        out_bytes = 0 if stats is None else int(stats.output_size_in_bytes + stats.temp_size_in_bytes)
        resident = 0 if stats is None else int(stats.output_size_in_bytes)
        code = 0 if stats is None else int(stats.generated_code_size_in_bytes)
        blob = self._blobs.get(tenant, {}).get(exe_hash, 0)
        return Compiled(compiled, max(code, 4 * blob), out_bytes, resident, tuple(map(_nbytes, exported.out_avals)))

    def _evict(self, per_tenant: OrderedDict) -> None:
        while len(per_tenant) > 1 and (len(per_tenant) > COMPILED_ENTRIES
                                       or sum(e.nbytes for e in per_tenant.values()) > self.compiled_budget):
            per_tenant.popitem(last=False)
            self.evictions += 1

    def tenant_stats(self, tenant: str) -> dict[str, int]:
        """One tenant's compiled executables on this host: how many, their estimated bytes, and its blobs' bytes."""
        compiled = self._compiled.get(tenant, {})
        return {"executables": len(compiled), "compiled_bytes": sum(e.nbytes for e in compiled.values()),
                "blob_bytes": sum(self._blobs.get(tenant, {}).values())}

    def __len__(self) -> int:
        return sum(len(c) for c in self._compiled.values())


def _deserialize(exe_hash: str, blob: bytes) -> Any:
    """The Exported behind ``blob``, refused if any array it names has a size XLA cannot represent."""
    try:
        exported = jax.export.deserialize(bytearray(blob))
    except Exception as exc:  # not a serialized jax.export module
        raise WireFormatError(f"executable {exe_hash[:12]}… is not a serialized jax.export module: {exc}") from None
    for aval in list(exported.in_avals) + list(exported.out_avals):
        if _overflows(aval.shape, np.dtype(aval.dtype).itemsize):
            raise ResourceError(f"executable {exe_hash[:12]}… has an array of shape {tuple(aval.shape)}, whose "
                                "size overflows; no host can hold it")
    for dims in _TENSOR.findall(exported.mlir_module()):
        shape = [int(d) for d in dims.rstrip("x").split("x")]
        if _overflows(shape, 16):
            raise ResourceError(f"executable {exe_hash[:12]}… computes an intermediate of shape {tuple(shape)}, "
                                "whose size overflows; no host can hold it")
    return exported


def _nbytes(aval: Any) -> int | None:
    """The bytes of an array of ``aval`` (None for a dtype numpy does not know, such as a PRNG key's)."""
    try:
        return math.prod(int(d) for d in aval.shape) * np.dtype(aval.dtype).itemsize
    except TypeError:
        return None


def _overflows(shape: Sequence[int], itemsize: int) -> bool:
    size = itemsize
    for n in shape:
        size *= int(n)
    return size >= _OVERFLOW
