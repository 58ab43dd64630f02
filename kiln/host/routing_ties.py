"""Expert routing in the eager check: which choices the dtype leaves open, and references that take them.

In bfloat16 a router over many experts has near-ties: a token whose k-th and
(k+1)-th best scores are closer than the dtype's rounding may take either, and
two correct implementations (eager, compiled) round differently, so they can
choose differently. One such flip moves that token's output by a share of an
expert's output, far more than rounding does; comparing outputs alone cannot
tell it from a wrong forward.

The checker therefore (kiln.host.loader.check_against_eager):

1. runs eager in the low dtype, recording every expert layer's scores and
   choices (a RouteProbe);
2. runs eager in float32 with the experts *forced* to the low-dtype run's
   choices (R0): eager's own error against it is rounding alone, no flip;
3. calls a (layer, token) *tied* when its low-dtype margin (its lowest chosen
   score minus the best unchosen one) is at most (1 + half_ratio) x the
   largest difference between that token's scores in the two runs: the
   compiled forward, allowed half_ratio x eager's error, may choose either;
4. runs float32 again with some of those choices taken the other way: per
   swap of SWAPS (a chosen expert among the two weakest replaced by an
   unchosen one among the three best, where their scores are within that
   token's slack: in bfloat16 scores are often exactly equal, and two topk
   implementations need not break such ties alike) and per set of layers
   whose ties swap (every subset while there are at most 3, else each layer
   alone and all together), at most MAX_ROUTINGS runs; the other ties forced
   as in R0 and every other token routed by its own float32 scores (a swap
   changes the hidden states after it, so later choices are recomputed);
5. holds each output position (sequence, token) to the limit against the
   nearest of these references.

A token's choice is thus allowed to differ only where the dtype itself leaves
it open, and then only between experts within its slack: a forward that is wrong anywhere else
(a weight, a routing term) is still compared with every reference and fails.
Ties of DeepSeek's group choice (which groups are open) are not swapped.
"""

from __future__ import annotations

import contextlib
from itertools import combinations

import torch

MAX_ROUTINGS = 12
"""At most this many swapped float32 references per check (beyond R0)."""


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
    from kiln.host.model import moe

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


def swapped_routings(low: RouteProbe, ties: list[tuple[torch.Tensor, torch.Tensor]]):
    """The forced routings of the swapped references (step 4 above): per swap of SWAPS, per set of layers
    swapped; at most MAX_ROUTINGS, none that would change no choice."""
    tied_layers = [layer for layer, (tied, _) in enumerate(ties) if bool(tied.any())]
    layer_sets = [set(c) for r in range(1, len(tied_layers) + 1) for c in combinations(tied_layers, r)]
    if len(layer_sets) > 3:  # all together first: with many such layers the cap leaves out later single ones
        layer_sets = [set(tied_layers)] + [{layer} for layer in tied_layers]
    made = 0
    for w, j in SWAPS:
        for layers in layer_sets:
            forced, changed = [], False
            for layer, (chosen, (tied, slack)) in enumerate(zip(low.chosen, ties)):
                if layer in layers:
                    experts, applies = swapped(low.scores[layer], chosen, slack, w, j)
                    chosen, changed = experts, changed or bool((applies & tied).any())
                forced.append((chosen, tied))
            if changed and made < MAX_ROUTINGS:
                made += 1
                yield forced


def tie_count(ties: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
    return sum(int(tied.sum()) for tied, _ in ties)
