"""The compiled decode loop of `bench --suite=tpu_model` (Qwen2.5-0.5B's shape, scanned,
'auto') as XLA:TPU optimized it, for a few cases: what the step does with the stacked
cache (copies, transposes, scatters). Usage on a TPU:
  python3 results/tpu-model/capture_decode_hlo.py OUT_DIR [PRESET:BxS ...]
Writes OUT_DIR/decode-<preset>-<B>x<S>.hlo.txt.gz and a summary of each program's
memory and its largest copy / transpose / scatter ops."""
import functools
import gzip
import os
import re
import sys

import jax
import jax.numpy as jnp

from attnprec import cache as cache_lib
from attnprec import decoding
from attnprec.bench import model as model_bench
from attnprec.bench import tpu_model

out = sys.argv[1]
wanted = sys.argv[2:] or ["bf16_flags:8x8192", "bf16_flags:1x8192", "bf16_flags_kv_int8:1x8192"]
os.makedirs(out, exist_ok=True)
config = tpu_model.qwen05_config()
params = tpu_model.init_params(config)
serving = tpu_model._Serving(params)
steps = 2
with open(os.path.join(out, "summary.txt"), "w") as log:
  for item in wanted:
    name, case = item.split(":")
    B, S = map(int, case.split("x"))
    p, prec = serving(model_bench.PRESETS[name])

    def fresh(prec=prec):
      return decoding.DecodeState(
          cache_lib.init_cache(config, B, S, prec.compute_dtype, prec.cache_storage),
          jnp.zeros((B, config.vocab_size), jnp.float32), jnp.full((B,), S - steps, jnp.int32))

    loop = jax.jit(functools.partial(model_bench._decode_loop, config=config, precision=prec,
                                     steps=steps), donate_argnums=(1,))
    tokens = jnp.zeros((B,), jnp.int32)
    compiled = loop.lower(p, jax.eval_shape(fresh), tokens).compile()
    text = compiled.as_text()
    with gzip.open(os.path.join(out, f"decode-{name}-{B}x{S}.hlo.txt.gz"), "wt") as f:
      f.write(text)
    m = compiled.memory_analysis()
    log.write(f"== {name} {B}x{S}: temp {m.temp_size_in_bytes/1e9:.3f} GB args "
              f"{m.argument_size_in_bytes/1e9:.3f} GB out {m.output_size_in_bytes/1e9:.3f} GB "
              f"alias {m.alias_size_in_bytes/1e9:.3f} GB\n")
    big = []
    for line in text.splitlines():
      mm = re.search(r"= (\w+)\[([\d,]*)\]\{[^}]*\} (copy|transpose|scatter|dynamic-update-slice|dynamic-slice|fusion|convert)\(", line)
      if mm:
        n = 1
        for d in filter(None, mm.group(2).split(",")):
          n *= int(d)
        if n >= B * S * 64:
          big.append(line.strip()[:300])
    log.write("\n".join(big[:80]) + "\n")
    log.flush()
    print(item, "done", flush=True)
