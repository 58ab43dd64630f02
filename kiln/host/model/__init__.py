"""The decoders Kiln compiles, in plain torch, tensor-parallel: one rank's step over a paged KV cache.

It computes what transformers' classes compute for the configs kiln.core.model.hf_config
accepts. The shared layers, each as its transformers counterpart computes it:
- `attention`: grouped-query attention over the paged cache (q/k/v, o and their
  biases, per-head q/k norms, sliding windows, soft-capped scores);
- `latent_attention`: DeepSeek's multi-head latent attention (the cache holds
  each token's latent and rotary key);
- `mlp`: the gated MLP (SwiGLU, GeGLU); `moe`: mixtures of experts (softmax or
  DeepSeek's grouped sigmoid routing, shared experts);
- `norms` (RMSNorm, Gemma's (1 + weight) kind, soft caps), `rotary` (default,
  linear, llama3 and yarn frequencies; halves or interleaved pairs);
- `collectives`: the tensor-parallel sum, torch's native functional all_reduce
  (a package needs neither Python nor Kiln to run);
and one module per family's decoder layer: `llama` (Llama, Mistral, Qwen2,
Qwen3, Phi-3, Mixtral, Qwen2-MoE, Qwen3-MoE), `gemma` (Gemma 2 and 3),
`deepseek` (DeepSeek-V3), and `deepseek_v4` (DeepSeek-V4: its own decoder over a
slot cache, with `compressed_attention`, `compressor`, `hyper_connections`
and `clipped_experts`; `decoder_of` picks the decoder of a config). `decoder` holds the module that scans them, `step`
what every layer of a step shares, `shards` a rank's constants and example
inputs.

One rank's module holds its shard: heads/tp query heads, kv_heads/tp KV heads
and intermediate/tp MLP columns (each expert's too); embeddings, norms, routers
and the output head are replicated.
"""

from kiln.host.model.layers.collectives import all_reduce, host_group, solo_group
from kiln.host.model.decoder import ShardedDecoder, layer_of
from kiln.host.model.families.deepseek_v4 import DeepseekV4Decoder
from kiln.host.model.layers.moe import GATHER_BELOW, mixture_of_experts
from kiln.host.model.layers.rotary import rope_inv_freq
from kiln.host.model.layers.step import FULL_ATTENTION
from kiln.host.model.shards import (example_inputs, expected_shapes, random_state_dict, rank_constants,
                                     shard_state_dict)



def decoder_of(cfg, tp: int = 1, *, scan: bool = True):
    """One rank's decoder module of `cfg`: DeepSeek-V4's (its slot cache) or ShardedDecoder (every paged family)."""
    return (DeepseekV4Decoder if cfg.v4 is not None else ShardedDecoder)(cfg, tp, scan=scan)


__all__ = ["DeepseekV4Decoder", "FULL_ATTENTION", "GATHER_BELOW", "ShardedDecoder", "decoder_of", "all_reduce", "example_inputs", "expected_shapes",
           "host_group", "layer_of", "mixture_of_experts", "random_state_dict", "rank_constants",
           "rope_inv_freq", "shard_state_dict", "solo_group"]
