"""`make decode` on a real model: generate a continuation under the decode precision, and
compare it token by token with an fp32-attention reference decode of the same prompt.

The prompt's padding, the serving precision, the attention kernels and the KV cache it
prints are those of the decode's `serving.plan`, which `serving.run` runs.

A decode whose logits were not finite (NaN/Inf: `decoding.generate`'s `finite_B`) is an
error (exit 2), never a continuation or an agreement figure: the message
(`serving.nonfinite_error`) names the first step whose logits were not finite and the
first model stage whose output was not finite, e.g. an fp16 overflow in layer 3's MLP."""
import dataclasses
import time
from typing import Optional

import gin
import numpy as np

from attnprec import checkpoints, checks, decoding, runs, xla_env
from attnprec.checkpoints import serving
from attnprec.errors import UserError
from attnprec.precision import REFERENCE, Precision

DEFAULT_PROMPT = ("Explain in three sentences why a language model's attention softmax can "
                  "go wrong when it is computed in low precision.")


def _name(precision) -> str:
  """'bf16', 'fp16', 'fp32': how the messages name a decode."""
  return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(precision.dtype,
                                                                       precision.dtype)


def _decode(ckpt, plan, name: str) -> serving.Decoded:
  """Runs `plan`; a decode whose logits were not finite is a NonFiniteError naming `name`'s
  first non-finite step and stage."""
  out = serving.run(plan, ckpt.params)
  if not all(out.finite):
    raise serving.nonfinite_error(plan, ckpt.params, out,
                                  what=f"the logits of the {name} decode")
  return out


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
  if eos_id is not None and eos_id >= ckpt.config.vocab_size:
    raise UserError(f"Invalid generate_text.eos_id = {eos_id}: the vocabulary of {model!r} "
                    f"has ids 0..{ckpt.config.vocab_size - 1}, so no token could end the "
                    f"answer. Give an id in that range, or None for the tokenizer's own "
                    f"({tok.eos_id}).")
  eos = tok.eos_id if eos_id is None else eos_id
  # Bucketed: prompts of other lengths in the same bucket reuse the compiled program.
  plan = serving.plan(ckpt.config, precision, [ids], max_new_tokens=max_new_tokens,
                      ends=eos, sampler=sampler, return_logits=True)   # checks the context
  k = getattr(sampler, "k", None)
  if k is not None and k > ckpt.config.vocab_size:
    raise UserError(f"Invalid TopK.k = {k}: must be <= the vocabulary size of {model!r} "
                    f"({ckpt.config.vocab_size}).")
  print(f"model: {ckpt.source} (loaded in {time.perf_counter() - t0:.1f} s)")
  # What the decode programs run: `generate` applies `decoding.for_serving`.
  print(f"attention precision in force (decode phase): {plan.serving.describe()}")
  print(xla_env.describe())     # what XLA runs with (a user's own XLA_FLAGS wins)
  print(plan.cache)
  print(plan.kernel_line())
  out = _decode(ckpt, plan, _name(precision))
  new = out.tokens[0]
  text = tok.decode(new)
  print(f"\nprompt ({len(ids)} tokens): {prompt}\n")
  print(f"--- continuation ({len(new)} tokens) ---\n{text}\n---")
  seconds = out.seconds
  tok_s = max_new_tokens / seconds
  print(f"{max_new_tokens} tokens in {seconds:.2f} s: {tok_s:.1f} tokens/s (batch 1, prefill "
        f"included, compile excluded; {out.compiled.describe()}; prompt padded to "
        f"{plan.padded_length})")
  result = {"model": model, "source": ckpt.source, "prompt": prompt,
            "prompt_tokens": len(ids), "padded_prompt_tokens": plan.padded_length,
            "precision": dataclasses.asdict(plan.serving),
            "kernels": {"prefill": plan.prefill_kernel, "decode_step": plan.step_kernel},
            "tokens": new, "text": text, "seconds": seconds, "tokens_per_s": tok_s,
            "compile_s": out.compiled.seconds,
            "compile_new_entries": out.compiled.new_entries,
            "compile_cached": out.compiled.cached,
            "compile_replaced_entries": out.compiled.replaced}
  if reference:
    ref = _decode(ckpt, serving.plan(ckpt.config, REFERENCE, [ids],
                                     max_new_tokens=max_new_tokens, ends=eos,
                                     return_logits=True), "fp32 reference")
    ref_compiled = ref.compiled
    a, b = (np.asarray(o.out.tokens_BxM[0]) for o in (out, ref))
    differ = np.nonzero(a != b)[0]
    first = int(differ[0]) if differ.size else None
    agreement = float(np.mean(a == b))
    result.update(reference_precision=dataclasses.asdict(REFERENCE),
                  reference_tokens=ref.tokens[0], greedy_agreement=agreement,
                  first_divergence=first, reference_compile_s=ref_compiled.seconds,
                  reference_compile_new_entries=ref_compiled.new_entries)
    where = "none" if first is None else f"new token {first}"
    print(f"agreement with the fp32-attention reference decode ({REFERENCE.describe()}): "
          f"{agreement:.1%} of {max_new_tokens} tokens identical; first divergence: {where} "
          f"(reference {ref_compiled.describe()})")
    if not isinstance(sampler, decoding.Greedy):
      print("(the sampler is not greedy, so disagreement includes sampling noise)")
  path = runs.write_json(run_dir, "results.json", result, provenance=True)
  print(f"wrote {path}")
  return result
