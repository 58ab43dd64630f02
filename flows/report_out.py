"""The export report's outputs: its JSON file (`write_report`) and its memory ledger as a picture (`draw`).

kiln.core.run.report builds the report, pure; writing and drawing are edges. `draw`
(matplotlib, Agg backend, no display) takes the report's host entries and
returns PNG bytes: per host, per phase boundary, host available and device free
MiB. The flow stores them with the export (`ledger_key`) and links them from
the run's summary.
"""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path

from kiln.core.trust.key_rules import sha256_bytes
from kiln.core.trust.layout import ledger_picture_key


def write_report(report, path: str | os.PathLike) -> None:
    """Write `report` (kiln.core.run.report.Report) as JSON at `path`, whole or not at all (a temporary file
    renamed over it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(report.to_dict(), indent=2, default=str))
    os.replace(tmp, path)


def ledger_key(export_id: str, png: bytes) -> str:
    """Store key of one drawing: content-addressed, so every try of an export keeps its own picture."""
    return ledger_picture_key(export_id, sha256_bytes(png)[:12])


def draw(hosts: list[dict], *, title: str = "memory ledger") -> bytes:
    """PNG of every host's memory at every phase boundary (one panel per host, MiB on the y axis).

    `hosts` are the report's host entries: {'name', 'memory': [{'phase',
    'host_available_mib', 'device_free_mib', 'assumed_available_mib'?}, ...]}.
    A host without a device shows only its available memory; an assumed figure
    (--assume-available) is drawn as a dashed line; the memory one compile worker
    needs ('required_one_mib', from the gate) as a dotted line, the lowest
    reading while compiling (phase 'compile (lowest)') as a triangle whose label
    gives the compile process tree's peak ('compile_memory.peak_tree_mib'), and
    for a refusal ('short_mib') the shortfall as an arrow.
    """
    import matplotlib

    matplotlib.use("Agg", force=True)
    from matplotlib.figure import Figure

    hosts = [h for h in hosts if h.get("memory")] or [{"name": "(no host reported)", "memory": []}]
    fig = Figure(figsize=(9, 2.2 + 3.4 * len(hosts)), dpi=100, layout="constrained")
    axes = fig.subplots(len(hosts), 1, squeeze=False)[:, 0]
    for ax, host in zip(axes, hosts):
        rows = host["memory"]
        x = list(range(len(rows)))
        phases = [r["phase"] for r in rows]
        avail = [r.get("host_available_mib") for r in rows]
        ax.plot(x, avail, marker="o", label="host available")
        if any(r.get("device_free_mib") is not None for r in rows):
            ax.plot(x, [r.get("device_free_mib") for r in rows], marker="s", label="device free")
        if any("assumed_available_mib" in r for r in rows):
            ax.plot(x, [r.get("assumed_available_mib") for r in rows], linestyle="--",
                    marker="x", label="assumed available")
        if host.get("required_one_mib"):
            ax.axhline(host["required_one_mib"], color="tab:red", linestyle=":", linewidth=1.2,
                       label=f"one compile worker needs {host['required_one_mib']} MiB with the headroom"
                             + (f"\n({host['worker_words']})" if host.get("worker_words") else ""))
        if host.get("short_mib") and rows and avail[-1] is not None:  # a refusal: the gap itself
            ax.annotate("", xy=(x[-1], host["required_one_mib"]), xytext=(x[-1], avail[-1]),
                        arrowprops={"arrowstyle": "<->", "color": "tab:red"})
            ax.annotate(f"{host['short_mib']} MiB short", (x[-1], (avail[-1] + host["required_one_mib"]) / 2),
                        textcoords="offset points", xytext=(-8, 0), ha="right", color="tab:red", fontsize=9)
        peak = (host.get("compile_memory") or {}).get("peak_tree_mib")
        for xi, row in zip(x, rows):
            if row["phase"] == "compile (lowest)" and row.get("host_available_mib") is not None:
                label = "lowest while compiling" + (
                    f"\n(compile processes, all workers and compilers: peak {peak} MiB)" if peak else "")
                ax.plot([xi], [row["host_available_mib"]], marker="v", color="tab:orange", markersize=9,
                        linestyle="none", label=label)
        for xi, value in zip(x, avail):
            if value is not None:
                ax.annotate(f"{value}", (xi, value), textcoords="offset points", xytext=(0, 6),
                            ha="center", fontsize=7)
        ax.set_title(f"host {host['name']}", fontsize=10, loc="left")
        ax.set_ylabel("MiB")
        ax.set_ylim(bottom=0)  # from zero: a small dip must look small
        ax.set_xticks(x, phases, rotation=30, ha="right", fontsize=8)
        ax.grid(True, alpha=0.3)
        if rows:  # below the panel: inside, it covered the lines it names
            ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(0.0, -0.32), ncol=2, frameon=False)
    fig.suptitle(title, fontsize=11)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def markdown(png: bytes, where: str | None, url: str | None = None) -> str:
    """A markdown page showing the picture inline (a data URI, so no store access is needed) and where it
    is stored: `where` as a link to `url` when a browser can open it, else as a path."""
    data = base64.b64encode(png).decode("ascii")
    if where is None:
        where = " Not stored: the export stopped before writing anything."
    else:
        where = f" Stored at [{where}]({url})" if url else f" Stored at `{where}`"
    return (f"# Memory ledger\n\nEvery host's memory at every phase boundary (MiB).{where}\n\n"
            f"![memory ledger](data:image/png;base64,{data})\n")
