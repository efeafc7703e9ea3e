"""The runtime's exceptions: one base class, one subclass per kind of failure."""

from __future__ import annotations


class PathwaysError(Exception):
    """Base of every error the runtime raises on purpose."""


class ResourceError(PathwaysError):
    """A slice cannot be placed: too large, unknown island, bad axes, or over quota."""


class ProgramError(PathwaysError):
    """A program or compiled function is malformed or called with the wrong values."""


class IslandFailedError(PathwaysError):
    """An island (or one of its hosts) died or stopped answering in time."""


class TenantAccessError(PathwaysError):
    """A tenant referenced a slice or buffer owned by another tenant."""


class WireFormatError(PathwaysError):
    """A control message was malformed or had an unsupported version."""


class ClusterSuspendedError(PathwaysError):
    """The cluster's admin suspended it: its arrays are saved, and calls work again once it is resumed."""


_KINDS: dict[str, type[PathwaysError]] = {
    cls.__name__: cls
    for cls in (
        PathwaysError,
        ResourceError,
        ProgramError,
        IslandFailedError,
        TenantAccessError,
        WireFormatError,
        ClusterSuspendedError,
    )
}


def to_wire(exc: BaseException) -> tuple[str, str]:
    """(kind, message) for an exception raised on a host, to be re-raised in the client."""
    if isinstance(exc, PathwaysError):
        return type(exc).__name__, str(exc)
    return "ProgramError", f"{type(exc).__name__}: {exc}"


def from_wire(kind: str, message: str) -> PathwaysError:
    """The exception a host's ``(kind, message)`` stands for, to raise in the client; unknown kinds become
    PathwaysError."""
    return _KINDS.get(kind, PathwaysError)(message)
