"""What only a TPU can show: run by `make test-tpu` on a TPU machine, skipped elsewhere.

  * the platform bound of tests/platform_bounds.py, tested: a float32 attention at DEFAULT
    is further from float64 than float32 arithmetic allows (its dots take one bf16 pass)
    and within KERNEL_UNITS units of 2^-8; at 'highest' it is back at float32's bound;
  * the compiled audit on this TPU: the safe presets pass all three phases with every
    attention dot read back compiled; programs that break the contract fail, naming the
    phase, layer and dot (the compiled text of one program held to another's contract);
  * one Pallas body: the interpreted kernel (XLA:CPU, in this process) and the Mosaic
    kernel (this TPU) on the same inputs agree within the platform's bound, every knob,
    'highest' included (it compiles: float32 operands into Mosaic's fp32 matmul);
  * jax's ragged paged attention, which lowers only on a TPU, read by `make inspect`.
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import audit, contract, kernels
from attnprec.precision import Precision
from platform_bounds import KERNEL_UNITS, tol
from tpu_cases import CONFIG, PRESETS, SAFE

pytestmark = pytest.mark.skipif(
    jax.default_backend() != "tpu",
    reason="needs a TPU (make test-tpu on a TPU machine; docs/tpu.md)")


def _inputs(seed=0, B=2, T=64, N=4, K=2, H=64):
  rng = np.random.default_rng(seed)
  return [rng.standard_normal((B, T, n, H)).astype(np.float32) for n in (N, K, K)]


# ----------------------------------------------------------------------------- the bound
def test_float32_at_default_takes_one_bf16_pass_and_stays_within_the_bound():
  q, k, v = _inputs()
  T = q.shape[1]
  mask = np.tril(np.ones((T, T), bool))[None, None]
  ref = contract.reference_attention_np(q, k, v, mask=mask)
  err = {}
  for name in ("default", "highest"):
    p = Precision(dtype="float32", einsum_precision=name)
    out = kernels.attend(p, *(jnp.asarray(x) for x in (q, k, v)), mask=mask)
    err[name] = float(np.abs(np.asarray(out, np.float64) - ref).max())
  assert err["default"] > 2e-5, err          # the rounding is real: f32 bounds do not hold
  assert err["default"] <= tol(2e-5, KERNEL_UNITS), err
  assert err["highest"] <= tol(2e-5, precision="highest") == 2e-5, err


# ----------------------------------------------------------------------------- the audit
def _compiled(name: str) -> dict:
  p = PRESETS[name]
  train = SAFE if p.kernel == "pallas" else p
  traced = audit.trace_programs(CONFIG, train, p, platform="tpu")
  return {ph: t.lower().compile().as_text() for ph, (_, t) in traced.items()}


@pytest.mark.parametrize("preset", ["fp32_attention", "highest", "blockwise", "pallas"])
def test_the_audit_passes_the_safe_presets_on_this_tpu(preset):
  p = PRESETS[preset]
  r = audit.run_audit(CONFIG, SAFE if p.kernel == "pallas" else p, p, platform="tpu")
  assert r["ok"], r["problems"][:6]
  for ph in audit.PHASES:
    c = r["phases"][ph]["compiled"]
    assert c["rows"], ph
    if not (p.kernel == "pallas" and ph != "train"):
      assert c["attention_dots_attributed"] == c["attention_dots_lowered"] == 4, (ph, c)
  if preset == "pallas":
    assert all(len(r["phases"][ph]["mosaic"]["calls"]) == 2 for ph in ("prefill", "decode"))


def test_the_audit_fails_programs_that_break_the_contract_on_this_tpu():
  bf16 = audit.run_audit(CONFIG, SAFE, SAFE, platform="tpu", compiled_texts=_compiled("bf16"))
  for ph in audit.PHASES:
    assert any(p.startswith(f"{ph} compiled qk dot layer 0") and "bf16" in p
               for p in bf16["problems"]), ph
  highest = PRESETS["highest"]
  fp32 = audit.run_audit(CONFIG, highest, highest, platform="tpu",
                         compiled_texts=_compiled("fp32"))
  assert any("compiled at DEFAULT: one bf16 pass on tpu" in p for p in fp32["problems"])


# ----------------------------------------------------------------------------- one body
@pytest.mark.parametrize("einsum", ["default", "highest"])
@pytest.mark.parametrize("qk,logits", [(False, False), (False, True), (True, False),
                                       (True, True)])
def test_interpreted_and_mosaic_pallas_bodies_agree(qk, logits, einsum):
  """Keys sharing a large offset (a vector in 8 channels, as Qwen2's key bias): where the
  logits are bf16 both bodies round them (an error of ~1 against float64), where they are
  f32 neither does; the two agree within the bound either way."""
  q, k, v = _inputs(seed=1, B=1, T=256)
  k[..., :8] += 40.0
  T = q.shape[1]
  mask = np.tril(np.ones((T, T), bool))[None, None]
  p = Precision(dtype="bfloat16", kernel="pallas", float32_qk_product=qk,
                float32_logits=logits, einsum_precision=einsum)
  args = [jnp.asarray(x, jnp.bfloat16) for x in (q, k, v)]
  tpu = np.asarray(jnp.asarray(kernels.attend(p, *args, mask=mask), jnp.float32))
  cpu_device = jax.devices("cpu")[0]
  with jax.default_device(cpu_device):
    cpu_args = [jax.device_put(x, cpu_device) for x in args]
    cpu = np.asarray(jnp.asarray(kernels.attend(p, *cpu_args, mask=mask), jnp.float32))
  ref = contract.reference_attention_np(*(np.asarray(jnp.asarray(x, jnp.float32))
                                          for x in args), mask=mask)
  diff = float(np.abs(tpu - cpu).max())
  # outputs are bf16 (unit 2^-8 at |out| < 1): at 'highest' the two differ by rounding
  # order alone; at DEFAULT the TPU's PV dot also takes f32 probabilities as bf16
  units = 2 if einsum == "highest" and not logits else KERNEL_UNITS
  assert diff <= units * 2.0 ** -8, (diff, float(np.abs(tpu - ref).max()),
                                     float(np.abs(cpu - ref).max()))
  if not qk:     # bf16 logits of offset keys: both bodies round them, beyond the bound
    far = KERNEL_UNITS * 2.0 ** -8     # (0.074 measured on a TPU v5e, both bodies)
    assert float(np.abs(cpu - ref).max()) > far and float(np.abs(tpu - ref).max()) > far


# ----------------------------------------------------------------------------- inspect
def test_make_inspect_reads_ragged_paged_attention_on_this_tpu(tmp_path):
  from attnprec.inspect import job
  report = job.inspect_job(run_dir=str(tmp_path),
                           fn="attnprec.inspect.examples:ragged_paged_attention",
                           inputs="attnprec.inspect.examples:ragged_paged_inputs",
                           platform="tpu")
  assert len(report.kernel_attentions) == 1 and not report.unread_kernels
  assert "ragged_paged_attention_kernel" in report.kernel_table()
