"""The msgpack wire format of every control message, versioned and validated on decode.

Arrays never travel inside these messages: they go as numpy buffers in Ray's
object store next to the message, or (same node) as addresses the receiver
copies from. A message that fails validation raises
``WireFormatError`` naming the field that was wrong, so a peer can refuse it
without crashing or touching any state.
"""

from __future__ import annotations

from typing import Any

import msgpack

from pathways.errors import WireFormatError

VERSION = 1

# A schema is a type, a tuple ("list", item) / ("map", value) / ("opt", inner),
# a dict of field -> schema (all required), or ANY.
ANY = object()
SPEC = ("list", ("opt", ("or", str, ("list", str))))
AVAL = {"shape": ("list", int), "dtype": str}
SLICE = {"key": str, "shape": ("list", int), "axes": ("list", str), "devices": ("list", ("list", int))}
ROUTE = {"host": int, "to": int, "shards": ("list", ("list", ("list", int)))}
# Shards lent by a sender on the same node: the receiver copies them out of process ``pid`` at ``addrs``.
DIRECT = {"pid": int, "host": int, "lease": int, "addrs": ("list", int), "channel": str}

FREES = ("opt", ("list", int))  # slots freed right after the op: intermediates at their last use
OPS: dict[str, dict] = {
    "exec": {"exe": str, "slice": str, "in": ("list", int), "out": ("list", int),
             "in_specs": ("list", SPEC), "out_specs": ("list", SPEC), "name": str, "frees": FREES},
    "send": {"in": int, "key": int, "island": int, "routes": ("list", ROUTE), "frees": FREES},
    "recv": {"out": int, "slice": str, "spec": SPEC, "aval": AVAL, "src": int,
             "expect": ("list", ("list", int)), "frees": FREES},
    "reshard": {"in": int, "out": int, "slice": str, "spec": SPEC, "frees": FREES},
}

MESSAGES: dict[str, dict] = {
    "template": {"program": str, "n_inputs": int, "n_values": int, "slices": ("map", SLICE),
                 "ops": ("list", dict)},
    "call": {"tenant": str, "client": int, "template": bytes, "base": int,
             "inputs": ("list", int), "exes": ("map", bytes), "frees": ("list", int)},
    "put": {"tenant": str, "client": int, "id": int, "slice": SLICE, "spec": SPEC, "aval": AVAL,
            "per_host": ("opt", bool)},
    "free": {"tenant": str, "client": int, "ids": ("list", int), "everything": ("opt", bool)},
    "deliver": {"key": int, "src": int, "shards": ("list", ("list", ("list", int))),
                "failure": ("opt", ("list", str)), "direct": ("opt", DIRECT), "dtype": ("opt", str)},
    "returned": {"leases": ("list", int)},
    "fetch": {"tenant": str, "id": int, "timeout": float, "ready_only": bool},
    "register": {"tenant": str, "pid": int, "weight": float},
    "quota": {"tenant": str, "devices": ("opt", int)},
    "allocate": {"tenant": str, "client": int, "shape": ("list", int), "axes": ("list", str),
                 "island": ("opt", int)},
    "release": {"tenant": str, "slice": str},
    "unregister": {"client": int},
    "unhealthy": {"island": int, "reason": str},
    "reply": {"ok": bool, "value": ANY},
}


def encode(kind: str, body: dict[str, Any]) -> bytes:
    """Pack ``body`` as a message of ``kind``; the version and kind are added here."""
    msg = {"v": VERSION, "kind": kind, **body}
    _check(msg, MESSAGES[kind], kind)
    return msgpack.packb(msg, use_bin_type=True)


def decode(data: Any, *kinds: str) -> dict[str, Any]:
    """Unpack and validate a message; it must be one of ``kinds`` when given."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError(f"expected a msgpack message as bytes, got {type(data).__name__}")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireFormatError(f"undecodable message ({len(data)} bytes): {exc}") from None
    if not isinstance(msg, dict):
        raise WireFormatError(f"a message must be a msgpack map, got {type(msg).__name__}")
    version = msg.get("v")
    if version != VERSION:
        raise WireFormatError(
            f"unsupported wire version {version!r}; this side speaks version {VERSION}. "
            "Run the same pathways release on the client and the cluster."
        )
    kind = msg.get("kind")
    if kind not in MESSAGES or (kinds and kind not in kinds):
        expected = ", ".join(kinds or MESSAGES)
        raise WireFormatError(f"unexpected message kind {kind!r}; expected one of: {expected}")
    _check(msg, MESSAGES[kind], kind)
    if kind == "template":
        for i, op in enumerate(msg["ops"]):
            name = op.get("op")
            if name not in OPS:
                raise WireFormatError(f"template.ops[{i}]: unknown op {name!r}; known: {', '.join(OPS)}")
            _check(op, OPS[name], f"template.ops[{i}]({name})")
    return msg


def _check(value: Any, schema: Any, path: str) -> None:
    if schema is ANY:
        return
    if isinstance(schema, dict):
        if not isinstance(value, dict):
            raise WireFormatError(f"{path}: expected a map, got {type(value).__name__}")
        for field, sub in schema.items():
            if field not in value:
                if isinstance(sub, tuple) and sub[0] == "opt":
                    continue
                raise WireFormatError(f"{path}: missing field {field!r}")
            _check(value[field], sub, f"{path}.{field}")
        return
    if isinstance(schema, tuple):
        tag = schema[0]
        if tag == "opt":
            if value is not None:
                _check(value, schema[1], path)
        elif tag == "or":
            errors = []
            for option in schema[1:]:
                try:
                    _check(value, option, path)
                    return
                except WireFormatError as exc:
                    errors.append(str(exc))
            raise WireFormatError(" / ".join(errors))
        elif tag == "list":
            if not isinstance(value, (list, tuple)):
                raise WireFormatError(f"{path}: expected a list, got {type(value).__name__}")
            for i, item in enumerate(value):
                _check(item, schema[1], f"{path}[{i}]")
        elif tag == "map":
            if not isinstance(value, dict):
                raise WireFormatError(f"{path}: expected a map, got {type(value).__name__}")
            for key, item in value.items():
                _check(item, schema[1], f"{path}[{key!r}]")
        return
    if schema is float and isinstance(value, int) and not isinstance(value, bool):
        return
    if schema is int and isinstance(value, bool):
        raise WireFormatError(f"{path}: expected int, got bool")
    if not isinstance(value, schema):
        raise WireFormatError(f"{path}: expected {schema.__name__}, got {type(value).__name__}")


class TemplateCache:
    """Decoded (validated) fragment templates by their bytes: one program's template arrives with every call,
    so each side decodes it once. Oldest first out beyond ``size``."""

    def __init__(self, size: int = 256) -> None:
        self._size = size
        self._decoded: dict[bytes, dict] = {}

    def get(self, blob: bytes) -> dict:
        template = self._decoded.get(blob)
        if template is None:
            template = decode(blob, "template")
            if len(self._decoded) >= self._size:
                self._decoded.pop(next(iter(self._decoded)))
            self._decoded[blob] = template
        return template
