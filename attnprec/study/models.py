"""The model a study (or an audit) runs: a recall checkpoint or a real checkpoint.

`load_model(name)` accepts
  * 'recall-tiny' or a `make train` run directory (model.json + params.npz + task.json):
    kind 'recall', with its `RecallTask`;
  * 'smollm2-135m', 'gemma3-270m', an HF checkpoint directory or a .gguf file:
    kind 'real', with its tokenizer (`attnprec.checkpoints`).
"""
import importlib
import os
from typing import NamedTuple, Optional

from attnprec.config import ModelConfig
from attnprec.errors import UserError


class LoadedModel(NamedTuple):
  config: ModelConfig
  params: Optional[dict]        # None when loaded for the config only
  kind: str                     # 'recall' | 'real'
  description: str
  task: object = None           # RecallTask (kind 'recall')
  tokenizer: object = None      # attnprec.checkpoints.Tokenizer (kind 'real')


def _is_recall_run(path: str) -> bool:
  return os.path.isfile(os.path.join(path, "task.json"))


def load_model(name: str, *, params: bool = True) -> LoadedModel:
  from attnprec import checkpoints, runs
  # the module (attnprec.jobs re-exports its job function under the same name)
  recall_eval = importlib.import_module("attnprec.jobs.recall_eval")
  if not isinstance(name, str) or not name:
    raise UserError(f"Model name must be a non-empty string, got {name!r}; valid: "
                    f"'recall-tiny', a train run directory, "
                    f"{', '.join(repr(s) for s in checkpoints.SHIPPED)}, an HF directory "
                    f"or a .gguf file.")
  if name in recall_eval.SHIPPED or (os.path.isdir(name) and _is_recall_run(name)):
    ckpt_dir = recall_eval.resolve_checkpoint(name)
    config, p = runs.load_checkpoint(ckpt_dir)
    task = recall_eval.load_task(ckpt_dir)
    return LoadedModel(config, p if params else None, "recall",
                       f"recall checkpoint {name} ({config.num_layers} layers, "
                       f"d={config.d_model})", task=task)
  if name in checkpoints.SHIPPED or os.path.exists(name):
    ckpt = checkpoints.load(name)
    return LoadedModel(ckpt.config, ckpt.params if params else None, "real", ckpt.source,
                       tokenizer=ckpt.tokenizer)
  raise UserError(f"Unknown model {name!r}: not a shipped recall checkpoint "
                  f"({', '.join(recall_eval.SHIPPED)}), a shipped real model "
                  f"({', '.join(checkpoints.SHIPPED)}), nor an existing path (a train run "
                  f"directory, an HF checkpoint directory or a .gguf file).")
