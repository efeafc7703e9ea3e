"""``pw.WeightSync``: a parameter tree moved to another slice's layout, planned once and then only executed.

Reinforcement learning keeps two copies of the policy: the trainer's, sharded for training, and the
sampler's, sharded for generation, often on another island. After each step the trainer's tree must reach
the sampler resharded. Mapping ``pw.transfer`` over the leaves does that, but pays one transfer per leaf;
a model's tree is a few large kernels and many small norms and scales. A ``WeightSync`` plans the move once
per tree signature (structure, shapes, dtypes, source slices and shardings) into *buckets*:

- a leaf of at most ``small_bytes`` joins a *pack*: the small leaves of one source slice and dtype are
  concatenated there, moved as one replicated buffer (one transfer) and cut back into leaves on the
  destination, each in its own spec; a pack holds at most ``bucket_bytes``;
- leaves of at most ``stack_bytes`` that share shape, dtype, source slice and both specs (a model's layers) form
  a *stack*: stacked on a new leading axis on the source (each device stacks its own shards, no communication),
  moved as one array (one transfer), and unstacked on the destination, each in its spec;
- any other leaf is a bucket of its own, moved host to host by the transfer path (never through the client),
  its shards cut into frames or read in chunks by the transports.

The packs and stacks of one source slice are made by one computation there and cut apart by one on the
destination.

A transfer costs the receiving host about a millisecond whatever its size (a recv op, its bookkeeping, the
devices' buffers); stacking and packing cost a local copy of the bytes on each side, so they pay for leaves of
up to a few MiB and are left to the leaves that are not larger.

Every call runs the plan as one program (one dispatch; inside a ``@pw.program`` it joins that graph). Each
bucket's send leaves as soon as its value exists: the leaves that move alone at once, in tree order, so the
destination lands them (and a computation there may use them) while the source still packs and stacks the
rest, whose transfers follow. Leaves already on the destination slice in their spec stay as they are
(``pw.transfer`` returns them too); on one island a move is a reshard there, with no copy between hosts.
Results are bitwise those of ``pw.transfer`` per leaf.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from client.array import Array, check_usable
from client.host_values import is_key_dtype
from client.program import ProgramFunction, transfer
from client.slices import VirtualSlice
from client.tracer import TracedValue, current_trace
from pathways.errors import ProgramError
from pathways.sharding import check_spec, norm_spec

BUCKET_BYTES = 64 << 20  # the most bytes one pack or stack carries
SMALL_BYTES = 64 << 10  # leaves of at most this many bytes are packed with others
STACK_BYTES = 2 << 20  # leaves of at most this many bytes are stacked with their likes
MAX_PLANS = 16  # tree signatures a sync keeps plans for; the least recently used goes first


@dataclass(frozen=True)
class Bucket:
    """One unit of the plan: the leaves (positions in the flattened tree) it moves and their bytes.

    ``kind`` is ``"pack"`` (small leaves concatenated on their source slice and cut apart on the
    destination), ``"stack"`` (leaves of one shape and sharding stacked on a leading axis, then unstacked),
    ``"leaf"`` (one leaf moved host to host) or ``"stay"`` (leaves already where and as they should be)."""

    kind: str
    leaves: tuple[int, ...]
    nbytes: int
    source: str  # the source slice's key


@dataclass
class SyncPlan:
    """What a ``WeightSync`` planned for one tree signature: its buckets, and per pair of shardings (source slice
    and spec, destination spec) how many leaves and bytes take it. ``executions`` counts the calls that ran it."""

    buckets: tuple[Bucket, ...]
    pairs: dict[tuple[str, tuple, tuple], tuple[int, int]]
    leaves: int
    nbytes: int
    executions: int = 0
    _run: Callable[[list], list] | None = field(default=None, repr=False)
    _program: ProgramFunction | None = field(default=None, repr=False)

    @property
    def transfers(self) -> int:
        """Transfers per execution (a pack, a stack or a moved leaf is one; leaves that stay are none)."""
        return sum(1 for b in self.buckets if b.kind != "stay")

    def describe(self) -> str:
        """The plan in a few lines: buckets by kind and bytes, and the pairs of shardings."""
        kinds = Counter(b.kind for b in self.buckets)
        lines = [f"{self.leaves} leaves, {self.nbytes / 2**20:.2f} MiB in {len(self.buckets)} buckets "
                 f"({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))}), {self.transfers} transfers per sync"]
        for (src, have, want), (count, nbytes) in sorted(self.pairs.items(), key=lambda kv: -kv[1][1]):
            lines.append(f"  {src} P{have} -> P{want}: {count} leaves, {nbytes / 2**20:.2f} MiB")
        return "\n".join(lines)


def _leaf_info(leaf: Any) -> tuple:
    """A leaf's part of the plan's key: shape, dtype, weak type, slice key, normalised spec."""
    return tuple(leaf.shape), np.dtype(leaf.dtype) if not is_key_dtype(leaf.dtype) else leaf.dtype, \
        bool(leaf.weak_type), leaf.slice.key, norm_spec(leaf.spec)


def _nbytes(leaf: Any) -> int:
    if is_key_dtype(leaf.dtype):
        return int(np.prod(leaf.value.shape, dtype=np.int64)) * np.dtype(leaf.value.dtype).itemsize
    return int(np.prod(leaf.shape, dtype=np.int64)) * np.dtype(leaf.dtype).itemsize


class WeightSync:
    """Moves a pytree of ``pw.Array``s to ``slice``, each leaf resharded to its spec, by a plan made once per tree
    signature.

    Args:
        slice: the destination ``pw.VirtualSlice`` (the sampler's), on the same or another island.
        specs: one ``PartitionSpec`` for every leaf, or a pytree of them matching the params tree (a prefix
            of it: a spec stands for every leaf under it; ``None`` keeps a leaf's own spec).
        bucket_bytes: the most bytes one pack or stack carries (default 64 MiB).
        small_bytes: leaves of at most this many bytes are packed (default 64 KiB; 0: none).
        stack_bytes: leaves of at most this many bytes are stacked with leaves of the same shape and
            shardings (default 2 MiB; 0: none).
        name: the program's name in graphs and traces.

    ``sync(params)`` returns ``params``' pytree of ``pw.Array`` futures on ``slice`` (traced values inside a
    ``@pw.program``), bitwise what ``pw.transfer`` gives each leaf. ``sync.plan`` is the plan the last call
    ran; ``sync.plans_made`` counts the plans made (a call with a tree signature seen before makes none).

    Raises:
        ProgramError: ``slice`` is not a live slice, a spec is not a PartitionSpec or does not fit its leaf on
            ``slice``, ``specs`` does not match the params tree, or a leaf is not a usable ``pw.Array`` (inside a
            program: a value of that program).
    """

    def __init__(self, slice: VirtualSlice, specs: Any, bucket_bytes: int = BUCKET_BYTES,  # noqa: A002
                 small_bytes: int = SMALL_BYTES, stack_bytes: int = STACK_BYTES, name: str = "weight_sync") -> None:
        if not isinstance(slice, VirtualSlice):
            raise ProgramError(f"pw.WeightSync needs a pw.VirtualSlice to sync to, got {type(slice).__name__}")
        if slice.released:
            raise ProgramError(f"pw.WeightSync: {slice} was released; allocate a new slice")
        if int(bucket_bytes) <= 0 or int(small_bytes) < 0 or int(stack_bytes) < 0:
            raise ProgramError(f"pw.WeightSync: bucket_bytes must be positive, small_bytes and stack_bytes not "
                               f"negative; got {bucket_bytes}, {small_bytes} and {stack_bytes}")
        self.slice, self.specs = slice, specs
        self.bucket_bytes, self.small_bytes = int(bucket_bytes), min(int(small_bytes), int(bucket_bytes))
        self.stack_bytes = min(int(stack_bytes), int(bucket_bytes))
        self.name = name
        self.plan: SyncPlan | None = None
        self.plans_made = 0
        self._plans: dict[tuple, SyncPlan] = {}

    # -- calls ------------------------------------------------------------------------------------------------
    def __call__(self, params: Any) -> Any:
        if self.slice.released:
            raise ProgramError(f"pw.WeightSync: {self.slice} was released; allocate a new slice")
        leaves, treedef = jax.tree_util.tree_flatten(params)
        trace = current_trace()
        for k, leaf in enumerate(leaves):
            if trace is not None and isinstance(leaf, TracedValue) and leaf.trace is trace:
                continue
            if trace is None and isinstance(leaf, Array):
                check_usable(leaf, f"pw.WeightSync at {self._path(params, k)} got")
                continue
            where = "a value of the program being traced" if trace is not None else "a pw.Array"
            raise ProgramError(f"pw.WeightSync: the leaf at {self._path(params, k)} is "
                               f"{type(leaf).__name__}, not {where}; every leaf of the params tree must be one")
        key = (treedef, tuple(_leaf_info(leaf) for leaf in leaves))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._make_plan(params, leaves, treedef)
            if len(self._plans) >= MAX_PLANS:
                self._plans.pop(next(iter(self._plans)))
            self._plans[key] = plan
            self.plans_made += 1
        else:
            self._plans[key] = self._plans.pop(key)  # most recently used last
        self.plan = plan
        plan.executions += 1
        if trace is not None:
            out = plan._run(leaves)
        else:
            out = plan._program(leaves)
        return jax.tree_util.tree_unflatten(treedef, out)

    @staticmethod
    def _paths(params: Any) -> list[str]:
        """Where each leaf sits in ``params``, as the user wrote it (for errors)."""
        return [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]

    def _path(self, params: Any, k: int) -> str:
        paths = self._paths(params)
        return paths[k] if k < len(paths) else f"leaf {k}"

    # -- planning ---------------------------------------------------------------------------------------------
    def _targets(self, params: Any, leaves: list) -> list[P]:
        """Each leaf's destination spec, checked against its shape on the destination slice."""
        specs = self.specs
        if isinstance(specs, P) or specs is None:
            per_leaf: list = [specs] * len(leaves)
        else:
            spec_leaves, spec_tree = jax.tree_util.tree_flatten(specs, is_leaf=lambda s: s is None or isinstance(s, P))
            try:
                subtrees = spec_tree.flatten_up_to(params)
            except (ValueError, TypeError) as exc:
                raise ProgramError(f"pw.WeightSync: specs do not match the params tree ({exc}); give one "
                                   "PartitionSpec, or a pytree of them shaped like params (or a prefix of "
                                   "it)") from None
            per_leaf = []
            for spec, sub in zip(spec_leaves, subtrees):
                per_leaf.extend([spec] * len(jax.tree_util.tree_leaves(sub)))
        out = []
        paths = self._paths(params)
        for k, (spec, leaf) in enumerate(zip(per_leaf, leaves)):
            target = leaf.spec if spec is None else spec
            where = f"pw.WeightSync at {paths[k]}"
            if not isinstance(target, P):
                raise ProgramError(f"{where}: a spec must be a jax.sharding.PartitionSpec (or None to keep the "
                                   f"leaf's own), got {target!r}")
            check_spec(target, tuple(leaf.shape), self.slice.shape, self.slice.axis_names, where)
            out.append(target)
        return out

    def _make_plan(self, params: Any, leaves: list, treedef: Any) -> SyncPlan:
        targets = self._targets(params, leaves)
        buckets: list[Bucket] = []
        packs: dict[tuple, list[int]] = {}  # (source slice key, dtype) -> leaves of the pack being filled
        pack_bytes: dict[tuple, int] = {}
        pairs: dict[tuple, list[int]] = {}
        stays: dict[str, list[int]] = {}
        stacks: dict[tuple, list[int]] = {}  # (source slice key, shape, dtype, specs) -> the stack being filled
        sizes = [_nbytes(leaf) for leaf in leaves]
        for k, (leaf, target) in enumerate(zip(leaves, targets)):
            pair = pairs.setdefault((leaf.slice.key, norm_spec(leaf.spec), norm_spec(target)), [0, 0])
            pair[0] += 1
            pair[1] += sizes[k]
            if leaf.slice is self.slice and norm_spec(leaf.spec) == norm_spec(target):
                stays.setdefault(leaf.slice.key, []).append(k)
                continue
            plain = not leaf.weak_type and not is_key_dtype(leaf.dtype) and leaf.slice is not self.slice
            if plain and self.small_bytes < sizes[k] <= self.stack_bytes:
                like = (leaf.slice.key, tuple(leaf.shape), np.dtype(leaf.dtype).str, norm_spec(leaf.spec),
                        norm_spec(target))
                if like in stacks and (len(stacks[like]) + 1) * sizes[k] > self.bucket_bytes:
                    buckets.append(self._stack_or_leaf(stacks.pop(like), sizes, like[0]))
                stacks.setdefault(like, []).append(k)
                continue
            if not (plain and 0 < sizes[k] <= self.small_bytes):
                buckets.append(Bucket("leaf", (k,), sizes[k], leaf.slice.key))
                continue
            group = (leaf.slice.key, np.dtype(leaf.dtype).str)
            if group in packs and pack_bytes[group] + sizes[k] > self.bucket_bytes:
                buckets.append(Bucket("pack", tuple(packs.pop(group)), pack_bytes.pop(group), group[0]))
            packs.setdefault(group, []).append(k)
            pack_bytes[group] = pack_bytes.get(group, 0) + sizes[k]
        for group, members in packs.items():
            buckets.append(Bucket("pack", tuple(members), pack_bytes[group], group[0]))
        for like, members in stacks.items():
            buckets.append(self._stack_or_leaf(members, sizes, like[0]))
        for key, members in stays.items():
            buckets.append(Bucket("stay", tuple(members), sum(sizes[k] for k in members), key))
        buckets.sort(key=lambda b: b.leaves[0])  # tree order: the first leaves arrive first
        run = self._runner(buckets, leaves, targets)
        plan = SyncPlan(tuple(buckets), {k: (v[0], v[1]) for k, v in pairs.items()}, len(leaves), sum(sizes),
                        _run=run)
        plan._program = ProgramFunction(run, name=self.name)
        return plan

    @staticmethod
    def _stack_or_leaf(members: list[int], sizes: list[int], source: str) -> Bucket:
        """A stack of ``members``, or a leaf bucket when it is one leaf (nothing to stack it with)."""
        return Bucket("stack" if len(members) > 1 else "leaf", tuple(members), sum(sizes[k] for k in members),
                      source)

    def _runner(self, buckets: list[Bucket], leaves: list, targets: list[P]) -> Callable[[list], list]:
        """The body that executes the plan on a list of leaves (traced values of the program it runs in).

        Leaves that move alone go first, in tree order: their shards are there at once, so the destination takes
        them while the source still packs and stacks the rest. The packs and stacks of one source slice are made
        by one computation there and cut apart by one on the destination (a computation costs about as much as a
        transfer here, whatever its size)."""
        from client.jit import jit

        alone = [b for b in buckets if b.kind in ("leaf", "stay")]
        groups: dict[str, list[Bucket]] = {}
        for bucket in buckets:
            if bucket.kind in ("pack", "stack"):
                groups.setdefault(bucket.source, []).append(bucket)
        bundles = []
        for group in groups.values():
            members = [k for b in group for k in b.leaves]
            moved_specs = tuple(P(None, *targets[b.leaves[0]]) if b.kind == "stack" else P() for b in group)
            bundle = jit(_bundler([(b.kind, len(b.leaves)) for b in group]), slice=leaves[members[0]].slice,
                         in_specs=tuple(leaves[k].spec for k in members),
                         out_specs=tuple(P(None, *leaves[b.leaves[0]].spec) if b.kind == "stack" else P()
                                         for b in group), name=f"{self.name}_bundle")
            unbundle = jit(_unbundler([(b.kind, [tuple(leaves[k].shape) for k in b.leaves]) for b in group]),
                           slice=self.slice, in_specs=moved_specs, out_specs=tuple(targets[k] for k in members),
                           name=f"{self.name}_unbundle")
            bundles.append((members, moved_specs, bundle, unbundle))
        slice_ = self.slice

        def run(values: list) -> list:
            out: list = [None] * len(values)
            for bucket in alone:
                for k in bucket.leaves:
                    out[k] = values[k] if bucket.kind == "stay" else transfer(values[k], slice_, targets[k])
            for members, moved_specs, bundle, unbundle in bundles:
                made = bundle(*[values[k] for k in members])
                parts = unbundle(*[transfer(v, slice_, spec) for v, spec in zip(made, moved_specs)])
                for k, part in zip(members, parts):
                    out[k] = part
            return out

        return run


def _bundler(kinds: list[tuple[str, int]]) -> Callable:
    """The source's computation: each bucket's leaves (in order, ``count`` each) stacked or packed flat."""
    def bundle(*xs: jax.Array) -> tuple[jax.Array, ...]:
        out, at = [], 0
        for kind, count in kinds:
            part, at = xs[at:at + count], at + count
            out.append(jnp.stack(part) if kind == "stack" else jnp.concatenate([jnp.ravel(x) for x in part]))
        return tuple(out)

    return bundle


def _unbundler(kinds: list[tuple[str, list[tuple[int, ...]]]]) -> Callable:
    """The destination's computation: each bucket's buffer cut back into its leaves (of ``shapes``)."""
    def unbundle(*buffers: jax.Array) -> tuple[jax.Array, ...]:
        out: list = []
        for (kind, shapes), buffer in zip(kinds, buffers):
            if kind == "stack":
                out.extend(buffer[i] for i in range(len(shapes)))
                continue
            at = 0
            for shape in shapes:
                size = int(np.prod(shape, dtype=np.int64))
                out.append(jax.lax.slice(buffer, (at,), (at + size,)).reshape(shape))
                at += size
        return tuple(out)

    return unbundle
