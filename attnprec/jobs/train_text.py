"""`make train TRAIN_GIN=gin/experiments/text_bytes.gin`: a byte-level LM on local text."""
import gin

from attnprec import checks
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.precision import Precision
from attnprec.tasks.text import TextTask
from attnprec.train import describe_task, train


@gin.configurable("train_text", denylist=["config", "precision", "run_dir"])
@checks.validated("train_text", task=checks.instance_of(TextTask, "@text()"))
def train_text(*, config: ModelConfig, precision: Precision, run_dir: str,
               task: TextTask = gin.REQUIRED) -> dict:
  if config.vocab_size != task.vocab_size:
    raise UserError(f"model.vocab_size={config.vocab_size} does not match the byte "
                    f"vocabulary ({task.vocab_size} = 256 bytes + PAD + BOS); set "
                    f"model.vocab_size = {task.vocab_size}.")
  if task.seq_len - 1 > config.max_seq_len:
    raise UserError(f"text.seq_len={task.seq_len} exceeds model.max_seq_len="
                    f"{config.max_seq_len} + 1.")
  desc = describe_task(task)
  print(f"training {config.num_layers} layers, d={config.d_model}, on {len(desc['files'])} "
        f"text file(s), {sum(f['bytes'] for f in desc['files'])} bytes "
        f"({task.heldout_fraction:.0%} held out); train precision: {precision.describe()}")
  # text_task.json, not task.json: the recall decode job reads task.json as a recall task.
  return train(config=config, precision=precision, task=task, run_dir=run_dir,
               files={"text_task.json": desc})
