"""Training: a pure, jitted update under the train phase's `Precision`, resumable exactly.

The state (params, optimizer state, step, rng) is a NamedTuple; `init_state` and the update
are pure functions. Params stay float32; compute runs in the phase's dtype.

Shapes: B batch, T tokens per sequence, V vocabulary.

Resuming is exact: the batch of step s is drawn from a numpy Generator seeded with
(seed, s), so the data position is the step; the train state is restored bit for bit from
the newest checkpoint (`attnprec.checkpointing`); and the update is deterministic. Training
2N steps straight or N steps, killed, then N more, gives the same params bit for bit.

Preemption: SIGINT and SIGTERM do not stop a step half-way. The loop finishes the step
in flight, saves a checkpoint at that step and raises `signals.Interrupted` (the runner exits
130 / 143 with one line saying where it saved); training again resumes from it exactly.
"""
import contextlib
import dataclasses
import functools
import json
import os
import time
from typing import NamedTuple, Optional

import gin
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from attnprec import (checkpointing, checks, kernels, keyoffset, memory, plotting, runs,
                      sharding, xla_env)
from attnprec import signals
from attnprec import model as model_lib
from attnprec.config import ModelConfig
from attnprec.contract import COMPUTE_CACHE
from attnprec.errors import UserError
from attnprec.faults import Faults, fault_injection
from attnprec.precision import Precision


class NonFiniteError(UserError):
  """The loss or gradient norm of a step was NaN or infinite (runners exit with 2)."""


class TrainState(NamedTuple):
  params: dict               # {module: {name: float32 array}}
  opt_state: optax.OptState  # moments shaped (and sharded) like params
  step: jax.Array            # int32 []: updates applied = batches consumed
  rng: jax.Array             # uint32 [2]: key for stochastic ops (the model has none yet)


@gin.configurable("optimizer")
@checks.validated("optimizer", learning_rate=checks.number(gt=0),
                  warmup_steps=checks.integer(min=0), total_steps=checks.at_least(1),
                  end_value_ratio=checks.number(ge=0, le=1), weight_decay=checks.number(ge=0),
                  clip_norm=checks.number(gt=0), b1=checks.number(ge=0, lt=1),
                  b2=checks.number(ge=0, lt=1), eps=checks.number(gt=0))
def make_optimizer(*, learning_rate: float = 3e-3, warmup_steps: int = 100,
                   total_steps: int = 1000, end_value_ratio: float = 0.1,
                   weight_decay: float = 0.01, clip_norm: float = 1.0, b1: float = 0.9,
                   b2: float = 0.98, eps: float = 1e-8) -> optax.GradientTransformation:
  """AdamW with linear warmup + cosine decay (to end_value_ratio x peak) and global-norm
  clipping. `total_steps` is set by the train loop to `train.steps`."""
  schedule = optax.warmup_cosine_decay_schedule(
      0.0, learning_rate, warmup_steps, max(total_steps, warmup_steps + 1),
      end_value=learning_rate * end_value_ratio)
  return optax.chain(optax.clip_by_global_norm(clip_norm),
                     optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay))


def _loss_sums(logits_BxTxV, targets_BxT, mask_BxT):
  """(sum of masked next-token NLL, count of masked correct argmaxes), float32."""
  logp_BxTxV = jax.nn.log_softmax(logits_BxTxV, axis=-1)
  nll_BxT = -jnp.take_along_axis(logp_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
  correct_BxT = jnp.argmax(logits_BxTxV, -1) == targets_BxT
  return (nll_BxT * mask_BxT).sum(), (correct_BxT * mask_BxT).sum()


def loss_fn(params, tokens_BxT, loss_mask_BxT, *, config: ModelConfig, precision: Precision,
            remat: str = "none", loss_chunk: int = 0):
  """Mean next-token cross-entropy over the masked targets; also token accuracy. `remat`
  (`model.REMAT`): what its gradient recomputes instead of keeping. `loss_chunk` > 0:
  the unembedding, softmax and NLL run over that many of the batch's tokens at a time
  (the B x T tokens taken as one row, so a chunk holds `loss_chunk` x V logits whatever
  the batch), each chunk recomputed in the backward pass, so the float32 [B, T, V]
  logits never exist whole (with a large vocabulary the largest tensor of a train
  step); the same products, the sums in another order."""
  model = model_lib.transformed(config, remat)
  inputs_BxT, targets_BxT = tokens_BxT[:, :-1], tokens_BxT[:, 1:]
  mask_BxT = loss_mask_BxT[:, 1:]
  if not loss_chunk:
    logits_BxTxV = model.apply(params, inputs_BxT, precision=precision).logits
    nll, correct = _loss_sums(logits_BxTxV, targets_BxT, mask_BxT)
  else:
    h_BxTxD = model.apply(params, inputs_BxT, precision=precision, hidden_only=True).hidden
    w_DxV = model_lib.unembedding(params, config)
    B, T, D = h_BxTxD.shape
    N = B * T
    C = min(loss_chunk, N)              # a chunk longer than the batch's tokens: one chunk
    n = -(-N // C)
    pad = n * C - N                     # padded tokens are masked out

    def chunks(x_BxT):                  # [B, T, ...] -> [n, 1, C, ...]
      x = x_BxT.reshape((N,) + x_BxT.shape[2:])
      x = jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))
      return x.reshape((n, 1, C) + x.shape[1:])

    @jax.checkpoint
    def chunk_sums(args):
      h_1xCxD, t_1xC, m_1xC = args
      return _loss_sums(model_lib.unembed(h_1xCxD, w_DxV, config, precision), t_1xC, m_1xC)

    nll_N, correct_N = jax.lax.map(chunk_sums, (chunks(h_BxTxD), chunks(targets_BxT),
                                                chunks(mask_BxT)))
    nll, correct = nll_N.sum(), correct_N.sum()
  denom = jnp.maximum(mask_BxT.sum(), 1.0)
  loss = nll / denom
  return loss, {"loss": loss, "accuracy": correct / denom}


def init_state(config: ModelConfig, optimizer, seed: int) -> TrainState:
  init_rng, rng = jax.random.split(jax.random.PRNGKey(seed))
  params = model_lib.init_params(config, init_rng)
  return TrainState(params, optimizer.init(params), jnp.zeros((), jnp.int32), rng)


def batch_rng(seed: int, step: int) -> np.random.Generator:
  """The Generator that draws the training batch of `step` (0-based): position = step."""
  return np.random.default_rng([seed, 0, step])


def eval_rng(seed: int) -> np.random.Generator:
  """The Generator of the held-out eval batch (a stream no training step uses)."""
  return np.random.default_rng([seed, 1])


def make_update(config: ModelConfig, precision: Precision, optimizer, *,
                skip_nonfinite: bool = False, faults: Optional[Faults] = None,
                remat: str = "none", loss_chunk: int = 0):
  """The jitted train step: (state, tokens_BxT, mask_BxT) -> (state, metrics).
  `remat` (`model.REMAT`, `train.remat`): what the backward pass recomputes;
  `loss_chunk` (`train.loss_chunk`): tokens per chunk of the loss's unembedding (0: all).

  metrics: loss, accuracy, grad_norm, param_norm (after the update) and `finite` (all
  three finite). With `skip_nonfinite`, a non-finite step leaves params and optimizer
  state unchanged (a select inside the program); step and data position still advance.
  """
  base_loss = functools.partial(loss_fn, config=config, precision=precision,
                                remat=model_lib.check_remat(remat), loss_chunk=loss_chunk)
  faults = faults or Faults()

  def update(state: TrainState, tokens_BxT, loss_mask_BxT):
    hit = (state.step + 1 == faults.nonfinite_at_step
           if faults.nonfinite_at_step is not None else None)
    loss = base_loss
    if hit is not None and faults.nonfinite_metric == "loss":
      def loss(params, *args):  # test-only: a NaN loss (and NaN gradients) at one step
        value, aux = base_loss(params, *args)
        value = value * jnp.where(hit, jnp.nan, 1.0)
        return value, dict(aux, loss=value)
    grads, metrics = jax.grad(loss, has_aux=True)(state.params, tokens_BxT, loss_mask_BxT)
    if hit is not None and faults.nonfinite_metric == "grad_norm":
      grads = jax.tree.map(lambda g: g * jnp.where(hit, jnp.inf, 1.0), grads)
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics["grad_norm"] = optax.tree.norm(grads)
    metrics["param_norm"] = optax.tree.norm(params)   # finite grads can still overflow params
    metrics["finite"] = (jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])
                         & jnp.isfinite(metrics["param_norm"]))
    if skip_nonfinite:
      params, opt_state = jax.tree.map(
          lambda new, old: jnp.where(metrics["finite"], new, old),
          (params, opt_state), (state.params, state.opt_state))
    return TrainState(params, opt_state, state.step + 1, state.rng), metrics

  return jax.jit(update)


def nonfinite_error(step: int, metrics: dict, ckpt: checkpointing.Checkpointer) -> UserError:
  """The message for a non-finite step: which step, which metric, where to resume."""
  values = {k: float(metrics[k]) for k in ("loss", "grad_norm", "param_norm")}
  name = next(k for k, v in values.items() if not np.isfinite(v))
  listed = ", ".join(f"{k}={v}" for k, v in values.items())
  last = ckpt.latest_step()
  where = (f"The last good checkpoint is step {last} in {ckpt.directory}; training again "
           f"with the same --run_dir resumes from it." if last is not None else
           "No checkpoint was written before it.")
  return NonFiniteError(
      f"Training stopped at step {step}: {name} is {values[name]} ({listed}). "
      f"{where} Lower optimizer.learning_rate, or set train.skip_nonfinite_steps = True "
      f"to skip such steps (params and optimizer state then stay unchanged).")


def describe_task(task) -> dict:
  """The task as JSON data (what checkpoints record; compared on resume)."""
  desc = task.describe() if hasattr(task, "describe") else dataclasses.asdict(task)
  return json.loads(json.dumps(desc))


def check_kernel(precision: Precision) -> None:
  """The train phase needs a gradient through its attention kernel: a kernel without one
  (`KernelSpec.trains`, e.g. 'pallas') is refused before anything runs."""
  no_grad = [n for n in kernels.NAMES if not kernels.get(n).trains]
  if precision.kernel in no_grad:
    trains = [n for n in kernels.CHOICES if n not in no_grad]
    raise UserError(
        f"train/precision.kernel = {precision.kernel!r} has no gradient, so the train step "
        f"cannot run it; valid kernels for the train phase: "
        f"{', '.join(repr(n) for n in trains)} (set the kernel per phase: "
        f"decode/precision.kernel = {precision.kernel!r}).")


@gin.configurable("train", denylist=["config", "precision", "task", "run_dir", "files"])
@checks.validated("train", steps=checks.at_least(1), batch_size=checks.at_least(1),
                  seed=checks.integer(min=0), log_every=checks.at_least(1),
                  eval_every=checks.at_least(1), eval_batch=checks.at_least(1),
                  target_accuracy=checks.optional(checks.number(ge=0, le=1)),
                  checkpoint_every=checks.at_least(1), keep_checkpoints=checks.at_least(1),
                  remat=checks.one_of(*model_lib.REMAT), loss_chunk=checks.integer(min=0))
def train(*, config: ModelConfig, precision: Precision, task, run_dir: str,
          files: Optional[dict] = None, steps: int = 600, batch_size: int = 64, seed: int = 0,
          log_every: int = 25, eval_every: int = 200, eval_batch: int = 256,
          target_accuracy: Optional[float] = None, checkpoint_every: int = 100,
          keep_checkpoints: int = 3, skip_nonfinite_steps: bool = False, plot: bool = True,
          progress: bool = True, remat: str = "none", loss_chunk: int = 0) -> dict:
  """Trains `config` on `task` into `run_dir`, resuming from its newest checkpoint.

  `task` has train_batch(rng, batch) -> (tokens_BxT int32, loss_mask_BxT float32) and
  optionally eval_batch (held-out data; else train_batch on an unused stream).
  Writes model.json and `files` ({name: JSON object}, e.g. task.json) once the resume
  checks pass, metrics.jsonl every `log_every` steps (eval every `eval_every`),
  operative_config.gin after the first step, checkpoints every `checkpoint_every` steps
  (the last `keep_checkpoints` kept), and at the end params.npz and metrics.png. Stops
  early once held-out token accuracy reaches `target_accuracy`. A non-finite loss or
  gradient norm stops training with NonFiniteError (or is skipped, with
  `skip_nonfinite_steps`). `remat` (`model.REMAT`): what the backward pass recomputes
  instead of keeping ('block': the residual stream alone is kept; the same numbers, more
  FLOPs, less memory); `loss_chunk` > 0: the loss unembeds that many tokens at a time
  (`loss_fn`). Returns the last metrics.
  """
  bound_total = checks.bound_args("optimizer").get("total_steps")
  if bound_total is not None:
    raise UserError(f"optimizer.total_steps = {bound_total!r} is set, but a training's "
                    f"schedule runs over train.steps ({steps}): the train loop sets total_steps itself, so the binding would be "
                    f"ignored. Drop it, and set train.steps instead.")
  faults = fault_injection()   # test-only; nothing bound in shipped gin files
  keyoffset.check(config, precision.key_offset, phase="train")
  check_kernel(precision)
  check_no_cache(precision)
  mesh = sharding.make_mesh()
  sharding.check(mesh, config, [("train.batch_size", batch_size),
                                ("train.eval_batch", eval_batch)])
  # A batch that surely does not fit is refused with its estimate before anything runs
  # (a forward pass's floor; a train step keeps more for its backward pass).
  # The model alone first (its params, gradients and Adam's moments): a model too large
  # is named as such, not as a batch to lower.
  state_bytes = memory.train_state_bytes(config)
  memory.check_fits(memory.model_setting(config), state_bytes,
                    holding="its float32 params, gradients and Adam's two moments")
  T = task.train_batch(batch_rng(seed, 0), 1)[0].shape[1]
  for name, b in (("train.batch_size", batch_size), ("train.eval_batch", eval_batch)):
    memory.check_fits(f"{name} = {b} (sequences of {T} tokens)",
                      memory.batch_bytes(config, b, T, T) + state_bytes,
                      holding="the model's params, gradients and Adam's moments, and the "
                              "batch's KV cache, one layer's attention logits and "
                              "activations, in float32")
  runs.check_writable(run_dir)
  optimizer = make_optimizer(total_steps=steps)
  optimizer_settings = optimizer_args()
  warmup = optimizer_settings["warmup_steps"]
  if warmup >= steps and jax.process_index() == 0:
    # A short run (a smoke test) may stop inside the warm-up; it is said, not silent.
    print(f"note: optimizer.warmup_steps = {warmup} >= train.steps = {steps}: the learning "
          f"rate stays in its warm-up and reaches at most {(steps - 1) / warmup:.3g} x "
          f"optimizer.learning_rate = {optimizer_settings['learning_rate']:g}; the cosine "
          f"decay never starts.")
  precision_line = precision.describe()
  xla_line = xla_env.describe()      # the XLA settings that change numbers: printed, recorded
  if jax.process_index() == 0:
    print(xla_line)
  init = functools.partial(init_state, config, optimizer, seed)
  abstract = jax.eval_shape(init)
  state_sh = sharding.tree_shardings(abstract, abstract.params, config, mesh)
  task_desc = describe_task(task)
  main = jax.process_index() == 0
  # One training per run directory (process 0 holds the lock for a multi-host run).
  with (runs.locked(run_dir) if main else contextlib.nullcontext()), \
       checkpointing.Checkpointer(run_dir, keep=keep_checkpoints, fault=faults) as ckpt, \
       jax.set_mesh(mesh), contextlib.ExitStack() as stack:
    restored = ckpt.restore_latest(jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
        abstract, state_sh)._asdict())
    if restored is None:
      state, meta = jax.jit(init, out_shardings=state_sh)(), {}
    else:
      state, meta = TrainState(**restored[0]), restored[1]
      _check_resume_precision(meta, precision_line, run_dir)
      _check_resume_xla(meta, xla_line, run_dir)
      _check_resume_model(meta, config, run_dir)
      _report_resume(meta, seed=seed, batch_size=batch_size, steps=steps, task=task_desc,
                     optimizer=optimizer_settings)
    # Only now (the checkpoint matched) touch the run directory's files.
    start = int(state.step)
    metrics_log = runs.MetricsWriter(run_dir)
    if main:
      runs.write_json(run_dir, runs.MODEL_FILE, runs.config_dict(config))
      for name, obj in (files or {}).items():
        runs.write_json(run_dir, name, obj)
      metrics_log.rewind(start)
    end = steps
    if start >= steps or (meta.get("target_reached") and target_accuracy is not None):
      print(f"{run_dir} is already trained to step {start}; nothing to do.")
      end = start

    update = jax.jit(make_update(config, precision, optimizer,
                                 skip_nonfinite=skip_nonfinite_steps, faults=faults,
                                 remat=remat, loss_chunk=loss_chunk),
                     out_shardings=(state_sh, sharding.NamedSharding(mesh, sharding.P())),
                     donate_argnums=0)
    eval_loss = jax.jit(functools.partial(loss_fn, config=config, precision=precision,
                                          loss_chunk=loss_chunk))
    draw_eval = getattr(task, "eval_batch", task.train_batch)
    eval_data = [sharding.put_batch(mesh, x) for x in draw_eval(eval_rng(seed), eval_batch)]

    def checkpoint_meta(n: int, last: dict, reached: bool) -> dict:
      return {"step": n, "data_position": n, "seed": seed, "batch_size": batch_size,
              "steps": steps, "precision": precision_line, "xla": xla_line,
              "optimizer": optimizer_settings,
              "model": runs.config_dict(config), "task": task_desc,
              "mesh": [mesh.shape["data"], mesh.shape["model"]],
              "eval_accuracy": last.get("eval_accuracy"), "target_reached": reached}

    bar = tqdm(total=steps, initial=start, desc="train", disable=not progress or not main,
               dynamic_ncols=True)
    stack.callback(bar.close)   # before any error message is printed
    last, t0, tokens_seen, skipped = {}, time.perf_counter(), 0, 0
    pending = stack.enter_context(signals.deferred_signals())   # finish the step, save, exit
    for step in range(start, end):
      n = step + 1
      tokens_BxT, mask_BxT = task.train_batch(batch_rng(seed, step), batch_size)
      state, metrics = update(state, sharding.put_batch(mesh, tokens_BxT),
                              sharding.put_batch(mesh, mask_BxT))
      if not bool(metrics["finite"]):
        if not skip_nonfinite_steps:
          bar.close()
          raise nonfinite_error(n, metrics, ckpt)
        skipped += 1
        bar.write(f"step {n}: loss={float(metrics['loss'])} grad_norm="
                  f"{float(metrics['grad_norm'])} not finite; step skipped (params unchanged).")
      tokens_seen += tokens_BxT.size
      if step == start and main:
        runs.write_operative_config(run_dir)
      do_eval = n % eval_every == 0 or n == steps
      reached = False
      if n % log_every == 0 or do_eval:
        last = {k: float(v) for k, v in metrics.items() if k != "finite"}
        last.update(step=n, skipped_steps=skipped,
                    tokens_per_s=tokens_seen / (time.perf_counter() - t0))
        if do_eval:
          _, ev = eval_loss(state.params, *eval_data)
          last.update({f"eval_{k}": float(v) for k, v in ev.items()})
          reached = target_accuracy is not None and last["eval_accuracy"] >= target_accuracy
        if main:
          metrics_log.write(last)
        bar.set_postfix(loss=f"{last['loss']:.3f}", acc=f"{last['accuracy']:.3f}",
                        tok_s=f"{last['tokens_per_s']:.0f}")
      saved = n % checkpoint_every == 0 or n == steps or reached
      if saved:
        ckpt.save(state._asdict(), checkpoint_meta(n, last, reached))
      bar.update(1)
      if faults.pause_after_step == n:
        faults.pause(f"after step {n}")
      if _signal_pending(pending):
        bar.close()
        if not saved:
          ckpt.save(state._asdict(), checkpoint_meta(n, last, reached))
        pending.raise_pending(
            f"saved a checkpoint at step {n} in {os.path.join(ckpt.directory, str(n))}; "
            f"training again with the same --run_dir resumes from it.")
      if reached:
        bar.write(f"eval accuracy {last['eval_accuracy']:.4f} >= target "
                  f"{target_accuracy} at step {n}; stopping.")
        break
    stack.close()   # signals from here on stop at once: the last checkpoint is saved
    bar.close()
    params = _host_params(state.params)
    if main:
      runs.save_params(run_dir, params)
      if plot:
        plotting.plot_run(run_dir)
  return last


def check_no_cache(precision: Precision) -> None:
  """Training runs no KV cache: a train precision's cache setting would be silently
  ignored (by `train` and by the audit of the train step)."""
  if precision.cache_storage.without_offset() != COMPUTE_CACHE:
    raise UserError(
        f"The train phase has no KV cache, so {precision.cache_storage.describe()} would "
        f"be ignored: set precision.kv_cache_* for the decode phase only "
        f"(decode/precision.kv_cache_k_dtype = ...), or leave them at 'compute' for train.")


def optimizer_args() -> dict:
  """The optimizer's settings in force (gin's bindings over `make_optimizer`'s defaults),
  total_steps aside (the train loop sets it): what a checkpoint records."""
  import inspect
  bound = checks.bound_args("optimizer")
  out = {}
  for name, param in inspect.signature(make_optimizer).parameters.items():
    if name != "total_steps" and param.default is not inspect.Parameter.empty:
      out[name] = bound.get(name, param.default)
  return json.loads(json.dumps(out, default=float))


def _check_resume_precision(meta: dict, line: str, run_dir: str) -> None:
  """A run's steps share one precision: resuming under another train precision than the
  checkpoint's (its precision line) is refused, never carried on silently; so is a
  checkpoint that does not record its precision (edited, or written before checkpoints
  recorded it): its steps' precision cannot be known."""
  saved = meta.get("precision")
  if saved is None:
    raise UserError(f"The checkpoint of {run_dir} at step {meta['step']} does not record "
                    f"the train precision its steps ran in (its meta has no 'precision'), "
                    f"so resuming could mix two precisions while the results name one. "
                    f"Train into a new --run_dir.")
  if saved != line:
    raise UserError(f"{run_dir} was trained to step {meta['step']} with precision "
                    f"'{saved}', and this run's train precision is '{line}': its steps "
                    f"would mix two precisions while its results name one. Resume with the "
                    f"checkpoint's train/precision.* settings, or train into a new "
                    f"--run_dir.")


def _check_resume_xla(meta: dict, line: str, run_dir: str) -> None:
  """The XLA settings that change numbers (excess precision, fast math, ...: the line
  `xla_env.describe` prints) are part of a run's precision: a resume under others, or from
  a checkpoint that does not record them, is refused like another train precision."""
  saved = meta.get("xla")
  if saved != line:
    was = (f"with '{saved}'" if isinstance(saved, str) else
           "without a record of its XLA settings (its meta has no 'xla')")
    raise UserError(f"{run_dir} was trained to step {meta['step']} {was}, and this run has "
                    f"'{line}': its steps would mix two numerics while its results name "
                    f"one. Resume with the checkpoint's XLA_FLAGS, or train into a new "
                    f"--run_dir.")


def _check_resume_model(meta: dict, config: ModelConfig, run_dir: str) -> None:
  """The checkpoint's weights were trained as its model (`meta['model']`): resuming as
  another one (a changed activation or RoPE base keeps every parameter's shape) is
  refused, and model.json is never rewritten to describe a model that was not trained.
  A field the record lacks (added to ModelConfig since) must hold its default."""
  saved = meta.get("model")
  if not isinstance(saved, dict):
    raise UserError(f"The checkpoint of {run_dir} at step {meta['step']} does not record "
                    f"the model its weights were trained as (its meta has model = "
                    f"{str(saved)[:80]!r}, not an object of model.* settings). Train into a "
                    f"new --run_dir.")
  now = json.loads(json.dumps(runs.config_dict(config)))
  defaults = json.loads(json.dumps({f.name: f.default for f in dataclasses.fields(ModelConfig)
                                    if f.default is not dataclasses.MISSING}))
  changed = [f"model.{k} ({saved.get(k, defaults.get(k))!r} -> {v!r})" for k, v in now.items()
             if saved.get(k, defaults.get(k)) != v]
  unknown = sorted(set(saved) - set(now))
  if changed or unknown:
    what = ", ".join(changed + [f"model.{k} (no such setting now)" for k in unknown])
    raise UserError(f"{run_dir} was trained to step {meta['step']} as another model than "
                    f"this run's: {what}. Its weights would run as a model they were not "
                    f"trained as. Resume with the checkpoint's model.* settings (its "
                    f"model.json), or train into a new --run_dir.")


def _report_resume(meta: dict, **now) -> None:
  """Says where training resumes and which settings changed since (the run then goes on
  with the new values, so it no longer matches an uninterrupted run)."""
  print(f"resuming from checkpoint step {meta['step']} (data position {meta['data_position']})")
  for key, value in now.items():
    if key in meta and meta[key] != value:
      if key == "optimizer":
        changed = {k: (meta[key].get(k), v) for k, v in value.items()
                   if isinstance(meta[key], dict) and meta[key].get(k) != v}
        shown = ", ".join(f"optimizer.{k} ({a!r} -> {b!r})" for k, (a, b) in changed.items())
      else:
        shown = "the task" if key == "task" else f"train.{key} ({meta[key]!r} -> {value!r})"
      print(f"note: {shown} changed since the checkpoint; training continues from step "
            f"{meta['step']} with the new value.")


def _signal_pending(pending: signals.deferred_signals) -> bool:
  """Whether SIGINT/SIGTERM arrived (on any process of a multi-host run: all of them
  then save the same step together)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    got = multihost_utils.process_allgather(np.int32(pending.signum or 0))
    pending.signum = pending.signum or (int(np.max(got)) or None)
  return pending.signum is not None


def _host_params(params):
  """Device params -> numpy on every process (gathered across hosts if needed)."""
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    return multihost_utils.process_allgather(params, tiled=True)
  return jax.device_get(params)
