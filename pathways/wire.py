"""The msgpack wire format: versioned, size-bounded, validated on decode against a schema per kind.

Arrays never travel inside these messages: they go as numpy buffers next to
the message, or (same node) as memory the receiver copies from. Each message
kind is declared once, by the module that owns its meaning (``pathways.ops``
for fragment templates, ``pathways.messages`` for the rest), with
``register``. A message that fails validation raises ``WireFormatError``
naming the field that was wrong, so a peer can refuse it without crashing or
touching any state.

A message is a msgpack array: the version, the kind, then the kind's fields in the order its schema declares
them (an absent optional field is nil). Both sides run the same release, so field names need not travel:
the array form unpacks in a third of the time of a map with named fields, and a call message is unpacked on
every island it reaches. Values inside a message (a slice, an op) are maps with named fields.

A schema is a type, a tuple ``("list", item)`` / ``("map", value)`` /
``("opt", inner)`` / ``("or", a, b, ...)``, a dict of field -> schema
(fields wrapped in ``opt`` may be absent), or ``ANY``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any, TypeVar

import msgpack

from pathways.errors import WireFormatError

VERSION = 5  # 5: a client's stream may carry ``calls`` (calls of one program merged)
MAX_MESSAGE_BYTES = 1 << 30  # a single control message; executables are the largest part
MAX_ITEMS = 1 << 20  # entries of any one list or map in a message

ANY = object()
SPEC = ("list", ("opt", ("or", str, ("list", str))))
AVAL = {"shape": ("list", int), "dtype": str}
SLICE = {"key": str, "shape": ("list", int), "axes": ("list", str), "devices": ("list", ("list", int))}

_SCHEMAS: dict[str, Callable[[Any], None]] = {}  # kind -> checker of its field values, in order
_FIELDS: dict[str, tuple[str, ...]] = {}  # kind -> its field names, in wire order
_REQUIRED: dict[str, frozenset[str]] = {}  # kind -> the fields that may not be absent
_CLASSES: dict[str, type] = {}
T = TypeVar("T")


def register(kind: str, schema: dict) -> None:
    """Declare message ``kind`` (its fields travel in the order of ``schema``); the schema is compiled into a
    checker once, here."""
    if kind in _SCHEMAS:
        raise ValueError(f"message kind {kind!r} is declared twice")
    _FIELDS[kind] = tuple(schema)
    _REQUIRED[kind] = frozenset(n for n, sub in schema.items() if not (isinstance(sub, tuple) and sub[0] == "opt"))
    _SCHEMAS[kind] = _values_check(schema)


def checker(schema: Any) -> Callable[[Any, str], None]:
    """A validator of values outside a message (e.g. the ops of a template) against ``schema``, compiled once:
    it raises WireFormatError naming the path it is given and the field that was wrong."""
    compiled = _compile(schema)

    def check_value(value: Any, path: str) -> None:
        _validate(value, compiled, path)
    return check_value


def declare(kind: str, schema: dict[str, Any]) -> Callable[[type[T]], type[T]]:
    """Make the class a frozen dataclass that is message ``kind``, with one ``schema`` entry per field: it gets
    ``encode()``, and ``parse`` builds it from a message's bytes. A field whose schema is ``("opt", ...)`` may be
    None, and is then left out of the message."""

    def wrap(cls: type[T]) -> type[T]:
        cls = dataclass(frozen=True)(cls)
        names = [f.name for f in fields(cls)]
        if names != list(schema):
            raise TypeError(f"message {kind!r}: fields {names} differ from its schema's {list(schema)} (names "
                            "and order: a message's fields travel in this order)")
        register(kind, schema)
        checker = _SCHEMAS[kind]

        def encode_message(self: Any) -> bytes:
            """The message's wire bytes."""
            values = [getattr(self, n) for n in names]
            _validate(values, checker, kind)
            return pack(kind, *values)

        cls.KIND = kind  # type: ignore[attr-defined]
        cls.encode = encode_message  # type: ignore[attr-defined]
        _CLASSES[kind] = cls
        return cls

    return wrap


def parse(data: Any, *classes: type[T]) -> T:
    """The message in ``data`` as one of ``classes`` (declared with ``declare``): schema-checked, then checked
    in meaning by the class's ``check()`` where it has one. WireFormatError (or the check's own error)
    otherwise."""
    kind, values = decode_values(data, *[c.KIND for c in classes])  # type: ignore[attr-defined]
    out = _CLASSES[kind](*values)
    check = getattr(out, "check", None)
    if check is not None:
        check()
    return out


def _declare_all() -> None:
    """Load the modules that declare the runtime's message kinds (once; they import this module)."""
    if "answer" not in _SCHEMAS:
        import pathways.messages  # noqa: F401
        import pathways.ops  # noqa: F401
        import pathways.requests  # noqa: F401


def encode(kind: str, body: dict[str, Any], check: bool = True) -> bytes:
    """Pack ``body`` (field -> value) as a message of ``kind``; the version and kind are added here.
    ``check=False`` skips validating it against the schema, for a hot message built from typed values (its
    receiver validates it)."""
    _declare_all()
    names = _FIELDS.get(kind)
    if names is None:
        raise WireFormatError(f"unknown message kind {kind!r}")
    values = [body.get(n) for n in names]
    if check:
        missing = [n for n in names if n not in body and n in _REQUIRED[kind]]
        if missing:
            raise WireFormatError(f"{kind}: missing field {missing[0]!r}")
        unknown = [n for n in body if n not in names]
        if unknown:
            raise WireFormatError(f"{kind}: no field {unknown[0]!r}; its fields are {', '.join(names)}")
        _validate(values, _SCHEMAS[kind], kind)
    return msgpack.packb([VERSION, kind, *values], use_bin_type=True)


def pack(kind: str, *values: Any) -> bytes:
    """A message of ``kind`` from its field values in schema order, not validated: for a hot message built from
    typed values (its receiver validates it)."""
    return msgpack.packb([VERSION, kind, *values], use_bin_type=True)


def position(kind: str, field: str) -> int:
    """Where ``field`` of message ``kind`` stands in its msgpack array (after the version and the kind)."""
    _declare_all()
    return 2 + _FIELDS[kind].index(field)


def decode(data: Any, *kinds: str) -> dict[str, Any]:
    """Unpack and validate a message, as a map of its fields (with ``v`` and ``kind``); it must be one of
    ``kinds`` when given."""
    kind, values = decode_values(data, *kinds)
    return {"v": VERSION, "kind": kind, **dict(zip(_FIELDS[kind], values))}


def decode_values(data: Any, *kinds: str) -> tuple[str, list[Any]]:
    """Unpack and validate a message: its kind, and its field values in the order its schema declares them.
    It must be one of ``kinds`` when given."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise WireFormatError(f"expected a msgpack message as bytes, got {type(data).__name__}")
    if len(data) > MAX_MESSAGE_BYTES:
        raise WireFormatError(f"a message of {len(data)} bytes is over the limit of {MAX_MESSAGE_BYTES}")
    try:
        msg = msgpack.unpackb(data, raw=False, strict_map_key=False, max_array_len=MAX_ITEMS,
                              max_map_len=MAX_ITEMS)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise WireFormatError(f"undecodable message ({len(data)} bytes): {exc}") from None
    if type(msg) is dict and "v" in msg:  # the map form of releases before version 4
        msg = [msg["v"], msg.get("kind")]
    if type(msg) is not list or len(msg) < 2:
        raise WireFormatError(f"a message is a msgpack array [version, kind, fields...], got "
                              f"{type(msg).__name__ if type(msg) is not list else 'an array of ' + str(len(msg))}")
    version, kind = msg[0], msg[1]
    if version != VERSION:
        raise WireFormatError(
            f"unsupported wire version {version!r}; this side speaks version {VERSION}. "
            "Run the same pathways release on the client and the cluster."
        )
    checker = _SCHEMAS.get(kind) if type(kind) is str else None
    if checker is None:
        _declare_all()  # a kind not declared yet may be one whose module is not loaded
        checker = _SCHEMAS.get(kind) if type(kind) is str else None
    if checker is None or (kinds and kind not in kinds):
        expected = ", ".join(kinds or sorted(_SCHEMAS))
        raise WireFormatError(f"unexpected message kind {kind!r}; expected one of: {expected}")
    values = msg[2:]
    try:
        checker(values)
    except _Invalid as exc:
        raise WireFormatError(f"{kind}{exc.where}: {exc.reason}") from None
    return kind, values


# -- validation: each schema compiles once into a checker; a path is spelled out only for an error ----


class _Invalid(Exception):
    """A value that does not fit its schema: why, and where below the value being checked."""

    def __init__(self, reason: str, where: str = "") -> None:
        super().__init__(reason)
        self.reason, self.where = reason, where

    def within(self, step: str) -> _Invalid:
        return _Invalid(self.reason, step + self.where)


Check = Callable[[Any], None]


def _validate(value: Any, checker: Check, path: str) -> None:
    try:
        checker(value)
    except _Invalid as exc:
        raise WireFormatError(f"{path}{exc.where}: {exc.reason}") from None


def _accept(value: Any) -> None:
    pass


def _type_check(kind: type) -> Check:
    if kind is int:  # a bool is an int to Python, never to the wire format
        def check_int(value: Any) -> None:
            if not isinstance(value, int) or isinstance(value, bool):
                raise _Invalid(f"expected int, got {type(value).__name__}")
        return check_int
    if kind is float:  # msgpack sends 2.0 as 2
        def check_float(value: Any) -> None:
            if not isinstance(value, (float, int)) or isinstance(value, bool):
                raise _Invalid(f"expected float, got {type(value).__name__}")
        return check_float

    def check_type(value: Any) -> None:
        if not isinstance(value, kind):
            raise _Invalid(f"expected {kind.__name__}, got {type(value).__name__}")
    return check_type


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
    if tag == "list" and schema[1] in (int, str, bytes):
        exact = schema[1]  # ``type(v) is int`` also keeps bools out, as ``check_int`` does

        def check_plain_list(value: Any) -> None:  # ids, names: the long lists, checked without a call per item
            if not isinstance(value, (list, tuple)):
                raise _Invalid(f"expected a list, got {type(value).__name__}")
            for v in value:
                if type(v) is not exact:
                    break
            else:
                return
            for i, v in enumerate(value):  # something is not of the exact type: say where, and whether it is wrong
                if type(v) is not exact:
                    try:
                        item(v)
                    except _Invalid as exc:
                        raise exc.within(f"[{i}]") from None
        return check_plain_list
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

    def check_map(value: Any) -> None:  # str keys, each value checked
        if not isinstance(value, dict):
            raise _Invalid(f"expected a map, got {type(value).__name__}")
        if not value:
            return
        for key, v in value.items():
            if not isinstance(key, str):
                raise _Invalid(f"expected str keys, got {type(key).__name__}")
            try:
                item(v)
            except _Invalid as exc:
                raise exc.within(f"[{key!r}]") from None
    return check_map


def _values_check(schema: dict) -> Check:
    """A message's field values, in the schema's order: one check each, in a list of exactly that length."""
    names = tuple(schema)
    # Passed without a call: a field of one plain type by its exact type (``type(v) is int`` keeps bools out), a
    # list of plain items whose items all are, an empty map.
    plain = (int, str, bytes)
    checks = tuple((name, _compile(sub), sub if sub in plain else None,
                    sub[1] if isinstance(sub, tuple) and sub[0] == "list" and sub[1] in plain else None,
                    isinstance(sub, tuple) and sub[0] == "map")
                   for name, sub in schema.items())

    def check_values(values: Any) -> None:
        if len(values) != len(names):
            raise _Invalid(f"{len(values)} field values, not {len(names)} ({', '.join(names)})")
        for (name, checker, exact, items, is_map), value in zip(checks, values):
            kind = type(value)
            if kind is exact:
                continue
            if kind is list and items is not None:
                for v in value:
                    if type(v) is not items:
                        break
                else:
                    continue
            elif kind is dict and is_map and not value:
                continue
            try:
                checker(value)
            except _Invalid as exc:
                raise exc.within(f".{name}") from None
    return check_values


def _fields_check(schema: dict) -> Check:
    fields = [(name, _compile(sub), isinstance(sub, tuple) and sub[0] == "opt") for name, sub in schema.items()]

    def check_fields(value: Any) -> None:
        if not isinstance(value, dict):
            raise _Invalid(f"expected a map, got {type(value).__name__}")
        for name, checker, optional in fields:
            if name not in value:
                if optional:
                    continue
                raise _Invalid(f"missing field {name!r}")
            try:
                checker(value[name])
            except _Invalid as exc:
                raise exc.within(f".{name}") from None
    return check_fields
