"""The shipped `qwen2.5-coder-1.5b` against transformers loading the same GGUF file.

What is checked where (the other shipped models: tests/test_checkpoints_real.py):

* Always, with nothing downloaded (tests/test_wheel_parts.py): its pinned SplitFile (22
  parts, member names, sizes summing to the file's 1,117,320,768 bytes), that it goes
  through the same code path as the 0.5B, and its errors: no parts and no network, a
  tampered part, through `checkpoints.load` and through the decode runner (exit 2).
* Here, when the assembled file is in the checkpoint cache ($ATTNPREC_CACHE/shipped/), and
  skipped when it is not: the file is 1.1 GB to download and ~6 GB of float32 params per
  side, so the test suite never fetches it (CI starts with an empty cache; the 0.5B, at
  477 MB, is fetched there). Fetch it once with `python -c "from attnprec import
  checkpoints; checkpoints.shipped_path('qwen2.5-coder-1.5b')"`.
  - test_tokenizer_and_chat_template: our tokenizer read from the file's metadata against
    transformers' (a few hundred lines of varied text, round trip, the same tokenizer saved
    as tokenizer.json, the ChatML template rendered and tokenized); no weights are loaded.
  - test_first_layers_match_transformers: the file's first LAYERS transformer blocks with
    its embedding, final norm and output head, written as a GGUF of their own (the same
    metadata but `qwen2.block_count`, the same tensor bytes), loaded by both loaders:
    logits over T tokens of stdlib text within 1e-3 of transformers in float64, NEW greedy
    tokens identical (forced full-forward argmax and cached `decoding.generate`), Q4_K /
    Q6_K dequantization bit-identical to transformers' torch kernels. Both sides read the
    same file with their own code (config, head dim 128, GQA 12/2, q/k/v biases, RoPE 1e6,
    untied head); only the number of blocks differs from the real model. The reference is
    float64 (transformers loads qwen2 GGUFs fully dequantized into plain nn.Linear, in the
    dtype asked for; its warning about packed float32 kernels does not apply): on these 2
    blocks transformers' own float32 is 9.9e-4 from its float64 and ours 3.1e-4 (both at
    one position of 64), so a float32-vs-float32 comparison at 1e-3 would hinge on
    transformers' rounding.
* By hand (ATTNPREC_FULL_PARITY=1, the file cached): test_first_layers_match_transformers
  above (~10 GB at peak and 1-3 minutes on 2 cores, too much to run beside the rest of
  the suite under `make test`'s two workers), and test_full_model_by_hand, which runs the
  whole 28-block model in one process per model (transformers float32, then ours; never
  two models in one process: ~14 GB at peak each), over FULL_T tokens and FULL_NEW greedy
  tokens, and compares logits (max abs diff <= 1e-3, argmax everywhere) and greedy tokens
  (forced and cached). Measured: 7.1e-5 (|logits| up to 25.7), 32 of 32 tokens identical.
"""
import json
import os
import pathlib
import subprocess
import sys
import time
import types

import numpy as np
import pytest

from attnprec.xla_env import disable_excess_precision

disable_excess_precision()      # run as a script (by hand) there is no conftest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import test_checkpoints_real as real_tests  # noqa: E402  (tests/ is on sys.path)
from attnprec import checkpoints, decoding  # noqa: E402
from attnprec import diskcache as cache
from attnprec.checkpoints import shipped  # noqa: E402
from attnprec.checkpoints.gguf_reader import GGUFFile  # noqa: E402
from attnprec.checkpoints.tokenizer import Tokenizer  # noqa: E402
from attnprec.precision import Precision  # noqa: E402

NAME = "qwen2.5-coder-1.5b"
ROOT = pathlib.Path(__file__).resolve().parents[1]
LAYERS, T, PROMPT, NEW = 2, 64, 16, 16          # the test-suite check
FULL_T, FULL_PROMPT, FULL_NEW = 64, 32, 32      # by hand, the whole model
LOGITS_TOL = 1e-3     # as for the other shipped models


def cached_file():
  """The assembled file if it is in the cache (never fetched here), else None. The path
  as `cache.cache_dir` makes it, without creating the directory (collection time)."""
  model = shipped.SHIPPED[NAME]
  root = os.environ.get(cache.ENV_VAR) or os.path.join(os.path.expanduser("~"), ".cache",
                                                       "attnprec")
  path = pathlib.Path(root, "shipped", model.file)
  return path if path.is_file() and path.stat().st_size == model.split.size else None


needs_file = pytest.mark.skipif(
    cached_file() is None,
    reason=f"{NAME} is not in the checkpoint cache (1.1 GB; the test suite never fetches "
           f"it): see this module's docstring")


def truncated_gguf(src, dst, n_layers: int) -> pathlib.Path:
  """The first `n_layers` blocks of `src` (plus every tensor outside the blocks) as a GGUF
  of their own: the same metadata except `<arch>.block_count`, the same tensor bytes."""
  reader = gguf.GGUFReader(src)
  arch = reader.fields["general.architecture"].contents()
  writer = gguf.GGUFWriter(str(dst), arch)
  for field in reader.fields.values():
    if field.name == "general.architecture" or field.name.startswith("GGUF."):
      continue                                       # written by GGUFWriter itself
    vtype = field.types[0]
    sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
    value = n_layers if field.name == f"{arch}.block_count" else field.contents()
    writer.add_key_value(field.name, value, vtype, sub_type=sub)
  keep = [t for t in reader.tensors
          if not t.name.startswith("blk.") or int(t.name.split(".")[1]) < n_layers]
  for t in keep:
    writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_ti_data_to_file()
  for t in keep:
    writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
  writer.close()
  return pathlib.Path(dst)


def tf_tokenizer(path):
  path = pathlib.Path(path)
  with real_tests.one_gguf_parse():
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def tf_model(path, dtype):
  path = pathlib.Path(path)
  with real_tests.one_gguf_parse():
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=dtype,
        attn_implementation="eager").eval()


def stdlib_ids(tok, n):
  ids = tok(real_tests.stdlib_text())["input_ids"][:n]
  assert len(ids) == n
  return ids


def tf_reference(path, ids, prompt_len, new, dtype):
  """transformers' logits over `ids` and its `new` greedy tokens after the first
  `prompt_len` of them, computed in `dtype` (the dequantized weights are exact in both)."""
  model = tf_model(path, dtype)
  greedy = transformers.GenerationConfig(do_sample=False, max_new_tokens=new,
                                         eos_token_id=None, pad_token_id=0)
  with torch.no_grad():
    logits = model(torch.tensor([ids])).logits.numpy()[0]
    out = model.generate(torch.tensor([ids[:prompt_len]]), generation_config=greedy)
  return logits, out[0, prompt_len:].tolist()


def our_results(ckpt, ids, prompt_len, ref_new):
  """Our logits over `ids`, our argmax at every step of prompt + `ref_new` (one forward
  pass, see test_checkpoints_real) and our cached greedy decode of the prompt."""
  n = len(ids)
  forced = ids[:prompt_len] + list(ref_new) + [0] * (n - prompt_len - len(ref_new))
  logits = np.asarray(checkpoints.logits(ckpt, np.array([ids])))[0]
  forced_logits = np.asarray(checkpoints.logits(ckpt, np.array([forced])))[0]
  steps = forced_logits[prompt_len - 1:prompt_len - 1 + len(ref_new)]
  tokens = decoding.generate(
      ckpt.params, jnp.asarray([ids[:prompt_len]], jnp.int32),
      jnp.asarray([prompt_len], jnp.int32), jax.random.PRNGKey(0), config=ckpt.config,
      precision=Precision(), max_new_tokens=len(ref_new), return_logits=False)[0]
  top2 = np.sort(steps, -1)[:, -2:]
  return logits, steps.argmax(-1).tolist(), np.asarray(tokens)[0].tolist(), \
      float((top2[:, 1] - top2[:, 0]).min())


@needs_file
def test_tokenizer_and_chat_template():
  """Tokenizer and chat template of the real file, without loading any weights."""
  path = cached_file()
  tok = Tokenizer.from_gguf_metadata(GGUFFile(path).metadata, origin=str(path))
  assert tok.chat_template is not None
  real = types.SimpleNamespace(name=NAME, ckpt=types.SimpleNamespace(tokenizer=tok),
                               tf_tok=tf_tokenizer(path))
  failures = []
  for check in (real_tests.check_tokenizer, real_tests.check_hf_tokenizer_files,
                real_tests.check_chat_template):
    try:
      check(real)
    except AssertionError as e:
      failures.append(f"{check.__name__}: {e}")
  assert not failures, "\n".join(failures)


@needs_file
@pytest.mark.skipif(os.environ.get("ATTNPREC_FULL_PARITY") != "1",
                    reason="by hand: ATTNPREC_FULL_PARITY=1 (~10 GB at peak and 1-3 min on "
                           "2 cores: too much beside the rest of the suite under xdist)")
def test_first_layers_match_transformers(tmp_path, monkeypatch):
  from attnprec.checkpoints import gguf as gguf_lib
  path = truncated_gguf(cached_file(), tmp_path / f"{NAME}-{LAYERS}-blocks.gguf", LAYERS)
  # The derived file is this test's own: no params or tokenizer entry in the real cache.
  monkeypatch.setenv("ATTNPREC_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(gguf_lib, "PARAMS_CACHE_MIN_BYTES", 1 << 62)
  ckpt = checkpoints.load(str(path))
  # Our tokenizer's ids (equal to transformers': test_tokenizer_and_chat_template).
  ids = ckpt.tokenizer.encode(real_tests.stdlib_text())[:T]
  with real_tests.one_torch_thread():
    ref_logits, ref_new = tf_reference(path, ids, PROMPT, NEW, torch.float64)
  assert (ckpt.config.num_layers, ckpt.config.head_dim) == (LAYERS, 128)
  logits, forced, cached, gap = our_results(ckpt, ids, PROMPT, ref_new)
  diff = float(np.abs(logits - ref_logits).max())
  print(f"{NAME}, first {LAYERS} blocks: max abs logit diff over {T} tokens {diff:.2e} "
        f"(|logits| up to {np.abs(ref_logits).max():.1f}); smallest top-1/top-2 gap {gap:.3f}")
  assert diff <= LOGITS_TOL
  assert (logits.argmax(-1) == ref_logits.argmax(-1)).all()
  assert forced == ref_new
  assert cached == ref_new
  real_tests.check_dequantization(types.SimpleNamespace(path=path))


# -- by hand: the whole model, one model per process ----------------------------------------

def _tf_main(out_dir, dtype):
  """A transformers process (eager, in `dtype`): the ids (transformers' tokenizer), its
  logits and its greedy tokens."""
  out_dir, path = pathlib.Path(out_dir), cached_file()
  t0 = time.perf_counter()
  ids = stdlib_ids(tf_tokenizer(path), FULL_T)
  logits, new = tf_reference(path, ids, FULL_PROMPT, FULL_NEW, getattr(torch, dtype))
  np.save(out_dir / f"tf_{dtype}.npy", logits)
  (out_dir / f"tf_{dtype}.json").write_text(json.dumps(
      {"ids": ids, "new": new, "seconds": time.perf_counter() - t0}))


def _ours_main(out_dir):
  """Our process (float32): logits over the same ids, the forced argmax after
  transformers' greedy tokens, our cached greedy decode."""
  out_dir = pathlib.Path(out_dir)
  ref = json.loads((out_dir / "tf_float32.json").read_text())
  t0 = time.perf_counter()
  ckpt = checkpoints.load(NAME)
  load_s = time.perf_counter() - t0
  logits, forced, cached, gap = our_results(ckpt, ref["ids"], FULL_PROMPT, ref["new"])
  np.save(out_dir / "ours.npy", logits)
  (out_dir / "ours.json").write_text(json.dumps(
      {"load_s": load_s, "float32": {"forced": forced, "cached": cached, "gap": gap}}))
  print(f"our load {load_s:.1f} s")


@needs_file
@pytest.mark.skipif(os.environ.get("ATTNPREC_FULL_PARITY") != "1",
                    reason="by hand: ATTNPREC_FULL_PARITY=1 (two processes, one after the "
                           "other, of up to ~14 GB; ~7 min)")
def test_full_model_by_hand(tmp_path):
  """The whole model against transformers in float32, as for the other shipped models."""
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  for args in (["tf", "float32"], ["ours"]):
    t0 = time.perf_counter()
    subprocess.run([sys.executable, __file__, *args, str(tmp_path)], cwd=ROOT, env=env,
                   check=True, timeout=3600)
    print(f"{' '.join(args)}: {time.perf_counter() - t0:.0f} s")
  ours = json.loads((tmp_path / "ours.json").read_text())["float32"]
  ref = json.loads((tmp_path / "tf_float32.json").read_text())["new"]
  a, b = np.load(tmp_path / "ours.npy"), np.load(tmp_path / "tf_float32.npy")
  diff = float(np.abs(a - b).max())
  print(f"{NAME}, all blocks: max abs logit diff over {FULL_T} tokens {diff:.2e} (|logits| "
        f"up to {np.abs(b).max():.1f}), argmax agreement "
        f"{float((a.argmax(-1) == b.argmax(-1)).mean()):.3f}; greedy {FULL_NEW} tokens: "
        f"forced {ours['forced'] == ref}, cached {ours['cached'] == ref} (smallest "
        f"top-1/top-2 gap {ours['gap']:.3f})")
  assert diff <= LOGITS_TOL
  assert (a.argmax(-1) == b.argmax(-1)).all()
  assert ours["forced"] == ref == ours["cached"]


if __name__ == "__main__":       # the processes of test_full_model_by_hand
  if sys.argv[1] == "tf":
    _tf_main(sys.argv[3], sys.argv[2])
  else:
    _ours_main(sys.argv[2])
