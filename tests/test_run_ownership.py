"""Run directories are owned: the runner that made one records itself in it
(`runs.OWNER_FILE`); another runner refuses it (exit 2) unless --replace_run_dir, which
replaces it whole: the old directory is kept until the new run succeeds and put back
if it fails. Tried through `cli.main`, the one entry every gin runner goes through, with
a body that writes a results file as the runners do."""
import json
import os
from unittest import mock

import pytest

from attnprec import cli, runs
from attnprec.errors import UserError


def _runner(prog, tmp_path, fail=False):
  """A runner named `prog` whose body writes results.json (and fails if asked)."""
  def body(run_dir):
    if fail == "early":
      raise UserError(f"{prog} failed before writing anything")
    runs.atomic_write(os.path.join(run_dir, "results.json"), json.dumps({"by": prog}))
    if fail:
      raise UserError(f"{prog} failed on purpose")
  return lambda argv: cli.main(argv, prog=prog, doc=f"{prog}: a test runner.",
                               examples=[], default_files=[],
                               default_run_dir=str(tmp_path / "default"), body=body)


def _results(d):
  with open(d / "results.json") as f:
    return json.load(f)["by"]


def test_another_runner_refuses_a_directory_it_did_not_make(tmp_path, capsys):
  d = tmp_path / "run"
  assert _runner("study", tmp_path)([f"--run_dir={d}"]) == 0
  assert runs.owner(str(d)) == "study"
  (d / "report.md").write_text("the study's report")
  assert _runner("decode", tmp_path)([f"--run_dir={d}"]) == cli.EXIT_USER_ERROR
  err = capsys.readouterr().err
  assert "was made by the 'study' runner" in err and "--replace_run_dir" in err
  assert _results(d) == "study" and (d / "report.md").exists()
  # the same runner again (a resume, a rerun) is its own directory
  assert _runner("study", tmp_path)([f"--run_dir={d}"]) == 0


def test_replacing_is_whole_and_kept_until_the_new_run_succeeds(tmp_path):
  d = tmp_path / "run"
  assert _runner("study", tmp_path)([f"--run_dir={d}"]) == 0
  (d / "report.md").write_text("the study's report")
  # a replacing run that fails puts the old directory back, whole
  assert _runner("decode", tmp_path, fail=True)([f"--run_dir={d}", "--replace_run_dir"]) \
      == cli.EXIT_USER_ERROR
  assert runs.owner(str(d)) == "study" and _results(d) == "study"
  assert (d / "report.md").exists()
  # one that succeeds leaves only its own files, and nothing beside the directory
  assert _runner("decode", tmp_path)([f"--run_dir={d}", "--replace_run_dir"]) == 0
  assert runs.owner(str(d)) == "decode" and _results(d) == "decode"
  assert not (d / "report.md").exists()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


def test_a_directory_with_files_but_no_record_is_refused_and_a_broken_record_refused(
    tmp_path):
  """A non-empty directory no runner recorded (a user's files, or a run made before
  records were kept): the runner would write over its files, so it is refused, nothing
  changed; --replace_run_dir replaces it whole; a record written by hand adopts it."""
  d = tmp_path / "old"
  d.mkdir()
  (d / "results.json").write_text(json.dumps({"by": "someone"}))
  (d / "notes.txt").write_text("mine")
  assert _runner("eval", tmp_path)([f"--run_dir={d}"]) == cli.EXIT_USER_ERROR
  assert runs.owner(str(d)) is None and json.loads((d / "results.json").read_text()) == {
      "by": "someone"}
  (d / runs.OWNER_FILE).write_text('{"runner": "eval"}')
  assert _runner("eval", tmp_path)([f"--run_dir={d}"]) == 0
  assert runs.owner(str(d)) == "eval" and (d / "notes.txt").exists()
  (d / runs.OWNER_FILE).write_text("[1, 2]")
  with pytest.raises(UserError, match="must be a JSON object with a string 'runner'"):
    runs.owner(str(d))
  other = tmp_path / "other"
  other.mkdir()
  (other / "notes.txt").write_text("mine")
  with pytest.raises(UserError, match=r"is not empty and records no runner .*'decode' "
                                      r"would write its results over the files there"):
    runs.claim(str(other), "decode")
  assert sorted(p.name for p in other.iterdir()) == ["notes.txt"]
  assert _runner("decode", tmp_path)([f"--run_dir={other}", "--replace_run_dir"]) == 0
  assert runs.owner(str(other)) == "decode" and not (other / "notes.txt").exists()


def test_a_run_that_fails_in_an_empty_directory_it_adopted_leaves_it_unowned(tmp_path):
  """An empty directory is adopted; a run that fails there leaves it as it was found."""
  d = tmp_path / "empty"
  d.mkdir()
  assert _runner("decode", tmp_path, fail="early")([f"--run_dir={d}"]) == cli.EXIT_USER_ERROR
  assert runs.owner(str(d)) is None and d.is_dir()
  assert _runner("eval", tmp_path)([f"--run_dir={d}"]) == 0
  assert runs.owner(str(d)) == "eval"


def test_a_first_run_that_fails_before_writing_leaves_no_directory(tmp_path):
  """The owner record alone is no output: the directory goes, as before records."""
  d = tmp_path / "new"
  assert _runner("decode", tmp_path, fail="early")([f"--run_dir={d}"]) == cli.EXIT_USER_ERROR
  assert not d.exists()


def test_a_result_file_carries_its_provenance(tmp_path):
  """`runs.write_json(..., provenance=True)`, which every runner's results file uses:
  the code (commit, clean tree), the XLA settings that change numerics, the machine."""
  import jax
  from attnprec import xla_env
  path = runs.write_json(str(tmp_path), "results.json", {"rows": [1]}, provenance=True)
  with open(path) as f:
    p = json.load(f)["provenance"]
  assert p["xla"] == xla_env.describe() and p["jax"] == jax.__version__
  assert p["backend"] == jax.default_backend() and "cores" in p["machine"]
  assert p["commit"] is None or p["clean"] == (not p["commit"].endswith("-dirty"))
  # a setting XLA_FLAGS makes that changes precision is named in the record
  flags = os.environ.get("XLA_FLAGS", "")
  try:
    os.environ["XLA_FLAGS"] = "--xla_allow_excess_precision=true"
    p = runs.provenance()
    assert "excess precision ALLOWED by your XLA_FLAGS" in p["xla"]
    assert p["xla_flags"] == "--xla_allow_excess_precision=true"
  finally:
    os.environ["XLA_FLAGS"] = flags


def test_the_source_digest_names_the_code_without_git(tmp_path):
  """A copy of the code without .git (what a device gets) has the same digest as this
  checkout; one changed byte in a runner, or a new gin file, changes it; caches do not."""
  import shutil
  root = os.path.dirname(os.path.dirname(os.path.abspath(runs.__file__)))
  copy = tmp_path / "copy"
  for top in runs.SOURCE_DIRS:
    shutil.copytree(os.path.join(root, top), copy / top,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
  digest = runs.source_digest()
  assert runs.provenance()["source"] == digest and len(digest) == 16

  def of_copy():
    with mock.patch.object(runs, "__file__", str(copy / "attnprec" / "runs.py")):
      return runs.source_digest()
  assert of_copy() == digest
  (copy / "attnprec" / "__pycache__").mkdir(exist_ok=True)
  (copy / "attnprec" / "__pycache__" / "x.pyc").write_bytes(b"cache")
  assert of_copy() == digest
  runner = copy / "runners" / "decode.py"
  runner.write_bytes(runner.read_bytes() + b" ")
  changed = of_copy()
  assert changed != digest
  (copy / "gin" / "new.gin").write_text("x = 1\n")
  assert of_copy() not in (digest, changed)


def test_a_result_names_the_code_its_run_started_from(tmp_path, monkeypatch):
  """The code is read as a runner starts (`cli.run` -> `runs.code_identity`): a tree
  edited or committed while a long run works does not rename the run's results."""
  monkeypatch.setattr(runs, "_STARTED_FROM", {})
  monkeypatch.setattr(runs, "source_digest", lambda: "at-start")
  monkeypatch.setattr(runs, "_git_describe", lambda: "abc1234")

  def body():   # the tree changes while the run works, then it writes its result
    monkeypatch.setattr(runs, "source_digest", lambda: "edited")
    monkeypatch.setattr(runs, "_git_describe", lambda: "def5678-dirty")
    runs.write_json(str(tmp_path), "results.json", {"rows": []}, provenance=True)

  assert cli.run("test", body) == cli.EXIT_OK
  with open(tmp_path / "results.json") as f:
    p = json.load(f)["provenance"]
  assert (p["commit"], p["clean"], p["source"]) == ("abc1234", True, "at-start")
  assert runs.code_version() == "abc1234"


def test_replace_with_nothing_to_replace_is_refused(tmp_path, capsys):
  """--replace_run_dir where no other runner's run is: the flag would not be used."""
  d = tmp_path / "run"
  assert _runner("decode", tmp_path)([f"--run_dir={d}", "--replace_run_dir"]) == \
      cli.EXIT_USER_ERROR
  assert "does not exist yet" in capsys.readouterr().err and not d.exists()
  assert _runner("decode", tmp_path)([f"--run_dir={d}"]) == 0
  assert _runner("decode", tmp_path)([f"--run_dir={d}", "--replace_run_dir"]) == \
      cli.EXIT_USER_ERROR
  assert "holds no other runner's run ('decode' record)" in capsys.readouterr().err


def test_an_interrupted_replacing_run_puts_the_old_directory_back(tmp_path):
  """Ctrl-C (or SIGTERM, which the runners raise as an interrupt) while replacing: the
  old run comes back whole, nothing of the new one stays."""
  d = tmp_path / "run"
  assert _runner("study", tmp_path)([f"--run_dir={d}"]) == 0

  def interrupted(run_dir):
    runs.atomic_write(os.path.join(run_dir, "results.json"), json.dumps({"by": "decode"}))
    raise KeyboardInterrupt

  rc = cli.main([f"--run_dir={d}", "--replace_run_dir"], prog="decode", doc="d.",
                examples=[], default_files=[], default_run_dir=str(d), body=interrupted)
  assert rc == cli.EXIT_INTERRUPTED
  assert runs.owner(str(d)) == "study" and _results(d) == "study"
  assert sorted(p.name for p in tmp_path.iterdir()) == ["run"]


@pytest.mark.parametrize("stop", ["write_error", "interrupt"])
def test_a_rerun_that_fails_leaves_the_earlier_run_s_files_as_they_were(tmp_path, stop):
  """A runner's own directory run again (a study rerun) that replaces files and then
  cannot finish (a write that fails: a full disk, an output path taken by a directory;
  or Ctrl-C): every file it replaced gets the earlier run's content back, a file it
  created is removed, nothing of it is left (no hidden copies either)."""
  d = tmp_path / "run"

  def first(run_dir):
    for name in ("results.json", "plot.png", "report.md"):
      runs.atomic_write(os.path.join(run_dir, name), f"old {name}")

  def again(run_dir):
    runs.atomic_write(os.path.join(run_dir, "results.json"), "new results.json")
    runs.atomic_write(os.path.join(run_dir, "plot.png"), "new plot.png")
    runs.atomic_write(os.path.join(run_dir, "plot.png"), "newer plot.png")
    runs.atomic_write(os.path.join(run_dir, "extra.png"), "new extra.png")
    if stop == "interrupt":
      raise KeyboardInterrupt
    os.remove(os.path.join(run_dir, "report.md"))
    os.mkdir(os.path.join(run_dir, "report.md"))      # the next write fails: EISDIR
    runs.atomic_write(os.path.join(run_dir, "report.md"), "new report.md")

  def main(body):
    return cli.main([f"--run_dir={d}"], prog="study", doc="s.", examples=[],
                    default_files=[], default_run_dir=str(d), body=body)

  assert main(first) == 0
  rc = main(again)
  assert rc == (cli.EXIT_INTERRUPTED if stop == "interrupt" else cli.EXIT_USER_ERROR)
  for name in ("results.json", "plot.png"):
    assert (d / name).read_text() == f"old {name}"
  assert not (d / "extra.png").exists()
  assert not [p.name for p in d.iterdir() if ".previous-" in p.name]
  assert runs.owner(str(d)) == "study"


def test_another_runner_s_directory_given_as_a_checkpoint_is_named_as_such(tmp_path):
  """A study / sizes / decode run directory passed where a checkpoint goes (e.g.
  recall_eval.checkpoint) says whose results it holds, not 'not an HF checkpoint'."""
  from attnprec import checkpoints
  d = tmp_path / "sizes_run"
  runs.claim(str(d), "sizes")
  runs.write_json(str(d), "results.json", {"x": 1})
  with pytest.raises(UserError, match=r"is a run directory of `sizes`.*not a checkpoint"):
    checkpoints.load(str(d))


def test_a_run_dir_inside_another_run_or_over_an_unrecorded_training_is_refused(tmp_path):
  """Inside another run's directory (a train run's checkpoints/), or over a train run made
  before directories recorded their runner, a runner's results would sit among that run's
  files and lock the training out: refused by name."""
  train_dir = tmp_path / "train"
  runs.claim(str(train_dir), "train")
  (train_dir / "checkpoints").mkdir()
  with pytest.raises(UserError, match=r"lies inside .*a run directory of the 'train' runner"):
    runs.claim(str(train_dir / "checkpoints"), "decode")
  old = tmp_path / "old_train"
  old.mkdir()
  (old / "params.npz").write_bytes(b"x")
  with pytest.raises(UserError, match=r"holds a training .* made before run directories"):
    runs.claim(str(old), "decode")
  runs.claim(str(old), "train")                # its own runner adopts it, as before
  assert runs.owner(str(old)) == "train"


def test_plot_and_bench_refuse_another_runner_s_directory(tmp_path):
  from attnprec import plotting
  d = tmp_path / "decode_run"
  runs.claim(str(d), "decode")
  (d / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
  with pytest.raises(UserError, match=r"was made by the 'decode' runner.*plot \(a train "
                                      r"run's metrics.png\) would write"):
    plotting.read_metrics(str(d))
  import importlib.util
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location("runner_bench_own",
                                                os.path.join(root, "runners", "bench.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  assert bench.main(["--suite=attention", f"--out={d}"]) == cli.EXIT_USER_ERROR
  assert not (d / "results.json").exists()


def test_the_bench_s_out_is_its_own(tmp_path, capsys):
  """The bench records its --out as its own before anything runs, so another runner
  refuses that directory instead of writing its results beside the bench's; a first run
  that fails leaves no directory."""
  import importlib.util
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location("runner_bench_out",
                                                os.path.join(root, "runners", "bench.py"))
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  d = tmp_path / "bench_out"
  with mock.patch.object(bench, "_suites", side_effect=UserError("stopped on purpose")):
    assert bench.main(["--suite=attention", f"--out={d}"]) == cli.EXIT_USER_ERROR
  assert not d.exists()
  with mock.patch.object(bench, "_suites"):
    assert bench.main(["--suite=attention", f"--out={d}"]) == 0
  assert runs.owner(str(d)) == "bench"
  assert _runner("sinks", tmp_path)([f"--run_dir={d}"]) == cli.EXIT_USER_ERROR
  assert "was made by the 'bench' runner" in capsys.readouterr().err
  assert not (d / "results.json").exists()


def test_a_metrics_file_that_is_not_a_regular_file_is_refused_not_waited_on(tmp_path):
  """A FIFO as metrics.jsonl would block the first append (or plot's read) forever."""
  from attnprec import plotting
  d = tmp_path / "run"
  d.mkdir()
  os.mkfifo(d / "metrics.jsonl")
  with pytest.raises(UserError, match="metrics.jsonl is not a regular file"):
    runs.MetricsWriter(str(d))
  with pytest.raises(UserError, match="metrics.jsonl is not a regular file"):
    plotting.read_metrics(str(d))


def test_replacing_a_run_dir_given_as_a_symlink_leaves_nothing_beside_it(tmp_path):
  """--replace_run_dir on a symlink to another runner's directory: the link is moved
  aside and, once the new run succeeds, removed (the target is another path's)."""
  target = tmp_path / "target"
  assert _runner("study", tmp_path)([f"--run_dir={target}"]) == 0
  link = tmp_path / "link"
  link.symlink_to(target)
  assert _runner("decode", tmp_path)([f"--run_dir={link}", "--replace_run_dir"]) == 0
  assert runs.owner(str(link)) == "decode" and not link.is_symlink()
  assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "target"]
