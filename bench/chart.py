"""The results chart: one horizontal bar per figure, its target marked, met in green, missed in red."""

from __future__ import annotations

from pathlib import Path

from bench.figures import FIGURES, Target


def write_chart(result: dict, path: Path) -> Path | None:
    """Write a PNG of `result`'s figures (log scale); None when there is nothing to plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = {n: v for n, v in result.get("figures", {}).items() if v is not None and v > 0}
    names = [n for n in FIGURES if n in figures] + sorted(set(figures) - set(FIGURES))
    if not names:
        return None
    targets = {n: Target(t["op"], t["bound"]) for n, t in result.get("targets", {}).items()}
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(names) + 1.6))
    for i, name in enumerate(names):
        target = targets.get(name)
        met = target.met(figures[name]) if target else None
        color = {True: "#2e7d32", False: "#c62828", None: "#9e9e9e"}[met]
        ax.barh(i, figures[name], color=color)
        ax.text(figures[name], i, f" {figures[name]:.3g}", va="center", fontsize=8)
        if target:
            ax.plot([target.bound, target.bound], [i - 0.4, i + 0.4], color="black", linewidth=2)
    ax.set_xscale("log")
    ax.set_yticks(range(len(names)), labels=names, fontsize=8)
    ax.invert_yaxis()
    m = result.get("machine", {})
    ax.set_title(f"Kiln bench {result.get('stamp', '')} ({result.get('mode', '')}); "
                 f"load avg mean {m.get('load_mean', 0) or 0:.1f} on {m.get('cpus', '?')} CPUs\n"
                 "green met, red missed, grey no target; black tick = target", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
