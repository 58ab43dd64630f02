"""Fault points: named places where a test may inject a fault. Nothing in Kiln installs a hook.

Purpose: tests break an export at a chosen place (a dropped store connection,
a compile worker killed midway, a host lost after an upload) without any
test-only code in Kiln: production code only marks the places, and calling a
point with no hook installed does nothing.

Points and their arguments:
- "probe" (): before a host's probe touches anything.
- "uploaded" (num_uploaded,): after each forward a host uploaded in the compile phase.
- "compile" (spec, stage): in a compile worker; stage 'export' (after torch.export,
  before Inductor) or 'written' (the package written, not yet published to the cache).
- "check" (rank,): in a rank check's own process, before it loads anything.
- "rank" (rank, doing): in a rank process of `kiln verify` or `kiln run`, as it starts
  something (`doing`: 'joining the gloo group', 'running forward 4x32', ...;
  kiln.host.ranks.verify_ranks.RankLink.doing).

Contracts: `install` is called by whoever wants faults in this process (the
test suite's seam, tests/fault_seam/, installs itself in every Python process
the tests start). A hook may raise or end the process; its exception
propagates from the point.
"""

from __future__ import annotations

from collections.abc import Callable

POINTS = ("probe", "uploaded", "compile", "check", "rank")
_hooks: dict[str, list[Callable]] = {}


def install(point: str, hook: Callable) -> Callable[[], None]:
    """Call `hook(*args)` at every `point(name, *args)` in this process; returns what uninstalls it."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; known: {', '.join(POINTS)}")
    _hooks.setdefault(point, []).append(hook)
    return lambda: _hooks[point].remove(hook)


def point(name: str, *args) -> None:
    """A place where a fault may be injected: runs the hooks installed for `name`, if any."""
    for hook in tuple(_hooks.get(name, ())):
        hook(*args)
