"""Where the flash kernel's time goes beside splash's, read from the chip: for each case,
each row of `bench --suite=tpu_attention` (the 'flash' kernel with both flags at the
given blocks, jax's splash at its blocks) compiled and called once, then one more call
under `jax.profiler`, the device's op times summed by op name
(`attnprec.bench.device_profile.device_ops`): the Pallas kernels against the layout and
bounds ops around them.

  python3 results/tpu-flash/profile_ops.py OUT_DIR [CASE ...]

CASE: prefill:S or train:S (default prefill:2048 prefill:8192 train:2048); the blocks of
the flash rows and splash's from the environment: FLASH_BLOCKS (default 1024/1024/512),
SPLASH_BLOCKS (default 512/512,1024/1024). Qwen2-7B's attention shape. Writes
OUT_DIR/profile_ops.json (with provenance; rewritten after every case)."""
import os
import sys
import time

from attnprec.xla_env import disable_excess_precision

disable_excess_precision()   # before jax is imported, as every runner (attnprec/xla_env.py)

import jax  # noqa: E402

from attnprec import runs  # noqa: E402
from attnprec.bench import tpu_attention  # noqa: E402
from attnprec.bench.device_profile import device_ops  # noqa: E402

SHAPE = "qwen2-7b"


def _blocks(text):
  return [tuple(int(x) for x in item.split("/")) for item in text.split(",") if item]


def main(out_dir, cases):
  flash_blocks = _blocks(os.environ.get("FLASH_BLOCKS", "1024/1024/512"))
  splash_blocks = _blocks(os.environ.get("SPLASH_BLOCKS", "512/512,1024/1024"))
  result = {"shape": SHAPE, "flash_blocks": flash_blocks, "splash_blocks": splash_blocks,
            "device": str(jax.devices()[0].device_kind), "cases": {}}
  for case in cases:
    mode, S = case.split(":")
    S = int(S)
    fns = tpu_attention.rows_for(SHAPE, S, mode == "train", ["flash"], ["both"],
                                 flash_blocks, splash_blocks)
    qkv = tpu_attention._inputs(SHAPE, S)
    rows = {}
    for name, fn in fns.items():
      jax.block_until_ready(fn(*qkv))
      t0 = time.perf_counter()
      jax.block_until_ready(fn(*qkv))
      wall_ms = 1e3 * (time.perf_counter() - t0)
      ops = device_ops(lambda: jax.block_until_ready(fn(*qkv)))
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
  main(sys.argv[1], sys.argv[2:] or ["prefill:2048", "prefill:8192", "train:2048"])
