"""The discrete choices in the eager check: forcing references to a forward's own, and which the dtype allows.

A forward makes discrete choices (kiln.host.model.layers.choices): the experts
of each token, DeepSeek-V4's indexer picks. In bfloat16, where two candidates'
scores are closer than the dtype's rounding, two correct implementations
(eager, compiled) can choose differently, and one such flip moves a token's
output by a share of an expert's output, far more than rounding does. Every
forward returns its choices, so the checker (kiln.host.ranks.loader
.check_against_eager) never guesses them:

1. eager in the low dtype, its scores recorded (a ChoiceProbe);
2. eager in float32 forced to the low-dtype run's own choices: eager's error
   against it is rounding alone, no flip, and sets the limit (half_ratio x it);
   the two runs' scores differ by the dtype's rounding of them: per row (token,
   or query) `rounding`, its largest difference over the candidates, at least
   the layer's median row's;
3. eager in float32 forced to the checked forward's choices: the reference its
   outputs are held to, one run whatever the ties;
4. each of the checked forward's choices must be one the dtype allows
   (`wrong_choices`): against the float32 scores of run 3 (what the router
   scores at that layer given the forward's own earlier choices), its weakest
   pick may trail the best candidate it left out by at most its row's slack,
   (1 + half_ratio) x that row's rounding: what the old tie rule called a tie
   (a forward allowed half_ratio x eager's error may round that much more).

DeepSeek-V3's group routing (`groups`, `keep`) chooses topk_groups groups by
the sum of each group's two best scores, then the experts among them: a
choice is allowed when the groups holding its experts, filled up with the best
other groups, trail the best groups left out by at most twice the slack (a sum
of two scores), and its experts trail the best left out among those groups by
at most the slack. In float32 the rounding is the check's own tolerance
(atol) of each row's largest score (at least 1).
"""

from __future__ import annotations

import contextlib

import torch


class ChoiceProbe:
    """Called by kiln.host.model.layers.choices.decide at each choice site of one eager forward, in layer order:
    records each call's scores (float32, [rows, candidates]), picks ([rows, k]) and how they were chosen, and
    returns the picks to use: `forced[site][i]` (any shape holding the call's picks) replaces the i-th call's
    at that site; None, or a site not in it, keeps the forward's own. A forced site whose picks are not as
    many as the model's (another k) is a misfit: recorded, and the model's own picks kept."""

    def __init__(self, forced: dict[str, list[torch.Tensor]] | None = None):
        self.forced = forced or {}
        self.scores: dict[str, list[torch.Tensor]] = {}
        self.chosen: dict[str, list[torch.Tensor]] = {}
        self.how: dict[str, list[dict]] = {}
        self.misfits: list[dict] = []

    def __call__(self, site: str, scores: torch.Tensor, picks: torch.Tensor, how: dict) -> torch.Tensor:
        i = len(self.scores.setdefault(site, []))
        forced = self.forced[site][i] if site in self.forced and i < len(self.forced[site]) else None
        if forced is not None and forced.numel() == picks.numel():
            picks = forced.to(device=picks.device, dtype=picks.dtype).reshape(picks.shape)
        elif site in self.forced:  # not as many as the model picks there: not this model's choices
            self.misfits.append({"site": site, "layer": i, "picks": picks.shape[-1],
                                 "got": None if forced is None else list(forced.shape)})
        self.scores[site].append(scores.detach().to(torch.float32).reshape(-1, scores.shape[-1]).clone())
        self.chosen.setdefault(site, []).append(picks.reshape(-1, picks.shape[-1]).clone())
        self.how.setdefault(site, []).append(how)
        return picks


@contextlib.contextmanager
def probing(probe: ChoiceProbe):
    """Send every choice through `probe` while inside (eager only)."""
    from kiln.host.model.layers import choices

    before, choices.PROBE = choices.PROBE, probe
    try:
        yield probe
    finally:
        choices.PROBE = before


def forced_by(sites: list[str], outputs: tuple) -> dict[str, list[torch.Tensor]]:
    """ChoiceProbe's `forced` from a forward's choice outputs (`outputs`: those after new_kv, one per site of
    `sites`, each [layers, b, t, k]): each layer's picks, in layer order."""
    return {site: list(picks.unbind(0)) for site, picks in zip(sites, outputs)}


def rounding(low: ChoiceProbe, exact: ChoiceProbe) -> dict[str, list[torch.Tensor]]:
    """Per site and layer, [rows]: each row's largest |low - float32| difference of a finite score, at least
    the layer's median row's: the dtype's rounding of that row's scores (`exact` forced to `low`'s choices, so
    both score the same hidden states up to rounding). The floor keeps a row whose scores happened to round
    exactly from being held to none."""
    out = {}
    for site, scores in low.scores.items():
        out[site] = []
        for s_low, s_exact in zip(scores, exact.scores[site]):
            both = torch.isfinite(s_low) & torch.isfinite(s_exact)
            rows = (s_low - s_exact).abs().masked_fill(~both, 0).amax(dim=1)
            out[site].append(rows.clamp(min=float(rows.median())))
    return out


def scale_rounding(probe: ChoiceProbe, atol: float) -> dict[str, list[torch.Tensor]]:
    """float32's stand-in for `rounding`: atol x each row's largest finite |score| (at least 1)."""
    out = {}
    for site, scores in probe.scores.items():
        out[site] = [atol * s.masked_fill(~torch.isfinite(s), 0).abs().amax(dim=1).clamp(min=1.0) for s in scores]
    return out


def margins(scores: torch.Tensor, chosen: torch.Tensor, how: dict) -> torch.Tensor:
    """[rows]: how far each row's choice trails the best it could have made, in score (<= 0; 0 where it is a
    best one). `scores` [rows, candidates] (-inf: not a candidate), `chosen` [rows, k] (an index equal to
    the candidates: no pick, scored -inf)."""
    if how.get("groups"):
        return _group_margins(scores, chosen, how["groups"], how["keep"])
    return _margins(scores, chosen)


def _margins(scores: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
    """A plain top-k's: its weakest pick's score minus the best score it left out, capped at 0."""
    padded = torch.cat((scores, torch.full_like(scores[:, :1], float("-inf"))), dim=1)  # index n: no pick
    weakest = padded.gather(1, chosen.long()).min(dim=1).values
    left = padded.scatter(1, chosen.long(), float("-inf"))[:, :-1].max(dim=1).values
    gap = torch.where(torch.isneginf(left), torch.zeros_like(weakest), weakest - left)  # nothing left out: 0
    return torch.nan_to_num(gap, nan=0.0, neginf=float("-inf")).clamp(max=0)


def _group_margins(scores: torch.Tensor, chosen: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """DeepSeek-V3's: the smaller of its groups' margin (halved: a group scores two experts) and its experts'
    among the groups it keeps (those holding its picks, filled up with the best others)."""
    rows, experts = scores.shape
    size = experts // groups
    group_scores = scores.view(rows, groups, size).topk(2, dim=-1).values.sum(dim=-1)  # [rows, groups]
    held = torch.zeros(rows, groups, dtype=torch.bool, device=scores.device).scatter(1, chosen.long() // size, True)
    over = held.sum(dim=1) > keep  # picks in more groups than the router keeps: no rounding explains that
    need = (keep - held.sum(dim=1)).clamp(min=0)
    others = torch.sort(group_scores.masked_fill(held, float("-inf")), dim=1, descending=True, stable=True)
    fill = torch.arange(groups, device=scores.device)[None, :] < need[:, None]
    kept = held | torch.zeros_like(held).scatter(1, others.indices, fill)
    weakest = group_scores.masked_fill(~kept, float("inf")).min(dim=1).values
    left = group_scores.masked_fill(kept, float("-inf")).max(dim=1).values
    group_gap = torch.where(torch.isneginf(left), torch.zeros_like(weakest), (weakest - left) / 2).clamp(max=0)
    within = scores.masked_fill(~kept[:, :, None].expand(rows, groups, size).reshape(rows, experts), float("-inf"))
    gap = torch.minimum(group_gap, _margins(within, chosen))
    return torch.where(over, torch.full_like(gap, float("-inf")), gap)


def wrong_choices(probe: ChoiceProbe, slack: dict[str, list[torch.Tensor]]) -> list[dict]:
    """The choices of the forward `probe` was forced to (its run scored them) that trail the best they could
    have made by more than their row's slack (`slack[site][layer]` [rows]): {'site', 'layer' (the site's i-th
    layer), 'row', 'picks', 'behind', 'slack', 'count'}, each layer's furthest over its slack, after any
    misfit (ChoiceProbe's: {'site', 'layer', 'picks', 'got', 'misfit'})."""
    out = [{**m, "misfit": True} for m in probe.misfits]
    for site, scores in probe.scores.items():
        for i, (s, chosen, how) in enumerate(zip(scores, probe.chosen[site], probe.how[site])):
            behind = -margins(s, chosen, how)
            over = behind - slack[site][i]
            if bool((over > 0).any()):
                row = int(torch.argmax(over))
                out.append({"site": site, "layer": i, "row": row, "picks": chosen[row].tolist(),
                            "behind": float(behind[row]), "slack": float(slack[site][i][row]),
                            "count": int((over > 0).sum())})
    return out


def differing(probe: ChoiceProbe) -> int:
    """How many rows' choices (over every site and layer of `probe`'s forced run) differ from what its own
    float32 scores pick: the choices the dtype left open that the forward took the other way."""
    total = 0
    for site, scores in probe.scores.items():
        for s, chosen, how in zip(scores, probe.chosen[site], probe.how[site]):
            total += int((margins(s, chosen, how) < 0).sum())
    return total
