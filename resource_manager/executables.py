"""A host's executable cache: serialized StableHLO compiled once per content hash and device set."""

from __future__ import annotations

import hashlib
import threading
import warnings
from typing import Any

import jax
from jax.sharding import Mesh, NamedSharding

from pathways.errors import ProgramError, WireFormatError
from pathways.sharding import spec_from_wire


def content_hash(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


class ExecutableCache:
    """Blobs by hash (verified), compiled executables by (hash, mesh, shardings).

    ``compiles`` only grows on a miss, which is what lets a test prove that a
    second call with the same shapes does not recompile.
    """

    def __init__(self) -> None:
        self._blobs: dict[str, bytes] = {}
        self._compiled: dict[tuple, Any] = {}
        self._lock = threading.Lock()
        self.compiles = 0
        self.hits = 0

    def add(self, exe_hash: str, blob: bytes) -> None:
        if exe_hash in self._blobs:
            return
        if content_hash(blob) != exe_hash:
            raise WireFormatError(f"executable bytes do not match their hash {exe_hash[:12]}…; refusing them")
        with self._lock:
            self._blobs[exe_hash] = blob

    def get(self, exe_hash: str, mesh: Mesh, mesh_key: tuple, in_specs: list, out_specs: list,
            donate: tuple[int, ...] = ()) -> Any:
        key = (exe_hash, mesh_key, repr(in_specs), repr(out_specs), donate)
        compiled = self._compiled.get(key)
        if compiled is not None:
            self.hits += 1
            return compiled
        blob = self._blobs.get(exe_hash)
        if blob is None:
            raise ProgramError(
                f"executable {exe_hash[:12]}… was never sent to this island; the client must include it "
                "with the first fragment that uses it")
        exported = jax.export.deserialize(bytearray(blob))
        in_sh = tuple(NamedSharding(mesh, spec_from_wire(s)) for s in in_specs)
        out_sh = tuple(NamedSharding(mesh, spec_from_wire(s)) for s in out_specs)
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) for a, s in zip(exported.in_avals, in_sh)]
        with warnings.catch_warnings():  # an input no output can reuse is simply not reused
            warnings.filterwarnings("ignore", message="Some donated buffers were not usable")
            compiled = jax.jit(exported.call, in_shardings=in_sh, out_shardings=out_sh,
                               donate_argnums=donate).lower(*avals).compile()
        with self._lock:
            self._compiled[key] = compiled
            self.compiles += 1
        return compiled

    def __len__(self) -> int:
        return len(self._compiled)


def donatable(op: dict, ids: list[int], entries: list, table: Any) -> tuple[int, ...]:
    """The input positions of an exec op whose buffers this host gives to XLA as donated.

    ``op["donate"]`` is what the client asked for (the inputs' last use in its program). A position is
    refused, and that input simply not donated, when its buffer is also passed at another position, or
    when another pending op (a later op, another fragment, a send still running) still reads it: the
    buffer table's use count says so. Positions that are not inputs of the op fail the op.
    """
    asked = op.get("donate") or ()
    n = len(ids)
    if any(not isinstance(p, int) or isinstance(p, bool) or not 0 <= p < n for p in asked) or \
            len(set(asked)) != len(asked):
        raise ProgramError(f"exec {op.get('name')!r}: donate {list(asked)} must name distinct input positions "
                           f"below {n}")
    return tuple(sorted(p for p in asked if ids.count(ids[p]) == 1 and table.sole_use(ids[p])
                        and isinstance(entries[p].value, jax.Array)))
