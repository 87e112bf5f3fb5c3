"""The train loop: NaN/Inf guard (stop or skip), optimizer bindings, metrics, eval, plots."""
import json
import os
import shutil
import subprocess
import sys
from unittest import mock

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import ginutils, train
from attnprec.errors import UserError
from attnprec.config import ModelConfig
from attnprec.faults import Faults
from attnprec.precision import Precision
from attnprec.tasks.recall import RecallTask
from test_train_utils import (REPO, TINY, assert_bitwise_equal, checkpoint_listing, load_npz,
                              load_runner, train_in_process)

CONFIG = ModelConfig(vocab_size=18, d_model=32, num_layers=1, num_heads=2, num_kv_heads=1,
                     head_dim=16, mlp_hidden=64, max_seq_len=64)
TASK = RecallTask(num_keys=8, value_vocab=8, value_len=1, num_pairs=4, num_queries=4)


def _train_runner():
  return load_runner("train.py")


def _batch(step=0):
  return TASK.train_batch(train.batch_rng(0, step), 8)


def _init(optimizer):
  return jax.jit(lambda: train.init_state(CONFIG, optimizer, 0))()


def _tree_bytes_equal(a, b) -> bool:
  return all(x.dtype == y.dtype and np.asarray(x).tobytes() == np.asarray(y).tobytes()
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("metric", ["grad_norm"])
def test_skipped_nonfinite_step_leaves_params_and_opt_state_unchanged(metric):
  """A skipped step of a non-finite gradient norm, the train step called directly (a
  skipped step of a non-finite loss: through the train loop's checkpoints, in
  test_skip_nonfinite_steps_finishes_and_counts)."""
  optimizer = train.make_optimizer(total_steps=10, warmup_steps=1)
  state0 = _init(optimizer)
  update = train.make_update(CONFIG, Precision(), optimizer, skip_nonfinite=True,
                             faults=Faults(nonfinite_at_step=1, nonfinite_metric=metric))
  state1, m1 = update(state0, *_batch(0))
  assert not bool(m1["finite"]) and not np.isfinite(float(m1[metric]))
  assert _tree_bytes_equal(state1.params, state0.params)
  assert _tree_bytes_equal(state1.opt_state, state0.opt_state)
  assert int(state1.step) == 1                                # data position still advances
  state2, m2 = update(state1, *_batch(1))                     # the next step trains normally
  assert bool(m2["finite"]) and not _tree_bytes_equal(state2.opt_state, state1.opt_state)


def test_nonfinite_loss_stops_naming_step_and_metric(tmp_path):
  run = tmp_path / "run"
  bindings = ["train.steps = 4", "train.checkpoint_every = 2",
              "fault_injection.nonfinite_at_step = 3"]
  with pytest.raises(train.NonFiniteError, match=r"step 3: loss is nan.*last good "
                                                 r"checkpoint is step 2"):
    train_in_process(run, bindings)
  assert checkpoint_listing(run) == ["2"]                     # the good one is kept
  assert not (run / "params.npz").exists()


def test_nonfinite_grad_norm_is_named(tmp_path):
  bindings = ["train.steps = 4", "fault_injection.nonfinite_at_step = 3",
              "fault_injection.nonfinite_metric = 'grad_norm'"]
  with pytest.raises(train.NonFiniteError, match=r"step 3: grad_norm is (inf|nan)"):
    train_in_process(tmp_path / "run", bindings)


def test_skip_nonfinite_steps_finishes_and_counts(tmp_path):
  """The loss of step 3 is NaN: the step is skipped and counted, and its checkpoint holds
  the params and optimizer state of step 2 bit for bit (the skipping select inside the
  train step), the step (data position) advanced; step 4 trains normally."""
  run = tmp_path / "run"
  train_in_process(run, ["train.steps = 4", "train.skip_nonfinite_steps = True",
                         "fault_injection.nonfinite_at_step = 3",
                         "train.checkpoint_every = 1"])
  records = [json.loads(line) for line in open(run / "metrics.jsonl")]
  assert [r["skipped_steps"] for r in records] == [0, 0, 1, 1]
  assert not np.isfinite(records[2]["loss"]) and np.isfinite(records[3]["loss"])
  assert all(np.isfinite(v).all() for v in load_npz(run / "params.npz").values())
  state = {n: _restore_raw(run, n) for n in (2, 3, 4)}
  assert _tree_bytes_equal(state[3]["params"], state[2]["params"])
  assert _tree_bytes_equal(state[3]["opt_state"], state[2]["opt_state"])
  assert int(state[3]["step"]) == 3                      # data position still advances
  assert not _tree_bytes_equal(state[4]["opt_state"], state[3]["opt_state"])


def _restore_raw(run, step) -> dict:
  """The train state a checkpoint holds, as saved (no template)."""
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(os.path.join(run, "checkpoints")) as m:
    return dict(m.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore())).state)


def test_runner_exits_2_when_a_huge_learning_rate_overflows_params(tmp_path, capfd):
  """A real blow-up, no injection: lr 1e30 overflows the params at step 2 (step 1 has lr 0
  from the warmup); the runner names the step and metric, keeps checkpoint 1, exits 2.
  (The runner's main() in this process: its code is the process's exit code, which
  test_runners checks through a real process.)"""
  run = tmp_path / "run"
  capfd.readouterr()
  rc = _train_runner().main([f"--run_dir={run}", "--gin_file=experiments/recall.gin", *[
      f"--gin_bindings={b}" for b in TINY + ["train.steps = 4", "train.checkpoint_every = 1",
                                             "optimizer.learning_rate = 1e30"]]])
  gin.clear_config()
  err = capfd.readouterr().err
  assert rc == 2, err
  assert "train: error: Training stopped at step 2: param_norm is inf" in err
  assert "last good checkpoint is step 1" in err
  assert "Traceback" not in err
  assert checkpoint_listing(run) == ["1"]


def test_optimizer_settings_are_bound_by_gin():
  params = {"m": {"w": jnp.ones((3,), jnp.float32)}}
  grads = {"m": {"w": jnp.full((3,), 0.5, jnp.float32)}}

  def two_updates():
    optimizer = train.make_optimizer(total_steps=4)
    opt_state = optimizer.init(params)
    for _ in range(2):   # the warmup starts at lr 0: the first update is zero
      updates, opt_state = optimizer.update(grads, opt_state, params)
    return np.asarray(updates["m"]["w"])

  ginutils.parse([], ["optimizer.warmup_steps = 1", "optimizer.weight_decay = 0.0",
                      "optimizer.learning_rate = 0.1"])
  np.testing.assert_allclose(two_updates(), -0.1, rtol=1e-2)
  gin.clear_config()
  ginutils.parse([], ["optimizer.warmup_steps = 1", "optimizer.weight_decay = 0.0",
                      "optimizer.learning_rate = 0.5"])
  np.testing.assert_allclose(two_updates(), -0.5, rtol=1e-2)   # Adam: ~lr per step


def test_params_stay_float32_under_bfloat16_compute():
  optimizer = train.make_optimizer(total_steps=4, warmup_steps=1)
  update = train.make_update(CONFIG, Precision(dtype="bfloat16"), optimizer)
  state0 = _init(optimizer)
  state1, _ = update(state0, *_batch(0))
  state2, _ = update(state1, *_batch(1))
  assert not _tree_bytes_equal(state2.params, state0.params)
  assert {x.dtype for x in jax.tree.leaves(state2.params)} == {jnp.dtype(jnp.float32)}


def test_batches_are_a_function_of_seed_and_step():
  a, b = _batch(5), _batch(5)
  assert all(np.array_equal(x, y) for x, y in zip(a, b))
  assert not np.array_equal(_batch(6)[0], a[0])
  assert not np.array_equal(TASK.train_batch(train.eval_rng(0), 8)[0], a[0])


def test_metrics_eval_operative_config_and_plot(tmp_path):
  run = tmp_path / "run"
  train_in_process(run, ["train.steps = 4", "train.log_every = 2", "train.eval_every = 3",
                         "train.plot = True"])
  records = [json.loads(line) for line in open(run / "metrics.jsonl")]
  assert [r["step"] for r in records] == [2, 3, 4]
  assert [r["step"] for r in records if "eval_loss" in r] == [3, 4]
  assert all({"loss", "accuracy", "grad_norm", "tokens_per_s"} <= set(r) for r in records)
  assert "train.steps = 4" in (run / "operative_config.gin").read_text()
  png = (run / "metrics.png").read_bytes()
  assert png.startswith(b"\x89PNG") and len(png) > 10_000
  os.remove(run / "metrics.png")
  done = subprocess.run([sys.executable, "runners/plot.py", f"--run_dir={run}"], cwd=REPO,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 0 and (run / "metrics.png").exists()
  done = subprocess.run([sys.executable, "runners/plot.py", f"--run_dir={tmp_path / 'none'}"],
                        cwd=REPO, capture_output=True, text=True, timeout=120)
  assert done.returncode == 2 and "has no metrics.jsonl" in done.stderr


def test_early_stop_on_target_is_not_resumed(tmp_path, capsys):
  run = tmp_path / "run"
  train_in_process(run, ["train.steps = 4", "train.eval_every = 2",
                         "train.target_accuracy = 0.0"])
  assert checkpoint_listing(run) == ["2"]
  params = load_npz(run / "params.npz")
  capsys.readouterr()
  train_in_process(run, ["train.steps = 4", "train.eval_every = 2",
                         "train.target_accuracy = 0.0"])
  assert "already trained to step 2" in capsys.readouterr().out
  assert_bitwise_equal(params, load_npz(run / "params.npz"))


def test_resuming_under_another_train_precision_is_refused_and_optimizer_changes_noted(
    tmp_path, capsys):
  """A checkpoint records the train precision line and the optimizer's settings: resuming
  with another precision is refused (its steps would mix two precisions under one name),
  a changed learning rate is said (the run then goes on with it)."""
  run = tmp_path / "run"
  # 4 steps: the programs of this file's other 4-step trainings (the compilation cache)
  train_in_process(run, ["train.steps = 4", "train.checkpoint_every = 2"])
  capsys.readouterr()
  with pytest.raises(UserError, match=r"trained to step 4 with precision 'dtype=float32.*"
                                      r"this run's train precision is 'dtype=bfloat16"):
    train_in_process(run, ["train.steps = 2", "train/precision.dtype = 'bfloat16'"])
  # a run that ends inside its warm-up says so (TINY's warm-up is 2 steps), before it
  # reads the checkpoint
  assert ("note: optimizer.warmup_steps = 2 >= train.steps = 2: the learning rate stays in "
          "its warm-up and reaches at most 0.5 x optimizer.learning_rate = 0.003"
          in capsys.readouterr().out)
  # another model whose parameters have the same shapes: refused, model.json untouched
  model_json = (run / "model.json").read_text()
  with pytest.raises(UserError, match=r"trained to step 4 as another model than this "
                                      r"run's: model.activation \('silu' -> 'gelu'\)"):
    train_in_process(run, ["train.steps = 5", "model.activation = 'gelu'"])
  assert (run / "model.json").read_text() == model_json
  # a checkpoint whose meta does not record its precision (edited): refused
  edited = tmp_path / "edited"
  shutil.copytree(run, edited)
  meta_path = edited / "checkpoints" / "4" / "meta" / "metadata"
  meta = json.loads(meta_path.read_text())
  del meta["precision"]
  meta_path.write_text(json.dumps(meta))
  with pytest.raises(UserError, match=r"does not record the train precision its steps ran "
                                      r"in"):
    train_in_process(edited, ["train.steps = 5", "train/precision.dtype = 'bfloat16'"])
  # XLA settings that change numbers are part of the run's precision
  with mock.patch.dict(os.environ, {"XLA_FLAGS": os.environ["XLA_FLAGS"] +
                                    " --xla_cpu_enable_fast_math=true"}):
    with pytest.raises(UserError, match=r"trained to step 4 with 'XLA: excess precision "
                                        r"disabled.*this run has .*fast_math"):
      train_in_process(run, ["train.steps = 5"])
  capsys.readouterr()
  train_in_process(run, ["train.steps = 5", "optimizer.learning_rate = 0.5"])
  out = capsys.readouterr().out
  assert "optimizer.learning_rate (0.003 -> 0.5) changed since the checkpoint" in out, out
  assert "warm-up" not in out                    # 5 steps leave the 2-step warm-up
