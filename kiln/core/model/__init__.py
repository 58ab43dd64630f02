"""The model's description: what one forward step computes, in plain data.

Purpose: `ModelConfig` (every setting that changes a step's math) and its
per-rank sizes (`param_counts`); the consumer contract of a forward's weights
(`contract`) and of its inputs and outputs (`interface`); what a rank's cache
holds (`cache_layout`); which layers one scan runs (`layer_runs`); DeepSeek-V4's
own fields (`v4_fields`); a quantized checkpoint's format (`quant`: FP8 blocks,
which tensors, their scales and a rank's grid of them); and what a checkpoint
says of itself: its
`config.json` read by an allow-list (`hf_config/`) and its safetensors headers
(`safetensors_header`, the one reader of that untrusted metadata).

Contracts: pure (no torch, no I/O); imports kiln.core.errors only, from
outside this package. Several of these modules shape compiled graphs and are
hashed into every forward key (kiln.host.compile.key_sources).

Pitfalls: a new field of a family belongs in its hf_config module and in
ModelConfig, never read ad hoc where it is used.
"""
