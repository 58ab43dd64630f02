"""DeepSeek-V4's own settings (ModelConfig.v4), its tensors by checkpoint name, and how tp splits it. Pure.

What transformers' DeepseekV4ForCausalLM computes (kiln.host.model.families.deepseek_v4 computes the same):
- every layer attends over a sliding window of one shared key=value head (head_dim wide, its trailing
  qk_rope_head_dim dims rotated in interleaved pairs), with a learned sink logit per query head, a
  low-rank query (q_lora_rank) and a grouped low-rank output (o_groups groups to o_lora_rank each);
- a compressed sparse attention layer (CSA) also attends to compressed entries, one per csa_rate tokens
  (overlapping windows of 2 x csa_rate), of which a lightning indexer (index_n_heads heads of
  index_head_dim) keeps the index_topk best per query; a heavily compressed one (HCA) to every entry of
  non-overlapping windows of hca_rate tokens; sliding layers and the sliding branch rotate at
  main_rope_theta, compressed layers at ModelConfig's rope (compress_rope_theta, yarn where given);
- hc_mult residual streams mixed before attention and before the MLP by matrices made doubly stochastic
  with hc_sinkhorn_iters Sinkhorn iterations (mHC), collapsed at the end by a hyper-head;
- every layer's MLP is a mixture of experts: hash-routed (a fixed tid2eid[token] table) or top-k by
  sqrt(softplus) scores plus a correction bias, renormalised and scaled, plus one shared expert; gate and
  up clipped at swiglu_limit.

The checkpoint's tensor names are what transformers' save_pretrained writes (the published checkpoints'
own names inside each layer: `attn.wq_a`, `attn.compressor.wkv`, `ffn.experts.0.w1`, `hc_attn_fn`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.errors import BadInput

# The functions below take a kiln.core.model.config.ModelConfig (`cfg`), which holds a V4Fields: named, not
# imported, so the two modules do not import each other.

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_KINDS = (SLIDING, CSA, HCA)
"""The attention kinds of a layer (DeepseekV4Config.layer_types)."""
HASH_MOE, TOPK_MOE = "hash_moe", "moe"
MLP_KINDS = (HASH_MOE, TOPK_MOE)
"""The expert routing of a layer (DeepseekV4Config.mlp_layer_types)."""

FLOAT32_SUFFIXES = ("norm.weight", "attn_sink", ".ape", "gate.bias", "hc_attn_fn", "hc_attn_base", "hc_attn_scale",
                    "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale", "hc_head.hc_fn", "hc_head.hc_base",
                    "hc_head.hc_scale")
"""Tensors transformers keeps in float32 whatever the model's dtype (its _keep_in_fp32_modules_strict: the
hyper-connections, sinks, the compressors' position biases, the correction bias and every weighted norm)."""
INT64_SUFFIXES = ("gate.tid2eid",)
"""The hash layers' token -> experts table: integers, never cast."""


@dataclass(frozen=True)
class V4Fields:
    """The settings only DeepSeek-V4 has (DeepseekV4Config's names in parentheses)."""

    layer_types: tuple[str, ...]
    """Each layer's attention kind (LAYER_KINDS)."""
    mlp_layer_types: tuple[str, ...]
    """Each layer's expert routing (MLP_KINDS)."""
    csa_rate: int
    """Tokens per compressed entry of a CSA layer (compress_rates[compressed_sparse_attention])."""
    hca_rate: int
    """Tokens per compressed entry of an HCA layer (compress_rates[heavily_compressed_attention])."""
    main_rope_theta: float
    """The sliding layers' rotary base, unscaled (rope_theta; rope_parameters.main)."""
    hc_mult: int
    """Residual streams (hc_mult)."""
    hc_sinkhorn_iters: int
    """Sinkhorn iterations making the stream mixing doubly stochastic (hc_sinkhorn_iters)."""
    hc_eps: float
    """The hyper-connections' floor (hc_eps)."""
    swiglu_limit: float
    """Experts' gate clipped above, up clipped to +-, at this (swiglu_limit)."""
    o_groups: int
    """Head groups of the grouped output projection (o_groups)."""
    o_lora_rank: int
    """Each group's low-rank output width (o_lora_rank)."""
    index_n_heads: int
    """The lightning indexer's heads (index_n_heads)."""
    index_head_dim: int
    """The lightning indexer's head width (index_head_dim)."""
    index_topk: int
    """Compressed entries a CSA query keeps (index_topk)."""

    def __post_init__(self) -> None:
        for name in ("layer_types", "mlp_layer_types"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        bad = sorted({t for t in self.layer_types if t not in LAYER_KINDS})
        if bad:
            raise BadInput(f"config.json: layer_types {bad} are not DeepSeek-V4's; each is one of {list(LAYER_KINDS)}.")
        bad = sorted({t for t in self.mlp_layer_types if t not in MLP_KINDS})
        if bad:
            raise BadInput(f"config.json: mlp_layer_types {bad} are not DeepSeek-V4's; each is one of "
                           f"{list(MLP_KINDS)}.")
        if len(self.layer_types) != len(self.mlp_layer_types):
            raise BadInput("config.json: layer_types and mlp_layer_types must name every layer.")
        for name in ("csa_rate", "hca_rate", "hc_mult", "hc_sinkhorn_iters", "o_groups", "o_lora_rank",
                     "index_n_heads", "index_head_dim", "index_topk"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise BadInput(f"config.json: {name} must be a positive integer, got {value!r}.")
        for name in ("main_rope_theta", "hc_eps", "swiglu_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise BadInput(f"config.json: {name} must be a positive number, got {value!r}.")

    def rate(self, layer: int) -> int | None:
        """Tokens per compressed entry of `layer`; None for a sliding layer."""
        return self.rate_of(self.layer_types[layer])

    def rate_of(self, kind: str) -> int | None:
        """Tokens per compressed entry of a layer of attention kind `kind`; None for a sliding one."""
        return None if kind == SLIDING else self.csa_rate if kind == CSA else self.hca_rate

    def kind(self, layer: int) -> tuple[str, str]:
        """(attention kind, routing) of `layer`: layers of one kind share their shapes and code."""
        return self.layer_types[layer], self.mlp_layer_types[layer]


def check_model(cfg: "ModelConfig") -> None:
    """The widths the V4 layers need of ModelConfig's own fields."""
    v4 = cfg.v4
    if len(v4.layer_types) != cfg.num_layers:
        raise BadInput(f"config.json: layer_types names {len(v4.layer_types)} layers; num_hidden_layers is "
                       f"{cfg.num_layers}.")
    if cfg.num_kv_heads != 1:
        raise BadInput(f"config.json: num_key_value_heads={cfg.num_kv_heads}: DeepSeek-V4 has one shared "
                       "key=value head (transformers' class builds one whatever this says).")
    if cfg.num_heads % v4.o_groups:
        raise BadInput(f"config.json: o_groups ({v4.o_groups}) must divide num_attention_heads ({cfg.num_heads}).")
    for width, what in ((cfg.head_dim, "head_dim"), (v4.index_head_dim, "index_head_dim")):
        if not 0 < cfg.qk_rope_head_dim <= width:
            raise BadInput(f"config.json: the rotated dims ({cfg.qk_rope_head_dim}, head_dim x "
                           f"partial_rotary_factor) must be at most {what} ({width}).")
    if cfg.qk_rope_head_dim % 2 or not cfg.q_lora_rank or not cfg.moe_layers:
        raise BadInput("config.json: DeepSeek-V4 needs an even number of rotated dims, a q_lora_rank and experts.")


def module_shapes(cfg: "ModelConfig") -> dict[str, tuple[int, ...]]:
    """Every tensor of the unsharded model by its checkpoint name (as save_pretrained writes it), in the
    module's order: the embedding, each layer's, then the final norm, the hyper-head and the output head."""
    v4, h, d, n = cfg.v4, cfg.hidden_size, cfg.head_dim, cfg.v4.hc_mult
    heads, rank, e_mlp = cfg.num_heads, cfg.q_lora_rank, cfg.moe_intermediate_size
    mix = (2 + n) * n
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p, kind = f"model.layers.{i}", v4.layer_types[i]
        out[f"{p}.attn_norm.weight"] = (h,)
        out[f"{p}.ffn_norm.weight"] = (h,)
        for which in ("attn", "ffn"):
            out.update({f"{p}.hc_{which}_fn": (mix, n * h), f"{p}.hc_{which}_base": (mix,),
                        f"{p}.hc_{which}_scale": (3,)})
        a = f"{p}.attn"
        out.update({f"{a}.wq_a.weight": (rank, h), f"{a}.q_norm.weight": (rank,), f"{a}.wq_b.weight": (heads * d, rank),
                    f"{a}.wkv.weight": (d, h), f"{a}.norm.weight": (d,),
                    f"{a}.wo_a.weight": (v4.o_groups * v4.o_lora_rank, heads * d // v4.o_groups),
                    f"{a}.wo_b.weight": (h, v4.o_groups * v4.o_lora_rank), f"{a}.attn_sink": (heads,)})
        if kind != SLIDING:
            out.update(_compressor(f"{a}.compressor", h, d, v4.rate(i), 2 if kind == CSA else 1))
        if kind == CSA:
            out.update(_compressor(f"{a}.indexer.compressor", h, v4.index_head_dim, v4.csa_rate, 2))
            out[f"{a}.indexer.weights_proj.weight"] = (v4.index_n_heads, h)
            out[f"{a}.indexer.wq_b.weight"] = (v4.index_n_heads * v4.index_head_dim, rank)
        f = f"{p}.ffn"
        out[f"{f}.gate.weight"] = (cfg.num_experts, h)
        if v4.mlp_layer_types[i] == HASH_MOE:
            out[f"{f}.gate.tid2eid"] = (cfg.vocab_size, cfg.experts_per_token)
        else:
            out[f"{f}.gate.bias"] = (cfg.num_experts,)
        for e in [*(f"experts.{j}" for j in range(cfg.num_experts)), "shared_experts"]:
            out.update({f"{f}.{e}.w1.weight": (e_mlp, h), f"{f}.{e}.w2.weight": (h, e_mlp),
                        f"{f}.{e}.w3.weight": (e_mlp, h)})
    out["model.norm.weight"] = (h,)
    out.update({"model.hc_head.hc_fn": (n, n * h), "model.hc_head.hc_base": (n,), "model.hc_head.hc_scale": (1,)})
    if not cfg.tie_word_embeddings:
        out["head.weight"] = (cfg.vocab_size, h)
    return out


def _compressor(p: str, h: int, width: int, rate: int, series: int) -> dict[str, tuple[int, ...]]:
    """A compressor's tensors: `series` (2: CSA's overlapping windows, 1: HCA's) projections of `width`."""
    return {f"{p}.wkv.weight": (series * width, h), f"{p}.wgate.weight": (series * width, h),
            f"{p}.ape": (rate, series * width), f"{p}.norm.weight": (width,)}


def constant_dtype(cfg: "ModelConfig", name: str) -> str:
    """The dtype a V4 tensor is held in: int64 (tid2eid), float32 (FLOAT32_SUFFIXES) or the model's."""
    if name.endswith(INT64_SUFFIXES):
        return "int64"
    return "float32" if name.endswith(FLOAT32_SUFFIXES) else cfg.dtype


def export_refusal(recipe: "Recipe") -> str | None:
    """Why Kiln does not export DeepSeek-V4 with `recipe`, or None. Its compiled step carries the compressed
    cache as a slot per sequence (kiln.core.model.contract.cache_layout) that every token of a step rewrites, so:
    - a step is never padded in tokens (kiln.core.run.decode.prefill_steps): a bucket of 1 token serves decoding
      and finishes any prompt;
    - static shapes only so far: over a range of batches Inductor's lowering of the scanned step fails
      (KeyError on the batch's symbol), over a range of tokens torch.export specializes it (the windows a
      step may complete, ceil(tokens / rate), differ across the range)."""
    why = []
    if not any(b.tokens == 1 for b in recipe.buckets):
        why.append("a bucket of 1 token (each decode step's: a step of DeepSeek-V4's compressed cache takes no "
                   "padding), e.g. --set buckets=1x1," + ",".join(map(str, recipe.buckets)))
    ranges = [str(r) for r in recipe.shapes if not r.static]
    if ranges:
        why.append(f"static shapes (forwards {', '.join(ranges)} are ranges, which its step does not compile "
                   "over yet): --set shape_policy=static, and only static forward_shapes")
    if not why:
        return None
    return "DeepSeek-V4 (model_type deepseek_v4) exports need " + "; and ".join(why) + "."


def shard_slice(name: str, cfg: "ModelConfig", share: "Share") -> tuple[int, int, int] | None:
    """(dim, start, stop) that a rank of `share` (kiln.core.model.shares) holds of an attention tensor tp
    splits, else None (the caller cuts the experts as every family's): the query rows and sinks of its heads,
    its groups' output rows (wo_a) and the matching columns of wo_b. The key=value head, compressors and
    indexer are every rank's: each is one head's width, and splitting the indexer's heads would need its
    scores summed before the top-k."""
    (h0, h1), (g0, g1), width = share.heads, share.groups, cfg.v4.o_lora_rank
    if ".indexer." in name:
        return None
    for suffix, dim, a, b in (("attn.wq_b.weight", 0, h0 * cfg.head_dim, h1 * cfg.head_dim),
                              ("attn.attn_sink", 0, h0, h1), ("attn.wo_a.weight", 0, g0 * width, g1 * width),
                              ("attn.wo_b.weight", 1, g0 * width, g1 * width)):
        if name.endswith(suffix):
            return dim, a, b
    return None


def layer_state(cfg: "ModelConfig", kind: str, capacity_tokens: int) -> dict[str, tuple[int, ...]]:
    """What one sequence's cache holds for a layer of attention kind `kind`, each a [rows, width] tensor
    (one rank's, the same on every rank: the key=value head, compressors and indexer are replicated), for
    up to `capacity_tokens` tokens. What transformers' DeepseekV4HCACache / DeepseekV4CSACache hold, with
    fixed shapes:
    - `window`: the last sliding_window tokens' key=value, row p % sliding_window for position p;
    - `entries`: compressed entry w at row w (one per rate tokens: the only part that grows with tokens);
    - `ring_kv` / `ring_gate`: the compressor's projections of the last rate (HCA) or 2 x rate (CSA: the
      previous window's first half overlaps) tokens, row p % rows: the tokens of the window not yet
      complete (transformers' buffer) and, for CSA, the last complete one (its overlap state);
    - `index_*`: a CSA layer's indexer, the same at index_head_dim."""
    d, rate = cfg.head_dim, cfg.v4.rate_of(kind)
    out = {"window": (cfg.sliding_window, d)}
    if kind == SLIDING:
        return out
    rows, entries = (2 if kind == CSA else 1) * rate, -(-capacity_tokens // rate)
    out.update({"entries": (entries, d), "ring_kv": (rows, rows // rate * d), "ring_gate": (rows, rows // rate * d)})
    if kind == CSA:
        i = cfg.v4.index_head_dim
        out.update({"index_entries": (entries, i), "index_ring_kv": (rows, 2 * i), "index_ring_gate": (rows, 2 * i)})
    return out
