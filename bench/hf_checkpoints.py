"""Random-init checkpoints written by transformers' own classes (nothing downloaded), with every part live.

transformers' init leaves biases at 0, norms at 1 and DeepSeek-V4's table of hash-routed experts at 0: a
model that computes nothing with them cannot show that Kiln does. `randomise` draws them away from their
init; `randomise_v4` does the same for V4's sinks, position biases, hyper-connections and its table. The
test suite's checkpoints (tests/reference) and the bench's (bench.wrong_forwards, bench.check_draws) are
written through these.
"""

from __future__ import annotations

CSA, HCA, SLIDING = "compressed_sparse_attention", "heavily_compressed_attention", "sliding_attention"

V4_SMALL = dict(vocab_size=512, hidden_size=128, moe_intermediate_size=48, num_hidden_layers=6, num_attention_heads=4,
                head_dim=64, q_lora_rank=48, num_experts_per_tok=2, n_routed_experts=8, routed_scaling_factor=1.5,
                layer_types=[SLIDING, CSA, HCA, CSA, HCA, CSA], mlp_layer_types=["hash_moe"] * 2 + ["moe"] * 4,
                compress_rates={CSA: 4, HCA: 8}, hc_mult=3, hc_sinkhorn_iters=6, sliding_window=8, o_groups=2,
                o_lora_rank=32, index_n_heads=4, index_head_dim=32, index_topk=3, partial_rotary_factor=0.25,
                swiglu_limit=0.6, max_position_embeddings=256, initializer_range=0.1, compress_rope_theta=1000.0)
"""Layers of kinds (sliding, hash), (CSA, hash), then (HCA, top-k) and (CSA, top-k) in turn, as the published
schedule alternates them: the last four are one segment (kiln.core.model.layer_runs), a scan whose body runs an HCA
and a CSA layer. swiglu_limit low enough that these weights reach it; a compress rope base of its own."""


def randomise(model) -> None:
    """Biases (DeepSeek's routing correction too) ~ N(0, 0.1), norm weights ~ N(1, 0.1) and gpt-oss's sinks
    ~ N(0, 1), from the global generator, so they matter in every output."""
    import torch

    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith(".sinks"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("bias") or "norm" in name and name.endswith("weight"):
                p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))


def randomise_v4(model, experts: int, seed: int) -> None:
    """DeepSeek-V4's parts drawn live: each token's hash-routed experts distinct (tid2eid a real table), sinks,
    position biases, hyper-connection bases and the correction bias ~ N(0, 1), scales and norms ~ N(1, 0.3)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("tid2eid"):
                p.copy_(torch.stack([torch.randperm(experts, generator=gen)[:p.shape[1]] for _ in range(p.shape[0])]))
            elif name.endswith(("sinks", "position_bias", ".base", "hc_base", "e_score_correction_bias")):
                p.copy_(torch.randn(p.shape, generator=gen))
            elif name.endswith(("scale", "hc_scale")) or "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.3 * torch.randn(p.shape, generator=gen))
