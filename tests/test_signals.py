"""Signals: SIGTERM and SIGINT save a checkpoint at the step in flight and exit 143 / 130
with one line; training again resumes bit for bit. Runners other than train leave no
empty or half-written run directory behind when a signal stops them."""
import contextlib
import importlib.util
import io
import os
import signal
import subprocess
import sys
import time
from unittest import mock

import gin
import numpy as np
import pytest

from attnprec import cli, faults, runs
from test_train_utils import (REPO, SUBPROCESS_ENV, TINY, assert_bitwise_equal,
                              checkpoint_listing, load_npz, run_train, runner_args,
                              train_in_process)

# only the end is periodic; 4 steps: the programs of the other tests' 4-step trainings
# (test_train_utils.TINY), loaded from the compilation cache
STEPS = ["train.steps = 4", "train.checkpoint_every = 100"]


def _load_runner(name):
  spec = importlib.util.spec_from_file_location(f"runner_{name}_signals",
                                                os.path.join(REPO, "runners", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _call(runner, argv):
  """(exit code, stderr) of runners/<runner>.py main(argv), in-process."""
  gin.clear_config()
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    rc = _load_runner(runner).main(list(argv))
  gin.clear_config()
  return rc, err.getvalue()


def _losses(run_dir):
  import json
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def test_sigterm_saves_the_step_in_flight_and_resumes_bit_identically(tmp_path):
  """A real SIGTERM to runners/train.py after step 2 (held there 2 s by the test-only
  pause, so the signal lands while the process is busy): exit 143, one line naming the
  checkpoint of step 2; training again finishes identical to an uninterrupted run."""
  resumed, straight, marker = tmp_path / "resumed", tmp_path / "straight", tmp_path / "m"
  pause = ["fault_injection.pause_after_step = 2", "fault_injection.pause_s = 2.0",
           f"fault_injection.marker = '{marker}'"]
  proc = subprocess.Popen(runner_args(resumed, STEPS + pause), stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=REPO, env=SUBPROCESS_ENV)
  try:
    deadline = time.time() + 120
    while not (marker.exists() and marker.read_text().endswith("\n")):
      assert proc.poll() is None, proc.communicate()[1][-3000:]
      assert time.time() < deadline, "training never finished step 2"
      time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == cli.EXIT_TERMINATED == 143, err[-3000:]
  lines = [line for line in err.splitlines() if line.strip()]
  where = os.path.join(resumed, "checkpoints", "2")
  assert lines[-1] == (f"train: interrupted by SIGTERM; saved a checkpoint at step 2 in "
                       f"{where}; training again with the same --run_dir resumes from it.")
  assert "Traceback" not in err
  assert checkpoint_listing(resumed) == ["2"]
  assert not (resumed / "params.npz").exists()

  done = run_train(resumed, STEPS)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "resuming from checkpoint step 2" in done.stdout
  train_in_process(straight, STEPS)
  assert_bitwise_equal(load_npz(straight / "params.npz"), load_npz(resumed / "params.npz"))
  assert _losses(resumed) == _losses(straight)


def test_sigint_saves_and_exits_130(tmp_path, monkeypatch):
  """Ctrl-C (SIGINT, sent to this process right after step 1) through the runner's
  main in-process: the step finishes, step 1 is saved, exit 130 with the same line."""
  monkeypatch.setattr(faults.Faults, "pause",
                      lambda self, where: os.kill(os.getpid(), signal.SIGINT))
  run_dir = tmp_path / "run"
  before = signal.getsignal(signal.SIGINT)  # the default, or SIG_IGN under a background job
  argv = [f"--run_dir={run_dir}", "--gin_file=experiments/recall.gin",
          *[f"--gin_bindings={b}" for b in TINY + STEPS + ["fault_injection.pause_after_step = 1"]]]
  rc, err = _call("train", argv)
  assert rc == cli.EXIT_INTERRUPTED == 130, err
  assert err.strip().splitlines()[-1].startswith(
      "train: interrupted by SIGINT; saved a checkpoint at step 1 in ")
  assert checkpoint_listing(run_dir) == ["1"]
  assert signal.getsignal(signal.SIGINT) is before                       # restored


def test_second_signal_stops_at_once():
  with pytest.raises(cli.Interrupted, match="second signal") as got:
    with cli.deferred_signals() as signals:
      os.kill(os.getpid(), signal.SIGTERM)
      assert signals.signum == signal.SIGTERM        # recorded, not raised
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(1)
  assert got.value.exit_code == 143


def _signal_in(kind):
  """A stand-in for a runner's heavy step that writes one output, then gets `kind`."""
  def work(*args, **kwargs):
    run_dir = os.environ["SIGNAL_TEST_RUN_DIR"]
    runs.write_json(run_dir, "partial.json", {"half": "done"})
    os.kill(os.getpid(), kind)
    time.sleep(5)
    raise AssertionError("the signal did not stop the run")
  return work


@pytest.mark.parametrize("kind,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_decode_signal_leaves_no_run_directory(tmp_path, monkeypatch, kind, code):
  recall_eval = importlib.import_module("attnprec.jobs.recall_eval")
  run_dir = tmp_path / "new_dir"
  monkeypatch.setenv("SIGNAL_TEST_RUN_DIR", str(run_dir))
  monkeypatch.setattr(recall_eval, "evaluate", _signal_in(kind))
  rc, err = _call("decode", ["--gin_file=experiments/recall.gin", f"--run_dir={run_dir}"])
  assert rc == code, err
  assert err.strip().splitlines()[-1] == f"decode: interrupted by {signal.Signals(kind).name}"
  assert not run_dir.exists()                       # created by the run, removed again


def test_study_signal_keeps_older_files_removes_its_own(tmp_path, monkeypatch):
  """An existing run directory: what the interrupted run wrote is removed, the rest kept."""
  import attnprec.study.sweep
  run_dir = tmp_path / "study"
  run_dir.mkdir()
  (run_dir / runs.OWNER_FILE).write_text('{"runner": "study"}')      # an earlier study's
  (run_dir / "older.json").write_text("{}")
  monkeypatch.setenv("SIGNAL_TEST_RUN_DIR", str(run_dir))
  monkeypatch.setattr(attnprec.study.sweep.models, "load_model", _signal_in(signal.SIGTERM))
  rc, err = _call("study", ["--gin_file=experiments/study_recall.gin", f"--run_dir={run_dir}"])
  assert rc == 143, err
  assert sorted(os.listdir(run_dir)) == sorted([runs.OWNER_FILE, "older.json"])


def test_write_failure_in_decode_exit_2_and_nothing_left(tmp_path, monkeypatch):
  """A full disk when decode writes its first file (its run directory's owner record,
  `runs.OWNER_FILE`, before results.json): exit 2, one paragraph naming the file and the
  cause, no temporary file, and the new run directory removed."""
  import errno
  recall_eval = importlib.import_module("attnprec.jobs.recall_eval")
  monkeypatch.setattr(recall_eval, "evaluate", lambda params, config, task, precision,
                      pair_counts, *a: {p: (1.0, np.zeros((1, 2), np.int32))
                                        for p in pair_counts})
  real_fdopen = os.fdopen

  def full_disk(fd, *args, **kwargs):
    f = real_fdopen(fd, *args, **kwargs)
    def write(data):
      raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    f.write = write
    return f

  monkeypatch.setattr(runs.os, "fdopen", full_disk)
  run_dir = tmp_path / "dec"
  rc, err = _call("decode", ["--gin_file=experiments/recall.gin", f"--run_dir={run_dir}",
                             "--gin.recall_eval.pair_counts=(4,)"])
  assert rc == 2, err
  lines = err.strip().splitlines()
  assert len(lines) == 1 and "Traceback" not in err, err
  assert lines[0].startswith(f"decode: error: Cannot write '{run_dir}/{runs.OWNER_FILE}': No "
                             f"space left on device (ENOSPC).")
  assert not run_dir.exists()


def test_sigterm_to_a_decode_subprocess_exits_143_and_leaves_nothing(tmp_path):
  """A real SIGTERM while decode compiles and runs (JAX busy in its own threads): exit 143
  with one line (not a crash at interpreter exit), and no run directory left."""
  run_dir = tmp_path / "decode"
  args = [os.path.join(REPO, "runners", "decode.py"), "--gin_file=experiments/recall.gin",
          f"--run_dir={run_dir}"]
  proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True, cwd=REPO, env=SUBPROCESS_ENV)
  try:
    for line in proc.stdout:                     # the evaluation starts after this line
      if line.startswith("reference precision:"):
        break
    time.sleep(1.5)   # inside the evaluation: with sys.exit this crashed (exit 139)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 143, err[-3000:]
  assert err.strip().splitlines()[-1] == "decode: interrupted by SIGTERM"
  assert not run_dir.exists()


@pytest.mark.parametrize("signum,rc", [(signal.SIGINT, 130), (signal.SIGTERM, 143),
                                       (signal.SIGHUP, 129)])
def test_a_signal_before_the_run_starts_ends_the_runner_with_its_line(signum, rc):
  """A runner's first line (`startup.begin`): a signal while it imports jax ends it at
  once with one line and 130 / 143 (Ctrl-C there was swallowed by a callback, and the
  run went on to write its results and exit 0). Imported rather than run, a runner
  leaves the process's handlers alone."""
  code = ("import os, signal, time\n"
          "from attnprec import startup\n"
          "before = signal.getsignal(signal.SIGINT)\n"
          "startup.begin('decode', 'runner_decode')\n"
          "assert signal.getsignal(signal.SIGINT) is before\n"
          "startup.begin('decode', '__main__')\n"
          f"os.kill(os.getpid(), {int(signum)})\n"
          "time.sleep(30)\n")
  proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                        cwd=REPO, timeout=60)
  assert proc.returncode == rc, proc.stderr
  assert proc.stderr == (f"decode: interrupted by {signal.Signals(signum).name} before the "
                         f"run started; nothing was written\n")


def test_a_closed_stdout_does_not_end_the_run(tmp_path):
  """`decode ... | head -1`: the reader goes away after one line. The run says so once
  on stderr and goes on to write its results (it ended in a BrokenPipeError traceback,
  exit 1, with its run directory removed); SIGHUP (a closed terminal) is handled like
  SIGTERM (`signals.SIGNALS`)."""
  from attnprec import signals
  assert signal.SIGHUP in signals.SIGNALS
  run_dir = tmp_path / "decode"
  proc = subprocess.Popen([sys.executable, os.path.join(REPO, "runners", "decode.py"),
                           "--gin_file=experiments/recall.gin", f"--run_dir={run_dir}",
                           "--gin.recall_eval.pair_counts=(4,)",
                           "--gin.recall_eval.num_prompts=2"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          cwd=REPO, env=SUBPROCESS_ENV)
  try:
    proc.stdout.readline()
    proc.stdout.close()                          # `| head -1`
    err = proc.stderr.read()
    proc.wait(timeout=120)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 0, err[-3000:]
  assert "decode: note: standard output failed (Broken pipe)" in err and "Traceback" not in err
  assert (run_dir / "results.json").exists()
