"""A ``pw.Array`` used by JAX code in the client, as a ``jax.Array`` that lives elsewhere.

Wherever JAX takes a ``jax.Array`` in the client (``jnp`` functions, ``lax``
primitives, ``jax.jit``, ``jax.vmap``, ``jax.grad``, operators, array methods,
``format``), a ``pw.Array`` is fetched once, kept as a local ``jax.Array``
(``pw.Array.__jax_array__``), and that local value is used. Nothing here moves
data to an island: the result of such a computation is an ordinary local
``jax.Array``. To compute on the island, call a ``pw.jit`` function instead.

JAX 0.10 refuses ``__jax_array__`` during abstractification, so the type is
registered with JAX's own tables instead: its abstract value comes from its
shape and dtype without a fetch, and its concrete value is the fetched copy.
"""

from __future__ import annotations

import operator
import sys
from typing import Any

import jax
import numpy as np

# Operators and methods of jax.Array that a pw.Array answers with its fetched local value.
_OPERATORS = (
    "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__", "__truediv__", "__rtruediv__",
    "__floordiv__", "__rfloordiv__", "__mod__", "__rmod__", "__divmod__", "__rdivmod__", "__pow__", "__rpow__",
    "__matmul__", "__rmatmul__", "__and__", "__rand__", "__or__", "__ror__", "__xor__", "__rxor__",
    "__lshift__", "__rlshift__", "__rshift__", "__rrshift__", "__lt__", "__le__", "__gt__", "__ge__",
    "__neg__", "__pos__", "__abs__", "__invert__", "__round__", "__getitem__", "__iter__", "__contains__",
)
LOCAL_ATTRIBUTES = frozenset({
    "T", "mT", "all", "any", "argmax", "argmin", "argpartition", "argsort", "astype", "at", "choose", "clip",
    "compress", "conj", "conjugate", "cumprod", "cumsum", "diagonal", "dot", "flatten", "imag", "max", "mean",
    "min", "nonzero", "prod", "ptp", "ravel", "real", "repeat", "reshape", "round", "searchsorted", "sort",
    "squeeze", "std", "sum", "swapaxes", "take", "trace", "transpose", "var", "view",
})
_ARRAY_LIKE = (jax.Array, np.ndarray, np.generic, int, float, complex, bool)


def _local_op(name: str) -> Any:
    def op(self: Any, *args: Any) -> Any:
        return getattr(self.__jax_array__(), name)(*args)

    op.__name__ = name
    op.__doc__ = f"jax.Array.{name} of the fetched value (a local jax.Array)."
    return op


class LocalArrayMethods:
    """The part of ``jax.Array``'s interface a ``pw.Array`` answers by fetching: operators, comparisons,
    indexing, iteration, ``format`` and the array methods (``x.reshape``, ``x.sum()``, ``x.T``, ...).

    Each fetches the value once (``__jax_array__``) and returns what ``jax.Array`` returns: a local
    ``jax.Array``. A ``pw.Array`` stays hashable by identity (the runtime keeps them in tables), where a
    ``jax.Array`` is unhashable.
    """

    __slots__ = ()

    def __jax_array__(self) -> jax.Array:  # defined by pw.Array
        raise NotImplementedError

    def __eq__(self, other: object) -> Any:
        if not _is_array_like(other):  # no fetch to compare with None, a string, ...: Python's identity rule
            return NotImplemented
        return self.__jax_array__().__eq__(other)

    def __ne__(self, other: object) -> Any:
        if not _is_array_like(other):
            return NotImplemented
        return self.__jax_array__().__ne__(other)

    __hash__ = object.__hash__

    def __format__(self, format_spec: str) -> str:
        """As ``jax.Array``: ``f"{loss:.2e}"`` formats the value (fetching it); an empty spec is ``str(x)``."""
        if not format_spec:
            return str(self)
        return format(self.__jax_array__(), format_spec)

    def __getattr__(self, name: str) -> Any:
        if name in LOCAL_ATTRIBUTES:
            return getattr(self.__jax_array__(), name)
        raise AttributeError(f"'pw.Array' object has no attribute {name!r}")


for _name in _OPERATORS:
    setattr(LocalArrayMethods, _name, _local_op(_name))


def _is_array_like(value: Any) -> bool:
    return isinstance(value, _ARRAY_LIKE) or hasattr(value, "__jax_array__")


def register(array_type: type) -> None:
    """Teach JAX ``array_type`` (``pw.Array``): its abstract value from ``shape``, ``dtype`` and ``weak_type``
    (no fetch, so tracing is free), and its concrete value from ``__jax_array__`` (one fetch)."""
    from jax._src import core, dtypes

    core.pytype_aval_mappings[array_type] = lambda x: core.ShapedArray(x.shape, x.dtype, weak_type=x.weak_type)
    concrete = operator.methodcaller("__jax_array__")
    if hasattr(dtypes, "register_canonicalize_value_handler"):
        dtypes.register_canonicalize_value_handler(array_type, concrete)
    else:  # older JAX: a plain dict
        dtypes.canonicalize_value_handlers[array_type] = concrete


def local_value(value: Any, weak_type: bool) -> jax.Array:
    """A fetched value as a local ``jax.Array`` with the weak type the island's value has."""
    local = jax.numpy.asarray(value)
    if weak_type and not local.weak_type:
        from jax._src.lax.lax import _convert_element_type

        local = _convert_element_type(local, local.dtype, weak_type=True)
    return local


def asked_by_jax() -> bool:
    """True when JAX's own code is reading the caller (a property of pw.Array). ``jax.jit`` places each
    argument by its ``sharding``; a pw.Array's is on the island's abstract mesh, which means nothing for the
    local copy JAX computes with, so JAX is told there is none (as for a numpy array)."""
    module = sys._getframe(2).f_globals.get("__name__", "")
    return module == "jax" or module.startswith("jax.")


def called_by_device_get() -> bool:
    """True when ``jax.device_get`` is asking the caller's ``__array__``: it brings typed keys home as keys
    (as for a ``jax.Array`` of keys), where ``np.asarray`` must refuse them."""
    from jax._src import api

    caller = sys._getframe(2)
    device_get = getattr(api, "_device_get", None)
    return device_get is not None and caller.f_code is device_get.__code__
