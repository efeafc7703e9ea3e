"""Reinforcement learning across islands: ``pw.rl``.

The loop and its placements (a sampler slice and a trainer slice, colocated, disaggregated or asynchronous);
the objective (pure JAX, runs inside a jitted trainer step): ``Rollout`` (a batch of sampled completions and
the weight version that sampled them), ``group_advantages`` and ``grpo_loss`` (GRPO)."""

# -- the GRPO objective --
from client.rl.grpo import Rollout, group_advantages, grpo_loss

# -- the loop and its placements --
from client.rl.loop import Event, Loop, StepResult
from client.rl.placement import Mesh, Placement, asynchronous, colocated, disaggregated, placement

__all__ = ["Event", "Loop", "Mesh", "Placement", "StepResult", "asynchronous", "colocated", "disaggregated",
           "placement"]
__all__ += ["Rollout", "group_advantages", "grpo_loss"]
