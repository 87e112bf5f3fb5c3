"""Checkpoints: exact resume after real SIGKILLs (one inside a save), atomic saves, the last
K kept, unreadable checkpoints set aside, and changed architectures refused.

Reference for "exact": the same number of steps trained straight through, compared bit for
bit (params.npz bytes and every logged loss). The straight runs (4 and 8 steps) are trained
once per module (fixtures); a test that changes a run works on its own copy.
"""
import errno
import json
import os
import shutil
import time
from unittest import mock

import gin
import jax
import jax.numpy as jnp
import pytest

from attnprec import checkpointing, runs
from attnprec.errors import UserError
from test_train_utils import (TINY, assert_bitwise_equal, checkpoint_listing, load_npz,
                              load_runner, run_and_kill, run_train, train_in_process)


TRAIN_RUNNER = load_runner("train.py")

STEPS4 = ["train.steps = 4", "train.checkpoint_every = 2"]
STEPS8 = ["train.steps = 8", "train.checkpoint_every = 2", "train.keep_checkpoints = 2"]


def _trained(tmp_path_factory, name, bindings):
  run = tmp_path_factory.mktemp(name) / "run"
  train_in_process(run, bindings)
  gin.clear_config()
  return run


@pytest.fixture(scope="module")
def finished4(tmp_path_factory):
  """A finished STEPS4 run (checkpoints 2 and 4, params.npz); copy it before changing it."""
  return _trained(tmp_path_factory, "finished4", STEPS4)


@pytest.fixture(scope="module")
def straight8(tmp_path_factory):
  """A STEPS8 run trained straight through, never interrupted (read only)."""
  return _trained(tmp_path_factory, "straight8", STEPS8)


def _copy(run, tmp_path):
  shutil.copytree(run, tmp_path / "run")
  return tmp_path / "run"


def _losses(run_dir):
  with open(os.path.join(run_dir, "metrics.jsonl")) as f:
    return [(r["step"], r["loss"]) for r in map(json.loads, f)]


def test_resume_after_sigkill_and_killed_save_is_bit_identical(tmp_path, straight8):
  straight, resumed = straight8, tmp_path / "resumed"         # the same program, unkilled
  marker = str(tmp_path / "marker")
  assert checkpoint_listing(straight) == ["6", "8"]          # keep_checkpoints = 2

  # 1) SIGKILL after step 5: the newest checkpoint is step 4.
  said = run_and_kill(resumed, STEPS8 + ["fault_injection.pause_after_step = 5"], marker)
  assert said.startswith("after step 5")
  assert checkpoint_listing(resumed) == ["2", "4"]
  # 2) resume from 4, SIGKILL inside the save of step 6 (its files partly written).
  said = run_and_kill(resumed, STEPS8 + ["fault_injection.pause_in_save_at_step = 6"], marker)
  assert said.startswith("in checkpoint save")
  listing = checkpoint_listing(resumed)
  assert "6" not in listing and any(n.startswith("6.orbax-checkpoint-tmp") for n in listing)
  ckpt = checkpointing.Checkpointer(str(resumed), keep=2)
  assert ckpt.latest_step() == 4
  ckpt.close()
  # 3) resume from 4 again (the half-written step 6 is ignored) and finish.
  done = run_train(resumed, STEPS8)
  assert done.returncode == 0, done.stderr[-3000:]
  assert "resuming from checkpoint step 4" in done.stdout

  assert_bitwise_equal(load_npz(straight / "params.npz"), load_npz(resumed / "params.npz"))
  assert _losses(resumed) == _losses(straight)                # each step once, same loss
  assert [s for s, _ in _losses(resumed)] == list(range(1, 9))
  assert checkpoint_listing(resumed) == ["6", "8"]
  for name in ("model.json", "task.json"):
    assert (resumed / name).read_text() == (straight / name).read_text()


def _corrupt(step_dir):
  with open(os.path.join(step_dir, "state", "manifest.ocdbt"), "wb") as f:
    f.write(b"not a manifest")


def test_unreadable_checkpoint_falls_back_to_previous(tmp_path, capsys, finished4):
  """Corrupt the newest checkpoint of a finished 4-step run, train again: it resumes from
  step 2 and ends bit-identical to the uninterrupted run."""
  run = _copy(finished4, tmp_path)
  straight = load_npz(run / "params.npz")
  os.remove(run / "params.npz")
  _corrupt(run / "checkpoints" / "4")
  capsys.readouterr()
  train_in_process(run, STEPS4)
  out = capsys.readouterr().out
  assert "checkpoint at step 4 is unreadable" in out and "step 2" in out
  assert "resuming from checkpoint step 2" in out
  assert sorted(checkpoint_listing(run)) == ["2", "4", "4.unreadable"]  # kept, not deleted
  assert_bitwise_equal(straight, load_npz(run / "params.npz"))


def _flip_a_data_byte(step_dir):
  """One byte flipped in the middle of the largest data file: same size, other bytes
  (a damaged disk), which orbax reads without a word."""
  files = [os.path.join(d, f) for d, _, fs in os.walk(os.path.join(step_dir, "state"))
           for f in fs if os.sep + "d" + os.sep in os.path.join(d, f)]
  largest = max(files, key=os.path.getsize)
  with open(largest, "r+b") as f:
    f.seek(os.path.getsize(largest) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0x10]))


def test_no_readable_checkpoint_is_a_user_error(tmp_path, finished4):
  """Step 2 without its state, step 4 with a flipped byte in its arrays (caught by the
  fingerprint its meta records): no readable checkpoint, named per step."""
  run = _copy(finished4, tmp_path)
  shutil.rmtree(run / "checkpoints" / "2" / "state")
  _flip_a_data_byte(run / "checkpoints" / "4")
  before = checkpoint_listing(run)
  with pytest.raises(UserError, match=r"No readable checkpoint.*step 4: .*fingerprint.*"
                                      r"step 2"):
    train_in_process(run, STEPS4)
  assert checkpoint_listing(run) == before                       # nothing moved or lost


def test_changed_architecture_names_the_leaves(tmp_path, finished4):
  run = _copy(finished4, tmp_path)
  model_json = (run / "model.json").read_text()
  with pytest.raises(UserError, match=r"step 4.*params/decoder/layer_0/mlp/down/w: checkpoint "
                                      r"\(64, 32\) float32, now \(96, 32\) float32"):
    train_in_process(run, STEPS4 + ["model.mlp_hidden = 96"])
  assert (run / "model.json").read_text() == model_json          # nothing overwritten
  assert checkpoint_listing(run) == ["2", "4"]


def test_changed_param_dtype_names_the_leaves(tmp_path, finished4):
  """A checkpoint whose params are bfloat16 (written directly) is refused by name."""
  run = _copy(finished4, tmp_path)
  ckpt = checkpointing.Checkpointer(str(run), keep=3)
  state = _restore_raw(run)
  state["params"] = jax.tree.map(lambda x: x.astype(jnp.bfloat16), state["params"])
  ckpt.save(state, {"step": 5, "data_position": 5})
  ckpt.close()
  with pytest.raises(UserError, match=r"step 5.*params/decoder/embed/embeddings: checkpoint "
                                      r"\(18, 32\) bfloat16, now \(18, 32\) float32"):
    train_in_process(run, ["train.steps = 8"])


def _restore_raw(run) -> dict:
  import orbax.checkpoint as ocp
  with ocp.CheckpointManager(os.path.join(run, "checkpoints")) as m:
    return dict(m.restore(m.latest_step(), args=ocp.args.Composite(
        state=ocp.args.StandardRestore())).state)


def test_unwritable_run_dir_is_a_user_error(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  with pytest.raises(UserError, match="run directory"):
    train_in_process(blocker / "run", ["train.steps = 1"])
  assert blocker.read_text() == "x"


def test_finished_run_is_not_retrained(tmp_path, capsys, finished4):
  run = _copy(finished4, tmp_path)
  params = load_npz(run / "params.npz")
  capsys.readouterr()
  train_in_process(run, STEPS4)
  assert "already trained to step 4" in capsys.readouterr().out
  assert_bitwise_equal(params, load_npz(run / "params.npz"))


# ------------------------------------------------------------------ full disk, write failures
def _enospc(*args, **kwargs):
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


_real_json_save = None


async def _enospc_at_step_6(self, item, directory):
  """JsonCheckpointHandler._save_fn failing for the meta item of step 6 only."""
  if isinstance(item, dict) and item.get("step") == 6:
    _enospc()
  return await _real_json_save(self, item, directory)


def test_full_disk_in_a_checkpoint_save_is_one_paragraph(tmp_path, capfd, straight8):
  """The meta item's write fails with ENOSPC inside orbax's writer thread while the state
  item is still being written: exit 2, one line naming the checkpoint and the cause, no
  traceback from any thread, the previous checkpoints intact, the partial one removed;
  training again (disk freed) resumes from step 4 and ends as an uninterrupted run."""
  # (checkpoints 2 and 4 are written; the save of step 6 fails)
  import orbax.checkpoint as ocp
  global _real_json_save
  _real_json_save = ocp.handlers.JsonCheckpointHandler._save_fn
  run = tmp_path / "run"
  capfd.readouterr()
  with mock.patch.object(ocp.handlers.JsonCheckpointHandler, "_save_fn", _enospc_at_step_6):
    rc = TRAIN_RUNNER.main([f"--run_dir={run}", "--gin_file=experiments/recall.gin",
                            *[f"--gin_bindings={b}" for b in TINY + STEPS8]])
  time.sleep(0.5)   # anything a writer thread would still print
  err = capfd.readouterr().err
  assert rc == 2, err
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1, err
  assert lines[0].startswith(f"train: error: Cannot write the checkpoint of step 6 to "
                             f"{run / 'checkpoints' / '6'}: No space left on device (ENOSPC).")
  assert checkpoint_listing(run) == ["2", "4"]             # no 6.orbax-checkpoint-tmp
  assert not (run / "params.npz").exists()
  gin.clear_config()
  train_in_process(run, STEPS8)
  assert "resuming from checkpoint step 4" in capfd.readouterr().out
  assert_bitwise_equal(load_npz(straight8 / "params.npz"), load_npz(run / "params.npz"))


def test_atomic_write_failure_keeps_the_old_file(tmp_path):
  path = tmp_path / "results.json"
  path.write_text("old")

  def half_then_full(f):
    f.write("new, half")
    _enospc()

  with pytest.raises(runs.WriteError, match=rf"Cannot write '{path}': No space left on device "
                                            rf"\(ENOSPC\)\. The partial file was removed"):
    runs.atomic_write(str(path), half_then_full)
  assert path.read_text() == "old"
  assert os.listdir(tmp_path) == ["results.json"]          # no temporary file left


def test_metrics_append_failure_cuts_the_half_line(tmp_path, monkeypatch):
  writer = runs.MetricsWriter(str(tmp_path))
  writer.write({"step": 1})
  before = (tmp_path / "metrics.jsonl").read_text()
  real_open = open

  class HalfFile:
    def __init__(self, f):
      self.f = f

    def write(self, text):
      self.f.write(text[:5])
      self.f.flush()
      _enospc()

    def __enter__(self):
      return self

    def __exit__(self, *exc):
      self.f.close()

  monkeypatch.setattr("builtins.open", lambda *a, **k: HalfFile(real_open(*a, **k)))
  with pytest.raises(runs.WriteError, match="metrics.jsonl': No space left on device"):
    writer.write({"step": 2})
  monkeypatch.undo()
  assert (tmp_path / "metrics.jsonl").read_text() == before


def test_unwritable_results_name_the_cause():
  e = runs.write_error("/x/y.json", OSError(errno.EROFS, os.strerror(errno.EROFS)))
  assert "Cannot write '/x/y.json': Read-only file system (EROFS)." in str(e)


def test_a_checkpoint_meta_record_edited_by_hand_is_refused():
  """What a resumed training reads of a checkpoint's meta is checked (`meta_problem`):
  the step and the data position are the checkpoint's step, target_reached a bool."""
  from attnprec.checkpointing import meta_problem
  good = {"step": 4, "data_position": 4, "seed": 0, "batch_size": 8, "steps": 6,
          "eval_accuracy": 0.5, "target_reached": False}
  assert meta_problem(good, 4) is None
  assert "not an object" in meta_problem([1, 2, 3], 4)
  assert "target_reached = 'no', not true or false" in meta_problem(
      dict(good, target_reached="no"), 4)
  assert "data_position = 'x', not the checkpoint's step 4" in meta_problem(
      dict(good, data_position="x"), 4)
  assert "data_position = -7" in meta_problem(dict(good, data_position=-7), 4)
  assert "step = 3" in meta_problem(dict(good, step=3), 4)
  assert "eval_accuracy = nan" in meta_problem(dict(good, eval_accuracy=float("nan")), 4)


def test_a_file_named_like_a_checkpoint_step_is_refused(tmp_path):
  """checkpoints/6 as a file: a restore would skip it and a save of step 6 replace it."""
  from attnprec import checkpointing
  from attnprec.errors import UserError
  d = tmp_path / "run" / "checkpoints"
  d.mkdir(parents=True)
  (d / "6").write_text("junk")
  with pytest.raises(UserError, match=r"checkpoints/6 is named like the checkpoint of step "
                                      r"6 but is not a directory"):
    checkpointing.Checkpointer(str(tmp_path / "run"), keep=2)
