"""The study's outputs: results.json, report.md and PNG plots, each written atomically
(temporary file in the run directory, then rename).

Plots (matplotlib, Agg backend):
  error_vs_context.png     attention-output error (worst layer) vs context, prefill | decode
  accuracy_vs_context.png  task accuracy | decoded tokens differing from the reference
  cost_vs_error.png        time relative to bf16 vs decode attention error (longest context)
  error_by_layer.png       decode attention error per layer at the longest context
"""
import json
import os

import numpy as np

from attnprec import plotting, runs
from attnprec.contract import CacheStorage

PLOTS = ("error_vs_context.png", "accuracy_vs_context.png", "cost_vs_error.png",
         "error_by_layer.png")
# One colour and marker per preset name, the same in every plot.
_STYLE = {"bf16": ("tab:red", "o"), "fp32_logits": ("tab:orange", "s"),
          "fp32_qk": ("tab:purple", "^"), "fp32_attention": ("tab:blue", "D"),
          "fp32": ("tab:green", "v"), "highest": ("tab:gray", "x")}
# Other presets (a study's extra_presets): by their index in the study, 8 colours x 3
# markers, so no two of the first 24 configurations look alike.
_EXTRA = ("tab:brown", "tab:pink", "tab:olive", "tab:cyan", "black", "gold", "teal", "navy")
_EXTRA_MARKERS = ("P", "X", "*")


def _style(name, i):
  return _STYLE.get(name, (_EXTRA[i % len(_EXTRA)], _EXTRA_MARKERS[i % len(_EXTRA_MARKERS)]))


def _worst(xs):
  return float(np.max(xs))


def _context(r) -> str:
  return r["label"] if r["label"].endswith("tokens") else f"{r['label']} ({r['context_tokens']} tok)"


def _fmt(x, digits=2):
  if x == 0:
    return "0"
  if abs(x) >= 0.01 and abs(x) < 1000:
    return f"{x:.{digits + 1}g}"
  return f"{x:.{digits}e}"


# ----------------------------------------------------------------------------- tables
def summary_table(res: dict) -> str:
  """One row per configuration at the longest context."""
  ref = res["reference"]["per_length"][-1]
  label = ref["label"]
  acc_name = "recall accuracy" if res["kind"] == "recall" else "passkey accuracy"
  lines = [f"At the longest context ({label}); errors against the fp32/HIGHEST reference; "
           f"attention errors are the worst layer's; top-1 = teacher-forced positions whose "
           f"most likely token is the reference's.", "",
           f"| config | attn rel L2 prefill | attn rel L2 decode | attn max abs decode | "
           f"logits KL | max abs Δlogit | decode logits KL | top-1 (prefill, decode) | "
           f"NLL/token | greedy agreement | first divergence (mean, min) | {acc_name} | "
           f"time vs {res['timing']['baseline']} |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
  g = None
  for c in res["configs"]:
    r = c["per_length"][-1]
    g = r["greedy"]
    lines.append(
        f"| {c['name']} | {_fmt(_worst(r['prefill_attn_rel_l2']))} | "
        f"{_fmt(_worst(r['decode_attn_rel_l2']))} | {_fmt(_worst(r['decode_attn_max_abs']))} | "
        f"{_fmt(r['logits_kl'])} | {_fmt(r['logits_max_abs'])} | {_fmt(r['decode_logits_kl'])} "
        f"| {r['top1_agreement']:.3f}, {r['decode_top1_agreement']:.3f} "
        f"| {r['nll']:.4f} | {g['agreement']:.3f} | {g['first_divergence_mean']:.1f}, "
        f"{g['first_divergence_min']} | {r['accuracy']:.3f} | {c['time_ratio']:.2f} |")
  lines.append(f"| reference (fp32/HIGHEST) | 0 | 0 | 0 | 0 | 0 | 0 | 1, 1 | {ref['nll']:.4f} | "
               f"1 | {g['steps'] if g else '-'}, - | {ref['accuracy']:.3f} | - |")
  return "\n".join(lines)


def per_length_table(res: dict) -> str:
  acc_name = "recall acc." if res["kind"] == "recall" else "passkey acc."
  lines = [f"| config | context | attn rel L2 prefill | attn rel L2 decode | logits KL | "
           f"decode logits KL | top-1 (prefill, decode) | greedy agreement | "
           f"first div. (min) | {acc_name} |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
  for ref in res["reference"]["per_length"]:
    lines.append(f"| reference | {_context(ref)} | | | | | | | | "
                 f"{ref['accuracy']:.3f} |")
  for c in res["configs"]:
    for r in c["per_length"]:
      g = r["greedy"]
      lines.append(
          f"| {c['name']} | {_context(r)} | "
          f"{_fmt(_worst(r['prefill_attn_rel_l2']))} | {_fmt(_worst(r['decode_attn_rel_l2']))} "
          f"| {_fmt(r['logits_kl'])} | {_fmt(r['decode_logits_kl'])} | "
          f"{r['top1_agreement']:.3f}, {r['decode_top1_agreement']:.3f} | {g['agreement']:.3f} "
          f"| {g['first_divergence_min']} | {r['accuracy']:.3f} |")
  return "\n".join(lines)


def float64_table(res: dict) -> str:
  rows = [r for r in res["reference"]["per_length"] if "float64" in r]
  if not rows:
    return (f"(no context short enough for the float64 pass: study.float64_max_tokens = "
            f"{res['settings']['float64_max_tokens']})")
  lines = ["| context | sequences | attn rel L2 (worst layer) | attn max abs | "
           "logits max abs | logits KL | largest attention logit | median row max (layer "
           "range) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
  for r in rows:
    f = r["float64"]
    st = f.get("attention_logits") or [{"max_abs_logit": float("nan"),
                                        "median_row_max": float("nan")}]
    med = [x["median_row_max"] for x in st]
    lines.append(f"| {r['label']} | {f['sequences']} | {_fmt(_worst(f['attn_rel_l2']))} | "
                 f"{_fmt(_worst(f['attn_max_abs']))} | {_fmt(f['logits_max_abs'])} | "
                 f"{_fmt(f['logits_kl'])} | {max(x['max_abs_logit'] for x in st):.1f} | "
                 f"{min(med):.1f} to {max(med):.1f} |")
  lines += ["", "Attention logits (scaled q·k over visible keys, float64 pass): bf16 spacing is "
            "0.125 in [16, 32) and 0.25 in [32, 64), so flags-off logits of that size carry "
            "rounding errors of up to half of that."]
  return "\n".join(lines)


def _cache_text(p: dict) -> str:
  """The KV cache's storage of a Precision dict (results.json), as `Precision.describe`
  writes it; results written before the cache fields existed: the compute dtype."""
  return CacheStorage(k_dtype=p.get("kv_cache_k_dtype", "compute"),
                      v_dtype=p.get("kv_cache_v_dtype", "compute"),
                      k_scale=p.get("kv_cache_k_scale"),
                      v_scale=p.get("kv_cache_v_scale")).describe()


def precision_table(res: dict) -> str:
  lines = ["| config | dtype | float32_qk_product | float32_logits | einsum_precision | "
           "matmul_precision | kernel | KV cache |", "|---|---|---|---|---|---|---|---|"]
  for c in [{"name": "reference", "precision": res["reference"]["precision"]}] + res["configs"]:
    p = c["precision"]
    lines.append(f"| {c['name']} | {p['dtype']} | {p['float32_qk_product']} | "
                 f"{p['float32_logits']} | {p['einsum_precision']} | {p['matmul_precision']} | "
                 f"{p['kernel']} | {_cache_text(p)} |")
  return "\n".join(lines)


def identical_groups(res: dict):
  """Configurations whose measurements are all identical (same numerics)."""
  groups = {}
  for c in res["configs"]:
    key = json.dumps([{k: v for k, v in r.items() if k != "label"} for r in c["per_length"]],
                     sort_keys=True)
    groups.setdefault(key, []).append(c["name"])
  return [g for g in groups.values() if len(g) > 1]


def to_markdown(res: dict) -> str:
  s, t = res["settings"], res["timing"]
  cfg = res["config"]
  text = res.get("text")
  held_out = bool(text) and text.get("text") == "project_docs"
  task = ("recall prompts (key-value pairs, then a queried key; an answer counts when every "
          "value token is decoded exactly)" if res["kind"] == "recall" else
          f"passkey retrieval (a 5-digit key stated once at a random depth of "
          f"{'the held-out' if held_out else 'stdlib'} text, asked for at the end; correct "
          f"when the greedy continuation contains it)")
  version = "" if held_out or not text else f", Python {text['python']}"
  text_line = (f"NLL and logits are measured on the {text['source']}{version}, "
               f"{text['chars']} characters, sha256 {text['sha256']}…; windows at evenly "
               f"spaced offsets." if text else
               "NLL is over the answer tokens of the recall sequences (prompt + true answer).")
  ts = "; ".join(f"{n}: {1000 * v:.0f} ms" for n, v in t["median_s"].items())
  lines = [
      f"# Precision study: {res['model']}", "",
      f"{cfg['num_layers']} layers, d={cfg['d_model']}, {cfg['num_heads']} heads / "
      f"{cfg['num_kv_heads']} kv heads, head dim {cfg['head_dim']}; query scale multiplier "
      f"{res['query_scale_multiplier']} (1 = as trained). Backend: {res['backend']}.", "",
      ] + _offset_lines(res) + [
      f"**Numerics:** run with `XLA_FLAGS={res['xla_flags']}`: XLA:CPU otherwise drops some "
      f"f32->bf16->f32 roundings (excess precision) and hides part of the effect studied. "
      f"On CPU `einsum_precision` / `matmul_precision` have no numeric effect (DEFAULT and "
      f"HIGHEST are bitwise equal; bf16 dots accumulate in f32); only the dtypes and the two "
      f"attention flags change numbers here. Whether `precision` reaches every dot is checked "
      f"by `make audit`, from the lowered program.", "",
      f"**Reference:** the same model and inputs under fp32/HIGHEST "
      f"(`attnprec.precision.REFERENCE`); its own error against an independent float64 NumPy "
      f"forward pass is the floor below.", "",
      f"**Inputs:** {s['batch']} sequences per context length; task: {task}. {text_line} "
      f"Decode errors come from {s['decode_steps']} teacher-forced single-token decode "
      f"steps from a cache at the end of each sequence; greedy agreement compares "
      f"{s['greedy_steps']} greedy tokens after each task prompt; logits KL / max abs over the "
      f"last {s['logit_positions']} positions.", "",
      "## Results", "", summary_table(res), ""] + [
      f"{' and '.join(g)} gave identical measurements (the same numbers on this backend"
      f"{': a float32 QK product makes the softmax float32 too' if 'fp32_qk' in g else ''})."
      for g in identical_groups(res)] + ["",
      "![error vs context](error_vs_context.png)", "",
      "![accuracy vs context](accuracy_vs_context.png)", "",
      "## Per context length", "", per_length_table(res), "",
      "## Error floor: fp32/HIGHEST reference vs float64", "", float64_table(res), "",
      "## Cost", "",
      f"{t['what']}, {t['rounds']} round-robin rounds, median; ratio to `{t['baseline']}`. "
      f"Medians: {ts}. The machine is shared (2 cores): compare ratios from one run only.", "",
      "![cost vs error](cost_vs_error.png)", "",
      "![error by layer](error_by_layer.png)", "",
      "## Configurations", "", precision_table(res), ""]
  return "\n".join(lines)


# ----------------------------------------------------------------------------- plots
def _figures(res: dict):
  plt = plotting.pyplot()
  import matplotlib.ticker  # noqa: F401

  figs = {}
  x_label = "context (tokens)"
  ctx = [r["context_tokens"] for r in res["reference"]["per_length"]]

  # Configurations bitwise equal to the reference have error 0: no point on a log axis.
  exact = [c["name"] for c in res["configs"]
           if all(_worst(r["prefill_attn_rel_l2"]) == 0 and _worst(r["decode_attn_rel_l2"]) == 0
                  for r in c["per_length"])]
  notes = [f"error 0 (identical to the reference): {', '.join(exact)}"] if exact else []
  notes += [f"identical results: {' = '.join(g)}" for g in identical_groups(res)
            if not set(g) & set(exact)]
  exact_note = "; ".join(notes) or None

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.4), sharey=True)
  for i, c in enumerate(res["configs"]):
    if c["name"] in exact:
      continue
    color, marker = _style(c["name"], i)
    for ax, key in zip(axes, ("prefill_attn_rel_l2", "decode_attn_rel_l2")):
      ax.plot(ctx, [_worst(r[key]) for r in c["per_length"]], marker=marker, color=color,
              label=c["name"], alpha=0.85)
  floor = [(r["context_tokens"], _worst(r["float64"]["attn_rel_l2"]))
           for r in res["reference"]["per_length"] if "float64" in r]
  if floor:
    axes[0].plot(*zip(*floor), "k--o", ms=4, label="fp32 reference vs float64")
  for ax, title in zip(axes, ("prefill (full forward)", "decode (single-token steps)")):
    ax.set_yscale("log")
    ax.set_xlabel(x_label)
    ax.set_title(f"attention output error, {title}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
  axes[0].set_ylabel("relative L2 vs fp32 reference (worst layer)")
  axes[0].legend(fontsize=8, loc="best")
  fig.suptitle(_title(res) + (f"\n{exact_note}" if exact_note else ""), fontsize=9)
  figs["error_vs_context.png"] = fig

  fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
  ref_acc = [r["accuracy"] for r in res["reference"]["per_length"]]
  axes[0].plot(ctx, ref_acc, "k--", lw=2, label="fp32 reference")
  for i, c in enumerate(res["configs"]):
    color, marker = _style(c["name"], i)
    axes[0].plot(ctx, [r["accuracy"] for r in c["per_length"]], marker=marker, color=color,
                 label=c["name"], alpha=0.85)
    axes[1].plot(ctx, [1 - r["greedy"]["agreement"] for r in c["per_length"]], marker=marker,
                 color=color, label=c["name"], alpha=0.85)
  axes[0].set_title("recall accuracy" if res["kind"] == "recall" else "passkey accuracy")
  axes[1].set_title("decoded answer tokens that differ from the reference" if
                    res["kind"] == "recall" else
                    f"greedy tokens that differ from the reference "
                    f"({res['settings']['greedy_steps']} steps)", fontsize=10)
  axes[0].set_ylim(-0.03, 1.03)
  axes[1].set_ylim(bottom=0)
  for ax in axes:
    ax.set_xlabel(x_label)
    ax.grid(True, alpha=0.3)
  axes[0].set_ylabel("fraction")
  axes[1].set_ylabel("fraction (1 - greedy agreement)")
  axes[0].legend(fontsize=8, loc="best")
  fig.suptitle(_title(res), fontsize=9)
  figs["accuracy_vs_context.png"] = fig

  fig, ax = plt.subplots(figsize=(6.5, 4.5))
  for i, c in enumerate(res["configs"]):
    if c["name"] in exact:
      continue
    color, marker = _style(c["name"], i)
    err = _worst(c["per_length"][-1]["decode_attn_rel_l2"])
    ax.scatter([c["time_ratio"]], [err], color=color, marker=marker, s=70, label=c["name"],
               alpha=0.85)
  ax.set_yscale("log")
  ax.set_xlabel(f"time relative to {res['timing']['baseline']} (decoding, median)")
  ax.set_ylabel("decode attention error (rel L2, worst layer)")
  ax.set_title(f"cost vs error at {res['reference']['per_length'][-1]['label']}", fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  if ax.get_legend_handles_labels()[0]:     # every configuration exact: nothing plotted
    ax.legend(fontsize=8, loc="best")
  if exact:
    times = ", ".join(f"{c['name']} {c['time_ratio']:.2f}x" for c in res["configs"]
                      if c["name"] in exact)
    ax.set_title(f"cost vs error at {res['reference']['per_length'][-1]['label']}\n"
                 f"(error 0: {times})", fontsize=10)
  figs["cost_vs_error.png"] = fig

  fig, ax = plt.subplots(figsize=(7, 4.2))
  for i, c in enumerate(res["configs"]):
    if c["name"] in exact:
      continue
    color, marker = _style(c["name"], i)
    y = c["per_length"][-1]["decode_attn_rel_l2"]
    ax.plot(range(len(y)), y, marker=marker, color=color, label=c["name"], alpha=0.85)
  ax.set_yscale("log")
  ax.set_xlabel("layer")
  ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
  ax.set_ylabel("decode attention error (rel L2)")
  ax.set_title(f"error by layer at {res['reference']['per_length'][-1]['label']}", fontsize=10)
  ax.grid(True, which="both", alpha=0.3)
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  if exact_note:
    ax.set_title(f"error by layer at {res['reference']['per_length'][-1]['label']}\n"
                 f"({exact_note})", fontsize=9)
  figs["error_by_layer.png"] = fig
  return figs, plt


def _title(res) -> str:
  """Plot title: the model, and what the study changed about it."""
  extra = []
  if res.get("query_scale_multiplier", 1.0) != 1.0:
    extra.append(f"query scale x{res['query_scale_multiplier']:g}")
  if res.get("logit_offset"):
    extra.append(f"logit offset {res['logit_offset']:g}")
  return res["model"][:110] + (f" ({', '.join(extra)})" if extra else "")


def _offset_lines(res) -> list:
  """The key-offset paragraph (study.logit_offset > 0), else nothing."""
  stats = res.get("offset_stats")
  if not res.get("logit_offset") or not stats:
    return []
  p10 = min(st["p10"] for st in stats)
  p90 = max(st["p90"] for st in stats)
  big = max(st["max_abs"] for st in stats)
  return [
      f"**Logit offset:** every layer adds a key bias after RoPE (`attnprec.study.offsets`) "
      f"that shifts each query's logits by {res['logit_offset']:g} on average (per-layer "
      f"10th-90th percentiles within {p10:.0f} to {p90:.0f}, largest {big:.0f}, on the "
      f"calibration inputs). The softmax ignores a per-query constant, so the model and the "
      f"reference compute the same function as without it; only rounding sees the larger "
      f"logits (bf16 spacing 0.5 in [64, 128), 1 in [128, 256)), as with learned key "
      f"biases that line up with the queries.", ""]


def write_outputs(run_dir: str, res: dict) -> None:
  """results.json, report.md and the plots, each atomically."""
  figs, plt = _figures(res)
  try:
    for name, fig in figs.items():
      plotting.save_figure(fig, os.path.join(run_dir, name), dpi=110)
  finally:
    for fig in figs.values():
      plt.close(fig)
  runs.atomic_write(os.path.join(run_dir, "report.md"), to_markdown(res))
  runs.write_json(run_dir, "results.json", res, provenance=True)
