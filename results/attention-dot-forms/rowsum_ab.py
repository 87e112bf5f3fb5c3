"""One-off: the blockwise kernel with its row sum taken out of the PV dot (a column of ones
appended to each value block, H + 1 = 65 columns: dot_forms.py's 'ones65') instead of a
separate reduction of the probabilities, against the kernel as it is, interleaved. SmolLM2's
heads (9 over 3, H = 64), bf16 with both flags, causal; prefill (T = S) and a decode step
(batch 8, a cache of 4001, the caller's [B, S, K, H] arrays). The variant is made from the
kernel's own source by one replacement (so it follows the kernel as it changes). Outputs
are checked finite before anything is timed (one that is not stops the run). From the
repository root:  .venv/bin/python results/attention-dot-forms/rowsum_ab.py  (rowsum_ab.txt)
"""
import functools, inspect, statistics, time, types
from attnprec import xla_env; xla_env.disable_excess_precision()  # before jax is imported
import jax, jax.numpy as jnp, numpy as np  # noqa: E402
from attnprec import contract
from attnprec.checkpoints.finite import require_finite
from attnprec.kernels import blockwise

OLD = '''    l_new = l_BxKxGxTq * correction + jnp.sum(probs_BxKxGxTqxSk, axis=-1, dtype=F32)
    if v_tok is not None:
      probs_BxKxGxTqxSk = contract.scale_columns(
          probs_BxKxGxTqxSk, jax.lax.dynamic_slice_in_dim(v_tok, s0, Sk, axis=2),
          rows["v_scale_in"])
    with jax.named_scope(contract.WV_SCOPE):
      pv_BxKxGxTqxH = jnp.einsum(
          "BKGTS,BKSH->BKGTH", probs_BxKxGxTqxSk, v_blk.astype(expected["probs"]),
          precision=prep.einsum, preferred_element_type=F32)
'''
NEW = '''    v_ext = jnp.concatenate([v_blk.astype(expected["probs"]),
                             jnp.ones(v_blk.shape[:-1] + (1,), expected["probs"])], -1)
    with jax.named_scope(contract.WV_SCOPE):
      pv_ext = jnp.einsum(
          "BKGTS,BKSH->BKGTH", probs_BxKxGxTqxSk, v_ext,
          precision=prep.einsum, preferred_element_type=F32)
    pv_BxKxGxTqxH = pv_ext[..., :H]
    l_new = l_BxKxGxTq * correction + pv_ext[..., H]
'''
src = inspect.getsource(blockwise)
assert OLD in src, "the kernel changed: update OLD"
src = src.replace(OLD, NEW).replace('gin.external_configurable(BlockSizes, "blockwise")', "None")
variant = types.ModuleType("blockwise_rowsum_in_pv")
exec(compile(src, "blockwise_rowsum_in_pv", "exec"), variant.__dict__)
FLAGS = contract.AttentionFlags(float32_qk_product=True, float32_logits=True)
N, K, H = 9, 3, 64


def ab(name, B, T, S, rounds, calls):
  r = np.random.default_rng(0)
  q = jnp.asarray(r.standard_normal((B, T, N, H)), jnp.bfloat16)
  k, v = (jnp.asarray(r.standard_normal((B, S, K, H)), jnp.bfloat16) for _ in "kv")
  fns = {"kernel": jax.jit(functools.partial(blockwise.blockwise_attention, flags=FLAGS,
                                             causal=True)),
         "row sum in PV": jax.jit(functools.partial(variant.blockwise_attention, flags=FLAGS,
                                                    causal=True,
                                                    block_sizes=variant.BlockSizes()))}
  outs = {n: require_finite(f"the output of {name}, {n}",
                            np.asarray(f(q, k, v).astype(jnp.float32))) for n, f in fns.items()}
  ts = {n: [] for n in fns}
  for _ in range(rounds):
    for n, f in fns.items():
      jax.block_until_ready(f(q, k, v))
      t0 = time.perf_counter()
      for _ in range(calls):
        out = f(q, k, v)
      jax.block_until_ready(out)
      ts[n].append((time.perf_counter() - t0) / calls)
  med = {n: statistics.median(x) for n, x in ts.items()}
  a, b = outs["kernel"], outs["row sum in PV"]
  print(f"{name}: kernel {med['kernel'] * 1e3:.1f} ms, row sum in PV "
        f"{med['row sum in PV'] * 1e3:.1f} ms ({med['row sum in PV'] / med['kernel']:.3f}x); "
        f"outputs equal: {np.mean(a == b):.4%}, max |diff| {np.max(np.abs(a - b)):.3g}",
        flush=True)


print(f"jax {jax.__version__}, {jax.default_backend()}; medians", flush=True)
ab("prefill T = S = 1000, 15 rounds of 5 calls", 1, 1000, 1000, 15, 5)
ab("prefill T = S = 4096, 15 rounds", 1, 4096, 4096, 15, 1)
ab("decode 8 x 4001, 15 rounds of 5 calls", 8, 1, 4001, 15, 5)
