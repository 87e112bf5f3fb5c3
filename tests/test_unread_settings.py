"""Settings a job would not read, and values it could not honour, are refused before it
runs (one paragraph naming the setting and what is read instead)."""
import os

import pytest

from attnprec.errors import UserError


def test_the_study_refuses_lengths_the_model_would_not_read(tmp_path):
  from attnprec.study.sweep import study
  with pytest.raises(UserError, match=r"study.context_lengths = \(64,\) is read only for "
                                      r"real models.*reads study.pair_counts instead"):
    study(run_dir=str(tmp_path / "s"), model="recall-tiny", presets=("bf16",),
          context_lengths=(64,), progress=False)


def test_the_study_refuses_settings_only_other_studies_read(tmp_path):
  """greedy_steps is read for real models' passkey prompts only; float64_batch only when
  some context is short enough for the float64 pass. Refused before anything runs."""
  from attnprec.study.sweep import study
  base = dict(model="recall-tiny", presets=("bf16",), pair_counts=(2,), progress=False,
              logit_positions=8)
  with pytest.raises(UserError, match=r"study.greedy_steps = 4 .* the recall model "
                                      r"'recall-tiny' decodes exactly"):
    study(run_dir=str(tmp_path / "a"), greedy_steps=4, **base)
  with pytest.raises(UserError, match=r"study.float64_batch = 1 .* at most "
                                      r"study.float64_max_tokens = 0 tokens; none of this "
                                      r"study's contexts \(\d+\.\.\d+ tokens\)"):
    study(run_dir=str(tmp_path / "b"), float64_max_tokens=0, float64_batch=1, **base)
  # values past the shortest sequence would be cut there while the report named them
  with pytest.raises(UserError, match=r"study.logit_positions = 100000 exceeds what the "
                                      r"shortest sequence of this study holds \((\d+) "
                                      r"tokens: at most \1\)"):
    study(run_dir=str(tmp_path / "c"), **{**base, "logit_positions": 100000})
  with pytest.raises(UserError, match=r"study.decode_steps = 1000 exceeds"):
    study(run_dir=str(tmp_path / "d"), decode_steps=1000, **base)
  assert not any(os.listdir(tmp_path / d) for d in "abcd")


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


def test_a_model_too_large_to_train_is_named_not_its_batch(tmp_path):
  """A model whose params, gradients and Adam moments alone exceed the machine is refused
  naming the model's dimensions (it was 'train.batch_size = 8 ... Lower it'), before it is
  built; the floor it uses is below the real parameter count (no false refusal)."""
  import jax
  import numpy as np
  from test_train_utils import train_in_process
  from attnprec import memory
  from attnprec.config import ModelConfig
  from attnprec.model import param_shapes
  with pytest.raises(UserError, match=r"the model \(model.d_model = 2000000000, "
                                      r"model.mlp_hidden = 64, .*\) needs at least "
                                      r"[\d.]+ GiB for one batch \(its float32 params"):
    train_in_process(tmp_path / "big", ["model.d_model = 2000000000"])
  assert not (tmp_path / "big").exists()
  for act in ("silu", "gelu"):
    config = ModelConfig(vocab_size=100, d_model=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, mlp_hidden=96, max_seq_len=64,
                         activation=act)
    real = sum(int(np.prod(x.shape)) for x in jax.tree.leaves(param_shapes(config)))
    # a floor (a gated MLP's third matrix, norms and biases left out), not far below
    assert 0.75 * real <= memory.weights_floor(config) <= real, (act, real)


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


def test_serving_on_a_tpu_stores_the_weights_in_the_compute_dtype_with_the_same_numbers():
  """decoding.for_serving for a TPU (or GPU): weight matrices stored in bf16, the values
  each projection casts them to at its use, so the logits are those of the float32
  weights cast at every use: the same products, float32 sums that may differ in order
  (here, on XLA:CPU, by at most a few float32 ulps); the precision line says so."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from attnprec import decoding
  from attnprec.config import ModelConfig
  from attnprec.model import init_params
  from attnprec.precision import Precision
  config = ModelConfig(vocab_size=50, d_model=32, num_layers=2, num_heads=2,
                       num_kv_heads=1, head_dim=16, mlp_hidden=64, max_seq_len=64)
  params = init_params(config, jax.random.PRNGKey(0))
  prec = Precision(dtype="bfloat16")
  stored, serving = decoding.for_serving(params, prec, backend="tpu")
  assert serving.stored_weights and not serving.carrier_weights
  assert "weights=bfloat16-stored" in serving.describe("tpu")
  assert stored["decoder/layer_0/attn/q"]["w"].dtype == jnp.bfloat16
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 50, (2, 12)), jnp.int32)
  lengths = jnp.asarray([12, 9], jnp.int32)
  run = lambda p, pr: decoding.prefill(p, tokens, lengths, config=config,  # noqa: E731
                                       precision=pr, cache_length=16)
  plain = dataclasses_replace(serving, stored_weights=False)
  a, b = run(stored, serving), run(params, plain)
  np.testing.assert_allclose(np.asarray(a.last_BxV), np.asarray(b.last_BxV),
                             rtol=2.0 ** -20, atol=2.0 ** -22)
  # float32 compute and XLA:CPU keep their forms
  assert not decoding.serving_precision(Precision(), "tpu").stored_weights
  assert decoding.serving_precision(prec, "cpu").carrier_weights


def dataclasses_replace(obj, **kw):
  import dataclasses
  return dataclasses.replace(obj, **kw)


def _bound(text):
  import gin
  gin.clear_config()
  gin.parse_config(text)


def test_bindings_a_job_sets_itself_or_would_not_read_are_refused(tmp_path):
  """optimizer.total_steps (the train loop sets it to train.steps), distributed.* without
  a coordinator, model.* beside audit.model, nextline's timing settings without timing:
  each a UserError naming the binding, before the job runs."""
  import gin
  from attnprec import audit, checks, sharding, train  # noqa: F401 -- registers them
  from attnprec.study import nextline
  try:
    _bound("optimizer.total_steps = 10")
    assert checks.bound_args("optimizer") == {"total_steps": 10}
    with pytest.raises(UserError, match="optimizer.total_steps = 10 is set.*train.steps"):
      train.train(config=None, precision=None, task=None, run_dir=str(tmp_path / "t"),
                  steps=4)
    with pytest.raises(UserError, match="distributed.num_processes = 2.*coordinator_address "
                                        "is not"):
      sharding.initialize_distributed(num_processes=2)
    _bound("model.num_layers = 3")
    with pytest.raises(UserError, match=r"audit.model = 'recall-tiny'.*\(model.num_layers\) "
                                        r"would be ignored"):
      audit.model_config_for("recall-tiny")
    _bound("nextline.timing_rounds = 5")
    with pytest.raises(UserError, match="nextline.time_decode = False, so "
                                        "nextline.timing_rounds"):
      nextline.nextline(run_dir=str(tmp_path / "n"), time_decode=False, timing_rounds=5)
  finally:
    gin.clear_config()
  assert not (tmp_path / "n").exists()


def test_audit_model_refuses_only_the_model_bindings_the_user_gave():
  """The audit runner's default file includes a model's model.* bindings: audit.model
  overrides those without a word; model.* given by the user beside it are refused."""
  from attnprec import audit, ginutils
  ginutils.parse(["runs/audit.gin"], ["audit.model = 'recall-tiny'"], defaults=1)
  config, description = audit.model_config_for("recall-tiny")
  assert config.num_layers >= 1 and "recall" in description
  ginutils.parse(["runs/audit.gin"], ["audit.model = 'recall-tiny'",
                                      "model.num_layers = 3"], defaults=1)
  with pytest.raises(UserError, match=r"\(model.num_layers\) would be ignored"):
    audit.model_config_for("recall-tiny")
  ginutils.parse(["runs/audit.gin", "experiments/audit_smollm2.gin"], [], defaults=1)
  from attnprec import checks
  assert checks.bound_args("model", by_user=True) == {}
  assert checks.bound_args("model")                  # bound, by the runner's default file


def test_two_sweep_presets_of_one_name_are_refused(tmp_path):
  from attnprec import presets
  alt = tmp_path / "bf16.gin"
  alt.write_text("precision.dtype = 'float32'\nprecision.einsum_precision = 'highest'\n")
  with pytest.raises(UserError, match="Two configurations of the sweep are named 'bf16'"):
    presets.load_sweep(("bf16",), (str(alt),))
  with pytest.raises(UserError, match="names the configuration 'bf16' twice"):
    presets.load_sweep(("bf16", "bf16"))      # the same one twice: one would not be read


def test_an_unknown_job_reference_names_the_valid_jobs():
  """`decode.job = @bogus`: the runner's jobs, not every configurable."""
  import attnprec.evals.jobs  # noqa: F401 -- declares eval.job's jobs
  import attnprec.jobs  # noqa: F401 -- declares decode.job's and train_job.job's
  from attnprec import ginutils
  error = ValueError("No configurable matching reference '@bogus'.\n In bindings string "
                     "line 1\n decode.job = @bogus")
  text = ginutils._clean_gin_error(error)
  assert "Valid jobs for decode.job: @recall_eval, @generate_text." in text
  assert "Known configurables" not in text
  other = ginutils._clean_gin_error(ValueError("No configurable matching 'bogus'"))
  assert "Known configurables" in other


def test_a_path_that_cannot_be_followed_says_why(tmp_path):
  """A symbolic-link loop or a dangling link is named as such, not as missing."""
  from attnprec import checkpoints, paths
  (tmp_path / "a").symlink_to(tmp_path / "b")
  (tmp_path / "b").symlink_to(tmp_path / "a")
  (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
  assert paths.unreachable(tmp_path / "a" / "model.json") == \
      "cannot be followed: its symbolic links loop"
  assert paths.unreachable(tmp_path / "nope") == "does not exist"
  with pytest.raises(UserError, match="cannot be followed: its symbolic links loop"):
    checkpoints.load(str(tmp_path / "a"))
  with pytest.raises(UserError, match=r"is a symbolic link to '.*nowhere', which does not"):
    checkpoints.load(str(tmp_path / "dangling"))
  from attnprec import ginutils
  with pytest.raises(UserError, match="Gin file .* cannot be followed"):
    ginutils.parse([str(tmp_path / "a")], [])


def test_environment_settings_that_change_numbers_unnamed_are_refused():
  """A flag file as XLA_FLAGS, JAX_DEFAULT_MATMUL_PRECISION and JAX_ENABLE_X64 would change
  numbers the precision line does not name: refused before anything runs (x64 allowed for
  `inspect`, which lowers a user's f64 function). A bare boolean flag reads as true."""
  from attnprec import xla_env
  base = {"XLA_FLAGS": xla_env.FLAG}
  with pytest.raises(UserError, match=r"names a flag file \('/tmp/flags'\)"):
    xla_env.check_environment({"XLA_FLAGS": "/tmp/flags " + xla_env.FLAG})
  with pytest.raises(UserError, match="JAX_DEFAULT_MATMUL_PRECISION='highest' is set"):
    xla_env.check_environment({**base, "JAX_DEFAULT_MATMUL_PRECISION": "highest"})
  with pytest.raises(UserError, match="JAX_ENABLE_X64='1' is set"):
    xla_env.check_environment({**base, "JAX_ENABLE_X64": "1"}, prog="decode")
  xla_env.check_environment({**base, "JAX_ENABLE_X64": "1"}, prog="inspect")
  xla_env.check_environment({**base, "JAX_ENABLE_X64": "0"}, prog="decode")
  with pytest.raises(UserError, match="JAX_DEFAULT_PRNG_IMPL='rbg' is set: it replaces the "
                                      "random number generator behind every seed"):
    xla_env.check_environment({**base, "JAX_DEFAULT_PRNG_IMPL": "rbg"}, prog="train")
  assert "(--xla_allow_excess_precision=true)" in xla_env.describe(
      "--xla_allow_excess_precision")


def test_the_python_api_refuses_a_default_matmul_precision_and_names_excess_precision(
    monkeypatch):
  """What the runners refuse from the environment, the model refuses (or names) when it
  is traced from Python: jax's default matmul precision however it was set (here the
  context manager), and excess precision left on for a bf16 model on XLA:CPU (a warning,
  once per process; float32 models are not affected)."""
  import warnings
  import jax
  import jax.numpy as jnp
  from attnprec import xla_env
  from attnprec.config import ModelConfig
  from attnprec.model import init_params, transformed
  from attnprec.precision import Precision
  config = ModelConfig(vocab_size=16, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=8, mlp_hidden=32, max_seq_len=16)
  params = jax.eval_shape(lambda: init_params(config, jax.random.PRNGKey(0)))

  def trace(dtype):
    return jax.eval_shape(lambda p: transformed(config).apply(
        p, jnp.zeros((1, 4), jnp.int32), precision=Precision(dtype=dtype)), params)

  with jax.default_matmul_precision("bfloat16"):
    with pytest.raises(UserError, match="jax's default matmul precision is set to "
                                        "'bfloat16'"):
      trace("float32")
  monkeypatch.setattr(xla_env, "_WARNED", [])
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    trace("bfloat16")                          # this process runs with FLAG: no warning
    monkeypatch.setattr(xla_env, "_FLAGS_AT_IMPORT", "")   # as if jax started first
    trace("float32")
    trace("bfloat16")
    trace("bfloat16")                          # once per process
  notes = [str(w.message) for w in caught if "excess precision" in str(w.message)]
  assert len(notes) == 1 and notes[0].startswith(
      "XLA:CPU excess precision is on in this process (JAX started its backend before "
      "attnprec was imported)"), notes
  assert xla_env.excess_precision_allowed("--xla_allow_excess_precision")
  assert not xla_env.excess_precision_allowed(xla_env.FLAG)


def test_a_platform_without_a_backend_is_bad_input(tmp_path):
  """JAX_PLATFORMS=cuda without a CUDA plugin: jax asserts with no message; exit 2."""
  import subprocess
  import sys
  from test_train_utils import REPO, SUBPROCESS_ENV
  done = subprocess.run(
      [sys.executable, "runners/decode.py", "--gin_file=experiments/recall.gin",
       "--gin.recall_eval.num_prompts=2", "--gin.recall_eval.pair_counts=(8,)",
       f"--run_dir={tmp_path / 'new' / 'run'}"], cwd=REPO, capture_output=True, text=True,
      env={**SUBPROCESS_ENV, "JAX_PLATFORMS": "cuda"}, timeout=120)
  assert done.returncode == 2, done.stderr[-2000:]
  assert "JAX_PLATFORMS='cuda' names (no backend of that name" in done.stderr
  assert "Traceback" not in done.stderr
  assert not (tmp_path / "new").exists()          # nothing left, not even the parent


def test_a_setting_scoped_to_a_phase_that_never_reads_it_is_refused():
  """The train step keeps no KV cache and runs no decode step: train/precision.kv_cache_*
  and train/blockwise.decode_kv_block are refused for every runner (the audit passed
  them, recorded in its report); unscoped, a kv preset's cache applies to decode."""
  from attnprec import ginutils
  with pytest.raises(UserError, match=r"train/precision.kv_cache_k_dtype is set, but the "
                                      r"train phase never reads it"):
    ginutils.parse(["runs/audit.gin"], ["train/precision.dtype = 'bfloat16'",
                                        "train/precision.kv_cache_k_dtype = 'int8'"])
  ginutils.clear()
  with pytest.raises(UserError, match=r"train/blockwise.decode_kv_block is set"):
    ginutils.parse(["runs/train.gin", "experiments/recall.gin"],
                   ["train/precision.kernel = 'blockwise'",
                    "train/blockwise.decode_kv_block = 64"])
  ginutils.clear()
  ginutils.parse(["runs/audit.gin", "precision/kv_int8.gin"], [])       # decode's cache


def test_a_precision_is_recorded_in_one_spelling_and_the_api_refuses_what_it_would_not_use():
  import jax
  import jax.numpy as jnp
  from attnprec import checkpoints
  from attnprec.precision import Precision
  assert Precision(dtype="BFLOAT16") == Precision(dtype=jnp.bfloat16) == \
      Precision(dtype="bfloat16")
  p = Precision(dtype="bfloat16", matmul_precision=jax.lax.Precision.HIGHEST,
                einsum_precision="HiGhEsT")
  assert (p.matmul_precision, p.einsum_precision) == ("highest", "highest")
  assert "matmul_precision=highest" in p.describe()
  assert Precision(dtype="bfloat16", matmul_precision=jax.lax.DotAlgorithmPreset
                   .BF16_BF16_F32).matmul_precision == "BF16_BF16_F32"
  ckpt = checkpoints.load("recall-tiny")
  with pytest.raises(UserError, match="a full-sequence forward pass keeps no cache"):
    checkpoints.logits(ckpt, [[1, 2, 3]], precision=Precision(
        dtype="bfloat16", kv_cache_k_dtype="int8", kv_cache_v_dtype="int8"))
  with pytest.raises(UserError, match="carrier_weights=True is set by attnprec itself"):
    checkpoints.logits(ckpt, [[1, 2, 3]], precision=Precision(dtype="bfloat16",
                                                              carrier_weights=True))


def test_a_run_record_or_lock_that_is_not_a_regular_file_is_named(tmp_path):
  """A FIFO as the run record would block every runner forever; a directory, FIFO or
  dangling link as a training's lock ended in a traceback."""
  from attnprec import runs
  fifo_dir = tmp_path / "fifo"
  fifo_dir.mkdir()
  os.mkfifo(fifo_dir / runs.OWNER_FILE)
  with pytest.raises(UserError, match="must name a regular file, not a FIFO"):
    runs.owner(str(fifo_dir))
  for name, make in (("dir", lambda p: p.mkdir()), ("fifo", os.mkfifo),
                     ("link", lambda p: p.symlink_to(tmp_path / "nowhere"))):
    run = tmp_path / f"lock-{name}"
    run.mkdir()
    make(run / runs.LOCK_FILE)
    with pytest.raises(UserError, match=r"\.lock \(a training's lock\) is not a regular"):
      with runs.locked(str(run)):
        pass
  with runs.locked(str(tmp_path / "fine")):                  # created, held, released
    assert (tmp_path / "fine" / runs.LOCK_FILE).is_file()


def test_edited_model_or_task_files_of_a_train_run_are_refused(tmp_path):
  """A train run is read as what its checkpoint records it trained: model.json or
  task.json edited since (same shapes: an activation, a pair count) is refused, and a
  task whose vocabulary is not the model's (the shipped checkpoint has no checkpoints/)."""
  import json
  import shutil
  from attnprec import runs
  from attnprec.checkpoints import trained
  from attnprec.train import describe_task
  run = tmp_path / "run"
  shutil.copytree(trained.SHIPPED["recall-tiny"], run)
  config, _, task = trained.load_run(str(run))
  meta = run / "checkpoints" / "4" / "meta"
  meta.mkdir(parents=True)
  (meta / "metadata").write_text(json.dumps(
      {"step": 4, "model": runs.config_dict(config), "task": describe_task(task)}))
  trained.load_run(str(run))                                   # as recorded: fine
  model = json.loads((run / "model.json").read_text())
  (run / "model.json").write_text(json.dumps({**model, "activation": "gelu"}))
  with pytest.raises(UserError, match=r"model.json does not describe what the run's "
                                      r"checkpoint at step 4 records it trained: "
                                      r"activation \('silu' -> 'gelu'\)"):
    trained.load_run(str(run))
  (run / "model.json").write_text(json.dumps(model))
  task_json = json.loads((run / "task.json").read_text())
  (run / "task.json").write_text(json.dumps({**task_json, "num_pairs": 24}))
  with pytest.raises(UserError, match=r"task.json does not describe .* num_pairs"):
    trained.load_run(str(run))
  (run / "task.json").write_text(json.dumps({**task_json, "num_keys": 40}))
  with pytest.raises(UserError, match=r"a recall task of 90 tokens .* has 98"):
    trained.load_run(str(run))


def test_sinks_refuses_injection_presets_with_no_layer_to_inject():
  from attnprec.study import sinks
  with pytest.raises(UserError, match=r"sinks.inject_presets = \('bf16',\) is set but "
                                      r"sinks.inject_layers is empty"):
    sinks.sinks_job(run_dir="/nonexistent-never-written", model="smollm2-135m",
                    inject_presets=("bf16",), inject_layers=())


def test_attention_report_refuses_settings_a_function_does_not_state():
  """A user's function carries no attnprec kernel, KV cache or key offset: expecting them
  gave a PASS that named them unchecked."""
  from attnprec.inspect import attention_report, examples
  from attnprec.precision import Precision
  args, kwargs = examples.maxtext_inputs()
  for field, value in (("kv_cache_k_dtype", "int8"), ("key_offset", "prefill_mean"),
                       ("kernel", "blockwise")):
    expect = Precision(dtype="bfloat16", **{field: value})
    with pytest.raises(UserError, match=f"sets {field}={value!r}"):
      attention_report(examples.maxtext_attention, *args, expect=expect, **kwargs)


def test_a_binding_for_the_job_a_runner_does_not_run_is_refused():
  """`eval.job = @retrieval` with `humaneval.problems` on the command line: the job
  parameter's default (humaneval) is not called once the job is bound."""
  from attnprec import ginutils
  import attnprec.evals.jobs  # noqa: F401 -- declares eval's jobs
  with pytest.raises(UserError, match=r"humaneval.problems is set on the command line but "
                                      r"eval does not read humaneval"):
    ginutils.parse(["runs/eval.gin"], ["eval.job = @retrieval", "humaneval.problems = 3"],
                   reads=("eval",), prog="eval", defaults=1)
  ginutils.clear()
  ginutils.parse(["runs/eval.gin"], ["humaneval.problems = 3"], reads=("eval",),
                 prog="eval", defaults=1)                      # the default job reads it


def test_a_missing_home_or_a_zero_padded_checkpoint_is_named(tmp_path, monkeypatch):
  """HOME=/nonexistent (a daemon user's) made the cache create it at the root; a step
  directory `04` was skipped by every restore, and its steps trained again."""
  from attnprec import checkpointing, diskcache
  monkeypatch.delenv(diskcache.ENV_VAR, raising=False)
  monkeypatch.setenv("HOME", str(tmp_path / "nonexistent" / "x"))
  with pytest.raises(UserError, match=r"home directory .*nonexistent/x' \(HOME\) does not "
                                      r"exist"):
    diskcache.cache_dir("jax-compilation")
  assert not (tmp_path / "nonexistent").exists()
  (tmp_path / "run" / "checkpoints" / "04").mkdir(parents=True)
  with pytest.raises(UserError, match=r"checkpoints/04 is named like the checkpoint of "
                                      r"step 4, but .*\(no leading zeros\)"):
    checkpointing.Checkpointer(str(tmp_path / "run"), keep=2)


def test_a_float64_batch_larger_than_the_batch_is_refused(tmp_path):
  """The float64 pass runs on the first sequences of the batch: float64_batch = 7 with a
  batch of 4 was cut to 4 while the settings recorded 7."""
  from attnprec.study.sweep import study
  with pytest.raises(UserError, match=r"study.float64_batch = 7 exceeds study.batch = 4"):
    study(run_dir=str(tmp_path / "s"), model="recall-tiny", presets=("bf16",),
          pair_counts=(2,), batch=4, float64_batch=7, logit_positions=8, progress=False)
  assert not os.listdir(tmp_path / "s")


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_an_output_directory_where_nothing_can_be_created_says_so():
  """/proc exists but takes no new directory: the error says nothing can be created
  there (it said "'/proc': No such file or directory")."""
  from attnprec import runs
  with pytest.raises(UserError, match=r"--run_dir='/proc/attnprec_x' is not writable: "
                                      r"nothing can be created in '/proc'"):
    runs.check_output_dir("/proc/attnprec_x")
