"""A Llama-family decoder (Llama, Mistral, Qwen2) in plain torch, tensor-parallel over `tp` ranks.

It computes what transformers' LlamaForCausalLM, MistralForCausalLM and
Qwen2ForCausalLM compute for the configs kiln.core.hf_config accepts: rotary
scaling (linear, llama3), q/k/v, o and MLP biases, tied embeddings, sliding
windows, RMSNorm in float32. One rank's module holds its shard: heads/tp query
heads, kv_heads/tp KV heads and intermediate/tp MLP columns; embeddings, norms
and the output head are replicated. The cross-rank sum after the attention output and MLP down
projections is torch's native functional collective (`_c10d_functional.all_reduce` +
`wait_tensor`) on the process group named TP_GROUP: AOTInductor compiles it to a C
shim of libtorch, so a package needs neither Python nor Kiln to run, and since the
default world group has that name on every rank, one package serves every rank.
Compiling a shard, or running one with tp > 1, therefore needs that group to exist:
`solo_group` makes a one-rank group for a process that runs alone (a compile worker,
a per-rank check), whose sums are then its own partial sums.

The forward is one inference step over a paged KV cache:

    forward(tokens[B,T], start_pos[B], kv_cache[L,2,P,page_tokens,kvh,hd], block_table[B,M])
        -> (logits[B,T,vocab], new_kv[L,2,B,T,kvh,hd])

P (the page count) is dynamic, so a new KV plan reuses compiled forwards.
Sequence b's first start_pos[b] tokens of context live in the pages
block_table[b]; the step returns the new tokens' rotated keys and values for
the caller to write into the cache.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.config import ModelConfig
from kiln.core.contract import PROCESS_GROUP as TP_GROUP
from kiln.core.contract import parameter_shapes, shard_slice


@contextlib.contextmanager
def solo_group():
    """A one-rank gloo world (group TP_GROUP) for the duration, unless this process already has one."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def host_group():
    """A gloo group of every rank for the caller's own collectives, apart from TP_GROUP.

    The default world group belongs to the packages' collectives. Measured with
    torch 2.13 CPU and gloo: a Python broadcast or all_gather on that group between
    two calls of a package can leave the next call's all_reduce waiting forever
    (within a few steps); the same collectives on a group of their own never did.
    Call it on every rank, in the same order, after init_process_group.
    """
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel group TP_GROUP (native ops: no Python inside a compiled package)."""
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", TP_GROUP))


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as transformers does (it matters in bfloat16)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Rotary inverse frequencies (float32, head_dim/2), computed as transformers computes them.

    Computed inside the graph from the config, never a buffer: Inductor inlines
    only tiny constants, so a buffer would become a package constant that no
    checkpoint provides.
    """
    exponent = torch.arange(0, cfg.head_dim, 2, dtype=torch.int64, device=device).to(torch.float32) / cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** exponent)
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        factor, old_len = cfg.rope_factor, cfg.rope_original_max_position
        low_wavelen = old_len / cfg.rope_low_freq_factor
        high_wavelen = old_len / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    return inv_freq


def _linear_then_reduce(x: torch.Tensor, proj: nn.Linear, tp: int) -> torch.Tensor:
    """A row-parallel projection: partial products summed over the ranks, then the bias added once."""
    out = F.linear(x, proj.weight)
    if tp > 1:  # an unsharded model never reduces, even inside a process group (the reference check runs one)
        out = all_reduce(out)
    return out if proj.bias is None else out + proj.bias


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, window: int | None):
        super().__init__()
        self.tp = tp
        self.window = window
        self.num_heads = cfg.num_heads // tp
        self.num_kv_heads = cfg.num_kv_heads // tp
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * cfg.head_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_bias)

    def forward(self, x, cos, sin, past_k, past_v, mask):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        keys = torch.cat((past_k, k), dim=1)
        values = torch.cat((past_v, v), dim=1)
        groups = self.num_heads // self.num_kv_heads
        keys = keys.repeat_interleave(groups, dim=2).transpose(1, 2)
        values = values.repeat_interleave(groups, dim=2).transpose(1, 2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask[:, None])
        return _linear_then_reduce(out.transpose(1, 2).reshape(b, t, -1), self.o_proj, self.tp), k, v


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int):
        super().__init__()
        self.tp = tp
        width = cfg.intermediate_size // tp
        self.gate_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(cfg.hidden_size, width, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(width, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x):
        return _linear_then_reduce(F.silu(self.gate_proj(x)) * self.up_proj(x), self.down_proj, self.tp)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int, layer: int):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, tp, cfg.window_of(layer))
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg, tp)


class Inner(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, tp, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class ShardedDecoder(nn.Module):
    """One tensor-parallel rank of the decoder; parameter names follow Hugging Face Llama.

    With tied embeddings there is no lm_head: the output head reads the
    embedding matrix, so the package asks for one tensor, not two copies.
    """

    def __init__(self, cfg: ModelConfig, tp: int = 1):
        super().__init__()
        cfg.check_tp(tp)
        self.cfg = cfg
        self.tp = tp
        self.model = Inner(cfg, tp)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, tokens, start_pos, kv_cache, block_table):
        b, t = tokens.shape
        num_pages_per_seq = block_table.shape[1]
        page_tokens = kv_cache.shape[3]
        ctx = num_pages_per_seq * page_tokens
        positions = start_pos[:, None] + torch.arange(t, device=tokens.device)[None]
        freqs = positions[..., None].to(torch.float32) * rope_inv_freq(self.cfg, tokens.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        cos, sin = emb.cos().to(kv_cache.dtype), emb.sin().to(kv_cache.dtype)
        # Query i sits at position start+i; cached key j at position j (valid below start); new key i at start+i.
        key_pos = torch.cat((torch.arange(ctx, device=tokens.device)[None].expand(b, ctx), positions), dim=1)
        key_ok = torch.cat((torch.arange(ctx, device=tokens.device)[None] < start_pos[:, None],
                            torch.ones(b, t, dtype=torch.bool, device=tokens.device)), dim=1)
        distance = positions[:, :, None] - key_pos[:, None, :]  # [b, t, ctx + t]
        causal = key_ok[:, None, :] & (distance >= 0)
        windowed = {w: causal & (distance < w) for w in {layer.self_attn.window for layer in self.model.layers}
                    if w is not None}
        x = self.model.embed_tokens(tokens)
        new_k, new_v = [], []
        for i, layer in enumerate(self.model.layers):
            past_k = kv_cache[i, 0][block_table].reshape(b, ctx, kv_cache.shape[4], kv_cache.shape[5])
            past_v = kv_cache[i, 1][block_table].reshape(b, ctx, kv_cache.shape[4], kv_cache.shape[5])
            mask = causal if layer.self_attn.window is None else windowed[layer.self_attn.window]
            h, k, v = layer.self_attn(layer.input_layernorm(x), cos, sin, past_k, past_v, mask)
            x = x + h
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            new_k.append(k)
            new_v.append(v)
        x = self.model.norm(x)
        logits = F.linear(x, self.model.embed_tokens.weight) if self.cfg.tie_word_embeddings else self.lm_head(x)
        new_kv = torch.stack((torch.stack(new_k), torch.stack(new_v)), dim=1)
        return logits, new_kv


def shard_state_dict(full: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """Slice a full (unsharded) Hugging Face Llama state dict down to one rank's shard."""
    cfg.check_tp(tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside tp {tp}")
    out = {}
    for name, tensor in full.items():
        cut = shard_slice(name, cfg, tp, rank)
        out[name] = tensor if cut is None else tensor.narrow(cut[0], cut[1], cut[2] - cut[1]).contiguous()
    return out


def expected_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the unsharded model with its shape, as a checkpoint must hold it (kiln.core.contract's
    statement of the layout, which a unit test holds to this module's own state dict)."""
    return parameter_shapes(cfg)


def random_state_dict(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random full weights with a sensible scale (for test checkpoints and the tiny model)."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)
    out = {}
    for name, shape in expected_shapes(cfg).items():
        if name.endswith("norm.weight"):
            out[name] = torch.ones(shape, dtype=dtype)
        else:
            out[name] = (torch.randn(shape, generator=gen) * shape[-1] ** -0.5).to(dtype)
    return out


def example_inputs(cfg: ModelConfig, tp: int, batch: int, tokens: int, *, page_tokens: int,
                   pages_per_seq: int, num_pages: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Inputs of one rank for a (batch, tokens) bucket; the cache holds random context."""
    gen = torch.Generator().manual_seed(seed)
    dtype = getattr(torch, cfg.dtype)
    kvh = cfg.num_kv_heads // tp
    tok = torch.randint(0, cfg.vocab_size, (batch, tokens), generator=gen)
    max_start = pages_per_seq * page_tokens
    start = torch.randint(0, max_start + 1, (batch,), generator=gen)
    cache = torch.randn(cfg.num_layers, 2, num_pages, page_tokens, kvh, cfg.head_dim, generator=gen).to(dtype)
    table = torch.randint(0, num_pages, (batch, pages_per_seq), generator=gen)
    return tok, start, cache, table
