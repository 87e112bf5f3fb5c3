"""A memory cgroup per sandbox run: one bound on the memory of all its processes together.

`find()` probes once for a cgroup hierarchy with the memory controller in which this process
may create children: cgroup v2 where the harness's own cgroup already delegates `memory`
to its children (cgroup.subtree_control; it is never switched on here, as that would change
the machine's configuration), else the cgroup v1 memory hierarchy. The harness's own cgroup
is the parent, so the run stays inside whatever limit the harness itself is under.
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


def _mounts() -> List[List[str]]:
  """(mount point, file system type, super options) of each mount, from mountinfo."""
  rows = []
  with open("/proc/self/mountinfo") as f:
    for line in f:
      before, _, after = line.partition(" - ")
      fields, tail = before.split(), after.split()
      if len(fields) >= 5 and len(tail) >= 3:
        point = fields[4].encode().decode("unicode_escape")
        rows.append([point, tail[0], tail[2]])
  return rows


def _own_cgroups() -> Dict[str, str]:
  """controller list ('' for v2) -> this process's cgroup path, from /proc/self/cgroup."""
  paths = {}
  with open("/proc/self/cgroup") as f:
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


def _candidates() -> List[Hierarchy]:
  mounts, own = _mounts(), _own_cgroups()
  found = []
  for point, fstype, _ in mounts:
    if fstype == "cgroup2" and "" in own:
      parent = os.path.join(point, own[""].lstrip("/"))
      subtree = os.path.join(parent, "cgroup.subtree_control")
      if os.path.exists(subtree) and "memory" in _read(subtree).split():
        found.append(Hierarchy(2, parent))
  for point, fstype, options in mounts:
    if fstype == "cgroup" and "memory" in options.split(","):
      path = next((p for c, p in own.items() if "memory" in c.split(",")), None)
      if path is not None:
        found.append(Hierarchy(1, os.path.join(point, path.lstrip("/"))))
  return found


def _owns_us(hierarchy: Hierarchy) -> bool:
  """The path is really this process's cgroup (its pid is listed there)."""
  try:
    return str(os.getpid()) in _read(os.path.join(hierarchy.parent, "cgroup.procs")).split()
  except OSError:
    return False


def find() -> Optional[Hierarchy]:
  """The first hierarchy where a child with a memory limit can be made (tried for real)."""
  try:
    candidates = _candidates()
  except OSError:
    return None
  for hierarchy in candidates:
    if not _owns_us(hierarchy):
      continue
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
