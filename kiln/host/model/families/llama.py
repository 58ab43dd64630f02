"""The Llama decoder layer, as transformers' LlamaDecoderLayer computes it; its kin share it.

    x = x + attention(input_layernorm(x))
    x = x + mlp(post_attention_layernorm(x))

Mistral (a sliding window), Qwen2 (q/k/v biases, a window from some layer on),
Qwen3 (per-head q/k norms), Phi-3 (its fused qkv_proj and gate_up_proj are cut
into the same q/k/v and gate/up constants when weights are read,
kiln.core.model.contract.FUSED) compute the same layer; Mixtral, Qwen2-MoE and
Qwen3-MoE put a mixture of experts in place of the MLP on their expert layers. Llama 4 computes it too, its
positions its own (kiln.host.model.layers.nope), its MLP and experts under `feed_forward`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.core.model.config import ModelConfig
from kiln.core.model.module_names import EXPERTS, mlp_module, router_of
from kiln.host.model.layers.attention import grouped_query_attention
from kiln.host.model.layers.mlp import gated_mlp
from kiln.host.model.layers.moe import mixture_of_experts
from kiln.host.model.layers.norms import rms_norm
from kiln.host.model.layers.step import StepContext

Layer = Callable[..., tuple[torch.Tensor, torch.Tensor]]
"""layer(cfg, tp, p, x, kv, window, ctx, picks=None) -> (x after the layer, this step's cache entry [E, b, t,
heads, width]): one decoder layer of one rank; a mixture-of-experts layer puts its choices in the dict `picks`
(kiln.host.model.layers.choices). `p` holds the layer's tensors by their checkpoint suffix
(`self_attn.q_proj.weight`, ...), `kv` the layer's cache [E, pages, page_tokens, heads, width], `window` a 0-d
window (tokens a query may look back, itself included) or None."""


def is_expert_layer(cfg: ModelConfig, p: dict[str, torch.Tensor]) -> bool:
    """The layer whose tensors `p` holds is a mixture-of-experts layer (it has a router)."""
    return bool(cfg.moe_layers) and f"{EXPERTS[cfg.architecture][0]}.{router_of(cfg)}" in p


def pre_norm_layer(attention: Callable[..., tuple[torch.Tensor, torch.Tensor]]) -> Layer:
    """Llama's layer around `attention(cfg, tp, p, h, kv, window, ctx, picks) -> (output, cache entry)`:
    DeepSeek-V3's layer is this one with latent attention (whose sparse kind makes choices, into `picks`)."""
    def layer(cfg: ModelConfig, tp: int, p: dict[str, torch.Tensor], x: torch.Tensor, kv: torch.Tensor,
              window: torch.Tensor | None, ctx: StepContext,
              picks: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        def norm(name: str, y: torch.Tensor) -> torch.Tensor:
            return rms_norm(y, p[f"{name}.weight"], cfg.rms_norm_eps, cfg.norm_unit_offset)

        attended, entry = attention(cfg, tp, p, norm("input_layernorm", x), kv, window, ctx, picks)
        x = x + attended
        h = norm("post_attention_layernorm", x)
        if is_expert_layer(cfg, p):
            return x + mixture_of_experts(cfg, tp, p, h, picks), entry
        return x + gated_mlp(cfg, tp, p, h, mlp_module(cfg)), entry

    return layer


layer: Layer = pre_norm_layer(grouped_query_attention)
"""One Llama-kin decoder layer of one rank (see kiln.host.model.decoder.Layer)."""
