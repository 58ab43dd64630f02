"""One tensor-parallel rank of the decoder: embeddings, runs of scanned layers, the final norm and head.

The forward is one inference step over a paged KV cache:

    forward(tokens[B,T], start_pos[B], kv_cache[L,E,P,page_tokens,heads,width], block_table[B,M]
            [, seq_lens[B]]) -> (logits[B,T,vocab], new_kv[L,E,B,T,heads,width]
                                 [, expert_choices[moe layers,B,T,k] int32])

expert_choices is an output only of a mixture of experts: the experts each
token took in each expert layer (kiln.host.model.layers.choices), which the
check forces its float32 reference to.

seq_lens is an input only of a model whose rotary frequencies depend on the
sequence's length (longrope, dynamic): sequence b's length as transformers would
see it in one call (max(position_ids) + 1), i.e. its whole prompt's length while
the prompt is fed, and its position + 1 for each token decoded after.

P (the page count) is dynamic, so a new KV plan reuses compiled forwards. What a
cached token holds (E entries of [heads, width]) is the model's cache layout
(kiln.core.model.cache_layout): its rotated keys and its values per KV head of
this rank, or latent attention's latent and rotary key. Sequence b's first
start_pos[b] tokens of context live in the pages block_table[b]; the step returns
the new tokens' entries for the caller to write into the cache.

The layers are not unrolled: each segment of layers (kiln.core.model.layer_runs) is one
`torch._higher_order_ops.scan` over its runs' tensors stacked along a leading layer
dimension, the cache's layer slices and each layer's window, so AOTInductor compiles
one layer body per run and a bucket's compile time does not grow with depth. A
segment whose kinds alternate (dense and mixture-of-experts layers in turn) runs one
layer of each of its runs per iteration. The step's new cache entries are the
scan's stacked outputs, put back in layer order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.model import llama4_fields
from kiln.core.model.config import ModelConfig
from kiln.core.model.layer_runs import Segment, layer_runs
from kiln.core.model.shares import rank_share
from kiln.host.model.families import deepseek, gemma, gpt_oss, llama
from kiln.host.model.families.llama import Layer
from kiln.host.model.layers.norms import RMSNorm, softcap
from kiln.host.model.layers.quantized import layer_weights
from kiln.host.model.layers.choices import stacked_choices, unstack_picks
from kiln.host.model.layers.stacked import LayerRun, every, interleave, keep_own_dtypes, segment_runs
from kiln.host.model.layers.step import FULL_ATTENTION, UNCHUNKED, StepContext, step_context


def layer_of(cfg: ModelConfig) -> Layer:
    """The decoder layer `cfg` computes: DeepSeek's (latent attention), Gemma's (norms around attention and
    MLP), gpt-oss's (sinks, its experts) or Llama's (every other family)."""
    if cfg.architecture == "gpt_oss":
        return gpt_oss.layer
    if cfg.latent:
        return deepseek.layer
    return gemma.layer if cfg.sandwich_norms else llama.layer


class Inner(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, rank: int = 0):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.runs = nn.ModuleList(LayerRun(cfg, tp, j, rank) for j in range(len(layer_runs(cfg))))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset,
                            float32_weight=cfg.architecture == "gpt_oss")


class ShardedDecoder(nn.Module):
    """One tensor-parallel rank of the decoder; constant names as kiln.core.model.contract states them.

    Each segment of layers is one `scan` over its runs' stacked tensors, the KV cache's layer slices and each
    layer's window, so the compiled graph holds one layer body per run whatever the depth. `scan=False` unrolls the
    same layers in Python (the eager reference and the depth bench's comparison); both compute the same.
    With tied embeddings there is no lm_head: the output head reads the embedding matrix, so the package
    asks for one tensor, not two copies. `rank` picks the rank's share where tp splits unevenly
    (kiln.core.model.shares): its tensors' shapes and, for query heads that straddle KV groups, its runs.
    """

    def __init__(self, cfg: ModelConfig, tp: int = 1, *, scan: bool = True, rank: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tp = tp
        self.kv_runs = rank_share(cfg, tp, rank).kv_runs
        self.scan = scan
        self.layer = layer_of(cfg)
        self.model = Inner(cfg, tp, rank)
        # A Python float (no tensor in the graph): sqrt(hidden) as the model's dtype holds it.
        self.embed_multiplier = torch.tensor(cfg.hidden_size ** 0.5, dtype=getattr(torch, cfg.dtype),
                                             device="cpu").item()
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def _apply(self, fn, recurse=True):
        """Every cast (`.to(dtype)`, `.half()`, ...) leaves the tensors the contract keeps in a dtype of their own
        (constant_dtype: DeepSeek-V3's router in float32, as transformers keeps it; a quantized checkpoint's
        float8 projections and their scales) in it."""
        super()._apply(fn, recurse)
        return keep_own_dtypes(self, self.cfg)

    def _windows(self, device) -> torch.Tensor | None:
        """[layers] int64: each layer's window, FULL_ATTENTION (a value no distance reaches) on full-attention
        layers (Llama 4's: its chunks, FULL_ATTENTION on its layers with no rope); None when no layer has a
        window. Computed in the graph (a buffer would become a package constant)."""
        cfg = self.cfg
        layer = torch.arange(cfg.num_layers, device=device)
        if llama4_fields.windowed(cfg):  # Llama 4: its chunk where it rotates, FULL_ATTENTION where it does not
            nope = torch.zeros_like(layer, dtype=torch.bool)
            for i in cfg.nope_layers:
                nope = nope | (layer == i)
            return torch.where(nope, FULL_ATTENTION, cfg.attention_chunk_size or UNCHUNKED)
        if all(cfg.window_of(i) is None for i in range(cfg.num_layers)):
            return None
        sliding = layer >= cfg.first_sliding_layer
        for i in cfg.full_attention_layers:
            sliding = sliding & (layer != i)
        return torch.where(sliding, cfg.sliding_window, FULL_ATTENTION)

    def forward(self, tokens, start_pos, kv_cache, block_table, seq_lens=None):
        if (seq_lens is not None) != self.cfg.length_dependent_rope:
            raise ValueError(f"seq_lens is an input exactly when the rope depends on the sequence's length "
                             f"(longrope, dynamic); this model's rope is {self.cfg.rope_type!r}")
        windows = self._windows(tokens.device)
        ctx = step_context(self.cfg, start_pos, tokens.shape[1], kv_cache.shape[3], block_table, kv_cache.dtype,
                           windowed=windows is not None, seq_lens=seq_lens, kv_runs=self.kv_runs)
        x = self.model.embed_tokens(tokens)
        if self.cfg.embed_scale:  # Gemma: sqrt(hidden), rounded to the dtype first as transformers does
            x = x * self.embed_multiplier
        new_entries, picks = [], []
        for segment, runs in segment_runs(self.cfg, self.model.runs):
            x, entries, made = self._segment(segment, runs, x, kv_cache[segment.start:segment.stop],
                                             None if windows is None else windows[segment.start:segment.stop], ctx)
            new_entries.append(entries)
            picks += made
        x = self.model.norm(x)
        logits = F.linear(x, self.model.embed_tokens.weight) if self.cfg.tie_word_embeddings else self.lm_head(x)
        return (softcap(logits, self.cfg.final_softcap), torch.cat(new_entries),
                *stacked_choices(self.cfg, picks, tokens.shape))

    def _segment(self, segment: Segment, runs: list[LayerRun], x, kv, windows, ctx: StepContext):
        """One segment of layers: (x after them, their new cache entries [layers, E, b, t, heads, width] in
        layer order, each layer's choices: a dict per layer, kiln.host.model.layers.choices). `kv` and
        `windows` are the segment's layer slices; run k takes every period-th."""
        cfg, tp, layer, period = self.cfg, self.tp, self.layer, segment.period
        dtype = x.dtype  # a quantized checkpoint's projections are dequantized to it, layer by layer
        phases = []
        for k, run in enumerate(runs):
            phase = {"weights": run.stacked(), "kv": every(kv, k, period)}
            if windows is not None:
                phase["window"] = every(windows, k, period)
            phases.append(phase)
        if not self.scan:
            entries, picks = [], []
            for i in range(segment.repeats):
                for phase in phases:
                    weights = layer_weights(cfg, tp, {n: w[i] for n, w in phase["weights"].items()}, dtype)
                    picks.append({})
                    x, entry = layer(cfg, tp, weights, x, phase["kv"][i],
                                     phase["window"][i] if "window" in phase else None, ctx, picks[-1])
                    entries.append(entry)
            return x, torch.stack(entries), picks
        from torch._higher_order_ops.scan import scan

        b, t = x.shape[0], x.shape[1]

        def body(carry, steps):
            # The outer batch and token sizes, closed over: over a range of shapes torch.export lifts them
            # into the body as its SymInt inputs, which Inductor's scan -> while_loop lowering needs to size
            # the body's outputs (without them it fails with KeyError on the outer size's symbol).
            carry = carry.view(b, t, carry.shape[-1])
            out = []
            for step in steps:
                picks = {}
                carry, entry = layer(cfg, tp, layer_weights(cfg, tp, step["weights"], dtype), carry, step["kv"],
                                     step.get("window"), ctx, picks)
                out.append((entry, picks))
            return carry, out

        x, out = scan(body, x, phases)
        return x, interleave([entry for entry, _ in out]), unstack_picks([picks for _, picks in out],
                                                                         segment.repeats)
