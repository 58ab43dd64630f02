"""The DeepSeek-V4 decoder of one rank, as transformers' DeepseekV4ForCausalLM computes it, over a prompt fed
from position 0 in one call (eager only: kiln.core.v4_fields.export_refusal says what a step still lacks).

    streams = embed(tokens) copied to hc_mult streams
    each layer:  post, comb, x = mix(streams)          (kiln.host.model.hyper_connections)
                 streams = expand(post, comb, attention(attn_norm(x)), streams)
                 post, comb, x = mix(streams)
                 streams = expand(post, comb, experts(ffn_norm(x), tokens), streams)
    logits = head(norm(hyper_head(streams)))

The attention is kiln.host.model.compressed_attention (sliding, CSA or HCA by the layer's kind), the MLP
kiln.host.model.clipped_experts (hash-routed or top-k). Layers are not unrolled: each run of layers of one
kind (kiln.core.contract.layer_runs: same attention kind and routing, so the same tensors) is one scan over
its stacked tensors, as kiln.host.model.decoder scans every other family's, so the code compiled per run does
not grow with its depth. Constant names are the checkpoint's, as kiln.core.contract states them.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.core.config import ModelConfig
from kiln.core.contract import layer_runs
from kiln.host.model.clipped_experts import experts
from kiln.host.model.compressed_attention import attention, rms_norm32
from kiln.host.model.decoder import Holder, LayerRun
from kiln.host.model.hyper_connections import expand, hyper_head, mix_weights
from kiln.core.v4_fields import HASH_MOE


def layer(cfg: ModelConfig, tp: int, kind: tuple[str, str], p: dict[str, torch.Tensor], streams: torch.Tensor,
          tokens: torch.Tensor) -> torch.Tensor:
    """One decoder layer of kind (attention kind, routing) on streams [b, t, hc_mult, hidden]."""
    eps = cfg.rms_norm_eps
    post, comb, x = mix_weights(cfg, p["hc_attn_fn"], p["hc_attn_base"], p["hc_attn_scale"], streams)
    streams = expand(post, comb, attention(cfg, tp, kind[0], p, rms_norm32(x, p["attn_norm.weight"], eps)), streams)
    post, comb, x = mix_weights(cfg, p["hc_ffn_fn"], p["hc_ffn_base"], p["hc_ffn_scale"], streams)
    routed = experts(cfg, tp, p, rms_norm32(x, p["ffn_norm.weight"], eps), tokens if kind[1] == HASH_MOE else None)
    return expand(post, comb, routed, streams)


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


class DeepseekV4Decoder(nn.Module):
    """One tensor-parallel rank of DeepSeek-V4: forward(tokens [b, t]) -> logits [b, t, vocab] of the prompt
    fed from position 0. `scan=False` unrolls the runs in Python; both compute the same."""

    def __init__(self, cfg: ModelConfig, tp: int = 1, *, scan: bool = True):
        super().__init__()
        cfg.check_tp(tp)
        self.cfg, self.tp, self.scan = cfg, tp, scan
        self.model = Inner(cfg, tp)
        if not cfg.tie_word_embeddings:
            self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        x = self.model.embed_tokens(tokens)
        streams = x.unsqueeze(2).expand(-1, -1, cfg.v4.hc_mult, -1).contiguous()
        for run in self.model.runs:
            streams = self._run(run, streams, tokens)
        hc = self.model.hc_head
        x = rms_norm32(hyper_head(cfg, hc.hc_fn, hc.hc_base, hc.hc_scale, streams), self.model.norm.weight,
                       cfg.rms_norm_eps)
        return torch.nn.functional.linear(x, self.model.embed_tokens.weight if cfg.tie_word_embeddings
                                          else self.head.weight)

    def _run(self, run: LayerRun, streams: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        cfg, tp, kind = self.cfg, self.tp, self.cfg.v4.kind(run.start)
        stacked = run.stacked()
        if not self.scan:
            for i in range(run.stop - run.start):
                streams = layer(cfg, tp, kind, {n: w[i] for n, w in stacked.items()}, streams, tokens)
            return streams
        from torch._higher_order_ops.scan import scan

        def body(carry, weights):
            out = layer(cfg, tp, kind, weights, carry, tokens)
            return out, out.new_zeros(())

        return scan(body, streams, stacked)[0]
