"""A memory cgroup per sandbox run: one bound on the memory of all its processes together.

`find()` probes once for a cgroup hierarchy with the memory controller in which this process
may create children: cgroup v2 where the harness's own cgroup, or else its parent, already
delegates `memory` to its children (cgroup.subtree_control; it is never switched on here,
as that would change the machine's configuration; a v2 cgroup that holds processes cannot
delegate, so outside the root cgroup it is usually the parent, and the run's cgroup is a
sibling of the harness's), else the cgroup v1 memory hierarchy, where the harness's own
cgroup is the parent. Either way the run stays inside the limits above the harness.
`create()` makes one child per run with its limit (swap included, where the kernel accounts
it) and `remove()` deletes it once every process of the run has exited. The supervisor
joins it (writes to cgroup.procs) before it forks the program, so every process the
program starts is charged to it: anonymous memory, the private tmpfs pages, shared memory.
Over the limit the kernel's OOM killer kills within the cgroup only.

Without root (or without a writable hierarchy) `find()` returns None and the sandbox falls
back to its documented cap (attnprec/evals/sandbox.py: processes x address space).
"""
import dataclasses
import os
import secrets
import time
from typing import Dict, List, Optional


@dataclasses.dataclass(frozen=True)
class Hierarchy:
  version: int     # 1 or 2
  parent: str      # the harness's own memory cgroup, e.g. /sys/fs/cgroup/memory/some/group


def _mounts(mountinfo: str) -> List[List[str]]:
  """(mount point, file system type, super options) of each mount, from mountinfo."""
  rows = []
  with open(mountinfo) as f:
    for line in f:
      before, _, after = line.partition(" - ")
      fields, tail = before.split(), after.split()
      if len(fields) >= 5 and len(tail) >= 3:
        point = fields[4].encode().decode("unicode_escape")
        rows.append([point, tail[0], tail[2]])
  return rows


def _own_cgroups(cgroup: str) -> Dict[str, str]:
  """controller list ('' for v2) -> this process's cgroup path, from /proc/self/cgroup."""
  paths = {}
  with open(cgroup) as f:
    for line in f:
      parts = line.rstrip("\n").split(":", 2)
      if len(parts) == 3:
        paths[parts[1]] = parts[2]
  return paths


def _read(path: str) -> str:
  with open(path) as f:
    return f.read()


def _write(path: str, value) -> None:
  with open(path, "w") as f:
    f.write(f"{value}\n")


def _holds(directory: str, pid: int) -> bool:
  """The directory is really the cgroup of process `pid` (it is listed there)."""
  try:
    return str(pid) in _read(os.path.join(directory, "cgroup.procs")).split()
  except OSError:
    return False


def _delegates_memory(directory: str) -> bool:
  try:
    return "memory" in _read(os.path.join(directory, "cgroup.subtree_control")).split()
  except OSError:
    return False


def candidates(mountinfo: str = "/proc/self/mountinfo", cgroup: str = "/proc/self/cgroup",
               pid: Optional[int] = None) -> List[Hierarchy]:
  """Where a run's cgroup could go, best first (read from the given /proc files)."""
  mounts, own = _mounts(mountinfo), _own_cgroups(cgroup)
  pid = os.getpid() if pid is None else pid
  found = []
  for point, fstype, _ in mounts:
    if fstype == "cgroup2" and "" in own:
      mine = os.path.normpath(os.path.join(point, own[""].lstrip("/")))
      if _holds(mine, pid):
        parents = [mine] + ([os.path.dirname(mine)] if mine != os.path.normpath(point) else [])
        found += [Hierarchy(2, d) for d in parents[:2] if _delegates_memory(d)][:1]
  for point, fstype, options in mounts:
    if fstype == "cgroup" and "memory" in options.split(","):
      path = next((p for c, p in own.items() if "memory" in c.split(",")), None)
      mine = None if path is None else os.path.join(point, path.lstrip("/"))
      if mine is not None and _holds(mine, pid):
        found.append(Hierarchy(1, mine))
  return found


def find() -> Optional[Hierarchy]:
  """The first hierarchy where a child with a memory limit can be made (tried for real)."""
  try:
    found = candidates()
  except OSError:
    return None
  for hierarchy in found:
    path = create(hierarchy, 64 << 20)
    if path is not None:
      remove(path)
      return hierarchy
  return None


def create(hierarchy: Hierarchy, limit_bytes: int) -> Optional[str]:
  """A new child cgroup limited to `limit_bytes` (memory and swap), or None on failure."""
  path = os.path.join(hierarchy.parent, f"attnprec-sandbox-{os.getpid()}-{secrets.token_hex(6)}")
  try:
    os.mkdir(path, 0o755)
  except OSError:
    return None
  try:
    if hierarchy.version == 2:
      _write(os.path.join(path, "memory.max"), limit_bytes)
      if os.path.exists(os.path.join(path, "memory.swap.max")):
        _write(os.path.join(path, "memory.swap.max"), 0)
    else:
      _write(os.path.join(path, "memory.limit_in_bytes"), limit_bytes)
      if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
        _write(os.path.join(path, "memory.memsw.limit_in_bytes"), limit_bytes)
  except OSError:
    os.rmdir(path)
    return None
  return path


def remove(path: str, timeout_s: float = 5.0) -> None:
  """Deletes the run's cgroup; its processes are being killed, so it waits until the kernel
  has let them go (rmdir says EBUSY until then)."""
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      os.rmdir(path)
      return
    except FileNotFoundError:
      return
    except OSError:
      if time.monotonic() > deadline:
        raise RuntimeError(f"The sandbox's cgroup {path} still holds processes "
                           f"{_read(os.path.join(path, 'cgroup.procs')).split()} "
                           f"{timeout_s:g} s after the run was killed.") from None
      time.sleep(0.01)
