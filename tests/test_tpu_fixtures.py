"""The TPU readers on what a TPU compiled: fixtures captured on a TPU v5e (jax 0.10.2).

tests/fixtures/tpu holds the TPU compiler's optimized HLO of the audit's three programs
for the tiny recall architecture under several presets, and of jax's own splash attention
and TPU flash_attention (scripts/capture_tpu_fixtures.py; manifest.json). These tests
run anywhere: the programs are lowered for tpu on this machine, and the compiled
checks read the captured text instead of compiling (`audit.run_audit(compiled_texts=)`).
What they hold the audit to is the issue's list: the safe presets pass with a non-empty
compiled table that reads every attention dot; the bf16 program held to
fp32_attention's contract, the float32-at-DEFAULT program held to 'highest' and a Pallas
body with bf16 logits fail, naming phase, layer and dot; the TPU's rewrite of the wv
result to bf16 is named; a reader that reads nothing fails.
"""
import base64
import functools
import gzip
import os

import pytest

from attnprec import audit
from attnprec.inspect import compiled, mosaic
from tpu_cases import CONFIG, PRESETS, SAFE

HERE = os.path.join(os.path.dirname(__file__), "fixtures", "tpu")


def fixture(name: str) -> str:
  with gzip.open(os.path.join(HERE, name + ".hlo.txt.gz"), "rt") as f:
    return f.read()


def texts(program: str) -> dict:
  return {ph: fixture(f"{program}-{ph}") for ph in audit.PHASES
          if os.path.exists(os.path.join(HERE, f"{program}-{ph}.hlo.txt.gz"))}


@functools.lru_cache(maxsize=None)
def audited(held: str, program: str) -> dict:
  """The audit of `program`'s captured TPU programs held to preset `held`."""
  p = PRESETS[held]
  train = SAFE if p.kernel == "pallas" else p
  return audit.run_audit(CONFIG, train, p, platform="tpu", compiled_texts=texts(program))


@pytest.mark.parametrize("preset", ["fp32_attention", "highest", "blockwise", "pallas"])
def test_safe_presets_pass_on_tpu_with_every_attention_dot_read(preset):
  r = audited(preset, preset)
  assert r["ok"], r["problems"][:5]
  for ph in texts(preset):
    c = r["phases"][ph]["compiled"]
    assert c["rows"], f"{ph}: empty compiled table"
    if preset != "pallas":
      # every forward qk and wv dot of the lowered program, attributed by name
      assert c["attention_dots_attributed"] == c["attention_dots_lowered"] == 4
      layers = {row["layers"] for row in c["rows"] if row["site"] in ("qk", "wv")}
      assert layers == {"0,1"}, c["rows"]
  if preset == "pallas":
    for ph in ("prefill", "decode"):
      m = r["phases"][ph]["mosaic"]
      assert m["source"] == "compiled" and len(m["calls"]) == CONFIG.num_layers
      assert all(c["ok"] and c["summary"]["qk"] == ["bf16 x bf16 -> f32"] for c in m["calls"])


def test_bf16_program_held_to_fp32_attention_fails_naming_phase_layer_and_dot():
  r = audited("fp32_attention", "bf16")
  assert not r["ok"]
  for ph in ("train", "prefill", "decode"):
    for layer in (0, 1):
      assert any(p.startswith(f"{ph} compiled qk dot layer {layer}") and
                 "stores its result as bf16" in p and "requires f32 logits" in p
                 for p in r["problems"]), (ph, layer, r["problems"][:8])


def test_float32_at_default_held_to_highest_fails_with_one_bf16_pass():
  r = audited("highest", "fp32")
  problems = [p for p in r["problems"] if "compiled" in p]
  for site in ("qk", "wv", "dense"):
    assert any(f"compiled {site} dot layer 0" in p and "compiled at DEFAULT: one bf16 pass "
               "on tpu" in p and "6 bf16 passes" in p for p in problems), site


def test_the_tpu_rewrite_of_the_wv_result_is_named_not_failed():
  r = audited("fp32", "fp32")
  assert r["ok"], r["problems"][:4]
  rows = r["phases"]["prefill"]["compiled"]["rows"]
  wv = [row for row in rows if row["site"] == "wv"]
  assert wv and all("-> bf16" in row["types"] for row in wv)
  assert all("read only by attn/o (DEFAULT)" in row["rewrite"] and
             "one bf16 pass" in row["rewrite"] for row in wv), wv
  # ... and the o-projection's bf16 operand is the same rewrite seen from the consumer
  assert any(row["site"] == "dense" and "lhs stored as bf16" in row["rewrite"]
             for row in rows)


def test_a_stored_bf16_result_that_a_non_dot_reads_is_a_problem():
  """The rewrite is allowed only where every reader is a one-pass dot: the same wv dot
  held to its contract with no readers known fails."""
  from attnprec.inspect import report
  dot = next(d for d in compiled.compiled_summary(fixture("fp32-prefill"))["dots"]
             if d.site == "wv")
  assert report.check_compiled_dot(dot, PRESETS["fp32"], "tpu") == []
  import dataclasses
  alone = dataclasses.replace(dot, feeds_only_dots=False)
  assert any("stores its result as bf16" in p
             for p in report.check_compiled_dot(alone, PRESETS["fp32"], "tpu"))
  # on a platform without the rule (XLA:CPU's dots return their accumulation) it fails
  assert report.check_compiled_dot(dot, PRESETS["fp32"], "cpu")


def test_a_pallas_body_with_bf16_logits_fails_where_f32_is_declared():
  r = audit.run_audit(CONFIG, SAFE, PRESETS["pallas"], platform="tpu",
                      compiled_texts={"prefill": fixture("pallas_bf16-prefill")})
  problems = r["phases"]["prefill"]["problems"]
  assert any("Mosaic QK matmul [bf16 x bf16 -> f32->bf16] gives bf16 logits" in p
             for p in problems), problems[:4]
  assert any("Mosaic exp in bf16" in p for p in problems)


def test_a_reader_that_reads_nothing_fails():
  s = audit.summarize_compiled("HloModule empty\n", SAFE, platform="tpu",
                               expected_attention_dots=4)
  assert not s["ok"] and "0 attention dots read where the lowered program has 4" in \
      s["problems"][-1]


def test_jax_splash_and_flash_attention_bodies_read():
  splash = mosaic.read_calls(fixture("jax_splash_attention"))
  flash = mosaic.read_calls(fixture("jax_flash_attention"))
  assert len(splash) == 1 and len(flash) == 1
  s = mosaic.summary(splash[0][1])
  assert s["attention"] and s["qk"] == ["bf16 x bf16 -> f32"] and s["exp"] == ["f32"]
  assert s["pv"] == ["f32 x f32<-bf16 -> f32"] and s["pv_products"] == ["one bf16 pass"]
  f = mosaic.summary(flash[0][1])
  assert f["probabilities"] == ["bf16 (rounded from f32)"] and f["max"] == ["f32"]


def test_attnprec_flash_bodies_hold_both_flags_as_the_tpu_compiled_them():
  """attnprec's flash kernel, both flags, a 128-wide head read where the caller holds it
  (`flash_direct-*`: scripts/capture_tpu_fixtures.py --only=flash): the prefill holds one
  body, the gradient three (forward with the logsumexp, dq, dk/dv); each reads as an
  attention whose QK product is exact bf16 x bf16 into float32 and whose softmax (exp2:
  the base-2 softmax) runs in float32. The forward bodies pass the fp32_attention row and,
  held to the bf16 preset (bf16 logits declared), fail naming the QK result; the
  backward bodies round P to bf16 before their gradient dots, as `contract.BACKWARD`
  says (the audit reads those from the jaxpr: `audit.run_audit`)."""
  import json
  with open(os.path.join(HERE, "manifest.json"), encoding="utf-8") as f:
    assert json.load(f)["flash_direct"]["H"] == 128
  for phase, kernels in (("prefill", ["attn_flash_fwd"]),
                         ("train", ["attn_flash_dkv", "attn_flash_dq", "attn_flash_fwd"])):
    calls = mosaic.read_calls(fixture(f"flash_direct-{phase}"))
    assert sorted(body.kernel for _, body in calls) == kernels
    for _, body in calls:
      s = mosaic.summary(body)
      assert s["attention"] and set(s["qk"]) == {"bf16 x bf16 -> f32"}, s
      assert s["exp"] == ["f32"], s
      if body.kernel != "attn_flash_fwd":
        assert set(s["probabilities"]) == {"bf16 (rounded from f32)"}, s
        continue
      assert s["pv"] == ["f32 x f32<-bf16 -> f32"] * len(s["pv"]), s
      assert mosaic.check_body(body, SAFE) == [], mosaic.check_body(body, SAFE)
      bad = mosaic.check_body(body, PRESETS["bf16"])
      assert any("QK" in p for p in bad), bad


def test_an_unreadable_mosaic_body_is_unread_and_fails():
  text = fixture("pallas-prefill")
  call = mosaic.custom_calls(text)[0]
  broken = text.replace(call.body, base64.b64encode(b"not a module").decode())
  r = audit.run_audit(CONFIG, SAFE, PRESETS["pallas"], platform="tpu",
                      compiled_texts={"prefill": broken})
  assert not r["ok"]
  assert any("could not be opened" in p and "unread, not checked" in p
             for p in r["phases"]["prefill"]["problems"])


def test_jax_ragged_paged_attention_body_read():
  """The TPU serving kernel (compiled on the TPU: its Mosaic lowering needs one)."""
  (call, body), = mosaic.read_calls(fixture("jax_ragged_paged_attention"))
  s = mosaic.summary(body)
  assert s["attention"] and s["exp"] == ["f32"] and s["max"] == ["f32"]
  assert all(q.endswith("-> f32") for q in s["qk"])
  assert s["pv_products"] and set(s["pv_products"]) == {"one bf16 pass"}


def test_make_inspect_reads_splash_attention_lowered_for_tpu_here(tmp_path):
  """`make inspect --platform=tpu` on jax's splash attention, on this (CPU) machine: the
  kernel's body is read from the program lowered for tpu, never 'no attention'."""
  import gin
  from attnprec.inspect import job
  gin.clear_config()
  report = job.inspect_job(run_dir=str(tmp_path), fn="attnprec.inspect.examples:splash_attention",
                           inputs="attnprec.inspect.examples:splash_inputs", platform="tpu")
  assert len(report.kernel_attentions) == 1 and not report.unread_kernels
  assert "NO ATTENTION" not in report.verdict() and "1 attention(s) found" in report.verdict()
  table = report.kernel_table()
  assert "splash_mha_fwd" in table and "f32, which the matmul at DEFAULT takes as bf16" in table
  # held to the safe preset: splash's probabilities are f32 into the PV matmul, as asked
  report.expect = SAFE
  assert report.ok, report.problems()
  assert (tmp_path / "inspect.md").exists()


def test_a_kernel_no_reader_opens_is_unread_not_no_attention():
  from attnprec.inspect.report import Report
  from attnprec.inspect.finder import Findings
  r = Report(function="f", findings=Findings(attentions=[], dense=[]),
             kernels=[{"call": "__gpu$xla.gpu.triton", "kernel": "__gpu$xla.gpu.triton",
                       "unread": "a __gpu$xla.gpu.triton custom call: no reader here "
                                 "opens its body"}])
  assert r.verdict().startswith("UNREAD:") and "NO ATTENTION" not in r.verdict()
  r.expect = SAFE
  assert not r.ok and any("unread" in p for p in r.problems())
