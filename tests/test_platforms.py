"""The precision contract per platform (`attnprec.platforms`) and the cross-platform audit.

The table is checked against jax where this machine can (which presets XLA:CPU's
lowering refuses; the algorithm each preset lowers to, per platform) and its arithmetic
against an independent NumPy emulation (bf16 passes and TF32 formed from exact float64
products: the significand bits each keeps). The audit lowers the tiny model's train
step, prefill and decode step for 'tpu' and 'cuda' (`lowering_platforms`, on this CPU
machine): it passes the safe presets and fails, naming phase, layer and dot, on
bf16-everywhere declared safe, on a kernel narrowing the QK accumulation and on a float32
dot at DEFAULT where 'highest' was asked (TF32 on cuda, one bf16 pass on tpu).
"""
import dataclasses
import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import audit, decoding, platforms
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.inspect import report
from attnprec.inspect.finder import DotSite
from attnprec.precision import ALGORITHM_PRESETS, Precision
from test_audit import _narrow_qk_kernel, _train_only_flags

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = ModelConfig(vocab_size=13, d_model=16, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_hidden=32, max_seq_len=64)
SAFE = Precision(dtype="bfloat16")                      # gin/precision/fp32_attention.gin
HIGHEST = Precision(dtype="float32", einsum_precision="highest",
                    matmul_precision="highest")         # gin/precision/highest.gin
X = jax.ShapeDtypeStruct((2, 2), jnp.float32)


def _lowered_dot(preset: str, platform: str) -> str:
  text = jax.jit(lambda a, b: jnp.dot(a, b, precision=preset)).trace(X, X).lower(
      lowering_platforms=(platform,)).as_text()
  return next(line for line in text.splitlines() if "dot_general" in line)


# ----------------------------------------------------------------------------- the table
def test_the_cpu_row_is_what_jax_lowers_for_cpu():
  """jax's own lowering (not the table) decides which presets XLA:CPU takes."""
  accepted = set()
  for name in ALGORITHM_PRESETS:
    try:
      _lowered_dot(name, "cpu")
      accepted.add(name)
    except ValueError as e:
      assert "not supported by dot_general on CPU" in str(e)
  assert accepted == set(platforms.TABLE["cpu"].presets)


def test_a_preset_lowers_to_the_same_algorithm_on_every_platform():
  """So the audit may read a preset's algorithm from any platform's lowering."""
  for name in platforms.TABLE["cuda"].presets | platforms.TABLE["tpu"].presets:
    lines = {p: _lowered_dot(name, p).split("algorithm = ")[1] for p in ("tpu", "cuda")}
    assert lines["tpu"] == lines["cuda"], name
    assert f"<{report.algorithm_text(name)}>" in lines["cuda"], name


def _round(x, bits):
  """x rounded to `bits` significand bits (round to nearest), in float64."""
  m, e = np.frexp(x)
  return np.ldexp(np.round(m * 2.0 ** bits) / 2.0 ** bits, e)


def _split(x, pieces):
  out = []
  for _ in range(pieces):
    out.append(_round(x - sum(out), 8))
  return out


def test_the_arithmetic_bits_match_an_emulation():
  """Each arithmetic's products, emulated from exact float64 products of the rounded
  pieces, against the exact product: -log2(max relative error) lies within 2 bits below
  the table's figure (the product of two roundings loses about one bit) and at most one
  above (the emulation sums the six passes in float64, the MXU in float32)."""
  rng = np.random.default_rng(0)
  a, b = (rng.uniform(1, 2, 4000).astype(np.float32).astype(np.float64) for _ in "ab")
  exact = a * b
  (a1, a2, a3), (b1, b2, b3) = _split(a, 3), _split(b, 3)
  emulated = {
      "bf16": _round(a, 8) * _round(b, 8),
      "tf32": _round(a, 11) * _round(b, 11),
      "bf16_3x": a1 * b1 + a1 * b2 + a2 * b1,
      "bf16_6x": a1 * b1 + a1 * b2 + a2 * b1 + a1 * b3 + a3 * b1 + a2 * b2,
      "f32": (a.astype(np.float32) * b.astype(np.float32)).astype(np.float64)}
  for name, got in emulated.items():
    bits = -np.log2(np.max(np.abs(got - exact) / exact))
    want = platforms.ARITHMETIC_BITS[name]
    assert want - 2 <= bits <= want + 1, (name, bits, want)


def _dot(lhs="f32", rhs="f32", precision="DEFAULT", lhs_source=None, rhs_source=None):
  return DotSite(name="", source="", lhs=lhs, rhs=rhs, result="f32", precision=precision,
                 algorithm=None, preferred="f32", lhs_shape=[2, 2], rhs_shape=[2, 2],
                 result_shape=[2, 2], lhs_source=lhs_source, rhs_source=rhs_source)


@pytest.mark.parametrize("platform,products", [("cpu", "f32"), ("tpu", "one bf16 pass"),
                                               ("cuda", "TF32")])
def test_a_float32_dot_at_default_under_each_platform(platform, products):
  dot = _dot()
  assert report.products_text(dot, platform) == products
  problems = report.platform_problems(dot, "highest", platform)
  if platform == "cpu":
    assert problems == []              # XLA:CPU computes it in f32 whatever it asks
  else:
    assert len(problems) == 1 and products in problems[0] and "'highest'" in problems[0]
  # operands holding bf16 values lose nothing to a bf16 pass or TF32
  upcast = _dot(lhs_source="bf16", rhs_source="bf16")
  assert report.products_text(upcast, platform) == "exact (bf16 x bf16 values)"
  assert report.platform_problems(upcast, "highest", platform) == []
  assert report.platform_problems(_dot(precision="HIGHEST"), "highest", platform) == []


@pytest.mark.parametrize("platform,default,highest", [
    ("cpu", "exact (f16 x f16 values)", "exact (f16 x f16 values)"),
    ("tpu", "one bf16 pass", "3 bf16 passes"),
    ("cuda", "exact (f16 x f16 values)", "exact (f16 x f16 values)")])
def test_float16_dots_under_each_platform(platform, default, highest):
  """float16 operands, and float32 ones upcast from float16, at DEFAULT and HIGHEST; on
  tpu a 'highest' lowered at DEFAULT fails, and the 6-pass preset keeps 3 passes' bits."""
  for dot in (_dot("f16", "f16"), _dot(lhs_source="f16", rhs_source="f16")):
    assert report.products_text(dot, platform) == default
    hi = dataclasses.replace(dot, precision="HIGHEST")
    assert report.products_text(hi, platform) == highest
    assert report.platform_problems(hi, "highest", platform) == []
    problems = report.platform_problems(dot, "highest", platform)
    if platform == "tpu":
      assert len(problems) == 1 and "one bf16 pass" in problems[0] and \
          "promises 3 bf16 passes" in problems[0], problems
      x6 = dataclasses.replace(dot, algorithm="lhs_precision_type = bf16, "
                               "rhs_precision_type = bf16, accumulation_type = f32, "
                               "num_primitive_operations = 6")
      assert report.products_text(x6, platform) == "3 bf16 passes"
    else:
      assert problems == []
  # one float16 and one bf16 operand: the float16 row too; bf16 alone is exact anywhere
  assert report.products_text(_dot("f16", "bf16"), platform) == default.replace(
      "f16 x f16", "f16 x bf16")
  assert report.products_text(_dot("bf16", "bf16"), platform) == "exact (bf16 x bf16 values)"


def test_the_tpu_float16_row_is_what_a_tpu_measured():
  """results/tpu-f16/f16_products.txt, run on a TPU v5e: each product of float16 values at
  DEFAULT equals the product of the operands rounded to bf16 (and so for float32 ones
  upcast from float16); at HIGH, HIGHEST and under the 3- and 6-pass presets the worst
  product keeps the bits of the table's arithmetic within the emulation test's bounds."""
  path = os.path.join(ROOT, "results", "tpu-f16", "f16_products.txt")
  with open(path) as f:
    text = f.read()
  assert "backend: tpu" in text
  rows = {}
  for line in text.splitlines():
    m = re.match(r"(.+?)\s+equal to exact:\s+([\d.]+)%\s+to one bf16 pass:\s+([\d.]+)%"
                 r"\s+max rel err ([\d.e+-]+)", line)
    if m:
      rows[m.group(1).strip()] = (float(m.group(3)), float(m.group(4)))
  row = platforms.TABLE["tpu"]
  checked = 0
  for name, (one_pass, err) in rows.items():
    if not name.startswith(("f16 x f16", "f32(f16 values)")):
      continue
    preset = re.search(r"(BF16_BF16_F32\S*)", name)
    if preset:
      arithmetic = row.f16_arithmetic(algorithm=platforms.preset_arithmetic(preset[1]))
    else:
      arithmetic = row.f16_arithmetic(name.rsplit(", ", 1)[1])
    if arithmetic == "bf16":
      assert one_pass == 100.0, name
    else:
      bits = -np.log2(err)
      want = platforms.ARITHMETIC_BITS[arithmetic]
      assert want - 2 <= bits <= want + 1, (name, bits, arithmetic)
    checked += 1
  assert checked == 9, rows


def test_the_docs_show_the_table():
  with open(os.path.join(ROOT, "docs", "contract.md")) as f:
    assert platforms.markdown_table() in f.read()


def test_the_local_platform():
  assert platforms.local_platform("cpu") == "cpu"
  assert platforms.local_platform("gpu", "cuda 12.8") == "cuda"
  assert platforms.local_platform("gpu", "rocm 6.2") is None
  with pytest.raises(UserError, match="'cpu', 'tpu', 'cuda'"):
    platforms.check("gpu")


# ----------------------------------------------------------------------------- the audit
# Prefill and decode step that ignore the decode precision's `overrides` fields.
_drop_in_decoding = _train_only_flags


@pytest.mark.parametrize("platform,precision,wv", [
    ("tpu", SAFE, "one bf16 pass"), ("cuda", SAFE, "TF32"),
    ("tpu", HIGHEST, "6 bf16 passes (~f32)"), ("cuda", HIGHEST, "f32")])
def test_safe_presets_pass_on_tpu_and_cuda(platform, precision, wv):
  result = audit.run_audit(CONFIG, precision, precision, platform=platform)
  assert result["ok"], result["problems"]
  for phase in audit.PHASES:
    a = result["phases"][phase]
    if platform == audit.local_platform():      # on that backend: compiled and read
      assert a["compiled"]["rows"] and a["compiled"]["ok"], a["compiled"]["problems"][:4]
    else:
      assert "compiled" not in a and "lowered StableHLO" in a["compiled_skipped"]
    forward = [r for r in a["attention"] if not r["backward"]]
    assert len(forward) == 2 * CONFIG.num_layers
    # the f32 probabilities into the wv dot: what the precision makes of them there
    assert {r["on_platform"] for r in forward if r["site"] == "wv"} == {wv}
  assert f"on {platform}" in audit.verdict(result)
  assert f"## On {platform}" in audit.to_markdown(result)
  # bf16 + flags at 'default': the f32 probabilities into the wv dot lose bits there, and
  # the verdict counts them; 'highest' keeps them
  counted = f"fewer bits than their operands hold ({wv})" in audit.verdict(result)
  assert counted is (precision is SAFE), audit.verdict(result)


@pytest.mark.parametrize("form", ["auto", "float32_dot"])
def test_the_audit_reads_float16_dots_on_tpu_by_the_measured_row(form):
  """dtype='float16' lowered for tpu: the qk dot and the dense projections (float16
  operands, or float32 ones upcast from float16 in the float32_dot form) multiply in one
  bf16 pass at 'default' and in 3 passes at 'highest' (the table's float16 row); the
  probabilities into the wv dot are genuine float32 values and keep the float32 row."""
  for asked, products, wv in (("default", "one bf16 pass", "one bf16 pass"),
                              ("highest", "3 bf16 passes", "6 bf16 passes (~f32)")):
    precision = Precision(dtype="float16", projection_form=form, einsum_precision=asked,
                          matmul_precision=asked)
    result = audit.run_audit(CONFIG, precision, precision, platform="tpu")
    assert result["ok"], result["problems"]
    # the verdict says how many dots multiply in fewer bits than their operands hold
    verdict = audit.verdict(result)
    assert verdict.startswith("PASS")
    assert (" dots read multiply in fewer bits than their operands hold (one bf16 pass)"
            in verdict) is (asked == "default"), verdict
    for phase in audit.PHASES:
      a = result["phases"][phase]
      forward = [r for r in a["attention"] if not r["backward"]]
      assert {r["on_platform"] for r in forward if r["site"] == "qk"} == {products}
      assert {r["on_platform"] for r in forward if r["site"] == "wv"} == {wv}
      projections = [r for r in a["dense"] if not r["backward"] and r["module"] != "unembed"]
      assert projections and {r["on_platform"] for r in projections} == {products}, phase


def test_bf16_everywhere_declared_safe_fails_naming_the_stage(monkeypatch):
  _drop_in_decoding(monkeypatch, float32_qk_product=False, float32_logits=False)
  result = audit.run_audit(CONFIG, SAFE, SAFE, platform="tpu")
  assert result["phases"]["train"]["ok"] and not result["ok"]
  for phase in ("prefill", "decode"):
    problems = result["phases"][phase]["problems"]
    assert any(p.startswith(f"{phase} layer 0 qk: QK^T logits are bf16") for p in problems)


def test_a_kernel_narrowing_the_qk_accumulation_fails(monkeypatch):
  """float32_qk_product=True, but the kernel forms the product with a bf16 result and
  casts it to f32 after (as tests/test_audit.py's variant): every phase FAILs."""
  _narrow_qk_kernel(monkeypatch)
  result = audit.run_audit(CONFIG, SAFE, SAFE, platform="cuda")
  for phase in audit.PHASES:
    assert any(p.startswith(f"{phase} layer 0 qk: QK^T logits are bf16, expected f32")
               for p in result["phases"][phase]["problems"]), phase


@pytest.mark.parametrize("platform,products", [("cuda", "TF32"), ("tpu", "one bf16 pass")])
def test_a_float32_dot_at_default_where_highest_was_asked_fails(monkeypatch, platform,
                                                                 products):
  """Decoding drops einsum_precision='highest' (float32 compute): on cuda its dots run in
  TF32, on tpu in one bf16 pass; the audit says so, naming phase, layer and dot."""
  _drop_in_decoding(monkeypatch, einsum_precision="default")
  result = audit.run_audit(CONFIG, HIGHEST, HIGHEST, platform=platform)
  assert result["phases"]["train"]["ok"]
  for phase in ("prefill", "decode"):
    problems = result["phases"][phase]["problems"]
    for site in ("qk", "wv"):
      assert any(p.startswith(f"{phase} layer 0 {site}: on {platform} this f32 x f32 dot "
                              f"(DEFAULT) multiplies in {products}") for p in problems)


def test_a_preset_the_platform_refuses_is_refused_before_lowering(monkeypatch):
  monkeypatch.setattr(audit, "_lower", None)          # nothing may be lowered
  with pytest.raises(UserError, match="Platform 'tpu' cannot honour einsum_precision="
                                      "'F32_F32_F32'"):
    audit.lower_programs(CONFIG, SAFE, Precision(einsum_precision="F32_F32_F32"),
                         platform="tpu")
  with pytest.raises(UserError, match="float8 operands"):
    platforms.check_precision("cuda", Precision(matmul_precision="ANY_F8_ANY_F8_F32"))


def test_the_model_refuses_a_matmul_precision_the_platform_does_not_honour():
  """The dense dots' matmul_precision is refused while the model is traced, as the
  attention kernels refuse an einsum_precision (`platforms.check_traced`): traced for a
  TPU, F32_F32_F32 (a TPU has no such dot); here, a preset this platform's dots reject,
  through the public API (a UserError naming it, not XLA's ValueError)."""
  from attnprec import checkpoints
  from attnprec.model import init_params, transformed
  from attnprec.precision import target_backend
  params = jax.eval_shape(lambda: init_params(CONFIG, jax.random.PRNGKey(0)))
  tokens = jax.ShapeDtypeStruct((1, 4), jnp.int32)
  f32 = Precision(matmul_precision="F32_F32_F32")
  with target_backend("tpu"):
    with pytest.raises(UserError, match="Platform 'tpu' cannot honour matmul_precision="
                                        "'F32_F32_F32'"):
      jax.eval_shape(lambda p, t: transformed(CONFIG).apply(p, t, precision=f32),
                     params, tokens)
  local = platforms.local_platform(jax.default_backend())
  refused = next(p for p in sorted(ALGORITHM_PRESETS) if platforms.refusal(
      local, p, knob="matmul_precision"))
  with pytest.raises(UserError, match=f"Platform '{local}' cannot honour matmul_precision="
                                      f"'{refused}'"):
    checkpoints.logits((CONFIG, init_params(CONFIG, jax.random.PRNGKey(0))), [[1, 2, 3]],
                       precision=Precision(matmul_precision=refused))


@pytest.mark.skipif(jax.default_backend() != "cpu",
                    reason="an accelerator is here: make device-check runs its checks")
def test_device_check_without_a_gpu_says_so_in_one_line(tmp_path, capsys):
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "device_check", os.path.join(ROOT, "runners", "device_check.py"))
  runner = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(runner)
  out = tmp_path / "out"
  assert runner.main([f"--out={out}"]) == 0
  lines = capsys.readouterr().out.strip().splitlines()
  assert len(lines) == 1 and "no GPU" in lines[0], lines
  assert not out.exists()
  # a bad --out is bad input here too, though nothing would be written (it exited 0)
  not_a_dir = tmp_path / "file"
  not_a_dir.write_text("x")
  assert runner.main([f"--out={not_a_dir}"]) == 2
  assert "exists and is not a directory" in capsys.readouterr().err


def test_device_check_refuses_another_runner_s_directory_and_claims_its_own(tmp_path,
                                                                            monkeypatch):
  """Where it runs (here: told it is on a TPU, no part asked for), the device check
  refuses an --out another runner made, before anything is written, and records its own
  --out as the device check's, so that other runners refuse it."""
  import importlib.util
  from attnprec import runs
  from attnprec.errors import UserError
  spec = importlib.util.spec_from_file_location(
      "device_check", os.path.join(ROOT, "runners", "device_check.py"))
  runner = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(runner)
  monkeypatch.setattr(runner, "here", lambda: "tpu")
  study = tmp_path / "study_run"
  runs.claim(str(study), "study")
  with pytest.raises(UserError, match="made by the 'study' runner"):
    runner.check(str(study), wanted=())
  assert sorted(os.listdir(study)) == [runs.OWNER_FILE]
  out = tmp_path / "dc"
  assert runner.check(str(out), wanted=()) == 0
  assert runs.owner(str(out)) == "device_check"
  assert (out / "device_check.json").exists()


def test_device_check_tables_are_its_files_or_a_paragraph(tmp_path, capsys):
  """`--tables=DIR` (any machine): the docs' tables from DIR's files; an option it would
  not read, a NaN figure, a file that is not a results file, or no file: exit 2, one
  paragraph naming it."""
  import importlib.util
  import shutil
  spec = importlib.util.spec_from_file_location(
      "device_check", os.path.join(ROOT, "runners", "device_check.py"))
  runner = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(runner)
  results = os.path.join(ROOT, "results", "tpu-device-check")
  assert runner.main([f"--tables={results}"]) == 0
  assert "| 1 x 4k | 1.99 ms |" in capsys.readouterr().out
  assert runner.main([f"--tables={results}", "--parts=train"]) == 2
  assert "--parts would not be read" in capsys.readouterr().err
  bad = tmp_path / "bad"
  bad.mkdir()
  assert runner.main([f"--tables={bad}"]) == 2
  assert "no device-check file there" in capsys.readouterr().err
  with open(os.path.join(results, "device_check-decode.json")) as f:
    record = json.load(f)
  case = next(iter(record["parts"].values()))["cases"]["1x4096"]
  case["step_ms"] = float("nan")
  (bad / "device_check-decode.json").write_text(json.dumps(record))
  assert runner.main([f"--tables={bad}"]) == 2
  assert "1x4096, step_ms is nan" in capsys.readouterr().err
  shutil.copy(os.path.join(results, "device_check-decode.json"), bad)
  (bad / "device_check.json").write_text("[1]")
  assert runner.main([f"--tables={bad}"]) == 2
  assert "is not a device check's results file" in capsys.readouterr().err


def test_inspect_reads_a_function_under_the_platform(capsys):
  """MaxText's attention (attnprec.inspect.examples) drops its `precision`: lowered for
  tpu, its wv dot multiplies the f32 probabilities in one bf16 pass where 'highest' was
  asked; its qk dot (f32 operands upcast from bf16) loses nothing."""
  from attnprec.inspect import examples, inspect_lowered, job
  args, kwargs = examples.maxtext_inputs()
  lowered = job.lower_for(examples.maxtext_attention, "tpu", args, kwargs)
  asked = Precision(dtype="bfloat16", einsum_precision="highest")
  problems = inspect_lowered(lowered, expect=asked, platform="tpu").problems()
  on_tpu = [p for p in problems if "on tpu" in p]
  assert len(on_tpu) == 1 and "multiplies in one bf16 pass" in on_tpu[0], problems
  assert "6 bf16 passes" in on_tpu[0]


def test_the_jax_nn_kernel_with_cudnn_is_refused_for_cuda_here():
  import functools

  from attnprec.inspect import job
  from attnprec.kernels import jax_nn
  fn = functools.partial(jax_nn.jax_nn_attention, implementation="cudnn")
  x = jax.ShapeDtypeStruct((1, 16, 4, 32), jnp.bfloat16)
  with pytest.raises(Exception) as raised:     # the kernel's own refusal, or jax's
    job.lower_for(fn, "cuda", (x, x, x), {})
  message = str(job.lowering_error("jax_nn_attention", "cuda", raised.value, "shapes"))
  assert "for platform 'cuda' failed" in message and "cuDNN" in message


def test_device_check_reports_no_figure_for_a_non_finite_kernel():
  """A kernel whose output is NaN gets an error row, not a time and an error of NaN."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "device_check", os.path.join(ROOT, "runners", "device_check.py"))
  runner = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(runner)
  x = jnp.ones((2, 3))
  rows = runner.timed_rows({"good": lambda q: q, "broken": lambda q: q * jnp.nan}, (x,),
                           np.ones((2, 3)), base="good")
  assert rows["good"]["max_abs_error"] == 0.0 and rows["good"]["time_vs_base"] == 1.0
  assert set(rows["broken"]) == {"error"} and "not finite" in rows["broken"]["error"]
