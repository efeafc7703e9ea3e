"""The msgpack wire format of every control message, versioned and validated on decode.

Arrays never travel inside these messages: they go as numpy buffers in Ray's
object store next to the message, or (same node) as addresses the receiver
copies from. A message that fails validation raises
``WireFormatError`` naming the field that was wrong, so a peer can refuse it
without crashing or touching any state.
"""

from __future__ import annotations

from collections.abc import Callable
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
             "expect": ("list", ("list", int)), "frees": FREES,
             "routes": ("opt", ("list", ROUTE))},  # the senders' routes: what the network path accepts from whom
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
    _validate(msg, _MESSAGE_CHECKS[kind], kind)
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
    _validate(msg, _MESSAGE_CHECKS[kind], kind)
    if kind == "template":
        for i, op in enumerate(msg["ops"]):
            name = op.get("op")
            if name not in OPS:
                raise WireFormatError(f"template.ops[{i}]: unknown op {name!r}; known: {', '.join(OPS)}")
            _validate(op, _OP_CHECKS[name], f"template.ops[{i}]({name})")
    return msg


# -- validation: each schema compiles once into a checker; a path is spelled out only for an error ----


class _Invalid(Exception):
    """A value that does not fit its schema: why, and where below the value being checked."""

    def __init__(self, reason: str, where: str = "") -> None:
        super().__init__(reason)
        self.reason, self.where = reason, where

    def within(self, step: str) -> _Invalid:
        return _Invalid(self.reason, step + self.where)


Check = Callable[[Any], None]


def _validate(value: Any, check: Check, path: str) -> None:
    try:
        check(value)
    except _Invalid as exc:
        raise WireFormatError(f"{path}{exc.where}: {exc.reason}") from None


def _accept(value: Any) -> None:
    pass


def _type_check(kind: type) -> Check:
    if kind is int:  # a bool is an int to Python, never to the wire format
        def check(value: Any) -> None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise _Invalid(f"expected int, got {type(value).__name__}")
    elif kind is float:  # msgpack sends 2.0 as 2
        def check(value: Any) -> None:
            if not isinstance(value, (float, int)) or isinstance(value, bool):
                raise _Invalid(f"expected float, got {type(value).__name__}")
    else:
        def check(value: Any) -> None:
            if not isinstance(value, kind):
                raise _Invalid(f"expected {kind.__name__}, got {type(value).__name__}")
    return check


def _compile(schema: Any) -> Check:
    if schema is ANY:
        return _accept
    if isinstance(schema, dict):
        return _fields_check(schema)
    if not isinstance(schema, tuple):
        return _type_check(schema)
    tag, inner = schema[0], [_compile(s) for s in schema[1:]]
    if tag == "opt":
        def check_opt(value: Any) -> None:
            if value is not None:
                inner[0](value)
        return check_opt
    if tag == "or":
        def check_or(value: Any) -> None:
            errors = []
            for option in inner:
                try:
                    return option(value)
                except _Invalid as exc:
                    errors.append(f"{exc.where}: {exc.reason}" if exc.where else exc.reason)
            raise _Invalid(" / ".join(errors))
        return check_or
    item = inner[0]
    if tag == "list":
        def check_list(value: Any) -> None:
            if not isinstance(value, (list, tuple)):
                raise _Invalid(f"expected a list, got {type(value).__name__}")
            for i, v in enumerate(value):
                try:
                    item(v)
                except _Invalid as exc:
                    raise exc.within(f"[{i}]") from None
        return check_list
    if tag != "map":
        raise ValueError(f"unknown schema tag {tag!r} in {schema!r}")

    def check_map(value: Any) -> None:  # any keys, each value checked
        if not isinstance(value, dict):
            raise _Invalid(f"expected a map, got {type(value).__name__}")
        for key, v in value.items():
            try:
                item(v)
            except _Invalid as exc:
                raise exc.within(f"[{key!r}]") from None
    return check_map


def _fields_check(schema: dict) -> Check:
    fields = [(name, _compile(sub), isinstance(sub, tuple) and sub[0] == "opt") for name, sub in schema.items()]

    def check_fields(value: Any) -> None:
        if not isinstance(value, dict):
            raise _Invalid(f"expected a map, got {type(value).__name__}")
        for name, check, optional in fields:
            if name not in value:
                if optional:
                    continue
                raise _Invalid(f"missing field {name!r}")
            try:
                check(value[name])
            except _Invalid as exc:
                raise exc.within(f".{name}") from None
    return check_fields


_MESSAGE_CHECKS = {kind: _fields_check(schema) for kind, schema in MESSAGES.items()}
_OP_CHECKS = {name: _fields_check(schema) for name, schema in OPS.items()}


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
