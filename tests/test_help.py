"""Every runner's --help is its own usage: exit 0, its purpose (its module docstring), its
options, the configurables it reads with their values after its default gin files, and
examples; nothing is written."""
import contextlib
import importlib.util
import io
import os
import re

import gin
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# runner -> a configurable parameter it reads, with the value its default gin files give
GIN_RUNNERS = {"train": "train.steps = 1500", "decode": "decode.job = (required)",
               "audit": "train/precision.dtype = ", "inspect_model": "inspect.fn = None",
               "study": "study.model = 'recall-tiny'", "nextline": "nextline.model = ",
               "sinks": "sinks.length = 256", "sizes": "sizes.humaneval_items = 164",
               "eval": "eval.job = @humaneval"}
PLAIN_RUNNERS = {"bench": "--out DIR             where results are written (default: bench)",
                 "plot": "--run_dir DIR  the train run directory to plot (default: runs/recall)",
                 "device_check": "--out DIR"}


def _load(name):
  spec = importlib.util.spec_from_file_location(f"runner_{name}_help",
                                                os.path.join(ROOT, "runners", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _help(name, *extra, cwd=None):
  module = _load(name)
  out, err = io.StringIO(), io.StringIO()
  gin.clear_config()
  with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    rc = module.main(["--help", *extra])
  gin.clear_config()
  return module, rc, out.getvalue(), err.getvalue()


def _purpose(module) -> str:
  return module.__doc__.strip().splitlines()[0]


@pytest.mark.parametrize("name", sorted(GIN_RUNNERS))
def test_gin_runner_help(name, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)                  # default run dirs are relative: none created
  module, rc, out, err = _help(name)
  assert rc == 0 and not err, err
  assert _purpose(module) in out
  for flag in ("--gin_file=PATH", "--gin.NAME=VALUE", "--gin_bindings='NAME = VALUE'",
               "--run_dir DIR", "(default: runs/"):
    assert flag in out, flag
  assert re.search(r"^configurables \w+ reads \(NAME = value after gin/runs/", out, re.M)
  assert f"\n  {GIN_RUNNERS[name]}" in out, out
  assert "fault_injection" not in out                       # test-only, not shown
  examples = out.split("\nexamples:\n", 1)[1].splitlines()
  assert examples and all(e.startswith(f"  python runners/{name}.py") for e in examples)
  assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", sorted(PLAIN_RUNNERS))
def test_runner_without_gin_help(name, tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  module, rc, out, err = _help(name)
  assert rc == 0 and not err, err
  assert _purpose(module) in out
  assert "It reads no gin files" in out
  assert PLAIN_RUNNERS[name] in out
  assert re.search(rf"^examples:\n  (python runners/{name}.py|make )", out, re.M)
  assert os.listdir(tmp_path) == []


def test_help_shows_the_values_of_given_gin_files():
  _, rc, out, _ = _help("train", "--gin_file=experiments/recall.gin", "--gin.train.steps=7")
  assert rc == 0
  assert "  model.d_model = 64\n" in out                      # from the experiment's model
  assert "  train.steps = 7\n" in out                         # the command line wins
  assert "  train_recall.task = @recall()\n" in out           # a reference as written
  assert "  train/precision.dtype = 'float32'\n" in out


def test_help_shows_a_macro_and_its_value():
  _, rc, out, _ = _help("train", "--gin_bindings=steps = 12", "--gin_bindings=train.steps = %steps")
  assert rc == 0 and "  train.steps = %steps (= 12)\n" in out


def test_help_with_a_bad_gin_file_still_shows_the_defaults():
  _, rc, out, _ = _help("train", "--gin.train.steps=0")
  assert rc == 0 and "  train.steps = 1500\n" in out


def test_help_exit_code_as_a_script():
  import subprocess
  import sys
  proc = subprocess.run([sys.executable, os.path.join(ROOT, "runners", "train.py"), "-h"],
                        capture_output=True, text=True, cwd=ROOT, timeout=120)
  assert proc.returncode == 0 and proc.stderr == "", proc.stderr
  assert proc.stdout.startswith("usage: train ") and "  train.steps = 1500\n" in proc.stdout
