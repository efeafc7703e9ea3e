"""pathways: a Pathways-style single-controller runtime for JAX on Ray.

    import pathways as pw
    pw.init()
    s = pw.slice((2, 2), ("data", "model"))
    x = pw.put(np.ones((4, 4), np.float32), s, P("data", None))
    f = pw.jit(lambda a: a @ a.T, slice=s, in_specs=(P("data", None),))
    print(np.asarray(f(x)))
"""

from client.array import Array, put
from client.jit import CompiledFunction, jit
from client.session import Timeouts, init, shutdown
from client.slices import VirtualSlice, release, slice
from client.tracer import ProgramFunction, program, transfer
from pathways.errors import (
    IslandFailedError,
    PathwaysError,
    ProgramError,
    ResourceError,
    TenantAccessError,
    WireFormatError,
)
from pathways.program import Program
from pathways.status import status
from pathways.topology import Topology

__all__ = [
    "Array",
    "CompiledFunction",
    "IslandFailedError",
    "PathwaysError",
    "Program",
    "ProgramError",
    "ProgramFunction",
    "ResourceError",
    "TenantAccessError",
    "Timeouts",
    "Topology",
    "VirtualSlice",
    "WireFormatError",
    "init",
    "jit",
    "program",
    "put",
    "release",
    "shutdown",
    "slice",
    "status",
    "transfer",
]
