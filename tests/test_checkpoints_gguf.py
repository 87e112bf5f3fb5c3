"""GGUF import (attnprec.checkpoints.gguf) on tiny files written with `gguf.GGUFWriter`.

The files are written the way llama.cpp's converter writes a llama model: HF tensors with
the q/k rows permuted for interleaved RoPE (llama.cpp's `permute`, copied below). Checks:
* an F32 file imports to exactly (bitwise) the params of the HF-layout source;
* a file with quantized tensors (F16, BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1) gives the
  logits transformers computes from the same GGUF (independent loader and model):
  max abs 1e-4 in float32 (both sides dequantize the same bytes to the same float32
  weights; the rest is summation order, ~1e-6);
* gguf's NumPy dequantization equals transformers' torch kernels bit for bit;
* errors: truncated / corrupt files, unsupported architecture and tensor types, tensors
  that disagree with the metadata; the tokenizer cache is written atomically.
"""
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from attnprec import checkpoints  # noqa: E402
from attnprec.checkpoints import tokenizer as tokenizer_lib  # noqa: E402
from attnprec.errors import UserError  # noqa: E402

Q = gguf.GGMLQuantizationType
TOL = 1e-4
V, D, F, L, N, K, H = 96, 64, 128, 2, 4, 2, 16
# Quantized files: which tensor gets which type (rows are multiples of 32 values).
QUANT = {"token_embd.weight": Q.F16, "output.weight": Q.BF16, "attn_q.weight": Q.Q8_0,
         "attn_k.weight": Q.Q4_0, "attn_v.weight": Q.Q4_1, "attn_output.weight": Q.Q5_0,
         "ffn_gate.weight": Q.Q5_1, "ffn_up.weight": Q.Q8_0, "ffn_down.weight": Q.Q4_0}
# Relative (Frobenius) quantization error bound per type: a wrong layout gives ~1.4.
REL_ERR = {Q.F16: 1e-3, Q.BF16: 1e-2, Q.Q8_0: 0.01, Q.Q5_0: 0.06, Q.Q5_1: 0.05,
           Q.Q4_0: 0.12, Q.Q4_1: 0.1}


def llama_cpp_permute(w, n_head):
  """llama.cpp convert_hf_to_gguf.py LlamaModel.permute (HF rotate-half -> interleaved)."""
  return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
          .swapaxes(1, 2).reshape(w.shape))


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
  """A random transformers llama and its saved HF directory."""
  torch.manual_seed(0)
  cfg = transformers.LlamaConfig(
      vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
      num_attention_heads=N, num_key_value_heads=K, head_dim=H, rms_norm_eps=1e-5,
      max_position_embeddings=128, tie_word_embeddings=False,
      rope_parameters={"rope_type": "default", "rope_theta": 500.0})
  model = transformers.LlamaForCausalLM(cfg).eval()
  gen = torch.Generator().manual_seed(0)
  with torch.no_grad():
    for name, p in model.named_parameters():
      base = 1.0 if name.endswith("norm.weight") else 0.0
      p.copy_(base + torch.randn(p.shape, generator=gen) / p.shape[-1] ** 0.5)
  directory = tmp_path_factory.mktemp("hf_llama")
  model.save_pretrained(directory)
  return model, directory


def _gguf_tensors(model):
  """{GGUF name: float32 numpy array in llama.cpp layout} of an HF llama."""
  sd = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
  out = {"token_embd.weight": sd["model.embed_tokens.weight"],
         "output_norm.weight": sd["model.norm.weight"],
         "output.weight": sd["lm_head.weight"]}
  names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
           "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
           "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
           "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
  for i in range(L):
    for hf, g in names.items():
      w = sd[f"model.layers.{i}.{hf}.weight"]
      if g == "attn_q":
        w = llama_cpp_permute(w, N)
      elif g == "attn_k":
        w = llama_cpp_permute(w, K)
      out[f"blk.{i}.{g}.weight"] = w
  return out


def write_gguf(path, tensors, *, arch="llama", quantize=False, tokenizer=False,
               raw_types=None):
  w = gguf.GGUFWriter(str(path), arch)
  w.add_context_length(128)
  w.add_block_count(L)
  w.add_embedding_length(D)
  w.add_feed_forward_length(F)
  w.add_head_count(N)
  w.add_head_count_kv(K)
  w.add_rope_dimension_count(H)
  w.add_rope_freq_base(500.0)
  w.add_layer_norm_rms_eps(1e-5)
  w.add_vocab_size(V)
  if tokenizer:
    tokens = ["<|endoftext|>", "Ġ"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens += ["Ġa", "ab", "Ġab"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] + [1] * (len(tokens) - 1))
    w.add_token_merges(["Ġ a", "a b", "Ġa b"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
  for name, x in tensors.items():
    qtype = QUANT.get(name.split(".", 2)[-1] if name.startswith("blk.") else name)
    if name in (raw_types or {}):
      w.add_tensor(name, x, raw_dtype=raw_types[name])        # bytes as given
    elif quantize and qtype is not None:
      w.add_tensor(name, gguf.quants.quantize(x, qtype), raw_dtype=qtype)
    else:
      w.add_tensor(name, x)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  return path


def _tokens():
  return np.random.default_rng(2).integers(0, V, (2, 12)).astype(np.int32)


def test_f32_gguf_equals_hf_source(hf_llama, tmp_path):
  """Permutation undone and every tensor placed: params bitwise equal to the HF import."""
  model, hf_dir = hf_llama
  path = write_gguf(tmp_path / "f32.gguf", _gguf_tensors(model))
  ours, ref = checkpoints.load(path), checkpoints.load(hf_dir)
  assert ours.tokenizer is None            # the file carries none
  assert ours.config == ref.config
  for m, d in ref.params.items():
    for n, v in d.items():
      np.testing.assert_array_equal(np.asarray(ours.params[m][n]), np.asarray(v),
                                    err_msg=f"{m}/{n}")


def test_quantized_gguf_matches_transformers(hf_llama, tmp_path):
  """Quantized tensors of seven types: logits equal transformers' on the same file, and
  each dequantized weight is within its type's quantization error of the source."""
  model, hf_dir = hf_llama
  path = write_gguf(tmp_path / "q.gguf", _gguf_tensors(model), quantize=True)
  ours = checkpoints.load(path)
  src = checkpoints.load(hf_dir)
  ref_model = transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), gguf_file="q.gguf", dtype=torch.float32, attn_implementation="eager")
  with torch.no_grad():
    ref = ref_model(torch.as_tensor(_tokens())).logits.numpy()
  diff = float(np.abs(np.asarray(checkpoints.logits(ours, _tokens())) - ref).max())
  print(f"tiny quantized llama GGUF vs transformers: max abs diff {diff:.2e}")
  assert diff <= TOL
  checked = set()
  for m, d in src.params.items():
    for n, v in d.items():
      a, b = np.asarray(ours.params[m][n]), np.asarray(v)
      rel = np.linalg.norm(a - b) / np.linalg.norm(b)
      leaf = {"embed": "token_embd.weight", "unembed": "output.weight", "attn/q": "attn_q.weight",
              "attn/k": "attn_k.weight", "attn/v": "attn_v.weight", "attn/o": "attn_output.weight",
              "mlp/gate": "ffn_gate.weight", "mlp/up": "ffn_up.weight",
              "mlp/down": "ffn_down.weight"}
      qtype = next((QUANT[g] for k, g in leaf.items() if m.endswith("/" + k)), None)
      if qtype is None:
        np.testing.assert_array_equal(a, b)           # norms stay F32
      else:
        assert rel < REL_ERR[qtype], f"{m}/{n} ({qtype.name}): relative error {rel:.3f}"
        checked.add(qtype)
  assert checked == set(QUANT.values())


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_dequantize_matches_transformers_kernels(qtype):
  """gguf.quants (NumPy, what we use) == transformers' torch dequantization kernels."""
  from transformers.integrations.gguf import dequant as tf_dequant
  x = np.random.default_rng(3).standard_normal((8, 256)).astype(np.float32)
  raw = gguf.quants.quantize(x, qtype)
  ours = gguf.quants.dequantize(raw, qtype).reshape(-1)
  ref = tf_dequant.dequantize(torch.from_numpy(raw.reshape(-1).copy()), int(qtype)).numpy()
  np.testing.assert_array_equal(ours, ref)


def test_tokenizer_cache_is_atomic_and_reused(hf_llama, tmp_path, monkeypatch):
  """The built tokenizer is cached under $ATTNPREC_CACHE and reused; a failed cache write
  leaves no entry and no temporary directory behind (and the load still succeeds)."""
  monkeypatch.setenv("ATTNPREC_CACHE", str(tmp_path / "cache"))
  model, _ = hf_llama
  path = write_gguf(tmp_path / "tok.gguf", _gguf_tensors(model), tokenizer=True)

  def broken_save(self, directory):
    (directory / "tokenizer.json").write_text("{")
    raise OSError("disk full")

  with monkeypatch.context() as m:        # a failed cache write does not fail the load
    m.setattr(tokenizer_lib.Tokenizer, "save", broken_save)
    assert checkpoints.load(path).tokenizer.encode("ab") == [29]
  assert os.listdir(tmp_path / "cache/gguf") == []          # no partial entry, no temp dir

  first = checkpoints.load(path).tokenizer
  entries = os.listdir(tmp_path / "cache/gguf")
  assert len(entries) == 1 and ".tmp-" not in entries[0]
  calls = []
  monkeypatch.setattr(tokenizer_lib.Tokenizer, "from_gguf_metadata",
                      classmethod(lambda cls, *a, **k: calls.append(1)))
  second = checkpoints.load(path).tokenizer                  # from the cache
  assert calls == []
  assert first.encode("ab ab a") == second.encode("ab ab a") == [29, 30, 28]
  assert second.decode(second.encode("ab ab a")) == "ab ab a"


def test_dequantized_params_cache(hf_llama, tmp_path, monkeypatch):
  """Large files keep their converted float32 params in the cache (one .npy each); the
  second load reads them instead of dequantizing and gives bitwise the same params (and
  the same bf16 cast); a failed write leaves no entry and no temporary directory; a
  damaged entry is rebuilt."""
  from attnprec.checkpoints import gguf as gguf_lib
  from attnprec.checkpoints.gguf_reader import GGUFFile
  monkeypatch.setenv("ATTNPREC_CACHE", str(tmp_path / "cache"))
  model, _ = hf_llama
  path = write_gguf(tmp_path / "q.gguf", _gguf_tensors(model), quantize=True)
  def entries():
    root = tmp_path / "cache/gguf"
    return sorted(e for e in os.listdir(root) if ".params" in e) if root.is_dir() else []

  fresh = checkpoints.load(path)                    # below the size limit: not cached
  assert entries() == []
  monkeypatch.setattr(gguf_lib, "PARAMS_CACHE_MIN_BYTES", 0)

  with monkeypatch.context() as m:
    m.setattr(np, "save", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    checkpoints.load(path)
  assert entries() == []
  first = checkpoints.load(path)
  assert len(entries()) == 1 and ".tmp-" not in entries()[0]

  def no_dequantizing(self, name):
    raise AssertionError(f"dequantized {name} although the params are cached")

  with monkeypatch.context() as m:
    m.setattr(GGUFFile, "tensor", no_dequantizing)
    second = checkpoints.load(path)
    second_bf16 = checkpoints.load(path, param_dtype="bfloat16")
  for ckpt in (first, second):
    for mod, d in fresh.params.items():
      for n, v in d.items():
        np.testing.assert_array_equal(np.asarray(ckpt.params[mod][n]), np.asarray(v))
  w = fresh.params["decoder/layer_0/attn/q"]["w"]
  got = second_bf16.params["decoder/layer_0/attn/q"]["w"]
  assert got.dtype == np.dtype("bfloat16")
  np.testing.assert_array_equal(np.asarray(got), np.asarray(w).astype(got.dtype))
  entry = tmp_path / "cache/gguf" / entries()[0]
  next(entry.glob("*.npy")).write_bytes(b"not an array")         # damaged: rebuilt
  again = checkpoints.load(path)
  np.testing.assert_array_equal(np.asarray(again.params["decoder/embed"]["embeddings"]),
                                np.asarray(fresh.params["decoder/embed"]["embeddings"]))
  assert len(entries()) == 1
  # a tensor replaced by a lower-precision copy (valid .npy, same shape): rebuilt, never
  # loaded as the model's float32 weights
  entry = tmp_path / "cache/gguf" / entries()[0]
  npy = entry / "decoder.embed.embeddings.npy"
  np.save(npy, np.load(npy).astype(np.float16))
  again = checkpoints.load(path)
  np.testing.assert_array_equal(np.asarray(again.params["decoder/embed"]["embeddings"]),
                                np.asarray(fresh.params["decoder/embed"]["embeddings"]))
  assert np.load(entry / "decoder.embed.embeddings.npy").dtype == np.float32


# ----------------------------------------------------------------------------- errors
def test_error_truncated_and_corrupt(hf_llama, tmp_path):
  model, _ = hf_llama
  path = write_gguf(tmp_path / "t.gguf", _gguf_tensors(model))
  data = path.read_bytes()
  path.write_bytes(data[: len(data) - 1000])
  with pytest.raises(UserError, match=r"t.gguf is not a valid GGUF file: tensor "
                                      r"'.*' ends at byte .*truncated"):
    checkpoints.load(path)
  path.write_bytes(data[:300])
  with pytest.raises(UserError, match="ends inside its header"):
    checkpoints.load(path)
  path.write_bytes(b"GGML" + data[4:])
  with pytest.raises(UserError, match="magic"):
    checkpoints.load(path)
  with pytest.raises(UserError, match="does not exist"):
    checkpoints.load(tmp_path / "missing.gguf")


def test_error_unsupported_architecture_and_type(hf_llama, tmp_path):
  model, _ = hf_llama
  tensors = _gguf_tensors(model)
  path = write_gguf(tmp_path / "arch.gguf", tensors, arch="mamba")
  with pytest.raises(UserError, match=r"unsupported GGUF architecture 'mamba'; supported: "
                                      r"llama, qwen2, gemma, gemma2, gemma3"):
    checkpoints.load(path)
  raw = np.zeros((F, D // 32 * 18), np.uint8)               # IQ4_NL bytes
  tensors = dict(tensors, **{"blk.0.ffn_up.weight": raw})
  path = write_gguf(tmp_path / "iq.gguf", tensors, raw_types={"blk.0.ffn_up.weight": Q.IQ4_NL})
  with pytest.raises(UserError, match=r"'blk.0.ffn_up.weight' in .*iq.gguf is stored as "
                                      r"IQ4_NL, which is not supported; supported GGUF "
                                      r"tensor types: F32, F16, BF16, Q8_0"):
    checkpoints.load(path)


def test_error_tensor_disagrees_with_metadata(hf_llama, tmp_path):
  model, _ = hf_llama
  tensors = _gguf_tensors(model)
  tensors["blk.1.ffn_down.weight"] = tensors["blk.1.ffn_down.weight"][:, :96]
  path = write_gguf(tmp_path / "shape.gguf", tensors)
  with pytest.raises(UserError, match=r"'blk.1.ffn_down.weight' in .*shape.gguf has shape "
                                      r"\(64, 96\), but the model config expects \(64, 128\)"):
    checkpoints.load(path)
  del tensors["blk.1.ffn_down.weight"]
  path = write_gguf(tmp_path / "missing.gguf", tensors)
  with pytest.raises(UserError, match=r"missing 1 tensor.*decoder/layer_1/mlp/down/w"):
    checkpoints.load(path)


# Byte-level vocabulary whose merges cross digit, space and punctuation boundaries, so
# each pre-tokenizer's split shows in the ids (with single bytes only, all would agree).
BL_MERGES = ["3 4", "1 2", "12 3", "Ġ 1", "( a", "(a b", "Ġ a", "a b", "Ġa b", "' s",
             "Ġ Ġ", "Ċ Ċ"]
BL_TOKENS = (["<|endoftext|>"] + [tokenizer_lib.bytes_to_unicode()[b] for b in range(256)]
             + ["".join(m.split(" ")) for m in BL_MERGES])
BL_TEXT = "x 1234567 (ab 's  ab\n\n 12 34<|endoftext|>(ab123 abab  "


def _byte_level(pre):
  return tokenizer_lib.Tokenizer.from_gguf_metadata({
      "general.architecture": "llama", "tokenizer.ggml.model": "gpt2",
      "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": BL_TOKENS,
      "tokenizer.ggml.token_type": [3] + [1] * (len(BL_TOKENS) - 1),
      "tokenizer.ggml.merges": BL_MERGES})


def test_byte_level_pre_tokenizers_differ():
  """The four supported splits give four different tokenizations; `smollm` (llama.cpp's
  pre-tokenizer for SmolLM) never merges digits; an unknown one is an error."""
  ids = {pre: tuple(_byte_level(pre).encode(BL_TEXT))
         for pre in ("default", "qwen2", "llama-bpe", "smollm")}
  assert len(set(ids.values())) == 4
  digits = _byte_level("smollm").encode("1234")
  assert [BL_TOKENS[i] for i in digits] == ["1", "2", "3", "4"]
  with pytest.raises(UserError, match="unsupported byte-level pre-tokenizer"):
    _byte_level("tekken")


@pytest.mark.parametrize("pre", ["default", "qwen2", "llama-bpe"])
def test_byte_level_pre_tokenizers_match_transformers(pre, tmp_path):
  """Byte-level BPE split by each `tokenizer.ggml.pre` regex: the ids transformers' GGUF
  tokenizer gives for the same file. (transformers has no digit split for `smollm`; the
  real SmolLM2 vocabulary has no multi-digit token, so its ids agree there anyway.)"""
  merges, tokens = BL_MERGES, BL_TOKENS
  w = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "llama")
  for add, value in ((w.add_block_count, 1), (w.add_context_length, 64),
                     (w.add_embedding_length, 32), (w.add_feed_forward_length, 64),
                     (w.add_head_count, 2), (w.add_head_count_kv, 2)):
    add(value)
  w.add_tokenizer_model("gpt2")
  w.add_tokenizer_pre(pre)
  w.add_token_list(tokens)
  w.add_token_types([3] + [1] * (len(tokens) - 1))
  w.add_token_merges(merges)
  w.add_bos_token_id(0)
  w.add_eos_token_id(0)
  w.add_add_bos_token(False)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()
  from attnprec.checkpoints.gguf_reader import GGUFFile
  ours = tokenizer_lib.Tokenizer.from_gguf_metadata(GGUFFile(tmp_path / "tok.gguf").metadata)
  ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf")
  text = BL_TEXT
  assert ours.encode(text) == ref(text)["input_ids"]
  assert ours.decode(ours.encode(text)) == text.replace("<|endoftext|>", "")
