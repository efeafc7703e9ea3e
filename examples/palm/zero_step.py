"""PaLM's two-pod step with ZeRO over the pods (``--zero 1|2|3``): each pod owns a share of the state.

The pods split the parameter leaves between them (``pw.zero.partition``, balanced by bytes within the head
and each layer group), and each pod keeps the optimizer state of its own leaves only. Every stage ends a step
with the same bits on every pod: a leaf is updated once, by its owner, and the other pods receive those bits.

- Stage 1: the gradients are exchanged whole, as in the replicated step (each piece packed, sent while the
  next group's backward runs); each pod computes the global norm from all of them, updates its share, and
  sends the updated share to the others.
- Stage 2: each pod sends the others only the gradients of their shares (a reduce-scatter), packed per owner
  and layer group, each leaving as soon as its group's backward is done. An owner sums its share over the
  pods, in pod order; the pods swap one scalar each (their share's sum of squares) for the global norm.
- Stage 3: a pod also holds only its share of the parameters. Before each layer group's forward, and again
  before its backward, the owners send their leaves of that group to the others; each send is issued one
  group ahead of where it is read, so it travels while the pods compute the group before. The last group's
  gathered copy is kept from its forward to its backward, which comes right after. Nothing is sent after
  the update: the next step gathers the new leaves.

Bytes crossing the network per step and pod, for P bytes of parameters and two pods: stage 0 sends P (its
whole gradients), stage 1 P + P/2 (the gradients, then the updated share), stage 2 P/2 + P/2 (the other
share's gradients, then the updated share), stage 3 P/2 of gradients plus about P/2 of parameters for the
forward and P/2 for the backward (less the last group and the head, which are gathered once).
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax
import optax
from jax.sharding import PartitionSpec as P

import pathways as pw
from examples.palm import model, optim
from examples.palm.config import PalmConfig
from examples.palm.step import (
    DATA,
    MODEL,
    SHARDS,
    PodState,
    TrainStep,
    mean_grads,
    opt_state_specs,
    pack,
    pack_shards,
    unpack,
    unpack_shards,
)

HEAD = "head"  # the head's piece (the shared embedding and the final norm); layer groups are pieces 0..G-1


@dataclass(frozen=True)
class Layout:
    """The parameter leaves (``jax.tree.leaves`` order), who owns each, and the step's pieces of them."""

    treedef: Any
    shapes: tuple  # ShapeDtypeStruct per leaf
    specs: tuple  # in-pod PartitionSpec per leaf
    part: pw.zero.Partition
    pieces: dict  # HEAD or group index -> leaf indices, ascending
    embed: int  # the shared embedding's leaf index (its owner also sums the lookup's gradients)
    opt_shapes: Any  # the whole optimizer state's shapes

    def owned(self, pod: int, piece: Any) -> list[int]:
        """The leaves of ``piece`` that ``pod`` owns."""
        return [i for i in self.pieces[piece] if self.part.owners[i] == pod]

    def pieces_of(self, pod: int) -> list:
        """The pieces in which ``pod`` owns a leaf, in leaf order."""
        return [k for k in self.pieces if self.owned(pod, k)]

    def share_specs(self, pod: int) -> list[P]:
        return [self.specs[i] for i in self.part.owned(pod)]

    def share_shapes(self, pod: int) -> list:
        return [self.shapes[i] for i in self.part.owned(pod)]

    def opt_share_specs(self, pod: int) -> Any:
        like = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in self.share_shapes(pod)]
        shapes = pw.zero.shard_state(self.opt_shapes, self.params_like(), self.part.owned(pod))
        return opt_state_specs(shapes, like, self.share_specs(pod))

    def params_like(self) -> Any:
        return jax.tree.unflatten(self.treedef, list(self.shapes))


@functools.lru_cache(maxsize=8)
def layout(config: PalmConfig, optim_config: optim.OptimConfig, pods: int) -> Layout:
    """The leaves of ``config``'s parameters shared over ``pods`` pods (the same on every process)."""
    shapes = jax.eval_shape(lambda k: model.init_params(config, k), jax.random.key(0))
    leaves, treedef = jax.tree.flatten(shapes)
    index = jax.tree.unflatten(treedef, list(range(len(leaves))))
    pieces: dict = {HEAD: sorted([index["embed"], index["final_norm"]])}
    for g, group in enumerate(model.split_groups(index["layers"], config)):
        pieces[g] = sorted(jax.tree.leaves(group))
    # an owner's share is its leaves piece by piece, in this order: the pieces must run in leaf order
    assert [i for p in pieces.values() for i in p] == list(range(len(leaves))), "pieces out of leaf order"
    part = pw.zero.partition(shapes, pods, list(pieces.values()))
    specs = jax.tree.leaves(model.param_specs(shapes, DATA, MODEL), is_leaf=lambda x: isinstance(x, P))
    opt_shapes = jax.eval_shape(lambda p: optim.init_opt_state(p, optim_config), shapes)
    return Layout(treedef, tuple(leaves), tuple(specs), part, pieces, index["embed"], opt_shapes)


def _replicated(specs: Sequence[P]) -> bool:
    return all(s == P() for s in specs)


@functools.lru_cache(maxsize=256)
def packer(specs: tuple[P, ...]) -> pw.CompiledFunction:
    """Leaves (of these in-pod specs) as one buffer, so they cross as one message: replicated leaves as one
    replicated buffer, otherwise each device packs the shards it holds (``step.pack_shards``)."""
    if _replicated(specs):
        return pw.jit(pack, in_specs=(list(specs),), out_specs=P(), name=f"zero_pack{len(specs)}")
    return pw.jit(lambda leaves: pack_shards(leaves, list(specs)), in_specs=(list(specs),), out_specs=SHARDS,
                  name=f"zero_pack_shards{len(specs)}")


def buffer_spec(specs: Sequence[P]) -> P:
    return P() if _replicated(specs) else SHARDS


def unpacked(flat: jax.Array, shapes: Sequence[Any], specs: Sequence[P]) -> list:
    """The inverse of ``packer`` (inside a jitted function)."""
    like = [jax.ShapeDtypeStruct(s.shape, s.dtype) for s in shapes]
    return unpack(flat, like) if _replicated(specs) else unpack_shards(flat, like, list(specs))


@functools.lru_cache(maxsize=256)
def unpacker(shapes: tuple, specs: tuple[P, ...]) -> pw.CompiledFunction:
    return pw.jit(lambda flat: unpacked(flat, shapes, specs), in_specs=(buffer_spec(specs),), out_specs=list(specs),
                  name=f"zero_unpack{len(specs)}")


@dataclass(frozen=True)
class ZeroFunctions:
    """Per owner: the reduce of its share's gradients, and its share's update (stage 1: from whole gradients)."""

    reduce: dict[int, pw.CompiledFunction]
    apply_share: dict[int, pw.CompiledFunction]
    apply_whole: dict[int, pw.CompiledFunction]


@functools.lru_cache(maxsize=8)
def zero_functions(config: PalmConfig, optim_config: optim.OptimConfig, pods: int, donate: bool) -> ZeroFunctions:
    lay = layout(config, optim_config, pods)
    shapes = lay.params_like()
    layer_spec = model.param_specs(shapes, DATA, MODEL)["layers"][0]
    head_like, group_like = model.head_params(shapes), model.split_groups(shapes["layers"], config)
    whole_grads_specs = {"lookup": P(), "head": P(), "groups": [SHARDS] * config.layer_groups}
    reduce, apply_share, apply_whole = {}, {}, {}
    for q in range(pods):
        pieces = lay.pieces_of(q)
        embed_at = lay.part.owned(q).index(lay.embed) if lay.embed in lay.part.owned(q) else None

        def reduce_fn(contribs: list, lookups: list, q: int = q, pieces: list = pieces,
                      embed_at: int | None = embed_at) -> tuple:
            per_pod = []
            for p, entries in enumerate(contribs):
                leaves: list = []
                for piece, entry in zip(pieces, entries):
                    idx = lay.owned(q, piece)
                    leaves += entry if p == q else unpacked(entry, [lay.shapes[i] for i in idx],
                                                            [lay.specs[i] for i in idx])
                if embed_at is not None:
                    leaves[embed_at] = leaves[embed_at] + lookups[p]
                per_pod.append(leaves)
            summed = [functools.reduce(operator.add, xs) / pods for xs in zip(*per_pod)]
            return summed, pw.zero.sq_norm(summed)

        contrib_specs = [[[lay.specs[i] for i in lay.owned(q, k)] if p == q
                          else buffer_spec([lay.specs[i] for i in lay.owned(q, k)]) for k in pieces]
                         for p in range(pods)]
        lookup_specs = [P()] * pods if embed_at is not None else []
        share_specs, opt_specs = lay.share_specs(q), lay.opt_share_specs(q)
        reduce[q] = pw.jit(reduce_fn, in_specs=(contrib_specs, lookup_specs), out_specs=(share_specs, P()),
                           name=f"zero_reduce{q}")

        def apply_fn(params: list, opt_state: Any, grads: list, partials: list) -> tuple:
            norm = pw.zero.global_norm(partials)
            new_params, new_state = optim.apply_share_update(params, opt_state, grads, norm, optim_config)
            return new_params, new_state, norm

        donated = (0, 1) if donate else ()
        apply_share[q] = pw.jit(apply_fn, in_specs=(share_specs, opt_specs, share_specs, [P()] * pods),
                                out_specs=(share_specs, opt_specs, P()), donate_argnums=donated,
                                name=f"zero_apply{q}")

        def whole_fn(params: list, opt_state: Any, *pod_grads: dict, q: int = q) -> tuple:
            grads = mean_grads(pod_grads, head_like, group_like, layer_spec)
            norm = optax.tree.norm(grads)
            share = lay.part.take(jax.tree.leaves(grads), q)
            new_params, new_state = optim.apply_share_update(params, opt_state, share, norm, optim_config)
            return new_params, new_state, norm

        apply_whole[q] = pw.jit(whole_fn, in_specs=(share_specs, opt_specs) + (whole_grads_specs,) * pods,
                                out_specs=(share_specs, opt_specs, P()), donate_argnums=donated,
                                name=f"zero_apply_whole{q}")
    return ZeroFunctions(reduce, apply_share, apply_whole)


class ZeroTrainStep(TrainStep):
    """PaLM's step with ZeRO stage 1, 2 or 3 over two or more pods; call it like ``TrainStep``.

    A ``PodState`` holds, per pod: stages 1 and 2, the whole parameter pytree (as in ``TrainStep``) and the
    pod's share of the optimizer state (``pw.zero.shard_state``); stage 3, the pod's share of the parameters
    (a list of leaves, ``Layout.part.owned(pod)``) and of the optimizer state. ``full_state`` joins the
    shares for a checkpoint. With ``donate`` a step consumes the state it is given, as ``TrainStep`` does.
    """

    def __init__(self, config: PalmConfig, optim_config: optim.OptimConfig, slices: Sequence[pw.VirtualSlice],
                 stage: int, donate: bool = True) -> None:
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3 (0 is TrainStep, the replicated step), got {stage!r}")
        if len(slices) < 2:
            raise ValueError(f"ZeRO shares the state over the pods: it needs two or more, got {len(slices)}")
        super().__init__(config, optim_config, slices, overlap=True, donate=donate)
        self.stage = stage
        self.layout = layout(config, optim_config, self.pods)
        self.zfns = zero_functions(config, optim_config, self.pods, donate)
        self.program = pw.program(self._step)
        self.program.name = f"palm_step_{self.pods}pod_zero{stage}"

    # -- placing and reading state --------------------------------------------------------------------------
    def put_state(self, params: Any, opt_state: Any) -> PodState:
        """Host values as each pod's share (stages 1-2: the whole parameters too)."""
        lay = self.layout
        leaves = jax.tree.leaves(params)
        pod_params, pod_opt = [], []
        for q, s in enumerate(self.slices):
            held = leaves if self.stage < 3 else lay.part.take(leaves, q)
            specs = lay.specs if self.stage < 3 else lay.share_specs(q)
            placed = [pw.put(jax.device_get(x), s, spec) for x, spec in zip(held, specs)]
            pod_params.append(jax.tree.unflatten(lay.treedef, placed) if self.stage < 3 else placed)
            opt_share = pw.zero.shard_state(opt_state, params, lay.part.owned(q))
            pod_opt.append(jax.tree.map(lambda x, spec, s=s: pw.put(jax.device_get(x), s, spec), opt_share,
                                        lay.opt_share_specs(q)))
        return PodState(pod_params, pod_opt)

    def _whole(self, pod: int, share: list, others: list) -> Any:
        """The whole parameter pytree on ``pod``: its own share's leaves where it owns them, else ``others``'."""
        owned = dict(zip(self.layout.part.owned(pod), share))
        return jax.tree.unflatten(self.layout.treedef, [owned.get(i, x) for i, x in enumerate(others)])

    def _share(self, state_params: Any, pod: int) -> list:
        """``pod``'s share of the parameter leaves, from what its PodState holds."""
        if self.stage == 3:
            return list(state_params)
        return self.layout.part.take(jax.tree.leaves(state_params), pod)

    def full_state(self, state: PodState) -> tuple[Any, Any]:
        """The whole parameters and optimizer state, each leaf taken from the pod that owns it."""
        lay = self.layout
        shares = [self._share(p, q) for q, p in enumerate(state.params)]
        params = jax.tree.unflatten(lay.treedef, lay.part.join(shares))
        return params, pw.zero.join_state(state.opt_state, lay.params_like(), lay.part)

    def eval_metrics(self, state: PodState, batch: dict) -> pw.Array:
        """Metric vector [METRICS] of the parameters on a batch, evaluated on the first pod."""
        if self.stage < 3:
            return super().eval_metrics(state, batch)
        params, _ = self.full_state(state)
        first = self.slices[0]
        on_first = jax.tree.map(lambda x: x if x.slice is first else pw.transfer(x, first), params)
        return super().eval_metrics(PodState([on_first], []), batch)

    def inject_spike(self, state: PodState) -> PodState:
        """The same state with the shared embedding scaled up wherever a pod holds it."""
        lay = self.layout
        params = []
        for q, p in enumerate(state.params):
            if self.stage == 3:
                owned = lay.part.owned(q)
                p = [self.fns.blow_up(x) if i == lay.embed else x for i, x in zip(owned, p)]
            else:
                p = {**p, "embed": self.fns.blow_up(p["embed"])}
            params.append(p)
        return PodState(params, state.opt_state)

    # -- the program ------------------------------------------------------------------------------------------
    def _step(self, params: list, opt_state: list, batch: list) -> tuple:
        if self.stage == 1:
            metrics, grads = self._all_grads(params, batch)
            outs = [self.zfns.apply_whole[q](self._share(params[q], q), opt_state[q],
                                             *[pw.transfer(grads[p], s) for p in range(self.pods)])
                    for q, s in enumerate(self.slices)]
        else:
            metrics, contribs, lookups = self._scatter_grads(params, batch)
            outs = self._update_shares(params, opt_state, contribs, lookups)
        shares = [o[0] for o in outs]
        new_params = shares if self.stage == 3 else self._publish(params, shares)
        return new_params, [o[1] for o in outs], metrics, [o[2] for o in outs]

    def _update_shares(self, params: list, opt_state: list, contribs: list, lookups: list) -> list:
        """Each owner sums its share's gradients over the pods, the pods swap their sums of squares, and each
        owner updates its share: [(new share, new optimizer share, global norm)] by pod."""
        reduced = []
        for q, s in enumerate(self.slices):
            mine = [[contribs[p][q][k] if p == q else pw.transfer(contribs[p][q][k], s)
                     for k in self.layout.pieces_of(q)] for p in range(self.pods)]
            theirs = [lk if p == q else pw.transfer(lk, s) for p, lk in enumerate(lookups)] \
                if self.layout.embed in self.layout.part.owned(q) else []
            reduced.append(self.zfns.reduce[q](mine, theirs))
        outs = []
        for q, s in enumerate(self.slices):
            partials = [r[1] if p == q else pw.transfer(r[1], s) for p, r in enumerate(reduced)]
            outs.append(self.zfns.apply_share[q](self._share(params[q], q), opt_state[q], reduced[q][0], partials))
        return outs

    def _publish(self, params: list, shares: list) -> list:
        """Stages 1-2: each owner sends its updated leaves, one packed buffer per piece, to every other pod;
        each pod's new parameter pytree is its own share and what it received."""
        lay = self.layout
        received: list[dict] = [{} for _ in self.slices]
        for q in range(self.pods):
            mine = dict(zip(lay.part.owned(q), shares[q]))
            for piece in lay.pieces_of(q):
                idx = lay.owned(q, piece)
                buf = packer(tuple(lay.specs[i] for i in idx))([mine[i] for i in idx])
                for p, s in enumerate(self.slices):
                    if p != q:
                        out = unpacker(tuple(lay.shapes[i] for i in idx), tuple(lay.specs[i] for i in idx))(
                            pw.transfer(buf, s))
                        received[p].update(zip(idx, out))
        return [self._whole(p, shares[p], [received[p].get(i) for i in range(len(lay.shapes))])
                for p in range(self.pods)]

    def _scatter_grads(self, params: list, batch: list) -> tuple[list, list, list]:
        """Stages 2-3: every pod's forward and staged backward, interleaved group by group so that stage 3's
        gathers can be issued one group ahead on the owners. Returns (metrics by pod, contributions
        ``[p][q][piece]`` = pod p's gradients of q's leaves in the piece: the leaves where p is q, else one
        packed buffer, and each pod's gradient of the embedding lookup)."""
        lay, fns, config = self.layout, self.fns, self.config
        pods, groups = range(self.pods), config.layer_groups
        contribs: list[list[dict]] = [[{} for _ in pods] for _ in pods]
        gather = _Gather(self, params)

        def contribute(p: int, piece: Any, grads: Any) -> None:
            leaves = jax.tree.leaves(grads)
            for q in pods:
                idx = [k for k, i in enumerate(lay.pieces[piece]) if lay.part.owners[i] == q]
                if not idx:
                    continue
                part = [leaves[k] for k in idx]
                contribs[p][q][piece] = part if p == q else packer(tuple(lay.specs[lay.pieces[piece][k]]
                                                                         for k in idx))(part)

        gather.publish(HEAD, "forward")
        gather.publish(0, "forward")
        heads = [dict(zip(("embed", "final_norm"), gather(HEAD, "forward", p))) for p in pods]
        xs = [[fns.embed_forward(heads[p]["embed"], batch[p]["inputs"])] for p in pods]
        last: list = [None] * self.pods
        for g in range(groups):
            if g + 1 < groups:
                gather.publish(g + 1, "forward")
            for p in pods:
                group = gather.group(g, "forward", p)
                xs[p].append(fns.stage_forward[len(group)](group, xs[p][-1]))
                if g == groups - 1:
                    last[p] = group
        metrics, cots = [], []
        for p in pods:
            m, head_grads, cot = fns.head(model.head_params(heads[p]), xs[p].pop(), batch[p]["targets"])
            metrics.append(m)
            cots.append(cot)
            contribute(p, HEAD, head_grads)
        for g in reversed(range(groups)):
            if g >= 1:
                gather.publish(g - 1, "backward")
            for p in pods:
                group = last[p] if g == groups - 1 else gather.group(g, "backward", p)
                group_grads, cots[p] = fns.stage_backward[len(group)](group, xs[p][g], cots[p])
                contribute(p, g, group_grads)
        lookups = [fns.embed_backward(batch[p]["inputs"], cots[p]) for p in pods]
        return metrics, contribs, lookups


class _Gather:
    """Where a pod's forward and backward read a piece's parameters: stages 1-2 hold them all; in stage 3 each
    owner packs its leaves of the piece (``publish``: placed in its order where called) and every other pod
    receives and unpacks them where it reads them."""

    def __init__(self, step: ZeroTrainStep, params: list) -> None:
        self.step, self.params = step, params
        self.sent: dict = {}

    def publish(self, piece: Any, phase: str) -> None:
        step, lay = self.step, self.step.layout
        if step.stage < 3:
            return
        for q in range(step.pods):
            idx = lay.owned(q, piece)
            if idx:
                mine = dict(zip(lay.part.owned(q), self.params[q]))
                self.sent[(piece, phase, q)] = packer(tuple(lay.specs[i] for i in idx))([mine[i] for i in idx])

    def __call__(self, piece: Any, phase: str, pod: int) -> list:
        """The piece's leaves (in leaf order) on ``pod``."""
        step, lay = self.step, self.step.layout
        if step.stage < 3:
            leaves = jax.tree.leaves(self.params[pod])
            return [leaves[i] for i in lay.pieces[piece]]
        have = dict(zip(lay.part.owned(pod), self.params[pod]))
        for q in range(step.pods):
            idx = lay.owned(q, piece)
            if q != pod and idx:
                moved = pw.transfer(self.sent[(piece, phase, q)], step.slices[pod])
                out = unpacker(tuple(lay.shapes[i] for i in idx), tuple(lay.specs[i] for i in idx))(moved)
                have.update(zip(idx, out))
        return [have[i] for i in lay.pieces[piece]]

    def group(self, g: int, phase: str, pod: int) -> list:
        """Layer group ``g``'s parameters on ``pod``, as the stage functions take them (a list of layer dicts)."""
        leaves = self(g, phase, pod)
        index = jax.tree.unflatten(self.step.layout.treedef, list(range(len(self.step.layout.shapes))))
        like = model.split_groups(index["layers"], self.step.config)[g]
        return jax.tree.unflatten(jax.tree.structure(like), leaves)
