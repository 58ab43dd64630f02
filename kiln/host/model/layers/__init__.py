"""The layers every family shares, each computed as its transformers counterpart computes it.

Purpose: attention kinds (`attention`: grouped-query attention over the paged
cache; `latent_attention`: DeepSeek's multi-head latent attention;
`paged_attention`: a decode step's attention where the pages lie;
`compressed_attention` and `compressor`: DeepSeek-V4's compressed cache and
its indexer), feed-forward kinds (`mlp`; `moe`: softmax or grouped sigmoid
routing, shared experts; `clipped_experts`: V4's), `norms`, `rotary`,
`hyper_connections` (V4's residual streams), `collectives` (the
tensor-parallel sum, Python-free), `step` (what a step's layers share),
`stacked` (a run of same-shaped layers as stacked tensors, scanned) and
`quantized` (a quantized checkpoint's projections dequantized in the graph
where a layer reads them: the one place the format meets the layers).

Contracts: plain torch on one rank's shard; no family names here: a family
assembles these in kiln.host.model.families. Everything here is hashed into
every forward key (kiln.host.compile.key_sources).
"""
