"""Settings a job would not read, and values it could not honour, are refused before it
runs (one paragraph naming the setting and what is read instead)."""
import pytest

from attnprec.errors import UserError


def test_the_study_refuses_lengths_the_model_would_not_read(tmp_path):
  from attnprec.study.sweep import study
  with pytest.raises(UserError, match=r"study.context_lengths = \(64,\) is read only for "
                                      r"real models.*reads study.pair_counts instead"):
    study(run_dir=str(tmp_path / "s"), model="recall-tiny", presets=("bf16",),
          context_lengths=(64,), progress=False)


def test_inspect_refuses_64_bit_shapes_that_jax_would_lower_as_32_bit():
  import jax
  from attnprec.inspect import job
  assert not jax.config.jax_enable_x64
  with pytest.raises(UserError, match="asks for f64, but 64-bit types are off"):
    job.parse_shapes("f64[2,8]")
  assert job.parse_shapes("f32[2,8]")[0].shape == (2, 8)


def test_nextline_refuses_a_module_it_cannot_read():
  from attnprec.study import nextline

  class Tok:
    def encode(self, text, add_bos=False):
      return [len(text)]
  assert nextline.source_tokens(Tok(), ["json"])           # a pure-Python module
  with pytest.raises(UserError, match="nextline.modules names 'no_such_module_x'"):
    nextline.source_tokens(Tok(), ["json", "no_such_module_x"])
  with pytest.raises(UserError, match="names 'sys', which has no"):
    nextline.source_tokens(Tok(), ["sys"])


def test_a_text_file_must_be_a_regular_file(tmp_path):
  """A FIFO given as a text file would block the reader forever: refused by rule."""
  import os
  from attnprec import checks
  from attnprec.tasks.text import TextTask
  fifo = tmp_path / "pipe"
  os.mkfifo(fifo)
  assert checks.regular_file(str(fifo)) == "must name a regular file, not a FIFO"
  assert checks.regular_file(str(tmp_path)) == "must name a regular file, not a directory"
  with pytest.raises(UserError, match="not a FIFO"):
    TextTask(files=(str(fifo),))
  ok = tmp_path / "t.txt"
  ok.write_text("hello, world " * 40)
  assert TextTask(files=(str(ok),), seq_len=16).files == (str(ok),)


def test_a_request_too_large_for_the_machine_is_refused_with_its_estimate(tmp_path):
  from attnprec import memory
  from attnprec.jobs.recall_eval import recall_eval
  from attnprec.precision import Precision
  with pytest.raises(UserError, match=r"recall_eval.num_prompts = 100000000 .* needs at "
                                      r"least [\d.]+ GiB .* of this machine's"):
    recall_eval(precision=Precision(), run_dir=str(tmp_path / "r"), num_prompts=10 ** 8)
  from attnprec.config import ModelConfig
  config = ModelConfig(vocab_size=100, d_model=64, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=32, mlp_hidden=128, max_seq_len=512)
  small = memory.batch_bytes(config, 4, 64, 64)
  assert memory.check_fits("x", small, total=2 ** 30) is None
  with pytest.raises(UserError, match="x needs at least 1.0 GiB"):
    memory.check_fits("x", 2 ** 30, total=2 ** 30)


def test_auto_decodes_with_the_platforms_kernel_in_the_program_lowered_for_it():
  """kernel='auto' traced for a TPU (the audit's --platform=tpu on this machine): its
  decode step holds the dense kernel (no online softmax), on XLA:CPU the blockwise one."""
  from attnprec import audit
  from attnprec.config import ModelConfig
  from attnprec.precision import Precision
  config = ModelConfig(vocab_size=13, d_model=16, num_layers=1, num_heads=2,
                       num_kv_heads=1, head_dim=8, mlp_hidden=32, max_seq_len=64)
  p = Precision(dtype="bfloat16", kernel="auto")
  from attnprec.inspect import inspect_lowered
  for platform, online in (("tpu", False), ("cpu", True)):
    lowered = audit.lower_programs(config, Precision(dtype="bfloat16"), p,
                                   platform=platform)["decode"][1]
    (att,) = inspect_lowered(lowered).attentions
    assert att.online == online, platform
