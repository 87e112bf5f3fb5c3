"""An independent float64 NumPy forward pass of `attnprec.model` (no JAX): the study's
error floor. Given the same params it returns the logits and each layer's attention
kernel output, like the model with the study's probes attached (`attnprec.study.probes`).

Shapes: B batch, T tokens, D width, N/K/H heads, kv heads, head dim, V vocabulary.
"""
import numpy as np

from attnprec.contract import reference_attention_np
from attnprec import layout
from attnprec.config import ModelConfig


def _p(params, key, layer=None):
  """The parameter `key` of the layout table (`attnprec.layout`), in float64."""
  return np.asarray(layout.get(params, key, layer), np.float64)


def _rms_norm(x, scale, eps, plus_one):
  y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
  return y * (1.0 + scale if plus_one else scale)


def _rope(x_BxTxNxH, positions_BxT, base, scale):
  H = x_BxTxNxH.shape[-1]
  inv_freq = 1.0 / (base ** (np.arange(0, H, 2, dtype=np.float64) / H))
  angles = (positions_BxT.astype(np.float64) / scale)[..., None] * inv_freq
  sin, cos = np.sin(angles)[:, :, None, :], np.cos(angles)[:, :, None, :]
  x1, x2 = x_BxTxNxH[..., : H // 2], x_BxTxNxH[..., H // 2:]
  return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _gelu_tanh(x):
  return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))


def _act(x, kind):
  if kind == "silu":
    return x / (1 + np.exp(-x))
  if kind == "gelu_tanh":
    return _gelu_tanh(x)
  from math import erf
  return 0.5 * x * (1 + np.vectorize(erf)(x / np.sqrt(2)))


def logit_stats(q_BxTxNxH, k_BxTxKxH, allowed_Bx1xTxS, scale, soft_cap) -> dict:
  """Magnitudes of one layer's attention logits over the visible keys: the largest
  |logit|, and per (query, head) row the median of its largest logit and of its spread
  (largest minus median). bf16 rounds a logit in [16, 32) to a multiple of 0.125."""
  B, T, N, H = q_BxTxNxH.shape
  G = N // k_BxTxKxH.shape[2]
  k = np.repeat(k_BxTxKxH, G, axis=2)
  logits = np.einsum("btnh,bsnh->bnts", q_BxTxNxH * scale, k)
  if soft_cap is not None:
    logits = soft_cap * np.tanh(logits / soft_cap)
  visible = np.broadcast_to(allowed_Bx1xTxS, logits.shape)
  big = np.where(visible, np.abs(logits), 0.0).max()
  row_max = np.where(visible, logits, -np.inf).max(-1)
  row_med = np.array([np.median(r[v]) for r, v in zip(logits.reshape(-1, logits.shape[-1]),
                                                       visible.reshape(-1, visible.shape[-1]))])
  return {"max_abs_logit": float(big), "median_row_max": float(np.median(row_max)),
          "median_row_spread": float(np.median(row_max.reshape(-1) - row_med))}


def forward(config: ModelConfig, params, tokens_BxT, stats=None):
  """(logits_BxTxV float64, [attn_BxTxNxH float64 per layer]) at positions 0..T-1.

  stats: if a list, one `logit_stats` dict per layer is appended to it."""
  cfg = config
  tokens_BxT = np.asarray(tokens_BxT)
  B, T = tokens_BxT.shape
  N, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
  pos_BxT = np.broadcast_to(np.arange(T), (B, T))
  embed_VxD = _p(params, "embed/embeddings")
  x = embed_VxD[tokens_BxT]
  if cfg.embed_scale:
    x = x * np.sqrt(cfg.d_model)
  norm = lambda y, key, layer=None: _rms_norm(y, _p(params, f"{key}/scale", layer),
                                              cfg.norm_eps, cfg.norm_plus_one)
  attn_outs = []
  for i in range(cfg.num_layers):
    h = norm(x, "pre_attn_norm", i)

    def dense(y, name):
      out = y @ _p(params, f"attn/{name}/w", i)
      if cfg.qkv_bias and name in "qkv":
        out = out + _p(params, f"attn/{name}/b", i)
      return out

    q = dense(h, "q").reshape(B, T, N, H)
    k = dense(h, "k").reshape(B, T, K, H)
    v = dense(h, "v").reshape(B, T, K, H)
    if cfg.qk_norm:
      q = norm(q, "attn/q_norm", i)
      k = norm(k, "attn/k_norm", i)
    base, scale = cfg.rope(i)
    q, k = _rope(q, pos_BxT, base, scale), _rope(k, pos_BxT, base, scale)
    offset = params.get(f"decoder/layer_{i}/attn/kernel", {}).get("k_offset")
    if offset is not None:                 # the study's key bias (attnprec/study/probes.py)
      k = k + np.asarray(offset, np.float64)
    allowed = pos_BxT[:, None, None, :] <= pos_BxT[:, None, :, None]       # [B, 1, T, S]
    window = cfg.window(i)
    if window is not None:
      allowed &= pos_BxT[:, None, None, :] > pos_BxT[:, None, :, None] - window
    if stats is not None:
      stats.append(logit_stats(q, k, allowed, cfg.effective_query_scale,
                               cfg.attn_logit_soft_cap))
    a = reference_attention_np(q, k, v, mask=allowed, logits_soft_cap=cfg.attn_logit_soft_cap,
                               scale=cfg.query_scale)
    attn_outs.append(a)
    h = a.reshape(B, T, N * H) @ _p(params, "attn/o/w", i)
    if cfg.post_attn_norm:
      h = norm(h, "post_attn_norm", i)
    x = x + h
    h = norm(x, "pre_mlp_norm", i)
    gate = h @ _p(params, "mlp/gate/w", i)
    up = h @ _p(params, "mlp/up/w", i)
    h = (_act(gate, cfg.activation) * up) @ _p(params, "mlp/down/w", i)
    if cfg.post_mlp_norm:
      h = norm(h, "post_mlp_norm", i)
    x = x + h
  x = norm(x, "final_norm")
  w_DxV = embed_VxD.T if cfg.tie_embeddings else _p(params, "unembed/w")
  logits = x @ w_DxV
  if cfg.final_logit_soft_cap is not None:
    logits = cfg.final_logit_soft_cap * np.tanh(logits / cfg.final_logit_soft_cap)
  return logits, attn_outs
