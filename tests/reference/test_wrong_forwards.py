"""A check that a wrong forward cannot pass and a right one cannot fail (kiln.host.ranks.loader.check_against_eager).

For every mixture-of-experts family (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, DeepSeek-V4), in float32 and
bfloat16, on a small checkpoint written by transformers' own class: the right forward (eager, reporting its
choices as a compiled one does) passes at every checked shape of a range, and each forward of a fixed list of
wrong ones fails at every one of them. A wrong forward is the eager model with one thing changed, its
outputs and choices what a compiled forward with that bug would return; the check compares them with the
right model's eager reference. Where a change does not apply to a family (a scaling factor it does not
have, a renormalisation it always makes, an indexer it has not) the list says so, and it is left out.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import CASES, DEEPSEEK, hf_config, hf_model
from test_deepseek_v4 import write_v4

from kiln.core.forwards.shape_ranges import parse_shape_range
from kiln.core.plan.recipe import Bucket
from kiln.core.run.outcome import passed
from kiln.host.model import example_inputs
from kiln.host.ranks.loader import check_against_eager, eager_model
from kiln.host.ranks.routing_ties import ChoiceProbe, probing
from kiln.host.weights.checkpoint import inspect_checkpoint, load_rank_weights

FAMILIES = {
    "mixtral": ("mixtral", dict(num_hidden_layers=3, num_local_experts=8, num_experts_per_tok=2,
                                intermediate_size=128)),
    "qwen2-moe": CASES["qwen2-moe"][:2],
    "qwen3-moe": ("qwen3_moe", dict(head_dim=64, num_hidden_layers=3, num_experts=16, num_experts_per_tok=2,
                                    moe_intermediate_size=32, mlp_only_layers=[1], norm_topk_prob=True)),
    "deepseek-v3": ("deepseek_v3", dict(DEEPSEEK, attention_bias=True)),
    "deepseek-v4": None,
}
SHAPES = (Bucket(1, 1), *parse_shape_range("2-4x2-9@3x8").checked_shapes())
"""A one-token decode step, and a range's checked shapes: its four corners, its hint and an interior shape."""
CHECK = dict(atol=1e-3, half_ratio=2.0)
"""The recipe's default verify_atol and verify_half_ratio."""
PAGE_TOKENS, PAGES_PER_SEQ = 16, 4


def _expert_tensors(weights: dict, which: str) -> list[str]:
    """The routed experts' stacked projections: 'down' (Mixtral's w2, V4's w2, the others' down_proj) or 'all'."""
    names = [n for n in weights if ".experts." in n and "shared" not in n]
    if which == "all":
        return names
    return [n for n in names if n.endswith((".w2.weight", ".down_proj.weight"))]


def _scaled_experts(factor: float):
    def change(cfg, weights, seen):
        out = dict(weights)
        for name in _expert_tensors(weights, "down"):
            out[name] = (weights[name].float() * factor).to(weights[name].dtype)
        return cfg, out
    return change


def _swapped_experts(cfg, weights, seen):
    """In every routed layer, two experts exchange their weights (the router, and so the choice reported,
    unchanged): the first token's first choice in the first routed layer and the expert it scores lowest there."""
    a = int(seen.chosen["experts"][0][0, 0])
    b = int(seen.scores["experts"][0][0].argmin())
    out = dict(weights)
    for name in _expert_tensors(weights, "all"):
        t = weights[name].clone()
        for base in range(0, t.shape[0], cfg.num_experts):  # each layer's experts, stacked along dimension 0
            t[[base + a, base + b]] = t[[base + b, base + a]]
        out[name] = t
    return cfg, out


def _config(**changes):
    def change(cfg, weights, seen):
        return cfg.replace(**{k: (v(cfg) if callable(v) else v) for k, v in changes.items()}), weights
    return change


def _v4_config(**changes):
    def change(cfg, weights, seen):
        import dataclasses
        return cfg.replace(v4=dataclasses.replace(cfg.v4, **{k: v(cfg.v4) for k, v in changes.items()})), weights
    return change


def _one_expert_fewer(cfg, weights, seen):
    """k - 1 experts per token (DeepSeek-V4's hash layers' tables cut to as many)."""
    k = cfg.experts_per_token - 1
    return cfg.replace(experts_per_token=k), {n: t[..., :k].contiguous() if n.endswith("tid2eid") else t
                                              for n, t in weights.items()}


MUTATIONS = {
    "expert weights x1.25": _scaled_experts(1.25),
    "expert weights x0.5": _scaled_experts(0.5),
    "two experts' weights swapped": _swapped_experts,
    "routed_scaling_factor changed": _config(routed_scaling_factor=lambda c: 1.0 if c.routed_scaling_factor != 1
                                            else 2.0),
    "norm eps 1e-2": _config(rms_norm_eps=1e-2),
    "rope theta x2": _config(rope_theta=lambda c: c.rope_theta * 2),
    "top-k weights not renormalised": _config(norm_topk_prob=lambda c: not c.norm_topk_prob),
    "one expert fewer": _one_expert_fewer,
    "the indexer's top-k off by one": _v4_config(index_topk=lambda v: v.index_topk - 1),
}
NOT_APPLICABLE = {
    "routed_scaling_factor changed": {"mixtral", "qwen2-moe", "qwen3-moe"},  # they have none
    "top-k weights not renormalised": {"deepseek-v4"},  # it always renormalises
    "the indexer's top-k off by one": {"mixtral", "qwen2-moe", "qwen3-moe", "deepseek-v3"},  # no indexer
}
"""Where a mutation does not apply: the family's forward has nothing it could change."""


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root, made = tmp_path_factory.mktemp("wrong-forwards"), {}

    def make(family: str, dtype: str):
        if (family, dtype) not in made:
            path = root / f"{family}-{dtype}"
            if FAMILIES[family] is None:
                write_v4(path, dtype=dtype)
            else:
                name, overrides = FAMILIES[family]
                hf_model(name, hf_config(name, overrides, dtype), seed=3).to(getattr(torch, dtype)).save_pretrained(path)
            cfg = inspect_checkpoint(path)
            made[family, dtype] = cfg, load_rank_weights(str(path), cfg, 1, 0)
        return made[family, dtype]
    return make


def _args(cfg, shape):
    return example_inputs(cfg, 1, shape.batch, shape.tokens, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                          num_pages=PAGES_PER_SEQ * shape.batch + 3, seed=1)


def _run(cfg, weights, args):
    with torch.no_grad(), probing(ChoiceProbe()) as seen:
        out = eager_model(cfg, 1, weights)(*args)
    return out, seen


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_right_forward_passes_and_every_wrong_one_fails_at_every_checked_shape(checkpoints, family, dtype):
    cfg, weights = checkpoints(family, dtype)
    assert cfg.dtype == dtype
    mutations = {name: change for name, change in MUTATIONS.items() if family not in NOT_APPLICABLE.get(name, ())}
    passed_wrongly, results = [], {}
    for shape in SHAPES:
        args = _args(cfg, shape)
        right, seen = _run(cfg, weights, args)
        result = check_against_eager(right, cfg, 1, weights, args, **CHECK)
        assert passed(result), (shape, result)
        assert result["choices"] > 0
        for name, change in mutations.items():
            wrong_cfg, wrong_weights = change(cfg, weights, seen)
            got, _ = _run(wrong_cfg, wrong_weights, args)
            results[name, str(shape)] = check = check_against_eager(got, cfg, 1, weights, args, **CHECK)
            if passed(check):
                passed_wrongly.append((name, str(shape), {k: check[k] for k in ("diff", "limit", "own")}))
    assert not passed_wrongly, passed_wrongly
    assert len(results) == len(mutations) * len(SHAPES) >= 7 * 7
