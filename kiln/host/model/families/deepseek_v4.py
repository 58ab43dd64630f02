"""The DeepSeek-V4 decoder of one rank, as transformers' DeepseekV4ForCausalLM computes it: a step of new
tokens over its compressed cache (`step`), a prompt from position 0 in one call (`prompt`), or the compiled
step over each sequence's slot of the contract's cache (`forward`, kiln.core.model.contract.cache_layout).

    streams = embed(tokens) copied to hc_mult streams
    each layer:  post, comb, x = mix(streams)          (kiln.host.model.layers.hyper_connections)
                 streams = expand(post, comb, attention(attn_norm(x)), streams)
                 post, comb, x = mix(streams)
                 streams = expand(post, comb, experts(ffn_norm(x), tokens), streams)
    logits = head(norm(hyper_head(streams)))

The attention is kiln.host.model.layers.compressed_attention (sliding, CSA or HCA by the layer's kind), the MLP
kiln.host.model.layers.clipped_experts (hash-routed or top-k). The cache (`new_cache`) holds, per run, each state
tensor of kiln.core.model.v4_fields.layer_state stacked over the run's layers: [layers, batch, rows, width].
Layers are not unrolled: each run of layers of one
kind (kiln.core.model.layer_runs: same attention kind and routing, so the same tensors) stacks its tensors, and each
segment of runs is one scan, as kiln.host.model.decoder scans every other family's, so the code compiled does
not grow with depth. The default schedule alternates CSA and HCA layers: that segment's scan runs a CSA and
an HCA layer per iteration. Constant names are the checkpoint's, as kiln.core.model.contract states them.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.core.model.cache_layout import CacheLayout, cache_layout, slot_context
from kiln.core.model.config import ModelConfig
from kiln.core.model.layer_runs import Segment, layer_runs
from kiln.host.model.layers.choices import stacked_choices, unstack_picks
from kiln.host.model.layers.clipped_experts import experts
from kiln.host.model.layers.compressed_attention import attention
from kiln.host.model.layers.norms import rms_norm32
from kiln.host.model.layers.quantized import layer_weights
from kiln.host.model.layers.stacked import Holder, LayerRun, keep_own_dtypes, segment_runs
from kiln.host.model.layers.hyper_connections import expand, hyper_head, mix_weights
from kiln.core.model.v4_fields import HASH_MOE

Cache = list[dict[str, torch.Tensor]]
"""Per run of layers, its state tensors by name, each [layers, batch, rows, width]."""


def layer(cfg: ModelConfig, tp: int, kind: tuple[str, str], p: dict[str, torch.Tensor], streams: torch.Tensor,
          tokens: torch.Tensor, start: torch.Tensor, state: dict[str, torch.Tensor], picks: dict | None = None):
    """(streams after one decoder layer of kind (attention kind, routing), its state after the step) on
    streams [b, t, hc_mult, hidden] of `tokens` [b, t] at positions start[b]...; the layer's choices (a CSA
    layer's indexer picks, a top-k layer's experts) go into `picks` (kiln.host.model.layers.choices)."""
    eps = cfg.rms_norm_eps
    post, comb, x = mix_weights(cfg, p["hc_attn_fn"], p["hc_attn_base"], p["hc_attn_scale"], streams)
    attended, state = attention(cfg, tp, kind[0], p, rms_norm32(x, p["attn_norm.weight"], eps), start, state, picks)
    streams = expand(post, comb, attended, streams)
    post, comb, x = mix_weights(cfg, p["hc_ffn_fn"], p["hc_ffn_base"], p["hc_ffn_scale"], streams)
    routed = experts(cfg, tp, p, rms_norm32(x, p["ffn_norm.weight"], eps), tokens if kind[1] == HASH_MOE else None,
                     picks)
    return expand(post, comb, routed, streams), state


class Inner(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, rank: int = 0):
        super().__init__()
        n, h = cfg.v4.hc_mult, cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.runs = nn.ModuleList(LayerRun(cfg, tp, j, rank) for j in range(len(layer_runs(cfg))))
        self.norm = Holder()
        self.norm.weight = nn.Parameter(torch.ones(h))
        self.hc_head = Holder()
        self.hc_head.hc_fn = nn.Parameter(torch.randn(n, n * h) * (n * h) ** -0.5)
        self.hc_head.hc_base = nn.Parameter(torch.zeros(n))
        self.hc_head.hc_scale = nn.Parameter(torch.ones(1))


def unpack(layout: CacheLayout, slots: torch.Tensor) -> Cache:
    """The cache (per run, each state [layers, b, rows, width]) held in `slots` [b, slot_values]."""
    out: Cache = []
    for s in layout.states:
        if s.run == len(out):
            out.append({})
        flat = slots[:, s.offset:s.offset + s.values]
        out[s.run][s.name] = flat.reshape(slots.shape[0], s.layers, s.rows, s.width).movedim(1, 0)
    return out


def pack(layout: CacheLayout, cache: Cache) -> torch.Tensor:
    """[b, slot_values]: each sequence's slot holding `cache`, in the layout's order."""
    return torch.cat([cache[s.run][s.name].movedim(0, 1).flatten(1) for s in layout.states], dim=1)


class DeepseekV4Decoder(nn.Module):
    """One tensor-parallel rank of DeepSeek-V4: forward(tokens, start_pos, kv_cache, slots), the compiled step
    over a slot cache, and its parts: `step` over a cache of per-run tensors, `prompt` from position 0.
    `scan=False` unrolls the runs in Python; both compute the same. `rank` picks the rank's share where tp
    splits unevenly (kiln.core.model.shares): its tensors' shapes."""

    def __init__(self, cfg: ModelConfig, tp: int = 1, *, scan: bool = True, rank: int = 0):
        super().__init__()
        cfg.check_tp(tp)
        self.cfg, self.tp, self.scan = cfg, tp, scan
        self.model = Inner(cfg, tp, rank)
        if not cfg.tie_word_embeddings:
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def new_cache(self, batch: int, capacity_tokens: int) -> Cache:
        """An empty cache for `batch` sequences of up to `capacity_tokens` tokens, in the model's dtype: the
        states of zero slots (kiln.core.model.contract.cache_layout)."""
        layout, weight = cache_layout(self.cfg, self.tp, capacity_tokens), self.model.embed_tokens.weight
        return unpack(layout, torch.zeros(batch, layout.slot_values, dtype=weight.dtype, device=weight.device))

    def _apply(self, fn, recurse=True):
        """A cast keeps the tensors the contract holds in float32 so (kiln.core.model.v4_fields.FLOAT32_SUFFIXES)."""
        super()._apply(fn, recurse)
        return keep_own_dtypes(self, self.cfg)

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, kv_cache: torch.Tensor,
                slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The compiled step (kiln.core.model.contract.forward_interface): (logits [b, t, vocab], new_kv [b,
        slot_values], its choices: kiln.core.model.interface.choice_sites) of `tokens` [b, t] at positions
        start_pos[b].. over the slots kv_cache[slots[b]] [num_slots, slot_values]
        (kiln.core.model.contract.cache_layout): each sequence's slot after the step."""
        layout = cache_layout(self.cfg, self.tp, slot_context(self.cfg, kv_cache.shape[1]))
        logits, after, picks = self._step(tokens, start_pos, unpack(layout, kv_cache[slots]))
        return logits, pack(layout, after), *stacked_choices(self.cfg, picks, tokens.shape)

    def prompt(self, tokens: torch.Tensor) -> torch.Tensor:
        """logits [b, t, vocab] of the prompts `tokens` [b, t] fed from position 0 in one call."""
        return self.step(tokens, 0, self.new_cache(tokens.shape[0], tokens.shape[1]))[0]

    def step(self, tokens: torch.Tensor, start: torch.Tensor | int, cache: Cache) -> tuple[torch.Tensor, Cache]:
        """(logits [b, t, vocab], the cache after the step) of `tokens` [b, t] at positions start[b]..start[b]+t-1
        (`start` [b] int64, or one int for every sequence) after the cache of the positions before."""
        return self._step(tokens, start, cache)[:2]

    def _step(self, tokens: torch.Tensor, start: torch.Tensor | int, cache: Cache):
        """step's (logits, cache after), and each layer's choices (a dict per layer, in layer order)."""
        cfg = self.cfg
        start = torch.as_tensor(start, dtype=torch.int64, device=tokens.device).expand(tokens.shape[0])
        x = self.model.embed_tokens(tokens)
        streams = x.unsqueeze(2).expand(-1, -1, cfg.v4.hc_mult, -1).contiguous()
        after, picks, j = [], [], 0
        for segment, runs in segment_runs(cfg, self.model.runs):
            streams, states, made = self._segment(segment, runs, streams, tokens, start, cache[j:j + len(runs)])
            after += states
            picks += made
            j += len(runs)
        hc = self.model.hc_head
        x = rms_norm32(hyper_head(cfg, hc.hc_fn, hc.hc_base, hc.hc_scale, streams), self.model.norm.weight,
                       cfg.rms_norm_eps)
        head = self.model.embed_tokens.weight if cfg.tie_word_embeddings else self.head.weight
        return torch.nn.functional.linear(x, head), after, picks

    def _segment(self, segment: Segment, runs: list[LayerRun], streams: torch.Tensor, tokens: torch.Tensor,
                 start: torch.Tensor, states: Cache) -> tuple[torch.Tensor, Cache, list[dict]]:
        """(streams after the segment's layers, each of its runs' state after the step, each layer's choices)."""
        cfg, tp = self.cfg, self.tp
        kinds = [cfg.v4.kind(run.layers[0]) for run in runs]
        dtype = getattr(torch, cfg.dtype)  # a quantized checkpoint's projections are dequantized to it, layer by layer
        phases = [{"weights": run.stacked(), "state": state} for run, state in zip(runs, states)]
        if not self.scan:
            after: Cache = [{n: [] for n in state} for state in states]
            picks = []
            for i in range(segment.repeats):
                for kind, phase, out in zip(kinds, phases, after):
                    picks.append({})
                    weights = layer_weights(cfg, tp, {n: w[i] for n, w in phase["weights"].items()}, dtype)
                    streams, one = layer(cfg, tp, kind, weights, streams, tokens, start,
                                         {n: s[i] for n, s in phase["state"].items()}, picks[-1])
                    for n, s in one.items():
                        out[n].append(s)
            return streams, [{n: torch.stack(s) for n, s in out.items()} for out in after], picks
        from torch._higher_order_ops.scan import scan

        def body(carry, steps):
            out = []
            for kind, step in zip(kinds, steps):
                picks = {}
                carry, state = layer(cfg, tp, kind, layer_weights(cfg, tp, step["weights"], dtype), carry, tokens,
                                     start, step["state"], picks)
                out.append((state, picks))
            return carry, out

        streams, out = scan(body, streams, phases)
        return streams, [state for state, _ in out], unstack_picks([picks for _, picks in out], segment.repeats)
