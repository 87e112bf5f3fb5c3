"""The sandbox that runs model-written programs: each hostile program is contained, counted as
a failure, and leaves nothing behind outside its temporary directory.

Every test runs with tempfile's directory pointed at a fresh folder under pytest's tmp_path,
so the autouse fixture can check that each run's working directory was removed. Where a
protection depends on the machine (namespaces, running as root), the test asserts what
`Outcome.protections` says and checks the behaviour that follows from it.
"""
import dataclasses
import functools
import inspect
import os
import random
import resource
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time

import pytest

from attnprec.errors import UserError
from attnprec.evals import sandbox, sandbox_cgroup
from attnprec.evals.sandbox import Limits, run_program

QUICK = Limits(timeout_s=2.0, cpu_s=5)


@pytest.fixture(autouse=True)
def sandbox_parent(tmp_path, monkeypatch):
  """Working directories go under tmp_path/sandboxes, which must be empty after each run."""
  parent = tmp_path / "sandboxes"
  parent.mkdir()
  parent.chmod(0o755)
  monkeypatch.setattr(tempfile, "tempdir", str(parent))
  yield parent
  assert os.listdir(parent) == [], "a sandbox working directory was left behind"


def _protections():
  return sandbox.available_protections()


def _marked_limits(**overrides):
  """QUICK limits with a tmpfs size no other run uses: it appears in the supervisor's
  command line, which its forks share, so the test can find this run's processes."""
  marker = (64 << 20) + 4096 * random.randrange(1, 1 << 20)
  fields = dict(timeout_s=QUICK.timeout_s, cpu_s=QUICK.cpu_s, tmpfs_bytes=marker)
  fields.update(overrides)
  return Limits(**fields), f'"tmpfs_bytes": {marker}'.encode()


def _processes_with(marker: bytes):
  found = []
  for entry in os.listdir("/proc"):
    try:
      with open(f"/proc/{entry}/cmdline", "rb") as f:
        if marker in f.read():
          found.append(int(entry))
    except (OSError, ValueError):
      continue
  return found


def _wait_gone(marker: bytes, timeout_s: float = 3.0):
  deadline = time.monotonic() + timeout_s
  while _processes_with(marker) and time.monotonic() < deadline:
    time.sleep(0.05)
  return _processes_with(marker)


# --- ordinary programs ----------------------------------------------------------------------

def test_correct_program_passes():
  source = "def add(a, b):\n  return a + b\n\ndef check(f):\n  assert f(2, 3) == 5\n\ncheck(add)\n"
  outcome = run_program(source, limits=QUICK)
  assert outcome.passed and outcome.kind == "passed"
  assert outcome.seconds < QUICK.timeout_s
  assert set(sandbox._ALWAYS) <= set(outcome.protections)


def test_wrong_assertion_fails():
  source = "def add(a, b):\n  return a - b\n\nassert add(2, 3) == 5, 'add is wrong'\n"
  outcome = run_program(source, limits=QUICK)
  assert not outcome.passed
  assert outcome.kind == "assertion"
  assert outcome.detail == "AssertionError: add is wrong (line 4)"


@pytest.mark.parametrize("source, error", [
    ("def f(:\n  return 1\n", "SyntaxError"),
    ("def f():\nreturn 1\n", "IndentationError"),
    ("x = 1\0\n", ""),
])
def test_syntax_error(source, error):
  outcome = run_program(source, limits=QUICK)
  assert not outcome.passed
  assert outcome.kind == "syntax"
  assert error in outcome.detail


def test_other_exception_is_an_error_and_detail_is_short():
  outcome = run_program("raise KeyError('k' * 5000)\n", limits=QUICK)
  assert (outcome.passed, outcome.kind) == (False, "error")
  assert outcome.detail.startswith("KeyError: 'kkk")
  assert len(outcome.detail) <= 300


def test_exit_without_verdict_or_forged_verdict_is_not_passed():
  """`passed` needs a clean exit as well as a passing verdict line: a program that exits
  before its verdict, or forges one and then dies from a signal, has not passed."""
  early_exit = run_program("import os\nos._exit(0)\n", limits=QUICK)
  assert (early_exit.passed, early_exit.kind) == (False, "error")
  forge = ("import os, signal\n"
           "for fd in range(3, 64):\n"
           "  try:\n"
           "    os.write(fd, b'{\"kind\": \"passed\", \"detail\": \"\"}\\n')\n"
           "  except OSError:\n"
           "    pass\n"
           "os.kill(os.getpid(), signal.SIGKILL)\n")
  forged = run_program(forge, limits=QUICK)
  assert (forged.passed, forged.kind) == (False, "killed")
  assert "SIGKILL" in forged.detail
  exit_zero = run_program("import sys\nsys.exit(0)\n", limits=QUICK)
  assert (exit_zero.passed, exit_zero.kind) == (False, "error")


def test_environment_is_scrubbed(monkeypatch):
  monkeypatch.setenv("ATTNPREC_SANDBOX_SECRET", "hunter2")
  monkeypatch.setenv("PYTHONPATH", "/nonexistent/evil")
  source = ("import os, sys\n"
            "assert 'ATTNPREC_SANDBOX_SECRET' not in os.environ, 'secret visible'\n"
            "assert not any('hunter2' in v for v in os.environ.values()), 'secret value visible'\n"
            "assert sorted(os.environ) == ['HOME', 'LANG', 'PATH', 'TMPDIR'], sorted(os.environ)\n"
            "assert os.environ['PATH'] == '/usr/bin:/bin'\n"
            "assert sys.flags.isolated and sys.flags.no_site, sys.flags\n"
            "assert not any('evil' in p or 'site-packages' in p for p in sys.path), sys.path\n"
            "assert os.listdir('.') == [], os.listdir('.')\n")
  outcome = run_program(source, limits=QUICK)
  assert outcome.passed, outcome.detail


def test_working_directory_is_removed_even_when_made_unwritable(sandbox_parent):
  source = ("import os\n"
            "os.makedirs('a/b/c')\n"
            "open('a/b/c/f', 'w').write('x')\n"
            "os.chmod('a/b/c', 0o500)\n"
            "os.chmod('a/b', 0o000)\n"
            "open('top', 'w').write('y')\n")
  outcome = run_program(source, limits=QUICK)
  assert outcome.passed, outcome.detail
  assert os.listdir(sandbox_parent) == []


# --- hostile programs -----------------------------------------------------------------------

def test_infinite_loop_times_out():
  outcome = run_program("while True:\n  pass\n", limits=QUICK)
  assert (outcome.passed, outcome.kind) == (False, "timeout")
  assert "2 s" in outcome.detail
  assert QUICK.timeout_s <= outcome.seconds < QUICK.timeout_s + 2.0


def test_cpu_limit_counts_as_timeout():
  """RLIMIT_CPU fires before the (long) wall-clock limit, however loaded the machine."""
  limits = Limits(timeout_s=30.0, cpu_s=1)
  outcome = run_program("while True:\n  pass\n", limits=limits)
  assert (outcome.passed, outcome.kind) == (False, "timeout")
  assert "CPU-time limit of 1 s" in outcome.detail
  assert outcome.seconds < limits.timeout_s


def test_fork_bomb_is_bounded_and_cleaned_up():
  limits, marker = _marked_limits(processes=8)
  bomb = ("import os\n"
          "while True:\n"
          "  try:\n"
          "    os.fork()\n"
          "  except OSError:\n"
          "    pass\n")
  start = time.monotonic()
  outcome = run_program(bomb, limits=limits)
  assert time.monotonic() - start < limits.timeout_s + 3.0
  assert not outcome.passed
  assert outcome.kind in ("timeout", "killed", "error")
  assert "rlimits" in outcome.protections
  assert _wait_gone(marker) == [], "fork-bomb processes outlived the run"
  healthy = run_program("import os\npid = os.fork()\nif pid == 0:\n  os._exit(0)\n"
                        "assert os.waitpid(pid, 0)[1] == 0\n", limits=QUICK)
  assert healthy.passed, healthy.detail


def test_processes_limit_holds():
  """RLIMIT_NPROC binds the program (as nobody when the harness is root: under root it
  would not hold)."""
  source = ("import os, time\n"
            "pids = []\n"
            "try:\n"
            "  for _ in range(50):\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "      time.sleep(5)\n"
            "      os._exit(0)\n"
            "    pids.append(pid)\n"
            "finally:\n"
            "  print(len(pids))\n"
            "assert False, 'forked %d' % len(pids)\n")
  outcome = run_program(source, limits=Limits(timeout_s=QUICK.timeout_s, processes=6))
  assert (outcome.passed, outcome.kind) == (False, "error")
  assert "BlockingIOError" in outcome.detail or "Resource temporarily" in outcome.detail


@pytest.mark.parametrize("source", [
    "x = bytearray(50 * 10**9)\n",
    "chunks = []\nfor _ in range(200):\n  chunks.append(bytearray(1 << 28))\n",
])
def test_allocating_50_gb_fails(source):
  """At once, or in 256 MiB chunks that are written (bytearray zero-fills them): the
  address-space limit stops both. It is lowered to 512 MiB so that the chunked case
  touches little memory and stays quick on a loaded machine."""
  limits = Limits(timeout_s=10.0, memory_bytes=512 << 20)
  outcome = run_program(source, limits=limits)
  assert not outcome.passed
  assert outcome.kind in ("memory", "killed"), outcome
  assert outcome.seconds < limits.timeout_s


def test_writing_10_gb_file_is_stopped(sandbox_parent):
  tag = f"attnprec-sandbox-big-{os.getpid()}-{random.randrange(1 << 30)}"
  outside = [f"/tmp/{tag}", f"/dev/shm/{tag}"]
  source = ("import os\n"
            f"for path in ['big.bin'] + {outside!r}:\n"
            "  try:\n"
            "    with open(path, 'wb') as f:\n"
            "      for _ in range(10 * 1024):\n"
            "        f.write(b'x' * (1 << 20))\n"
            "  except OSError as e:\n"
            "    last = e\n"
            "raise last\n")
  try:
    outcome = run_program(source, limits=QUICK)
    assert not outcome.passed
    assert outcome.kind in ("error", "killed"), outcome
    assert "File too large" in outcome.detail or "SIGXFSZ" in outcome.detail, outcome
    assert os.listdir(sandbox_parent) == []
    if "private tmpfs" in outcome.protections:
      assert [p for p in outside if os.path.exists(p)] == []
    else:   # /tmp and /dev/shm are world-writable: only RLIMIT_FSIZE bounds those files
      assert all(os.path.getsize(p) <= QUICK.file_bytes for p in outside if os.path.exists(p))
  finally:
    for path in outside:
      if os.path.exists(path):
        os.remove(path)


def _deleting_program(canary: str) -> str:
  """Tries four ways to destroy the canary; fails naming the errno of each refusal."""
  return ("import errno, os, shutil\n"
          f"canary = {canary!r}\n"
          "done, errors = [], []\n"
          "for name, attempt in [('remove', lambda: os.remove(canary)),\n"
          "                      ('truncate', lambda: open(canary, 'w').close()),\n"
          "                      ('rename', lambda: os.rename(canary, canary + '.moved')),\n"
          "                      ('rmtree', lambda: shutil.rmtree(os.path.dirname(canary)))]:\n"
          "  try:\n"
          "    attempt()\n"
          "    done.append(name)\n"
          "  except OSError as e:\n"
          "    errors.append(errno.errorcode.get(e.errno, type(e).__name__))\n"
          "assert done, ' '.join(sorted(set(errors)))\n")


def _canary(directory) -> str:
  """A root-owned (if we are root) 0644 file in a 0755 directory: readable by anyone,
  writable only by its owner."""
  os.makedirs(directory, exist_ok=True)
  os.chmod(directory, 0o755)
  path = os.path.join(directory, "canary.txt")
  with open(path, "w") as f:
    f.write("precious\n")
  os.chmod(path, 0o644)
  return path


def _assert_intact(canary: str):
  with open(canary) as f:
    assert f.read() == "precious\n"
  assert stat.S_IMODE(os.stat(os.path.dirname(canary)).st_mode) == 0o755


def test_deleting_files_by_absolute_path_in_tmp(tmp_path):
  """The canary lies under pytest's tmp_path. Every directory above it is made traversable
  by others (o+x), so it is the sandbox, not pytest's 0700 base directory, that stops the
  program: with a private /tmp the path does not exist inside; without one, user nobody
  has no write permission on a root-owned 0755 directory."""
  canary = _canary(tmp_path / "precious")
  opened = []
  for directory in [tmp_path, *tmp_path.parents]:
    if str(directory) in ("/", tempfile.gettempdir()):
      break
    mode = stat.S_IMODE(directory.stat().st_mode)
    opened.append((directory, mode))
    directory.chmod(mode | stat.S_IXOTH)
  try:
    outcome = run_program(_deleting_program(canary), limits=QUICK)
  finally:
    for directory, mode in opened:
      directory.chmod(mode)
  _assert_intact(canary)
  assert (outcome.passed, outcome.kind) == (False, "assertion")
  if "private tmpfs" in outcome.protections:
    assert "ENOENT" in outcome.detail, outcome.detail
  elif "uid nobody" in outcome.protections:
    assert "EACCES" in outcome.detail, outcome.detail


def test_deleting_files_by_absolute_path_outside_tmp(request):
  """A canary the program can see (in the repository's pytest cache, outside every private
  mount): the read-only root refuses every change (EROFS), and without it the drop to user
  nobody does (EACCES). A checkout under /tmp puts the canary where the program has its own
  tmpfs instead: there the path does not exist for it (ENOENT)."""
  cache = getattr(request.config, "cache", None)
  if cache is None:
    pytest.skip("needs pytest's cache directory (cacheprovider plugin)")
  if "uid nobody" not in _protections():
    pytest.skip("the harness does not run as root here, so the program runs as the same "
                "user and can delete that user's files: only namespaces and rlimits apply")
  directory = cache.mkdir(f"sandbox-canary-{os.getpid()}")
  try:
    canary = _canary(directory)
    outcome = run_program(_deleting_program(canary), limits=QUICK)
    _assert_intact(canary)
    assert (outcome.passed, outcome.kind) == (False, "assertion")
    under_private = any(directory.resolve().is_relative_to(d)
                        for d in ("/tmp", "/var/tmp", "/dev/shm"))
    if under_private and "private tmpfs" in outcome.protections:
      # a checkout under /tmp: the program's /tmp is its own tmpfs, where the canary is not
      assert "ENOENT" in outcome.detail, outcome.detail
    elif "read-only root" in outcome.protections:
      assert outcome.detail == "AssertionError: EROFS (line 13)", outcome.detail
    else:
      assert "EACCES" in outcome.detail, outcome.detail
  finally:
    shutil.rmtree(directory, ignore_errors=True)


def test_opening_a_socket_fails_without_network():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    source = ("import socket\n"
              f"socket.create_connection(('127.0.0.1', {port}), timeout=1).close()\n")
    outcome = run_program(source, limits=QUICK)
    try:
      connection, _ = listener.accept()
      connection.close()
      reached = True
    except BlockingIOError:
      reached = False
  if "network namespace" in outcome.protections:
    assert not reached
    assert (outcome.passed, outcome.kind) == (False, "error")
    assert "Network is unreachable" in outcome.detail or "refused" in outcome.detail
  else:   # this machine does not allow `unshare -n`: the program shares our network
    assert "network namespace" not in _protections()
    assert reached and outcome.passed


def test_killing_its_parent_harms_nobody_outside():
  bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
  try:
    source = ("import os, signal\n"
              f"for pid in (os.getppid(), {os.getpid()}, {bystander.pid}):\n"
              "  try:\n"
              "    os.kill(pid, signal.SIGKILL)\n"
              "  except OSError:\n"
              "    pass\n"
              "try:\n"
              "  os.kill(-1, signal.SIGKILL)\n"
              "except OSError:\n"
              "  pass\n"
              "os.killpg(0, signal.SIGKILL)\n")
    outcome = run_program(source, limits=QUICK)
    time.sleep(0.1)
    assert bystander.poll() is None, "a process outside the sandbox was killed"
  finally:
    bystander.kill()
    bystander.wait()
  assert not outcome.passed
  assert outcome.kind == "killed", outcome


def test_killing_only_its_parent_leaves_the_supervisor_in_charge():
  """Under a PID namespace the parent is the supervisor, pid 1 there, and the kernel drops
  SIGKILL sent to it from inside: the program goes on and its own verdict stands. Without
  one the supervisor dies, and the run counts as killed."""
  source = ("import os, signal, time\n"
            "os.kill(os.getppid(), signal.SIGKILL)\n"
            "time.sleep(0.2)\n"
            "assert False, 'still here'\n")
  outcome = run_program(source, limits=QUICK)
  assert not outcome.passed
  if "pid namespace" in outcome.protections:
    assert (outcome.kind, outcome.detail) == ("assertion", "AssertionError: still here (line 4)")
  else:
    assert outcome.kind == "killed", outcome


def test_sysv_ipc_does_not_outlive_the_run():
  """Shared memory, a semaphore set and a message queue (one with a fixed key, one private)
  are made inside; none of them is left on the host afterwards, and the namespace's own
  shared-memory limit refuses a segment larger than Limits.tmpfs_bytes."""
  key = random.randrange(1 << 20, 1 << 30)
  source = ("import ctypes\n"
            "lib = ctypes.CDLL(None, use_errno=True)\n"
            f"key, create = {key}, 0o1666\n"
            "made = [lib.shmget(key, 1 << 20, create), lib.semget(key, 1, create),\n"
            "        lib.msgget(key, create), lib.shmget(0, 1 << 20, create),\n"
            "        lib.msgget(0, create)]\n"
            "assert min(made) >= 0, ('not made', made, ctypes.get_errno())\n"
            f"huge = lib.shmget(0, ctypes.c_size_t({2 * QUICK.tmpfs_bytes}), create)\n"
            "assert False, 'made all, huge segment %s' % ('refused' if huge < 0 else 'made')\n")
  before = _sysv_ipc()
  outcome = run_program(source, limits=QUICK)
  after = _sysv_ipc()
  try:
    assert (outcome.passed, outcome.kind) == (False, "assertion"), outcome
    if "ipc namespace" in outcome.protections:
      assert outcome.detail == "AssertionError: made all, huge segment refused (line 9)"
      assert [entry for entry in after if entry[1] == key] == []
      assert after <= before, f"IPC objects left on the host: {sorted(after - before)}"
    else:   # only where this machine allows no namespaces at all
      assert not sandbox._plan().prefix, outcome.protections
  finally:
    for kind, _, ident in after - before:
      subprocess.run(["ipcrm", {"shm": "-m", "sem": "-s", "msg": "-q"}[kind], str(ident)],
                     stderr=subprocess.DEVNULL, check=False)


def _sysv_ipc():
  """{(kind, key, id)} of every SysV IPC object on the host."""
  found = set()
  for kind in ("shm", "sem", "msg"):
    with open(f"/proc/sysvipc/{kind}") as f:
      for line in f.read().splitlines()[1:]:
        key, ident = line.split()[:2]
        found.add((kind, int(key), int(ident)))
  return found


def _directories(depth: int):
  """Every directory at most `depth` levels below / (not /proc or /sys), without links."""
  for top, subdirs, _ in os.walk("/"):
    level = 0 if top == "/" else top.count("/")
    if level >= depth:
      subdirs[:] = []
    elif top == "/":
      subdirs[:] = [d for d in subdirs if d not in ("proc", "sys")]
    yield top


_WALK_DEPTH = 3


def test_no_written_file_survives_the_run(sandbox_parent):
  """The program writes a file into every directory it finds (three levels deep, plus
  the usual world-writable ones and its working directory). Only the private tmpfs mounts
  may take it (the root is read-only), and afterwards none of the files exists on the
  host: not in /run/lock (on the root disk), nor anywhere else the host's own walk finds."""
  tag = f"attnprec-sandbox-left-{os.getpid()}-{random.randrange(1 << 30)}"
  fixed = ["/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue", "/run/shm"]
  source = ("import os\n"
            f"tag, fixed = {tag!r}, {fixed!r} + [os.getcwd()]\n"
            f"{inspect.getsource(_directories)}\n"
            "wrote = set()\n"
            f"for d in fixed + list(_directories({_WALK_DEPTH})):\n"
            "  try:\n"
            "    with open(os.path.join(d, tag), 'x') as f:\n"
            "      f.write('left behind')\n"
            "    wrote.add(os.path.realpath(d))\n"
            "  except OSError:\n"
            "    pass\n"
            "assert {'/tmp', os.getcwd()} <= wrote, sorted(wrote)\n"
            "extra = wrote - {'/tmp', '/var/tmp', '/dev/shm', os.getcwd()}\n"
            "assert False, 'elsewhere: %s' % sorted(extra)\n")
  outcome = run_program(source, limits=QUICK)
  host = set(_directories(_WALK_DEPTH)) | set(fixed)
  left = sorted({os.path.realpath(d) for d in host if os.path.lexists(os.path.join(d, tag))})
  try:
    assert (outcome.passed, outcome.kind) == (False, "assertion"), outcome
    if "read-only root" in outcome.protections and "private tmpfs" in outcome.protections:
      assert outcome.detail.startswith("AssertionError: elsewhere: [] "), outcome.detail
      assert left == [], f"files the program wrote are still on the host in {left}"
    else:   # only where this machine allows no namespaces at all
      assert not sandbox._plan().prefix, outcome.protections
  finally:
    for d in left:
      os.remove(os.path.join(d, tag))


def test_read_only_fallback_for_kernels_without_mount_setattr(tmp_path):
  """Kernels before 5.12 lack mount_setattr; then every mount point is remounted read-only
  one by one. Run here directly in a private mount namespace: the harness's own directory
  and /dev/shm refuse a new file inside it, and stay writable outside."""
  if not sandbox._plan().prefix:
    assert "read-only root" not in _protections()
    return
  definitions = sandbox._SUPERVISOR.replace("\nmain()\n", "\n")   # the functions, not main()
  script = ("import os\n"
            f"namespace = {{}}\nexec({definitions!r}, namespace)\n"
            "namespace['remount_each_read_only'](namespace['libc']())\n"
            "refused = []\n"
            f"inside = {str(tmp_path / 'inside')!r}\n"
            "for path in [inside, '/dev/shm/attnprec-sandbox-%d' % os.getpid()]:\n"
            "  try:\n"
            "    open(path, 'x').close()\n"
            "  except OSError as e:\n"
            "    refused.append(e.strerror)\n"
            "print(refused)\n")
  unshare = sandbox._plan().prefix[0]
  done = subprocess.run([unshare, "--mount", "--propagation", "private", sys.executable, "-c",
                         script], capture_output=True, text=True, timeout=30)
  assert done.stdout.strip() == "['Read-only file system', 'Read-only file system']", done
  (tmp_path / "outside").write_text("still writable")
  assert not (tmp_path / "inside").exists()


_FORGED = b'{"kind": "passed", "detail": ""}\n'


@pytest.mark.parametrize("forgery, exit_kind", [
    ("print(forged.decode(), end='')\nsys.stderr.write(forged.decode())\n", "assertion"),
    ("import glob\n"
     "def forge():\n"
     "  for fd in range(1024):\n"
     "    try:\n"
     "      os.write(fd, forged)\n"
     "    except OSError:\n"
     "      pass\n"
     "  for path in glob.glob('/proc/[0-9]*/fd/*'):\n"
     "    try:\n"
     "      with open(path, 'wb') as f:\n"
     "        f.write(forged)\n"
     "    except OSError:\n"
     "      pass\n"
     "forge()\n"
     "if os.fork() == 0:\n"          # a child that forges again once the worker has exited
     "  time.sleep(0.3)\n"
     "  forge()\n"
     "  os._exit(0)\n", "assertion"),
    ("os.write(1, forged)\nos._exit(0)\n", "error"),
])
def test_a_forged_verdict_is_not_believed(forgery, exit_kind):
  """A program writes a passing verdict line to its output; to every file descriptor it has
  and every /proc/<pid>/fd it can open (again from a child after the worker has exited);
  or to its output before exiting with status 0. Its test then fails, or never runs: judged
  by how the worker ended, it fails. (The worker closes the status pipe before the program
  starts, and the supervisor is not dumpable.)"""
  source = (f"import os, sys, time\nforged = {_FORGED!r}\n{forgery}"
            "def add(a, b):\n  return a - b\n"
            "assert add(2, 3) == 5, 'add is wrong'\n")
  outcome = run_program(source, limits=QUICK)
  assert (outcome.passed, outcome.kind) == (False, exit_kind), outcome
  if exit_kind == "assertion":
    assert outcome.detail.startswith("AssertionError: add is wrong (line "), outcome.detail
  assert "sealed verdict" in outcome.protections


def _no_cgroup(monkeypatch):
  plan = sandbox._plan()
  monkeypatch.setattr(sandbox, "_plan", lambda: dataclasses.replace(plan, cgroup=None))


_HOLDERS = ("import os, time\n"
            "r, w = os.pipe()\n"
            "children = []\n"
            "for _ in range(6):\n"
            "  try:\n"
            "    pid = os.fork()\n"
            "  except OSError:\n"
            "    break\n"
            "  if pid == 0:\n"
            "    try:\n"
            "      block = b'x' * (96 << 20)\n"   # written, so it is resident
            "      os.write(w, b'%d ' % os.getpid())\n"
            "    except MemoryError:\n"
            "      os._exit(3)\n"
            "    time.sleep(30)\n"
            "    os._exit(0)\n"
            "  children.append(pid)\n"
            "time.sleep(1.5)\n"
            "os.set_blocking(r, False)\n"
            "try:\n"
            "  reported = {int(p) for p in os.read(r, 4096).split()}\n"
            "except BlockingIOError:\n"
            "  reported = set()\n"
            "alive = {p for p in children if os.waitpid(p, os.WNOHANG) == (0, 0)}\n"
            "assert False, 'holding %d' % len(reported & alive)\n")


@pytest.mark.parametrize("cgroup", [True, False])
def test_forked_allocations_share_one_memory_bound(cgroup, monkeypatch):
  """Six children each write 96 MiB and keep it (576 MiB in all, each well within its own
  address-space limit); the sandbox's total is 384 MiB. With the memory cgroup the kernel
  kills children beyond it; with the fallback cap each process may only have 384 MiB / 16,
  so the allocations fail. Either way at most 384 MiB are held at once, and the program
  fails quickly. (16 processes: room to spare where other runs hold some of user nobody's.)"""
  limits, marker = _marked_limits(timeout_s=8.0, processes=16, memory_bytes=192 << 20,
                                  total_memory_bytes=384 << 20)
  if not cgroup:
    _no_cgroup(monkeypatch)
  outcome = run_program(_HOLDERS, limits=limits)
  assert not outcome.passed
  assert outcome.seconds < limits.timeout_s
  assert _wait_gone(marker) == []
  if cgroup and "memory cgroup" not in _protections():
    assert sandbox._plan().cgroup is None   # no writable cgroup hierarchy here
    return
  assert ("memory cgroup" in outcome.protections) == cgroup, outcome.protections
  assert ("memory cap" in outcome.protections) == (not cgroup), outcome.protections
  assert outcome.kind == "assertion", outcome
  held = int(outcome.detail.split("holding ")[1].split()[0])
  assert held * (96 << 20) <= limits.total_memory_bytes, outcome.detail
  if not cgroup:
    assert held == 0


def test_fork_bomb_that_allocates_is_contained():
  """Forks without end, each process writing 64 MiB: contained by the sandbox's memory
  bound (256 MiB here) and its process limit, judged a failure within the time limit, its
  processes and its cgroup gone afterwards."""
  limits, marker = _marked_limits(timeout_s=2.0, processes=6, memory_bytes=192 << 20,
                                  total_memory_bytes=256 << 20)
  bomb = ("import os\n"
          "blocks = []\n"
          "while True:\n"
          "  try:\n"
          "    os.fork()\n"
          "    blocks.append(b'x' * (64 << 20))\n"
          "  except (OSError, MemoryError):\n"
          "    pass\n")
  outcome = run_program(bomb, limits=limits)
  assert not outcome.passed
  assert outcome.kind in ("timeout", "killed", "memory", "error"), outcome
  assert outcome.seconds < limits.timeout_s + 3.0
  assert _wait_gone(marker) == [], "fork-bomb processes outlived the run"
  hierarchy = sandbox._plan().cgroup
  if hierarchy is not None:
    assert "memory cgroup" in outcome.protections
    mine = f"attnprec-sandbox-{os.getpid()}-"
    assert [d for d in os.listdir(hierarchy.parent) if d.startswith(mine)] == []


def test_cgroup_hierarchies_are_found_from_proc(tmp_path):
  """Where a run's memory cgroup goes, read from mountinfo and /proc/self/cgroup (here
  fakes): cgroup v2 under the harness's cgroup or, since a v2 cgroup holding processes
  cannot delegate, its parent, where `memory` is delegated; else the v1 memory hierarchy;
  never a cgroup that does not list the harness's pid."""
  v2, v1 = tmp_path / "unified", tmp_path / "memory"
  (v2 / "slice" / "me").mkdir(parents=True)
  (v2 / "slice" / "me" / "cgroup.procs").write_text("42\n")
  (v2 / "slice" / "me" / "cgroup.subtree_control").write_text("")
  (v2 / "slice" / "cgroup.subtree_control").write_text("cpu memory\n")
  (v1 / "group").mkdir(parents=True)
  (v1 / "group" / "cgroup.procs").write_text("7\n42\n")
  mountinfo, cgroup = tmp_path / "mountinfo", tmp_path / "cgroup"
  mountinfo.write_text(f"30 25 0:26 / {v2} rw,relatime shared:9 - cgroup2 cgroup2 rw\n"
                       f"31 25 0:27 / {v1} rw,relatime shared:10 - cgroup cgroup rw,memory\n")
  cgroup.write_text("4:memory:/group\n0::/slice/me\n")
  find = functools.partial(sandbox_cgroup.candidates, str(mountinfo), str(cgroup))
  on_v1 = sandbox_cgroup.Hierarchy(1, str(v1 / "group"))
  assert find(pid=42) == [sandbox_cgroup.Hierarchy(2, str(v2 / "slice")), on_v1]
  assert find(pid=43) == []
  (v2 / "slice" / "me" / "cgroup.subtree_control").write_text("memory\n")
  assert find(pid=42)[0] == sandbox_cgroup.Hierarchy(2, str(v2 / "slice" / "me"))
  (v2 / "slice" / "me" / "cgroup.subtree_control").write_text("")
  (v2 / "slice" / "cgroup.subtree_control").write_text("cpu\n")
  assert find(pid=42) == [on_v1]


def test_memory_cap_without_a_cgroup(monkeypatch):
  """Where no memory cgroup applies, the processes the program may have times the address
  space each may map is at most Limits.total_memory_bytes."""
  limits = Limits(timeout_s=QUICK.timeout_s, processes=8, total_memory_bytes=1 << 30)
  _no_cgroup(monkeypatch)
  source = ("import resource\n"
            "space = resource.getrlimit(resource.RLIMIT_AS)\n"
            "processes = resource.getrlimit(resource.RLIMIT_NPROC)\n"
            f"assert space == ({1 << 27}, {1 << 27}) and processes == (8, 8), (space, processes)\n")
  outcome = run_program(source, limits=limits)
  assert outcome.passed, outcome.detail
  assert "memory cap" in outcome.protections and "memory cgroup" not in outcome.protections


def test_keyrings_and_host_unix_sockets_are_refused(tmp_path_factory):
  """A key added to the user's keyring would outlive the run (the kernel keeps it), and a
  daemon's socket file on the read-only root would still take connections: the seccomp
  filter refuses add_key, keyctl, socket(AF_UNIX) and io_uring (which could make the socket
  without the socket call) with EPERM; socketpair still works."""
  directory = tmp_path_factory.mktemp("sock")
  path = str(directory / "daemon.sock")
  source = ("import ctypes, errno, socket\n"
            "lib = ctypes.CDLL(None, use_errno=True)\n"
            "lib.syscall.restype = ctypes.c_long\n"
            "def call(*args):\n"
            "  result = lib.syscall(*args)\n"
            "  return errno.errorcode.get(ctypes.get_errno()) if result < 0 else 'made'\n"
            "key = call(248, b'user', b'attnprec-sandbox', b'persist', 7, ctypes.c_int(-4))\n"
            "ring = call(250, 0, ctypes.c_int(-4), 0)\n"
            "params = ctypes.create_string_buffer(120)\n"
            "uring = call(425, 8, params)\n"
            "try:\n"
            f"  socket.socket(socket.AF_UNIX).connect({path!r})\n"
            "  unix = 'connected'\n"
            "except OSError as e:\n"
            "  unix = errno.errorcode[e.errno]\n"
            "a, b = socket.socketpair()\n"
            "a.send(b'x')\n"
            "assert b.recv(1) == b'x'\n"
            "assert False, (key, ring, uring, unix)\n")
  try:
    with socket.socket(socket.AF_UNIX) as listener:
      listener.bind(path)
      os.chmod(path, 0o777)
      listener.listen(1)
      outcome = run_program(source, limits=QUICK)
  finally:
    os.remove(path)
  assert (outcome.passed, outcome.kind) == (False, "assertion"), outcome
  if "seccomp filter" in outcome.protections:
    assert outcome.detail == "AssertionError: ('EPERM', 'EPERM', 'EPERM', 'EPERM') (line 19)"
  else:   # the filter is written for x86_64 and aarch64 and needs no_new_privs
    assert (os.uname().machine not in ("x86_64", "aarch64")
            or "no_new_privs" not in outcome.protections), outcome.protections


def test_printing_1_gb_hits_the_output_limit():
  source = ("import sys\n"
            "chunk = 'x' * (1 << 20)\n"
            "for _ in range(1024):\n"
            "  sys.stdout.write(chunk)\n")
  rss_before_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  outcome = run_program(source, limits=QUICK)
  rss_after_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  assert (outcome.passed, outcome.kind) == (False, "output_limit")
  assert outcome.seconds < 1.5
  assert rss_after_kib - rss_before_kib < 32 * 1024, "the harness buffered the output"


# --- the API --------------------------------------------------------------------------------

def test_available_protections_are_those_applied():
  protections = _protections()
  assert protections == run_program("pass", limits=QUICK).protections
  assert set(sandbox._ALWAYS) <= set(protections)
  assert "rlimits" in protections
  assert ("uid nobody" in protections) == (os.geteuid() == 0 and sandbox._plan().drop_to == 65534)
  if not sandbox._plan().prefix:
    assert not {"network namespace", "pid namespace", "ipc namespace", "read-only root",
                "private tmpfs"} & set(protections)
  assert ("memory cgroup" in protections) != ("memory cap" in protections)
  assert ("memory cgroup" in protections) == (sandbox._plan().cgroup is not None)


def test_kinds_are_documented():
  assert set(sandbox.KINDS) == {"passed", "assertion", "syntax", "error", "memory", "timeout",
                                "killed", "output_limit"}


@pytest.mark.parametrize("call, names", [
    (lambda: run_program(b"assert True"), "source"),
    (lambda: run_program(None), "source"),
    (lambda: run_program("pass", limits={"timeout_s": 1}), "limits"),
    (lambda: Limits(timeout_s=0), "timeout_s=0"),
    (lambda: Limits(timeout_s=float("inf")), "timeout_s=inf"),
    (lambda: Limits(cpu_s=-1), "cpu_s=-1"),
    (lambda: Limits(memory_bytes=1.5), "memory_bytes=1.5"),
    (lambda: Limits(processes=True), "processes=True"),
    (lambda: Limits(output_bytes=0), "output_bytes=0"),
])
def test_bad_arguments_raise_user_error(call, names):
  with pytest.raises(UserError) as error:
    call()
  message = str(error.value)
  assert names in message
  assert "\n" not in message
