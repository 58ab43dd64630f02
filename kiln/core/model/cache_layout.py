"""What a rank's KV cache holds, as a forward's interface states it (kiln.core.model.contract). Pure.

Paged (every family but DeepSeek-V4): each token's entries, [layers, entries,
num_pages, page_tokens, heads, width], a step returning its new tokens'
entries for the caller to write into their pages. A slot cache
(DeepSeek-V4's, whose state every token rewrites: a sliding window,
compressors' rings, compressed entries and a CSA layer's indexer keys): one
slot of `slot_values` per sequence, [num_slots, slot_values], a step
returning each sequence's whole slot after it; `states` says what a slot
holds and which rows grow with the context. The KV plan's page size is
`CacheLayout.page_bytes` (a slot counts as its sequence's pages_per_seq pages).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.model import v4_fields
from kiln.core.model.config import ModelConfig
from kiln.core.model.layer_runs import layer_runs
from kiln.core.model.shares import rank_share

DYNAMIC_PAGES = "num_pages"
"""The name of the kv_cache's dynamic dimension in interface shapes."""
DYNAMIC_SLOTS = "num_slots"
"""A slot cache's (DeepSeek-V4's) dynamic dimension: its slot count."""


@dataclass(frozen=True)
class CacheState:
    """One state tensor of a slot cache (DeepSeek-V4's): [layers, rows, width] of run `run`, at `offset`
    values into each sequence's slot."""

    run: int
    """The run of layers (kiln.core.model.layer_runs) whose layers hold it, stacked in layer order."""
    kind: str
    """The run's attention kind (kiln.core.model.v4_fields.LAYER_KINDS)."""
    name: str
    """What it holds (kiln.core.model.v4_fields.layer_state): window, entries, ring_kv, ring_gate, index_*."""
    layers: int
    rows: int
    width: int
    tokens_per_row: int | None
    """Rows grow one per this many tokens (the compressed entries: the rate); None: a fixed number of rows,
    rewritten as tokens arrive (the window and the compressors' rings)."""
    offset: int
    model_layers: tuple[int, ...] = ()
    """The decoder layers stacked along its first dimension, in order (a run's, kiln.core.model.layer_runs)."""

    @property
    def values(self) -> int:
        return self.layers * self.rows * self.width

    def to_dict(self) -> dict:
        return {"run": self.run, "kind": self.kind, "name": self.name, "shape": [self.layers, self.rows, self.width],
                "tokens_per_row": self.tokens_per_row, "offset": self.offset, "model_layers": list(self.model_layers)}


@dataclass(frozen=True)
class CacheLayout:
    """What the KV cache holds. Paged (every family but DeepSeek-V4): per layer and token, `entries` tensors
    of [heads, width]. Slots (DeepSeek-V4, `states` not empty): per sequence, one slot of `slot_values`
    values holding every state tensor of `states`, sized for `capacity_tokens` tokens."""

    entries: tuple[str, ...]
    """What each entry is: ('keys', 'values'), or ('latent_and_rope_key',) for latent attention
    (('latent_rope_and_index_key',) with DeepSeek sparse attention's indexer key); ('state',) for a slot cache."""
    heads: int
    """Heads per rank in an entry: kv_heads/tp, or 1 (one latent every head reads)."""
    width: int
    """Values per head: head_dim, or kv_lora_rank + qk_rope_head_dim (the latent, then the rotated key; then
    index_head_dim, the indexer's rotated key, with DeepSeek sparse attention);
    0 for a slot cache (its `slot_values` is a slot's width)."""
    sharded: bool
    """Each rank caches its own heads (True), or every rank caches the same whole entry (latent attention,
    and DeepSeek-V4's state: its one key=value head, compressors and indexer are computed whole on every rank)."""
    states: tuple[CacheState, ...] = ()
    """A slot cache's state tensors, in slot order; empty for a paged cache."""
    capacity_tokens: int = 0
    """Tokens a slot holds (the export's max_context_tokens); 0 for a paged cache."""

    @property
    def paged(self) -> bool:
        return not self.states

    @property
    def slot_values(self) -> int:
        return sum(s.values for s in self.states)

    def shape(self, num_layers: int, num_pages: int | str, page_tokens: int) -> list:
        """The kv_cache input's shape: [layers, entries, num_pages, page_tokens, heads, width], or a slot
        cache's [num_slots, slot_values] (`num_pages` slots)."""
        if not self.paged:
            return [num_pages, self.slot_values]
        return [num_layers, len(self.entries), num_pages, page_tokens, self.heads, self.width]

    def new_shape(self, num_layers: int, batch: int, tokens: int) -> list:
        """The new_kv output's shape, the step's own entries: [layers, entries, batch, tokens, heads, width];
        a slot cache's [batch, slot_values], each sequence's whole slot after the step."""
        if not self.paged:
            return [batch, self.slot_values]
        return [num_layers, len(self.entries), batch, tokens, self.heads, self.width]

    def values_per_token(self, num_layers: int) -> float:
        """Cached values one rank keeps per token: a paged cache's every entry of every layer; a slot
        cache's rows that grow with tokens (its compressed entries), the fixed rows apart."""
        if self.paged:
            return len(self.entries) * num_layers * self.heads * self.width
        return sum(s.layers * s.width / s.tokens_per_row for s in self.states if s.tokens_per_row)

    def values_per_sequence(self) -> int:
        """Cached values one rank keeps per sequence whatever its length (a slot cache's fixed rows)."""
        return sum(s.values for s in self.states if not s.tokens_per_row)

    def page_bytes(self, num_layers: int, page_tokens: int, pages_per_seq: int, dtype_bytes: int) -> int:
        """Bytes the KV plan counts per page of one rank: a paged cache's page; a slot cache's slot shared
        out over the pages_per_seq pages a sequence counts as (the plan's pages / pages_per_seq are slots)."""
        if self.paged:
            return int(self.values_per_token(num_layers)) * page_tokens * dtype_bytes
        return -(-self.slot_values * dtype_bytes // pages_per_seq)

    def to_dict(self) -> dict:
        if not self.paged:
            return {"entries": list(self.entries), "slot_values": self.slot_values, "sharded": self.sharded,
                    "capacity_tokens": self.capacity_tokens, "dims": [DYNAMIC_SLOTS, "slot_values"],
                    "states": [s.to_dict() for s in self.states],
                    "write": "new_kv[b] replaces kv_cache[slots[b]] for each sequence b of the step"}
        return {"entries": list(self.entries), "heads": self.heads, "width": self.width, "sharded": self.sharded,
                "dims": ["layers", "entries", DYNAMIC_PAGES, "page_tokens", "heads", "width"]}


def cache_layout(cfg: ModelConfig, tp: int, context_tokens: int | None = None, rank: int = 0) -> CacheLayout:
    """The KV cache layout of rank `rank` of `cfg` at `tp` (see the module docstring): its own KV heads
    (kiln.core.model.shares; rank 0 holds the most where tp splits them unevenly, bar ranks whose query heads
    straddle two groups). DeepSeek-V4's is a slot per sequence sized for `context_tokens` (its compressed
    entries grow with the context), the same on every rank, as is latent attention's."""
    if cfg.v4 is not None:
        if context_tokens is None:
            raise ValueError("DeepSeek-V4's cache layout depends on the context: pass context_tokens")
        return CacheLayout(entries=("state",), heads=1, width=0, sharded=False,
                           states=tuple(_v4_states(cfg, context_tokens)), capacity_tokens=context_tokens)
    if cfg.latent and cfg.dsa is not None:  # DeepSeek sparse attention: the indexer's key after them
        return CacheLayout(entries=("latent_rope_and_index_key",), heads=1, sharded=False,
                           width=cfg.kv_lora_rank + cfg.qk_rope_head_dim + cfg.dsa.index_head_dim)
    if cfg.latent:
        return CacheLayout(entries=("latent_and_rope_key",), heads=1, width=cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                           sharded=False)
    kv_heads = rank_share(cfg, tp, rank).kv_heads
    return CacheLayout(entries=("keys", "values"), heads=kv_heads[1] - kv_heads[0], width=cfg.head_dim, sharded=True)


def slot_context(cfg: ModelConfig, slot_values: int) -> int:
    """A context whose DeepSeek-V4 slot is `slot_values` wide (every such context has the same states: the
    layout's rows, all a model needs to read a slot); ValueError when no context has a slot that wide."""
    fixed = cache_layout(cfg, 1, 0).slot_values
    per_token = cache_layout(cfg, 1, 0).values_per_token(cfg.num_layers)
    context = int((slot_values - fixed) // per_token) if per_token else 0
    while context >= 0:  # a slot's rows round its context up to whole entries: it is at most this
        width = cache_layout(cfg, 1, context).slot_values
        if width == slot_values:
            return context
        if width < slot_values:
            break
        context -= 1
    raise ValueError(f"no context has a DeepSeek-V4 slot of {slot_values} values (kiln.core.model.contract.cache_layout)")


def _v4_states(cfg: ModelConfig, context_tokens: int) -> list[CacheState]:
    """DeepSeek-V4's state tensors, run by run (kiln.core.model.v4_fields.layer_state of the run's kind)."""
    out, offset = [], 0
    for j, layers in enumerate(layer_runs(cfg)):
        kind = cfg.v4.layer_types[layers[0]]
        for name, (rows, width) in v4_fields.layer_state(cfg, kind, context_tokens).items():
            grows = cfg.v4.rate_of(kind) if name.endswith("entries") else None
            out.append(CacheState(run=j, kind=kind, name=name, layers=len(layers), rows=rows, width=width,
                                  tokens_per_row=grows, offset=offset, model_layers=tuple(layers)))
            offset += out[-1].values
    return out
