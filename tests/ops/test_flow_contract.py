"""The export flow as Prefect sees it, without a server: one parameter model, retries, lease names."""

from __future__ import annotations

import pickle

import cloudpickle

from flows.export import export
from flows.model_lease import lease_name
from flows.params import ExportParams
from flows.serve import deployment_parameters
from kiln.core.recipe import SETTINGS, Recipe


def test_the_deployment_takes_one_pydantic_model():
    schema = export.parameters.model_dump()
    assert list(schema["properties"]) == ["params"]
    assert schema["required"] == ["params"]
    form = schema["definitions"]["ExportParams"]["properties"]
    assert {"model", "tp", "store", "recipe"} <= set(form)
    recipe = schema["definitions"]["RecipeSettings"]["properties"]
    assert list(recipe) == [s.name for s in SETTINGS]  # every setting, typed, in declaration order
    assert "settings" not in form  # no NAME=VALUE list


def test_flow_retries_default_to_the_recipe():
    assert export.retries == Recipe().flow_retries == 2
    assert export.retry_delay_seconds == int(Recipe().flow_retry_delay_s)


def test_served_flow_validates_parameters_after_pickling():
    # A served flow reaches its run process pickled; the parameter annotation must survive that.
    flow = pickle.loads(cloudpickle.dumps(export))
    params = flow.validate_parameters({"params": {"recipe": {"buckets": "1x8"}}})["params"]
    assert isinstance(params, ExportParams) and params.recipe.buckets == "1x8"


def test_default_deployment_parameters_are_empty():
    assert deployment_parameters(ExportParams()) == {"params": {}}
    assert deployment_parameters(ExportParams(recipe={"buckets": "1x8"}, tp=1)) == {
        "params": {"recipe": {"buckets": "1x8"}, "tp": 1}}


def test_lease_names_are_one_per_model():
    assert lease_name("tiny") == "kiln-model-tiny"
    assert lease_name("Llama 3/70B") == "kiln-model-llama-3-70b"
    assert lease_name("...") == "kiln-model-model"
