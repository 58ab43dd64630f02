"""The eager check of a bfloat16 mixture of experts: a routing tie the dtype leaves open, broken the other way
and reported so, passes; a wrong forward, at a tie or elsewhere, fails (kiln.host.ranks.loader.compare_with_eager,
eager only; kiln.host.ranks.routing_ties).

The model is built so that ties are certain, not left to rounding: in each expert layer experts 1 and 2 have
the same router row and expert 0 twice it, so every token that leans towards them takes expert 0 and one of
1 and 2 at exactly the same score. Which of the two is the index order's choice; a forward forced to the
other one (kiln.host.ranks.routing_ties.ChoiceProbe) breaks the tie the other way and reports it, as a compiled
forward may when it rounds differently from eager.
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


def _forced(forward, change):
    """`forward` with its expert choices replaced by change(layer's choices [n, k], its scores [n, E]) -> [n, k],
    reported as such."""
    from kiln.host.ranks.routing_ties import ChoiceProbe, probing

    def changed(*args):
        with probing(ChoiceProbe()) as seen:
            forward(*args)
        with probing(ChoiceProbe({"experts": [change(c, s) for c, s in zip(seen.chosen["experts"],
                                                                            seen.scores["experts"])]})):
            return forward(*args)
    return changed


def _other_of_tie(chosen, rows=slice(None)):
    """`chosen` with expert 1 and 2 exchanged at `rows` (tokens)."""
    other = chosen.clone()
    other[chosen == 1], other[chosen == 2] = 2, 1
    keep = torch.ones(chosen.shape[0], dtype=torch.bool)
    keep[rows] = False
    return torch.where(keep[:, None], chosen, other)


@pytest.mark.parametrize("bucket", [Bucket(1, 16), Bucket(2, 8)])
@pytest.mark.parametrize("rows", ["every token", "odd tokens"])
def test_a_tie_broken_the_other_way_and_reported_passes(weights, bucket, rows):
    """Every tied token breaks the tie the other way, or only odd ones (as a compiled topk may, rounding
    differently token by token): the reference is forced to what the forward reports."""
    which = slice(None) if rows == "every token" else slice(1, None, 2)
    forward = _forced(_eager(CFG, weights), lambda c, s: _other_of_tie(c, which))
    result = _check(forward, weights, bucket)
    assert result["diff"] <= result["limit"] and result["wrong_choice"] is None, result
    args = _inputs(bucket)
    taken, own = forward(*args)[2], _eager(CFG, weights)(*args)[2]
    assert int((taken != own).any(dim=-1).sum()) >= 2  # the ties were there, and taken the other way


def test_the_same_forward_passes_and_its_own_error_is_rounding_alone(weights):
    from kiln.host.model.layers import choices

    result = _check(_eager(CFG, weights), weights)
    assert result["diff"] <= result["limit"] and result["diff"] <= result["own"] * 1.01, result
    assert result["choices"] == CFG.num_layers * 16 and result["wrong_choice"] is None, result
    assert choices.PROBE is None  # the checker's probe is gone once it has answered: nothing traced sees it


@pytest.mark.parametrize("wrong", ["a tie broken towards an expert outside the slack",
                                   "tied experts' weights swapped, the choice reported unchanged",
                                   "an expert's down projection sign-flipped",
                                   "top-k weights not renormalised", "one expert fewer"])
def test_a_wrong_forward_fails_the_check(weights, wrong):
    cfg, w, forward = CFG, weights, None
    if wrong == "a tie broken towards an expert outside the slack":
        # expert 1, tied with 2, replaced by the token's weakest expert
        forward = _forced(_eager(CFG, weights), lambda c, s: torch.where(c == 1, s.argmin(dim=1, keepdim=True), c))
    elif wrong == "tied experts' weights swapped, the choice reported unchanged":
        w = _experts_moved(weights, {1: 2, 2: 1})
    elif wrong == "an expert's down projection sign-flipped":
        w = dict(weights)
        w[EXPERT_TENSORS[2]] = weights[EXPERT_TENSORS[2]].clone()
        w[EXPERT_TENSORS[2]][CFG.num_experts] *= -1  # layer 1's expert 0, which every leaning token takes
    elif wrong == "top-k weights not renormalised":
        cfg = CFG.replace(norm_topk_prob=False)
    else:
        cfg = CFG.replace(experts_per_token=1)
    from kiln.core.run.outcome import passed

    result = _check(forward or _eager(cfg, w), weights)
    assert not passed(result), result
    if wrong.startswith("a tie broken towards"):
        assert "'s experts [" in result["wrong_choice"] and "slack" in result["wrong_choice"], result
    if wrong == "one expert fewer":
        assert "makes 2 per token" in result["wrong_choice"], result


def test_margins_of_a_top_k_groups_and_indexer_picks():
    """How far a choice trails the best one (kiln.host.ranks.routing_ties.margins): 0 for a best choice, an
    exact tie either way, the score gap otherwise; DeepSeek-V3's groups by their two best experts; an index
    past the candidates is no pick, right only where nothing ready was left out."""
    from kiln.host.ranks.routing_ties import margins

    scores = torch.tensor([[0.5, 0.3, 0.3, 0.1], [0.5, 0.3, 0.29, 0.1]])
    assert margins(scores, torch.tensor([[0, 2], [0, 2]]), {}).tolist() == pytest.approx([0.0, -0.01], abs=1e-6)
    assert margins(scores, torch.tensor([[3, 0], [1, 0]]), {}).tolist() == pytest.approx([-0.2, 0.0])
    groups = torch.tensor([[0.9, 0.1, 0.5, 0.45, 0.6, 0.0]])  # three groups of two: sums 1.0, 0.95, 0.6
    how = {"groups": 3, "keep": 1}
    assert margins(groups, torch.tensor([[0, 1]]), how).tolist() == [0.0]
    assert margins(groups, torch.tensor([[2, 3]]), how).tolist() == pytest.approx([-0.025])  # group gap / 2
    assert margins(groups, torch.tensor([[0, 2]]), how).tolist() == [float("-inf")]  # two groups, one kept
    assert margins(groups, torch.tensor([[4, 0]]), {"groups": 3, "keep": 2}).tolist() == pytest.approx([-0.175])
    ready = torch.tensor([[0.2, 0.4, float("-inf")], [0.2, float("-inf"), float("-inf")]])
    assert margins(ready, torch.tensor([[1, 0], [0, 3]]), {}).tolist() == [0.0, 0.0]  # one ready: one pick
    assert margins(ready, torch.tensor([[1, 3], [0, 3]]), {}).tolist()[0] == float("-inf")  # one left out
