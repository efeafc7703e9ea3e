"""Model sizes for the MoE example, and the dense model of the same active FLOPs per token."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass


@dataclass(frozen=True)
class MoeConfig:
    """A decoder-only Transformer whose every other feed-forward block is a mixture of experts.

    Layer ``l`` has an MoE block when ``l % 2 == 1`` (GShard's "every other layer"). Each token goes to its
    top-2 experts; each expert takes at most ``capacity`` tokens per group (a group is one sequence).
    ``n_experts == 0`` makes every layer dense.
    """

    vocab_size: int = 256
    seq_len: int = 64
    d_model: int = 64
    n_heads: int = 4
    n_layers: int = 4
    ffn_dim: int = 256  # the dense layers' hidden width
    n_experts: int = 8
    expert_dim: int = 128  # each expert's hidden width
    top_k: int = 2
    capacity_factor: float = 1.25
    aux_weight: float = 0.01  # the load-balancing loss's weight (GShard: 0.01 ... 0.1)
    learning_rate: float = 3e-3
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.top_k != 2:
            raise ValueError(f"GShard's gating is top-2; got top_k={self.top_k}")
        if self.d_model % self.n_heads:
            raise ValueError(f"d_model {self.d_model} must divide into {self.n_heads} heads")
        if self.n_experts and self.n_experts < 2:
            raise ValueError(f"top-2 gating needs at least 2 experts, got {self.n_experts}")
        if self.capacity_factor <= 0:
            raise ValueError(f"capacity_factor must be positive, got {self.capacity_factor}")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """The layers whose feed-forward block is a mixture of experts."""
        return tuple(range(1, self.n_layers, 2)) if self.n_experts else ()

    @property
    def capacity(self) -> int:
        """Tokens one expert takes per group: GShard's ceil(k * S / E * capacity_factor)."""
        return max(1, math.ceil(self.top_k * self.seq_len * self.capacity_factor / self.n_experts))

    def dense_equivalent(self) -> MoeConfig:
        """The dense model with the same active FLOPs per token: each MoE block becomes one feed-forward block
        ``top_k`` experts wide (so ``top_k * expert_dim`` hidden units), every other part unchanged."""
        if self.ffn_dim != self.top_k * self.expert_dim:
            raise ValueError("the dense equivalent needs ffn_dim == top_k * expert_dim, so every layer's "
                             "feed-forward block does the same FLOPs")
        return dataclasses.replace(self, n_experts=0)

    def flops_per_token(self) -> float:
        """Training FLOPs per token (6 x active matmul parameters, plus attention's 12 * L * T * D)."""
        d, layers = self.d_model, self.n_layers
        attn = 4 * d * d
        ffn = 2 * d * self.ffn_dim
        active = layers * (attn + ffn) + self.vocab_size * d
        return 6 * active + 12 * layers * self.seq_len * d


CONFIGS = {
    "tiny": MoeConfig(seq_len=16, d_model=32, n_heads=2, ffn_dim=64, n_experts=4, expert_dim=32),
    "small": MoeConfig(),
    "base": MoeConfig(seq_len=128, d_model=128, n_heads=4, ffn_dim=512, n_experts=8, expert_dim=256),
}
