"""The export flow as Prefect sees it, without a server: one parameter model, retries (the documented
defaults, and which failures are made final), lease names."""

from __future__ import annotations

import logging
import pickle
import uuid
from concurrent.futures.process import BrokenProcessPool
from types import SimpleNamespace

import cloudpickle
import pytest

from flows import retry
from flows.export import export
from flows.model_lease import lease_name
from flows.params import ExportParams
from flows.serve import deployment_parameters
from kiln.core.errors import BadInput, CheckCrashed, GateRefused, HostsLost, IntegrityError, StoreError
from kiln.core.run.retry_rule import mark_retried_in_task
from kiln.host.compile.compiler import CompileFailed
from kiln.core.plan.recipe import SETTINGS


def test_the_flow_parameters_are_top_level_fields_with_defaults():
    schema = export.parameters.model_dump()
    form = schema["properties"]
    assert list(form) == list(ExportParams.model_fields)  # derived: one parameter per field, in order
    assert not schema.get("required")  # every parameter has its default: the plain Run button works
    assert form["tp"]["default"] == 2 and form["tp"]["minimum"] == 1 and form["model"]["default"] == "tiny"
    assert all(form[name].get("description") for name in form)
    recipe = schema["definitions"]["RecipeSettings"]["properties"]
    assert sorted(recipe) == sorted(s.name for s in SETTINGS)  # every setting, typed (listed by section)
    assert recipe["policy"]["enum"] == ["borrow", "fail"] and recipe["policy"]["default"] == "borrow"
    assert "settings" not in form  # no NAME=VALUE list
    pair = schema["definitions"]["HostMemory"]["properties"]
    assert form["assume_available"]["type"] == "array" and set(pair) == {"host", "mib"}


def _schema_nodes(node, path="$"):
    """Every (path, sub-schema) of a JSON schema."""
    if isinstance(node, dict):
        yield path, node
        for k, v in node.items():
            yield from _schema_nodes(v, f"{path}/{k}")
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _schema_nodes(v, f"{path}[{i}]")


def test_the_run_form_has_no_type_switches_and_human_titles():
    """What the Prefect UI renders as the run form: no `X | None` (a type switch), every label a title a
    reader reads (no snake_case), optional fields with a typed default (dtype: the checkpoint's)."""
    schema = export.parameters.model_dump()
    nullable = [p for p, n in _schema_nodes(schema) for alt in n.get("anyOf", []) if alt.get("type") == "null"]
    assert not nullable, nullable
    assert not [p for p, n in _schema_nodes(schema) if n.get("type") == "null"]
    props = [(p, n) for p, n in _schema_nodes(schema) if p.endswith("/properties")]
    titles = {f"{p}/{name}": field.get("title") for p, n in props for name, field in n.items()}
    assert all(titles.values()) and not {p: t for p, t in titles.items() if "_" in t}, titles
    assert schema["properties"]["s3_endpoint"]["title"] == "S3 endpoint"
    assert schema["properties"]["dtype"]["default"] == "checkpoint" and "float32" in schema["properties"]["dtype"]["enum"]
    recipe = schema["definitions"]["RecipeSettings"]["properties"]
    assert recipe["kv_max_pages"]["title"] == "Most KV pages per rank"
    assert not [n for n, f in recipe.items() if "kiln " in f["description"] or "--" in f["description"]]
    # In the form's order: model and layout first, then the store; the recipe's sections in GROUPS order.
    assert list(schema["properties"])[:3] == ["model", "tp", "dtype"]
    assert [schema["properties"][n]["position"] for n in schema["properties"]] == list(range(len(schema["properties"])))


def test_the_served_flow_retries_twice_30_s_apart():
    # The documented defaults (docs/recipe.md, docs/operations.md), as literals, on the copy a served run gets.
    flow = pickle.loads(cloudpickle.dumps(export))
    assert (flow.retries, flow.retry_delay_seconds) == (2, 30)


class _Try:
    """One try of the export flow as `flows.retry.resumable` sees it, without a server: the flow run
    context is faked and every change of the run's retry policy is recorded instead of sent. (The policy
    reaching a real server is tested end to end in tests/ops/test_retry_resume.py.)"""

    def __init__(self, monkeypatch, run_count: int = 1):
        self.policies: list[dict] = []
        run = SimpleNamespace(id=uuid.uuid4(), run_count=run_count, expected_start_time=None, start_time=None)
        monkeypatch.setattr(retry, "FlowRunContext", SimpleNamespace(get=lambda: SimpleNamespace(flow_run=run)))
        monkeypatch.setattr(retry, "get_run_logger", lambda: logging.getLogger("test_flow_contract"))
        monkeypatch.setattr(retry, "_set_policy", lambda run_id, **policy: self.policies.append(policy))

    def run(self, params: ExportParams, fail_with: BaseException | None = None):
        """Runs one try whose body raises `fail_with` (if given); returns the try's (params, recipe)."""
        with retry.resumable(params) as (try_params, recipe):
            if fail_with is not None:
                raise fail_with
        return try_params, recipe

    def retries_left(self) -> int:
        """The run's retries as the server would hold them after the try: the last policy set."""
        return self.policies[-1]["retries"]


def test_a_try_sets_the_runs_retries_from_its_recipe(monkeypatch):
    t = _Try(monkeypatch)
    params, _ = t.run(ExportParams(recipe={"flow_retries": 5, "flow_retry_delay_s": 7}))
    assert t.policies == [{"retries": 5, "delay_s": 7}]
    assert params.export_id  # fixed for the run: every try writes the same export


@pytest.mark.parametrize("error", [GateRefused("not enough memory"), BadInput("bad bucket"),
                                   IntegrityError("sha256 mismatch")], ids=type)
def test_a_deterministic_failure_is_not_retried(monkeypatch, error):
    t = _Try(monkeypatch)
    with pytest.raises(type(error)):
        t.run(ExportParams(), fail_with=error)
    assert t.retries_left() == 0


def test_a_failure_before_the_recipe_is_read_is_not_retried(monkeypatch):
    t = _Try(monkeypatch)

    def bad_recipe(params):
        raise BadInput("recipe block 'nope' not found")

    monkeypatch.setattr(retry, "build_recipe", bad_recipe)
    with pytest.raises(BadInput):
        t.run(ExportParams())
    assert t.policies == [{"retries": 0}]


@pytest.mark.parametrize("error", [ConnectionError("store unreachable"), HostsLost("host-1 gone")], ids=type)
def test_a_transient_failure_keeps_the_recipes_retries(monkeypatch, error):
    t = _Try(monkeypatch)
    with pytest.raises(type(error)):
        t.run(ExportParams(), fail_with=error)
    assert t.policies == [{"retries": 2, "delay_s": 30}]


def _retried_by_an_io_task() -> ConnectionResetError:
    exc = ConnectionResetError(104, "Connection reset by peer")
    mark_retried_in_task(exc)  # as tasks.phases.io_task marks what escapes its retries
    return exc


@pytest.mark.parametrize("error", [StoreError("S3 get failed: SlowDown", transient=True), _retried_by_an_io_task(),
                                   BrokenProcessPool("a rank check's process died"), CheckCrashed("rank 1 died"),
                                   CompileFailed("killed its compile worker 2 times")], ids=type)
def test_a_crash_or_what_a_lower_level_retried_is_not_retried_by_the_flow(monkeypatch, error):
    # One level per failure (kiln.core.run.retry_rule): botocore's tries x the task's x the flow's no longer multiply.
    t = _Try(monkeypatch)
    with pytest.raises(type(error)):
        t.run(ExportParams(), fail_with=error)
    assert t.retries_left() == 0


def test_a_gate_refusal_is_retried_when_the_recipe_waits_for_memory(monkeypatch):
    t = _Try(monkeypatch)
    with pytest.raises(GateRefused):
        t.run(ExportParams(recipe={"retry_refusals": True}), fail_with=GateRefused("short of memory"))
    assert t.retries_left() == 2


def test_a_final_error_ends_the_run_with_itself_as_the_state_message(monkeypatch):
    # Not Prefect's "Flow run encountered an exception: GateRefused: ...": the error first, then why no try follows.
    t = _Try(monkeypatch)
    refusal = GateRefused("export refused before compiling: h is 5 MiB short of one compile worker. To fix: x")
    with pytest.raises(GateRefused) as raised:
        t.run(ExportParams(), fail_with=refusal)
    state = retry.final_state(raised.value)
    assert state.is_failed() and state.data is refusal  # a caller in this process gets the refusal raised
    assert state.message == ("h is 5 MiB short of one compile worker. To fix: x. Not retried: a refusal is final (to "
                             "wait for memory instead, set Recipe > 'Retry refusals' to true in the run form (CLI: "
                             "--set retry_refusals=true)).")
    assert retry.final_state(raised.value) is None  # said once


def test_an_error_a_try_follows_is_raised_for_prefect_to_retry(monkeypatch):
    t = _Try(monkeypatch)
    with pytest.raises(HostsLost) as raised:
        t.run(ExportParams(), fail_with=HostsLost("host-1 gone"))
    assert retry.final_state(raised.value) is None
    last = _Try(monkeypatch, run_count=3)  # the last of 3 tries: final, saying so
    with pytest.raises(HostsLost) as raised:
        last.run(ExportParams(), fail_with=HostsLost("host-1 gone"))
    assert retry.final_state(raised.value).message == \
        "host-1 gone. Not retried: this was try 3 of 3 (Recipe > 'Retries of a failed export' is 2)."


def test_served_flow_validates_parameters_after_pickling():
    # A served flow reaches its run process pickled; the parameter annotation must survive that.
    flow = pickle.loads(cloudpickle.dumps(export))
    values = flow.validate_parameters({"recipe": {"buckets": "1x8"}, "assume_available": [{"host": "h", "mib": 5}]})
    params = ExportParams(**values)
    assert params.recipe.buckets == "1x8" and params.assumed() == {"h": 5} and params.tp == 2


def test_default_deployment_parameters_are_empty():
    assert deployment_parameters(ExportParams()) == {}
    assert deployment_parameters(ExportParams(recipe={"buckets": "1x8"}, tp=1)) == {"recipe": {"buckets": "1x8"}, "tp": 1}


def test_lease_names_are_one_per_model():
    assert lease_name("tiny") == "kiln-model-tiny"
    assert lease_name("Llama 3/70B") == "kiln-model-llama-3-70b"
    assert lease_name("...") == "kiln-model-model"
