"""`bench --suite=tpu_decode` (`attnprec.bench.tpu_decode`) on CPU, interpreted: every row
runs and agrees with float64 (NumPy), the int8 rows with the codes times their scales; a
rerun into the same --out measures only the cases it lacks. The timings here are the
interpreter's and mean nothing; the TPU's are in results/tpu-decode/.

Bounds (relative L2 against float64): a bf16 output is rounded once (at most 2^-8
relative per element), so rows with both flags stay within 2^-8; flags off adds bf16
logits (up to |logit| 2^-8 each, |logit| <= ~4 here), within 4 x 2^-8.
"""
import json

import pytest

from attnprec.bench import tpu_decode
from attnprec.errors import UserError


def test_every_row_runs_and_matches_float64_and_a_rerun_resumes(tmp_path, monkeypatch):
  monkeypatch.setattr(tpu_decode, "hbm_read_bandwidth",
                      lambda: {"f32_matvec": 1e10, "best": 1e10})
  real_layers = tpu_decode.layers_for
  monkeypatch.setattr(tpu_decode, "STEPS", 3)            # 3 steps over 2 caches here
  monkeypatch.setattr(tpu_decode, "layers_for", lambda cache_bytes: 2)
  kw = dict(shapes=("qwen2.5-0.5b",), batches=(2,), seq_lens=(300,), blocks=(256,),
            rounds=1, progress=lambda m: None)
  result = tpu_decode.run(str(tmp_path), **kw)
  (case,) = result["cases"].values()
  names = set(case["rows"])
  assert {"dot_product", "blockwise", "flash dk=256", "flash bf16 dk=256",
          "flash stacked dk=256", "dot_product int8", "flash int8 dk=256",
          "flash stacked int8 dk=256"} == names
  for name, row in case["rows"].items():
    assert "error" not in row, (name, row)
    bound = 4 * 2 ** -8 if "bf16" in name else 2 ** -8
    assert row["rel_l2"] <= bound, (name, row["rel_l2"])
    assert row["bytes"] == 2 * 2 * 300 * (2 * 64 * (1 if "int8" in name else 2)
                                         + (8 if "int8" in name else 0))
  ratio = tpu_decode.int8_ratio(case["rows"], "flash int8 dk=256")
  assert ratio == (case["rows"]["flash int8 dk=256"]["median_us"]
                   / case["rows"]["flash dk=256"]["median_us"])
  assert tpu_decode.int8_ratio(case["rows"], "flash dk=256") is None
  assert real_layers(2 ** 20) == 1024 and real_layers(2 ** 31) == 2
  saved = json.loads((tmp_path / "tpu_decode.json").read_text())
  assert saved["provenance"]["source"] and "flash int8 dk=256" in (
      tmp_path / "tpu_decode.md").read_text()
  seen = []
  tpu_decode.run(str(tmp_path), **dict(kw, progress=seen.append))
  assert any("already measured" in m for m in seen), seen
  with pytest.raises(UserError, match="other settings"):
    tpu_decode.run(str(tmp_path), **dict(kw, blocks=(128,)))


def test_the_docs_table_is_the_tpu_run_s():
  """docs/performance.md quotes the TPU's decode table to the character, rendered from
  results/tpu-decode/stacked_loop.json (`tpu_decode.to_markdown`, less its title line),
  a run on a TPU by the code its README names."""
  import os
  root = os.path.join(os.path.dirname(__file__), "..")
  with open(os.path.join(root, "results", "tpu-decode", "stacked_loop.json")) as f:
    result = json.load(f)
  assert result["backend"] == "tpu" and result["provenance"]["source"] == "ec399554f92ae21d"
  table = tpu_decode.to_markdown(result).split("\n", 2)[2]
  assert table.count("\n") >= 2 + 2 * 9       # two cases of nine rows
  with open(os.path.join(root, "docs", "performance.md")) as f:
    assert table in f.read()


def test_a_case_past_the_device_memory_is_refused_and_a_nan_loop_is_an_error(
    tmp_path, monkeypatch):
  """A case whose stacks would not fit is refused by name before anything runs (nothing
  written); a row whose timed loop gives a non-finite output is recorded as an error,
  never timed."""
  with pytest.raises(UserError, match=r"B=4096 S=32768 needs about .* GiB"):
    tpu_decode.run(str(tmp_path / "big"), batches=(1, 4096), seq_lens=(32768,),
                   progress=lambda m: None)
  assert not (tmp_path / "big").exists()
  # the first test's case (B=2, S=300, 3 steps over 2 caches): its programs, shared
  # through the compilation cache (the nan is multiplied outside the jitted loop)
  monkeypatch.setattr(tpu_decode, "hbm_read_bandwidth", lambda: {"best": 1e10})
  monkeypatch.setattr(tpu_decode, "STEPS", 3)
  monkeypatch.setattr(tpu_decode, "layers_for", lambda cache_bytes: 2)
  rows = tpu_decode.rows_for
  monkeypatch.setattr(tpu_decode, "rows_for", lambda S, blocks: {
      n: r for n, r in rows(S, blocks).items() if n in ("dot_product", "flash int8 dk=256")})
  real = tpu_decode.decode_loop
  monkeypatch.setattr(tpu_decode, "decode_loop",
                      lambda f, stacked=False: lambda *a: real(f, stacked)(*a) * float("nan"))
  case = tpu_decode.run_case("qwen2.5-0.5b", 2, 300, blocks=(256,), rounds=1,
                             bandwidth=1e10, progress=lambda m: None)
  assert len(case["rows"]) == 2 and all(
      "non-finite output in the timed decode loop" in r["error"]
      for r in case["rows"].values()), case["rows"]
