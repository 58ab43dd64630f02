"""DeepSeek sparse attention's own settings (ModelConfig.dsa): DeepSeek-V3.2's and GLM-5's lightning indexer. Pure.

DeepSeek-V3's latent attention where each query attends only to the index_topk cached tokens a lightning indexer
ranks best (transformers' DeepseekV32Indexer, GlmMoeDsaIndexer): index_heads query heads of index_head_dim
from the query's low-rank latent (`self_attn.indexer.wq_b`), one key per token (`wk`, then a LayerNorm with a
bias, `k_norm`), their leading qk_rope_head_dim dims rotated (in halves for DeepSeek-V3.2, in interleaved pairs
for GLM-5); a token's score is sum_h w_h relu(q_h . k) / sqrt(index_head_dim), w (`weights_proj`) over the
token's hidden state / sqrt(index_heads). The indexer's key is cached with the latent and the rotary key (the
entry is latent, rotary key, index key) and the indexer is computed whole on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.core.errors import BadInput

ARCHITECTURES = ("deepseek_v32", "glm_moe_dsa")
"""The model_types whose latent attention is sparse: DeepSeek-V3.2, GLM-5."""


@dataclass(frozen=True)
class DsaFields:
    """The lightning indexer's settings (DeepseekV32Config's names in parentheses)."""

    index_heads: int
    """The indexer's query heads (index_n_heads)."""
    index_head_dim: int
    """Width of an indexer head and of a token's index key (index_head_dim)."""
    index_topk: int
    """Cached tokens a query attends to: the best by the indexer's score (index_topk)."""
    rope_interleave: bool
    """The indexer's rotated dims turn in interleaved pairs (GLM-5), not in halves (DeepSeek-V3.2)."""


def check(cfg) -> None:
    """BadInput naming the first of `cfg`'s (a ModelConfig) sparse-attention settings that cannot be."""
    if (cfg.dsa is not None) != (cfg.architecture in ARCHITECTURES):
        raise BadInput(f"config.json: the lightning indexer's fields (index_n_heads, index_head_dim, index_topk) go "
                       f"with model_type {' or '.join(ARCHITECTURES)}, and every one of them has them.")
    if cfg.dsa is None:
        return
    for field in ("index_heads", "index_head_dim", "index_topk"):
        value = getattr(cfg.dsa, field)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise BadInput(f"config.json: {field.replace('index_heads', 'index_n_heads')} must be a positive "
                           f"integer, got {value!r}.")
    if not cfg.latent or not cfg.q_lora_rank:
        raise BadInput("config.json: DeepSeek sparse attention's indexer reads the query's low-rank latent: it needs "
                       "latent attention with a q_lora_rank.")
    if cfg.dsa.index_head_dim < cfg.qk_rope_head_dim or cfg.qk_rope_head_dim % 2:
        raise BadInput(f"config.json: index_head_dim ({cfg.dsa.index_head_dim}) must hold the qk_rope_head_dim "
                       f"({cfg.qk_rope_head_dim}) dims the indexer rotates.")


def indexer_shapes(cfg, a: str) -> dict[str, tuple[int, ...]]:
    """The indexer's tensors of a layer's attention `a` (`model.layers.<i>.self_attn`), all replicated."""
    d, h = cfg.dsa.index_head_dim, cfg.hidden_size
    return {f"{a}.indexer.wq_b.weight": (cfg.dsa.index_heads * d, cfg.q_lora_rank), f"{a}.indexer.wk.weight": (d, h),
            f"{a}.indexer.k_norm.weight": (d,), f"{a}.indexer.k_norm.bias": (d,),
            f"{a}.indexer.weights_proj.weight": (cfg.dsa.index_heads, h)}


def indexer_params(cfg) -> int:
    """Parameters of one layer's indexer (every rank holds it whole)."""
    return sum(math.prod(shape) for shape in indexer_shapes(cfg, "").values())
