"""What a program that is not Kiln needs to bind a forward's weights: its constants and their sources. Pure.

A forward's inputs and outputs are kiln.core.model.interface's.

The decoder layers are compiled once per forward, not once per layer: each run
of same-shaped layers (kiln.core.model.layer_runs: consecutive layers of one kind,
or, where kinds alternate, every period-th layer of a segment that repeats a
pattern) is scanned over its weights stacked along a leading layer dimension
(LAYOUT names this package layout and goes into every forward key). So the
package's constants are of two kinds, and `weight_layout` states both:
- a plain constant is one checkpoint tensor (the embedding, the final norm,
  the output head), named as in the checkpoint;
- a stacked constant `model.runs.<j>.<suffix>` (e.g.
  `model.runs.0.self_attn.q_proj.weight`) is the checkpoint tensors
  `model.layers.<i>.<suffix>` of the run's layers, each cut for the rank,
  stacked in layer order (`sources` lists them) along a new leading dimension.
Each entry lists its `sources` (checkpoint tensor, full shape, and how rank r
cuts it: `dim`, `offsets[r]`, `length`, or whole) and `stack` (the number of
sources stacked, or None for a plain constant). A quantized checkpoint's
projections (kiln.core.model.quant: FP8 blocks) are float8 constants, each with
a float32 constant of its scales (`<module>.weight_scale_inv`, its own
entry); a rank's scales may repeat each block's scale over the sub-blocks of
its share (the cut's `repeat`). Nothing is computed from the
config outside the graph (rotary frequencies and per-layer windows are
computed inside it). A forward with tp > 1 sums its partial products with
torch's native all_reduce over the process group named PROCESS_GROUP, which
the caller must have registered (torch's default world group has that name).

`parameter_shapes` (the checkpoint's tensors), `shard_slice`, `rank_reads`
and `constant_sources` state the model's layout without torch; a unit test
holds them to the torch module's own state dict. A checkpoint tensor is
usually the source of one constant; a fused one (Phi-3's qkv_proj and
gate_up_proj, FUSED) is the source of each of its projections' constants,
each source cut to its own rows, at tp 1 too; so is a layer's fused 3-D experts
tensor (Mistral 4's gate_up_proj: kiln.core.model.fused_experts), cut along its
own dimension.
"""

from __future__ import annotations

from kiln.core.model import attention_shapes, fused_experts, gpt_oss_fields, quant, v4_fields
from kiln.core.model.config import ModelConfig
from kiln.core.model.layer_runs import layer_runs
from kiln.core.model.module_names import (EXPERTS, SHARED_EXPERTS, correction_bias, is_shared_expert, mlp_module,
                                          router_of)
from kiln.core.model.shares import rank_share

PROCESS_GROUP = "0"
"""The group name the packages' collectives are compiled with: the default world group on every rank."""


LAYOUT = "scan-2"
"""The package layout: decoder layers as one scan per segment over stacked constants, a run's layers
interleaved with another run's where kinds alternate (kiln.core.model.layer_runs; scan-1's runs were consecutive).
In every forward key, so a package of another layout (e.g. the unrolled one, with a constant per layer) is
never loaded as this one."""

LAYER_PREFIX = "model.layers."
RUN_PREFIX = "model.runs."

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj", "w1", "w3", "q_b_proj", "kv_b_proj")
_ROW = ("o_proj", "down_proj", "w2")

FUSED = {"phi3": {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                                 "self_attn.v_proj.weight"),
                  "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}}
"""model_type -> {a layer's fused checkpoint tensor: the projections it holds, its rows in this order}. The
package keeps one constant per projection, as for every other family: each source of such a constant is the
fused tensor, cut to the projection's rows (and, with tp > 1, to the rank's share of them)."""


def constant_dtype(cfg: ModelConfig, name: str) -> str:
    """The dtype the package holds tensor `name` (a constant, a stacked constant's suffix or a checkpoint tensor)
    in: the model's, but float32 for DeepSeek-V3's router and its correction bias, as transformers keeps them
    (its _keep_in_fp32_modules_strict): in a bfloat16 model a rounded bias would choose other experts.
    A quantized checkpoint's projections and their scales: kiln.core.model.quant's dtypes, whatever the model's.
    DeepSeek-V4's: kiln.core.model.v4_fields.constant_dtype (float32 for a few more, int64 for its hash table)."""
    if cfg.quant is not None and quant.is_scale(name):
        return quant.scale_dtype(cfg.quant)
    if quant.is_quantized(cfg.quant, name):
        return quant.weight_dtype(cfg.quant, name)
    if cfg.v4 is not None:
        return v4_fields.constant_dtype(cfg, name)
    if cfg.swiglu_limit is not None:
        return gpt_oss_fields.constant_dtype(cfg, name)
    if cfg.router == "sigmoid_groups" and cfg.architecture != "minimax_m2" and name.endswith(
            (".gate.weight", ".gate.e_score_correction_bias")):  # MiniMax-M2 keeps its router in the model's dtype
        return "float32"
    return cfg.dtype


def parameter_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the unsharded model, named as in a Hugging Face checkpoint, with its shape."""
    module = _module_shapes(cfg)
    out: dict[str, tuple[int, ...]] = {}
    for name, (tensor, start, dim) in _part_offsets(cfg, module).items():
        shape = list(module[name])
        shape[dim] += start  # a fused tensor: its last part's end
        out[tensor] = tuple(shape)
    return out


def _fused_source(name: str, parts: dict[str, str]) -> str:
    """The checkpoint tensor that holds module tensor `name` (`parts`: a projection's suffix -> its fused one)."""
    if not name.startswith(LAYER_PREFIX):
        return name
    layer, suffix = name[len(LAYER_PREFIX):].split(".", 1)
    return f"{LAYER_PREFIX}{layer}.{parts[suffix]}" if suffix in parts else name


def _part_offsets(cfg: ModelConfig, module: dict[str, tuple[int, ...]] | None = None) -> dict[
        str, tuple[str, int, int]]:
    """Module tensor -> (its checkpoint tensor, where it starts there, along which dimension): (itself, 0, 0)
    unless fused (FUSED: along the rows; kiln.core.model.fused_experts: 3-D experts along their own dimension).
    `module`: _module_shapes(cfg), where the caller has it already."""
    fused = FUSED.get(cfg.architecture) or {}
    parts = {part: tensor for tensor, names in fused.items() for part in names}
    out, rows = {}, {}
    for name, shape in (module or _module_shapes(cfg)).items():
        three_d = fused_experts.source(cfg, name) if fused_experts.fused(cfg) else None
        if three_d is not None:
            out[name] = three_d[0], three_d[2], three_d[1]
            continue
        tensor = _fused_source(name, parts)
        start = rows.get(tensor, 0)
        out[name] = (tensor, start, 0)
        rows[tensor] = start + shape[0]
    return out


def _module_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the module reads, by its checkpoint-style name (Phi-3's fused projections apart)."""
    if cfg.v4 is not None:
        return _with_scales(cfg, v4_fields.module_shapes(cfg))
    h, mlp = cfg.hidden_size, cfg.intermediate_size
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = (h,)
        out.update(attention_shapes.latent(cfg, p) if cfg.latent else attention_shapes.grouped(cfg, p))
        out[f"{p}.post_attention_layernorm.weight"] = (h,)
        if cfg.sandwich_norms:
            out[f"{p}.pre_feedforward_layernorm.weight"] = (h,)
            out[f"{p}.post_feedforward_layernorm.weight"] = (h,)
        if cfg.swiglu_limit is not None:  # gpt-oss: its router's bias, its stacked experts
            out.update(gpt_oss_fields.layer_shapes(cfg, p))
            continue
        if cfg.is_moe(i):
            module, (gate, up, down) = EXPERTS[cfg.architecture]
            e_mlp = cfg.moe_intermediate_size
            bias = f"{p}.{module}.{correction_bias(cfg)}"
            beside = cfg.router == "sigmoid_groups" and ".gate." not in bias  # the module's own: before its router
            if beside:
                out[bias] = (cfg.num_experts,)
            out[f"{p}.{module}.{router_of(cfg)}"] = (cfg.num_experts, h)
            if cfg.router == "sigmoid_groups" and not beside:
                out[bias] = (cfg.num_experts,)
            if fused_experts.fused(cfg):  # [experts, ...] each, from the checkpoint's 3-D tensors
                out.update(fused_experts.layer_shapes(cfg, p))
            for e in range(0 if fused_experts.fused(cfg) else cfg.num_experts):
                for name, shape in ((gate, (e_mlp, h)), (up, (e_mlp, h)), (down, (h, e_mlp))):
                    out[f"{p}.{module}.experts.{e}.{name}.weight"] = shape
            if cfg.shared_expert_intermediate_size:
                shared, shared_gate = SHARED_EXPERTS[cfg.architecture]
                s_mlp = cfg.shared_expert_intermediate_size
                for name, shape in (("gate_proj", (s_mlp, h)), ("up_proj", (s_mlp, h)), ("down_proj", (h, s_mlp))):
                    out[f"{p}.{shared}.{name}.weight"] = shape
                if shared_gate is not None:
                    out[f"{p}.{shared_gate}.weight"] = (1, h)
            continue
        for name, shape, bias in (("gate_proj", (mlp, h), mlp), ("up_proj", (mlp, h), mlp),
                                  ("down_proj", (h, mlp), h)):
            out[f"{p}.{mlp_module(cfg)}.{name}.weight"] = shape
            if cfg.mlp_bias:
                out[f"{p}.{mlp_module(cfg)}.{name}.bias"] = (bias,)
    out["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, h)
    return _with_scales(cfg, out)


def _with_scales(cfg: ModelConfig, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """`shapes` with each quantized weight's scales right after it (kiln.core.model.quant) and each FP4 weight
    at its stored shape (half the inputs: two a byte); itself unquantized."""
    if cfg.quant is None:
        return shapes
    out = {}
    for name, shape in shapes.items():
        if quant.is_fp4(cfg.quant, name):
            shape = (*shape[:-1], shape[-1] // 2)
        out[name] = shape
        if quant.is_quantized(cfg.quant, name):
            out[quant.scale_of(name, cfg.quant)] = quant.scale_shape(cfg.quant, shape, name)
    return out


_EXPERT = ".experts."


def is_expert(name: str) -> bool:
    """`name` (a checkpoint tensor or a stacked constant's suffix) is one expert's projection (gpt-oss stacks its
    experts in the checkpoint: kiln.core.model.gpt_oss_fields)."""
    return _EXPERT in name and not gpt_oss_fields.owns(name)


def _stack_suffix(suffix: str) -> str:
    """A per-layer tensor's suffix in its stacked constant: an expert's index dropped
    (`mlp.experts.3.gate_proj.weight` -> `mlp.experts.gate_proj.weight`), since the experts stack too."""
    if not is_expert(suffix) or not suffix.split(_EXPERT, 1)[1][:1].isdigit():  # fused 3-D experts: no index
        return suffix
    module, rest = suffix.split(_EXPERT, 1)
    return f"{module}{_EXPERT}{rest.split('.', 1)[1]}"



def constant_sources(cfg: ModelConfig) -> dict[str, list[str]]:
    """Package constant -> the checkpoint tensors it holds: one for a plain constant; a stacked one's
    tensors in layer order (and, for experts' projections, in expert order within each layer: the constant
    stacks layers x experts along one leading dimension, which the graph views as [layers, experts, ...]).
    Ordered as the torch module's state dict. A fused tensor (FUSED) is a source of each of its projections'
    constants, cut to that projection's rows (rank_reads)."""
    where = _part_offsets(cfg)
    return {name: [where[part][0] for part in parts] for name, parts in _constant_parts(cfg).items()}


def rank_reads(cfg: ModelConfig, tp: int, rank: int) -> dict[str, list[tuple[str, tuple[int, ...] | None]]]:
    """Package constant -> what `rank` reads into it, in order: (checkpoint tensor, (dim, start, stop) or None)
    per source: shard_slice's cut of the tensor itself, or, for a projection fused in the checkpoint (FUSED),
    the rows of the fused tensor that hold the rank's share of that projection. A quantized weight's scales
    whose rank grid repeats the checkpoint's blocks (kiln.core.model.quant.scale_cut) are cut
    (dim, start, stop, repeat): entries [start, stop) of `dim` once each of its entries is repeated `repeat`
    times."""
    shapes = _module_shapes(cfg)
    where = _part_offsets(cfg, shapes)
    full = parameter_shapes(cfg) if fused_experts.fused(cfg) else {}

    def read(part: str) -> tuple[str, tuple[int, ...] | None]:
        tensor, start, along = where[part]
        cut = shard_slice(part, cfg, tp, rank)
        if cut is not None and quant.is_scale(part):  # with its repeat, where the rank's grid has one
            weight = quant.weight_of(part)
            cut = quant.scale_cut(cfg.quant, _held(weight, cfg, tp, rank), weight)
            cut = cut if cut[3] > 1 else cut[:3]
        if tensor == part:
            return tensor, cut
        dim, a, b = cut if cut is not None else (along, 0, shapes[part][along])
        if dim != along:
            raise AssertionError(f"{part}: a fused projection is cut along the dimension it is fused along")
        if full and (dim, start, b - a) == (along, 0, full[tensor][along]):
            return tensor, None  # the whole tensor (a 3-D down_proj at tp 1)
        return tensor, (dim, start + a, start + b)

    return {name: [read(part) for part in parts] for name, parts in _constant_parts(cfg).items()}


def _constant_parts(cfg: ModelConfig) -> dict[str, list[str]]:
    """Package constant -> the module tensors it stacks (constant_sources before fused tensors are named)."""
    out: dict[str, list[str]] = {}
    full = _module_shapes(cfg)
    plain = [n for n in full if not n.startswith(LAYER_PREFIX)]
    out[plain[0]] = [plain[0]]  # the embedding comes first, as in the module
    runs = layer_runs(cfg)
    run_of = {i: j for j, run in enumerate(runs) for i in run}
    stacked: list[dict[str, list[str]]] = [{} for _ in runs]
    for name in full:  # layer by layer, each layer's experts in order
        if name.startswith(LAYER_PREFIX):
            layer, suffix = name[len(LAYER_PREFIX):].split(".", 1)
            stacked[run_of[int(layer)]].setdefault(_stack_suffix(suffix), []).append(name)
    for j, run in enumerate(stacked):
        for suffix, sources in run.items():
            out[f"{RUN_PREFIX}{j}.{suffix}"] = sources
    for name in plain[1:]:
        out[name] = [name]
    return out


def constant_shapes(cfg: ModelConfig, tp: int, rank: int = 0) -> dict[str, tuple[int, ...]]:
    """Package constant -> the shape rank `rank` binds (a stacked one leads with its layer count). Rank 0's
    are the largest (kiln.core.model.shares: near-equal splits give the first ranks the extra units)."""
    full = _module_shapes(cfg)
    out = {}
    for name, sources in _constant_parts(cfg).items():
        shape = list(full[sources[0]])
        cut = shard_slice(sources[0], cfg, tp, rank)
        if cut is not None:
            shape[cut[0]] = cut[2] - cut[1]
        out[name] = tuple(shape) if name == sources[0] else (len(sources), *shape)
    return out


def shard_slice(name: str, cfg: ModelConfig, tp: int, rank: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of `name`'s rows or columns that `rank` holds (kiln.core.model.shares.rank_share);
    None when replicated.

    Column-parallel projections (q, k, v, gate, up) split their output rows and
    their biases; row-parallel ones (o, down) split their input columns and
    keep their bias whole (it is added once, after the all-reduce).
    """
    if tp == 1:
        return None
    share = rank_share(cfg, tp, rank)
    if cfg.v4 is not None and v4_fields.shard_slice(name, cfg, share) is not None:
        return v4_fields.shard_slice(name, cfg, share)
    if cfg.swiglu_limit is not None and gpt_oss_fields.owns(name):
        return gpt_oss_fields.shard_slice(name, share)
    if cfg.quant is not None and quant.is_scale(name):  # on the rank's grid: kiln.core.model.quant.scale_cut
        weight = quant.weight_of(name)
        cut = quant.scale_cut(cfg.quant, _held(weight, cfg, tp, rank), weight)
        return None if cut is None else cut[:3]
    parts = name.rsplit(".", 2)
    whole_norm = cfg.qk_norm_whole and len(parts) == 3 and parts[-2] in ("q_norm", "k_norm")  # split with the heads
    if not whole_norm and (len(parts) < 3 or parts[-2] not in _COLUMN + _ROW or parts[-1] not in ("weight", "bias")):
        return None
    if parts[-1] == "bias" and parts[-2] in _ROW:
        return None
    (h0, h1), (k0, k1) = share.heads, share.kv_heads
    q, kv = (h0 * cfg.head_dim, h1 * cfg.head_dim), (k0 * cfg.head_dim, k1 * cfg.head_dim)
    latent = cfg.qk_nope_head_dim + cfg.v_head_dim
    mlp = share.experts if is_expert(name) else share.shared if is_shared_expert(name) else share.mlp
    three_d = fused_experts.fused(cfg) and is_expert(name) and not name.split(_EXPERT, 1)[1][:1].isdigit()
    a, b = {"q_proj": q, "q_b_proj": q, "o_proj": (h0 * cfg.v_head_dim, h1 * cfg.v_head_dim) if cfg.latent else q,
            "k_proj": kv, "v_proj": kv, "kv_b_proj": (h0 * latent, h1 * latent), "q_norm": q,
            "k_norm": kv}.get(parts[-2], mlp)
    output_dim = 0 if not three_d or not fused_experts.input_major(cfg) else 1  # Llama 4's: [experts, in, out]
    dim = (output_dim if parts[-2] in _COLUMN or whole_norm else 1 - output_dim) + (1 if three_d else 0)
    if dim == 1 and quant.is_fp4(cfg.quant, name):  # stored two inputs a byte: the rank's bytes
        a, b = a // 2, b // 2
    return dim, a, b


def _held(weight: str, cfg: ModelConfig, tp: int, rank: int) -> tuple[int, int, int] | None:
    """shard_slice of a quantized weight, None at tp 1 (a whole tensor keeps the checkpoint's block grid)."""
    return shard_slice(weight, cfg, tp, rank) if tp > 1 else None


def scale_grid(cfg: ModelConfig, tp: int, weight: str) -> tuple[int, int]:
    """(rows, cols) each of a rank's scales of quantized weight `weight` (a checkpoint name or a stacked constant's
    suffix) covers: the same on every rank (equal shares cut blocks alike, unequal ones are whole blocks)."""
    return quant.scale_grid(cfg.quant, _held(weight, cfg, tp, 0), weight)


def weight_layout(cfg: ModelConfig, tp: int) -> dict[str, dict]:
    """Package constant name -> {'dtype', 'shape', 'stack', 'sources'}.

    `dtype` is the dtype the package was compiled for (cast the checkpoint's tensors to it: the model's, float32
    for a few, constant_dtype); `shape` what a rank binds; `stack` None (a plain constant: its one source, cut)
    or the number of sources stacked along a new leading dimension, in order; each source is {'tensor' (the
    checkpoint tensor), 'full_shape', 'cut'}, with `cut` None (every rank binds it whole) or {'dim', 'length',
    'offsets'}: rank r binds `length` entries of dimension `dim` starting at `offsets[r]`; with 'repeat' too (a
    quantized weight's scales on the rank's sub-blocks, kiln.core.model.quant), of the tensor whose entries
    along `dim` are each repeated `repeat` times first. Where ranks' shares differ (kiln.core.model.shares),
    'shapes' (rank r binds shapes[r]) replaces a shape that differs by rank, 'lengths' a length: a consumer
    of the even form fails on the missing key rather than binding rank 0's."""
    full = parameter_shapes(cfg)
    shapes = [constant_shapes(cfg, tp, r) for r in range(tp)]
    reads = [rank_reads(cfg, tp, r) for r in range(tp)]

    def source(name: str, i: int) -> dict:
        tensor, first = reads[0][name][i]
        if first is None:
            return {"tensor": tensor, "full_shape": list(full[tensor]), "cut": None}
        cuts = [r[name][i][1] for r in reads]
        lengths = [c[2] - c[1] for c in cuts]
        cut = {"dim": first[0], **({"length": lengths[0]} if len(set(lengths)) == 1 else {"lengths": lengths}),
               "offsets": [c[1] for c in cuts], **({"repeat": first[3]} if len(first) > 3 else {})}
        return {"tensor": tensor, "full_shape": list(full[tensor]), "cut": cut}

    def shape(name: str) -> dict:
        each = [list(s[name]) for s in shapes]
        return {"shape": each[0]} if all(e == each[0] for e in each) else {"shapes": each}

    return {name: {"dtype": constant_dtype(cfg, name), **shape(name),
                   "stack": None if parts == [name] else len(parts),
                   "sources": [source(name, i) for i in range(len(parts))]}
            for name, parts in _constant_parts(cfg).items()}
