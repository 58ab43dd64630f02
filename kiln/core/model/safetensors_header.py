"""The one reader of untrusted checkpoint metadata: a safetensors header and a sharded checkpoint's index.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {...}}, then
the data section (offsets count from its start). Every reader of a checkpoint
(a directory or S3, the flow process or a host reading its rank's weights)
goes through `header_length` and `parse_header`, so each refuses the same
files, with BadInput naming the file and the field, before any byte of a
tensor is trusted:

- N at most MAX_HEADER_BYTES and at most the file's size less 8;
- the header a JSON object; `__metadata__`, when there, an object;
- each tensor an object with a dtype in DTYPES (F8_E4M3 is read, the other
  FP8 codes are refused by name; which tensors may be FP8 is the config's
  business: kiln.host.weights.checkpoint.check_tensors), a
  shape of non-negative ints, and data_offsets [begin, end] of ints with
  0 <= begin <= end <= the data section's size and end - begin the bytes
  its shape and dtype need;
- no two tensors' bytes overlapping.

`index_weight_map` checks an index's weight_map: tensor names to file names,
strings, each a relative path that stays in the checkpoint directory.

Pure: no torch, no file I/O (callers read the bytes and pass the file's size).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import PurePosixPath

from kiln.core.errors import BadInput

MAX_HEADER_BYTES = 100 * 1024 * 1024
"""The largest header accepted (safetensors' own limit): a corrupt length must not make a reader allocate
or fetch gigabytes."""


@dataclass(frozen=True)
class Dtype:
    """A safetensors dtype Kiln reads: torch's name for it and its size."""

    torch_name: str
    itemsize_bytes: int


DTYPES = {"F64": Dtype("float64", 8), "F32": Dtype("float32", 4), "F16": Dtype("float16", 2),
          "BF16": Dtype("bfloat16", 2), "I64": Dtype("int64", 8), "I32": Dtype("int32", 4),
          "I16": Dtype("int16", 2), "I8": Dtype("int8", 1), "U8": Dtype("uint8", 1), "BOOL": Dtype("bool", 1),
          "F8_E4M3": Dtype("float8_e4m3fn", 1), "F8_E8M0": Dtype("uint8", 1)}
"""safetensors' dtype codes Kiln reads (the header's `dtype`), the only table of them. F8_E4M3 is an FP8-block
checkpoint's quantized projections, F8_E8M0 DeepSeek-V4-Flash's UE8M0 scales, read as their bytes
(kiln.core.model.quant.E8M0_DTYPE); I8 its FP4 experts."""

FP8_DTYPES = ("F8_E5M2",)
"""The FP8 codes Kiln does not read: refused by name (e5m2 weights)."""


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a header: dtype code (a key of DTYPES), shape, and its bytes [begin_byte, end_byte)
    counted from the start of the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin_byte: int
    end_byte: int

    @property
    def itemsize_bytes(self) -> int:
        return DTYPES[self.dtype].itemsize_bytes


def _refuse(where: str, what: str) -> BadInput:
    return BadInput(f"{where}: {what}; the file is corrupt or not a safetensors file Kiln reads: "
                    "re-download or re-save it.")


def header_length(first_8_bytes: bytes, file_size_bytes: int, where: str) -> int:
    """N, the header's length in bytes, from the file's first 8 bytes; BadInput (naming `where`, the file)
    when the file is shorter than 8 bytes or N is over MAX_HEADER_BYTES or past the file's end."""
    if file_size_bytes < 8 or len(first_8_bytes) < 8:
        raise _refuse(where, f"it is {file_size_bytes} bytes, too short to hold a header length (truncated?)")
    length = int.from_bytes(first_8_bytes[:8], "little")
    if length > MAX_HEADER_BYTES:
        raise _refuse(where, f"its header claims {length} bytes, more than the "
                             f"{MAX_HEADER_BYTES} bytes safetensors allows")
    if length > file_size_bytes - 8:
        raise _refuse(where, f"its header claims {length} bytes, more than the file's "
                             f"{file_size_bytes} bytes hold (truncated?)")
    return length


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(where: str, name: str, raw, data_bytes: int) -> TensorEntry:
    at = f"{where}: tensor {name!r}"
    if not isinstance(raw, dict):
        raise _refuse(where, f"tensor {name!r} is {type(raw).__name__}, not an object with dtype, shape and "
                             "data_offsets")
    dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
    if dtype in FP8_DTYPES:
        raise BadInput(f"{at} has dtype {dtype}: FP8 that Kiln does not read (it reads F8_E4M3 weights with "
                       "float32 block scales, as DeepSeek-V3 and Qwen3's FP8 checkpoints hold them, or with UE8M0 "
                       "(F8_E8M0) scales, as DeepSeek-V4-Flash's). Convert the checkpoint to bfloat16 first.")
    if dtype not in DTYPES:
        raise _refuse(where, f"tensor {name!r} has dtype {dtype!r}, not one Kiln reads "
                             f"({', '.join(DTYPES)})")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise _refuse(where, f"tensor {name!r} has shape {shape!r}, not a list of non-negative ints")
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets) \
            or not 0 <= offsets[0] <= offsets[1]:
        raise _refuse(where, f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end] with "
                             "0 <= begin <= end")
    begin, end = offsets
    need = math.prod(shape) * DTYPES[dtype].itemsize_bytes
    if end - begin != need:
        raise _refuse(where, f"tensor {name!r} has data_offsets {offsets} ({end - begin} bytes) but its shape "
                             f"{shape} of {dtype} needs {need} bytes")
    if end > data_bytes:
        raise _refuse(where, f"tensor {name!r} has data_offsets {offsets}, past the end of the "
                             f"{data_bytes}-byte data section (truncated?)")
    return TensorEntry(dtype, tuple(shape), begin, end)


def parse_header(header_bytes: bytes, file_size_bytes: int, where: str) -> dict[str, TensorEntry]:
    """Every tensor of the header (`header_bytes`: the N bytes after the length field, the file
    `file_size_bytes` long), `__metadata__` left out; BadInput naming `where` and the field when any check
    of the module docstring fails."""
    data_bytes = file_size_bytes - 8 - len(header_bytes)
    if data_bytes < 0:
        raise _refuse(where, f"its {len(header_bytes)}-byte header does not fit in its {file_size_bytes} bytes")
    try:
        raw = json.loads(header_bytes)
    except (ValueError, UnicodeDecodeError) as exc:
        raise _refuse(where, f"its header is not valid JSON ({exc})") from None
    if not isinstance(raw, dict):
        raise _refuse(where, f"its header is a JSON {type(raw).__name__}, not an object")
    if not isinstance(raw.get("__metadata__", {}), dict):
        raise _refuse(where, "its __metadata__ is not an object")
    out = {name: _entry(where, name, value, data_bytes) for name, value in raw.items() if name != "__metadata__"}
    previous: tuple[str, TensorEntry] | None = None
    for name, entry in sorted(((n, e) for n, e in out.items() if e.end_byte > e.begin_byte),
                              key=lambda item: item[1].begin_byte):
        if previous is not None and entry.begin_byte < previous[1].end_byte:
            raise _refuse(where, f"tensors {previous[0]!r} and {name!r} overlap (data_offsets "
                                 f"[{previous[1].begin_byte}, {previous[1].end_byte}] and "
                                 f"[{entry.begin_byte}, {entry.end_byte}])")
        previous = name, entry
    return out


def _safe_relative(file: str) -> bool:
    """True when `file` names a path inside the checkpoint directory: relative, no '..', no backslash
    (a Windows separator), no empty or NUL parts."""
    if not file or "\\" in file or "\0" in file:
        return False
    path = PurePosixPath(file)
    return not path.is_absolute() and all(part not in ("..", "") for part in file.split("/"))


def index_weight_map(index_bytes: bytes, where: str) -> dict[str, str]:
    """The index's weight_map (tensor name -> file name relative to the checkpoint directory); BadInput
    naming `where` (the index file) and the entry when it is not JSON, has no weight_map object, or an
    entry's file is not a string naming a path inside the directory (absolute, or with '..')."""
    try:
        raw = json.loads(index_bytes)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadInput(f"{where} is not a valid safetensors index ({exc}); re-save the checkpoint.") from None
    mapping = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(mapping, dict):
        raise BadInput(f"{where} is not a valid safetensors index: it has no weight_map object; "
                       "re-save the checkpoint.")
    for name, file in mapping.items():
        if not isinstance(file, str) or not _safe_relative(file):
            raise BadInput(f"{where}: weight_map entry {name!r} -> {file!r} is not a file name inside the "
                           "checkpoint directory (a relative path without '..'); fix the index.")
    return dict(mapping)
