"""`eval.job = @retrieval`: long-context key-value retrieval per precision preset, paired.

The items are `attnprec.evals.retrieval`'s (UUID key -> value JSON objects of about
`lengths` tokens; a fixed seed, nothing downloaded). An item is scored teacher-forced:
correct when every token of the gold value is the argmax at its position, which is
exactly when greedy decoding would reproduce the value (one forward pass, no generation;
tests/test_retrieval.py checks the two agree on a tiny model in float32). Under a 16-bit
preset a many-token forward and single-token decode steps round in different places, so
there the agreement holds up to that rounding (an item whose margin is within it could
go either way). The weights are those `decoding.generate` runs (`for_serving`).

Prefix reuse. The items of one context share its prefix (instruction + JSON object):
`Scorer` runs the prefix once into a one-row KV cache of (longest prefix + longest
suffix) positions of that length, then, for each batch of the context's questions, one
forward of the suffixes (question + value tokens, right-padded) at positions P.. over the
prefix's cache broadcast to the batch. The prefix goes in chunks of PREFILL_CHUNK (512)
tokens, each a forward at positions start.. over the cache so far, so the attention
scores of one forward are [heads, 512, cache] and never [heads, P, P] (a whole 8k prefix
in one forward took 17 GB with the dot_product kernel and was killed for memory). The
tokens and positions are those of the whole item, so the logits are the full forward's
up to the order of float32 accumulation (tests bound the difference). Prefixes are
padded to whole chunks of the length's longest and suffix batches to its longest suffix,
so one prefill program and one suffix program serve a whole length (`batch` rows; a
short last batch repeats a row, its results dropped); each is compiled once per preset
and length (or loaded from the persistent compilation cache) and its compile time
recorded apart from the run time. The default batch is 10: the 20 questions of a
context are two full batches (batches of 8 would run 8 + 8 + 4 padded to 8: 24 rows for
20 items). Memory: the cache of one row at 8k tokens is ~0.2 GB for the 0.5B in float32
(24 layers x 2 kv heads x 64 x 2 x 4 bytes), so a batch of 10 holds ~2.1 GB of caches
plus the [10, suffix, 151936] logits. Measured: an 8k slice of the 0.5B under bf16
(batch 8) peaked at 8.2 GB resident, params and their served copy included; float32
presets hold twice the cache bytes (expect ~10 GB at batch 10).

Cost. With the dot_product kernel every prefill chunk attends to the whole cache (the
mask hides the positions not yet written), the same work as a dense full-prefix forward
(measured: 894 s per 8k context under bf16, beside another job); with blockwise (what
gin/experiments/eval_retrieval.gin runs) the hidden blocks are skipped: bf16 took 40 min
for all four lengths, the float32 reference 74 min (2-core machine, beside other jobs).

Kernel. `retrieval.kernel` replaces every preset's attention kernel (the flags are kept),
so all presets are compared under one kernel. gin/experiments/eval_retrieval.gin sets
'blockwise', the kernel `make decode` serves long contexts with (`auto` picks it from
512 keys up, and for every decode step): measured on the 0.5B (2-core machine, shared
with a HumanEval run), one 512-token prefill chunk over a 4.6k-position cache took
15-20 s with dot_product and 2-5 s with blockwise (bf16 and the reference alike), because
blockwise skips the key blocks the causal mask hides and never materialises the
[heads, 512, cache] scores.
Blockwise keeps its running sum and output accumulator in float32 whatever the flags
(docs/kernels.md), so with both flags off it rounds less than dot_product would; the logits still leave the
qk dot in bf16 without `float32_qk_product`, the rounding this task probes.

Order and resumption. For each preset (the reference first), every length, shortest
first, so a partial run is useful; one record per item (`attnprec.evals.records`) is
appended as its batch finishes, and a rerun skips the items already recorded. The report
(results.json, results.md, retrieval.png) is rewritten after every (preset, length): per
length and preset, accuracy with a Wilson 95% interval; per length, the paired tables
with exact McNemar p-values of every preset against the reference and against the
baseline (bf16); accuracy vs length; accuracy by the asked key's position; and, for
each preset, the shortest length whose McNemar p against the reference is below 0.05
("where it departs from the reference"), or none.

Bad input (unknown presets, sizes < 1, a length beyond the model's context or too short
to hold one pair, an unknown first_token) is refused before any model is loaded: for a
shipped model or a .gguf file the context length and the tokenizer are read from the
GGUF header (`model_facts`, no weights read); for a train run or HF directory they are
known only from `checkpoints.load`, and the checks run right after it, before anything
is compiled.
"""
import dataclasses
import functools
import os
import time
from typing import Dict, List, Optional, Sequence, Tuple

import gin
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from attnprec import checkpoints, checks, compilation, decoding, memory, runs, xla_env
from attnprec import model as model_lib
from attnprec.cache import init_cache
from attnprec.errors import UserError
from attnprec.evals import common, records, report, retrieval
from attnprec.precision import Precision

ITEMS_FILE = "items.jsonl"
PLOT_FILE = "retrieval.png"
ALPHA = 0.05
PREFILL_CHUNK = 512   # prefix tokens per prefill forward (bounds the attention scores)


# ----------------------------------------------------------------------------- programs
@functools.partial(jax.jit, static_argnames=("config", "precision"), donate_argnums=(1,))
def prefill_chunk(params, cache_1, tokens_1xC, start, last, *, config, precision: Precision):
  """Writes C prefix tokens at positions start.. into the one-row cache (DONATED: updated
  in place); returns (cache, whether the logits of chunk token `last` are finite)."""
  C = tokens_1xC.shape[1]
  positions_1xC = start + jnp.arange(C, dtype=jnp.int32)[None]
  out = model_lib.transformed(config).apply(params, tokens_1xC, positions_1xC, cache_1,
                                            precision=precision,
                                            logits_at_B=jnp.reshape(last, (1,)))
  return out.cache, jnp.all(jnp.isfinite(out.logits))


@functools.partial(jax.jit, static_argnames=("config", "precision"))
def extend_suffixes(params, cache_1, suffix_BxS, start, targets_BxS, *, config,
                    precision: Precision):
  """The suffixes at positions start.. over the prefix cache (one row, broadcast to B).

  targets_BxS[b, s] is the token that should follow suffix position s. Returns per
  position: the argmax, the logit of the target, the best logit of any other token and
  whether the logits row was finite (four [B, S] arrays: no [B, S, V] leaves the
  program)."""
  B, S = suffix_BxS.shape
  cache_B = jax.tree_util.tree_map(lambda x: jnp.broadcast_to(x, (B,) + x.shape[1:]),
                                   cache_1)
  positions_BxS = start + jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  logits_BxSxV = model_lib.transformed(config).apply(
      params, suffix_BxS, positions_BxS, cache_B, precision=precision).logits
  argmax_BxS = jnp.argmax(logits_BxSxV, axis=-1).astype(jnp.int32)
  gold_BxS = jnp.take_along_axis(logits_BxSxV, targets_BxS[..., None], axis=-1)[..., 0]
  is_gold_BxSxV = jnp.arange(logits_BxSxV.shape[-1])[None, None] == targets_BxS[..., None]
  other_BxS = jnp.max(jnp.where(is_gold_BxSxV, -jnp.inf, logits_BxSxV), axis=-1)
  finite_BxS = jnp.all(jnp.isfinite(logits_BxSxV), axis=-1)
  return argmax_BxS, gold_BxS, other_BxS, finite_BxS


@dataclasses.dataclass
class Scored:
  item: retrieval.Item
  verdict: dict           # retrieval.judge's
  finite: bool
  batch_seconds: float
  batch_rows: int
  compile_seconds: float  # the suffix program's compile, on the first item of the batch
                          # that compiled it (0 elsewhere)


class Scorer:
  """Teacher-forced scoring of one length's items under one Precision, with prefix reuse
  (see the module docstring). prefix_len / suffix_len: the longest prefix and suffix
  (question + value) of the length; every context and batch is padded to them."""

  def __init__(self, config, params, precision: Precision, *, batch: int, prefix_len: int,
               suffix_len: int):
    self.config, self.batch = config, batch
    # As `decoding.generate` runs them (bf16 weights rounded once on XLA:CPU).
    self.params, self.precision = decoding.for_serving(params, precision)
    self.chunk = min(PREFILL_CHUNK, prefix_len)
    # the prefix chunks read the blocks' weights stored in c (`decoding.prefill_params`)
    self.prefill_params = decoding.prefill_params(self.params, self.precision, self.chunk)
    self.prefix_len = -(-prefix_len // self.chunk) * self.chunk     # whole chunks
    self.suffix_len = suffix_len
    self.cache_length = self.prefix_len + suffix_len
    self._prefill = self._extend = None
    self.prefill_seconds = 0.0

  def _prefix(self, context: retrieval.Context):
    """The prefix's cache, chunk by chunk (PREFILL_CHUNK tokens per forward, the last
    chunk right-padded: the padding sits at later positions than every real token, so
    the causal mask hides it and the suffix overwrites it)."""
    ids = list(context.prefix_ids)
    C = self.chunk
    ids_1xP = np.zeros((1, self.prefix_len), np.int32)
    ids_1xP[0, :len(ids)] = ids
    cache = init_cache(self.config, 1, self.cache_length, self.precision.compute_dtype,
                       self.precision.cache_storage)     # as `decoding.prefill` stores it
    compile_s, seconds, finite = 0.0, 0.0, True
    for start in range(0, len(ids), C):
      args = (self.prefill_params, cache, jnp.asarray(ids_1xP[:, start:start + C]),
              jnp.int32(start), jnp.int32(min(len(ids) - 1 - start, C - 1)))
      if self._prefill is None:
        c = compilation.compile_lowerable(prefill_chunk, *args, config=self.config,
                                          precision=self.precision)
        self._prefill, compile_s = c.program, c.seconds
      t0 = time.perf_counter()
      cache, ok = jax.block_until_ready(self._prefill(*args))
      seconds += time.perf_counter() - t0
      finite = finite and bool(ok)
    return cache, finite, seconds, compile_s

  def _rows(self, chunk: Sequence[retrieval.Item]):
    rows = list(chunk) + [chunk[0]] * (self.batch - len(chunk))
    S = self.suffix_len
    suffix, targets = [], []
    for it in rows:
      inp = list(it.question_ids + it.value_ids)        # the closing quote is never input
      full = list(it.suffix_ids)
      suffix.append(inp + [0] * (S - len(inp)))
      targets.append(full[1:] + [0] * (S - len(full) + 1))
    return jnp.asarray(suffix, jnp.int32), jnp.asarray(targets, jnp.int32)

  def score(self, context: retrieval.Context, items: Sequence[retrieval.Item]
            ) -> Tuple[List[Scored], float, float]:
    """(scored items, prefill seconds, prefill compile seconds) of `items` (all of
    `context`'s)."""
    cache, prefix_finite, prefill_s, prefill_compile_s = self._prefix(context)
    start = jnp.int32(len(context.prefix_ids))
    out = []
    for i in range(0, len(items), self.batch):
      chunk = list(items[i:i + self.batch])
      suffix_BxS, targets_BxS = self._rows(chunk)
      compile_s = 0.0
      if self._extend is None:
        c = compilation.compile_lowerable(
            extend_suffixes, self.params, cache, suffix_BxS, start, targets_BxS,
            config=self.config, precision=self.precision)
        self._extend, compile_s = c.program, c.seconds
      t0 = time.perf_counter()
      res = jax.block_until_ready(self._extend(self.params, cache, suffix_BxS, start,
                                               targets_BxS))
      seconds = time.perf_counter() - t0
      argmax, gold, other, finite = (np.asarray(a) for a in res)
      for b, it in enumerate(chunk):
        lo, hi = retrieval.score_positions(it)
        verdict = retrieval.judge(it, argmax[b, lo:hi], gold[b, lo:hi], other[b, lo:hi])
        out.append(Scored(it, verdict, prefix_finite and bool(finite[b, lo:hi].all()),
                          seconds, len(chunk), compile_s if b == 0 else 0.0))
    self.prefill_seconds += prefill_s
    return out, prefill_s, prefill_compile_s


# ----------------------------------------------------------------------------- checks
def model_facts(model: str):
  """(context length, tokenizer) of `model` without reading its weights, or None when
  only loading it tells (a train run or HF directory). A shipped model or a .gguf file:
  its GGUF header (metadata and tensor table; the shipped file is assembled on first use,
  as `checkpoints.load` would)."""
  from attnprec.checkpoints import gguf
  from attnprec.checkpoints.gguf_reader import GGUFFile
  from attnprec.checkpoints.tokenizer import Tokenizer
  if model in checkpoints.SHIPPED:
    path = checkpoints.shipped_path(model)
  elif str(model).endswith(".gguf") and os.path.isfile(model):
    path = model
  else:
    return None
  f = GGUFFile(path)
  if "token_embd.weight" not in f.tensors:
    return None                         # let checkpoints.load say what is wrong
  cfg = gguf.config_from_gguf(f.metadata, f.tensors["token_embd.weight"].shape,
                              "output.weight" in f.tensors, str(path))
  tok = (Tokenizer.from_gguf_metadata(f.metadata, origin=str(path))
         if "tokenizer.ggml.tokens" in f.metadata else None)
  return cfg.max_seq_len, tok


def check_lengths(lengths: Sequence[int], max_seq_len: int, model: str) -> None:
  long = [n for n in lengths if n > max_seq_len]
  if long:
    raise UserError(f"retrieval.lengths {tuple(long)} exceed the context of {model!r} "
                    f"({max_seq_len} tokens); valid lengths are 1..{max_seq_len}.")


def build_items(tokenizer, *, lengths, contexts, questions, seed, first_token
                ) -> Dict[int, List[retrieval.Context]]:
  if tokenizer is None:
    raise UserError("The retrieval eval needs the model's tokenizer, and this model has "
                    "none; use a shipped model, a .gguf file or an HF directory with a "
                    "tokenizer.json.")
  return {n: retrieval.make_contexts(tokenizer, length=n, contexts=contexts,
                                     questions=questions, seed=seed,
                                     first_token=first_token) for n in lengths}


# ----------------------------------------------------------------------------- the job
@gin.configurable("retrieval", denylist=["run_dir"])
@checks.validated("retrieval", model=checks.string,
                  presets=checks.sequence_of(checks.string, distinct=True), reference=checks.string,
                  baseline=checks.optional(checks.string),
                  lengths=checks.sequence_of(checks.at_least(1), distinct=True),
                  contexts=checks.at_least(1), questions=checks.at_least(1),
                  seed=checks.at_least(0),
                  first_token=checks.one_of(*retrieval.FIRST_TOKENS),
                  batch=checks.at_least(1))
def retrieval_eval(*, run_dir: str, model: str = "qwen2.5-coder-0.5b",
                   presets: Sequence[str] = ("bf16", "fp32_qk", "fp32_attention",
                                             "fp32_logits"),
                   reference: str = "highest", baseline: Optional[str] = "bf16",
                   lengths: Sequence[int] = (1024, 2048, 4096, 8192), contexts: int = 10,
                   questions: int = 20, seed: int = 0, first_token: str = "endoftext",
                   batch: int = 10, kernel: Optional[str] = None) -> dict:
  """Scores `contexts * questions` retrieval items per length under each preset; writes
  the records and the report into run_dir. kernel: None runs each preset's own attention
  kernel; a name (`attnprec.kernels.CHOICES`) runs every preset with that kernel, its
  precision flags unchanged (see the module docstring, "Kernel")."""
  sweep = common.pick_presets(presets, reference)     # before any model is loaded
  if kernel is not None:
    sweep = common.with_kernel(sweep, kernel, "retrieval.kernel")
  names = [n for n, _ in sweep]
  if baseline is not None and baseline not in names:
    raise UserError(f"retrieval.baseline = {baseline!r} is not among the presets {names}; "
                    f"add it to retrieval.presets or set retrieval.baseline = None.")
  lengths = sorted(set(int(n) for n in lengths))     # shortest first
  facts = model_facts(model)
  ckpt = None
  if facts is None:                                   # only loading tells
    ckpt = _load(model)
    facts = (ckpt.config.max_seq_len, ckpt.tokenizer)
  max_seq_len, tok = facts
  check_lengths(lengths, max_seq_len, model)
  t0 = time.perf_counter()
  by_length = build_items(tok, lengths=lengths, contexts=contexts, questions=questions,
                          seed=seed, first_token=first_token)
  print(f"items: {len(lengths)} lengths x {contexts * questions} (built in "
        f"{time.perf_counter() - t0:.1f} s); " + ", ".join(
            f"{n}: {len(cs)} contexts of {min(len(c.pairs) for c in cs)}-"
            f"{max(len(c.pairs) for c in cs)} pairs, longest item "
            f"{retrieval.longest_item(cs)} tokens"
            for n, cs in by_length.items()))
  meta = {"task": "retrieval", "format": retrieval.FORMAT, "model": model, "seed": seed,
          "first_token": first_token, "contexts": contexts, "questions": questions,
          "batch": batch, "score": "value tokens argmax, teacher-forced, prefix reused",
          "kernel": kernel or "each preset's own",
          # the XLA settings that change numbers: a resume under others is refused
          "xla": xla_env.describe()}
  path = os.path.join(run_dir, ITEMS_FILE)
  # Records of other settings are refused before the model is loaded; a new results
  # file is created only once the model has loaded (a failed load leaves nothing).
  log = records.ItemLog(path, meta) if os.path.isfile(path) else None
  if ckpt is None:
    ckpt = _load(model)
  # one batch's memory at the longest length (`batch` rows: a short batch is padded to
  # it), refused with its estimate rather than running until the system kills it
  memory.check_fits(f"retrieval.batch = {batch} (rows of {lengths[-1]} tokens)",
                    memory.batch_bytes(ckpt.config, batch, lengths[-1], lengths[-1]))
  vocab = max(max(c.prefix_ids) for cs in by_length.values() for c in cs)
  if vocab >= ckpt.config.vocab_size:
    raise UserError(f"The tokenizer of {model!r} gives token id {vocab}, beyond the "
                    f"model's vocabulary ({ckpt.config.vocab_size}).")
  if log is None:
    runs.ensure_dir(run_dir)
    log = records.ItemLog(path, meta)
  summary = None
  for name, precision in sweep:
    print(f"[{name}] {precision.describe()}")
    for n in lengths:
      _score_length(log, name, precision, ckpt, by_length[n], batch, tok)
      summary = write_report(run_dir, log, names, by_length, reference=reference,
                             baseline=baseline, model=model, first_token=first_token,
                             kernel=kernel)
  non_finite = [(n, r) for n, s in summary["lengths"].items() for r in s["presets"]
                if r["non_finite"]]
  if non_finite:
    raise UserError(
        "The logits were not finite (NaN or Inf) on "
        + "; ".join(f"{r['non_finite']} item(s) of length {n} under {r['preset']}"
                    for n, r in non_finite)
        + f": those items are reported as non-finite in {run_dir}/results.md, not "
          f"scored or compared.")
  return summary


def _load(model: str):
  t0 = time.perf_counter()
  ckpt = checkpoints.load(model)
  print(f"model: {ckpt.source} (loaded in {time.perf_counter() - t0:.1f} s)")
  return ckpt


def _check_one_precision(log, name: str, line: Optional[str] = None) -> None:
  """A preset's records were all computed under one precision line, this run's (`line`,
  where known): a record from another precision (edited, or another code's resolution of
  the preset) is never counted under this preset's name."""
  lines = {}
  for item, r in log.of_preset(name).items():
    lines.setdefault(r.get("precision"), item)
  if line is not None:
    lines.setdefault(line, None)
  if len(lines) > 1:
    shown = "; ".join(f"{v!r} (item {item})" if item else f"{v!r} (this run)"
                      for v, item in lines.items())
    raise UserError(f"{log.path} holds records of preset {name!r} computed under more than "
                    f"one precision: {shown}. Results of different precisions are never "
                    f"counted together. Use another --run_dir, or delete the file to start "
                    f"over.")


def _score_length(log, name, precision, ckpt, contexts, batch, tok) -> None:
  todo = [(c, [i for i in c.items if not log.has(name, i.id)]) for c in contexts]
  todo = [(c, items) for c, items in todo if items]
  total = sum(len(c.items) for c in contexts)
  left = sum(len(items) for _, items in todo)
  n = contexts[0].length
  print(f"[{name}] length {n}: {total - left} of {total} items already done")
  _check_one_precision(log, name)
  if not todo:
    return
  scorer = Scorer(ckpt.config, ckpt.params, precision, batch=batch,
                  prefix_len=max(len(c.prefix_ids) for c in contexts),
                  suffix_len=max(len(i.question_ids) + len(i.value_ids)
                                 for c in contexts for i in c.items))
  code, line = runs.code_version(), scorer.precision.describe()   # each record names them
  _check_one_precision(log, name, line)
  bar = tqdm(total=left, desc=f"{name} L{n}", unit="item", dynamic_ncols=True)
  with bar:
    for c, items in todo:
      scored, prefill_s, prefill_compile_s = scorer.score(c, items)
      for k, s in enumerate(scored):
        it, v = s.item, s.verdict
        log.write({
            "preset": name, "item": it.id, "length": it.length, "context": it.context,
            "question": it.question, "index": it.index, "pairs": it.pairs,
            "relative": it.relative, "where": it.where, "tokens": len(c.prefix_ids) +
            len(it.suffix_ids), "correct": v["correct"] if s.finite else False,
            "finite": s.finite, "close_ok": v["close_ok"],
            "closed": tok.decode(v["argmax_close"]).startswith('"'), "argmax": v["argmax"],
            "gold": v["gold"], "argmax_close": v["argmax_close"], "margin": v["margin"],
            "first_wrong": v["first_wrong"],
            "seconds": s.batch_seconds / s.batch_rows + prefill_s / len(items),
            "batch_seconds": s.batch_seconds, "batch_rows": s.batch_rows,
            "prefill_seconds": prefill_s,
            "compile_seconds": s.compile_seconds + (prefill_compile_s if k == 0 else 0.0),
            "code_version": code, "precision": line})
        bar.update(1)
      bar.set_postfix(prefill=f"{prefill_s:.1f}s",
                      compile=f"{prefill_compile_s + scored[0].compile_seconds:.0f}s")


# ----------------------------------------------------------------------------- report
def departure(by_length: Dict[int, dict], preset: str, against: str) -> Optional[int]:
  """The shortest length whose exact McNemar p of `preset` vs `against` is < ALPHA."""
  for n in sorted(by_length):
    for c in by_length[n]["comparisons"]:
      if c["a"] == preset and c["b"] == against and c["mcnemar_p"] < ALPHA:
        return n
  return None


def _timing(recs: Dict[str, dict]) -> dict:
  prefills = {(r["length"], r["context"], r["prefill_seconds"]) for r in recs.values()}
  batches = {(r["length"], r["context"], r["batch_seconds"]) for r in recs.values()}
  run = sum(p for _, _, p in prefills) + sum(b for _, _, b in batches)
  return {"run_seconds": run, "compile_seconds": sum(r["compile_seconds"]
                                                     for r in recs.values()),
          "seconds_per_item": run / len(recs) if recs else None}


def write_report(run_dir, log, presets, by_length, *, reference, baseline, model,
                 first_token, kernel=None) -> dict:
  lengths, all_items, timing = {}, [], {}
  for n, contexts in sorted(by_length.items()):
    items = [i.id for c in contexts for i in c.items]
    all_items += items
    recs = {p: log.of_preset(p, items) for p in presets}
    recs = {p: r for p, r in recs.items() if r}
    if not recs:
      continue
    s = report.summarize(recs, reference=reference, baseline=baseline, tokens=False)
    for row in s["presets"]:
      t = _timing(recs[row["preset"]])
      row.update(t, seconds_per_item_s=f"{t['seconds_per_item']:.2f}",
                 compile_s=f"{t['compile_seconds']:.0f}")
    lengths[n] = s
  recs = {p: log.of_preset(p, all_items) for p in presets}
  recs = {p: r for p, r in recs.items() if r}
  pooled = report.summarize(recs, reference=reference, baseline=baseline, tokens=False)
  positions = {p: {w: report.preset_row(p, {i: x for i, x in r.items() if x["where"] == w})
                   for w in ("start", "middle", "end")} for p, r in recs.items()}
  departs = {p: {"vs_reference": departure(lengths, p, reference),
                 "vs_baseline": departure(lengths, p, baseline) if baseline else None}
             for p in recs if p != reference}
  versions = report.code_versions(recs)
  summary = {"task": "retrieval", "model": model, "first_token": first_token,
             "kernel": kernel or "each preset's own", "reference": reference, "baseline": baseline, "alpha": ALPHA,
             "lengths": lengths, "pooled": pooled, "by_position": positions,
             "departure": departs, "code_versions": versions,
             "mixed_code": report.mixed_code_note(versions)}
  runs.write_json(run_dir, "results.json", summary, provenance=True)
  md = markdown(summary)
  runs.atomic_write(os.path.join(run_dir, "results.md"), md)
  if lengths:
    report.plot_series({n: s for n, s in lengths.items()}, os.path.join(run_dir, PLOT_FILE),
                       xlabel="prompt length (tokens)",
                       title=f"UUID key-value retrieval, {model}", log2=True)
  return summary


def _acc(row) -> str:
  if row["accuracy"] is None:
    return "–"
  lo, hi = row["wilson95"]
  return (f"{100 * row['accuracy']:.1f} ({100 * lo:.1f}–{100 * hi:.1f}) "
          f"[{row['correct']}/{row['items'] - row['non_finite']}]")


def markdown(summary: dict) -> str:
  lengths, ref, base = summary["lengths"], summary["reference"], summary["baseline"]
  presets = [r["preset"] for r in summary["pooled"]["presets"]]
  cols = sorted(lengths)
  out = [f"# UUID key-value retrieval, {summary['model']}, teacher-forced value "
         f"(first token: {summary['first_token']}; attention kernel: "
         f"{summary['kernel']})", "",
         *([f"**{summary['mixed_code']}**", ""] if summary.get("mixed_code") else []),
         "Accuracy % (Wilson 95%) [correct/scored] per prompt length (tokens):", "",
         "| preset | " + " | ".join(str(n) for n in cols) + " |",
         "|---" * (len(cols) + 1) + "|"]
  for p in presets:
    cells = []
    for n in cols:
      row = next((r for r in lengths[n]["presets"] if r["preset"] == p), None)
      cells.append(_acc(row) if row else "–")
    out.append(f"| {p} | " + " | ".join(cells) + " |")
  out += ["", f"Where each preset departs from {ref} (the shortest length with exact "
              f"McNemar p < {summary['alpha']}):", ""]
  for p, d in summary["departure"].items():
    line = f"- {p}: {d['vs_reference'] if d['vs_reference'] is not None else 'none'}"
    if base and p != base:
      line += (f" (vs {base}: "
               f"{d['vs_baseline'] if d['vs_baseline'] is not None else 'none'})")
    out.append(line)
  for n in cols:
    out += ["", f"## {n} tokens", "", report.markdown(
        lengths[n], extra_columns=("seconds_per_item_s", "compile_s")).rstrip()]
  out += ["", "## Accuracy by the asked key's position (all lengths)", "",
          "| preset | start (first 10%) | middle | end (last 10%) |", "|---|---|---|---|"]
  for p, rows in summary["by_position"].items():
    out.append(f"| {p} | " + " | ".join(_acc(rows[w]) for w in ("start", "middle", "end"))
               + " |")
  out += ["", "## All lengths pooled", "", report.markdown(summary["pooled"]).rstrip(), ""]
  return "\n".join(out)
