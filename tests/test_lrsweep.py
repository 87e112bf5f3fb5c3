"""The LR sweep (`attnprec.lrsweep`): LR sensitivity as the paper defines it, the paired
bootstrap, one vmapped group against its members trained alone, resume, the logit probe
against a float64 NumPy computation, and bad input refused before anything trains."""
import json
import os
import shutil

import haiku as hk
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from attnprec import runs
from attnprec.errors import UserError
from attnprec.layers import AttentionKernel
from attnprec.lrsweep import corpus, group, report, settings
from attnprec import model as model_lib
from test_train_utils import use_compilation_cache

use_compilation_cache()   # identical programs compiled once (the runner's below: TINY)

PLAN_ARGS = dict(sizes=("tiny",), settings=("fp32",), lrs=(1e-3, 3e-2), seeds=(0,),
                 steps=4, warmup=1, batch=2, seq_len=16, eval_every=2, eval_batch=3)


def plan(**kw):
  return settings.check_plan(**dict(PLAN_ARGS, **kw))


def test_sensitivity_caps_at_the_initial_loss_and_counts_divergence():
  # curve over 4 learning rates; the 4th diverged, the 3rd rose above l_0 (capped)
  final = np.array([2.0, 1.0, 3.5, 0.5])
  init = np.array([3.0, 3.0, 3.0, 3.0])
  diverged = np.array([False, False, False, True])
  # capped [2, 1, 3, 3]: mean 2.25 - min 1.0
  assert report.sensitivity(final, init, diverged) == pytest.approx(1.25)
  assert report.sensitivity(np.array([1.0, 1.0]), np.array([3.0, 3.0]),
                            np.array([False, False])) == 0.0


def _fake_results(final_SxNxE, init=4.0, lrs=(1e-3, 1e-2, 1e-1)):
  """One result per seed, as run_group writes them."""
  S, N, E = final_SxNxE.shape
  out = []
  for seed in range(S):
    fin, ini = final_SxNxE[seed], np.full((N, E), init)
    spec = {"seed": seed, "lrs": list(lrs), "steps": 10, "eval_batch": E}
    ev = [{"step": 0, "loss": ini.mean(1).tolist(), "lse": [1.0] * N,
           "max_logit": [[1.0]] * N, "seq_loss": ini.tolist()},
          {"step": 10, "loss": fin.mean(1).tolist(), "lse": [1.0] * N,
           "max_logit": [[2.0]] * N, "seq_loss": fin.tolist()}]
    out.append({"size": "tiny", "setting": "x", "seed": seed, "spec": spec,
                "members": [{"seed": seed, "lr": lr} for lr in lrs],
                "diverged_at": [None] * N, "eval": ev, "provenance": {}, "timing": {}})
  return out


def test_bootstrap_of_identical_settings_is_zero_and_a_shift_is_found():
  rng = np.random.default_rng(0)
  base = np.array([2.0, 1.5, 2.5])[None, :, None] + 0.01 * rng.standard_normal((2, 3, 40))
  a, b = report.Curves(_fake_results(base)), report.Curves(_fake_results(base))
  point, lo, hi = report.bootstrap(a, b, draws=200)
  assert point == lo == hi == 0.0
  worse = base.copy()
  worse[:, 2] += 0.5           # the highest rate ends 0.5 worse: sensitivity + 0.5 / 3
  point, lo, hi = report.bootstrap(report.Curves(_fake_results(worse)), a, draws=200)
  assert point == pytest.approx(0.5 / 3, abs=1e-9) and 0 < lo <= point <= hi


def test_a_tampered_result_is_named(tmp_path):
  r = _fake_results(np.full((1, 3, 4), 2.0))[0]
  path = tmp_path / "result.json"
  path.write_text(json.dumps(r))
  assert report.read_result(str(path))["size"] == "tiny"
  r["eval"][1]["loss"][0] = 1.0            # no longer the mean of its sequences
  path.write_text(json.dumps(r))
  with pytest.raises(UserError, match=r"result.json.*member 0's loss"):
    report.read_result(str(path))
  r = _fake_results(np.full((1, 3, 4), 2.0))[0]
  r["members"] = r["members"][:2]
  path.write_text(json.dumps(r))
  with pytest.raises(UserError, match="members"):
    report.read_result(str(path))


def test_corpus_is_the_pinned_text_and_splits_by_file(tmp_path):
  train, held, desc = corpus.load()
  assert desc["sha256"] == corpus.CORPUS_SHA256 and len(held) > 100_000
  assert "dataclasses.py" in desc["heldout_files"]
  assert b"# ==== dataclasses.py" not in train.astype(np.uint8).tobytes()
  b1, b2 = corpus.train_batch(3, 7, 4, 32), corpus.train_batch(3, 7, 4, 32)
  assert (b1 == b2).all() and b1.shape == (4, 32) and (b1[:, 0] == corpus.BOS).all()
  import lzma
  bad = tmp_path / "c.xz"
  with lzma.open(bad, "wb") as f:
    f.write(b"# ==== a.py\nprint(1)\n")
  with pytest.raises(UserError, match="not the pinned"):
    corpus.load(str(bad))


@pytest.fixture(scope="module")
def prepared():
  """The compiled programs of plan()'s tiny fp32 group (shared: one compilation)."""
  return group.prepare(plan(), "tiny", "fp32")


@pytest.fixture(scope="module")
def finished(tmp_path_factory, prepared):
  """One group of two learning rates, trained whole (checkpoints every 2 steps)."""
  p = plan()
  d = str(tmp_path_factory.mktemp("sweep") / "tiny" / "fp32" / "seed0")
  return p, group.run_group(p, "tiny", "fp32", 0, d, checkpoint_every=2, progress=False,
                            prepared=prepared), d


def test_a_member_of_the_vmapped_group_is_the_run_alone(finished, tmp_path):
  """Independent check: the member of lr 3e-2 trained alone (a group of one) ends with
  the same held-out loss (float32, sums in another order: 1e-5)."""
  p, both, _ = finished
  alone = group.run_group(plan(lrs=(3e-2,)), "tiny", "fp32", 0, str(tmp_path / "g"),
                          progress=False)
  np.testing.assert_allclose(alone["eval"][-1]["seq_loss"][0],
                             both["eval"][-1]["seq_loss"][1], rtol=1e-5)
  assert both["eval"][-1]["loss"][1] < both["eval"][0]["loss"][1]   # it learned


def _interrupted_before_its_result(p, d, prepared, monkeypatch):
  """Trains plan p's tiny fp32 group into d, interrupted (KeyboardInterrupt) as it writes
  result.json: the state of its last checkpoint (step 2) stays."""
  real = runs.write_json

  def interrupted(run_dir, name, obj, **kw):
    if name == "result.json":
      raise KeyboardInterrupt
    return real(run_dir, name, obj, **kw)

  with monkeypatch.context() as m:
    m.setattr(runs, "write_json", interrupted)
    with pytest.raises(KeyboardInterrupt):
      group.run_group(p, "tiny", "fp32", 0, d, checkpoint_every=2, progress=False,
                      prepared=prepared)


def test_an_interrupted_group_resumes_to_the_same_result(finished, prepared, tmp_path,
                                                        monkeypatch):
  p, whole, _ = finished
  d = str(tmp_path / "g")
  _interrupted_before_its_result(p, d, prepared, monkeypatch)
  assert os.path.exists(os.path.join(d, "state.npz"))       # the state of step 2
  resumed = group.run_group(p, "tiny", "fp32", 0, d, checkpoint_every=2, progress=False,
                            prepared=prepared)
  assert resumed["timing"]["resumed_from"] == 2
  assert resumed["eval"] == whole["eval"] and resumed["train"] == whole["train"]
  assert not os.path.exists(os.path.join(d, "state.npz"))


def test_the_logit_probe_matches_float64_numpy():
  """Independent check: the probe's per-layer maximum against NumPy float64 on the same
  queries and keys the kernels received."""
  cfg = settings.model_config("tiny", "bf16", 16)
  prec = settings.precision("bf16", "dot_product")
  params = model_lib.init_params(cfg, jax.random.PRNGKey(1))
  params = jax.tree.map(lambda x: x * 3.0, params)        # logits well away from zero
  tokens = jnp.asarray(corpus.eval_batch(0, 2, 16))
  seen = []

  def grab(next_f, args, kwargs, context):
    if isinstance(context.module, AttentionKernel) and context.method_name == "__call__":
      seen.append((np.asarray(args[0], np.float64), np.asarray(args[1], np.float64)))
    return next_f(*args, **kwargs)

  with hk.experimental.intercept_methods(grab):
    model_lib.transformed(cfg).apply(params, tokens[:, :-1], precision=prec)
  out = group.make_eval(cfg, prec)(jax.tree.map(lambda x: x[None], params), tokens)
  for layer, (q, k) in enumerate(seen):
    logits = np.einsum("btnh,bsnh->bnts", q, k) * cfg.head_dim ** -0.5
    T = logits.shape[-1]
    want = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf).max()
    assert float(out["max_logit"][0, layer]) == pytest.approx(want, rel=1e-5)


def test_bad_plans_are_refused_by_name():
  cases = [(dict(lrs=()), "empty grid"), (dict(lrs=(1e-3, -1.0)), "-1.0.*> 0"),
           (dict(lrs=(0.0,)), "> 0"), (dict(sizes=("huge",)), "'huge'.*valid: 'tiny'"),
           (dict(settings=("bf16", "fp16")), "'fp16'.*valid: 'bf16'"),
           (dict(kernel="pallas"), "no gradient.*'dot_product'"),
           (dict(warmup=4), "fewer than"), (dict(seeds=(0, 0)), "twice"),
           (dict(z_loss=-1.0), "z_loss")]
  for kw, match in cases:
    with pytest.raises(UserError, match=match):
      plan(**kw)


def _runner():
  import importlib.util
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location("runner_sweep",
                                                os.path.join(root, "runners", "sweep.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _call(argv, capsys):
  import gin
  gin.clear_config()
  try:
    rc = _runner().main(argv)
  finally:
    gin.clear_config()
  return rc, capsys.readouterr().err


# PLAN_ARGS with one learning rate: the shapes of the group of one trained above, so the
# runner's compiled programs are that group's (loaded from the compilation cache).
TINY = ["--gin.lr_sweep.sizes=('tiny',)", "--gin.lr_sweep.settings=('fp32',)",
        "--gin.lr_sweep.lrs=(1e-3,)", "--gin.lr_sweep.seeds=(0,)", "--gin.lr_sweep.steps=4",
        "--gin.lr_sweep.warmup=1", "--gin.lr_sweep.batch=2", "--gin.lr_sweep.seq_len=16",
        "--gin.lr_sweep.eval_every=2", "--gin.lr_sweep.eval_batch=3"]


@pytest.mark.parametrize("binding,needle", [
    ("--gin.lr_sweep.lrs=()", "lr_sweep.lrs = () is an empty grid"),
    ("--gin.lr_sweep.lrs=(1e-3,-0.1)", "-0.1: every learning rate must be"),
    ("--gin.lr_sweep.sizes=('1b',)", "'1b', which is not one; valid: 'tiny', '5m'"),
    ("--gin.lr_sweep.kernel='pallas'", "no gradient"),
])
def test_the_runner_refuses_bad_input_with_exit_2_and_writes_nothing(tmp_path, capsys,
                                                                     binding, needle):
  run_dir = tmp_path / "sweep"
  rc, err = _call([*TINY, binding, f"--run_dir={run_dir}"], capsys)
  lines = [line for line in err.splitlines() if line.strip()]
  assert rc == 2 and len(lines) == 1 and lines[0].startswith("sweep: error: "), err
  assert needle in lines[0] and not run_dir.exists()


def test_a_size_that_does_not_fit_is_refused_before_anything_is_written(tmp_path, capsys,
                                                                       monkeypatch):
  monkeypatch.setattr(group, "device_memory_bytes", lambda: 1000)
  run_dir = tmp_path / "sweep"
  rc, err = _call([*TINY, f"--run_dir={run_dir}"], capsys)
  assert rc == 2 and "'tiny'" in err and "than 95% of this device's" in err, err
  assert not run_dir.exists()


def test_a_run_dir_of_another_plan_is_refused(finished, tmp_path):
  from attnprec.lrsweep import job
  _, _, gdir = finished
  d = tmp_path / "sweep"
  shutil.copytree(os.path.dirname(os.path.dirname(os.path.dirname(gdir))), d)
  with pytest.raises(UserError, match="another sweep plan.*steps: 4 there, 5 now"):
    job.lr_sweep_job(run_dir=str(d), **dict(PLAN_ARGS, steps=5), progress=False)
  # the same plan: nothing to train, the report is written from the finished group
  out = job.lr_sweep_job(run_dir=str(d), **PLAN_ARGS, progress=False)
  assert out["sizes"]["tiny"]["settings"]["fp32"]["lrs"] == [1e-3, 3e-2]
  assert (d / "report.md").exists() and (d / "lr_sensitivity.png").exists()


def _shipped_plan():
  """The plan of gin/runs/sweep.gin (the sweep whose results ship in results/lr-sweep)."""
  import ast
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  values = {}
  with open(os.path.join(root, "gin", "runs", "sweep.gin")) as f:
    for line in f:
      if line.startswith("lr_sweep."):
        name, value = line[len("lr_sweep."):].split("=", 1)
        values[name.strip()] = ast.literal_eval(value.strip())
  return root, settings.check_plan(**values)


def test_the_shipped_report_is_what_the_code_computes_from_the_shipped_results():
  """results/lr-sweep/report.md is recomputed from the groups' result.json files (the
  TPU's runs) to the character, and docs/training.md quotes its tables verbatim."""
  root, p = _shipped_plan()
  run_dir = os.path.join(root, "results", "lr-sweep")
  results = report.load_results(run_dir, p)
  assert sum(len(v) for per in results.values() for v in per.values()) >= 12
  for per in results.values():
    for seed_results in per.values():
      for r in seed_results:
        assert r["provenance"]["backend"] == "tpu" and r["provenance"]["source"]
  text = report.markdown(report.analyze(results), p)
  with open(os.path.join(run_dir, "report.md")) as f:
    assert f.read() == text + "\n"
  with open(os.path.join(root, "docs", "training.md")) as f:
    doc = f.read()
  tables = [block for block in text.split("\n\n") if block.startswith("| ")]
  assert len(tables) >= 7
  for table in tables:
    assert table in doc, table.splitlines()[0]


def test_non_finite_or_missing_figures_in_a_result_are_named(tmp_path):
  """A result that parses but holds NaN / inf where a run that did not diverge has finite
  figures, or lacks its timing, is refused by name (it would move the sensitivity)."""
  path = tmp_path / "result.json"
  for edit, match in [
      (lambda r: r["eval"][1]["seq_loss"][1].__setitem__(0, float("nan")), "finite"),
      (lambda r: r["eval"][1]["lse"].__setitem__(0, float("inf")), "'lse' is not 3 finite"),
      (lambda r: r["eval"][1]["max_logit"][2].__setitem__(0, float("inf")), "max_logit"),
      (lambda r: r.pop("timing"), "no 'timing'"),
      (lambda r: r.__setitem__("timing", []), "'timing' is not an object")]:
    r = _fake_results(np.full((1, 3, 4), 2.0))[0]
    edit(r)
    path.write_text(json.dumps(r))
    with pytest.raises(UserError, match=match):
      report.read_result(str(path))


def test_a_state_file_that_is_not_this_group_s_is_refused_by_name(tmp_path, monkeypatch,
                                                                  prepared):
  """A saved state that is truncated, of a step outside the plan, with non-finite or
  mis-shaped parameters, or with logs of another shape is refused naming the file and
  the field (never a traceback, never trained on)."""
  p = plan()
  d = str(tmp_path / "g")
  _interrupted_before_its_result(p, d, prepared, monkeypatch)
  state = os.path.join(d, "state.npz")
  with np.load(state) as z:
    good = dict(z)

  def rewrite(**changes):
    arrays = dict(good, **changes)
    with open(state, "wb") as f:
      np.savez(f, **arrays)

  cases = [(dict(step=np.int64(60)), r"'step' is 60, not a step of this plan's 1..3"),
           (dict(step=np.int64(-6)), "'step' is -6"),
           (dict(leaf_0=np.full_like(good["leaf_0"], np.nan)), "'leaf_0' holds values"),
           (dict(leaf_0=good["leaf_0"][..., :1]), "'leaf_0' is float32"),
           (dict(logs=np.frombuffer(b"[1, 2]", np.uint8)), "'logs' is not the object")]
  for changes, match in cases:
    rewrite(**changes)
    with pytest.raises(UserError, match=f"state.npz is not a state this sweep group saved: "
                                        f"{match}"):
      group.run_group(p, "tiny", "fp32", 0, d, checkpoint_every=2, progress=False,
                      prepared=prepared)
  with open(state, "r+b") as f:
    f.truncate(500)
  with pytest.raises(UserError, match="cannot be read as this group's saved state"):
    group.run_group(p, "tiny", "fp32", 0, d, checkpoint_every=2, progress=False,
                    prepared=prepared)


def test_an_interrupted_report_leaves_no_part_of_itself(finished, tmp_path, monkeypatch):
  p, _, gdir = finished
  d = tmp_path / "sweep"
  shutil.copytree(os.path.dirname(os.path.dirname(os.path.dirname(gdir))), d)

  def interrupted(*args, **kwargs):
    raise KeyboardInterrupt

  monkeypatch.setattr(report, "plot", interrupted)
  with pytest.raises(KeyboardInterrupt):
    report.write_report(str(d), p, draws=10)
  assert not any((d / n).exists() for n in ("report.json", "report.md"))


def test_a_curve_where_no_run_learned_has_no_sensitivity():
  """Every run diverged (or ended at l_0): the sensitivity would read 0.000, a perfectly
  flat curve, from runs that all failed. It is reported as none, and a difference with
  it is not claimed."""
  final, init = np.array([4.0, 4.0]), np.array([4.0, 4.0])
  assert np.isnan(report.sensitivity(final, init, np.array([True, True])))
  assert np.isnan(report.sensitivity(np.array([5.0, 4.5]), init, np.array([False, False])))
  failed = _fake_results(np.full((2, 3, 8), 4.0))        # ends at l_0 = 4.0 everywhere
  learned = _fake_results(np.array([2.0, 1.5, 2.5])[None, :, None] + np.zeros((2, 3, 8)))
  assert report.bootstrap(report.Curves(failed), report.Curves(learned), draws=20) == \
      (None, None, None)
  analysis = report.analyze({"tiny": {"qk_norm": failed, "bf16": learned}}, draws=20)
  (d,) = analysis["sizes"]["tiny"]["differences"]
  assert d["verdict"] == "not claimed: no run of a curve learned"
  assert analysis["sizes"]["tiny"]["settings"]["qk_norm"]["sensitivity"] is None
  assert analysis["qk_norm_reproduced"] is False
  text = report.markdown(analysis, plan())
  assert "– (no run learned)" in text and "0.000 [0.000, 0.000]" not in text
