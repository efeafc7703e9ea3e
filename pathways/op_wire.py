"""Op kinds, each declared once: its wire kind and, field by field, the wire name and codec of its dataclass fields.

An op travels inside a template as a map: ``{"op": kind, field: value, ...}``. ``declare`` makes an op class a
frozen dataclass and registers its kind; the map's schema (and so its validation, with errors that name the
field), its decoding and its encoding all come from that one declaration, so a template's ops are read and
written with no code per kind. Every op has ``frees`` (the slots it frees right after it runs): it travels
last, and is left out when empty, like any optional field.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, TypeVar

from pathways import wire
from pathways.errors import WireFormatError

T = TypeVar("T")
_WIRE = "pathways.op_wire"  # the dataclass field metadata key holding a field's (wire name, codec)


@dataclass(frozen=True, slots=True)
class Codec:
    """How one field travels: its schema, how a checked wire value becomes the field's value (``decode``) and back
    (``encode``); None: as it is. An ``optional`` field may be absent (nil): it is left out when empty and
    decodes to empty."""

    schema: Any
    decode: Callable[[Any], Any] | None = None
    encode: Callable[[Any], Any] | None = None
    optional: bool = False


def many(item: Codec) -> Codec:
    """A tuple of ``item`` values, travelling as a list."""
    dec, enc = item.decode, item.encode
    return Codec(("list", item.schema), tuple if dec is None else (lambda v: tuple(dec(x) for x in v)),
                 list if enc is None else (lambda v: [enc(x) for x in v]))


def optional(codec: Codec) -> Codec:
    """``codec``'s field made optional: absent when empty (a tuple field, whose default is ``()``)."""
    dec = codec.decode or (lambda v: v)
    return Codec(("opt", codec.schema), lambda v: dec(v) if v else (), codec.encode, optional=True)


INT = Codec(int)
TEXT = Codec(str)
SLOTS = many(INT)
FREES = optional(SLOTS)


def on_wire(codec: Codec, name: str | None = None, default: Any = MISSING) -> Any:
    """A field of an op declared with ``declare``: it travels as ``name`` (its own name when None) by ``codec``."""
    return field(default=default, metadata={_WIRE: (name, codec)})


@dataclass(frozen=True, slots=True)
class Kind:
    """One declared op kind: its class, and its fields' wire names and codecs in constructor and in wire order."""

    kind: str
    cls: type
    decoders: tuple[tuple[str, Callable[[Any], Any] | None], ...]  # (wire name, decode), in constructor order
    encoders: tuple[tuple[str, str, Callable[[Any], Any] | None, bool], ...]  # (wire name, field, encode, optional)
    check: Callable[[Any, str], None]  # the op map's schema, compiled once

    def build(self, d: Mapping) -> Any:
        """The op a (schema-checked) map describes."""
        return self.cls(*[d.get(key) if decode is None else decode(d.get(key)) for key, decode in self.decoders])


_KINDS: dict[str, Kind] = {}  # wire kind -> its declaration, in declaration order
_CLASSES: dict[type, Kind] = {}


def declare(kind: str) -> Callable[[type[T]], type[T]]:
    """Make the class a frozen dataclass that is op ``kind``: every field declared with ``on_wire``, ``frees``
    among them. Its ``KIND`` is set; ``decode`` and ``to_wire`` handle it from
    now on."""

    def wrap(cls: type[T]) -> type[T]:
        if kind in _KINDS:
            raise ValueError(f"op kind {kind!r} is declared twice")
        cls.KIND = kind  # type: ignore[attr-defined]
        cls = dataclass(frozen=True)(cls)
        declared = []
        for f in fields(cls):  # type: ignore[arg-type]
            if _WIRE not in f.metadata:
                raise TypeError(f"op {kind!r}: field {f.name!r} is not declared with on_wire")
            name, codec = f.metadata[_WIRE]
            declared.append((name or f.name, f.name, codec))
        if "frees" not in [attr for _, attr, _ in declared]:
            raise TypeError(f"op {kind!r}: every op has a field 'frees' (the slots it frees right after it runs)")
        wire_order = [d for d in declared if d[1] != "frees"] + [d for d in declared if d[1] == "frees"]
        decl = Kind(kind, cls, tuple((key, codec.decode) for key, _, codec in declared),
                    tuple((key, attr, codec.encode, codec.optional) for key, attr, codec in wire_order),
                    wire.checker({key: codec.schema for key, _, codec in declared}))
        _KINDS[kind] = _CLASSES[cls] = decl
        return cls

    return wrap


def classes() -> tuple[type, ...]:
    """The declared op classes, in declaration order (a host gives each one a handler)."""
    return tuple(_CLASSES)


def decode(d: Mapping, path: str) -> Any:
    """The op a template's map ``d`` describes, checked against its kind's schema; WireFormatError (naming
    ``path`` and the field) when it is not one."""
    kind = d.get("op")
    decl = _KINDS.get(kind) if type(kind) is str else None
    if decl is None:
        raise WireFormatError(f"{path}: unknown op {kind!r}; known: {', '.join(_KINDS)}")
    decl.check(d, f"{path}({kind})")
    return decl.build(d)


def to_wire(op: Any) -> dict:
    """An op's map (the inverse of ``decode``): its kind, then its fields in wire order, empty optional ones
    left out."""
    decl = _CLASSES.get(type(op))
    if decl is None:
        raise TypeError(f"not a declared fragment op: {op!r}")
    out: dict[str, Any] = {"op": decl.kind}
    for key, attr, encode, optional_ in decl.encoders:
        value = getattr(op, attr)
        if optional_ and not value:
            continue
        out[key] = value if encode is None else encode(value)
    return out
