"""Wrong forwards the check must catch, and right ones it must pass, for every mixture-of-experts family.

For Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3 and DeepSeek-V4, in float32 and bfloat16, a small checkpoint
written by transformers' own class (bench.hf_checkpoints), checked at a one-token step and every checked
shape of a range (kiln.core.forwards.shape_ranges: four corners, the hint, an interior shape): the right
forward (eager, reporting its choices as a compiled one does) must pass, and each of a fixed list of wrong
forwards (the eager model with one thing changed: its outputs and choices are what a compiled forward with
that bug would return) must fail, against the right model's reference (kiln.host.ranks.loader.
check_against_eager). Where a change does not apply to a family (a scaling factor it does not have, a
renormalisation it always makes, an indexer it has not) it is left out, and NOT_APPLICABLE says so.

`tests/reference/test_wrong_forwards.py` holds every one; the bench part `checks` reports the fraction
caught (`wrong_forwards_caught`). Usage: python -m bench.wrong_forwards OUT.json [--quick]
(--quick: two shapes, never fewer mutations).
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

FAMILIES = {
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_hidden_layers=3, num_local_experts=8,
                                                            num_experts_per_tok=2, intermediate_size=128)),
    "qwen2-moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
        shared_expert_intermediate_size=96, mlp_only_layers=[1])),
    "qwen3-moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        head_dim=64, num_hidden_layers=3, num_experts=16, num_experts_per_tok=2, moe_intermediate_size=32,
        mlp_only_layers=[1], norm_topk_prob=True)),
    "deepseek-v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", dict(
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=48, kv_lora_rank=64,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, moe_intermediate_size=32, n_routed_experts=16,
        n_group=4, topk_group=2, num_experts_per_tok=3, n_shared_experts=1, first_k_dense_replace=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True)),
    "deepseek-v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", None),  # bench.hf_checkpoints.V4_SMALL
}
"""family -> (transformers config class, model class, config over BASE; None: V4_SMALL as it is)."""
BASE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1)
DTYPES = ("float32", "bfloat16")
RANGE = "2-4x2-9@3x8"
"""The range whose checked shapes are compared (with a one-token step): 2x2, 2x9, 4x2, 4x9, 3x8, 3x5."""
CHECK = dict(atol=1e-3, half_ratio=2.0)
"""The recipe's default verify_atol and verify_half_ratio."""
PAGE_TOKENS, PAGES_PER_SEQ = 16, 4


def shapes(quick: bool = False) -> list:
    from kiln.core.forwards.shape_ranges import parse_shape_range
    from kiln.core.plan.recipe import Bucket

    every = [Bucket(1, 1), *parse_shape_range(RANGE).checked_shapes()]
    return every[:2] if quick else every


SEEDS = {"deepseek-v4": 0}
"""Each family's draw (3 unless named; V4's is the reference tests' own). Not every draw separates every
mutation at every shape in bfloat16: of V4's draws 0-7 at a one-token step, draw 3 lets `norm eps 1e-2` through
(0.027 against a limit of 0.0375, twice that draw's own bfloat16 error of 0.019), the other seven fail it."""


def write(family: str, dtype: str, path: Path, seed: int | None = None) -> Path:
    """Write `family`'s small checkpoint in `dtype` at `path` (once), its draw SEEDS' (or `seed`)."""
    import torch
    import transformers

    from bench.hf_checkpoints import V4_SMALL, randomise, randomise_v4

    if (path / "config.json").exists():
        return path
    config_cls, model_cls, fields = FAMILIES[family]
    config = getattr(transformers, config_cls)(**(V4_SMALL if fields is None else {**BASE, **fields}))
    seed = SEEDS.get(family, 3) if seed is None else seed
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    if fields is None:
        randomise_v4(model, config.n_routed_experts, seed + 1)
    else:
        randomise(model)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return path


def _scaled_experts(factor: float):
    def change(cfg, weights, seen):
        return cfg, {n: (t.float() * factor).to(t.dtype) if _routed(n) and n.endswith((".w2.weight", ".down_proj.weight"))
                     else t for n, t in weights.items()}
    return change


def _routed(name: str) -> bool:
    """A routed experts' stacked projection (not a shared expert's)."""
    return ".experts." in name and "shared" not in name


def _swapped_experts(cfg, weights, seen):
    """In every routed layer two experts exchange their weights (the router, and so the choice reported,
    unchanged): the first token's first choice in the first routed layer and the expert it scores lowest."""
    a, b = int(seen.chosen["experts"][0][0, 0]), int(seen.scores["experts"][0][0].argmin())
    out = dict(weights)
    for name in filter(_routed, weights):
        t = weights[name].clone()
        for base in range(0, t.shape[0], cfg.num_experts):  # each layer's experts, stacked along dimension 0
            t[[base + a, base + b]] = t[[base + b, base + a]]
        out[name] = t
    return cfg, out


def _config(**changes):
    def change(cfg, weights, seen):
        return cfg.replace(**{k: v(cfg) for k, v in changes.items()}), weights
    return change


def _one_expert_fewer(cfg, weights, seen):
    """k - 1 experts per token (DeepSeek-V4's hash layers' tables cut to as many)."""
    k = cfg.experts_per_token - 1
    return cfg.replace(experts_per_token=k), {n: t[..., :k].contiguous() if n.endswith("tid2eid") else t
                                              for n, t in weights.items()}


def _indexer_off_by_one(cfg, weights, seen):
    return cfg.replace(v4=dataclasses.replace(cfg.v4, index_topk=cfg.v4.index_topk - 1)), weights


MUTATIONS = {
    "expert weights x1.25": _scaled_experts(1.25),
    "expert weights x0.5": _scaled_experts(0.5),
    "two experts' weights swapped": _swapped_experts,
    "routed_scaling_factor changed": _config(routed_scaling_factor=lambda c: 1.0 if c.routed_scaling_factor != 1
                                            else 2.0),
    "norm eps 1e-2": _config(rms_norm_eps=lambda c: 1e-2),
    "rope theta x2": _config(rope_theta=lambda c: c.rope_theta * 2),
    "top-k weights not renormalised": _config(norm_topk_prob=lambda c: not c.norm_topk_prob),
    "one expert fewer": _one_expert_fewer,
    "the indexer's top-k off by one": _indexer_off_by_one,
}
"""name -> change(cfg, weights, the right forward's ChoiceProbe) -> (cfg, weights) of the wrong forward. The
expert weights scaled are the routed experts' down projections (the output scales exactly)."""
NOT_APPLICABLE = {
    "routed_scaling_factor changed": {"mixtral", "qwen2-moe", "qwen3-moe"},  # they have none
    "top-k weights not renormalised": {"deepseek-v4"},  # it always renormalises
    "the indexer's top-k off by one": {"mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3"},  # no indexer
}


def mutations_of(family: str) -> list[str]:
    return [name for name in MUTATIONS if family not in NOT_APPLICABLE.get(name, ())]


def check_family(path: Path, quick: bool = False) -> dict:
    """{'right': [(shape, passed, check)], 'wrong': [(mutation, shape, caught, check)]} of the checkpoint at
    `path` (one family, one dtype)."""
    import torch

    from kiln.core.run.outcome import passed
    from kiln.host.model import example_inputs
    from kiln.host.ranks.loader import check_against_eager, eager_model
    from kiln.host.ranks.routing_ties import ChoiceProbe, probing
    from kiln.host.weights.checkpoint import inspect_checkpoint, load_rank_weights

    cfg = inspect_checkpoint(path)
    weights = load_rank_weights(str(path), cfg, 1, 0)
    family = path.name.rsplit("-", 1)[0]

    def run(c, w, args):
        with torch.no_grad(), probing(ChoiceProbe()) as seen:
            return eager_model(c, 1, w)(*args), seen

    def brief(check):
        return {k: check.get(k) for k in ("diff", "own", "limit", "choices", "differ", "wrong_choice")}

    out = {"right": [], "wrong": []}
    for shape in shapes(quick):
        args = example_inputs(cfg, 1, shape.batch, shape.tokens, page_tokens=PAGE_TOKENS,
                              pages_per_seq=PAGES_PER_SEQ, num_pages=PAGES_PER_SEQ * shape.batch + 3, seed=1)
        right, seen = run(cfg, weights, args)
        check = check_against_eager(right, cfg, 1, weights, args, **CHECK)
        out["right"].append((str(shape), passed(check), brief(check)))
        for name in mutations_of(family):
            wrong_cfg, wrong_weights = MUTATIONS[name](cfg, weights, seen)
            got, _ = run(wrong_cfg, wrong_weights, args)
            check = check_against_eager(got, cfg, 1, weights, args, **CHECK)
            out["wrong"].append((name, str(shape), not passed(check), brief(check)))
    return out


def main() -> int:
    import tempfile
    import time

    out, quick = Path(sys.argv[1]), "--quick" in sys.argv
    work = Path(tempfile.mkdtemp(prefix="kiln-wrong-forwards-"))
    results, start = {}, time.perf_counter()
    for family in FAMILIES:
        for dtype in DTYPES:
            results[f"{family}-{dtype}"] = check_family(write(family, dtype, work / f"{family}-{dtype}"), quick)
    wrong = [w for r in results.values() for w in r["wrong"]]
    right = [r for rs in results.values() for r in rs["right"]]
    out.write_text(json.dumps({"caught": sum(w[2] for w in wrong), "wrong": len(wrong),
                               "right_passed": sum(r[1] for r in right), "right": len(right),
                               "missed": [w[:2] for r in results.values() for w in r["wrong"] if not w[2]],
                               "seconds": round(time.perf_counter() - start, 1), "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
