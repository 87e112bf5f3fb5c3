"""Whether a request fits the machine: an estimate of one batch's memory, checked before
anything is computed (a huge `recall_eval.num_prompts` or `study.batch` is refused with
its estimate instead of running until the kernel kills it).

The estimate is a floor of what one forward pass over the batch holds at once, in
float32: the KV cache (every layer's keys and values), the dense kernel's attention
logits and probabilities for one layer ([B, N, T, S], the largest activation of a long
prompt), and the residual stream and MLP activations of one layer. The real program
holds more (weights, XLA's temporaries), so a request above the limit surely fails.
"""
import os
from typing import Optional

from attnprec.config import ModelConfig
from attnprec.errors import UserError

# The share of the machine's memory one batch may claim.
SHARE = 0.8


def physical_bytes() -> Optional[int]:
  """This machine's physical memory in bytes (None where the OS does not say)."""
  try:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
  except (ValueError, OSError, AttributeError):
    return None


def batch_bytes(config: ModelConfig, batch: int, queries: int, keys: int) -> int:
  """A floor of one forward pass's memory (module docstring): `batch` sequences of
  `queries` new tokens over `keys` cached ones."""
  f32 = 4
  cache = 2 * config.num_layers * batch * keys * config.num_kv_heads * config.head_dim * f32
  attention = 2 * batch * config.num_heads * queries * keys * f32
  hidden = batch * queries * (2 * config.d_model + 2 * config.mlp_hidden) * f32
  logits = batch * min(queries, 1) * config.vocab_size * f32
  return int(cache + attention + hidden + logits)


def weights_floor(config: ModelConfig) -> int:
  """A floor of the model's parameter count, from its dimensions alone (no trace: a
  model too large to build is refused before it is built): the embedding, and per layer
  the q/k/v/o projections and two MLP matrices (a gated MLP has a third; norms and
  biases are left out)."""
  d, h = config.d_model, config.head_dim
  attn = d * h * (2 * config.num_heads + 2 * config.num_kv_heads)
  return int(config.vocab_size * d + config.num_layers * (attn + 2 * d * config.mlp_hidden))


def train_state_bytes(config: ModelConfig) -> int:
  """A floor of what a training holds besides its batch: float32 params, their
  gradients and Adam's two moments."""
  return 4 * 4 * weights_floor(config)


def model_setting(config: ModelConfig) -> str:
  """The dimensions that size a model, as gin settings, for an error naming them."""
  return (f"the model (model.d_model = {config.d_model}, model.mlp_hidden = "
          f"{config.mlp_hidden}, model.num_layers = {config.num_layers}, model.vocab_size = "
          f"{config.vocab_size}, model.num_heads = {config.num_heads})")


def check_fits(what: str, needed: int, *, total: Optional[int] = None,
               holding: str = "the KV cache, one layer's attention logits and "
                              "activations, in float32") -> None:
  """A UserError naming the setting, its estimate (of `holding`) and the machine's
  memory when one batch would need more than SHARE of it."""
  total = physical_bytes() if total is None else total
  if total is None or needed <= SHARE * total:
    return
  raise UserError(f"{what} needs at least {needed / 2**30:.1f} GiB for one batch "
                  f"({holding}), more than {SHARE:.0%} of this machine's {total / 2**30:.1f} GiB of "
                  f"memory: it would run until the system kills it. Lower it.")
