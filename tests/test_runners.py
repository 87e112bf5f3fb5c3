"""The runners end to end, as a user calls them: outputs on success, exit 2 and one clear
paragraph (no traceback) on bad input, nothing half-written.

Each bad input is given to the runner's `main(argv)` in this process (what its
`__main__` passes to `cli.exit`: the process's exit code); one bad input per runner
also goes through a real process (`test_bad_input_exits_2_from_the_command_line`), so
the path from `main`'s code to the process's exit code is tested too."""
import json
import os
import subprocess
import sys

import pytest

from test_train_utils import SUBPROCESS_ENV   # also turns on the tests' compilation cache
from test_train_utils import TINY as TRAIN_TINY
from test_train_utils import runner_main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The training tests' tiny setup (test_train_utils.TINY) and 4 steps, as --gin.X=V flags:
# the programs the in-process trainings of 4 steps compile (the compilation cache).
TINY = [f"--gin.{b.replace(' = ', '=')}" for b in TRAIN_TINY + ["train.steps = 4"]]


def run(script, *args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "runners", script), *args],
                        capture_output=True, text=True, cwd=ROOT, timeout=600,
                        env={**SUBPROCESS_ENV, "XLA_FLAGS": "--xla_allow_excess_precision=false"})


run_main = runner_main         # (exit code, stderr) of a runner's main(args), in-process


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
  run_dir = str(tmp_path_factory.mktemp("train"))
  proc = run("train.py", "--gin_file=experiments/recall.gin", f"--run_dir={run_dir}", *TINY)
  assert proc.returncode == 0, proc.stderr
  return run_dir


def test_train_writes_run_directory(trained):
  for name in ("model.json", "task.json", "params.npz", "metrics.jsonl",
               "operative_config.gin"):
    assert os.path.isfile(os.path.join(trained, name)), name
  with open(os.path.join(trained, "metrics.jsonl")) as f:
    records = [json.loads(line) for line in f]
  assert records[-1]["step"] == 4 and "eval_accuracy" in records[-1]
  with open(os.path.join(trained, "operative_config.gin")) as f:
    assert "precision.dtype" in f.read()


def test_decode_reads_the_train_run_with_decode_precision(trained, tmp_path):
  proc = run("decode.py", "--gin_file=experiments/recall_bf16.gin",
             f"--gin.recall_eval.checkpoint={trained}", "--gin.recall_eval.num_prompts=4",
             "--gin.recall_eval.pair_counts=(4, 8)", "--gin.recall_eval.num_queries=2",
             "--gin.decode/precision.float32_logits=True", f"--run_dir={tmp_path}")
  assert proc.returncode == 0, proc.stderr
  with open(tmp_path / "results.json") as f:
    results = json.load(f)
  assert results["precision"]["float32_logits"] is True          # the override
  assert results["precision"]["float32_qk_product"] is False      # the experiment file
  assert results["precision"]["dtype"] == "bfloat16"
  assert [r["pairs"] for r in results["rows"]] == [4, 8]
  assert "| pairs | context tokens |" in proc.stdout


@pytest.mark.parametrize("args,needle", [
    (["--gin.train/precision.dtype=float8"],
     "Invalid train/precision.dtype = 'float8': valid values are"),
    (["--gin.nonexistent.x=1"], "No configurable matching 'nonexistent'"),
    (["--gin.precision.float32_logitz=True"], "doesn't have a parameter named"),
    (["--gin.model.num_kv_heads=3"], "num_heads=2 is not divisible by model.num_kv_heads=3"),
    (["--gin_file=experiments/missing.gin"], "Gin file 'experiments/missing.gin' not found"),
    (["--bogus"], "Unknown argument(s) ['--bogus']"),
])
def test_train_bad_input_exit_2(args, needle, tmp_path, monkeypatch):
  run_dir = tmp_path / "run"
  rc, err = run_main("train.py", "--gin_file=experiments/recall.gin", f"--run_dir={run_dir}",
                     *TINY, *args, monkeypatch=monkeypatch)
  assert rc == 2, (rc, err)
  assert needle in err
  assert "Traceback" not in err
  assert not (run_dir / "params.npz").exists()


@pytest.mark.parametrize("args,needle", [
    (["--gin.recall_eval.checkpoint=/nonexistent/run"], "is neither a shipped checkpoint"),
    (["--gin.recall_eval.pair_counts=()"], "recall_eval.pair_counts = (): must be a non-empty"),
    (["--gin.decode/precision.einsum_precision=fastest"],
     "Invalid decode/precision.einsum_precision = 'fastest': valid values are"),
])
def test_decode_bad_input_exit_2(args, needle, tmp_path, monkeypatch):
  rc, err = run_main("decode.py", "--gin_file=experiments/recall.gin", f"--run_dir={tmp_path}",
                     *args, monkeypatch=monkeypatch)
  assert rc == 2, (rc, err)
  assert needle in err
  assert "Traceback" not in err
  assert "In call to configurable" not in err   # one paragraph, no gin trailer
  assert not (tmp_path / "results.json").exists()


def test_bad_input_exits_2_from_the_command_line(tmp_path):
  """A bad input to each runner as a process: exit code 2, the paragraph on stderr, no
  traceback, nothing written (one train and one decode case of the tests above)."""
  run_dir = tmp_path / "run"
  proc = run("train.py", "--gin_file=experiments/recall.gin", f"--run_dir={run_dir}", *TINY,
             "--gin.model.num_kv_heads=3")
  assert proc.returncode == 2, (proc.returncode, proc.stderr)
  assert "num_heads=2 is not divisible by model.num_kv_heads=3" in proc.stderr
  assert "Traceback" not in proc.stderr
  assert not (run_dir / "params.npz").exists()
  proc = run("decode.py", "--gin_file=experiments/recall.gin", f"--run_dir={tmp_path / 'dec'}",
             "--gin.decode/precision.einsum_precision=fastest")
  assert proc.returncode == 2, (proc.returncode, proc.stderr)
  assert "Invalid decode/precision.einsum_precision = 'fastest': valid values are" in proc.stderr
  assert "Traceback" not in proc.stderr and "In call to configurable" not in proc.stderr
  assert not (tmp_path / "dec" / "results.json").exists()
