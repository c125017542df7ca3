"""Write a safetensors file tensor by tensor: the header is computed from shapes up front, data streams after."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

DTYPE_NAMES = {
    torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8",
}


class StreamingSafetensorsWriter:
    """Tensors must be written in the declared order; each may arrive in several row-major chunks."""

    def __init__(self, path: Path, entries: list[tuple[str, torch.dtype, tuple[int, ...]]], metadata: dict[str, str] | None = None) -> None:
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": metadata or {}}
        offset = 0
        self.sizes: list[tuple[str, int]] = []
        for name, dtype, shape in entries:
            n = dtype.itemsize
            for d in shape:
                n *= d
            header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self.sizes.append((name, n))
            offset += n
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.total = 8 + len(raw) + offset
        self._f = open(self.path, "wb")
        self._f.write(len(raw).to_bytes(8, "little"))
        self._f.write(raw)
        self._index = 0
        self._left = self.sizes[0][1] if self.sizes else 0

    def write(self, name: str, chunk: torch.Tensor) -> None:
        expected, _ = self.sizes[self._index]
        if name != expected:
            raise RuntimeError(f"safetensors writer: got {name!r}, expected {expected!r} next")
        data = chunk.contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        if data.nbytes > self._left:
            raise RuntimeError(f"safetensors writer: {name!r} got more bytes than its shape holds")
        self._f.write(memoryview(data))
        self._left -= data.nbytes
        if self._left == 0:
            self._index += 1
            self._left = self.sizes[self._index][1] if self._index < len(self.sizes) else 0

    def close(self) -> None:
        if self._index != len(self.sizes):
            self._f.close()
            raise RuntimeError(f"safetensors writer: {self.path} incomplete ({self._index}/{len(self.sizes)} tensors)")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()
