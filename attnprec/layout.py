"""The parameter layout: every parameter of the decoder, declared once.

One row per parameter: where Haiku puts it (module path under `decoder/`, `{i}` = the
layer), its shape rule, when the architecture has it, its sharding role, and its name in
each checkpoint format (HF safetensors, GGUF). The HF importer, the GGUF importer, the
sharding table and the float64 forward pass all read this table; so does anything that
needs to know which parameters are dense projections. Adding an architecture touches
`config.py`, `layers.py` and this table.

Shapes: V vocabulary, D model width, N/K heads/kv heads, H head dim, F MLP hidden.
Sharding roles (over the mesh's `model` axis, `attnprec.sharding`):
  columns     w [in, out] split by output column (heads / hidden units), its bias too
  kv_columns  as columns when the kv heads divide the model axis, else replicated
  rows        w [in, out] split by input row
  replicated  everything else (embeddings, norm scales, the unembedding)
Formats: HF names sit under the text model's prefix (`model.` etc.), except the untied
head (`lm_head.weight`, beside the prefix); `transpose` = the file stores [out, in].

`python -m attnprec.layout` prints the table.
"""
import dataclasses
import re
from typing import Callable, Dict, Iterator, Optional, Tuple, Union

import jax.numpy as jnp
import numpy as np

from attnprec.config import ModelConfig
from attnprec.errors import UserError

# The scanned model's (`model.scan_layers`) per-layer params: one module per row, under
# `STACKED` (the `hk.layer_stack` named STACKED_SCAN, its one Block STACKED_BLOCK), with a
# leading L axis: 'decoder/layers/layer/attn/q' {'w': [L, D, N*H]}.
STACKED_SCAN = "layers"
STACKED_BLOCK = "layer"
STACKED = f"decoder/{STACKED_SCAN}/{STACKED_BLOCK}"

ShapeRule = Callable[[ModelConfig], Tuple[int, ...]]
NameRule = Union[None, str, Callable[[ModelConfig], str]]
ROLES = ("columns", "kv_columns", "rows", "replicated")


@dataclasses.dataclass(frozen=True)
class Param:
  key: str                   # 'attn/q/w': module path below the layer (or decoder) + name
  shape: ShapeRule           # config -> shape of our (Haiku) array
  shape_doc: str             # the shape in letters, e.g. '[D, N*H]'
  role: str = "replicated"   # sharding role (ROLES)
  dense: bool = False        # a dense projection (a matmul weight of the model)
  norm: bool = False         # an RMSNorm scale
  when: Callable[[ModelConfig], bool] = lambda c: True   # the architecture has it
  hf: NameRule = None        # HF name ('{i}' = layer); None: not in HF checkpoints
  gguf: NameRule = None      # GGUF name; None: not in GGUF files
  transpose: bool = False    # both formats store it [out, in]
  per_layer: bool = True     # one per layer (module under decoder/layer_{i}/)

  @property
  def module_suffix(self) -> str:
    return self.key.rpartition("/")[0]

  @property
  def name(self) -> str:
    return self.key.rpartition("/")[2]

  def module(self, layer: Optional[int] = None) -> str:
    """The Haiku module path: 'decoder/layer_3/attn/q'."""
    if self.per_layer:
      return f"decoder/layer_{layer}/{self.module_suffix}"
    return f"decoder/{self.module_suffix}"

  def file_name(self, fmt: str, config: ModelConfig, layer: Optional[int] = None
                ) -> Optional[str]:
    """This parameter's tensor name in format `fmt` ('hf' | 'gguf'), or None."""
    rule = {"hf": self.hf, "gguf": self.gguf}[fmt]
    name = rule(config) if callable(rule) else rule
    return None if name is None else name.format(i=layer)


def _layer(key, shape, shape_doc, **kw) -> Param:
  return Param(key, shape, shape_doc, **kw)


def _top(key, shape, shape_doc, **kw) -> Param:
  return Param(key, shape, shape_doc, per_layer=False, **kw)


_D = lambda c: (c.d_model,)
_bias = lambda c: c.qkv_bias

TABLE: Tuple[Param, ...] = (
    _top("embed/embeddings", lambda c: (c.vocab_size, c.d_model), "[V, D]",
         hf="embed_tokens.weight", gguf="token_embd.weight"),
    _layer("pre_attn_norm/scale", _D, "[D]", norm=True,
           hf="layers.{i}.input_layernorm.weight", gguf="blk.{i}.attn_norm.weight"),
    _layer("attn/q/w", lambda c: (c.d_model, c.num_heads * c.head_dim), "[D, N*H]",
           role="columns", dense=True, transpose=True,
           hf="layers.{i}.self_attn.q_proj.weight", gguf="blk.{i}.attn_q.weight"),
    _layer("attn/q/b", lambda c: (c.num_heads * c.head_dim,), "[N*H]", role="columns",
           when=_bias, hf="layers.{i}.self_attn.q_proj.bias", gguf="blk.{i}.attn_q.bias"),
    _layer("attn/k/w", lambda c: (c.d_model, c.num_kv_heads * c.head_dim), "[D, K*H]",
           role="kv_columns", dense=True, transpose=True,
           hf="layers.{i}.self_attn.k_proj.weight", gguf="blk.{i}.attn_k.weight"),
    _layer("attn/k/b", lambda c: (c.num_kv_heads * c.head_dim,), "[K*H]", role="kv_columns",
           when=_bias, hf="layers.{i}.self_attn.k_proj.bias", gguf="blk.{i}.attn_k.bias"),
    _layer("attn/v/w", lambda c: (c.d_model, c.num_kv_heads * c.head_dim), "[D, K*H]",
           role="kv_columns", dense=True, transpose=True,
           hf="layers.{i}.self_attn.v_proj.weight", gguf="blk.{i}.attn_v.weight"),
    _layer("attn/v/b", lambda c: (c.num_kv_heads * c.head_dim,), "[K*H]", role="kv_columns",
           when=_bias, hf="layers.{i}.self_attn.v_proj.bias", gguf="blk.{i}.attn_v.bias"),
    _layer("attn/q_norm/scale", lambda c: (c.head_dim,), "[H]", norm=True,
           when=lambda c: c.qk_norm,
           hf="layers.{i}.self_attn.q_norm.weight", gguf="blk.{i}.attn_q_norm.weight"),
    _layer("attn/k_norm/scale", lambda c: (c.head_dim,), "[H]", norm=True,
           when=lambda c: c.qk_norm,
           hf="layers.{i}.self_attn.k_norm.weight", gguf="blk.{i}.attn_k_norm.weight"),
    _layer("attn/o/w", lambda c: (c.num_heads * c.head_dim, c.d_model), "[N*H, D]",
           role="rows", dense=True, transpose=True,
           hf="layers.{i}.self_attn.o_proj.weight", gguf="blk.{i}.attn_output.weight"),
    _layer("post_attn_norm/scale", _D, "[D]", norm=True, when=lambda c: c.post_attn_norm,
           hf="layers.{i}.post_attention_layernorm.weight",
           gguf="blk.{i}.post_attention_norm.weight"),
    # HF names the pre-MLP norm after the attention unless the block has a post-attn norm.
    _layer("pre_mlp_norm/scale", _D, "[D]", norm=True,
           hf=lambda c: ("layers.{i}.pre_feedforward_layernorm.weight" if c.post_attn_norm
                         else "layers.{i}.post_attention_layernorm.weight"),
           gguf="blk.{i}.ffn_norm.weight"),
    _layer("post_mlp_norm/scale", _D, "[D]", norm=True, when=lambda c: c.post_mlp_norm,
           hf="layers.{i}.post_feedforward_layernorm.weight",
           gguf="blk.{i}.post_ffw_norm.weight"),
    _layer("mlp/gate/w", lambda c: (c.d_model, c.mlp_hidden), "[D, F]", role="columns",
           dense=True, transpose=True,
           hf="layers.{i}.mlp.gate_proj.weight", gguf="blk.{i}.ffn_gate.weight"),
    _layer("mlp/up/w", lambda c: (c.d_model, c.mlp_hidden), "[D, F]", role="columns",
           dense=True, transpose=True,
           hf="layers.{i}.mlp.up_proj.weight", gguf="blk.{i}.ffn_up.weight"),
    _layer("mlp/down/w", lambda c: (c.mlp_hidden, c.d_model), "[F, D]", role="rows",
           dense=True, transpose=True,
           hf="layers.{i}.mlp.down_proj.weight", gguf="blk.{i}.ffn_down.weight"),
    _top("final_norm/scale", _D, "[D]", norm=True, hf="norm.weight",
         gguf="output_norm.weight"),
    _top("unembed/w", lambda c: (c.d_model, c.vocab_size), "[D, V]", dense=True,
         transpose=True, when=lambda c: not c.tie_embeddings,
         hf="lm_head.weight", gguf="output.weight"),
)
BY_KEY: Dict[str, Param] = {p.key: p for p in TABLE}
# The untied head sits beside the HF text model's prefix, not under it.
HF_HEAD_KEY = "unembed/w"


def param(key: str) -> Param:
  return BY_KEY[key]


def locate(key: str, layer: Optional[int] = None) -> Tuple[str, str]:
  """(Haiku module, param name) of `key` ('attn/q/w') in `layer`."""
  p = BY_KEY[key]
  return p.module(layer), p.name


def get(params, key: str, layer: Optional[int] = None):
  """The array of `key` in a Haiku params tree {module: {name: array}}."""
  module, name = locate(key, layer)
  return params[module][name]


def entries(config: ModelConfig) -> Iterator[Tuple[Param, Optional[int]]]:
  """(row, layer or None) for every parameter `config`'s model has, in table order
  (the top-level rows once, each per-layer row for every layer)."""
  for p in TABLE:
    if not p.when(config):
      continue
    if p.per_layer:
      for i in range(config.num_layers):
        yield p, i
    else:
      yield p, None


def shapes(config: ModelConfig) -> Dict[str, Dict[str, Tuple[int, ...]]]:
  """{module: {name: shape}} by the table's shape rules (== `model.param_shapes`), in
  the layout `config.scan_layers` says."""
  out: Dict[str, Dict[str, Tuple[int, ...]]] = {}
  for p, i in entries(config):
    out.setdefault(p.module(i), {})[p.name] = tuple(p.shape(config))
  return stack(out, config.num_layers, shapes=True) if config.scan_layers else out


# ----------------------------------------------------------------------------- stacking
_LAYER = re.compile(r"^decoder/layer_(\d+)/(.+)$")


def is_stacked(params) -> bool:
  """Whether a params tree is in the scanned model's layout (modules under `STACKED`)."""
  return any(m.startswith(STACKED + "/") for m in params)


def stack(params, num_layers: int, *, shapes: bool = False):
  """Unrolled params ('decoder/layer_{i}/attn/q' {'w': [D, N*H]}) -> the scanned model's
  ('decoder/layers/layer/attn/q' {'w': [L, D, N*H]}): each per-layer parameter's L
  arrays stacked on a new axis 0 (exact: the same values; numpy arrays stay numpy). Any
  module under decoder/layer_{i}/ is stacked (the table's and any other, e.g. one a probe
  injects), and must then be there for every layer with the same shape.
  shapes=True: `params` holds shape tuples, stacked as (L,) + shape."""
  per_layer: Dict[Tuple[str, str], Dict[int, object]] = {}
  out = {}
  for module, group in params.items():
    m = _LAYER.match(module)
    if m is None:
      if module.startswith(STACKED + "/"):
        raise UserError(f"Parameter {module} is already stacked; params mix the unrolled "
                        f"and the scanned layout.")
      out[module] = dict(group)
      continue
    for name, x in group.items():
      per_layer.setdefault((m.group(2), name), {})[int(m.group(1))] = x
  for (suffix, name), by_layer in sorted(per_layer.items()):
    if sorted(by_layer) != list(range(num_layers)):
      raise UserError(f"Cannot stack {suffix}/{name} over {num_layers} layers: the params "
                      f"hold it for layer(s) {sorted(by_layer)}, need 0..{num_layers - 1}.")
    xs = [by_layer[i] for i in range(num_layers)]
    if shapes:
      value = (num_layers,) + tuple(xs[0])
    else:
      if len({tuple(np.shape(x)) for x in xs}) != 1:
        raise UserError(f"Cannot stack {suffix}/{name}: its shape differs between layers "
                        f"({sorted({tuple(np.shape(x)) for x in xs})}).")
      value = (np.stack(xs) if all(isinstance(x, np.ndarray) for x in xs)
               else jnp.stack(xs))
    out.setdefault(f"{STACKED}/{suffix}", {})[name] = value
  return out


def unstack(params):
  """The scanned model's params -> the unrolled model's: each stacked parameter's slice
  i as layer i's (exact). Params already unrolled are returned as they are."""
  out = {}
  for module, group in params.items():
    if not module.startswith(STACKED + "/"):
      out[module] = dict(group)
      continue
    suffix = module[len(STACKED) + 1:]
    for name, x in group.items():
      for i in range(np.shape(x)[0]):
        out.setdefault(f"decoder/layer_{i}/{suffix}", {})[name] = x[i]
  return out


def as_layout(params, config: ModelConfig):
  """`params` (in either layout) in the one `config.scan_layers` says."""
  if config.scan_layers:
    return params if is_stacked(params) else stack(params, config.num_layers)
  return unstack(params) if is_stacked(params) else params


def tensor_map(config: ModelConfig, fmt: str) -> Dict[str, Tuple[Param, Optional[int]]]:
  """{tensor name in format `fmt` ('hf' | 'gguf'): (row, layer)} for `config`."""
  out = {}
  for p, i in entries(config):
    name = p.file_name(fmt, config, i)
    if name is not None:
      out[name] = (p, i)
  return out


def lookup(module: str, name: str) -> Optional[Param]:
  """The table's row of Haiku parameter `module/name` (None if it has none)."""
  if module.startswith(STACKED + "/"):
    return BY_KEY.get(f"{module[len(STACKED) + 1:]}/{name}")
  parts = module.split("/")
  suffix = "/".join(parts[2:] if len(parts) > 2 and parts[1].startswith("layer_")
                    else parts[1:])
  return BY_KEY.get(f"{suffix}/{name}")


def role(module: str, name: str) -> str:
  """The sharding role of Haiku parameter `module/name` ('replicated' if unknown)."""
  p = lookup(module, name)
  return p.role if p is not None else "replicated"


def read_as_matrix(module: str, name: str) -> bool:
  """Whether a matmul reads `module/name` whole: a dense projection's weight, or the
  embedding table (the tied unembedding reads it)."""
  p = lookup(module, name)
  return p is not None and (p.dense or p.key == "embed/embeddings")


def dense_module_suffixes() -> Tuple[str, ...]:
  """Module paths (below the layer or decoder) of the dense projections:
  ('attn/q', 'attn/k', 'attn/v', 'attn/o', 'mlp/gate', 'mlp/up', 'mlp/down', 'unembed')."""
  return tuple(p.module_suffix for p in TABLE if p.dense)


def describe() -> str:
  """The table as text (`python -m attnprec.layout`)."""
  rows = [("parameter", "shape", "role", "HF", "GGUF")]
  probe = ModelConfig(vocab_size=2, d_model=2, num_layers=1, num_heads=1, num_kv_heads=1,
                      head_dim=2, mlp_hidden=2)
  for p in TABLE:
    where = ("layer_{i}/" if p.per_layer else "") + p.key

    def fmt_name(rule):
      if callable(rule):
        return " | ".join(sorted({rule(dataclasses.replace(probe, post_attn_norm=f))
                                  for f in (False, True)}))
      return rule or "-"

    rows.append((where, p.shape_doc, p.role, fmt_name(p.hf), fmt_name(p.gguf)))
  widths = [max(len(r[c]) for r in rows) for c in range(5)]
  return "\n".join("  ".join(v.ljust(w) for v, w in zip(r, widths)).rstrip() for r in rows)


if __name__ == "__main__":
  print(describe())
