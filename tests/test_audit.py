"""The audit (`make audit`): passes on every precision preset in every phase, and FAILS when
inference drops the attention flags (the seed's bug) or the einsum precision.

What the audit compares against: the contract table `attnprec.contract.stage_dtypes` and
the phase's `Precision`; the programs are lowered from the real train step, prefill and
decode step (`attnprec.train`, `attnprec.decoding`). The broken variants below are built
here by wrapping `decoding.prefill` / `decoding.decode_step`, exactly the way the seed
applied the flags only in training.
"""
import dataclasses
import functools
import glob
import importlib.util
import json
import os

import jax
import pytest

from attnprec import audit, decoding, ginutils
from attnprec.inspect import compiled
from attnprec.inspect.report import compiled_text
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.precision import Precision, phase_precision
from test_train_utils import use_compilation_cache

CONFIG = ModelConfig(vocab_size=13, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_hidden=32, max_seq_len=64)
# The same model with one layer, for the claims that are per program, not per layer: the
# deliberately broken variants (decoding that drops a flag, a narrowing kernel, the broken
# KV-cache rows), the other kernels and settings, a per-channel key scale, dropped
# op_names. CONFIG's two layers where the rows per layer are the point. ONE's unpatched
# bf16 programs are compiled by the text-compile-options test alone (see there).
ONE = dataclasses.replace(CONFIG, num_layers=1)
PRESETS = sorted(glob.glob(os.path.join(ginutils.REPO_GIN_DIR, "precision", "*.gin")))
# The quantized-KV-cache presets (int8 / float8 codes with float32 scales): the audit reads
# their cache rows back from the prefill and decode programs (tests at the end).
KV_PRESETS = [p for p in PRESETS if os.path.basename(p).startswith("kv_")]
RUNNER = os.path.join(os.path.dirname(ginutils.REPO_GIN_DIR), "runners", "audit.py")
# The serving programs: tests that assert only on them compile only them (`run_audit`'s
# `compile`), the train step is still lowered and checked.
SERVING = ("prefill", "decode")

# Tests of what XLA:CPU compiled (its fusions, its rewrites, its dropped op_names): the
# programs are lowered for cpu and `run_audit` compiles only for the backend this process
# runs on, so elsewhere they have no compiled program to read. What a TPU compiled is
# tested in tests/test_tpu_fixtures.py and tests/test_tpu.py for the attention and dense
# dots; the quantized KV cache's compiled rows (kv_int8 / kv_fp8) are not yet tested on
# a TPU's compiled program.
xla_cpu = pytest.mark.skipif(
    jax.default_backend() != "cpu",
    reason="reads what XLA:CPU compiled (lowered for cpu, compiled only on a CPU backend); "
           "the TPU's compiled attention and dense dots are tested in "
           "tests/test_tpu_fixtures.py and tests/test_tpu.py, its KV-cache rows not yet")


# Identical programs are compiled once (the persistent compilation cache the suite's other
# files turn on when they are collected; here too when this file runs alone). On a TPU the
# suite runs as it always did.
if jax.default_backend() == "cpu":
  use_compilation_cache()


def _audit(config, train, decode, compile):
  """`audit.run_audit` of unpatched programs, once per (config, precisions, compile) in
  this process: tests that audit the same thing assert on one result (never used with a
  monkeypatched kernel or decoding)."""
  key = (config, train, decode, compile)
  if key not in _AUDITS:
    _AUDITS[key] = audit.run_audit(config, train, decode, compile=compile)
  return _AUDITS[key]


_AUDITS = {}


@functools.lru_cache(maxsize=None)
def _lowered_safe():
  """{phase: (precision, lowered)} of CONFIG under Precision(dtype='bfloat16') in both
  phases (unpatched), lowered once for the tests that read one of them."""
  safe = Precision(dtype="bfloat16")
  return audit.lower_programs(CONFIG, safe, safe)


def _phases(files, bindings=()):
  ginutils.parse(files, list(bindings))
  out = {}
  for phase in ginutils.PHASES:
    with ginutils.phase(phase):
      out[phase] = phase_precision()
  return out


def _forward_attention_rows(result, phase):
  return [r for r in result["phases"][phase]["attention"] if not r["backward"]]


# The presets whose audit other tests compile too: the same audit, run once
# (test_compiled_programs_pass, test_kv_presets_pass_the_compiled_check; the compiled
# checks only add problems, and where the backend is not cpu they are skipped).
PRESET_COMPILE = {"bf16.gin": True, "fp32_attention.gin": True, "fp32.gin": True,
                  "kv_int8.gin": SERVING, "kv_fp8.gin": SERVING}


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: os.path.basename(p))
def test_every_preset_passes_in_every_phase(preset):
  p = _phases([preset])
  result = _audit(CONFIG, p["train"], p["decode"],
                  compile=PRESET_COMPILE.get(os.path.basename(preset), False))
  assert result["ok"], result["problems"]
  for phase in audit.PHASES:
    rows = _forward_attention_rows(result, phase)
    # one qk and one wv dot per layer, each checked for types and precision
    assert sorted((r["layer"], r["site"]) for r in rows) == [
        (0, "qk"), (0, "wv"), (1, "qk"), (1, "wv")], (phase, rows)
    assert all(r["checked"] == "types+precision" and r["ok"] for r in rows)
    dense = result["phases"][phase]["dense"]
    assert len([r for r in dense if not r["backward"]]) == 7 * CONFIG.num_layers + 1


def test_the_qk_result_type_follows_the_flag_in_decode():
  """The audit reads the types it checks: flag on -> f32 logits, flag off -> bf16.
  (These are the fp32_attention.gin and bf16.gin precisions: their audits, shared.)"""
  for flag, want in ((True, "f32"), (False, "bf16")):
    prec = Precision(dtype="bfloat16", float32_qk_product=flag, float32_logits=flag)
    result = _audit(CONFIG, prec, prec, compile=True)
    qk = [r for r in _forward_attention_rows(result, "decode") if r["site"] == "qk"]
    assert {r["result"] for r in qk} == {want}, qk


def _train_only_flags(monkeypatch, **overrides):
  """Decoding that ignores the decode precision's flags (the seed's bug)."""
  real_prefill, real_step = decoding.prefill, decoding.decode_step

  def prefill(params, *args, precision, **kwargs):
    return real_prefill(params, *args, precision=dataclasses.replace(precision, **overrides),
                        **kwargs)

  def decode_step(params, *args, precision, **kwargs):
    return real_step(params, *args, precision=dataclasses.replace(precision, **overrides),
                     **kwargs)

  monkeypatch.setattr(decoding, "prefill", prefill)
  monkeypatch.setattr(decoding, "decode_step", decode_step)


@pytest.fixture(scope="module")
def seed_bug():
  """The seed's bug, audited once (lowered and, on cpu, compiled): decoding drops both
  flags of a precision that sets both, in both phases."""
  with pytest.MonkeyPatch.context() as mp:
    _train_only_flags(mp, float32_qk_product=False, float32_logits=False)
    safe = Precision(dtype="bfloat16")          # both flags on, in both phases
    return audit.run_audit(CONFIG, safe, safe)


def test_decode_ignoring_float32_qk_product_fails(seed_bug):
  result = seed_bug
  assert not result["ok"]
  assert result["phases"]["train"]["ok"]          # training still honours the flags
  for phase in ("prefill", "decode"):
    problems = result["phases"][phase]["problems"]
    assert any("QK^T logits are bf16, expected f32" in p for p in problems), problems
    assert any("probabilities must enter as f32" in p for p in problems), problems
  assert audit.verdict(result).startswith("FAIL")


def test_decode_ignoring_only_float32_logits_fails(monkeypatch):
  _train_only_flags(monkeypatch, float32_logits=False)
  prec = Precision(dtype="bfloat16", float32_qk_product=False, float32_logits=True)
  result = audit.run_audit(ONE, prec, prec, compile=False)
  assert not result["ok"] and result["phases"]["train"]["ok"]
  assert not result["phases"]["decode"]["ok"]


def test_decode_dropping_einsum_precision_fails(monkeypatch):
  _train_only_flags(monkeypatch, einsum_precision="default")
  prec = Precision(einsum_precision="highest")
  result = audit.run_audit(ONE, prec, prec, compile=False)
  assert result["phases"]["train"]["ok"] and not result["phases"]["decode"]["ok"]
  assert any("precision DEFAULT, expected HIGHEST" in p
             for p in result["phases"]["decode"]["problems"])


@pytest.mark.parametrize("flags", [False, True])
def test_algorithm_preset_read_through_its_converts(flags):
  """BF16_BF16_F32_X3 makes JAX upcast the bf16 operands and convert the f32 result back:
  the audit still sees the contract's types (and would see a wrong one)."""
  prec = Precision(dtype="bfloat16", einsum_precision="BF16_BF16_F32_X3",
                   float32_qk_product=flags, float32_logits=flags)
  result = audit.run_audit(ONE, prec, prec, compile=False)
  assert result["ok"], result["problems"]
  qk = [r for r in _forward_attention_rows(result, "decode") if r["site"] == "qk"]
  assert all(r["lhs"] == "f32<-bf16" for r in qk), qk
  assert {r["result"] for r in qk} == ({"f32"} if flags else {"f32->bf16"})
  want = audit.algorithm_text("BF16_BF16_F32_X3")
  assert "num_primitive_operations = 3" in want
  assert all(r["precision"] == f"algorithm <{want}>" for r in qk)


@pytest.mark.parametrize("kernel,flags", [
    ("blockwise", dict(float32_qk_product=False, float32_logits=True)),
    # both flags off: the running max stays in bf16 (a max of bf16 logits, exact), so no
    # float32 -> bf16 cast lies between the qk dot and the exp (one did, and failed)
    ("blockwise", dict(float32_qk_product=False, float32_logits=False)),
    ("jax_nn", {})])
def test_other_kernels_pass(kernel, flags):
  prec = Precision(dtype="bfloat16", kernel=kernel, **flags)
  result = audit.run_audit(ONE, prec, prec, compile=False)
  assert result["ok"], result["problems"]
  for phase in ("prefill", "decode"):
    rows = _forward_attention_rows(result, phase)
    assert {r["site"] for r in rows} == {"qk", "wv"}
    assert all(r["checked"] == "types+precision" for r in rows)


def test_blockwise_dropping_float32_logits_fails(monkeypatch):
  _train_only_flags(monkeypatch, float32_logits=False)
  prec = Precision(dtype="bfloat16", kernel="blockwise", float32_qk_product=False)
  result = audit.run_audit(ONE, prec, prec, compile=False)
  assert not result["phases"]["decode"]["ok"]


@xla_cpu
def test_compiled_summary_shows_the_backend_rewrite():
  """On CPU, the bf16 attention dots compile to f32 dots; the bf16 roundings the program
  asks for appear as f32->bf16 converts (excess precision is disabled in conftest)."""
  prec = Precision(dtype="bfloat16", float32_qk_product=False, float32_logits=False)
  lowered = audit.lower_programs(CONFIG, prec, prec)["decode"][1]
  summary = audit.summarize_compiled(compiled_text(lowered))
  assert summary["converts"].get("f32->bf16", 0) > 0
  assert sum(summary["dots"].values()) >= 7 * CONFIG.num_layers + 1
  assert all(k.endswith("->f32") for k in summary["dots"]), summary["dots"]


# ----------------------------------------------------------------------------- compiled
@xla_cpu
def test_the_text_compile_options_leave_the_compiled_program_s_text_unchanged():
  """What the audit reads is compiled with `Platform.text_compile_options` (XLA:CPU:
  LLVM's optimization level 0): the optimized HLO is the same text as the default
  compile's, for a train step, a prefill and a decode step (a 1-layer model: the passes
  are per program, not per layer; and programs no other test compiles, so both compiles
  are of this lowering: a compilation-cache hit would bring another trace's metadata).
  """
  from attnprec import platforms
  assert platforms.TABLE["cpu"].text_compile_options        # something to check
  safe = Precision(dtype="bfloat16")
  for phase, (_, lowered) in audit.lower_programs(ONE, safe, safe).items():
    assert compiled_text(lowered) == lowered.compile().as_text(), phase


def test_compile_names_phases_or_is_refused():
  safe = Precision(dtype="bfloat16")
  with pytest.raises(UserError, match=r"compile='decode'.*\['train', 'prefill', 'decode'\]"):
    audit.run_audit(CONFIG, safe, safe, compile="decode")
  with pytest.raises(UserError, match="compile=\\('serve',\\)"):
    audit.run_audit(CONFIG, safe, safe, compile=("serve",))


def _narrow_qk_kernel(monkeypatch):
  """A dot_product kernel that computes the QK product with a bf16 result even when
  float32_qk_product=True, then casts it to f32 (so its own type checks still pass): the
  logits are silently rounded to bf16."""
  import jax.numpy as jnp

  from attnprec.kernels import dot_product

  class NarrowQK:
    def __getattr__(self, name):
      return getattr(jnp, name)

    @staticmethod
    def einsum(spec, *operands, preferred_element_type=None, **kwargs):
      if spec == "BTKGH,BSKH->BKGTS":
        # bf16 whatever the operands (float32 casts on a CPU without bf16 dots:
        # `Precision.float32_qk_operands`)
        narrow = jnp.einsum(spec, *operands, preferred_element_type=jnp.bfloat16, **kwargs)
        return narrow.astype(preferred_element_type or narrow.dtype)
      return jnp.einsum(spec, *operands, preferred_element_type=preferred_element_type,
                        **kwargs)

  monkeypatch.setattr(dot_product, "jnp", NarrowQK())


@xla_cpu
@pytest.mark.parametrize("preset", ["bf16.gin", "fp32_attention.gin", "fp32.gin"])
def test_compiled_programs_pass(preset):
  """The compiled check passes the shipped presets in every phase, and sees every dot:
  one qk and one wv per layer, 7 dense dots per layer + the unembedding, as XLA:CPU
  compiled them (dots inside its __ynn_fusion library fusions included)."""
  p = _phases([os.path.join(ginutils.REPO_GIN_DIR, "precision", preset)])
  result = _audit(CONFIG, p["train"], p["decode"], compile=True)
  assert result["ok"], result["problems"]
  for phase in audit.PHASES:
    rows = result["phases"][phase]["compiled"]["rows"]
    count = lambda site: sum(r["count"] for r in rows if r["site"] == site)
    assert count("qk") == count("wv") == CONFIG.num_layers, rows
    assert count("dense") == 7 * CONFIG.num_layers + 1, rows
    assert all(r["verdict"] in ("ok", "listed") for r in rows)
  assert "this backend compiled them into." in audit.verdict(result)


@xla_cpu
def test_a_kernel_narrowing_the_qk_product_fails_lowered_and_compiled(monkeypatch):
  """float32_qk_product=True, but the kernel forms the product with a bf16 result (cast
  to f32 after): the lowered check sees a bf16 qk result; the compiled check sees the f32
  dot XLA:CPU made of it rounded to bf16 right after: both FAIL, in every phase."""
  _narrow_qk_kernel(monkeypatch)
  safe = Precision(dtype="bfloat16")
  result = audit.run_audit(ONE, safe, safe)
  assert not result["ok"]
  for phase in audit.PHASES:
    problems = result["phases"][phase]["problems"]
    lowered = [q for q in problems if "compiled" not in q]
    compiled = result["phases"][phase]["compiled"]["problems"]
    assert any("QK^T logits are bf16, expected f32" in q for q in lowered), problems
    assert any("logits are rounded to bf16 right after" in q for q in compiled), compiled
    assert all(q.startswith("compiled qk") for q in compiled), compiled
  assert "MISMATCH" in audit.compiled_table(result)


@xla_cpu
def test_decode_ignoring_the_flags_fails_the_compiled_check_too(seed_bug):
  """The seed's bug (decode drops both flags) in the compiled program: the qk logits are
  rounded to bf16 and the wv dot reads bf16 probabilities; training stays clean."""
  result = seed_bug
  assert result["phases"]["train"]["compiled"]["ok"]
  for phase in ("prefill", "decode"):
    compiled = result["phases"][phase]["compiled"]["problems"]
    assert any("rounded to bf16" in q for q in compiled), compiled
    assert any("probabilities enter narrowed" in q for q in compiled), compiled


@xla_cpu
def test_dots_whose_op_name_xla_dropped_are_attributed_by_shape(monkeypatch):
  """With one kv head XLA:CPU rewrites the attention dots and drops their op_name; in
  the prefill and decode programs they are told apart by the dimension they contract
  (the head dim: qk; a key length: wv), so the narrowing kernel still fails there.
  (One layer: the rewrite is per dot, not per layer.)"""
  one_kv = dataclasses.replace(ONE, num_heads=2, num_kv_heads=1, head_dim=32, d_model=64)
  safe = Precision(dtype="bfloat16")
  result = audit.run_audit(one_kv, safe, safe, compile=SERVING)
  assert result["ok"], result["problems"]
  for phase in ("prefill", "decode"):
    sites = {r["site"] for r in result["phases"][phase]["compiled"]["rows"]}
    assert {"qk (op_name dropped; by shape)", "wv (op_name dropped; by shape)"} <= sites, \
        sites
  _narrow_qk_kernel(monkeypatch)
  result = audit.run_audit(one_kv, safe, safe, compile=SERVING)
  for phase in ("prefill", "decode"):
    compiled = result["phases"][phase]["compiled"]["problems"]
    assert any("logits are rounded to bf16 right after" in q for q in compiled), compiled


def _safe_decode_text():
  return compiled_text(_lowered_safe()["decode"][1]), \
      decoding.serving_precision(Precision(dtype="bfloat16"))


@xla_cpu
def test_a_backend_narrowing_the_accumulation_is_seen_only_in_the_compiled_program():
  """No XLA:CPU setting found narrows a dot the lowered program states in f32 (default,
  --xla_cpu_use_onednn and --xla_cpu_use_xnnpack compile these programs to the same
  HLO), so this case is synthetic: the compiled text of a correct decode step with its qk
  dots edited to accumulate in bf16 (as a backend lowering them to a bf16 library call
  would), and once more as a oneDNN matmul custom-call with a bf16 result. The lowered
  program is unchanged (it passes); only the compiled check can see this."""
  import re

  from attnprec.inspect import report
  text, prec = _safe_decode_text()
  assert report.check_compiled(text, prec)["ok"]
  qk_line = re.compile(r"^(\s*(?:ROOT )?%[\w.\-]+ = )f32(\[[^\]]*\]\S* dot\(.*attn_qk.*)$",
                       re.MULTILINE)
  narrowed, n = qk_line.subn(r"\1bf16\2", text)
  assert n == CONFIG.num_layers
  checked = report.check_compiled(narrowed, prec)
  assert not checked["ok"]
  assert sum("accumulates in bf16" in q for q in checked["problems"]) == CONFIG.num_layers

  def to_library(m):
    operands = re.search(r"dot\((%[\w.\-]+, %[\w.\-]+)\)", m.group(2)).group(1)
    meta = re.search(r"metadata=\{[^}]*\}", m.group(2)).group(0)
    shape = re.match(r"\[[^\]]*\]\S*", m.group(2)).group(0)
    return (f"{m.group(1)}bf16{shape} custom-call({operands}), "
            f'custom_call_target="__onednn$matmul", {meta}')

  library, n = qk_line.subn(to_library, text)
  assert n == CONFIG.num_layers
  checked = report.check_compiled(library, prec)
  dots = [d for d, _ in checked["dots"] if d.via.startswith("custom-call")]
  assert len(dots) == CONFIG.num_layers and {d.site for d in dots} == {"qk"}
  assert not checked["ok"]


def test_the_runner_exits_3_on_a_compiled_mismatch(tmp_path, monkeypatch):
  """(On ONE's architecture: the programs of
  test_a_kernel_narrowing_the_qk_product_fails_lowered_and_compiled, compiled once.)"""
  runner = _runner()
  _narrow_qk_kernel(monkeypatch)
  out = tmp_path / "narrow"
  assert runner.main(["--gin_file=precision/fp32_attention.gin", f"--run_dir={out}"]
                     + _architecture(ONE)) == 3
  _assert_audited(out, ONE)
  md = (out / "audit.md").read_text()
  assert "checked" in md and "MISMATCH" in md


def test_site_classification():
  assert compiled.site("jit(update)/jvp(decoder)/layer_0/attn/q/dot_general") == "dense"
  assert compiled.site("jit(f)/decoder/layer_3/mlp/down/dot_general") == "dense"
  assert compiled.site("jit(f)/decoder/BTD,DV->BTV/dot_general") == "dense"
  assert compiled.site("jit(f)/decoder/layer_0/attn/attn_qk/BTKGH,BSKH->BKGTS/dot_general") == "qk"
  assert compiled.site("cond/branch_1_fun/BKGTS,BKSH->BKGTH/dot_general") == "wv"
  assert compiled.site("cond/branch_1_fun/BKGTH,BKSH->BKGTS/dot_general") == "qk"
  assert compiled.site("jit(f)/decoder/layer_0/attn/vmap(BNTS,BSNH->BTNH)/dot_general") == "wv"
  assert compiled.site("jit(f)/something/dot_general") == "other"


def test_too_long_context_is_a_user_error():
  with pytest.raises(UserError, match="max_seq_len"):
    audit.lower_programs(CONFIG, Precision(), Precision(), prompt_len=60, new_tokens=8)


# ----------------------------------------------------------------------------- runner
def _runner():
  spec = importlib.util.spec_from_file_location("audit_runner", RUNNER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _architecture(config):
  """--gin.model.* bindings that make the runner's model (gin/models/recall_tiny.gin by
  default) `config`: its programs are then the in-process tests' (compiled once)."""
  fields = ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim",
            "mlp_hidden", "max_seq_len", "embed_scale")
  return [f"--gin.model.{f}={getattr(config, f)!r}" for f in fields]


def _assert_audited(run_dir, config):
  """The runner audited `config` (its audit.json's architecture)."""
  from attnprec import runs
  written = json.loads((run_dir / "audit.json").read_text())["config"]
  assert written == json.loads(json.dumps(runs.config_dict(config))), written


def test_runner_exit_codes_and_files(tmp_path, monkeypatch):
  runner = _runner()
  small = ["--gin.audit.compile=False", "--gin.model.num_layers=1"]
  ok_dir = tmp_path / "ok"
  assert runner.main(["--gin_file=precision/bf16.gin", f"--run_dir={ok_dir}"] + small) == 0
  result = json.loads((ok_dir / "audit.json").read_text())
  assert result["ok"] and "PASS" in (ok_dir / "audit.md").read_text()
  # no temp files left; the owner record names the runner (runs.claim)
  assert sorted(os.listdir(ok_dir)) == [".attnprec-run.json", "audit.json", "audit.md"]

  # a missing gin file / a context longer than the model: exit 2, nothing written
  bad = tmp_path / "bad"
  assert runner.main(["--gin_file=precision/nope.gin", f"--run_dir={bad}"] + small) == 2
  assert runner.main([f"--run_dir={bad}", "--gin.audit.prompt_len=600"] + small) == 2
  assert not bad.exists() or not os.listdir(bad)
  # an unwritable run directory (below a regular file): exit 2
  blocker = tmp_path / "file"
  blocker.write_text("x")
  assert runner.main([f"--run_dir={blocker / 'sub'}"] + small) == 2

  # the seed's bug: exit 3 (a mismatch), and the report says which dots
  _train_only_flags(monkeypatch, float32_qk_product=False, float32_logits=False)
  broken = tmp_path / "broken"
  assert runner.main(["--gin_file=precision/fp32_attention.gin", f"--run_dir={broken}"]
                     + small) == 3
  assert "MISMATCH" in (broken / "audit.md").read_text()


@xla_cpu
def test_inspect_report_checks_the_compiled_program_too(monkeypatch):
  """`attnprec.inspect`'s Report.with_compiled: the same compiled check as the audit."""
  import jax

  from attnprec.inspect import inspect_lowered
  safe = decoding.serving_precision(Precision(dtype="bfloat16"))
  # the prefill lowered under the serving form of bf16 compute (lower_programs applies it)
  assert _lowered_safe()["prefill"][0] == safe
  lowered = _lowered_safe()["prefill"][1]
  report = inspect_lowered(lowered, expect=safe).with_compiled(lowered)
  assert report.ok, report.problems()
  assert "What the backend compiled" in report.to_markdown()
  assert report.to_dict()["compiled"]
  _narrow_qk_kernel(monkeypatch)
  jax.clear_caches()
  # (the 1-layer prefill test_a_kernel_narrowing_the_qk_product_fails_lowered_and_compiled
  # compiles)
  lowered = audit.lower_programs(ONE, safe, safe)["prefill"][1]
  report = inspect_lowered(lowered, expect=safe).with_compiled(lowered)
  assert any(p.startswith("compiled qk") for p in report.problems())


# ----------------------------------------------------------------------------- KV cache
# The kernels that take a quantized cache (jax_nn refuses one by name), in every flag
# combination.
KV_KERNELS = ("dot_product", "blockwise")
_ALL_FLAGS = [(True, True), (True, False), (False, True), (False, False)]
KV_FLAGS = {"dot_product": _ALL_FLAGS, "blockwise": _ALL_FLAGS}
# kv_fp8 differs from kv_int8 only in the codes' type: two flag combinations suffice there
# (the suite's time budget), the extremes.
KV_FP8_FLAGS = [(True, True), (False, False)]
# the codes each preset stores, as StableHLO and HLO name them
KV_CODE = {"kv_int8.gin": ("i8", "s8"), "kv_fp8.gin": ("f8E4M3FN", "f8e4m3fn")}
KV_INT8 = os.path.join(ginutils.REPO_GIN_DIR, "precision", "kv_int8.gin")
KV_FP8 = os.path.join(ginutils.REPO_GIN_DIR, "precision", "kv_fp8.gin")
# The (preset, kernel) pairs whose compiled programs are checked
# (test_kv_presets_pass_the_compiled_check): their audit with both flags on, on CONFIG, is
# run once and read by the lowered tests too.
KV_COMPILED = [(KV_INT8, "dot_product"), (KV_INT8, "blockwise"), (KV_FP8, "dot_product")]
CACHE_LENGTH = 16                        # the audit's prompt_len 8 + new_tokens 8


def _kv_phases(preset, kernel, qk=True, logits=True, k_scale=None):
  bindings = [f"precision.kernel = '{kernel}'", f"precision.float32_qk_product = {qk}",
              f"precision.float32_logits = {logits}"]
  if k_scale:
    bindings.append(f"precision.kv_cache_k_scale = '{k_scale}'")
  return _phases([preset], bindings)


def _compiled_types(result, phase, site):
  return [r["types"] for r in result["phases"][phase]["compiled"]["rows"]
          if r["site"] == site]


def test_the_kv_presets_are_audited():
  assert sorted(os.path.basename(p) for p in KV_PRESETS) == sorted(KV_CODE)


@pytest.mark.parametrize("kernel", KV_KERNELS)
@pytest.mark.parametrize("preset", KV_PRESETS, ids=lambda p: os.path.basename(p))
def test_kv_presets_pass_with_their_cache_rows_read_back(preset, kernel):
  """Every flag combination over the preset's cache: the prefill and decode programs
  show the codes the keys and values are stored as, converted straight to the dots'
  operand dtype, and the float32 per-token scales on the logits (in the logits dtype)
  and the probabilities (in the probs dtype); the train step shows no cache."""
  code, _ = KV_CODE[os.path.basename(preset)]
  B, K, S = 2, CONFIG.num_kv_heads, CACHE_LENGTH
  flags = KV_FP8_FLAGS if os.path.basename(preset) == "kv_fp8.gin" else KV_FLAGS[kernel]
  assert flags[0] == (True, True)
  for i, (qk, logits) in enumerate(flags):
    # every layer's rows on the 2-layer model once (both flags on: where the compiled
    # check runs, its audit); the other flag combinations on one layer (the rows are per
    # layer, the flags change each one the same way)
    config = CONFIG if i == 0 else ONE
    p = _kv_phases(preset, kernel, qk, logits)
    compiled = i == 0 and (preset, kernel) in KV_COMPILED
    result = _audit(config, p["train"], p["decode"], compile=SERVING if compiled else False)
    assert result["ok"], (qk, logits, result["problems"])
    lg, probs = ("f32" if qk else "bf16"), ("f32" if qk or logits else "bf16")
    rounded = lambda dt: "" if dt == "f32" else " (f32->bf16)"  # noqa: E731
    for phase in ("prefill", "decode"):
      rows = result["phases"][phase]["cache"]
      assert sorted(r["layer"] for r in rows) == list(range(config.num_layers)), rows
      for r in rows:
        assert (r["k"], r["v"]) == (code, code), r
        assert r["k_scale"] == f"f32[{B}, {K}, {S}] per key, on the logits in {lg}{rounded(lg)}"
        assert r["v_scale"] == (f"f32[{B}, {K}, {S}] per key, on the probabilities in "
                                f"{probs}{rounded(probs)}")
        assert f"bf16<-{code}" in r["qk"] and f"{probs}<-{code}" in r["wv"], r
    train = result["phases"]["train"]["cache"]
    assert {(r["k"], r["k_scale"], r["v"], r["v_scale"]) for r in train} == {
        ("no codes", "none", "no codes", "none")}


@pytest.mark.parametrize("preset,kernel", KV_COMPILED,
                         ids=["kv_int8-dot_product", "kv_int8-blockwise", "kv_fp8-dot_product"])
@xla_cpu
def test_kv_presets_pass_the_compiled_check(preset, kernel):
  """As compiled: the attention dots read the codes (converted from s8 / f8e4m3fn), the
  qk result is multiplied by the key scale in f32 and the probabilities by the value
  scale in f32, each told apart from the softmax's normalisation by the keys' axis."""
  code, hlo_code = KV_CODE[os.path.basename(preset)]
  p = _kv_phases(preset, kernel)
  result = _audit(CONFIG, p["train"], p["decode"], compile=SERVING)
  assert result["ok"], result["problems"]
  for phase in ("prefill", "decode"):
    qk, wv = (_compiled_types(result, phase, site) for site in ("qk", "wv"))
    assert qk and all(f"<-{hlo_code}" in t and t.endswith("-> f32 (x f32)") for t in qk), qk
    assert wv and all(f"<-{hlo_code}" in t and "(x f32)" in t for t in wv), wv
  assert f"| prefill | 0,1 | {code} |" in audit.cache_table(result)
  assert "## KV cache" in audit.to_markdown(result)
  assert "cache's codes and scales match its rows" in audit.verdict(result)
  # only the serving programs were compiled, and the verdict says so
  assert ("compiled the prefill and decode step into (the rest was read as lowered only)"
          in audit.verdict(result))


@xla_cpu
@pytest.mark.parametrize("kernel", KV_KERNELS)
def test_a_per_channel_key_scale_is_read_back_on_q(kernel):
  """kv_cache_k_scale = 'channel': the scale multiplies q (float32, float32_qk_product)
  along the head dim, in the lowered program and in the compiled one; the logits carry
  no key scale. (One layer: the scale is applied per layer the same way.)"""
  p = _kv_phases(KV_INT8, kernel, k_scale="channel")
  result = audit.run_audit(ONE, p["train"], p["decode"], compile=SERVING)
  assert result["ok"], result["problems"]
  for phase in ("prefill", "decode"):
    for r in result["phases"][phase]["cache"]:
      assert r["k_scale"] == f"f32[2, {CONFIG.num_kv_heads}, {CONFIG.head_dim}] per " \
                             f"channel, on q in f32", r
      assert "f32<-i8" in r["qk"] and "bf16" not in r["qk"], r
    qk = _compiled_types(result, phase, "qk")
    assert qk and all("f32 (x f32) x" in t or "x f32 (x f32)" in t for t in qk), qk
    assert not any(t.endswith("(x f32)") for t in qk), qk


# Deliberately wrong variants: each breaks one cache row of the contract in the kernels'
# shared helpers (`attnprec.contract`), as a kernel bug would, and must FAIL the audit.
def _quantized_query(monkeypatch):
  """q rounded through float8_e4m3fn before the qk dot (the contract never quantizes q)."""
  import jax
  import jax.numpy as jnp

  from attnprec import contract
  real = contract.query_operand

  def query_operand(q, rows, kv_scales):
    out = real(q, rows, kv_scales)
    return out.astype(jnp.float8_e4m3fn).astype(out.dtype)

  monkeypatch.setattr(contract, "query_operand", query_operand)
  jax.clear_caches()


def _scale_columns_variant(monkeypatch, *, key=None, value=None):
  """contract.scale_columns with the key scale's call (the first of each pair: both
  kernels scale the logits, then the probabilities) and / or the value scale's replaced
  by key(real, x, scale, dtype) / value(...)."""
  import jax

  from attnprec import contract
  real, calls = contract.scale_columns, [0]

  def scale_columns(x, scale, dtype):
    calls[0] += 1
    wrong = key if calls[0] % 2 == 1 else value
    return wrong(real, x, scale, dtype) if wrong else real(x, scale, dtype)

  monkeypatch.setattr(contract, "scale_columns", scale_columns)
  jax.clear_caches()


def _kv_int8_result(kernel="dot_product", compile=SERVING):
  """kv_int8 audited on the 1-layer model (a broken variant breaks every layer alike)."""
  p = _kv_phases(KV_INT8, kernel)
  return audit.run_audit(ONE, p["train"], p["decode"], compile=compile)


def _lowered_problems(result, phase):
  return [q for q in result["phases"][phase]["problems"] if " compiled " not in f" {q}"]


@xla_cpu
@pytest.mark.parametrize("kernel", KV_KERNELS)
def test_a_quantized_query_fails_lowered_and_compiled(monkeypatch, kernel):
  """q rounded through float8 before the qk dot, in every phase."""
  _quantized_query(monkeypatch)
  result = _kv_int8_result(kernel)
  assert not result["ok"]
  # the train step has no cache, and its q is quantized all the same: caught there too
  train = _lowered_problems(result, "train")
  assert any("no KV cache): q is never quantized" in q for q in train), train
  for phase in ("prefill", "decode"):
    lowered = _lowered_problems(result, phase)
    compiled = result["phases"][phase]["compiled"]["problems"]
    assert any("q is quantized" in q and "f8E4M3FN" in q for q in lowered), lowered
    assert any("q is quantized" in q and "f8e4m3fn" in q for q in compiled), compiled
  assert "MISMATCH" in audit.cache_table(result)


@xla_cpu
@pytest.mark.parametrize("kernel", KV_KERNELS)
def test_a_key_scale_applied_after_a_bf16_cast_fails(monkeypatch, kernel):
  """The per-token key scale multiplies the logits after they are cast to bf16 (the
  contract: in the f32 logits dtype): the lowered program shows the multiply in bf16,
  the compiled one the qk dot's f32 logits rounded to bf16."""
  import jax.numpy as jnp
  _scale_columns_variant(monkeypatch, key=lambda real, x, s, dtype: real(
      x.astype(jnp.bfloat16), s, jnp.bfloat16).astype(dtype))
  result = _kv_int8_result(kernel)
  assert not result["ok"]
  for phase in ("prefill", "decode"):
    lowered = _lowered_problems(result, phase)
    compiled = result["phases"][phase]["compiled"]["problems"]
    assert any("per-token key scale multiplies the logits in bf16; the contract applies "
               "it in f32" in q for q in lowered), lowered
    assert any("logits are rounded to bf16 right after" in q for q in compiled), compiled


@xla_cpu
def test_quantized_probabilities_fail_lowered_and_compiled(monkeypatch):
  import jax.numpy as jnp
  _scale_columns_variant(monkeypatch, value=lambda real, x, s, dtype: real(
      x, s, dtype).astype(jnp.float8_e4m3fn).astype(dtype))
  result = _kv_int8_result()
  for phase in ("prefill", "decode"):
    lowered = _lowered_problems(result, phase)
    compiled = result["phases"][phase]["compiled"]["problems"]
    assert any("the probabilities come from codes" in q and "quantized" in q
               for q in lowered), lowered
    assert any("the probabilities are quantized" in q for q in compiled), compiled


@xla_cpu
def test_a_key_scale_rounded_to_bf16_fails_lowered_and_compiled(monkeypatch):
  """The f32 key scale rounded through bf16 before it multiplies the f32 logits."""
  import jax.numpy as jnp
  _scale_columns_variant(monkeypatch, key=lambda real, x, s, dtype: real(
      x, s.astype(jnp.bfloat16).astype(s.dtype), dtype))
  result = _kv_int8_result()
  for phase in ("prefill", "decode"):
    lowered = _lowered_problems(result, phase)
    compiled = result["phases"][phase]["compiled"]["problems"]
    assert any("key scale is rounded on its way to the logits (f32->bf16)" in q
               for q in lowered), lowered
    assert any("key scale is rounded to bf16 before it multiplies the logits" in q
               for q in compiled), compiled


def test_codes_entering_the_qk_dot_in_another_dtype_fail(monkeypatch):
  """The keys' int8 codes cast to f32 for the qk dot where the rows say bf16 (jnp then
  upcasts q too): exact, but not the contract's operand dtype."""
  import jax
  import jax.numpy as jnp

  from attnprec import contract
  real = contract.code_operand
  monkeypatch.setattr(contract, "code_operand", lambda x, rows, row: (
      x.astype(jnp.float32) if rows is not None and row == "k_into_qk" else
      real(x, rows, row)))
  jax.clear_caches()
  result = _kv_int8_result(compile=False)
  for phase in ("prefill", "decode"):
    problems = result["phases"][phase]["problems"]
    assert any("the keys' codes are cast to f32 (i8->f32); the contract's operand dtype "
               "is bf16" in q for q in problems), problems
    assert any("q enters as f32" in q for q in problems), problems


def test_the_runner_passes_a_kv_preset_and_exits_3_on_a_quantized_query(tmp_path,
                                                                       monkeypatch):
  """(On CONFIG's architecture: the passing run's prefill and decode step are the programs
  test_kv_presets_pass_the_compiled_check[kv_int8-dot_product] compiles, compiled once;
  its train step, float32 qk operands under a quantized cache, is compiled here.)"""
  runner = _runner()
  small = _architecture(CONFIG)
  ok = tmp_path / "ok"
  assert runner.main(["--gin_file=precision/kv_int8.gin", f"--run_dir={ok}"] + small) == 0
  _assert_audited(ok, CONFIG)
  md = (ok / "audit.md").read_text()
  assert "## KV cache" in md and "| decode | 0,1 | i8 |" in md and "PASS" in md
  _quantized_query(monkeypatch)
  bad = tmp_path / "bad"     # the lowered check alone finds it (compiled: tests above)
  assert runner.main(["--gin_file=precision/kv_int8.gin", f"--run_dir={bad}",
                      "--gin.audit.compile=False"] + _architecture(ONE)) == 3
  assert "q is quantized" in (bad / "audit.md").read_text()


def test_the_mlp_activation_in_float32_is_audited_both_ways(monkeypatch):
  """mlp_activation='float32': the gate and up projections return their f32 sums, and the
  audit passes; a program whose MLP still rounds them to bf16 (the model run as
  'compute'), checked against 'float32', fails on exactly those projections."""
  bf16 = Precision(dtype="bfloat16")
  wide = dataclasses.replace(bf16, mlp_activation="float32")
  result = audit.run_audit(ONE, wide, wide, compile=False)
  assert result["ok"], result["problems"]
  real_prefill = decoding.prefill
  monkeypatch.setattr(decoding, "prefill", lambda *a, precision, **k: real_prefill(
      *a, precision=dataclasses.replace(precision, mlp_activation="compute"), **k))
  result = audit.run_audit(ONE, wide, wide, compile=False)
  assert not result["ok"]
  bad = [p for p in result["problems"] if "expected f32" in p]
  assert bad and all("mlp/gate" in p or "mlp/up" in p for p in bad), result["problems"]
  assert all(p.startswith("prefill") for p in bad), bad
