"""PaLM's pipeline-free training step as one ``@pw.program`` over one or two pods.

Each pod is an island with its own ("data", "model") slice. Every pod runs the
staged backward (``model.head_forward_backward`` then ``model.stage_backward``
group by group) on its share of the global batch, sends each piece of its
gradients to the other pod, and applies the optimizer to the sum of all pods'
gradients, in the same argument order everywhere, so every pod computes
bitwise-identical parameters.

A piece (the head's gradients, one layer group's, the embedding lookup's) is
packed into one buffer before it leaves, so it crosses as one message rather
than one per parameter (each message has a fixed cost, whatever its size).
A group's buffer is packed shard by shard on each device, so packing moves no
data, and it lands on the other pod's matching devices.

The runtime places each send right after the computation that produced its
value (sends run on a background thread), and each receive where the program
reads the value. So with ``overlap=True`` the program moves the gradients
where the optimizer reads them, each layer group's gradients leave as soon as
its backward is done, and the exchange runs under the next group's backward.
With ``overlap=False`` the pieces first pass through one computation that
needs all of them, so the exchange starts after the whole backward, as PaLM
ran it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import pathways as pw
from examples.palm import model, optim
from examples.palm.config import PalmConfig

DATA, MODEL = "data", "model"
ACT = P(DATA)  # activations and their cotangents: [batch, seq, d_model] split over the batch
SHARDS = P((DATA, MODEL))  # a packed buffer of sharded leaves: one chunk per device
METRICS = ("loss", "cross_entropy", "z_loss", "accuracy")
SPIKE_SCALE = 100.0  # what an injected spike multiplies the shared embedding (so the logits) by


def _is_spec(x: object) -> bool:
    return isinstance(x, P)


def opt_state_specs(opt_state: Any, params: Any, specs: Any) -> Any:
    """Specs for an optax state: a leaf shaped like a parameter (found by path suffix) takes its spec.

    Adafactor's unfactored second moment and momentum mirror the params; counts
    and factored row/column statistics are small and stay replicated.
    """
    by_path = {}
    for (path, leaf), spec in zip(jax.tree_util.tree_flatten_with_path(params)[0],
                                  jax.tree.leaves(specs, is_leaf=_is_spec)):
        by_path[tuple(path)] = (tuple(np.shape(leaf)), spec)

    def spec_of(path: tuple, leaf: Any) -> P:
        for start in range(len(path)):
            hit = by_path.get(tuple(path[start:]))
            if hit is not None and hit[0] == tuple(np.shape(leaf)):
                return hit[1]
        return P()

    return jax.tree_util.tree_map_with_path(spec_of, opt_state)


def pack(tree: Any) -> jax.Array:
    """Replicated leaves as one flat replicated buffer: one message per piece instead of one per leaf."""
    return jnp.concatenate([x.ravel() for x in jax.tree.leaves(tree)])


def unpack(flat: jax.Array, like: Any) -> Any:
    """The inverse of ``pack`` for a tree shaped like ``like``."""
    return _split(flat, jax.tree.structure(like), [leaf.shape for leaf in jax.tree.leaves(like)])


def pack_shards(tree: Any, specs: Any) -> jax.Array:
    """Sharded leaves as one flat buffer split over every device: each device packs the shards it holds.

    No data moves between devices, and since both pods shard alike, each device's chunk crosses host
    i to host i and lands where its unpacked shards belong.
    """
    mesh = jax.typeof(jax.tree.leaves(tree)[0]).sharding.mesh
    return jax.shard_map(lambda t: jnp.concatenate([x.ravel() for x in jax.tree.leaves(t)]), mesh=mesh,
                         in_specs=(specs,), out_specs=SHARDS, check_vma=False)(tree)


def unpack_shards(flat: jax.Array, like: Any, specs: Any) -> Any:
    """The inverse of ``pack_shards``: every leaf comes back with its sharding, without communication."""
    mesh = jax.typeof(flat).sharding.mesh
    sizes = dict(mesh.shape)
    local = []
    for leaf, spec in zip(jax.tree.leaves(like), jax.tree.leaves(specs, is_leaf=_is_spec)):
        shape = list(leaf.shape)
        for dim, entry in enumerate(spec):
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                shape[dim] //= sizes[axis]
        local.append(tuple(shape))
    treedef = jax.tree.structure(like)
    return jax.shard_map(lambda chunk: _split(chunk, treedef, local), mesh=mesh, in_specs=SHARDS,
                         out_specs=specs, check_vma=False)(flat)


def _split(flat: jax.Array, treedef: Any, shapes: list[tuple[int, ...]]) -> Any:
    parts = jnp.split(flat, np.cumsum([math.prod(shape) for shape in shapes])[:-1].tolist())
    return jax.tree.unflatten(treedef, [part.reshape(shape) for part, shape in zip(parts, shapes)])


def mean_grads(pod_grads: Sequence[dict], head_like: Any, group_like: list, layer_spec: Any) -> dict:
    """The mean of the pods' packed gradient pieces in the params structure, summed in pod order (so every pod
    that computes it gets the same bits)."""
    merged = []
    for g in pod_grads:
        head = unpack(g["head"], head_like)
        groups = [unpack_shards(flat, like, [layer_spec] * len(like)) for flat, like in zip(g["groups"], group_like)]
        merged.append(model.merge_group_grads({"embed": head["embed"] + g["lookup"],
                                               "final_norm": head["final_norm"], "groups": groups}))
    n = len(merged)
    return jax.tree.map(lambda *xs: functools.reduce(operator.add, xs) / n, *merged)


@dataclass(frozen=True)
class Functions:
    """The step's compiled pieces. They have no slice: each runs on the pod of its first argument."""

    embed_forward: pw.CompiledFunction
    stage_forward: dict[int, pw.CompiledFunction]  # by group length
    head: pw.CompiledFunction
    stage_backward: dict[int, pw.CompiledFunction]
    embed_backward: pw.CompiledFunction
    pack_head: pw.CompiledFunction
    pack_group: dict[int, pw.CompiledFunction]  # by group length
    apply: dict[int, pw.CompiledFunction]  # by number of pods
    eval_loss: pw.CompiledFunction
    exchange_buffer: pw.CompiledFunction
    blow_up: pw.CompiledFunction
    param_specs: Any
    opt_specs: Any


@functools.lru_cache(maxsize=8)
def functions(config: PalmConfig, optim_config: optim.OptimConfig, donate: bool = True) -> Functions:
    """Build (once per config) the pw.jit functions; their exports are shared by every slice of shape (2, 2).

    With ``donate``, the optimizer update donates the parameters and optimizer state it replaces, so each
    pod holds one copy of them through a step instead of two.
    """
    shapes = jax.eval_shape(lambda k: model.init_params(config, k), jax.random.key(0))
    specs = model.param_specs(shapes, DATA, MODEL)
    opt_shapes = jax.eval_shape(lambda p: optim.init_opt_state(p, optim_config), shapes)
    opt_specs = opt_state_specs(opt_shapes, shapes, specs)
    layer_spec = specs["layers"][0]
    head_specs = model.head_params(specs)
    batch_specs = model.batch_spec(DATA)
    sizes = sorted({stop - start for start, stop in config.group_bounds()})

    def head(h: dict, x: jax.Array, targets: jax.Array) -> tuple:
        metrics, grads, cot = model.head_forward_backward(h, x, targets, config)
        return jnp.stack([metrics[k] for k in METRICS]), grads, cot

    # One pod's gradient pieces, each packed into one buffer: the head's, each group's, the embedding lookup's.
    head_like, group_like = model.head_params(shapes), model.split_groups(shapes["layers"], config)
    grads_specs = {"lookup": P(), "head": P(), "groups": [SHARDS] * config.layer_groups}

    def apply(params: dict, opt_state: Any, *pod_grads: dict) -> tuple:
        grads = mean_grads(pod_grads, head_like, group_like, layer_spec)
        new_params, new_state = optim.apply_update(params, opt_state, grads, optim_config)
        return new_params, new_state, optax.tree.norm(grads)

    def eval_loss(params: dict, batch: dict) -> jax.Array:
        metrics = model.loss_fn(params, batch, config)[1]
        return jnp.stack([metrics[k] for k in METRICS])

    def per_size(fn: Any, name: str, extra: tuple, out: Any) -> dict[int, pw.CompiledFunction]:
        return {n: pw.jit(fn, in_specs=([layer_spec] * n, *extra), out_specs=out(n), name=f"{name}{n}")
                for n in sizes}

    return Functions(
        embed_forward=pw.jit(lambda e, t: model.embed_forward(e, t, config), in_specs=(P(), P(DATA)),
                             out_specs=ACT, name="embed_forward"),
        stage_forward=per_size(lambda g, x: model.stage_forward(g, x, config), "stage_forward", (ACT,),
                               lambda n: ACT),
        head=pw.jit(head, in_specs=(head_specs, ACT, P(DATA)), out_specs=(P(), head_specs, ACT),
                    name="head_forward_backward"),
        stage_backward=per_size(lambda g, x, c: model.stage_backward(g, x, c, config), "stage_backward",
                                (ACT, ACT), lambda n: ([layer_spec] * n, ACT)),
        embed_backward=pw.jit(lambda t, c: model.embed_backward(t, c, config), in_specs=(P(DATA), ACT),
                              out_specs=P(), name="embed_backward"),
        pack_head=pw.jit(pack, in_specs=(head_specs,), out_specs=P(), name="pack_head"),
        pack_group={n: pw.jit(lambda g, n=n: pack_shards(g, [layer_spec] * n), in_specs=([layer_spec] * n,),
                              out_specs=SHARDS, name=f"pack_group{n}") for n in sizes},
        apply={pods: pw.jit(apply, in_specs=(specs, opt_specs) + (grads_specs,) * pods,
                            out_specs=(specs, opt_specs, P()), name=f"apply_{pods}pod",
                            donate_argnums=(0, 1) if donate else ())
               for pods in (1, 2)},
        eval_loss=pw.jit(eval_loss, in_specs=(specs, batch_specs), out_specs=P(), name="eval_loss"),
        exchange_buffer=pw.jit(lambda g: g, in_specs=(grads_specs,), out_specs=grads_specs,
                               name="exchange_buffer"),
        blow_up=pw.jit(lambda e: e * SPIKE_SCALE, in_specs=(P(),), out_specs=P(), name="blow_up"),
        param_specs=specs,
        opt_specs=opt_specs,
    )


@dataclass
class PodState:
    """Parameters and optimizer state, one copy per pod (pw.Array pytrees)."""

    params: list
    opt_state: list


class TrainStep:
    """The step program bound to one slice per pod. Call it with a PodState and a global numpy batch.

    With ``donate`` (the default) a step consumes the PodState it is given: its parameters and optimizer
    state are donated to the update, so read (fetch, checkpoint, evaluate) a state before the next step.
    """

    def __init__(self, config: PalmConfig, optim_config: optim.OptimConfig, slices: Sequence[pw.VirtualSlice],
                 overlap: bool = True, donate: bool = True) -> None:
        if len(slices) not in (1, 2):
            raise ValueError(f"PaLM's step runs on one or two pods, got {len(slices)} slices")
        for s in slices:
            if s.axis_names != (DATA, MODEL):
                raise ValueError(f"each pod needs a ({DATA!r}, {MODEL!r}) slice, got {s}")
        self.config, self.optim_config = config, optim_config
        self.slices = list(slices)
        self.overlap = overlap
        self.donate = donate
        self.fns = functions(config, optim_config, donate)
        self.program = pw.program(self._step)
        self.program.name = f"palm_step_{len(slices)}pod" + ("_overlap" if overlap and len(slices) > 1 else "")

    @property
    def pods(self) -> int:
        return len(self.slices)

    # -- placing values ---------------------------------------------------------------------------
    def put_state(self, params: Any, opt_state: Any) -> PodState:
        """The same host values on every pod, sharded by the in-pod specs."""
        def put_tree(tree: Any, specs: Any, s: pw.VirtualSlice) -> Any:
            return jax.tree.map(lambda x, spec: pw.put(np.asarray(x), s, spec), tree, specs)

        fns = self.fns
        return PodState([put_tree(params, fns.param_specs, s) for s in self.slices],
                        [put_tree(opt_state, fns.opt_specs, s) for s in self.slices])

    def put_batch(self, batch: dict[str, np.ndarray]) -> list[dict]:
        """Split the global batch by rows: pod p gets the p-th contiguous share."""
        size = batch["inputs"].shape[0]
        if size % (2 * self.pods):
            raise ValueError(f"global batch {size} must divide into {self.pods} pod(s) x 2 data shards")
        share = size // self.pods
        spec = P(DATA)
        return [{k: pw.put(v[p * share:(p + 1) * share], s, spec) for k, v in batch.items()}
                for p, s in enumerate(self.slices)]

    def __call__(self, state: PodState, batch: dict[str, np.ndarray],
                 spike: bool = False) -> tuple[PodState, list, list]:
        """One training step; returns (new state, per-pod metric vectors [METRICS], per-pod grad norms).
        ``spike``: first blow up the parameters (``inject_spike``)."""
        if spike:
            state = self.inject_spike(state)
        params, opt_state, metrics, norms = self.program(state.params, state.opt_state, self.put_batch(batch))
        return PodState(params, opt_state), metrics, norms

    def read(self, state: PodState, metrics: list, norms: list) -> tuple[np.ndarray, float]:
        """What a step returned, fetched: metric vectors [pods x METRICS] and the gradient norm."""
        return np.stack([m.fetch() for m in metrics]), float(norms[0].fetch())

    def full_state(self, state: PodState) -> tuple[Any, Any]:
        """The parameters and optimizer state a checkpoint holds, as pw.Array pytrees: the first pod's copy
        (every pod holds the same bits)."""
        return state.params[0], state.opt_state[0]

    # -- the program --------------------------------------------------------------------------------
    def _backward(self, params: dict, batch: dict) -> Iterator[tuple[Any, Any]]:
        """One pod's forward and staged backward, yielding (key, gradient piece) in the order computed.

        Keys: "head" (with the metrics: (metrics, head grads)), then each group index from the last,
        then "lookup" (the embedding lookup's half of the embedding gradient). Each piece is one
        packed buffer, so it crosses to the other pod as one message.
        """
        fns, config = self.fns, self.config
        groups = model.split_groups(params["layers"], config)
        xs = [fns.embed_forward(params["embed"], batch["inputs"])]
        for group in groups:
            xs.append(fns.stage_forward[len(group)](group, xs[-1]))
        metrics, head_grads, cot = fns.head(model.head_params(params), xs.pop(), batch["targets"])
        yield "head", (metrics, fns.pack_head(head_grads))
        for g in reversed(range(len(groups))):
            group_grads, cot = fns.stage_backward[len(groups[g])](groups[g], xs[g], cot)
            yield g, fns.pack_group[len(groups[g])](group_grads)
        yield "lookup", fns.embed_backward(batch["inputs"], cot)

    def _assemble(self, pieces: dict) -> tuple[pw.Array, dict]:
        """(metrics, gradients) from one pod's pieces: {"head", "groups": [per group], "lookup"}."""
        metrics, head = pieces["head"]
        return metrics, {"head": head, "lookup": pieces["lookup"],
                         "groups": [pieces[g] for g in range(self.config.layer_groups)]}

    def _all_grads(self, params: list, batch: list) -> tuple[list, list]:
        """Every pod's (metrics, gradients)."""
        metrics, grads = zip(*[self._assemble(dict(self._backward(params[p], batch[p]))) for p in range(self.pods)])
        return list(metrics), list(grads)

    def _step(self, params: list, opt_state: list, batch: list) -> tuple:
        pods = range(self.pods)
        metrics, grads = self._all_grads(params, batch)
        if not self.overlap and self.pods > 1:
            # PaLM's order: the exchange starts once the whole backward is done. Routing the pieces through
            # one computation that needs all of them keeps any send from starting earlier.
            grads = [self.fns.exchange_buffer(g) for g in grads]
        # Same argument order on every pod (pod 0's grads, then pod 1's), so the sums are bitwise equal.
        # The runtime sends each piece right after the computation that produced it, so with overlap each
        # layer group's gradients travel while the next group's backward runs; the receives wait here.
        outs = [self.fns.apply[self.pods](params[q], opt_state[q],
                                          *[pw.transfer(grads[p], self.slices[q]) for p in pods])
                for q in pods]
        return [o[0] for o in outs], [o[1] for o in outs], metrics, [o[2] for o in outs]

    def inject_spike(self, state: PodState) -> PodState:
        """The same state with the shared embedding scaled up on every pod: the next loss explodes."""
        params = [{**p, "embed": self.fns.blow_up(p["embed"])} for p in state.params]
        return PodState(params, state.opt_state)

    # -- evaluation -------------------------------------------------------------------------------
    def eval_metrics(self, state: PodState, batch: dict[str, np.ndarray]) -> pw.Array:
        """Metric vector [METRICS] of the first pod's parameters on a batch (every pod holds the same ones)."""
        s = jax.tree.leaves(state.params[0])[0].slice
        placed = {k: pw.put(v, s, P(DATA)) for k, v in batch.items()}
        return self.fns.eval_loss(state.params[0], placed)


class ElasticTrainStep(TrainStep):
    """PaLM's step through ``pw.elastic.DataParallel``: the same computations as ``TrainStep`` on the same
    pods, so the same bits, but a pod may fail and come back. While one is out, the survivors compute its
    half of the batch too (``GLOBAL_BATCH``: the loss curve stays bitwise identical) or train on their
    own halves at a learning rate scaled by the live fraction (``POD_BATCH``).

    Nothing is donated: the runner keeps the state a step starts from until the step has landed (one
    more copy of the parameters and optimizer state on every pod). A step's state is a ``PodState`` that
    holds the first live pod's copy once ``read`` has had the step land.
    """

    def __init__(self, config: PalmConfig, optim_config: optim.OptimConfig, slices: Sequence[pw.VirtualSlice],
                 overlap: bool = True, policy: str = "global_batch",
                 on_event: Any = None) -> None:
        super().__init__(config, optim_config, slices, overlap=overlap, donate=False)
        self.runner = pw.elastic.DataParallel(self.slices, self._grads, self._update, batch_specs=P(DATA),
                                              policy=policy, on_event=on_event, name=f"palm_elastic_{self.pods}pod")

    def put_state(self, params: Any, opt_state: Any, step: int = 0) -> PodState:
        """The same host values on every live pod, as the state after ``step`` updates."""
        self.runner.start((params, opt_state), (self.fns.param_specs, self.fns.opt_specs), step=step)
        return self._landed(step)

    def __call__(self, state: PodState, batch: dict[str, np.ndarray],
                 spike: bool = False) -> tuple[PodState, Any, None]:
        """Submit one step (the runner continues from its own latest state, which ``state`` stands for);
        returns (its state, filled by ``read``; the pending step; None)."""
        pending = self.runner.submit(batch, transform=self._blow_up if spike else None)
        return PodState([], []), pending, None

    def read(self, state: PodState, metrics: Any, norms: None) -> tuple[np.ndarray, float]:
        """Have the step land (redone on the survivors if a pod failed): metric vectors [shares x METRICS], the
        gradient norm, and ``state`` filled with the step's parameters and optimizer state."""
        result = self.runner.result(metrics)
        landed = self._landed(result.step)
        state.params[:], state.opt_state[:] = landed.params, landed.opt_state
        return np.stack(result.metrics), float(result.aux)

    def _landed(self, step: int) -> PodState:
        landed, (params, opt_state) = self.runner.state()
        if landed != step:
            raise RuntimeError(f"the elastic runner's latest landed step is {landed}, not {step}")
        return PodState([params], [opt_state])

    # -- what the runner traces -------------------------------------------------------------------------
    def _grads(self, state: tuple, batch: dict) -> tuple[Any, Any]:
        metrics, grads = self._assemble(dict(self._backward(state[0], batch)))
        if not self.overlap:
            grads = self.fns.exchange_buffer(grads)
        return grads, metrics

    def _update(self, state: tuple, grads: list, lr_scale: float) -> tuple[tuple, Any]:
        fns = self.fns
        if lr_scale != 1.0:
            scaled = dataclasses.replace(self.optim_config, peak_lr=self.optim_config.peak_lr * lr_scale)
            fns = functions(self.config, scaled, False)
        params, opt_state, norm = fns.apply[len(grads)](state[0], state[1], *grads)
        return (params, opt_state), norm

    def _blow_up(self, state: tuple) -> tuple:
        return {**state[0], "embed": self.fns.blow_up(state[0]["embed"])}, state[1]
