"""The DeepSeek-V4 decoder of one rank, as transformers' DeepseekV4ForCausalLM computes it: a step of new
tokens over its compressed cache (`step`), a prompt from position 0 in one call (`prompt`), or the compiled
step over each sequence's slot of the contract's cache (`forward`, kiln.core.contract.cache_layout).

    streams = embed(tokens) copied to hc_mult streams
    each layer:  post, comb, x = mix(streams)          (kiln.host.model.hyper_connections)
                 streams = expand(post, comb, attention(attn_norm(x)), streams)
                 post, comb, x = mix(streams)
                 streams = expand(post, comb, experts(ffn_norm(x), tokens), streams)
    logits = head(norm(hyper_head(streams)))

The attention is kiln.host.model.compressed_attention (sliding, CSA or HCA by the layer's kind), the MLP
kiln.host.model.clipped_experts (hash-routed or top-k). The cache (`new_cache`) holds, per run, each state
tensor of kiln.core.v4_fields.layer_state stacked over the run's layers: [layers, batch, rows, width].
Layers are not unrolled: each run of layers of one
kind (kiln.core.contract.layer_runs: same attention kind and routing, so the same tensors) is one scan over
its stacked tensors, as kiln.host.model.decoder scans every other family's, so the code compiled per run does
not grow with its depth. Constant names are the checkpoint's, as kiln.core.contract states them.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.core.config import ModelConfig
from kiln.core.contract import CacheLayout, cache_layout, layer_runs, slot_context
from kiln.host.model.clipped_experts import experts
from kiln.host.model.compressed_attention import attention
from kiln.host.model.compressor import rms_norm32
from kiln.host.model.decoder import Holder, LayerRun, keep_float32
from kiln.host.model.hyper_connections import expand, hyper_head, mix_weights
from kiln.core.v4_fields import HASH_MOE

Cache = list[dict[str, torch.Tensor]]
"""Per run of layers, its state tensors by name, each [layers, batch, rows, width]."""


def layer(cfg: ModelConfig, tp: int, kind: tuple[str, str], p: dict[str, torch.Tensor], streams: torch.Tensor,
          tokens: torch.Tensor, start: torch.Tensor, state: dict[str, torch.Tensor]):
    """(streams after one decoder layer of kind (attention kind, routing), its state after the step) on
    streams [b, t, hc_mult, hidden] of `tokens` [b, t] at positions start[b]..."""
    eps = cfg.rms_norm_eps
    post, comb, x = mix_weights(cfg, p["hc_attn_fn"], p["hc_attn_base"], p["hc_attn_scale"], streams)
    attended, state = attention(cfg, tp, kind[0], p, rms_norm32(x, p["attn_norm.weight"], eps), start, state)
    streams = expand(post, comb, attended, streams)
    post, comb, x = mix_weights(cfg, p["hc_ffn_fn"], p["hc_ffn_base"], p["hc_ffn_scale"], streams)
    routed = experts(cfg, tp, p, rms_norm32(x, p["ffn_norm.weight"], eps), tokens if kind[1] == HASH_MOE else None)
    return expand(post, comb, routed, streams), state


class Inner(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int):
        super().__init__()
        n, h = cfg.v4.hc_mult, cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.vocab_size, h)
        self.runs = nn.ModuleList(LayerRun(cfg, tp, j) for j in range(len(layer_runs(cfg))))
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
    `scan=False` unrolls the runs in Python; both compute the same."""

    def __init__(self, cfg: ModelConfig, tp: int = 1, *, scan: bool = True):
        super().__init__()
        cfg.check_tp(tp)
        self.cfg, self.tp, self.scan = cfg, tp, scan
        self.model = Inner(cfg, tp)
        if not cfg.tie_word_embeddings:
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def new_cache(self, batch: int, capacity_tokens: int) -> Cache:
        """An empty cache for `batch` sequences of up to `capacity_tokens` tokens, in the model's dtype: the
        states of zero slots (kiln.core.contract.cache_layout)."""
        layout, weight = cache_layout(self.cfg, self.tp, capacity_tokens), self.model.embed_tokens.weight
        return unpack(layout, torch.zeros(batch, layout.slot_values, dtype=weight.dtype, device=weight.device))

    def _apply(self, fn, recurse=True):
        """A cast keeps the tensors the contract holds in float32 so (kiln.core.v4_fields.FLOAT32_SUFFIXES)."""
        super()._apply(fn, recurse)
        return keep_float32(self, self.cfg)

    def forward(self, tokens: torch.Tensor, start_pos: torch.Tensor, kv_cache: torch.Tensor,
                slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The compiled step (kiln.core.contract.forward_interface): (logits [b, t, vocab], new_kv [b,
        slot_values]) of `tokens` [b, t] at positions start_pos[b].. over the slots kv_cache[slots[b]]
        [num_slots, slot_values] (kiln.core.contract.cache_layout): each sequence's slot after the step."""
        layout = cache_layout(self.cfg, self.tp, slot_context(self.cfg, kv_cache.shape[1]))
        logits, after = self.step(tokens, start_pos, unpack(layout, kv_cache[slots]))
        return logits, pack(layout, after)

    def prompt(self, tokens: torch.Tensor) -> torch.Tensor:
        """logits [b, t, vocab] of the prompts `tokens` [b, t] fed from position 0 in one call."""
        return self.step(tokens, 0, self.new_cache(tokens.shape[0], tokens.shape[1]))[0]

    def step(self, tokens: torch.Tensor, start: torch.Tensor | int, cache: Cache) -> tuple[torch.Tensor, Cache]:
        """(logits [b, t, vocab], the cache after the step) of `tokens` [b, t] at positions start[b]..start[b]+t-1
        (`start` [b] int64, or one int for every sequence) after the cache of the positions before."""
        cfg = self.cfg
        start = torch.as_tensor(start, dtype=torch.int64, device=tokens.device).expand(tokens.shape[0])
        x = self.model.embed_tokens(tokens)
        streams = x.unsqueeze(2).expand(-1, -1, cfg.v4.hc_mult, -1).contiguous()
        after = []
        for run, state in zip(self.model.runs, cache):
            streams, state = self._run(run, streams, tokens, start, state)
            after.append(state)
        hc = self.model.hc_head
        x = rms_norm32(hyper_head(cfg, hc.hc_fn, hc.hc_base, hc.hc_scale, streams), self.model.norm.weight,
                       cfg.rms_norm_eps)
        head = self.model.embed_tokens.weight if cfg.tie_word_embeddings else self.head.weight
        return torch.nn.functional.linear(x, head), after

    def _run(self, run: LayerRun, streams: torch.Tensor, tokens: torch.Tensor, start: torch.Tensor,
             state: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg, tp, kind = self.cfg, self.tp, self.cfg.v4.kind(run.start)
        stacked = run.stacked()
        if not self.scan:
            states = []
            for i in range(run.stop - run.start):
                streams, one = layer(cfg, tp, kind, {n: w[i] for n, w in stacked.items()}, streams, tokens, start,
                                     {n: s[i] for n, s in state.items()})
                states.append(one)
            return streams, {n: torch.stack([one[n] for one in states]) for n in state}
        from torch._higher_order_ops.scan import scan

        def body(carry, xs):
            return layer(cfg, tp, kind, xs["weights"], carry, tokens, start, xs["state"])

        return scan(body, streams, {"weights": stacked, "state": state})
