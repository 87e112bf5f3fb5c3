"""Why the first token matters for bf16 attention: attention sinks, key biases and where the
error enters, layer by layer.

`capture(config, params, tokens_BxT)` runs an independent NumPy forward pass (float32 by
default; the formulas of `attnprec.study.float64`) and keeps, per layer, what enters the
attention kernel: q and k after RoPE, v, and the part of k that is the (rotated) key bias.
`analyze(...)` then measures on those exact inputs, per layer:

  * logit magnitudes (reference, float64): the largest |logit|, the median over query rows
    of the row's largest logit, of the logit given to key 0 (the sink), of the gap between
    the sink's logit and the largest other one, and of the row's mean logit (the part every
    key shares, which the softmax ignores but a bf16 QK product rounds at its magnitude);
    the attention mass on key 0 (median and mean over rows and heads); the part of the
    sink's logit that is q . b_k;
  * the kernel's own error (`local_rel_l2`): the attention output of each precision preset
    from the same bf16 q, k, v against float64 attention of those inputs; error that
    enters in this layer, not error carried from earlier layers;
  * the same with the keys centred (k - mean_s k_s per sequence and kv head): every logit
    of a query moves by the same amount, so the attention function is unchanged in exact
    arithmetic; if the error disappears, it came from the shared offset's magnitude;
  * the same with the key-bias offset subtracted (`precision.key_offset = 'bias'`'s fixed
    c = E_p[R(p)] b_k, `keyoffset.bias_offset`): what that offset leaves of the error;
  * the same with the query scale folded into q before q is rounded (`prescale_query`):
    where the contract scales q in the compute dtype (QK product in c), the difference is
    what the scale's placement costs (nothing at head dim 64, whose 1/8 is exact);
  * the bias norms of the layer (max |b| of q, k, v).
Shapes: B batch, T tokens, N/K/G heads, kv heads, heads per kv head, H head dim.
"""
import os
from typing import Dict, List, NamedTuple, Sequence

import gin
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from attnprec import contract, kernels, keyoffset, plotting, runs
from attnprec.errors import NonFiniteError, UserError
from attnprec.config import ModelConfig
from attnprec.precision import Precision
from attnprec.study.float64 import _act, _rms_norm, _rope


class LayerInputs(NamedTuple):
  q_BxTxNxH: np.ndarray      # after RoPE
  k_BxTxKxH: np.ndarray      # after RoPE
  v_BxTxKxH: np.ndarray
  kb_BxTxKxH: np.ndarray     # RoPE(b_k) at each position: the bias's part of k (0 if none)


def _layer(cfg: ModelConfig, params, i: int, x_BxTxD, pos_BxT, dtype, precision=None):
  """One block of the NumPy pass: (x after the block, LayerInputs). With `precision`, the
  attention runs through attnprec's kernel under it (inputs rounded to its compute dtype);
  otherwise float64 reference attention."""
  B, T, _ = x_BxTxD.shape
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  p = lambda module, name: np.asarray(params[module][name], dtype)   # noqa: E731
  norm = lambda y, module: _rms_norm(y, p(module, "scale"), cfg.norm_eps,   # noqa: E731
                                     cfg.norm_plus_one).astype(dtype)
  pre = f"decoder/layer_{i}"
  h = norm(x_BxTxD, f"{pre}/pre_attn_norm")
  proj = {}
  for name, heads in (("q", N), ("k", K), ("v", K)):
    y = h @ p(f"{pre}/attn/{name}", "w")
    if cfg.qkv_bias:
      y = y + p(f"{pre}/attn/{name}", "b")
    proj[name] = y.reshape(B, T, heads, H)
  if cfg.qk_norm:
    proj["q"] = norm(proj["q"], f"{pre}/attn/q_norm")
    proj["k"] = norm(proj["k"], f"{pre}/attn/k_norm")
  base, scale = cfg.rope(i)
  q = _rope(proj["q"], pos_BxT, base, scale).astype(dtype)
  k = _rope(proj["k"], pos_BxT, base, scale).astype(dtype)
  kb = np.zeros_like(k)
  if cfg.qkv_bias and not cfg.qk_norm:
    b = np.broadcast_to(p(f"{pre}/attn/k", "b").reshape(1, 1, K, H), (B, T, K, H))
    kb = _rope(b, pos_BxT, base, scale).astype(dtype)
  if "k_offset" in params.get(f"{pre}/attn/kernel", {}):   # the study's key bias (probes.py)
    k = k + p(f"{pre}/attn/kernel", "k_offset")
  v = proj["v"]
  allowed = pos_BxT[:, None, None, :] <= pos_BxT[:, None, :, None]
  window = cfg.window(i)
  if window is not None:
    allowed = allowed & (pos_BxT[:, None, None, :] > pos_BxT[:, None, :, None] - window)
  if precision is None:
    a = contract.reference_attention_np(q, k, v, mask=allowed, scale=cfg.query_scale,
                                        logits_soft_cap=cfg.attn_logit_soft_cap)
  else:
    c = contract.parse_dtype(precision.dtype)
    a = np.asarray(kernels.attend(precision, *(jnp.asarray(t, c) for t in (q, k, v)),
                                  mask=jnp.asarray(allowed), scale=cfg.query_scale,
                                  logits_soft_cap=cfg.attn_logit_soft_cap), np.float64)
  hh = a.astype(dtype).reshape(B, T, N * H) @ p(f"{pre}/attn/o", "w")
  if cfg.post_attn_norm:
    hh = norm(hh, f"{pre}/post_attn_norm")
  x = x_BxTxD + hh
  hh = norm(x, f"{pre}/pre_mlp_norm")
  g = hh @ p(f"{pre}/mlp/gate", "w")
  hh = (_act(g, cfg.activation).astype(dtype) * (hh @ p(f"{pre}/mlp/up", "w"))) \
      @ p(f"{pre}/mlp/down", "w")
  if cfg.post_mlp_norm:
    hh = norm(hh, f"{pre}/post_mlp_norm")
  return x + hh, LayerInputs(q, k, v, kb)


def _embed(cfg, params, tokens_BxT, dtype):
  x = np.asarray(params["decoder/embed"]["embeddings"], dtype)[np.asarray(tokens_BxT)]
  return x * dtype(np.sqrt(cfg.d_model)) if cfg.embed_scale else x


def _logits(cfg, params, x_BxTxD, dtype):
  x = _rms_norm(x_BxTxD, np.asarray(params["decoder/final_norm"]["scale"], dtype),
                cfg.norm_eps, cfg.norm_plus_one).astype(dtype)
  w = (np.asarray(params["decoder/embed"]["embeddings"], dtype).T if cfg.tie_embeddings
       else np.asarray(params["decoder/unembed"]["w"], dtype))
  out = x @ w
  if cfg.final_logit_soft_cap is not None:
    out = cfg.final_logit_soft_cap * np.tanh(out / cfg.final_logit_soft_cap)
  return out


def capture(config: ModelConfig, params, tokens_BxT, dtype=np.float32) -> List[LayerInputs]:
  """Per layer, the attention kernel's inputs (see `LayerInputs`), positions 0..T-1."""
  B, T = np.asarray(tokens_BxT).shape
  pos_BxT = np.broadcast_to(np.arange(T), (B, T))
  x, out = _embed(config, params, tokens_BxT, dtype), []
  for i in range(config.num_layers):
    x, inputs = _layer(config, params, i, x, pos_BxT, dtype)
    out.append(inputs)
  return out


def injected_kl(config: ModelConfig, params, tokens_BxT, precision: Precision,
                layers: Sequence, dtype=np.float32) -> Dict[str, float]:
  """Where the error that matters enters: the mean KL(clean || injected) of the final
  next-token distributions when the attention of ONE layer (or of 'all') runs through the
  kernel under `precision` and everything else is the float32 NumPy pass. Positions 1..
  T-1 (position 0 sees only itself)."""
  B, T = np.asarray(tokens_BxT).shape
  pos_BxT = np.broadcast_to(np.arange(T), (B, T))
  xs = [_embed(config, params, tokens_BxT, dtype)]
  for i in range(config.num_layers):
    xs.append(_layer(config, params, i, xs[-1], pos_BxT, dtype)[0])
  clean = _logits(config, params, xs[-1], dtype)[:, 1:]
  if not np.isfinite(clean).all():
    raise NonFiniteError("sinks: the float32 NumPy forward pass's logits are not finite; the "
                         "model's activations overflow float32.")
  out = {}
  for which in layers:
    if which == "all":
      x = xs[0]
      for i in range(config.num_layers):
        x = _layer(config, params, i, x, pos_BxT, dtype, precision)[0]
    else:
      x = _layer(config, params, which, xs[which], pos_BxT, dtype, precision)[0]
      for i in range(which + 1, config.num_layers):
        x = _layer(config, params, i, x, pos_BxT, dtype)[0]
    injected = _logits(config, params, x, dtype)[:, 1:]
    _require_finite(injected, f"the logits with layer {which!r}'s attention under the "
                              f"preset", precision)
    out[str(which)] = _kl(clean, injected)
  return out


def _require_finite(array, what: str, precision) -> None:
  """A NonFiniteError instead of an error figure computed from NaN/Inf."""
  x = np.asarray(array)
  if np.isfinite(x).all():
    return
  kind = "NaN" if np.isnan(x).any() else "Inf"
  raise NonFiniteError(f"sinks: {what} holds {kind} under {precision.describe()}; no error "
                       f"or KL is reported for values that are not finite."
                       + (" float16 holds values up to 65504 only; use bfloat16."
                          if precision.dtype == "float16" else ""))


def _kl(ref_logits, logits) -> float:
  lr = ref_logits.astype(np.float64)
  lr = lr - lr.max(-1, keepdims=True)
  lr = lr - np.log(np.exp(lr).sum(-1, keepdims=True))
  lp = logits.astype(np.float64)
  lp = lp - lp.max(-1, keepdims=True)
  lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
  return float(np.mean(np.sum(np.exp(lr) * (lr - lp), -1)))


def _grouped_logits(cfg: ModelConfig, q_BxTxNxH, k_BxTxKxH) -> np.ndarray:
  """float64 logits [B, N, T, S] (query head n reads kv head n // G)."""
  G = cfg.num_heads // cfg.num_kv_heads
  k = np.repeat(np.asarray(k_BxTxKxH, np.float64), G, axis=2)
  return np.einsum("btnh,bsnh->bnts", np.asarray(q_BxTxNxH, np.float64)
                   * cfg.effective_query_scale, k)


def logit_profile(cfg: ModelConfig, layer: LayerInputs) -> Dict[str, float]:
  """The reference logit magnitudes of one layer (see the module docstring); rows are
  queries t >= 1 (they see the sink and at least one other key) of every head."""
  L = _grouped_logits(cfg, layer.q_BxTxNxH, layer.k_BxTxKxH)          # [B, N, T, S]
  T = L.shape[-1]
  vis = np.tril(np.ones((T, T), bool))
  Lm = np.where(vis, L, -np.inf)
  rows = slice(1, None)
  sink = L[:, :, rows, 0]
  others = Lm[:, :, rows, 1:].max(-1)
  p = np.exp(Lm - Lm.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  mean = np.where(vis, L, 0).sum(-1) / vis.sum(-1)
  bias = _grouped_logits(cfg, layer.q_BxTxNxH, layer.kb_BxTxKxH)[:, :, rows, 0]
  return {"max_abs_logit": float(np.abs(np.where(vis, L, 0)).max()),
          "median_row_max": float(np.median(Lm[:, :, rows].max(-1))),
          "median_sink_logit": float(np.median(sink)),
          "median_other_max": float(np.median(others)),
          "median_sink_gap": float(np.median(sink - others)),
          "median_row_mean": float(np.median(mean[:, :, rows])),
          "median_abs_row_mean": float(np.median(np.abs(mean[:, :, rows]))),
          "median_sink_mass": float(np.median(p[:, :, rows, 0])),
          "mean_sink_mass": float(np.mean(p[:, :, rows, 0])),
          "median_sink_bias_logit": float(np.median(bias)),
          "bf16_spacing_at_row_max": float(np.median(
              2.0 ** (np.floor(np.log2(np.abs(Lm[:, :, rows].max(-1)) + 1e-30)) - 7)))}


def local_error(cfg: ModelConfig, layer: LayerInputs, precision: Precision,
                center_keys: bool = False, prescale_query: bool = False,
                key_offset_KxH=None) -> float:
  """Relative L2 error of the kernel under `precision` on this layer's inputs (rounded to
  the compute dtype) against float64 attention of the same rounded inputs.

  prescale_query: q is multiplied by the query scale in float64 BEFORE it is rounded to
  the compute dtype, and the kernel runs with scale 1. Under a contract row that scales q
  in the compute dtype (the QK product in c), this removes the second rounding of q (its
  product with the scale), so the difference from the contract's own error is what the
  query scale's placement costs. When the scale is a power of two (head dim 64: 1/8) the
  product is exact and the two errors are identical; at head dim 128 (1/sqrt(128)) it is
  not.

  key_offset_KxH: a fixed vector subtracted from every key in float32 before the keys are
  rounded (`precision.key_offset = 'bias'`: `keyoffset.bias_offset` of the layer's key
  bias); like centring, exact in exact arithmetic."""
  c = contract.parse_dtype(precision.dtype)
  k = np.asarray(layer.k_BxTxKxH, np.float32)
  if center_keys:
    k = k - k.mean(axis=1, keepdims=True)
  if key_offset_KxH is not None:
    k = k - np.asarray(key_offset_KxH, np.float32)[None, None]
  q = np.asarray(layer.q_BxTxNxH, np.float32)
  scale = cfg.query_scale
  if prescale_query:
    q = (np.asarray(q, np.float64) * cfg.effective_query_scale).astype(np.float32)
    scale = 1.0
  q_, k_, v_ = (jnp.asarray(np.asarray(a, np.float32), c) for a in (q, k, layer.v_BxTxKxH))
  T = q_.shape[1]
  mask = np.tril(np.ones((T, T), bool))[None, None]
  out = np.asarray(kernels.attend(precision, q_, k_, v_, mask=jnp.asarray(mask),
                                  scale=scale), np.float64)
  _require_finite(out, "the attention kernel's output on a layer's inputs", precision)
  ref = contract.reference_attention_np(*(np.asarray(a, np.float64) for a in (q_, k_, v_)),
                                        mask=mask, scale=scale)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def bias_norms(cfg: ModelConfig, params) -> List[Dict[str, float]]:
  """Per layer max |b| of the q, k, v biases and the largest L2 norm of a kv head's b_k."""
  rows = []
  for i in range(cfg.num_layers):
    row = {}
    for name in "qkv":
      b = np.asarray(params[f"decoder/layer_{i}/attn/{name}"].get("b", np.zeros(1)),
                     np.float64) if cfg.qkv_bias else np.zeros(1)
      row[f"max_abs_b{name}"] = float(np.abs(b).max())
    bk = (np.asarray(params[f"decoder/layer_{i}/attn/k"]["b"], np.float64).reshape(
        cfg.num_kv_heads, cfg.head_dim) if cfg.qkv_bias else np.zeros((1, 1)))
    row["max_l2_bk_per_kv_head"] = float(np.linalg.norm(bk, axis=-1).max())
    rows.append(row)
  return rows


def bias_offsets(cfg: ModelConfig, params):
  """Per layer `precision.key_offset = 'bias'`'s c (float32 [K, H]), or None for a model
  without a key bias."""
  if not cfg.qkv_bias:
    return None
  return [np.asarray(keyoffset.bias_offset(jnp.asarray(np.asarray(
      params[f"decoder/layer_{i}/attn/k"]["b"], np.float32).reshape(
          cfg.num_kv_heads, cfg.head_dim)), cfg, i)) for i in range(cfg.num_layers)]


def analyze(cfg: ModelConfig, params, variants: Dict[str, np.ndarray],
            presets: Sequence, on_variant=None) -> dict:
  """{variant: {"profile": [per layer], "local": {preset: [per layer]}, "local_centered":
  {preset: [per layer]}, "local_prescaled": {preset: [per layer]}}, "bias_norms": [per
  layer]} for each token array in `variants`
  (e.g. the windows with and without their first token). presets: [(name, Precision)]."""
  out = {"bias_norms": bias_norms(cfg, params), "variants": {}}
  offsets = bias_offsets(cfg, params)
  for label, tokens in variants.items():
    layers = capture(cfg, params, tokens)
    res = {"tokens": list(np.asarray(tokens).shape), "profile": [], "local": {},
           "local_centered": {}, "local_prescaled": {}, "local_bias_offset": {}}
    for layer in layers:
      res["profile"].append(logit_profile(cfg, layer))
    for name, prec in presets:
      res["local"][name] = [local_error(cfg, l, prec) for l in layers]
      res["local_centered"][name] = [local_error(cfg, l, prec, center_keys=True)
                                     for l in layers]
      res["local_prescaled"][name] = [local_error(cfg, l, prec, prescale_query=True)
                                      for l in layers]
      if offsets is not None:
        res["local_bias_offset"][name] = [local_error(cfg, l, prec, key_offset_KxH=c)
                                          for l, c in zip(layers, offsets)]
    out["variants"][label] = res
    if on_variant is not None:
      on_variant()
  return out


def plot(result: dict, path_prefix: str, title: str = "") -> List[str]:
  """Three PNGs: logit magnitudes, local kernel error, bias norms. Returns the paths."""
  plt = plotting.pyplot()
  paths = []
  variants = result["variants"]
  styles = ["-", "--", ":", "-."]
  fig, ax = plt.subplots(figsize=(8, 4.5))
  for (label, res), ls in zip(variants.items(), styles):
    prof = res["profile"]
    layers = np.arange(len(prof))
    for key, color, name in (("median_sink_logit", "C3", "sink (key 0) logit"),
                             ("median_other_max", "C0", "largest other logit"),
                             ("median_abs_row_mean", "C2", "|row mean| (shared offset)"),
                             ("max_abs_logit", "C7", "max |logit|")):
      ax.plot(layers, [abs(r[key]) for r in prof], ls, color=color, marker=".",
              label=f"{name}, {label}")
  ax.set_yscale("log")
  ax.set_xlabel("layer")
  ax.set_ylabel("|attention logit| (median over query rows)")
  ax.set_title(f"{title}: attention logit magnitudes per layer (fp32 reference)")
  ax.legend(fontsize=6, ncol=2)
  ax.grid(alpha=0.3)
  paths.append(f"{path_prefix}_logits.png")
  plotting.save_figure(fig, paths[-1])

  fig, ax = plt.subplots(figsize=(8, 4.5))
  for (label, res), ls in zip(variants.items(), styles):
    for k, (name, errs) in enumerate(res["local"].items()):
      ax.plot(np.arange(len(errs)), errs, ls, color=f"C{k}", marker=".",
              label=f"{name}, {label}")
    for k, (name, errs) in enumerate(res["local_centered"].items()):
      if name == "bf16":
        ax.plot(np.arange(len(errs)), errs, ls, color="C7", marker="x",
                label=f"{name}, keys centred, {label}")
    for name, errs in res.get("local_bias_offset", {}).items():
      if name == "bf16":
        ax.plot(np.arange(len(errs)), errs, ls, color="C9", marker="s", markersize=3,
                label=f"{name}, key-bias offset, {label}")
    for name, errs in res.get("local_prescaled", {}).items():
      if name == "bf16":
        ax.plot(np.arange(len(errs)), errs, ls, color="C8", marker="+",
                label=f"{name}, q scaled before rounding, {label}")
  ax.set_yscale("log")
  ax.set_xlabel("layer")
  ax.set_ylabel("attention output rel. L2 error of the kernel alone")
  ax.set_title(f"{title}: error entering at each layer (same inputs, vs float64)")
  ax.legend(fontsize=6, ncol=2)
  ax.grid(alpha=0.3)
  paths.append(f"{path_prefix}_local_error.png")
  plotting.save_figure(fig, paths[-1])

  fig, ax = plt.subplots(figsize=(8, 3.5))
  bn = result["bias_norms"]
  for key, color in (("max_abs_bq", "C0"), ("max_abs_bk", "C3"), ("max_abs_bv", "C2")):
    ax.plot(np.arange(len(bn)), [r[key] for r in bn], color=color, marker="o",
            label=key.replace("max_abs_", "max |").replace("b", "b_", 1) + "|")
  ax.set_yscale("log")
  ax.set_xlabel("layer")
  ax.set_ylabel("max |bias|")
  ax.set_title(f"{title}: q/k/v bias magnitudes")
  ax.legend(fontsize=8)
  ax.grid(alpha=0.3)
  paths.append(f"{path_prefix}_biases.png")
  plotting.save_figure(fig, paths[-1])

  if result.get("injected"):
    fig, ax = plt.subplots(figsize=(8, 4))
    for (label, per), ls in zip(result["injected"].items(), styles):
      for k, (name, kl) in enumerate(per.items()):
        keys = [l for l in kl if l != "all"]
        ax.plot([int(l) for l in keys], [kl[l] for l in keys], ls, color=f"C{k}",
                marker="o", label=f"{name}, {label} (all layers: {kl.get('all', 0):.1e})")
    ax.set_yscale("log")
    ax.set_xlabel("the one layer whose attention runs under the preset")
    ax.set_ylabel("final next-token KL vs float32")
    ax.set_title(f"{title}: which layer's attention error reaches the output")
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    paths.append(f"{path_prefix}_injected.png")
    plotting.save_figure(fig, paths[-1])
  return paths


VARIANTS = ("endoftext", "none")


def _variant_tokens(tokenizer, ids: List[int], length: int, windows: int, variant: str
                    ) -> np.ndarray:
  from attnprec.study import inputs
  bos = tokenizer.encode("", add_bos=True)
  w = inputs.text_windows(ids, length, windows, bos)
  return w if variant == "endoftext" else w[:, len(bos):]


def report(result: dict) -> str:
  """Markdown: per-layer table per variant, and the injected KL table."""
  out = [f"# Attention sinks and key biases: {result['model']}", "",
         f"{result['windows']} window(s) of {result['length']} tokens of stdlib text; "
         f"variants: {', '.join(result['variants'])}.", ""]
  bn = result["bias_norms"]
  for label, res in result["variants"].items():
    presets = list(res["local"])
    out += [f"## {label}", "",
            "| layer | max abs bk | max abs logit | row max | sink logit | largest other | "
            "row mean | sink mass | q.b_k at sink | "
            + " | ".join(f"kernel err {p}" for p in presets)
            + " | kernel err bf16, keys centred | kernel err bf16, key-bias offset"
            " | kernel err bf16, q scaled before rounding |",
            "|---:|" + "---:|" * (11 + len(presets))]
    for i, prof in enumerate(res["profile"]):
      errs = " | ".join(f"{res['local'][p][i]:.2e}" for p in presets)
      cen = res["local_centered"].get("bf16", [float("nan")] * (i + 1))[i]
      pre = res.get("local_prescaled", {}).get("bf16", [float("nan")] * (i + 1))[i]
      off = res.get("local_bias_offset", {}).get("bf16", [float("nan")] * (i + 1))[i]
      out.append(f"| {i} | {bn[i]['max_abs_bk']:.1f} | {prof['max_abs_logit']:.1f} | "
                 f"{prof['median_row_max']:.1f} | {prof['median_sink_logit']:.1f} | "
                 f"{prof['median_other_max']:.1f} | {prof['median_row_mean']:.1f} | "
                 f"{prof['median_sink_mass']:.3f} | {prof['median_sink_bias_logit']:.1f} | "
                 f"{errs} | {cen:.2e} | {off:.2e} | {pre:.2e} |")
    out.append("")
  if result.get("injected"):
    layers = list(next(iter(next(iter(result["injected"].values())).values())))
    out += ["## Final-logit KL when one layer's attention runs under a preset",
            "(everything else float32)", "",
            "| variant | preset | " + " | ".join(f"layer {l}" for l in layers) + " |",
            "|---|---|" + "---:|" * len(layers)]
    for label, per in result["injected"].items():
      for name, kl in per.items():
        out.append(f"| {label} | {name} | " + " | ".join(f"{kl[l]:.2e}" for l in layers)
                   + " |")
  return "\n".join(out)


@gin.configurable("sinks", denylist=["run_dir"])
def sinks_job(*, run_dir: str, model: str = "qwen2.5-coder-0.5b", length: int = 256,
              windows: int = 1, variants: Sequence[str] = VARIANTS,
              presets: Sequence[str] = ("bf16", "fp32_logits", "fp32_qk"),
              inject_presets: Sequence[str] = ("bf16", "fp32_qk"),
              inject_layers: Sequence = ("all", 0, 1, 2, 4, 8, 16)) -> dict:
  """The analysis of the module docstring on `windows` windows of `length` tokens of the
  study's stdlib text, for each first-token variant ('endoftext': the tokenizer's BOS id
  first; 'none': the same text without it); writes sinks.json, report.md and PNGs."""
  from attnprec.study import inputs, models
  from attnprec import presets as preset_lib
  bad = [v for v in variants if v not in VARIANTS]
  if bad or not variants:
    raise UserError(f"Invalid sinks.variants {tuple(variants)!r}; valid values are: "
                    f"{', '.join(map(repr, VARIANTS))}.")
  for name, value, least in (("length", length, 8), ("windows", windows, 1)):
    if not isinstance(value, int) or value < least:
      raise UserError(f"sinks.{name} must be an integer >= {least}, got {value!r}.")
  if bool(inject_presets) != bool(inject_layers):
    (given, value), empty = ((("inject_presets", inject_presets), "inject_layers")
                             if inject_presets else
                             (("inject_layers", inject_layers), "inject_presets"))
    raise UserError(f"sinks.{given} = {tuple(value)!r} is set but sinks.{empty} is "
                    f"empty, so nothing would be injected and the setting would not be "
                    f"used (the injection plot would show nothing measured). Set both, or "
                    f"leave both empty to skip the injection.")
  sweep = preset_lib.load_sweep(tuple(presets), ())
  inject = preset_lib.load_sweep(tuple(inject_presets), ()) if inject_presets else []
  m = models.load_model(model)
  if m.kind != "real" or m.tokenizer is None:
    raise UserError(f"sinks.model must be a real checkpoint with a tokenizer, got {model!r}.")
  cfg = m.config
  layers = []
  for l in inject_layers:
    if l != "all" and not (isinstance(l, int) and not isinstance(l, bool)
                           and 0 <= l < cfg.num_layers):
      raise UserError(f"sinks.inject_layers: {l!r} is not 'all' nor a layer index in "
                      f"0..{cfg.num_layers - 1}.")
    if l in layers:
      raise UserError(f"sinks.inject_layers names {l!r} twice; each is measured once, so "
                      f"name each once.")
    layers.append(l)
  runs.ensure_dir(run_dir)
  ids = m.tokenizer.encode(inputs.stdlib_text(), add_bos=False)
  toks = {v: _variant_tokens(m.tokenizer, ids, length, windows, v) for v in variants}
  bar = tqdm(total=len(toks) * (1 + len(inject)), desc="sinks", unit="pass",
             dynamic_ncols=True)
  with bar:
    bar.set_postfix_str("kernel errors per layer")
    result = analyze(cfg, m.params, toks, sweep, on_variant=bar.update)
    result.update(model=m.description, length=length, windows=windows)
    if inject:
      result["injected"] = {}
      for v, t in toks.items():
        result["injected"][v] = {}
        for name, prec in inject:
          bar.set_postfix_str(f"injected KL, {v}, {name}")
          result["injected"][v][name] = injected_kl(cfg, m.params, t, prec, layers)
          bar.update()
  runs.write_json(run_dir, "sinks.json", result, provenance=True)
  runs.atomic_write(os.path.join(run_dir, "report.md"), report(result) + "\n")
  paths = plot(result, os.path.join(run_dir, "sinks"), model)
  print(report(result))
  print(f"wrote {run_dir}/sinks.json, report.md, " + ", ".join(map(os.path.basename, paths)))
  return result
