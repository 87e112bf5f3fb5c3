"""The next-line task (`attnprec.study.nextline`): its scoring, spans, intervals, and bad
input.

The key claim: exact match computed from one teacher-forced forward pass equals running
greedy decoding (`attnprec.decoding.generate`, a KV cache and single-token steps) from
each line's prefix and comparing the generated tokens with the line. Checked on a tiny
random model with windows made of its own greedy continuations, some tokens changed, so
that some lines match and some do not.
"""


import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import checkpoints, decoding
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec import stats
from attnprec.precision import REFERENCE
from attnprec.study import nextline
from test_train_utils import numpy_params, runner_exit  # noqa: E402

CONFIG = ModelConfig(vocab_size=11, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_hidden=48)


def test_teacher_forced_exact_match_equals_greedy_decoding():
  params = numpy_params(CONFIG, 3)
  rng = np.random.default_rng(0)
  prompts = rng.integers(0, 11, (3, 6)).astype(np.int32)
  gen, _, *_ = decoding.generate(params, jnp.asarray(prompts), jnp.full((3,), 6, jnp.int32),
                             jax.random.PRNGKey(0), config=CONFIG, precision=REFERENCE,
                             max_new_tokens=18)
  windows = np.concatenate([prompts, np.asarray(gen)], 1)          # [3, 24]
  windows[0, 14] = (windows[0, 14] + 1) % 11                       # break some lines
  windows[2, 9] = (windows[2, 9] + 3) % 11
  spans = [[(6, 9), (10, 13), (14, 17), (18, 22)]] * 3
  logits = np.asarray(checkpoints.logits((CONFIG, params), windows, precision=REFERENCE))
  scored = nextline._score(logits[:, :-1].argmax(-1), windows, spans)
  # greedy decoding from each line's prefix: one batch, right-padded prompts (one compile)
  pairs = [(w, a, b) for w, sp in enumerate(spans) for a, b in sp]
  out, _, *_ = decoding.generate(params, jnp.asarray(windows[[w for w, _, _ in pairs]]),
                             jnp.asarray([a for _, a, _ in pairs], jnp.int32),
                             jax.random.PRNGKey(0), config=CONFIG, precision=REFERENCE,
                             max_new_tokens=5)
  out = np.asarray(out)
  hits = [bool((out[k, :b - a + 1] == windows[w, a:b + 1]).all())
          for k, (w, a, b) in enumerate(pairs)]
  greedy = [hits[4 * w:4 * w + 4] for w in range(3)]
  assert [list(map(bool, s)) for s in scored] == greedy
  flat = sum(greedy, [])
  assert any(flat) and not all(flat)


class _Tok:
  """Token i decodes to PIECES[i]."""
  PIECES = ["def", " f", "():\n", "    ", "return", " 1", "\n", "\n\n", "x"]

  def decode(self, ids, skip_special=True):
    return "".join(self.PIECES[i] for i in ids)


def test_line_spans():
  #        0  1  2  3  4  5  6  7  8  9  10
  tokens = [0, 1, 2, 3, 4, 5, 6, 7, 8, 5, 6]
  # lines: [0..2] "def f():\n", [3..6] "    return 1\n", [7] "\n\n" (blank: skipped),
  # [8..10] "x 1\n"
  assert nextline.line_spans(_Tok(), tokens, 0) == [(3, 6), (8, 10)]   # first has no start
  assert nextline.line_spans(_Tok(), tokens, 4) == [(8, 10)]
  assert nextline.line_spans(_Tok(), tokens[:10], 0) == [(3, 6)]       # unfinished line


def test_windows_and_intervals():
  files = [list(range(100)), list(range(200, 240)), list(range(300, 310))]
  w = nextline.make_windows(files, 5, 21, [7])
  assert w.shape == (5, 21) and (w[:, 0] == 7).all()
  for row in w:                                   # a contiguous run of one file
    assert (np.diff(row[1:]) == 1).all()
  # 81 + 21 distinct starts of a 20-token body: one more window would repeat one
  assert len(nextline.make_windows(files, 102, 21, [7])) == 102
  with pytest.raises(UserError, match=r"nextline.windows = 103 exceeds the distinct "
                                      r"windows of 21 tokens the source files hold \(102\)"):
    nextline.make_windows(files, 103, 21, [7])
  lo, hi = stats.wilson(5, 10)
  assert abs(lo - 0.2366) < 1e-4 and abs(hi - 0.7634) < 1e-4
  a = [np.array([1, 0, 1], bool), np.array([1, 1], bool)]
  assert nextline.bootstrap_diff(a, a) == (0.0, 0.0)
  b = [np.array([0, 0, 0], bool), np.array([0, 0], bool)]
  lo, hi = nextline.bootstrap_diff(a, b)
  assert 2 / 3 - 1e-9 <= lo <= 0.8 <= hi <= 1   # per window 2/3 and 2/2


@pytest.mark.parametrize("binding, needle, process", [
    ("nextline.first_token='bos'", "first_token", True),
    ("nextline.windows=0", "nextline.windows", False),
    ("nextline.presets=('bf17',)", "bf17", False),
])
def test_bad_input_exit_2(binding, needle, process, tmp_path, monkeypatch):
  """Exit code 2, one message naming the setting, no traceback, nothing written. The first
  case runs the runner as a process (its exit code); the others drive its `main(argv)`
  in-process (the same checks, without a process's start-up)."""
  argv = [f"--gin_bindings={binding}", f"--run_dir={tmp_path / 'run'}"]
  rc, err = runner_exit("nextline.py", argv, process=process, monkeypatch=monkeypatch)
  assert rc == 2, err[-2000:]
  assert needle in err and "Traceback" not in err
  assert not (tmp_path / "run").exists()


def test_report_and_plot(tmp_path):
  rows = []
  base = [np.array([1] * 6 + [0] * 4, bool)]
  for name, k, gen in (("reference", 6, 1.5), ("bf16", 4, None), ("fp32_qk", 6, 2.0)):
    hits = [np.array([1] * k + [0] * (10 - k), bool)]
    r = {"name": name, "lines": 10, "exact": k, "exact_match": k / 10,
         "wilson95": stats.wilson(k, 10), "token_top1": 0.5, "nll": 1.0,
         "agreement_with_reference": 1.0, "prefill_s": 0.1, "prefill_plus_decode_s": gen,
         "decode_steps": 8}
    if name != "reference":
      r["vs_reference"] = {"diff": (k - 6) / 10, "bootstrap95": nextline.bootstrap_diff(hits, base),
                           "only_this": 0, "only_other": 6 - k}
    rows.append(r)
  result = {"lines": 10, "windows": 1, "length": 64, "first_token": "endoftext",
            "model": "tiny", "configs": rows}
  text = nextline.report(result)
  assert "| bf16 | 0.400 (4/10) |" in text and "-0.200" in text and "—" in text
  path = nextline.plot(result, str(tmp_path / "n.png"))
  assert open(path, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
