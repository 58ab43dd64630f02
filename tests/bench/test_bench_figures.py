"""The bench's pure pieces: ratio arithmetic, targets, the capture sizes, the gate on paper, the table."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench.figures import (
    FIGURES,
    Target,
    compile_efficiency,
    less,
    median,
    ratio,
    render_markdown,
    round_floats,
    targets_for,
    throughput_mib_s,
)
from bench.scale import capture_sizes, scale_layout, simulate
from kiln.core.errors import BadInput


def test_pure_modules_import_no_torch_prefect_or_boto3():
    code = ("import sys, bench.alternating, bench.figures, bench.scale, bench.context; "
            "print(sorted(m for m in ('torch', 'prefect', 'boto3') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("op,bound,value,met", [
    ("<=", 0.1, 0.1, True), ("<=", 0.1, 0.11, False), ("<", 1.0, 1.0, False), ("<", 1.0, 0.5, True),
    (">=", 0.85, 0.85, True), (">=", 0.9, 0.89, False), ("==", 0.5, 0.5, True), ("==", 1 / 3, 0.34, False),
])
def test_target_met(op, bound, value, met):
    assert Target(op, bound).met(value) is met


def test_target_without_a_finite_value_is_undecided():
    assert Target("<=", 0.1).met(None) is None
    assert Target("<=", 0.1).met(float("nan")) is None


def test_ratio_and_less_refuse_to_invent_numbers():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(1.0, 0.0) is None and ratio(None, 2.0) is None and ratio(1.0, None) is None
    assert less(30.0, 12.5) == 17.5
    assert less(10.0, 12.5) == 0.0  # a fixed cost larger than the total leaves nothing, not a negative time
    assert less(None, 1.0) is None and less(1.0, None) is None


def test_median_skips_missing_values():
    assert median([3.0, None, 1.0, 2.0]) == 2.0
    assert median([None]) is None


def test_compile_efficiency_is_ideal_over_measured():
    e = compile_efficiency([20.0, 20.0, 20.0, 20.0], workers=2, phase_wall_s=50.0)
    assert e["ideal_s"] == 40.0 and e["efficiency"] == pytest.approx(0.8)
    assert compile_efficiency([20.0], workers=0, phase_wall_s=10.0)["efficiency"] is None


def test_throughput():
    assert throughput_mib_s(64 * 2**20, 2.0) == 32.0


def test_dedup_target_follows_tp():
    assert targets_for(2)["dedup_ratio"] == Target("==", 0.5)
    assert targets_for(4)["dedup_ratio"].bound == 0.25
    assert "dedup_ratio" not in targets_for(None)


def test_every_targeted_figure_is_described():
    assert set(targets_for(2)) <= set(FIGURES)


def test_round_floats_drops_non_finite():
    assert round_floats({"a": [1.234567, float("inf")], "b": 2}) == {"a": [1.2346, None], "b": 2}


def test_round_floats_keeps_a_small_difference():
    """A max difference of 3.7e-06 between two packages reads as that, not as 0 (bitwise equal)."""
    assert round_floats([3.6656856e-06, -2.5e-07, 0.0, 0.00012345]) == [3.666e-06, -2.5e-07, 0.0, 0.0001]


def test_capture_sizes_of_a_common_serving_engine():
    sizes = capture_sizes()
    assert len(sizes) == 67
    assert sizes[:6] == [1, 2, 4, 8, 16, 24] and sizes[-1] == 512
    assert sizes == sorted(set(sizes))
    assert capture_sizes(16) == [1, 2, 4, 8, 16]


def test_paper_layout_has_lenders_and_every_key_is_compiled_once():
    layout = scale_layout(num_hosts=64, ranks_per_host=8)
    assert layout["num_ranks"] == 512 and layout["num_buckets"] == 67
    sim = simulate(20.0, repeats=2)
    assert sim["forwards_compiled"] == 67
    assert sim["hosts_lending"] > 0 and sim["hosts_compiling"] > 0
    assert sim["predicted_s"] >= 20.0
    assert len(sim["gate_run_s"]) == 2


def test_fewer_slots_than_forwards_predicts_several_rounds():
    sim = simulate(10.0, repeats=1, num_hosts=4, ranks_per_host=2)
    assert sim["compile_slots"] < 67
    assert sim["predicted_s"] >= 10.0 * (67 // sim["compile_slots"])


def _result(**figures) -> dict:
    return {"stamp": "20260101T000000Z", "mode": "quick", "parts": ["x"], "suite_s": 12.0,
            "machine": {"cpus": 2, "load_start": 1.0, "load_mean": 2.5, "load_max": 4.0},
            "figures": figures, "targets": {n: {"op": t.op, "bound": t.bound} for n, t in targets_for(2).items()},
            "notes": {"fail_fast": "what it includes"}, "errors": {"borrow": "BenchFailed: boom"}}


def test_markdown_table_gives_value_target_and_verdict():
    md = render_markdown(_result(fail_fast_ratio=0.05, warm_cold_ratio=0.4, borrow_ratio=1.2, extra_figure=3.0))
    rows = {line.split("|")[1].strip(): line for line in md.splitlines() if line.startswith("| `")}
    assert "| 0.05 | <= 0.1 | met |" in rows["`fail_fast_ratio`"]
    assert "| 0.4 | <= 0.1 | **missed** |" in rows["`warm_cold_ratio`"]
    assert "| 1.2 | - | - |" in rows["`borrow_ratio`"]
    assert "`extra_figure`" in rows
    assert "load average 1 at start, 2.5 mean / 4 max" in md
    assert "- `borrow`: BenchFailed: boom" in md and "- **fail_fast**: what it includes" in md


def test_select_parts():
    from bench.suite import PARTS, select

    assert select([], quick=False) == list(PARTS)
    assert "borrow" not in select([], quick=True)
    assert select(["gate_scale", "borrow"], quick=True) == ["borrow", "gate_scale"]  # suite order
    with pytest.raises(BadInput, match="unknown bench part"):
        select(["nope"], quick=False)


def test_write_results_writes_json_markdown_and_chart(tmp_path):
    from bench.suite import write_results

    paths = write_results(_result(fail_fast_ratio=0.05, gate_scale_s=0.003, dedup_ratio=0.5), tmp_path)
    assert json.loads(paths["json"].read_text())["figures"]["dedup_ratio"] == 0.5
    assert "`gate_scale_s`" in paths["md"].read_text()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


REPO = Path(__file__).resolve().parents[2]


def _quoted(doc: str) -> set[str]:
    return set(re.findall(r"bench/results/(\d{8}T\d{6}Z)\.(?:md|json|png)", (REPO / doc).read_text()))


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout


def _history_or_skip() -> None:
    try:
        shallow = _git("rev-parse", "--is-shallow-repository").strip()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the commit rule needs the repository's history")
    if shallow == "true":
        pytest.skip("a shallow clone: the commit rule needs the repository's history (git fetch --unshallow)")


def test_the_readme_quotes_only_results_files_that_exist():
    """Figures in the READMEs come from a committed results file; a stale or invented reference fails.

    README.md points at the latest results; bench/README.md holds the figures themselves."""
    assert _quoted("README.md"), "the README quotes no results file"
    assert _quoted("bench/README.md"), "bench/README.md quotes no results file"
    for doc in ("README.md", "bench/README.md"):
        for stamp in _quoted(doc):
            assert (REPO / "bench" / "results" / f"{stamp}.json").exists(), f"{doc} quotes {stamp}, not committed"
            assert (REPO / "bench" / "results" / f"{stamp}.md").exists(), f"{doc} quotes {stamp}, not committed"


def test_quoted_figures_describe_the_code_that_publishes_them():
    """The commit rule: a quoted results file names the commit it measured, measured with no uncommitted
    change to the code, and between that commit and the one that added the file nothing changed in the
    code the figures describe (kiln/, flows/, tasks/, blocks/, cli/, bench/ but its results and markdown).
    The publishing commit is the latest that added the file or a quote of it."""
    from bench.suite import MEASURED_CODE

    _history_or_skip()
    for stamp in _quoted("README.md") | _quoted("bench/README.md"):
        path = f"bench/results/{stamp}.json"
        machine = json.loads((REPO / path).read_text())["machine"]
        measured = machine.get("commit")
        assert measured, f"{path} does not record the commit it measured"
        assert machine.get("code_changed") == [], f"{path} was measured with uncommitted changes: " \
                                                  f"{machine.get('code_changed')}"
        # The publishing commit: the latest that added the results file or a README's quote of it.
        publishing = _git("log", "-1", "--format=%H", f"-S{stamp}", "--", path, "README.md", "bench/README.md").strip()
        assert publishing, f"{path} is not committed"
        changed = _git("diff", "--name-only", measured, publishing, "--", *MEASURED_CODE,
                       ":(exclude)bench/results", ":(exclude)*.md").split()
        assert not changed, f"{path} measured {measured[:10]}, but {publishing[:10]} publishes it after " \
                            f"changing {changed}: rerun `kiln bench` on the code you publish"


def test_the_suite_takes_alternating_samples_and_keeps_them(tmp_path, monkeypatch):
    """Every part runs once per sample, in a fresh work directory, its sides' order flipping each time;
    the figure is the median and the JSON keeps every sample with its spread."""
    import bench.suite as suite

    seen = []

    def part_a(ctx):
        seen.append((ctx.sample, ctx.forward_order, ctx.ordered(["x", "y"]), ctx.work.root.name))
        return {"figures": {"a_ratio": [0.3, 0.1, 0.2][ctx.sample]}, "raw": {"sample": ctx.sample}, "notes": "a"}

    def part_inside(ctx):
        return {"figures": {"b_ratio": 2.0}, "samples": {"b_ratio": [1.0, 2.0, 3.0, 4.0, 5.0]}, "raw": {},
                "notes": "b"}

    monkeypatch.setattr(suite, "PARTS", {"a": part_a, "collective": part_inside})
    assert suite.run_suite([], out_dir=str(tmp_path)) == 0
    assert [s[:3] for s in seen] == [(0, True, ["x", "y"]), (1, False, ["y", "x"]), (2, True, ["x", "y"])]
    assert len({s[3] for s in seen}) == 3  # a fresh work directory per sample
    (out,) = tmp_path.glob("*.json")
    result = json.loads(out.read_text())
    assert result["figures"] == {"a_ratio": 0.2, "b_ratio": 3.0}
    assert result["figure_samples"]["a_ratio"] == {"values": [0.3, 0.1, 0.2], "n": 3, "min": 0.1, "max": 0.3}
    assert result["figure_samples"]["b_ratio"]["n"] == 5  # a part that samples inside runs once
    assert [r["sample"] for r in result["raw"]["a"]["samples"]] == [0, 1, 2]
    assert result["settings"]["samples"] == 3 and "commit" in result["machine"]
    assert "| `a_ratio` | 0.2 (0.1-0.3, n=3) |" in out.with_suffix(".md").read_text()


def test_the_cli_names_every_bench_part():
    """`kiln bench --help` lists the parts the suite has (the help text is not derived, so it is held here)."""
    from bench.suite import PARTS

    out = subprocess.run([sys.executable, "-m", "cli.main", "bench", "--help"], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout
    assert all(name in " ".join(out.split()) for name in PARTS), out
