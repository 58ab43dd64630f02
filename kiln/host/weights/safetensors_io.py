"""Read safetensors tensors, or one rank's cut of them, straight into tensors the caller allocated.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
{name: {dtype, shape, data_offsets: [begin, end]}}, then the data (offsets
count from the end of the header), checked by kiln.core.model.safetensors_header
before any tensor is read. Reading with plain file reads (not a memory
map) keeps the checkpoint's pages out of this process's resident memory, and
reading into the caller's tensor (a stacked constant's slice) means a rank's
weights are held once: a temporary is needed only to convert the dtype, or for
a cut along dimension 1 (read a few rows at a time, copy their columns).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import torch

from kiln.core.errors import BadInput
from kiln.core.model.safetensors_header import DTYPES, TensorEntry, header_length, parse_header

_CHUNK_BYTES = 16 << 20
"""Most bytes read at once for a cut along dimension 1 (whole rows, of which the rank keeps some columns)."""


def torch_dtype(code: str) -> torch.dtype:
    """The torch dtype of a safetensors dtype code (a key of kiln.core.model.safetensors_header.DTYPES)."""
    return getattr(torch, DTYPES[code].torch_name)


class SafetensorsFile:
    """One open safetensors file: its header read and checked once (kiln.core.model.safetensors_header: BadInput
    naming the file and the field), tensors read on demand. `tensors`: name -> TensorEntry."""

    def __init__(self, path: Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise BadInput(f"{self.path} does not exist (the checkpoint index lists it, or it was removed "
                           "while reading); re-download it.")
        self._f = open(self.path, "rb")
        try:
            size_bytes = os.fstat(self._f.fileno()).st_size
            length = header_length(self._f.read(8), size_bytes, str(self.path))
            self.tensors: dict[str, TensorEntry] = parse_header(self._f.read(length), size_bytes, str(self.path))
        except BaseException:
            self._f.close()
            raise
        self.base = 8 + length

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

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
        info = self.tensors[name]
        dtype, shape, begin = torch_dtype(info.dtype), list(info.shape), info.begin_byte
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
        dim, lo, hi = cut  # any other dimension: whole outer rows read a chunk at a time, their span kept
        outer, inner = math.prod(shape[:dim]), math.prod(shape[dim + 1:])
        row_bytes = shape[dim] * inner * dtype.itemsize
        into = out.view(outer, hi - lo, inner)
        rows = max(1, _CHUNK_BYTES // max(1, row_bytes))
        for first in range(0, outer, rows):
            n = min(rows, outer - first)
            tmp = torch.empty((n, shape[dim], inner), dtype=dtype)
            self._readinto(begin + first * row_bytes, tmp)
            into[first:first + n].copy_(tmp[:, lo:hi])
