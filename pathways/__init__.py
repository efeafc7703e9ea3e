"""pathways: a Pathways-style single-controller runtime for JAX on Ray.

    import pathways as pw
    pw.init()
    s = pw.slice((2, 2), ("data", "model"))
    x = pw.put(np.ones((4, 4), np.float32), s, P("data", None))
    f = pw.jit(lambda a: a @ a.T, slice=s, in_specs=(P("data", None),))
    print(np.asarray(f(x)))

Only the errors load eagerly; everything else loads on first use, so island
hosts, which import only the vocabulary, never load the client, and the
``pathways`` command does not pay for JAX unless it needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

from pathways.cluster import ClusterStatus
from pathways.errors import (
    ClusterSuspendedError,
    IslandFailedError,
    PathwaysError,
    ProgramError,
    ResourceError,
    TenantAccessError,
    WireFormatError,
)

_LAZY = {
    "Topology": "pathways.topology",
    "Program": "pathways.graph",
    "ClusterStatus": "pathways.cluster",
    "Admin": "client.admin",
    "admin": "client.admin",
    "Array": "client.array",
    "put": "client.array",
    "CompiledFunction": "client.jit",
    "jit": "client.jit",
    "filter_jit": "client.filter",
    "trace": "client.profiler",
    "Timeouts": "client.runtime",
    "init": "client.session",
    "shutdown": "client.session",
    "VirtualSlice": "client.slices",
    "release": "client.slices",
    "slice": "client.slices",
    "ProgramFunction": "client.program",
    "program": "client.program",
    "transfer": "client.program",
    "status": "client.status",
    "WeightSync": "client.weight_sync",
}
_MODULES = {"elastic": "client.elastic", "nnx": "client.nnx", "pipeline": "client.pipeline", "rl": "client.rl",
            "zero": "client.zero"}

__all__ = [
    "Admin", "Array", "ClusterStatus", "ClusterSuspendedError", "CompiledFunction", "IslandFailedError",
    "PathwaysError", "Program", "ProgramError", "ProgramFunction", "ResourceError", "TenantAccessError", "Timeouts",
    "Topology", "VirtualSlice", "WeightSync", "WireFormatError", "admin", "elastic", "filter_jit", "init", "jit", "nnx",
    "pipeline", "program", "put", "release", "rl", "shutdown", "slice", "status", "trace", "transfer", "zero",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    else:
        raise AttributeError(f"module 'pathways' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
