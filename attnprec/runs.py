"""Run directories: operative config, metrics, params, results. Every write is atomic
(temporary file in the same directory, then rename), so nothing is ever half-written.

A write that fails (a full disk, a quota, a read-only mount) raises `WriteError`, a
UserError naming the path and the cause; the partial file is removed first, and what was
there before is untouched. `track_writes` records the files a run writes (and keeps the
previous version of each file a write replaces), so a runner can undo them when the run
is interrupted (`attnprec.cli.run`): what it created is removed, what it replaced is
put back.
"""
import contextlib
import dataclasses
import errno as errno_lib
import fcntl
import json
import math
import os
import shutil
import tempfile
import zipfile
from typing import Any, Dict, List, Optional

import gin
import numpy as np

from attnprec.config import ModelConfig
from attnprec import checks, paths, readback
from attnprec.checks import INT_MAX
from attnprec.errors import UserError
from attnprec.model import check_params

PARAMS_FILE = "params.npz"
MODEL_FILE = "model.json"


class WriteError(UserError):
  """Writing an output failed (disk full, quota, permissions, I/O error): runners exit 2."""


def write_error(path: str, e: BaseException, *, what: str = "") -> WriteError:
  """The one paragraph for a failed write: the path, the cause and what is still intact."""
  cause = os_error_text(e) or f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
  return WriteError(
      f"Cannot write {what or repr(path)}: {cause}. The partial file was removed and the "
      f"files written before are intact. Free space (or fix the permissions) on that filesystem, "
      f"or choose another output directory, then run again.")


def os_error_text(e: Optional[BaseException]) -> Optional[str]:
  """'No space left on device (ENOSPC)' for an OSError anywhere in e's cause chain (or
  a message holding an errno's text, as tensorstore's do), else None."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if isinstance(e, OSError) and e.errno:
      return f"{e.strerror or os.strerror(e.errno)} ({errno_lib.errorcode.get(e.errno, e.errno)})"
    for code in (errno_lib.ENOSPC, errno_lib.EDQUOT, errno_lib.EFBIG, errno_lib.EROFS,
                 errno_lib.EACCES, errno_lib.EIO):
      if os.strerror(code) in str(e):
        return f"{os.strerror(code)} ({errno_lib.errorcode[code]})"
    e = e.__cause__ or e.__context__
  return None


class Written(list):
  """The paths (absolute) written through this module while a `track_writes` block runs,
  and `kept`: for each file a write replaced, a hidden hard link (or copy) beside it to
  the content it had before the block first wrote it, so `remove_written` can put it
  back. The links left when the block ends are removed."""

  def __init__(self, keep_previous: bool = True):
    super().__init__()
    self.keep_previous = keep_previous
    self.kept: Dict[str, str] = {}

  def discard_kept(self) -> None:
    for link in self.kept.values():
      with contextlib.suppress(OSError):
        os.remove(link)
    self.kept.clear()


_tracked: List[Written] = []   # one per active track_writes(), innermost last


@contextlib.contextmanager
def track_writes(keep_previous: bool = True):
  """Yields the `Written` of the files written through this module while the block
  runs (keeping the previous version of each file replaced, unless not `keep_previous`:
  a run whose partial outputs are kept, a training)."""
  written = Written(keep_previous)
  _tracked.append(written)
  try:
    yield written
  finally:
    _tracked.remove(written)
    written.discard_kept()


def _record(path: str) -> None:
  for written in _tracked:
    written.append(os.path.abspath(path))


def _keep_previous(path: str) -> None:
  """Before a tracked write replaces the file at `path`: a hidden link to its current
  content, once per tracking block (the version from before the run, not one the run
  wrote itself). A file that can be neither linked nor copied is a WriteError before
  anything is replaced."""
  path = os.path.abspath(path)
  if not os.path.isfile(path):
    return
  for written in _tracked:
    if not written.keep_previous or path in written.kept or path in written:
      continue
    link = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.previous-"
                                                f"{os.getpid()}-{len(written.kept)}")
    try:
      with contextlib.suppress(FileNotFoundError):
        os.remove(link)                     # a stale one of an earlier process's pid
      try:
        os.link(path, link)
      except OSError:                       # a filesystem without hard links
        shutil.copy2(path, link)
    except OSError as e:
      raise write_error(path, e, what=f"{path!r} (keeping its previous version, so that "
                                      f"an interrupted run can put it back)") from None
    written.kept[path] = link


def remove_written(written: Written, under: str) -> None:
  """Undoes, inside directory `under`, what a run that was interrupted (or could not
  finish writing) wrote there: a file it replaced gets its previous content back, a file
  it created is removed. So no mix of its outputs and older ones is left, and nothing
  older is lost. Files it did not write stay."""
  root = os.path.abspath(under)
  for path in set(written):
    if not path.startswith(root + os.sep):
      continue
    with contextlib.suppress(OSError):
      if path in written.kept:
        os.replace(written.kept.pop(path), path)
      elif os.path.isfile(path):
        os.remove(path)


def ensure_dir(run_dir: str) -> str:
  try:
    os.makedirs(run_dir, exist_ok=True)
  except OSError as e:
    raise UserError(f"Cannot create run directory {run_dir!r}: {e.strerror}. Choose a "
                    f"writable path with --run_dir.") from None
  if not os.access(run_dir, os.W_OK):
    raise UserError(f"Run directory {run_dir!r} is not writable. Choose a writable path "
                    f"with --run_dir.")
  return run_dir


def check_writable(run_dir: str) -> str:
  """ensure_dir, then proves the directory writable by creating and removing a file (the
  permission bits alone do not tell: root ignores them, a read-only mount does not)."""
  ensure_dir(run_dir)
  try:
    fd, probe = tempfile.mkstemp(dir=run_dir, prefix=".write-probe-")
    os.close(fd)
    os.remove(probe)
  except OSError as e:
    raise UserError(f"Run directory {run_dir!r} is not writable ({e.strerror}). Choose a "
                    f"writable path with --run_dir.") from None
  return run_dir


def check_output_dir(path: str, *, flag: str = "--run_dir") -> str:
  """Checks, before any work and without creating anything, that outputs can be written
  to directory `path`: it is a writable directory, or it does not exist yet and its
  nearest existing parent is a writable directory. Raises a UserError naming the path."""
  if not isinstance(path, str) or not path.strip():
    raise UserError(f"{flag} must name a directory, got {path!r}.")
  if os.path.lexists(path) and not os.path.isdir(path):
    raise UserError(f"{flag}={path!r} exists and is not a directory; choose a directory "
                    f"(it is created if missing).")
  probe_in = os.path.abspath(path)
  while not os.path.isdir(probe_in):
    parent = os.path.dirname(probe_in)
    if os.path.lexists(probe_in) or parent == probe_in:
      raise UserError(f"{flag}={path!r} cannot be created: {probe_in!r} is not a "
                      f"directory. Choose a writable path with {flag}.")
    probe_in = parent
  try:
    os.rmdir(tempfile.mkdtemp(dir=probe_in, prefix=".write-probe-"))
  except OSError as e:
    raise UserError(f"{flag}={path!r} is not writable: nothing can be created in "
                    f"{probe_in!r} (creating a directory there failed: {e.strerror}). Choose "
                    f"a writable path with {flag}.") from None
  return path


# ----------------------------------------------------------------------------- ownership
OWNER_FILE = ".attnprec-run.json"
# The runners that record themselves (each runner's `prog`).
RUNNERS = frozenset({"audit", "bench", "decode", "device_check", "eval", "inspect",
                     "nextline", "plot", "sinks", "sizes", "study", "sweep", "train"})


def owner(run_dir: str) -> Optional[str]:
  """The runner that made `run_dir` (its OWNER_FILE), None where none is recorded. A
  marker that is not a runner's record is a UserError naming the file."""
  path = os.path.join(run_dir, OWNER_FILE)
  if not os.path.lexists(path):
    return None
  problem = checks.regular_file(path)       # a FIFO would block the read forever
  if problem:
    raise UserError(f"{path} (the record of the runner that made {run_dir!r}) {problem}"
                    f"{'' if os.path.exists(path) else ' (' + paths.unreachable(path) + ')'}"
                    f". Remove it, or choose another --run_dir.")
  try:
    with open(path, encoding="utf-8") as f:
      data = json.load(f, object_pairs_hook=readback.unique_keys)
  except (OSError, UnicodeDecodeError, ValueError) as e:
    raise UserError(f"{path} is not the JSON record of the runner that made {run_dir!r} "
                    f"({type(e).__name__}: {e}). Remove the directory, or choose another "
                    f"--run_dir.") from None
  if not isinstance(data, dict) or not isinstance(data.get("runner"), str):
    raise UserError(f"{path} must be a JSON object with a string 'runner' (the runner "
                    f"that made {run_dir!r}); it holds {str(data)[:120]!r}. Remove the "
                    f"directory, or choose another --run_dir.")
  if set(data) != {"runner"} or data["runner"] not in RUNNERS:
    raise UserError(f"{path} must name the runner that made {run_dir!r} and nothing else, "
                    f'{{"runner": NAME}} with NAME one of {", ".join(sorted(RUNNERS))}; it '
                    f"holds {str(data)[:120]!r} (edited, or written by other code). Fix it, "
                    f"remove the directory, or choose another --run_dir.")
  return data["runner"]


def check_owner(path: str, allowed, who: str, *, flag: str = "--run_dir",
                replaceable: bool = False) -> None:
  """Refuses `path` when a runner other than those `allowed` made it (its OWNER_FILE):
  `who` (a runner, or a command that writes into another's run, e.g. plot into a train
  run's) would write its results over that run's and leave the rest beside them."""
  made_by = owner(path) if os.path.isdir(path) else None
  if made_by is None or made_by in allowed:
    return
  raise UserError(
      f"Run directory {path!r} was made by the {made_by!r} runner ({OWNER_FILE}); {who} "
      f"would write its own results over that run's and leave the rest beside them. "
      f"Choose another {flag}"
      + (", or pass --replace_run_dir to replace the directory whole (the old one is kept "
         "until this run succeeds)." if replaceable else "."))


def _refuse_inside_another_run(run_dir: str, runner: str) -> None:
  """A run directory inside another run's (e.g. a train run's checkpoints/) is refused:
  its results would sit among that run's files."""
  here = os.path.dirname(os.path.abspath(run_dir))
  while True:
    made_by = owner(here) if os.path.isfile(os.path.join(here, OWNER_FILE)) else None
    if made_by is not None:
      raise UserError(f"Run directory {run_dir!r} lies inside {here!r}, a run directory of "
                      f"the {made_by!r} runner ({OWNER_FILE}); {runner!r} would write its "
                      f"results among that run's files. Choose a --run_dir outside it.")
    parent = os.path.dirname(here)
    if parent == here:
      return
    here = parent


def claim(run_dir: str, runner: str, *, replace: bool = False, flag: str = "--run_dir",
          replaceable: bool = True):
  """Makes `run_dir` this runner's before anything is written: records `runner` in a new
  directory (or in an empty one that holds no record, which is adopted, and in train's
  own training made before records were kept, which it resumes); refuses one another
  runner made, and a non-empty one no runner recorded (its files would be written over),
  unless `replace`, which moves that
  directory aside whole (one rename) and returns `finish(ok)`: called when the run ends,
  it deletes the old directory after a run that succeeded and puts it back, whole, after
  one that did not. An adopted directory's `finish` takes the record back off after a
  run that failed. Returns None where nothing was moved or adopted."""
  if runner not in RUNNERS:
    raise ValueError(f"runs.claim: {runner!r} is not in runs.RUNNERS")
  existed = os.path.isdir(run_dir)
  made_by = owner(run_dir) if existed else None
  _refuse_inside_another_run(run_dir, runner)
  training = existed and any(os.path.exists(os.path.join(run_dir, f))
                             for f in ("checkpoints", PARAMS_FILE))
  if existed and made_by is None and runner != "train" and training:
    # A train run made before run directories recorded their runner: adopting it would
    # put this runner's results beside the training and lock the training out of it.
    raise UserError(f"Run directory {run_dir!r} holds a training (checkpoints/ or "
                    f"{PARAMS_FILE}) made before run directories recorded their runner; "
                    f"{runner!r} would write its results beside it and take it over. "
                    f"Choose another --run_dir (a train run is read through its own "
                    f"settings, e.g. recall_eval.checkpoint).")
  # Files no run recorded (a user's, or a run made before records were kept): this run
  # would write its files over theirs and leave the rest beside them. Only an empty
  # directory is taken as it is (and train's own older training, which it resumes).
  foreign = existed and made_by is None and bool(set(os.listdir(run_dir)) - {LOCK_FILE}) \
      and not (runner == "train" and training)
  if foreign and not replace:
    raise UserError(f"Run directory {run_dir!r} is not empty and records no runner (no "
                    f"{OWNER_FILE}): {runner!r} would write its results over the files "
                    f"there and leave the rest beside them. Choose another {flag}, "
                    + ("pass --replace_run_dir to replace the directory whole (the old one "
                       "is kept until this run succeeds), " if replaceable else "")
                    + f"or, if it is a {runner!r} run made before "
                    f"run directories recorded their runner, record it: echo "
                    f"'{{\"runner\": \"{runner}\"}}' > {os.path.join(run_dir, OWNER_FILE)}")
  if replace and (made_by == runner or (made_by is None and not foreign)):
    raise UserError(f"--replace_run_dir replaces a run directory another runner made, but "
                    f"{run_dir!r} " + ("does not exist yet" if not os.path.isdir(run_dir)
                                       else f"holds no other runner's run "
                                            f"({made_by or 'no'!r} record)")
                    + f": there is nothing to replace, so the flag would not be used. Drop "
                      f"it.")
  moved = None
  if foreign or (made_by is not None and made_by != runner):
    if not replace:
      check_owner(run_dir, (runner,), repr(runner), replaceable=True)
    moved = tempfile.mkdtemp(dir=os.path.dirname(os.path.abspath(run_dir)) or ".",
                             prefix=f".{os.path.basename(os.path.abspath(run_dir))}.replaced-")
    os.rmdir(moved)
    os.rename(run_dir, moved)
  ensure_dir(run_dir)
  if made_by != runner:
    atomic_write(os.path.join(run_dir, OWNER_FILE),
                 json.dumps({"runner": runner}) + "\n")
  if moved is None:
    if not (existed and made_by is None):
      return None

    def unadopt(ok: bool) -> None:
      # A directory adopted by a run that failed is left as it was found: without this
      # runner's record (else the runner that made it could no longer resume it).
      if not ok:
        with contextlib.suppress(OSError):
          os.remove(os.path.join(run_dir, OWNER_FILE))
    return unadopt

  def finish(ok: bool) -> None:
    if ok:
      if os.path.islink(moved):     # a run directory given as a symlink: the link goes
        with contextlib.suppress(OSError):
          os.remove(moved)
      else:
        shutil.rmtree(moved, ignore_errors=True)
      return
    shutil.rmtree(run_dir, ignore_errors=True)
    os.rename(moved, run_dir)
    # What the failed run wrote went with its directory; the paths now name the old
    # run's files, which the caller's clean-up of a failed run must not remove.
    root = os.path.abspath(run_dir) + os.sep
    for written in _tracked:
      written[:] = [p for p in written if not p.startswith(root)]
  return finish


def remove_if_empty(path: str, up_to: Optional[str] = None) -> None:
  """Removes directory `path` if it holds no file but the run lock and the owner record
  (only empty directories): what a run that failed before writing anything leaves. Then
  its parents, up to and including `up_to`, while they are empty (the directories the run
  created above its own: `first_missing`)."""
  if not os.path.isdir(path) or os.path.islink(path):
    return
  for _, _, files in os.walk(path):
    if any(f not in (LOCK_FILE, OWNER_FILE) for f in files):
      return
  shutil.rmtree(path, ignore_errors=True)
  top = os.path.abspath(up_to) if up_to else None
  here = os.path.abspath(path)
  while top and here != top and here.startswith(top + os.sep):
    here = os.path.dirname(here)
    try:
      os.rmdir(here)          # only an empty directory
    except OSError:
      return


def first_missing(path: str) -> Optional[str]:
  """The highest directory on `path`'s way that does not exist yet (what creating `path`
  would create first), or None when `path` exists."""
  path = os.path.abspath(path)
  if os.path.lexists(path):
    return None
  while not os.path.lexists(os.path.dirname(path)) and os.path.dirname(path) != path:
    path = os.path.dirname(path)
  return path


LOCK_FILE = ".lock"


@contextlib.contextmanager
def locked(run_dir: str):
  """Holds an exclusive lock (flock on run_dir/.lock) while training into `run_dir`, so a
  second training into the same directory fails at once instead of interleaving its
  metrics and checkpoints. Released when the process ends, however it ends."""
  ensure_dir(run_dir)
  path = os.path.join(run_dir, LOCK_FILE)
  if os.path.lexists(path) and (os.path.islink(path) or not os.path.isfile(path)):
    raise UserError(f"{path} (a training's lock) is not a regular file ("
                    f"{'a symbolic link' if os.path.islink(path) else 'a directory' if os.path.isdir(path) else 'a FIFO, device or socket'}"
                    f"); remove it, or choose another --run_dir.")
  fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
      with open(path) as f:
        holder = f.read().strip() or "another process"
      raise UserError(f"Run directory {run_dir!r} is in use by another training (pid "
                      f"{holder}); wait for it to finish, or choose another --run_dir.") \
          from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    yield run_dir
  finally:
    os.close(fd)   # releases the lock


def atomic_write(path: str, data, mode: str = "w") -> None:
  """Writes `data` (str or bytes, or a callable taking a file object) atomically: a
  failed write (OSError) removes the temporary file and raises WriteError; an
  interrupted one removes it too, and `path` keeps its previous content either way."""
  directory = os.path.dirname(os.path.abspath(path))
  ensure_dir(directory)
  tmp = None
  try:
    fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".")
    with os.fdopen(fd, mode) as f:
      data(f) if callable(data) else f.write(data)
    os.chmod(tmp, 0o644)  # mkstemp makes 0600 files; outputs are for everyone to read
    if _tracked:
      _keep_previous(path)
    os.replace(tmp, path)
  except BaseException as e:
    if tmp is not None and os.path.exists(tmp):
      os.remove(tmp)
    if isinstance(e, OSError):
      raise write_error(path, e) from None
    raise
  _record(path)


def write_json(run_dir: str, name: str, obj: Any, *, provenance: bool = False) -> str:
  """Writes obj as JSON (atomically). provenance: a result's file, which gets a
  'provenance' entry (`provenance()`: the code, the XLA settings, the machine)."""
  if provenance and isinstance(obj, dict):
    obj = dict(obj, provenance=globals()["provenance"]())
  path = os.path.join(run_dir, name)
  atomic_write(path, json.dumps(obj, indent=1, default=_jsonable) + "\n")
  return path


_STARTED_FROM: Dict[str, Any] = {}


def code_identity() -> Dict[str, Any]:
  """{commit, clean, source} of the code this process runs, read once, at its first call
  (every runner makes it as it starts: `cli.run`): a result written at the end of a long
  run names the code the run started from, not what the tree became meanwhile (an edit
  or a commit made while it ran)."""
  if not _STARTED_FROM:
    commit = _git_describe()
    _STARTED_FROM.update(commit=commit, source=source_digest(),
                         clean=None if commit is None else not commit.endswith("-dirty"))
  return dict(_STARTED_FROM)


def code_version() -> Optional[str]:
  """`git describe --always --dirty` of the checkout this process started from
  (`code_identity`; None outside a git checkout): a figure names the code that made it,
  and '-dirty' says the tree had uncommitted changes."""
  return code_identity()["commit"]


def _git_describe() -> Optional[str]:
  import subprocess
  try:
    out = subprocess.run(["git", "describe", "--always", "--dirty"], capture_output=True,
                         text=True, timeout=10, cwd=os.path.dirname(os.path.abspath(__file__)))
  except (OSError, subprocess.SubprocessError):
    return None
  return out.stdout.strip() or None if out.returncode == 0 else None


SOURCE_DIRS = ("attnprec", "runners", "gin")


def source_digest() -> str:
  """SHA-256 (first 16 hex digits) of the code that makes a figure: every .py, .gin and
  asset file under attnprec/, runners/ and gin/ by relative path and content. Unlike the
  commit it needs no git metadata: a copy of the tree sent to another machine (a TPU
  without the repository's history) names its code by it, and any checkout recomputes it
  (`python -c 'from attnprec import runs; print(runs.source_digest())'`) to find the
  commit a figure came from."""
  import hashlib
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  h = hashlib.sha256()
  for top in SOURCE_DIRS:
    for dirpath, dirnames, filenames in os.walk(os.path.join(root, top)):
      dirnames[:] = sorted(d for d in dirnames if d != "__pycache__" and not d.startswith("."))
      for name in sorted(filenames):
        if name.endswith((".pyc", ".pyo")) or name.startswith("."):
          continue
        path = os.path.join(dirpath, name)
        h.update(os.path.relpath(path, root).encode() + b"\0")
        with open(path, "rb") as f:
          h.update(hashlib.sha256(f.read()).digest())
  return h.hexdigest()[:16]


def provenance() -> Dict[str, Any]:
  """Where a result comes from: the commit and whether the tree was clean, the digest of
  the source (`source_digest`: the code, also where git metadata is absent or stale), all
  three as the process started (`code_identity`), the XLA
  settings that change numerics (`xla_env.describe`: excess precision, the dot library,
  a user's numerics flags) and XLA_FLAGS as given, jax / jaxlib, the backend, the device
  and the machine."""
  import platform as host
  import jax
  import jaxlib
  from attnprec import xla_env
  code = code_identity()
  device = jax.devices()[0]
  return {"commit": code["commit"], "clean": code["clean"], "source": code["source"],
          "xla": xla_env.describe(), "xla_flags": os.environ.get("XLA_FLAGS", ""),
          "jax": jax.__version__, "jaxlib": jaxlib.__version__,
          "backend": jax.default_backend(), "device": getattr(device, "device_kind", str(device)),
          "machine": f"{host.machine()}, {os.cpu_count()} cores", "python": host.python_version()}


def _jsonable(x):
  if isinstance(x, (np.floating, np.integer)):
    return x.item()
  if isinstance(x, np.ndarray):
    return x.tolist()
  raise TypeError(f"not JSON serializable: {type(x)}")


def config_dict(config: ModelConfig) -> Dict[str, Any]:
  d = dataclasses.asdict(config)
  d["layer_pattern"] = list(d["layer_pattern"])
  return d


def write_operative_config(run_dir: str) -> None:
  """What gin actually used so far (call after the first step)."""
  atomic_write(os.path.join(run_dir, "operative_config.gin"), gin.operative_config_str())


class MetricsWriter:
  """Appends one JSON object per line to run_dir/metrics.jsonl (line-buffered)."""

  def __init__(self, run_dir: str, name: str = "metrics.jsonl"):
    self.path = os.path.join(ensure_dir(run_dir), name)
    if os.path.lexists(self.path) and not os.path.isfile(self.path):
      # A FIFO would block the first append forever; a directory cannot be appended to.
      raise UserError(f"{self.path} is not a regular file; the run appends its metrics "
                      f"there. Remove it, or choose another --run_dir.")

  def write(self, record: Dict[str, Any]) -> None:
    """Appends one line; a failed append is cut back off (WriteError), so the log never
    holds half a record."""
    unknown = sorted(set(record) - METRIC_KEYS)
    if unknown:     # what is written is what the read-back schema accepts
      raise ValueError(f"metrics keys {unknown} are not in runs.METRIC_KEYS")
    line = json.dumps(record, default=_jsonable) + "\n"
    size = os.path.getsize(self.path) if os.path.exists(self.path) else 0
    try:
      with open(self.path, "a") as f:
        f.write(line)
    except OSError as e:
      with contextlib.suppress(OSError):
        os.truncate(self.path, size)
      raise write_error(self.path, e) from None
    _record(self.path)

  def rewind(self, step: int) -> None:
    """Drops records after `step` (written by a run that was killed after its last
    checkpoint), so a resumed run's log has each step once. Every record is checked
    first (`read_metrics`)."""
    if not os.path.isfile(self.path):
      return
    records, text = read_metrics(self.path)
    kept = [r for r in records if r["step"] <= step]
    keep = "".join(json.dumps(r, default=_jsonable) + "\n" for r in kept)
    if len(kept) < len(records):
      dropped = [r["step"] for r in records if r["step"] > step]
      print(f"note: {self.path}: dropping {len(dropped)} record(s) of steps "
            f"{dropped[0]}..{dropped[-1]}, after the checkpoint of step {step} this run "
            f"resumes from (a run stopped after its last checkpoint writes them).")
    if keep != text:
      atomic_write(self.path, keep)


def read_metrics(path: str):
  """(records, the file's text) of a metrics.jsonl, every line checked: a JSON object
  with an integer 'step'. Only a last line cut short by a kill (no newline) is dropped;
  any other line that is not such a record, or a file that is not UTF-8, is a UserError
  naming the file and the line."""
  try:
    with open(path, encoding="utf-8") as f:
      text = f.read()
  except UnicodeDecodeError as e:
    raise UserError(f"{path} is not UTF-8 text (line {readback.line_of(e)}, "
                    f"byte {e.start}): not a metrics file a "
                    f"training wrote. Move it away, or use another --run_dir.") from None
  records, last_step = [], 0
  for number, line in enumerate(text.split("\n")[:-1], start=1):
    if not line.strip():
      continue
    obj, why = readback.loads(line)
    if why is None and not isinstance(obj, dict):
      why = f"a JSON {type(obj).__name__}, not an object"
    if why is None:
      why = _metrics_problem(obj, last_step)
    if why:
      raise UserError(f"{path}, line {number}: {why}. A training writes one JSON object "
                      f"per line with its step; the file was edited or written by other "
                      f"code. Fix or remove that line, or move the file away.")
    records.append(obj)
    last_step = obj["step"]
  return records, text


# What a training's metrics line holds (`train.train`: the update's metrics, the step,
# the steps skipped so far, the throughput, and at an eval step the eval's metrics).
METRIC_KEYS = frozenset({"step", "loss", "accuracy", "grad_norm", "param_norm",
                         "skipped_steps", "tokens_per_s", "eval_loss", "eval_accuracy"})


def _metrics_problem(obj: dict, last_step: int) -> Optional[str]:
  """What is wrong with one metrics record after a record of step `last_step`: a key
  outside METRIC_KEYS, a 'step' that is not an integer above it (steps count from 1, once each, in order), a value
  that is not a number, or a non-finite one in a run that skipped no step (a training
  writes non-finite figures only for steps it skipped: `skipped_steps` > 0)."""
  step = obj.get("step")
  if not readback.is_int(step):
    return f"its 'step' is {step!r}, not an integer"
  if step <= last_step:
    return (f"its 'step' is {step}, not above the line before's {last_step} (each step is "
            f"logged once, in order, from 1)")
  if step > INT_MAX:
    return f"its 'step' is {step}, past the most steps a training runs ({INT_MAX})"
  unknown = sorted(set(obj) - METRIC_KEYS)
  if unknown:
    return (f"its {unknown[0]!r} is not a figure a training logs (it logs "
            f"{', '.join(sorted(METRIC_KEYS))})")
  skipped = obj.get("skipped_steps", 0)
  for key, value in obj.items():
    if not readback.is_number(value):
      return f"its {key!r} is {value!r}, not a number"
    if not math.isfinite(value) and not (readback.is_number(skipped) and skipped > 0):
      return (f"its {key!r} is {value!r} while the run skipped no step (a training logs "
              f"a non-finite figure only for a step it skipped)")
    if math.isfinite(value) and key in ("accuracy", "eval_accuracy") and not 0 <= value <= 1:
      return f"its {key!r} is {value!r}, not a fraction in [0, 1]"
    if math.isfinite(value) and key in ("loss", "eval_loss") and value < 0:
      return f"its {key!r} is {value!r}, not a loss (a cross-entropy is >= 0)"
  return None


def save_params(run_dir: str, params) -> str:
  """{module: {name: array}} -> run_dir/params.npz with keys 'module//name'."""
  flat = {f"{m}//{n}": np.asarray(a) for m, d in params.items() for n, a in d.items()}
  path = os.path.join(run_dir, PARAMS_FILE)
  atomic_write(path, lambda f: np.savez(f, **flat), mode="wb")
  return path


def load_checkpoint(run_dir: str):
  """(ModelConfig, params) from a train run directory (or a shipped checkpoint dir)."""
  model_path = os.path.join(run_dir, MODEL_FILE)
  params_path = os.path.join(run_dir, PARAMS_FILE)
  if not os.path.isdir(run_dir):
    raise UserError(f"Checkpoint directory {run_dir!r} {paths.unreachable(run_dir)}. Train one with "
                    f"'make train' (writes runs/recall) or pass an existing run directory.")
  for p in (model_path, params_path):
    if os.path.lexists(p) and not os.path.isfile(p):
      raise UserError(f"{p!r} is not a regular file (a directory, a broken link, a FIFO): "
                      f"a train run directory holds {MODEL_FILE} and {PARAMS_FILE} as "
                      f"files a training wrote. Replace it, or train into a new directory.")
    if not os.path.isfile(p):
      raise UserError(f"Checkpoint directory {run_dir!r} has no {os.path.basename(p)}; a "
                      f"train run directory holds {MODEL_FILE} and {PARAMS_FILE}. Was the "
                      f"training run interrupted before it finished?")
  try:
    with open(model_path) as f:
      raw = json.load(f, object_pairs_hook=readback.unique_keys)
  except (OSError, ValueError) as e:
    raise UserError(f"Cannot read {model_path!r}: {e}. The file is corrupt or truncated.") \
        from None
  config = ModelConfig.from_dict(raw, origin=repr(model_path))
  try:
    with np.load(params_path) as z:
      params: Dict[str, Dict[str, np.ndarray]] = {}
      for key in z.files:
        parts = key.split("//")
        if len(parts) != 2 or not all(parts):
          raise UserError(
              f"{params_path!r} holds an array named {key!r}, not a parameter a training "
              f"saves (each is 'module//name', e.g. 'decoder/embed//embeddings'). It was "
              f"edited or written by other code; remove that array, or train into a new "
              f"directory.")
        params.setdefault(parts[0], {})[parts[1]] = z[parts[0] + "//" + parts[1]]
  except (OSError, ValueError, KeyError, zipfile.BadZipFile) as e:
    raise UserError(f"Cannot read {params_path!r}: {e}. The file is corrupt or truncated.") \
        from None
  check_params(config, params, params_path)
  return config, params
