"""What the thin runners share: flags -> gin -> checks -> a job, one error path, signals
and `--help`.

Exit codes of every runner (`runners/*.py`):
  0   success (audit: PASS)
  1   a crash: a bug in attnprec, with its traceback
  2   bad input, or an output that cannot be written (a full disk): one paragraph on
      stderr naming the bad value (or the path and the cause) and the valid ones
  3   audit only: the compiled programs do not follow the precision contract (MISMATCH)
  130 interrupted by SIGINT (Ctrl-C)
  143 terminated by SIGTERM (a scheduler, `docker stop`, a preemption)
  129 hung up by SIGHUP (the terminal it ran in was closed), handled as SIGTERM

Signals: SIGINT and SIGTERM are handled alike. Outside training they stop the run at
once; what the run had written into its output directory is removed again (every file
is written atomically, so there is never half a file), and a run directory it created is
removed when that leaves it empty. Training defers them (`deferred_signals`): it finishes
the step in flight, saves a checkpoint at that step and exits with one line saying where.

A new runner (runners/NAME.py) is a module docstring (its purpose: the first lines of
its --help) and:

    EXAMPLES = ["python runners/NAME.py --gin_file=gin/experiments/x.gin"]

    def main(argv) -> int:
      return cli.main(argv, prog="NAME", doc=__doc__, examples=EXAMPLES,
                      default_files=["runs/NAME.gin"], default_run_dir="runs/NAME",
                      reads=("NAME",), body=lambda run_dir: ginutils.call(job, run_dir=run_dir))

    if __name__ == "__main__":
      cli.exit(main(sys.argv[1:]))   # not sys.exit: see `exit`

`reads` names the configurables it calls itself (see `main`); its --help lists every
configurable those reach with the value in force after the default gin files (and any
--gin_file/--gin.X given with --help). A runner without gin builds its parser with
`ArgumentParser(prog=..., doc=__doc__, examples=...)` and calls `run`.
"""
import argparse
import os
import signal
import sys
from typing import Callable, Optional, Sequence

from attnprec import ginutils, runs, xla_env
# The signal handling lives on a lower floor (training uses it); re-exported here.
from attnprec.signals import (SIGNALS, Interrupted, _handled_signals,  # noqa: F401
                              _raise_interrupted, deferred_signals)
from attnprec.errors import UserError

EXIT_OK, EXIT_CRASH, EXIT_USER_ERROR, EXIT_MISMATCH = 0, 1, 2, 3
EXIT_INTERRUPTED, EXIT_TERMINATED = 128 + signal.SIGINT, 128 + signal.SIGTERM  # 130, 143
EXIT_HANGUP = 128 + signal.SIGHUP                                               # 129


class _HelpFormatter(argparse.RawDescriptionHelpFormatter,
                     argparse.ArgumentDefaultsHelpFormatter):
  """Description and epilog as written; an option's help shows its default."""


class ArgumentParser(argparse.ArgumentParser):
  """argparse whose errors are UserErrors (one paragraph, exit 2 through `run`), never a
  SystemExit from inside a library call, and whose --help is the runner's own usage:
  `doc` (the runner's module docstring: what it does), its options with their defaults,
  `sections` (extra text blocks, e.g. the gin options and configurables) and `examples`
  (command lines)."""

  def __init__(self, *, prog: str, doc: str, examples: Sequence[str] = (),
               sections: Sequence[str] = (), **kwargs):
    blocks = list(sections)
    if examples:
      blocks.append("examples:\n" + "\n".join(f"  {e}" for e in examples))
    kwargs.setdefault("allow_abbrev", False)
    super().__init__(prog=prog, description=(doc or "").strip(), epilog="\n\n".join(blocks),
                     formatter_class=_HelpFormatter, **kwargs)

  def error(self, message):
    raise UserError(f"{message}. Usage: {self.format_usage().strip()[len('usage: '):]}")


def run(prog: str, body: Callable[[], object], *, output_dir: Optional[str] = None,
        keep_partial: bool = False) -> int:
  """Runs body() with the one error path every runner shares: a UserError is printed as
  `prog: error: <paragraph>` with exit code 2 and no traceback (a failed write too:
  `runs.WriteError`); SIGINT gives 130 and SIGTERM 143, with one line.

  Outputs: if `output_dir` did not exist before and the run fails, it is removed again
  when it holds no file, so a failed load leaves no empty run directory behind. When the
  run is interrupted or cannot write an output, what it wrote into `output_dir` is undone
  (`runs.remove_written`: a file it created is removed, a file it replaced gets its
  previous content back: no mix of a half-done run's outputs and older ones, and no older
  one lost), unless `keep_partial` (training: its checkpoints are the point).
  """
  runs.code_identity()   # the code this run starts from, named by every result it writes
  existed = output_dir is None or os.path.lexists(output_dir)
  created = None if existed else runs.first_missing(output_dir)   # and removed on failure
  partial = False
  with runs.track_writes(keep_previous=not keep_partial) as written, \
      _handled_signals(_raise_interrupted):
    try:
      # XLA ends the process on a flag it does not know; a flag file or jax's numerics
      # settings from the environment would change numbers the precision line names not
      xla_env.check_environment(prog=prog)
      body()
      return EXIT_OK
    except UserError as e:
      _print_error(prog, e)
      rc, partial = EXIT_USER_ERROR, isinstance(e, runs.WriteError)
    except KeyboardInterrupt as e:
      rc, partial = _print_interrupted(prog, e), True
    except (RuntimeError, AssertionError) as e:
      why = _backend_start_error(e)
      if why is None:
        if not existed:
          runs.remove_if_empty(output_dir, created)
        raise
      _print_error(prog, why)
      rc = EXIT_USER_ERROR
    except SystemExit as e:   # argparse --help
      return e.code if isinstance(e.code, int) else EXIT_OK
    except BaseException:
      if not existed:
        runs.remove_if_empty(output_dir, created)
      raise
    if partial and output_dir is not None and not keep_partial:
      runs.remove_written(written, output_dir)    # files it replaced get their content back
  if not existed:
    runs.remove_if_empty(output_dir, created)
  return rc


def _backend_start_error(e: Exception) -> Optional[UserError]:
  """The UserError for JAX failing to start the backend JAX_PLATFORMS names (a platform
  this machine does not have: `JAX_PLATFORMS=tpu` on a CPU machine), else None. JAX
  starts its backends lazily, at the first array, so this is caught where it surfaces,
  not checked first: checking would start the backend before `jax.distributed` may
  initialize (a multi-host training)."""
  text = str(e)
  names = os.environ.get("JAX_PLATFORMS", "")
  if isinstance(e, AssertionError):
    # JAX_PLATFORMS=cuda without a CUDA plugin: jax's backend lookup asserts, with no
    # message (and jax filters its frames from the traceback): ask the backend again
    if not names:
      return None
    import jax
    try:
      jax.devices()
      return None
    except AssertionError:
      text = "no backend of that name is installed here"
  elif "Unable to initialize backend" not in text:
    return None
  first = " ".join(text.strip().splitlines()[0].split())[:300]
  what = f"the backend JAX_PLATFORMS={names!r} names" if names else "its backend"
  return UserError(f"JAX could not start {what} ({first}). Unset JAX_PLATFORMS to use "
                   f"what this machine has, or name a platform that is here ('cpu' always "
                   f"is).")


def exit(rc: int) -> None:  # noqa: A001 -- the runners' sys.exit
  """Ends a runner's process with code `rc` (its `__main__` calls `cli.exit(main(argv))`).
  After a signal (130, 143) the process ends at once, once its output is flushed: JAX may
  still be compiling or computing in its own threads, and tearing the interpreter down
  under them can crash (a segfault, exit 139, instead of 143). Outputs are already
  complete or removed by then (`run`)."""
  if rc in (EXIT_INTERRUPTED, EXIT_TERMINATED, EXIT_HANGUP):
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
  sys.exit(rc)


def _print_interrupted(prog: str, e: KeyboardInterrupt) -> int:
  if isinstance(e, Interrupted):
    name, rc, note = e.signal_name, e.exit_code, e.note
  else:
    name, rc, note = "SIGINT", EXIT_INTERRUPTED, ""
  print(f"{prog}: interrupted by {name}" + (f"; {note}" if note else ""), file=sys.stderr)
  return rc


def _print_error(prog: str, e: UserError) -> None:
  # gin appends "In call to configurable ..." lines to errors raised inside
  # configurables; the user's paragraph is what comes before them.
  message = str(e).split("\n  In call to configurable")[0]
  message = " ".join(message.split())
  print(f"{prog}: error: {message}", file=sys.stderr)


GIN_OPTIONS = """\
gin options (repeatable; later ones override earlier ones):
  --gin_file=PATH           a gin file, read after the defaults ({defaults}); a relative
                            path also resolves against the repository's gin/
  --gin.NAME=VALUE          one binding, e.g. --gin.train.steps=300; a VALUE that is not a
                            Python/gin literal (runs/recall) is taken as a string
  --gin_bindings='NAME = VALUE'
                            one binding as gin syntax, e.g. --gin_bindings='train.seed = 1'"""


def main(argv: Sequence[str], *, prog: str, doc: str, examples: Sequence[str],
         default_files: Sequence[str], default_run_dir: str, body: Callable[[str], object],
         reads: Optional[Sequence[str]] = None, keep_partial: bool = False,
         options: Optional[Callable[[ArgumentParser], None]] = None) -> int:
  """Parses `--gin_file/--gin_bindings/--gin.X=V` and `--run_dir`, checks the whole
  configuration and the run directory, then runs body(run_dir) (see `run`).

  doc: the runner's module docstring (what it does, the start of its --help).
  examples: one or two command lines for its --help.
  default_files: gin files read first (relative to gin/), e.g. ["runs/train.gin"].
  reads: the configurables the runner calls itself (`phase/precision` for the phase
  precision it reads); gin's config and the command line's bindings are checked against
  them (`ginutils.check_config`, `ginutils.check_command_line`), and --help lists what
  they reach with their values. None: only the config is checked.
  keep_partial: keep what the run wrote when it is interrupted (training).
  options: adds the runner's own flags to the parser (`parser.add_argument(...)`); their
  values reach body as keyword arguments: body(run_dir, **values).
  """
  def parser(sections=()):
    p = ArgumentParser(prog=prog, doc=doc, examples=examples, sections=sections,
                       usage=f"{prog} [--gin_file=PATH ...] [--gin.NAME=VALUE ...] "
                             f"[--gin_bindings='NAME = VALUE' ...] [--run_dir=DIR]")
    p.add_argument("--run_dir", default=default_run_dir, metavar="DIR",
                   help="where outputs are written")
    p.add_argument("--replace_run_dir", action="store_true",
                   help="replace a run directory another runner made, whole (the old "
                        "one is kept until this run succeeds)")
    if options is not None:
      options(p)
    return p

  def parse_then_body():
    files, bindings, rest = ginutils.split_flags(argv)
    if "-h" in rest or "--help" in rest:
      parser(_gin_help(default_files, files, bindings, reads, prog)).print_help()
      return
    args, unknown = parser().parse_known_args(rest)
    own = [a.option_strings[0] for a in parser()._actions  # noqa: SLF001
           if a.option_strings and a.dest not in ("help", "run_dir", "replace_run_dir")]
    if unknown:
      raise UserError(f"Unknown argument(s) {unknown}; valid: --gin_file=PATH, "
                      f"--gin_bindings='NAME=VALUE', --gin.NAME=VALUE, --run_dir=DIR, "
                      f"--replace_run_dir, " + "".join(f"{o}=..., " for o in own)
                      + "--help.")
    ginutils.parse(list(default_files) + files, bindings, reads=reads, prog=prog,
                   defaults=len(default_files))
    runs.check_output_dir(args.run_dir, flag="--run_dir")
    # the directory is this runner's, or another's replaced whole (runs.claim)
    finish = runs.claim(args.run_dir, prog, replace=args.replace_run_dir)
    values = {k: v for k, v in vars(args).items() if k not in ("run_dir", "replace_run_dir")}
    ok = False
    try:
      body(args.run_dir, **values)
      ok = True
    finally:
      if finish is not None:
        finish(ok)

  run_dir = _run_dir_flag(argv, default_run_dir)
  if any(a in ("-h", "--help") for a in argv):
    run_dir = None   # --help writes nothing
  return run(prog, parse_then_body, output_dir=run_dir, keep_partial=keep_partial)


def _gin_help(default_files, files, bindings, reads, prog) -> list:
  """The gin part of a runner's --help: the gin options, then the configurables it
  reads with the values in force after its default files (and those given with --help;
  if they do not parse, after the default files alone)."""
  shown = ", ".join(f"gin/{f}" for f in default_files) or "none"
  sections = [GIN_OPTIONS.format(defaults=shown)]
  try:
    ginutils.parse(list(default_files) + files, bindings, reads=reads, prog=prog,
                   defaults=len(default_files))
    source = ", ".join([f"gin/{f}" for f in default_files] + files + bindings) or "code"
  except UserError:
    ginutils.clear()
    ginutils.parse(list(default_files), [], reads=reads, prog=prog,
                   defaults=len(default_files))
    source = shown
  if reads:
    lines = [f"  {name} = {value}" for name, value in ginutils.configurable_values(reads)]
    sections.append(f"configurables {prog} reads (NAME = value after {source}; bind them "
                    f"with --gin.NAME=VALUE):\n" + "\n".join(lines))
  return sections


def _run_dir_flag(argv: Sequence[str], default: str) -> str:
  """The --run_dir a command line names (the last one), before full parsing."""
  run_dir = default
  args = list(argv)
  for i, a in enumerate(args):
    if a.startswith("--run_dir="):
      run_dir = a.split("=", 1)[1]
    elif a == "--run_dir" and i + 1 < len(args):
      run_dir = args[i + 1]
  return run_dir


def repo_root() -> str:
  return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
