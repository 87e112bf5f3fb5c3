"""The parameter layout table (`attnprec.layout`) against the model itself: the table's
shape rules give exactly `model.param_shapes` (Haiku's own parameters, by tracing init)
for every architecture feature, and each format's names are unique."""
import dataclasses

import pytest

from attnprec import layout
from attnprec.config import ModelConfig
from attnprec.model import param_shapes

BASE = ModelConfig(vocab_size=11, d_model=12, num_layers=2, num_heads=4, num_kv_heads=2,
                   head_dim=6, mlp_hidden=10)
VARIANTS = {
    "llama_tied": {},
    "untied": dict(tie_embeddings=False),
    "qwen2_bias": dict(qkv_bias=True, tie_embeddings=False),
    "gemma3": dict(qk_norm=True, post_attn_norm=True, post_mlp_norm=True,
                   norm_plus_one=True, embed_scale=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_table_shapes_equal_the_model(variant):
  config = dataclasses.replace(BASE, **VARIANTS[variant])
  want = {m: {n: tuple(s.shape) for n, s in d.items()}
          for m, d in param_shapes(config).items()}
  assert layout.shapes(config) == want


@pytest.mark.parametrize("fmt", ["hf", "gguf"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_format_names_are_unique_and_cover_every_checkpoint_param(fmt, variant):
  config = dataclasses.replace(BASE, **VARIANTS[variant])
  names = [p.file_name(fmt, config, i) for p, i in layout.entries(config)]
  given = [n for n in names if n is not None]
  assert len(given) == len(set(given))
  missing = [p.module(i) + "/" + p.name for (p, i), n in zip(layout.entries(config), names)
             if n is None]
  assert missing == []


def test_roles_and_lookups():
  assert {p.role for p in layout.TABLE} <= set(layout.ROLES)
  assert layout.role("decoder/layer_1/attn/q", "w") == "columns"
  assert layout.role("decoder/layer_0/attn/k", "b") == "kv_columns"
  assert layout.role("decoder/layer_0/mlp/down", "w") == "rows"
  assert layout.role("decoder/embed", "embeddings") == "replicated"
  assert layout.locate("attn/o/w", 3) == ("decoder/layer_3/attn/o", "w")
  assert layout.locate("final_norm/scale") == ("decoder/final_norm", "scale")
  assert layout.dense_module_suffixes() == (
      "attn/q", "attn/k", "attn/v", "attn/o", "mlp/gate", "mlp/up", "mlp/down", "unembed")
  assert "pre_feedforward_layernorm" in layout.param("pre_mlp_norm/scale").file_name(
      "hf", dataclasses.replace(BASE, post_attn_norm=True), 0)
  assert "layers.0.post_attention_layernorm" in layout.param("pre_mlp_norm/scale").file_name(
      "hf", BASE, 0)
