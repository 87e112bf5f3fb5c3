"""`make decode` on the recall task: decode answers at several context lengths under the
decode precision and under an fp32 reference, side by side.

A decode whose logits were not finite (NaN/Inf in the logits any answer slot was decoded
from) is an error (exit 2) naming the pair count, the step and the first model stage
whose output was not finite; no accuracy or agreement is printed for it."""
import dataclasses
import os
from typing import Sequence

import gin
import numpy as np

from attnprec import checkpoints, checks, keyoffset, memory, runs, xla_env
from attnprec.checkpoints import finite
from attnprec.errors import UserError
from attnprec.precision import REFERENCE, Precision
from attnprec.tasks import recall

def _kind_at_end(config, params, tokens_1xT, precision) -> str:
  """'NaN' or 'Inf': what the logits at the last position of a forward pass of
  `tokens_1xT` hold ('' when they are finite there)."""
  # a full forward keeps no cache: the phase's settings but the cache's
  full = dataclasses.replace(precision, kv_cache_k_dtype="compute", kv_cache_v_dtype="compute",
                             kv_cache_k_scale=None, kv_cache_v_scale=None)
  row = np.asarray(checkpoints.logits((config, params), np.asarray(tokens_1xT),
                                      precision=full, check_finite=False)[0, -1])
  return "NaN" if np.isnan(row).any() else "Inf" if np.isinf(row).any() else ""


def load_recall_checkpoint(checkpoint: str):
  """(config, params, RecallTask) of a recall checkpoint: 'recall-tiny' or a recall train
  run directory, through `checkpoints.load`."""
  ckpt = checkpoints.load(checkpoint)
  if ckpt.task is None:
    raise UserError(f"{checkpoint!r} has no task.json: it is not a recall training run "
                    f"({ckpt.source}). Use 'recall-tiny' or a run of 'make train'.")
  return ckpt.config, ckpt.params, ckpt.task


def evaluate(params, config, task, precision: Precision, pair_counts: Sequence[int],
             num_prompts: int, num_queries: int, seed: int):
  """{pairs: (accuracy, decoded_BxM)}: prefill the pairs, then decode every answer."""
  out = {}
  for pairs in pair_counts:     # every episode fits the model's context, or none runs
    prompt_BxP, template_BxM, _ = task.eval_episode(np.random.default_rng(seed + pairs), 1,
                                                    pairs, num_queries)
    need = prompt_BxP.shape[1] + template_BxM.shape[1]
    if need > config.max_seq_len:
      raise UserError(f"A recall episode of {pairs} pairs and {num_queries} queries needs "
                      f"{need} positions, more than the model's context (max_seq_len = "
                      f"{config.max_seq_len}, from its model.json); valid pair counts fit "
                      f"it. Lower recall_eval.pair_counts or num_queries, or evaluate a "
                      f"model trained for longer episodes.")
  for pairs in pair_counts:
    prompt_BxP, template_BxM, answers_BxM = task.eval_episode(
        np.random.default_rng(seed + pairs), num_prompts, pairs, num_queries)
    lengths_B = np.full((num_prompts,), prompt_BxP.shape[1], np.int32)
    tokens_BxM, answered_BxM, finite_BxM = finite.decode_with_template(
        params, prompt_BxP, lengths_B, template_BxM, config=config, precision=precision,
        cache_length=prompt_BxP.shape[1] + template_BxM.shape[1])
    decoded = np.asarray(tokens_BxM)
    bad = finite.first_bad(finite_BxM)
    if bad is not None:
      b, m = bad
      # The logits of slot m: those after the prompt and the slots before m.
      seq = np.concatenate([prompt_BxP[b], decoded[b, :m]])[None]
      stage = finite.first_nonfinite_stage(config, params, seq, precision)
      kind = _kind_at_end(config, params, seq, precision) or "NaN or Inf"
      name = "fp32 reference" if precision == REFERENCE else f"{precision.dtype}"
      raise finite.nonfinite_error(
          f"the logits of the {name} decode", precision,
          finite.Where(kind, f"at step {m} of episode {b}, {pairs} pairs"), stage)
    out[pairs] = (recall.score(decoded, answers_BxM, answered_BxM), decoded)
  return out


@gin.configurable("recall_eval", denylist=["precision", "run_dir"])
@checks.validated("recall_eval", checkpoint=checks.string,
                  pair_counts=checks.sequence_of(checks.at_least(1), distinct=True),
                  num_prompts=checks.at_least(1), num_queries=checks.at_least(1),
                  seed=checks.integer(min=0))
def recall_eval(*, precision: Precision, run_dir: str, checkpoint: str = "recall-tiny",
                pair_counts: Sequence[int] = (8, 16, 24, 32), num_prompts: int = 128,
                num_queries: int = 16, seed: int = 1234) -> dict:
  if not pair_counts:
    raise UserError("recall_eval.pair_counts is empty; give at least one pair count, "
                    "e.g. (8, 16, 32).")
  config, params, task = load_recall_checkpoint(checkpoint)
  keyoffset.check(config, precision.key_offset)
  for p in pair_counts:
    if not 1 <= p <= task.max_pairs:
      raise UserError(f"recall_eval.pair_counts has {p}; valid pair counts for this "
                      f"checkpoint's task are 1..{task.max_pairs}.")
  longest = max(task.context_len(p, num_queries) for p in pair_counts)
  memory.check_fits(f"recall_eval.num_prompts = {num_prompts} (episodes of up to {longest} "
                    f"tokens, all in one batch)",
                    memory.batch_bytes(config, num_prompts, longest, longest))
  print(f"checkpoint: {checkpoint} ({config.num_layers} layers, d={config.d_model}, trained "
        f"with {task.num_pairs} pairs)")
  print(f"decode precision:    {precision.describe()}")
  print(f"reference precision: {REFERENCE.describe()}")
  print(xla_env.describe())     # what XLA runs with (a user's own XLA_FLAGS wins)
  got = evaluate(params, config, task, precision, pair_counts, num_prompts, num_queries, seed)
  ref = evaluate(params, config, task, REFERENCE, pair_counts, num_prompts, num_queries, seed)
  rows = []
  for p in pair_counts:
    agree = float(np.mean(got[p][1] == ref[p][1]))
    rows.append({"pairs": p, "context_tokens": task.context_len(p, num_queries),
                 "accuracy": got[p][0], "reference_accuracy": ref[p][0],
                 "agreement_with_reference": agree})
  table = format_table(rows, num_prompts)
  print(table)
  results = {"checkpoint": checkpoint, "precision": dataclasses.asdict(precision),
             "reference_precision": dataclasses.asdict(REFERENCE), "num_prompts": num_prompts,
             "rows": rows, "table": table}
  runs.write_json(run_dir, "results.json", results, provenance=True)
  print(f"wrote {os.path.join(run_dir, 'results.json')}")
  return results


def format_table(rows, num_prompts: int) -> str:
  """Markdown: context length x accuracy under the decode precision and the reference."""
  lines = [f"| pairs | context tokens | accuracy (decode precision) | accuracy (fp32 reference)"
           f" | same tokens as reference |",
           "|---:|---:|---:|---:|---:|"]
  for r in rows:
    lines.append(f"| {r['pairs']} | {r['context_tokens']} | {r['accuracy']:.3f} | "
                 f"{r['reference_accuracy']:.3f} | {r['agreement_with_reference']:.3f} |")
  lines.append(f"({num_prompts} held-out episodes per row, each with its queries; the "
               f"pairs are prefilled, every later answer comes from a decode step)")
  return "\n".join(lines)
