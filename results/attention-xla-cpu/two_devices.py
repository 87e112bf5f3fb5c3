"""One-off: the blockwise kernel split over two XLA:CPU devices in one process
(`--xla_force_host_platform_device_count=2`, `jax.shard_map`), each device's program on
its own thread, against one device running the whole kernel; interleaved. Is the kernel's
element-wise work, which XLA:CPU runs as one chain of thunks, faster when two chains run
side by side? Both flags, bf16, causal, H = 64; SmolLM2's heads (9 over 3) and
Qwen2.5-Coder-0.5B's (14 over 2) at 1000 and 4096 tokens. Two splits:
  queries  each device takes half the query blocks (Tq = 512), paired short with long
           (blocks i and nq - 1 - i) so both do the same number of key blocks; explicit
           query positions keep the causal mask and the block skipping exact.
  kv heads each device takes one kv head and its query heads (Qwen's K = 2 only).
Outputs are checked finite (one that is not stops the run) and compared with the
one-device kernel's bit for bit. A process with two CPU
devices also runs one device's program slower than a process with one, so each round also
times the kernel in a child process with the default single device ('1-device process',
the same inputs). From the repository root:
  .venv/bin/python results/attention-xla-cpu/two_devices.py  (two_devices.txt)
"""
import os, statistics, subprocess, sys, tempfile, time
CHILD = r'''
import os, statistics, sys, time
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from attnprec import contract
from attnprec.kernels.blockwise import blockwise_attention
N, K, S, calls = map(int, sys.argv[1:5])
rng = np.random.default_rng(0)
q, k, v = (jnp.asarray(rng.standard_normal((1, S, n, 64)), jnp.bfloat16) for n in (N, K, K))
f = jax.jit(lambda q, k, v: blockwise_attention(q, k, v, causal=True, q_block=512,
    flags=contract.AttentionFlags(float32_qk_product=True, float32_logits=True)))
np.save(sys.argv[5], np.asarray(f(q, k, v), np.float32)); ts = []
for _ in range(calls):
  t = time.perf_counter(); f(q, k, v).block_until_ready(); ts.append(time.perf_counter() - t)
print(statistics.median(ts) * 1e3)
'''
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=2")
sys.path.insert(0, os.getcwd())
from attnprec import xla_env; xla_env.disable_excess_precision()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from attnprec import contract, cpu_features
from attnprec.checkpoints.finite import require_finite
from attnprec.kernels.blockwise import blockwise_attention

TQ, ROUNDS, CALLS = 512, 7, 5
TMP_DIR = tempfile.TemporaryDirectory(prefix="two_devices-")   # the child's output;
TMP = TMP_DIR.name                                             # removed at exit
BF = jnp.bfloat16
FLAGS = contract.AttentionFlags(float32_qk_product=True, float32_logits=True)
MESH = Mesh(np.array(jax.devices()[:2]), ("x",))


def one_device(q, k, v):
  return blockwise_attention(q, k, v, causal=True, flags=FLAGS, q_block=TQ)


def query_rows(S):
  """[2, T/2-ish] query rows per device: block pairs (i, nq - 1 - i) dealt out in turn;
  a device short of rows is padded with row S (a zero query, dropped at the end)."""
  nq = -(-S // TQ)
  pairs = [(i, nq - 1 - i) for i in range(nq // 2)]
  dev = [[b for n, p in enumerate(pairs) if n % 2 == d for b in p] for d in (0, 1)]
  if nq % 2:
    dev[0].append(nq // 2)
  rows = [[r for b in blocks for r in range(b * TQ, min(b * TQ + TQ, S))] for blocks in dev]
  width = max(map(len, rows))
  return np.array([r + [S] * (width - len(r)) for r in rows])


def split_queries(S):
  idx = query_rows(S)
  pos = np.minimum(idx, S - 1)

  def part(q_1xBxTxNxH, pos_1xBxT, k, v):
    out = blockwise_attention(q_1xBxTxNxH[0], k, v, causal=True, flags=FLAGS, q_block=TQ,
                              q_positions_BxT=pos_1xBxT[0],
                              k_positions_BxS=jnp.arange(S)[None])
    return out[None]

  def run(q, k, v):
    B, _, N, H = q.shape
    q_pad = jnp.pad(q, ((0, 0), (0, 1), (0, 0), (0, 0)))
    qs = jnp.moveaxis(q_pad[:, idx], 1, 0)                   # [2, B, rows, N, H]
    ps = jnp.broadcast_to(jnp.asarray(pos)[:, None], (2, B, idx.shape[1]))
    out = jax.shard_map(part, mesh=MESH, in_specs=(P("x"), P("x"), P(), P()),
                        out_specs=P("x"), check_vma=False)(qs, ps, k, v)
    full = jnp.zeros((B, S + 1, N, H), out.dtype).at[:, idx.reshape(-1)].set(
        jnp.moveaxis(out, 0, 1).reshape(B, -1, N, H))
    return full[:, :S]
  return run


def split_kv_heads(q, k, v):
  return jax.shard_map(one_device, mesh=MESH, in_specs=(P(None, None, "x"),) * 3,
                       out_specs=P(None, None, "x"), check_vma=False)(q, k, v)


def tm(fn, calls):
  jax.block_until_ready(fn()); ts = []
  for _ in range(calls):
    t = time.perf_counter(); jax.block_until_ready(fn()); ts.append(time.perf_counter() - t)
  return statistics.median(ts) * 1e3


print(f"CPU: {cpu_features.describe()}; jax {jax.__version__}; {jax.device_count()} CPU "
      f"devices; both flags; {ROUNDS} interleaved rounds of {CALLS} calls, medians", flush=True)
for name, N, K in (("smollm2", 9, 3), ("qwen2.5-coder-0.5b", 14, 2)):
  for S in (1000, 4096):
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, S, n, 64)), BF) for n in (N, K, K))
    forms = {"one device": jax.jit(one_device), "queries split": jax.jit(split_queries(S))}
    if K % 2 == 0:
      forms["kv heads split"] = jax.jit(split_kv_heads)
    outs = {n: require_finite(f"the output of {name} {S}, {n}",
                              np.asarray(f(q, k, v), np.float32)) for n, f in forms.items()}
    ref = outs["one device"]
    same = {n: np.array_equal(ref, out) for n, out in outs.items()}
    child_out = os.path.join(TMP, "one_device_process.npy")
    res = {n: [] for n in forms}
    res["1-device process"] = []
    env = {k_: v_ for k_, v_ in os.environ.items() if k_ != "XLA_FLAGS"}
    for _ in range(ROUNDS):
      for n, f in forms.items():
        res[n].append(tm(lambda: f(q, k, v), CALLS))
      res["1-device process"].append(float(subprocess.run(
          [sys.executable, "-c", CHILD, str(N), str(K), str(S), str(CALLS), child_out], env=env,
          capture_output=True, text=True, check=True).stdout.split()[-1]))
    same["1-device process"] = np.array_equal(ref, require_finite(
        f"the output of {name} {S}, 1-device process", np.load(child_out)))
    base = statistics.median(res["one device"])
    print(f"{name} prefill {S}: " + "; ".join(
        f"{n} {statistics.median(t):.1f} ms ({statistics.median(t) / base:.2f}x"
        f"{'' if same[n] else ', NOT bit-identical'})" for n, t in res.items()), flush=True)
