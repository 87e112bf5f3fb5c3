"""Large attention logits without changing the model: a key bias after RoPE.

With a bias b added to every key after RoPE (param `attn/kernel/k_offset` [K, H], which the study
injects into the params and applies from outside the model: `attnprec.study.probes`),
all of a query's logits move by scale * q.b. The softmax ignores a per-query constant, so in
exact arithmetic the model computes the same function; but a bfloat16 QK product rounds
each logit at the shifted magnitude (spacing 0.5 in [64, 128), 1 in [128, 256)), which a
float32 QK product does not. Learned key biases (Qwen2 has q/k/v biases) give such offsets
when they line up with the queries; `study.logit_offset` emulates them on any model.

`add_key_offsets` points b, per layer and kv head, along the mean direction of that group's
queries after RoPE (measured on the given tokens under the fp32/HIGHEST reference), with
the norm that makes the mean per-query offset equal to the requested one. The queries of
trained models share a large common direction (SmolLM2's: |mean q| / mean |q| 0.61-0.94), so
the offset is a coherent sum over the head dimension, as a large learned bias would be.

Shapes: B batch, T tokens, N/K/G heads, kv heads, heads per kv head, H head dim, R rows.
"""
import jax
import numpy as np

from attnprec import model as model_lib
from attnprec.config import ModelConfig
from attnprec.errors import UserError
from attnprec.precision import REFERENCE
from attnprec.study import probes


def _with_zero_offsets(config: ModelConfig, params) -> dict:
  K, H = config.num_kv_heads, config.head_dim
  out = dict(params)
  for i in range(config.num_layers):
    module = probes.offset_module(i)
    out[module] = {**params.get(module, {}), probes.OFFSET: np.zeros((K, H), np.float32)}
  return out


def _rows_by_kv_head(config: ModelConfig, q_BxTxNxH) -> np.ndarray:
  """[K, R, H] float64: every query row (position, batch entry, head) that reads kv head k
  (query head n reads kv head n // G)."""
  K, H = config.num_kv_heads, config.head_dim
  G = config.num_heads // K
  q_RxKxGxH = np.asarray(q_BxTxNxH, np.float64).reshape(-1, K, G, H)
  return q_RxKxGxH.transpose(1, 0, 2, 3).reshape(K, -1, H)


def offset_stats(config: ModelConfig, queries, params) -> list:
  """Per layer: the per-query logit offsets scale * q.b (over every query row and head),
  as {"mean", "p10", "p90", "max_abs"}. queries: per layer [B, T, N, H] after RoPE."""
  stats = []
  for i, q_BxTxNxH in enumerate(queries):
    b_KxH = np.asarray(params[probes.offset_module(i)][probes.OFFSET], np.float64)
    q_KxRxH = _rows_by_kv_head(config, q_BxTxNxH)
    off = config.effective_query_scale * np.einsum("krh,kh->kr", q_KxRxH, b_KxH).reshape(-1)
    stats.append({"mean": float(off.mean()), "p10": float(np.percentile(off, 10)),
                  "p90": float(np.percentile(off, 90)), "max_abs": float(np.abs(off).max())})
  return stats


def queries(config: ModelConfig, params, tokens_BxT, precision=REFERENCE) -> list:
  """Per layer [B, T, N, H]: the queries after RoPE of a full forward pass."""
  apply = model_lib.transformed(config).apply

  def fn(p, t):
    with probes.attached(p) as rec:
      apply(p, t, precision=precision)
    return rec.queries

  return jax.jit(fn)(params, np.asarray(tokens_BxT, np.int32))


def check_offsets(config: ModelConfig, params, source: str = "the params") -> None:
  """Raises UserError unless every layer of `params` carries its attn/k_offset [K, H]."""
  want = (config.num_kv_heads, config.head_dim)
  problems = []
  for i in range(config.num_layers):
    module = probes.offset_module(i)
    got = params.get(module, {}).get(probes.OFFSET)
    if got is None:
      problems.append(f"{module}/{probes.OFFSET} missing (expected shape {want})")
    elif tuple(np.shape(got)) != want:
      problems.append(f"{module}/{probes.OFFSET} has shape "
                      f"{tuple(np.shape(got))}, expected {want}")
  if problems:
    raise UserError(f"Key offsets in {source} do not match the architecture: "
                    f"{'; '.join(problems)}.")


def add_key_offsets(config: ModelConfig, params, tokens_BxT, logit_offset: float):
  """(params with attn/k_offset set in every layer, per-layer offset stats on tokens_BxT).
  The mean offset scale * q.b is `logit_offset` in every layer and kv head."""
  if not logit_offset > 0:
    raise UserError(f"The logit offset must be > 0, got {logit_offset!r}.")
  cfg = config
  new = _with_zero_offsets(cfg, params)
  queries_ = queries(cfg, new, tokens_BxT)
  for i, q_BxTxNxH in enumerate(queries_):
    mean_KxH = _rows_by_kv_head(cfg, q_BxTxNxH).mean(axis=1)
    # mean of scale * q.b with b = c * mean is scale * c * |mean|^2
    norm2_K = np.sum(mean_KxH ** 2, axis=-1)
    if np.any(norm2_K == 0):
      raise UserError(f"Layer {i}: the queries average to zero, so no key bias direction "
                      f"gives them a common logit offset; use other calibration tokens.")
    per_unit_KxH = mean_KxH / (cfg.effective_query_scale * norm2_K)[:, None]
    with np.errstate(over="ignore", invalid="ignore"):
      b_KxH = (per_unit_KxH * logit_offset).astype(np.float32)
    if not np.all(np.isfinite(b_KxH)):
      largest = float(np.finfo(np.float32).max / np.max(np.abs(per_unit_KxH)))
      raise UserError(f"study.logit_offset = {logit_offset!r} needs a key bias beyond "
                      f"float32's range in layer {i} (its queries' mean is small: a bias of "
                      f"{np.max(np.abs(per_unit_KxH)):.3g} per unit of offset); valid: "
                      f"offsets up to {largest:.3g} for this model and text, and in "
                      f"practice far less (logits of that size saturate every softmax).")
    new[probes.offset_module(i)][probes.OFFSET] = b_KxH
  return new, offset_stats(cfg, queries_, new)
