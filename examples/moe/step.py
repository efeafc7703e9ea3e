"""Training steps: on one island (experts sharded over its devices), or across islands (one program per step).

``SingleIslandStep`` is one ``pw.jit`` computation: the whole forward and backward, with the experts split over
the slice's devices and the tokens dispatched and combined by all-to-all inside it.

``CrossIslandStep`` spreads the experts over several islands as a ``Placement`` says. Each island holds a copy
of the shared (non-expert) parameters and a share of the global batch. A step is one ``@pw.program``
(``program.run``): every island runs the model's segments on its own tokens and sends each MoE layer's
dispatched tokens to the islands holding their experts (static shapes from the capacities), which send the
outputs back; the backward pass takes the same routes. Between steps ``place`` moves or replicates experts
(weights and optimizer state travel island to island) without changing the model or the step's math.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import pathways as pw
from examples.moe import model
from examples.moe.config import MoeConfig
from examples.moe.placement import Placement
from examples.moe.program import IslandState, functions, optimizer, stats_vector
from examples.moe.program import run as program_run
from examples.palm.step import opt_state_specs

AXIS = "expert"
METRICS = ("loss", "cross_entropy", "aux", "accuracy")


@dataclass(frozen=True)
class Stats:
    """What a step reports: metrics, and per MoE layer the tokens each expert was sent and took."""

    metrics: dict[str, float]
    demand: np.ndarray  # [M, E] routing choices before capacity
    kept: np.ndarray  # [M, E] choices the experts took

    @classmethod
    def parse(cls, vector: np.ndarray, config: MoeConfig) -> Stats:
        n = len(config.moe_layers) * config.n_experts
        shape = (len(config.moe_layers), config.n_experts)
        metrics = dict(zip(METRICS, map(float, vector[:len(METRICS)])))
        rest = vector[len(METRICS):]
        return cls(metrics, rest[:n].reshape(shape).astype(np.int64), rest[n:2 * n].reshape(shape).astype(np.int64))

    @property
    def dropped(self) -> float:
        """Fraction of routing choices dropped for capacity."""
        total = self.demand.sum()
        return float(1.0 - self.kept.sum() / total) if total else 0.0


class SingleIslandStep:
    """The whole step as one computation on one slice of shape (n,) over axis ``"expert"``.

    Groups (sequences) and experts are both split over the n devices; with n == 1 the experts run in place.
    """

    def __init__(self, config: MoeConfig, s: pw.VirtualSlice) -> None:
        if s.axis_names != (AXIS,) or config.n_experts % s.shape[0]:
            raise ValueError(f"the single-island step needs a ({AXIS!r},) slice whose size divides the "
                             f"{config.n_experts} experts, got {s}")
        self.config, self.slice = config, s
        shapes = jax.eval_shape(lambda k: model.init_params(config, k), jax.random.key(0))
        self.param_specs = {"shared": jax.tree.map(lambda _: P(), shapes["shared"]),
                            "experts": jax.tree.map(lambda _: P(AXIS), shapes["experts"])}
        opt_shapes = jax.eval_shape(optimizer(config).init, shapes)
        self.opt_specs = opt_state_specs(opt_shapes, shapes, self.param_specs)
        tables = model.uniform_tables(config)
        opt = optimizer(config)

        def train_step(params: dict, opt_state: Any, batch: dict) -> tuple:
            experts = (model.experts_all_to_all(config, AXIS) if s.shape[0] > 1 and config.n_experts
                       else model.experts_local(tables))
            grads, metrics = jax.grad(lambda p: model.loss(p, batch, config, tables, experts), has_aux=True)(params)
            updates, opt_state = opt.update(grads, opt_state, params)
            vector = jnp.stack([metrics[k].astype(jnp.float32) for k in METRICS])
            return (optax.apply_updates(params, updates), opt_state,
                    stats_vector(vector, metrics["demand"], metrics["kept"]))

        self.fn = pw.jit(train_step, slice=s, in_specs=(self.param_specs, self.opt_specs, P(AXIS)),
                         out_specs=(self.param_specs, self.opt_specs, P()), name="moe_step_one_island")

    def put_state(self, params: dict) -> tuple[Any, Any]:
        """Host parameters (``model.init_params``) and a fresh optimizer state, placed on the slice."""
        opt_state = optimizer(self.config).init(params)
        put = lambda tree, specs: jax.tree.map(lambda x, spec: pw.put(np.asarray(x), self.slice, spec), tree, specs)  # noqa: E731
        return put(params, self.param_specs), put(opt_state, self.opt_specs)

    def __call__(self, state: tuple, batch: dict[str, np.ndarray]) -> tuple[tuple, pw.Array]:
        params, opt_state, vector = self.fn(state[0], state[1], batch)
        return (params, opt_state), vector

    def read(self, vector: pw.Array) -> Stats:
        return Stats.parse(vector.fetch(), self.config)


def _put_tree(tree: Any, s: pw.VirtualSlice) -> Any:
    return jax.tree.map(lambda x: pw.put(np.asarray(x), s), tree)


class CrossIslandStep:
    """One ``@pw.program`` per step over one slice per island; the experts placed by a ``Placement``."""

    def __init__(self, config: MoeConfig, slices: list[pw.VirtualSlice], placement: Placement) -> None:
        if len(slices) != placement.islands:
            raise ValueError(f"{len(slices)} slices for a placement over {placement.islands} islands")
        if len({s.island for s in slices}) != len(slices):
            raise ValueError("each island's slice must be on an island of its own")
        if len(placement.layers) != len(config.moe_layers) or placement.n_experts != config.n_experts:
            raise ValueError("the placement was made for another model: it places "
                             f"{placement.n_experts} experts in {len(placement.layers)} MoE layers")
        self.config, self.slices, self.placement = config, list(slices), placement
        self.shapes = jax.eval_shape(lambda k: model.init_params(config, k), jax.random.key(0))
        self.opt = optimizer(config)
        self._ones: list[pw.Array] | None = None
        self._programs: dict[Placement, Any] = {}

    @property
    def islands(self) -> int:
        return len(self.slices)

    # -- state ------------------------------------------------------------------------------------------
    def put_state(self, params: dict, placement: Placement | None = None) -> list[IslandState]:
        """Host parameters placed on the islands: the shared ones on each, each expert on its slots (of
        ``placement``, which becomes the step's, or of the step's current one) with a fresh Adam state."""
        if placement is not None:
            self._check(placement)
            self.placement = placement
        states = []
        for j, s in enumerate(self.slices):
            put = functools.partial(_put_tree, s=s)
            slots = [[{k: params["experts"][m][k][slot.expert] for k in ("wi", "wo")} for slot in layout[j]]
                     for m, layout in enumerate(self.placement.layers)]
            states.append(IslandState(put(params["shared"]), put(self.opt.init(params["shared"])), put(slots),
                                      put([[self.opt.init(w) for w in layer] for layer in slots])))
        return states

    def gather(self, states: list[IslandState]) -> dict:
        """The parameters as ``model.init_params`` lays them out (host arrays): shared from island 0, each
        expert from its first copy."""
        shared = jax.tree.map(lambda a: a.fetch(), states[0].shared)
        experts = []
        for m in range(len(self.config.moe_layers)):
            copies = [self.placement.replicated(m, e)[0] for e in range(self.config.n_experts)]
            ws = [jax.tree.map(lambda a: a.fetch(), states[j].slots[m][s]) for j, s in copies]
            experts.append({k: np.stack([w[k] for w in ws]) for k in ("wi", "wo")})
        return {"shared": shared, "experts": experts}

    def place(self, states: list[IslandState], placement: Placement) -> list[IslandState]:
        """The same parameters and optimizer state under a new placement: a slot takes the weights and Adam
        state of a copy of its expert on its own island if there is one, else of the first copy elsewhere
        (``pw.transfer``, island to island). Every copy is identical, so the model does not change."""
        self._check(placement)
        new = [IslandState(st.shared, st.shared_opt, [], []) for st in states]
        for m in range(len(placement.layers)):
            for j in range(self.islands):
                weights, opts = [], []
                for slot in placement.layers[m][j]:
                    copies = self.placement.replicated(m, slot.expert)
                    src, s = next(((i, s) for i, s in copies if i == j), copies[0])
                    w, o = states[src].slots[m][s], states[src].slot_opts[m][s]
                    if src != j:
                        w, o = pw.transfer(w, self.slices[j]), pw.transfer(o, self.slices[j])
                    weights.append(w)
                    opts.append(o)
                new[j].slots.append(weights)
                new[j].slot_opts.append(opts)
        self.placement = placement
        return new

    def _check(self, placement: Placement) -> None:
        if (placement.islands != self.islands or placement.n_experts != self.placement.n_experts
                or len(placement.layers) != len(self.placement.layers)):
            raise ValueError(f"a placement over {placement.islands} islands of {placement.n_experts} experts in "
                             f"{len(placement.layers)} MoE layers does not fit this step's "
                             f"{self.islands} islands, {self.placement.n_experts} experts, "
                             f"{len(self.placement.layers)} MoE layers")

    # -- the step -------------------------------------------------------------------------------------
    def __call__(self, states: list[IslandState], batch: dict[str, np.ndarray]) -> tuple[list, list]:
        """One step on the global batch (split by rows over the islands, in order); returns the new states and
        each island's stats vector (``read`` fetches them)."""
        size = batch["inputs"].shape[0]
        if size % self.islands:
            raise ValueError(f"global batch {size} must split evenly over {self.islands} islands")
        share = size // self.islands
        parts = [{k: pw.put(v[i * share:(i + 1) * share], s) for k, v in batch.items()}
                 for i, s in enumerate(self.slices)]
        if self._ones is None:
            self._ones = [pw.put(np.float32(1.0), s) for s in self.slices]
        return self.program()(states, parts, self._ones)

    def program(self) -> Any:
        """The step's ``@pw.program`` for the current placement (built once per placement)."""
        if self.placement not in self._programs:
            program = pw.program(functools.partial(program_run, functions(self.config, self.placement)))
            program.name = f"moe_step_{self.islands}islands"
            self._programs[self.placement] = program
        return self._programs[self.placement]

    def read(self, vectors: list[pw.Array]) -> tuple[Stats, list[Stats]]:
        """(The global batch's stats, each island's): metrics averaged over islands, counts added up."""
        per = [Stats.parse(v.fetch(), self.config) for v in vectors]
        metrics = {k: float(np.mean([s.metrics[k] for s in per])) for k in METRICS}
        return Stats(metrics, sum(s.demand for s in per), sum(s.kept for s in per)), per
