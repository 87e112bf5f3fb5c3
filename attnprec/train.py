"""Training: a pure, jitted update under the train phase's `Precision`.

The state (params, optimizer state, step) is a NamedTuple; `init` and `update` are pure
functions. Params stay float32; compute runs in the phase's dtype.
"""
import functools
import time
from typing import NamedTuple, Optional

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from attnprec import model as model_lib
from attnprec import runs
from attnprec.config import ModelConfig
from attnprec.precision import Precision


class TrainState(NamedTuple):
  params: dict
  opt_state: optax.OptState
  step: jax.Array


@gin.configurable("optimizer")
def make_optimizer(*, learning_rate: float = 3e-3, warmup_steps: int = 100,
                   total_steps: int = 1000, weight_decay: float = 0.01,
                   clip_norm: float = 1.0, b2: float = 0.98) -> optax.GradientTransformation:
  """AdamW with linear warmup + cosine decay and global-norm clipping."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, learning_rate, warmup_steps, max(total_steps, warmup_steps + 1),
      end_value=learning_rate * 0.1)
  return optax.chain(optax.clip_by_global_norm(clip_norm),
                     optax.adamw(schedule, b2=b2, weight_decay=weight_decay))


def loss_fn(params, tokens_BxT, loss_mask_BxT, *, config: ModelConfig, precision: Precision):
  """Mean next-token cross-entropy over the masked targets; also token accuracy."""
  logits_BxTxV = model_lib.transformed(config).apply(
      params, tokens_BxT[:, :-1], precision=precision).logits
  targets_BxT = tokens_BxT[:, 1:]
  mask_BxT = loss_mask_BxT[:, 1:]
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
  nll_BxT = -jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
  denom = jnp.maximum(mask_BxT.sum(), 1.0)
  loss = (nll_BxT * mask_BxT).sum() / denom
  acc = ((jnp.argmax(logits_BxTxV, -1) == targets_BxT) * mask_BxT).sum() / denom
  return loss, {"loss": loss, "accuracy": acc}


def init_state(config: ModelConfig, optimizer, seed: int) -> TrainState:
  params = model_lib.init_params(config, jax.random.PRNGKey(seed))
  return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32))


def make_update(config: ModelConfig, precision: Precision, optimizer):
  """The jitted train step: (state, tokens, mask) -> (state, metrics)."""

  @jax.jit
  def update(state: TrainState, tokens_BxT, loss_mask_BxT):
    grads, metrics = jax.grad(
        functools.partial(loss_fn, config=config, precision=precision), has_aux=True)(
            state.params, tokens_BxT, loss_mask_BxT)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics["grad_norm"] = optax.tree.norm(grads)
    return TrainState(params, opt_state, state.step + 1), metrics

  return update


@gin.configurable("train", denylist=["config", "precision", "task", "run_dir"])
def train(*, config: ModelConfig, precision: Precision, task, run_dir: str,
          steps: int = 600, batch_size: int = 64, seed: int = 0, log_every: int = 25,
          eval_every: int = 200, eval_batch: int = 256, target_accuracy: Optional[float] = None,
          progress: bool = True) -> dict:
  """Trains `config` on `task` (a recall-like task with train_batch/eval) into `run_dir`.

  Writes model.json, metrics.jsonl, operative_config.gin (after the first step) and
  params.npz. Stops early once held-out token accuracy reaches `target_accuracy`.
  Returns the last metrics.
  """
  optimizer = make_optimizer(total_steps=steps)
  state = init_state(config, optimizer, seed)
  update = make_update(config, precision, optimizer)
  eval_loss = jax.jit(functools.partial(loss_fn, config=config, precision=precision))
  data_rng = np.random.default_rng(seed)
  eval_tokens, eval_mask = task.train_batch(np.random.default_rng(seed + 10_000), eval_batch)
  runs.write_json(run_dir, "model.json", runs.config_dict(config))

  metrics_log = runs.MetricsWriter(run_dir)
  bar = tqdm(range(steps), desc="train", disable=not progress, dynamic_ncols=True)
  last, t0, tokens_seen = {}, time.perf_counter(), 0
  for step in bar:
    tokens_BxT, mask_BxT = task.train_batch(data_rng, batch_size)
    state, metrics = update(state, tokens_BxT, mask_BxT)
    tokens_seen += tokens_BxT.size
    if step == 0:
      runs.write_operative_config(run_dir)
    do_eval = (step + 1) % eval_every == 0 or step + 1 == steps
    if (step + 1) % log_every == 0 or do_eval:
      last = {k: float(v) for k, v in metrics.items()}
      last.update(step=step + 1, tokens_per_s=tokens_seen / (time.perf_counter() - t0))
      if do_eval:
        _, ev = eval_loss(state.params, eval_tokens, eval_mask)
        last.update({f"eval_{k}": float(v) for k, v in ev.items()})
      metrics_log.write(last)
      bar.set_postfix(loss=f"{last['loss']:.3f}", acc=f"{last['accuracy']:.3f}",
                      tok_s=f"{last['tokens_per_s']:.0f}")
      if (target_accuracy is not None and "eval_accuracy" in last
          and last["eval_accuracy"] >= target_accuracy):
        bar.write(f"eval accuracy {last['eval_accuracy']:.4f} >= target "
                  f"{target_accuracy} at step {step + 1}; stopping.")
        break
  bar.close()
  runs.save_params(run_dir, jax.device_get(state.params))
  return last
