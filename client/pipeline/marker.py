"""``pw.pipeline.end_stage(x)``: the mark that ends one pipeline stage of an ordinary JAX function.

The mark is an identity primitive, so a marked model runs unchanged under ``jax.jit``, ``jax.grad`` or
``jax.vmap``. Differentiation keeps it visible: the tangent passes through the same primitive, and its
transpose is a second identity primitive (``END_STAGE_BWD``) in the backward pass. So the jaxpr of a whole
training step shows where every stage's forward ends and where its backward begins, which is what
``client.pipeline.split`` cuts at.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import PartitionSpec as P

from pathways.errors import ProgramError

END_STAGE = Primitive("pipeline_end_stage")
END_STAGE_BWD = Primitive("pipeline_end_stage_bwd")


def _identity(*xs: Any, **_: Any) -> tuple:
    return xs


def _abstract(*avals: Any, **_: Any) -> tuple:
    return avals


def _lower(ctx: Any, *xs: Any, **_: Any) -> list:
    return list(xs)


def _jvp(prim: Primitive) -> Any:
    def rule(primals: tuple, tangents: tuple, **params: Any) -> tuple:
        tangents = [ad.instantiate_zeros(t) for t in tangents]
        return prim.bind(*primals, **params), prim.bind(*tangents, **params)

    return rule


def _transpose(into: Primitive) -> Any:
    def rule(cts: tuple, *xs: Any, **params: Any) -> list:
        return list(into.bind(*[ad.instantiate_zeros(c) for c in cts], **params))

    return rule


def _batch(prim: Primitive) -> Any:
    def rule(args: tuple, dims: tuple, **params: Any) -> tuple:
        return prim.bind(*args, **params), dims

    return rule


for _prim, _other in ((END_STAGE, END_STAGE_BWD), (END_STAGE_BWD, END_STAGE)):
    _prim.multiple_results = True
    _prim.def_impl(_identity)
    _prim.def_abstract_eval(_abstract)
    mlir.register_lowering(_prim, _lower)
    ad.primitive_jvps[_prim] = _jvp(_prim)
    ad.primitive_transposes[_prim] = _transpose(_other)
    batching.primitive_batchers[_prim] = _batch(_prim)


def end_stage(x: Any, spec: P | None = None) -> Any:
    """Mark ``x`` (an array or a pytree of arrays) as the output of one pipeline stage.

    What the function computes after the mark runs on the next stage; the computation after the last
    mark (usually the loss) runs with the last stage. Mark the end of every stage, the last one included:
    a step with S marks splits into S stages. Outside ``pw.pipeline.jit`` the mark is the identity, so the
    same model runs under ``jax.jit``, ``jax.grad`` and ``jax.vmap`` as before.

        def model(params, x):
            for k, layer in enumerate(params):
                x = block(layer, x)
                if k % per_stage == per_stage - 1:
                    x = pw.pipeline.end_stage(x)
            return x

    Args:
        x: the stage's output: the activations the next stage reads.
        spec: how the activations (and their gradients) are sharded while they move between stages' slices,
            a PartitionSpec for every leaf; None: like the batch where a leaf has the batch dimension (the
            micro-batch's own sharding), replicated otherwise.

    Returns:
        ``x`` unchanged.
    """
    if spec is not None and not isinstance(spec, P):
        raise ProgramError(f"pw.pipeline.end_stage: spec must be a PartitionSpec or None, got {spec!r}")
    leaves, tree = jax.tree_util.tree_flatten(x)
    if not leaves:
        raise ProgramError("pw.pipeline.end_stage needs the stage's output arrays, got an empty pytree")
    return jax.tree_util.tree_unflatten(tree, END_STAGE.bind(*leaves, spec=spec))
