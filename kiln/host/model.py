"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE, Gemma 2 and 3, Phi-3) in
plain torch, tensor-parallel.

It computes what transformers' LlamaForCausalLM, MistralForCausalLM,
Qwen2ForCausalLM, Qwen3ForCausalLM, MixtralForCausalLM, Qwen2MoeForCausalLM,
Qwen3MoeForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM and Phi3ForCausalLM compute for the configs
kiln.core.hf_config accepts: rotary scaling (linear, llama3, yarn), q/k/v, o and MLP
biases, per-head q/k norms, tied embeddings, sliding windows (on some layers,
interleaved or from one layer on), RMSNorm in float32 (Gemma's (1 + weight)
kind too, and its norms around attention and MLP), GeGLU, soft-capped scores
and logits, a rotary base of the sliding layers' own, mixtures of experts
(top-k routing; each expert's intermediate columns split over the ranks like
the dense MLP's; Qwen2-MoE's gated shared expert), a partial rotary (Phi-3;
its fused qkv_proj and gate_up_proj are cut into the same q/k/v and gate/up
constants as the others', kiln.core.contract.FUSED). One rank's module holds
its shard: heads/tp query heads, kv_heads/tp KV heads and intermediate/tp MLP
columns; embeddings, norms and the output head are replicated. The cross-rank
sum after the attention output and MLP down projections is torch's native
functional collective (`_c10d_functional.all_reduce` + `wait_tensor`) on the
process group named TP_GROUP: AOTInductor compiles it to a C
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

The layers are not unrolled: each run of same-shaped layers (kiln.core.contract.layer_runs)
is one `torch._higher_order_ops.scan` over its tensors stacked along a leading layer
dimension, the cache's layer slices and each layer's window, so AOTInductor compiles
one layer body per run and a bucket's compile time does not grow with depth. The
step's new keys and values are the scan's stacked outputs.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.core.config import ModelConfig
from kiln.core.contract import PROCESS_GROUP as TP_GROUP
from kiln.core.contract import (EXPERTS, RUN_PREFIX, constant_shapes, is_expert, layer_runs, parameter_shapes,
                                 rank_reads)


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
    """RMSNorm of one replicated weight (see _rms_norm)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _rms_norm(x, self.weight, self.eps, self.unit_offset)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rope_inv_freq(cfg: ModelConfig, device=None) -> torch.Tensor:
    """Rotary inverse frequencies (float32, head_dim/2), computed as transformers computes them.

    Computed inside the graph from the config, never a buffer: Inductor inlines
    only tiny constants, so a buffer would become a package constant that no
    checkpoint provides.
    """
    dim = cfg.rotated_dims  # Phi-3's partial rotary: only the leading rotary_dim dims of a head turn
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
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
    elif cfg.rope_type == "yarn":  # transformers' _compute_yarn_parameters, op for op
        low, high = yarn_correction_range(cfg)
        pos_freqs = cfg.rope_theta ** (torch.arange(0, dim, 2, device=device).to(torch.float32) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (cfg.rope_factor * pos_freqs)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
        keep = 1 - ramp
        inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq


def yarn_correction_range(cfg: ModelConfig) -> tuple[float, float]:
    """yarn's ramp between the dims that keep their frequency and the interpolated ones, as transformers
    bounds it (its beta_fast and beta_slow rotations over the original context; whole dims when truncated)."""
    dim, base, old_len = cfg.rotated_dims, cfg.rope_theta, cfg.rope_original_max_position

    def dim_of(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(cfg.rope_beta_fast), dim_of(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    return low, (high + 0.001 if low == high else high)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x's leading cos.shape[-1] dims; the rest pass through (a partial rotary)."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :dim], x[..., dim:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)


def _linear_then_reduce(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: int) -> torch.Tensor:
    """A row-parallel projection: partial products summed over the ranks, then the bias added once."""
    out = F.linear(x, weight)
    if tp > 1:  # an unsharded model never reduces, even inside a process group (the reference check runs one)
        out = all_reduce(out)
    return out if bias is None else out + bias


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as transformers does (it matters in bfloat16): scaled by
    `weight` after the cast (Llama), or with `unit_offset` by (1 + weight) before it (Gemma)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.to(torch.float32))).to(x.dtype)
    return weight * h.to(x.dtype)


def _softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's soft capping of attention scores and logits); x itself for None."""
    return x if cap is None else torch.tanh(x / cap) * cap


def _attention(cfg: ModelConfig, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """Softmax attention [b, heads, t, hd] of q over keys/values where `mask` [b, 1, t, keys] allows.

    Scaled by query_pre_attn_scalar ** -0.5 when the config gives one (else head_dim ** -0.5). Soft-capped
    scores (Gemma 2) are computed as transformers' eager attention does: scores, cap, mask, a float32 softmax
    cast back, then the values; otherwise torch's fused attention."""
    scale = None if cfg.query_pre_attn_scalar is None else cfg.query_pre_attn_scalar ** -0.5
    if cfg.attn_softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    scores = _softcap(torch.matmul(q, keys.transpose(2, 3)) * (scale or cfg.head_dim ** -0.5), cfg.attn_softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), values)


@dataclass(frozen=True)
class StepContext:
    """What every layer of one step shares: rotary tables, masks and the pages to gather."""

    cos: torch.Tensor
    sin: torch.Tensor
    local_cos: torch.Tensor | None
    """Sliding layers' rotary tables when they have a base of their own (Gemma 3's local_rope_theta)."""
    local_sin: torch.Tensor | None
    causal: torch.Tensor
    """[b, t, ctx + t] bool: key j is a valid, earlier-or-same position for query i."""
    distance: torch.Tensor | None
    """[b, t, ctx + t]: query position minus key position; None when no layer has a window."""
    block_table: torch.Tensor


def decoder_layer(cfg: ModelConfig, tp: int, p: dict[str, torch.Tensor], x: torch.Tensor, kv: torch.Tensor,
                  window: torch.Tensor | None, ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One decoder layer of one rank: (x after the layer, this step's rotated keys, its values).

    `p` holds the layer's tensors by their checkpoint suffix (`self_attn.q_proj.weight`, ...), `kv` the
    layer's cache [2, pages, page_tokens, kv_heads/tp, head_dim], `window` a 0-d window (tokens a query
    may look back, itself included) or None.
    """
    b, t, _ = x.shape
    heads, kv_heads, hd = cfg.num_heads // tp, cfg.num_kv_heads // tp, cfg.head_dim

    def norm(name: str, y: torch.Tensor) -> torch.Tensor:
        return _rms_norm(y, p[name], cfg.rms_norm_eps, cfg.norm_unit_offset)

    h = norm("input_layernorm.weight", x)
    q = F.linear(h, p["self_attn.q_proj.weight"], p.get("self_attn.q_proj.bias")).view(b, t, heads, hd)
    k = F.linear(h, p["self_attn.k_proj.weight"], p.get("self_attn.k_proj.bias")).view(b, t, kv_heads, hd)
    v = F.linear(h, p["self_attn.v_proj.weight"], p.get("self_attn.v_proj.bias")).view(b, t, kv_heads, hd)
    if cfg.qk_norm:  # Qwen3, Gemma 3: every head normalised over head_dim, before the rotary embedding
        q = norm("self_attn.q_norm.weight", q)
        k = norm("self_attn.k_norm.weight", k)
    cos, sin = ctx.cos, ctx.sin
    if ctx.local_cos is not None and window is not None:  # Gemma 3: a sliding layer rotates at its own base
        cos, sin = (torch.where(window < FULL_ATTENTION, local, full)
                    for local, full in ((ctx.local_cos, cos), (ctx.local_sin, sin)))
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    num_ctx = ctx.block_table.shape[1] * kv.shape[2]
    past_k = kv[0][ctx.block_table].reshape(b, num_ctx, kv_heads, hd)
    past_v = kv[1][ctx.block_table].reshape(b, num_ctx, kv_heads, hd)
    keys = torch.cat((past_k, k), dim=1).repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2)
    values = torch.cat((past_v, v), dim=1).repeat_interleave(heads // kv_heads, dim=2).transpose(1, 2)
    mask = ctx.causal if window is None else ctx.causal & (ctx.distance < window)
    out = _attention(cfg, q.transpose(1, 2), keys, values, mask[:, None])
    attended = _linear_then_reduce(out.transpose(1, 2).reshape(b, t, -1), p["self_attn.o_proj.weight"],
                                   p.get("self_attn.o_proj.bias"), tp)
    if cfg.sandwich_norms:  # Gemma: the attention's output normalised before the residual add, the MLP's too
        x = x + norm("post_attention_layernorm.weight", attended)
        h = norm("pre_feedforward_layernorm.weight", x)
    else:
        x = x + attended
        h = norm("post_attention_layernorm.weight", x)
    if cfg.moe_layers and f"{EXPERTS[cfg.architecture][0]}.gate.weight" in p:
        return x + mixture_of_experts(cfg, tp, p, h), k, v
    gate = F.linear(h, p["mlp.gate_proj.weight"], p.get("mlp.gate_proj.bias"))
    up = F.linear(h, p["mlp.up_proj.weight"], p.get("mlp.up_proj.bias"))
    act = F.silu(gate) if cfg.activation == "silu" else F.gelu(gate, approximate="tanh")
    mlp = _linear_then_reduce(act * up, p["mlp.down_proj.weight"], p.get("mlp.down_proj.bias"), tp)
    if cfg.sandwich_norms:
        mlp = norm("post_feedforward_layernorm.weight", mlp)
    return x + mlp, k, v


FULL_ATTENTION = 1 << 62
"""The window of a full-attention layer among sliding ones: no distance reaches it."""

GATHER_BELOW = 3
"""A step gathers its chosen experts when GATHER_BELOW x its (token, expert) pairs are at most the experts."""


def mixture_of_experts(cfg: ModelConfig, tp: int, p: dict[str, torch.Tensor], h: torch.Tensor) -> torch.Tensor:
    """One rank's share of a mixture-of-experts MLP, summed over the ranks: [b, t, hidden].

    The router (replicated) takes the softmax over the experts in float32 and keeps the top k, renormalised
    when `norm_topk_prob`; each expert is a SwiGLU MLP whose intermediate columns are split over the ranks,
    so a rank's weighted sum of its experts' partial down projections is summed once over the ranks
    (with Qwen2-MoE's shared expert, split the same way, its partial output weighted by the replicated sigmoid
    gate joins that sum).
    The compute follows the chosen experts: when a step routes few (token, expert) pairs against the
    experts (GATHER_BELOW; decode), only the chosen experts' weights are gathered and multiplied; otherwise
    (prefill) every expert runs over every token, weighted by its routing weight or 0: a gathered expert's
    weights are read, copied and read again, so for that many pairs reading every expert once costs less.
    The choice is made per bucket when the graph is traced (its shapes are static).
    """
    module, names = EXPERTS[cfg.architecture]
    gate_w, up_w, down_w = (p[f"{module}.experts.{n}.weight"] for n in names)  # [E, I/tp, H], [E, I/tp, H], [E, H, I/tp]
    b, t, hidden = h.shape
    x = h.reshape(b * t, hidden)
    probs = torch.softmax(F.linear(x, p[f"{module}.gate.weight"]).to(torch.float32), dim=-1)
    weights, chosen = torch.topk(probs, cfg.experts_per_token, dim=-1)  # [n, k]
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if cfg.architecture in ("qwen2_moe", "qwen3_moe"):  # Qwen's MoEs weigh in the model's dtype, Mixtral in float32
        weights = weights.to(h.dtype)
    n, k = chosen.shape
    if GATHER_BELOW * n * k <= cfg.num_experts:
        flat = chosen.reshape(-1)
        rows = x.repeat_interleave(k, dim=0)[:, None, :]  # [n*k, 1, H]
        act = F.silu(torch.bmm(rows, gate_w[flat].transpose(1, 2))) * torch.bmm(rows, up_w[flat].transpose(1, 2))
        out = torch.bmm(act, down_w[flat].transpose(1, 2)).reshape(n, k, hidden)  # [n, k, H]
        mixed = (out * weights[..., None]).to(h.dtype).sum(dim=1)
    else:
        act = F.silu(torch.einsum("nh,eih->nei", x, gate_w)) * torch.einsum("nh,eih->nei", x, up_w)
        out = torch.einsum("nei,ehi->neh", act, down_w)  # [n, E, H]
        dense = torch.zeros(n, cfg.num_experts, dtype=weights.dtype, device=x.device).scatter(1, chosen, weights)
        mixed = (out * dense[..., None]).to(h.dtype).sum(dim=1)
    if cfg.shared_expert_intermediate_size:  # Qwen2-MoE: every token also runs the shared expert, gated
        shared = F.silu(F.linear(x, p[f"{module}.shared_expert.gate_proj.weight"])) * F.linear(
            x, p[f"{module}.shared_expert.up_proj.weight"])
        shared = F.linear(shared, p[f"{module}.shared_expert.down_proj.weight"])  # this rank's partial sum
        mixed = mixed + torch.sigmoid(F.linear(x, p[f"{module}.shared_expert_gate.weight"])) * shared
    if tp > 1:
        mixed = all_reduce(mixed)
    return mixed.reshape(b, t, hidden)


class Holder(nn.Module):
    """A bare container, so stacked tensors keep their checkpoint suffix as their module path."""


def _initial(suffix: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A stacked parameter's initial value, from the global generator as nn.Linear's would be (norms start at
    one, everything else at random with a 1/sqrt(fan-in) scale): a model built without weights computes
    something, so comparing two forwards of it shows something. Free on the meta device."""
    if suffix.endswith("norm.weight"):
        return torch.ones(shape)
    return torch.randn(shape) * shape[-1] ** -0.5


class LayerRun(nn.Module):
    """Run `index` of same-shaped decoder layers of one rank, each tensor stacked along a leading layer dimension.

    Its state dict names are the checkpoint suffixes (`self_attn.q_proj.weight`, shape [layers, ...]), so
    the package constant `model.runs.<index>.<suffix>` stacks the checkpoint tensors `model.layers.<i>.<suffix>`.
    """

    def __init__(self, cfg: ModelConfig, tp: int, index: int):
        super().__init__()
        self.start, self.stop = layer_runs(cfg)[index]
        prefix = f"{RUN_PREFIX}{index}."
        shapes = constant_shapes(cfg, tp)
        self.suffixes = [n.removeprefix(prefix) for n in shapes if n.startswith(prefix)]
        for suffix in self.suffixes:
            owner = self
            *path, leaf = suffix.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, Holder())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, nn.Parameter(_initial(suffix, shapes[prefix + suffix])))

    def stacked(self) -> dict[str, torch.Tensor]:
        """suffix -> the stacked tensor [layers, ...]; experts' projections, stacked layers x experts along
        one dimension, viewed as [layers, experts, ...]."""
        out = {}
        for suffix in self.suffixes:
            w = self.get_parameter(suffix)
            out[suffix] = w.view(self.stop - self.start, -1, *w.shape[1:]) if is_expert(suffix) else w
        return out


class Inner(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.runs = nn.ModuleList(LayerRun(cfg, tp, j) for j in range(len(layer_runs(cfg))))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_unit_offset)


class ShardedDecoder(nn.Module):
    """One tensor-parallel rank of the decoder; constant names as kiln.core.contract states them.

    Each run of layers is one `scan` over its stacked tensors, the KV cache's layer slices and each layer's
    window, so the compiled graph holds one layer body per run whatever the depth. `scan=False` unrolls the
    same layers in Python (the eager reference and the depth bench's comparison); both compute the same.
    With tied embeddings there is no lm_head: the output head reads the embedding matrix, so the package
    asks for one tensor, not two copies.
    """

    def __init__(self, cfg: ModelConfig, tp: int = 1, *, scan: bool = True):
        super().__init__()
        cfg.check_tp(tp)
        self.cfg = cfg
        self.tp = tp
        self.scan = scan
        self.model = Inner(cfg, tp)
        # A Python float (no tensor in the graph): sqrt(hidden) as the model's dtype holds it.
        self.embed_multiplier = torch.tensor(cfg.hidden_size ** 0.5, dtype=getattr(torch, cfg.dtype),
                                             device="cpu").item()
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def _windows(self, device) -> torch.Tensor | None:
        """[layers] int64: each layer's window, FULL_ATTENTION (a value no distance reaches) on full-attention
        layers; None when no layer has a window. Computed in the graph (a buffer would become a package
        constant)."""
        cfg = self.cfg
        if all(cfg.window_of(i) is None for i in range(cfg.num_layers)):
            return None
        layer = torch.arange(cfg.num_layers, device=device)
        sliding = layer >= cfg.first_sliding_layer
        for i in cfg.full_attention_layers:
            sliding = sliding & (layer != i)
        return torch.where(sliding, cfg.sliding_window, FULL_ATTENTION)

    def forward(self, tokens, start_pos, kv_cache, block_table):
        b, t = tokens.shape
        ctx_len = block_table.shape[1] * kv_cache.shape[3]
        positions = start_pos[:, None] + torch.arange(t, device=tokens.device)[None]
        freqs = positions[..., None].to(torch.float32) * rope_inv_freq(self.cfg, tokens.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        local = None
        if self.cfg.local_rope_theta is not None:
            plain = self.cfg.replace(rope_theta=self.cfg.local_rope_theta, rope_type="default")
            local_freqs = positions[..., None].to(torch.float32) * rope_inv_freq(plain, tokens.device)
            local = torch.cat((local_freqs, local_freqs), dim=-1)[:, :, None, :]
        # Query i sits at position start+i; cached key j at position j (valid below start); new key i at start+i.
        key_pos = torch.cat((torch.arange(ctx_len, device=tokens.device)[None].expand(b, ctx_len), positions), dim=1)
        key_ok = torch.cat((torch.arange(ctx_len, device=tokens.device)[None] < start_pos[:, None],
                            torch.ones(b, t, dtype=torch.bool, device=tokens.device)), dim=1)
        distance = positions[:, :, None] - key_pos[:, None, :]  # [b, t, ctx + t]
        windows = self._windows(tokens.device)
        cos, sin = emb.cos(), emb.sin()
        if self.cfg.rope_attention_factor != 1.0:  # yarn's: cos and sin scaled before the cast, as transformers does
            cos, sin = cos * self.cfg.rope_attention_factor, sin * self.cfg.rope_attention_factor
        ctx = StepContext(cos=cos.to(kv_cache.dtype), sin=sin.to(kv_cache.dtype),
                          local_cos=None if local is None else local.cos().to(kv_cache.dtype),
                          local_sin=None if local is None else local.sin().to(kv_cache.dtype),
                          causal=key_ok[:, None, :] & (distance >= 0),
                          distance=None if windows is None else distance, block_table=block_table)
        x = self.model.embed_tokens(tokens)
        if self.cfg.embed_scale:  # Gemma: sqrt(hidden), rounded to the dtype first as transformers does
            x = x * self.embed_multiplier
        new_k, new_v = [], []
        for run in self.model.runs:
            x, k, v = self._run(run, x, kv_cache[run.start:run.stop],
                                None if windows is None else windows[run.start:run.stop], ctx)
            new_k.append(k)
            new_v.append(v)
        x = self.model.norm(x)
        logits = F.linear(x, self.model.embed_tokens.weight) if self.cfg.tie_word_embeddings else self.lm_head(x)
        logits = _softcap(logits, self.cfg.final_softcap)
        new_kv = torch.stack((torch.cat(new_k), torch.cat(new_v)), dim=1)
        return logits, new_kv

    def _run(self, run: LayerRun, x, kv, windows, ctx: StepContext):
        """One run of layers: (x after them, keys [layers, b, t, kvh, hd], values likewise)."""
        cfg, tp = self.cfg, self.tp
        stacked = run.stacked()
        if not self.scan:
            ks, vs = [], []
            for i in range(run.stop - run.start):
                x, k, v = decoder_layer(cfg, tp, {n: w[i] for n, w in stacked.items()}, x, kv[i],
                                        None if windows is None else windows[i], ctx)
                ks.append(k)
                vs.append(v)
            return x, torch.stack(ks), torch.stack(vs)
        from torch._higher_order_ops.scan import scan

        def body(carry, layer):
            out, k, v = decoder_layer(cfg, tp, layer["weights"], carry, layer["kv"], layer.get("window"), ctx)
            return out, (k, v)

        xs = {"weights": stacked, "kv": kv} if windows is None else {"weights": stacked, "kv": kv, "window": windows}
        x, (ks, vs) = scan(body, x, xs)
        return x, ks, vs


def rank_constants(cfg: ModelConfig, tp: int, rank: int,
                   read_into: Callable[[str, tuple | None, torch.Tensor], None],
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every package constant of `rank` in `dtype`, each allocated once and filled by
    `read_into(checkpoint_name, cut, out)`, which writes that tensor (cut to (dim, start, stop) when `cut`
    is not None) into `out`: a stacked constant's sources go straight into its layer slices, so building
    the constants never holds a second copy of the rank's weights."""
    cfg.check_tp(tp)
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside tp {tp}")
    out = {}
    reads = rank_reads(cfg, tp, rank)
    for name, shape in constant_shapes(cfg, tp).items():
        constant = torch.empty(shape, dtype=dtype)
        sources = reads[name]
        for i, (source, cut) in enumerate(sources):
            read_into(source, cut, constant if sources == [(name, cut)] else constant[i])
        out[name] = constant
    return out


def shard_state_dict(full: dict[str, torch.Tensor], cfg: ModelConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """One rank's package constants from a full (unsharded) Hugging Face state dict, in its dtype."""
    def read_into(name: str, cut: tuple | None, out: torch.Tensor) -> None:
        tensor = full[name]
        out.copy_(tensor if cut is None else tensor.narrow(cut[0], cut[1], cut[2] - cut[1]))

    return rank_constants(cfg, tp, rank, read_into, full["model.embed_tokens.weight"].dtype)


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
