"""Expert routing in the eager check: which choices the dtype leaves open, and references that take them.

In bfloat16 a router over many experts has near-ties: a token whose k-th and
(k+1)-th best scores are closer than the dtype's rounding may take either, and
two correct implementations (eager, compiled) round differently, so they can
choose differently. One such flip moves that token's output by a share of an
expert's output, far more than rounding does; comparing outputs alone cannot
tell it from a wrong forward.

The checker therefore (kiln.host.ranks.loader.check_against_eager):

1. runs eager in the low dtype, recording every expert layer's scores and
   choices (a RouteProbe);
2. runs eager in float32 with the experts *forced* to the low-dtype run's
   choices (R0): eager's own error against it is rounding alone, no flip;
3. calls a (layer, token) *tied* when its low-dtype margin (its lowest chosen
   score minus the best unchosen one) is at most (1 + half_ratio) x the
   largest difference between that token's scores in the two runs: the
   compiled forward, allowed half_ratio x eager's error, may choose either;
4. reads, layer by layer, which way the checked forward took each tie
   (`identified_routing`): a tied token's candidates are R0's choice and each
   swap of SWAPS (a chosen expert among the two weakest replaced by an
   unchosen one among the three best, where their scores are within that
   token's slack: in bfloat16 scores are often exactly equal, and two topk
   implementations need not break such ties alike). One float32 run per
   candidate, earlier layers as already read, gives every token's output of
   the next layer's new cache entries (the last expert layer: the logits),
   which depend on that token's choice in this layer alone: each tied token
   takes the candidate nearest to the checked forward there;
5. runs float32 routed as read (every tie forced that way, every other token
   routed by its own float32 scores, as a choice changes the hidden states
   after it) and holds each output position (sequence, token) to the limit
   against the nearer of R0 and that reference.

A token's choice is thus allowed to differ only where the dtype itself leaves
it open, and then only between experts within its slack: a forward that is
wrong anywhere else (a weight, a routing term) is far from every candidate,
and fails. Reading the choices token by token, where a fixed set of swapped
references took every tied token of a layer the same way, is what lets a
real-width bfloat16 Qwen3-MoE pass (24 ties in 32 choices: its compiled
forward broke them in a mix no such reference held). Ties of DeepSeek's group
choice (which groups are open) are not swapped.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch


class RouteProbe:
    """Called by moe.route once per expert layer of one forward, in layer order: records (scores, chosen)
    and returns the experts to use: `forced[layer]` = (experts [n, k], where [n] bool) replaces the
    router's own choice at the tokens where `where` holds; None routes as the router does."""

    def __init__(self, forced: list | None = None):
        self.forced = forced
        self.scores: list[torch.Tensor] = []
        self.chosen: list[torch.Tensor] = []

    def __call__(self, scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        layer = len(self.scores)
        if self.forced is not None:
            experts, where = self.forced[layer]
            chosen = torch.where(where[:, None], experts, chosen)
        self.scores.append(scores.detach().to(torch.float32).clone())
        self.chosen.append(chosen)
        return chosen


@contextlib.contextmanager
def probing(probe: RouteProbe):
    """Route every expert layer through `probe` while inside (eager only)."""
    from kiln.host.model.layers import moe

    before, moe.ROUTE_PROBE = moe.ROUTE_PROBE, probe
    try:
        yield probe
    finally:
        moe.ROUTE_PROBE = before


def forced_as(low: RouteProbe) -> list:
    """Force every token of every layer to `low`'s choice."""
    return [(c, torch.ones(c.shape[0], dtype=torch.bool)) for c in low.chosen]


def find_ties(low: RouteProbe, exact: RouteProbe, *, half_ratio: float) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per expert layer, (tied [n] bool, slack [n]): a token's slack is (1 + half_ratio) x its largest |low -
    float32| score difference (`exact` forced to the same choices), and it is tied when its low-dtype margin
    (the lowest chosen score minus the best unchosen one) is at most that."""
    ties = []
    for s_low, s_exact, chosen in zip(low.scores, exact.scores, low.chosen):
        both = torch.isfinite(s_low) & torch.isfinite(s_exact)
        slack = (1 + half_ratio) * torch.where(both, (s_low - s_exact).abs(), torch.zeros_like(s_low)).amax(dim=1)
        margin = s_low.gather(1, chosen).min(dim=1).values - _unchosen(s_low, chosen).max(dim=1).values
        ties.append((torch.isfinite(margin) & (margin <= slack), slack))
    return ties


def _unchosen(scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    return scores.scatter(1, chosen, float("-inf"))


SWAPS = ((0, 0), (0, 1), (1, 0), (0, 2))
"""(w, j): the (w+1)-th weakest chosen expert replaced by the (j+1)-th best unchosen one, in this order. In
bfloat16 scores are often exactly equal, and two implementations' topk need not break such ties alike."""


def swapped(scores: torch.Tensor, chosen: torch.Tensor, slack: torch.Tensor, w: int, j: int):
    """(`chosen` [n, k] with swap (w, j) made at the tokens where the two experts' scores are within `slack`,
    those tokens [n] bool)."""
    n, k = chosen.shape
    if w >= k or j >= scores.shape[1] - k:
        return chosen, torch.zeros(n, dtype=torch.bool)
    # Stable sorts: equal scores keep one order whatever j and w (topk orders equal values differently per k).
    chosen_scores = scores.gather(1, chosen)
    drop = torch.sort(chosen_scores, dim=1, stable=True).indices[:, w:w + 1]  # the (w+1)-th weakest's slot
    best = torch.sort(_unchosen(scores, chosen), dim=1, descending=True, stable=True)
    gap = chosen_scores.gather(1, drop)[:, 0] - best.values[:, j]
    applies = torch.isfinite(best.values[:, j]) & (gap <= slack)
    return torch.where(applies[:, None], chosen.scatter(1, drop, best.indices[:, j:j + 1]), chosen), applies


def identified_routing(run: Callable[[list], tuple], got: tuple, low: RouteProbe,
                       ties: list[tuple[torch.Tensor, torch.Tensor]], moe_layers: list[int]) -> tuple[list, int]:
    """(The forced routing that takes each tie the way the checked outputs `got` did (step 4 above), the float32
    runs it took). `run(forced)` is one float32 reference run; `moe_layers[e]` is the decoder layer of expert
    layer e. A layer without ties costs no run."""
    forced = [(chosen, tied) for chosen, (tied, _) in zip(low.chosen, ties)]
    runs = 0
    for e, (tied, slack) in enumerate(ties):
        if not bool(tied.any()):
            continue
        best, best_gap = low.chosen[e], None
        for w, j in ((None, None), *SWAPS):
            candidate = low.chosen[e] if w is None else swapped(low.scores[e], low.chosen[e], slack, w, j)[0]
            if w is not None and bool((candidate == low.chosen[e]).all()):
                continue  # this swap applies to no token: nothing to tell apart
            trial = list(forced)
            trial[e] = (candidate, tied)
            runs += 1
            gap = _layer_gap(run(trial), got, moe_layers[e])
            if best_gap is None:
                best, best_gap = candidate, gap
                continue
            nearer = tied & (gap < best_gap)
            best = torch.where(nearer[:, None], candidate, best)
            best_gap = torch.where(nearer, gap, best_gap)
        forced[e] = (best, tied)
    return forced, runs


def _layer_gap(out: tuple, got: tuple, layer: int) -> torch.Tensor:
    """[tokens]: per token, the largest |difference| between `out` and `got` in what decoder layer `layer`'s
    expert choice alone decides at that token: the next layer's new cache entries (output 1: [layers,
    entries, b, t, heads, width]), or after the last layer the logits (output 0: [b, t, vocab])."""
    if layer + 1 < out[1].shape[0]:
        diff = (out[1][layer + 1].float() - got[1][layer + 1].float()).abs().amax(dim=(0, 3, 4))  # [b, t]
    else:
        diff = (out[0].float() - got[0].float()).abs().amax(dim=-1)
    return diff.reshape(-1)


def tie_count(ties: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(int(tied.sum()) for tied, _ in ties)
