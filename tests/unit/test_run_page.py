"""What a run's page says (kiln.core.run.run_page, the gate's worker figure, the log filter): pure, no server."""

from __future__ import annotations

import logging

from flows.logs import HideExpectedTracebacks
from kiln.core.run import run_page
from kiln.core.errors import GateRefused
from kiln.core.plan.gate import worker_words
from kiln.core.plan.recipe import Recipe

SHA = "ab" * 32


def fwd(bucket: str, compiled_by: str | None = None, compile_s: float | None = None) -> dict:
    return {"shapes": bucket, "key": f"k{bucket}", "sha256": SHA, "size_bytes": 3 * 2**20 // 2, "target": "cpu",
            "compiled_by": compiled_by, "compile_s": compile_s}


def test_forwards_are_counted_and_shown_by_origin_with_mib_and_a_short_sha256():
    forwards = [fwd("1x8", "host-0", 12.34), fwd("2x8", "host-1", 3.0), fwd("4x8")]
    assert run_page.forward_counts(forwards) == \
        "3 forwards: 1 compiled by host-0, 1 compiled by host-1, 1 reused from the store"
    rows = run_page.forward_rows(forwards)
    assert list(rows[0]) == list(run_page.FORWARD_COLUMNS)
    assert [r["origin"] for r in rows] == ["compiled by host-0 (12.3 s)", "compiled by host-1 (3.0 s)",
                                           "reused from the store"]
    # The header says the unit, the cells the number; hashes short enough for a 1400 px page.
    assert rows[0]["size (MiB)"] == "1.5" and rows[0]["sha256"] == SHA[:12] + "…"
    assert list(rows[0])[-2:] == ["key", "sha256"]


def test_checks_give_ranks_the_worst_difference_its_limit_and_what_was_remembered():
    verify = {"h": {"rank0/1x8": {"diff": 1e-6, "limit": 1e-3},
                    "rank1/1x8": {"diff": 2e-6, "limit": 1e-3, "remembered": "2026-01-01T10:00:00+00:00"}}}
    [line] = run_page.checks_lines(verify)
    assert line == ("- h: ranks 0, 1 against eager, 2 check(s) (1 checked now, 1 remembered from a verification on "
                    "2026-01-01T10:00:00+00:00); largest difference 2.00e-06 (limit 1.00e-03, rank1/1x8)")


def test_one_worker_figure_says_where_it_comes_from():
    r = Recipe()
    assert worker_words(r, 885, 770) == "a worker counted at 885 MiB: its measured peak 770 MiB x margin 1.15"
    assert worker_words(r, None, None) == "a worker counted at 1024 MiB, the estimate before anything was measured"
    set_ = r.replace(worker_host_mib=2048, worker_device_mib=2048)
    assert worker_words(set_, 885, 770, cuda=True, unified=True) == \
        "a worker counted at 2048 MiB, as set in the recipe, + 2048 MiB device memory"
    assert worker_words(set_, 885, 770, cuda=True, unified=False) == \
        "a worker counted at 2048 MiB, as set in the recipe; and 2048 MiB of device memory on its GPU"
    # A CPU export's worker touches no device, whatever worker_device_mib says.
    assert worker_words(set_, 885, 770, cuda=False) == "a worker counted at 2048 MiB, as set in the recipe"


def test_changed_settings_and_the_manifest_in_words():
    assert run_page.changed_lines({}) == ["Every setting has its default."]
    assert run_page.changed_lines({"Recipe > Buckets": "1x8"}) == ["- Recipe > Buckets: `1x8`"]
    manifest = {"export_id": "e", "tp": 2, "runtime": {"world_size": 2, "process_group": "0", "python_free": True},
                "signing": {"signed": True},
                "forwards": [{"shapes": "1x8", "sha256": SHA, "interface": {
                    "inputs": [{"name": "tokens", "dtype": "int64", "shape": [1, 8]}],
                    "outputs": [{"name": "logits", "dtype": "float32", "shape": [1, 8, 32]}]}}],
                "weights": {f"w{i}": {"source": f"w{i}", "split": None} for i in range(3)}}
    text = run_page.manifest_markdown(manifest, "Stored at `x`", max_rows=2)
    assert "**Ranks:** 2 (world size 2, process group `0`); Python-free: yes; signed: yes" in text
    assert f"| 1x8 | tokens int64 [1, 8] | logits float32 [1, 8, 32] | `{SHA[:12]}…` |" in text
    assert "## Weights (3 constants per rank)" in text and "| `w0` | source w0; split null |" in text
    assert "and 1 more (in the manifest)" in text


def test_an_expected_error_is_said_once_in_the_log():
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("test_run_page")
    handler = Keep()
    handler.addFilter(HideExpectedTracebacks())
    log.addHandler(handler)
    log.propagate = False
    refusal = GateRefused("export refused before compiling: h has 10 MiB available but needs 20 MiB: 10 MiB short")
    try:
        task_log = logging.getLogger("prefect.task_runs.test")
        task_log.addHandler(handler)
        task_log.propagate = False
        task_log.error("Task run failed with exception: %r", refusal, exc_info=(GateRefused, refusal, None))
        log.error("gate: %s", refusal)
        log.error("Finished in state Failed('Flow run encountered an exception: GateRefused: %s')", refusal)
    finally:
        log.removeHandler(handler)
        task_log.removeHandler(handler)
    assert sum("MiB short" in r for r in records) == 1 and "MiB short" in records[1], records
    assert records[0] == "Task run failed with exception: GateRefused (the flow run's log says why)"
    assert records[2] == "Finished in state Failed('Flow run encountered an exception: GateRefused: (said above)')"


def test_a_weights_layout_entry_is_said_in_words_each_source_on_its_line():
    entry = {"dtype": "float32", "shape": [32, 64], "stack": None, "sources": [
        {"tensor": "layers.0.q.weight", "full_shape": [64, 64], "cut": {"dim": 0, "length": 32, "offsets": [0, 32]}},
        {"tensor": "norm.weight", "full_shape": [64], "cut": None}]}
    assert run_page._entry(entry) == ("float32 [32, 64]<br>`layers.0.q.weight` [64, 64]<br>dim 0: 32 per rank, from "
                                      "offsets 0, 32<br>`norm.weight` [64]<br>whole on every rank")


def test_the_state_message_starts_with_the_shortfall_and_the_fix():
    refusal = GateRefused("export refused before compiling: h is 10 MiB short of one compile worker: it has 10 MiB "
                          "available but one worker needs 20 MiB (headroom 5 MiB + a worker counted at 15 MiB); g can "
                          "run no compile worker (0 CPUs). To fix: set Recipe > 'Headroom floor (MiB)' to 5.",
                          {"h": {"short_mib": 10}, "g": {"short_mib": 0}})
    assert run_page.state_message(refusal, "not retried: a refusal is final") == (
        "h is 10 MiB short of one compile worker. To fix: set Recipe > 'Headroom floor (MiB)' to 5. The figures: h: it "
        "has 10 MiB available but one worker needs 20 MiB (headroom 5 MiB + a worker counted at 15 MiB); g can run no "
        "compile worker (0 CPUs). Not retried: a refusal is final.")
    # Any other error (a KV refusal, bad input) as it is, then why no try follows.
    assert run_page.state_message(GateRefused("export refused before compiling: the KV plan leaves 0 pages"),
                                  "not retried: x") == "the KV plan leaves 0 pages. Not retried: x."
    assert run_page.state_message(ValueError("bad bucket"), "not retried: BadInput fails the same way every time") \
        == "bad bucket. Not retried: BadInput fails the same way every time."


def test_the_gate_outcome_in_words():
    assert run_page.gate_line({"decision": "nothing_to_do", "policy": "fail",
                               "message": "every forward is already in the store"}) == \
        "**Gate:** nothing to compile: every forward is already in the store (when a host cannot compile: fail)"
    assert run_page.gate_line({"decision": "refused", "policy": "borrow", "message": "x"}, "x") == \
        "**Gate:** refused: see the error above (when a host cannot compile: borrow)"
    assert run_page.gate_line({"decision": None, "policy": None, "message": None}) == "**Gate:** not reached"
