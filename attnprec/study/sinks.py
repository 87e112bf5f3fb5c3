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
    the attention mass on key 0; the share of the sink's logit that is q . b_k;
  * the kernel's own error (`local_rel_l2`): the attention output of each precision preset
    from the same bf16 q, k, v against float64 attention of those inputs; error that
    enters in this layer, not error carried from earlier layers;
  * the same with the keys centred (k - mean_s k_s per sequence and kv head): every logit
    of a query moves by the same amount, so the attention function is unchanged in exact
    arithmetic; if the error disappears, it came from the shared offset's magnitude;
  * the bias norms of the layer (max |b| of q, k, v).
Shapes: B batch, T tokens, N/K/G heads, kv heads, heads per kv head, H head dim.
"""
import dataclasses
from typing import Dict, List, NamedTuple, Sequence

import jax.numpy as jnp
import numpy as np

from attnprec import contract, kernels
from attnprec.config import ModelConfig
from attnprec.precision import Precision
from attnprec.study.float64 import _act, _rms_norm, _rope


class LayerInputs(NamedTuple):
  q_BxTxNxH: np.ndarray      # after RoPE
  k_BxTxKxH: np.ndarray      # after RoPE
  v_BxTxKxH: np.ndarray
  kb_BxTxKxH: np.ndarray     # RoPE(b_k) at each position: the bias's part of k (0 if none)


def capture(config: ModelConfig, params, tokens_BxT, dtype=np.float32) -> List[LayerInputs]:
  """Per layer, the attention kernel's inputs (see `LayerInputs`), positions 0..T-1."""
  cfg = config
  tokens_BxT = np.asarray(tokens_BxT)
  B, T = tokens_BxT.shape
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  p = lambda module, name: np.asarray(params[module][name], dtype)   # noqa: E731
  pos_BxT = np.broadcast_to(np.arange(T), (B, T))
  x = p("decoder/embed", "embeddings")[tokens_BxT]
  if cfg.embed_scale:
    x = x * dtype(np.sqrt(cfg.d_model))
  norm = lambda y, module: _rms_norm(y, p(module, "scale"), cfg.norm_eps,   # noqa: E731
                                     cfg.norm_plus_one).astype(dtype)
  out = []
  for i in range(cfg.num_layers):
    pre = f"decoder/layer_{i}"
    h = norm(x, f"{pre}/pre_attn_norm")
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
    if "k_offset" in params.get(f"{pre}/attn/kernel", {}):  # the study's key bias (probes.py)
      k = k + p(f"{pre}/attn/kernel", "k_offset")
    v = proj["v"]
    out.append(LayerInputs(q, k, v, kb))
    allowed = pos_BxT[:, None, None, :] <= pos_BxT[:, None, :, None]
    window = cfg.window(i)
    if window is not None:
      allowed = allowed & (pos_BxT[:, None, None, :] > pos_BxT[:, None, :, None] - window)
    a = contract.reference_attention_np(q, k, v, mask=allowed, scale=cfg.query_scale,
                                        logits_soft_cap=cfg.attn_logit_soft_cap)
    hh = a.astype(dtype).reshape(B, T, N * H) @ p(f"{pre}/attn/o", "w")
    if cfg.post_attn_norm:
      hh = norm(hh, f"{pre}/post_attn_norm")
    x = x + hh
    hh = norm(x, f"{pre}/pre_mlp_norm")
    g = hh @ p(f"{pre}/mlp/gate", "w")
    hh = (_act(g, cfg.activation).astype(dtype) * (hh @ p(f"{pre}/mlp/up", "w"))) \
        @ p(f"{pre}/mlp/down", "w")
    if cfg.post_mlp_norm:
      hh = norm(hh, f"{pre}/post_mlp_norm")
    x = x + hh
  return out


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
          "median_sink_bias_logit": float(np.median(bias)),
          "bf16_spacing_at_row_max": float(np.median(
              2.0 ** (np.floor(np.log2(np.abs(Lm[:, :, rows].max(-1)) + 1e-30)) - 7)))}


def local_error(cfg: ModelConfig, layer: LayerInputs, precision: Precision,
                center_keys: bool = False) -> float:
  """Relative L2 error of the kernel under `precision` on this layer's inputs (rounded to
  the compute dtype) against float64 attention of the same rounded inputs."""
  c = contract.parse_dtype(precision.dtype)
  k = np.asarray(layer.k_BxTxKxH, np.float32)
  if center_keys:
    k = k - k.mean(axis=1, keepdims=True)
  q_, k_, v_ = (jnp.asarray(np.asarray(a, np.float32), c)
                for a in (layer.q_BxTxNxH, k, layer.v_BxTxKxH))
  T = q_.shape[1]
  mask = np.tril(np.ones((T, T), bool))[None, None]
  out = np.asarray(kernels.attend(precision, q_, k_, v_, mask=jnp.asarray(mask),
                                  scale=cfg.query_scale), np.float64)
  ref = contract.reference_attention_np(*(np.asarray(a, np.float64) for a in (q_, k_, v_)),
                                        mask=mask, scale=cfg.query_scale)
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


def analyze(cfg: ModelConfig, params, variants: Dict[str, np.ndarray],
            presets: Sequence) -> dict:
  """{variant: {"profile": [per layer], "local": {preset: [per layer]}, "local_centered":
  {preset: [per layer]}}, "bias_norms": [per layer]} for each token array in `variants`
  (e.g. the windows with and without their first token). presets: [(name, Precision)]."""
  out = {"bias_norms": bias_norms(cfg, params), "variants": {}}
  for label, tokens in variants.items():
    layers = capture(cfg, params, tokens)
    res = {"tokens": list(np.asarray(tokens).shape), "profile": [], "local": {},
           "local_centered": {}}
    for layer in layers:
      res["profile"].append(logit_profile(cfg, layer))
    for name, prec in presets:
      res["local"][name] = [local_error(cfg, l, prec) for l in layers]
      res["local_centered"][name] = [local_error(cfg, l, prec, center_keys=True)
                                     for l in layers]
    out["variants"][label] = res
  return out


def plot(result: dict, path_prefix: str, title: str = "") -> List[str]:
  """Three PNGs: logit magnitudes, local kernel error, bias norms. Returns the paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
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
  fig.tight_layout()
  paths.append(f"{path_prefix}_logits.png")
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)

  fig, ax = plt.subplots(figsize=(8, 4.5))
  for (label, res), ls in zip(variants.items(), styles):
    for k, (name, errs) in enumerate(res["local"].items()):
      ax.plot(np.arange(len(errs)), errs, ls, color=f"C{k}", marker=".",
              label=f"{name}, {label}")
    for k, (name, errs) in enumerate(res["local_centered"].items()):
      if name == "bf16":
        ax.plot(np.arange(len(errs)), errs, ls, color="C7", marker="x",
                label=f"{name}, keys centred, {label}")
  ax.set_yscale("log")
  ax.set_xlabel("layer")
  ax.set_ylabel("attention output rel. L2 error of the kernel alone")
  ax.set_title(f"{title}: error entering at each layer (same inputs, vs float64)")
  ax.legend(fontsize=6, ncol=2)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  paths.append(f"{path_prefix}_local_error.png")
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)

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
  fig.tight_layout()
  paths.append(f"{path_prefix}_biases.png")
  fig.savefig(paths[-1], dpi=120)
  plt.close(fig)
  return paths
