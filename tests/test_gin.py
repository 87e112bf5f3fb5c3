"""Every gin file parses; phase scopes deliver different values to train and decode."""
import ast
import glob
import os

import gin
import pytest

from attnprec import ginutils
from attnprec.config import ModelConfig, model_config
from attnprec.errors import UserError
from attnprec.precision import Precision, phase_precision

GIN_DIR = ginutils.REPO_GIN_DIR
ALL_FILES = sorted(glob.glob(os.path.join(GIN_DIR, "**", "*.gin"), recursive=True))


def _phase_precision(phase):
  with ginutils.phase(phase):
    return phase_precision()


@pytest.mark.parametrize("path", ALL_FILES, ids=lambda p: os.path.relpath(p, GIN_DIR))
def test_every_gin_file_parses(path):
  ginutils.parse([path], [])
  for phase in ginutils.PHASES:
    assert isinstance(_phase_precision(phase), Precision)


@pytest.mark.parametrize("path", glob.glob(os.path.join(GIN_DIR, "models", "*.gin")))
def test_model_files_hold_no_precision(path):
  with open(path) as f:
    text = f.read()
  assert "precision." not in text
  ginutils.parse([path], [])
  assert isinstance(model_config(), ModelConfig)


def test_phase_scopes_differ():
  ginutils.parse(["experiments/recall_bf16.gin"], [])
  train, decode = _phase_precision("train"), _phase_precision("decode")
  assert (train.float32_qk_product, train.float32_logits) == (True, True)
  assert (decode.float32_qk_product, decode.float32_logits) == (False, False)
  assert decode.dtype == "bfloat16"


def test_command_line_override_beats_files():
  files, bindings, rest = ginutils.split_flags(
      ["--gin_file=experiments/recall_bf16.gin",
       "--gin.decode/precision.float32_logits=True", "--run_dir=x"])
  assert rest == ["--run_dir=x"]
  ginutils.parse(files, bindings)
  assert _phase_precision("decode").float32_logits is True
  assert _phase_precision("decode").float32_qk_product is False


def test_bare_string_values_are_quoted():
  _, bindings, _ = ginutils.split_flags(["--gin.recall_eval.checkpoint=runs/recall",
                                         "--gin.precision.dtype=bfloat16",
                                         "--gin.train.steps=5"])
  assert bindings == ["recall_eval.checkpoint = 'runs/recall'",
                      "precision.dtype = 'bfloat16'", "train.steps = 5"]


def test_precision_constants_registered():
  ginutils.parse([], ["precision.einsum_precision = %jax.lax.Precision.HIGHEST"])
  assert phase_precision().einsum_precision == "highest"


@pytest.mark.parametrize("binding,match", [
    ("precision.float32_logitz = True", "precision"),
    ("nonexistent.x = 1", "No configurable matching 'nonexistent'"),
    ("precision.dtype = ", "Invalid gin configuration"),
])
def test_bad_bindings_are_user_errors(binding, match):
  with pytest.raises(UserError, match=match):
    ginutils.parse([], [binding])


@pytest.mark.parametrize("binding,match", [
    ("precision.dtype = 'float8'", "precision.dtype = 'float8': valid values are: 'float32'"),
    ("precision.einsum_precision = 'fastest'",
     "precision.einsum_precision = 'fastest': valid values are: 'default'"),
    ("precision.kernel = 'magic'", "precision.kernel = 'magic': valid values are: 'dot_product'"),
])
def test_bad_values_fail_at_parse_time_and_at_construction(binding, match):
  with pytest.raises(UserError, match=match):
    ginutils.parse([], [binding])        # before any runner does work
  gin.clear_config()
  field, value = binding.split(".", 1)[1].split(" = ")
  with pytest.raises(UserError, match=match):
    Precision(**{field: ast.literal_eval(value)})   # constructed in code


def test_missing_gin_file_lists_available():
  with pytest.raises(UserError, match="not found. Available gin files: .*recall.gin"):
    ginutils.parse(["experiments/nope.gin"], [])


def test_two_precision_presets_or_one_file_twice_are_refused():
  with pytest.raises(UserError, match=r"Two precision presets are given \('precision/bf16.gin'"
                                      r", 'gin/precision/fp32.gin'\)"):
    ginutils.parse(["precision/bf16.gin", "gin/precision/fp32.gin"], [])
  with pytest.raises(UserError, match=r"'runs/train.gin' is given twice"):
    ginutils.parse(["runs/train.gin", "runs/train.gin"], [])
  ginutils.parse(["runs/train.gin", "precision/bf16.gin"], [])    # one of each: fine


def test_gin_cleared_between_tests():
  assert gin.config_str().strip() == ""


# ---------------------------------------------------------------- gin edge cases, via a runner
def _train_main(argv):
  """(exit code, stderr) of runners/train.py main(argv), in-process (bad gin is refused
  before any work)."""
  import contextlib
  import importlib.util
  import io
  spec = importlib.util.spec_from_file_location(
      "runner_train_gin", os.path.join(os.path.dirname(GIN_DIR), "runners", "train.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  err = io.StringIO()
  with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    rc = module.main(list(argv))
  gin.clear_config()
  return rc, err.getvalue()


def _refused(tmp_path, files, *bindings):
  """Writes {name: text} gin files into tmp_path, runs train with the first of them."""
  for name, text in files.items():
    (tmp_path / name).write_text(text)
  run_dir = tmp_path / "run"
  argv = ["--gin_file=experiments/recall.gin", f"--run_dir={run_dir}"]
  argv += [f"--gin_file={tmp_path / next(iter(files))}"] if files else []
  rc, err = _train_main(argv + [f"--gin_bindings={b}" for b in bindings])
  lines = [line for line in err.splitlines() if line.strip()]
  assert rc == 2, err
  assert len(lines) == 1 and lines[0].startswith("train: error: "), err
  assert "Traceback" not in err and "RecursionError" not in err
  assert not run_dir.exists()
  return lines[0]


def test_include_cycle_names_the_files_and_lines(tmp_path):
  a, b = tmp_path / "a.gin", tmp_path / "b.gin"
  line = _refused(tmp_path, {"a.gin": f"train.seed = 1\ninclude '{b}'\n",
                             "b.gin": f"include '{a}'\n"})
  assert line == (f"train: error: Gin include cycle: {a} includes {b} ({a}, line 2); {b} "
                  f"includes {a} ({b}, line 1). A file cannot include itself, directly or "
                  f"through others; remove one of these include lines.")


def test_file_including_itself(tmp_path):
  a = tmp_path / "a.gin"
  line = _refused(tmp_path, {"a.gin": f"include '{a}'\n"})
  assert f"Gin include cycle: {a} includes {a} ({a}, line 1)" in line


@pytest.mark.parametrize("text,where,what", [
    ("train.seed = 1\ntrain.steps = (1,\n", "line 2", "the '(' opened there is never closed"),
    ("train.steps = [1,\n  2\n", "line 1", "the '[' opened there is never closed"),
    ("train.steps = (1,\ntrain.seed = 2\n", "line 1",
     "the '(' opened there is not closed before line 2 ('train.seed = 2')"),
    ("train.seed = 1\ntrain.steps = '''abc\n", "line 2", "unterminated string"),
])
def test_unterminated_expression_names_file_and_line(tmp_path, text, where, what):
  line = _refused(tmp_path, {"bad.gin": text})
  assert f"{tmp_path / 'bad.gin'}, {where}: " in line and what in line, line


def test_unterminated_command_line_binding(tmp_path):
  line = _refused(tmp_path, {}, "train.seed = 1", "train.steps = (1,")
  assert "in the command-line binding 'train.steps = (1,': unterminated expression" in line


@pytest.mark.parametrize("text,shown", [
    ("x = %x\ntrain.seed = %x\n", "x = %x ({f}, line 1)"),
    ("x = %y\ny = %x\ntrain.seed = %x\n", "x = %y ({f}, line 1) -> y = %x ({f}, line 2)"),
    ("optimizer.learning_rate = @optimizer()\n",
     "optimizer.learning_rate = @optimizer() ({f}, line 1)"),
    ("m = @optimizer()\noptimizer.learning_rate = %m\n",
     "m = @optimizer() ({f}, line 1) -> optimizer.learning_rate = %m ({f}, line 2)"),
])
def test_self_reference_is_refused_before_recursing(tmp_path, text, shown):
  line = _refused(tmp_path, {"cycle.gin": text})
  assert "reference themselves in a cycle" in line
  assert shown.format(f=tmp_path / "cycle.gin") in line, line


def test_references_without_a_cycle_still_parse():
  ginutils.parse([], ["x = 3", "y = %x", "train.seed = %y",
                      "decode/precision.dtype = %dtype", "dtype = 'bfloat16'"])
  assert _phase_precision("decode").dtype == "bfloat16"


# --- what a runner reaches: derived from the code (ginutils.calls) -------------------------

def _calls_leaf_helper():
  return _calls_leaf()


@gin.configurable("test_calls_leaf")
def _calls_leaf(x: int = 1):
  return x


@gin.configurable("test_calls_root")
def _calls_root(y: int = 2):
  return _calls_leaf_helper() + y   # through a plain function, not a reference


@gin.configurable("test_calls_default")
def _calls_default(job=_calls_root):
  return job()


def test_calls_are_read_from_the_code():
  from attnprec.ginutils import calls
  ginutils._import_configurables()  # noqa: SLF001
  # the edges a runner needs and the code makes: train's optimizer, mesh and fault
  # injection, the audit's model and optimizer (through its helpers), precision's
  # block sizes (a BlockSizes field), train_job's default job
  assert {"optimizer", "mesh", "fault_injection"} <= calls.calls("train")
  assert {"model", "optimizer"} <= calls.calls("audit")
  assert calls.calls("precision") == {"blockwise"}
  assert "train_recall" in calls.calls("train_job")
  assert "train" in calls.calls("train_text")
  assert calls.calls("test_calls_root") == {"test_calls_leaf"}
  assert calls.calls("test_calls_default") == {"test_calls_root"}
  assert calls.calls("test_calls_leaf") == frozenset()
  assert calls.reached(["test_calls_default"]) == {
      "test_calls_default", "test_calls_root", "test_calls_leaf"}


def test_reached_follows_references_in_bindings():
  from attnprec.ginutils import calls
  ginutils._import_configurables()  # noqa: SLF001
  gin.clear_config()
  try:
    gin.parse_config("test_calls_leaf.x = 3\ndecode.job = @generate_text")
    assert {"decode", "generate_text"} <= calls.reached(["decode"])
    assert "recall_eval" not in calls.reached(["decode"])
  finally:
    gin.clear_config()


def test_a_loader_runner_reads_model_scan_layers_and_no_other_model_binding():
  """A runner that loads a checkpoint takes its architecture from the checkpoint's files:
  it reads `model.scan_layers` (the program's form, `config.bound_scan_layers`) and
  nothing else of `model.*`, so `--gin.model.num_layers=3` is refused there (it would be
  ignored) while `audit`, which builds the model from `model.*`, reads all of it."""
  from attnprec.ginutils import calls, config_checks
  ginutils._import_configurables()  # noqa: SLF001
  gin.clear_config()
  try:
    gin.parse_config("decode.job = @generate_text")
    reached = calls.reached(["decode/precision", "decode"])
    assert "model.scan_layers" in reached and "model" not in reached
    config_checks.check_command_line(["model.scan_layers = True"],
                                     ["decode/precision", "decode"], "decode")
    with pytest.raises(UserError, match="model.num_layers is set on the command line"):
      config_checks.check_command_line(["model.num_layers = 3"],
                                       ["decode/precision", "decode"], "decode")
    assert "model" in calls.reached(["audit"])
  finally:
    gin.clear_config()


def test_every_configurable_is_the_outermost_decorator():
  # A decorator above @gin.configurable hides the configurable from `ginutils.calls`
  # (runners then refuse its bindings) and runs before gin injects them (bound values
  # skip the checks): the module attribute must be gin's own wrapper.
  import importlib
  from attnprec.ginutils import _gin as gin_registry
  ginutils._import_configurables()  # noqa: SLF001
  wrong = []
  for selector, c in gin_registry.registered():
    wrapped = c.wrapped
    module = getattr(wrapped, "__module__", "") or ""
    if selector.startswith("gin.") or not module.startswith("attnprec") or \
        isinstance(wrapped, type):     # classes are registered through factories
      continue
    attr = getattr(importlib.import_module(module), wrapped.__name__, None)
    if attr is not None and attr is not c.wrapper:
      wrong.append(f"{module}.{wrapped.__name__}")
  assert not wrong, wrong
