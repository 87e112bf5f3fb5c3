"""Where the flash kernel's time goes beside splash's, read from the chip: for each case,
each row of `bench --suite=tpu_attention` (the 'flash' kernel with both flags at the
given blocks, jax's splash at its blocks) compiled and called once, then one more call
under `jax.profiler`, the device's op times summed by op name
(`attnprec.bench.device_profile.device_ops`): the Pallas kernels against the layout and
bounds ops around them.

  python3 results/tpu-flash/profile_ops.py OUT_DIR [CASE ...]

CASE: prefill:S or train:S (default prefill:2048 prefill:8192 train:2048); the blocks of
the flash rows and splash's from the environment: FLASH_BLOCKS (default 1024/1024/512),
SPLASH_BLOCKS (default 512/512,1024/1024); the inputs' form from INPUTS ('projection',
the default, or 'heads': `tpu_attention._inputs`). Qwen2-7B's attention shape. Writes
OUT_DIR/profile_ops.json (with provenance; rewritten after every case, atomically). A
malformed case or block, a machine without a TPU, or a row with a non-finite output is
refused in one line (exit 2)."""
import os
import sys
import time

from attnprec.xla_env import disable_excess_precision

disable_excess_precision()   # before jax is imported, as every runner (attnprec/xla_env.py)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from attnprec import runs  # noqa: E402
from attnprec.bench import tpu_attention  # noqa: E402
from attnprec.bench.device_profile import device_ops  # noqa: E402

SHAPE = "qwen2-7b"


def _refuse(message):
  print(f"profile_ops: {message}", file=sys.stderr)
  sys.exit(2)


def _blocks(name, default, sizes):
  """FLASH_BLOCKS / SPLASH_BLOCKS: Q/KV(/CHUNK) items, Q a multiple of 16, the rest of
  128; anything else refused by name (exit 2) before jax starts."""
  text = os.environ.get(name, default)
  try:
    out = [tuple(int(x) for x in item.split("/")) for item in text.split(",") if item]
  except ValueError:
    out = []
  if not out or any(len(b) not in sizes or b[0] <= 0 or b[0] % 16
                    or any(x <= 0 or x % 128 for x in b[1:]) for b in out):
    _refuse(f"{name}={text!r} is not a list of {' or '.join(f'{n}-part' for n in sizes)} "
            f"blocks Q/KV{'/CHUNK' if 3 in sizes else ''} with Q a positive multiple of 16 "
            f"and the rest of 128, e.g. {default}.")
  return out


def _cases(items):
  cases = []
  for item in items:
    mode, _, length = item.partition(":")
    if mode not in ("prefill", "train") or not length.isdigit() or int(length) % 128 \
        or int(length) <= 0:
      _refuse(f"case {item!r} is not prefill:S or train:S with S a positive multiple of "
              f"128 (e.g. prefill:2048 train:8192).")
    cases.append((mode, int(length)))
  return cases


def main(out_dir, cases, flash_blocks, splash_blocks, inputs="projection"):
  if jax.default_backend() != "tpu":
    _refuse(f"reads the op times of a TPU's device plane; this backend is "
            f"{jax.default_backend()!r} (its Pallas kernels would run interpreted and "
            f"record no device ops). Run it on a TPU (docs/tpu.md).")
  if inputs not in tpu_attention.INPUT_FORMS:
    _refuse(f"INPUTS={inputs!r} is not one of {tpu_attention.INPUT_FORMS}.")
  result = {"shape": SHAPE, "flash_blocks": flash_blocks, "splash_blocks": splash_blocks,
            "inputs": inputs,
            "device": str(jax.devices()[0].device_kind), "cases": {}}
  for mode, S in cases:
    case = f"{mode}:{S}"
    fns = tpu_attention.rows_for(SHAPE, S, mode == "train", ["flash"], ["both"],
                                 flash_blocks, splash_blocks)
    qkv = tpu_attention._inputs(SHAPE, S, form=inputs)
    rows = {}
    for name, fn in fns.items():
      xs = tpu_attention.prepare(name, tpu_attention.SHAPES[SHAPE][2], qkv)
      out = jax.block_until_ready(fn(*xs))
      if not all(bool(jnp.isfinite(x).all()) for x in jax.tree_util.tree_leaves(out)):
        _refuse(f"{case} {name}: a non-finite output; its op times would describe a "
                f"broken run, so nothing more is written.")
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*xs))
      wall_ms = 1e3 * (time.perf_counter() - t0)
      ops = device_ops(lambda: jax.block_until_ready(fn(*xs)))
      rows[name] = {"wall_ms": wall_ms,
                    "device_us": sum(t for t, _ in ops.values()),
                    "ops": {k: {"us": t, "count": n} for k, (t, n) in ops.items()}}
      print(f"{case} {name:28s} wall {wall_ms:8.3f} ms  device ops "
            f"{rows[name]['device_us'] / 1e3:8.3f} ms", flush=True)
      for k, (t, n) in list(ops.items())[:8]:
        print(f"    {t / 1e3:8.3f} ms x{n:<4d} {k}", flush=True)
    result["cases"][case] = rows
    runs.write_json(out_dir, "profile_ops.json", result, provenance=True)


if __name__ == "__main__":
  if len(sys.argv) < 2:
    sys.exit(__doc__)
  main(sys.argv[1], _cases(sys.argv[2:] or ["prefill:2048", "prefill:8192", "train:2048"]),
       _blocks("FLASH_BLOCKS", "1024/1024/512", (2, 3)),
       _blocks("SPLASH_BLOCKS", "512/512,1024/1024", (2,)),
       os.environ.get("INPUTS", "projection"))
