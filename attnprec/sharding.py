"""Device mesh and shardings (JAX's own): the batch over `data`, heads and MLP hidden over `model`.

A 2-D mesh `(data, model)` of Auto axes; jit propagates the shardings of the inputs and
XLA inserts the collectives (tensor parallelism over `model`, data parallelism over `data`).

Parameters: each row of the parameter layout table (`attnprec.layout`) has a sharding
role: `columns` (q, gate, up: w [D, out] split by output column, bias too; the heads or
MLP hidden units must divide the model axis), `kv_columns` (k, v: split by kv head when
K % model == 0, else replicated), `rows` (o, down: w [in, D] split by input row), and
`replicated` (embeddings, norm scales, unembed).
Optimizer moments follow their parameter; scalars are replicated.
Data: tokens [B, T] split over data (needs B % data == 0). Each layer's KV cache [B, K, S, H]
that `decoding.generate` builds follows by propagation: B over data, K over model when the
k/v projections are split (`cache_spec` says which; tests check the compiled program).

gin: `mesh.shape = (data, model)`, one entry may be -1 ("the remaining devices");
`distributed.*` for multi-host (see `initialize_distributed`).
"""
import math
from typing import Optional, Sequence, Tuple

import gin
import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from attnprec import checks, layout
from attnprec.config import ModelConfig
from attnprec.errors import UserError

AXES = ("data", "model")


@gin.configurable("distributed")
@checks.validated("distributed", coordinator_address=checks.optional(checks.string),
                  num_processes=checks.optional(checks.at_least(1)),
                  process_id=checks.optional(checks.integer(min=0)))
def initialize_distributed(*, coordinator_address: Optional[str] = None,
                           num_processes: Optional[int] = None,
                           process_id: Optional[int] = None) -> bool:
  """Calls `jax.distributed.initialize` when `distributed.coordinator_address` is set.

  Must run before anything touches a device (the train runner calls it first). Each host
  runs the same command with its own `distributed.process_id`. Returns whether it ran.
  """
  if not coordinator_address:
    if num_processes is not None or process_id is not None:
      raise UserError(f"distributed.num_processes = {num_processes!r} / process_id = "
                      f"{process_id!r} are set, but distributed.coordinator_address is "
                      f"not: without it this is one process and they would be ignored. "
                      f"Set distributed.coordinator_address (host:port of process 0), or "
                      f"drop them.")
    return False
  if num_processes is None or process_id is None:
    raise UserError("distributed.coordinator_address is set, so distributed.num_processes "
                    "and distributed.process_id must be set too (process_id in "
                    "0..num_processes-1, different on every host).")
  if not 0 <= process_id < num_processes:
    raise UserError(f"distributed.process_id={process_id} must be in 0..{num_processes - 1}.")
  jax.distributed.initialize(coordinator_address=coordinator_address,
                             num_processes=num_processes, process_id=process_id)
  return True


def _valid_shapes(n: int):
  return [(d, n // d) for d in range(1, n + 1) if n % d == 0]


@gin.configurable("mesh")
@checks.validated("mesh", shape=checks.sequence_of(checks.integer(min=-1)))
def make_mesh(*, shape: Sequence[int] = (-1, 1)) -> Mesh:
  """A (data, model) mesh over the first prod(shape) devices; -1 takes the rest."""
  n = jax.device_count()
  shape = tuple(int(s) for s in shape)
  if len(shape) != 2 or shape.count(-1) > 1 or any(s == 0 or s < -1 for s in shape):
    raise UserError(f"mesh.shape={shape} must be (data, model): two positive sizes, one of "
                    f"which may be -1 (all remaining devices). Valid shapes for {n} "
                    f"device(s): {_valid_shapes(n)}.")
  known = math.prod(s for s in shape if s != -1)
  if n % known:
    raise UserError(f"mesh.shape={shape} needs a multiple of {known} devices, but there "
                    f"are {n}. Valid shapes for {n} device(s): {_valid_shapes(n)}.")
  shape = tuple(n // known if s == -1 else s for s in shape)
  size = math.prod(shape)
  if size != n and jax.process_count() > 1:
    raise UserError(f"mesh.shape={shape} uses {size} of {n} devices; with several processes "
                    f"the mesh must use all of them. Valid shapes: {_valid_shapes(n)}.")
  # jax.make_mesh orders the devices for the topology (neighbours on the model axis).
  return jax.make_mesh(shape, AXES, axis_types=(AxisType.Auto,) * 2,
                       devices=jax.devices()[:size])


def describe(mesh: Mesh) -> str:
  return f"mesh data={mesh.shape['data']} x model={mesh.shape['model']}"


def check(mesh: Mesh, config: ModelConfig, batch_sizes: Sequence[Tuple[str, int]] = ()) -> None:
  """UserError unless the model axis divides the heads and MLP hidden width and the data
  axis divides every batch size (given as (gin name, size) pairs)."""
  m, d = mesh.shape["model"], mesh.shape["data"]
  for name, value in (("num_heads", config.num_heads), ("mlp_hidden", config.mlp_hidden)):
    if value % m:
      ok = [s for s in range(1, config.num_heads + 1)
            if config.num_heads % s == 0 and config.mlp_hidden % s == 0]
      raise UserError(f"The mesh's model axis ({m}) does not divide model.{name}={value}; "
                      f"heads and MLP hidden units are split over it. Valid model-axis "
                      f"sizes for this model: {ok} (set mesh.shape = (data, model)).")
  for name, value in batch_sizes:
    if value % d:
      raise UserError(f"The mesh's data axis ({d}) does not divide {name}={value}; the batch "
                      f"is split over it. Use a multiple of {d} or another mesh.shape.")


def kv_split(config: ModelConfig, mesh: Mesh) -> bool:
  """Whether k/v projections (and so the KV cache) are split over the model axis."""
  return config.num_kv_heads % mesh.shape["model"] == 0


def param_spec(module: str, name: str, config: ModelConfig, mesh: Mesh) -> P:
  """PartitionSpec of parameter `module/name`: its layout role (module docstring)."""
  role = layout.role(module, name)
  if role == "kv_columns":
    role = "columns" if kv_split(config, mesh) else "replicated"
  # The scanned model's stacked params ([L, ...]) keep their layer axis whole.
  layer = (None,) if module.startswith(layout.STACKED + "/") else ()
  if role == "columns":
    return P(*layer, None, "model") if name == "w" else P(*layer, "model")
  if role == "rows":
    return P(*layer, "model", None)
  return P()


def param_shardings(params, config: ModelConfig, mesh: Mesh):
  """{module: {name: NamedSharding}} for a Haiku params tree (arrays or shape structs)."""
  return {m: {n: NamedSharding(mesh, param_spec(m, n, config, mesh)) for n in d}
          for m, d in params.items()}


def _path_names(path) -> Tuple[str, ...]:
  """('opt_state', '0', 'mu', 'decoder/layer_0/attn/q', 'w') for a key path."""
  return tuple(jax.tree_util.keystr((k,), simple=True) for k in path)


def tree_shardings(tree, params, config: ModelConfig, mesh: Mesh):
  """Shardings for any tree (train state, optimizer state) that holds copies of `params`:
  a leaf whose path ends in (module, name) of a parameter of the same shape gets that
  parameter's sharding; every other leaf is replicated."""
  shapes = {(m, n): tuple(a.shape) for m, d in params.items() for n, a in d.items()}
  replicated = NamedSharding(mesh, P())

  def leaf(path, x):
    key = _path_names(path)[-2:]
    if len(key) == 2 and shapes.get(key) == tuple(x.shape):
      return NamedSharding(mesh, param_spec(key[0], key[1], config, mesh))
    return replicated

  return jax.tree_util.tree_map_with_path(leaf, tree)


def cache_spec(config: ModelConfig, mesh: Mesh) -> P:
  """Each layer's KV cache [B, K, S, H]: batch over data, kv heads over model when split."""
  return P("data", "model" if kv_split(config, mesh) else None, None, None)


def batch_sharding(mesh: Mesh, ndim: int) -> NamedSharding:
  """Leading (batch) axis over data, the rest replicated."""
  return NamedSharding(mesh, P("data", *([None] * (ndim - 1))))


def put_batch(mesh: Mesh, x: np.ndarray) -> jax.Array:
  """A host array holding the GLOBAL batch (every process builds the same one) -> a global
  jax.Array split over data; each process supplies only its own devices' rows."""
  x = np.asarray(x)
  return jax.make_array_from_callback(x.shape, batch_sharding(mesh, x.ndim), lambda i: x[i])


def put_params(params, config: ModelConfig, mesh: Mesh):
  """Host or device params -> params placed on the mesh."""
  return jax.device_put(params, param_shardings(params, config, mesh))
