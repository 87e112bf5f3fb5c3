"""`make sweep`: the LR sweep job (gin: `lr_sweep.*`), group by group, resumable.

Each (size, setting, seed) group trains in `RUN_DIR/<size>/<setting>/seed<k>/`
(`attnprec.lrsweep.group`);
a finished group (its result.json, of the same plan and corpus) is not trained again, an
unfinished one resumes from its state.npz, so a sweep cut off (a time limit, a signal)
continues where it stopped when run again; a seed added to the plan later trains only
the new groups. `max_groups` (0: all) trains at most that many
groups this time, so one call can be given a budget; `report_only` trains none and
writes the report from the finished ones. After the groups, the report
(`attnprec.lrsweep.report`) is written from every finished group in RUN_DIR.

Bad input (an empty or non-positive LR grid, an unknown size or setting, a kernel the
train phase cannot run, a size that does not fit the device, a run directory holding
another plan's groups) is refused before any group trains.
"""
import os
from typing import Sequence

import gin
from tqdm import tqdm

from attnprec import checks, readback, runs
from attnprec.errors import UserError
from attnprec.lrsweep import group as group_lib
from attnprec.lrsweep import report as report_lib
from attnprec.lrsweep.settings import SETTINGS, SIZES, check_plan
from attnprec.model import REMAT


def group_dir(run_dir: str, size: str, setting: str, seed: int) -> str:
  return os.path.join(run_dir, size, setting, f"seed{seed}")


def _finished(group_dir: str, want: dict) -> bool:
  """Whether group_dir holds a result of exactly this spec; a result of another spec is
  refused (this run directory belongs to another plan)."""
  path = os.path.join(group_dir, "result.json")
  if not os.path.exists(path):
    spec_path = os.path.join(group_dir, "spec.json")
    if os.path.exists(spec_path):
      try:
        with open(spec_path, encoding="utf-8") as f:
          got, why = readback.loads(f.read())
      except (OSError, UnicodeDecodeError) as e:
        got, why = None, str(e)
      if why or not isinstance(got, dict):
        why = why or "not an object"
        raise UserError(f"{spec_path} is not a sweep group's spec ({why}); delete that "
                        f"group's directory to train it again.")
      _same_spec(group_dir, got, want)
    return False
  got = report_lib.read_result(path)
  _same_spec(group_dir, got["spec"], want)
  return True


def _same_spec(group_dir: str, got: dict, want: dict) -> None:
  diff = sorted(k for k in set(got) | set(want) if got.get(k) != want.get(k))
  if diff:
    shown = ", ".join(f"{k}: {got.get(k)!r} there, {want.get(k)!r} now" for k in diff[:3])
    raise UserError(f"{group_dir} holds a group of another sweep plan ({shown}); a sweep "
                    f"resumes only its own plan. Use another --run_dir, or the plan it "
                    f"was made with.")


def _names(table) -> checks.Rule:
  """A tuple of names from `table` (the per-name checks are `check_plan`'s); a bare
  string or another type is answered with the valid names."""
  listed = ", ".join(map(repr, table))

  def rule(v):
    if isinstance(v, (str, bytes)) or not isinstance(v, (tuple, list)):
      return f"must be a tuple of names, e.g. ({next(iter(table))!r},); valid names: {listed}"
  return rule


@gin.configurable("lr_sweep", denylist=["run_dir"])
@checks.validated("lr_sweep", sizes=_names(SIZES), settings=_names(SETTINGS),
                  remat=checks.one_of(*REMAT))
def lr_sweep_job(*, run_dir: str, sizes: Sequence[str] = ("5m", "20m"),
                 settings: Sequence[str] = ("bf16", "both", "fp32", "qk_norm"),
                 lrs: Sequence[float] = (3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 1e-1, 3e-1),
                 seeds: Sequence[int] = (0, 1), steps: int = 500, warmup: int = 25,
                 batch: int = 32, seq_len: int = 256, eval_every: int = 50,
                 eval_batch: int = 64, kernel: str = "dot_product", z_loss: float = 1e-4,
                 remat: str = "block",
                 checkpoint_every: int = 100, max_groups: int = 0,
                 report_only: bool = False, progress: bool = True) -> dict:
  """Trains every pending group of the plan into run_dir (none with `report_only`), then
  writes the report from every finished group."""
  plan = check_plan(sizes=sizes, settings=settings, lrs=lrs, seeds=seeds, steps=steps,
                    warmup=warmup, batch=batch, seq_len=seq_len, eval_every=eval_every,
                    eval_batch=eval_batch, kernel=kernel, z_loss=z_loss, remat=remat)
  for name, v in (("checkpoint_every", checkpoint_every), ("max_groups", max_groups)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
      raise UserError(f"lr_sweep.{name} = {v!r} must be an integer >= 0 (0: "
                      f"{'no saved state' if name[0] == 'c' else 'every group'}).")
  if not isinstance(report_only, bool):
    raise UserError(f"lr_sweep.report_only = {report_only!r} must be True or False.")
  # Settings given (gin) that the plan would not use: refused, never silently ignored.
  bound = checks.bound_args("lr_sweep")
  if "checkpoint_every" in bound and checkpoint_every >= plan.steps:
    raise UserError(f"lr_sweep.checkpoint_every = {checkpoint_every} would save no state "
                    f"in a group of lr_sweep.steps = {plan.steps}; valid: 1..{plan.steps - 1} "
                    f"steps between saves, or 0 for none.")
  if "eval_every" in bound and eval_every > plan.steps:
    raise UserError(f"lr_sweep.eval_every = {eval_every} is more than lr_sweep.steps = "
                    f"{plan.steps}: no evaluation would run between the first and the last; "
                    f"valid: 1..{plan.steps}.")
  unread = sorted(set(bound) & {"max_groups", "checkpoint_every"})
  if report_only and unread:
    raise UserError(f"lr_sweep.report_only = True trains no group, so "
                    f"{', '.join('lr_sweep.' + n for n in unread)} would not be read; drop "
                    f"{'it' if len(unread) == 1 else 'them'}, or set report_only = False.")
  pending = []
  for size, setting, seed in plan.groups():
    gdir = group_dir(run_dir, size, setting, seed)
    want = group_lib.spec(plan, size, setting, seed)
    if not _finished(gdir, want):
      pending.append((size, setting, seed, gdir, want))
  done = len(plan.groups()) - len(pending)
  if report_only:
    pending = []
  elif max_groups:
    pending = pending[:max_groups]
  print(f"lr_sweep: {done} of {len(plan.groups())} groups (size x setting x seed) done; "
        f"training {len(pending)} now ({len(plan.lrs)} learning rates each, {plan.steps} "
        f"steps)")
  # Every program compiled (once per size x setting: its seeds share it) and checked to
  # fit the device before the first group trains.
  prepared = {}
  for size, setting, *_ in tqdm(pending, desc="compile", unit="group", disable=not progress):
    if (size, setting) not in prepared:
      prepared[size, setting] = group_lib.prepare(plan, size, setting)
  for size, setting, seed, gdir, want in pending:
    runs.ensure_dir(gdir)
    runs.write_json(gdir, "spec.json", want)
    result = group_lib.run_group(plan, size, setting, seed, gdir,
                                 prepared=prepared[size, setting],
                                 checkpoint_every=checkpoint_every, progress=progress)
    t = result["timing"]
    print(f"lr_sweep: {size} {setting} seed {seed}: done in {t['train_s']:.0f} s "
          f"(+{t['compile_s']:.0f} s compile), {t['tokens_per_s']} tokens/s")
  runs.ensure_dir(run_dir)
  return report_lib.write_report(run_dir, plan)
