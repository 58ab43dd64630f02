"""Read safetensors tensors, or one rank's cut of them, straight into tensors the caller allocated.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}}, then the data (offsets
count from the end of the header). Reading with plain file reads (not a memory
map) keeps the checkpoint's pages out of this process's resident memory, and
reading into the caller's tensor (a stacked constant's slice) means a rank's
weights are held once: a temporary is needed only to convert the dtype, or for
a cut along dimension 1 (read a few rows at a time, copy their columns).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

from kiln.core.errors import BadInput

DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool}
_CHUNK_BYTES = 16 << 20
"""Most bytes read at once for a cut along dimension 1 (whole rows, of which the rank keeps some columns)."""


class SafetensorsFile:
    """One open safetensors file: its header parsed once, tensors read on demand."""

    def __init__(self, path: Path):
        self.path = path
        self._f = open(path, "rb")
        (length,) = struct.unpack("<Q", self._f.read(8))
        self.header = json.loads(self._f.read(length))
        self.base = 8 + length

    def close(self) -> None:
        self._f.close()

    def _readinto(self, offset: int, out: torch.Tensor) -> None:
        view = out.view(torch.uint8).reshape(-1).numpy()
        self._f.seek(self.base + offset)
        done = 0
        while done < view.nbytes:
            got = self._f.readinto(memoryview(view)[done:])
            if not got:
                raise BadInput(f"{self.path} ends before its tensors do (truncated?); re-download or re-save it.")
            done += got

    def read_into(self, name: str, cut: tuple[int, int, int] | None, out: torch.Tensor) -> None:
        """Fill `out` (contiguous, the cut's shape, any float dtype) with tensor `name`, cut to (dim, start,
        stop) when `cut` is not None, converting the dtype as it goes."""
        info = self.header[name]
        dtype, shape = DTYPES[info["dtype"]], list(info["shape"])
        begin = info["data_offsets"][0]
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        if cut is None or cut[0] == 0:
            start, stop = (0, shape[0] if shape else 1) if cut is None else cut[1:]
            if out.dtype == dtype:
                self._readinto(begin + start * row_bytes, out)
            else:
                tmp = torch.empty(out.shape, dtype=dtype)
                self._readinto(begin + start * row_bytes, tmp)
                out.copy_(tmp)
            return
        if cut[0] != 1 or len(shape) != 2:
            raise ValueError(f"cannot cut {name} {shape} along dimension {cut[0]}")
        rows = max(1, _CHUNK_BYTES // max(1, row_bytes))
        for first in range(0, shape[0], rows):
            n = min(rows, shape[0] - first)
            tmp = torch.empty((n, shape[1]), dtype=dtype)
            self._readinto(begin + first * row_bytes, tmp)
            out[first:first + n].copy_(tmp[:, cut[1]:cut[2]])
