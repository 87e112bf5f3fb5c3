"""`make eval`: HumanEval pass@1 per precision preset of the decode phase, paired.

For each preset (the reference first), the problems not yet in `items.jsonl` are decoded
greedily in batches (prompts sorted by length, `common.Generator`), each answer's code is
extracted and run with the benchmark's test in the sandbox (`attnprec.evals.sandbox`),
and one record per problem is appended as soon as its batch is scored: a killed run loses
at most the batch in flight and a rerun resumes. After every preset, results.json,
results.md and humaneval.png are rewritten from all records so far (`report`).

Decoding stops when every answer of the batch has ended: at the chat end token or at the
token that closes the answer's code block (the code is what is scored; the prose after
it is not), whichever comes first, or at `max_new_tokens`.
"""
import os
import time
from typing import Optional, Sequence

import gin
from tqdm import tqdm

from attnprec import checkpoints, checks, memory, runs, xla_env
from attnprec.errors import UserError
from attnprec.evals import common, humaneval, records, report, sandbox

ITEMS_FILE = "items.jsonl"


# A problem's tests run in a fresh sandboxed Python: below this its start-up alone times
# out, and every problem would count as failed (1e-45 s ran and reported 0%).
MIN_TIMEOUT_S = 0.5


@gin.configurable("humaneval", denylist=["run_dir"])
@checks.validated("humaneval", model=checks.string,
                  presets=checks.sequence_of(checks.string, distinct=True),
                  reference=checks.string, baseline=checks.optional(checks.string),
                  problems=checks.integer(min=1, max=humaneval.NUM_PROBLEMS),
                  batch=checks.at_least(1), max_new_tokens=checks.at_least(1),
                  timeout_s=checks.number(ge=MIN_TIMEOUT_S, le=3600))
def humaneval_eval(*, run_dir: str, model: str = "qwen2.5-coder-0.5b",
                   presets: Sequence[str] = ("bf16", "fp32_qk", "fp32_attention",
                                             "fp32_logits"),
                   reference: str = "highest", baseline: Optional[str] = "bf16",
                   problems: int = humaneval.NUM_PROBLEMS, batch: int = 16,
                   max_new_tokens: int = 512, timeout_s: float = 10.0) -> dict:
  """Decodes `problems` HumanEval problems under each preset; writes the records and the
  report into run_dir."""
  sweep = common.pick_presets(presets, reference)     # before any model is loaded
  if baseline is not None and baseline not in [n for n, _ in sweep]:
    raise UserError(f"humaneval.baseline = {baseline!r} is not among the presets "
                    f"{[n for n, _ in sweep]}; add it to humaneval.presets or set "
                    f"humaneval.baseline = None.")
  limits = sandbox.Limits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s)))
  tasks = humaneval.load_problems()[:problems]
  runs.ensure_dir(run_dir)
  t0 = time.perf_counter()
  ckpt = checkpoints.load(model)
  tok = ckpt.tokenizer
  if tok is None or tok.chat_template is None:
    raise UserError(f"humaneval.model = {model!r} has no tokenizer with a chat template; "
                    f"the eval prompts an instruction-tuned model in its chat format.")
  print(f"model: {ckpt.source} (loaded in {time.perf_counter() - t0:.1f} s)")
  prompts = {p.task_id: humaneval.prompt_tokens(tok, p) for p in tasks}
  longest = max(len(v) for v in prompts.values())
  if longest + max_new_tokens > ckpt.config.max_seq_len:
    raise UserError(f"The longest HumanEval prompt ({longest} tokens) + humaneval."
                    f"max_new_tokens ({max_new_tokens}) exceed the model's context "
                    f"({ckpt.config.max_seq_len}).")
  # one batch's memory (`batch` rows: a short last batch is padded to it), refused with
  # its estimate before anything runs rather than running until the system kills it
  memory.check_fits(f"humaneval.batch = {batch} (prompts of up to {longest} tokens + "
                    f"{max_new_tokens} new)",
                    memory.batch_bytes(ckpt.config, batch, longest, longest + max_new_tokens))
  ends_ExL = humaneval.end_sequences(tok)     # the chat end token, or the closing fence
  log = records.ItemLog(os.path.join(run_dir, ITEMS_FILE), meta={
      "task": "humaneval", "model": model, "source": ckpt.source,
      "max_new_tokens": max_new_tokens, "batch": batch, "prompt": "evalplus-instruct",
      "timeout_s": timeout_s, "xla": xla_env.describe()})
  print(f"sandbox protections on this machine: {', '.join(sandbox.available_protections())}")
  print(xla_env.describe())     # what XLA runs with (a user's own XLA_FLAGS wins)
  summary = None
  for name, precision in sweep:
    # Batches of answers of about one length stop early together: ordered by the
    # reference's answer length where it is known (it runs first), else prompt length.
    ref = log.of_preset(reference)
    order = sorted(tasks, key=lambda p: (len(ref[p.task_id]["tokens"]) if p.task_id in ref
                                         else 0, len(prompts[p.task_id])))
    todo = [p for p in order if not log.has(name, p.task_id)]
    print(f"[{name}] {precision.describe()}: {len(tasks) - len(todo)} of {len(tasks)} "
          f"problems already done")
    if todo:
      _decode_preset(log, name, precision, ckpt, todo, prompts, ends_ExL, batch,
                     max_new_tokens, limits)
    summary = write_report(run_dir, log, [n for n, _ in sweep], [p.task_id for p in tasks],
                           reference=reference, baseline=baseline,
                           max_new_tokens=max_new_tokens, model=model)
  non_finite = [r for r in summary["presets"] if r["non_finite"]]
  if non_finite:
    raise UserError(
        "The logits were not finite (NaN or Inf) while decoding "
        + "; ".join(f"{r['non_finite']} problem(s) under {r['preset']}" for r in non_finite)
        + f": those problems are reported as non-finite in {run_dir}/results.md, not "
          f"scored or compared.")
  return summary


def _decode_preset(log, name, precision, ckpt, todo, prompts, ends_ExL, batch,
                   max_new_tokens, limits) -> None:
  tok = ckpt.tokenizer
  code = runs.code_version()
  gen = common.Generator(ckpt, precision, batch=batch, max_new_tokens=max_new_tokens,
                         ends_ExL=ends_ExL)
  bar = tqdm(total=len(todo), desc=name, unit="problem", dynamic_ncols=True)
  with bar:
    for start in range(0, len(todo), batch):
      chunk = todo[start:start + batch]
      out = gen([prompts[p.task_id] for p in chunk])
      batch_id = f"{name}:{chunk[0].task_id}"      # each problem is decoded once
      for p, tokens, stopped, finite in zip(chunk, out.tokens, out.stopped, out.finite):
        log.write(dict(_score(p, tokens, stopped, finite, tok, limits, name, out),
                       batch_id=batch_id, code_version=code))
        bar.update(1)
      bar.set_postfix(steps=out.steps, s=f"{out.seconds:.0f}",
                      compile=f"{out.compile_seconds:.0f}")


def _score(problem, tokens, stopped, finite, tok, limits, preset, out) -> dict:
  answer = tok.decode(tokens)
  rec = {"preset": preset, "item": problem.task_id, "tokens": tokens, "answer": answer,
         "finite": bool(finite), "stopped": stopped, "batch_steps": out.steps,
         "batch_seconds": out.seconds, "batch_rows": len(out.tokens),
         "compile_seconds": out.compile_seconds}
  if not finite:
    return dict(rec, correct=False, kind="non_finite", detail="logits not finite",
                exec_seconds=0.0)
  ex = humaneval.extract_code(answer)
  if not ex.code.strip():
    return dict(rec, correct=False, kind="extraction", detail="no code in the answer",
                code="", fence_closed=ex.fence_closed, exec_seconds=0.0)
  result = sandbox.run_program(humaneval.program(problem, ex.code), limits=limits)
  return dict(rec, correct=result.passed, kind=result.kind, detail=result.detail,
              code=ex.code, fence_closed=ex.fence_closed, exec_seconds=result.seconds)


def speed(recs) -> dict:
  """tokens/s of a preset's decode (compile excluded) and the steps early stopping saved."""
  batches = {r["batch_id"]: (r["batch_seconds"], r["batch_steps"]) for r in recs.values()}
  tokens = sum(len(r["tokens"]) for r in recs.values())
  seconds = sum(s for s, _ in batches.values())
  steps = sum(st for _, st in batches.values())
  return {"tokens": tokens, "decode_seconds": seconds, "batches": len(batches),
          "steps": steps, "tokens_per_s": tokens / seconds if seconds else None}


def write_report(run_dir, log, presets, items, *, reference, baseline, max_new_tokens,
                 model) -> dict:
  recs = {p: log.of_preset(p, items) for p in presets}
  recs = {p: r for p, r in recs.items() if r}
  summary = report.summarize(recs, reference=reference, baseline=baseline, tokens=True)
  for row in summary["presets"]:
    sp = speed(recs[row["preset"]])
    kinds = {}
    for r in recs[row["preset"]].values():
      kinds[r["kind"]] = kinds.get(r["kind"], 0) + 1
    row.update(sp, kinds=kinds, max_steps=sp["batches"] * max_new_tokens,
               tok_s=f"{sp['tokens_per_s']:.1f}" if sp["tokens_per_s"] else "–",
               steps_run=f"{sp['steps']} / {sp['batches'] * max_new_tokens}")
  versions = report.code_versions(recs)
  summary.update(task="humaneval", model=model, max_new_tokens=max_new_tokens,
                 xla=xla_env.describe(),
                 sandbox_protections=list(sandbox.available_protections()),
                 code_versions=versions, mixed_code=report.mixed_code_note(versions))
  table = report.markdown(summary, extra_columns=("tok_s", "steps_run"))
  kinds = "\n".join(f"- {r['preset']}: " + ", ".join(f"{k} {v}" for k, v in
                                                      sorted(r["kinds"].items()))
                    for r in summary["presets"])
  mixed = f"**{summary['mixed_code']}**\n\n" if summary["mixed_code"] else ""
  md = (f"# HumanEval pass@1, {model}, greedy, up to {max_new_tokens} new tokens\n\n"
        f"{mixed}{table}\nOutcomes per preset:\n{kinds}\n")
  runs.write_json(run_dir, "results.json", summary, provenance=True)
  runs.atomic_write(os.path.join(run_dir, "results.md"), md)
  report.plot(summary, os.path.join(run_dir, "humaneval.png"),
              title=f"HumanEval pass@1, {model}", divergence=True)
  print(md)
  return summary
