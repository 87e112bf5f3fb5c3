"""Train run directories as checkpoints: what `make train` writes (model.json + params.npz,
and for the recall task its task.json), and the shipped recall checkpoint `recall-tiny`.

    config, params, task = load_run("recall-tiny")       # or a run directory

`task` is the run's `RecallTask` (from task.json) for a recall run, None for another run
(a text run describes its data in text_task.json, which is not a task to evaluate).
"""
import dataclasses
import json
import os
from typing import Optional, Tuple

import numpy as np

from attnprec import checks, readback, runs
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.tasks import recall

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
SHIPPED = {"recall-tiny": os.path.join(ASSETS, "recall-tiny")}
TASK_FILE = "task.json"


# What `make train` writes into a run directory (model.json and params.npz come last).
_RUN_FILES = (runs.MODEL_FILE, runs.PARAMS_FILE, "operative_config.gin", "metrics.jsonl",
              "checkpoints")


def is_run_dir(path) -> bool:
  """Whether `path` is a train run directory (finished or not: an unfinished one then
  fails to load with an error that says what is missing)."""
  path = str(path)
  return os.path.isdir(path) and any(
      os.path.exists(os.path.join(path, f)) for f in _RUN_FILES)


def run_dir(name_or_path) -> str:
  """A shipped recall checkpoint name or a run directory -> the directory."""
  key = str(name_or_path)
  return SHIPPED.get(key, key)


# RecallTask fields added after runs were written without them, with the value those runs
# had (the shipped recall-tiny predates shared_vocab).
ADDED_LATER = {"shared_vocab": False}


def load_task(directory: str) -> Optional[recall.RecallTask]:
  """The RecallTask a run trained on (its task.json), or None without one. The file must
  hold every field and no other: a missing field would silently take a default and
  evaluate a different task."""
  path = os.path.join(directory, TASK_FILE)
  if not os.path.lexists(path):
    return None
  problem = checks.regular_file(path)      # a FIFO would block; a directory is no task
  if problem:
    raise UserError(f"{path} (the recall task the run trained on) {problem}. Restore the "
                    f"run directory's task.json.")
  fields = sorted(f.name for f in dataclasses.fields(recall.RecallTask))
  try:
    with open(path) as f:
      raw = json.load(f, object_pairs_hook=readback.unique_keys)
  except (OSError, ValueError) as e:
    raise UserError(f"Cannot read the recall task of {directory!r} from {path}: {e}. It "
                    f"should be a JSON object with the fields {fields}.") from None
  if not isinstance(raw, dict):
    raise UserError(f"{path!r} holds a JSON {type(raw).__name__}, not an object with the "
                    f"recall task's fields {fields}.")
  missing = sorted(set(fields) - set(raw) - set(ADDED_LATER))
  unknown = sorted(set(raw) - set(fields))
  if missing or unknown:
    raise UserError(f"{path!r} does not describe a recall task: missing field(s) {missing}, "
                    f"unknown field(s) {unknown}; a task.json written by `make train` has "
                    f"exactly {fields}.")
  try:
    return recall.RecallTask(**{**ADDED_LATER, **raw})
  except UserError as e:     # a field's value out of its rule (a NaN, a negative count)
    raise UserError(f"{path}: the recall task the run trained on holds a value that is "
                    f"not a recall task's: {e} The file was edited or written by other "
                    f"code; restore it, or train the run again.") from None


def load_run(name_or_path, *, dtype=np.float32
             ) -> Tuple[ModelConfig, dict, Optional[recall.RecallTask]]:
  """(config, params {module: {name: np.ndarray}} in `dtype`, task or None)."""
  directory = run_dir(name_or_path)
  for name in (runs.MODEL_FILE, runs.PARAMS_FILE):
    path = os.path.join(directory, name)
    if os.path.isfile(path) and os.path.getsize(path) == 0:
      raise UserError(f"{path} is empty (0 bytes): the run that wrote it was interrupted, "
                      f"or the copy is incomplete. Retrain, or copy the run directory again.")
  try:
    config, params = runs.load_checkpoint(directory)
  except (EOFError, OSError) as e:
    raise UserError(f"Cannot read the train run {directory}: {e} (a truncated or corrupt "
                    f"{runs.PARAMS_FILE}?).") from None
  # A train run saves float32 params (`runs.save_params`): a tensor of another dtype was
  # edited or replaced, and casting it would run the model on other weights.
  for m, d in params.items():
    for n, a in d.items():
      if np.asarray(a).dtype != np.float32:
        raise UserError(f"{os.path.join(directory, runs.PARAMS_FILE)}: tensor {m}/{n} is "
                        f"{np.asarray(a).dtype}, not the float32 a train run saves; the file "
                        f"was edited or replaced. Retrain, or restore the run directory.")
  params = {m: {n: np.asarray(a, dtype) for n, a in d.items()} for m, d in params.items()}
  task = load_task(directory)
  if task is not None and task.vocab_size != config.vocab_size:
    raise UserError(f"{os.path.join(directory, TASK_FILE)} describes a recall task of "
                    f"{task.vocab_size} tokens (2 + num_keys + value_vocab), but the model "
                    f"in {runs.MODEL_FILE} has {config.vocab_size}: a recall run trains its "
                    f"model on its task's vocabulary, so one of the files was edited. "
                    f"Restore the run directory, or train it again.")
  _check_against_checkpoint(directory, config, task)
  return config, params, task


def _check_against_checkpoint(directory: str, config: ModelConfig, task) -> None:
  """model.json and task.json must describe what the run's last checkpoint records it
  trained (`meta['model']`, `meta['task']`): an edited file (an activation, a pair count)
  would run or evaluate the weights as something they were not trained as."""
  root = os.path.join(directory, "checkpoints")
  try:
    steps = sorted((int(n) for n in os.listdir(root) if n.isdigit()), reverse=True)
  except OSError:
    return
  for step in steps:
    path = os.path.join(root, str(step), "meta", "metadata")
    try:
      with open(path, encoding="utf-8") as f:
        meta = json.load(f, object_pairs_hook=readback.unique_keys)
    except (OSError, ValueError):
      continue                      # an unreadable checkpoint: the next older one
    if not isinstance(meta, dict):
      continue
    from attnprec.train import describe_task   # train imports the checkpoint machinery
    pairs = [(runs.MODEL_FILE, meta.get("model"), runs.config_dict(config))]
    if task is not None:
      pairs.append((TASK_FILE, meta.get("task"), describe_task(task)))
    for name, recorded, now in pairs:
      # as JSON (tuples are lists there); fields added to the code since the run was
      # trained are not in its record, and hold their defaults
      now = json.loads(json.dumps(now))
      changed = sorted(k for k in (recorded if isinstance(recorded, dict) else {})
                       if recorded[k] != now.get(k))
      if changed:
        listed = ", ".join(f"{k} ({recorded.get(k)!r} -> {now.get(k)!r})" for k in changed)
        raise UserError(f"{os.path.join(directory, name)} does not describe what the run's "
                        f"checkpoint at step {step} records it trained: {listed}. The file "
                        f"was edited; restore it (the checkpoint's record is "
                        f"{os.path.join(root, str(step), 'meta', 'metadata')}).")
    return
