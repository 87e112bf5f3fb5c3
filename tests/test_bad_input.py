"""Every runner refuses bad input the same way: exit code 2, one paragraph naming the bad
value, no traceback, no file left behind — and before any work starts.

The runners' `main(argv)` are driven in-process with generated bad bindings and values
(hypothesis). The first heavy step of each runner (loading a model, the train loop, the
benchmark) is replaced by a function raising `WorkStarted`: bad input must be refused
before it, so every example takes milliseconds; a good input reaching it proves the
harness is not vacuous. Two subprocess cases check the real exit code and stderr.
"""
import contextlib
import importlib.util
import io
import json
import os
import string
import subprocess
import sys
from unittest import mock

import gin
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attnprec import ginutils, runs
from attnprec.errors import UserError
from attnprec.kernels import CHOICES as KERNELS
from attnprec.precision import DTYPES, KV_CACHE_DTYPES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


class WorkStarted(BaseException):
  """The runner got past every check and began its real work."""


def _load_runner(name):
  spec = importlib.util.spec_from_file_location(f"runner_{name}",
                                                os.path.join(ROOT, "runners", f"{name}.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


RUNNERS = {name: _load_runner(name) for name in ("train", "decode", "audit", "study",
                                                 "bench", "plot", "sinks", "nextline")}
RUNNERS["inspect"] = _load_runner("inspect_model")   # prog "inspect"
# A valid configuration per gin runner (the bad value comes on top of it).
GIN_ARGS = {"train": ["--gin_file=experiments/recall.gin"],
            "decode": ["--gin_file=experiments/recall.gin"],
            "audit": ["--gin_file=precision/fp32_attention.gin"],
            "study": ["--gin_file=experiments/study_recall.gin"],
            "sinks": ["--gin_bindings=sinks.windows = 1"],
            "nextline": ["--gin_file=experiments/nextline_qwen2.gin"],
            "inspect": ["--gin.inspect.fn=attnprec.inspect.examples:maxtext_attention",
                        "--gin.inspect.inputs=attnprec.inspect.examples:maxtext_inputs"]}
GIN_FILES = GIN_ARGS   # the runners that read gin


def _work(*args, **kwargs):
  raise WorkStarted()


@contextlib.contextmanager
def _no_work():
  """Replaces each runner's first heavy step by `_work` (loading a real model, the recall
  evaluation, the train loop, the study's model, the audit, the benchmarks)."""
  import attnprec.bench.attention
  import attnprec.bench.model
  import attnprec.checkpoints
  import attnprec.inspect.job
  import attnprec.study.nextline
  import attnprec.study.sweep
  import attnprec.train
  # the module (attnprec.jobs re-exports its job function under the same name)
  recall_eval = importlib.import_module("attnprec.jobs.recall_eval")
  with mock.patch.object(attnprec.train.checkpointing, "Checkpointer", _work), \
       mock.patch.object(recall_eval, "evaluate", _work), \
       mock.patch.object(attnprec.checkpoints, "load_gguf", _work), \
       mock.patch.object(attnprec.study.sweep.models, "load_model", _work), \
       mock.patch.object(RUNNERS["audit"], "audit_job", _work), \
       mock.patch.object(attnprec.bench.attention, "run_attention_bench", _work), \
       mock.patch.object(attnprec.bench.model, "run_model_bench", _work), \
       mock.patch.object(attnprec.study.nextline, "checkpoints", mock.Mock(load=_work)), \
       mock.patch.object(attnprec.inspect.job, "inspect_lowered", _work):
    yield


def call(runner, argv):
  """(exit code or 'work', stderr) of runners/<runner>.py main(argv), in-process."""
  gin.clear_config()
  err = io.StringIO()
  with _no_work(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
      rc = RUNNERS[runner].main(list(argv))
    except WorkStarted:
      rc = "work"
  gin.clear_config()
  return rc, err.getvalue()


def gin_argv(runner, run_dir, *extra):
  return [*GIN_ARGS[runner], f"--run_dir={run_dir}", *extra]


def assert_refused(runner, rc, err, run_dir, *needles):
  assert rc == 2, (runner, rc, err)
  assert "Traceback" not in err, err
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith(f"{runner}: error: "), err
  for needle in needles:
    assert needle in lines[0], (needle, lines[0])
  assert not os.path.exists(run_dir), f"{run_dir} left behind"


# ----------------------------------------------------------------------------- strategies
identifiers = st.text(string.ascii_lowercase + "_", min_size=1, max_size=10).filter(
    lambda s: s[0] != "_")
gin_runners = st.sampled_from(sorted(GIN_FILES))
# Values of the wrong type for a numeric or boolean parameter: gin literals as typed.
non_numbers = st.sampled_from(["'abc'", "None", "(1, 2)", "[]", "{}", "'1'"])
non_positive_ints = st.integers(max_value=0).map(str)
non_ints = st.one_of(non_numbers, st.sampled_from(["1.5", "True", "False", "0.0"]))
non_positive_numbers = st.one_of(st.integers(max_value=0).map(str),
                                 st.floats(max_value=0, allow_nan=False).map(repr))
not_finite = st.sampled_from(["float('nan')", "float('inf')"])
non_bools = st.one_of(st.integers().map(str), st.sampled_from(["'True'", "'yes'", "None"]))

# (binding, bad values): what the issue and README say is invalid, written out by hand.
INT_AT_LEAST_1 = ["train.steps", "train.checkpoint_every", "train.keep_checkpoints",
                  "train.log_every", "train.eval_every", "train.batch_size",
                  "train.eval_batch", "TopK.k", "recall_eval.num_prompts",
                  "recall_eval.num_queries", "generate_text.max_new_tokens",
                  "recall.num_pairs", "recall.num_keys", "recall.value_len",
                  "model.num_heads", "model.d_model", "model.max_seq_len", "study.batch",
                  "study.timing_rounds", "audit.batch", "audit.prompt_len",
                  "text.seq_len"]
POSITIVE_NUMBERS = ["Temperature.temperature", "TopK.temperature", "TopP.temperature",
                    "optimizer.learning_rate", "optimizer.clip_norm", "optimizer.eps",
                    "model.norm_eps", "model.rope_base", "study.query_scale_multiplier"]
bad_bindings = st.one_of(
    st.tuples(st.sampled_from(INT_AT_LEAST_1), st.one_of(non_positive_ints, non_ints)),
    st.tuples(st.sampled_from(POSITIVE_NUMBERS),
              st.one_of(non_positive_numbers, not_finite, non_numbers)),
    st.tuples(st.just("TopP.p"), st.one_of(non_positive_numbers, not_finite,
                                           st.floats(min_value=1.0, exclude_min=True,
                                                     allow_infinity=False).map(repr))),
    st.tuples(st.just("optimizer.end_value_ratio"),
              st.one_of(st.floats(max_value=0, exclude_max=True,
                                  allow_infinity=False).map(repr), not_finite,
                        st.floats(min_value=1.0, exclude_min=True,
                                  allow_infinity=False).map(repr))),
    st.tuples(st.sampled_from(["precision.dtype", "train/precision.dtype",
                               "decode/precision.dtype"]),
              identifiers.filter(lambda s: s not in DTYPES).map(repr)),
    st.tuples(st.just("precision.kernel"),
              identifiers.filter(lambda s: s not in KERNELS).map(repr)),
    st.tuples(st.sampled_from(["precision.float32_qk_product", "precision.float32_logits",
                               "train.skip_nonfinite_steps"]), non_bools),
    st.tuples(st.sampled_from(["recall_eval.pair_counts", "study.pair_counts"]),
              st.sampled_from(["(0,)", "(8, -1)", "('a',)", "8"])),
    st.tuples(st.just("recall_eval.pair_counts"), st.just("()")),
    st.tuples(st.just("mesh.shape"), st.sampled_from(["'ab'", "(1, -2)", "(1.5, 1)"])),
    st.tuples(st.sampled_from(["train.seed", "recall_eval.seed", "optimizer.warmup_steps"]),
              st.integers(max_value=-1).map(str)),
)


# ----------------------------------------------------------------------------- properties
@SETTINGS
@given(runner=gin_runners, binding=bad_bindings)
def test_bad_values_are_refused_before_work(tmp_path, runner, binding):
  if runner == "study" and "precision." in binding[0]:
    return   # the study refuses any precision binding (tested below)
  name, value = binding
  run_dir = str(tmp_path / "run")
  rc, err = call(runner, gin_argv(runner, run_dir, f"--gin.{name}={value}"))
  assert_refused(runner, rc, err, run_dir, name.split("/")[-1])


@SETTINGS
@given(runner=gin_runners, scope=identifiers.filter(lambda s: s not in ginutils.PHASES),
       field=st.sampled_from(["dtype", "float32_qk_product", "float32_logits", "kernel"]))
def test_unknown_scopes_are_refused(tmp_path, runner, scope, field):
  value = {"dtype": "'float32'", "kernel": "'dot_product'"}.get(field, "False")
  run_dir = str(tmp_path / "run")
  rc, err = call(runner, gin_argv(runner, run_dir, f"--gin.{scope}/precision.{field}={value}"))
  assert_refused(runner, rc, err, run_dir, f"Unknown scope '{scope}'", "train, decode")


@SETTINGS
@given(runner=gin_runners, phase=st.sampled_from(ginutils.PHASES),
       binding=st.sampled_from(["recall_eval.num_prompts=4", "train.steps=5",
                                "model.d_model=32", "TopK.k=3", "study.batch=2"]))
def test_scoped_bindings_that_nothing_reads_are_refused(tmp_path, runner, phase, binding):
  run_dir = str(tmp_path / "run")
  rc, err = call(runner, gin_argv(runner, run_dir, f"--gin.{phase}/{binding}"))
  assert_refused(runner, rc, err, run_dir, f"{phase}/{binding.split('=')[0]}",
                 "would be ignored")


@SETTINGS
@given(runner=gin_runners, name=identifiers, param=identifiers)
def test_unknown_names_are_refused(tmp_path, runner, name, param):
  run_dir = str(tmp_path / "run")
  known = ginutils._configurable_names()  # noqa: SLF001
  if name in known:
    expect = "doesn't have a parameter named"
    if param in ginutils._parameter_names(name):  # noqa: SLF001
      return
  else:
    expect = f"No configurable matching '{name}'"
  rc, err = call(runner, gin_argv(runner, run_dir, f"--gin.{name}.{param}=1"))
  assert_refused(runner, rc, err, run_dir, expect)


@SETTINGS
@given(flag=st.sampled_from(["--presets", "--kernels"]), value=identifiers)
def test_bench_refuses_unknown_names_before_running(tmp_path, flag, value):
  out = str(tmp_path / "bench")
  rc, err = call("bench", [f"{flag}={value}", f"--out={out}"])
  assert_refused("bench", rc, err, out, f"{flag}={value!r}", "valid:")


@SETTINGS
@given(value=st.one_of(st.sampled_from(["x", "1,a", "1.5", "-4", "0", "16,0"]),
                       st.integers(max_value=0).map(str)),
       flag=st.sampled_from(["--seq_lens", "--memory_seq_lens", "--decode_seq_lens"]))
def test_bench_refuses_bad_lengths(tmp_path, flag, value):
  out = str(tmp_path / "bench")
  rc, err = call("bench", [f"{flag}={value}", f"--out={out}"])
  assert_refused("bench", rc, err, out, flag)


@SETTINGS
@given(flag=st.sampled_from(["--presets", "--seq_lens", "--decode_seq_lens", "--cases"]),
       index=st.integers(0, 1))
def test_bench_refuses_a_name_or_length_given_twice(tmp_path, flag, index):
  """A list option naming one value twice (which would run once or twice: neither is
  what was asked) is refused before anything runs, naming the value."""
  value = {"--presets": ["bf16", "fp32"], "--cases": ["1x32", "8x1000"]}.get(
      flag, ["64", "128"])[index]
  out = str(tmp_path / "bench")
  rc, err = call("bench", [f"{flag}={value},{value}", f"--out={out}"])
  assert_refused("bench", rc, err, out, flag, f"{value} ", "more than once")


# ----------------------------------------------------------------------------- explicit
@pytest.mark.parametrize("runner", sorted(GIN_FILES) + ["bench"])
def test_good_input_reaches_the_work(tmp_path, runner):
  """The harness is not vacuous: valid input gets past every check, and the run
  directory a run that failed at once created is removed again."""
  run_dir = str(tmp_path / "run")
  argv = ([f"--out={run_dir}"] if runner == "bench"
          else gin_argv(runner, run_dir))
  rc, err = call(runner, argv)
  assert rc == "work", (rc, err)
  assert not os.path.exists(run_dir)


@pytest.mark.parametrize("runner,args,needles", [
    ("decode", ["--gin.deocde/precision.float32_qk_product=False"],
     ["Unknown scope 'deocde'", "valid scopes are: train, decode"]),
    ("decode", ["--gin.serve/precision.dtype='float8'"], ["Unknown scope 'serve'"]),
    ("train", ["--gin.train.checkpoint_every=0"], ["train.checkpoint_every = 0"]),
    ("train", ["--gin.train.steps=0"], ["train.steps = 0"]),
    ("train", ["--gin.train.keep_checkpoints=0"], ["train.keep_checkpoints = 0"]),
    ("decode", ["--gin.TopK.k=0"], ["TopK.k = 0", ">= 1"]),
    ("decode", ["--gin.Temperature.temperature=0"], ["Temperature.temperature = 0", ">= 1e-06"]),
    ("decode", ["--gin.TopP.p=-1"], ["TopP.p = -1"]),
    ("study", ["--gin.precision.dtype='bfloat16'"], ["does not read precision.*",
                                                    "study.extra_presets"]),
    ("train", ["--gin.recall_eval.pair_counts=(8, 0)"], ["recall_eval.pair_counts"]),
    # The KV cache's precision (issue 20).
    ("decode", ["--gin.precision.kv_cache_k_dtype='int4'"],
     ["precision.kv_cache_k_dtype = 'int4'", "'int8'", "'float8_e4m3fn'"]),
    ("decode", ["--gin.decode/precision.kv_cache_k_scale='token'"],
     ["precision.kv_cache_k_scale = 'token'", "takes none"]),
    ("decode", ["--gin.precision.kv_cache_v_dtype='int8'",
                "--gin.precision.kv_cache_v_scale='channel'"],
     ["precision.kv_cache_v_scale = 'channel'", "values take 'token'"]),
    ("decode", ["--gin.precision.kernel='jax_nn'", "--gin.precision.kv_cache_k_dtype='int8'"],
     ["'jax_nn'", "quantized KV cache", "'compute', 'float32', 'bfloat16'"]),
    # The key offset (issue 35): an unknown name, an offset the model cannot take (no
    # key bias), the prompt's mean in a phase without a prefill.
    ("decode", ["--gin.precision.key_offset='mean'"],
     ["precision.key_offset", "'mean'", "'prefill_mean'"]),
    ("decode", ["--gin.decode/precision.key_offset='bias'"],
     ["key_offset = 'bias'", "has none", "'prefill_mean'"]),
    ("train", ["--gin.precision.key_offset='prefill_mean'"],
     ["'prefill_mean'", "train phase", "decode/precision.key_offset"]),
    # The platform (attnprec/platforms.py): not a name; a preset the platform refuses; a
    # lowering this machine cannot make (cuDNN's fused attention, lowered for cuda).
    ("audit", ["--platform=gpu"], ["Invalid platform 'gpu'", "'cpu', 'tpu', 'cuda'"]),
    ("inspect", ["--platform=gpu"], ["Invalid platform 'gpu'", "'cpu', 'tpu', 'cuda'"]),
    ("audit", ["--platform=tpu", "--gin.decode/precision.einsum_precision='F32_F32_F32'"],
     ["Platform 'tpu' cannot honour einsum_precision='F32_F32_F32'", "'BF16_BF16_F32_X6'"]),
    ("inspect", ["--platform=cuda", "--gin.inspect.fn=attnprec.inspect.examples:cudnn_attention",
                 "--gin.inspect.inputs=attnprec.inspect.examples:cudnn_inputs"],
     ["for platform 'cuda' failed", "cuDNN", "implementation='xla'"]),
])
def test_issue_examples_are_refused(tmp_path, runner, args, needles):
  run_dir = str(tmp_path / "run")
  rc, err = call(runner, gin_argv(runner, run_dir, *args))
  assert_refused(runner, rc, err, run_dir, *needles)


def test_decode_without_an_experiment_file(tmp_path):
  run_dir = str(tmp_path / "run")
  rc, err = call("decode", [f"--run_dir={run_dir}"])
  assert_refused("decode", rc, err, run_dir, "decode.job is not set", "--gin_file=")


def test_bench_presets_nope(tmp_path):
  rc, err = call("bench", ["--presets=nope", f"--out={tmp_path / 'b'}"])
  assert_refused("bench", rc, err, str(tmp_path / "b"), "--presets='nope'", "fp32_attention")


@pytest.mark.parametrize("runner", sorted(GIN_FILES) + ["bench", "plot"])
def test_outputs_are_checked_before_work(tmp_path, runner):
  """A --run_dir / --out that is a file, or lies below one, is refused before any work."""
  blocker = tmp_path / "file"
  blocker.write_text("x")
  for target in (blocker, blocker / "sub"):
    flag = "--out" if runner == "bench" else "--run_dir"
    argv = ([f"{flag}={target}"] if runner in ("bench", "plot")
            else [*GIN_ARGS[runner], f"{flag}={target}"])
    rc, err = call(runner, argv)
    assert rc == 2, (runner, rc, err)
    assert str(target) in err and "Traceback" not in err
  assert blocker.read_text() == "x"


def test_failed_load_leaves_no_run_directory(tmp_path):
  run_dir = tmp_path / "new" / "run"
  rc, err = call("decode", gin_argv("decode", run_dir,
                                    f"--gin.recall_eval.checkpoint={tmp_path / 'none'}"))
  assert rc == 2 and "is neither a shipped checkpoint" in err
  assert not (tmp_path / "new").exists()       # nor the parent it created for it


def _fake_run(tmp_path, task):
  """A recall run directory: the shipped checkpoint's model and params, a given task."""
  import shutil
  src = os.path.join(ROOT, "attnprec", "assets", "recall-tiny")
  run = tmp_path / "ckpt"
  run.mkdir()
  for f in ("model.json", "params.npz"):
    shutil.copy(os.path.join(src, f), run / f)
  (run / "task.json").write_text(json.dumps(task))
  return run


def test_a_sampler_class_without_call_is_refused(tmp_path):
  run_dir = str(tmp_path / "run")
  rc, err = call("decode", [f"--gin_file=experiments/smollm2.gin", f"--run_dir={run_dir}",
                            "--gin.generate_text.sampler=@TopK"])
  assert_refused("decode", rc, err, run_dir, "generate_text.sampler", "@TopK()")


@pytest.mark.parametrize("edit,needle", [
    (lambda t: t.pop("value_len"), "missing field(s) ['value_len']"),
    (lambda t: t.update(pairs=3), "unknown field(s) ['pairs']"),
    (lambda t: t.update(num_pairs=float("nan")),
     "task.json: the recall task the run trained on holds a value"),
])
def test_task_json_must_hold_exactly_the_task(tmp_path, edit, needle):
  with open(os.path.join(ROOT, "attnprec", "assets", "recall-tiny", "task.json")) as f:
    task = json.load(f)
  edit(task)
  run = _fake_run(tmp_path, task)
  run_dir = str(tmp_path / "out")
  rc, err = call("decode", gin_argv("decode", run_dir,
                                    f"--gin.recall_eval.checkpoint='{run}'"))
  assert_refused("decode", rc, err, run_dir, needle)


def test_task_json_must_be_an_object(tmp_path):
  run = _fake_run(tmp_path, [1, 2])
  run_dir = str(tmp_path / "out")
  rc, err = call("decode", gin_argv("decode", run_dir,
                                    f"--gin.recall_eval.checkpoint='{run}'"))
  assert_refused("decode", rc, err, run_dir, "not an object")


@pytest.mark.parametrize("runner,binding", [
    ("decode", "--gin.recall_eval.pair_counts=(8, 8)"),
    ("study", "--gin.study.pair_counts=(8, 24, 8)"),
])
def test_a_list_of_measured_values_naming_one_twice_is_refused(tmp_path, runner, binding):
  """Each value of such a list is measured once and reported as a row: named twice it
  was measured twice, two identical rows (`checks.sequence_of(..., distinct=True)`)."""
  run_dir = str(tmp_path / "run")
  rc, err = call(runner, gin_argv(runner, run_dir, binding))
  assert_refused(runner, rc, err, run_dir, "must name each value once (got 8 twice)")


@pytest.mark.parametrize("arg,needle", [
    ("--seq_lens=1024,,4096", "an empty one, as in 1024,,4096, is not"),
    ("--seq_lens=99999999999", "every value must be an integer from 1 to 2147483647"),
    ("--rounds=99999999999", "'99999999999' is not an integer from 0 to 2147483647"),
    ("--presets=bf16,,fp32", "Invalid --presets='bf16,,fp32': an empty item"),
])
def test_bench_list_and_count_options_refuse_empty_items_and_values_past_int32(
    tmp_path, arg, needle):
  """An empty item in a list option was dropped silently; a count past int32 ran until
  killed."""
  out = tmp_path / "out"
  rc, err = call("bench", ["--suite=attention", "--kernels=dot_product", "--no_torch",
                           f"--out={out}", arg])
  assert rc == 2 and needle in err and "Traceback" not in err, err
  assert not out.exists()


def test_bench_refuses_torch_dtypes_with_no_torch(tmp_path):
  """--torch_dtypes names the torch baselines' dtypes; with --no_torch none runs."""
  out = tmp_path / "out"
  rc, err = call("bench", ["--suite=model", "--no_torch", "--torch_dtypes=bfloat16",
                           f"--out={out}"])
  assert rc == 2 and "which --no_torch skips: it would not be read" in err, err
  assert not out.exists()


def test_a_backend_jax_platforms_names_that_cannot_start_is_exit_2(tmp_path, monkeypatch,
                                                                   capsys):
  """JAX starts its backend at the first array (inside a job, after loading): JAX's
  RuntimeError for a platform this machine does not have is the one-paragraph error,
  exit 2, the new output directory removed; any other RuntimeError stays a crash."""
  from attnprec import cli
  monkeypatch.setenv("JAX_PLATFORMS", "tpu")
  out = tmp_path / "run"

  def body():
    out.mkdir()
    raise RuntimeError("Unable to initialize backend 'tpu': INTERNAL: Failed to open "
                       "libtpu.so\nmore")
  assert cli.run("decode", body, output_dir=str(out)) == 2
  err = capsys.readouterr().err
  assert err.startswith("decode: error: JAX could not start the backend JAX_PLATFORMS='tpu' "
                        "names (Unable to initialize backend 'tpu'") and not out.exists()
  with pytest.raises(RuntimeError, match="something else"):
    cli.run("decode", lambda: (_ for _ in ()).throw(RuntimeError("something else")))


def test_second_training_into_a_run_directory_is_refused(tmp_path):
  run_dir = str(tmp_path / "run")
  with runs.locked(run_dir):      # as a first training holds it
    rc, err = call("train", gin_argv("train", run_dir))
  assert rc == 2 and "is in use by another training" in err, err
  assert "Traceback" not in err
  rc, _ = call("train", gin_argv("train", run_dir))   # released: the next one may start
  assert rc == "work"


@pytest.mark.parametrize("raw,needle", [
    ([1, 2], "holds a JSON list"),
    ({"model_type": "llama", "num_attention_heads": 0, "hidden_size": 64,
      "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 10},
     "num_attention_heads must be a positive integer, got 0"),
    ({"model_type": "llama", "num_attention_heads": 2, "hidden_size": 64,
      "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 10,
      "rms_norm_eps": "tiny"}, "rms_norm_eps must be a number, got 'tiny'"),
])
def test_hf_config_json_is_checked(raw, needle):
  from attnprec.checkpoints.hf_config import config_from_hf
  with pytest.raises(UserError, match=needle.replace("(", r"\(").replace("[", r"\[")):
    config_from_hf(raw)


# ----------------------------------------------------------------------------- subprocess
def _subprocess(script, *args):
  return subprocess.run([sys.executable, os.path.join(ROOT, "runners", script), *args],
                        capture_output=True, text=True, cwd=ROOT, timeout=300,
                        env={**os.environ, "XLA_FLAGS": "--xla_allow_excess_precision=false"})


def test_real_exit_code_and_stderr(tmp_path):
  proc = _subprocess("decode.py", "--gin_file=experiments/recall.gin",
                     "--gin.deocde/precision.float32_qk_product=False",
                     f"--run_dir={tmp_path / 'run'}")
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.startswith("decode: error: Unknown scope 'deocde'")
  assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
  proc = _subprocess("bench.py", "--presets=nope", f"--out={tmp_path / 'bench'}")
  assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
  assert not (tmp_path / "run").exists() and not (tmp_path / "bench").exists()


# ----------------------------------------------------------------------------- unread
@pytest.mark.parametrize("runner,files,args,needle", [
    ("decode", ["experiments/recall.gin"], ["--gin.train.steps=5"],
     "decode does not read train.*"),
    ("decode", ["experiments/smollm2.gin"], ["--gin.TopK.k=3"], "does not read TopK.*"),
    ("train", ["experiments/recall.gin"], ["--gin.decode/precision.dtype='float32'"],
     "train reads precision.* only in train phase"),
    ("decode", ["experiments/recall.gin"], ["--gin.train/precision.dtype='float32'"],
     "decode reads precision.* only in decode phase"),
    ("study", ["experiments/study_recall.gin"], ["--gin.model.d_model=32"],
     "study does not read model.*"),
    ("train", ["experiments/recall.gin"], ["--gin.recall_eval.num_prompts=8"],
     "train does not read recall_eval.*"),
    # block sizes for a kernel the phase does not run
    ("decode", ["experiments/recall.gin"], ["--gin.precision.kernel='dot_product'",
                                            "--gin.decode/blockwise.q_block=128"],
     "the kernel there does not read it (decode: 'dot_product')"),
    ("train", ["experiments/recall.gin"], ["--gin.blockwise.kv_block=64"],
     "(train: 'dot_product')"),
])
def test_command_line_bindings_the_runner_does_not_read_are_refused(tmp_path, runner, files,
                                                                     args, needle):
  run_dir = str(tmp_path / "run")
  rc, err = call(runner, [f"--gin_file={f}" for f in files] + [f"--run_dir={run_dir}", *args])
  assert_refused(runner, rc, err, run_dir, needle, "would be ignored")


@pytest.mark.parametrize("field", ["carrier_weights", "block_sizes"])
def test_fields_filled_by_code_cannot_be_bound(tmp_path, field):
  """Precision.carrier_weights (set by decoding.for_serving) and block_sizes (from
  blockwise.*) are not gin-bindable: binding them is refused, naming the field."""
  run_dir = str(tmp_path / "run")
  rc, err = call("decode", ["--gin_file=experiments/recall.gin", f"--run_dir={run_dir}",
                            f"--gin.precision.{field}=True"])
  assert_refused("decode", rc, err, run_dir, field)


@pytest.mark.parametrize("runner,files,args", [
    ("train", ["experiments/recall.gin"], ["--gin.optimizer.learning_rate=0.01",
                                           "--gin.mesh.shape=(1, 1)", "--gin.recall.num_pairs=8",
                                           "--gin.precision.kernel='blockwise'",
                                           "--gin.train/precision.float32_logits=True"]),
    ("train", ["experiments/text_bytes.gin"], ["--gin.text.seq_len=64"]),
    ("decode", ["experiments/smollm2.gin"], ["--gin.generate_text.sampler=@TopK()",
                                             "--gin.TopK.k=3", "--gin.blockwise.q_block=64",
                                             "--gin.precision.kernel='blockwise'"]),
    ("audit", ["precision/bf16.gin"], ["--gin.model.d_model=32", "--gin.optimizer.b1=0.8",
                                       "--gin.decode/precision.float32_logits=True"]),
    ("study", ["experiments/study_recall.gin"], ["--gin.study.batch=2"]),
])
def test_command_line_bindings_the_runner_reads_are_accepted(tmp_path, runner, files, args):
  rc, err = call(runner, [f"--gin_file={f}" for f in files]
                 + [f"--run_dir={tmp_path / 'run'}", *args])
  assert rc == "work", err


# ----------------------------------------------------------------------------- Python API
# The API checks its arguments at the boundary: a UserError naming the argument and what
# is valid, the bad value echoed at most ~200 characters, before anything is compiled
# (the compiled steps are replaced by `_work`: reaching one means a check is missing).
@pytest.fixture(scope="module")
def recall_tiny():
  from attnprec import checkpoints
  return checkpoints.load("recall-tiny")


@contextlib.contextmanager
def _no_compile():
  import attnprec.checkpoints.forward
  import attnprec.decoding
  import attnprec.inspect
  import attnprec.checkpoints.serving
  with mock.patch.object(attnprec.checkpoints.forward, "_forward", _work), \
       mock.patch.object(attnprec.decoding, "generate", _work), \
       mock.patch.object(attnprec.checkpoints.serving, "run", _work), \
       mock.patch.object(attnprec.inspect, "inspect_lowered", _work):
    yield


def api_refused(call, *needles):
  """The message of the UserError `call()` raises (gin's 'In call to configurable' note
  dropped), checked for each needle and for its length."""
  with _no_compile():
    try:
      call()
    except WorkStarted:
      raise AssertionError("a bad argument reached the compiled work") from None
    except UserError as e:
      message = str(e).split("\n  In call to configurable")[0]
    else:
      raise AssertionError("accepted")
  assert "\n" not in message and len(message) < 900, message
  for needle in needles:
    assert needle in message, (needle, message)
  return message


long_texts = st.text(string.ascii_letters, min_size=250, max_size=5000)
bad_objects = st.one_of(st.none(), st.floats(allow_nan=False), st.binary(max_size=4),
                        st.lists(st.integers(0, 5), max_size=3), st.dictionaries(
                            identifiers, st.integers(), max_size=2), long_texts,
                        st.builds(object))
non_number_objects = bad_objects.filter(lambda v: not isinstance(v, float))
not_bools = st.one_of(st.integers(), st.none(), st.sampled_from(["True", "yes", 1.0]))


@SETTINGS
@given(value=st.one_of(st.integers(), bad_objects.filter(lambda v: not isinstance(v, str))))
def test_api_load_refuses_bad_paths(value):
  from attnprec import checkpoints
  api_refused(lambda: checkpoints.load(value), "path_or_name", "shipped model name")


@SETTINGS
@given(value=st.one_of(identifiers.filter(lambda s: s not in ("float32", "bfloat16",
                                                               "float16")), st.integers(),
                       bad_objects))
def test_api_load_refuses_bad_param_dtypes(value):
  from attnprec import checkpoints
  api_refused(lambda: checkpoints.load("recall-tiny", param_dtype=value), "param_dtype",
              "'float32', 'bfloat16', 'float16'")


GENERATE_BAD = st.one_of(
    st.tuples(st.just("max_new_tokens"), st.one_of(st.integers(max_value=0), bad_objects,
                                                   st.just(2.0))),
    st.tuples(st.just("precision"), st.one_of(st.integers(), bad_objects)),
    st.tuples(st.just("sampler"), st.one_of(st.integers(), bad_objects)),
    st.tuples(st.just("eos_id"), st.one_of(st.integers(max_value=-2), st.integers(min_value=98),
                                           st.floats(), st.just("2"))),
    st.tuples(st.just("rng"), st.one_of(st.integers(), bad_objects.filter(
        lambda v: v is not None))),
    st.tuples(st.sampled_from(["chat", "check_finite"]), not_bools),
)


@SETTINGS
@given(binding=GENERATE_BAD)
def test_api_generate_refuses_bad_arguments(recall_tiny, binding):
  from attnprec import checkpoints
  name, value = binding
  api_refused(lambda: checkpoints.generate(recall_tiny, [[3, 4, 5]], **{name: value}),
              name, shorten_check(value))


def shorten_check(value) -> str:
  """What the message must echo of `value`: its first characters, at most ~200."""
  from attnprec.errors import shorten
  return shorten(value)[:40]


@SETTINGS
@given(rows=st.lists(st.lists(st.integers(0, 97), min_size=1, max_size=6), min_size=2,
                     max_size=4).filter(lambda r: len({len(x) for x in r}) > 1))
def test_api_logits_refuses_ragged_batches(recall_tiny, rows):
  from attnprec import checkpoints
  api_refused(lambda: checkpoints.logits(recall_tiny, rows), "tokens_BxT",
              "different lengths")
  ragged = np.empty(len(rows), dtype=object)
  ragged[:] = rows
  api_refused(lambda: checkpoints.logits(recall_tiny, ragged), "tokens_BxT")


@pytest.mark.parametrize("call,needles", [
    (lambda c: checkpoints_api().logits(c, np.zeros((1, 513), np.int32)),
     ["513 tokens", "model's context (512 tokens)"]),
    (lambda c: checkpoints_api().logits(c, np.zeros((1, 4))), ["2-D integer array"]),
    (lambda c: checkpoints_api().logits(c, np.zeros((1, 0), np.int32)), ["at least one"]),
    (lambda c: checkpoints_api().logits("recall-tiny", [[1]]), ["Checkpoint", "pair"]),
    (lambda c: checkpoints_api().logits(c, [[1]], precision="bf16"),
     ["precision='bf16'", "Precision"]),
    (lambda c: checkpoints_api().generate(c, [1, 2, 3]), ["flat list of token ids"]),
    (lambda c: checkpoints_api().generate(c, [[1, 2], []]), ["Prompt 1", "empty"]),
    (lambda c: checkpoints_api().generate(c, [[1, 2], ["a"]]), ["prompt 1"]),
    (lambda c: checkpoints_api().generate(c, [[1]], eos_id=98),
     ["eos_id=98", "[0, 98)"]),
    (lambda c: checkpoints_api().generate(c, [[1]], sampler=decoding_api().TopK),
     ["sampler=", "instance"]),
    (lambda c: checkpoints_api().generate(c, [[1]], sampler=decoding_api().TopK(k=99),
                                          rng=__import__("jax").random.PRNGKey(0)),
     ["TopK.k = 99", "vocabulary (98 tokens)"]),
    (lambda c: checkpoints_api().generate("x" * 10000, [[1]]), ["ckpt=", "(10002 char"]),
])
def test_api_examples_are_refused(recall_tiny, call, needles):
  message = api_refused(lambda: call(recall_tiny), *needles)
  assert "x" * 300 not in message


def checkpoints_api():
  from attnprec import checkpoints
  return checkpoints


def decoding_api():
  from attnprec import decoding
  return decoding


PRECISION_BAD = st.one_of(
    st.tuples(st.sampled_from(["dtype", "matmul_precision", "einsum_precision", "kernel"]),
              st.one_of(identifiers.map(lambda s: s + "_x"), st.integers(), bad_objects)),
    st.tuples(st.sampled_from(["float32_qk_product", "float32_logits"]), not_bools),
    st.tuples(st.just("block_sizes"), st.one_of(st.integers(), bad_objects)),
    st.tuples(st.sampled_from(["kv_cache_k_dtype", "kv_cache_v_dtype"]),
              st.one_of(identifiers.filter(lambda s: s not in KV_CACHE_DTYPES), st.integers(),
                        bad_objects)),
    st.tuples(st.sampled_from(["kv_cache_k_scale", "kv_cache_v_scale"]),
              st.one_of(identifiers.filter(lambda s: s not in ("token", "channel")),
                        st.integers(), st.floats(allow_nan=False))),   # None is valid
)
SAMPLER_BAD = st.one_of(
    st.tuples(st.just("TopK"), st.just("k"), st.one_of(st.integers(max_value=0), st.just(2.0),
                                                       bad_objects)),
    st.tuples(st.sampled_from(["Temperature", "TopK", "TopP"]), st.just("temperature"),
              st.one_of(st.floats(max_value=0), st.just(float("nan")), st.just("1"),
                        non_number_objects)),
    st.tuples(st.just("TopP"), st.just("p"), st.one_of(st.floats(min_value=1.0,
                                                                 exclude_min=True),
                                                       st.floats(max_value=0),
                                                       non_number_objects)),
)


@SETTINGS
@given(binding=PRECISION_BAD)
def test_api_precision_refuses_bad_fields(binding):
  from attnprec.precision import Precision
  field, value = binding
  api_refused(lambda: Precision(**{field: value}), f"precision.{field} = ")


@SETTINGS
@given(binding=SAMPLER_BAD)
def test_api_samplers_refuse_bad_fields(binding):
  from attnprec import decoding
  cls, field, value = binding
  api_refused(lambda: getattr(decoding, cls)(**{field: value}), f"{cls}.{field} = ")


def test_api_wrong_calls_are_refused():
  from attnprec import decoding
  from attnprec.precision import Precision
  api_refused(lambda: Precision("bfloat16"), "Precision(...)", "dtype, matmul_precision")
  api_refused(lambda: decoding.TopK(kk=3), "TopK(...)", "k, temperature")
  api_refused(lambda: decoding.Greedy(1), "Greedy(...)")


@SETTINGS
@given(fn=st.one_of(st.integers(), bad_objects.filter(lambda v: not callable(v))),
       expect=st.one_of(st.none(), identifiers, st.integers()))
def test_api_attention_report_refuses_bad_arguments(fn, expect):
  from attnprec.inspect import attention_report, examples
  api_refused(lambda: attention_report(fn), "fn=", "callable")
  if expect is not None:
    args, kwargs = examples.maxtext_inputs()
    api_refused(lambda: attention_report(examples.maxtext_attention, *args, expect=expect,
                                         **kwargs), "expect=", "Precision")
  api_refused(lambda: attention_report(examples.maxtext_attention, "abc"), "argument 0",
              "arrays, jax.ShapeDtypeStructs")


def test_api_good_input_reaches_the_work(recall_tiny):
  """The API harness is not vacuous: valid arguments reach the compiled work."""
  import jax

  from attnprec import checkpoints, decoding
  from attnprec.inspect import attention_report, examples
  from attnprec.precision import Precision
  calls = [lambda: checkpoints.logits(recall_tiny, [[1, 2, 3]], precision=Precision()),
           lambda: checkpoints.generate(recall_tiny, [[1, 2], [3]], max_new_tokens=2,
                                        sampler=decoding.TopK(k=3),
                                        rng=jax.random.PRNGKey(1), eos_id=-1),
           lambda: attention_report(examples.maxtext_attention,
                                    *examples.maxtext_inputs()[0],
                                    expect=Precision(dtype="bfloat16"),
                                    **examples.maxtext_inputs()[1])]
  for call in calls:
    with _no_compile(), pytest.raises(WorkStarted):
      call()


def test_api_empty_model_files_are_refused(tmp_path):
  from attnprec import checkpoints
  (tmp_path / "empty.gguf").write_bytes(b"")
  api_refused(lambda: checkpoints.load(tmp_path / "empty.gguf"), "empty.gguf",
              "is empty (0 bytes")
  hf = tmp_path / "hf"
  hf.mkdir()
  (hf / "config.json").write_text(json.dumps(
      {"model_type": "llama", "num_attention_heads": 2, "hidden_size": 16,
       "num_hidden_layers": 1, "intermediate_size": 8, "vocab_size": 10}))
  (hf / "model.safetensors").write_bytes(b"")
  api_refused(lambda: checkpoints.load(hf), "model.safetensors is empty (0 bytes)")
  run = _fake_run(tmp_path, {})
  (run / "params.npz").write_bytes(b"")
  api_refused(lambda: checkpoints.load(run), "params.npz is empty (0 bytes)")


def test_api_a_params_array_named_otherwise_than_a_training_names_it_is_named(tmp_path):
  """An array in params.npz whose name is not 'module//name' (it was 'not enough values
  to unpack')."""
  from attnprec import checkpoints
  run = _fake_run(tmp_path, {})
  with np.load(run / "params.npz") as z:
    arrays = {k: z[k] for k in z.files}
  np.savez(run / "params.npz", **arrays, **{"bogus/w": np.zeros(2, np.float32)})
  api_refused(lambda: checkpoints.load(run), "holds an array named 'bogus/w', not a "
                                             "parameter a training saves")


# ----------------------------------------------------------------------------- hostile files
def _gguf_header(dims, *, n_dims=None):
  """A GGUF v3 header with one F32 tensor 'token_embd.weight' of `dims` (and 64 zero
  bytes of data): what a hostile or corrupt file can claim."""
  import struct
  name = b"token_embd.weight"
  out = b"GGUF" + struct.pack("<IQQ", 3, 1, 0)
  out += struct.pack("<Q", len(name)) + name
  out += struct.pack("<I", len(dims) if n_dims is None else n_dims)
  out += struct.pack(f"<{len(dims)}Q", *dims) + struct.pack("<IQ", 0, 0)
  return out + b"\0" * 64


@pytest.mark.parametrize("dims,n_dims,needle", [
    ([2 ** 32, 2 ** 32], None, "overflows a 64-bit count"),      # wraps to 0 in uint64
    ([3, 2 ** 62], None, "overflows a 64-bit count"),
    ([2 ** 63, 1], None, "overflows a 64-bit count"),
    ([4, 4], 2 ** 31, "has 2147483648 dimensions"),
])
def test_gguf_dimensions_past_64_bits_are_corrupt(tmp_path, dims, n_dims, needle):
  from attnprec import checkpoints
  path = tmp_path / "hostile.gguf"
  path.write_bytes(_gguf_header(dims, n_dims=n_dims))
  message = api_refused(lambda: checkpoints.load(path), "is not a valid GGUF file", needle)
  assert "token_embd.weight" in message


@pytest.mark.parametrize("template,needle", [
    ("{% for i in range(100000) %}{% for j in range(100000) %}xxxxxxxx{% endfor %}"
     "{% endfor %}", "its output passed"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
     "range() items"),
    ("{% set s = 'x' * 10000000000 %}{{ s }}", "multiplies a value"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recurses without end"),
    ("{{ ''.__class__.__mro__ }}", "unsafe"),
])
def test_chat_templates_are_bounded(template, needle):
  import time

  import tokenizers

  from attnprec.checkpoints.tokenizer import Tokenizer
  tok = Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), bos_id=None, eos_id=None,
                  chat_template=template)
  t0 = time.perf_counter()
  api_refused(lambda: tok.apply_chat_template([{"role": "user", "content": "hi"}]),
              "chat template", needle)
  assert time.perf_counter() - t0 < 5


def test_a_normal_chat_template_still_renders():
  import tokenizers

  from attnprec.checkpoints.tokenizer import Tokenizer
  tok = Tokenizer(tokenizers.Tokenizer(tokenizers.models.BPE()), bos_id=None, eos_id=None,
                  chat_template="{% for m in messages %}<|{{ m.role }}|>{{ m.content }}"
                                "{% endfor %}{{ '-' * 3 }}")
  long = "y" * 3_000_000                         # a long prompt is not a hostile template
  assert tok.apply_chat_template([{"role": "user", "content": long}]) == \
      f"<|user|>{long}---"


@pytest.mark.parametrize("suite,option", [
    ("attention", "--cases=1x32"), ("attention", "--quick"), ("attention", "--no_flag_phases"),
    ("projections", "--no_torch"), ("projections", "--model=smollm2-135m"),
    ("model", "--seq_lens=64"), ("model", "--xla_settings=default"),
    ("all", "--projection_parts=micro")])
def test_bench_refuses_an_option_its_suite_does_not_read(tmp_path, suite, option):
  """A bench option the chosen suite would not use is refused before any work, naming it
  and the options the suite reads (never silently ignored)."""
  out = str(tmp_path / "bench")
  rc, err = call("bench", [f"--suite={suite}", option, f"--out={out}"])
  assert_refused("bench", rc, err, out, f"--suite={suite} does not read "
                 f"{option.split('=')[0]}", "the options it reads:")
  # the same option with a suite that reads it gets past every check (the projections
  # suite's own work is not replaced here, so its options are only refused)
  reader = {"--cases": "model", "--quick": "model", "--no_flag_phases": "model",
            "--no_torch": "attention", "--model": "model", "--seq_lens": "attention"}
  if option.split("=")[0] in reader:
    rc, _ = call("bench", [f"--suite={reader[option.split('=')[0]]}", option,
                           f"--out={out}"])
    assert rc == "work"


def test_xla_flags_xla_would_refuse_are_refused_before_anything_is_written(tmp_path):
  """XLA ends the process at JAX's start on a flag it does not know or a value it cannot
  read (exit 1, after the runner made its run directory): refused first (exit 2, one
  paragraph quoting XLA's words), nothing written. The project's own flag alone asks XLA
  nothing; a flag XLA knows passes. (One runner run; the value case through the check.)"""
  from attnprec import xla_env
  assert xla_env.flag_problems("--xla_allow_excess_precision=false") == []
  assert xla_env.flag_problems("--xla_cpu_enable_fast_math=false") == []
  with pytest.raises(UserError, match="Couldn't interpret value banana for flag "
                                      "xla_cpu_enable_fast_math.*Nothing was run"):
    xla_env.check_known_flags("--xla_cpu_enable_fast_math=banana")
  proc = subprocess.run(
      [sys.executable, os.path.join(ROOT, "runners", "decode.py"),
       f"--run_dir={tmp_path / 'run'}"], capture_output=True, text=True, cwd=ROOT,
      timeout=300, env={**os.environ,
                        "XLA_FLAGS": "--xla_allow_excess_precision=false --xla_bogus_flag=1"})
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.startswith("decode: error: XLA_FLAGS=")
  assert "Unknown flag in XLA_FLAGS: --xla_bogus_flag=1" in proc.stderr
  assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
  assert not (tmp_path / "run").exists()
