"""kiln.core.model.safetensors_header: the one parser of safetensors headers and checkpoint indexes, over bytes.

Each bad header or index is BadInput naming the file and the field; a header the safetensors library
writes parses to the shapes and offsets the library reads.
"""

from __future__ import annotations

import json
import struct

import pytest

from kiln.core.errors import BadInput
from kiln.core.model.safetensors_header import (MAX_HEADER_BYTES, TensorEntry, header_length, index_weight_map,
                                          parse_header)

W = "ckpt/model.safetensors"


def _parse(header: dict, data_bytes: int) -> dict[str, TensorEntry]:
    """parse_header over `header` as JSON, in a file with `data_bytes` of data after it."""
    raw = json.dumps(header).encode()
    return parse_header(raw, 8 + len(raw) + data_bytes, W)


def _refused(header: dict, data_bytes: int, *needles: str) -> None:
    with pytest.raises(BadInput) as err:
        _parse(header, data_bytes)
    for needle in (W, *needles):
        assert needle in str(err.value), str(err.value)


def test_a_valid_header_parses_with_metadata_and_empty_tensors():
    header = {"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
              "b": {"dtype": "BF16", "shape": [4], "data_offsets": [24, 32]},
              "empty": {"dtype": "F16", "shape": [0, 5], "data_offsets": [8, 8]},  # empty: overlaps nothing
              "scalar": {"dtype": "I64", "shape": [], "data_offsets": [32, 40]}}
    got = _parse(header, 40)
    assert got == {"a": TensorEntry("F32", (2, 3), 0, 24), "b": TensorEntry("BF16", (4,), 24, 32),
                   "empty": TensorEntry("F16", (0, 5), 8, 8), "scalar": TensorEntry("I64", (), 32, 40)}
    assert got["b"].itemsize_bytes == 2


def test_the_header_length_is_bounded_by_the_limit_and_the_file():
    assert header_length(struct.pack("<Q", 10), 18, W) == 10
    with pytest.raises(BadInput, match=rf"{W}: it is 5 bytes, too short"):
        header_length(b"\x01" * 5, 5, W)
    with pytest.raises(BadInput, match=rf"{W}: its header claims {2**64 - 1} bytes, more than the {MAX_HEADER_BYTES}"):
        header_length(b"\xff" * 8, 10 * MAX_HEADER_BYTES, W)
    with pytest.raises(BadInput, match=rf"{W}: its header claims 11 bytes, more than the file's 18 bytes"):
        header_length(struct.pack("<Q", 11), 18, W)


@pytest.mark.parametrize("raw, needle", [
    (b"{garbage", "not valid JSON"), (b"\xff\xfe", "not valid JSON"), (b"[1, 2]", "a JSON list, not an object"),
    (b'{"__metadata__": [1]}', "__metadata__ is not an object")])
def test_a_header_that_is_not_a_json_object_is_refused(raw, needle):
    with pytest.raises(BadInput, match=needle) as err:
        parse_header(raw, 8 + len(raw), W)
    assert W in str(err.value)


@pytest.mark.parametrize("entry, data_bytes, needles", [
    ({"dtype": "F8_E5M2", "shape": [4], "data_offsets": [0, 4]}, 4, ["F8_E5M2", "FP8", "F8_E4M3"]),
    ({"dtype": "Q4", "shape": [4], "data_offsets": [0, 4]}, 4, ["'t' has dtype 'Q4'", "BF16"]),
    ({"dtype": None, "shape": [4], "data_offsets": [0, 4]}, 4, ["has dtype None"]),
    ({"dtype": "F32", "shape": [2, -1], "data_offsets": [0, 0]}, 0, ["shape [2, -1]"]),
    ({"dtype": "F32", "shape": [2.0], "data_offsets": [0, 8]}, 8, ["shape [2.0]"]),
    ({"dtype": "F32", "shape": [True], "data_offsets": [0, 4]}, 4, ["shape [True]"]),
    ({"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}, 16, ["shape '4'"]),
    ({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}, 16, ["data_offsets [16, 0]"]),
    ({"dtype": "F32", "shape": [4], "data_offsets": [-4, 12]}, 16, ["data_offsets [-4, 12]"]),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0]}, 16, ["data_offsets [0]"]),
    ({"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}, 16, ["data_offsets ['0', '16']"]),
    ({"dtype": "F32", "shape": [4]}, 16, ["data_offsets None"]),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}, 16, ["(8 bytes) but its shape [4] of F32 needs 16"]),
    ({"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}, 16, ["past the end of the 16-byte data section"]),
    ([1, 2], 0, ["tensor 't' is list"])])
def test_each_bad_tensor_entry_is_refused_naming_the_tensor_and_field(entry, data_bytes, needles):
    _refused({"t": entry}, data_bytes, *needles)


def test_overlapping_tensors_are_refused():
    _refused({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
              "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}, 16, "'a' and 'b' overlap")


def test_a_header_the_library_writes_parses_as_the_library_reads_it(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = tmp_path / "m.safetensors"
    save_file({"x": torch.zeros(3, 5), "y": torch.ones(7, dtype=torch.bfloat16), "z": torch.zeros(0, 2)},
              str(path), metadata={"format": "pt"})
    data = path.read_bytes()
    length = header_length(data[:8], len(data), str(path))
    got = parse_header(data[8:8 + length], len(data), str(path))
    with safe_open(str(path), framework="pt") as f:
        assert {n: list(e.shape) for n, e in got.items()} == {n: f.get_slice(n).get_shape() for n in f.keys()}


def test_an_index_maps_names_to_files_inside_the_directory():
    index = json.dumps({"metadata": {}, "weight_map": {"a": "m-1.safetensors", "b": "sub/./m-2.safetensors"}})
    assert index_weight_map(index.encode(), "i.json") == {"a": "m-1.safetensors", "b": "sub/./m-2.safetensors"}


@pytest.mark.parametrize("weight_map, needle", [
    ({"a": "../x.safetensors"}, "'a' -> '../x.safetensors'"),
    ({"a": "sub/../../x.safetensors"}, "'a' -> 'sub/../../x.safetensors'"),
    ({"a": "/etc/passwd"}, "'a' -> '/etc/passwd'"),
    ({"a": "..\\x.safetensors"}, "'a' -> '..\\\\x.safetensors'"),
    ({"a": ""}, "'a' -> ''"),
    ({"a": 3}, "'a' -> 3"),
    ({"a": None}, "'a' -> None"),
    ({"a": ["m.safetensors"]}, "'a' -> ['m.safetensors']"),
    ([["a", "m.safetensors"]], "no weight_map object"),
    (None, "no weight_map object")])
def test_an_index_entry_leaving_the_directory_or_not_a_string_is_refused(weight_map, needle):
    with pytest.raises(BadInput) as err:
        index_weight_map(json.dumps({"weight_map": weight_map}).encode(), "ckpt/model.safetensors.index.json")
    assert "ckpt/model.safetensors.index.json" in str(err.value) and needle in str(err.value), str(err.value)


@pytest.mark.parametrize("raw", [b"{not json", b"[]", b"\xff"])
def test_an_index_that_is_not_a_json_object_is_refused(raw):
    with pytest.raises(BadInput, match="i.json is not a valid safetensors index"):
        index_weight_map(raw, "i.json")
