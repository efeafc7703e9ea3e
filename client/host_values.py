"""Values that live in the client (numpy arrays and scalars, Python scalars, jax.Arrays, typed PRNG keys) as
the runtime sends them to a slice.

One conversion serves ``pw.put`` and the arguments of ``pw.jit`` functions and
programs, so both treat a value the way ``jax.device_put`` and ``jax.jit`` do:

- dtypes are canonicalized as JAX does (float64 -> float32 while
  ``jax_enable_x64`` is off), and a value that would not survive the narrowing
  (2**40 as int32, 1e40 as float32) raises ``ProgramError`` instead of
  arriving as 0 or inf;
- Python scalars are weakly typed (``2.0`` is a weak float32), so
  ``x_bf16 * 2.0`` stays bfloat16 as under ``jax.jit``;
- a typed PRNG key array (``jax.random.key(0)``) travels as its uint32 key
  data, tagged with its implementation, and comes back as keys.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P

from pathways.errors import ProgramError

SMALL_BYTES = 64 * 1024  # host values up to this size are recognised by content (see content_key)
PYTHON_SCALARS = (bool, int, float, complex)


def broadcast_specs(prefix: Any, tree: Any, what: str) -> list[P]:
    """One spec per leaf of ``tree``, from a pytree prefix of specs (None means replicated)."""
    out: list[P] = []

    def visit(spec: Any, sub: Any) -> None:
        if spec is not None and not isinstance(spec, P):
            raise ProgramError(f"{what}: expected a PartitionSpec or None, got {spec!r}")
        out.extend([spec if spec is not None else P()] * len(jax.tree_util.tree_leaves(sub)))

    try:
        jax.tree_util.tree_map(visit, prefix, tree, is_leaf=lambda x: isinstance(x, P) or x is None)
    except ValueError as exc:
        raise ProgramError(f"{what} {prefix!r} does not match the structure of the values: {exc}") from None
    return out


# -- typed PRNG keys ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class KeyInfo:
    """What turns uint32 key data back into typed keys: the PRNG implementation and its data's trailing shape."""

    impl: str  # e.g. "threefry2x32"
    dtype: Any  # the key dtype, e.g. key<fry>
    data_shape: tuple[int, ...]  # (2,) for threefry2x32

    def wrap(self, data: Any) -> jax.Array:
        """Typed keys from their uint32 data."""
        return jax.random.wrap_key_data(data, impl=self.impl)


def is_key_dtype(dtype: Any) -> bool:
    """True for a typed PRNG key dtype (key<fry>, key<rbg>, ...)."""
    return jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key)


@functools.cache
def key_info(dtype: Any) -> KeyInfo:
    """The KeyInfo of a key dtype (worked out abstractly, without touching a device)."""
    impl: list[str] = []

    def data_of(k: jax.Array) -> jax.Array:
        impl.append(str(jax.random.key_impl(k)))
        return jax.random.key_data(k)

    data = jax.eval_shape(data_of, jax.ShapeDtypeStruct((), dtype))
    return KeyInfo(impl[0], dtype, tuple(data.shape))


def physical(shape: tuple[int, ...], dtype: Any) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype of the buffer that holds a value of ``shape`` and ``dtype`` (keys hold uint32 data)."""
    if is_key_dtype(dtype):
        info = key_info(dtype)
        return tuple(shape) + info.data_shape, np.dtype(np.uint32)
    return tuple(shape), np.dtype(dtype)


def dtype_name(dtype: Any) -> str:
    """'float32', 'key<fry>': a dtype as errors and reprs spell it."""
    return dtype.name if isinstance(dtype, np.dtype) else str(dtype)


# -- conversion -----------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class HostData:
    """A host value ready to be sent: ``data`` is what travels, the rest is how JAX sees the value."""

    data: np.ndarray  # C-contiguous, canonical dtype; for keys, their uint32 data
    shape: tuple[int, ...]  # the value's shape (a key array's, without the data's trailing dims)
    dtype: Any  # np.dtype, or a key dtype
    weak_type: bool
    key: KeyInfo | None

    @property
    def aval(self) -> tuple[tuple[int, ...], Any, bool]:
        """(shape, dtype, weak_type) as a ``jax.jit`` argument."""
        return self.shape, self.dtype, self.weak_type

    def content_key(self) -> tuple | None:
        """A key equal for equal contents (same bytes, dtype and shape), or None for values over SMALL_BYTES:
        hashing those on every call would cost more than sending them."""
        if self.data.nbytes > SMALL_BYTES:
            return None
        return (dtype_name(self.dtype), self.shape, self.data.dtype.str, self.data.tobytes())


def is_host_value(value: Any) -> bool:
    """True for what a pw.jit function or a program takes besides pw.Arrays: arrays and scalars in the client."""
    return isinstance(value, (np.ndarray, np.generic, jax.Array)) or type(value) in PYTHON_SCALARS


def _x64_hint(source: np.dtype, dtype: np.dtype) -> str:
    return (f"{dtype.name} is the dtype JAX gives {source.name} values while jax_enable_x64 is off; pass a value "
            "in range, or enable 64-bit types with jax.config.update('jax_enable_x64', True)")


def _python_scalar(value: Any, what: str) -> HostData:
    if isinstance(value, bool):
        return HostData(np.asarray(value, np.bool_), (), np.dtype(np.bool_), False, None)
    if isinstance(value, int):
        dtype = np.dtype(jax.dtypes.canonicalize_dtype(np.int64))
        info = np.iinfo(dtype)
        if not info.min <= value <= info.max:
            hint = _x64_hint(np.dtype(np.int64), dtype) if dtype.itemsize < 8 else f"{dtype.name} holds no more"
            raise ProgramError(f"{what}: Python int {value} does not fit in {dtype.name} "
                               f"[{info.min}, {info.max}]; {hint}")
        return HostData(np.asarray(value, dtype), (), dtype, True, None)
    source = np.dtype(np.float64 if isinstance(value, float) else np.complex128)
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(source))
    with np.errstate(over="ignore"):  # an overflow is reported below, as an error
        data = np.asarray(value, dtype)
    if np.isfinite(value) and not np.isfinite(data):
        raise ProgramError(f"{what}: Python {type(value).__name__} {value!r} overflows {dtype.name} "
                           f"(it would become {data.item()!r}); {_x64_hint(source, dtype)}")
    return HostData(data, (), dtype, True, None)


def canonical(array: np.ndarray, what: str) -> np.ndarray:
    """``array`` in the dtype JAX would give it, C-contiguous; ProgramError if a value does not survive."""
    if array.dtype.kind not in "biufcV":
        raise ProgramError(f"{what} needs a numeric array, got an array of {array.dtype}")
    dtype = np.dtype(jax.dtypes.canonicalize_dtype(array.dtype))
    if dtype == array.dtype:
        return np.asarray(array, order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    with np.errstate(over="ignore", invalid="ignore"):  # a value that does not survive is reported below
        out = np.asarray(array, dtype=dtype, order="C")
    if array.dtype.kind in "iu":
        lost = out.astype(array.dtype) != array
    elif array.dtype.kind in "fc":
        with np.errstate(invalid="ignore"):
            lost = np.isfinite(array) & ~np.isfinite(out)
    else:
        lost = None
    if lost is not None and lost.any():
        where = np.unravel_index(int(np.argmax(lost)), array.shape) if array.ndim else ()
        bad = array[where] if array.ndim else array[()]
        at = f" at index {tuple(int(i) for i in where)}" if array.ndim else ""
        became = "overflows to" if array.dtype.kind in "fc" else "would become"
        raise ProgramError(f"{what}: {array.dtype.name} value {bad!r}{at} does not fit in {dtype.name} "
                           f"({became} {out[where]!r}); {_x64_hint(array.dtype, dtype)}")
    return out


def as_host_data(value: Any, what: str) -> HostData:
    """Convert a host value for sending (see the module docstring); ``what`` names it in errors."""
    if type(value) in PYTHON_SCALARS:
        return _python_scalar(value, what)
    if isinstance(value, jax.Array):
        if is_key_dtype(value.dtype):
            info = key_info(value.dtype)
            data = np.asarray(jax.random.key_data(value), order="C")
            return HostData(data, tuple(value.shape), value.dtype, False, info)
        data = canonical(np.asarray(value), what)
        return HostData(data, data.shape, data.dtype, bool(getattr(value, "weak_type", False)), None)
    if isinstance(value, (np.ndarray, np.generic)):
        data = canonical(np.asarray(value), what)
        return HostData(data, data.shape, data.dtype, False, None)
    try:
        array = np.asarray(value)
    except Exception as exc:  # anything numpy cannot make an array of
        raise ProgramError(f"{what} needs an array or a scalar, got {type(value).__name__}: {exc}") from None
    if array.dtype == object:
        raise ProgramError(f"{what} needs an array or a scalar, got {type(value).__name__}")
    data = canonical(array, what)
    return HostData(data, data.shape, data.dtype, False, None)


def host_aval(value: Any) -> tuple[tuple[int, ...], Any, bool]:
    """(shape, dtype, weak_type) of a host value as a jax.jit argument, without converting it."""
    kind = type(value)
    if kind in PYTHON_SCALARS:
        if kind is bool:
            return (), np.dtype(np.bool_), False
        source = {int: np.int64, float: np.float64, complex: np.complex128}[kind]
        return (), np.dtype(jax.dtypes.canonicalize_dtype(source)), True
    if isinstance(value, jax.Array):
        if is_key_dtype(value.dtype):
            return tuple(value.shape), value.dtype, False
        return tuple(value.shape), np.dtype(value.dtype), bool(getattr(value, "weak_type", False))
    dtype = np.asarray(value).dtype if isinstance(value, np.generic) else value.dtype
    if dtype.kind not in "biufcV":
        raise ProgramError(f"a {type(value).__name__} of {dtype} is not an array JAX can take; pass numbers")
    return tuple(np.shape(value)), np.dtype(jax.dtypes.canonicalize_dtype(dtype)), False
