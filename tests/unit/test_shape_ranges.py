"""Forward shapes: ranges parsed and refused by name, buckets grouped into at most four forwards, one rule
for choosing among forwards that hold a shape, and a key per range and hint."""

from __future__ import annotations

import pytest

from kiln.core.errors import BadInput
from kiln.core.forwards.forward_keys import forward_spec
from kiln.core.plan.recipe import Recipe, recipe_from_text
from kiln.core.forwards.shape_ranges import (Bucket, choose_forward, group_buckets, parse_shape_range, parse_shape_ranges,
                                    static_shape)

INCIDENT = tuple(Bucket(b, 1) for b in [1, 2, 4, *range(8, 257, 8)]) + (Bucket(1, 128), Bucket(1, 256),
                                                                          Bucket(1, 512))
"""38 buckets: the decode batches a serving engine captures (1, 2, 4, then every 8 up to 256) and three
prefill lengths up to 512 (bench.parts_ranges uses the same list)."""


def names(ranges) -> list[str]:
    return [str(r) for r in ranges]


def test_the_incident_buckets_become_at_most_four_forwards():
    assert len(INCIDENT) == 38
    assert names(group_buckets(INCIDENT, "ranges")) == ["1x1", "1x128-512@1x512", "2-256x1@256x1"]
    assert len(group_buckets(INCIDENT, "static")) == 38
    assert names(Recipe().shapes) == ["1x16", "2-8x16-64@8x64"]


def test_every_bucket_is_held_by_a_forward():
    for policy in ("ranges", "static"):
        ranges = group_buckets(INCIDENT, policy)
        assert all(any(r.holds(b) for r in ranges) for b in INCIDENT)


def test_given_shapes_take_their_buckets_and_the_policy_groups_the_rest():
    recipe = recipe_from_text(["buckets=1x1,2x1,4x1,8x1,1x16,4x32", "forward_shapes=2x1,4-8x1@4x1"])
    assert names(recipe.shapes) == ["1x1", "1x16", "2x1", "4x32", "4-8x1@4x1"]
    assert recipe.to_dict()["forward_shapes"] == ["2x1", "4-8x1@4x1"]
    assert Recipe.from_dict(recipe.to_dict()) == recipe


@pytest.mark.parametrize("text,words", [
    ("1-4x1", "dynamic batch range starts at 1"),
    ("2-4x1-8", "dynamic tokens range starts at 1"),
    ("4-2x1", "batch range 4-2 is empty"),
    ("2-4x1@8x1", "hint 8x1 lies outside its batch range 2-4"),
    ("2-4x1@4", "are not BxT, B0-B1xT0-T1"),
    ("2:4x1", "are not BxT, B0-B1xT0-T1"),
])
def test_bad_ranges_are_refused_by_name(text, words):
    with pytest.raises(BadInput, match=words):
        recipe_from_text([f"forward_shapes={text}"])


def test_a_given_range_that_holds_no_bucket_is_refused():
    with pytest.raises(BadInput, match="forward shapes 9-12x1@12x1 hold none of the buckets"):
        recipe_from_text(["forward_shapes=9-12x1"])


def test_a_range_parses_back_from_its_name():
    for text in ("3x5", "2-64x1@16x1", "1x16-512@1x64", "2-8x16-64@8x64"):
        assert str(parse_shape_range(text)) == text
    assert parse_shape_range("2-2x3-3") == static_shape(Bucket(2, 3))
    assert parse_shape_ranges(" ") is None


def test_a_range_is_checked_at_its_four_corners_its_hint_and_an_odd_interior_shape():
    B = Bucket
    assert parse_shape_range("2-8x16-64@4x32").checked_shapes() == (B(2, 16), B(2, 64), B(4, 32), B(5, 39),
                                                                    B(8, 16), B(8, 64))
    assert parse_shape_range("2-64x1@64x1").checked_shapes() == (B(2, 1), B(33, 1), B(64, 1))
    assert parse_shape_range("1x16-512@1x64").checked_shapes() == (B(1, 16), B(1, 64), B(1, 263), B(1, 512))
    # Two values per dimension: no interior, the four corners are every shape.
    assert parse_shape_range("2-3x2-3").checked_shapes() == (B(2, 2), B(2, 3), B(3, 2), B(3, 3))
    # The odd value nearest the middle; none inside: the even one there.
    assert parse_shape_range("4-8x1").checked_shapes() == (B(4, 1), B(5, 1), B(8, 1))
    assert parse_shape_range("3-5x1").checked_shapes() == (B(3, 1), B(4, 1), B(5, 1))
    assert parse_shape_range("4x7").checked_shapes() == (B(4, 7),)


def test_the_consumer_rule_prefers_the_fewest_shapes_then_the_nearest_hint():
    ranges = [parse_shape_range(t) for t in ("2-64x1@64x1", "4x1", "2-64x1@8x1", "2-8x1@8x1")]
    assert str(choose_forward(ranges, Bucket(4, 1))) == "4x1"  # a static forward wins
    assert str(choose_forward(ranges, Bucket(6, 1))) == "2-8x1@8x1"  # the narrowest range
    assert str(choose_forward(ranges, Bucket(20, 1))) == "2-64x1@8x1"  # equal ranges: the nearest hint
    with pytest.raises(ValueError, match="no forward takes 1x1"):
        choose_forward(ranges, Bucket(1, 1))


def test_the_key_covers_the_range_and_the_hint():
    base = dict(graph={"tp": 1}, target="t", torch_version="v", page_tokens=16, pages_per_seq=4, compiler={})
    keys = {text: forward_spec(shapes=parse_shape_range(text), **base).key
            for text in ("2-8x1@8x1", "2-8x1@4x1", "2-16x1@8x1", "8x1")}
    assert len(set(keys.values())) == 4
    spec = forward_spec(shapes=parse_shape_range("2-8x1@4x1"), **base)
    assert spec.inputs["batch"] == [2, 8] and spec.inputs["tokens"] == [1, 1] and spec.inputs["hint"] == [4, 1]


def test_the_manifest_refuses_a_forward_whose_shapes_do_not_state_its_range():
    from kiln.core.errors import IntegrityError
    from kiln.core.trust.manifest import MANIFEST_VERSION, check_manifest

    good = {"key": "a" * 32, "object": f"forwards/{'a' * 32}.pt2", "sha256": "0" * 64, "python_free": True,
            **parse_shape_range("2-8x1@4x1").to_dict()}
    manifest = {"version": MANIFEST_VERSION, "signing": {"signed": False}, "forwards": [good]}
    assert check_manifest(manifest)
    for bad, words in [({"shapes": "2-8x"}, "malformed shapes"), ({"hint": [8, 1]}, "do not state the range"),
                       ({"batch": [1, 8]}, "do not state the range")]:
        with pytest.raises(IntegrityError, match=words):
            check_manifest({**manifest, "forwards": [{**good, **bad}]})
