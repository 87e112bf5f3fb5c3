"""Shared helpers for the training tests: a tiny recall setup, in-process and subprocess
training runs, and process killing at announced points. (No tests in this file.)"""
import os
import signal
import subprocess
import sys
import time

import numpy as np

from attnprec import ginutils

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_RUNNER = os.path.join(REPO, "runners", "train.py")

# 1 layer, d 32, recall with 4 pairs + 4 queries (17 tokens), batch 8: compiles in seconds.
TINY = [
    "model.vocab_size = 18", "model.d_model = 32", "model.num_layers = 1",
    "model.num_heads = 2", "model.num_kv_heads = 1", "model.head_dim = 16",
    "model.mlp_hidden = 64", "model.max_seq_len = 64",
    "recall.num_keys = 8", "recall.value_vocab = 8", "recall.value_len = 1",
    "recall.num_pairs = 4", "recall.num_queries = 4",
    "train.batch_size = 8", "train.eval_batch = 8", "train.log_every = 1",
    "train.eval_every = 4", "train.target_accuracy = None", "train.progress = False",
    "train.plot = False", "optimizer.warmup_steps = 2",
]


def train_in_process(run_dir, bindings, files=("experiments/recall.gin",)):
  """Parses gin like the runner does and runs the train job; returns its last metrics."""
  from attnprec.config import model_config
  from attnprec.jobs import train_job
  from attnprec.precision import phase_precision
  ginutils.parse(["runs/train.gin", *files], list(TINY) + list(bindings))
  config = model_config()
  with ginutils.phase("train"):
    precision = phase_precision()
  return train_job(config=config, precision=precision, run_dir=str(run_dir))


def runner_args(run_dir, bindings, files=("experiments/recall.gin",)):
  args = [sys.executable, TRAIN_RUNNER, f"--run_dir={run_dir}"]
  args += [f"--gin_file={f}" for f in files]
  return args + [f"--gin_bindings={b}" for b in list(TINY) + list(bindings)]


def run_train(run_dir, bindings, files=("experiments/recall.gin",), timeout=240):
  """runners/train.py in a subprocess -> CompletedProcess (text stdout/stderr)."""
  return subprocess.run(runner_args(run_dir, bindings, files), capture_output=True, text=True,
                        timeout=timeout, cwd=REPO, env=SUBPROCESS_ENV)


def run_and_kill(run_dir, bindings, marker, timeout=240) -> str:
  """Starts a training subprocess that pauses at an announced point (fault_injection with
  `marker`), waits for the announcement, SIGKILLs it; returns the announcement."""
  if os.path.exists(marker):
    os.remove(marker)
  bindings = list(bindings) + [f"fault_injection.marker = '{marker}'"]
  proc = subprocess.Popen(runner_args(run_dir, bindings), stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, cwd=REPO, env=SUBPROCESS_ENV)
  deadline = time.time() + timeout
  try:
    while not os.path.exists(marker) or not open(marker).read().endswith("\n"):
      if proc.poll() is not None:
        raise AssertionError(f"training exited ({proc.returncode}) before pausing:\n"
                             f"{proc.stdout.read()[-3000:]}")
      if time.time() > deadline:
        raise AssertionError("training never reached the pause point")
      time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    proc.stdout.close()
  with open(marker) as f:
    return f.read()


def load_npz(path) -> dict:
  with np.load(path) as z:
    return {k: z[k] for k in z.files}


def assert_bitwise_equal(a: dict, b: dict) -> None:
  assert sorted(a) == sorted(b)
  for k in a:
    assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
    assert a[k].tobytes() == b[k].tobytes(), f"{k} differs"


def checkpoint_listing(run_dir) -> list:
  return sorted(os.listdir(os.path.join(run_dir, "checkpoints")))


def use_compilation_cache() -> dict:
  """Persistent XLA compilation cache for these tests (in this process and, through the
  returned environment, in subprocesses): the tiny programs are identical across runs, and
  compiling them dominates the tests' time on a busy 2-core machine. Cached executables
  are the same compiled programs, so results are unchanged."""
  import jax
  cache = os.path.join(REPO, ".cache", "jax-test-compilation")
  env = {"JAX_COMPILATION_CACHE_DIR": cache, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
         "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
  jax.config.update("jax_compilation_cache_dir", cache)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
  return env


SUBPROCESS_ENV = {**os.environ, **use_compilation_cache()}


def numpy_params(config, seed=0, bias_std=0.0, dtype=np.float32) -> dict:
  """Random params for `config` at the scales `model.init_params` draws (embeddings
  d_model^-1/2, weights fan_in^-1/2, both cut at 2 standard deviations; norm scales 1),
  drawn in NumPy: no op-by-op compiles of the model's init. Biases are zero, or normal
  with `bias_std`."""
  from attnprec import model as model_lib
  rng = np.random.default_rng(seed)

  def draw(name, shape):
    if name == "scale":
      return np.ones(shape)
    if name == "b":
      return bias_std * rng.standard_normal(shape) if bias_std else np.zeros(shape)
    std = config.d_model ** -0.5 if name == "embeddings" else shape[0] ** -0.5
    return std * np.clip(rng.standard_normal(shape), -2, 2)
  return {m: {n: draw(n, s.shape).astype(dtype) for n, s in d.items()}
          for m, d in model_lib.param_shapes(config).items()}


def load_runner(script):
  """runners/<script> as a module (its main(argv) callable in this process)."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      f"runner_{script[:-3]}_in_process", os.path.join(REPO, "runners", script))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def runner_exit(script, argv, *, process: bool, monkeypatch):
  """(exit code, stderr) of runners/<script> with `argv`: as a process (its real exit code)
  or through its main(argv) in this process (`runner_main`)."""
  if process:
    proc = subprocess.run([sys.executable, os.path.join("runners", script), *argv], cwd=REPO,
                          capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=REPO), timeout=300)
    return proc.returncode, proc.stderr
  return runner_main(script, *argv, monkeypatch=monkeypatch)


def runner_main(script, *args, monkeypatch):
  """(exit code, stderr) of runners/<script>'s main(args), called in this process (a bad
  input's checks without a process's start-up)."""
  import contextlib
  import io

  import gin
  import jax
  cache = jax.config.jax_compilation_cache_dir
  # a runner's `compilation.enable()` keeps a cache directory named by the environment:
  # the tests' own (else it would point this process at the user's cache).
  monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", cache)
  module = load_runner(script)
  err = io.StringIO()
  gin.clear_config()
  try:
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
      rc = module.main(list(args))
  finally:
    gin.clear_config()
    jax.config.update("jax_compilation_cache_dir", cache)
  return rc, err.getvalue()
