"""Device check: `python runners/device_check.py [--out=DIR]` (`make device-check`).

On a machine with an NVIDIA GPU it checks what can only be checked there:
  audit    the precision audit for 'cuda' on the compiled program (the tiny recall
           architecture under fp32_attention and highest): what XLA:GPU made of every dot;
  kernels  prefill attention at B=1, S=2048, N=K=8, H=64 (bf16, causal): the dense
           'dot_product' kernel, the 'pallas' kernel if the registry has one (looked up
           by name now; said when absent) and jax.nn.dot_product_attention(
           implementation='cudnn'): median time and max |error| against the float64
           reference (`contract.reference_attention_np`);
  flags    the cost of the flags per phase (bf16 vs bf16 + both flags: train step,
           prefill, decode step) on SmolLM2-135M (`bench.model.flag_cost`), if its
           checkpoint can be loaded here.
Results go to <out>/device_check.json and device_check.md (atomic writes); a part that
fails is recorded with its error and the others still run.

On a machine without a GPU it exits 0 after one line saying so, and writes nothing.
Exit codes: 0 done (also: no GPU), 2 bad input, 3 the cuda audit found a mismatch, 1 a
crash (attnprec.cli).
"""
import json
import os
import statistics
import sys
import time

from attnprec.xla_env import disable_excess_precision

disable_excess_precision()  # before jax is imported (see attnprec/xla_env.py)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from attnprec import cli, platforms, runs  # noqa: E402

EXAMPLES = ["python runners/device_check.py --out=runs/device_check"]
SHAPE = dict(B=1, S=2048, N=8, K=8, H=64)


def here() -> str:
  """The `platforms` name of this machine's backend ('cpu', 'cuda', ...; '' if none)."""
  return platforms.local_platform(jax.default_backend(), getattr(
      jax.devices()[0].client, "platform_version", "")) or jax.default_backend()


def _median_s(fn, *args, reps: int = 20) -> float:
  jax.block_until_ready(fn(*args))        # compile and warm up
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


def audit_part() -> dict:
  from attnprec import audit
  from attnprec.config import ModelConfig
  from attnprec.precision import Precision
  config = ModelConfig(vocab_size=13, d_model=16, num_layers=2, num_heads=4,
                       num_kv_heads=2, head_dim=8, mlp_hidden=32, max_seq_len=64)
  out = {}
  for name, p in (("fp32_attention", Precision(dtype="bfloat16")),
                  ("highest", Precision(dtype="float32", einsum_precision="highest",
                                        matmul_precision="highest"))):
    r = audit.run_audit(config, p, p, platform="cuda", compile=True)
    out[name] = {"ok": r["ok"], "compiled_checked": audit.not_compiled(r) is None,
                 "problems": r["problems"][:20],
                 "compiled": audit.compiled_table(r), "verdict": audit.verdict(r)}
  return out


def kernels_part() -> dict:
  from attnprec import contract, kernels
  from attnprec.precision import Precision
  B, S, N, K, H = (SHAPE[x] for x in "BSNKH")
  rng = np.random.default_rng(0)
  q, k, v = (rng.standard_normal((B, S, n, H)).astype(np.float32) for n in (N, K, K))
  want = contract.reference_attention_np(q, k, v, mask=np.tril(np.ones((S, S), bool)))
  qkv = tuple(jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
  pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32), (B, S))
  fns = {}
  for name in ("dot_product", "pallas"):
    if name not in kernels.NAMES:
      continue
    prec = Precision(dtype="bfloat16", kernel=name)
    fns[name] = jax.jit(lambda q, k, v, prec=prec: kernels.attend(
        prec, q, k, v, mask=contract.CausalMask(pos, pos)))
  fns["jax_nn_cudnn"] = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation="cudnn"))
  out = {"shape": SHAPE, "dtype": "bfloat16", "reference": "float64 NumPy",
         "pallas": "in the registry" if "pallas" in kernels.NAMES else
         f"absent: attnprec.kernels has {', '.join(kernels.NAMES)}",
         "cudnn": "q, k, v in bf16: the probabilities enter its wv dot in bf16 "
                  "(attnprec/kernels/jax_nn.py)", "rows": {}}
  for name, fn in fns.items():
    try:
      t = _median_s(fn, *qkv)
      err = float(np.max(np.abs(np.asarray(fn(*qkv), np.float64) - want)))
      out["rows"][name] = {"median_s": t, "max_abs_error": err}
    except Exception as e:  # noqa: BLE001 -- recorded, the other kernels still run
      out["rows"][name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"}
  dense = out["rows"].get("dot_product", {}).get("median_s")
  for row in out["rows"].values():
    if dense and "median_s" in row:
      row["vs_dot_product"] = row["median_s"] / dense
  return out


def flags_part() -> dict:
  from attnprec import checkpoints
  from attnprec.bench import model as model_bench
  ckpt = checkpoints.load("smollm2-135m")
  result = model_bench.flag_cost(ckpt.config, ckpt.params, (1, 1000), 256, 3,
                                 lambda *a, **k: None, np.random.default_rng(0))
  return {"model": "smollm2-135m", "case": "batch 1, 1000-token prefill, 256-token "
          "train step", **{k: result[k] for k in ("flags_over_no_flags", "median_s")}}


def to_markdown(result: dict) -> str:
  lines = [f"# Device check: {result['device']}", "", f"jax {result['jax']}", ""]
  for name, part in result["parts"].items():
    lines += [f"## {name}", "", "```", json.dumps(part, indent=1, default=str), "```", ""]
  return "\n".join(lines)


def check(out_dir: str) -> int:
  platform = here()
  if platform != "cuda":
    print(f"device-check: no GPU on this machine (jax backend {jax.default_backend()!r}); "
          f"nothing to check, nothing written.")
    return cli.EXIT_OK
  runs.check_output_dir(out_dir, flag="--out")
  result = {"device": str(jax.devices()[0]), "jax": jax.__version__, "parts": {}}
  for name, part in (("audit (cuda, compiled)", audit_part), ("kernels", kernels_part),
                     ("flag cost per phase", flags_part)):
    print(f"device-check: {name} ...", flush=True)
    try:
      result["parts"][name] = part()
    except Exception as e:  # noqa: BLE001 -- recorded; the next part still runs
      result["parts"][name] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
  runs.ensure_dir(out_dir)
  runs.atomic_write(os.path.join(out_dir, "device_check.json"),
                    json.dumps(result, indent=1, default=str) + "\n")
  runs.atomic_write(os.path.join(out_dir, "device_check.md"), to_markdown(result))
  print(to_markdown(result))
  audited = result["parts"]["audit (cuda, compiled)"]
  ok = all(v.get("ok", False) for v in audited.values()) if "error" not in audited else False
  return cli.EXIT_OK if ok else cli.EXIT_MISMATCH


def main(argv) -> int:
  parser = cli.ArgumentParser(prog="device_check", doc=__doc__, examples=EXAMPLES,
                              sections=["It reads no gin files: the options below are its "
                                        "configuration."])
  parser.add_argument("--out", default="runs/device_check", metavar="DIR",
                      help="where results are written (on a GPU machine)")
  outcome = {}

  def body():
    args = parser.parse_args(argv)
    outcome["rc"] = check(args.out)

  rc = cli.run("device_check", body)
  return outcome.get("rc", rc) if rc == cli.EXIT_OK else rc


if __name__ == "__main__":
  cli.exit(main(sys.argv[1:]))
