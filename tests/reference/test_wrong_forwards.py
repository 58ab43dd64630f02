"""A check that a wrong forward cannot pass and a right one cannot fail (kiln.host.ranks.loader.check_against_eager).

For every mixture-of-experts family (Mixtral, Qwen2-MoE, Qwen3-MoE, DeepSeek-V3, DeepSeek-V4), in float32 and
bfloat16, on a small checkpoint written by transformers' own class, at a one-token step and every checked
shape of a range: the right forward passes at every shape and each wrong forward of bench.wrong_forwards'
fixed list fails at every one of them (where it applies: NOT_APPLICABLE).
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]'")

from bench.wrong_forwards import DTYPES, FAMILIES, MUTATIONS, check_family, mutations_of, shapes, write  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_right_forward_passes_and_every_wrong_one_fails_at_every_checked_shape(family, dtype, tmp_path):
    result = check_family(write(family, dtype, tmp_path / f"{family}-{dtype}"))
    assert [r[0] for r in result["right"]] == [str(s) for s in shapes()] and len(shapes()) == 7
    assert all(ok for _, ok, _ in result["right"]), [r for r in result["right"] if not r[1]]
    assert all(check["choices"] > 0 for _, _, check in result["right"])
    missed = [(name, shape, check) for name, shape, caught, check in result["wrong"] if not caught]
    assert not missed, missed
    assert len(result["wrong"]) == len(mutations_of(family)) * len(shapes()) >= 7 * 7
    assert set(mutations_of(family)) <= set(MUTATIONS)
