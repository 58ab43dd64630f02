"""What a run's page says, in its reader's words: forwards by origin, checks, memory, changed settings,
the manifest's contents. Pure: markdown and table rows from the report's records.

Contracts: `origin` is one of "compiled by HOST (S s)" (this export compiled it)
or "reused from the store" (an earlier export did); sizes are MiB with one
decimal; a sha256 is shown whole.
"""

from __future__ import annotations

import json
from collections import Counter

from kiln.core.outcome import routing_note

FORWARD_COLUMNS = ("bucket", "origin", "size_mib", "target", "key", "sha256")
"""The forwards table: what a reader looks for first, the hashes last."""


def origin(forward: dict) -> str:
    """Where a forward of this export comes from (a kiln.core.outcome.forward_records entry)."""
    if forward.get("compiled_by"):
        took = f" ({forward['compile_s']:.1f} s)" if forward.get("compile_s") is not None else ""
        return f"compiled by {forward['compiled_by']}{took}"
    return "reused from the store"


def mib(size_bytes: int | None) -> str:
    return "-" if size_bytes is None else f"{size_bytes / 2**20:.1f} MiB"


def forward_rows(forwards: list[dict]) -> list[dict]:
    """The forwards table's rows (FORWARD_COLUMNS)."""
    return [{"bucket": f["bucket"], "origin": origin(f), "size_mib": mib(f.get("size_bytes")),
             "target": f.get("target"), "key": f["key"], "sha256": f["sha256"]} for f in forwards]


def forward_counts(forwards: list[dict]) -> str:
    """'3 forwards: 1 compiled by host-0, 2 reused from the store' (origin counts, without timings)."""
    if not forwards:
        return "no forwards recorded"
    by = Counter(f"compiled by {f['compiled_by']}" if f.get("compiled_by") else "reused from the store"
                 for f in forwards)
    parts = [f"{n} {what}" for what, n in sorted(by.items())]
    return f"{len(forwards)} forward{'s' if len(forwards) != 1 else ''}: " + ", ".join(parts)


def checks_lines(verify: dict[str, dict]) -> list[str]:
    """Per host: ranks checked against eager, the largest measured difference and its limit, and which
    checks were remembered from an earlier verification (and when)."""
    out = []
    for host in sorted(verify):
        checks = verify[host]
        if not checks:
            out.append(f"- {host}: nothing to check")
            continue
        ranks = sorted({name.split("/")[0].removeprefix("rank") for name in checks}, key=int)
        worst_name, worst = max(checks.items(), key=lambda kv: kv[1]["diff"] / kv[1]["limit"])
        remembered = sorted({c["remembered"] for c in checks.values() if c.get("remembered")})
        again = len(checks) - sum(1 for c in checks.values() if c.get("remembered"))
        how = (f"{again} checked now" if again else "none checked now") + (
            f", {len(checks) - again} remembered from a verification on {', '.join(remembered)}"
            if remembered else "")
        out.append(f"- {host}: rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)} against eager, "
                   f"{len(checks)} check(s) ({how}); largest difference {worst['diff']:.2e} "
                   f"(limit {worst['limit']:.2e}, {worst_name}{routing_note(worst)})")
    return out


def worker_lines(hosts: dict[str, dict]) -> list[str]:
    """Per host the gate looked at: what one compile worker was counted at and why (kiln.core.gate.worker_words),
    what one worker needs with the floor, and what the compile processes peaked at, if they ran."""
    out = []
    for name in sorted(hosts):
        h = hosts[name]
        if not h.get("worker_words"):
            continue
        line = f"- {name}: {h['worker_words']}; with the headroom, one worker needs {h['required_one_mib']} MiB"
        peak = (h.get("compile_memory") or {}).get("peak_tree_mib")
        if peak:
            line += f"; this run's compile processes (all workers and their compilers) peaked at {peak} MiB"
        out.append(line)
    return out


def changed_lines(changed: dict[str, str]) -> list[str]:
    """The settings of this run that differ from the defaults, by their form titles."""
    if not changed:
        return ["Every setting has its default."]
    return [f"- {title}: `{value}`" for title, value in changed.items()]


def manifest_markdown(manifest: dict, where: str, *, max_rows: int = 20) -> str:
    """The manifest's contents for a reader: ranks and runtime, each forward's interface, the weights."""
    rt = manifest.get("runtime") or {}
    out = [f"# Manifest of `{manifest['export_id']}`", "", where, "",
           f"**Ranks:** {manifest['tp']} (world size {rt.get('world_size')}, process group "
           f"`{rt.get('process_group') or 'none'}`); Python-free: {'yes' if rt.get('python_free') else 'no'}; "
           f"signed: {'yes' if (manifest.get('signing') or {}).get('signed') else 'no'}", "",
           "## Forwards and their interface", "", "| bucket | inputs | outputs | sha256 |", "|---|---|---|---|"]
    for f in manifest.get("forwards", []):
        iface = f.get("interface") or {}
        out.append(f"| {f['bucket']} | {_args(iface.get('inputs'))} | {_args(iface.get('outputs'))} | "
                   f"`{f['sha256']}` |")
    weights = manifest.get("weights") or {}
    out += ["", f"## Weights ({len(weights)} constants per rank)", "", "| constant | from the checkpoint |",
            "|---|---|"]
    for name in sorted(weights)[:max_rows]:
        out.append(f"| `{name}` | {_entry(weights[name])} |")
    if len(weights) > max_rows:
        out.append(f"| ... | and {len(weights) - max_rows} more (in the manifest) |")
    return "\n".join(out) + "\n"


def _args(args) -> str:
    return "<br>".join(f"{a['name']} {a['dtype']} [{', '.join(map(str, a['shape']))}]" for a in args or [])


def _entry(entry) -> str:
    """One weight's layout entry as `key value; ...` (values as JSON)."""
    if not isinstance(entry, dict):
        return str(entry)
    return "; ".join(f"{k} {v if isinstance(v, str) else json.dumps(v)}" for k, v in entry.items()).replace("|", "\\|")
