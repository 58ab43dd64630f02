"""What a program that is not Kiln needs to run a forward: its interface and its weights. Pure.

Every forward of an export is one step of the decoder (kiln.host.model) over a
paged KV cache:

    inputs:  tokens[batch, tokens] int64, start_pos[batch] int64,
             kv_cache[layers, 2, num_pages, page_tokens, kv_heads/tp, head_dim] <dtype>,
             block_table[batch, pages_per_seq] int64
    outputs: logits[batch, tokens, vocab] <dtype>, new_kv[layers, 2, batch, tokens, kv_heads/tp, head_dim] <dtype>

`num_pages` is the one dynamic dimension (named in the shapes as a string).
The package's constants are the rank's checkpoint tensors, named as in the
checkpoint: `weight_layout` says, for each, its full shape and how rank r cuts
it (`dim`, `offsets[r]`, `length`), or that every rank reads it whole. Nothing
is computed from the config outside the graph (rotary frequencies are
computed inside it). A forward with tp > 1 sums its partial products with
torch's native all_reduce over the process group named PROCESS_GROUP, which
the caller must have registered (torch's default world group has that name).

`parameter_shapes` and `shard_slice` state the model's layout without torch;
a unit test holds them to the torch module's own state dict.
"""

from __future__ import annotations

from kiln.core.config import ModelConfig

PROCESS_GROUP = "0"
"""The group name the packages' collectives are compiled with: the default world group on every rank."""

DYNAMIC_PAGES = "num_pages"
"""The name of the kv_cache's dynamic dimension in interface shapes."""

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the unsharded model, named as in a Hugging Face checkpoint, with its shape."""
    h, q, kv, mlp = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (h,)
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            out[f"{p}.self_attn.{name}.weight"] = (rows, h)
            if cfg.qkv_bias:
                out[f"{p}.self_attn.{name}.bias"] = (rows,)
        out[f"{p}.self_attn.o_proj.weight"] = (h, q)
        if cfg.o_bias:
            out[f"{p}.self_attn.o_proj.bias"] = (h,)
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        for name, shape, bias in (("gate_proj", (mlp, h), mlp), ("up_proj", (mlp, h), mlp),
                                  ("down_proj", (h, mlp), h)):
            out[f"{p}.mlp.{name}.weight"] = shape
            if cfg.mlp_bias:
                out[f"{p}.mlp.{name}.bias"] = (bias,)
    out["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return out


def shard_slice(name: str, cfg: ModelConfig, tp: int, rank: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of `name`'s rows or columns that `rank` holds; None when replicated.

    Column-parallel projections (q, k, v, gate, up) split their output rows and
    their biases; row-parallel ones (o, down) split their input columns and
    keep their bias whole (it is added once, after the all-reduce).
    """
    parts = name.rsplit(".", 2)
    if len(parts) < 3 or parts[-2] not in _COLUMN + _ROW or parts[-1] not in ("weight", "bias"):
        return None
    if parts[-1] == "bias" and parts[-2] in _ROW:
        return None
    hq, hkv = cfg.num_heads // tp * cfg.head_dim, cfg.num_kv_heads // tp * cfg.head_dim
    n = {"q_proj": hq, "o_proj": hq, "k_proj": hkv, "v_proj": hkv}.get(parts[-2], cfg.intermediate_size // tp)
    return (0 if parts[-2] in _COLUMN else 1), rank * n, (rank + 1) * n


def weight_layout(cfg: ModelConfig, tp: int) -> dict[str, dict]:
    """Package constant name -> {'source', 'dtype', 'full_shape', 'shape', 'cut'} for every rank.

    `source` is the checkpoint tensor (the same name); `dtype` the dtype the
    package was compiled for (cast the checkpoint's tensor to it); `shape` what
    one rank binds; `cut` None (every rank binds the whole tensor) or
    {'dim', 'length', 'offsets'}: rank r binds `length` entries of dimension
    `dim` starting at `offsets[r]`.
    """
    layout = {}
    for name, full in parameter_shapes(cfg).items():
        cuts = [shard_slice(name, cfg, tp, r) for r in range(tp)]
        shape = list(full)
        cut = None
        if cuts[0] is not None:
            dim, start, stop = cuts[0]
            shape[dim] = stop - start
            cut = {"dim": dim, "length": stop - start, "offsets": [c[1] for c in cuts]}
        layout[name] = {"source": name, "dtype": cfg.dtype, "full_shape": list(full), "shape": shape, "cut": cut}
    return layout


def forward_interface(cfg: ModelConfig, tp: int, inputs: dict) -> dict:
    """{'inputs', 'outputs', 'process_group'} of one forward; `inputs` is a spec's static input dims."""
    b, t = inputs["batch"], inputs["tokens"]
    kv = [cfg.num_layers, 2, DYNAMIC_PAGES, inputs["page_tokens"], cfg.num_kv_heads // tp, cfg.head_dim]

    def arg(name: str, dtype: str, shape: list) -> dict:
        return {"name": name, "dtype": dtype, "shape": shape}

    return {
        "inputs": [arg("tokens", "int64", [b, t]), arg("start_pos", "int64", [b]), arg("kv_cache", cfg.dtype, kv),
                   arg("block_table", "int64", [b, inputs["pages_per_seq"]])],
        "outputs": [arg("logits", cfg.dtype, [b, t, cfg.vocab_size]),
                    arg("new_kv", cfg.dtype, [cfg.num_layers, 2, b, t, cfg.num_kv_heads // tp, cfg.head_dim])],
        "process_group": PROCESS_GROUP if tp > 1 else None,
        "dynamic_dims": {DYNAMIC_PAGES: {"min": 2}},
    }
