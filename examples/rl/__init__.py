"""Reinforcement learning with GRPO: a PaLM policy learns to sort digits.

Pure JAX, no runtime: ``task`` (the verifiable sorting task and its reward), ``model`` (the policy: KV-cached
generation, per-token log-probs, sampler and trainer shardings), ``step`` (the sampler step that makes a
``pw.rl.Rollout`` and the GRPO trainer step), ``local`` (the whole loop in one process, on CPU).
"""
