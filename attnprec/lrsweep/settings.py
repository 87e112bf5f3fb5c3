"""What an LR sweep trains: model sizes and precision settings as data, checked up front.

A *size* is a decoder-only byte-level model (vocabulary 258, untied embeddings, no
biases, multi-head attention, SwiGLU MLP of 3 x d_model, RoPE). Non-embedding parameters:
12 * d_model^2 per layer.

A *setting* is the train phase's numerics plus what the model adds:
  'bf16'          gin/precision/bf16.gin: bfloat16 compute, float32_qk_product and
                  float32_logits off: the QK product, the mask and the softmax in bfloat16
  'both'          gin/precision/fp32_attention.gin: bfloat16 compute with both flags
                  (float32 QK product and softmax)
  'fp32'          gin/precision/fp32.gin with the attention einsums (QK and PV) at
                  'highest': float32 activations and attention at full precision, the
                  attention reference. The projections keep matmul_precision 'default'
                  (on a TPU one bf16 pass with float32 accumulation; 'highest' there would
                  cost six passes in every projection for what the sweep does not vary)
  'qk_norm'       'bf16' with RMSNorm on each head's queries and keys (`model.qk_norm`)
  'qk_norm_both'  'both' with qk-norm
Every setting runs the attention kernel `kernel` ('dot_product' unless set); the train
phase's other knobs (a KV cache's storage, a key offset) have no meaning in a forward
pass without a cache and are not settings.
"""
import dataclasses
from typing import Dict, Sequence, Tuple

from attnprec import kernels, presets
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.model import REMAT
from attnprec.precision import Precision
from attnprec.tasks.text import VOCAB_SIZE

# name: (d_model, num_layers, num_heads, head_dim)
SIZES: Dict[str, Tuple[int, int, int, int]] = {
    "tiny": (32, 2, 2, 16),       # tests only (~25k non-embedding parameters)
    "5m": (256, 6, 4, 64),        # 4.7M non-embedding parameters
    "20m": (512, 6, 8, 64),       # 18.9M
    "80m": (768, 12, 12, 64),     # 84.9M
}

# name: (the gin preset of gin/precision/ it starts from, overrides of Precision fields,
#        overrides of ModelConfig fields): the one preset registry (`attnprec.presets`).
SETTINGS: Dict[str, Tuple[str, dict, dict]] = {
    "bf16": ("bf16", {}, {}),
    "both": ("fp32_attention", {}, {}),
    "fp32": ("fp32", {"einsum_precision": "highest"}, {}),
    "qk_norm": ("bf16", {}, {"qk_norm": True}),
    "qk_norm_both": ("fp32_attention", {}, {"qk_norm": True}),
}


def model_config(size: str, setting: str, seq_len: int) -> ModelConfig:
  d, layers, heads, head_dim = SIZES[size]
  extra = SETTINGS[setting][2]
  return ModelConfig(vocab_size=VOCAB_SIZE, d_model=d, num_layers=layers, num_heads=heads,
                     num_kv_heads=heads, head_dim=head_dim, mlp_hidden=3 * d,
                     activation="silu", tie_embeddings=False, qkv_bias=False,
                     max_seq_len=seq_len, **extra)


def precision(setting: str, kernel: str) -> Precision:
  preset, knobs, _ = SETTINGS[setting]
  return presets.variant(preset, kernel=kernel, **knobs)


def non_embedding_params(size: str) -> int:
  d, layers, _, _ = SIZES[size]
  return 12 * d * d * layers


def _listed(values) -> str:
  return ", ".join(map(repr, values))


@dataclasses.dataclass(frozen=True)
class Plan:
  """A whole sweep: every (size, setting, seed) group trains len(lrs) members."""
  sizes: Tuple[str, ...]
  settings: Tuple[str, ...]
  lrs: Tuple[float, ...]
  seeds: Tuple[int, ...]
  steps: int
  warmup: int
  batch: int
  seq_len: int
  eval_every: int
  eval_batch: int
  kernel: str = "dot_product"
  b1: float = 0.9
  b2: float = 0.95
  eps: float = 1e-8
  weight_decay: float = 1e-4     # independent of the learning rate (decoupled), x schedule
  clip_norm: float = 1.0
  end_lr: float = 1e-5           # the cosine decay's last learning rate (absolute)
  z_loss: float = 1e-4           # x mean(log Z^2) added to the loss (0: none)
  remat: str = "block"           # what the backward pass recomputes (`model.REMAT`)

  def groups(self):
    """(size, setting, seed) in training order: a size's settings seed by seed, so the
    first seed of every setting finishes before any second seed."""
    return [(size, setting, seed) for size in self.sizes for seed in self.seeds
            for setting in self.settings]


def check_plan(*, sizes: Sequence[str], settings: Sequence[str], lrs: Sequence[float],
               seeds: Sequence[int], steps: int, warmup: int, batch: int, seq_len: int,
               eval_every: int, eval_batch: int, kernel: str = "dot_product",
               z_loss: float = 1e-4, remat: str = "block", **rest) -> Plan:
  """The plan, or a UserError naming the first bad value and the valid ones."""
  def fail(msg):
    raise UserError(msg)

  def int_at_least(name, v, least):
    if isinstance(v, bool) or not isinstance(v, int) or v < least:
      fail(f"lr_sweep.{name} = {v!r} must be an integer >= {least}.")

  for name, values, table in (("sizes", sizes, SIZES), ("settings", settings, SETTINGS)):
    if isinstance(values, str) or not isinstance(values, (tuple, list)) or not values:
      fail(f"lr_sweep.{name} = {values!r} must be a non-empty tuple of names; valid: "
           f"{_listed(table)}.")
    bad = [v for v in values if v not in table]
    if bad:
      fail(f"lr_sweep.{name} has {bad[0]!r}, which is not one; valid: {_listed(table)}.")
    if len(set(values)) != len(values):
      fail(f"lr_sweep.{name} = {tuple(values)!r} names one twice.")
  if isinstance(lrs, (str, bytes)) or not isinstance(lrs, (tuple, list)) or not lrs:
    fail(f"lr_sweep.lrs = {lrs!r} is an empty grid; give a tuple of positive learning "
         f"rates, e.g. (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1).")
  for lr in lrs:
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not lr > 0 or lr != lr \
        or lr == float("inf"):
      fail(f"lr_sweep.lrs has {lr!r}: every learning rate must be a finite number > 0.")
  if len(set(lrs)) != len(lrs):
    fail(f"lr_sweep.lrs = {tuple(lrs)!r} lists a learning rate twice.")
  if isinstance(seeds, (str, bytes)) or not isinstance(seeds, (tuple, list)) or not seeds:
    fail(f"lr_sweep.seeds = {seeds!r} must be a non-empty tuple of integers >= 0.")
  for s in seeds:
    if isinstance(s, bool) or not isinstance(s, int) or s < 0:
      fail(f"lr_sweep.seeds has {s!r}: seeds are integers >= 0.")
  if len(set(seeds)) != len(seeds):
    fail(f"lr_sweep.seeds = {tuple(seeds)!r} lists a seed twice.")
  int_at_least("steps", steps, 1)
  int_at_least("warmup", warmup, 0)
  if warmup >= steps:
    fail(f"lr_sweep.warmup = {warmup} must be fewer than lr_sweep.steps = {steps}.")
  int_at_least("batch", batch, 1)
  int_at_least("seq_len", seq_len, 8)
  int_at_least("eval_every", eval_every, 1)
  int_at_least("eval_batch", eval_batch, 1)
  if isinstance(z_loss, bool) or not isinstance(z_loss, (int, float)) or not z_loss >= 0 \
      or z_loss == float("inf"):
    fail(f"lr_sweep.z_loss = {z_loss!r} must be a finite number >= 0 (0: no z-loss).")
  if remat not in REMAT:
    fail(f"lr_sweep.remat = {remat!r} is not a rematerialisation choice; valid: "
         f"{_listed(REMAT)}.")
  if kernel not in kernels.NAMES:
    fail(f"lr_sweep.kernel = {kernel!r} is not a kernel; valid: {_listed(kernels.NAMES)}.")
  if not kernels.get(kernel).trains:
    trainers = [n for n in kernels.NAMES if kernels.get(n).trains]
    fail(f"lr_sweep.kernel = {kernel!r} has no gradient, so the train phase cannot run "
         f"it; valid for training: {_listed(trainers)}.")
  plan = Plan(tuple(sizes), tuple(settings), tuple(float(x) for x in lrs), tuple(seeds),
              steps, warmup, batch, seq_len, eval_every, eval_batch, kernel,
              z_loss=float(z_loss), remat=remat, **rest)
  for size, setting, _ in plan.groups():   # the model and precision checks of their own
    model_config(size, setting, seq_len)
    precision(setting, kernel)
  return plan
