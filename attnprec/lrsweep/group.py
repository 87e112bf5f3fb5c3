"""One group of an LR sweep: one model size under one precision setting and one seed,
every learning rate of the plan trained side by side in one program.

The members (M = len(lrs)) are stacked along a leading axis and trained by one
`jax.vmap`-ed update: the same program, compiled once per (size, setting) and shared by
its seeds, runs every learning rate (a traced value), so a grid of 7 rates costs one
compilation, and a member's numbers are those it would get alone (tests/test_lrsweep.py).
The members share the seed's init and batches; the same seed draws the same init and
batches in every setting's group, so settings are compared on paired runs.

The backward pass recomputes what `remat` says (default 'block': each block from the
residual stream; the same numbers, a third more FLOPs, the activations of one block at a
time: 14 members of the 20m size keep [T, S] logits and probabilities otherwise, more
than a 16 GB TPU holds). The loss: mean next-byte cross-entropy plus z_loss x mean(log Z^2) (the paper's z-loss,
which keeps the output logits from drifting; 0 turns it off). The optimizer (per member): gradients clipped to global norm `clip_norm`, Adam moments
(b1, b2, eps), then  p <- p - s(t) * (lr * adam_direction + weight_decay * p)  for
matrices (weight decay independent of the learning rate; none on norm scales), with s(t)
a linear warm-up over `warmup` steps then a cosine decay to end_lr / lr.

A member *diverges* at the first step whose loss, gradient norm or parameter norm is not
finite; its parameters stay as they were before that step (a select inside the program)
and it is reported as diverged.

Evaluation, every `eval_every` steps and at steps 0 and `steps`, on one fixed held-out
batch (the same sequences for every member of every group): the loss (per sequence at the
start and the end, for the report's bootstrap), each layer's largest attention logit (the
scaled q . k over visible positions, computed in float32 at HIGHEST from the queries and
keys the kernel received: a measurement, not the phase's numerics) and the mean
log-sum-exp of the output logits (output logit drift).

Files in the group's directory (`<size>/<setting>/seed<k>/`): `spec.json` (the plan's settings for it), `state.npz`
(the stacked train state every `checkpoint_every` steps, written atomically: a rerun
resumes from it) and, once done, `result.json` (with provenance).
"""
import dataclasses
import io
import json
import os
import time
import zipfile
from typing import Callable, Dict, Optional

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm import tqdm

from attnprec import memory, readback, runs
from attnprec import model as model_lib
from attnprec.errors import UserError
from attnprec.layers import AttentionKernel
from attnprec.lrsweep import corpus
from attnprec.lrsweep.settings import (SIZES, Plan, model_config, non_embedding_params,
                                       precision)


def member_grid(plan: Plan, seed: int):
  """[(seed, lr)] of one seed's group, in the plan's learning-rate order."""
  return [(seed, lr) for lr in plan.lrs]


def schedule(plan: Plan, lr: jax.Array, step: jax.Array) -> jax.Array:
  """s(t) x lr: linear warm-up to lr, then cosine to end_lr (end_lr >= lr: constant)."""
  t = step.astype(jnp.float32)
  warm = jnp.minimum((t + 1.0) / max(plan.warmup, 1), 1.0) if plan.warmup else 1.0
  frac = jnp.clip((t - plan.warmup) / max(plan.steps - plan.warmup, 1), 0.0, 1.0)
  end = jnp.minimum(plan.end_lr, lr)
  cosine = end + 0.5 * (lr - end) * (1.0 + jnp.cos(jnp.pi * frac))
  return warm * cosine


def _decayed(params) -> dict:
  """1.0 for the matrices weight decay applies to, 0.0 for vectors (norm scales)."""
  return jax.tree.map(lambda p: jnp.float32(p.ndim >= 2), params)


def _lse_nll(logits_BxTxV, tokens_BxT):
  """(log-sum-exp [B, T], next-token NLL [B, T]) in float32."""
  logits = logits_BxTxV.astype(jnp.float32)
  lse_BxT = jax.nn.logsumexp(logits, axis=-1)
  target = jnp.take_along_axis(logits, tokens_BxT[:, 1:, None], axis=-1)[..., 0]
  return lse_BxT, lse_BxT - target


def make_update(plan: Plan, config, prec) -> Callable:
  """(params_M, adam_M, diverged_M, lr_M, step, tokens_MxBxT) -> (params, adam, diverged,
  metrics_M); jitted, the state donated."""
  adam = optax.scale_by_adam(plan.b1, plan.b2, plan.eps)
  clip = optax.clip_by_global_norm(plan.clip_norm)

  model = model_lib.transformed(config, plan.remat)

  def loss_fn(params, tokens_BxT):
    logits = model.apply(params, tokens_BxT[:, :-1], precision=prec).logits
    lse_BxT, nll_BxT = _lse_nll(logits, tokens_BxT)
    nll = jnp.mean(nll_BxT)
    return nll + plan.z_loss * jnp.mean(lse_BxT ** 2), {"loss": nll}

  def one(params, adam_state, diverged, lr, step, tokens_BxT):
    grads, metrics = jax.grad(loss_fn, has_aux=True)(params, tokens_BxT)
    grad_norm = optax.tree.norm(grads)
    grads, _ = clip.update(grads, clip.init(params))
    direction, new_adam = adam.update(grads, adam_state)
    rate = schedule(plan, lr, step)
    decay = rate / lr * plan.weight_decay
    new_params = jax.tree.map(lambda p, d, m: p - rate * d - decay * m * p,
                              params, direction, _decayed(params))
    param_norm = optax.tree.norm(new_params)
    finite = (jnp.isfinite(metrics["loss"]) & jnp.isfinite(grad_norm)
              & jnp.isfinite(param_norm))
    keep = diverged | ~finite
    params, adam_state = jax.tree.map(lambda old, new: jnp.where(keep, old, new),
                                      (params, adam_state), (new_params, new_adam))
    return params, adam_state, keep, {"loss": metrics["loss"], "grad_norm": grad_norm,
                                      "param_norm": param_norm,
                                      "diverged": keep.astype(jnp.int8)}

  def update(params, adam_state, diverged, lr_M, step, tokens_MxBxT):
    return jax.vmap(one, in_axes=(0, 0, 0, 0, None, 0))(params, adam_state, diverged, lr_M,
                                                       step, tokens_MxBxT)

  return jax.jit(update, donate_argnums=(0, 1, 2))


def _max_logits(config, record: list):
  """An interceptor recording, per layer, the largest scaled q . k over visible positions."""
  scale = config.query_scale if config.query_scale is not None else config.head_dim ** -0.5

  def interceptor(next_f, args, kwargs, context):
    if isinstance(context.module, AttentionKernel) and context.method_name == "__call__":
      q_BxTxNxH, k_BxSxKxH = args[0], args[1]
      N, K = q_BxTxNxH.shape[2], k_BxSxKxH.shape[2]
      k_BxSxNxH = jnp.repeat(k_BxSxKxH, N // K, axis=2)
      logits = jnp.einsum("btnh,bsnh->bnts", q_BxTxNxH.astype(jnp.float32),
                          k_BxSxNxH.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST) * scale
      T, S = logits.shape[-2:]
      visible = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None] + (S - T)
      record.append(jnp.max(jnp.where(visible, logits, -jnp.inf)))
    return next_f(*args, **kwargs)

  return interceptor


def make_eval(config, prec) -> Callable:
  """(params_M, tokens_BxT) -> {seq_loss [M, B], max_logit [M, L], lse [M]}; jitted."""
  model = model_lib.transformed(config)

  def one(params, tokens_BxT):
    record = []
    with hk.experimental.intercept_methods(_max_logits(config, record)):
      logits = model.apply(params, tokens_BxT[:, :-1], precision=prec).logits
    lse_BxT, nll_BxT = _lse_nll(logits, tokens_BxT)
    return {"seq_loss": jnp.mean(nll_BxT, axis=1), "max_logit": jnp.stack(record),
            "lse": jnp.mean(lse_BxT)}

  return jax.jit(jax.vmap(one, in_axes=(0, None)))


def init_members(plan: Plan, config, seed: int):
  """Stacked float32 params and Adam state of every member (a seed's init is the same for
  each of its learning rates and in every setting's group)."""
  init = model_lib.init_params(config, jax.random.PRNGKey(seed))
  params = jax.tree.map(lambda x: jnp.stack([x] * len(plan.lrs)), init)
  adam_state = jax.vmap(optax.scale_by_adam(plan.b1, plan.b2, plan.eps).init)(params)
  return params, adam_state


def device_memory_bytes() -> Optional[int]:
  """The first device's memory limit (a TPU's HBM), else this machine's RAM."""
  stats = getattr(jax.devices()[0], "memory_stats", lambda: None)()
  if stats and stats.get("bytes_limit"):
    return int(stats["bytes_limit"])
  return memory.physical_bytes()


@dataclasses.dataclass
class Prepared:
  """A group's compiled update and evaluation, checked to fit the device before anything
  runs."""
  update: Callable
  evaluate: Callable
  needed: Optional[int]      # XLA's estimate of a train step's bytes (None: not reported)
  limit: Optional[int]       # the device's bytes
  compile_s: float


def _bytes_needed(compiled) -> Optional[int]:
  analysis = compiled.memory_analysis()
  if analysis is None:
    return None
  return int(analysis.temp_size_in_bytes + analysis.argument_size_in_bytes
             + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)


def prepare(plan: Plan, size: str, setting: str) -> Prepared:
  """Compiles the group's update and evaluation from abstract shapes (nothing allocated)
  and checks that each fits the device: a UserError naming the size and the batch that
  does not."""
  config, prec = model_config(size, setting, plan.seq_len), precision(setting, plan.kernel)
  M = len(plan.lrs)
  t0 = time.time()
  params, adam_state = jax.eval_shape(lambda: init_members(plan, config, 0))
  state = (params, adam_state, jax.ShapeDtypeStruct((M,), jnp.bool_))
  lr_M = jax.ShapeDtypeStruct((M,), jnp.float32)
  tokens = jax.ShapeDtypeStruct((M, plan.batch, plan.seq_len), jnp.int32)
  update = make_update(plan, config, prec).lower(
      *state, lr_M, jax.ShapeDtypeStruct((), jnp.int32), tokens).compile()
  evaluate = make_eval(config, prec).lower(
      params, jax.ShapeDtypeStruct((plan.eval_batch, plan.seq_len), jnp.int32)).compile()
  limit = device_memory_bytes()
  needed = _bytes_needed(update)
  for what, value, batch in (("a train step", needed, f"lr_sweep.batch = {plan.batch}"),
                             ("an evaluation", _bytes_needed(evaluate),
                              f"lr_sweep.eval_batch = {plan.eval_batch}")):
    if value is not None and limit is not None and value > 0.95 * limit:
      raise UserError(
          f"lr_sweep.sizes: {size!r} ({non_embedding_params(size) / 1e6:.1f}M parameters) "
          f"with {M} members (one per learning rate), {batch} sequences of "
          f"lr_sweep.seq_len = {plan.seq_len}, needs {value / 2**30:.2f} GiB for {what} "
          f"({setting}), more than 95% of this device's {limit / 2**30:.2f} GiB "
          f"({jax.devices()[0].device_kind}). Use a smaller size (valid: "
          f"{', '.join(repr(s) for s in SIZES)}), fewer learning rates, or a smaller batch "
          f"or seq_len.")
  return Prepared(update, evaluate, needed, limit, time.time() - t0)


def _state_bytes(step: int, state, logs: dict) -> bytes:
  """state.npz's bytes: the state's leaves, the step reached and the logs so far."""
  leaves = jax.tree.leaves(state)
  arrays = {f"leaf_{i}": np.asarray(x) for i, x in enumerate(leaves)}
  arrays["step"] = np.int64(step)
  arrays["logs"] = np.frombuffer(json.dumps(logs).encode(), np.uint8)
  buf = io.BytesIO()
  np.savez(buf, **arrays)
  return buf.getvalue()


def _state_problem(step, logs, new, leaves, plan: Plan, M: int):
  """What is wrong with a state.npz's content, or None."""
  if not 1 <= step < plan.steps:
    return f"'step' is {step}, not a step of this plan's 1..{plan.steps - 1}"
  for i, (a, b) in enumerate(zip(new, leaves)):
    if a.shape != np.shape(b) or a.dtype != np.asarray(b).dtype:
      return (f"'leaf_{i}' is {a.dtype}{list(a.shape)}, not this group's "
              f"{np.asarray(b).dtype}{list(np.shape(b))}")
    if np.issubdtype(a.dtype, np.floating) and not np.all(np.isfinite(a)):
      return f"'leaf_{i}' holds values that are not finite (a state is saved finite)"
  if not isinstance(logs, dict) or set(logs) != {"train", "eval", "diverged_at"}:
    return "'logs' is not the object of train / eval / diverged_at records"
  dv = logs["diverged_at"]
  if not isinstance(dv, list) or len(dv) != M or not all(
      d is None or (readback.is_int(d) and 1 <= d <= step) for d in dv):
    return "'logs' diverged_at is not one step or null per member"
  for kind in ("train", "eval"):
    recs = logs[kind]
    if not isinstance(recs, list) or not all(
        isinstance(r, dict) and readback.is_int(r.get("step")) and 0 <= r["step"] <= step
        and isinstance(r.get("loss"), list) and len(r["loss"]) == M for r in recs):
      return f"'logs' {kind} records are not steps up to {step} with {M} losses each"
  return None


def _load_state(path: str, template, plan: Plan, M: int):
  """(step, state, logs) from state.npz, checked against this group (shapes, dtypes, a
  step of the plan, finite values, the logs' schema); anything else is a UserError
  naming the file and the field."""
  leaves, treedef = jax.tree.flatten(template)
  try:
    with np.load(path, allow_pickle=False) as z:
      new = [z[f"leaf_{i}"] for i in range(len(leaves))]
      step = z["step"]
      logs, why = readback.loads(bytes(z["logs"]).decode("utf-8"))
  except (OSError, ValueError, KeyError, EOFError, UnicodeDecodeError,
          zipfile.BadZipFile) as e:
    problem = f"it cannot be read as this group's saved state ({type(e).__name__}: {e})"
  else:
    if why:
      problem = f"'logs' is {why}"
    elif step.shape != () or not np.issubdtype(step.dtype, np.integer):
      problem = "'step' is not one integer"
    else:
      problem = _state_problem(int(step), logs, new, leaves, plan, M)
  if problem:
    raise UserError(f"{path} is not a state this sweep group saved: {problem}. Delete it "
                    f"to train the group from its first step.")
  return int(step), jax.tree.unflatten(treedef, [jnp.asarray(a) for a in new]), logs


def spec(plan: Plan, size: str, setting: str, seed: int) -> dict:
  """What a group's result depends on (not the plan's other sizes, settings or seeds)."""
  d = dataclasses.asdict(plan)
  d.pop("sizes"), d.pop("settings"), d.pop("seeds")
  return json.loads(json.dumps({"size": size, "setting": setting, "seed": seed, **d,
          "precision": repr(precision(setting, plan.kernel)),
          "model": runs.config_dict(model_config(size, setting, plan.seq_len)),
          "corpus_sha256": corpus.CORPUS_SHA256}, default=runs._jsonable))


def run_group(plan: Plan, size: str, setting: str, seed: int, group_dir: str, *,
              checkpoint_every: int = 100, progress: bool = True,
              prepared: Optional[Prepared] = None) -> dict:
  """Trains the group into `group_dir` (resuming from its state.npz); returns result.json's
  content."""
  prepared = prepared or prepare(plan, size, setting)
  runs.ensure_dir(group_dir)
  config, prec = model_config(size, setting, plan.seq_len), precision(setting, plan.kernel)
  grid = member_grid(plan, seed)
  M = len(grid)
  lr_M = jnp.asarray([lr for _, lr in grid], jnp.float32)
  eval_BxT = jnp.asarray(corpus.eval_batch(0, plan.eval_batch, plan.seq_len))

  def batch_at(step):
    tokens = corpus.train_batch(seed, step, plan.batch, plan.seq_len)
    return jnp.asarray(np.broadcast_to(tokens, (M,) + tokens.shape))

  params, adam_state = init_members(plan, config, seed)
  state = (params, adam_state, jnp.zeros((M,), bool))
  start, logs = 0, {"train": [], "eval": [], "diverged_at": [None] * M}
  state_path = os.path.join(group_dir, "state.npz")
  if os.path.exists(state_path):
    start, state, logs = _load_state(state_path, state, plan, M)
  update, evaluate = prepared.update, prepared.evaluate

  def do_eval(step, params):
    out = jax.device_get(evaluate(params, eval_BxT))
    entry = {"step": step, "loss": out["seq_loss"].mean(1).tolist(),
             "max_logit": out["max_logit"].tolist(), "lse": out["lse"].tolist()}
    if step in (0, plan.steps):
      entry["seq_loss"] = out["seq_loss"].tolist()
    logs["eval"].append(entry)

  if start == 0 and not logs["eval"]:
    do_eval(0, state[0])
  bar = tqdm(total=plan.steps, initial=start, desc=f"{size} {setting} seed {seed}", unit="step",
             dynamic_ncols=True, disable=not progress)
  train_t = time.time()
  pending = []
  with bar:
    for step in range(start, plan.steps):
      params, adam_state, diverged, metrics = update(*state, lr_M, jnp.int32(step),
                                                     batch_at(step))
      state = (params, adam_state, diverged)
      pending.append((step + 1, metrics))
      done = step + 1
      if done % plan.eval_every == 0 or done == plan.steps or \
          (checkpoint_every and done % checkpoint_every == 0):
        for s, m in jax.device_get(pending):
          logs["train"].append({"step": s, "loss": np.asarray(m["loss"]).tolist()})
          for i, flag in enumerate(np.asarray(m["diverged"])):
            if flag and logs["diverged_at"][i] is None:
              logs["diverged_at"][i] = s
        pending = []
        losses = np.asarray(logs["train"][-1]["loss"])
        bar.set_postfix_str(f"loss {np.nanmin(losses):.3f}..{np.nanmax(losses):.3f}, "
                            f"diverged {sum(d is not None for d in logs['diverged_at'])}/{M}")
      if done % plan.eval_every == 0 or done == plan.steps:
        do_eval(done, state[0])
      if checkpoint_every and done % checkpoint_every == 0 and done < plan.steps:
        runs.atomic_write(state_path, _state_bytes(done, state, logs), "wb")
      bar.update(1)
  train_s = time.time() - train_t
  steps_run = plan.steps - start
  result = {
      "size": size, "setting": setting, "seed": seed, "spec": spec(plan, size, setting, seed),
      "non_embedding_params": non_embedding_params(size),
      "precision_line": prec.describe(jax.default_backend()),
      "members": [{"seed": s, "lr": lr} for s, lr in grid],
      "diverged_at": logs["diverged_at"], "train": logs["train"], "eval": logs["eval"],
      "timing": {"compile_s": round(prepared.compile_s, 2), "train_s": round(train_s, 2),
                 "steps_run": steps_run, "resumed_from": start,
                 "tokens_per_s": (round(steps_run * M * plan.batch * plan.seq_len / train_s)
                                  if steps_run and train_s > 0 else None),
                 "step_bytes_estimate": prepared.needed, "device_bytes": prepared.limit},
  }
  runs.write_json(group_dir, "result.json", result, provenance=True)
  if os.path.exists(state_path):
    os.remove(state_path)
  return result
