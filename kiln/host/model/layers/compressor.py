"""DeepSeek-V4's compressors over a step of new tokens, with the state a cache keeps between steps, as
transformers' DeepseekV4HCACompressor, DeepseekV4CSACompressor and the indexer's compressor compute them.

A compressor turns each window of `rate` tokens into one entry: a softmax over the window (per channel, of
the gate projection plus the position bias `ape`) weighs the window's kv projections, then an RMSNorm and
the rotation (compress rope) at the window's first position. A CSA compressor's projections are twice as
wide: an entry weighs its own window's tokens through the second half and the previous window's through
the first (the first window's previous half weighs nothing). An entry depends only on its tokens, so
computing it when its window completes, whatever the steps were, gives transformers' entries: the state is
the entries so far and the projections of the tokens a coming entry still needs (a ring of rate or
2 x rate rows, row p % rows for position p; kiln.core.model.v4_fields.layer_state).

Positions are tensors, one start per sequence: the graph's shapes depend only on the step's token count.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.core.model.config import ModelConfig
from kiln.host.model.layers.norms import rms_norm32


def pair_tables(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., qk_rope_head_dim / 2] of `positions` at cfg's rope, one entry per rotated pair."""
    from kiln.host.model.layers.rotary import rope_inv_freq

    freqs = positions[..., None].to(torch.float32) * rope_inv_freq(cfg, positions.device)
    factor = cfg.rope_attention_factor
    return (freqs.cos() * factor).to(dtype), (freqs.sin() * factor).to(dtype)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x's trailing 2 x cos.shape[-1] dims rotated in adjacent pairs, in place (x0, x1 stay neighbours),
    in float32 and cast back; `cos`/`sin` broadcast against x's leading dims."""
    dim = 2 * cos.shape[-1]
    kept, turned = x[..., :-dim], x[..., -dim:]
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    half = torch.stack((-turned[..., 1::2], turned[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((kept, (turned.float() * cos + half.float() * sin).to(x.dtype)), dim=-1)


def _rows_of(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x [b, n, ...] at rows index [b, ...] of each sequence: [b, ..., ...]."""
    batch = torch.arange(x.shape[0], device=x.device).view(-1, *([1] * (index.dim() - 1)))
    return x[batch, index]


def ring_read(ring: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """[b, rows, ...]: each sequence's ring in position order, positions start[b] - rows .. start[b] - 1."""
    rows = ring.shape[1]
    return _rows_of(ring, (torch.arange(rows, device=ring.device) + start[:, None] - rows) % rows)


def ring_write(seq: torch.Tensor, end: torch.Tensor, rows: int) -> torch.Tensor:
    """The ring of the last `rows` rows of seq [b, n, ...], whose last row is position end[b] - 1."""
    ring = torch.arange(rows, device=seq.device)
    return _rows_of(seq, seq.shape[1] - rows + (ring - (end[:, None] - rows)) % rows)


def compress(cfg: ModelConfig, p: dict[str, torch.Tensor], prefix: str, x: torch.Tensor, start: torch.Tensor,
             rate: int, state: dict[str, torch.Tensor], key: str = "") -> dict[str, torch.Tensor]:
    """The state after the new tokens x [b, t, hidden] at positions start[b]..start[b]+t-1: `{key}entries`
    [b, capacity, width] with the entries of the windows they complete written, `{key}ring_kv` and
    `{key}ring_gate` [b, rows, series x width]. A step completes at most ceil(t / rate) windows: that many
    candidates are computed per sequence, and those whose window does not end within the step are written
    to a spare row that is dropped, so the graph's shapes do not depend on the positions."""
    b, t, _ = x.shape
    ring_kv, ring_gate, entries = state[f"{key}ring_kv"], state[f"{key}ring_gate"], state[f"{key}entries"]
    rows, width, capacity = ring_kv.shape[1], entries.shape[-1], entries.shape[1]
    kv = torch.cat((ring_read(ring_kv, start), F.linear(x, p[f"{prefix}.wkv.weight"])), dim=1)
    gate = torch.cat((ring_read(ring_gate, start), F.linear(x, p[f"{prefix}.wgate.weight"])), dim=1)
    out = {f"{key}ring_kv": ring_write(kv, start + t, rows), f"{key}ring_gate": ring_write(gate, start + t, rows)}
    window = start[:, None] // rate + torch.arange(-(-t // rate), device=x.device)  # [b, k] candidates
    ends = (window + 1) * rate <= start[:, None] + t
    token = window[..., None] * rate + torch.arange(rate, device=x.device) - (start[:, None, None] - rows)
    own = token.clamp(0, kv.shape[1] - 1)  # [b, k, rate]: kv's row of each window token
    own_kv, own_gate = _rows_of(kv, own), _rows_of(gate, own) + p[f"{prefix}.ape"]
    if own_kv.shape[-1] != width:  # CSA: [the previous window's first halves | this window's second halves]
        prev = (token - rate).clamp(0, kv.shape[1] - 1)
        prev_kv = _rows_of(kv[..., :width], prev)
        prev_gate = _rows_of(gate[..., :width], prev) + p[f"{prefix}.ape"][:, :width]
        none = (window == 0)[..., None, None]  # window 0 has none before
        prev_kv = torch.where(none, torch.zeros_like(prev_kv), prev_kv)
        prev_gate = torch.where(none, torch.full_like(prev_gate, float("-inf")), prev_gate)
        own_kv = torch.cat((prev_kv, own_kv[..., width:]), dim=2)
        own_gate = torch.cat((prev_gate, own_gate[..., width:]), dim=2)
    weights = own_gate.softmax(dim=2, dtype=torch.float32).to(own_kv.dtype)
    made = rms_norm32((own_kv * weights).sum(dim=2), p[f"{prefix}.norm.weight"], cfg.rms_norm_eps)
    cos, sin = pair_tables(cfg, window * rate, x.dtype)
    made = rotate_pairs(made, cos, sin).to(entries.dtype)  # [b, k, width]
    row = torch.where(ends, window, capacity).clamp(max=capacity)  # not ending here: the spare row
    spare = torch.cat((entries, entries[:, :1]), dim=1)
    written = spare.scatter(1, row[..., None].expand(-1, -1, width), made)
    return {**out, f"{key}entries": written[:, :capacity]}
