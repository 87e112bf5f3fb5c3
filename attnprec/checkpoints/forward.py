"""`Checkpoint` and `logits`: the loaded model as plain data, and its full-sequence
forward pass (re-exported by `attnprec.checkpoints`, where users find them; kept in a
module of their own so `generation` can use them without importing the package)."""
import functools
from typing import NamedTuple, Optional, Tuple, Union

import jax
import jax.numpy as jnp
import numpy as np

from attnprec import checks
from attnprec.checkpoints import finite
from attnprec.checkpoints.tokenizer import Tokenizer
from attnprec.config import ModelConfig
from attnprec.contract import COMPUTE_CACHE
from attnprec.errors import UserError, shorten
from attnprec.model import check_params, transformed
from attnprec.precision import Precision


class Checkpoint(NamedTuple):
  config: ModelConfig           # the architecture
  params: dict                  # {module: {name: jax.Array}} in the requested param dtype
  tokenizer: Optional[Tokenizer]
  source: str                   # what was loaded, in words
  task: object = None           # a train run's RecallTask (task.json), else None



@functools.lru_cache(maxsize=32)
def _forward(config: ModelConfig, precision: Precision):
  apply = transformed(config).apply
  return jax.jit(lambda params, tokens_BxT: apply(params, tokens_BxT,
                                                  precision=precision).logits)


def config_and_params(checkpoint_or_config_params, function: str):
  """(config, params) of a Checkpoint or a (ModelConfig, params dict) pair."""
  if isinstance(checkpoint_or_config_params, Checkpoint):
    return checkpoint_or_config_params.config, checkpoint_or_config_params.params
  if (isinstance(checkpoint_or_config_params, tuple) and len(checkpoint_or_config_params) == 2
      and isinstance(checkpoint_or_config_params[0], ModelConfig)
      and isinstance(checkpoint_or_config_params[1], dict)):
    config, params = checkpoint_or_config_params
    # every tensor the architecture reads, of its shape: else a UserError naming them
    # (haiku's ValueError from deep inside the forward pass)
    check_params(config, params, f"the (ModelConfig, params) pair given to {function}")
    return config, params
  raise UserError(f"Invalid first argument {shorten(checkpoint_or_config_params)} of "
                  f"{function}: must be a checkpoints.Checkpoint (from checkpoints.load) or "
                  f"a (ModelConfig, params dict) pair.")


def token_array(tokens_BxT, config: ModelConfig, function: str) -> np.ndarray:
  """A [B, T] integer array of ids in [0, vocab), T within the model's context."""
  try:
    tokens = np.asarray(tokens_BxT)
  except (ValueError, TypeError):
    tokens = None                      # ragged lists (numpy >= 1.24 refuses them)
  if tokens is None or tokens.dtype == object:
    raise UserError(f"Invalid argument tokens_BxT={shorten(tokens_BxT)} of {function}: the "
                    f"rows have different lengths (or are not numbers); pass a 2-D integer "
                    f"array [batch, length] with rows of one length (pad them; "
                    f"decoding.pad_prompts right-pads token lists).")
  if (tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer)
      or tokens.dtype == np.bool_):
    raise UserError(f"tokens_BxT must be a 2-D integer array [batch, length], got shape "
                    f"{tokens.shape} dtype {tokens.dtype} ({shorten(tokens_BxT)}).")
  if tokens.shape[0] == 0 or tokens.shape[1] == 0:
    raise UserError(f"tokens_BxT of {function} has shape {tokens.shape}: it needs at least "
                    f"one sequence of at least one token.")
  if tokens.min() < 0 or tokens.max() >= config.vocab_size:
    raise UserError(f"Token ids must lie in [0, {config.vocab_size}); got "
                    f"{tokens.min()}..{tokens.max()}.")
  if tokens.shape[1] > config.max_seq_len:
    raise UserError(f"tokens_BxT of {function} holds sequences of {tokens.shape[1]} tokens, "
                    f"longer than the model's context ({config.max_seq_len} tokens); pass at "
                    f"most {config.max_seq_len} tokens per sequence.")
  return tokens


def check_precision(precision, function: str) -> None:
  if not isinstance(precision, Precision):
    raise UserError(f"Invalid argument precision={shorten(precision)} of {function}: must "
                    f"be an attnprec.precision.Precision, e.g. Precision(dtype='bfloat16') "
                    f"or precision.REFERENCE.")
  for name in ("carrier_weights", "stored_weights"):
    if getattr(precision, name):
      raise UserError(f"Invalid argument precision of {function}: {name}=True is set by "
                      f"attnprec itself, with the weights it prepares for serving "
                      f"(`decoding.serving_precision`); given by hand it describes weights "
                      f"this call does not make. Leave it False.")


def logits(checkpoint_or_config_params: Union[Checkpoint, Tuple[ModelConfig, dict]],
           tokens_BxT, *, precision: Precision = Precision(),
           check_finite: bool = True) -> jax.Array:
  """Full-sequence logits [B, T, V] float32 of `tokens_BxT` (int, positions 0..T-1).

  check_finite: raise `NonFiniteError` if any logit is NaN or Inf (naming the first one
    and the model stage that produced it); False returns the logits as computed.
  """
  config, params = config_and_params(checkpoint_or_config_params, "checkpoints.logits")
  tokens = token_array(tokens_BxT, config, "checkpoints.logits")
  check_precision(precision, "checkpoints.logits")
  if precision.cache_storage.without_offset() != COMPUTE_CACHE:
    raise UserError(f"Invalid argument precision of checkpoints.logits: "
                    f"{precision.cache_storage.describe()} sets how a KV cache is stored, "
                    f"but a full-sequence forward pass keeps no cache, so the setting would "
                    f"not be used. Leave the kv_cache_* fields at 'compute' here, or pass the "
                    f"precision to checkpoints.generate, which decodes from a cache.")
  checks.check_argument("checkpoints.logits", "check_finite", check_finite, checks.boolean)
  out = _forward(config, precision)(params, jnp.asarray(tokens, jnp.int32))
  if check_finite:
    nan, inf, first = finite.logits_problem(out)
    if first:
      stage = finite.first_nonfinite_stage(config, params, tokens, precision)
      kind = "NaN" if nan else "Inf"
      raise finite.nonfinite_error(
          "the logits of checkpoints.logits", precision,
          finite.Where(kind, f"at sequence {first[0]}, position {first[1]}; {nan} NaN and "
                             f"{inf} Inf of {out.size} values"),
          stage, " Pass check_finite=False to get them anyway.")
  return out
