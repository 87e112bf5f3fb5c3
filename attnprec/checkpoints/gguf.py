"""Import a GGUF file (llama.cpp's format): metadata -> ModelConfig, tensors -> params.

    config, params, tokenizer = load_gguf("model.gguf", param_dtype="float32")

Architectures: llama, qwen2, gemma, gemma2, gemma3 (`general.architecture`). Tensors are
dequantized to float32 with `gguf.quants.dequantize` (types: see
`gguf_reader.SUPPORTED_TYPES`), then cast to the param dtype. Conversions llama.cpp's
converter applied, undone here (they reproduce transformers' GGUF loader exactly):

* llama: `attn_q` / `attn_k` rows are permuted for llama.cpp's interleaved RoPE; we restore
  the HF "rotate-half" order: `w.reshape(n, H // 2, 2, D).swapaxes(1, 2).reshape(n * H, D)`
  (n = query heads for q, kv heads for k).
* gemma family: every `*norm.weight` holds (1 + w); we store w (subtracting 1 in float32) so
  the config is the same as for the HF checkpoint (`norm_plus_one=True`).
* gemma3: the file lacks the local RoPE base, the layer pattern and the query scale; they
  are filled in from the architecture's fixed values (local base 1e4, every 6th layer
  global, `query_pre_attn_scalar` 256), as transformers' Gemma 3 defaults do.

Caching: the header is parsed in < 0.5 s. Dequantizing takes ~1.5 s (SmolLM2) / ~3 s
(Gemma 3), so those weights are not cached; files of `PARAMS_CACHE_MIN_BYTES` or more
(Qwen2.5-Coder 0.5B: 12 s idle, ~130 s on a loaded machine) keep their converted float32
params as one `.npy` per parameter in `<cache_dir>/gguf/<key>.params/` and later loads
memory-map those. The tokenizer is always cached: building Gemma 3's (merges rebuilt from
262k tokens) takes ~6 s, loading the cached one ~1 s. Cache entries (`<cache_dir>/gguf/
<key>/`, `<key>.params/`) are keyed by the file's absolute path, size and mtime, and are
built in a temporary directory (locked while it is written) and renamed into place (never
half-written); a killed build's directory is removed by a later start
(`cache.remove_stale_temporaries`).
"""
import hashlib
import json
import os
import pathlib
import shutil
from typing import Optional, Tuple

import numpy as np

from attnprec import layout, readback
from attnprec.diskcache import cache_dir, locked_temporary_dir
from attnprec.checkpoints.gguf_reader import GGUFFile
from attnprec.checkpoints.hf_config import period
from attnprec.checkpoints.params import ParamBuilder
from attnprec.checkpoints.tokenizer import Tokenizer
from attnprec.config import ModelConfig
from attnprec.errors import UserError

SUPPORTED = ("llama", "qwen2", "gemma", "gemma2", "gemma3")
_GEMMA = ("gemma", "gemma2", "gemma3")
_CACHE_VERSION = "1"
PARAMS_CACHE_MIN_BYTES = 256 << 20


def _f32(x) -> float:
  """A float32 metadata value as the decimal it was written from (1e-05, not 9.99e-06)."""
  return float(str(np.float32(x)))


def config_from_gguf(meta: dict, embed_shape: Tuple[int, int], has_output: bool,
                     origin: str) -> ModelConfig:
  """The ModelConfig a GGUF's metadata describes (see the module docstring)."""
  arch = meta.get("general.architecture")
  if arch not in SUPPORTED:
    raise UserError(f"{origin}: unsupported GGUF architecture {arch!r}; supported: "
                    f"{', '.join(SUPPORTED)}.")

  def get(key, default=None):
    v = meta.get(f"{arch}.{key}", default)
    if v is None:
      raise UserError(f"{origin} has no {arch}.{key} in its metadata.")
    return v

  d_model, heads = int(get("embedding_length")), int(get("attention.head_count"))
  kv_heads = int(get("attention.head_count_kv", heads))
  head_dim = int(get("attention.key_length", d_model // heads))
  num_layers = int(get("block_count"))
  rot = meta.get(f"{arch}.rope.dimension_count")
  if rot is not None and int(rot) != head_dim:
    raise UserError(f"{origin}: partial rotary embeddings (rope.dimension_count={rot} < "
                    f"head dim {head_dim}) are not supported.")
  if embed_shape[1] != d_model:
    raise UserError(f"{origin}: tensor 'token_embd.weight' has shape {embed_shape}, but "
                    f"{arch}.embedding_length is {d_model}; the file is inconsistent.")
  scaling = meta.get(f"{arch}.rope.scaling.type", "none")
  if scaling not in ("none", "linear"):
    raise UserError(f"{origin}: unsupported RoPE scaling {scaling!r}; supported: none, linear.")
  rope_scale = _f32(meta.get(f"{arch}.rope.scaling.factor", 1.0)) if scaling == "linear" else 1.0

  gemma = arch in _GEMMA
  kw = dict(
      vocab_size=int(embed_shape[0]), d_model=d_model, num_layers=num_layers,
      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
      mlp_hidden=int(get("feed_forward_length")),
      activation="gelu_tanh" if gemma else "silu",
      norm_eps=_f32(get("attention.layer_norm_rms_epsilon")),
      norm_plus_one=gemma, embed_scale=gemma, tie_embeddings=not has_output,
      qkv_bias=arch == "qwen2", rope_base=_f32(get("rope.freq_base", 10_000.0)),
      rope_scale=rope_scale, max_seq_len=int(get("context_length", 8192)))
  if arch in ("gemma2", "gemma3"):
    # llama.cpp's query scale: 1/sqrt(head dim), except the 27B models (46 / 62 layers)
    # which use 1/sqrt(d_model / heads); transformers' query_pre_attn_scalar agrees.
    big = num_layers == (46 if arch == "gemma2" else 62)
    scalar = d_model / heads if big else float(head_dim)
    if arch == "gemma3":
      # Newer llama.cpp writes the pattern: a period, or one is-sliding flag per layer.
      swa = meta.get("gemma3.attention.sliding_window_pattern", 6)
      if np.ndim(swa):
        pattern = period(["local" if s else "global" for s in swa])
      else:
        pattern = ("local",) * (int(swa) - 1) + ("global",)
    else:
      pattern = ("local", "global")
    kw.update(post_attn_norm=True, post_mlp_norm=True, query_scale=scalar ** -0.5,
              sliding_window=int(get("attention.sliding_window")), layer_pattern=pattern)
  if arch == "gemma2":
    kw.update(attn_logit_soft_cap=_f32(get("attn_logit_softcapping", 50.0)),
              final_logit_soft_cap=_f32(get("final_logit_softcapping", 30.0)))
  if arch == "gemma3":
    kw.update(qk_norm=True, rope_base_local=10_000.0)
  if scaling == "linear" and "local" in kw.get("layer_pattern", ()) and arch != "gemma3":
    raise UserError(f"{origin}: linear RoPE scaling with sliding-window layers is only "
                    f"supported for gemma3.")
  return ModelConfig(**kw)


def tensor_map(config: ModelConfig) -> dict:
  """{GGUF name: (our module, our param name, transpose?)}, from the layout table."""
  return {name: (p.module(i), p.name, p.transpose)
          for name, (p, i) in layout.tensor_map(config, "gguf").items()}


def unpermute_qk(w_RxD: np.ndarray, n_heads: int) -> np.ndarray:
  """Undo llama.cpp's q/k row permutation (interleaved RoPE -> HF rotate-half)."""
  R, D = w_RxD.shape
  return w_RxD.reshape(n_heads, R // n_heads // 2, 2, D).swapaxes(1, 2).reshape(R, D)


def load_gguf(path, *, param_dtype="float32", tokenizer: bool = True
              ) -> Tuple[ModelConfig, dict, Optional[Tokenizer]]:
  """(config, params {module: {name: np.ndarray}}, tokenizer) of a GGUF file.

  The tokenizer is None when `tokenizer=False` or the file carries none.
  """
  path = pathlib.Path(path)
  f = GGUFFile(path)
  arch = f.metadata.get("general.architecture")
  if "token_embd.weight" not in f.tensors:
    raise UserError(f"{path} has no 'token_embd.weight' tensor; it is not a decoder LM GGUF.")
  config = config_from_gguf(f.metadata, f.tensors["token_embd.weight"].shape,
                            "output.weight" in f.tensors, str(path))
  mapping = layout.tensor_map(config, "gguf")
  unexpected = sorted(set(f.tensors) - set(mapping))
  if unexpected:
    raise UserError(f"{path} holds tensor(s) {unexpected[:5]} that the {arch} model its "
                    f"metadata describes has no place for (an unsupported variant).")
  cached = _params_entry(path) if f.size >= PARAMS_CACHE_MIN_BYTES else None
  params = None
  if cached is not None and (cached / "params.json").is_file():
    try:
      params = _read_params(cached, config, param_dtype, str(path))
    except (OSError, ValueError, KeyError):   # an entry from another version: rebuild it
      shutil.rmtree(cached, ignore_errors=True)
  if params is None:
    builder = ParamBuilder(config, "float32" if cached is not None else param_dtype,
                           origin=str(path))
    for name, (p, layer) in mapping.items():
      if name not in f.tensors:
        continue                       # finish() reports everything missing at once
      w = f.tensor(name)
      if arch == "llama" and p.key in ("attn/q/w", "attn/k/w"):
        n = config.num_heads if p.key == "attn/q/w" else config.num_kv_heads
        if w.ndim != 2 or w.shape[0] != n * config.head_dim:
          raise UserError(f"Tensor {name!r} in {path} has shape {w.shape}; expected "
                          f"({n * config.head_dim}, {config.d_model}).")
        w = unpermute_qk(w, n)
      if arch in _GEMMA and p.norm:
        w = w - np.float32(1.0)
      builder.put(p.module(layer), p.name, w, source=name, file=str(path),
                  transpose=p.transpose)
    params = builder.finish()
    if cached is not None:
      _write_params(cached, params)
      params = _cast(params, config, param_dtype, str(path))
  has_tokenizer = tokenizer and "tokenizer.ggml.tokens" in f.metadata
  return config, params, (_cached_tokenizer(f) if has_tokenizer else None)


def _cache_key(path: pathlib.Path) -> str:
  st = path.stat()
  ident = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{_CACHE_VERSION}"
  return f"{path.stem[:40]}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _params_entry(path: pathlib.Path) -> pathlib.Path:
  return cache_dir("gguf") / (_cache_key(path) + ".params")


def _npy_name(module: str, name: str) -> str:
  return f"{module.replace('/', '.')}.{name}.npy"


def _write_params(entry: pathlib.Path, params: dict) -> None:
  """The float32 params as one .npy each plus params.json, built in a temporary
  directory and renamed onto `entry` (another process may win the race: fine)."""
  try:
    with locked_temporary_dir(entry.name + ".tmp-", entry.parent) as tmp:
      index = {}
      for module, d in params.items():
        for name, w in d.items():
          np.save(tmp / _npy_name(module, name), w, allow_pickle=False)
          index.setdefault(module, []).append(name)
      (tmp / "params.json").write_text(json.dumps(index), encoding="utf-8")
      os.rename(tmp, entry)
  except OSError:
    pass                              # another process won the race, or a read-only cache


def _read_params(entry: pathlib.Path, config: ModelConfig, param_dtype, origin: str
                 ) -> dict:
  """The cached params (memory-mapped), checked against the config like a fresh load."""
  index = json.loads((entry / "params.json").read_text(encoding="utf-8"),
                     object_pairs_hook=readback.unique_keys)
  builder = ParamBuilder(config, param_dtype, origin=origin)
  for module, names in index.items():
    for name in names:
      w = np.load(entry / _npy_name(module, name), mmap_mode="r", allow_pickle=False)
      if w.dtype != np.float32:     # the cache writes float32 only: an entry edited since
        raise ValueError(f"cached {module}/{name} is {w.dtype}, not float32")
      builder.put(module, name, w, source=f"cached {module}/{name}", file=str(entry))
  return builder.finish()


def _cast(params: dict, config: ModelConfig, param_dtype, origin: str) -> dict:
  builder = ParamBuilder(config, param_dtype, origin=origin)
  for module, d in params.items():
    for name, w in d.items():
      builder.put(module, name, w, source=f"{module}/{name}")
  return builder.finish()


def _cached_tokenizer(f: GGUFFile) -> Tokenizer:
  """The file's tokenizer, from the cache or built and cached (atomically)."""
  root = cache_dir("gguf")
  entry = root / _cache_key(pathlib.Path(f.path))
  if (entry / "tokenizer_meta.json").is_file():
    try:
      return Tokenizer.load(entry)
    except Exception:                 # an entry from another version: rebuild it
      shutil.rmtree(entry, ignore_errors=True)
  tok = Tokenizer.from_gguf_metadata(f.metadata, origin=f.path)
  try:
    with locked_temporary_dir(entry.name + ".tmp-", root) as tmp:
      tok.save(tmp)
      os.rename(tmp, entry)
  except OSError:
    pass                              # another process won the race, or a read-only cache
  return tok
