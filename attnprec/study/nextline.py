"""A downstream task for a code model: next-line exact match on Python source.

Windows of `length` tokens of Python standard-library source (shipped with every CPython;
`FILES`), each starting with `first_token` ('endoftext': the tokenizer's BOS id, for Qwen
`<|endoftext|>`, the document separator; 'none': the code alone). In the second half of
each window, every line is a target: the model, given everything before the line, must
produce the whole line greedily, through its newline token. Exact match is computed from
one teacher-forced forward pass per window: greedy decoding reproduces a line exactly if
and only if the argmax at each of its positions is the true token (by induction over the
line's tokens), so the forward pass's argmax answers every line of the window at once.
A line is the run of tokens after a token containing a newline, up to and including the
next token containing one; lines with no visible character are skipped.

Per precision preset (and the fp32/HIGHEST reference): exact-match rate with a Wilson 95%
interval; the paired difference to the reference and to the first preset (lines answered
differently, and a 95% bootstrap interval resampling whole windows, since lines of one
window are correlated); token top-1 accuracy and NLL of the true text; and the cost per
phase in the same run: the prefill (full forward of a window) and the decode phase
(single-token decode steps from a cache), timed round-robin after compiling.

Shapes: W windows, L tokens, V vocabulary.
"""
import dataclasses
import importlib
import inspect
import os
import statistics
import time
from typing import Dict, List, Optional, Sequence, Tuple

import gin
import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from attnprec import checkpoints, checks, decoding, plotting, runs
from attnprec.errors import NonFiniteError, UserError
from attnprec import stats
from attnprec.precision import REFERENCE, Precision
from attnprec import presets as preset_lib

# Stdlib modules whose source is the task's text (none is in study.inputs.DOC_MODULES'
# docstring text the other studies read).
FILES = ("ast", "configparser", "dataclasses", "enum", "ipaddress", "fnmatch", "graphlib",
         "bisect", "colorsys", "contextlib", "copy", "dis", "filecmp", "ftplib", "gzip",
         "imaplib", "linecache", "netrc", "ntpath", "opcode", "operator", "platform",
         "plistlib", "posixpath", "quopri", "reprlib", "selectors", "signal", "stat",
         "symtable", "sysconfig", "tabnanny", "timeit", "token", "types", "wave",
         "webbrowser", "zipimport")
FIRST_TOKENS = ("endoftext", "none")


def source_tokens(tokenizer, modules: Sequence[str]) -> List[List[int]]:
  """Token ids of each module's source file. A module that does not import, or has no
  Python source file (a C extension, a built-in), is a UserError naming it: results list
  the modules they read, so none may be skipped."""
  out = []
  for name in modules:
    try:
      path = inspect.getsourcefile(importlib.import_module(name))
    except (ImportError, TypeError) as e:
      raise UserError(f"nextline.modules names {name!r}, which has no Python source here "
                      f"({type(e).__name__}: {e}); the task's text is the modules' "
                      f"source files. Name importable pure-Python modules, e.g. "
                      f"{', '.join(repr(m) for m in FILES[:3])}.") from None
    if not path:
      raise UserError(f"nextline.modules names {name!r}, which has no source file (a "
                      f"built-in or compiled module). Name pure-Python modules, e.g. "
                      f"{', '.join(repr(m) for m in FILES[:3])}.")
    with open(path, encoding="utf-8") as f:
      out.append(tokenizer.encode(f.read(), add_bos=False))
  return out


def make_windows(files: List[List[int]], count: int, length: int, prefix: List[int]
                 ) -> np.ndarray:
  """`count` windows [W, L]: `prefix` + a run of one file's tokens, files taken in turn,
  the start drawn evenly through each file."""
  body = length - len(prefix)
  usable = [f for f in files if len(f) >= body]
  if not usable:
    raise UserError(f"No source file has {body} tokens; lower nextline.length.")
  distinct = sum(len(f) - body + 1 for f in usable)
  if count > distinct:
    raise UserError(f"nextline.windows = {count} exceeds the distinct windows of {length} "
                    f"tokens the source files hold ({distinct}): windows would repeat, and "
                    f"the interval would count the copies as independent. Lower "
                    f"nextline.windows, or add modules.")
  per_file = -(-count // len(usable))
  windows = []
  for k in range(per_file):
    for f in usable:
      if len(windows) == count:
        break
      start = int((len(f) - body) * (k + 0.5) / per_file)
      windows.append(prefix + f[start:start + body])
  return np.asarray(windows, np.int32)


def line_spans(tokenizer, tokens: Sequence[int], start: int) -> List[Tuple[int, int]]:
  """[(first, last)] token positions of every visible line that begins at or after
  `start` and ends (with a newline token) inside `tokens`."""
  spans, begin = [], None
  for p, t in enumerate(tokens):
    piece = tokenizer.decode([int(t)], skip_special=False)
    if "\n" in piece:
      if begin is not None and begin >= start:
        text = tokenizer.decode([int(x) for x in tokens[begin:p + 1]])
        if text.strip():
          spans.append((begin, p))
      begin = p + 1
  return spans


def bootstrap_diff(a_WxK: List[np.ndarray], b_WxK: List[np.ndarray], rounds: int = 2000,
                   seed: int = 0) -> Tuple[float, float]:
  """95% interval of mean(a) - mean(b) over lines, resampling whole windows."""
  rng = np.random.default_rng(seed)
  W = len(a_WxK)
  sa = np.array([x.sum() for x in a_WxK], float)
  sb = np.array([x.sum() for x in b_WxK], float)
  n = np.array([len(x) for x in a_WxK], float)
  idx = rng.integers(0, W, (rounds, W))
  diffs = (sa[idx].sum(1) - sb[idx].sum(1)) / np.maximum(n[idx].sum(1), 1)
  return (float(np.percentile(diffs, 2.5)), float(np.percentile(diffs, 97.5)))


def _predictions(ckpt, windows_WxL, precision, batch):
  """(argmax [W, L-1] predicting tokens[1:], NLL [W, L-1] of the true tokens, median
  seconds of one compiled forward pass of `batch` windows: the prefill phase's cost)."""
  preds, nlls, times = [], [], []
  for i in range(0, len(windows_WxL), batch):
    chunk = windows_WxL[i:i + batch]
    t0 = time.perf_counter()
    logits = jax.block_until_ready(checkpoints.logits(ckpt, chunk, precision=precision))
    times.append(time.perf_counter() - t0)
    logits = np.asarray(logits)[:, :-1]
    preds.append(logits.argmax(-1))
    m = logits.max(-1, keepdims=True)
    lse = (m[..., 0] + np.log(np.exp(logits - m).sum(-1)))
    nlls.append(lse - np.take_along_axis(logits, chunk[:, 1:, None], -1)[..., 0])
  later = times[1:] or times           # the first call compiles
  return np.concatenate(preds), np.concatenate(nlls), statistics.median(later)


def _score(pred_WxL, windows_WxL, spans) -> List[np.ndarray]:
  """Per window, a bool per target line: every token of the line predicted."""
  out = []
  for w, sp in enumerate(spans):
    hit = pred_WxL[w] == windows_WxL[w, 1:]            # hit[p - 1]: token p predicted
    out.append(np.array([hit[a - 1:b].all() for a, b in sp], bool))
  return out


def _time_phases(ckpt, windows_WxL, sweep, batch, decode_steps, rounds):
  """Median seconds per configuration of (prefill: full forward of `batch` windows,
  decode: `decode_steps` single-token steps after a prefill of the same windows minus the
  prefill's own time), round-robin after one warm-up each."""
  chunk = windows_WxL[:batch]
  B, L = chunk.shape
  prompt = jnp.asarray(chunk[:, :L - decode_steps])
  lengths = jnp.full((B,), L - decode_steps, jnp.int32)
  gen = {}
  for name, prec in sweep:
    gen[name] = decoding.generate.lower(
        ckpt.params, prompt, lengths, jax.random.PRNGKey(0), config=ckpt.config,
        precision=prec, max_new_tokens=decode_steps).compile()
    jax.block_until_ready(checkpoints.logits(ckpt, chunk, precision=prec))   # compile
  samples = {n: {"prefill": [], "generate": []} for n, _ in sweep}
  for _ in range(rounds):
    for name, prec in sweep:
      t0 = time.perf_counter()
      jax.block_until_ready(checkpoints.logits(ckpt, chunk, precision=prec))
      t1 = time.perf_counter()
      jax.block_until_ready(gen[name](ckpt.params, prompt, lengths, jax.random.PRNGKey(0)))
      t2 = time.perf_counter()
      samples[name]["prefill"].append(t1 - t0)
      samples[name]["generate"].append(t2 - t1)
  out = {}
  for name, s in samples.items():
    pre, g = statistics.median(s["prefill"]), statistics.median(s["generate"])
    out[name] = {"prefill_s": pre, "prefill_tokens": B * L,
                 "prefill_plus_decode_s": g, "decode_steps": decode_steps, "batch": B}
  return out


@gin.configurable("nextline", denylist=["run_dir"])
def nextline(*, run_dir: str, model: str = "qwen2.5-coder-0.5b",
             presets: Sequence[str] = ("bf16", "fp32_logits", "fp32_qk"),
             modules: Sequence[str] = FILES, windows: int = 16, length: int = 512,
             first_token: str = "endoftext", batch: int = 1, decode_steps: int = 8,
             timing_rounds: int = 1, time_decode: bool = True,
             progress: bool = True) -> dict:
  """Runs the task (module docstring) and writes results.json, report.md, nextline.png."""
  if first_token not in FIRST_TOKENS:
    raise UserError(f"Invalid nextline.first_token {first_token!r}; valid values are: "
                    f"{', '.join(map(repr, FIRST_TOKENS))}.")
  for name, value in (("windows", windows), ("length", length), ("batch", batch),
                      ("decode_steps", decode_steps), ("timing_rounds", timing_rounds)):
    if not isinstance(value, int) or value < 1:
      raise UserError(f"nextline.{name} must be a positive integer, got {value!r}.")
  if length < 32 or decode_steps >= length // 2:
    raise UserError(f"nextline.length must be >= 32 and nextline.decode_steps < length / 2; "
                    f"got length={length}, decode_steps={decode_steps}.")
  if not time_decode:
    unread = sorted({"timing_rounds", "decode_steps"} & set(checks.bound_args("nextline")))
    if unread:
      raise UserError(f"nextline.time_decode = False, so {', '.join('nextline.' + u for u in unread)} "
                      f"(read only to time decode steps) would be ignored. Drop them, or "
                      f"set nextline.time_decode = True.")
  sweep = preset_lib.load_sweep(tuple(presets), ())
  runs.ensure_dir(run_dir)
  ckpt = checkpoints.load(model)
  tok = ckpt.tokenizer
  if tok is None:
    raise UserError(f"{model!r} has no tokenizer; the next-line task needs one.")
  prefix = tok.encode("", add_bos=True) if first_token == "endoftext" else []
  files = source_tokens(tok, modules)
  win = make_windows(files, windows, length, prefix)
  spans = [line_spans(tok, w, length // 2) for w in win]
  if not sum(map(len, spans)):
    raise UserError(f"The {windows} windows of {length} tokens hold no complete line in "
                    f"their second half; raise nextline.length or nextline.windows.")
  configs = [("reference", REFERENCE)] + list(sweep)
  bar = tqdm(total=len(configs) + 1, desc="nextline", disable=not progress,
             dynamic_ncols=True)
  raw, prefill_s = {}, {}
  for name, prec in configs:
    bar.set_postfix_str(name)
    try:
      pred, nll, seconds = _predictions(ckpt, win, prec, batch)
    except NonFiniteError as e:    # checkpoints.logits checks every forward pass
      raise NonFiniteError(f"nextline, configuration {name!r}: {e}", stage=e.stage) from None
    raw[name] = (pred, nll, _score(pred, win, spans))
    prefill_s[name] = seconds
    bar.update()
  if time_decode:
    bar.set_postfix_str("timing")
    cost = _time_phases(ckpt, win, configs, batch, decode_steps, timing_rounds)
  else:
    cost = {n: {"prefill_s": prefill_s[n], "prefill_tokens": batch * length,
                "prefill_plus_decode_s": None, "decode_steps": decode_steps,
                "batch": batch} for n, _ in configs}
  bar.update()
  bar.close()

  n_lines = sum(len(s) for s in spans)
  ref_pred, _, ref_hits = raw["reference"]
  first = sweep[0][0]
  rows = []
  for name, prec in configs:
    pred, nll, hits = raw[name]
    k = int(sum(h.sum() for h in hits))
    row = {"name": name, "precision": dataclasses.asdict(prec), "lines": n_lines,
           "exact": k, "exact_match": k / n_lines, "wilson95": stats.wilson(k, n_lines),
           "token_top1": float((pred == win[:, 1:]).mean()),
           "agreement_with_reference": float((pred == ref_pred).mean()),
           "nll": float(nll.mean()), **cost[name]}
    for other, label in (("reference", "vs_reference"), (first, f"vs_{first}")):
      if other == name:
        continue
      o = raw[other][2]
      row[label] = {
          "diff": (k - int(sum(h.sum() for h in o))) / n_lines,
          "bootstrap95": bootstrap_diff(hits, o),
          "only_this": int(sum((a & ~b).sum() for a, b in zip(hits, o))),
          "only_other": int(sum((~a & b).sum() for a, b in zip(hits, o)))}
    rows.append(row)
  result = {"model": ckpt.source, "first_token": first_token,
            "first_token_ids": prefix, "windows": windows, "length": length,
            "modules": list(modules), "lines": n_lines, "configs": rows}
  runs.write_json(run_dir, "results.json", result, provenance=True)
  text = report(result)
  runs.atomic_write(os.path.join(run_dir, "report.md"), text + "\n")
  plot(result, f"{run_dir}/nextline.png")
  print(text)
  print(f"wrote {run_dir}/results.json, report.md and nextline.png")
  return result


def report(result: dict) -> str:
  first = result["configs"][1]["name"] if len(result["configs"]) > 1 else ""
  lines = [f"next-line exact match, {result['lines']} lines in {result['windows']} windows "
           f"of {result['length']} tokens (first token: {result['first_token']}); "
           f"{result['model']}", "",
           f"| preset | exact match | Wilson 95% | vs reference (95% bootstrap) | "
           f"vs {first} (95% bootstrap) | lines only it / only other (vs {first}) | "
           f"token top-1 | NLL/token | agreement with reference | prefill s | "
           f"prefill + {result['configs'][0]['decode_steps']} decode steps s |",
           "|---|---:|---|---|---|---|---:|---:|---:|---:|---:|"]
  for r in result["configs"]:
    def d(key):
      v = r.get(key)
      return "—" if v is None else (f"{v['diff']:+.3f} [{v['bootstrap95'][0]:+.3f}, "
                                    f"{v['bootstrap95'][1]:+.3f}]")
    vs = r.get(f"vs_{first}")
    counts = "—" if vs is None else f"{vs['only_this']} / {vs['only_other']}"
    gen = r["prefill_plus_decode_s"]
    gen = "—" if gen is None else f"{gen:.2f}"
    lines.append(
        f"| {r['name']} | {r['exact_match']:.3f} ({r['exact']}/{r['lines']}) | "
        f"[{r['wilson95'][0]:.3f}, {r['wilson95'][1]:.3f}] | {d('vs_reference')} | "
        f"{d(f'vs_{first}')} | {counts} | "
        f"{r['token_top1']:.4f} | {r['nll']:.4f} | {r['agreement_with_reference']:.4f} | "
        f"{r['prefill_s']:.2f} | {gen} |")
  return "\n".join(lines)


def plot(result: dict, path: str) -> str:
  plt = plotting.pyplot()
  rows = result["configs"]
  fig, ax = plt.subplots(figsize=(6, 3.5))
  x = np.arange(len(rows))
  acc = [r["exact_match"] for r in rows]
  lo = [r["exact_match"] - r["wilson95"][0] for r in rows]
  hi = [r["wilson95"][1] - r["exact_match"] for r in rows]
  ax.bar(x, acc, yerr=[lo, hi], capsize=4, color=["C7"] + [f"C{k}" for k in range(len(rows))])
  ax.set_xticks(x, [r["name"] for r in rows])
  ax.set_ylabel("next-line exact match")
  ax.set_ylim(max(0, min(acc) - 0.15), min(1, max(acc) + 0.1))
  ax.set_title(f"{result['lines']} lines, {result['windows']} x {result['length']} tokens, "
               f"first token: {result['first_token']}", fontsize=9)
  ax.grid(axis="y", alpha=0.3)
  plotting.save_figure(fig, path)
  return path
