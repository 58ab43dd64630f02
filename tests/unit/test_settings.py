"""One typed settings schema: every recipe setting is declared once and everything else derives from it.

The CLI's flags, the deployment form's fields, the Kiln Recipe block and
docs/recipe.md are checked against the declarations, and a setting added to
the recipe (in a copy of the code, in a subprocess) shows up in all of them
with no other edit.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from cli import recipe_doc
from cli.main import parser
from flows.params import ExportParams, build_recipe, export_params
from kiln.core.errors import BadInput
from kiln.core.plan.recipe import SETTING, SETTINGS, Bucket, Recipe, form_overrides, recipe_from_text, recipe_of_form
from kiln.core.plan.settings import GROUPS, form_description, form_value

ROOT = Path(__file__).resolve().parents[2]


def test_docs_recipe_md_is_generated_from_the_declarations():
    committed = (ROOT / "docs" / "recipe.md").read_text()
    assert committed == recipe_doc.render(), "docs/recipe.md is stale: run `make docs` (python -m cli.recipe_doc)"


def _flags(command: str) -> set[str]:
    sub = parser()._subparsers._group_actions[0].choices[command]
    return {opt for action in sub._actions for opt in action.option_strings}


@pytest.mark.parametrize("command", ["export", "plan", "serve"])
def test_every_setting_is_a_flag(command):
    assert {s.flag for s in SETTINGS} <= _flags(command)


def test_every_setting_is_a_typed_form_and_block_field_with_its_default():
    from blocks.kiln_blocks import KilnRecipe

    form = ExportParams.model_json_schema()["$defs"]["RecipeSettings"]["properties"]
    block = KilnRecipe.model_json_schema()["properties"]
    for s in SETTINGS:
        for where, props in (("form", form), ("block", block)):
            assert s.name in props, f"{s.name} missing from the {where}"
            field = props[s.name]
            assert field.get("default") == form_value(s, s.default), (where, s.name, field)
            assert field["title"] == s.title and "_" not in field["title"]
            assert field["description"] == form_description(s, {t.name: t.title for t in SETTINGS})
            assert "anyOf" not in field, (where, s.name)  # never a type switch in a form
            if s.kind == "choice":
                assert field["enum"] == (["auto"] if s.nullable else []) + list(s.choices)
    # Listed by the form's sections, in declaration order within each.
    assert list(form) == [s.name for s in sorted(SETTINGS, key=lambda s: list(GROUPS).index(s.group))]


def test_the_defaults_round_trip_through_form_block_and_text():
    from blocks.kiln_blocks import KilnRecipe

    assert build_recipe(ExportParams()) == Recipe()
    assert KilnRecipe().recipe() == Recipe()
    assert recipe_from_text([f"{s.name}={s.show(s.default)}" for s in SETTINGS]) == Recipe()


def test_a_flag_reaches_the_recipe_typed():
    args = parser().parse_args(["export", "--headroom-floor-mib", "30000", "--policy", "fail", "--buckets", "2x8,1x4",
                                "--unified-memory", "true", "--set", "verify_atol=0.01"])
    from cli.main import _params
    recipe = build_recipe(_params(args))
    assert recipe.changed() == {"headroom_floor_mib": 30000, "policy": "fail", "unified_memory": True,
                                "buckets": (Bucket(1, 4), Bucket(2, 8)), "verify_atol": 0.01}


def test_a_flag_the_user_gave_wins_over_a_recipe_block_also_when_it_is_the_default():
    from cli.main import _params
    from flows.serve import deployment_parameters

    block = Recipe(policy="fail", buckets=(Bucket(1, 8),), headroom_floor_mib=900)
    params = _params(parser().parse_args(["export", "--policy", "borrow", "--headroom-floor-mib", "30000"]))
    assert form_overrides(params.recipe) == {"policy": "borrow", "headroom_floor_mib": 30000}
    recipe = recipe_of_form(form_overrides(params.recipe), block)
    assert (recipe.policy, recipe.headroom_floor_mib, recipe.buckets) == ("borrow", 30000, (Bucket(1, 8),))
    # `kiln serve --policy borrow`: every run of the deployment keeps the flag given.
    assert deployment_parameters(params)["recipe"] == {"policy": "borrow", "headroom_floor_mib": 30000}


def test_the_run_form_sends_every_setting_so_only_a_changed_one_overrides_a_block():
    """What the Prefect UI's custom run sends (tests/ops/test_ui_run.py reads it back): all settings, the
    untouched ones at their defaults."""
    sent = {s.name: form_value(s, s.default) for s in SETTINGS} | {"buckets": "1x8"}
    params = ExportParams(recipe=sent)
    assert form_overrides(params.recipe) == {"buckets": "1x8"}
    assert recipe_of_form(form_overrides(params.recipe), Recipe(policy="fail")).policy == "fail"


def test_a_flag_and_set_for_the_same_setting_is_bad_input():
    args = parser().parse_args(["export", "--policy", "fail", "--set", "policy=borrow"])
    from cli.main import _params
    with pytest.raises(BadInput, match="--policy and --set policy"):
        _params(args)


@pytest.mark.parametrize("argv", [["--headroom-floor-mib", "0"], ["--headroom-floor-mib", "lots"],
                                  ["--policy", "lend"], ["--buckets", "ax3"], ["--unified-memory", "maybe"]])
def test_a_bad_flag_value_exits_2_naming_what_it_takes(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        parser().parse_args(["plan", *argv])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert argv[0] in err and ("must be" in err or "expected" in err or "invalid choice" in err
                               or "BATCHxTOKENS" in err), err


def test_checks_come_from_the_declarations():
    for name, bad in (("page_tokens", 0), ("worker_mib_margin", 0.5), ("flow_retries", 11), ("policy", "lend"),
                      ("retry_refusals", "yes"), ("headroom_floor_mib", 1.5), ("verify_atol", float("nan"))):
        with pytest.raises(BadInput, match=f"recipe setting {name}"):
            Recipe().replace(**{name: bad})
    with pytest.raises(BadInput, match="unknown recipe setting"):
        Recipe().replace(nonsense=1)
    assert SETTING["worker_host_mib"].parse("auto") is None
    with pytest.raises(BadInput, match="multiple of page_tokens"):
        build_recipe(export_params(recipe={"max_context_tokens": 100}))


ADD_FIELD = '''    dummy_knob_mib: int = setting(7, "A dummy setting added by the test.", unit="MiB", ge=0)
'''

CHECK = textwrap.dedent('''
    import json
    from blocks.kiln_blocks import KilnRecipe
    from cli import recipe_doc
    from cli.main import _params, parser
    from flows.params import ExportParams, build_recipe
    help_text = parser()._subparsers._group_actions[0].choices["export"].format_help()
    recipe = build_recipe(_params(parser().parse_args(["export", "--dummy-knob-mib", "9"])))
    print(json.dumps({
        "flag": "--dummy-knob-mib" in help_text,
        "form": ExportParams.model_json_schema()["$defs"]["RecipeSettings"]["properties"]["dummy_knob_mib"]["default"],
        "block": KilnRecipe.model_json_schema()["properties"]["dummy_knob_mib"]["default"],
        "doc": "| `dummy_knob_mib` | int (MiB), >= 0 | `7` |" in recipe_doc.render(),
        "value": recipe.dummy_knob_mib,
        "set": build_recipe(_params(parser().parse_args(["plan", "--set", "dummy_knob_mib=11"]))).dummy_knob_mib,
    }))
''')


@pytest.mark.timeout(300)
def test_a_new_setting_appears_everywhere_with_no_other_edit(tmp_path):
    for package in ("kiln", "flows", "tasks", "blocks", "cli", "bench"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    recipe = tmp_path / "kiln" / "core" / "plan" / "recipe.py"
    text = recipe.read_text()
    anchor = "    def __post_init__(self) -> None:"
    assert anchor in text
    recipe.write_text(text.replace(anchor, ADD_FIELD + "\n" + anchor, 1))
    out = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, capture_output=True, text=True, timeout=280,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(tmp_path), "HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"flag": True, "form": 7, "block": 7, "doc": True,
                                                                "value": 9, "set": 11}
