"""HumanEval harness: the benchmark's own answers pass in the sandbox (164/164) and a wrong
one fails; code extraction; the per-item records (resume, repair, no mixing); the report's
statistics on hand-counted records; the job end to end on a tiny model with a byte
tokenizer (resumes, refuses bad input before loading a model). Runs no real model.
"""
import json
import os

import jax
import jax.numpy as jnp
import pytest

from attnprec import checkpoints
from attnprec.checkpoints import serving
from attnprec.checkpoints import Checkpoint
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.evals import common, humaneval, humaneval_eval, records, report, sandbox
from test_train_utils import numpy_params  # noqa: E402


@pytest.fixture(scope="module")
def problems():
  return humaneval.load_problems()


def test_canonical_solutions_pass_and_stubs_fail(problems):
  """The harness on the benchmark's own answers: all 164 pass; the function's stub
  (returns None) fails, on every fourth problem."""
  assert len(problems) == humaneval.NUM_PROBLEMS == 164
  limits = sandbox.Limits(timeout_s=10)
  failed = [(p.task_id, o.kind, o.detail) for p in problems
            for o in [sandbox.run_program(humaneval.canonical_program(p), limits=limits)]
            if not o.passed]
  assert failed == []
  for p in problems[::4]:
    o = sandbox.run_program(humaneval.wrong_program(p), limits=limits)
    assert not o.passed and o.kind in ("assertion", "error"), (p.task_id, o)


def test_extract_code():
  answer = ("import math\n\ndef f(x):\n    return math.sqrt(x)\n\nprint(f(4))\n"
            "if __name__ == '__main__':\n    input()\n```\n\nThis function ...")
  ex = humaneval.extract_code(answer)
  assert ex.fence_closed and ex.parsed
  assert ex.code == "import math\n\ndef f(x):\n    return math.sqrt(x)"
  cut = humaneval.extract_code("def f(x):\n    return (x +")       # the budget ran out
  assert not cut.fence_closed and not cut.parsed and cut.code.startswith("def f")
  assert humaneval.extract_code("```\nprose").code == ""
  assert humaneval.failure_kind(humaneval.extract_code("print(1)\n```"), "passed") == \
      "extraction"


def test_model_code_replaces_the_stub_and_keeps_the_prompts_helpers(problems):
  p = next(p for p in problems if p.task_id == "HumanEval/38")   # uses encode_cyclic
  body = p.canonical_solution
  code = f"def {p.entry_point}(s: str):\n{body}"
  assert sandbox.run_program(humaneval.program(p, code)).passed


def test_end_sequences_and_end_index():
  class ByteTok:
    vocab_size, eos_id = 260, 259

    def decode(self, ids, skip_special=True):
      return "".join("<e>" if i == 259 else chr(i) if i < 256 else "" for i in ids)

  ends = humaneval.end_sequences(ByteTok())
  assert ends.shape[1] == 2 and list(ends[0]) == [-1, 259]
  tick = ord("`")
  assert [tick, tick] not in ends.tolist()          # "``" is no fence
  text = [ord(c) for c in "x = 1\n``"] + [tick, 10]   # three single backticks: no pair
  assert serving.end_index(text, ends) is None
  assert serving.end_index([1, 2, 259, 5], ends) == 2


def test_item_log_resumes_repairs_and_refuses_other_settings(tmp_path):
  path = str(tmp_path / "items.jsonl")
  log = records.ItemLog(path, meta={"task": "t", "n": 1})
  log.write({"preset": "a", "item": "1", "correct": True})
  with open(path, "a") as f:
    f.write('{"preset": "a", "item": "2", "corr')          # cut short by a kill
  again = records.ItemLog(path, meta={"task": "t", "n": 1})
  assert again.has("a", "1") and not again.has("a", "2")
  again.write({"preset": "a", "item": "2", "correct": False})
  lines = open(path).read().splitlines()
  assert len(lines) == 3 and all(json.loads(line) for line in lines)
  with pytest.raises(UserError, match=r"n = 1.*n = 2"):
    records.ItemLog(path, meta={"task": "t", "n": 2})


def _recs(outcomes, tokens=None):
  return {str(i): {"correct": bool(c), "finite": True,
                   "tokens": (tokens or {}).get(i, [1, 2, 3])}
          for i, c in enumerate(outcomes)}


def test_report_counts_pairs_and_never_scores_non_finite():
  ref = _recs([1, 1, 0, 0, 1, 1])
  bf16 = _recs([1, 0, 0, 1, 0, 1], tokens={1: [1, 9, 3], 3: [7]})
  bf16["5"]["finite"] = False
  s = report.summarize({"ref": ref, "bf16": bf16}, reference="ref", baseline=None,
                       tokens=True)
  row = s["presets"][1]
  assert (row["items"], row["non_finite"], row["correct"]) == (6, 1, 2)
  c = s["comparisons"][0]
  # items 0..4 (5 is not finite): both {0}, only bf16 {3}, only ref {1, 4}, neither {2}
  assert (c["items"], c["both"], c["only_a"], c["only_b"], c["neither"]) == (5, 1, 1, 2, 1)
  assert c["mcnemar_p"] == 1.0
  assert c["token_identical"] == 3 / 5 and c["median_first_divergence"] == 0.5
  assert "| bf16 vs ref | 5 |" in report.markdown(s)
  assert report.markdown(s).rstrip().endswith("| 60.0 | 0.5 |")
  c["median_first_divergence"] = 125.0  # the median of an even count: shown as 125, not 125.0
  assert report.markdown(s).rstrip().endswith("| 60.0 | 125 |")


# ------------------------------------------------------------------- the job, tiny model
class _ByteTokenizer:
  """Bytes 0..255, <|im_start|> 256, <|im_end|> 257 (the end token)."""
  vocab_size, eos_id, bos_id = 258, 257, None
  chat_template = "(bytes)"

  def apply_chat_template(self, messages, add_generation_prompt=True):
    return "".join(f"<s>{m['role']}\n{m['content']}</s>\n" for m in messages) + "<s>assistant\n"

  def encode(self, text, add_bos=False):
    return list(text.encode())

  def decode(self, ids, skip_special=True):
    return bytes(i for i in ids if i < 256).decode("utf-8", "replace")


@pytest.fixture
def tiny_model(monkeypatch):
  config = ModelConfig(vocab_size=258, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                       head_dim=8, mlp_hidden=32, max_seq_len=4096)
  params = jax.tree_util.tree_map(jnp.asarray, numpy_params(config, 0))
  ckpt = Checkpoint(config, params, _ByteTokenizer(), "tiny random model")
  loads = []
  monkeypatch.setattr(checkpoints, "load", lambda name, **kw: loads.append(name) or ckpt)
  return loads


def test_job_runs_resumes_and_checks_before_loading(tiny_model, tmp_path, capsys):
  run_dir = str(tmp_path / "he")
  kw = dict(run_dir=run_dir, model="tiny", presets=("bf16",), reference="fp32",
            baseline=None, problems=3, batch=2, max_new_tokens=4, timeout_s=5.0)
  s = humaneval_eval.humaneval_eval(**kw)
  assert [r["preset"] for r in s["presets"]] == ["fp32", "bf16"]
  assert all(r["items"] == 3 and r["correct"] == 0 for r in s["presets"])
  assert {k for r in s["presets"] for k in r["kinds"]} <= {"extraction", "syntax", "error",
                                                          "assertion"}
  for name in ("results.json", "results.md", "humaneval.png"):
    assert os.path.getsize(os.path.join(run_dir, name)) > 0
  from attnprec.evals import sizes         # what sizes reads back is what this run wrote
  with open(os.path.join(run_dir, "results.json")) as f:
    assert sizes._schema_problem(json.load(f), "HumanEval run") is None
  lines = open(os.path.join(run_dir, "items.jsonl")).read().splitlines()
  assert len(lines) == 1 + 6
  humaneval_eval.humaneval_eval(**kw)                    # resumes: nothing new to decode
  assert len(open(os.path.join(run_dir, "items.jsonl")).read().splitlines()) == 7
  assert "3 of 3 problems already done" in capsys.readouterr().out
  n = len(tiny_model)
  for bad, match in ((dict(presets=("bf17",)), "Unknown precision preset 'bf17'"),
                     (dict(timeout_s=1e-45), r"timeout_s = 1e-45: must be a finite number "
                                             r">= 0.5"),
                     (dict(presets=("bf16", "bf16")), "must name each value once"),
                     (dict(baseline="fp32_qk"), "baseline = 'fp32_qk' is not among")):
    with pytest.raises(UserError, match=match):
      humaneval_eval.humaneval_eval(**dict(kw, **bad))
  assert len(tiny_model) == n                            # refused before any load
  with pytest.raises(UserError, match="max_new_tokens"):
    humaneval_eval.humaneval_eval(**dict(kw, max_new_tokens=0))
  # a batch past the machine's memory: refused with its estimate, nothing written
  with pytest.raises(UserError, match=r"humaneval.batch = 2000000000 \(prompts of up to .* "
                                      r"needs at least"):
    humaneval_eval.humaneval_eval(**dict(kw, batch=2_000_000_000,
                                         run_dir=str(tmp_path / "huge")))
  huge = tmp_path / "huge"       # (the runner's cli.run removes the empty directory)
  assert not huge.exists() or not [p for p in huge.iterdir() if p.name != ".attnprec-run.json"]


def test_best_case_detectable_is_the_power_threshold():
  """No sample of n pairs detects a smaller difference at 80% power than this, even with
  every discordant pair in one direction (checked against the exact power)."""
  from attnprec import stats
  for n in (40, 164):
    d = report.best_case_detectable(n)
    assert stats.mcnemar_power(n, d, 0.0) >= 0.8 > stats.mcnemar_power(n, d - 1e-3, 0.0)
