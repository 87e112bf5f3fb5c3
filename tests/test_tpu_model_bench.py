"""`bench --suite=tpu_model` (`attnprec.bench.tpu_model`) on CPU at a tiny configuration:
every phase's rows run (checked finite before timing), the figures follow from their
definitions (FLOPs counted by hand, the floor from the bytes and the bandwidth), a rerun
into the same --out measures nothing again, and a decode case that would not fit the
device is refused before anything runs. The timings here mean nothing; the TPU's are in
results/tpu-model/."""
import json

import numpy as np
import pytest

from attnprec import cache as cache_lib
from attnprec.bench import tpu_decode, tpu_model
from attnprec.errors import UserError

TINY = dict(vocab_size=96, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
            head_dim=8, mlp_hidden=64, max_seq_len=128)
PRESETS = ("bf16", "bf16_flags", "bf16_flags_kv_int8")


def test_every_phase_runs_and_its_figures_follow_from_their_definitions(tmp_path,
                                                                         monkeypatch):
  monkeypatch.setattr(tpu_decode, "hbm_read_bandwidth", lambda: {"best": 1e10})
  monkeypatch.setattr(tpu_model.model_bench, "matmul_peak", lambda shape: {"bf16": 1e12})
  config = tpu_model.qwen05_config(**TINY)
  kw = dict(presets=PRESETS, prefill_cases=((2, 16),), decode_cases=((2, 64),),
            train_cases=((1, 16),), rounds=1, steps=4, config=config,
            progress=lambda m: None)
  result = tpu_model.run(str(tmp_path), **kw)
  assert list(result["cases"]) == ["prefill 2x16", "decode 2x64", "train 1x16"]
  prefill, decode, train = result["cases"].values()
  # the int8 cache is a decode preset; the train step runs bf16 and bf16_flags
  assert set(prefill["rows"]) == {"bf16", "bf16_flags"} == set(train["rows"])
  assert set(decode["rows"]) == set(PRESETS)
  for case in (prefill, decode, train):
    for name, row in case["rows"].items():
      assert "error" not in row, (name, row)
      assert row["kernel"] in ("dot_product", "blockwise"), row   # 'auto' on XLA:CPU
    assert case["flags_over_no_flags"] > 0
  # FLOPs by hand: per layer q, k, v, o (D x N H, D x K H twice, N H x D) and the MLP's
  # three D x F matrices; causal attention 2 products x 2 flops x T^2 / 2 x N H per layer
  D, N, K, H, F, L, V = 32, 4, 2, 8, 64, 2, 96
  per_token = 2 * L * (D * N * H + 2 * D * K * H + N * H * D + 3 * D * F)
  attn = 2 * 16 * 16 * N * H * L
  assert prefill["flops"] == 2 * 16 * per_token + 2 * 2 * D * V + 2 * attn
  assert train["flops"] == 3 * (16 * per_token + 2 * 16 * D * V + attn)
  for name, row in prefill["rows"].items():
    assert row["mfu"] == pytest.approx(prefill["flops"] / (row["median_ms"] / 1e3) / 1e12)
  for name, row in decode["rows"].items():
    prec = tpu_model.model_bench.PRESETS[name]
    cache = cache_lib.cache_bytes(config, 2, 64, prec.compute_dtype, prec.cache_storage)
    assert row["cache_gb"] * 1e9 == pytest.approx(cache)
    assert row["floor_ms"] == pytest.approx(1e3 * (row["weight_gb"] * 1e9 + cache) / 1e10)
    assert row["over_floor"] == pytest.approx(row["step_ms"] / row["floor_ms"])
  assert decode["rows"]["bf16_flags_kv_int8"]["cache_gb"] < decode["rows"]["bf16"]["cache_gb"]
  saved = json.loads((tmp_path / "tpu_model.json").read_text())
  assert saved["provenance"]["source"]
  assert "| decode 2x64 | bf16_flags_kv_int8 |" in (tmp_path / "tpu_model.md").read_text()
  seen = []
  tpu_model.run(str(tmp_path), **dict(kw, progress=seen.append))
  assert sum("already measured" in m for m in seen) == 3, seen


def test_a_decode_case_past_the_device_memory_is_refused_by_name(tmp_path, monkeypatch):
  """Refused before anything is compiled or written; the default grid keeps only the
  cases that fit (at Qwen2.5-0.5B's shape on a 16 GiB chip, batch 32 at 32k does not:
  its bf16 cache alone is 12.9 GB, with the float32 params and their bf16 copy 14.8 GiB).
  So are presets this suite would run under another's name, and a prefill longer than
  the model."""
  monkeypatch.setattr(tpu_decode, "device_bytes", lambda: 16 * 2 ** 30)
  config = tpu_model.qwen05_config()
  with pytest.raises(UserError, match=r"decode case 32x32768 needs about 14\.8 GiB"):
    tpu_model.run(str(tmp_path / "big"), decode_cases=((1, 1024), (32, 32768)),
                  config=config, progress=lambda m: None)
  assert not (tmp_path / "big").exists()
  # a preset the model suite reads by its name alone (its weight form) is not this one's
  with pytest.raises(UserError, match=r"'bf16_flags_cast'.*choose from .*bf16_flags_kv_int8"):
    tpu_model.run(str(tmp_path / "named"), presets=("bf16_flags_cast",), config=config,
                  decode_cases=(), progress=lambda m: None)
  with pytest.raises(UserError, match=r"1x40000: more tokens than the model's max_seq_len"):
    tpu_model.run(str(tmp_path / "long"), prefill_cases=((1, 40000),), decode_cases=(),
                  config=config, progress=lambda m: None)
  assert not (tmp_path / "named").exists() and not (tmp_path / "long").exists()
  grid = tpu_model.fitting(config, tpu_model.DECODE_CASES, tpu_model.PRESETS)
  assert (32, 32768) not in grid and (8, 32768) in grid and len(grid) == 8
  assert np.isclose(cache_lib.cache_bytes(config, 32, 32768, "bfloat16"), 12.88e9, rtol=1e-3)


def test_the_docs_table_is_the_tpu_run_s():
  """docs/performance.md quotes the TPU's whole-model table to the character, rendered from
  results/tpu-model/tpu_model.json (`tpu_model.to_markdown`, less its title line), a run on
  a TPU by the code its README names."""
  import os
  root = os.path.join(os.path.dirname(__file__), "..")
  with open(os.path.join(root, "results", "tpu-model", "tpu_model.json")) as f:
    result = json.load(f)
  assert result["backend"] == "tpu" and result["provenance"]["source"] == "8fb504f789bbdbc2"
  table = tpu_model.to_markdown(result).split("\n", 2)[2]
  assert table.count("\n") >= 2 + 2 * 3 + 8 * 4 + 2     # prefill, decode, train rows
  with open(os.path.join(root, "docs", "performance.md")) as f:
    assert table in f.read()


def test_a_phase_left_without_rows_or_a_broken_probe_is_refused(tmp_path, monkeypatch):
  """Presets that run no row of an asked phase (an int8 cache is decode-only; the train
  step runs bf16 and bf16_flags) are refused by name, not run as empty cases; a peak or a
  bandwidth that is not a finite positive number stops the run before anything is
  written (every MFU and floor divides by it)."""
  config = tpu_model.qwen05_config(**TINY)
  kw = dict(prefill_cases=((2, 16),), decode_cases=(), train_cases=(), rounds=1, steps=4,
            config=config, progress=lambda m: None)
  with pytest.raises(UserError, match=r"bf16_flags_kv_int8 leaves no row to time in --cases"):
    tpu_model.run(str(tmp_path / "a"), presets=("bf16_flags_kv_int8",), **kw)
  with pytest.raises(UserError, match=r"no row to time in --train_cases"):
    tpu_model.run(str(tmp_path / "a"), presets=("bf16_flags_offset",),
                  **dict(kw, train_cases=((1, 16),)))
  monkeypatch.setattr(tpu_decode, "hbm_read_bandwidth", lambda: {"best": 1e10})
  monkeypatch.setattr(tpu_model.model_bench, "matmul_peak",
                      lambda shape: {"bf16": float("nan")})
  from attnprec.errors import NonFiniteError
  with pytest.raises(NonFiniteError, match=r"bf16 matmul peak .* is nan"):
    tpu_model.run(str(tmp_path / "b"), presets=("bf16",), **kw)
  assert not (tmp_path / "a").exists() and not (tmp_path / "b" / "tpu_model.json").exists()
