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

`logits(checkpoint_or_config_params, tokens_BxT, *, precision)`: full-sequence logits
[B, T, V] float32 under the given attention/matmul precision; the forward pass is jitted
once per (config, precision) and reused.

`generate(ckpt, prompts, *, precision, max_new_tokens, sampler, rng=None, chat=False)`:
texts or token id lists in, `Generation(texts, tokens, stopped)` out; each sequence stops
at the tokenizer's end token; greedy (the default sampler) needs no rng
(`attnprec.checkpoints.generation`).

Every problem with the input (missing or corrupt file, unsupported architecture or
quantization type, a tensor whose shape disagrees with the config) raises
`attnprec.errors.UserError` with one paragraph naming the file, tensor and expectation.
"""
import functools
import os
import pathlib
from typing import NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from attnprec.checkpoints import trained
from attnprec.checkpoints.generation import Generation, generate
from attnprec.checkpoints.gguf import load_gguf
from attnprec.checkpoints.hf import load_hf_dir
from attnprec.checkpoints.params import param_dtype as param_dtype_of
from attnprec.checkpoints.shipped import SHIPPED, shipped_path
from attnprec.checkpoints.tokenizer import Tokenizer
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.model import transformed
from attnprec.precision import Precision

__all__ = ["Checkpoint", "Generation", "Tokenizer", "SHIPPED", "generate", "load", "logits",
           "shipped_path"]


class Checkpoint(NamedTuple):
  config: ModelConfig           # the architecture
  params: dict                  # {module: {name: jax.Array}} in the requested param dtype
  tokenizer: Optional[Tokenizer]
  source: str                   # what was loaded, in words
  task: object = None           # a train run's RecallTask (task.json), else None


def _names() -> str:
  return ", ".join(list(SHIPPED) + list(trained.SHIPPED))


def load(path_or_name: Union[str, os.PathLike], *, param_dtype: str = "float32"
         ) -> Checkpoint:
  """Loads a shipped model (or recall checkpoint) by name, a train run directory, an HF
  checkpoint directory or a .gguf file (see the module docstring)."""
  dtype = param_dtype_of(param_dtype)     # a bad value fails before any file is read
  key = str(path_or_name)
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
    path = pathlib.Path(path_or_name)
    if path.is_dir():
      config, params, tok = load_hf_dir(path, param_dtype=param_dtype)
      source = f"HF checkpoint {path}"
    elif path.is_file() and path.suffix == ".gguf":
      config, params, tok = load_gguf(path, param_dtype=param_dtype)
      source = f"GGUF file {path}"
    elif path.exists():
      raise UserError(f"Cannot load {path}: expected an HF checkpoint directory "
                      f"(config.json + *.safetensors), a .gguf file or a train run "
                      f"directory (model.json + params.npz).")
    else:
      raise UserError(f"Checkpoint {key!r} does not exist: it is neither a shipped "
                      f"checkpoint ({_names()}) nor an existing path. Pass a train run "
                      f"directory ('make train' writes runs/recall), an HF checkpoint "
                      f"directory or a .gguf file.")
  params = jax.tree_util.tree_map(jnp.asarray, params)
  return Checkpoint(config, params, tok, source, task)


@functools.lru_cache(maxsize=32)
def _forward(config: ModelConfig, precision: Precision):
  apply = transformed(config).apply
  return jax.jit(lambda params, tokens_BxT: apply(params, tokens_BxT,
                                                  precision=precision).logits)


def logits(checkpoint_or_config_params: Union[Checkpoint, Tuple[ModelConfig, dict]],
           tokens_BxT, *, precision: Precision = Precision()) -> jax.Array:
  """Full-sequence logits [B, T, V] float32 of `tokens_BxT` (int, positions 0..T-1)."""
  if isinstance(checkpoint_or_config_params, Checkpoint):
    config, params = checkpoint_or_config_params.config, checkpoint_or_config_params.params
  else:
    config, params = checkpoint_or_config_params
  tokens = np.asarray(tokens_BxT)
  if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
    raise UserError(f"tokens_BxT must be a 2-D integer array [batch, length], got shape "
                    f"{tokens.shape} dtype {tokens.dtype}.")
  if tokens.size and (tokens.min() < 0 or tokens.max() >= config.vocab_size):
    raise UserError(f"Token ids must lie in [0, {config.vocab_size}); got "
                    f"{tokens.min()}..{tokens.max()}.")
  return _forward(config, precision)(params, jnp.asarray(tokens, jnp.int32))
