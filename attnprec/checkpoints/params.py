"""Assembling Haiku params from a checkpoint's tensors, checked against the model.

Importers call `ParamBuilder.put(module, name, array, source=...)` once per parameter;
every array is checked against `attnprec.model.param_shapes(config)` at once (an error
names the checkpoint tensor, its file, the expected and the actual shape), and `finish()`
checks that nothing is missing. Arrays are converted to the requested param dtype.
"""
from typing import Dict, Optional

import numpy as np

from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.model import param_shapes
from attnprec.precision import parse_dtype

PARAM_DTYPES = ("float32", "bfloat16", "float16")


def param_dtype(name) -> np.dtype:
  """'float32' | 'bfloat16' | 'float16' -> a numpy dtype (bfloat16 via ml_dtypes)."""
  if isinstance(name, str) and name.lower() not in PARAM_DTYPES:
    raise UserError(f"Invalid param_dtype {name!r}; valid values are: "
                    f"{', '.join(map(repr, PARAM_DTYPES))}.")
  return np.dtype(parse_dtype(name))


class ParamBuilder:
  """Collects `{module: {name: array}}` exactly matching `param_shapes(config)`."""

  def __init__(self, config: ModelConfig, dtype="float32", *, origin: str = ""):
    self.config = config
    self.dtype = param_dtype(dtype)
    self.origin = origin          # the checkpoint, for error messages
    self.expected = {m: {n: tuple(s.shape) for n, s in d.items()}
                     for m, d in param_shapes(config).items()}
    self.params: Dict[str, Dict[str, np.ndarray]] = {}
    self.sources: Dict[tuple, str] = {}

  def put(self, module: str, name: str, array: np.ndarray, *, source: str,
          file: Optional[str] = None, transpose: bool = False) -> None:
    """Stores one parameter. `source` names the checkpoint tensor it came from.

    `transpose`: the tensor is stored [out, in] (HF and GGUF Linear layout) and is
    transposed to our [in, out]; shapes in errors are then given in the file's layout.
    """
    where = f"tensor {source!r} in {file or self.origin}"
    if module not in self.expected or name not in self.expected[module]:
      raise UserError(f"Checkpoint {where} maps to parameter {module}/{name}, which the "
                      f"model config does not have (the checkpoint and its config disagree "
                      f"about the architecture).")
    want = self.expected[module][name]
    if transpose:
      want = want[::-1]
    if tuple(array.shape) != want:
      raise UserError(f"Checkpoint {where} has shape {tuple(array.shape)}, but the model "
                      f"config expects {want} for it (parameter {module}/{name}); the "
                      f"checkpoint does not match its config (file corrupt or config "
                      f"edited?).")
    if transpose:
      array = np.asarray(array).T
    if (module, name) in self.sources:
      raise UserError(f"Checkpoint {where} gives parameter {module}/{name} a second time "
                      f"(first from {self.sources[(module, name)]!r}).")
    array = np.asarray(array)
    if not np.issubdtype(array.dtype, np.floating) and array.dtype.name != "bfloat16":
      raise UserError(f"Checkpoint {where} has dtype {array.dtype}; expected a float tensor.")
    with np.errstate(over="ignore"):   # beyond a 16-bit dtype's range: Inf, which
      # `checkpoints.finite.check_params` then reports by tensor
      self.params.setdefault(module, {})[name] = np.asarray(array, dtype=self.dtype,
                                                            order="C")
    self.sources[(module, name)] = source

  def finish(self) -> Dict[str, Dict[str, np.ndarray]]:
    """The params; raises naming every parameter no tensor provided."""
    missing = [f"{m}/{n} {s}" for m, d in sorted(self.expected.items())
               for n, s in sorted(d.items()) if (m, n) not in self.sources]
    if missing:
      shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8
                                        else "")
      raise UserError(f"Checkpoint {self.origin} is missing {len(missing)} tensor(s) the "
                      f"model config needs: {shown}. The file is incomplete or its config "
                      f"describes a different architecture.")
    return self.params
