"""The sandbox that runs model-written programs (HumanEval: prompt + completion + test + check).

Design. `run_program(source)` runs one program in a fresh subprocess and classifies what
happened as an `Outcome`. The chain of processes is

  harness (this process)
    -> unshare --net --pid --ipc --fork --mount-proc --kill-child   (where the machine allows it)
      -> supervisor: `python -I -S -B -X utf8 -c <_SUPERVISOR>`  (trusted, written here)
        -> worker: a fork of the supervisor that compiles and runs the untrusted source

The supervisor reads the program and the run's pass code (below) from the (root-owned)
working directory and deletes them, joins the run's memory cgroup, makes every mount of its
own mount namespace read-only and mounts private size-capped tmpfs file systems over /tmp,
/var/tmp, /dev/shm and the working directory (so the only writable places are fresh tmpfs
that vanish with the namespace), bounds SysV IPC in its new IPC namespace, sets hard
resource limits, drops to the user `nobody` (uid/gid 65534) when it runs as root, sets
no_new_privs, installs a seccomp filter, makes itself non-dumpable, reports on a status pipe
which of these it applied, and then forks the worker and waits for it. It changes mounts and
IPC settings only after checking (by the namespace's inode number) that its namespace is
not the harness's. Resource limits alone do not hold under root (root may raise its hard
limits, and RLIMIT_NPROC is not enforced for it), which is why the drop comes after the
limits and before any untrusted code runs.

Protections, each reported in `Outcome.protections` only when it actually applied:

- 'isolated interpreter': `-I -S -B` (no PYTHON* variables, no user or site packages: the
  program sees the standard library only, which is all HumanEval needs), always.
- 'scrubbed environment': the program sees only PATH=/usr/bin:/bin, HOME, TMPDIR, LANG.
- 'temporary directory': an empty working directory (mkdtemp) removed after every run.
- 'timeout': a wall-clock limit; on expiry the whole process group is SIGKILLed.
- 'rlimits': RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NPROC, RLIMIT_CORE=0 (hard limits).
- 'memory cgroup': all processes of the run share one memory limit,
  `Limits.total_memory_bytes` (2 GiB; swap included), in a cgroup made for the run
  (cgroup v2 under the harness's own cgroup or its parent, where `memory` is delegated;
  else v1 under the harness's own; `sandbox_cgroup`) and removed after it. Over the
  limit the kernel's OOM killer kills inside the run only.
- 'memory cap': where no such cgroup can be made (not root, no writable hierarchy), each
  process's address space is lowered to total_memory_bytes // processes, so the at most
  `processes` processes map at most total_memory_bytes together (2 GiB / 16 = 128 MiB
  each by default). Exactly one of the two applies; the total never exceeds half the RAM.
- 'uid nobody': the program runs as uid/gid 65534 with no supplementary groups (only when
  the harness runs as root; otherwise it runs as the harness's own user).
- 'no_new_privs': set-uid binaries cannot give the program its privileges back.
- 'seccomp filter': add_key, request_key and keyctl fail (a key in the user's keyring
  would outlive the run), and so do socket(AF_UNIX) (a daemon's socket file on the
  read-only root would still accept connections; socketpair works) and io_uring (it could
  make that socket without the socket call); x86_64 and aarch64.
- 'sealed verdict': the verdict reaches the harness only through the status pipe, which
  the worker closes before the program starts, from a supervisor that is not dumpable (the
  program cannot ptrace it or open /proc/<pid>/fd of it).
- 'network namespace': a new network namespace with no interfaces up: no network at all.
- 'pid namespace': the supervisor is pid 1 of its own PID namespace; the program cannot see
  or signal any process outside it (its "parent" is the supervisor, which it cannot kill
  either: pid 1 ignores signals from inside its namespace), and when the supervisor exits
  or is killed (`--kill-child`) the kernel kills everything left in the namespace,
  including processes that left the process group.
- 'ipc namespace': SysV shared memory, semaphores and message queues (and POSIX message
  queues) the program makes live in a namespace that dies with the run; its shared memory
  is bounded by Limits.tmpfs_bytes and it may have at most 16 segments and 16 queues.
- 'read-only root': every mount the program sees is read-only (mount_setattr with
  AT_RECURSIVE, or one bind remount per mount point on kernels before 5.12), so no file
  it writes outside the private tmpfs can outlive the run, whatever directories are
  world-writable on the machine (e.g. /run/lock).
- 'private tmpfs': the tmpfs mounts described above.

The verdict. The worker runs the program with `exec` and ends with an exit status that
says how: one fixed status per failure kind (syntax, assertion, error, memory) or, for
passed, a status drawn at random per run by the harness and handed to the supervisor in a
file it deletes (never on a command line). The supervisor turns the worker's wait status
into the verdict line; a program that prints or writes a verdict anywhere, or exits by
itself (os._exit, a signal) before its tests have run, fails. What no sandbox can prevent:
a hostile program runs in the interpreter that runs its tests, so it can subvert them
(replace `check`, patch builtins, return an object equal to everything), and in the same
way it can read the pass status out of the worker's own frames. The sandbox contains
damage; it guarantees that a crash, a kill, a limit, a timeout, an early exit or a printed
verdict is never reported as passed.

The interpreter. Under root the harness's own Python may live where nobody cannot read it
(pyenv under /root, mode 0700, on these machines); the probe then picks the first of the
harness's interpreter, its base interpreter, /usr/bin/python3 and /usr/local/bin/python3
whose standard library nobody can import, so the program may run on another Python 3 than
the harness (HumanEval needs the standard library only). With none, the program runs as
the harness's user and 'uid nobody' is not reported.

What is not contained. RLIMIT_NPROC counts all processes of a user, so sandboxes running
at the same time share the `processes` budget of user nobody (run them one at a time or
raise `Limits.processes`). Under the memory cap (no cgroup) the private tmpfs mounts (4 x
Limits.tmpfs_bytes) and SysV shared memory (Limits.tmpfs_bytes) come on top of the
processes' total. Without the namespaces (no `unshare`, or not allowed) the program has
the machine's network and SysV IPC, can write to world-writable directories such as /tmp
(each file bounded by RLIMIT_FSIZE), and a process that leaves its process group outlives
the run; `protections` then says so by leaving those entries out.
"""
import contextlib
import dataclasses
import functools
import json
import math
import os
import selectors
import shutil
import signal
import secrets
import subprocess
import sys
import tempfile
import time
from typing import Optional, Tuple

from attnprec.errors import UserError
from attnprec.evals import sandbox_cgroup

NOBODY = 65534
_DETAIL_CHARS = 300
_STATUS_BYTES = 64 << 10     # the status pipe carries two short JSON lines
_TAIL_BYTES = 4 << 10        # the end of the output kept to explain a crash
_CHUNK_BYTES = 64 << 10
_PROGRAM_FILE = ".program.py"

KINDS = {
    "passed": "the program ran to its end without an exception (said by the worker's exit status)",
    "assertion": "an AssertionError escaped (a failed test)",
    "syntax": "the source does not compile (SyntaxError, IndentationError, null bytes)",
    "error": "another exception escaped, or the program exited before its end (os._exit)",
    "memory": "a MemoryError escaped (the address-space limit was hit)",
    "timeout": "the wall-clock limit (or the CPU-time limit) was exceeded",
    "killed": "the program died from a signal (a resource limit, a crash, or killing itself)",
    "output_limit": "stdout + stderr exceeded Limits.output_bytes",
}
_WORKER_KINDS = ("passed", "assertion", "syntax", "error", "memory")

_ALWAYS = ("isolated interpreter", "scrubbed environment", "temporary directory", "timeout")
_NAMESPACE_FLAGS = ("--net", "--pid", "--ipc", "--fork", "--mount-proc", "--kill-child")
_NAMESPACE_KINDS = ("net", "pid", "ipc", "mnt")
_PASS_FILE = ".pass_code"
# Exit statuses the worker uses for a failure (sandbox._SUPERVISOR: FAILURE_CODES) and a few
# a process commonly exits with; the status that means "passed" is drawn among the others.
_RESERVED_CODES = frozenset({0, 1, 2, 3, 4, 5, 6, 120, 125, 126, 127})


@dataclasses.dataclass(frozen=True)
class Limits:
  """Per-program limits; the defaults suit HumanEval (a few ms of CPU per problem).

  timeout_s: wall clock, interpreter start included. cpu_s: CPU seconds (RLIMIT_CPU).
  memory_bytes: address space per process (RLIMIT_AS). total_memory_bytes: memory of the
  whole sandbox, all its processes together (never more than half the machine's RAM): the
  limit of its memory cgroup, or where none applies the cap that lowers each process's
  address space to total_memory_bytes // processes. file_bytes: largest file the program
  may write (RLIMIT_FSIZE). processes: processes of the sandbox user (RLIMIT_NPROC; counts
  the supervisor). output_bytes: stdout + stderr together. tmpfs_bytes: size of each
  private tmpfs (working directory, /tmp, /var/tmp, /dev/shm) where they apply.
  """
  timeout_s: float = 10.0
  cpu_s: int = 10
  memory_bytes: int = 2 << 30
  total_memory_bytes: int = 2 << 30
  file_bytes: int = 16 << 20
  processes: int = 16
  output_bytes: int = 1 << 20
  tmpfs_bytes: int = 64 << 20

  def __post_init__(self):
    for field in dataclasses.fields(self):
      _check_positive(field.name, getattr(self, field.name), field.type)


@dataclasses.dataclass(frozen=True)
class Outcome:
  """What happened to one program. `kind` is one of KINDS; `detail` is short (the last line
  of the traceback, or which limit was hit); `protections` are those that applied."""
  passed: bool
  kind: str
  detail: str
  seconds: float
  protections: Tuple[str, ...]


def _check_positive(name: str, value, type_name) -> None:
  want_float = type_name in (float, "float")
  ok_type = (isinstance(value, (int, float)) if want_float else isinstance(value, int))
  if isinstance(value, bool) or not ok_type or not (value > 0 and math.isfinite(value)):
    kind = "a positive finite number of seconds" if want_float else "a positive integer"
    raise UserError(f"Invalid sandbox limit {name}={value!r}: it must be {kind} (see "
                    f"attnprec.evals.sandbox.Limits for the defaults).")


def _check_args(source, limits) -> None:
  if not isinstance(source, str):
    raise UserError(f"run_program(source=...) must be the program's source text as a str, "
                    f"got a {type(source).__name__}: {_short(repr(source))}.")
  if not isinstance(limits, Limits):
    raise UserError(f"run_program(limits=...) must be an attnprec.evals.sandbox.Limits, got "
                    f"a {type(limits).__name__}: {_short(repr(limits))}.")


def _short(text: str, chars: int = _DETAIL_CHARS) -> str:
  text = " ".join(text.split())
  return text if len(text) <= chars else text[:chars - 3] + "..."


# --- the trusted supervisor, run by the child interpreter -----------------------------------

_SUPERVISOR = r'''
import builtins, json, os, resource, socket, sys, traceback

MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND = 2, 4, 8, 32, 4096
FAILURE_CODES = {"syntax": 3, "assertion": 4, "error": 5, "memory": 6}


def libc():
  import ctypes
  return ctypes.CDLL(None, use_errno=True)


def errno_error(what):
  import ctypes
  err = ctypes.get_errno()
  return OSError(err, "%s: %s" % (what, os.strerror(err)))


def new_namespace(kind, host_ns):
  """Whether this process is in another namespace of `kind` than the harness."""
  return os.stat("/proc/self/ns/" + kind).st_ino != host_ns[kind]


def mount_tmpfs(lib, target, size, mode, uid):
  opts = "size=%d,nr_inodes=4096,mode=%o" % (size, mode)
  if uid is not None:
    opts += ",uid=%d,gid=%d" % (uid, uid)
  flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
  if lib.mount(b"tmpfs", target.encode(), b"tmpfs", flags, opts.encode()) != 0:
    raise errno_error("mount tmpfs on %s" % target)


def read_only_root(lib):
  """Every mount of this (private) mount namespace read-only: mount_setattr(2) on / with
  AT_RECURSIVE, or one bind remount per mount point where the kernel lacks it (< 5.12)."""
  import ctypes

  class MountAttr(ctypes.Structure):
    _fields_ = [(name, ctypes.c_uint64)
                for name in ("attr_set", "attr_clr", "propagation", "userns_fd")]

  attr = MountAttr(1, 0, 0, 0)   # MOUNT_ATTR_RDONLY
  lib.syscall.restype = ctypes.c_long
  if lib.syscall(ctypes.c_long(442), ctypes.c_int(-100), b"/", ctypes.c_uint(0x8000),
                 ctypes.byref(attr), ctypes.c_size_t(ctypes.sizeof(attr))) != 0:
    remount_each_read_only(lib)


def remount_each_read_only(lib):
  """One read-only bind remount per mount point, keeping its nosuid/nodev/noexec/atime."""
  keep = {1: 1, 2: 2, 4: 4, 8: 8, 1024: 1024, 2048: 2048, 4096: 1 << 21}  # statvfs -> mount
  with open("/proc/self/mountinfo") as f:
    points = [line.split()[4] for line in f]
  for point in points:
    point = point.encode().decode("unicode_escape").encode("latin-1")
    flags = os.statvfs(point).f_flag
    extra = sum(mount for st, mount in keep.items() if flags & st)
    if lib.mount(None, point, None, MS_REMOUNT | MS_BIND | 1 | extra, None) != 0:
      raise errno_error("remount %s read-only" % point.decode(errors="replace"))


def private_tmpfs(lib, cfg):
  for target in ("/tmp", "/var/tmp", "/dev/shm"):
    if os.path.isdir(target):
      mount_tmpfs(lib, target, cfg["tmpfs_bytes"], 0o1777, None)
  os.makedirs(cfg["workdir"], exist_ok=True)
  mount_tmpfs(lib, cfg["workdir"], cfg["tmpfs_bytes"], 0o700, cfg["drop_to"])
  os.chdir(cfg["workdir"])


def ipc_limits(cfg):
  """SysV IPC of the new namespace bounded (its defaults allow terabytes of shared memory
  and 32000 message queues), so it also holds where no memory cgroup applies."""
  page = os.sysconf("SC_PAGE_SIZE")
  for name, value in (("shmmax", cfg["tmpfs_bytes"]), ("shmall", cfg["tmpfs_bytes"] // page),
                      ("shmmni", 16), ("msgmni", 16), ("sem", "32 256 32 16")):
    with open("/proc/sys/kernel/" + name, "w") as f:
      f.write("%s\n" % value)


def join_cgroup(path):
  with open(os.path.join(path, "cgroup.procs"), "w") as f:
    f.write("0\n")


def set_limits(cfg, address_space):
  for name, soft, hard in cfg["rlimits"] + [["RLIMIT_AS", address_space, address_space]]:
    resource.setrlimit(getattr(resource, name), (soft, hard))


def drop_privileges(uid):
  os.setgroups([])
  os.setgid(uid)
  os.setuid(uid)
  try:
    os.setuid(0)
  except PermissionError:
    pass
  else:
    raise RuntimeError("could not drop root")
  if os.getuid() != uid or os.geteuid() != uid or os.getgid() != uid:
    raise RuntimeError("uid/gid not dropped")


def no_new_privs(lib):
  return lib.prctl(38, 1, 0, 0, 0) == 0   # PR_SET_NO_NEW_PRIVS


def not_dumpable(lib):
  return lib.prctl(4, 0, 0, 0, 0) == 0    # PR_SET_DUMPABLE: no ptrace, /proc/1/fd closed


# Per architecture: (audit arch, calls refused outright, the socket call or None) for the
# native and the compat table (a 64-bit process may still make 32-bit calls, e.g. int 0x80;
# no honest program does, so the compat table loses every socket call as well). Refused
# everywhere: the keyring calls and io_uring (425-427), whose requests (a socket, a
# connect) would not pass through this filter.
IO_URING = (425, 426, 427)
SYSCALL_FILTER = {
    "x86_64": [(0xC000003E, (248, 249, 250) + IO_URING, 41),
               (0x40000003, (286, 287, 288, 102, 359) + IO_URING, None)],
    "aarch64": [(0xC00000B7, (217, 218, 219) + IO_URING, 198),
                (0x40000028, (309, 310, 311, 281) + IO_URING, None)],
}


def syscall_filter(lib):
  """A seccomp filter: add_key, request_key and keyctl fail with EPERM (the kernel keeps a
  user's keyrings after the run, so a key would survive it), and so do socket(AF_UNIX, ...)
  (a socket file on the read-only root, a host daemon's, still accepts connections;
  socketpair stays), io_uring, x32 calls and calls of any other architecture. Needs
  no_new_privs."""
  import ctypes
  tables = SYSCALL_FILTER.get(os.uname().machine)
  if tables is None:
    return False
  load, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
  allow, deny = 0x7FFF0000, 0x00050000 | 1   # SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO | EPERM
  code = [(load, 0, 0, 4)]                   # A = seccomp_data.arch
  for arch, refused, socket_call in tables:
    body = [(load, 0, 0, 0)]                 # A = seccomp_data.nr
    if arch == 0xC000003E:
      body.append((jge, "deny", 0, 0x40000000))   # x32 system calls
    body += [(jeq, "deny", 0, nr) for nr in refused]
    if socket_call is not None:              # A = args[0] (its low word: an int)
      body += [(jeq, 0, 2, socket_call), (load, 0, 0, 16), (jeq, "deny", 0, 1)]   # AF_UNIX
    body.append((ret, 0, 0, allow))
    code += [(jeq, 0, len(body), arch)] + body
  code.append((ret, 0, 0, deny))
  end = len(code) - 1
  code = [(op, end - i - 1 if jt == "deny" else jt, jf, k)
          for i, (op, jt, jf, k) in enumerate(code)]

  class Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8),
                ("k", ctypes.c_uint32)]

  class Program(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(Filter))]

  filters = (Filter * len(code))(*[Filter(*row) for row in code])
  program = Program(len(code), filters)
  return lib.prctl(22, 2, ctypes.byref(program), 0, 0) == 0   # PR_SET_SECCOMP, FILTER


def only_loopback():
  return [name for _, name in socket.if_nameindex()] == ["lo"]


def where(tb):
  line = None
  while tb is not None:
    if tb.tb_frame.f_code.co_filename == "<program>":
      line = tb.tb_lineno
    tb = tb.tb_next
  return line


def describe(exc):
  text = traceback.format_exception_only(type(exc), exc)[-1].strip()
  line = getattr(exc, "lineno", None) if isinstance(exc, SyntaxError) else where(exc.__traceback__)
  return text if line is None else "%s (line %s)" % (text, line)


def execute(source):
  try:
    code = compile(source, "<program>", "exec", dont_inherit=True)
  except (SyntaxError, ValueError) as exc:
    return "syntax", describe(exc)
  try:
    exec(code, {"__name__": "__main__", "__builtins__": builtins})
  except AssertionError as exc:
    return "assertion", describe(exc)
  except MemoryError as exc:
    return "memory", describe(exc)
  except BaseException as exc:
    return "error", describe(exc)
  return "passed", ""


def worker(source, pass_code, detail_fd):
  """Runs the program; its verdict is its exit status (the status pipe is closed)."""
  codes = dict(FAILURE_CODES, passed=pass_code)
  sys.argv = [""]
  kind, detail = execute(source)
  code = codes[kind]
  for stream in (sys.stdout, sys.stderr):
    try:
      stream.flush()
    except BaseException:
      pass
  try:
    os.set_blocking(detail_fd, False)
    os.write(detail_fd, b"\n" + detail[:1000].encode("utf-8", "replace") + b"\n")
  except BaseException:
    pass
  os._exit(code)


def read_detail(fd):
  os.set_blocking(fd, False)
  data = b""
  while len(data) < (64 << 10):
    try:
      chunk = os.read(fd, 64 << 10)
    except OSError:
      break
    if not chunk:
      break
    data += chunk
  lines = [line for line in data.split(b"\n") if line.strip()]
  return lines[-1].decode("utf-8", "replace") if lines else ""


def verdict(status, pass_code, detail):
  """What the worker's wait status says (the only verdict the harness reads)."""
  if os.WIFSIGNALED(status):
    return {"signal": os.WTERMSIG(status)}
  code = os.waitstatus_to_exitcode(status)
  if code == pass_code:
    return {"kind": "passed", "detail": ""}
  for kind, failure_code in FAILURE_CODES.items():
    if code == failure_code:
      return {"kind": kind, "detail": detail}
  return {"kind": "error",
          "detail": "the program exited with status %d before its verdict (os._exit?)" % code}


def main():
  cfg = json.loads(sys.argv[1])
  status_fd = cfg["status_fd"]
  with open(cfg["program"], "rb") as f:
    source = f.read().decode("utf-8", "surrogatepass")
  os.unlink(cfg["program"])
  with open(cfg["pass_code"]) as f:
    pass_code = int(f.read())
  os.unlink(cfg["pass_code"])
  lib = libc()   # before the limits: loading it needs memory
  applied = []
  cgroup = False
  if cfg["cgroup"]:
    try:
      join_cgroup(cfg["cgroup"])
      cgroup = True
      applied.append("memory cgroup")
    except OSError as exc:
      sys.stderr.write("sandbox: no memory cgroup: %s\n" % exc)
  if cfg["namespaces"]:
    host_ns = cfg["host_ns"]
    if os.getpid() == 1:
      applied.append("pid namespace")
    if new_namespace("net", host_ns) and only_loopback():
      applied.append("network namespace")
    if new_namespace("ipc", host_ns):
      applied.append("ipc namespace")
      try:
        ipc_limits(cfg)
      except OSError as exc:
        sys.stderr.write("sandbox: SysV IPC not bounded: %s\n" % exc)
    if new_namespace("mnt", host_ns):   # never touch the harness's own mounts
      try:
        read_only_root(lib)
        applied.append("read-only root")
      except OSError as exc:
        sys.stderr.write("sandbox: root not read-only: %s\n" % exc)
      try:
        private_tmpfs(lib, cfg)
        applied.append("private tmpfs")
      except OSError as exc:
        sys.stderr.write("sandbox: no private tmpfs: %s\n" % exc)
  memory = cfg["memory"]
  set_limits(cfg, memory["per_process"] if cgroup else memory["capped"])
  applied.append("rlimits")
  if not cgroup:
    applied.append("memory cap")
  if cfg["drop_to"] is not None:
    drop_privileges(cfg["drop_to"])
    applied.append("uid nobody")
  if no_new_privs(lib):
    applied.append("no_new_privs")
    if syscall_filter(lib):
      applied.append("seccomp filter")
  if not_dumpable(lib):
    applied.append("sealed verdict")
  os.write(status_fd, (json.dumps({"supervisor": applied}) + "\n").encode())
  detail_r, detail_w = os.pipe()
  try:
    pid = os.fork()
  except OSError as exc:   # e.g. other sandboxes hold user nobody's RLIMIT_NPROC budget
    sys.stderr.write("sandbox: cannot fork the program: %s\n" % exc)
    os._exit(125)
  if pid == 0:
    os.close(status_fd)
    os.close(detail_r)
    worker(source, pass_code, detail_w)
  os.close(detail_w)
  _, status = os.waitpid(pid, 0)
  line = json.dumps(verdict(status, pass_code, read_detail(detail_r))) + "\n"
  os.write(status_fd, line.encode())
  os._exit(0)


main()
'''


# --- the harness side -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class _Plan:
  prefix: Tuple[str, ...]     # the unshare command line, or ()
  python: str                 # the interpreter that runs the supervisor and the program
  drop_to: Optional[int]      # NOBODY when running as root and an interpreter allows it
  cgroup: Optional[sandbox_cgroup.Hierarchy]   # where each run gets a memory cgroup


# What the probe imports as nobody: proof that the interpreter's standard library (not
# only what was imported before the drop) is readable by the sandbox user.
_PROBE_IMPORTS = "import tempfile, signal, socket, encodings.idna, ctypes, hashlib, heapq, re"


def _usable_by_nobody(python: str) -> bool:
  code = (f"import os; os.setgroups([]); os.setgid({NOBODY}); os.setuid({NOBODY}); "
          f"{_PROBE_IMPORTS}")
  try:
    probe = subprocess.run([python, "-I", "-S", "-c", code], stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                           cwd="/", env=_environment("/"), timeout=30)
  except (OSError, subprocess.TimeoutExpired):
    return False
  return probe.returncode == 0


def _interpreter(as_root: bool) -> Tuple[str, bool]:
  """The interpreter to use and whether the program can run as nobody with it. Under root
  the harness's own interpreter may live where nobody cannot read (e.g. pyenv under
  /root, mode 0700); then a system Python 3 serves (HumanEval needs the stdlib only)."""
  if not as_root:
    return sys.executable, False
  candidates = [sys.executable, getattr(sys, "_base_executable", sys.executable),
                "/usr/bin/python3", "/usr/local/bin/python3"]
  for python in dict.fromkeys(candidates):
    if os.path.exists(python) and _usable_by_nobody(python):
      return python, True
  return sys.executable, False


def _namespaces() -> Tuple[str, ...]:
  """The unshare command line, if this machine lets us create the namespaces."""
  unshare = shutil.which("unshare", path="/usr/bin:/bin:/usr/sbin:/sbin")
  if unshare is None:
    return ()
  prefix = (unshare,) + _NAMESPACE_FLAGS
  try:
    probe = subprocess.run(prefix + ("true",), stdin=subprocess.DEVNULL,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=10)
  except (OSError, subprocess.TimeoutExpired):
    return ()
  return prefix if probe.returncode == 0 else ()


@functools.lru_cache(maxsize=None)
def _plan() -> _Plan:
  """Probes once what this machine allows."""
  python, drop = _interpreter(os.geteuid() == 0)
  return _Plan(_namespaces(), python, NOBODY if drop else None, sandbox_cgroup.find())


@functools.lru_cache(maxsize=None)
def available_protections() -> Tuple[str, ...]:
  """The protections that apply on this machine, found by running one trivial program."""
  return run_program("pass").protections


def _rlimits(limits: Limits):
  """All but RLIMIT_AS, which depends on whether the memory cgroup applied (_memory)."""
  return [("RLIMIT_CPU", limits.cpu_s, limits.cpu_s + 1),
          ("RLIMIT_FSIZE", limits.file_bytes, limits.file_bytes),
          ("RLIMIT_NPROC", limits.processes, limits.processes),
          ("RLIMIT_CORE", 0, 0)]


def _memory(limits: Limits):
  """RLIMIT_AS with the memory cgroup ('per_process') and without it ('capped': at most
  `processes` processes of total // processes each), and the total itself."""
  total = min(limits.total_memory_bytes, _physical_memory() // 2)
  return {"total": total, "per_process": limits.memory_bytes,
          "capped": min(limits.memory_bytes, total // limits.processes)}


def _physical_memory() -> int:
  return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _host_namespaces():
  """The harness's namespaces (their inode numbers): the supervisor compares its own with
  these and touches mounts and IPC settings only in namespaces that are really new."""
  return {kind: os.stat(f"/proc/self/ns/{kind}").st_ino for kind in _NAMESPACE_KINDS}


def _pass_code() -> int:
  return secrets.choice([code for code in range(256) if code not in _RESERVED_CODES])


def _environment(workdir: str):
  return {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"}


def _make_workdir(plan: _Plan) -> str:
  workdir = tempfile.mkdtemp(prefix="attnprec-sandbox-")
  if plan.drop_to is not None:
    os.chown(workdir, plan.drop_to, plan.drop_to)
  return workdir


def _remove_workdir(workdir: str) -> None:
  """Removes the working directory, also when the program left unreadable directories
  in it (possible where it runs as the harness's own user)."""
  shutil.rmtree(workdir, ignore_errors=True)
  if os.path.lexists(workdir):
    for parent, dirs, _ in os.walk(workdir):
      for name in dirs:
        os.chmod(os.path.join(parent, name), 0o700, follow_symlinks=False)
    shutil.rmtree(workdir)


def run_program(source: str, *, limits: Limits = Limits()) -> Outcome:
  """Runs `source` as a program in the sandbox and says how it ended (see KINDS)."""
  _check_args(source, limits)
  plan = _plan()
  memory = _memory(limits)
  workdir = _make_workdir(plan)
  cgroup = None
  try:
    program = _write_private(workdir, _PROGRAM_FILE, source.encode("utf-8", "surrogatepass"))
    pass_code = _write_private(workdir, _PASS_FILE, str(_pass_code()).encode())
    if plan.cgroup is not None:
      cgroup = sandbox_cgroup.create(plan.cgroup, memory["total"])
    return _run(plan, workdir, program, pass_code, cgroup, memory, limits)
  finally:
    try:
      _remove_workdir(workdir)
    finally:
      if cgroup is not None:
        sandbox_cgroup.remove(cgroup)


def _write_private(workdir: str, name: str, data: bytes) -> str:
  """A file only the harness's user (root, before the supervisor drops) can read."""
  path = os.path.join(workdir, name)
  with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
    f.write(data)
  return path


def _run(plan: _Plan, workdir: str, program: str, pass_code: str, cgroup: Optional[str],
         memory, limits: Limits) -> Outcome:
  out_r, out_w = os.pipe()
  status_r, status_w = os.pipe()
  config = {"status_fd": status_w, "program": program, "pass_code": pass_code,
            "workdir": workdir, "namespaces": bool(plan.prefix),
            "host_ns": _host_namespaces(), "drop_to": plan.drop_to, "cgroup": cgroup,
            "memory": memory, "rlimits": _rlimits(limits), "tmpfs_bytes": limits.tmpfs_bytes}
  argv = list(plan.prefix) + [plan.python, "-I", "-S", "-B", "-X", "utf8", "-c",
                              _SUPERVISOR, json.dumps(config)]
  start = time.monotonic()
  try:
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out_w, stderr=out_w,
                            pass_fds=(status_w,), cwd=workdir, env=_environment(workdir),
                            start_new_session=True)
  finally:
    os.close(out_w)
    os.close(status_w)
  try:
    stop, output, status = _supervise(proc, out_r, status_r, limits, start)
  finally:   # close first: a writer blocked on a full pipe then gets EPIPE, not a wait
    os.close(out_r)
    os.close(status_r)
    _kill_group(proc)
  seconds = time.monotonic() - start
  return _classify(stop, proc.returncode, output, status, limits, seconds)


def _exited(pid: int) -> bool:
  """Whether the child has exited, without reaping it (its pid stays its group's id)."""
  return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


class _Streams:
  """Reads the output pipe (counting it, keeping only its tail) and the status pipe."""

  def __init__(self, out_r: int, status_r: int, output_cap: int):
    self.out_r, self.status_r, self.output_cap = out_r, status_r, output_cap
    self.output_total = 0
    self.tail = bytearray()
    self.status = bytearray()

  def read(self, fd: int) -> bool:
    """Reads one chunk; False at end of file or when nothing is ready."""
    try:
      chunk = os.read(fd, _CHUNK_BYTES)
    except BlockingIOError:
      return False
    if fd == self.out_r:
      self.output_total += len(chunk)
      self.tail = (self.tail + chunk)[-_TAIL_BYTES:]
    elif len(self.status) < _STATUS_BYTES:
      self.status += chunk[:_STATUS_BYTES - len(self.status)]
    return bool(chunk)

  def over_cap(self) -> bool:
    return self.output_total > self.output_cap

  def drain(self) -> None:
    """After the child exited: what is left in the pipes, without waiting for writers that
    may outlive it (and never more than the output cap)."""
    for fd in (self.out_r, self.status_r):
      os.set_blocking(fd, False)
      while not self.over_cap() and self.read(fd):
        pass


def _supervise(proc, out_r: int, status_r: int, limits: Limits, start: float):
  """Waits for the child, its output cap or its deadline, whichever comes first."""
  streams = _Streams(out_r, status_r, limits.output_bytes)
  deadline = start + limits.timeout_s
  with selectors.DefaultSelector() as selector:
    selector.register(out_r, selectors.EVENT_READ)
    selector.register(status_r, selectors.EVENT_READ)
    stop = None
    while stop is None:
      remaining = deadline - time.monotonic()
      if remaining <= 0:
        stop = "timeout"
        break
      for key, _ in selector.select(min(remaining, 0.02)):
        if not streams.read(key.fd):
          selector.unregister(key.fd)
      if streams.over_cap():
        stop = "output_limit"
      elif _exited(proc.pid):
        streams.drain()
        stop = "output_limit" if streams.over_cap() else "exited"
  return stop, bytes(streams.tail), bytes(streams.status)


def _children(pid: int) -> Tuple[int, ...]:
  try:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
      return tuple(int(child) for child in f.read().split())
  except OSError:
    pass
  children = []
  for entry in os.listdir("/proc"):
    try:
      with open(f"/proc/{entry}/stat") as f:
        if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
          children.append(int(entry))
    except (OSError, ValueError, IndexError):
      continue
  return tuple(children)


def _kill_group(proc) -> None:
  """Kills everything the run left, then reaps the child.

  Under unshare the supervisor (pid 1 of the namespace) is killed first: the kernel then
  kills the rest of the namespace and unshare reaps the supervisor and exits, so no zombie
  is left to a host init that may be slow to reap it (a zombie still counts against user
  nobody's RLIMIT_NPROC). Then the whole process group is SIGKILLed: the child is its
  leader and is not yet reaped, so the group id cannot have been reused."""
  if not _exited(proc.pid):
    for child in _children(proc.pid):
      with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(child, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
      _wait_exited(proc.pid, timeout_s=5.0)
  with contextlib.suppress(ProcessLookupError, PermissionError):
    os.killpg(proc.pid, signal.SIGKILL)
  proc.wait()


def _wait_exited(pid: int, timeout_s: float) -> None:
  deadline = time.monotonic() + timeout_s
  while not _exited(pid):
    if time.monotonic() > deadline:
      raise subprocess.TimeoutExpired(f"pid {pid}", timeout_s)
    time.sleep(0.005)


def _parse_status(status: bytes):
  """The supervisor's report (first line, written before any untrusted code ran) and its
  verdict from the worker's wait status (second line). Only the supervisor holds the
  status pipe: the worker closes it before the program starts."""
  lines = status.split(b"\n")
  try:
    applied = tuple(json.loads(lines[0])["supervisor"])
  except (ValueError, KeyError, TypeError):
    return None, None
  try:
    verdict = json.loads(lines[1])
    if "signal" in verdict:
      return applied, ("signal", int(verdict["signal"]))
    kind, detail = str(verdict["kind"]), str(verdict["detail"])
  except (ValueError, KeyError, TypeError, IndexError):
    return applied, None
  return applied, (kind if kind in _WORKER_KINDS else "error", detail)


def _signal_name(number: int) -> str:
  try:
    return signal.Signals(number).name
  except ValueError:
    return f"signal {number}"


def _last_line(output: bytes) -> str:
  lines = output.decode("utf-8", "replace").strip().splitlines()
  return lines[-1] if lines else ""


def _classify(stop, returncode, output, status, limits, seconds) -> Outcome:
  applied, verdict = _parse_status(status)
  protections = _ALWAYS + (applied or ())

  def outcome(kind, detail, passed=False):
    return Outcome(passed, kind, _short(detail), seconds, protections)

  if stop == "timeout":
    return outcome("timeout", f"wall-clock limit of {limits.timeout_s:g} s exceeded")
  if stop == "output_limit":
    return outcome("output_limit", f"stdout + stderr exceeded {limits.output_bytes} bytes")
  if applied is None:
    raise RuntimeError(f"The sandbox did not start (exit status {returncode}): "
                       f"{_short(_last_line(output))}")
  def killed(number):
    if number == signal.SIGXCPU:
      return outcome("timeout", f"CPU-time limit of {limits.cpu_s} s exceeded (SIGXCPU)")
    return outcome("killed", f"killed by {_signal_name(number)}")

  if returncode > 128 or returncode < 0:   # the supervisor itself (unshare passes it on)
    return killed(returncode - 128 if returncode > 128 else -returncode)
  if returncode != 0 or verdict is None:
    return outcome("error", f"the sandbox's supervisor failed (exit status {returncode}): "
                            f"{_last_line(output)}")
  kind, detail = verdict
  if kind == "signal":
    return killed(detail)
  return outcome(kind, detail or "all assertions held", passed=(kind == "passed"))
