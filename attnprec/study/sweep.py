"""`make study`: a sweep of precision configurations for one model, measured against an
fp32/HIGHEST reference run (`attnprec.precision.REFERENCE`) of the same model and inputs,
and against an independent float64 NumPy forward pass where the size allows.

Per configuration and context length:
  * attention-output error per layer (relative L2, max abs) in prefill (full forward) and
    in decode (teacher-forced single-token steps from a cache, as in serving);
  * final logits: KL(reference || config), max abs difference and how often the top token
    is the reference's (last positions, teacher-forced, in prefill and in decode steps),
    NLL per token (recall: of the answer tokens; real models: of the stdlib text);
  * decoding from the task prompts: greedy-token agreement with the reference (recall:
    over the answer slots of an episode whose queries arrive between answers; real
    models: M greedy tokens after a passkey prompt) and the first diverging step;
  * task accuracy: recall answers (recall model), passkey retrieval (real models);
  * cost: time of the greedy-decode program at the longest context, round-robin over the
    configurations in the same run, relative to the bf16 preset.
On CPU `precision` (einsum/matmul) changes no numbers (XLA:CPU computes DEFAULT and
HIGHEST alike); the dtypes and the two flags do. The audit checks `precision` instead.
"""
import dataclasses
import os
import statistics
from typing import Optional, Sequence

import gin
import jax
import numpy as np
from tqdm import tqdm

from attnprec import checks, memory, runs
from attnprec.checkpoints import finite
from attnprec.errors import UserError
from attnprec.precision import REFERENCE
from attnprec.tasks import recall
from attnprec import xla_env
from attnprec.study import float64, inputs, measure, models, offsets, report
from attnprec import presets as preset_lib

EXCESS_FLAG = xla_env.FLAG


@dataclasses.dataclass
class Case:
  """One context length: the inputs every configuration sees."""
  label: str                 # '16 pairs' / '1024 tokens'
  context_tokens: int        # tokens in the whole episode / window
  tokens_BxL: np.ndarray     # forward / teacher-forced decode sequences
  nll_mask_BxL: np.ndarray   # which next-token targets count for NLL ([B, L-1])
  prompts_BxP: np.ndarray    # task prompts for decoding
  answers: list              # recall answer tokens [B, M] or passkey strings
  decode_steps: int
  template_BxM: Optional[np.ndarray] = None  # recall: given tokens (>= 0) and answer slots


def _recall_cases(task, pair_counts, batch, decode_steps, num_queries, seed):
  """Recall episodes as `make decode` runs them: the pairs and the first query key are
  prefilled, then every answer is decoded by single-token decode steps from the cache,
  the next query key being fed after each answer."""
  cases = []
  for pairs in pair_counts:
    prompt_BxP, template_BxM, answers_BxM = task.eval_episode(
        np.random.default_rng(seed + pairs), batch, pairs, num_queries)
    tokens = np.concatenate([prompt_BxP, answers_BxM], axis=1).astype(np.int32)
    P = prompt_BxP.shape[1]
    mask = np.zeros((batch, tokens.shape[1] - 1), np.float32)
    mask[:, P - 1:] = (template_BxM < 0).astype(np.float32)
    cases.append(Case(f"{pairs} pairs", tokens.shape[1], tokens, mask, prompt_BxP,
                      answers_BxM, min(decode_steps, tokens.shape[1] - 1), template_BxM))
  return cases


def _real_cases(tokenizer, lengths, batch, decode_steps, seed, text_name="stdlib"):
  text = inputs.load_text(text_name)
  ids = tokenizer.encode(text, add_bos=False)
  bos = tokenizer.encode("", add_bos=True)
  cases = []
  for L in lengths:
    windows = inputs.text_windows(ids, L, batch, bos)
    prompts, keys = inputs.passkey_prompts(tokenizer, ids, L, batch, seed + L)
    cases.append(Case(f"{L} tokens", L, windows, np.ones((batch, L - 1), np.float32),
                      prompts, keys, min(decode_steps, L - 1)))
  return cases, inputs.describe_text(text, text_name)


def _generate(model, config, precision, case, greedy_steps):
  """(tokens_BxM, answered_BxM): recall fills the template's answer slots by greedy
  decode steps; real models continue each passkey prompt greedily."""
  if case.template_BxM is not None:
    return measure.decode_template(model.params, case.prompts_BxP, case.template_BxM, config,
                                   precision)
  tokens, finite_B = measure.generate(model.params, case.prompts_BxP, config, precision,
                                      greedy_steps)
  return tokens, np.ones_like(tokens, bool), finite_B


def _accuracy(kind, generated_BxM, answered_BxM, case, tokenizer):
  if kind == "recall":
    return recall.score(generated_BxM, case.answers, answered_BxM)
  texts = [tokenizer.decode(list(map(int, row))) for row in generated_BxM]
  return float(np.mean([key in t for key, t in zip(case.answers, texts)]))


def _run_case(model, config, precision, case, keep, greedy_steps, name):
  """Raw outputs of one configuration on one case (numpy)."""
  params = model.params
  nll, logits, attn = measure.forward_fn(config, precision, keep)(params, case.tokens_BxL)
  prefix = case.tokens_BxL.shape[1] - case.decode_steps
  dec_logits, dec_attn = measure.decode_fn(config, precision, prefix)(params, case.tokens_BxL)
  generated, answered, generated_finite = _generate(model, config, precision, case,
                                                    greedy_steps)
  out = {"nll": np.asarray(nll), "logits": np.asarray(logits), "attn": np.asarray(attn),
         "dec_logits": np.asarray(dec_logits), "dec_attn": np.asarray(dec_attn),
         "generated": generated, "answered": answered}
  _check_finite(model, config, precision, case, out, generated_finite, name)
  return out


def _check_finite(model, config, precision, case, out, generated_finite, name):
  """Non-finite outputs are an error naming the configuration, never a comparison."""
  problems = [what for key, what in (
      ("logits", "the full-sequence logits"), ("dec_logits", "the decode-step logits"),
      ("attn", "the attention outputs"), ("dec_attn", "the decode-step attention outputs"))
      if not np.isfinite(out[key]).all()]
  if not np.asarray(generated_finite).all():
    problems.append("the greedy decode's logits")
  if not problems:
    return
  stage = measure.first_nonfinite_stage(config, model.params, case.tokens_BxL[:1], precision)
  where = finite.Where("", f"in {', '.join(problems)} at {case.label}")
  raise finite.nonfinite_error(f"the outputs of the study's configuration {name!r}",
                               precision, where, stage)


def _compare(out, ref, case, kind, tokenizer):
  pre_rel, pre_max = measure.per_layer(out["attn"], ref["attn"], 0)
  dec_rel, dec_max = measure.per_layer(out["dec_attn"], ref["dec_attn"], 1)
  mask = case.nll_mask_BxL
  return {
      "context_tokens": case.context_tokens, "label": case.label,
      "prefill_attn_rel_l2": pre_rel, "prefill_attn_max_abs": pre_max,
      "decode_attn_rel_l2": dec_rel, "decode_attn_max_abs": dec_max,
      "logits_kl": measure.kl(ref["logits"], out["logits"]),
      "logits_max_abs": measure.max_abs(out["logits"], ref["logits"]),
      "decode_logits_kl": measure.kl(ref["dec_logits"], out["dec_logits"]),
      "decode_logits_max_abs": measure.max_abs(out["dec_logits"], ref["dec_logits"]),
      "top1_agreement": measure.top1_agreement(out["logits"], ref["logits"]),
      "decode_top1_agreement": measure.top1_agreement(out["dec_logits"], ref["dec_logits"]),
      "nll": float((out["nll"] * mask).sum() / mask.sum()),
      "greedy": measure.greedy_agreement(out["generated"], ref["generated"], out["answered"]),
      "accuracy": _accuracy(kind, out["generated"], out["answered"], case, tokenizer),
  }


def _float64_floor(model, config, ref, case, batch):
  """The fp32/HIGHEST reference against float64 NumPy on the first `batch` sequences."""
  stats = []
  logits64, attn64 = float64.forward(config, model.params, case.tokens_BxL[:batch], stats)
  keep = ref["logits"].shape[1]
  rel, mx = measure.per_layer(ref["attn"][:, :batch], np.stack(attn64), 0)
  return {"sequences": batch, "attn_rel_l2": rel, "attn_max_abs": mx,
          "logits_max_abs": measure.max_abs(ref["logits"][:batch], logits64[:, -keep:]),
          "logits_kl": measure.kl(logits64[:, -keep:], ref["logits"][:batch]),
          "attention_logits": stats}


def _check_environment():
  if jax.default_backend() == "cpu" and EXCESS_FLAG not in os.environ.get("XLA_FLAGS", ""):
    raise UserError(f"The study needs XLA_FLAGS={EXCESS_FLAG} set before jax is imported "
                    f"(XLA:CPU otherwise drops some bf16 roundings, hiding the effect under "
                    f"study). `make study` and runners/study.py set it.")


# The lengths swept by default (gin/runs/study.gin binds the same): recall pair counts,
# real models' context lengths in tokens.
PAIR_COUNTS = (8, 16, 24, 32, 48)
CONTEXT_LENGTHS = (256, 512)
# Defaults of settings that only some studies read (a value other than these, set for a
# study that would not read it, is refused).
GREEDY_STEPS = 16
FLOAT64_BATCH = 2


@gin.configurable("study", denylist=["run_dir"])
@checks.validated(
    "study", model=checks.string,
    presets=checks.optional(checks.sequence_of(checks.string, nonempty=False)),
    extra_presets=checks.sequence_of(checks.string, nonempty=False),
    pair_counts=checks.sequence_of(checks.at_least(1), nonempty=False, distinct=True),
    context_lengths=checks.sequence_of(checks.at_least(2), nonempty=False,
                                     distinct=True),
    batch=checks.at_least(1), decode_steps=checks.at_least(1),
    greedy_steps=checks.at_least(1), num_queries=checks.at_least(1),
    logit_positions=checks.at_least(1), float64_max_tokens=checks.integer(min=0),
    float64_batch=checks.at_least(1), timing_rounds=checks.at_least(1),
    query_scale_multiplier=checks.number(gt=0), logit_offset=checks.number(ge=0),
    seed=checks.integer(min=0), text=checks.optional(checks.one_of(*inputs.TEXTS)))
def study(*, run_dir: str, model: str = "recall-tiny", presets: Optional[Sequence[str]] = None,
          extra_presets: Sequence[str] = (), pair_counts: Sequence[int] = PAIR_COUNTS,
          context_lengths: Sequence[int] = CONTEXT_LENGTHS, batch: int = 32,
          decode_steps: int = 8, greedy_steps: int = GREEDY_STEPS, num_queries: int = 16,
          logit_positions: int = 64, float64_max_tokens: int = 1024,
          float64_batch: int = FLOAT64_BATCH, timing_rounds: int = 3,
          query_scale_multiplier: float = 1.0, logit_offset: float = 0.0, seed: int = 0,
          text: Optional[str] = None, progress: bool = True) -> dict:
  """Runs the sweep and writes results.json, report.md and PNG plots into run_dir.

  model: 'recall-tiny', a recall train run directory, or a real model ('smollm2-135m',
    'gemma3-270m', an HF directory, a .gguf file).
  presets: preset names in gin/precision/ (None = all of them);
    extra_presets: more names or paths of preset files.
  pair_counts: recall context lengths (pairs); context_lengths: real-model lengths (tokens).
  query_scale_multiplier: multiplies the model's query scale at inference (a sharper or
    flatter attention with the same weights; 1.0 = the model as trained).
  logit_offset: if > 0, adds a key bias after RoPE that shifts every query's logits by
    this much on average: the same function in exact arithmetic, large logits in bf16
    (`attnprec.study.offsets`); calibrated on the first context length's inputs.
  text: real models' text for NLL, logits and the passkey filler: 'stdlib' (Python's
    docstrings; None means it) or 'project_docs' (held-out: text written after the
    models' release). The recall model reads no text, so it refuses any.
  """
  _check_environment()
  sweep = preset_lib.load_sweep(presets, extra_presets)
  for name, value in (("batch", batch), ("decode_steps", decode_steps),
                      ("greedy_steps", greedy_steps), ("logit_positions", logit_positions),
                      ("timing_rounds", timing_rounds)):
    if not isinstance(value, int) or value < 1:
      raise UserError(f"study.{name} must be a positive integer, got {value!r}.")
  if query_scale_multiplier <= 0:
    raise UserError(f"study.query_scale_multiplier must be > 0, got {query_scale_multiplier}.")
  if not isinstance(logit_offset, (int, float)) or logit_offset < 0:
    raise UserError(f"study.logit_offset must be a number >= 0 (0 = none), got "
                    f"{logit_offset!r}.")
  runs.ensure_dir(run_dir)
  m = models.load_model(model)
  config = m.config
  if query_scale_multiplier != 1.0:
    config = dataclasses.replace(config, query_scale=config.effective_query_scale * query_scale_multiplier)
  # The lengths the other kind of model reads: a value other than the default
  # (gin/runs/study.gin's) was set for this study and would not be read.
  unread, value, default = (("context_lengths", context_lengths, CONTEXT_LENGTHS)
                            if m.kind == "recall" else
                            ("pair_counts", pair_counts, PAIR_COUNTS))
  if tuple(value) != tuple(default):
    used = "pair_counts" if m.kind == "recall" else "context_lengths"
    raise UserError(f"study.{unread} = {tuple(value)} is read only for "
                    f"{'real models' if m.kind == 'recall' else 'the recall model'}; the "
                    f"{'recall model' if m.kind == 'recall' else 'real model'} {model!r} "
                    f"reads study.{used} instead, so the setting would not be used. Set "
                    f"study.{used}, or remove the binding.")
  if m.kind == "recall" and greedy_steps != GREEDY_STEPS:
    raise UserError(f"study.greedy_steps = {greedy_steps} sets how far a real model "
                    f"continues its passkey prompts; the recall model {model!r} decodes "
                    f"exactly its episodes' answer slots (study.num_queries), so the "
                    f"setting would not be used. Remove the binding, or study a real model.")
  lengths = list(pair_counts if m.kind == "recall" else context_lengths)
  if not lengths:
    raise UserError(f"No context lengths: set study.{'pair_counts' if m.kind == 'recall' else 'context_lengths'}.")
  longest = (max(m.task.context_len(p, num_queries) for p in lengths) if m.kind == "recall"
             else max(lengths))
  memory.check_fits(f"study.batch = {batch} (sequences of up to {longest} tokens, with "
                    f"{decode_steps} decode steps)",
                    memory.batch_bytes(config, batch, longest, longest + decode_steps))
  text_info = None
  if m.kind == "recall" and text is not None:
    raise UserError(f"study.text={text!r} sets the text of a real model's study; the "
                    f"recall model {model!r} reads no text (its inputs are recall "
                    f"episodes). Remove the binding, or study a real model.")
  if m.kind == "recall":
    cases = _recall_cases(m.task, lengths, batch, decode_steps, num_queries, seed)
  else:
    cases, text_info = _real_cases(m.tokenizer, lengths, batch, decode_steps, seed,
                                   text or "stdlib")
  sizes = sorted(case.tokens_BxL.shape[1] for case in cases)
  # The report says how many decode steps and logit positions were compared: a value past
  # the shortest sequence would be cut there, and the report would name the value asked.
  for name, value, most in (("decode_steps", decode_steps, sizes[0] - 1),
                            ("logit_positions", logit_positions, sizes[0])):
    if value > most:
      raise UserError(f"study.{name} = {value} exceeds what the shortest sequence of this "
                      f"study holds ({sizes[0]} tokens: at most {most}); it would be cut to "
                      f"{most} while the report named {value}. Set study.{name} <= {most}, "
                      f"or study longer contexts.")
  if float64_batch > batch:
    raise UserError(f"study.float64_batch = {float64_batch} exceeds study.batch = {batch}: "
                    f"the float64 pass runs on the first of the batch's sequences, so it "
                    f"would be cut to {batch} while the settings recorded {float64_batch}. "
                    f"Set study.float64_batch <= study.batch.")
  if float64_batch != FLOAT64_BATCH and sizes[0] > float64_max_tokens:
    raise UserError(f"study.float64_batch = {float64_batch} sizes the float64 reference "
                    f"pass, which runs only on contexts of at most study.float64_max_tokens "
                    f"= {float64_max_tokens} tokens; none of this study's contexts "
                    f"({sizes[0]}..{sizes[-1]} tokens) is that short, so the setting would "
                    f"not be used. Raise study.float64_max_tokens, or remove the binding.")
  offset_stats = None
  if logit_offset:
    params, offset_stats = offsets.add_key_offsets(config, m.params, cases[0].tokens_BxL,
                                                   float(logit_offset))
    m = m._replace(params=params)
  for case in cases:
    need = case.tokens_BxL.shape[1] + (0 if case.template_BxM is not None else greedy_steps)
    if need > config.max_seq_len:
      raise UserError(f"{m.description} does not fit the requested context: {case.label} "
                      f"needs {need} positions (prompt + study.greedy_steps), the model's "
                      f"max_seq_len is {config.max_seq_len}.")

  total = (1 + len(sweep)) * len(cases) + 1
  bar = tqdm(total=total, desc="study", disable=not progress, dynamic_ncols=True)
  ref_out, ref_rows = [], []
  for case in cases:
    bar.set_postfix_str(f"reference, {case.label}")
    out = _run_case(m, config, REFERENCE, case, logit_positions, greedy_steps, "reference")
    ref_out.append(out)
    row = {"context_tokens": case.context_tokens, "label": case.label,
           "accuracy": _accuracy(m.kind, out["generated"], out["answered"], case,
                                 m.tokenizer),
           "nll": float((out["nll"] * case.nll_mask_BxL).sum() / case.nll_mask_BxL.sum())}
    if case.tokens_BxL.shape[1] <= float64_max_tokens:
      row["float64"] = _float64_floor(m, config, out, case, float64_batch)
    ref_rows.append(row)
    bar.update()

  results = []
  for name, prec in sweep:
    per_length = []
    for case, ref in zip(cases, ref_out):
      bar.set_postfix_str(f"{name}, {case.label}")
      out = _run_case(m, config, prec, case, logit_positions, greedy_steps, name)
      per_length.append(_compare(out, ref, case, m.kind, m.tokenizer))
      bar.update()
    results.append({"name": name, "precision": dataclasses.asdict(prec),
                    "per_length": per_length})

  bar.set_postfix_str("timing")
  timing = _time_round_robin(m, config, sweep, cases[-1], greedy_steps, timing_rounds)
  bar.update()
  bar.close()
  base = timing["baseline"]
  for r in results:
    r["time_s"] = timing["median_s"][r["name"]]
    r["time_ratio"] = r["time_s"] / timing["median_s"][base]

  out = {"model": m.description, "model_arg": model, "kind": m.kind,
         "config": runs.config_dict(config), "query_scale_multiplier": query_scale_multiplier,
         "logit_offset": float(logit_offset), "key_offset": bool(logit_offset),
         "offset_stats": offset_stats,
         "backend": jax.default_backend(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
         "settings": dict(batch=batch, decode_steps=decode_steps, greedy_steps=greedy_steps,
                          logit_positions=logit_positions, float64_max_tokens=float64_max_tokens,
                          float64_batch=float64_batch, timing_rounds=timing_rounds, seed=seed,
                          lengths=lengths),
         "text": text_info, "reference": {"precision": dataclasses.asdict(REFERENCE),
                                          "per_length": ref_rows},
         "configs": results, "timing": timing}
  report.write_outputs(run_dir, out)
  print(report.summary_table(out))
  print(f"wrote {run_dir}/results.json, report.md and plots")
  return out


def _time_round_robin(m, config, sweep, case, greedy_steps, rounds):
  """Median wall time of the (already compiled) greedy-decode program per configuration,
  measured round-robin so drift on a shared machine hits every configuration alike."""
  names = [n for n, _ in sweep]
  samples = {n: [] for n in names}
  precs = dict(sweep)
  for _ in range(rounds):
    for n in names:
      _, dt = measure.timed(_generate, m, config, precs[n], case, greedy_steps)
      samples[n].append(dt)
  baseline = "bf16" if "bf16" in samples else names[0]
  steps = (case.template_BxM.shape[1] if case.template_BxM is not None else greedy_steps)
  return {"what": f"decoding {case.prompts_BxP.shape[0]} prompts x {steps} steps at "
                  f"{case.label} (prefill + single-token decode steps)",
          "rounds": rounds, "baseline": baseline, "samples_s": samples,
          "median_s": {n: statistics.median(v) for n, v in samples.items()}}
