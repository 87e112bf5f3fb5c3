"""Loading models: shipped models, train run directories, HF directories, GGUF files.

Public API (stable):

    from attnprec import checkpoints
    ckpt = checkpoints.load("smollm2-135m")     # or "recall-tiny", a run dir, an HF dir, a .gguf
    ckpt.config        # attnprec.config.ModelConfig
    ckpt.params        # Haiku params {module: {name: jax.Array}}, == param_shapes(config)
    ckpt.tokenizer     # attnprec.checkpoints.tokenizer.Tokenizer (or None)
    ckpt.source        # where it came from, in words
    logits_BxTxV = checkpoints.logits(ckpt, tokens_BxT, precision=Precision())
    out = checkpoints.generate(ckpt, ["Once upon a time"], precision=REFERENCE,
                               max_new_tokens=16)   # out.texts, out.tokens, out.stopped

`load(path_or_name, *, param_dtype="float32")`, the one way to load a model:
  * a shipped model name (`attnprec.checkpoints.shipped`: "smollm2-135m", "gemma3-270m",
    ...) or the shipped recall checkpoint "recall-tiny";
  * a train run directory (model.json + params.npz, `attnprec.checkpoints.trained`);
    `ckpt.task` is its `RecallTask` for a recall run (task.json), else None;
  * a directory with config.json + *.safetensors: HF format (`attnprec.checkpoints.hf`);
    model types llama, qwen2, gemma, gemma2, gemma3;
  * a `.gguf` file (`attnprec.checkpoints.gguf`): same architectures.
  `param_dtype` is the dtype the params are stored in ("float32", "bfloat16",
  "float16"); the compute dtype is the phase's `Precision.dtype`, chosen per call.
  The params come in the layout of `ckpt.config.scan_layers`: the gin binding
  `model.scan_layers` when one is bound, else the checkpoint's own (a train run's
  model.json; False for HF and GGUF files), converted exactly (`layout.as_layout`).

`logits(checkpoint_or_config_params, tokens_BxT, *, precision, check_finite=True)`:
full-sequence logits [B, T, V] float32 under the given attention/matmul precision; the
forward pass is jitted once per (config, precision) and reused.

`generate(ckpt, prompts, *, precision, max_new_tokens, sampler, rng=None, chat=False,
eos_id=None, check_finite=True)`: texts or token id lists in,
`Generation(texts, tokens, stopped, finite)` out; each sequence stops at the tokenizer's
end token; greedy (the default sampler) needs no rng (`attnprec.checkpoints.generation`).

Non-finite values are reported, never returned as if they were results:
  * `load` refuses a model whose weights hold NaN or Inf (after conversion to
    `param_dtype`), naming each tensor (module/name) and its NaN / Inf counts.
  * `logits` and `generate` raise `attnprec.errors.NonFiniteError` (a `UserError`) when
    any logits they computed are NaN or Inf: the message gives the first NaN/Inf (its
    position, or the decode step) and the first stage of the model whose output is not
    finite (the embedding, layer k attention / MLP / residual stream, the final norm, the
    unembedding), found by one extra forward pass with every module's output checked
    (`attnprec.checkpoints.finite`); `NonFiniteError.stage` holds that stage.
  * With `check_finite=False` nothing is raised: `logits` returns the array as computed,
    and `generate` returns every sequence, with `Generation.finite[b]` False for a
    sequence whose tokens were chosen from non-finite logits (its tokens are then
    meaningless). `Generation.finite` is filled either way.

Every problem with the input (a wrong argument type or value, missing, empty or corrupt
file, unsupported architecture or quantization type, a tensor whose shape disagrees with
the config) raises `attnprec.errors.UserError` with one paragraph naming the argument (or
file and tensor), the bad value (shortened to ~200 characters) and what is valid, before
anything is compiled.
"""
import dataclasses
import os
import pathlib
from typing import Union

import jax
import jax.numpy as jnp

from attnprec import checks, layout, paths, runs
from attnprec.checkpoints import finite, trained
from attnprec.checkpoints.forward import _forward  # noqa: F401  (one program per config)
from attnprec.checkpoints.forward import Checkpoint, logits
from attnprec.checkpoints.generation import Generation, generate
from attnprec.checkpoints.gguf import load_gguf
from attnprec.checkpoints.hf import load_hf_dir
from attnprec.checkpoints.params import PARAM_DTYPES
from attnprec.checkpoints.params import param_dtype as param_dtype_of
from attnprec.checkpoints.shipped import SHIPPED, shipped_path
from attnprec.checkpoints.tokenizer import Tokenizer
from attnprec.config import bound_scan_layers
from attnprec.errors import NonFiniteError, UserError, shorten

__all__ = ["Checkpoint", "Generation", "NonFiniteError", "Tokenizer", "SHIPPED", "generate",
           "load", "logits", "shipped_path"]


def _names() -> str:
  return ", ".join(list(SHIPPED) + list(trained.SHIPPED))


def _refuse_other_runs(path: pathlib.Path) -> None:
  """A directory another runner made (a study, a decode, an eval, a sizes table: its
  `runs.OWNER_FILE`) and that is no checkpoint is named as what it is, not as a broken HF
  checkpoint."""
  if (path / "config.json").exists():
    return
  made_by = runs.owner(str(path))
  if made_by is not None:
    raise UserError(f"{path} is a run directory of `{made_by}` (its {runs.OWNER_FILE}), "
                    f"not a checkpoint: it holds that runner's results, no weights. Pass a "
                    f"train run directory (`make train` writes runs/recall), an HF "
                    f"checkpoint directory (config.json + *.safetensors) or a .gguf file.")


def load(path_or_name: Union[str, os.PathLike], *, param_dtype: str = "float32"
         ) -> Checkpoint:
  """Loads a shipped model (or recall checkpoint) by name, a train run directory, an HF
  checkpoint directory or a .gguf file (see the module docstring)."""
  if not isinstance(path_or_name, (str, os.PathLike)) or not str(path_or_name):
    raise UserError(f"Invalid argument path_or_name={shorten(path_or_name)} of "
                    f"checkpoints.load: must be a shipped model name ({_names()}) or a path "
                    f"(str or os.PathLike) to a train run directory, an HF checkpoint "
                    f"directory or a .gguf file.")
  checks.check_argument("checkpoints.load", "param_dtype", param_dtype,
                        checks.one_of(*PARAM_DTYPES))
  dtype = param_dtype_of(param_dtype)     # a bad value fails before any file is read
  key = os.fspath(path_or_name)
  if isinstance(key, bytes):
    key = os.fsdecode(key)
  task = None
  if key in SHIPPED:
    path = shipped_path(key)
    config, params, tok = load_gguf(path, param_dtype=param_dtype)
    source = f"{key}: {SHIPPED[key].description} ({path})"
  elif key in trained.SHIPPED or trained.is_run_dir(key):
    config, params, task = trained.load_run(key, dtype=dtype)
    tok = None
    kind = "recall checkpoint" if task is not None else "train run"
    source = (f"{kind} {key} ({config.num_layers} layers, d={config.d_model})")
  else:
    path = pathlib.Path(key)
    try:
      kind = "dir" if path.is_dir() else "file" if path.is_file() else \
          "other" if path.exists() else None
    except OSError as e:                  # a name too long for the file system, ...
      raise UserError(f"Cannot load {shorten(key)}: {e.strerror or e}.") from None
    if kind == "dir":
      _refuse_other_runs(path)
      config, params, tok = load_hf_dir(path, param_dtype=param_dtype)
      source = f"HF checkpoint {path}"
    elif kind == "file" and path.suffix == ".gguf":
      config, params, tok = load_gguf(path, param_dtype=param_dtype)
      source = f"GGUF file {path}"
    elif kind is not None:
      raise UserError(f"Cannot load {path}: expected an HF checkpoint directory "
                      f"(config.json + *.safetensors), a .gguf file or a train run "
                      f"directory (model.json + params.npz).")
    else:
      raise UserError(f"Checkpoint {shorten(key)} {paths.unreachable(key)}: it is neither a shipped "
                      f"checkpoint ({_names()}) nor an existing path. Pass a train run "
                      f"directory ('make train' writes runs/recall), an HF checkpoint "
                      f"directory or a .gguf file.")
  finite.check_params(params, source)   # every loader: GGUF, HF, train runs
  # The program form: the gin binding model.scan_layers if any, else the checkpoint's
  # own; the params converted to its layout (exact: `layout.stack` / `layout.unstack`).
  scan = bound_scan_layers()
  if scan is not None and scan != config.scan_layers:
    config = dataclasses.replace(config, scan_layers=scan)
  params = layout.as_layout(params, config)
  params = jax.tree_util.tree_map(jnp.asarray, params)
  return Checkpoint(config, params, tok, source, task)
