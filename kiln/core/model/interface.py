"""A forward's inputs and outputs, as a program that is not Kiln calls it. Pure.

Every forward of an export is one step of the decoder (kiln.host.model) over a
paged KV cache:

    inputs:  tokens[batch, tokens] int64, start_pos[batch] int64,
             kv_cache[layers, entries, num_pages, page_tokens, heads, width] <dtype>,
             block_table[batch, pages_per_seq] int64
             [, seq_lens[batch] int64: only when the rope depends on the sequence's length]
    outputs: logits[batch, tokens, vocab] <dtype>, new_kv[layers, entries, batch, tokens, heads, width] <dtype>
             [, expert_choices[expert layers, batch, tokens, k] int32]
             [, indexer_picks[CSA layers, batch, tokens, picks] int32: DeepSeek-V4 alone]

The outputs after new_kv are the forward's discrete choices (`choice_sites`):
the experts each token took in each routed layer (k = experts_per_token; a
hash-routed layer's experts are its table's, not a choice), and DeepSeek-V4's
compressed entries each query's indexer picked in each CSA layer (picks =
min(index_topk, the cache's compressed entries); an index equal to the entries
means no pick: fewer were ready). A consumer may ignore them; the check forces
its float32 reference to them (kiln.host.ranks.routing_ties).

`num_pages` is always dynamic; `batch` and `tokens` are where the forward
takes a range of them (kiln.core.forwards.shape_ranges). A dynamic dimension is named in
the shapes as a string, with its bounds under the interface's `dynamic_dims`.
What a cached token holds is the cache layout (`cache_layout`): per-head keys
and values (entries 2, heads kv_heads/tp, width head_dim), or, for latent
attention, one entry of the token's latent and rotary key that every head
reads (entries 1, heads 1, width kv_lora_rank + qk_rope_head_dim, the same on
every rank; DeepSeek sparse attention's indexer key, index_head_dim, after
them). DeepSeek-V4's cache is not per-token entries but state that is
rewritten as tokens arrive (a sliding window, compressors' rings, compressed
entries and a CSA layer's indexer keys): a slot per sequence
(kv_cache[num_slots, slot_values], one `slots[batch]` input naming each
sequence's slot instead of a block table, new_kv[batch, slot_values] each
sequence's slot after the step), whose `states` the layout lists with their
shapes and which of them grow with tokens.

The weights a forward binds are kiln.core.model.contract's.
"""

from __future__ import annotations

from kiln.core.model.cache_layout import DYNAMIC_PAGES, DYNAMIC_SLOTS, cache_layout
from kiln.core.model.config import ModelConfig
from kiln.core.model.contract import PROCESS_GROUP

EXPERT_CHOICES, INDEXER_PICKS = "expert_choices", "indexer_picks"
"""The choice outputs' names, by site (kiln.host.model.layers.choices: 'experts', 'indexer')."""
CHOICE_OUTPUTS = {"experts": EXPERT_CHOICES, "indexer": INDEXER_PICKS}


def choice_sites(cfg: ModelConfig) -> list[str]:
    """The choice sites whose picks a forward of `cfg` returns after new_kv, in output order: 'experts' where
    a layer routes its tokens by a top-k, 'indexer' where a DeepSeek-V4 layer is CSA or a layer's attention is
    DeepSeek sparse attention."""
    if cfg.v4 is not None:
        from kiln.core.model.v4_fields import CSA, TOPK_MOE

        return ([*(["experts"] if TOPK_MOE in cfg.v4.mlp_layer_types else []),
                 *(["indexer"] if CSA in cfg.v4.layer_types else [])])
    return [*(["experts"] if cfg.moe_layers else []), *(["indexer"] if cfg.dsa is not None else [])]


def choice_layers(cfg: ModelConfig, site: str) -> list[int]:
    """The layers that make choices at `site`, in order."""
    if cfg.v4 is None:  # DeepSeek sparse attention: every layer's indexer
        return list(cfg.moe_layers) if site == "experts" else list(range(cfg.num_layers)) if cfg.dsa else []
    from kiln.core.model.v4_fields import CSA, TOPK_MOE

    kinds = cfg.v4.mlp_layer_types if site == "experts" else cfg.v4.layer_types
    return [i for i, kind in enumerate(kinds) if kind == (TOPK_MOE if site == "experts" else CSA)]


def choice_width(cfg: ModelConfig, site: str, capacity_tokens: int) -> int:
    """Picks per token at `site` of a forward whose cache holds `capacity_tokens` per sequence."""
    if site == "experts":
        return cfg.experts_per_token
    if cfg.dsa is not None:  # whatever the context (a pick past the tokens there are: none)
        return cfg.dsa.index_topk
    return min(cfg.v4.index_topk, -(-capacity_tokens // cfg.v4.csa_rate))


def choice_outputs(cfg: ModelConfig, batch, tokens, capacity_tokens: int) -> list[dict]:
    """The interface's choice outputs (after new_kv), in order."""
    return [{"name": CHOICE_OUTPUTS[site], "dtype": "int32",
             "shape": [len(choice_layers(cfg, site)), batch, tokens, choice_width(cfg, site, capacity_tokens)]}
            for site in choice_sites(cfg)]


def forward_interface(cfg: ModelConfig, tp: int, inputs: dict, rank: int = 0) -> dict:
    """{'inputs', 'outputs', 'process_group', 'dynamic_dims', ...} of one forward of rank `rank` (its cache holds
    its own KV heads: kiln.core.model.shares); `inputs` is a spec's input dims. A dimension the forward takes
    over a range is named ('batch', 'tokens', like the page count) with its bounds in 'dynamic_dims'; a static
    one is its size."""
    ranges = {name: inputs[name] for name in ("batch", "tokens")}
    b, t = (name if lo < hi else lo for name, (lo, hi) in ranges.items())
    layout = cache_layout(cfg, tp, inputs["page_tokens"] * inputs["pages_per_seq"], rank)

    def arg(name: str, dtype: str, shape: list) -> dict:
        return {"name": name, "dtype": dtype, "shape": shape}

    dynamic = {name: {"min": lo, "max": hi} for name, (lo, hi) in ranges.items() if lo < hi}
    if not layout.paged:  # DeepSeek-V4: one slot of state per sequence, the step's slots read and rewritten
        return {
            "inputs": [arg("tokens", "int64", [b, t]), arg("start_pos", "int64", [b]),
                       arg("kv_cache", cfg.dtype, layout.shape(cfg.num_layers, DYNAMIC_SLOTS, 0)),
                       arg("slots", "int64", [b])],
            "outputs": [arg("logits", cfg.dtype, [b, t, cfg.vocab_size]),
                        arg("new_kv", cfg.dtype, layout.new_shape(cfg.num_layers, b, t)),
                        *choice_outputs(cfg, b, t, inputs["page_tokens"] * inputs["pages_per_seq"])],
            "kv_cache": layout.to_dict(), "process_group": PROCESS_GROUP if tp > 1 else None,
            "dynamic_dims": {DYNAMIC_SLOTS: {"min": 2}, **dynamic},
        }
    kv = layout.shape(cfg.num_layers, DYNAMIC_PAGES, inputs["page_tokens"])

    lengths = [arg("seq_lens", "int64", [b])] if cfg.length_dependent_rope else []
    rope = {}
    if cfg.rope_type == "longrope":  # kiln.core.run.decode: seq_lens, and the cache rebuilt at the switch
        rope = {"rope": {"type": "longrope", "long_after_tokens": cfg.rope_original_max_position,
                         "refill_cache_at_length": cfg.rope_original_max_position + 1}}
    elif cfg.rope_type == "dynamic":
        rope = {"rope": {"type": "dynamic", "grows_after_tokens": cfg.rope_max_position}}
    return {
        "inputs": [arg("tokens", "int64", [b, t]), arg("start_pos", "int64", [b]), arg("kv_cache", cfg.dtype, kv),
                   arg("block_table", "int64", [b, inputs["pages_per_seq"]]), *lengths],
        "outputs": [arg("logits", cfg.dtype, [b, t, cfg.vocab_size]),
                    arg("new_kv", cfg.dtype, layout.new_shape(cfg.num_layers, b, t)),
                    *choice_outputs(cfg, b, t, inputs["page_tokens"] * inputs["pages_per_seq"])],
        "kv_cache": layout.to_dict(), **rope,
        "process_group": PROCESS_GROUP if tp > 1 else None,
        "dynamic_dims": {DYNAMIC_PAGES: {"min": 2}, **dynamic},
    }
