"""Non-finite values are reported, never compared: NaN weights are refused when a model is
loaded (naming the tensor); logits holding NaN/Inf raise `NonFiniteError` from
`checkpoints.logits` / `checkpoints.generate` (or are flagged with check_finite=False),
and the decode runner exits 2 naming the step and the stage that overflowed, printing no
agreement figure. Models: tiny GGUF files written here with `gguf.GGUFWriter`."""
import contextlib
import dataclasses
import io
import os

import numpy as np
import pytest

import gguf
from attnprec import layout
from attnprec.config import ModelConfig

CONFIG = ModelConfig(vocab_size=31, d_model=16, num_layers=2, num_heads=2, num_kv_heads=1,
                     head_dim=8, mlp_hidden=32, activation="silu", norm_eps=1e-5,
                     norm_plus_one=False, embed_scale=False, tie_embeddings=True,
                     qkv_bias=False, rope_base=10000.0, max_seq_len=64)
TOKENS = (["<|endoftext|>", "\u0120"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
          + ["\u0120a", "ab", "\u0120ab"])


def tiny_gguf(path, edit=None, seed=0):
  """A random llama GGUF of CONFIG with a byte-level tokenizer; `edit` maps GGUF tensor
  names to functions applied to them (NaN weights, weights scaled past float16)."""
  rng = np.random.default_rng(seed)
  c = CONFIG
  w = gguf.GGUFWriter(str(path), "llama")
  w.add_context_length(c.max_seq_len)
  w.add_block_count(c.num_layers)
  w.add_embedding_length(c.d_model)
  w.add_feed_forward_length(c.mlp_hidden)
  w.add_head_count(c.num_heads)
  w.add_head_count_kv(c.num_kv_heads)
  w.add_rope_dimension_count(c.head_dim)
  w.add_rope_freq_base(c.rope_base)
  w.add_layer_norm_rms_eps(c.norm_eps)
  w.add_vocab_size(c.vocab_size)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre("smollm")
  w.add_token_list(TOKENS)
  w.add_token_types([3] + [1] * (len(TOKENS) - 1))
  w.add_token_merges(["\u0120 a", "a b", "\u0120a b"])
  w.add_bos_token_id(0)
  w.add_eos_token_id(0)
  shapes = {m: {n: s.shape for n, s in d.items()}
            for m, d in __import__("attnprec.model", fromlist=["x"]).param_shapes(c).items()}
  for name, (p, i) in layout.tensor_map(c, "gguf").items():
    shape = shapes[p.module(i)][p.name]
    if p.norm:
      x = np.ones(shape, np.float32)
    else:
      x = (rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32)
    if p.transpose:
      x = np.ascontiguousarray(x.T)
    if edit and name in edit:
      x = np.asarray(edit[name](x), np.float32)
    w.add_tensor(name, x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


# ----------------------------------------------------------------------------- fixtures
def _nan_every_7th(w):
  return np.where(np.arange(w.size).reshape(w.shape) % 7 == 0, np.nan, w)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
  """{'ok', 'nan', 'big'}: paths of tiny GGUF files; 'big' has layer 0's MLP down
  projection scaled by 1e6, so its output passes float16's 65504 (float32 is fine)."""
  d = tmp_path_factory.mktemp("nonfinite")
  return {"ok": tiny_gguf(d / "ok.gguf"),
          "nan": tiny_gguf(d / "nan.gguf", edit={"blk.1.ffn_up.weight": _nan_every_7th}),
          "big": tiny_gguf(d / "big.gguf",
                           edit={"blk.0.ffn_down.weight": lambda w: w * 1e6})}


@pytest.fixture(autouse=True)
def _cache(tmp_path_factory, monkeypatch):
  """Tokenizer and compilation caches in a temporary directory; jax's compilation cache
  setting restored afterwards (the decode runner turns it on)."""
  import jax
  from jax._src import compilation_cache
  monkeypatch.setenv("ATTNPREC_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
  before = jax.config.jax_compilation_cache_dir
  yield
  if jax.config.jax_compilation_cache_dir != before:
    jax.config.update("jax_compilation_cache_dir", before)
    compilation_cache.reset_cache()


# ----------------------------------------------------------------------------- loading
def test_load_refuses_nonfinite_weights_naming_the_tensor(models, tmp_path):
  from attnprec import checkpoints
  from attnprec.checkpoints import trained
  from attnprec.errors import UserError
  with pytest.raises(UserError, match=r"decoder/layer_1/mlp/up/w \(74 NaN and 0 Inf of "
                                      r"512 values\)"):
    checkpoints.load(models["nan"])
  # float32 values beyond float16's range become Inf when converted: refused too.
  with pytest.raises(UserError, match=r"decoder/layer_0/mlp/down/w \(0 NaN and \d+ Inf"):
    checkpoints.load(models["big"], param_dtype="float16")
  # a train run (params.npz) goes through the same check
  run = tmp_path / "run"
  run.mkdir()
  src = trained.SHIPPED["recall-tiny"]
  for f in ("model.json", "task.json"):
    (run / f).write_bytes(open(os.path.join(src, f), "rb").read())
  with np.load(os.path.join(src, "params.npz")) as z:
    params = dict(z)
  params["decoder/embed//embeddings"][3, :2] = [np.inf, np.nan]
  np.savez(run / "params.npz", **params)
  with pytest.raises(UserError, match=r"decoder/embed/embeddings \(1 NaN and 1 Inf"):
    checkpoints.load(run)


# ----------------------------------------------------------------------------- the API
def test_api_raises_on_nonfinite_logits_and_names_the_stage(models):
  from attnprec import checkpoints
  from attnprec.errors import NonFiniteError
  from attnprec.precision import Precision
  big = checkpoints.load(models["big"])
  fp16 = Precision(dtype="float16")
  ok = checkpoints.generate(big, "ab a", max_new_tokens=3)     # float32: finite
  assert ok.finite == [True] and len(ok.tokens[0]) == 3
  # the two prompts of the flagged call below: one compiled fp16 program for both calls
  with pytest.raises(NonFiniteError, match=r"NaN at decode step 0 of prompt 0\) under "
                                           r"dtype=float16") as e:
    checkpoints.generate(big, ["ab a", "b"], max_new_tokens=3, precision=fp16)
  assert e.value.stage == "layer 0 MLP (down projection)"
  assert "65504" in str(e.value) and "agreement" in str(e.value)
  flagged = checkpoints.generate(big, ["ab a", "b"], max_new_tokens=3, precision=fp16,
                                 check_finite=False)
  assert flagged.finite == [False, False]
  with pytest.raises(NonFiniteError, match=r"sequence 0, position 0; 93 NaN") as e:
    checkpoints.logits(big, np.array([[1, 2, 3]]), precision=fp16)
  assert e.value.stage == "layer 0 MLP (down projection)"
  raw = checkpoints.logits(big, np.array([[1, 2, 3]]), precision=fp16, check_finite=False)
  assert np.isnan(np.asarray(raw)).all()


# ----------------------------------------------------------------------------- runner
def _decode(argv):
  import contextlib as cl
  import importlib.util

  import gin
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location("runner_decode_nf",
                                                os.path.join(root, "runners", "decode.py"))
  runner = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(runner)
  out, err = io.StringIO(), io.StringIO()
  gin.clear_config()
  try:
    with cl.redirect_stdout(out), cl.redirect_stderr(err):
      rc = runner.main(argv)
  finally:
    gin.clear_config()
  return rc, out.getvalue(), err.getvalue()


def _decode_args(model, run_dir, dtype):
  return ["--gin_file=experiments/smollm2.gin", f"--gin.generate_text.model='{model}'",
          f"--gin.decode/precision.dtype='{dtype}'", "--gin.generate_text.max_new_tokens=3",
          "--gin.generate_text.prompt='ab a'", f"--run_dir={run_dir}"]


def test_decode_runner_refuses_nan_weights_and_fp16_overflow(models, tmp_path):
  run_dir = tmp_path / "run"
  rc, out, err = _decode(_decode_args(models["nan"], run_dir, "bfloat16"))
  assert rc == 2 and "Traceback" not in err, err
  assert "holds weights that are not finite: decoder/layer_1/mlp/up/w" in err
  assert not run_dir.exists()

  rc, out, err = _decode(_decode_args(models["big"], run_dir, "float16"))
  assert rc == 2 and "Traceback" not in err, err
  lines = [line for line in err.splitlines() if line.strip()]
  assert len(lines) == 1 and lines[0].startswith("decode: error: The logits of the fp16 "
                                                 "decode were not finite (NaN at step 0)")
  assert "layer 0 MLP (down projection)" in lines[0]
  assert "agreement with" not in out and "continuation" not in out
  assert not (run_dir / "results.json").exists()


def test_template_decode_with_finite_flags_matches_decodings():
  """The recall eval's decode (`checkpoints.finite.decode_with_template`) gives the
  tokens of `decoding.decode_with_template`, plus per-slot finite flags."""
  from attnprec import checkpoints, decoding
  from attnprec.checkpoints import finite
  from attnprec.precision import Precision
  ckpt = checkpoints.load("recall-tiny")
  prompt_BxP, template_BxM, _ = ckpt.task.eval_episode(np.random.default_rng(0), 2, 4, 2)
  lengths_B = np.full((2,), prompt_BxP.shape[1], np.int32)
  kw = dict(config=ckpt.config, precision=Precision(dtype="bfloat16"),
            cache_length=prompt_BxP.shape[1] + template_BxM.shape[1])
  want, answered = decoding.decode_with_template(ckpt.params, prompt_BxP, lengths_B,
                                                 template_BxM, **kw)
  got, got_answered, ok = finite.decode_with_template(ckpt.params, prompt_BxP, lengths_B,
                                                      template_BxM, **kw)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(got_answered), np.asarray(answered))
  assert np.asarray(ok).all() and finite.first_bad(ok) is None
  assert finite.first_bad(np.array([[True, True], [True, False]])) == (1, 1)


def test_stage_finder_runs_through_a_quantized_cache(models, monkeypatch):
  """A precision whose KV cache is int8 is searched as the program that failed ran it: a
  prefill into that cache. NaN injected into what the cache reads back (a scale, as a
  corrupt cache would hold) is named at the layer 0 attention kernel; a finder that ran
  the plain forward (exact keys and values) would find every stage finite."""
  from attnprec import cache as cache_lib
  from attnprec import checkpoints
  from attnprec.checkpoints import finite
  from attnprec.precision import Precision
  ckpt = checkpoints.load(models["ok"])
  int8 = Precision(dtype="bfloat16", kv_cache_k_dtype="int8", kv_cache_v_dtype="int8")
  tokens = np.array([[1, 2, 3, 4]])
  assert finite.first_nonfinite_stage(ckpt.config, ckpt.params, tokens, int8) is None
  real = cache_lib.LayerCache.scales

  def nan_scales(self, storage, **kw):
    out = real(self, storage, **kw)
    return dataclasses.replace(out, k_token_BxKxS=out.k_token_BxKxS * np.float32("nan"))
  monkeypatch.setattr(cache_lib.LayerCache, "scales", nan_scales)
  stage = finite.first_nonfinite_stage(ckpt.config, ckpt.params, tokens, int8)
  assert stage == ("layer 0 attention (attention kernel: QK^T, softmax, weighted values)")
  plain = Precision(dtype="bfloat16")
  assert finite.first_nonfinite_stage(ckpt.config, ckpt.params, tokens, plain) is None


def test_one_error_path_whether_the_logits_were_kept_or_not(models):
  """`serving.nonfinite_error` names the same step, kind and stage from the program's own
  logits (the decode job keeps them) as from a forward pass (the API and the evals keep
  none)."""
  from attnprec import checkpoints
  from attnprec.checkpoints import serving
  from attnprec.errors import NonFiniteError
  from attnprec.precision import Precision
  big = checkpoints.load(models["big"])
  fp16 = Precision(dtype="float16")
  ids = big.tokenizer.encode("ab a")
  messages = set()
  for keep in (True, False):
    plan = serving.plan(big.config, fp16, [ids, ids[:2]], max_new_tokens=3,
                        return_logits=keep)
    out = serving.run(plan, big.params)
    assert out.finite == [False, False]
    assert (out.out.logits_BxMxV is not None) == keep
    e = serving.nonfinite_error(plan, big.params, out, what="the logits of the decode",
                                step="at step {step} of prompt {prompt}")
    assert isinstance(e, NonFiniteError) and e.stage == "layer 0 MLP (down projection)"
    messages.add(str(e))
  (message,) = messages
  assert message.startswith("The logits of the decode were not finite (NaN at step 0 of "
                            "prompt 0) under dtype=float16"), message


def test_require_finite_counts_nan_and_inf_and_passes_finite_arrays():
  """The check the one-off timing scripts run on every output before they report it."""
  import jax.numpy as jnp
  from attnprec.checkpoints.finite import require_finite
  from attnprec.errors import NonFiniteError
  ok = jnp.ones((2, 3), jnp.bfloat16)
  assert require_finite("a form's output", ok) is ok
  bad = np.ones((4, 5), np.float32)
  bad[0, 0], bad[1, 2], bad[3, 4] = np.nan, np.inf, -np.inf
  with pytest.raises(NonFiniteError, match=r"A form's output is not finite \(1 NaN and 2 "
                     r"Inf of 20 values\)"):
    require_finite("a form's output", bad)
  with pytest.raises(NonFiniteError, match=r"\(1 NaN and 0 Inf of 2 values\)"):
    require_finite("x", jnp.array([1.0, jnp.nan], jnp.bfloat16))
