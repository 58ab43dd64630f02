"""Llama 4's own fields of a ModelConfig (kiln.core.model.config), and their checks. Pure.

Llama 4 (transformers' Llama4TextConfig) has two kinds of layer, told apart by `no_rope_layers`:
- the layers that rotate: rope over adjacent pairs of each head's dims (its complex rope, in float32), then
  q and k RMS-normalised over head_dim without a weight (use_qk_norm), attending within chunks of
  attention_chunk_size positions;
- the layers with no rope (ModelConfig.nope_layers): q and k as projected, full attention, each query scaled
  by the attention temperature 1 + attn_scale x log1p(floor((position + 1) / floor_scale)).
A layer's kind reaches the scanned layer as data (its window: kiln.host.model.layers.nope), so a run of
layers of both kinds is one loop body.
"""

from __future__ import annotations

from kiln.core.errors import BadInput

ARCHITECTURE = "llama4_text"
ROUTER = "sigmoid_input"
"""Llama 4's router (kiln.core.model.expert_checks.ROUTERS): the top k of the router's logits, each chosen
expert's sigmoid multiplying the token it is given, not the expert's output."""


def check(cfg) -> None:
    """BadInput naming the first of `cfg`'s Llama 4 fields that cannot be, or that a model of another family
    holds."""
    if cfg.architecture != ARCHITECTURE:
        if (cfg.attention_chunk_size is not None or cfg.nope_layers or cfg.qk_l2_norm or cfg.temperature_floor
                or cfg.router == ROUTER):
            raise BadInput("config.json: chunked attention, layers without rope, the weightless q/k norm, the "
                           "attention temperature and the sigmoid-scaled expert inputs are Llama 4's "
                           f"(model_type {ARCHITECTURE}).")
        return
    chunk = cfg.attention_chunk_size
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk <= 0):
        raise BadInput(f"config.json: attention_chunk_size must be a positive integer or null, got {chunk!r}.")
    if list(cfg.nope_layers) != sorted(set(cfg.nope_layers)) or not all(
            isinstance(i, int) and 0 <= i < cfg.num_layers for i in cfg.nope_layers):
        raise BadInput(f"config.json: the layers without rope {list(cfg.nope_layers)} must be distinct layer "
                       f"indices below {cfg.num_layers}, in order.")
    floor, scale = cfg.temperature_floor, cfg.temperature_scale
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 0:
        raise BadInput(f"config.json: floor_scale must be a positive integer, got {floor!r}.")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale < 0:
        raise BadInput(f"config.json: attn_scale must be a number >= 0, got {scale!r}.")
    if cfg.sliding_window is not None or cfg.full_attention_layers or cfg.rope_interleave or cfg.qk_norm:
        raise BadInput("config.json: a llama4_text model has no sliding window and no weighted q/k norms; its "
                       "layers without rope are its full-attention ones.")
    if cfg.moe_layers and cfg.router != ROUTER:
        raise BadInput(f"config.json: Llama 4's experts are routed by {ROUTER!r}, not {cfg.router!r}.")


def rotates(cfg, layer: int) -> bool:
    """Decoder layer `layer` turns q and k by the rope (and, chunked, attends within its chunk)."""
    return layer not in cfg.nope_layers


def windowed(cfg) -> bool:
    """Whether the layers' kinds reach the forward as per-layer windows: a Llama 4 model with layers of both
    kinds or with chunks."""
    return cfg.architecture == ARCHITECTURE and (bool(cfg.nope_layers) or cfg.attention_chunk_size is not None)
