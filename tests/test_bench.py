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


def test_tiny_model_bench_reports_every_case(tmp_path):
  """The whole-model bench (attnprec/bench/model.py) on a tiny random model, without
  transformers: every case and preset timed, ratios to fp32, the roofline, the flag
  cost per phase, markdown and plot (its numbers are not checked)."""
  import jax

  from attnprec.bench import model as model_bench
  from attnprec.config import ModelConfig
  from attnprec.model import init_params
  config = ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=8, mlp_hidden=16, max_seq_len=64)
  params = init_params(config, jax.random.PRNGKey(0))
  result = model_bench.run_model_bench(
      config=config, params=params, model="tiny", cases=((2, 9),), steps=3, rounds=2,
      include_torch=False, flag_case=(1, 6), train_tokens=8, bandwidth_mbytes=1, progress=False)
  rows = {(r["name"], r["batch"], r["prompt"]): r for r in result["rows"]}
  assert set(rows) == {(n, 2, 9) for n in ("fp32", "bf16_flags")}
  for r in rows.values():
    assert len(r["step_times_s"]) == 2 and r["tokens_per_s"] > 0 and r["of_roofline"] > 0
    assert set(r["compile_s"]) == {"prefill", "decode"}
  assert rows[("fp32", 2, 9)]["step_vs_fp32"] == 1.0
  # The floor counts the weights as each configuration holds them: float32-carried bf16
  # values are 4 bytes each, like fp32 (bf16-stored ones would be 2).
  assert rows[("bf16_flags", 2, 9)]["weights"] == "carried"
  assert rows[("fp32", 2, 9)]["weights"] == "float32"
  assert rows[("bf16_flags", 2, 9)]["weight_bytes"] == rows[("fp32", 2, 9)]["weight_bytes"]
  assert set(result["flags"]["flags_over_no_flags"]) == {"train", "prefill", "decode"}
  json.dumps(result)
  table = model_bench.to_markdown(result)
  assert "| 2, 9 | bf16_flags | carried |" in table and "| decode |" in table
  model_bench.plot(result, str(tmp_path / "m.png"))
  assert (tmp_path / "m.png").stat().st_size > 0
