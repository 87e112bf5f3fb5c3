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


def test_a_variant_sets_only_what_its_preset_leaves_unbound():
  """`presets.variant`: the benches' named configurations are gin presets plus fields the
  file does not bind; one that would redefine the preset's precision is refused."""
  v = presets.variant("bf16", kernel="blockwise", key_offset="bias")
  assert v == Precision(dtype="bfloat16", float32_qk_product=False, float32_logits=False,
                        kernel="blockwise", key_offset="bias")
  with pytest.raises(UserError, match=r"variant of precision preset 'bf16' sets "
                     r"float32_logits=True, which .*bf16.gin binds \(float32_logits=False\)"
                     r".*may set only fields .*kernel"):
    presets.variant("bf16", float32_logits=True)


def test_no_bench_restates_a_precision():
  """One registry: no `Precision(...)` in the benches or the device check sets a field a
  gin preset binds (dtype, the flags, einsum / matmul precision, the cache's dtypes and
  scales); they name a preset (`presets.variant`) instead. Read from the source (ast)."""
  import ast
  import glob
  import os
  root = os.path.dirname(os.path.dirname(os.path.abspath(presets.__file__)))
  bound = set().union(*(presets.bindings(presets.preset_path(n))
                        for n in presets.available()))
  assert {"dtype", "float32_qk_product", "float32_logits"} <= bound
  files = sorted(glob.glob(os.path.join(root, "attnprec", "bench", "*.py"))) + \
      [os.path.join(root, "runners", "device_check.py")]
  restated, calls = [], 0
  for path in files:
    with open(path) as f:
      tree = ast.parse(f.read())
    for node in ast.walk(tree):
      if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Precision":
        calls += 1
        named = {k.arg for k in node.keywords if k.arg} & bound
        if named:
          restated.append(f"{os.path.relpath(path, root)}:{node.lineno} sets "
                          f"{sorted(named)}")
  assert calls, "no Precision(...) call read: the check would find nothing"
  assert not restated, restated


def test_a_preset_named_twice_in_a_sweep_is_refused():
  """('bf16', 'bf16'): one row would be dropped, the setting as given not read."""
  from attnprec import presets
  with pytest.raises(UserError, match=r"names the configuration 'bf16' twice"):
    presets.load_sweep(("bf16", "bf16"))
