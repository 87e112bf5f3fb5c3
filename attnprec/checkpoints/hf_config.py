"""HF `config.json` -> `ModelConfig`, for llama, qwen2, gemma, gemma2 and gemma3.

Read from the JSON alone (transformers is not needed at run time). Semantics follow
transformers' modeling code (`models/<type>/modeling_<type>.py`), including the class
defaults a `config.json` may leave out:

  | model_type | MLP       | norm      | embed x sqrt(D) | extras                             |
  | llama      | SwiGLU    | w         | no              | untied head by default             |
  | qwen2      | SwiGLU    | w         | no              | q/k/v bias; optional sliding layers |
  | gemma      | GeGLU     | (1 + w)   | yes             | legacy hidden_act "gelu" = tanh    |
  | gemma2     | GeGLU     | (1 + w)   | yes             | pre/post norms, soft-caps 50 / 30, |
  |            |           |           |                 | sliding layers at even indices,    |
  |            |           |           |                 | query scale query_pre_attn_scalar^-1/2 |
  | gemma3     | GeGLU     | (1 + w)   | yes             | QK-norm, 5 local : 1 global,       |
  |            |           |           |                 | local RoPE base 1e4, global 1e6    |

Sliding windows: transformers masks key j for query i unless `j > i - sliding_window`
(`masking_utils.sliding_window_overlay`), exactly our `causal_mask`; the window is copied
as is. `layer_types` (newer configs) wins over the older pattern keys. RoPE: newer configs
hold `rope_parameters` (per layer type for gemma3), older ones `rope_theta`,
`rope_scaling` and `rope_local_base_freq`; only the `default` and `linear` RoPE types
exist in our model.
"""
from typing import Optional

from attnprec.config import ModelConfig
from attnprec.errors import UserError

SUPPORTED = ("llama", "qwen2", "gemma", "gemma2", "gemma3")
ROPE_TYPES = ("default", "linear")
GEMMA = ("gemma", "gemma2", "gemma3")

# transformers' class defaults for keys a config.json may omit.
_DEFAULTS = {
    "llama": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu",
                  rope_theta=10_000.0),
    "qwen2": dict(tie_word_embeddings=False, rms_norm_eps=1e-6, hidden_act="silu",
                  rope_theta=10_000.0, sliding_window=4096, max_window_layers=28),
    "gemma": dict(tie_word_embeddings=True, rms_norm_eps=1e-6, head_dim=256,
                  hidden_act="gelu_pytorch_tanh", rope_theta=10_000.0),
    "gemma2": dict(tie_word_embeddings=True, rms_norm_eps=1e-6, head_dim=256,
                   hidden_activation="gelu_pytorch_tanh", rope_theta=10_000.0,
                   query_pre_attn_scalar=256, sliding_window=4096,
                   attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
    "gemma3": dict(tie_word_embeddings=True, rms_norm_eps=1e-6, head_dim=256,
                   hidden_activation="gelu_pytorch_tanh", rope_theta=1_000_000.0,
                   rope_local_base_freq=10_000.0, query_pre_attn_scalar=256,
                   sliding_window=4096, attn_logit_softcapping=None,
                   final_logit_softcapping=None),
}
_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh",
                "gelu_new": "gelu_tanh", "gelu_tanh": "gelu_tanh", "gelu": "gelu"}
_LAYER_TYPES = {"full_attention": "global", "sliding_attention": "local"}


def model_type(raw: dict) -> str:
  """The architecture family of a config.json (multimodal gemma3 -> its text model)."""
  t = raw.get("model_type")
  if t == "gemma3_text":
    t = "gemma3"
  if t not in SUPPORTED:
    raise UserError(f"Unsupported model_type {t!r} in config.json; supported: "
                    f"{', '.join(SUPPORTED)}.")
  return t


def text_config(raw: dict) -> dict:
  """The text model's settings: gemma3 multimodal configs nest them under text_config."""
  if isinstance(raw.get("text_config"), dict):
    inner = dict(raw["text_config"])
    inner.setdefault("model_type", raw.get("model_type"))
    inner.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", True))
    return inner
  return raw


def config_from_hf(raw: dict, *, origin: str = "config.json") -> ModelConfig:
  """Builds the `ModelConfig` a transformers model with this config.json computes.

  A config.json whose top level is not an object, or whose values have the wrong type or
  range (`num_attention_heads: 0`, `"rms_norm_eps": "x"`), is a UserError naming it."""
  if not isinstance(raw, dict):
    raise UserError(f"{origin} holds a JSON {type(raw).__name__}; an HF config.json is a "
                    f"JSON object (model_type, hidden_size, num_attention_heads, ...).")
  if "text_config" in raw and not isinstance(raw["text_config"], dict):
    raise UserError(f"{origin}: text_config must be a JSON object, got "
                    f"{raw['text_config']!r}.")
  try:
    return _config_from_hf(raw, origin)
  except UserError:
    raise
  except (TypeError, ValueError, KeyError, ZeroDivisionError) as e:
    raise UserError(f"{origin} has a value of the wrong type or range ({type(e).__name__}: "
                    f"{e}); compare it with the model's published config.json.") from None


def _config_from_hf(raw: dict, origin: str) -> ModelConfig:
  family = model_type(raw)
  d = dict(_DEFAULTS[family])
  d.update({k: v for k, v in text_config(raw).items()})

  def need(key):
    if d.get(key) is None:
      raise UserError(f"{origin} has no {key!r}, which a {family} config needs.")
    return positive(key)

  def positive(key):
    value = d[key]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
      raise UserError(f"{origin}: {key} must be a positive integer, got {value!r}.")
    return value

  heads = need("num_attention_heads")
  kv_heads = positive("num_key_value_heads") if d.get("num_key_value_heads") is not None \
      else heads
  head_dim = positive("head_dim") if d.get("head_dim") is not None \
      else need("hidden_size") // heads
  if head_dim <= 0:
    raise UserError(f"{origin}: hidden_size={d['hidden_size']} is smaller than "
                    f"num_attention_heads={heads}; set head_dim.")
  num_layers = need("num_hidden_layers")
  for flag in ("attention_bias", "mlp_bias", "use_bidirectional_attention"):
    if d.get(flag):
      raise UserError(f"{origin} sets {flag}=true, which our decoder does not implement "
                      f"(supported: causal attention without o-projection or MLP biases).")

  act_key = "hidden_act" if family in ("llama", "qwen2", "gemma") else "hidden_activation"
  act_name = d.get(act_key) or d.get("hidden_act")
  if family == "gemma" and act_name == "gelu":
    act_name = "gelu_pytorch_tanh"   # transformers' legacy fix for Gemma 1 configs
  if act_name not in _ACTIVATIONS:
    raise UserError(f"{origin}: unsupported activation {act_key}={act_name!r}; supported: "
                    f"{', '.join(_ACTIVATIONS)}.")

  kinds = _layer_kinds(d, family, num_layers, origin)
  global_rope, local_rope = _rope(d, family, origin)
  if "local" in kinds and family in ("llama", "qwen2") and global_rope[1] != 1.0:
    raise UserError(f"{origin}: linear RoPE scaling together with sliding-window layers is "
                    f"not supported for {family} (our local layers are unscaled).")
  gemma = family in GEMMA
  return ModelConfig(
      vocab_size=need("vocab_size"), d_model=need("hidden_size"), num_layers=num_layers,
      num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
      mlp_hidden=need("intermediate_size"), activation=_ACTIVATIONS[act_name],
      norm_eps=_float(d, "rms_norm_eps", origin), norm_plus_one=gemma, embed_scale=gemma,
      tie_embeddings=bool(d["tie_word_embeddings"]), qkv_bias=family == "qwen2",
      qk_norm=family == "gemma3", post_attn_norm=family in ("gemma2", "gemma3"),
      post_mlp_norm=family in ("gemma2", "gemma3"),
      query_scale=(float(d["query_pre_attn_scalar"]) ** -0.5
                   if family in ("gemma2", "gemma3") else None),
      attn_logit_soft_cap=_opt_float(d.get("attn_logit_softcapping")) if gemma else None,
      final_logit_soft_cap=_opt_float(d.get("final_logit_softcapping")) if gemma else None,
      rope_base=global_rope[0], rope_scale=global_rope[1],
      rope_base_local=local_rope if local_rope != global_rope[0] else None,
      sliding_window=int(d["sliding_window"]) if "local" in kinds else None,
      layer_pattern=period(kinds),
      max_seq_len=int(d.get("max_position_embeddings") or 8192))


def _float(d: dict, key: str, origin: str) -> float:
  value = d[key]
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    raise UserError(f"{origin}: {key} must be a number, got {value!r}.")
  return float(value)


def _opt_float(x) -> Optional[float]:
  return None if x is None else float(x)


def _layer_kinds(d: dict, family: str, num_layers: int, origin: str) -> list:
  """'global' / 'local' per layer, as transformers' config `__post_init__` computes it."""
  types = d.get("layer_types")
  if types is not None:
    bad = sorted({t for t in types if t not in _LAYER_TYPES})
    if bad or len(types) != num_layers:
      raise UserError(f"{origin}: layer_types must list {num_layers} entries from "
                      f"{list(_LAYER_TYPES)}; got {len(types)} entries, unknown {bad}.")
    kinds = [_LAYER_TYPES[t] for t in types]
  elif family == "gemma2":
    kinds = ["local" if (i + 1) % 2 else "global" for i in range(num_layers)]
  elif family == "gemma3":
    every = int(d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or 6)
    kinds = ["local" if (i + 1) % every else "global" for i in range(num_layers)]
  elif family == "qwen2" and d.get("use_sliding_window"):
    kinds = ["local" if i >= d["max_window_layers"] else "global" for i in range(num_layers)]
  else:
    kinds = ["global"] * num_layers
  if family == "qwen2" and not d.get("use_sliding_window"):
    kinds = ["global"] * num_layers   # transformers drops the window when it is disabled
  if "local" in kinds and not d.get("sliding_window"):
    raise UserError(f"{origin} has sliding-window layers but no sliding_window length.")
  return kinds


def period(kinds: list) -> tuple:
  """The shortest pattern that, repeated cyclically, gives `kinds`."""
  for p in range(1, len(kinds) + 1):
    if all(k == kinds[i % p] for i, k in enumerate(kinds)):
      return tuple(kinds[:p])
  return tuple(kinds)


def _rope(d: dict, family: str, origin: str):
  """((global base, global linear scale), local base)."""
  params = d.get("rope_parameters")
  if isinstance(params, dict) and ("full_attention" in params or
                                   "sliding_attention" in params):
    full = params.get("full_attention") or {}
    local = params.get("sliding_attention") or {}
  elif isinstance(params, dict):
    full, local = params, {}
  else:
    full = dict(d.get("rope_scaling") or {})
    full.setdefault("rope_theta", d.get("rope_theta"))
    local = {"rope_theta": d.get("rope_local_base_freq")}
  full_theta = float(full.get("rope_theta") or d["rope_theta"])
  local_theta = float(local.get("rope_theta") or d.get("rope_local_base_freq") or full_theta)
  for which, p in (("global", full), ("local", local)):
    kind = p.get("rope_type") or p.get("type") or "default"
    if kind not in ROPE_TYPES or (which == "local" and kind != "default"):
      raise UserError(f"{origin}: unsupported RoPE type {kind!r} for {which} layers; "
                      f"supported: {', '.join(ROPE_TYPES)} (linear on global layers only).")
  scale = float(full.get("factor", 1.0)) if (full.get("rope_type") or
                                             full.get("type")) == "linear" else 1.0
  return (full_theta, scale), local_theta
