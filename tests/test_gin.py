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


def test_gin_cleared_between_tests():
  assert gin.config_str().strip() == ""
