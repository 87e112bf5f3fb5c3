"""The model a study (or an audit) runs: a recall checkpoint or a real checkpoint, loaded
through the one loader, `attnprec.checkpoints.load`.

`load_model(name)` accepts
  * 'recall-tiny' or a `make train` recall run directory (model.json + params.npz +
    task.json): kind 'recall', with its `RecallTask`;
  * a shipped real model name, an HF checkpoint directory or a .gguf file: kind 'real',
    with its tokenizer.
"""
from typing import NamedTuple, Optional

from attnprec import checkpoints
from attnprec.config import ModelConfig
from attnprec.errors import UserError


class LoadedModel(NamedTuple):
  config: ModelConfig
  params: Optional[dict]        # None when loaded for the config only
  kind: str                     # 'recall' | 'real'
  description: str
  task: object = None           # RecallTask (kind 'recall')
  tokenizer: object = None      # attnprec.checkpoints.Tokenizer (kind 'real')


def load_model(name: str, *, params: bool = True) -> LoadedModel:
  if not isinstance(name, str) or not name:
    raise UserError(f"Model name must be a non-empty string, got {name!r}; valid: "
                    f"'recall-tiny', a train run directory, "
                    f"{', '.join(repr(s) for s in checkpoints.SHIPPED)}, an HF directory "
                    f"or a .gguf file.")
  ckpt = checkpoints.load(name)
  if params and ckpt.config.scan_layers:
    raise UserError(
        f"The study reads {name!r} layer by layer (its probes record each layer's "
        f"attention, the float64 pass and the sink analysis read each layer's params), "
        f"and model.scan_layers = True runs all layers as one scanned body over stacked "
        f"params. Run the study with model.scan_layers = False (the default; the scanned "
        f"model computes the same numbers).")
  if ckpt.task is not None:
    return LoadedModel(ckpt.config, ckpt.params if params else None, "recall", ckpt.source,
                       task=ckpt.task)
  if ckpt.tokenizer is None and checkpoints.trained.is_run_dir(name):
    raise UserError(f"{name!r} is a train run without a recall task (task.json), e.g. a "
                    f"byte-level text run; the study runs a recall checkpoint or a real "
                    f"checkpoint with a tokenizer.")
  return LoadedModel(ckpt.config, ckpt.params if params else None, "real", ckpt.source,
                     tokenizer=ckpt.tokenizer)
