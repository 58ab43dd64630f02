"""What a run's page says, in its reader's words: forwards by origin, checks, memory, changed settings,
the manifest's contents. Pure: markdown and table rows from the report's records.

Contracts: `origin` is one of "compiled by HOST (S s)" (this export compiled it)
or "reused from the store" (an earlier export did); sizes are MiB with one
decimal; the forwards table shortens keys and sha256s, the manifest's page shows them whole.
"""

from __future__ import annotations

import json
import re
from collections import Counter

from kiln.core.run.outcome import routing_note

REFUSED = "export refused before compiling: "
"""How every gate refusal's text begins (kiln.core.plan.gate)."""

GATE_WORDS = {"compile": "compiling", "nothing_to_do": "nothing to compile", "refused": "refused"}
"""The gate's decisions (kiln.core.plan.gate.Plan.decision, or 'refused') as the run's page says them."""


def state_message(error: Exception, why_final: str) -> str:
    """The flow run's final state message (the run's Details, the artifacts' side panel and the runs list
    show its start): the error itself first, then `why_final` ('not retried: ...') as its own sentence.

    A refusal of short hosts leads with who is short and by how much, then the fix, then the figures
    (a reader sees the start, the rest is one "See More" away); any other error is said as it is.
    """
    text = " ".join(str(error).split()).removeprefix(REFUSED)
    short = {h: f["short_mib"] for h, f in sorted(getattr(error, "short_hosts", {}).items()) if f.get("short_mib")}
    body, sep, fix = text.partition(" To fix: ")
    if short and sep:
        figures = re.sub(r"(\S+) is \d+ MiB short of one compile worker: ", r"\1: ", body).rstrip(".")
        headline = "; ".join(f"{h} is {mib} MiB short of one compile worker" for h, mib in short.items())
        text = f"{headline}. To fix: {fix.rstrip('.')}. The figures: {figures}"
    if not text.endswith("."):
        text += "."
    return f"{text} {why_final[:1].upper()}{why_final[1:]}."


def gate_line(gate: dict, error: str | None = None) -> str:
    """'**Gate:** nothing to compile: every forward is already in the store (when a host cannot compile:
    borrow)': the gate's outcome in words (a refusal said as the error above is not repeated)."""
    decision = gate.get("decision")
    words = GATE_WORDS.get(decision, decision or "not reached")
    message = gate.get("message")
    message = "see the error above" if message and message == error else message
    policy = f" (when a host cannot compile: {gate['policy']})" if gate.get("policy") else ""
    return f"**Gate:** {words}" + (f": {message}" if message else "") + policy

FORWARD_COLUMNS = ("shapes", "origin", "size (MiB)", "target", "key", "sha256")
"""The forwards table: what a reader looks for first, the hashes last and short (the manifest has them whole)."""

SHORT_HEX = 12
"""Hex digits of a key or sha256 the forwards table shows: it fits a 1400 px page; the manifest holds all 64."""


def origin(forward: dict) -> str:
    """Where a forward of this export comes from (a kiln.core.run.outcome.forward_records entry)."""
    if forward.get("compiled_by"):
        took = f" ({forward['compile_s']:.1f} s)" if forward.get("compile_s") is not None else ""
        return f"compiled by {forward['compiled_by']}{took}"
    return "reused from the store"


def mib(size_bytes: int | None) -> str:
    return "-" if size_bytes is None else f"{size_bytes / 2**20:.1f} MiB"


def short(hex_digest: str | None) -> str:
    """The first SHORT_HEX digits and an ellipsis (the whole digest is in the manifest)."""
    if not hex_digest:
        return "-"
    return hex_digest if len(hex_digest) <= SHORT_HEX else f"{hex_digest[:SHORT_HEX]}…"


def forward_rows(forwards: list[dict]) -> list[dict]:
    """The forwards table's rows (FORWARD_COLUMNS): sizes as numbers under a MiB header, keys and
    sha256s shortened."""
    return [{"shapes": f["shapes"], "origin": origin(f),
             "size (MiB)": "-" if f.get("size_bytes") is None else f"{f['size_bytes'] / 2**20:.1f}",
             "target": f.get("target"), "key": short(f["key"]), "sha256": short(f["sha256"])} for f in forwards]


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
    """Per host the gate looked at: what one compile worker was counted at and why (kiln.core.plan.gate.worker_words),
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
           "## Forwards and their interface", "", "Each sha256 by its first 12 hex digits (the manifest has all 64).",
           "", "| shapes | inputs | outputs | sha256 |", "|---|---|---|---|"]
    for f in manifest.get("forwards", []):
        iface = f.get("interface") or {}
        out.append(f"| {f['shapes']} | {_args(iface.get('inputs'))} | {_args(iface.get('outputs'))} | "
                   f"`{short(f['sha256'])}` |")
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
    """One weight's layout entry for a table cell: a kiln.core.model.contract.weight_layout entry in words (each
    source on its own line), any other as `key value; ...` (values as JSON)."""
    if not isinstance(entry, dict):
        return str(entry)
    if "sources" in entry:
        head = f"{entry.get('dtype')} [{', '.join(map(str, entry.get('shape') or []))}]"
        if entry.get("stack"):
            head += f", {entry['stack']} sources stacked"
        return "<br>".join([head] + [_source(s) for s in entry["sources"]]).replace("|", "\\|")
    return "; ".join(f"{k} {v if isinstance(v, str) else json.dumps(v)}" for k, v in entry.items()).replace("|", "\\|")


def _source(source: dict) -> str:
    """'`tensor` [full shape]' and, on a line of its own (a cell's code does not wrap), how ranks take it:
    'whole on every rank' or 'dim D: LENGTH per rank, from offsets 0, 32'."""
    text = f"`{source.get('tensor')}` [{', '.join(map(str, source.get('full_shape') or []))}]"
    cut = source.get("cut")
    if not cut:
        return f"{text}<br>whole on every rank"
    offsets = ", ".join(map(str, cut.get("offsets") or []))
    return f"{text}<br>dim {cut.get('dim')}: {cut.get('length')} per rank, from offsets {offsets}"
