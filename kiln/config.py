"""The model configuration: a Llama-style decoder described the way Hugging Face does.

Pure: no torch import. `ModelConfig.from_hf` reads a `config.json` dict;
`check_tp` says whether a tensor-parallel degree can split the model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kiln.errors import BadInput

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-style decoder (everything but the weights)."""

    vocab_size: int
    """Rows of the embedding and of the output head."""
    hidden_size: int
    """Width of the residual stream."""
    num_layers: int
    """Decoder blocks."""
    num_heads: int
    """Query heads; split across tensor-parallel ranks."""
    num_kv_heads: int
    """Key/value heads (grouped-query attention); split across ranks."""
    head_dim: int
    """Width of one attention head."""
    intermediate_size: int
    """Width of the SwiGLU MLP; split across ranks."""
    rope_theta: float = 10000.0
    """Base of the rotary embedding frequencies."""
    rms_norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    dtype: str = "float32"
    """Dtype of weights and activations."""

    def __post_init__(self) -> None:
        for field in ("vocab_size", "hidden_size", "num_layers", "num_heads",
                      "num_kv_heads", "head_dim", "intermediate_size"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise BadInput(f"config.json: {field} must be a positive integer, got {value!r}.")
        if self.num_heads % self.num_kv_heads:
            raise BadInput(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads}).")
        if self.head_dim % 2:
            raise BadInput(f"config.json: head_dim ({self.head_dim}) must be even for rotary embeddings.")
        if self.dtype not in DTYPE_BYTES:
            raise BadInput(f"config.json: torch_dtype {self.dtype!r} is not supported; use one of {sorted(DTYPE_BYTES)}.")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @classmethod
    def from_hf(cls, raw: dict) -> "ModelConfig":
        """Build from a Hugging Face Llama-style `config.json` dict."""
        if not isinstance(raw, dict):
            raise BadInput("config.json must hold a JSON object.")
        missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers",
                               "num_attention_heads", "intermediate_size") if k not in raw]
        if missing:
            raise BadInput(f"config.json lacks {', '.join(missing)}; it must describe a Llama-style decoder.")
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        head_dim = raw.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int) and heads else 0)
        return cls(
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            num_layers=raw["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=raw.get("num_key_value_heads", heads),
            head_dim=head_dim,
            intermediate_size=raw["intermediate_size"],
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
            dtype=raw.get("torch_dtype", "float32"),
        )

    def to_hf(self) -> dict:
        """The `config.json` dict that `from_hf` reads back."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "torch_dtype": self.dtype,
        }

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    def check_tp(self, tp: int) -> None:
        """Raise BadInput unless `tp` ranks can split heads, KV heads and the MLP evenly."""
        if not isinstance(tp, int) or tp <= 0:
            raise BadInput(f"--tp must be a positive integer, got {tp!r}.")
        for what, count in (("attention heads", self.num_heads), ("KV heads", self.num_kv_heads),
                            ("MLP intermediate size", self.intermediate_size)):
            if count % tp:
                ok = [d for d in range(1, count + 1) if count % d == 0 and self.num_heads % d == 0
                      and self.num_kv_heads % d == 0 and self.intermediate_size % d == 0]
                raise BadInput(
                    f"--tp {tp} does not divide the model's {count} {what}; "
                    f"use a tp that divides heads, KV heads and the MLP: {', '.join(map(str, ok))}.")

    def num_params(self) -> int:
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        per_layer = attn + mlp + 2 * self.hidden_size
        return self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size + self.hidden_size

    def weight_bytes_per_rank(self, tp: int) -> int:
        """Bytes of one rank's weights: sharded attention and MLP, replicated embeddings and norms."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads) // tp
        mlp = 3 * self.hidden_size * self.intermediate_size // tp
        per_layer = attn + mlp + 2 * self.hidden_size
        total = self.num_layers * per_layer + 2 * self.vocab_size * self.hidden_size + self.hidden_size
        return total * self.dtype_bytes


TINY = ModelConfig(vocab_size=1024, hidden_size=384, num_layers=2, num_heads=24,
                   num_kv_heads=12, head_dim=16, intermediate_size=1152)
"""The bundled tiny model: ~4M parameters; tp 1, 2, 3, 4 and 6 all divide it."""
