"""Smoke test of the attention benchmark on a tiny shape (its numbers are not checked)."""
import json

import numpy as np
import pytest

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


def test_the_attention_suite_runs_splash_prefill_and_says_it_has_no_decode_step():
  """'splash' (not a default: a Pallas kernel, interpreted on CPU) asked for by name: its
  prefill runs (the keys are the queries' own tokens, `CausalMask(own_positions=True)`),
  its decode rows are refused with its reason, never a crash of the whole run; the
  defaults leave every Pallas kernel out."""
  assert not {"pallas", "flash", "splash"} & set(bench.KERNELS)
  result = bench.run_attention_bench(
      seq_lens=(128,), heads=2, head_dim=16, kernels=("splash",),
      presets=("fp32_attention",), reps={128: 1}, include_torch=False,
      memory_seq_lens=(), memory_presets=("fp32_attention",), matmul_size=128,
      decode_seq_lens=(96,), decode_presets=("fp32_attention",), decode_reps=1,
      progress=False)
  assert [r["status"] for r in result["rows"]] == ["ok"]
  (d,) = result["decode"]
  # a shape it refuses at trace (head dim 8: a query scale that is no power of two) is a
  # row that says so
  small = bench.run_attention_bench(
      seq_lens=(64,), heads=2, head_dim=8, kernels=("splash",), presets=("fp32_attention",),
      reps={64: 1}, include_torch=False, memory_seq_lens=(64,),
      memory_presets=("fp32_attention",), matmul_size=128, decode_seq_lens=(),
      progress=False)
  assert small["rows"][0]["status"] == "unsupported"
  assert small["memory"][0]["status"] == "unsupported"
  assert "query scale" in small["rows"][0]["reason"]
  assert d["status"] == "refused" and "positions other than" in d["reason"]
  assert "| refused: The 'splash' attention kernel" in bench.to_markdown(result)


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
  params = jax.jit(init_params, static_argnums=0)(config, jax.random.PRNGKey(0))
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
  # prefill against the matmul peak of its dtype, measured in the same run
  assert set(result["matmul_peak"]) == {"f32", "bf16"}
  for r in rows.values():
    assert r["prefill_matmul_flops"] == model_bench.projection_flops(params, config, 2, 9)
    assert r["of_matmul_peak"] > 0
  assert model_bench.TORCH_DTYPES == {"float32": "transformers",
                                      "bfloat16": "transformers_bf16"}
  assert all(P + 32 <= 8192 for _, P in model_bench.LONG_CASES)   # SmolLM2's context
  json.dumps(result)
  table = model_bench.to_markdown(result)
  assert "| 2, 9 | bf16_flags | carried |" in table and "| decode |" in table
  # A quantized-cache preset: its kv_bytes are the stored codes and scales (int8 at
  # head dim 8: 8 one-byte codes + a 4-byte scale per token and side, vs 16 bytes bf16).
  kv = model_bench.run_model_bench(
      config=config, params=params, model="tiny", cases=((2, 9),), steps=3, rounds=1,
      presets=("bf16_flags_kv_int8",), include_torch=False, flag_phases=False,
      bandwidth_mbytes=1, progress=False)
  bf16_cache = 2 * 1 * 2 * 1 * (9 + 3) * 8 * 2       # k+v, layers, B, K, S, H, bytes
  assert rows[("bf16_flags", 2, 9)]["kv_bytes"] == bf16_cache
  assert kv["rows"][0]["kv_bytes"] * 16 == bf16_cache * 12
  model_bench.plot(result, str(tmp_path / "m.png"))
  assert (tmp_path / "m.png").stat().st_size > 0


def test_xla_settings_a_users_flags_win_and_are_named():
  """attnprec/xla_env.py: the project adds --xla_allow_excess_precision=false only where
  XLA_FLAGS does not choose it; a user's own value is kept and named on the runners'
  precision line (`describe`); the dot-library settings the projection bench compares
  replace one another and are named too."""
  import os

  from attnprec import xla_env
  saved = os.environ.get("XLA_FLAGS")
  try:
    os.environ["XLA_FLAGS"] = "--xla_allow_excess_precision=true --xla_cpu_use_onednn=true"
    xla_env.disable_excess_precision()
    assert os.environ["XLA_FLAGS"] == ("--xla_allow_excess_precision=true "
                                       "--xla_cpu_use_onednn=true")     # the user's value
    line = xla_env.describe()
    assert "ALLOWED by your XLA_FLAGS" in line and "dot library: onednn" in line
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    xla_env.disable_excess_precision()
    assert xla_env.FLAG in os.environ["XLA_FLAGS"].split()
    assert xla_env.describe() == "XLA: excess precision disabled; dot library: default"
    # a flag that can change XLA:CPU's numerics is named, as written (a dot library
    # turned off too); others are not
    os.environ["XLA_FLAGS"] = ("--xla_cpu_enable_fast_math=true --xla_cpu_use_xnnpack=false "
                               "--xla_cpu_experimental_ynn_fusion_type=dot "
                               "--xla_force_host_platform_device_count=2")
    line = xla_env.describe()
    assert line.endswith("also set by your XLA_FLAGS: --xla_cpu_enable_fast_math=true "
                         "--xla_cpu_use_xnnpack=false "
                         "--xla_cpu_experimental_ynn_fusion_type=dot (may change XLA:CPU's "
                         "numerics; the project's tests and measurements ran without it)")
  finally:
    if saved is None:
      os.environ.pop("XLA_FLAGS", None)
    else:
      os.environ["XLA_FLAGS"] = saved
  flags = xla_env.flags_for("xnnpack", f"{xla_env.FLAG} --xla_cpu_use_onednn=true")
  assert flags.split() == [xla_env.FLAG, "--xla_cpu_use_xnnpack=true"]
  assert xla_env.in_force(flags) == "xnnpack"
  assert xla_env.flags_for("default", flags) == xla_env.FLAG
  # the runners' own environment (conftest applies the same call before jax is imported)
  assert "--xla_allow_excess_precision=false" in os.environ.get("XLA_FLAGS", "")


def test_projection_bench_tiny(tmp_path):
  """attnprec/bench/projections.py on tiny shapes and a tiny model (numbers not checked):
  every form timed, ratios to the carried form, markdown."""
  import json

  import jax

  from attnprec.bench import projections
  from attnprec.config import ModelConfig
  from attnprec.model import init_params
  config = ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=8, mlp_hidden=16, max_seq_len=64)
  rows = projections.micro(rows=(8, 1), shapes=(("tiny", 16, 24),), rounds=2,
                           layers_per_call=2)
  assert {(r["M"], r["form"]) for r in rows} == {
      (m, f) for m in (8, 1) for f in projections.MICRO_FORMS}
  projections.add_ratios(rows, ("shape", "M"), "carried")
  assert all(r["vs_carried"] > 0 for r in rows)
  params = jax.jit(init_params, static_argnums=0)(config, jax.random.PRNGKey(0))
  result = projections.run(config=config, params=params,
                           model_name="tiny", micro_rows=(4,), micro_shapes=(("t", 16, 8),),
                           layers_per_call=1, micro_rounds=1, model_rounds=1,
                           prefill_tokens=16, steps=2, decode_cache=8,
                           model_forms=("fp32", "carried", "current/carried"),
                           log=lambda *a, **k: None)
  cases = {(r["case"], r["form"]) for r in result["model"]}
  assert cases == {(c, f) for c in ("prefill", "decode_B1", "decode_B8")
                   for f in ("fp32", "carried", "current/carried")}
  json.dumps(result, default=float)
  assert "| decode_B8 | current/carried |" in projections.to_markdown(result)


def test_runner_no_flag_phases_reaches_the_model_bench(tmp_path):
  """`--no_flag_phases` (and only it, or --quick) turns off the per-phase flag cost: the
  runner's options as `run_model_bench` receives them (the bench itself replaced)."""
  import importlib.util
  import os
  from unittest import mock

  from attnprec.bench import model as model_bench

  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(
      "runner_bench", os.path.join(root, "runners", "bench.py"))
  runner = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(runner)

  class Stop(BaseException):
    pass

  seen = []

  def fake(**kwargs):
    seen.append(kwargs)
    raise Stop()

  for argv in (["--no_torch"], ["--no_torch", "--no_flag_phases"]):
    with mock.patch.object(model_bench, "run_model_bench", fake):
      try:
        runner.main(argv + [f"--out={tmp_path / 'bench'}"])
      except Stop:
        pass
  assert [k["flag_phases"] for k in seen] == [True, False]
  assert not any(k["include_torch"] for k in seen)


def test_presets_and_cases_share_one_copy_of_the_carried_weights(monkeypatch):
  """bf16 and bf16_flags carry the same rounded weights: one copy per compute dtype and
  bench run (a 1.5B model's is 6 GB), equal to what `decoding.for_serving` makes; fp32
  keeps the given params. A prefill of >= 128 rows reads `decoding.prefill_params`' copy
  (the blocks' matrices stored in bf16), also one per dtype; the carried-prefill preset
  reads the carried weights. The small cases are test_tiny_model_bench_reports_every_case's
  programs (fp32 and bf16_flags at 2x9, 3 steps; bf16 and bf16_flags at its flag case 1x6,
  8 steps), which the compilation cache then holds."""
  import dataclasses

  import jax
  import jax.numpy as jnp
  import numpy as np

  from attnprec import cpu_features, decoding
  from attnprec.bench import model as model_bench
  from attnprec.config import ModelConfig
  from attnprec.model import init_params
  config = ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=8, mlp_hidden=16, max_seq_len=64)
  params = jax.jit(init_params, static_argnums=0)(config, jax.random.PRNGKey(0))
  prompt = np.zeros((2, 9), np.int32)
  flag_case = np.zeros((1, 6), np.int32)
  carried = {}
  case = lambda name, prompt, steps=3: model_bench._AttnprecCase(  # noqa: E731
      config, params, model_bench.PRESETS[name], prompt, steps, carried=carried)
  fp32, flags = case("fp32", prompt), case("bf16_flags", prompt)
  bf16, other_case = case("bf16", flag_case, 8), case("bf16_flags", flag_case, 8)
  assert fp32.params is params and fp32.weights == "float32"
  assert bf16.params is flags.params is other_case.params
  assert sorted(k[:2] for k in carried if len(k) == 2) == [("bfloat16", True),
                                                            ("float32", False)]
  assert fp32.prefill_params is params and flags.prefill_params is flags.params
  # 'auto' as on a CPU with bf16 dots: a 128-row prefill reads stored block matrices
  monkeypatch.setattr(cpu_features, "bf16_features", lambda *a: ("avx512_bf16",))
  rows128 = np.zeros((2, 64), np.int32)
  big, big2 = case("bf16_flags", rows128, 2), case("bf16", rows128, 2)
  assert big.prefill_params is big2.prefill_params is not big.params
  assert big.params is flags.params and big.weights == "carried, prefill stored"
  assert big.prefill_params["decoder/layer_0/mlp/up"]["w"].dtype == jnp.bfloat16
  old = model_bench._AttnprecCase(config, params, model_bench.PRESETS[
      "bf16_flags_carried_prefill"], rows128, 2, carried=carried, carried_prefill=True)
  assert old.prefill_params is old.params is flags.params and old.weights == "carried"
  # a bf16 preset whose weights are not carried (a dot-algorithm matmul_precision) gets
  # the params as given, not the carried copy
  algo = dataclasses.replace(model_bench.PRESETS["bf16"], matmul_precision="BF16_BF16_F32")
  uncarried = model_bench._AttnprecCase(config, params, algo, prompt, 2, carried=carried)
  assert uncarried.params is params and uncarried.weights == "float32"
  assert flags.weights == other_case.weights == "carried"
  expect, _ = decoding.for_serving(params, model_bench.PRESETS["bf16_flags"])
  for a, b in zip(jax.tree_util.tree_leaves(expect), jax.tree_util.tree_leaves(flags.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def _bench_runner():
  import importlib.util
  import os
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(
      "runner_bench_forms", os.path.join(root, "runners", "bench.py"))
  runner = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(runner)
  return runner


def _fixed_rates(monkeypatch, forms):
  """The floor's matmul rates, not measured (they are not what these tests check)."""
  monkeypatch.setattr(forms, "matmul_peak", lambda shape: {"f32": 1e11, "bf16": 1e11})


def test_attention_forms_tiny(tmp_path, monkeypatch):
  """Every block size at one small shape, interleaved, without torch: one row per form,
  the baseline's ratio 1, and every form's output the baseline's up to float32 summation
  order in the online softmax (bf16 outputs of magnitude <= ~3: within a few bf16 ulps,
  asserted <= 0.05)."""
  import json
  from attnprec.bench import attention_forms as forms
  _fixed_rates(monkeypatch, forms)
  result = forms.run(seq_lens=(96,), shapes=("smollm2-135m",),
                     blocks=((32, 32), (64, 32), (96, 96)), rounds=1, include_torch=False,
                     log=lambda m: None)
  rows, floor = result["rows"][:-1], result["rows"][-1]
  assert [r["form"] for r in rows] == ["q32/kv32", "q64/kv32", "q96/kv96"]
  assert floor["form"] == forms.FLOOR and floor["median_s"] > 0
  assert rows[0]["vs_default"] == 1.0 and rows[0]["max_abs_vs_default"] == 0.0
  assert all(r["max_abs_vs_default"] <= 0.05 for r in rows)
  assert all(r["median_s"] > 0 and r["vs_torch"] is None for r in rows)
  json.dumps(result)
  assert "| smollm2-135m (9 / 3) | 96 | q64/kv32 |" in forms.to_markdown(result)


def test_attention_forms_contract_floor_counts_each_dot_at_its_operands_rate(monkeypatch):
  """The floor row: the QK dot's FLOPs at the bf16 rate (bf16 x bf16 -> f32 with the
  float32 QK product), the PV dot's at the float32 rate (float32 probabilities), over the
  causal visible pairs, held to the fastest rate over the shapes and the two measurements; counted by hand
  here (S = 96, N = 9, H = 64)."""
  from attnprec.bench import attention_forms as forms
  # per shape, before the rounds then after: the fastest of each dtype must count
  measured = iter([{"f32": 1e11, "bf16": 4e11}, {"f32": 0.5e11, "bf16": 1e11},
                   {"f32": 0.9e11, "bf16": 2e11}, {"f32": 2e11, "bf16": 3e11},
                   {"f32": 1e11, "bf16": 1e11}, {"f32": 1e11, "bf16": 1e11}])
  monkeypatch.setattr(forms, "FLOOR_SHAPES", ((1, 1, 1), (2, 2, 2), (3, 3, 3)))
  monkeypatch.setattr(forms, "matmul_peak", lambda shape: next(measured))
  result = forms.run(seq_lens=(96,), shapes=("smollm2-135m",), blocks=((32, 32),),
                     rounds=1, include_torch=False, log=lambda m: None)
  flops = 2 * 64 * 9 * (96 * 97 // 2)
  floor = result["rows"][-1]
  assert floor["form"] == forms.FLOOR
  assert floor["median_s"] == pytest.approx(flops / 4e11 + flops / 2e11, rel=1e-12)
  assert floor["vs_default"] == pytest.approx(floor["median_s"] / result["rows"][0]["median_s"])
  assert result["config"]["matmul_rates"] == {"f32": 2e11, "bf16": 4e11}
  assert "the PV dot at 200 (f32)" in forms.to_markdown(result)
  # all-bf16 flags put the PV dot on bf16 probabilities: both dots at the bf16 rate
  off = forms.contract_floor_s(96, 9, {"f32": 1e11, "bf16": 4e11},
                               flags=forms.contract.AttentionFlags(
      float32_qk_product=False, float32_logits=False))
  assert off == pytest.approx(2 * flops / 4e11, rel=1e-12)
  # on a CPU without bf16 dots the float32 QK product may run on float32 casts
  # (`Precision.float32_qk_operands`): its QK dot is bounded by the faster rate
  no_bf16 = {"f32": 2e11, "bf16": 1e11}
  assert forms.contract_floor_s(96, 9, no_bf16) == pytest.approx(2 * flops / 2e11, rel=1e-12)
  # ... where a bf16 QK product has no such form: both dots at the bf16 rate
  assert forms.contract_floor_s(96, 9, no_bf16, flags=forms.contract.AttentionFlags(
      float32_qk_product=False, float32_logits=False)) == pytest.approx(2 * flops / 1e11)


def test_attention_forms_bad_input_exits_2_and_writes_nothing(tmp_path):
  runner = _bench_runner()
  for i, argv in enumerate((["--suite=attention_forms", "--model=gpt2"],
                            ["--suite=attention_forms", "--blocks=512/0"],
                            ["--suite=attention_forms", "--blocks=512"],
                            ["--suite=model", "--blocks=512/256"],
                            # off a TPU, and options it does not read / cannot use
                            ["--suite=tpu_decode"],
                            ["--suite=tpu_decode", "--seq_lens=1024"],
                            ["--suite=tpu_decode", "--decode_batches=0"],
                            ["--suite=tpu_decode", "--splash_blocks=512/512"],
                            ["--suite=tpu_attention", "--splash_blocks=512/512/128"],
                            ["--suite=tpu_attention", "--splash_blocks=100/512"])):
    out = tmp_path / f"out{i}"
    assert runner.main(argv + [f"--out={out}"]) == 2, argv
    assert not out.exists() or not list(out.iterdir()), argv


def test_splash_blocks_are_refused_by_their_shape_before_the_platform(capsys):
  """A splash block with a chunk, or rows Mosaic cannot tile, is named as such (not as
  'not a TPU'): the arguments are checked before the machine."""
  runner = _bench_runner()
  for blocks, named in (("512/512/128", "splash takes Q/KV pairs"),
                        ("100/512", "Q a multiple of 16")):
    assert runner.main(["--suite=tpu_attention", f"--splash_blocks={blocks}"]) == 2
    assert named in capsys.readouterr().err, blocks


def test_attention_forms_marks_a_non_finite_form_and_checks_its_sizes(monkeypatch):
  """A form whose output holds NaN is marked in the table, never given a difference
  computed from it; zero rounds or an empty length list are refused by name."""
  import jax.numpy as jnp
  from attnprec.bench import attention_forms as forms
  from attnprec.errors import UserError
  real = forms.blockwise_attention

  def broken(q, k, v, **kw):
    out = real(q, k, v, **kw)
    return out.at[0, 0, 0, 0].set(jnp.nan) if kw["q_block"] == 64 else out

  monkeypatch.setattr(forms, "blockwise_attention", broken)
  _fixed_rates(monkeypatch, forms)
  result = forms.run(seq_lens=(64,), shapes=("smollm2-135m",), blocks=((32, 32), (64, 32)),
                     rounds=1, include_torch=False, log=lambda m: None)
  good, bad, floor = result["rows"]
  assert good["finite"] and "max_abs_vs_default" in good
  assert bad["finite"] is False and "max_abs_vs_default" not in bad
  assert "| q64/kv32 |" in forms.to_markdown(result)
  assert "non-finite output" in forms.to_markdown(result)
  assert "PARTIAL" not in forms.to_markdown(result)
  del result["wall_s"]            # interrupted while measuring the rates after the rounds
  assert "PARTIAL" not in forms.to_markdown(result)
  assert "rates after them were not measured" in forms.to_markdown(result)
  del result["rounds_done"]                 # as an interrupted run leaves its last write
  assert "PARTIAL" in forms.to_markdown(result)
  for kwargs, match in ((dict(rounds=0), "rounds"), (dict(seq_lens=()), "lengths")):
    with pytest.raises(UserError, match=match):
      forms.run(**{**dict(seq_lens=(64,), shapes=("smollm2-135m",), rounds=1,
                          include_torch=False, log=lambda m: None), **kwargs})


def test_cases_are_parsed_with_their_errors_named():
  from attnprec.bench.cases import LONG_CASES, parse_cases
  from attnprec.errors import UserError
  assert parse_cases("1x32,8X1000") == ((1, 32), (8, 1000))
  assert parse_cases("long") == LONG_CASES
  for bad, match in (("1x0", "must be >= 1"), ("1y3", "expected BATCHxPROMPT"),
                     ("8", "expected BATCHxPROMPT")):
    with pytest.raises(UserError, match=match):
      parse_cases(bad)


def test_a_bench_case_refuses_non_finite_logits():
  """Every suite (the model bench, the profile, the one-off A/B scripts) times only cases
  whose prefill and decode loop gave finite logits (`_AttnprecCase`): a NaN weight is
  refused by name, the same weights without it pass."""
  import jax
  import jax.numpy as jnp
  from attnprec.bench import model as model_bench
  from attnprec.config import ModelConfig
  from attnprec.errors import UserError
  from attnprec.model import init_params
  from attnprec.precision import Precision
  config = ModelConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=8, mlp_hidden=32, max_seq_len=32)
  params = jax.jit(init_params, static_argnums=0)(config, jax.random.PRNGKey(0))
  prompt = jnp.ones((1, 4), jnp.int32)
  clean = model_bench._AttnprecCase(config, params, Precision(), prompt, 1, label="clean")
  assert clean.decode() > 0 and clean._decode_checked
  broken = jax.tree_util.tree_map(lambda x: x, params)
  name = next(k for k in broken if "mlp" in k)
  leaf = next(iter(broken[name]))
  broken[name] = {**broken[name], leaf: broken[name][leaf].at[0, 0].set(jnp.nan)}
  with pytest.raises(UserError, match="The logits of the prefill of bench case broken were "
                                      "not finite .*layer 0 MLP"):
    model_bench._AttnprecCase(config, broken, Precision(), prompt, 1, label="broken")


def test_attention_forms_takes_no_ratio_to_a_broken_baseline(monkeypatch):
  """A default-blocks form whose output holds NaN is no baseline: no row gets a ratio to
  it (the table prints '-'), where the ratios read like a clean run's before. torch's
  output is checked the same way and compared with the default blocks' (float64 view of
  two bf16 attentions of the same inputs: close, bf16 probabilities on torch's side)."""
  import jax.numpy as jnp
  from attnprec.bench import attention_forms as forms
  real = forms.blockwise_attention
  monkeypatch.setattr(forms, "blockwise_attention", lambda q, k, v, **kw: (
      real(q, k, v, **kw).at[0, 0, 0, 0].set(jnp.nan) if kw["q_block"] == 32
      else real(q, k, v, **kw)))
  _fixed_rates(monkeypatch, forms)
  result = forms.run(seq_lens=(64,), shapes=("smollm2-135m",), blocks=((32, 32), (64, 32)),
                     rounds=1, include_torch=False, log=lambda m: None)
  assert [r["vs_default"] for r in result["rows"]] == [None, None, None]
  assert "| q64/kv32 | " in forms.to_markdown(result)
  assert all(line.split(" | ")[4] == "-" for line in forms.to_markdown(result).splitlines()
             if line.startswith("| smollm2"))
  pytest.importorskip("torch")
  monkeypatch.setattr(forms, "blockwise_attention", real)
  result = forms.run(seq_lens=(64,), shapes=("smollm2-135m",), blocks=((32, 32),),
                     rounds=1, include_torch=True, log=lambda m: None)
  torch_row = next(r for r in result["rows"] if r["form"] == "torch_sdpa_bf16")
  assert torch_row["finite"] and torch_row["vs_torch"] == 1.0
  assert 0 < torch_row["max_abs_vs_default"] < 0.1


def test_a_train_step_with_a_nonfinite_metric_is_not_timed():
  """`check_train_step` (flag_cost's and the device check's train rows): a NaN loss or
  an Inf gradient norm is a NonFiniteError naming it, never a step time."""
  from attnprec.bench.model import check_train_step
  from attnprec.checkpoints.finite import NonFiniteError
  ok = {"loss": np.float32(2.0), "grad_norm": np.float32(1.0), "param_norm": np.float32(3.0)}
  check_train_step("a step", ok)
  for key, bad in (("loss", np.nan), ("grad_norm", np.inf)):
    with pytest.raises(NonFiniteError, match=f"(?i){key} of a step is not finite"):
      check_train_step("a step", dict(ok, **{key: np.float32(bad)}))


def test_an_attention_length_past_the_machine_is_refused_with_its_estimate():
  """A length whose float32 q, k and v alone exceed the machine (here 2**40 tokens:
  XLA aborted the process compiling it) is refused before anything compiles, naming the
  option, the length and the estimate; any of the three length options."""
  from attnprec.bench import attention as bench
  from attnprec.errors import UserError
  for option in ("seq_lens", "memory_seq_lens", "decode_seq_lens"):
    with pytest.raises(UserError, match=rf"--{option}={2**40} .* needs at least "
                                        rf"[0-9.]+ GiB.*its q, k and v in float32"):
      bench.run_attention_bench(**{option: (2 ** 40,)}, include_torch=False,
                                progress=False)


class _Stop(Exception):
  pass


@pytest.mark.parametrize("argv,memory,decode", [
    ([], ("fp32_attention", "fp32"), ("bf16", "fp32_attention", "fp32")),
    (["--presets=fp32"], ("fp32",), ("fp32",)),
])
def test_the_attention_suite_runs_the_presets_given_in_every_section(tmp_path, monkeypatch,
                                                                    argv, memory, decode):
  """`--presets` names what every section of the attention suite runs (the memory and
  decode sections used to run their defaults whatever it said, while results.json listed
  only the presets given); the bench records each section's presets."""
  from test_train_utils import load_runner
  runner = load_runner("bench.py")
  seen = {}

  def stop(**kwargs):
    seen.update(kwargs)
    raise _Stop
  monkeypatch.setattr(runner.bench, "run_attention_bench", stop)
  with pytest.raises(_Stop):
    runner.main(["--suite=attention", "--no_torch", f"--out={tmp_path / 'b'}"] + argv)
  assert tuple(seen["memory_presets"]) == memory and tuple(seen["decode_presets"]) == decode
