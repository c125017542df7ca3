"""Read an HF safetensors checkpoint one tensor at a time (never the whole model in memory)."""

from __future__ import annotations

import json
from pathlib import Path

import torch


from tilepd.model_format.model_spec import quantizes_only_kv_cache  # noqa: E402
from tilepd.weights.errors import WeightsError  # noqa: E402  (re-exported: callers import it from here)


TORCH_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
    "F64": torch.float64,
}


class SafetensorsFile:
    """Header of one safetensors file; tensors are read with pread into fresh memory (no mmap, so reading
    a checkpoint does not pin its pages in this process's RSS)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                raise WeightsError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
            n = int.from_bytes(raw, "little")
            if n <= 0 or 8 + n > size:
                raise WeightsError(f"{path}: corrupt safetensors header (declares {n} header bytes, file has {size})")
            try:
                header = json.loads(f.read(n))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise WeightsError(f"{path}: corrupt safetensors header ({e})") from e
        header.pop("__metadata__", None)
        self.data_start = 8 + n
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, e in header.items():
            try:
                dtype = TORCH_DTYPES[e["dtype"]]
                begin, end = (int(x) for x in e["data_offsets"])
                shape = tuple(int(d) for d in e["shape"])
            except (KeyError, TypeError, ValueError) as err:
                raise WeightsError(f"{path}: tensor {name!r} has a corrupt header entry ({err})") from err
            count = 1
            for d in shape:
                count *= d
            if end - begin != count * dtype.itemsize or self.data_start + end > size:
                raise WeightsError(
                    f"{path}: tensor {name!r} is truncated or corrupt (bytes {begin}..{end} of shape {list(shape)} "
                    f"{e['dtype']}; data region holds {size - self.data_start} bytes)"
                )
            self.entries[name] = (dtype, shape, begin, end)

    def read(self, name: str) -> torch.Tensor:
        dtype, shape, begin, end = self.entries[name]
        buf = torch.empty(end - begin, dtype=torch.uint8)
        with open(self.path, "rb") as f:
            f.seek(self.data_start + begin)
            got = f.readinto(memoryview(buf.numpy()))
        if got != end - begin:
            raise WeightsError(f"{self.path}: tensor {name!r} is truncated (read {got} of {end - begin} bytes)")
        return buf.view(dtype).reshape(shape)


class Checkpoint:
    """Name -> file index over every *.safetensors of an HF checkpoint directory, with per-tensor reads."""

    def __init__(self, model_dir: Path) -> None:
        self.dir = Path(model_dir)
        if not (self.dir / "config.json").is_file():
            raise WeightsError(f"{self.dir}: no config.json (not an HF checkpoint directory)")
        paths = sorted(self.dir.glob("*.safetensors"))
        if not paths:
            raise WeightsError(f"{self.dir}: no *.safetensors files")
        self.files = [SafetensorsFile(p) for p in paths]
        self.where: dict[str, SafetensorsFile] = {}
        for f in self.files:
            for name in f.entries:
                self.where[name] = f

    def close(self) -> None:
        """Nothing stays open between reads; kept so callers can use `with`."""

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def config(self) -> dict:
        try:
            return json.loads((self.dir / "config.json").read_text())
        except json.JSONDecodeError as e:
            raise WeightsError(f"{self.dir / 'config.json'}:{e.lineno}: invalid JSON ({e.msg})") from e

    def generation_config(self) -> dict | None:
        p = self.dir / "generation_config.json"
        return json.loads(p.read_text()) if p.is_file() else None

    def names(self) -> set[str]:
        return set(self.where)

    def _file(self, name: str) -> SafetensorsFile:
        f = self.where.get(name)
        if f is None:
            raise WeightsError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        return f

    def shape(self, name: str) -> tuple[int, ...]:
        return self._file(name).entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        """The dtype a tensor is stored in, from its file's header (nothing read; fp8 is reported as stored)."""
        return self._file(name).entries[name][0]

    def fp8_block(self) -> tuple[int, int] | None:
        """(block_n, block_k) of a block-scaled fp8 checkpoint (config.json quantization_config), else None.
        Any other quantisation is refused by name: tilepd would otherwise read its packed bytes as weights."""
        q = self.config().get("quantization_config")
        if q is None or quantizes_only_kv_cache(q):
            return None
        where = f"{self.dir / 'config.json'}: quantization_config"
        if q.get("quant_method") != "fp8":
            raise WeightsError(f"{where}.quant_method {q.get('quant_method')!r} is not supported (only block-scaled 'fp8')")
        if q.get("fmt", "e4m3") != "e4m3":
            raise WeightsError(f"{where}.fmt {q.get('fmt')!r} is not supported (only 'e4m3')")
        block = q.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise WeightsError(f"{where}.weight_block_size {block!r} is not supported (per-tensor fp8; need [block_n, block_k])")
        return int(block[0]), int(block[1])

    def is_fp8(self, name: str) -> bool:
        """A block-scaled fp8 tensor: stored float8_e4m3fn with a `<name>_scale_inv` beside it."""
        return self._file(name).entries[name][0] == torch.float8_e4m3fn and name + "_scale_inv" in self.where

    def get_raw(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(tensor as stored, its weight_scale_inv or None); fp8 values are not dequantised."""
        t = self._file(name).read(name)
        if t.dtype == torch.float8_e4m3fn and name + "_scale_inv" in self.where:
            return t, self._file(name + "_scale_inv").read(name + "_scale_inv")
        if t.is_floating_point() and t.dtype.itemsize > 1 and not bool(torch.isfinite(t).all()):
            raise WeightsError(f"{self._file(name).path}: tensor {name!r} holds NaN or Inf values (corrupt checkpoint?)")
        return t, None

    def get(self, name: str) -> torch.Tensor:
        """One tensor; float8 block-quantised sources (weight_scale_inv) dequantised; finiteness checked."""
        f = self._file(name)
        t = f.read(name)
        if t.dtype == torch.float8_e4m3fn and name + "_scale_inv" in self.where:
            t = _dequant_block_fp8(t, self._file(name + "_scale_inv").read(name + "_scale_inv"))
        if t.is_floating_point() and t.dtype.itemsize > 1 and not bool(torch.isfinite(t).all()):
            raise WeightsError(f"{f.path}: tensor {name!r} holds NaN or Inf values (corrupt checkpoint?)")
        return t


def _dequant_block_fp8(w: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V3 style fp8: one float32 scale per 128x128 block."""
    rows, cols = w.shape
    br = -(-rows // scale_inv.shape[0])
    bc = -(-cols // scale_inv.shape[1])
    s = scale_inv.repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return w.float() * s.float()
