"""Smoke test of the attention benchmark on a tiny shape (its numbers are not checked)."""
import json

from attnprec.bench import attention as bench


def test_tiny_run_reports_every_configuration(tmp_path):
  result = bench.run_attention_bench(
      seq_lens=(64,), heads=2, head_dim=8, kernels=("dot_product", "jax_nn"),
      presets=("bf16", "fp32_attention"), reps={64: 2}, include_torch=False,
      memory_seq_lens=(128,), memory_presets=("fp32_attention",), matmul_size=128,
      decode_seq_lens=(96,), decode_presets=("fp32_attention",), decode_reps=2,
      progress=False)
  rows = {(r["kernel"], r["preset"]): r for r in result["rows"]}
  assert rows[("jax_nn", "bf16")]["status"] == "unsupported"
  assert "float32_qk_product=False" in rows[("jax_nn", "bf16")]["reason"]
  for key in (("dot_product", "bf16"), ("dot_product", "fp32_attention"),
              ("jax_nn", "fp32_attention")):
    assert rows[key]["status"] == "ok" and rows[key]["reps"] == 2
  assert rows[("dot_product", "bf16")]["vs_dot_product_bf16"] == 1.0
  # Causal convention: half of 4*B*N*T*S*H.
  assert bench.useful_flops(1, 2, 64, 64, 8) == 2 * 2 * 64 * 64 * 8
  assert {m["kernel"] for m in result["memory"]} == {"dot_product", "jax_nn"}
  assert {(d["kernel"], d["position"]) for d in result["decode"]} == {
      (k, p) for k in ("dot_product", "jax_nn") for p in (95, 24)}
  json.dumps(result)  # plain data
  assert "| 64 | jax_nn | bf16 | unsupported" in bench.to_markdown(result)
  bench.plot(result, str(tmp_path / "a.png"))
  assert (tmp_path / "a.png").stat().st_size > 0
