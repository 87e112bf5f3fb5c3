"""`make train`: train the tiny decoder on associative recall under the train precision."""
import dataclasses

import gin

from attnprec import checks
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.precision import Precision
from attnprec.tasks.recall import RecallTask
from attnprec.train import train


@gin.configurable("train_recall", denylist=["config", "precision", "run_dir"])
@checks.validated("train_recall", task=checks.instance_of(RecallTask, "@recall()"))
def train_recall(*, config: ModelConfig, precision: Precision, run_dir: str,
                 task: RecallTask = gin.REQUIRED) -> dict:
  if config.vocab_size != task.vocab_size:
    raise UserError(f"model.vocab_size={config.vocab_size} does not match the recall task's "
                    f"vocabulary ({task.vocab_size} = 2 + recall.num_keys + "
                    f"recall.value_vocab); set model.vocab_size = {task.vocab_size}.")
  print(f"training {config.num_layers} layers, d={config.d_model}, on recall with "
        f"{task.num_pairs} pairs ({task.seq_len} tokens); train precision: "
        f"{precision.describe()}")
  # task.json (what the decode job reads) is written by `train` once resume checks pass.
  return train(config=config, precision=precision, task=task, run_dir=run_dir,
               files={"task.json": dataclasses.asdict(task)})
