"""The scripts under results/ that made a committed figure run under the project's XLA
settings: each that imports jax turns XLA's excess precision off first
(`attnprec.xla_env.disable_excess_precision`, as every runner does), or is a library that
only such scripts import. Read as text: nothing is run."""
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _scripts():
  return sorted(glob.glob(os.path.join(ROOT, "results", "**", "*.py"), recursive=True))


def test_every_results_script_turns_excess_precision_off_before_jax():
  scripts = {p: open(p, encoding="utf-8").read() for p in _scripts()}
  jax_import = re.compile(r"^(?:import jax\b|from jax\b)", re.M)
  checked, missing = 0, []
  for path, text in scripts.items():
    first_jax = jax_import.search(text)
    if first_jax is None:
      continue
    call = text.find("disable_excess_precision()")
    if 0 <= call < first_jax.start():
      checked += 1
      continue
    name = os.path.splitext(os.path.basename(path))[0]
    importers = [p for p, t in scripts.items() if os.path.dirname(p) == os.path.dirname(path)
                 and re.search(rf"^\s*(?:import {name}\b|from {name} import)", t, re.M)]
    if importers and all(0 <= scripts[p].find("disable_excess_precision()") for p in importers):
      checked += 1                   # a library of its siblings, which set it first
      continue
    missing.append(os.path.relpath(path, ROOT))
  assert checked >= 20, checked      # a check that finds nothing to check fails
  assert not missing, ("results scripts that import jax without turning XLA's excess "
                       f"precision off first: {missing}")


def test_profile_ops_refuses_a_malformed_case_or_block_by_name(tmp_path):
  """results/tpu-flash/profile_ops.py: a case that is not prefill:S / train:S, a block
  that Mosaic cannot tile, or a machine without a TPU: one line naming it, exit 2,
  nothing written."""
  import subprocess
  import sys
  script = os.path.join(ROOT, "results", "tpu-flash", "profile_ops.py")
  out = tmp_path / "out"
  for args, env, named in (
      (["prefill:100"], {}, "case 'prefill:100'"),
      ([], {"FLASH_BLOCKS": "1024/1000"}, "FLASH_BLOCKS='1024/1000'"),
      ([], {"SPLASH_BLOCKS": "512/512/128"}, "SPLASH_BLOCKS='512/512/128'"),
      (["prefill:256"], {"JAX_PLATFORMS": "cpu"}, "this backend is 'cpu'")):
    r = subprocess.run([sys.executable, script, str(out)] + args, capture_output=True,
                       text=True, env=dict(os.environ, **env), cwd=ROOT, timeout=120)
    assert r.returncode == 2 and named in r.stderr, (args, env, r.stderr[-500:])
    assert not out.exists()
