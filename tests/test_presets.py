"""Precision presets (`attnprec.presets`): a preset is a gin file of gin/precision/, read
with gin's parser into a `Precision`: what the study and the evals load is what gin binds
when a runner is given the same file."""
import gin
import pytest

from attnprec import presets
from attnprec.errors import UserError
from attnprec.precision import Precision


@pytest.mark.parametrize("name", presets.available())
def test_preset_is_what_gin_binds(name):
  import attnprec.precision  # noqa: F401  registers `precision`
  path = presets.preset_path(name)
  gin.clear_config()
  try:
    gin.parse_config_file(path)
    bound = gin.get_bindings("precision")
  finally:
    gin.clear_config()
  assert bound and presets.bindings(path) == bound
  short, precision = presets.load_preset(name)
  assert short == name and precision == Precision(**bound)


@pytest.mark.parametrize("text,bad", [
    ("precision.dtype = 'bfloat16'\ntrain.steps = 1\n", "train.steps = 1"),
    ("decode/precision.dtype = 'bfloat16'\n", "decode/precision.dtype"),
    ("precision.dtype = %x\n", "%x"),
    ("precision.dtype = @precision()\n", "@precision()"),
    ("include 'precision/bf16.gin'\n", "include"),
    ("precision.carrier_weights = True\n", "carrier_weights"),
    ("precision.dtype = bfloat16\n", "bfloat16"),
])
def test_preset_holds_only_literal_precision_bindings(tmp_path, text, bad):
  path = tmp_path / "mine.gin"
  path.write_text(text)
  with pytest.raises(UserError, match="a precision preset may hold only") as e:
    presets.load_preset(str(path))
  assert bad in str(e.value) and str(path) in str(e.value)


def test_preset_defaults_and_comments(tmp_path):
  path = tmp_path / "mine.gin"
  path.write_text("# a comment\nprecision.dtype = 'bfloat16'  # trailing\n\n"
                  "precision.float32_logits = False\n")
  assert presets.load_preset(str(path)) == (
      "mine", Precision(dtype="bfloat16", float32_logits=False))
