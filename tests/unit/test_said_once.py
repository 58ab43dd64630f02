"""An expected error is said once in a run's log (kiln.core.run.said_once): the text rules, without logging."""

from __future__ import annotations

from kiln.core.errors import GateRefused
from kiln.core.run.said_once import FLOW_SAYS_WHY, SAID_ABOVE, SaidOnce

REFUSAL = GateRefused("export refused before compiling: host-1 is 1200 MiB short of one compile worker")


def test_a_task_line_names_the_error_and_points_to_the_flow_run():
    said = SaidOnce()
    line = said.task_line(f"Task run failed with exception: {REFUSAL!r} - Retries are exhausted", REFUSAL)
    assert line == f"Task run failed with exception: GateRefused {FLOW_SAYS_WHY} - Retries are exhausted"
    # A later task line quoting the text (Prefect's "Finished in state Failed('...')") points there too.
    later = said.task_line(f"Finished in state Failed('{REFUSAL}')", None)
    assert later == f"Finished in state Failed({FLOW_SAYS_WHY})"  # the quoted text, quotes and all


def test_the_flow_says_the_text_once_then_refers_to_it():
    said = SaidOnce()
    assert said.flow_line(f"gate: {REFUSAL}", [REFUSAL]) == f"gate: {REFUSAL}"  # said in full, once
    assert said.flow_line(f"Finished in state Failed('GateRefused: {REFUSAL}')", []) == \
        f"Finished in state Failed('GateRefused: {SAID_ABOVE}')"


def test_a_short_text_is_said_again_and_an_unrelated_line_is_kept():
    said = SaidOnce()
    short = GateRefused("no hosts")
    said.flow_line(f"gate: {short}", [short])
    assert said.flow_line(f"again: {short}", []) == "again: no hosts"
    assert said.flow_line("took the model lease kiln-model-tiny after 0.1 s", []) == \
        "took the model lease kiln-model-tiny after 0.1 s"
    said.say("a state message set by the retry rule")  # counted as said although never logged here
    assert said.flow_line("Failed('a state message set by the retry rule')", []) == f"Failed('{SAID_ABOVE}')"
