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
4. runs float32 again once per set of layers whose ties are swapped (the
   lowest chosen expert replaced by the best unchosen one at every tie of
   those layers; every subset while that is at most MAX_ROUTINGS runs, else
   each layer alone and all together), the other ties forced as in R0 and
   every other token routed by its own float32 scores (a swap changes the
   hidden states after it, so later choices are recomputed);
5. holds each output position (sequence, token) to the limit against the
   nearest of these references.

A token's choice is thus allowed to differ only where the dtype itself leaves
it open, and then only to the runner-up: a forward that is wrong anywhere else
(a weight, a routing term) is still compared with every reference and fails.
Ties of DeepSeek's group choice (which groups are open) are not swapped.
"""

from __future__ import annotations

import contextlib
from itertools import combinations

import torch

MAX_ROUTINGS = 8
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


def find_ties(low: RouteProbe, exact: RouteProbe, *, half_ratio: float) -> list[torch.Tensor]:
    """Per expert layer, [n] bool: the tokens whose low-dtype margin (the lowest chosen score minus the best
    unchosen one) is at most (1 + half_ratio) x the token's largest |low - float32| score difference
    (`exact` forced to the same choices)."""
    ties = []
    for s_low, s_exact, chosen in zip(low.scores, exact.scores, low.chosen):
        both = torch.isfinite(s_low) & torch.isfinite(s_exact)
        error = torch.where(both, (s_low - s_exact).abs(), torch.zeros_like(s_low)).amax(dim=1)
        margin = s_low.gather(1, chosen).min(dim=1).values - _unchosen(s_low, chosen).max(dim=1).values
        ties.append(torch.isfinite(margin) & (margin <= (1 + half_ratio) * error))
    return ties


def _unchosen(scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    return scores.scatter(1, chosen, float("-inf"))


def runner_up(scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """`chosen` [n, k] with its lowest-scored expert replaced by the best unchosen one."""
    weakest = scores.gather(1, chosen).argmin(dim=1, keepdim=True)
    best_other = _unchosen(scores, chosen).argmax(dim=1, keepdim=True)
    return chosen.scatter(1, weakest, best_other)


def swapped_routings(low: RouteProbe, ties: list[torch.Tensor]):
    """The forced routings of the swapped references (step 4 above), one per set of swapped layers."""
    tied_layers = [layer for layer, t in enumerate(ties) if bool(t.any())]
    if not tied_layers:
        return
    every = [set(c) for r in range(1, len(tied_layers) + 1) for c in combinations(tied_layers, r)]
    if len(every) > MAX_ROUTINGS:
        every = [{layer} for layer in tied_layers[:MAX_ROUTINGS - 1]] + [set(tied_layers)]
    for layers in every:
        forced = []
        for layer, (chosen, tied) in enumerate(zip(low.chosen, ties)):
            if layer in layers:
                chosen = torch.where(tied[:, None], runner_up(low.scores[layer], chosen), chosen)
            forced.append((chosen, tied))
        yield forced


def tie_count(ties: list[torch.Tensor]) -> int:
    return sum(int(t.sum()) for t in ties)
