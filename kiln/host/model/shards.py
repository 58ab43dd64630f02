"""A rank's package constants from a checkpoint, random weights, and example inputs of one step."""

from __future__ import annotations

from collections.abc import Callable

import torch

from kiln.core.model import quant
from kiln.core.model.cache_layout import cache_layout
from kiln.core.model.config import ModelConfig
from kiln.core.model.contract import constant_dtype, constant_shapes, parameter_shapes, rank_reads
from kiln.host.model.layers.quantized import quantize_like


def rank_constants(cfg: ModelConfig, tp: int, rank: int,
                   read_into: Callable[[str, tuple | None, torch.Tensor], None],
                   dtype: torch.dtype, later: list[Callable[[], None]] | None = None) -> dict[str, torch.Tensor]:
    """Every package constant of `rank` in `dtype` (float32 or int64 where the contract keeps it so,
    constant_dtype),
    each allocated once and filled by
    `read_into(checkpoint_name, cut, out)`, which writes that tensor (cut to (dim, start, stop) when `cut`
    is not None) into `out`: a stacked constant's sources go straight into its layer slices, so building
    the constants never holds a second copy of the rank's weights. A quantized checkpoint's projections stay
    float8, their scales float32 (constant_dtype); scales on a grid finer than the checkpoint's blocks
    (kiln.core.model.quant.scale_cut) are read block by block, then repeated over their sub-blocks: at once,
    or, for a `read_into` that only schedules its reads, by the calls appended to `later`, which the caller
    makes once its reads are done."""
    cfg.check_tp(tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside tp {tp}")
    out = {}
    reads = rank_reads(cfg, tp, rank)
    for name, shape in constant_shapes(cfg, tp, rank).items():
        own = constant_dtype(cfg, name)  # the model's, or float32 / int64 / float8 for those the contract keeps so
        follows = own == cfg.dtype and not quant.is_scale(name)  # a block's scale keeps its dtype whatever `dtype`
        constant = torch.empty(shape, dtype=dtype if follows else getattr(torch, own))
        sources = reads[name]
        for i, (source, cut) in enumerate(sources):
            into = constant if sources == [(name, cut)] else constant[i]
            if cut is not None and len(cut) == 4:
                repeat = _read_repeated(read_into, source, cut, into)
                repeat() if later is None else later.append(repeat)
            else:
                read_into(source, cut, into)
        out[name] = constant
    return out


def _read_repeated(read_into: Callable[[str, tuple | None, torch.Tensor], None], source: str,
                   cut: tuple[int, int, int, int], out: torch.Tensor) -> Callable[[], None]:
    """Entries [start, stop) of dimension `dim` of `source` once each of its entries is repeated `repeat` times
    (cut = (dim, start, stop, repeat)) into `out`: the entries that hold them handed to `read_into`; the call
    returned repeats them into `out` once they are read."""
    dim, start, stop, repeat = cut
    first, last = start // repeat, -(-stop // repeat)
    shape = list(out.shape)
    shape[dim] = last - first
    held = torch.empty(shape, dtype=out.dtype)
    read_into(source, (dim, first, last), held)
    return lambda: out.copy_(held.repeat_interleave(repeat, dim=dim).narrow(dim, start - first * repeat,
                                                                            stop - start))


def shard_state_dict(full: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """One rank's package constants from a full (unsharded) Hugging Face state dict, in its dtype."""
    def read_into(name: str, cut: tuple | None, out: torch.Tensor) -> None:
        tensor = full[name]
        if tensor.dtype == getattr(torch, "float8_e8m0fnu", None):  # UE8M0 scales: held as their bytes
            tensor = tensor.view(torch.uint8)
        out.copy_(tensor if cut is None else tensor.narrow(cut[0], cut[1], cut[2] - cut[1]))

    return rank_constants(cfg, tp, rank, read_into, full["model.embed_tokens.weight"].dtype)


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the unsharded model with its shape, as a checkpoint must hold it (kiln.core.model.contract's
    statement of the layout, which a unit test holds to the module's own state dict)."""
    return parameter_shapes(cfg)


def random_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random full weights with a sensible scale (for test checkpoints and the tiny model); a quantized
    config's projections quantized (kiln.host.model.layers.quantized.quantize) beside their scales."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if quant.is_scale(name):
            continue  # made with its weight
        if quant.is_quantized(cfg.quant, name):
            logical = (*shape[:-1], shape[-1] * (2 if quant.is_fp4(cfg.quant, name) else 1))
            out[name], out[quant.scale_of(name, cfg.quant)] = quantize_like(
                cfg.quant, name, torch.randn(logical, generator=gen) * logical[-1] ** -0.5)
        elif constant_dtype(cfg, name) == "uint8":  # gpt-oss's MXFP4 bytes, and scales of 2^-3 or so
            out[name] = (torch.randint(123, 126, shape, generator=gen) if name.endswith("_scales")
                         else torch.randint(0, 256, shape, generator=gen)).to(torch.uint8)
        elif name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype)
        elif constant_dtype(cfg, name) == "int64":  # an index table (DeepSeek-V4's tid2eid): expert ids
            out[name] = torch.randint(0, cfg.num_experts, shape, generator=gen)
        else:
            out[name] = (torch.randn(shape, generator=gen) * shape[-1] ** -0.5).to(dtype)
    return out


def example_inputs(cfg: ModelConfig, tp: int, batch: int, tokens: int, *, page_tokens: int,
                   pages_per_seq: int, num_pages: int, seed: int = 0, rank: int = 0) -> tuple[torch.Tensor, ...]:
    """Inputs of one rank for a (batch, tokens) bucket; the cache holds random context. A model whose rope
    depends on the sequence's length also takes seq_lens: here each sequence's context and new tokens.
    DeepSeek-V4's: num_pages random slots, and each sequence's slot instead of a block table."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)
    tok = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen)
    max_start = pages_per_seq * page_tokens
    start = torch.randint(0, max_start + 1, (batch,), generator=gen)
    layout = cache_layout(cfg, tp, max_start, rank)
    cache = torch.randn(layout.shape(cfg.num_layers, num_pages, page_tokens), generator=gen).to(dtype)
    if not layout.paged:  # DeepSeek-V4: a slot per sequence (num_pages slots), the step within its context
        start = torch.randint(0, max(1, max_start - tokens + 1), (batch,), generator=gen)
        return tok, start, cache, torch.randint(0, num_pages, (batch,), generator=gen)
    table = torch.randint(0, num_pages, (batch, pages_per_seq), generator=gen)
    return (tok, start, cache, table, start + tokens) if cfg.length_dependent_rope else (tok, start, cache, table)
