"""Model shapes for the PaLM example, and the counts derived from them.

Parameter counts and FLOPs are computed from the shapes alone so that the
training script can report MFU without building the model.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PalmConfig:
    """Shapes of a PaLM-style decoder (hashable, so jit can take it as a static argument).

    ``layer_groups`` splits the layer stack into that many contiguous groups whose
    gradients become ready one after another in the backward pass, so the runtime
    can exchange one group's gradients while it computes the next.
    """

    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int
    ffn_dim: int
    seq_len: int
    vocab_size: int = 256
    z_loss: float = 1e-4
    layer_groups: int = 1
    rope_base: float = 10_000.0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "head_dim", "ffn_dim", "seq_len", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"PalmConfig.{name} must be a positive int, got {value!r}")
        if self.head_dim % 2:
            raise ValueError(f"PalmConfig.head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not 1 <= self.layer_groups <= self.n_layers:
            raise ValueError(f"PalmConfig.layer_groups must be in [1, n_layers={self.n_layers}], "
                             f"got {self.layer_groups}")

    def group_bounds(self) -> tuple[tuple[int, int], ...]:
        """(start, stop) layer indices of each group; earlier groups take the remainder."""
        base, extra = divmod(self.n_layers, self.layer_groups)
        bounds, start = [], 0
        for g in range(self.layer_groups):
            stop = start + base + (1 if g < extra else 0)
            bounds.append((start, stop))
            start = stop
        return tuple(bounds)

    def params_per_layer(self) -> int:
        """Weights of one parallel block: shared norm scale, multi-query attention, SwiGLU MLP."""
        d, h, q, f = self.d_model, self.n_heads, self.head_dim, self.ffn_dim
        attention = d * h * q + 2 * d * q + h * q * d  # query heads, one key and one value head, output
        mlp = 3 * d * f  # gate, up, down
        return d + attention + mlp

    def n_embed_params(self) -> int:
        """The shared input/output embedding."""
        return self.vocab_size * self.d_model

    def n_params(self) -> int:
        """Exact parameter count of ``model.init_params``: embedding, layers, final norm scale."""
        return self.n_embed_params() + self.n_layers * self.params_per_layer() + self.d_model

    def flops_per_token(self) -> float:
        """Training FLOPs per token by PaLM's formula (Appendix B): 6N + 12·L·H·Q·T.

        N here is every parameter, the shared embedding included. That is right for a
        tied embedding: the output-logit matmul really costs 6·V·D per token and the
        input lookup costs nothing, so the only overcount is the norm scales. (With a
        byte vocabulary the embedding is under 0.1% of N for the GPU configs anyway.)
        The attention term counts the full T×T score matrix, causal mask or not.
        """
        attention = 12 * self.n_layers * self.n_heads * self.head_dim * self.seq_len
        return 6.0 * self.n_params() + attention


# Parameter counts (PalmConfig.n_params, byte vocabulary) and PaLM training FLOPs per token:
#   tiny   135,360        8.6e5  -- unit tests: quick to compile and run on CPU
#   small  2,188,224      1.4e7  -- the CPU demo (python -m examples.palm.train --config small)
#   350m   355,755,008    2.4e9  -- one GPU
#   1b     1,066,964,992  7.3e9  -- one or more GPUs
CONFIGS: dict[str, PalmConfig] = {
    "tiny": PalmConfig(d_model=64, n_layers=2, n_heads=4, head_dim=16, ffn_dim=256, seq_len=32, layer_groups=2),
    "small": PalmConfig(d_model=192, n_layers=4, n_heads=4, head_dim=48, ffn_dim=768, seq_len=128,
                        layer_groups=2),
    "350m": PalmConfig(d_model=1024, n_layers=24, n_heads=16, head_dim=64, ffn_dim=4096, seq_len=1024,
                       layer_groups=4),
    "1b": PalmConfig(d_model=2048, n_layers=18, n_heads=16, head_dim=128, ffn_dim=8192, seq_len=2048,
                     layer_groups=3),
}
