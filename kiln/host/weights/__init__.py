"""A checkpoint's weights, read for one rank: local files and S3, safetensors, the host's weight caches.

Purpose: `rank_weights` (a checkpoint by its address: its config, identity
and a rank's weights), `checkpoint` (Hugging Face-layout directories:
inspection, one rank's slices, writing random ones), `s3_checkpoint` (read in
place with ranged GETs), `s3_weight_cache` (ranks' weights from S3 kept on the
host) and `safetensors_io` (a rank's cut read straight into its tensors).

Contracts: a rank reads only its slices; untrusted headers are parsed by
kiln.core.model.safetensors_header before any byte is read.
"""
