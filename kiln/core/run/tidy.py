"""What a run leaves behind, and which of it to remove: pure decisions, no I/O.

Three kinds of leftovers, each decided here and removed by its owner's code:

- temporary directories of a process that is gone: each Kiln process keeps its temporary files (and
  AOTInductor's extractions) in one directory named `<pid>-<start time>` (`owner_dir_name`), so a later
  process tells a dead owner's (no process with that pid, or one started at another time:
  kiln.core.run.holders' rule) from a live one's (`owner_gone`);
- caches over their cap (the host's cache of forwards, KILN_HOME/verify and KILN_HOME/run): the least
  recently used entries go first, never one the run now needs (`over_cap`);
- uploads in parts never completed (S3 multipart uploads of killed writers): those older than a day.

`Removed` counts what went, and `removed_line` says it in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.run.holders import START_TOLERANCE_S

MIB = 2**20


def owner_dir_name(pid: int, started_at_s: float) -> str:
    """The name of process `pid`'s temporary directory: its pid and start time (epoch seconds, 2 decimals)."""
    return f"{pid}-{started_at_s:.2f}"


def owner_of(name: str) -> tuple[int, float] | None:
    """(pid, start time) a directory named by `owner_dir_name` belongs to; None for any other name."""
    pid, _, started = name.partition("-")
    try:
        return (int(pid), float(started)) if pid.isdigit() and started else None
    except ValueError:
        return None


def owner_gone(name: str, pid_started_at_s: float | None) -> bool:
    """Whether the owner of the directory `name` is provably gone: `pid_started_at_s` is the start time of
    the process that has its pid now (None: none). A name that names no owner is not judged (False)."""
    owner = owner_of(name)
    if owner is None:
        return False
    return pid_started_at_s is None or abs(pid_started_at_s - owner[1]) > START_TOLERANCE_S


@dataclass(frozen=True)
class Entry:
    """One entry of a cache: its `name`, its size and when it was last used (epoch seconds)."""

    name: str
    size_bytes: int
    used_s: float


def over_cap(entries: list[Entry], cap_bytes: int, keep: frozenset[str] | set[str] = frozenset()) -> list[str]:
    """The names to remove so that the entries left take at most `cap_bytes`: least recently used first
    (then by name), never one in `keep` (what the run needs now; those alone may exceed the cap)."""
    total = sum(e.size_bytes for e in entries)
    out = []
    for e in sorted(entries, key=lambda e: (e.used_s, e.name)):
        if total <= cap_bytes:
            break
        if e.name in keep:
            continue
        out.append(e.name)
        total -= e.size_bytes
    return out


@dataclass(frozen=True)
class Removed:
    """What was removed of one kind: `count` entries, `size_bytes` in all."""

    count: int = 0
    size_bytes: int = 0

    def __add__(self, other: "Removed") -> "Removed":
        return Removed(self.count + other.count, self.size_bytes + other.size_bytes)


def removed_line(where: str, removed: dict[str, Removed]) -> str | None:
    """One line saying what was removed `where`, per kind ('3 temporary directories of dead processes
    (5.4 MiB)'); None when nothing was."""
    parts = [f"{r.count} {kind} ({r.size_bytes / MIB:.1f} MiB)" for kind, r in removed.items() if r.count]
    return f"removed {where}: " + "; ".join(parts) if parts else None
