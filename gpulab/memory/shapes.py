"""Model shapes: the few numbers of a Llama-architecture decoder that fix its memory.

A `ModelShape` counts parameters exactly as `transformers.LlamaForCausalLM` allocates them,
so the calculator can be checked against a real model to the byte.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ModelShape:
    """Dimensions of a Llama-style decoder (RMSNorm, GQA attention, SwiGLU MLP, no biases)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if name != "tie_embeddings" and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        if self.hidden_size % self.num_heads:
            raise ValueError("hidden_size must be a multiple of num_heads")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def kv_dim(self) -> int:
        """Width of the K (or V) projection: kv heads x head dim (smaller than hidden under GQA)."""
        return self.num_kv_heads * self.head_dim

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out_features, in_features) of each projection in one decoder layer."""
        h, kv, i = self.hidden_size, self.kv_dim, self.intermediate_size
        return {
            "q_proj": (h, h),
            "k_proj": (kv, h),
            "v_proj": (kv, h),
            "o_proj": (h, h),
            "gate_proj": (i, h),
            "up_proj": (i, h),
            "down_proj": (h, i),
        }

    def layer_linear_params(self) -> int:
        return sum(o * i for o, i in self.linear_shapes().values())

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the LM head (counted once when they are tied)."""
        per_table = self.vocab_size * self.hidden_size
        return per_table if self.tie_embeddings else 2 * per_table

    @property
    def norm_params(self) -> int:
        """Two RMSNorm weights per layer and the final norm."""
        return (2 * self.num_layers + 1) * self.hidden_size

    @property
    def num_params(self) -> int:
        return self.num_layers * self.layer_linear_params() + self.embedding_params + self.norm_params

    def param_tensor_shapes(self) -> list[tuple[int, ...]]:
        """Shape of every parameter tensor, in the order the model registers them."""
        h = self.hidden_size
        shapes: list[tuple[int, ...]] = [(self.vocab_size, h)]
        for _ in range(self.num_layers):
            shapes += list(self.linear_shapes().values()) + [(h,), (h,)]
        shapes.append((h,))
        if not self.tie_embeddings:
            shapes.append((self.vocab_size, h))
        return shapes

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a `transformers.LlamaConfig` (or anything with the same attribute names)."""
        heads = config.num_attention_heads
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            tie_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        )

    def to_config_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `transformers.LlamaConfig`."""
        return {
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "tie_word_embeddings": self.tie_embeddings,
        }


# Published dimensions (the config.json of each checkpoint); nothing is downloaded.
KNOWN_SHAPES: dict[str, ModelShape] = {
    "llama3-1b": ModelShape(128256, 2048, 8192, 16, 32, 8, tie_embeddings=True),  # Llama-3.2-1B
    "llama3-3b": ModelShape(128256, 3072, 8192, 28, 24, 8, tie_embeddings=True),  # Llama-3.2-3B
    "llama3-8b": ModelShape(128256, 4096, 14336, 32, 32, 8),  # Llama-3.1-8B
    "llama3-70b": ModelShape(128256, 8192, 28672, 80, 64, 8),  # Llama-3.1-70B
}
