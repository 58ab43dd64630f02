"""The eager check of a bfloat16 mixture of experts: a routing tie the dtype leaves open, broken the other way,
passes; a wrong forward, at a tie or elsewhere, fails (kiln.host.ranks.loader.compare_with_eager, eager only).

The model is built so that ties are certain, not left to rounding: in each expert layer experts 1 and 2 have
the same router row and expert 0 twice it, so every token that leans towards them takes expert 0 and one of
1 and 2 at exactly the same score. Which of the two is the index order's choice; a forward holding 1's and
2's weights the other way round computes the same function with the tie broken the other way, as a compiled
forward may break a near-tie the other way from eager when it rounds differently.
"""

from __future__ import annotations

import pytest
import torch

from kiln.core.model.config import TINY
from kiln.core.plan.recipe import Bucket
from kiln.host.weights.checkpoint import load_rank_weights, write_checkpoint
from kiln.host.ranks.loader import compare_with_eager
from kiln.host.model import ShardedDecoder, random_state_dict

CFG = TINY.replace(architecture="qwen3_moe", qk_norm=True, num_layers=2, hidden_size=128, num_heads=4,
                   num_kv_heads=2, head_dim=32, intermediate_size=256, vocab_size=256, num_experts=8,
                   experts_per_token=2, moe_intermediate_size=64, norm_topk_prob=True, moe_layers=(0, 1),
                   dtype="bfloat16")
EXPERT_TENSORS = ("model.runs.0.mlp.experts.gate_proj.weight", "model.runs.0.mlp.experts.up_proj.weight",
                  "model.runs.0.mlp.experts.down_proj.weight")
CHECK = dict(page_tokens=16, pages_per_seq=4, atol=1e-3, half_ratio=2.0)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    full = random_state_dict(CFG.replace(dtype="float32"), seed=5)
    direction = torch.randn(CFG.hidden_size, generator=torch.Generator().manual_seed(9)) * CFG.hidden_size ** -0.5
    for layer in range(CFG.num_layers):
        gate = full[f"model.layers.{layer}.mlp.gate.weight"]  # [experts, hidden]
        gate[0], gate[1], gate[2] = 16 * direction, 8 * direction, 8 * direction
    full = {n: t.to(torch.bfloat16) for n, t in full.items()}
    path = write_checkpoint(tmp_path_factory.mktemp("tied-moe") / "model", CFG, full)
    return load_rank_weights(str(path), CFG, 1, 0)


def _eager(cfg, weights):
    """A bfloat16 forward computed eagerly with `weights`: the stand-in for a compiled one."""
    with torch.device("meta"):
        model = ShardedDecoder(cfg, 1, scan=False).to(torch.bfloat16).eval()
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for name, p in model.state_dict().items():
            p.copy_(weights[name])

    def forward(*args):
        with torch.no_grad():
            return model(*args)
    return forward


def _experts_moved(weights, moves: dict[int, int]):
    """`weights` with each expert layer's expert `to` holding expert `frm`'s weights, for frm, to in moves."""
    out = dict(weights)
    for name in EXPERT_TENSORS:
        t = weights[name].clone()
        for layer in range(CFG.num_layers):
            base = layer * CFG.num_experts
            for frm, to in moves.items():
                t[base + to] = weights[name][base + frm]
        out[name] = t
    return out


def _inputs(bucket):
    """The inputs compare_with_eager checks at (its seed)."""
    from kiln.host.model import example_inputs

    return example_inputs(CFG, 1, bucket.batch, bucket.tokens, page_tokens=CHECK["page_tokens"],
                          pages_per_seq=CHECK["pages_per_seq"], num_pages=CHECK["pages_per_seq"] * bucket.batch + 3,
                          seed=1)


def _check(forward, weights, bucket=Bucket(1, 16)):
    return compare_with_eager(forward, CFG, 1, 0, weights, bucket, **CHECK)


@pytest.mark.parametrize("bucket", [Bucket(1, 16), Bucket(2, 8)])
def test_a_tie_broken_the_other_way_passes_the_check(weights, bucket):
    result = _check(_eager(CFG, _experts_moved(weights, {1: 2, 2: 1})), weights, bucket)
    assert result["diff"] <= result["limit"], result
    assert result.get("ties", 0) > 0  # the tie is there, and was the reason for a second reference


def test_the_same_forward_passes_without_any_swap(weights):
    from kiln.host.model.layers import moe

    result = _check(_eager(CFG, weights), weights)
    assert result["diff"] <= result["limit"] and result["diff"] <= result["own"] * 1.01, result
    assert moe.ROUTE_PROBE is None  # the checker's probe is gone once it has answered: nothing traced sees it


def test_ties_broken_each_their_own_way_pass_the_check(weights):
    """A forward that breaks the tie one way at some tokens and the other way at others, in every expert layer
    (as a compiled topk may, rounding differently token by token): the check reads each token's choice."""
    from kiln.host.ranks.routing_ties import RouteProbe, probing

    args = _inputs(Bucket(1, 16))
    with probing(RouteProbe()) as seen:
        _eager(CFG, weights)(*args)
    mixed = []
    for chosen in seen.chosen:
        other = chosen.clone()
        other[chosen == 1], other[chosen == 2] = 2, 1
        odd = torch.arange(chosen.shape[0]) % 2 == 1
        mixed.append((torch.where(odd[:, None], other, chosen), torch.ones(chosen.shape[0], dtype=torch.bool)))
    assert sum(int(((m != c).any(dim=1)).sum()) for (m, _), c in zip(mixed, seen.chosen)) >= 4, "few ties taken"
    base = _eager(CFG, weights)

    def forward(*a):
        with probing(RouteProbe(mixed)):
            return base(*a)

    result = _check(forward, weights)
    assert result["diff"] <= result["limit"] and result["ties"] > 0, result


@pytest.mark.parametrize("wrong", ["a tie broken towards an expert outside the slack",
                                   "an expert's down projection sign-flipped",
                                   "top-k weights not renormalised", "one expert fewer"])
def test_a_wrong_forward_fails_the_check(weights, wrong):
    cfg, w = CFG, weights
    if wrong == "a tie broken towards an expert outside the slack":
        w = _experts_moved(weights, {5: 1, 1: 5})
    elif wrong == "an expert's down projection sign-flipped":
        w = dict(weights)
        w[EXPERT_TENSORS[2]] = weights[EXPERT_TENSORS[2]].clone()
        w[EXPERT_TENSORS[2]][CFG.num_experts] *= -1  # layer 1's expert 0, which every leaning token takes
    elif wrong == "top-k weights not renormalised":
        cfg = CFG.replace(norm_topk_prob=False)
    else:
        cfg = CFG.replace(experts_per_token=1)
    result = _check(_eager(cfg, w), weights)
    assert result["diff"] > result["limit"], result


def test_swaps_reach_every_expert_of_an_exact_tie():
    # bfloat16 scores are often exactly equal: the second- and third-best unchosen experts must be two experts
    # (topk orders equal values differently for each k), and only those within the slack are taken.
    from kiln.host.ranks.routing_ties import swapped

    scores = torch.full((1, 128), 0.10)  # 128 experts, as Qwen3-30B-A3B's: topk's order of equals varies with k
    scores[0, :2] = torch.tensor([0.30, 0.20])
    chosen = torch.tensor([[0, 1]])
    taken = {int(swapped(scores, chosen, torch.tensor([0.15]), 0, j)[0][0, 1]) for j in range(3)}
    assert len(taken) == 3 and not taken & {0, 1}
    experts, applies = swapped(scores, chosen, torch.tensor([0.05]), 0, 0)
    assert not applies.any() and experts.tolist() == [[0, 1]]
