"""`make decode` on a real model: generate a continuation under the decode precision, and
compare it token by token with an fp32-attention reference decode of the same prompt.

A decode whose logits were not finite (NaN/Inf: `decoding.generate`'s `finite_B`) is an
error (exit 2), never a continuation or an agreement figure: the message names the first
step whose logits were not finite and the first model stage whose output was not finite
(`attnprec.checkpoints.finite`), e.g. an fp16 overflow in layer 3's MLP."""
import dataclasses
import time
from typing import Optional

import gin
import jax
import numpy as np

from attnprec import checkpoints, checks, compilation, decoding, kernels, runs, xla_env
from attnprec.cache import cache_bytes
from attnprec.checkpoints import finite
from attnprec.contract import COMPUTE_CACHE
from attnprec.errors import UserError
from attnprec.precision import REFERENCE, Precision

DEFAULT_PROMPT = ("Explain in three sentences why a language model's attention softmax can "
                  "go wrong when it is computed in low precision.")


def _compiled_generate(ckpt, prompt_BxP, lengths_B, *, precision, sampler, max_new_tokens,
                       eos_id, name):
  """Compiles (or loads from the persistent cache) once, timed apart, then runs and times
  the whole jitted prefill + decode. Returns (tokens_BxM, run seconds, Compiled); raises
  NonFiniteError if the logits of any step were not finite."""
  args = (ckpt.params, prompt_BxP, lengths_B, jax.random.PRNGKey(0))
  static = dict(config=ckpt.config, precision=precision, sampler=sampler,
                max_new_tokens=max_new_tokens)
  compiled = compilation.compile_lowerable(decoding.generate, *args, eos_id=eos_id, **static)
  t0 = time.perf_counter()
  out = compiled.program(*args, eos_id=eos_id)
  tokens_BxM = np.asarray(jax.block_until_ready(out.tokens_BxM))
  seconds = time.perf_counter() - t0
  if not bool(np.asarray(out.finite_B).all()):
    raise _nonfinite(ckpt, prompt_BxP, lengths_B, out, precision, name)
  return tokens_BxM, seconds, compiled


def _nonfinite(ckpt, prompt_BxP, lengths_B, out, precision, name):
  """The error of a decode whose logits were not finite: the first such step, NaN or Inf,
  and the first stage of a forward pass over the tokens up to it that is not finite."""
  steps = int(out.steps)
  logits_MxV = np.asarray(out.logits_BxMxV[0, :max(steps, 1)])
  bad_M = ~np.isfinite(logits_MxV).all(-1)
  k = int(np.argmax(bad_M))
  kind = "NaN" if np.isnan(logits_MxV[k]).any() else "Inf"
  prompt = np.asarray(prompt_BxP[0, :int(lengths_B[0])]).tolist()
  seq = prompt + np.asarray(out.tokens_BxM[0, :k]).tolist()   # the logits of step k: last
  stage = finite.first_nonfinite_stage(ckpt.config, ckpt.params, np.asarray([seq]),
                                       precision)
  return finite.nonfinite_error(f"the logits of the {name} decode", precision,
                                finite.Where(kind, f"at step {k}"), stage)


def _name(precision) -> str:
  """'bf16', 'fp16', 'fp32': how the messages name a decode."""
  return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(precision.dtype,
                                                                       precision.dtype)


def _compile_note(compiled) -> str:
  # True by construction: every program JAX looked up was a hit (compilation.Compiled).
  return compiled.describe()


def _until_eos(tokens, eos_id):
  tokens = list(int(t) for t in tokens)
  return tokens[: tokens.index(eos_id) + 1] if eos_id in tokens else tokens


def cache_line(config, precision, length: int, batch: int = 1) -> str:
  """The KV cache `generate` makes under `precision`: its storage and its bytes, beside
  those of a cache stored in the compute dtype."""
  mib = lambda n: f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"  # noqa
  held = cache_bytes(config, batch, length, precision.compute_dtype,
                     precision.cache_storage)
  line = (f"KV cache: {precision.cache_storage.describe()}, {batch} x {length} positions "
          f"x {config.num_layers} layers: {mib(held)}")
  if precision.cache_storage != COMPUTE_CACHE:
    plain = cache_bytes(config, batch, length, precision.compute_dtype)
    line += f" ({held / plain:.2f}x the {mib(plain)} of a compute-dtype cache)"
  return line


@gin.configurable("generate_text", denylist=["precision", "run_dir"])
@checks.validated("generate_text", model=checks.string, prompt=checks.string,
                  max_new_tokens=checks.at_least(1),
                  sampler=checks.instance_of(decoding.SAMPLERS, decoding.SAMPLER_NAMES),
                  param_dtype=checks.one_of("float32", "bfloat16", "float16"),
                  eos_id=checks.optional(checks.integer(min=0)))
def generate_text(*, precision: Precision, run_dir: str, model: str = "smollm2-135m",
                  prompt: str = DEFAULT_PROMPT, chat: bool = True, max_new_tokens: int = 64,
                  sampler=decoding.Greedy(), reference: bool = True,
                  param_dtype: str = "float32", eos_id: Optional[int] = None) -> dict:
  """Decodes `prompt` with `model` (a shipped name, an HF directory or a .gguf file)."""
  if max_new_tokens < 1:
    raise UserError(f"generate_text.max_new_tokens must be >= 1, got {max_new_tokens}.")
  runs.ensure_dir(run_dir)
  t0 = time.perf_counter()
  ckpt = checkpoints.load(model, param_dtype=param_dtype)
  tok = ckpt.tokenizer
  if tok is None:
    raise UserError(f"{model!r} has no tokenizer; generate_text needs one to encode the "
                    f"prompt.")
  ids = (tok.encode_chat([{"role": "user", "content": prompt}])
         if chat and tok.chat_template else tok.encode(prompt))
  if len(ids) + max_new_tokens > ckpt.config.max_seq_len:
    raise UserError(f"Prompt ({len(ids)} tokens) + max_new_tokens ({max_new_tokens}) exceed "
                    f"the model's context ({ckpt.config.max_seq_len} tokens).")
  k = getattr(sampler, "k", None)
  if k is not None and k > ckpt.config.vocab_size:
    raise UserError(f"Invalid TopK.k = {k}: must be <= the vocabulary size of {model!r} "
                    f"({ckpt.config.vocab_size}).")
  eos = tok.eos_id if eos_id is None else eos_id
  eos = -1 if eos is None else eos
  print(f"model: {ckpt.source} (loaded in {time.perf_counter() - t0:.1f} s)")
  # What the decode programs run: `generate` applies `decoding.for_serving`.
  served = decoding.serving_precision(precision)
  print(f"attention precision in force (decode phase): {served.describe()}")
  print(xla_env.describe())     # what XLA runs with (a user's own XLA_FLAGS wins)
  # Bucketed: prompts of other lengths in the same bucket reuse the compiled program.
  prompt_BxP, lengths_B = decoding.pad_prompts([ids], bucket=True)
  if prompt_BxP.shape[1] + max_new_tokens > ckpt.config.max_seq_len:
    prompt_BxP, lengths_B = decoding.pad_prompts([ids])

  P = int(prompt_BxP.shape[1])
  S = P + max_new_tokens                 # the cache `generate` makes
  print(cache_line(ckpt.config, served, S))
  prefill_kernel = kernels.resolve(precision.kernel, P, S)
  step_kernel = kernels.resolve(precision.kernel, 1, S)
  print(f"attention kernel: prefill ({P} tokens) {prefill_kernel}, decode steps "
        f"(cache of {S}) {step_kernel}" + (
            f" (kernel=auto: blockwise from {kernels.AUTO_MIN_QUERIES} queries or "
            f"{kernels.AUTO_MIN_KEYS} keys)" if precision.kernel == kernels.AUTO else ""))
  tokens, seconds, compiled = _compiled_generate(
      ckpt, prompt_BxP, lengths_B, precision=precision, sampler=sampler,
      max_new_tokens=max_new_tokens, eos_id=eos, name=_name(precision))
  new = _until_eos(tokens[0], eos)
  text = tok.decode(new)
  print(f"\nprompt ({len(ids)} tokens): {prompt}\n")
  print(f"--- continuation ({len(new)} tokens) ---\n{text}\n---")
  tok_s = max_new_tokens / seconds
  print(f"{max_new_tokens} tokens in {seconds:.2f} s: {tok_s:.1f} tokens/s (batch 1, prefill "
        f"included, compile excluded; {_compile_note(compiled)}; prompt padded to "
        f"{prompt_BxP.shape[1]})")
  result = {"model": model, "source": ckpt.source, "prompt": prompt,
            "prompt_tokens": len(ids), "padded_prompt_tokens": int(prompt_BxP.shape[1]),
            "precision": dataclasses.asdict(served),
            "kernels": {"prefill": prefill_kernel, "decode_step": step_kernel},
            "tokens": new, "text": text, "seconds": seconds, "tokens_per_s": tok_s,
            "compile_s": compiled.seconds, "compile_new_entries": compiled.new_entries,
            "compile_cached": compiled.cached,
            "compile_replaced_entries": compiled.replaced}
  if reference:
    ref_tokens, _, ref_compiled = _compiled_generate(
        ckpt, prompt_BxP, lengths_B, precision=REFERENCE, sampler=decoding.Greedy(),
        max_new_tokens=max_new_tokens, eos_id=eos, name="fp32 reference")
    a, b = tokens[0], ref_tokens[0]
    differ = np.nonzero(a != b)[0]
    first = int(differ[0]) if differ.size else None
    agreement = float(np.mean(a == b))
    result.update(reference_precision=dataclasses.asdict(REFERENCE),
                  reference_tokens=_until_eos(b, eos), greedy_agreement=agreement,
                  first_divergence=first, reference_compile_s=ref_compiled.seconds,
                  reference_compile_new_entries=ref_compiled.new_entries)
    where = "none" if first is None else f"new token {first}"
    print(f"agreement with the fp32-attention reference decode ({REFERENCE.describe()}): "
          f"{agreement:.1%} of {max_new_tokens} tokens identical; first divergence: {where} "
          f"(reference {_compile_note(ref_compiled)})")
    if not isinstance(sampler, decoding.Greedy):
      print("(the sampler is not greedy, so disagreement includes sampling noise)")
  path = runs.write_json(run_dir, "results.json", result)
  print(f"wrote {path}")
  return result
