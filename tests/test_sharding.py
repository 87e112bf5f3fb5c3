"""Meshes (1x8, 2x4, 8x1) give the single-device loss and decoded tokens; bad meshes are
UserErrors. Runs in a subprocess with 8 host CPU devices (XLA_FLAGS must be set before jax
is imported, which pytest's process already did).

Reference: the same program on one device, no mesh. fp32 tolerances: sharded reductions
add in a different order, so results may differ in the last bits. Losses of 2 train steps
agree to TOL_LOSS (absolute, loss ~3.5), gradient norms to TOL_GRAD_NORM (relative), the
decode logits of the same params to TOL_LOGITS, greedy tokens exactly. Params after the
2 Adam steps agree to TOL_PARAMS: Adam divides by sqrt(second moment), which turns ulp-level
differences of near-zero gradients into visible ones, bounded by the step size (lr 3e-3);
1e-4 is ~3% of one step.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

TOL_LOSS, TOL_GRAD_NORM, TOL_LOGITS, TOL_PARAMS = 2e-6, 1e-6, 1e-5, 1e-4
MESHES = [(1, 8), (2, 4), (8, 1)]


def _run_child():
  """Runs this file as a script on 8 devices; returns the JSON it prints."""
  from test_train_utils import REPO, SUBPROCESS_ENV
  flags = os.environ.get("XLA_FLAGS", "")
  env = dict(SUBPROCESS_ENV, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=8")
  assert "--xla_allow_excess_precision=false" in env["XLA_FLAGS"]
  done = subprocess.run([sys.executable, os.path.abspath(__file__)], capture_output=True,
                        text=True, timeout=400, cwd=REPO, env=env)
  assert done.returncode == 0, done.stderr[-4000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def test_meshes_match_single_device_resume_across_meshes_and_reject_bad_ones():
  """One test (one 8-device subprocess, which xdist would otherwise start per worker)."""
  child = _run_child()
  for shape in MESHES:
    _check_mesh(shape, child["meshes"][f"{shape[0]}x{shape[1]}"])
  # train() under mesh (4, 2); a copy with the step-4 checkpoint dropped (as if killed
  # after step 3) resumes under (8, 1) at step 2 and ends where the (4, 2) run did.
  assert child["train"]["resumed_from"] == 2
  assert child["train"]["params_diff"] <= TOL_PARAMS
  errors = child["errors"]
  assert "needs a multiple of 3 devices, but there are 8" in errors["device_count"]
  assert "model axis (8) does not divide model.num_heads=2" in errors["heads"]
  assert "data axis (8) does not divide train.batch_size=4" in errors["batch"]
  assert "mesh.shape=(2, 2, 2) must be (data, model)" in errors["rank"]


def _check_mesh(shape, got):
  where = f"mesh {shape}: {got}"
  assert got["devices"] == 8, where
  assert got["loss_diff"] <= TOL_LOSS and got["grad_norm_rel_diff"] <= TOL_GRAD_NORM, where
  assert got["params_diff"] <= TOL_PARAMS, where
  assert got["tokens_equal"] and got["logits_diff"] <= TOL_LOGITS, where
  assert got["params_sharded_as_planned"], where
  # The KV cache in the compiled decode loop: batch split over data; kv heads split over
  # model when the k/v projections are (else XLA's propagation decides; it must still
  # hold whole kv heads).
  b, k, S, H = got["cache_shard_shape"]
  assert (b, S, H) == (8 // shape[0], 11, 8), where
  if got["kv_split"]:
    assert k == 4 // shape[1], where
  else:
    assert 4 % k == 0, where


def test_distributed_settings_are_checked_and_optional():
  from attnprec import sharding
  from attnprec.errors import UserError
  assert sharding.initialize_distributed() is False          # nothing bound: not called
  with pytest.raises(UserError, match="num_processes and distributed.process_id"):
    sharding.initialize_distributed(coordinator_address="localhost:1")
  with pytest.raises(UserError, match=r"process_id=2 must be in 0..1"):
    sharding.initialize_distributed(coordinator_address="localhost:1", num_processes=2,
                                    process_id=2)


def test_two_processes_match_one(tmp_path):
  """Multi-host on one machine: 2 train runner processes (1 CPU device each, joined by
  jax.distributed through the gin `distributed.*` settings, mesh data=2) give the params of
  a single-process run to TOL_PARAMS, and write the run directory once."""
  import socket
  from test_train_utils import (SUBPROCESS_ENV, load_npz, runner_args, train_in_process)
  with socket.socket() as sock:
    sock.bind(("localhost", 0))
    port = sock.getsockname()[1]
  steps = ["train.steps = 4", "train.checkpoint_every = 2"]
  procs = [subprocess.Popen(
      runner_args(tmp_path / "multi", steps + [
          f"distributed.coordinator_address = 'localhost:{port}'",
          "distributed.num_processes = 2", f"distributed.process_id = {i}"]),
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=SUBPROCESS_ENV)
      for i in range(2)]
  outs = [p.communicate(timeout=300)[0] for p in procs]
  assert [p.returncode for p in procs] == [0, 0], outs[0][-3000:] + outs[1][-3000:]
  train_in_process(tmp_path / "one", steps)
  a, b = load_npz(tmp_path / "one" / "params.npz"), load_npz(tmp_path / "multi" / "params.npz")
  assert sorted(a) == sorted(b)
  assert max(float(np.max(np.abs(a[k] - b[k]))) for k in a) <= TOL_PARAMS
  with open(tmp_path / "multi" / "metrics.jsonl") as f:
    assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4]   # written once


# ------------------------------------------------------------------ the 8-device child
def _max_diff(a, b) -> float:
  import jax
  import numpy as np
  return max(float(np.max(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _cache_shard_shape(txt: str, S: int, H: int):
  """Per-device shape [b, k, S, H] of a layer's KV cache carried by the compiled decode
  loop."""
  import re
  for line in txt.splitlines():
    if " while(" in line:
      m = re.search(rf"f32\[(\d+),(\d+),{S},{H}\]", line)
      if m:
        return [*map(int, m.groups()), S, H]
  return None


def _child_mesh(shape, config, precision, batch, ref):
  import jax
  import numpy as np
  from attnprec import decoding, sharding, train
  mesh = sharding.make_mesh(shape=shape)
  optimizer = train.make_optimizer(total_steps=10, warmup_steps=1)
  abstract = jax.eval_shape(lambda: train.init_state(config, optimizer, 0))
  state_sh = sharding.tree_shardings(abstract, abstract.params, config, mesh)
  state = jax.device_put(ref["state0"], state_sh)
  update = jax.jit(train.make_update(config, precision, optimizer),
                   out_shardings=(state_sh, sharding.NamedSharding(mesh, sharding.P())))
  with jax.set_mesh(mesh):
    tokens, mask = (sharding.put_batch(mesh, x) for x in batch)
    losses, norms = [], []
    for _ in range(2):
      state, metrics = update(state, tokens, mask)
      losses.append(float(metrics["loss"]))
      norms.append(float(metrics["grad_norm"]))
    planned = all(state.params[m][n].sharding.spec == sharding.param_spec(m, n, config, mesh)
                  for m in state.params for n in state.params[m])
    # Decode the reference params (so only the sharded decode itself can differ).
    params = sharding.put_params(ref["params"], config, mesh)
    prompt = sharding.put_batch(mesh, ref["prompt"])
    lengths = sharding.put_batch(mesh, ref["lengths"])
    kwargs = dict(config=config, precision=precision, max_new_tokens=5)
    lowered = decoding.generate.lower(params, prompt, lengths, jax.random.PRNGKey(0), **kwargs)
    compiled = lowered.compile()
    toks, logits, *_ = compiled(params, prompt, lengths, jax.random.PRNGKey(0))
    txt = compiled.as_text()
  return {"devices": mesh.size,
          "loss_diff": max(abs(a - b) for a, b in zip(losses, ref["losses"])),
          "grad_norm_rel_diff": max(abs(a - b) / b for a, b in zip(norms, ref["norms"])),
          "params_diff": _max_diff(state.params, ref["params"]),
          "tokens_equal": bool(np.array_equal(np.asarray(toks), ref["tokens"])),
          "logits_diff": _max_diff(logits, ref["logits"]),
          "cache_shard_shape": _cache_shard_shape(txt, prompt.shape[1] + 5, config.head_dim),
          "kv_split": sharding.kv_split(config, mesh),
          "params_sharded_as_planned": planned}


def _child_train_loop():
  """train() 4 steps on mesh (4, 2); a copy of the run with its step-4 checkpoint dropped
  resumes from step 2 on mesh (8, 1); max param difference between the two."""
  import shutil
  import tempfile
  from test_train_utils import load_npz, train_in_process
  import gin
  base = ["train.steps = 4", "train.checkpoint_every = 2"]
  tmp = tempfile.mkdtemp()
  try:
    train_in_process(f"{tmp}/straight", base + ["mesh.shape = (2, 2)"])
    shutil.copytree(f"{tmp}/straight", f"{tmp}/resumed")
    shutil.rmtree(f"{tmp}/resumed/checkpoints/4")
    os.remove(f"{tmp}/resumed/params.npz")
    gin.clear_config()
    train_in_process(f"{tmp}/resumed", base + ["mesh.shape = (4, 1)"])
    with open(f"{tmp}/resumed/metrics.jsonl") as f:
      steps = [json.loads(line)["step"] for line in f]
    a, b = load_npz(f"{tmp}/straight/params.npz"), load_npz(f"{tmp}/resumed/params.npz")
    return {"resumed_from": 2 if steps == [1, 2, 3, 4] else None,
            "params_diff": _max_diff([a[k] for k in sorted(a)], [b[k] for k in sorted(b)])}
  finally:
    shutil.rmtree(tmp)


def _child_errors(config):
  import dataclasses
  from attnprec import sharding
  from attnprec.errors import UserError
  out = {}
  cases = {
      "device_count": lambda: sharding.make_mesh(shape=(3, 1)),
      "rank": lambda: sharding.make_mesh(shape=(2, 2, 2)),
      "heads": lambda: sharding.check(sharding.make_mesh(shape=(1, 8)),
                                      dataclasses.replace(config, num_heads=2,
                                                          num_kv_heads=1)),
      "batch": lambda: sharding.check(sharding.make_mesh(shape=(8, 1)), config,
                                      [("train.batch_size", 4)]),
  }
  for name, fn in cases.items():
    try:
      fn()
      out[name] = "no error"
    except UserError as e:
      out[name] = str(e)
  return out


def _child_main():
  import jax
  import numpy as np
  from attnprec import decoding, train
  from attnprec.config import ModelConfig
  from attnprec.precision import Precision
  from test_train_utils import numpy_params
  assert jax.device_count() == 8
  config = ModelConfig(vocab_size=32, d_model=32, num_layers=1, num_heads=8, num_kv_heads=4,
                       head_dim=8, mlp_hidden=64, max_seq_len=64)
  precision = Precision()
  rng = np.random.default_rng(0)
  batch = (rng.integers(0, 32, (8, 16)).astype(np.int32), np.ones((8, 16), np.float32))
  optimizer = train.make_optimizer(total_steps=10, warmup_steps=1)
  # The starting state: params drawn in NumPy at init_params' scales (numpy_params: no
  # compile of the model's init) and the optimizer's own init; every mesh starts from it.
  params0 = numpy_params(config)
  state0 = train.TrainState(params0, jax.jit(optimizer.init)(params0), np.zeros((), np.int32),
                            jax.random.PRNGKey(0))
  update = train.make_update(config, precision, optimizer)
  state, losses, norms = state0, [], []
  for _ in range(2):
    state, metrics = update(state, *batch)
    losses.append(float(metrics["loss"]))
    norms.append(float(metrics["grad_norm"]))
  prompt = rng.integers(0, 32, (8, 6)).astype(np.int32)
  lengths = np.full((8,), 6, np.int32)
  toks, logits, *_ = decoding.generate(state.params, prompt, lengths, jax.random.PRNGKey(0),
                                   config=config, precision=precision, max_new_tokens=5)
  ref = {"state0": jax.device_get(state0), "losses": losses, "norms": norms, "params": state.params,
         "prompt": prompt, "lengths": lengths, "tokens": np.asarray(toks), "logits": logits}
  out = {"meshes": {f"{d}x{m}": _child_mesh((d, m), config, precision, batch, ref)
                    for d, m in MESHES},
         "errors": _child_errors(config), "train": _child_train_loop()}
  print(json.dumps(out))


if __name__ == "__main__":
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  _child_main()
