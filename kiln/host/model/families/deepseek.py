"""The DeepSeek-V3 decoder layer, as transformers' DeepseekV3DecoderLayer computes it.

    x = x + latent_attention(input_layernorm(x))
    x = x + mlp(post_attention_layernorm(x))

The attention is multi-head latent attention (kiln.host.model.layers.latent_attention:
the cache holds each token's latent and rotary key). The first
first_k_dense_replace layers keep a dense SwiGLU MLP; the others are a mixture
of experts routed by sigmoid scores within the best groups of experts, plus
shared experts every token runs (kiln.host.model.layers.moe).
"""

from __future__ import annotations

from kiln.host.model.layers.latent_attention import latent_attention
from kiln.host.model.families.llama import Layer, pre_norm_layer

layer: Layer = pre_norm_layer(latent_attention)
"""One DeepSeek-V3 decoder layer of one rank (see kiln.host.model.families.llama.Layer)."""
