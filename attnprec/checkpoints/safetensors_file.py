"""A lazy, memory-mapped reader for `.safetensors` files (the HF weight format).

Format: 8 bytes little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then
the raw little-endian tensor bytes; offsets are relative to the end of the header.

Why not `safetensors.safe_open(framework="numpy")`: it cannot return bfloat16 tensors (numpy
has no bfloat16), and most HF checkpoints are bfloat16. Here the file is memory-mapped and
bfloat16 is viewed through `ml_dtypes` (a jax dependency); nothing is read until a tensor
is asked for, and the header is validated up front (offsets inside the file, byte counts
matching the shapes) so a truncated or corrupt file fails with a clear `UserError`.
"""
import json
import os
import struct
from typing import Dict, NamedTuple, Tuple

import ml_dtypes
import numpy as np

from attnprec.errors import UserError

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16,
          "BF16": ml_dtypes.bfloat16, "I64": np.int64, "I32": np.int32, "I16": np.int16,
          "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_}


class TensorEntry(NamedTuple):
  dtype: np.dtype
  shape: Tuple[int, ...]
  begin: int              # absolute byte offset in the file
  end: int


class SafetensorsFile:
  """`keys()`, `shape(name)`, `get(name) -> np.ndarray` (a read-only memory-mapped view)."""

  def __init__(self, path: str):
    self.path = str(path)
    try:
      size = os.path.getsize(self.path)
      with open(self.path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
          raise self._corrupt("it is shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
          raise self._corrupt(f"its header claims {n} bytes but the file has {size}")
        header = json.loads(f.read(n).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      if isinstance(e, FileNotFoundError):
        raise UserError(f"Weights file {self.path} does not exist.") from None
      raise self._corrupt(f"its header cannot be read ({e})") from None
    if not isinstance(header, dict):
      raise self._corrupt("its header is not a JSON object")
    header.pop("__metadata__", None)
    data_start = 8 + n
    self.entries: Dict[str, TensorEntry] = {}
    for name, info in header.items():
      try:
        dtype = np.dtype(DTYPES[info["dtype"]])
        shape = tuple(int(d) for d in info["shape"])
        begin, end = (int(o) for o in info["data_offsets"])
      except (KeyError, TypeError, ValueError):
        raise self._corrupt(f"tensor {name!r} has an unreadable entry {info!r} (supported "
                            f"dtypes: {', '.join(DTYPES)})") from None
      if end - begin != int(np.prod(shape, dtype=np.int64)) * dtype.itemsize:
        raise self._corrupt(f"tensor {name!r} spans {end - begin} bytes, not the "
                            f"{int(np.prod(shape)) * dtype.itemsize} its shape {shape} needs")
      if data_start + end > size:
        raise self._corrupt(f"tensor {name!r} ends at byte {data_start + end} but the file "
                            f"has only {size} bytes (truncated?)")
      self.entries[name] = TensorEntry(dtype, shape, data_start + begin, data_start + end)
    self._map = np.memmap(self.path, mode="r", dtype=np.uint8) if size > data_start else None

  def _corrupt(self, why: str) -> UserError:
    return UserError(f"Weights file {self.path} is not a valid .safetensors file: {why}. "
                     f"Re-download or re-save the checkpoint.")

  def keys(self):
    return self.entries.keys()

  def shape(self, name: str) -> Tuple[int, ...]:
    return self.entries[name].shape

  def get(self, name: str) -> np.ndarray:
    e = self.entries[name]
    if e.end == e.begin:
      return np.zeros(e.shape, e.dtype)
    return self._map[e.begin:e.end].view(e.dtype).reshape(e.shape)
