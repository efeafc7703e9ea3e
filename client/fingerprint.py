"""Bit-exact fingerprints of a state's leaves, computed where the state lives (inside ``pw.jit``).

Two pods that should hold the same training state compare fingerprints instead of moving the state to
the client: each leaf's bits, as uint32 words scrambled together with their positions, are summed (mod
2**32), so a changed or moved word changes the sum. ``probe`` reads one word of every leaf: a host
runs it only once the whole state exists, so fetching it says so in one round trip.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def _words(x: jax.Array) -> jax.Array:
    """The bits of ``x`` as uint32 words (8- and 16-bit values widened, 64-bit ones split in two)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        x = jnp.stack([jnp.real(x), jnp.imag(x)], axis=-1)
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    unsigned = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(x.dtype.itemsize)
    if unsigned is None:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _mix(x: jax.Array) -> jax.Array:
    """A bijective scramble of uint32 words (Wellons' lowbias32): nearby inputs land far apart."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def fingerprint(tree: Any) -> jax.Array:
    """One uint32 per leaf: the sum (mod 2**32) of its words, each scrambled together with its position, so
    a changed or moved word changes it, and many changed words do not cancel out in a pattern. Two copies
    of a state with equal fingerprints hold the same bits, short of a 1-in-2**32 accident per leaf."""
    sums = []
    for leaf in jax.tree.leaves(tree):
        words = _words(leaf)
        position = jax.lax.broadcasted_iota(jnp.uint32, words.shape, 0) if words.ndim else jnp.uint32(0)
        for dim in range(1, words.ndim):
            position = position * jnp.uint32(words.shape[dim]) + jax.lax.broadcasted_iota(jnp.uint32, words.shape,
                                                                                           dim)
        sums.append(jnp.sum(_mix(words ^ _mix(position)), dtype=jnp.uint32))
    return jnp.stack(sums) if sums else jnp.zeros((0,), jnp.uint32)


def probe(tree: Any) -> jax.Array:
    """A few bytes that depend on every leaf of ``tree`` (one word of each): the host runs it only once every
    leaf exists, so fetching it says that the whole state was computed, in one round trip."""
    words = [_words(leaf)[(0,) * leaf.ndim] for leaf in jax.tree.leaves(tree) if leaf.size]
    return jnp.stack([w if w.ndim == 0 else w.ravel()[0] for w in words]) if words else jnp.zeros((0,), jnp.uint32)
