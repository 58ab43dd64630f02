"""The export flow as Prefect sees it, without a server: one parameter model, retries, lease names."""

from __future__ import annotations

import pickle

import cloudpickle

from flows.export import export
from flows.model_lease import lease_name
from flows.params import ExportParams
from flows.serve import deployment_parameters
from kiln.core.recipe import SETTINGS, Recipe


def test_the_flow_parameters_are_top_level_fields_with_defaults():
    schema = export.parameters.model_dump()
    form = schema["properties"]
    assert list(form) == list(ExportParams.model_fields)  # derived: one parameter per field, in order
    assert not schema.get("required")  # every parameter has its default: the plain Run button works
    assert form["tp"]["default"] == 2 and form["tp"]["minimum"] == 1 and form["model"]["default"] == "tiny"
    assert all(form[name].get("description") for name in form)
    recipe = schema["definitions"]["RecipeSettings"]["properties"]
    assert list(recipe) == [s.name for s in SETTINGS]  # every setting, typed, in declaration order
    assert recipe["policy"]["enum"] == ["borrow", "fail"] and recipe["policy"]["default"] == "borrow"
    assert "settings" not in form  # no NAME=VALUE list
    pair = schema["definitions"]["HostMemory"]["properties"]
    assert form["assume_available"]["type"] == "array" and set(pair) == {"host", "mib"}


def test_flow_retries_default_to_the_recipe():
    assert export.retries == Recipe().flow_retries == 2
    assert export.retry_delay_seconds == int(Recipe().flow_retry_delay_s)


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
