"""Kiln's model against transformers' own classes, in eager mode (no compilation): every supported case.

Each case is written by transformers (`save_pretrained`) and read back by
Kiln's checkpoint reader, so the config mapping, the weight names and the math
are checked together. A case that adds a feature also shows that the feature
matters: the same weights computed without it differ from the reference.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import CASES, CLASSES, TEXT_OF, transformers, write_case

from kiln.core.model.cache_layout import cache_layout
from kiln.core.model.dsa_fields import DsaFields
from kiln.core.model.layer_runs import layer_runs
from kiln.host.weights.checkpoint import inspect_checkpoint, load_rank_weights
from kiln.host.model import ShardedDecoder

FEATURE_OFF = {
    # case: the ModelConfig fields that turn its feature off
    "llama3-rope": {"rope_type": "default"},
    "llama-linear-rope": {"rope_type": "default"},
    "llama-theta": {"rope_theta": 10000.0},
    "qwen2-yarn": {"rope_type": "default", "rope_attention_factor": 1.0},
    "llama-yarn-mscale": {"rope_attention_factor": 1.0},
    "llama-attention-bias": {"qkv_bias": False, "o_bias": False},
    "llama-mlp-bias": {"mlp_bias": False},
    "mistral-window": {"sliding_window": None},
    "qwen2": {"qkv_bias": False},
    "qwen2-window": {"sliding_window": None, "first_sliding_layer": 0},
    "qwen3": {"qk_norm": False},
    "qwen3-bias-window": {"sliding_window": None, "first_sliding_layer": 0},
    "mixtral": {"norm_topk_prob": False},
    "mixtral-window": {"sliding_window": None},
    "qwen3-moe": {"norm_topk_prob": False},
    "qwen3-moe-step": {"experts_per_token": 1},
    "qwen2-moe": {"shared_expert_intermediate_size": 0},
    "qwen2-moe-window-yarn": {"sliding_window": None, "first_sliding_layer": 0},
    "gemma2": {"attn_softcap": None, "final_softcap": None},
    "gemma3": {"local_rope_theta": None},
    "phi3": {"rotary_dim": None},
    "phi3-longrope": {"rope_long_factor": tuple(1.0 + 0.05 * i for i in range(24))},  # the short factors throughout
    "llama-dynamic": {"rope_max_position": 64},  # 20 tokens stay below it: the base never grows
    "deepseek-v3": {"topk_groups": 4},  # every group open: the top 3 of all 16 experts
    "deepseek-v3-yarn": {"attn_scale_multiplier": 1.0},
    "deepseek-v3-bf16": {"rope_interleave": False},
    "gpt-oss": {"swiglu_limit": 1e4},
    "minimax-m2": {"rotary_dim": None},
    "mistral4": {"query_scale_beta": 0.0},
    "llama4": {"attention_chunk_size": None},
    "llama4-bf16": {"temperature_floor": 0},
    "deepseek-v32": {"dsa": DsaFields(8, 48, 32, False)},  # every token kept: dense latent attention
    "glm5": {"dsa": DsaFields(8, 48, 4, False)},  # the indexer's pairs turned as halves
    "gpt-oss-bf16": {"sliding_window": None, "full_attention_layers": ()},
}


def kiln_logits(cfg, weights, tokens, scan=False):
    """Kiln's logits: scanned (the compiled forward's structure; dynamo traces it, 1-4 s per model) in each
    case's comparison with transformers, unrolled (the same layers, nothing traced) where a test turns a
    feature off or switches an order of the math."""
    model = ShardedDecoder(cfg, 1, scan=scan).to(getattr(torch, cfg.dtype)).eval()
    model.load_state_dict({k: v for k, v in weights.items() if k in model.state_dict()}, strict=True)
    pages = -(-tokens.shape[1] // 16)
    cache = torch.zeros(cache_layout(cfg, 1).shape(cfg.num_layers, pages + 1, 16), dtype=getattr(torch, cfg.dtype))
    lengths = [torch.tensor([tokens.shape[1]])] if cfg.length_dependent_rope else []  # one call: the whole sequence
    with torch.no_grad():
        logits = model(tokens, torch.tensor([0]), cache, torch.arange(pages)[None], *lengths)[0]
    return logits.float()


def reference_logits(path, family, dtype, tokens):
    model = getattr(transformers, CLASSES[family][1]).from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    with torch.no_grad():
        return model(tokens).logits.float()


@pytest.mark.parametrize("case", sorted(CASES))
def test_kiln_computes_what_transformers_computes(case, hf_root):
    family, _, dtype = CASES[case]
    path = write_case(case, hf_root)
    cfg = inspect_checkpoint(path)
    assert cfg.dtype == dtype and cfg.architecture == TEXT_OF.get(family, family)  # an image-text one: its decoder
    tokens = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    weights = load_rank_weights(path, cfg, 1, 0)
    got = kiln_logits(cfg, weights, tokens, scan=True)
    if dtype == "float32":
        want = reference_logits(path, family, "float32", tokens)
        assert float((got - want).abs().max()) < 1e-4
    else:  # both against transformers in float32 on the same weights: Kiln stays within transformers' own error
        exact = reference_logits(path, family, "float32", tokens)
        theirs = float((reference_logits(path, family, dtype, tokens) - exact).abs().max())
        ours = float((got - exact).abs().max())
        assert ours <= 2 * theirs, f"Kiln {dtype} is off by {ours:.2e}; transformers' own {dtype} by {theirs:.2e}"
    if case in FEATURE_OFF:
        without = kiln_logits(cfg.replace(**FEATURE_OFF[case]), weights, tokens)
        assert float((without - got).abs().max()) > 1e-2, f"{case}: the feature does not change these logits"


@pytest.mark.parametrize("case", ["mixtral", "qwen3-moe", "qwen2-moe", "deepseek-v3", "mistral4", "llama4"])
def test_each_way_of_computing_the_experts_computes_the_same(case, hf_root):
    """The ways a mixture-of-experts layer computes (kiln.host.model.mixture_of_experts): in float32 one
    token alone gathers its experts, the same token among many runs every expert over every token; in
    bfloat16 both run the grouped multiplies over the pairs sorted by expert, whose every pair matches its
    gathered expert's output (the same routing: float32 and bfloat16 may route a near tie apart)."""
    from kiln.core.model.contract import EXPERTS
    from kiln.core.model.fused_experts import input_major
    from kiln.host.model import GATHER_BELOW, mixture_of_experts
    from kiln.host.model.layers.moe import _gathered, _grouped, groups_trace, route

    path = write_case(case, hf_root)
    cfg = inspect_checkpoint(path)
    weights = load_rank_weights(path, cfg, 1, 0)
    run = next(j for j, layers in enumerate(layer_runs(cfg)) if cfg.is_moe(layers[0]))
    model = ShardedDecoder(cfg, 1).eval()
    model.load_state_dict({k: v for k, v in weights.items() if k in model.state_dict()}, strict=True)
    layer = {n: w[0] for n, w in model.model.runs[run].stacked().items()}
    half = {n: w.to(torch.bfloat16) for n, w in layer.items()}
    many = cfg.num_experts // cfg.experts_per_token + 1
    assert GATHER_BELOW * cfg.experts_per_token <= cfg.num_experts < many * cfg.experts_per_token
    h = torch.randn(1, many, cfg.hidden_size, generator=torch.Generator().manual_seed(3))
    module, names = EXPERTS[cfg.architecture]
    gate = f"{module}.experts.{names[0]}.weight"
    projections = [half[f"{module}.experts.{name}.weight"] for name in names]
    if input_major(cfg):  # Llama 4's [E, H, I]: the module reads them transposed
        projections = [w.transpose(1, 2) for w in projections]
    assert not groups_trace(h[0], projections[0].float()) and groups_trace(h[0].bfloat16(), projections[0])
    with torch.no_grad():
        alone = mixture_of_experts(cfg, 1, layer, h[:, :1])
        among = mixture_of_experts(cfg, 1, layer, h)
        weights, chosen = route(cfg, half, module, h[0].bfloat16())
        scale = weights if cfg.router == "sigmoid_input" else None  # Llama 4 scales each pair's token
        pairs = _grouped(h[0].bfloat16(), chosen, *projections, scale).float()
        gathered = _gathered(h[0].bfloat16(), chosen, *projections, scale).float()
        grouped_alone = mixture_of_experts(cfg, 1, half, h[:, :1].bfloat16()).float()
        grouped_among = mixture_of_experts(cfg, 1, half, h.bfloat16()).float()
    assert float(alone.abs().max()) > 1e-2
    assert float((alone - among[:, :1]).abs().max()) < 1e-5
    assert float((pairs - gathered).abs().max()) < 1e-2 * float(gathered.abs().max())
    assert float((grouped_alone - grouped_among[:, :1]).abs().max()) < 2e-2 * float(grouped_alone.abs().max())


def moved_by(case: str, hf_root, suffix: str, replace) -> float:
    """How far Kiln's logits of `case` (20 tokens) move when every package constant ending in `suffix` (there
    must be one) is replaced by `replace(tensor)`."""
    path = write_case(case, hf_root)
    cfg = inspect_checkpoint(path)
    weights = load_rank_weights(path, cfg, 1, 0)
    tokens = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    names = [name for name in weights if name.endswith(suffix)]
    assert names, f"{suffix} is a package constant of {case}"
    changed = {name: replace(w) if name in names else w for name, w in weights.items()}
    return float((kiln_logits(cfg, changed, tokens) - kiln_logits(cfg, weights, tokens)).abs().max())


def test_deepseek_routing_correction_matters(hf_root):
    """DeepSeek-V3's e_score_correction_bias changes which experts are chosen (not their weights): with it
    zeroed, Kiln's logits move (the reference case perturbs it, as a trained model's is not zero)."""
    assert moved_by("deepseek-v3", hf_root, "e_score_correction_bias", torch.zeros_like) > 1e-2


@pytest.mark.parametrize("case", ["deepseek-v3", "deepseek-v3-bf16", "mistral4"])
def test_latent_attention_absorbed_or_expanded_computes_what_transformers_computes(case, hf_root, monkeypatch):
    """Latent attention's two orders of the same math (kiln.host.model.layers.latent_attention.absorbs): each matches
    transformers (float32 within 1e-4; bfloat16 within twice transformers' own error). At DeepSeek-V3's own
    sizes a decode step at a long context takes the absorbed one, a long prefill the expanded one."""
    import kiln.host.model.layers.latent_attention as mla

    family, _, dtype = CASES[case]
    path = write_case(case, hf_root)
    cfg = inspect_checkpoint(path)
    weights = load_rank_weights(path, cfg, 1, 0)
    tokens = torch.randint(0, cfg.vocab_size, (1, 20), generator=torch.Generator().manual_seed(1))
    exact = reference_logits(path, family, "float32", tokens)
    limit = 1e-4 if dtype == "float32" else 2 * float((reference_logits(path, family, dtype, tokens) - exact)
                                                      .abs().max())
    for absorbed in (True, False):
        monkeypatch.setattr(mla, "absorbs", lambda *args, absorbed=absorbed: absorbed)
        diff = float((kiln_logits(cfg, weights, tokens) - exact).abs().max())
        assert diff <= limit, f"{'absorbed' if absorbed else 'expanded'}: {diff:.2e} > {limit:.2e}"
    monkeypatch.undo()
    v3 = cfg.replace(kv_lora_rank=512, head_dim=192, qk_rope_head_dim=64, v_head_dim=128)
    assert mla.absorbs(v3, 128, 1, 4096) and not mla.absorbs(v3, 128, 4096, 4096)
