"""The decoders Kiln compiles, in plain torch, tensor-parallel: one rank's step over its cache.

It computes what transformers' classes compute for the configs
kiln.core.model.hf_config accepts, in three rooms:
- `layers/`: what every family shares (attention kinds, the MLP and experts,
  norms, rotary, collectives, the step's context, stacked runs of layers);
- `families/`: one module per family's decoder layer, assembled from those
  layers and read top to bottom (`llama`, `gemma`, `deepseek`, `deepseek_v4`);
- here: `decoder` (ShardedDecoder: embeddings, the scanned runs of layers, the
  head, for every paged family), `shards` (a rank's constants and example
  inputs) and `decoder_of`, which picks the decoder of a config (DeepSeek-V4's
  slot-cache decoder or ShardedDecoder).

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



def decoder_of(cfg, tp: int = 1, *, scan: bool = True, rank: int = 0):
    """Rank `rank`'s decoder module of `cfg` (its share: kiln.core.model.shares): DeepSeek-V4's (its slot cache)
    or ShardedDecoder (every paged family)."""
    return (DeepseekV4Decoder if cfg.v4 is not None else ShardedDecoder)(cfg, tp, scan=scan, rank=rank)


__all__ = ["DeepseekV4Decoder", "FULL_ATTENTION", "GATHER_BELOW", "ShardedDecoder", "decoder_of", "all_reduce", "example_inputs", "expected_shapes",
           "host_group", "layer_of", "mixture_of_experts", "random_state_dict", "rank_constants",
           "rope_inv_freq", "shard_state_dict", "solo_group"]
