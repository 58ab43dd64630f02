"""How many parameters a model has per tensor-parallel rank: what its weights weigh, before any is read.

Pure arithmetic over a `ModelConfig`'s fields (kiln.core.model.config), counted the
way kiln.host.model holds them; the gate, the KV plan and the memory sizing
read it through `kiln.core.model.rank_bytes.weight_bytes_per_rank`. A unit test holds it to
the torch module's own parameter count.
"""

from __future__ import annotations

import math

from kiln.core.model.dsa_fields import indexer_params
from kiln.core.model.gpt_oss_fields import params as gpt_oss_params
from kiln.core.model.quant import scale_grid
from kiln.core.model.shares import rank_share
from kiln.core.model.v4_fields import module_shapes


def _most(cfg, tp: int) -> dict[str, int]:
    """The most of each count any rank of `tp` holds (kiln.core.model.shares.Share.counts): the counts below are
    a bound from above for every rank, exact where tp splits evenly."""
    counts = [share.counts() for share in (rank_share(cfg, tp, r) for r in range(tp))]
    return {k: max(c.get(k, 0) for c in counts) for k in ("heads", "kv_heads", "groups", "mlp", "experts", "shared")}


def _latent_attention(cfg, tp: int) -> int:
    """One layer's latent attention: replicated down-projections and their norms, sharded up-projections."""
    h, heads = cfg.hidden_size, _most(cfg, tp)["heads"]
    bias = cfg.o_bias  # attention_bias: q_a_proj, kv_a_proj_with_mqa and o_proj
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    q = (h * cfg.q_lora_rank + cfg.q_lora_rank * (1 + bias) + cfg.q_lora_rank * heads * cfg.head_dim
         if cfg.q_lora_rank else h * heads * cfg.head_dim)
    kv = h * latent + latent * bias + cfg.kv_lora_rank
    kv += cfg.kv_lora_rank * heads * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    indexer = 0 if cfg.dsa is None else indexer_params(cfg)  # DeepSeek sparse attention's, whole on every rank
    return q + kv + heads * cfg.v_head_dim * h + h * bias + indexer


_V4_SPLIT = (("wq_b.weight", "heads"), ("attn_sink", "heads"), ("wo_a.weight", "groups"), ("wo_b.weight", "groups"),
             ("shared_experts.w1.weight", "shared"), ("shared_experts.w2.weight", "shared"),
             ("shared_experts.w3.weight", "shared"), (".w1.weight", "experts"), (".w2.weight", "experts"),
             (".w3.weight", "experts"))
"""DeepSeek-V4's tensors that tp splits (kiln.core.model.v4_fields.shard_slice; the experts' as every family's),
its indexer's apart, each with the count it splits by."""


def _v4_fraction(cfg, tp: int, name: str) -> tuple[int, int]:
    """(the most any rank holds, the whole) of what DeepSeek-V4 tensor `name` splits by; (1, 1) if whole."""
    if "indexer" in name:
        return 1, 1
    whole = {"heads": cfg.num_heads, "groups": cfg.v4.o_groups, "experts": cfg.moe_intermediate_size,
             "shared": cfg.moe_intermediate_size}
    for suffix, count in _V4_SPLIT:
        if name.endswith(suffix):
            return _most(cfg, tp)[count], whole[count]
    return 1, 1


def params_per_rank(cfg, tp: int) -> int:
    """Parameters one of `tp` ranks holds: attention and MLP (experts too) sharded, embeddings and norms whole;
    DeepSeek-V4's tensors by their shapes, those that tp splits cut to the largest rank's share. Where tp
    splits unevenly, the most any rank holds of each (a bound from above)."""
    if cfg.v4 is not None:
        total = 0
        for n, s in module_shapes(cfg).items():
            most, whole = _v4_fraction(cfg, tp, n)
            total += math.prod(s) * most // whole
        return total
    most = _most(cfg, tp)
    q, kv = most["heads"] * cfg.head_dim, most["kv_heads"] * cfg.head_dim
    attn = cfg.hidden_size * (2 * q + 2 * kv)
    attn += (q + 2 * kv if cfg.qkv_bias else 0) + (cfg.hidden_size if cfg.o_bias else 0)
    if cfg.latent:
        attn = _latent_attention(cfg, tp)
    mlp = 3 * cfg.hidden_size * most["mlp"]
    mlp += 2 * most["mlp"] + cfg.hidden_size if cfg.mlp_bias else 0
    norms = (4 if cfg.sandwich_norms else 2) * cfg.hidden_size
    norms += (q + kv if cfg.qk_norm_whole else 2 * cfg.head_dim) if cfg.qk_norm else 0
    per_layer = attn + norms
    if cfg.swiglu_limit is not None:  # gpt-oss: sinks, router bias, expert biases
        per_layer += gpt_oss_params(cfg, most["heads"], most["experts"])
    moe = cfg.num_experts * (3 * cfg.hidden_size * most["experts"] + cfg.hidden_size)
    moe += cfg.num_experts if cfg.router == "sigmoid_groups" else 0  # the choice's correction bias
    if cfg.shared_expert_intermediate_size:  # with Qwen2-MoE's gate (hidden_size); DeepSeek's has none
        moe += 3 * cfg.hidden_size * most["shared"]
        moe += cfg.hidden_size if cfg.architecture == "qwen2_moe" else 0
    dense = cfg.num_layers - len(cfg.moe_layers)
    layers = cfg.num_layers * per_layer + len(cfg.moe_layers) * moe + dense * mlp
    heads = 1 if cfg.tie_word_embeddings else 2
    return layers + heads * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size + _quantized(cfg, tp)[1]


def _projections(cfg, tp: int) -> list[tuple[int, int, int, int | None]]:
    """(how many, rows, cols, the dimension tp cuts or None) of the projections one rank holds, over all layers:
    the tensors a quantized checkpoint quantizes (kiln.core.model.quant.QUANTIZED)."""
    most = _most(cfg, tp)
    h, heads, layers = cfg.hidden_size, most["heads"], cfg.num_layers
    if cfg.latent:
        out = [(layers, cfg.kv_lora_rank + cfg.qk_rope_head_dim, h, None),
               (layers, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank, 0),
               (layers, h, heads * cfg.v_head_dim, 1)]
        out += ([(layers, cfg.q_lora_rank, h, None), (layers, heads * cfg.head_dim, cfg.q_lora_rank, 0)]
                if cfg.q_lora_rank else [(layers, heads * cfg.head_dim, h, 0)])
    else:
        q, kv = heads * cfg.head_dim, most["kv_heads"] * cfg.head_dim
        out = [(layers, q, h, 0), (2 * layers, kv, h, 0), (layers, h, q, 1)]
    moe = len(cfg.moe_layers)
    for count, width in ((layers - moe, most["mlp"]), (moe * cfg.num_experts, most["experts"]),
                         (moe if cfg.shared_expert_intermediate_size else 0, most["shared"])):
        if count:
            out += [(2 * count, width, h, 0), (count, h, width, 1)]
    return out


def _quantized(cfg, tp: int) -> tuple[int, int]:
    """(the quantized weights' entries, their scales') one rank holds; (0, 0) unquantized."""
    if cfg.quant is None or cfg.quant.method == "mxfp4":  # MXFP4's entries: kiln.core.model.gpt_oss_fields.params
        return 0, 0
    weights = scales = 0
    for count, rows, cols, dim in _projections(cfg, tp):
        grid = scale_grid(cfg.quant, None if dim is None or tp == 1 else (dim, 0, (rows, cols)[dim]))
        weights += count * rows * cols
        scales += count * -(-rows // grid[0]) * -(-cols // grid[1])
    return weights, scales


def weight_bytes(cfg, tp: int, dtype_bytes: int) -> int:
    """Bytes of one rank's weights: `dtype_bytes` a parameter, but a quantized checkpoint's projections at a byte
    each (float8) and their scales at four (float32). Not for a quantized DeepSeek-V4, whose formats are too
    many to count by hand: kiln.core.model.rank_bytes.weight_bytes_per_rank counts its constants."""
    weights, scales = _quantized(cfg, tp)
    return (params_per_rank(cfg, tp) - weights - scales) * dtype_bytes + weights + 4 * scales
