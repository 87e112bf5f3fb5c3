"""The audit (`make audit`): passes on every precision preset in every phase, and FAILS when
inference drops the attention flags (the seed's bug) or the einsum precision.

What the audit compares against: the contract table `attnprec.contract.stage_dtypes` and
the phase's `Precision`; the programs are lowered from the real train step, prefill and
decode step (`attnprec.train`, `attnprec.decoding`). The broken variants below are built
here by wrapping `decoding.prefill` / `decoding.decode_step`, exactly the way the seed
applied the flags only in training.
"""
import dataclasses
import glob
import importlib.util
import json
import os

import pytest

from attnprec import audit, decoding, ginutils, hlo
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.precision import Precision, phase_precision

CONFIG = ModelConfig(vocab_size=13, d_model=16, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_hidden=32, max_seq_len=64)
ALL_PRESETS = sorted(glob.glob(os.path.join(ginutils.REPO_GIN_DIR, "precision", "*.gin")))
# The quantized-cache presets are refused by the audit until it reads the cache rows back
# (test_a_quantized_cache_is_refused_not_passed).
KV_PRESETS = [p for p in ALL_PRESETS if os.path.basename(p).startswith("kv_")]
PRESETS = [p for p in ALL_PRESETS if p not in KV_PRESETS]
RUNNER = os.path.join(os.path.dirname(ginutils.REPO_GIN_DIR), "runners", "audit.py")


def _phases(files, bindings=()):
  ginutils.parse(files, list(bindings))
  out = {}
  for phase in ginutils.PHASES:
    with ginutils.phase(phase):
      out[phase] = phase_precision()
  return out


def _forward_attention_rows(result, phase):
  return [r for r in result["phases"][phase]["attention"] if not r["backward"]]


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: os.path.basename(p))
def test_every_preset_passes_in_every_phase(preset):
  p = _phases([preset])
  result = audit.run_audit(CONFIG, p["train"], p["decode"], compile=False)
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
  """The audit reads the types it checks: flag on -> f32 logits, flag off -> bf16."""
  for flag, want in ((True, "f32"), (False, "bf16")):
    prec = Precision(dtype="bfloat16", float32_qk_product=flag, float32_logits=flag)
    result = audit.run_audit(CONFIG, prec, prec, compile=False)
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


def test_decode_ignoring_float32_qk_product_fails(monkeypatch):
  _train_only_flags(monkeypatch, float32_qk_product=False, float32_logits=False)
  safe = Precision(dtype="bfloat16")            # both flags on, in both phases
  result = audit.run_audit(CONFIG, safe, safe, compile=False)
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
  result = audit.run_audit(CONFIG, prec, prec, compile=False)
  assert not result["ok"] and result["phases"]["train"]["ok"]
  assert not result["phases"]["decode"]["ok"]


def test_decode_dropping_einsum_precision_fails(monkeypatch):
  _train_only_flags(monkeypatch, einsum_precision="default")
  prec = Precision(einsum_precision="highest")
  result = audit.run_audit(CONFIG, prec, prec, compile=False)
  assert result["phases"]["train"]["ok"] and not result["phases"]["decode"]["ok"]
  assert any("precision DEFAULT, expected HIGHEST" in p
             for p in result["phases"]["decode"]["problems"])


@pytest.mark.parametrize("flags", [False, True])
def test_algorithm_preset_read_through_its_converts(flags):
  """BF16_BF16_F32_X3 makes JAX upcast the bf16 operands and convert the f32 result back:
  the audit still sees the contract's types (and would see a wrong one)."""
  prec = Precision(dtype="bfloat16", einsum_precision="BF16_BF16_F32_X3",
                   float32_qk_product=flags, float32_logits=flags)
  result = audit.run_audit(CONFIG, prec, prec, compile=False)
  assert result["ok"], result["problems"]
  qk = [r for r in _forward_attention_rows(result, "decode") if r["site"] == "qk"]
  assert all(r["lhs"] == "f32<-bf16" for r in qk), qk
  assert {r["result"] for r in qk} == ({"f32"} if flags else {"f32->bf16"})
  want = audit.algorithm_text("BF16_BF16_F32_X3")
  assert "num_primitive_operations = 3" in want
  assert all(r["precision"] == f"algorithm <{want}>" for r in qk)


@pytest.mark.parametrize("kernel", ["blockwise", "jax_nn"])
def test_other_kernels_pass(kernel):
  flags = dict(float32_qk_product=False, float32_logits=True) if kernel == "blockwise" else {}
  prec = Precision(dtype="bfloat16", kernel=kernel, **flags)
  result = audit.run_audit(CONFIG, prec, prec, compile=False)
  assert result["ok"], result["problems"]
  for phase in ("prefill", "decode"):
    rows = _forward_attention_rows(result, phase)
    assert {r["site"] for r in rows} == {"qk", "wv"}
    assert all(r["checked"] == "types+precision" for r in rows)


def test_blockwise_dropping_float32_logits_fails(monkeypatch):
  _train_only_flags(monkeypatch, float32_logits=False)
  prec = Precision(dtype="bfloat16", kernel="blockwise", float32_qk_product=False)
  result = audit.run_audit(CONFIG, prec, prec, compile=False)
  assert not result["phases"]["decode"]["ok"]


def test_compiled_summary_shows_the_backend_rewrite():
  """On CPU, the bf16 attention dots compile to f32 dots; the bf16 roundings the program
  asks for appear as f32->bf16 converts (excess precision is disabled in conftest)."""
  prec = Precision(dtype="bfloat16", float32_qk_product=False, float32_logits=False)
  lowered = audit.lower_programs(CONFIG, prec, prec)["decode"][1]
  summary = audit.summarize_compiled(lowered.compile().as_text())
  assert summary["converts"].get("f32->bf16", 0) > 0
  assert sum(summary["dots"].values()) >= 7 * CONFIG.num_layers + 1
  assert all(k.endswith("->f32") for k in summary["dots"]), summary["dots"]


# ----------------------------------------------------------------------------- compiled
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
        narrow = jnp.einsum(spec, *operands, preferred_element_type=operands[0].dtype,
                            **kwargs)
        return narrow.astype(preferred_element_type or narrow.dtype)
      return jnp.einsum(spec, *operands, preferred_element_type=preferred_element_type,
                        **kwargs)

  monkeypatch.setattr(dot_product, "jnp", NarrowQK())


@pytest.mark.parametrize("preset", ["bf16.gin", "fp32_attention.gin", "fp32.gin"])
def test_compiled_programs_pass(preset):
  """The compiled check passes the shipped presets in every phase, and sees every dot:
  one qk and one wv per layer, 7 dense dots per layer + the unembedding, as XLA:CPU
  compiled them (dots inside its __ynn_fusion library fusions included)."""
  p = _phases([os.path.join(ginutils.REPO_GIN_DIR, "precision", preset)])
  result = audit.run_audit(CONFIG, p["train"], p["decode"])
  assert result["ok"], result["problems"]
  for phase in audit.PHASES:
    rows = result["phases"][phase]["compiled"]["rows"]
    count = lambda site: sum(r["count"] for r in rows if r["site"] == site)
    assert count("qk") == count("wv") == CONFIG.num_layers, rows
    assert count("dense") == 7 * CONFIG.num_layers + 1, rows
    assert all(r["verdict"] in ("ok", "listed") for r in rows)
  assert "so do the" in audit.verdict(result)


def test_a_kernel_narrowing_the_qk_product_fails_lowered_and_compiled(monkeypatch):
  """float32_qk_product=True, but the kernel forms the product with a bf16 result (cast
  to f32 after): the lowered check sees a bf16 qk result; the compiled check sees the f32
  dot XLA:CPU made of it rounded to bf16 right after: both FAIL, in every phase."""
  _narrow_qk_kernel(monkeypatch)
  safe = Precision(dtype="bfloat16")
  result = audit.run_audit(CONFIG, safe, safe)
  assert not result["ok"]
  for phase in audit.PHASES:
    problems = result["phases"][phase]["problems"]
    lowered = [q for q in problems if "compiled" not in q]
    compiled = result["phases"][phase]["compiled"]["problems"]
    assert any("QK^T logits are bf16, expected f32" in q for q in lowered), problems
    assert any("logits are rounded to bf16 right after" in q for q in compiled), compiled
    assert all(q.startswith("compiled qk") for q in compiled), compiled
  assert "MISMATCH" in audit.compiled_table(result)


def test_decode_ignoring_the_flags_fails_the_compiled_check_too(monkeypatch):
  """The seed's bug (decode drops both flags) in the compiled program: the qk logits are
  rounded to bf16 and the wv dot reads bf16 probabilities; training stays clean."""
  _train_only_flags(monkeypatch, float32_qk_product=False, float32_logits=False)
  safe = Precision(dtype="bfloat16")
  result = audit.run_audit(CONFIG, safe, safe)
  assert result["phases"]["train"]["compiled"]["ok"]
  for phase in ("prefill", "decode"):
    compiled = result["phases"][phase]["compiled"]["problems"]
    assert any("rounded to bf16" in q for q in compiled), compiled
    assert any("probabilities enter narrowed" in q for q in compiled), compiled


def test_dots_whose_op_name_xla_dropped_are_attributed_by_shape(monkeypatch):
  """With one kv head XLA:CPU rewrites the attention dots and drops their op_name; in
  the prefill and decode programs they are told apart by the dimension they contract
  (the head dim: qk; a key length: wv), so the narrowing kernel still fails there."""
  one_kv = dataclasses.replace(CONFIG, num_heads=2, num_kv_heads=1, head_dim=32,
                               d_model=64)
  safe = Precision(dtype="bfloat16")
  result = audit.run_audit(one_kv, safe, safe)
  assert result["ok"], result["problems"]
  for phase in ("prefill", "decode"):
    sites = {r["site"] for r in result["phases"][phase]["compiled"]["rows"]}
    assert {"qk (op_name dropped; by shape)", "wv (op_name dropped; by shape)"} <= sites, \
        sites
  _narrow_qk_kernel(monkeypatch)
  result = audit.run_audit(one_kv, safe, safe)
  for phase in ("prefill", "decode"):
    compiled = result["phases"][phase]["compiled"]["problems"]
    assert any("logits are rounded to bf16 right after" in q for q in compiled), compiled


def _safe_decode_text():
  safe = Precision(dtype="bfloat16")
  return audit.lower_programs(CONFIG, safe, safe)["decode"][1].compile().as_text(), \
      decoding.serving_precision(safe)


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
  runner = _runner()
  _narrow_qk_kernel(monkeypatch)
  out = tmp_path / "narrow"
  assert runner.main(["--gin_file=precision/fp32_attention.gin", f"--run_dir={out}",
                      "--gin.model.num_layers=1"]) == 3
  md = (out / "audit.md").read_text()
  assert "checked" in md and "MISMATCH" in md


def test_site_classification():
  assert hlo.site("jit(update)/jvp(decoder)/layer_0/attn/q/dot_general") == "dense"
  assert hlo.site("jit(f)/decoder/layer_3/mlp/down/dot_general") == "dense"
  assert hlo.site("jit(f)/decoder/BTD,DV->BTV/dot_general") == "dense"
  assert hlo.site("jit(f)/decoder/layer_0/attn/attn_qk/BTKGH,BSKH->BKGTS/dot_general") == "qk"
  assert hlo.site("cond/branch_1_fun/BKGTS,BKSH->BKGTH/dot_general") == "wv"
  assert hlo.site("cond/branch_1_fun/BKGTH,BKSH->BKGTS/dot_general") == "qk"
  assert hlo.site("jit(f)/decoder/layer_0/attn/vmap(BNTS,BSNH->BTNH)/dot_general") == "wv"
  assert hlo.site("jit(f)/something/dot_general") == "other"


def test_too_long_context_is_a_user_error():
  with pytest.raises(UserError, match="max_seq_len"):
    audit.lower_programs(CONFIG, Precision(), Precision(), prompt_len=60, new_tokens=8)


# ----------------------------------------------------------------------------- runner
def _runner():
  spec = importlib.util.spec_from_file_location("audit_runner", RUNNER)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_runner_exit_codes_and_files(tmp_path, monkeypatch):
  runner = _runner()
  small = ["--gin.audit.compile=False", "--gin.model.num_layers=1"]
  ok_dir = tmp_path / "ok"
  assert runner.main(["--gin_file=precision/bf16.gin", f"--run_dir={ok_dir}"] + small) == 0
  result = json.loads((ok_dir / "audit.json").read_text())
  assert result["ok"] and "PASS" in (ok_dir / "audit.md").read_text()
  assert sorted(os.listdir(ok_dir)) == ["audit.json", "audit.md"]   # no temp files left

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


def test_inspect_report_checks_the_compiled_program_too(monkeypatch):
  """`attnprec.inspect`'s Report.with_compiled: the same compiled check as the audit."""
  import jax

  from attnprec.inspect import inspect_lowered
  safe = decoding.serving_precision(Precision(dtype="bfloat16"))
  lowered = audit.lower_programs(CONFIG, safe, safe)["prefill"][1]
  report = inspect_lowered(lowered, expect=safe).with_compiled(lowered)
  assert report.ok, report.problems()
  assert "What the backend compiled" in report.to_markdown()
  assert report.to_dict()["compiled"]
  _narrow_qk_kernel(monkeypatch)
  jax.clear_caches()
  lowered = audit.lower_programs(CONFIG, safe, safe)["prefill"][1]
  report = inspect_lowered(lowered, expect=safe).with_compiled(lowered)
  assert any(p.startswith("compiled qk") for p in report.problems())


@pytest.mark.parametrize("preset", KV_PRESETS, ids=lambda p: os.path.basename(p))
def test_a_quantized_cache_is_refused_not_passed(preset):
  """The audit cannot yet read a quantized cache's rows from the programs: it says so
  (a UserError naming the setting) instead of passing them unchecked."""
  assert KV_PRESETS, "the kv_*.gin presets exist"
  p = _phases([preset])
  with pytest.raises(UserError, match=r"does not check a quantized KV cache yet.*kv_cache=k:"):
    audit.run_audit(CONFIG, p["train"], p["decode"], compile=False)
