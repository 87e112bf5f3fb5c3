"""docs/precision.md's KV-cache table, made again as a record: SmolLM2-135M (the shipped
checkpoint), the first 256 tokens of the standard library's `json/decoder.py` (its source
file, as this Python ships it), one prefill through a cache of each storage; the logits
at every position against those through the compute-dtype cache of the same compute
dtype (prefill attends to the cache it writes, so this is also the prefill's difference
between exact and quantized keys and values).

  python3 results/kv-cache/kv_cache_table.py [OUT_DIR]      # default: results/kv-cache

Per row: NLL (mean next-token negative log-likelihood over the 255 predicted tokens), KL
mean and max over the 256 positions (KL(p_compute || p_row), nats, float64 from the
float32 logits), argmax agreement with the compute cache's logits, and the cache's bytes
(`cache.cache_bytes`: codes or values and their scales). bf16 rows run both flags
(`gin/precision/kv_int8.gin`'s precision); float32 rows the float32 model.
Writes OUT_DIR/kv_cache.json (with provenance) and kv_cache.md."""
import json
import os
import sys

from attnprec.xla_env import disable_excess_precision

disable_excess_precision()   # before jax is imported, as every runner (attnprec/xla_env.py)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from scipy.special import log_softmax  # noqa: E402

from attnprec import cache as cache_lib  # noqa: E402
from attnprec import checkpoints, runs, xla_env  # noqa: E402
from attnprec import model as model_lib  # noqa: E402
from attnprec.precision import Precision  # noqa: E402

TOKENS = 256
BF16 = dict(dtype="bfloat16", float32_qk_product=True, float32_logits=True)
F32 = dict(dtype="float32")
# (label, compute, the cache's precision fields)
ROWS = [
    ("compute", "bf16", {}),
    ("int8, token", "bf16", dict(kv_cache_k_dtype="int8", kv_cache_v_dtype="int8",
                                 kv_cache_k_scale="token", kv_cache_v_scale="token")),
    ("int8, channel keys", "bf16", dict(kv_cache_k_dtype="int8", kv_cache_v_dtype="int8",
                                        kv_cache_k_scale="channel", kv_cache_v_scale="token")),
    ("fp8 e4m3", "bf16", dict(kv_cache_k_dtype="float8_e4m3fn",
                              kv_cache_v_dtype="float8_e4m3fn",
                              kv_cache_k_scale="token", kv_cache_v_scale="token")),
    ("fp8 e5m2", "bf16", dict(kv_cache_k_dtype="float8_e5m2", kv_cache_v_dtype="float8_e5m2",
                              kv_cache_k_scale="token", kv_cache_v_scale="token")),
    ("compute", "f32", {}),
    ("bfloat16", "f32", dict(kv_cache_k_dtype="bfloat16", kv_cache_v_dtype="bfloat16")),
    ("int8, token", "f32", dict(kv_cache_k_dtype="int8", kv_cache_v_dtype="int8",
                                kv_cache_k_scale="token", kv_cache_v_scale="token")),
    ("fp8 e4m3", "f32", dict(kv_cache_k_dtype="float8_e4m3fn",
                             kv_cache_v_dtype="float8_e4m3fn",
                             kv_cache_k_scale="token", kv_cache_v_scale="token")),
]


def text() -> str:
  import json.decoder
  with open(json.decoder.__file__, encoding="utf-8") as f:
    return f.read()


def prefill_logits(config, params, tokens_1xT, prec: Precision) -> np.ndarray:
  """[T, V] float64 logits of one prefill of `tokens_1xT` through an empty cache of
  `prec`'s storage (every position's logits, the cache written first)."""
  apply = model_lib.transformed(config).apply
  T = tokens_1xT.shape[1]

  @jax.jit
  def run(params, tokens):
    cache = cache_lib.init_cache(config, 1, T, prec.compute_dtype, prec.cache_storage)
    return apply(params, tokens, None, cache, precision=prec).logits

  out = np.asarray(run(params, tokens_1xT), np.float64)[0]
  if not np.isfinite(out).all():
    raise SystemExit(f"non-finite logits under {prec.describe()}")
  return out


def main(out_dir: str) -> None:
  print(xla_env.describe(), flush=True)
  ckpt = checkpoints.load("smollm2-135m")
  ids = ckpt.tokenizer.encode(text())[:TOKENS]
  assert len(ids) == TOKENS, len(ids)
  tokens = jnp.asarray([ids], jnp.int32)
  rows, reference = [], {}
  for label, compute, fields in ROWS:
    prec = Precision(**(BF16 if compute == "bf16" else F32), **fields)
    lp = log_softmax(prefill_logits(ckpt.config, ckpt.params, tokens, prec), axis=-1)
    nll = float(-lp[np.arange(TOKENS - 1), ids[1:]].mean())
    row = {"cache": label, "compute": compute, "precision": prec.describe(), "nll": nll,
           "bytes": cache_lib.cache_bytes(ckpt.config, 1, TOKENS, prec.compute_dtype,
                                          prec.cache_storage)}
    if label == "compute":
      reference[compute] = lp
    else:
      ref = reference[compute]
      kl = (np.exp(ref) * (ref - lp)).sum(-1)
      row.update(kl_mean=float(kl.mean()), kl_max=float(kl.max()),
                 argmax_agree=float((ref.argmax(-1) == lp.argmax(-1)).mean()))
    rows.append(row)
    print(f"{label:20s} {compute:5s} NLL {nll:.4f}  "
          + (f"KL {row['kl_mean']:.2e} / {row['kl_max']:.3g}  agree "
             f"{100 * row['argmax_agree']:.1f}%" if "kl_mean" in row else "reference"),
          flush=True)
  result = {"model": "smollm2-135m", "text": "json/decoder.py (the first 256 tokens)",
            "tokens": TOKENS, "rows": rows}
  runs.write_json(out_dir, "kv_cache.json", result, provenance=True)
  runs.atomic_write(os.path.join(out_dir, "kv_cache.md"), to_markdown(result) + "\n")


def to_markdown(result: dict) -> str:
  lines = ["| cache | compute | NLL | KL mean | KL max | argmax agree | bytes |",
           "|---|---|---:|---:|---:|---:|---:|"]
  for r in result["rows"]:
    if "kl_mean" in r:
      kl = (f"{r['kl_mean']:.1e} | {r['kl_max']:.2g} | "
            f"{100 * r['argmax_agree']:.1f}%")
    else:
      kl = "– | – | –"
    lines.append(f"| {r['cache']} | {r['compute']} | {r['nll']:.4f} | {kl} | "
                 f"{r['bytes'] / 1e6:.3g} MB |")
  return "\n".join(lines)


if __name__ == "__main__":
  if len(sys.argv) > 2:
    print(f"kv_cache_table.py takes one argument, the output folder; got {sys.argv[1:]!r}. "
          f"Usage: python3 results/kv-cache/kv_cache_table.py [OUT_DIR]", file=sys.stderr)
    sys.exit(2)
  main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
