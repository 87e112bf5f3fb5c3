"""Captures the TPU fixtures CPU CI tests the readers on (`tests/fixtures/tpu/`).

Run on a TPU machine (`make tpu-fixtures`, after scripts/tpu_install.sh): for the tiny
recall architecture under each preset below it compiles the audit's three programs
(`audit.trace_programs`: train step, prefill, decode step) and writes what the TPU
compiler made of them (`compiled.as_text()`, gzipped), plus jax's own splash attention
and TPU flash_attention compiled on small shapes, attnprec's own flash kernel with both
flags (a prefill and its gradient: `--only=flash` captures just these), and a manifest
(jax version, device, commit). A few hundred kB in all; the readers' tests (tests/test_tpu_fixtures.py) hold
the audit to them on any machine.

  python scripts/capture_tpu_fixtures.py [--out=tests/fixtures/tpu]
"""
import argparse
import gzip
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from attnprec.xla_env import disable_excess_precision  # noqa: E402

disable_excess_precision()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from attnprec import audit, runs  # noqa: E402
from attnprec.config import ModelConfig  # noqa: E402
from attnprec.precision import Precision  # noqa: E402

# The tiny recall architecture (gin/models/recall_tiny.gin), as the audit's defaults.
CONFIG = ModelConfig(vocab_size=98, d_model=64, num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=32, mlp_hidden=256, max_seq_len=512)
SAFE = Precision(dtype="bfloat16")
# name -> (decode precision, phases captured); the train step runs the safe preset where
# the decode precision's kernel has no gradient ('pallas').
PRESETS = {
    "fp32_attention": (SAFE, ("train", "prefill", "decode")),
    "bf16": (Precision(dtype="bfloat16", float32_qk_product=False, float32_logits=False),
             ("train", "prefill", "decode")),
    "fp32": (Precision(dtype="float32"), ("prefill", "decode")),
    "highest": (Precision(dtype="float32", einsum_precision="highest",
                          matmul_precision="highest"), ("prefill", "decode")),
    "blockwise": (Precision(dtype="bfloat16", kernel="blockwise"), ("prefill", "decode")),
    "pallas": (Precision(dtype="bfloat16", kernel="pallas"), ("prefill", "decode")),
    "pallas_bf16": (Precision(dtype="bfloat16", kernel="pallas", float32_qk_product=False,
                              float32_logits=False), ("prefill",)),
}


def write(out: str, name: str, text: str) -> None:
  """name.gz in out, written atomically (a stopped capture leaves no truncated fixture)."""
  runs.atomic_write(os.path.join(out, name + ".gz"), gzip.compress(text.encode(), mtime=0),
                    mode="wb")


def jax_kernels(out: str) -> None:
  """jax's splash attention and TPU flash_attention on small causal shapes."""
  from jax.experimental.pallas.ops.tpu import flash_attention as fa
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as sk, splash_attention_mask as sm)
  T, H = 512, 128
  kernel = sk.make_splash_mha(sm.MultiHeadMask([sm.CausalMask((T, T))] * 4),
                              head_shards=1, q_seq_shards=1)
  x = jnp.ones((4, T, H), jnp.bfloat16)
  write(out, "jax_splash_attention.hlo.txt", jax.jit(kernel).lower(x, x, x).compile().as_text())
  y = jnp.ones((1, 2, T, H), jnp.bfloat16)
  flash = jax.jit(lambda a, b, c: fa.flash_attention(a, b, c, causal=True))
  write(out, "jax_flash_attention.hlo.txt", flash.lower(y, y, y).compile().as_text())
  # ragged paged attention lowers only on a TPU (its Mosaic lowering asks the device kind)
  from attnprec.inspect import examples
  args, _ = examples.ragged_paged_inputs()
  write(out, "jax_ragged_paged_attention.hlo.txt",
        jax.jit(examples.ragged_paged_attention).lower(*args).compile().as_text())


FLASH_SHAPE = dict(B=1, T=512, N=4, K=2, H=128)


def flash_kernel(out: str) -> dict:
  """attnprec's 'flash' kernel, both flags, a 128-wide head (read where the caller holds
  it: `flash.direct_geometries`): a causal prefill and its gradient."""
  from attnprec.contract import AttentionFlags
  from attnprec.kernels import flash
  sh = FLASH_SHAPE
  q = jnp.ones((sh["B"], sh["T"], sh["N"], sh["H"]), jnp.bfloat16)
  kv = jnp.ones((sh["B"], sh["T"], sh["K"], sh["H"]), jnp.bfloat16)
  f = lambda q, k, v: flash.flash_attention(q, k, v, causal=True, flags=AttentionFlags())  # noqa: E731
  g = jax.grad(lambda *x: f(*x).astype(jnp.float32).sum(), argnums=(0, 1, 2))
  for phase, fn in (("prefill", f), ("train", g)):
    write(out, f"flash_direct-{phase}.hlo.txt", jax.jit(fn).lower(q, kv, kv).compile().as_text())
    print(f"flash_direct {phase}", flush=True)
  return dict(sh, flags="fp32_attention (both)", blocks=flash.DEFAULT_BLOCKS.describe(),
              source=runs.code_identity()["source"])


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--out", default=os.path.join("tests", "fixtures", "tpu"))
  parser.add_argument("--only", choices=["flash"], default=None,
                      help="capture only attnprec's flash kernel (flash_direct-*), "
                      "recorded under 'flash_direct' in the existing manifest")
  args = parser.parse_args(argv)
  if jax.default_backend() != "tpu":
    print(f"capture_tpu_fixtures: needs a TPU (this backend: {jax.default_backend()}); "
          f"nothing written.", file=sys.stderr)
    return 2
  os.makedirs(args.out, exist_ok=True)
  path = os.path.join(args.out, "manifest.json")
  if args.only == "flash":
    with open(path, encoding="utf-8") as f:
      manifest = json.load(f)
    manifest["flash_direct"] = dict(flash_kernel(args.out), jax=jax.__version__,
                                    device=jax.devices()[0].device_kind)
    runs.atomic_write(path, json.dumps(manifest, indent=1, default=str) + "\n")
    print(f"wrote {args.out}")
    return 0
  for name, (decode, phases) in PRESETS.items():
    train = SAFE if decode.kernel == "pallas" else decode
    traced = audit.trace_programs(CONFIG, train, decode, batch=2, prompt_len=8,
                                  new_tokens=8, platform="tpu")
    for phase in phases:
      write(args.out, f"{name}-{phase}.hlo.txt", traced[phase][1].lower().compile().as_text())
      print(f"{name} {phase}", flush=True)
  jax_kernels(args.out)
  flash_direct = dict(flash_kernel(args.out), jax=jax.__version__,
                      device=jax.devices()[0].device_kind)
  manifest = {"jax": jax.__version__, "device": jax.devices()[0].device_kind,
              "platform_version": getattr(jax.devices()[0].client, "platform_version", ""),
              "config": runs.config_dict(CONFIG), "batch": 2, "prompt_len": 8,
              "new_tokens": 8, "presets": {n: list(p) for n, (_, p) in PRESETS.items()},
              "commit": os.environ.get("ATTNPREC_COMMIT") or runs.code_version(),
              "flash_direct": flash_direct}
  runs.atomic_write(path,
                    json.dumps(manifest, indent=1, default=str) + "\n")
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
