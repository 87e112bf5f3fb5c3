"""Training checkpoints (orbax): atomic, the last K kept, resumed exactly.

Layout: run_dir/checkpoints/<step>/
  state/  the train state as a pytree: params (float32), optimizer state, step, rng;
          sharded arrays are written shard by shard and restored onto the current mesh
  meta/   JSON: step, data_position (= batches consumed; each step's batch is derived from
          (seed, step), so this is all the data stream needs), seed, batch_size, model
          config, task description, mesh shape.

Atomicity: orbax writes a step into `<step>.orbax-checkpoint-tmp` and renames it to
`<step>` only once everything is written; a save killed half-way leaves just the tmp
directory, which the step listing ignores and the next save of that step replaces.

Write failures: saves are synchronous (no background orbax thread outlives `save`). A save
that fails because the disk is full (or any OSError, also one raised in orbax's writer
threads) removes its `<step>.orbax-checkpoint-tmp*` directory and raises
`runs.WriteError` naming the checkpoint and the cause; the previous checkpoints are
untouched (pruning to the last K happens only after a save completes).

Restoring checks the checkpoint's leaf shapes and dtypes against the model being trained
(a mismatch is a UserError naming the leaves: nothing is overwritten). A checkpoint that
cannot be read is moved aside to `<step>.unreadable` (kept, never deleted) and the previous
one is used instead, with a message saying so.
"""
import asyncio
import contextlib
import glob
import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from typing import List, Optional, Tuple

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from attnprec.errors import UserError
from attnprec import faults, runs
from attnprec.faults import Faults

SUBDIR = "checkpoints"


class _PauseHandler(ocp.handlers.JsonCheckpointHandler):
  """Test-only item (fault_injection.pause_in_save_at_step): once the other items of a
  save have started writing, announce and sleep, so a test can kill the save mid-way."""

  async def async_save(self, directory, item=None, args=None):
    out = await super().async_save(directory, item, args)
    pause = (args.item if args is not None else item) or {}
    if pause.get("pause_s"):
      faults.announce(pause.get("marker", ""), "in checkpoint save")
      await asyncio.sleep(pause["pause_s"])   # lets the state item keep writing meanwhile
    return out


@ocp.args.register_with_handler(_PauseHandler, for_save=True)
class _PauseSave(ocp.args.JsonSave):
  pass


@ocp.args.register_with_handler(_PauseHandler, for_restore=True)
class _PauseRestore(ocp.args.JsonRestore):
  pass


def leaf_name(path) -> str:
  """'params/decoder/layer_0/attn/q/w' for a key path, whatever the container types."""
  return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def leaf_table(tree) -> dict:
  """{leaf name: (shape, dtype name)} for arrays, shape structs or orbax metadata."""
  return {leaf_name(p): (tuple(x.shape), str(x.dtype))
          for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def differing_leaves(saved: dict, expected: dict) -> List[str]:
  """Human-readable lines for every leaf that is missing, extra or differs (params first)."""
  out = []
  names = set(saved) | set(expected)
  for name in sorted(names, key=lambda n: (not n.startswith("params/"), n)):
    s, e = saved.get(name), expected.get(name)
    if s == e:
      continue
    fmt = lambda v: "absent" if v is None else f"{v[0]} {v[1]}"  # noqa: E731
    out.append(f"{name}: checkpoint {fmt(s)}, now {fmt(e)}")
  return out


class Checkpointer:
  """Saves and restores `{params, opt_state, step, rng}` dicts under run_dir/checkpoints."""

  def __init__(self, run_dir: str, *, keep: int, fault: Optional[Faults] = None):
    _drop_closed_loop_noise()
    self.directory = os.path.abspath(os.path.join(run_dir, SUBDIR))
    self.fault = fault or Faults()
    self._keep = keep
    self._refuse_step_files()
    self._manager = self._open()

  def _refuse_step_files(self) -> None:
    """An entry named like a step that is not a directory (a file `checkpoints/6`) would
    be skipped by every restore without a word, and a save of that step would replace
    it: refused by name before anything is read or written."""
    if not os.path.isdir(self.directory):
      return
    for name in sorted(os.listdir(self.directory)):
      path = os.path.join(self.directory, name)
      if name.isdigit() and not os.path.isdir(path):
        raise UserError(f"{path} is named like the checkpoint of step {name} but is not a "
                        f"directory (a checkpoint is one); a restore would skip it and a "
                        f"save of that step replace it. Move it out of {self.directory}.")
      if name.isdigit() and name != str(int(name)):
        raise UserError(f"{path} is named like the checkpoint of step {int(name)}, but a "
                        f"checkpoint's directory is named {int(name)!s} (no leading zeros); "
                        f"a restore would skip it without a word and train those steps "
                        f"again. Rename it to {int(name)!s}, or move it out of "
                        f"{self.directory}.")

  def _open(self) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(max_to_keep=self._keep, create=True,
                                           enable_async_checkpointing=False)
    registry = ocp.handlers.DefaultCheckpointHandlerRegistry()
    for args in (ocp.args.StandardSave, ocp.args.StandardRestore):
      registry.add("state", args)
    for args in (ocp.args.JsonSave, ocp.args.JsonRestore):
      registry.add("meta", args)
    return ocp.CheckpointManager(self.directory, options=options, handler_registry=registry)

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def save(self, state: dict, meta: dict) -> None:
    """Writes step meta['step'] (blocking; atomic) and prunes to the last `keep`. The
    meta records the state's `fingerprint`, checked when it is restored."""
    step = int(meta["step"])
    meta = dict(meta, fingerprint=fingerprint(state))
    items = dict(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta))
    if self.fault.pause_in_save_at_step == step:
      items["pause"] = _PauseSave({"pause_s": self.fault.pause_s, "marker": self.fault.marker})
    try:
      with _quiet_orbax():
        self._manager.save(step, args=ocp.args.Composite(**items), force=True)
        self._manager.wait_until_finished()
    except Exception as e:  # noqa: BLE001 -- a write failure is a WriteError, else re-raised
      if runs.os_error_text(e) is None:
        raise
      self._remove_partial(step)
      raise runs.write_error(os.path.join(self.directory, str(step)), e,
                             what=f"the checkpoint of step {step} to "
                                  f"{os.path.join(self.directory, str(step))}") from None

  def _remove_partial(self, step: int) -> None:
    """Removes what a failed save of `step` left: its orbax tmp directory (process 0).
    Orbax raises on the first failed write while the other items' writes are still in
    flight; removing their directory under them would make each of them fail loudly in
    its own thread, so first wait (up to 60 s) until they are done."""
    pattern = os.path.join(self.directory, f"{step}.orbax-checkpoint-tmp*")
    with _quiet_orbax():
      _wait_for_writers(pattern)
    if jax.process_index() != 0:
      return
    for path in glob.glob(pattern):
      shutil.rmtree(path, ignore_errors=True)

  def restore_latest(self, abstract_state: dict) -> Optional[Tuple[dict, dict]]:
    """(state, meta) of the newest readable checkpoint, or None when there is none.

    `abstract_state` holds jax.ShapeDtypeStruct leaves with the target shardings.
    Raises UserError if a checkpoint's leaves differ from it (architecture or dtype
    changed) or if checkpoints exist but none can be read.
    """
    expected = leaf_table(abstract_state)
    unreadable = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      try:
        metadata = self._manager.item_metadata(step)["state"]
        if metadata is None:
          raise ValueError("the state item's metadata is missing")
        saved = leaf_table(metadata.tree)
      except Exception as e:  # noqa: BLE001 -- any failure to read means unreadable
        unreadable.append((step, e))
        continue
      diff = differing_leaves(saved, expected)
      if diff:
        raise UserError(
            f"The checkpoint at step {step} in {self.directory} was written for a different "
            f"architecture or parameter dtype; {len(diff)} leaf/leaves differ: "
            f"{'; '.join(diff[:8])}{'; ...' if len(diff) > 8 else ''}. Restore the original "
            f"model settings to resume, or train into a new --run_dir. Nothing was changed.")
      try:
        got = self._manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001
        unreadable.append((step, e))
        continue
      why = meta_problem(got.meta, step)
      if why:
        raise UserError(
            f"{os.path.join(self.directory, str(step), 'meta')}: the checkpoint's record "
            f"{why}. A training writes it with the checkpoint; it was edited or written by "
            f"other code, and resuming from it would continue from a wrong place. Restore "
            f"it, remove step {step}'s directory to resume from the one before, or train "
            f"into a new --run_dir. Nothing was changed.")
      recorded = got.meta.get("fingerprint")
      if recorded is not None and fingerprint(got.state) != recorded:
        # orbax reads a damaged chunk (same size, other bytes) without a word
        unreadable.append((step, ValueError(
            "its arrays are not the ones saved: their fingerprint differs from the one "
            "recorded with them (a damaged file)")))
        continue
      self._set_aside(unreadable, fallback=step)
      return got.state, got.meta
    if unreadable:
      listed = "; ".join(f"step {s}: {_short(e)}" for s, e in unreadable)
      raise UserError(f"No readable checkpoint in {self.directory} ({listed}). Remove the "
                      f"directory to start over, or train into a new --run_dir.")
    return None

  def _set_aside(self, unreadable, fallback: int) -> None:
    """Moves unreadable step directories to `<step>.unreadable[.n]` and says so."""
    for step, e in unreadable:
      src = os.path.join(self.directory, str(step))
      dst, n = src + ".unreadable", 1
      while os.path.exists(dst):
        dst, n = f"{src}.unreadable.{n}", n + 1
      if jax.process_index() == 0:
        os.rename(src, dst)
      if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"set aside checkpoint {step}")
      print(f"checkpoint at step {step} is unreadable ({_short(e)}); moved it to "
            f"{os.path.basename(dst)} and resuming from the previous good checkpoint, "
            f"step {fallback}.")
    if unreadable:
      self._manager.close()
      self._manager = self._open()

  def close(self) -> None:
    with _quiet_orbax():
      self._manager.close()

  def __enter__(self) -> "Checkpointer":
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _is_closed_loop_noise(exc_type, exc) -> bool:
  """RuntimeError('Event loop is closed') raised in asyncio's call_soon_threadsafe: a
  tensorstore write or read of a failed orbax save/restore finishing after orbax closed
  the event loop it was started from (orbax raises on the first failure without waiting
  for the others). Nothing is lost: the operation's result is no longer wanted."""
  return (exc_type is RuntimeError and str(exc) == "Event loop is closed")


def _drop_closed_loop_noise() -> None:
  """Filters that one message out of sys.excepthook and sys.unraisablehook (tensorstore
  prints it through them, once per operation still in flight: dozens of tracebacks
  after a full disk); every other exception is printed as before."""
  if getattr(sys.excepthook, "_attnprec_filter", False):
    return
  previous_hook, previous_unraisable = sys.excepthook, sys.unraisablehook

  def excepthook(exc_type, exc, tb):
    if not _is_closed_loop_noise(exc_type, exc):
      previous_hook(exc_type, exc, tb)

  def unraisablehook(unraisable):
    if not _is_closed_loop_noise(unraisable.exc_type, unraisable.exc_value):
      previous_unraisable(unraisable)

  excepthook._attnprec_filter = True
  sys.excepthook, sys.unraisablehook = excepthook, unraisablehook


def _wait_for_writers(pattern: str, timeout_s: float = 60.0) -> None:
  """Returns once no orbax writer thread is alive and the files under `pattern` have
  stopped changing (or after timeout_s)."""
  deadline, before = time.monotonic() + timeout_s, None
  while time.monotonic() < deadline:
    busy = any(type(t).__name__ == "_SignalingThread" and t.is_alive()
               for t in threading.enumerate())
    now = _listing(pattern)
    if not busy and now == before:
      return
    before = now
    time.sleep(0.2)


def _listing(pattern: str) -> list:
  out = []
  for top in glob.glob(pattern):
    for d, _, files in os.walk(top):
      for f in files:
        with contextlib.suppress(OSError):
          st = os.stat(os.path.join(d, f))
          out.append((d, f, st.st_size, st.st_mtime_ns))
  return sorted(out)


@contextlib.contextmanager
def _quiet_orbax():
  """Orbax logs a failed save's traceback from its writer threads before re-raising it
  here; the caller reports the failure once, as one paragraph."""
  loggers = [logging.getLogger(n) for n in ("absl", "orbax")]
  levels = [lg.level for lg in loggers]
  for lg in loggers:
    lg.setLevel(logging.CRITICAL)
  try:
    yield
  finally:
    for lg, level in zip(loggers, levels):
      lg.setLevel(level)


def _short(e: BaseException) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text[:200]}"


@jax.jit
def _leaf_sums(leaves):
  """Per leaf, two wrapping sums of its bits as unsigned words, plain and mixed (each word
  through a nonlinear bijection first): a flipped bit changes both. Integer sums, so the
  same on any sharding of the leaf (an SPMD all-reduce of a sum: XLA:CPU partitions no
  XOR reduction)."""
  out = []
  for x in leaves:
    bits = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}.get(jnp.dtype(x.dtype).itemsize)
    if bits is None or x.dtype == jnp.bool_:
      x = x.astype(jnp.uint32)
      bits = jnp.uint32
    words = jax.lax.bitcast_convert_type(x, bits).astype(jnp.uint32).ravel()
    mixed = (words ^ (words >> 15)) * jnp.uint32(0x2C1B3C6D)
    mixed = mixed ^ (mixed >> 12)
    out.append(jnp.stack([words.sum(dtype=jnp.uint32), mixed.sum(dtype=jnp.uint32)]))
  return out


def fingerprint(state) -> str:
  """A digest of every array of a train state (`_leaf_sums`, computed where the arrays
  are, then hashed): recorded in a checkpoint's meta when it is saved and compared when
  it is restored."""
  sums = jax.device_get(_leaf_sums(jax.tree.leaves(state)))
  digest = hashlib.sha256()
  for s in sums:
    digest.update(np.asarray(s, np.uint32).tobytes())
  return digest.hexdigest()[:32]


def meta_problem(meta, step: int) -> Optional[str]:
  """None if a checkpoint's meta record is what a training writes for `step`, else what
  is wrong: not an object; 'step' or 'data_position' (the batches consumed, one per
  step) not that step; 'target_reached' not a bool; a count or the held-out accuracy
  not a number."""
  from attnprec import readback
  if not isinstance(meta, dict):
    return f"is a JSON {type(meta).__name__}, not an object"
  for key in ("step", "data_position"):
    if meta.get(key) != step or not readback.is_int(meta.get(key)):
      return f"has {key} = {meta.get(key)!r}, not the checkpoint's step {step}"
  if "target_reached" in meta and not isinstance(meta["target_reached"], bool):
    return f"has target_reached = {meta['target_reached']!r}, not true or false"
  for key in ("seed", "batch_size", "steps"):
    if key in meta and not readback.is_int(meta[key]):
      return f"has {key} = {meta[key]!r}, not an integer"
  for key in ("precision", "xla"):
    if key in meta and not isinstance(meta[key], str):
      return f"has {key} = {meta[key]!r}, not a line of settings"
  if "fingerprint" in meta and not isinstance(meta["fingerprint"], str):
    return f"has fingerprint = {meta['fingerprint']!r}, not a digest"
  if "optimizer" in meta and not isinstance(meta["optimizer"], dict):
    return f"has optimizer = {meta['optimizer']!r}, not an object of settings"
  acc = meta.get("eval_accuracy")
  if acc is not None and not readback.is_finite_number(acc):
    return f"has eval_accuracy = {acc!r}, not a number"
  return None
