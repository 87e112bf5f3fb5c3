"""A fast, validating reader for GGUF files (llama.cpp's single-file format).

Layout (little-endian): magic `GGUF`, version u32 (2 or 3), tensor count u64, metadata
count u64; metadata entries (key string, value type u32, value); tensor infos (name, n_dims
u32, dims u64 x n_dims fastest-moving first, ggml type u32, offset u64); padding to
`general.alignment` (default 32); tensor data. A string is a u64 length + UTF-8 bytes.

Why not `gguf.GGUFReader`: it builds a numpy view per array element, so opening a file
with a 262k-token vocabulary takes 2-20 s; walking the header with `struct` takes well
under a second. Tensor bytes stay memory-mapped until asked for, and are dequantized with
`gguf.quants.dequantize` (the gguf package's reference NumPy kernels).

Every offset is checked against the file size, and every tensor's dimensions (at most 4,
their product below 2^63: computed with Python integers, so a hostile header cannot wrap
a 64-bit count around to a small size), so a truncated, corrupt or hostile file raises a
`UserError` naming the file (and the tensor), never an IndexError, a MemoryError or
garbage weights.
"""
import math
import os
import struct
from typing import Dict, NamedTuple, Tuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf import quants as gguf_quants

from attnprec import paths
from attnprec.errors import UserError

# Quantization types we dequantize (each checked by the tests, directly or on a real model).
SUPPORTED_TYPES = tuple(GGMLQuantizationType[n] for n in (
    "F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K",
    "Q5_K", "Q6_K"))
_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
          6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
MAX_DIMS = 4              # GGML_MAX_DIMS


class TensorInfo(NamedTuple):
  name: str
  shape: Tuple[int, ...]       # numpy order (slowest first): HF's [out, in] for a Linear
  ggml_type: int
  begin: int                   # absolute byte offset
  nbytes: int


class _Truncated(Exception):
  pass


class GGUFFile:
  """`metadata` (dict), `tensors` ({name: TensorInfo}), `tensor(name) -> float32 array`."""

  def __init__(self, path):
    self.path = str(path)
    if not os.path.isfile(self.path):
      raise UserError(f"GGUF file {self.path} {paths.unreachable(self.path)}.")
    if os.path.getsize(self.path) == 0:
      raise self._corrupt("it is empty (0 bytes: an interrupted download or copy?)")
    self._map = np.memmap(self.path, mode="r", dtype=np.uint8)
    self._buf = memoryview(self._map)
    self.size = len(self._map)
    try:
      self._parse()
    except UserError:
      raise
    except _Truncated:
      raise self._corrupt("it ends inside its header (truncated download?)") from None
    except (UnicodeDecodeError, struct.error, OverflowError, ValueError) as e:
      raise self._corrupt(f"its header cannot be parsed ({e})") from None

  def _corrupt(self, why: str) -> UserError:
    return UserError(f"{self.path} is not a valid GGUF file: {why}. Re-download or "
                     f"re-assemble it.")

  # -- header ---------------------------------------------------------------------------
  def _take(self, fmt: str):
    n = struct.calcsize(fmt)
    if self._pos + n > self.size:
      raise _Truncated()
    values = struct.unpack_from(fmt, self._buf, self._pos)
    self._pos += n
    return values if len(values) > 1 else values[0]

  def _string(self) -> str:
    n = self._take("<Q")
    if self._pos + n > self.size:
      raise _Truncated()
    s = bytes(self._buf[self._pos:self._pos + n]).decode("utf-8")
    self._pos += n
    return s

  def _value(self, vtype: int):
    if vtype in _SCALAR:
      return self._take(_SCALAR[vtype])
    if vtype == _STRING:
      return self._string()
    if vtype == _ARRAY:
      etype, count = self._take("<IQ")
      if etype in _NUMPY:
        dtype = np.dtype(_NUMPY[etype]).newbyteorder("<")
        end = self._pos + count * dtype.itemsize
        if end > self.size:
          raise _Truncated()
        arr = np.frombuffer(self._buf, dtype, count, self._pos).copy()
        self._pos = end
        return arr
      return [self._value(etype) for _ in range(count)]
    raise ValueError(f"unknown metadata value type {vtype}")

  def _parse(self):
    self._pos = 0
    if self.size < 4 or bytes(self._buf[:4]) != b"GGUF":
      raise self._corrupt("it does not start with the GGUF magic bytes")
    self._pos = 4
    version, n_tensors, n_kv = self._take("<IQQ")
    if version not in (2, 3):
      raise self._corrupt(f"GGUF version {version} is not supported (2 and 3 are)")
    self.metadata: Dict[str, object] = {}
    for _ in range(n_kv):
      key = self._string()
      self.metadata[key] = self._value(self._take("<I"))
    infos = []
    for _ in range(n_tensors):
      name = self._string()
      n_dims = self._take("<I")
      if n_dims > MAX_DIMS:
        raise self._corrupt(f"tensor {name[:100]!r} has {n_dims} dimensions (GGUF tensors "
                            f"have at most {MAX_DIMS})")
      dims = self._take(f"<{n_dims}Q") if n_dims else ()
      dims = (dims,) if n_dims == 1 else tuple(dims)
      elements = 1
      for d in dims:
        elements *= d            # Python ints: no wrap-around
      if elements >= 2 ** 63:
        raise self._corrupt(f"tensor {name[:100]!r} has dimensions {list(dims)}: their "
                            f"product ({elements} elements) overflows a 64-bit count")
      ggml_type, offset = self._take("<IQ")
      infos.append((name, tuple(reversed(dims)), ggml_type, offset))
    align = self.metadata.get("general.alignment", 32)
    if isinstance(align, bool) or not isinstance(align, (int, np.integer)) or not (
        0 < int(align) <= 1 << 20):
      raise self._corrupt(f"its general.alignment is {str(align)[:50]} (expected a positive "
                          f"integer, 32 by default)")
    align = int(align)
    data_start = -(-self._pos // align) * align
    self.tensors: Dict[str, TensorInfo] = {}
    for name, shape, ggml_type, offset in infos:
      nbytes = _nbytes(ggml_type, shape)
      begin = data_start + offset
      if nbytes is not None and begin + nbytes > self.size:
        raise self._corrupt(f"tensor {name!r} ends at byte {begin + nbytes} but the file has "
                            f"only {self.size} bytes (truncated download?)")
      self.tensors[name] = TensorInfo(name, shape, ggml_type, begin, nbytes or 0)

  # -- tensors --------------------------------------------------------------------------
  def type_name(self, name: str) -> str:
    t = self.tensors[name].ggml_type
    try:
      return GGMLQuantizationType(t).name
    except ValueError:
      return f"unknown ggml type {t}"

  def raw(self, name: str) -> np.ndarray:
    """The tensor's bytes as stored (uint8, memory-mapped, read-only)."""
    info = self.tensors[name]
    return np.asarray(self._map[info.begin:info.begin + info.nbytes])

  def tensor(self, name: str) -> np.ndarray:
    """The tensor dequantized to float32, numpy shape (slowest axis first)."""
    info = self.tensors[name]
    if info.ggml_type not in SUPPORTED_TYPES:
      raise UserError(
          f"Tensor {name!r} in {self.path} is stored as {self.type_name(name)}, which is not "
          f"supported; supported GGUF tensor types: "
          f"{', '.join(t.name for t in SUPPORTED_TYPES)}.")
    qtype = GGMLQuantizationType(info.ggml_type)
    raw = self.raw(name)
    if qtype == GGMLQuantizationType.F32:
      values = raw.view("<f4")
    else:
      values = gguf_quants.dequantize(raw, qtype)
    return np.asarray(values, np.float32).reshape(info.shape)


def _nbytes(ggml_type: int, shape) -> "int | None":
  """Bytes a tensor occupies, or None for a type gguf does not know (error when read)."""
  try:
    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
  except (ValueError, KeyError):
    return None
  n = math.prod(int(d) for d in shape)     # exact (dimensions checked < 2^63)
  if n % block:
    raise ValueError(f"a tensor of {n} elements is not a whole number of "
                     f"{GGMLQuantizationType(ggml_type).name} blocks of {block}")
  return n // block * block_bytes
