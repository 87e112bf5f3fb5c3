"""The precision study (`make study`): its float64 reference, its metrics, its presets, a
whole (tiny) sweep end to end, and its bad-input handling.

Comparisons: the float64 NumPy forward pass against the JAX model under fp32/HIGHEST
(independent implementations); metrics against hand-computed values; the sweep's fp32
preset against the reference (bitwise equal on CPU, where `precision` changes no
numbers: a documented XLA:CPU fact this asserts).
"""
import dataclasses
import glob
import importlib.util
import json
import os

import gin
import jax
import numpy as np
import pytest

from attnprec import ginutils, runs
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.precision import REFERENCE
from attnprec.study import float64, measure
from attnprec import presets as preset_lib
from attnprec.study.sweep import study
from attnprec.tasks.recall import RecallTask
from test_train_utils import numpy_params

RUNNER = os.path.join(os.path.dirname(ginutils.REPO_GIN_DIR), "runners", "study.py")
PNG = b"\x89PNG\r\n\x1a\n"


# ----------------------------------------------------------------------------- float64
@pytest.mark.parametrize("features", [
    dict(),
    dict(qk_norm=True, norm_plus_one=True, embed_scale=True, post_attn_norm=True,
         post_mlp_norm=True, activation="gelu_tanh", attn_logit_soft_cap=20.0,
         final_logit_soft_cap=15.0, sliding_window=3, layer_pattern=("local", "global"),
         rope_base_local=100.0, query_scale=0.3),
    dict(qkv_bias=True, tie_embeddings=False, num_kv_heads=4, rope_scale=2.0),
])
def test_float64_forward_matches_the_model(features):
  fields = dict(vocab_size=23, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                head_dim=8, mlp_hidden=48)
  config = ModelConfig(**{**fields, **features})
  # params drawn in NumPy at init_params' scales (no compile of the model's init), plus
  # non-trivial norm scales and biases, so every parameter matters; the forward is
  # jitted as one program (op by op, it compiles ~100 small ones)
  rng = np.random.default_rng(0)
  params = jax.tree_util.tree_map(lambda x: x + 0.1 * rng.standard_normal(x.shape)
                                  .astype(np.float32), numpy_params(config, seed=1))
  tokens = rng.integers(0, 23, (2, 11)).astype(np.int32)
  logits, attn, _ = jax.jit(lambda p, t: measure.collect(config, p, t, REFERENCE))(params, tokens)
  logits64, attn64 = float64.forward(config, params, tokens)
  scale = np.abs(logits64).max()
  assert np.abs(np.asarray(logits) - logits64).max() <= 1e-5 * scale
  for a, a64 in zip(attn, attn64):
    assert measure.rel_l2(a, a64) < 1e-5


# ----------------------------------------------------------------------------- metrics
def test_metrics_on_known_values():
  assert measure.rel_l2([3.0, 4.0], [3.0, 4.0]) == 0
  assert measure.rel_l2([3.0, 5.0], [3.0, 4.0]) == pytest.approx(0.2)
  assert measure.max_abs([1.0, -2.0], [1.5, 0.0]) == 2.0
  logits = np.array([[0.0, np.log(3.0)]])             # p = (1/4, 3/4)
  assert measure.kl(logits, logits) == 0
  want = 0.25 * np.log(0.25 / 0.5) + 0.75 * np.log(0.75 / 0.5)
  assert measure.kl(logits, np.zeros((1, 2))) == pytest.approx(want)
  ref = np.array([[1, 2, 3, 4], [1, 2, 3, 4]])
  got = np.array([[1, 2, 3, 4], [1, 9, 3, 9]])
  g = measure.greedy_agreement(got, ref)
  assert g == {"agreement": 0.75, "identical": 0.5, "first_divergence_mean": 2.5,
               "first_divergence_min": 1, "steps": 4}
  counted = np.array([[0, 1, 0, 1], [0, 0, 1, 1]], bool)  # only these slots count
  g = measure.greedy_agreement(got, ref, counted)
  assert g["agreement"] == 0.75 and g["first_divergence_min"] == 1 and g["steps"] == 2


# ----------------------------------------------------------------------------- presets
def test_presets():
  sweep = preset_lib.load_sweep(None)
  assert [n for n, _ in sweep] == preset_lib.available()
  assert {"bf16", "fp32", "fp32_attention", "fp32_logits", "fp32_qk", "highest"} <= set(
      preset_lib.available())
  bf16 = dict(sweep)["bf16"]
  assert (bf16.dtype, bf16.float32_qk_product, bf16.float32_logits) == ("bfloat16", False,
                                                                        False)
  with pytest.raises(UserError, match="Unknown precision preset 'bf17'.*bf16"):
    preset_lib.load_sweep(["bf17"])
  with pytest.raises(UserError, match="empty"):
    preset_lib.load_sweep([])


def test_preset_file_with_other_bindings_is_refused(tmp_path):
  path = tmp_path / "mine.gin"
  path.write_text("precision.dtype = 'bfloat16'\nmodel.d_model = 3\n")
  with pytest.raises(UserError, match="mine.gin:2"):
    preset_lib.load_preset(str(path))
  path.write_text("precision.dtype = 'bfloat16'\nprecision.float32_logits = True\n"
                  "precision.dtype = 'float32'\n")
  with pytest.raises(UserError, match=r"mine.gin:3: binds precision.dtype a second time "
                                      r"\(line 1 binds it too\)"):
    preset_lib.load_preset(str(path))
  path.write_text("# mine\nprecision.dtype = 'bfloat16'  # bf16\nprecision.float32_logits = False\n")
  name, prec = preset_lib.load_preset(str(path))
  assert name == "mine" and prec.dtype == "bfloat16" and not prec.float32_logits


# ----------------------------------------------------------------------------- sweep
TASK = RecallTask(num_keys=8, value_vocab=8, value_len=1, num_pairs=4, num_queries=4)


def _checkpoint(path, max_seq_len=64, num_layers=2):
  config = ModelConfig(vocab_size=TASK.vocab_size, d_model=16, num_layers=num_layers, num_heads=2,
                       num_kv_heads=1, head_dim=8, mlp_hidden=32, max_seq_len=max_seq_len)
  runs.save_params(str(path), numpy_params(config, seed=0))   # init_params' scales, no compile
  runs.write_json(str(path), "model.json", runs.config_dict(config))
  runs.write_json(str(path), "task.json", dataclasses.asdict(TASK))
  return str(path)


SMALL = dict(presets=("bf16", "fp32"), pair_counts=(2, 6), batch=4, decode_steps=3,
             num_queries=4, logit_positions=8, timing_rounds=1, progress=False)


def test_tiny_sweep_end_to_end(tmp_path):
  ckpt = _checkpoint(tmp_path / "ckpt")
  out_dir = tmp_path / "study"
  res = study(run_dir=str(out_dir), model=ckpt, **SMALL)
  assert sorted(os.listdir(out_dir)) == sorted(
      ["results.json", "report.md", "error_vs_context.png", "accuracy_vs_context.png",
       "cost_vs_error.png", "error_by_layer.png"])          # no temporary files left
  for name in os.listdir(out_dir):
    if name.endswith(".png"):
      assert (out_dir / name).read_bytes()[:8] == PNG
  saved = json.loads((out_dir / "results.json").read_text())
  assert [c["name"] for c in saved["configs"]] == ["bf16", "fp32"]
  from attnprec.evals import sizes         # what sizes reads back is what this run wrote
  assert sizes._schema_problem(saved, "study") is None
  bf16, fp32 = (c["per_length"] for c in saved["configs"])
  for r in fp32:   # fp32 / DEFAULT vs the fp32 / HIGHEST reference: identical on CPU
    assert max(r["prefill_attn_rel_l2"] + r["decode_attn_rel_l2"]) == 0
    assert r["logits_kl"] == 0 and r["greedy"]["agreement"] == 1
  for r in bf16:   # bf16 rounding is visible, and bounded
    assert len(r["prefill_attn_rel_l2"]) == 2 and len(r["decode_attn_rel_l2"]) == 2
    assert 1e-4 < max(r["prefill_attn_rel_l2"]) < 0.1
    assert 1e-4 < max(r["decode_attn_rel_l2"]) < 0.1
    assert 0 <= r["accuracy"] <= 1 and r["greedy"]["steps"] == TASK.num_queries
  floor = saved["reference"]["per_length"][0]["float64"]
  assert max(floor["attn_rel_l2"]) < 1e-5       # the reference is fp32-accurate
  report = (out_dir / "report.md").read_text()
  assert "--xla_allow_excess_precision=false" in report
  assert "no numeric effect" in report and "| bf16 |" in report
  assert res["timing"]["baseline"] == "bf16"
  assert [c["time_ratio"] for c in res["configs"]][0] == 1.0


# Every configuration of this sweep is exact (fp32), so the error plots have no line: no
# legend is drawn (matplotlib would warn about an empty one; warnings are errors here).
@pytest.mark.filterwarnings("error:No artists with labels found:UserWarning")
def test_study_with_a_logit_offset_reports_it(tmp_path):
  """The offset (attnprec/study/offsets.py) is calibrated, applied to every configuration
  and the reference alike (fp32 matches the reference exactly, float64 follows it), and
  reported. One layer: per-layer calibration is tests/test_study_offsets.py's. The fp32
  preset alone: it is the one whose rows are asserted (a bf16 preset would add its three
  programs and no assertion)."""
  ckpt = _checkpoint(tmp_path / "ckpt", num_layers=1)
  out_dir = tmp_path / "study"
  study(run_dir=str(out_dir), model=ckpt, **{**SMALL, "presets": ("fp32",), "pair_counts": (3,)},
        logit_offset=100.0)
  saved = json.loads((out_dir / "results.json").read_text())
  assert saved["logit_offset"] == 100.0 and saved["key_offset"] is True
  assert [st["mean"] for st in saved["offset_stats"]] == pytest.approx([100.0], rel=1e-4)
  assert [c["name"] for c in saved["configs"]] == ["fp32"]
  fp32 = saved["configs"][0]["per_length"][0]
  assert max(fp32["prefill_attn_rel_l2"]) == 0 and fp32["greedy"]["agreement"] == 1
  floor = saved["reference"]["per_length"][0]["float64"]
  assert max(floor["attn_rel_l2"]) < 1e-4     # the float64 pass applies the offset too
  report = (out_dir / "report.md").read_text()
  assert "**Logit offset:**" in report and "shifts each query's logits by 100" in report


def test_decode_errors_come_from_decode_steps(tmp_path):
  """The decode measurement runs single-token steps from a cache: under fp32 it agrees
  with the full forward pass at the same positions (a check of the measurement itself).
  The shapes are the tiny sweep's at 2 pairs (batch 4, 13 tokens, 8 logit positions kept,
  3 decode steps), so both programs are the ones that sweep compiled."""
  ckpt = _checkpoint(tmp_path / "ckpt")
  from attnprec.study import models
  m = models.load_model(ckpt)
  L = TASK.context_len(SMALL["pair_counts"][0], SMALL["num_queries"])
  prefix = L - SMALL["decode_steps"]
  tokens = np.random.default_rng(0).integers(2, 18, (SMALL["batch"], L)).astype(np.int32)
  _, _, attn = measure.forward_fn(m.config, REFERENCE, SMALL["logit_positions"])(m.params, tokens)
  _, dec_attn = measure.decode_fn(m.config, REFERENCE, prefix)(m.params, tokens)
  np.testing.assert_allclose(np.asarray(dec_attn),
                             np.moveaxis(np.asarray(attn)[:, :, prefix:], 2, 0), atol=2e-6)


def test_a_cache_preset_measures_its_cache_in_the_forward_rows():
  """A quantized-cache preset's forward (prefill error, NLL, logits) runs through its cache:
  it equals a prefill into that cache done by hand (the model's own cached apply, an
  independent path), and differs from the same flags with the compute-dtype cache (the
  setting is measured, not silently ignored); a compute-cache preset is unchanged. One
  layer: the cache, not the depth, is the point."""
  from attnprec import model as model_lib
  from attnprec.cache import init_cache
  config = ModelConfig(vocab_size=23, d_model=32, num_layers=1, num_heads=4, num_kv_heads=2,
                       head_dim=8, mlp_hidden=48)
  params = numpy_params(config, seed=3)
  tokens = np.random.default_rng(1).integers(0, 23, (2, 10)).astype(np.int32)
  exact = dataclasses.replace(REFERENCE, matmul_precision="default",
                              einsum_precision="default")
  int8 = dataclasses.replace(exact, kv_cache_k_dtype="int8", kv_cache_v_dtype="int8",
                             kv_cache_k_scale="token", kv_cache_v_scale="token")
  nll_c, logits_c, _ = measure.forward_fn(config, exact, 10)(params, tokens)
  nll_q, logits_q, _ = measure.forward_fn(config, int8, 10)(params, tokens)
  by_hand = jax.jit(lambda p, t: model_lib.transformed(config).apply(
      p, t, None, init_cache(config, 2, 10, int8.compute_dtype, int8.cache_storage),
      precision=int8).logits)(params, tokens)
  # two jitted programs: float32 accumulation order only; the int8 cache moves the
  # logits by more than 100x the bound.
  np.testing.assert_allclose(np.asarray(logits_q), np.asarray(by_hand), rtol=0, atol=1e-5)
  moved = np.abs(np.asarray(logits_q) - np.asarray(logits_c)).max()
  assert moved > 1e-3, moved
  assert not np.array_equal(np.asarray(nll_q), np.asarray(nll_c))
  plain = jax.jit(lambda p, t: model_lib.transformed(config).apply(
      p, t, precision=exact).logits)(params, tokens)
  np.testing.assert_allclose(np.asarray(logits_c), np.asarray(plain), rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- runner
def _runner():
  spec = importlib.util.spec_from_file_location("study_runner", RUNNER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_runner_bad_input_exits_2_and_writes_nothing(tmp_path):
  runner = _runner()
  ckpt = _checkpoint(tmp_path / "ckpt", max_seq_len=24)
  base = [f"--gin.study.model='{ckpt}'", "--gin.study.batch=2", "--gin.study.progress=False"]
  cases = {
      "unknown_preset": ["--gin.study.presets=('bf16', 'nope')"],
      "empty_sweep": ["--gin.study.presets=()", "--gin.study.extra_presets=()"],
      "too_long": ["--gin.study.presets=('bf16',)", "--gin.study.pair_counts=(8,)"],
      "bad_model": ["--gin.study.model='no-such-model'"],
      "negative_offset": ["--gin.study.logit_offset=-5.0"],
      "unknown_text": ["--gin.study.text='wikipedia'"],
      "text_for_recall": ["--gin.study.text='project_docs'"],   # recall reads no text
      "stdlib_for_recall": ["--gin.study.text='stdlib'"],       # not even the default
  }
  for name, flags in cases.items():
    run_dir = tmp_path / name
    assert runner.main(base + flags + [f"--run_dir={run_dir}"]) == 2, name
    assert not run_dir.exists() or not os.listdir(run_dir), name
  blocker = tmp_path / "file"
  blocker.write_text("x")
  assert runner.main(base + [f"--run_dir={blocker / 'sub'}"]) == 2


def test_study_refuses_to_run_with_excess_precision(tmp_path, monkeypatch):
  monkeypatch.setenv("XLA_FLAGS", "")
  with pytest.raises(UserError, match="xla_allow_excess_precision=false"):
    study(run_dir=str(tmp_path / "x"), model="recall-tiny", **SMALL)


@pytest.mark.parametrize("name", sorted(
    os.path.basename(p) for p in glob.glob(
        os.path.join(ginutils.REPO_GIN_DIR, "experiments", "study_*.gin"))))
def test_every_study_file_names_presets_that_load(name):
  """Each experiment's study.presets and study.extra_presets load (paths are relative to
  the repository root, where make runs), and the KV-cache study's variants are what their
  names say."""
  gin.clear_config()
  ginutils.parse([f"experiments/{name}"], [])
  presets = gin.query_parameter("study.presets") if _bound("study.presets") else None
  extra = gin.query_parameter("study.extra_presets") if _bound("study.extra_presets") else ()
  gin.clear_config()
  cwd = os.getcwd()
  os.chdir(os.path.dirname(ginutils.REPO_GIN_DIR))
  try:
    sweep = dict(preset_lib.load_sweep(presets, extra))
  finally:
    os.chdir(cwd)
  if name.startswith("study_kv_"):
    assert sweep["kv_int8_channel"].cache_storage.k_scale == "channel"
    assert sweep["kv_fp8_channel"].kv_cache_k_dtype == "float8_e4m3fn"
    off = sweep["kv_int8_flags_off"]
    assert (off.float32_qk_product, off.float32_logits, off.kv_cache_k_dtype) == \
        (False, False, "int8")


def _bound(binding: str) -> bool:
  try:
    gin.query_parameter(binding)
    return True
  except ValueError:
    return False


def test_the_configurations_table_names_the_kv_cache():
  from attnprec.study import report
  int8 = dataclasses.replace(REFERENCE, kv_cache_k_dtype="int8", kv_cache_v_dtype="int8",
                             kv_cache_k_scale="channel", kv_cache_v_scale="token")
  res = {"reference": {"precision": dataclasses.asdict(REFERENCE)},
         "configs": [{"name": "kv", "precision": dataclasses.asdict(int8)}]}
  rows = report.precision_table(res).splitlines()
  assert rows[0].endswith("| kernel | KV cache |")
  assert rows[2].endswith("| kv_cache=k:compute,v:compute |")
  assert rows[3].endswith("| kv_cache=k:int8/channel,v:int8/token |")


def test_the_held_out_text_is_the_projects_own_docs_frozen_and_pinned(tmp_path):
  """'project_docs' is README.md then docs/*.md by name as of HELDOUT_COMMIT, frozen in a
  shipped file and pinned by its SHA-256; another text, a checkout without them, or an
  unknown text, is refused by name."""
  import gzip
  import hashlib
  from attnprec.study import inputs
  text = inputs.load_text("project_docs")
  assert hashlib.sha256(text.encode()).hexdigest() == inputs.HELDOUT_SHA256
  assert text.startswith("# attnprec") and "## Where to go next" in text
  try:                                  # made again from its commit, byte for byte
    assert inputs.freeze_project_docs() == text
  except Exception as e:  # noqa: BLE001 -- a clone without the commit: said, not hidden
    if "CalledProcessError" not in type(e).__name__:
      raise
  files = inputs.project_docs_files()
  assert os.path.basename(files[0]) == "README.md" and len(files) > 2
  assert [os.path.basename(f) for f in files[1:]] == sorted(os.path.basename(f) for f in files[1:])
  edited = tmp_path / "edited.txt.gz"
  edited.write_bytes(gzip.compress(text.replace("attnprec", "attnprex", 1).encode()))
  with pytest.raises(UserError, match="not the pinned"):
    inputs.heldout_text(str(edited))
  info = inputs.describe_text(text, "project_docs")
  assert info["text"] == "project_docs" and "held-out" in info["source"]
  assert info["chars"] == len(text)
  assert inputs.describe_text("abc")["sha256"] != inputs.describe_text("abd")["sha256"]
  (tmp_path / "README.md").write_text("x")
  with pytest.raises(UserError, match="docs"):
    inputs.project_docs_files(str(tmp_path))
  with pytest.raises(UserError, match="'stdlib', 'project_docs'"):
    inputs.load_text("wikipedia")
