"""The retrieval eval: its generator, its teacher-forced scorer, its job and its refusals.

A byte-level tokenizer with no merges (one token per byte, `<|endoftext|>` as id 256) and
a tiny random Qwen2-like model stand in for the real ones: every property checked here
(determinism, lengths, prefix reuse, agreement with greedy decoding) holds for any
tokenizer and model.
"""
import contextlib
import dataclasses
import importlib.util
import io
import json
import os
from collections import Counter
from unittest import mock

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import checkpoints, decoding
from attnprec import model as model_lib
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.evals import retrieval, retrieval_eval
from attnprec.precision import REFERENCE
from test_train_utils import numpy_params  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = ModelConfig(vocab_size=257, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                     head_dim=8, mlp_hidden=64, qkv_bias=True, max_seq_len=2048)


@pytest.fixture(scope="module")
def tok():
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers

  from attnprec.checkpoints.tokenizer import Tokenizer, bytes_to_unicode
  vocab = {ch: i for i, ch in enumerate(sorted(bytes_to_unicode().values()))}
  vocab["<|endoftext|>"] = 256
  backend = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[]))
  backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  backend.decoder = decoders.ByteLevel()
  backend.add_special_tokens(["<|endoftext|>"])
  return Tokenizer(backend, bos_id=256, eos_id=256)


@pytest.fixture(scope="module")
def params():
  """Random params at init_params' scales (in NumPy: no compile), small non-zero biases."""
  return jax.tree_util.tree_map(jnp.asarray, numpy_params(CONFIG, 3, bias_std=0.1))


def _contexts(tok, **kw):
  args = dict(length=1024, contexts=2, questions=5, seed=0)
  return retrieval.make_contexts(tok, **{**args, **kw})


# ----------------------------------------------------------------------------- generator
def test_the_tokenizer_is_one_token_per_byte(tok):
  assert tok.encode("ab\n", add_bos=True) == [256, *[tok.backend.token_to_id(c)
                                                       for c in "abĊ"]]
  assert len(tok.encode("ab\n", add_bos=False)) == 3
  assert tok.decode(tok.encode('{"k": 1}\n', add_bos=False)) == '{"k": 1}\n'


def test_same_seed_same_items_other_seed_other_items(tok):
  a, b, c = _contexts(tok), _contexts(tok), _contexts(tok, seed=1)
  assert [x.prefix_text for x in a] == [x.prefix_text for x in b]
  assert [x.prefix_ids for x in a] == [x.prefix_ids for x in b]
  assert [x.items for x in a] == [x.items for x in b]
  assert all(x.prefix_text != y.prefix_text for x, y in zip(a, c))
  assert [i.key for x in a for i in x.items] != [i.key for x in c for i in x.items]
  # Contexts of one run differ from each other too.
  assert a[0].prefix_text != a[1].prefix_text


def test_keys_unique_asked_key_once_and_the_format(tok):
  for ctx in _contexts(tok, contexts=3):
    uuids = [u for pair in ctx.pairs for u in pair]
    assert len(set(uuids)) == len(uuids)              # keys and values all distinct
    assert json.loads(ctx.prefix_text.split("JSON data:\n", 1)[1]) == dict(ctx.pairs)
    assert ctx.prefix_text.startswith(retrieval.INSTRUCTION + "\n\nJSON data:\n{\n")
    assert ctx.prefix_ids[0] == tok.bos_id            # first_token = 'endoftext'
    for it in ctx.items:
      text = ctx.prefix_text + retrieval.question_text(it.key)
      assert text.count(it.key) == 2 and ctx.prefix_text.count(it.key) == 1
      assert ctx.prefix_text.count(it.value) == 1
      assert ctx.pairs[it.index] == (it.key, it.value)
      assert tok.decode(it.question_ids) == f'Key: "{it.key}"\nCorresponding value: "'
      assert tok.decode(it.value_ids) == it.value and tok.decode(it.close_ids) == '"'
      # By construction: the whole item is prefix + question + value + quote.
      assert ctx.tokens(it) == (list(ctx.prefix_ids) + list(it.question_ids)
                                + list(it.value_ids) + list(it.close_ids))
    assert len({it.key for it in ctx.items}) == len(ctx.items)


def test_first_token_none_drops_the_bos(tok):
  a = _contexts(tok, contexts=1)[0]
  b = retrieval.make_contexts(tok, length=1024, contexts=1, questions=5, seed=0,
                              first_token="none")[0]
  assert b.prefix_ids == a.prefix_ids[1:] and b.pairs == a.pairs
  with pytest.raises(UserError, match="first_token"):
    retrieval.make_contexts(tok, length=1024, contexts=1, questions=5, seed=0,
                            first_token="bos")


def test_positions_spread_over_the_object(tok):
  ctxs = _contexts(tok, length=2048, contexts=4, questions=10)
  items = [i for c in ctxs for i in c.items]
  where = Counter(i.where for i in items)
  assert set(where) == {"start", "middle", "end"}, where
  rel = np.array([i.relative for i in items])
  assert rel.min() < 0.1 and rel.max() > 0.9 and 0.3 < np.median(rel) < 0.7
  for c in ctxs:                                      # one index per stratum, in order
    idx = [i.index for i in c.items]
    assert idx == sorted(idx) and len(set(idx)) == len(idx)


@pytest.mark.parametrize("length", [512, 1024, 2048])
def test_lengths_land_near_the_target(tok, length):
  ctxs = _contexts(tok, length=length, contexts=3, questions=3)
  per_pair = len(retrieval.prefix_text(ctxs[0].pairs[:2])) - len(
      retrieval.prefix_text(ctxs[0].pairs[:1]))        # one token per byte here
  for c in ctxs:
    lens = [len(c.tokens(i)) for i in c.items]
    assert max(lens) <= length                         # never beyond the target
    assert max(lens) > length - per_pair               # one more pair would not fit
  assert retrieval.longest_item(ctxs) <= length


def test_every_length_gets_contexts_times_questions_items(tok):
  ctxs = _contexts(tok, length=512, contexts=2, questions=5)   # 512 holds ~3 pairs
  assert sum(len(c.items) for c in ctxs) == 10
  assert len(ctxs) > 2 and all(len(c.items) <= len(c.pairs) for c in ctxs)
  ids = [i.id for c in ctxs for i in c.items]
  assert len(set(ids)) == len(ids) and ids[0] == "L512/c0/q0"


def test_a_length_too_short_for_one_pair_is_refused(tok):
  with pytest.raises(UserError, match="cannot hold one key-value pair"):
    _contexts(tok, length=200)
  with pytest.raises(UserError, match="contexts"):
    _contexts(tok, contexts=0)


# ----------------------------------------------------------------------------- scorer
def _scorer(params, contexts, precision=REFERENCE, batch=3):
  return retrieval_eval.Scorer(
      CONFIG, params, precision, batch=batch,
      prefix_len=max(len(c.prefix_ids) for c in contexts),
      suffix_len=max(len(i.question_ids) + len(i.value_ids) for c in contexts
                     for i in c.items))


def _greedy(params, prompts, n, precision=REFERENCE):
  prompt_BxP, lengths_B = decoding.pad_prompts(prompts)
  out = decoding.generate(params, prompt_BxP, lengths_B, jax.random.PRNGKey(0),
                          config=CONFIG, precision=precision, max_new_tokens=n,
                          return_logits=False)
  return np.asarray(out.tokens_BxM).tolist()


def test_teacher_forced_score_agrees_with_greedy_decoding(tok, params):
  """correct iff greedy decoding from prefix + question reproduces the gold value: gold
  values that are the model's own greedy continuation (correct), that continuation with
  one token changed (wrong from that token on), and the random UUIDs (wrong)."""
  ctx = _contexts(tok, length=768, contexts=1, questions=4)[0]
  base = list(ctx.items)
  n = len(base[0].value_ids)
  greedy = _greedy(params, [list(ctx.prefix_ids) + list(i.question_ids) for i in base], n)
  items = []
  for k, (it, g) in enumerate(zip(base, greedy)):
    items.append(dataclasses.replace(it, id=it.id + "/own", value_ids=tuple(g)))
    j = (7 * k + 5) % n                               # change one token: wrong from j
    bad = list(g)
    bad[j] = (bad[j] + 1) % 256
    items.append(dataclasses.replace(it, id=it.id + f"/bad{j}", value_ids=tuple(bad)))
    items.append(it)                                  # the UUID itself
  ctx = dataclasses.replace(ctx, items=tuple(items))
  scored, _, _ = _scorer(params, [ctx]).score(ctx, ctx.items)
  assert [s.item.id for s in scored] == [i.id for i in items]
  greedy_of = {it.id: g for it, g in zip(base, greedy)}
  kinds = Counter()
  for s in scored:
    g = greedy_of[s.item.id.split("/own")[0].split("/bad")[0]]
    assert s.finite
    assert s.verdict["correct"] == (list(s.item.value_ids) == g), s.item.id
    assert (s.verdict["margin"] > 0) == s.verdict["correct"]
    first = next((j for j, (a, b) in enumerate(zip(g, s.item.value_ids)) if a != b), None)
    assert s.verdict["first_wrong"] == first
    if first is not None:          # up to the first error, the argmax IS greedy's token
      assert s.verdict["argmax"][:first + 1] == g[:first + 1]
    kinds[s.verdict["correct"]] += 1
  assert kinds[True] == len(base) and kinds[False] == 2 * len(base)


def test_prefix_reuse_equals_the_full_forward(tok, params):
  """Prefill of the prefix + a batched suffix forward over its broadcast cache gives the
  full forward's logits: |difference| <= 2e-5 (float32 HIGHEST; logits here are O(1),
  float32 accumulation-order differences are ~1e-6)."""
  ctxs = _contexts(tok, length=1024, contexts=2, questions=4)
  scorer = _scorer(params, ctxs, batch=3)
  apply = jax.jit(lambda p, t: model_lib.transformed(CONFIG).apply(
      p, t, precision=REFERENCE).logits)
  worst = 0.0
  for ctx in ctxs:
    cache, finite, _, _ = scorer._prefix(ctx)
    assert finite
    for k in range(0, len(ctx.items), scorer.batch):
      chunk = list(ctx.items[k:k + scorer.batch])
      suffix_BxS, targets_BxS = scorer._rows(chunk)
      argmax, gold, other, fin = (np.asarray(a) for a in retrieval_eval.extend_suffixes(
          scorer.params, cache, suffix_BxS, jnp.int32(len(ctx.prefix_ids)), targets_BxS,
          config=CONFIG, precision=scorer.precision))
      for b, it in enumerate(chunk):
        full = ctx.tokens(it)
        logits_TxV = np.asarray(apply(params, jnp.asarray([full[:-1]], jnp.int32)))[0]
        P, lo, hi = len(ctx.prefix_ids), *retrieval.score_positions(it)
        ref_SxV = logits_TxV[P:]                     # positions of the suffix
        s = np.arange(lo, hi)
        tgt = np.asarray(full[P + 1:])[s]
        np.testing.assert_array_equal(argmax[b, s], ref_SxV[s].argmax(-1))
        ref_gold = ref_SxV[s, tgt]
        ref_other = np.where(np.arange(CONFIG.vocab_size)[None] == tgt[:, None], -np.inf,
                             ref_SxV[s]).max(-1)
        worst = max(worst, np.abs(gold[b, s] - ref_gold).max(),
                    np.abs(other[b, s] - ref_other).max())
        assert fin[b, s].all()
  assert worst <= 2e-5, worst


def test_judge():
  it = retrieval.Item(id="x", length=9, context=0, question=0, key="k", value="v",
                      index=0, pairs=1, relative=0.0, where="start", question_ids=(1, 2),
                      value_ids=(3, 4), close_ids=(5,))
  assert retrieval.score_positions(it) == (1, 4)
  v = retrieval.judge(it, [3, 4, 6], [2.0, 1.0, 0.5], [1.0, 0.5, 0.9])
  assert v["correct"] and not v["close_ok"] and v["margin"] == 0.5 and v["first_wrong"] is None
  v = retrieval.judge(it, [3, 7, 5], [2.0, 1.0, 0.5], [1.0, 1.5, 0.1])
  assert not v["correct"] and v["close_ok"] and v["margin"] == -0.5 and v["first_wrong"] == 1


# ----------------------------------------------------------------------------- the job
def _load_runner():
  spec = importlib.util.spec_from_file_location("runner_eval_retrieval",
                                                os.path.join(ROOT, "runners", "eval.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


RUNNER = _load_runner()


class WorkStarted(BaseException):
  """The job got past every check and began loading the model."""


def _work(*args, **kwargs):
  raise WorkStarted()


def call(argv, tok, *, load=_work, max_seq_len=2048):
  """(exit code or 'work', stderr) of runners/eval.py with eval.job = @retrieval."""
  gin.clear_config()
  err = io.StringIO()
  with mock.patch.object(retrieval_eval, "model_facts", lambda m: (max_seq_len, tok)), \
       mock.patch.object(retrieval_eval.checkpoints, "load", load), \
       contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
    try:
      rc = RUNNER.main(["--gin_file=experiments/eval_retrieval.gin", *argv])
    except WorkStarted:
      rc = "work"
  gin.clear_config()
  return rc, err.getvalue()


@pytest.mark.parametrize("bindings,needle", [
    (["--gin.retrieval.presets=('bf16', 'nope')"], "Unknown precision preset 'nope'"),
    (["--gin.retrieval.baseline='fp32'"], "retrieval.baseline = 'fp32' is not among"),
    (["--gin.retrieval.contexts=0"], "retrieval.contexts"),
    (["--gin.retrieval.questions=-3"], "retrieval.questions"),
    (["--gin.retrieval.batch=0"], "retrieval.batch"),
    (["--gin.retrieval.lengths=(1024, 0)"], "retrieval.lengths"),
    (["--gin.retrieval.lengths=()"], "retrieval.lengths"),
    (["--gin.retrieval.seed=-1"], "retrieval.seed"),
    (["--gin.retrieval.first_token='bos'"], "retrieval.first_token"),
    (["--gin.retrieval.lengths=(1024, 4096)"], "exceed the context"),
    (["--gin.retrieval.lengths=(100, 1024)"], "cannot hold one key-value pair"),
    (["--gin.eval.job=@retrieve"], "No configurable matching reference '@retrieve'"),
    (["--gin.eval.job='retrieval'"], "Invalid eval.job = 'retrieval': valid jobs are: "
                                     "@humaneval, @retrieval"),
    (["--gin.eval.task='retrieval'"], "Valid parameters of eval: job"),
    (["--gin.retrieval.kernel='flashy'"], "retrieval.kernel = 'flashy' is not an attention"),
    (["--gin.retrieval.kernel='jax_nn'"], "retrieval.kernel = 'jax_nn' cannot run preset"),
    # the presets come from their files: a block size or precision binding would be unused
    (["--gin.blockwise.kv_block=128"], "retrieval.presets (and retrieval.kernel)"),
    (["--gin.precision.float32_logits=True"], "does not read precision.*"),
])
def test_bad_input_is_refused_before_the_model_is_loaded(tok, tmp_path, bindings, needle):
  run_dir = tmp_path / "run"
  rc, err = call([*bindings, f"--run_dir={run_dir}"], tok)
  assert rc == 2, (rc, err)
  assert "Traceback" not in err, err
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("eval: error: "), err
  assert needle in lines[0], (needle, lines[0])
  assert not os.path.exists(run_dir), "run dir left behind"


def test_good_input_reaches_the_model(tok, tmp_path):
  rc, err = call(["--gin.retrieval.lengths=(1024, 2048)", f"--run_dir={tmp_path / 'r'}"],
                 tok)
  assert rc == "work", err
  assert not os.path.exists(tmp_path / "r")          # nothing written before the load


def test_the_job_writes_records_and_report_and_resumes(tok, params, tmp_path):
  ckpt = checkpoints.Checkpoint(CONFIG, params, tok, "tiny random model")
  run_dir = tmp_path / "run"
  # the highest preset's programs are the other tests': 768 the teacher-forced test's,
  # 1024 the prefix test's (both 4 questions in batches of 3, the last one padded)
  argv = ["--gin.retrieval.presets=('bf16',)", "--gin.retrieval.lengths=(768, 1024)",
          "--gin.retrieval.contexts=1", "--gin.retrieval.questions=4",
          "--gin.retrieval.batch=3", f"--run_dir={run_dir}"]
  rc, err = call(argv, tok, load=lambda *a, **k: ckpt)
  assert rc == 0, err
  lines = [json.loads(x) for x in (run_dir / "items.jsonl").read_text().splitlines()]
  meta, recs = lines[0]["meta"], lines[1:]
  assert meta["task"] == "retrieval" and meta["seed"] == 0
  assert meta["kernel"] == "blockwise"              # eval_retrieval.gin's, for every preset
  assert len(recs) == 2 * 2 * 4                     # 2 presets x 2 lengths x 4 items
  assert [r["preset"] for r in recs] == ["highest"] * 8 + ["bf16"] * 8
  assert [r["length"] for r in recs[:8]] == [768] * 4 + [1024] * 4   # shortest first
  for r in recs:
    assert r["finite"] and len(r["argmax"]) == len(r["gold"]) == 36
    assert r["tokens"] <= r["length"] and r["seconds"] > 0
    assert isinstance(r["closed"], bool) and isinstance(r["close_ok"], bool)
  assert sum(r["compile_seconds"] > 0 for r in recs) <= 2 * 2   # first item of each run
  summary = json.loads((run_dir / "results.json").read_text())
  assert sorted(summary["lengths"]) == ["1024", "768"]
  from attnprec.evals import sizes         # what sizes reads back is what this run wrote
  assert sizes._schema_problem(summary, "retrieval run") is None
  comp = summary["lengths"]["768"]["comparisons"]
  assert [(c["a"], c["b"]) for c in comp] == [("bf16", "highest")]
  assert set(summary["departure"]["bf16"]) == {"vs_reference", "vs_baseline"}
  md = (run_dir / "results.md").read_text()
  assert "| preset | 768 | 1024 |" in md and "exact McNemar p" in md
  assert (run_dir / "retrieval.png").stat().st_size > 0
  # A rerun resumes: nothing scored again (the model is never even called).
  before = (run_dir / "items.jsonl").read_text()
  with mock.patch.object(retrieval_eval.Scorer, "score", _work):
    rc, err = call(argv, tok, load=lambda *a, **k: ckpt)
  assert rc == 0, err
  assert (run_dir / "items.jsonl").read_text() == before
  # Other settings never mix with these records.
  rc, err = call([*argv[:-1], "--gin.retrieval.seed=1", argv[-1]], tok,
                 load=lambda *a, **k: ckpt)
  assert rc == 2 and "seed" in err, err
  # ... nor do records computed under other XLA numerics (the header pins them)
  assert meta["xla"].startswith("XLA: excess precision disabled")
  with mock.patch.dict(os.environ, {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "") +
                                    " --xla_cpu_enable_fast_math=true"}):
    rc, err = call(argv, tok, load=lambda *a, **k: ckpt)
  assert rc == 2 and "xla = " in err and "fast_math" in err, err
  # ... nor a record whose precision line is another's (edited): never counted
  lines = before.splitlines()
  last = json.loads(lines[-1])
  assert last["precision"] != recs[0]["precision"]
  last["precision"] = recs[0]["precision"]                 # highest's line on a bf16 record
  (run_dir / "items.jsonl").write_text("\n".join(lines[:-1] + [json.dumps(last)]) + "\n")
  rc, err = call(argv, tok, load=lambda *a, **k: ckpt)
  assert rc == 2 and "preset 'bf16' computed under more than one precision" in err, err


def test_a_batch_past_the_machine_s_memory_is_refused_with_its_estimate(tok, params, tmp_path):
  """retrieval.batch sizes every batch (a short one is padded to it): one whose memory
  estimate exceeds the machine is refused naming it, before anything is scored or
  written (it ran until the system killed it)."""
  ckpt = checkpoints.Checkpoint(CONFIG, params, tok, "tiny random model")
  run_dir = tmp_path / "run"
  rc, err = call(["--gin.retrieval.presets=('bf16',)", "--gin.retrieval.lengths=(512,)",
                  "--gin.retrieval.contexts=1", "--gin.retrieval.questions=2",
                  "--gin.retrieval.batch=2000000000", f"--run_dir={run_dir}"], tok,
                 load=lambda *a, **k: ckpt)
  assert rc == 2 and "retrieval.batch = 2000000000 (rows of 512 tokens) needs at least" in err
  assert not run_dir.exists()
