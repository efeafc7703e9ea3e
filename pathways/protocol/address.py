"""The runtime's address: ``pathways://HOST:PORT``, the resource manager's client endpoint."""

from __future__ import annotations

from pathways.errors import PathwaysError

SCHEME = "pathways://"


def format_address(host: str, port: int) -> str:
    """``pathways://HOST:PORT`` (an IPv6 host in brackets)."""
    return f"{SCHEME}[{host}]:{port}" if ":" in host else f"{SCHEME}{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """(host, port) of ``pathways://HOST:PORT`` (the scheme may be left out); PathwaysError saying what a valid
    address looks like otherwise."""
    text = address.strip()
    rest = text[len(SCHEME):] if text.startswith(SCHEME) else text
    if "://" in rest:
        raise PathwaysError(f"{address!r} is not a pathways address; it looks like pathways://HOST:PORT, the "
                            "address `pathways up` prints")
    host, sep, port = rest.rpartition(":")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise PathwaysError(f"{address!r} is not a pathways address; it looks like pathways://HOST:PORT, the "
                            "address `pathways up` prints")
    return host, int(port)
