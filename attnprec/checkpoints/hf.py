"""Import an HF-format checkpoint directory: `config.json` + `*.safetensors`.

    config, params, tokenizer = load_hf_dir("path/to/dir", param_dtype="float32")

Weights come from `model.safetensors`, or from the shards listed in
`model.safetensors.index.json`; files are memory-mapped and each tensor is read once,
converted to the param dtype and (for Linear weights) transposed from HF's [out, in] to our
[in, out]. Every tensor is checked against `attnprec.model.param_shapes(config)`; a tensor
the config has no place for (e.g. an o-projection bias) is an error, not silently dropped.
The tokenizer is read from `tokenizer.json` when the directory has one (else None).

Which HF tensor goes where (names under the text model's prefix, the untied `lm_head`
beside it, which are stored [out, in]): the parameter layout table, `attnprec.layout`.
"""
import json
import pathlib
from typing import Dict, Optional, Tuple

from attnprec import layout, paths, readback
from attnprec.checkpoints.hf_config import config_from_hf
from attnprec.checkpoints.params import ParamBuilder
from attnprec.checkpoints.safetensors_file import SafetensorsFile
from attnprec.checkpoints.tokenizer import Tokenizer
from attnprec.config import ModelConfig
from attnprec.errors import UserError

# Where the text decoder lives in the checkpoint: plain causal LMs, then multimodal gemma3
# (new and old transformers layouts). The lm_head sits beside the prefix's parent.
_PREFIXES = (("model.", "lm_head.weight"),
             ("model.language_model.", "lm_head.weight"),
             ("language_model.model.", "language_model.lm_head.weight"),
             ("", "lm_head.weight"))
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_config(directory: pathlib.Path) -> dict:
  path = directory / "config.json"
  if not path.is_file():
    raise UserError(f"{directory} is not an HF checkpoint directory: it has no config.json "
                    f"(expected config.json and model.safetensors or "
                    f"model.safetensors.index.json).")
  try:
    return json.loads(path.read_text(encoding="utf-8"),
                      object_pairs_hook=readback.unique_keys)
  except (OSError, ValueError) as e:          # UnicodeDecodeError and JSON's errors too
    raise UserError(f"Cannot read {path}: {e}.") from None


def weight_files(directory: pathlib.Path) -> Dict[str, pathlib.Path]:
  """{tensor name: file holding it}, from the shard index or the single file."""
  index = directory / "model.safetensors.index.json"
  single = directory / "model.safetensors"
  if index.is_file():
    try:
      weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as e:
      raise UserError(f"Cannot read the shard index {index}: {e!r}.") from None
    files = {name: directory / fname for name, fname in weight_map.items()}
    missing = sorted({str(p) for p in files.values() if not p.is_file()})
    if missing:
      raise UserError(f"The shard index {index} lists weight file(s) that do not exist: "
                      f"{', '.join(missing)}.")
    for file in sorted(set(files.values())):
      _not_empty(file)
    return files
  if single.is_file():
    _not_empty(single)
    return {name: single for name in SafetensorsFile(single).keys()}
  raise UserError(f"{directory} has a config.json but no weights: expected "
                  f"model.safetensors or model.safetensors.index.json.")


def _not_empty(file: pathlib.Path) -> None:
  if file.stat().st_size == 0:
    raise UserError(f"Weights file {file} is empty (0 bytes): an interrupted download or "
                    f"copy. Re-download or re-save the checkpoint.")


def tensor_map(config: ModelConfig) -> Dict[str, Tuple[str, str, bool]]:
  """{HF name under the prefix: (our module, our param name, transpose?)}, from the
  layout table (without the untied head, which sits beside the prefix)."""
  return {name: (p.module(i), p.name, p.transpose)
          for name, (p, i) in layout.tensor_map(config, "hf").items()
          if p.key != layout.HF_HEAD_KEY}


def load_hf_dir(path, *, param_dtype="float32"
                ) -> Tuple[ModelConfig, dict, Optional[Tokenizer]]:
  """(config, params {module: {name: np.ndarray}}, tokenizer or None) of an HF directory."""
  directory = pathlib.Path(path)
  if not directory.is_dir():
    raise UserError(f"Checkpoint directory {directory} {paths.unreachable(directory)}.")
  config = config_from_hf(read_config(directory), origin=str(directory / "config.json"))
  files = weight_files(directory)
  prefix, head_name = _find_prefix(files, directory)
  builder = ParamBuilder(config, param_dtype, origin=str(directory))
  mapping = {prefix + k: v for k, v in tensor_map(config).items()}
  if not config.tie_embeddings:
    head = layout.param(layout.HF_HEAD_KEY)
    mapping[head_name] = (head.module(), head.name, head.transpose)
  opened: Dict[pathlib.Path, SafetensorsFile] = {}
  for name, file in sorted(files.items()):
    if name not in mapping:
      if (name == head_name or not name.startswith(prefix)
          or name.endswith(_IGNORED_SUFFIXES)):
        continue    # a tied head stored anyway (transformers ignores it too), a vision
                    # tower or projector, cached RoPE tables
      raise UserError(f"Checkpoint tensor {name!r} in {file} has no place in the model its "
                      f"config describes (an architecture feature we do not implement, or "
                      f"a config that does not match the weights).")
    if file not in opened:
      opened[file] = SafetensorsFile(file)
    if name not in opened[file].keys():
      raise UserError(f"Tensor {name!r} is listed for {file} but that file does not hold it.")
    module, pname, transpose = mapping[name]
    builder.put(module, pname, opened[file].get(name), source=name, file=str(file),
                transpose=transpose)
  params = builder.finish()
  return config, params, Tokenizer.from_hf_dir(directory)


def _find_prefix(files: Dict[str, pathlib.Path], directory) -> Tuple[str, str]:
  for prefix, head in _PREFIXES:
    if prefix + "embed_tokens.weight" in files:
      return prefix, head
  raise UserError(f"No embedding tensor in the weights of {directory}: expected one of "
                  f"{[p + 'embed_tokens.weight' for p, _ in _PREFIXES]}.")
