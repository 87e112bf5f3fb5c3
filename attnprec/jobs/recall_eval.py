"""`make decode` on the recall task: decode answers at several context lengths under the
decode precision and under an fp32 reference, side by side."""
import dataclasses
import json
import os
from typing import Sequence

import gin
import numpy as np

from attnprec import checks, decoding, runs
from attnprec.errors import UserError
from attnprec.precision import REFERENCE, Precision
from attnprec.tasks import recall

ASSETS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets")
SHIPPED = {"recall-tiny": os.path.join(ASSETS, "recall-tiny")}


def resolve_checkpoint(checkpoint: str) -> str:
  """A shipped checkpoint name or a train run directory -> directory path."""
  if checkpoint in SHIPPED:
    return SHIPPED[checkpoint]
  if not os.path.isdir(checkpoint):
    raise UserError(f"Checkpoint {checkpoint!r} is neither a shipped checkpoint "
                    f"({', '.join(SHIPPED)}) nor an existing run directory. Train one "
                    f"with 'make train' (writes runs/recall).")
  return checkpoint


# RecallTask fields added after runs were written without them, with the value those runs
# had (the shipped recall-tiny predates shared_vocab).
ADDED_LATER = {"shared_vocab": False}


def load_task(ckpt_dir: str) -> recall.RecallTask:
  """The RecallTask a run trained on, from its task.json: every field present, no other
  (a missing field would silently take a default and evaluate a different task)."""
  path = os.path.join(ckpt_dir, "task.json")
  if not os.path.isfile(path):
    raise UserError(f"{ckpt_dir!r} has no task.json: it is not a recall training run.")
  fields = sorted(f.name for f in dataclasses.fields(recall.RecallTask))
  try:
    with open(path) as f:
      raw = json.load(f)
  except (OSError, ValueError) as e:
    raise UserError(f"Cannot read {path!r}: {e}. It should hold the recall task's settings "
                    f"as a JSON object with the fields {fields}.") from None
  if not isinstance(raw, dict):
    raise UserError(f"{path!r} holds a JSON {type(raw).__name__}, not an object with the "
                    f"recall task's fields {fields}.")
  missing = sorted(set(fields) - set(raw) - set(ADDED_LATER))
  unknown = sorted(set(raw) - set(fields))
  if missing or unknown:
    raise UserError(f"{path!r} does not describe a recall task: missing field(s) {missing}, "
                    f"unknown field(s) {unknown}; a task.json written by `make train` has "
                    f"exactly {fields}.")
  return recall.RecallTask(**{**ADDED_LATER, **raw})


def evaluate(params, config, task, precision: Precision, pair_counts: Sequence[int],
             num_prompts: int, num_queries: int, seed: int):
  """{pairs: (accuracy, decoded_BxM)}: prefill the pairs, then decode every answer."""
  out = {}
  for pairs in pair_counts:
    prompt_BxP, template_BxM, answers_BxM = task.eval_episode(
        np.random.default_rng(seed + pairs), num_prompts, pairs, num_queries)
    lengths_B = np.full((num_prompts,), prompt_BxP.shape[1], np.int32)
    tokens_BxM, answered_BxM = decoding.decode_with_template(
        params, prompt_BxP, lengths_B, template_BxM, config=config, precision=precision,
        cache_length=prompt_BxP.shape[1] + template_BxM.shape[1])
    decoded = np.asarray(tokens_BxM)
    out[pairs] = (recall.score(decoded, answers_BxM, answered_BxM), decoded)
  return out


@gin.configurable("recall_eval", denylist=["precision", "run_dir"])
@checks.validated("recall_eval", checkpoint=checks.string,
                  pair_counts=checks.sequence_of(checks.at_least(1)),
                  num_prompts=checks.at_least(1), num_queries=checks.at_least(1),
                  seed=checks.integer(min=0))
def recall_eval(*, precision: Precision, run_dir: str, checkpoint: str = "recall-tiny",
                pair_counts: Sequence[int] = (8, 16, 24, 32), num_prompts: int = 128,
                num_queries: int = 16, seed: int = 1234) -> dict:
  if not pair_counts:
    raise UserError("recall_eval.pair_counts is empty; give at least one pair count, "
                    "e.g. (8, 16, 32).")
  ckpt_dir = resolve_checkpoint(checkpoint)
  config, params = runs.load_checkpoint(ckpt_dir)
  task = load_task(ckpt_dir)
  for p in pair_counts:
    if not 1 <= p <= task.max_pairs:
      raise UserError(f"recall_eval.pair_counts has {p}; valid pair counts for this "
                      f"checkpoint's task are 1..{task.max_pairs}.")
  print(f"checkpoint: {checkpoint} ({config.num_layers} layers, d={config.d_model}, trained "
        f"with {task.num_pairs} pairs)")
  print(f"decode precision:    {precision.describe()}")
  print(f"reference precision: {REFERENCE.describe()}")
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
  runs.write_json(run_dir, "results.json", results)
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
