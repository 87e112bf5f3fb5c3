"""The byte-level text task: splits, determinism, and a tiny resumable training run."""
import json
import os
import shutil

import numpy as np
import pytest

from attnprec.errors import UserError
from attnprec.tasks import text
from attnprec.train import batch_rng
from test_train_utils import assert_bitwise_equal, load_npz, train_in_process

TINY_TEXT = [
    "train_job.job = @train_text", "train_text.task = @text()",
    "model.vocab_size = 258", "text.seq_len = 16", "train.batch_size = 4",
    "train.eval_batch = 4",
]


@pytest.fixture
def corpus(tmp_path):
  a, b = tmp_path / "a.txt", tmp_path / "b.txt"
  a.write_bytes(b"A" * 900 + b"a" * 100)     # held-out tail of a: the 100 'a' bytes
  b.write_bytes(b"B" * 450 + b"b" * 50)
  return (str(a), str(b))


def test_split_and_windows(corpus):
  task = text.TextTask(files=corpus, seq_len=16, heldout_fraction=0.1)
  tokens, mask = task.train_batch(np.random.default_rng(0), 64)
  assert tokens.shape == (64, 16) and mask.shape == (64, 16) and mask.all()
  assert (tokens[:, 0] == text.BOS).all()
  body = tokens[:, 1:]
  assert set(np.unique(body)) <= {ord("A"), ord("B"), text.BOS}
  held, _ = task.eval_batch(np.random.default_rng(0), 64)
  assert set(np.unique(held[:, 1:])) <= {ord("a"), ord("b"), text.BOS}
  assert task.vocab_size == 258


def test_batches_depend_only_on_the_generator(corpus):
  task = text.TextTask(files=corpus, seq_len=16)
  x1, _ = task.train_batch(batch_rng(3, 7), 4)
  x2, _ = text.TextTask(files=corpus, seq_len=16).train_batch(batch_rng(3, 7), 4)
  np.testing.assert_array_equal(x1, x2)
  assert not np.array_equal(x1, task.train_batch(batch_rng(3, 8), 4)[0])


def test_default_corpus_is_stdlib_and_described():
  task = text.TextTask()
  desc = task.describe()
  assert [f["path"].rsplit("/", 1)[-1] for f in desc["files"]] == list(text.DEFAULT_MODULES)
  assert all(f["bytes"] > 1000 and len(f["sha256"]) == 64 for f in desc["files"])
  assert text.decode(text.encode("héllo")) == "héllo"


def test_bad_text_settings_are_user_errors(tmp_path, corpus):
  with pytest.raises(UserError, match="text.files.*must name a readable file"):
    text.TextTask(files=(str(tmp_path / "missing.txt"),))
  with pytest.raises(UserError, match="heldout_fraction"):
    text.TextTask(files=corpus, heldout_fraction=1.0)
  with pytest.raises(UserError, match="held-out split .* fewer than text.seq_len"):
    text.TextTask(files=corpus, seq_len=400)


def test_text_training_resumes_exactly(tmp_path, corpus):
  """Train 4 steps; drop the step-4 checkpoint (as if killed after step 3) and train again:
  it resumes at step 2 and must end bit-identical to the uninterrupted run."""
  bindings = TINY_TEXT + [f"text.files = {tuple(corpus)!r}", "train.steps = 4",
                          "train.checkpoint_every = 2", "train.eval_every = 2"]
  run = tmp_path / "run"
  train_in_process(run, bindings)
  straight = load_npz(run / "params.npz")
  shutil.rmtree(run / "checkpoints" / "4")
  os.remove(run / "params.npz")
  train_in_process(run, bindings)
  assert_bitwise_equal(straight, load_npz(run / "params.npz"))
  assert (run / "text_task.json").exists() and not (run / "task.json").exists()
  desc = json.loads((run / "text_task.json").read_text())
  assert desc["kind"] == "text_bytes" and len(desc["files"]) == 2
  records = [json.loads(line) for line in open(run / "metrics.jsonl")]
  assert [r["step"] for r in records] == [1, 2, 3, 4]
  assert np.isfinite(records[-1]["eval_loss"])
