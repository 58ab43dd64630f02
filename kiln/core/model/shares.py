"""What each of tp ranks holds of what tensor parallelism splits, for any tp, and which tp a model refuses. Pure.

Every split is by whole units, near-equal, the first ranks taking one unit more where the units do not divide
(no padding: ranks whose shares differ hold tensors of different shapes):
- grouped-query attention: KV heads, each with its group of query heads, while there are at least as many KV
  heads as ranks; with fewer (2 KV heads at tp 3) the query heads, each rank holding the KV heads its query
  heads use (a KV head serving two ranks is held by both) and attending a run of its query heads to each
  (Share.kv_runs);
- latent attention (DeepSeek-V3): query heads (the latent is every rank's);
- DeepSeek-V4: output groups (o_groups), each with its query heads; its one key=value head, compressors and
  indexer are every rank's;
- the MLP's, each expert's and the shared expert's intermediate columns: single columns where tp divides them,
  else whole blocks of a quantized checkpoint's scales (a rank's scales are then the checkpoint's own), FP4
  scale groups of DeepSeek-V4-Flash's experts.
Near-equal splits give rank 0 the most of everything, so its share is the one a bound per rank reads.

A tp whose split would leave a rank without a unit (more ranks than attention heads, say) is refused by name
with the degrees that work. The functions take a kiln.core.model.config.ModelConfig (`cfg`), named, not
imported: config asks this module whether a tp is sensible.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from kiln.core.errors import BadInput
from kiln.core.model import quant

Span = tuple[int, int]
"""[start, stop) of a rank's units along a split dimension."""


def split(count: int, parts: int, unit: int = 1) -> list[Span]:
    """`count` entries in `parts` contiguous near-equal spans of whole `unit`s (the last may end in a partial
    unit at `count`), the first spans a unit longer where the units do not divide."""
    units = -(-count // unit)
    base, extra = divmod(units, parts)
    out, at = [], 0
    for r in range(parts):
        n = base + (r < extra)
        out.append((min(at * unit, count), min((at + n) * unit, count)))
        at += n
    return out


@dataclass(frozen=True)
class Share:
    """One rank's spans of what tp splits."""

    heads: Span
    """Its query heads (and their sinks, DeepSeek-V4)."""
    kv_heads: Span
    """Its KV heads (grouped-query attention; latent and DeepSeek-V4 attention hold the whole latent or head)."""
    groups: Span | None
    """DeepSeek-V4: its output groups (wo_a's rows, wo_b's columns, of o_lora_rank each); None otherwise."""
    mlp: Span
    """Its columns of the dense MLP's intermediate size."""
    experts: Span
    """Its columns of each expert's intermediate size (moe_intermediate_size)."""
    shared: Span
    """Its columns of the shared expert's intermediate size."""
    kv_runs: tuple[int, ...] | None
    """Grouped-query attention whose query heads straddle KV groups unevenly: per held KV head (in order) the
    number of the rank's query heads that attend it; None when each KV head serves the same number (the
    query heads then group as everywhere: heads // kv_heads each)."""

    def counts(self) -> dict:
        """What the rank's forward is compiled for: the length of each span and the runs (ranks with equal
        counts share a compiled forward)."""
        out = {k: v[1] - v[0] for k, v in (("heads", self.heads), ("kv_heads", self.kv_heads), ("mlp", self.mlp),
                                           ("experts", self.experts), ("shared", self.shared))}
        if self.groups is not None:
            out["groups"] = self.groups[1] - self.groups[0]
        if self.kv_runs is not None:
            out["kv_runs"] = list(self.kv_runs)
        return out


def _unit(cfg, count: int, tp: int, weights: tuple[str, ...]) -> int:
    """The unit an intermediate size of `count` splits in: one column where tp divides it evenly (a quantized
    weight's scales then cut as at any even tp: kiln.core.model.quant.scale_cut; FP4 weights in whole bytes,
    two columns), else the scale block of its quantized weights (`weights`: names of its two column- and its
    row-parallel projections)."""
    if cfg.quant is None:
        return 1
    if cfg.quant.method == quant.MXFP4:  # gpt-oss's experts: whole groups of 32 inputs (their down blocks' cut)
        return quant.FP4_GROUP
    fp4 = any(quant.is_fp4(cfg.quant, name) for name in weights)
    if count % (2 * tp if fp4 else tp) == 0:
        return 1
    unit = 1
    for name, dim in zip(weights, (0, 0, 1)):
        if quant.is_quantized(cfg.quant, name):
            block = quant.block_of(cfg.quant, name)[dim] * (2 if quant.is_fp4(cfg.quant, name) and dim else 1)
            unit = max(unit, block)
    return unit


_WEIGHTS = {
    "mlp": tuple(f"model.layers.0.mlp.{n}_proj.weight" for n in ("gate", "up", "down")),
    "experts": tuple(f"model.layers.0.mlp.experts.0.{n}_proj.weight" for n in ("gate", "up", "down")),
    "shared": tuple(f"model.layers.0.mlp.shared_experts.{n}_proj.weight" for n in ("gate", "up", "down")),
    "v4 experts": tuple(f"model.layers.0.ffn.experts.0.{n}.weight" for n in ("w1", "w3", "w2")),
    "v4 shared": tuple(f"model.layers.0.ffn.shared_experts.{n}.weight" for n in ("w1", "w3", "w2"))}
"""A layer's gate, up and down projections of each intermediate size, as the quantization rules name them."""


def _intermediates(cfg) -> list[tuple[str, str, int]]:
    """(Share field, what it is called, its size) of each intermediate size tp splits."""
    v4 = cfg.v4 is not None
    return [("mlp", "MLP intermediate size", cfg.intermediate_size),
            ("experts", "expert intermediate size", cfg.moe_intermediate_size),
            ("shared", "shared expert intermediate size",
             cfg.moe_intermediate_size if v4 else cfg.shared_expert_intermediate_size)]


def _mlp_spans(cfg, tp: int) -> dict[str, tuple[list[Span], int]]:
    """Share field -> (each rank's span, the unit split in)."""
    out, split_here = {}, dict(_units(cfg))
    for field, what, count in _intermediates(cfg):
        if what not in split_here:  # none in this model (DeepSeek-V4's dense MLP, say)
            out[field] = [(0, 0)] * tp, 1
            continue
        unit = _unit(cfg, count, tp, _WEIGHTS[f"v4 {field}" if cfg.v4 is not None and field != "mlp" else field])
        out[field] = split(count, tp, unit), unit
    return out


def _attention_spans(cfg, tp: int) -> list[tuple[Span, Span, Span | None, tuple | None]]:
    """Per rank: (query heads, KV heads, output groups, kv_runs)."""
    h, k = cfg.num_heads, cfg.num_kv_heads
    if cfg.v4 is not None:
        per_group = h // cfg.v4.o_groups
        return [((a * per_group, b * per_group), (0, k), (a, b), None) for a, b in split(cfg.v4.o_groups, tp)]
    if cfg.latent:
        return [(span, (0, k), None, None) for span in split(h, tp)]
    group = h // k
    if k >= tp:
        return [((a * group, b * group), (a, b), None, None) for a, b in split(k, tp)]
    out = []
    for a, b in split(h, tp):
        first, last = a // group, (b - 1) // group + 1  # the KV heads of its first and last query heads
        runs = tuple(len([q for q in range(a, b) if q // group == kv]) for kv in range(first, last))
        out.append(((a, b), (first, last), None, None if len(set(runs)) <= 1 else runs))
    return out


@functools.lru_cache(maxsize=64)
def _shares(cfg, tp: int) -> tuple[Share, ...]:
    spans = {field: spans for field, (spans, _) in _mlp_spans(cfg, tp).items()}
    return tuple(Share(heads=heads, kv_heads=kv, groups=groups, mlp=spans["mlp"][r], experts=spans["experts"][r],
                       shared=spans["shared"][r], kv_runs=runs)
                 for r, (heads, kv, groups, runs) in enumerate(_attention_spans(cfg, tp)))


def rank_share(cfg, tp: int, rank: int) -> Share:
    """What rank `rank` of `tp` holds (check_tp first: a refused tp has no sensible share)."""
    check_tp(cfg, tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside tp {tp}")
    return _shares(cfg, tp)[rank]


def even(cfg, tp: int) -> bool:
    """Every rank of `tp` holds the same counts (one compiled forward serves them all)."""
    check_tp(cfg, tp)
    return len({repr(s.counts()) for s in _shares(cfg, tp)}) == 1


def _units(cfg) -> list[tuple[str, int]]:
    """What tp splits, each a count of whole units no rank may go without."""
    counts = [("output groups (o_groups)", cfg.v4.o_groups) if cfg.v4 is not None else
              ("attention heads", cfg.num_heads)]
    if cfg.v4 is None and len(cfg.moe_layers) < cfg.num_layers:
        counts.append(("MLP intermediate size", cfg.intermediate_size))
    if cfg.moe_layers or cfg.v4 is not None:
        counts.append(("expert intermediate size", cfg.moe_intermediate_size))
    if cfg.moe_layers and cfg.shared_expert_intermediate_size or cfg.v4 is not None:
        counts.append(("shared expert intermediate size",
                       cfg.moe_intermediate_size if cfg.v4 is not None else cfg.shared_expert_intermediate_size))
    return counts


@functools.lru_cache(maxsize=256)  # asked for every tensor a rank cuts
def _why_not(cfg, tp: int) -> str | None:
    """Why `tp` ranks cannot split `cfg` sensibly, or None."""
    if cfg.v4 is not None and cfg.num_heads % cfg.v4.o_groups:
        return f"its {cfg.num_heads} attention heads do not fill its {cfg.v4.o_groups} output groups evenly"
    if cfg.qk_norm_whole and cfg.num_kv_heads < tp:  # a key head held twice would count twice in k_norm's sum
        return (f"its k_norm normalises all {cfg.num_kv_heads} key/value heads together, and a rank's share of "
                "them must be its own")
    for what, count in _units(cfg):
        if count < tp:
            return f"it has {count} {what}, fewer than {tp} ranks"
    split_here = dict(_units(cfg))
    for field, what, count in _intermediates(cfg):
        spans, unit = _mlp_spans(cfg, tp)[field]
        if what not in split_here or unit == 1:
            continue
        if count % unit or any(b <= a for a, b in spans):
            whole = " in whole bytes" if unit == quant.FP4_GROUP else ""  # FP4: two columns a byte
            return (f"it does not split its {count} {what} evenly{whole}, and an uneven split needs whole "
                    f"quantization blocks of {unit} columns on every rank")
    return None if cfg.quant is None else _straddles(cfg, tp)


def _attention_cuts(cfg) -> list[tuple[str, str, int, int]]:
    """The quantized attention projections tp cuts: (weight, span it follows, entries per unit, dimension)."""
    if cfg.v4 is not None:
        return [("attn.wq_b.weight", "heads", cfg.head_dim, 0), ("attn.wo_a.weight", "groups", cfg.v4.o_lora_rank, 0),
                ("attn.wo_b.weight", "groups", cfg.v4.o_lora_rank, 1)]
    if cfg.latent:
        return [("self_attn.q_b_proj.weight" if cfg.q_lora_rank else "self_attn.q_proj.weight", "heads",
                 cfg.head_dim, 0), ("self_attn.kv_b_proj.weight", "heads", cfg.qk_nope_head_dim + cfg.v_head_dim, 0),
                ("self_attn.o_proj.weight", "heads", cfg.v_head_dim, 1)]
    return [("self_attn.q_proj.weight", "heads", cfg.head_dim, 0), ("self_attn.k_proj.weight", "kv_heads",
            cfg.head_dim, 0), ("self_attn.v_proj.weight", "kv_heads", cfg.head_dim, 0),
            ("self_attn.o_proj.weight", "heads", cfg.head_dim, 1)]


def _straddles(cfg, tp: int) -> str | None:
    """Where ranks hold unequal counts of a quantized attention projection, a rank boundary inside a block
    (its scales would cover two ranks' entries; at equal counts a rank's scales sit on sub-blocks instead:
    kiln.core.model.quant.scale_cut)."""
    shares = _shares(cfg, tp)
    for weight, span, per_unit, dim in _attention_cuts(cfg):
        name = f"model.layers.0.{weight}"
        if not quant.is_quantized(cfg.quant, name):
            continue
        spans = [getattr(s, span) for s in shares]
        if len({b - a for a, b in spans}) == 1:
            continue
        block, end = quant.block_of(cfg.quant, name)[dim], spans[-1][1] * per_unit
        for a, b in spans:
            if (a * per_unit) % block or (b * per_unit) % block and b * per_unit != end:
                return (f"ranks would hold unequal shares of {weight} cut inside its {block}-entry quantization "
                        f"blocks ({per_unit} entries per {span.replace('_', ' ')[:-1]})")
    return None


def check_tp(cfg, tp: int) -> None:
    """Raise BadInput unless `tp` ranks can each hold a share of `cfg` (see the module docstring), naming what
    is short and the degrees that work."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
        raise BadInput(f"--tp must be a positive integer, got {tp!r}.")
    why = _why_not(cfg, tp)
    if why is None:
        return
    largest = max(count for _, count in _units(cfg))
    ok = [d for d in range(1, min(largest, 64) + 1) if _why_not(cfg, d) is None]
    raise BadInput(f"--tp {tp} cannot split the model: {why}; use a tp of {', '.join(map(str, ok))}.")


def rank_classes(cfg, tp: int) -> list[list[int]] | None:
    """The ranks of `tp` grouped by equal counts (each group one compiled forward), in rank order; None where
    every rank's are equal (one forward serves them all, and the forward's key names no share)."""
    if even(cfg, tp):
        return None
    groups: dict[str, list[int]] = {}
    for rank, share in enumerate(_shares(cfg, tp)):
        groups.setdefault(repr(share.counts()), []).append(rank)
    return list(groups.values())


def graph_shares(cfg, tp: int) -> list[dict | None]:
    """What each distinct rank shape puts in its forwards' graph (kiln.core.plan.job.ExportJob.specs): [None]
    where tp splits evenly, else per group of rank_classes {'ranks': its ranks, **their counts}; a compile
    builds the model of its first rank."""
    classes = rank_classes(cfg, tp)
    if classes is None:
        return [None]
    return [{"ranks": ranks, **_shares(cfg, tp)[ranks[0]].counts()} for ranks in classes]


def share_rank(graph: dict) -> int:
    """The rank whose share a forward of `graph` is built for: its share's first rank, rank 0 where tp
    splits evenly (every rank's share alike)."""
    share = graph.get("share")
    return 0 if share is None else share["ranks"][0]
