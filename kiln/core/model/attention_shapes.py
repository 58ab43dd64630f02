"""Each attention kind's tensors in a decoder layer, by checkpoint name and shape (kiln.core.model.contract). Pure."""

from __future__ import annotations

from kiln.core.model.config import ModelConfig
from kiln.core.model.dsa_fields import indexer_shapes


def grouped(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Layer `p`'s grouped-query attention tensors (gpt-oss's sinks first: the module's own parameter)."""
    h, q, kv = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, tuple[int, ...]] = {f"{p}.self_attn.sinks": (cfg.num_heads,)} if cfg.attention_sinks else {}
    for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
        out[f"{p}.self_attn.{name}.weight"] = (rows, h)
        if cfg.qkv_bias:
            out[f"{p}.self_attn.{name}.bias"] = (rows,)
    if cfg.qk_norm:  # per head, or (MiniMax-M2) over all heads
        out[f"{p}.self_attn.q_norm.weight"] = (q if cfg.qk_norm_whole else cfg.head_dim,)
        out[f"{p}.self_attn.k_norm.weight"] = (kv if cfg.qk_norm_whole else cfg.head_dim,)
    out[f"{p}.self_attn.o_proj.weight"] = (h, q)
    if cfg.o_bias:
        out[f"{p}.self_attn.o_proj.bias"] = (h,)
    return out


def latent(cfg: ModelConfig, p: str) -> dict[str, tuple[int, ...]]:
    """Layer `p`'s latent attention tensors (DeepSeek's attention_bias: q_a, kv_a and o carry biases)."""
    h, a = cfg.hidden_size, f"{p}.self_attn"
    out: dict[str, tuple[int, ...]] = {}

    def linear(name: str, rows: int, cols: int, bias: bool = False) -> None:
        out[f"{a}.{name}.weight"] = (rows, cols)
        if bias:
            out[f"{a}.{name}.bias"] = (rows,)

    if cfg.q_lora_rank:
        linear("q_a_proj", cfg.q_lora_rank, h, cfg.o_bias)
        out[f"{a}.q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        linear("q_b_proj", cfg.num_heads * cfg.head_dim, cfg.q_lora_rank)
    else:
        linear("q_proj", cfg.num_heads * cfg.head_dim, h)
    linear("kv_a_proj_with_mqa", cfg.kv_lora_rank + cfg.qk_rope_head_dim, h, cfg.o_bias)
    out[f"{a}.kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    linear("kv_b_proj", cfg.num_heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    linear("o_proj", h, cfg.num_heads * cfg.v_head_dim, cfg.o_bias)
    if cfg.dsa is not None:  # DeepSeek sparse attention's lightning indexer, replicated
        out.update(indexer_shapes(cfg, a))
    return out
