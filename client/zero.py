"""ZeRO over data-parallel pods: each pod owns a share of the training state instead of a copy of all of it.

Data-parallel pods (PaLM's two-pod step) each hold every parameter and every optimizer statistic. ZeRO
(Rajbhandari et al., 2020) partitions that redundancy over the replicas: stage 1 the optimizer state, stage 2
the gradients too (each replica receives only the gradients of its share: a reduce-scatter), stage 3 the
parameters too (gathered piece by piece as the forward and backward passes need them).

The unit of a share here is a whole leaf of the parameter pytree, never a slice of one: an optimizer such
as Adafactor reads per-leaf statistics (the RMS of a parameter, of its update), so a whole leaf updates on
its owner with the same operations as in the replicated step, and the owner's bits are the bits every pod
then holds. ``partition`` balances the shares by bytes, piece by piece (a layer group, say), so the
exchange of any piece is about even both ways. Leaves keep their in-pod sharding: a share is a list of
leaves, each still split over its pod's devices.

What crosses pods beyond the leaves' own traffic is one scalar per pod per step: the global gradient norm
(for clipping) is the sum, in pod order, of each owner's ``sq_norm`` of its summed share, the same on every
pod. ``clip`` then scales a share exactly as ``optax.clip_by_global_norm`` scales the whole tree.

Pure JAX: the functions run inside ``pw.jit`` on each pod; ``Partition`` and the state helpers run in the
client on shapes or on ``pw.Array`` pytrees alike.

    part = pw.zero.partition(params, pods=2, pieces=[[0, 1], list(range(2, 10))])
    mine = part.take(jax.tree.leaves(params), pod)      # the leaves pod ``pod`` owns, in leaf order
    state = pw.zero.shard_state(full_opt_state, params, part.owned(pod))
"""

from __future__ import annotations

import functools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

STAGES = (0, 1, 2, 3)  # 0: replicated; 1: optimizer state sharded; 2: and gradients; 3: and parameters


@dataclass(frozen=True)
class Partition:
    """Which pod owns each leaf of a pytree (by ``jax.tree.leaves`` order), and the leaves' sizes in bytes."""

    owners: tuple[int, ...]
    nbytes: tuple[int, ...]
    pods: int

    def owned(self, pod: int) -> tuple[int, ...]:
        """The indices of the leaves ``pod`` owns, ascending."""
        return tuple(i for i, owner in enumerate(self.owners) if owner == pod)

    def take(self, leaves: Sequence[Any], pod: int) -> list:
        """``pod``'s share of a flat leaf list (of the partitioned tree, or of one that mirrors it)."""
        if len(leaves) != len(self.owners):
            raise ValueError(f"a partition of {len(self.owners)} leaves cannot take a share of {len(leaves)}")
        return [leaves[i] for i in self.owned(pod)]

    def join(self, shares: Sequence[Sequence[Any]]) -> list:
        """The flat leaf list from every pod's share (``shares[p]`` as ``take`` gave it): the inverse of take."""
        if len(shares) != self.pods:
            raise ValueError(f"join needs one share per pod ({self.pods}), got {len(shares)}")
        out: list = [None] * len(self.owners)
        for pod, share in enumerate(shares):
            index = self.owned(pod)
            if len(share) != len(index):
                raise ValueError(f"pod {pod}'s share has {len(share)} leaves; it owns {len(index)}")
            for i, leaf in zip(index, share):
                out[i] = leaf
        return out

    def share_bytes(self, pod: int) -> int:
        """Bytes of the leaves ``pod`` owns."""
        return sum(self.nbytes[i] for i in self.owned(pod))

    def among(self, indices: Sequence[int], pod: int) -> list[int]:
        """The positions within ``indices`` (a piece's leaf indices) of the leaves ``pod`` owns."""
        return [k for k, i in enumerate(indices) if self.owners[i] == pod]


def partition(tree: Any, pods: int, pieces: Sequence[Sequence[int]] | None = None) -> Partition:
    """Owners for the leaves of ``tree`` (arrays or shape structs), balanced by bytes over ``pods``.

    Each piece (a list of leaf indices; default: the whole tree as one) is dealt largest leaf first to the
    pod holding the fewest bytes so far (the lowest index on a tie), pieces in the order given, so each
    piece is about even and the shares are even overall. Deterministic: every process computes the same.
    """
    leaves = jax.tree.leaves(tree)
    if pods < 1:
        raise ValueError(f"a partition needs at least one pod, got {pods}")
    if len(leaves) < pods:
        raise ValueError(f"{len(leaves)} leaves cannot give each of {pods} pods a share: ZeRO partitions whole "
                         "leaves; use fewer pods or stage 0")
    nbytes = tuple(math.prod(np.shape(x)) * np.dtype(x.dtype).itemsize for x in leaves)
    pieces = [list(range(len(leaves)))] if pieces is None else [list(p) for p in pieces]
    seen = sorted(i for p in pieces for i in p)
    if seen != list(range(len(leaves))):
        raise ValueError(f"the pieces must name each of the {len(leaves)} leaves exactly once")
    owners = [0] * len(leaves)
    load = [0] * pods
    for piece in pieces:
        for i in sorted(piece, key=lambda i: (-nbytes[i], i)):
            pod = min(range(pods), key=lambda p: (load[p], p))
            owners[i] = pod
            load[pod] += nbytes[i]
    if min(load) == 0 and pods > 1:
        raise ValueError(f"a pod would own nothing (leaf bytes {sorted(nbytes, reverse=True)[:pods]}...)")
    return Partition(tuple(owners), nbytes, pods)


# -- optimizer state ----------------------------------------------------------------------------------------

def _mirrors(like: Any) -> Any:
    """A predicate: a subtree shaped like the parameter tree (an optimizer's per-parameter statistics)."""
    treedef = jax.tree.structure(like)

    def is_mirror(x: Any) -> bool:
        return not _is_array_leaf(x) and jax.tree.structure(x) == treedef

    return is_mirror


def _is_array_leaf(x: Any) -> bool:
    return jax.tree.structure(x).num_nodes == 1 and jax.tree.structure(x).num_leaves == 1


def shard_state(state: Any, params: Any, keep: Sequence[int]) -> Any:
    """An optimizer state with each per-parameter subtree (one shaped like ``params``) cut to the leaves
    ``keep`` (a share, as a list); counts and other leaves stay whole. The result is the state the same
    optimizer keeps for a list of those parameter leaves."""
    is_mirror = _mirrors(params)
    return jax.tree.map(lambda sub: [jax.tree.leaves(sub)[i] for i in keep] if is_mirror(sub) else sub,
                        state, is_leaf=is_mirror)


def join_state(shares: Sequence[Any], params: Any, part: Partition) -> Any:
    """The whole optimizer state from every pod's ``shard_state`` share: the inverse of ``shard_state`` (the
    per-parameter lists interleaved back into trees shaped like ``params``; counts and the rest from pod 0's).
    The shares' only lists are those per-parameter ones, as with optax, whose states are tuples."""
    if len(shares) != part.pods:
        raise ValueError(f"join_state needs one share per pod ({part.pods}), got {len(shares)}")
    treedef = jax.tree.structure(params)

    def is_list(x: Any) -> bool:
        return isinstance(x, list)

    flat = [jax.tree.leaves(s, is_leaf=is_list) for s in shares]
    out = []
    for k, node in enumerate(flat[0]):
        out.append(jax.tree.unflatten(treedef, part.join([f[k] for f in flat])) if is_list(node) else node)
    return jax.tree.unflatten(jax.tree.structure(shares[0], is_leaf=is_list), out)


# -- the global norm, from shares ---------------------------------------------------------------------------

def sq_norm(leaves: Sequence[jax.Array]) -> jax.Array:
    """The sum of squares of a share's leaves (float32), as ``optax.tree.norm`` sums them."""
    if not leaves:
        return jnp.zeros((), jnp.float32)
    return functools.reduce(operator.add, [jnp.sum(jnp.square(x)) for x in leaves])


def global_norm(partials: Sequence[jax.Array]) -> jax.Array:
    """The global norm from every pod's ``sq_norm``, summed in pod order (so the same bits on every pod)."""
    return jnp.sqrt(functools.reduce(operator.add, partials))


def clip(leaves: Sequence[jax.Array], norm: jax.Array, max_norm: float) -> list[jax.Array]:
    """A share clipped by the global norm exactly as ``optax.clip_by_global_norm`` clips the whole tree."""
    trigger = jnp.squeeze(norm < max_norm)
    return [jax.lax.select(trigger, t, (t / norm.astype(t.dtype)) * max_norm) for t in leaves]
