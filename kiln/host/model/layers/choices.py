"""The discrete choices a forward makes, reported as outputs and, in the eager check alone, forced.

A forward of a mixture of experts chooses, per token, its k experts (a top-k of
router scores); DeepSeek-V4's compressed sparse attention chooses, per query,
the compressed entries its indexer ranks best. In a low dtype two correct
implementations can choose differently where scores are closer than the
dtype's rounding, so the check needs to know which way the checked forward
chose (kiln.host.ranks.routing_ties). Every forward therefore returns its
choices as outputs of its own (kiln.core.model.interface.choice_sites): each
site's picks stacked over the layers that make them.

Each choice site calls `decide(site, scores, picks, **how)` with the scores it
chose by and its picks, and stores what it returns in the layer's `picks`
dict (created by the caller, one per layer call). `PROBE` is None except in
the eager checker, which sets a kiln.host.ranks.routing_ties.ChoiceProbe that
records the scores and may replace the picks: nothing is traced while it is
set, so a compiled graph never holds it.
"""

from __future__ import annotations

import torch

EXPERT_SITE, INDEXER_SITE = "experts", "indexer"
"""The choice sites: a routed layer's experts per token [n, k]; a CSA layer's indexer picks per query [b, t, k]."""

PROBE = None
"""The eager checker's probe (kiln.host.ranks.routing_ties.ChoiceProbe), None otherwise."""


def decide(site: str, scores: torch.Tensor, picks: torch.Tensor, **how) -> torch.Tensor:
    """The picks to use at `site`: `picks` itself, or what the eager checker's probe says. `scores` are what
    the picks were chosen by (the best k of each row of its last dimension; -inf where not a candidate);
    `how` says how, where it is not a plain top-k (DeepSeek-V3: groups=n_group, keep=topk_groups)."""
    return picks if PROBE is None else PROBE(site, scores, picks, how)


def report(into: dict | None, site: str, picks: torch.Tensor) -> None:
    """Keep a layer's `picks` at `site` in its `into` dict (None: the caller wants none)."""
    if into is not None:
        into[site] = picks


def unstack_picks(phases: list[dict], repeats: int) -> list[dict]:
    """A scanned segment's choices per layer, in layer order: `phases[k]` holds phase k's picks stacked over
    its `repeats` iterations (site -> [repeats, ...]); layer i x period + k is iteration i of phase k."""
    return [{site: stacked[i] for site, stacked in phase.items()} for i in range(repeats) for phase in phases]


def stacked_choices(cfg, picks: list[dict], shape: torch.Size) -> tuple[torch.Tensor, ...]:
    """The forward's choice outputs (kiln.core.model.interface.choice_sites), each site's picks over the
    layers that make them [layers, b, t, k] int32, from `picks` (one dict per layer, in layer order)."""
    from kiln.core.model.interface import choice_sites

    b, t = shape[0], shape[1]
    out = []
    for site in choice_sites(cfg):
        made = [p[site] for p in picks if site in p]
        out.append(torch.stack([m.reshape(b, t, m.shape[-1]) for m in made]).to(torch.int32))
    return tuple(out)
