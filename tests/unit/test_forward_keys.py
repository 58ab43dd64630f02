"""Forward keys change with what changes the code, and only with that."""

from kiln.core.forwards.forward_keys import forward_spec
from kiln.core.plan.recipe import Bucket
from kiln.core.forwards.shape_ranges import static_shape

BASE = dict(shapes=static_shape(Bucket(1, 16)), graph={"config": {"h": 1}, "tp": 2, "code": "abc"}, target="avx2",
            torch_version="2.13.0", page_tokens=16, pages_per_seq=16, compiler={"max_autotune": False})


def key(**changes):
    return forward_spec(**{**BASE, **changes}).key


def test_key_is_stable():
    assert key() == key()


def test_key_changes_with_what_changes_code():
    base = key()
    assert key(shapes=static_shape(Bucket(2, 16))) != base
    assert key(target="avx512") != base
    assert key(torch_version="2.14.0") != base
    assert key(page_tokens=32) != base
    assert key(compiler={"max_autotune": True}) != base
    assert key(graph={**BASE["graph"], "tp": 3}) != base


def test_spec_leaves_the_page_count_dynamic():
    """The page count is not an input of the key at all (a new KV plan reusing every forward is shown end
    to end in tests/integration/test_export.py)."""
    spec = forward_spec(**BASE)
    assert spec.inputs["num_pages"] == "dynamic"
    assert "num_pages" not in forward_spec.__code__.co_varnames[:forward_spec.__code__.co_kwonlyargcount]


def test_key_records_the_package_layout(monkeypatch):
    """A package of another constant layout (say, unrolled layers) never shares a key with a scanned one."""
    import kiln.core.forwards.forward_keys as forward_keys

    base = key()
    monkeypatch.setattr(forward_keys, "LAYOUT", "unrolled")
    assert key() != base
