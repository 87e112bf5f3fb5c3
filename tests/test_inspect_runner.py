"""`make inspect` (runners/inspect_model.py): exit codes, files, one-paragraph errors.

The inspected functions are `attnprec.inspect.examples` (written in other code bases'
styles) and small functions defined here; what each must report is said next to it.
"""
import importlib.util
import json
import os
import subprocess
import sys

import gin
import jax.numpy as jnp

from attnprec import paths

RUNNERS = os.path.join(os.path.dirname(paths.REPO_GIN_DIR), "runners")
RUNNER = os.path.join(RUNNERS, "inspect_model.py")
MAXTEXT = ["--gin.inspect.fn=attnprec.inspect.examples:maxtext_attention",
           "--gin.inspect.inputs=attnprec.inspect.examples:maxtext_inputs"]


class _Runner:
  """runners/inspect_model.py's main, each call with fresh gin bindings (as a new process)."""

  def __init__(self):
    spec = importlib.util.spec_from_file_location("inspect_runner", RUNNER)
    self.module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(self.module)

  def main(self, argv):
    gin.clear_config()
    return self.module.main(argv)


def bad_inputs():
  return [1, 2]                       # not (args, kwargs)


def seed_style(q, k, v):
  """f32 QK product cast down to bf16 before the softmax."""
  logits = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32)
  probs = jnp.exp(logits.astype(jnp.bfloat16) - logits.max(-1, keepdims=True).astype(
      jnp.bfloat16))
  probs = probs / probs.sum(-1, keepdims=True)
  return jnp.einsum("bnts,bsnh->btnh", probs, v)


def test_exit_codes_files_and_errors(tmp_path, capsys):
  runner = _Runner()
  ok = tmp_path / "ok"
  # no Precision stated, nothing flagged: 0, both files, no temp files left
  assert runner.main(MAXTEXT + [f"--run_dir={ok}"]) == 0
  assert sorted(os.listdir(ok)) == [".attnprec-run.json", "inspect.json", "inspect.md"]
  result = json.loads((ok / "inspect.json").read_text())
  assert len(result["attentions"]) == 1 and result["ok"]
  assert result["attentions"][0]["qk"]["lhs_source"] == "bf16"
  # the stated einsum precision is not what the program runs: 3 (as the audit), and the report says so
  bad = tmp_path / "mismatch"
  assert runner.main(MAXTEXT + [f"--run_dir={bad}", "--gin_file=precision/fp32_attention.gin",
                                "--gin.precision.einsum_precision=highest"]) == 3
  assert "precision DEFAULT, expected HIGHEST" in (bad / "inspect.md").read_text()
  # a down-cast before the softmax is flagged with no Precision stated: 3
  here = "tests.test_inspect_runner"
  flagged = tmp_path / "flagged"
  assert runner.main([f"--gin.inspect.fn={here}:seed_style", f"--run_dir={flagged}",
                      "--gin.inspect.shapes=bf16[1,4,2,8] bf16[1,4,2,8] bf16[1,4,2,8]"]) == 3
  assert "f32->bf16" in (flagged / "inspect.md").read_text()
  capsys.readouterr()

  # bad input: 2, one paragraph naming the bad value, nothing written
  nothing = tmp_path / "nothing"
  cases = [(["--gin.inspect.fn=no_such_pkg.mod:f"], "no_such_pkg"),
           (["--gin.inspect.fn=attnprec.inspect.examples:nope"], "maxtext_attention"),
           (["--gin.inspect.fn=attnprec.inspect.examples"], "package.module:function"),
           (MAXTEXT[:1] + ["--gin.inspect.shapes=bf16[2,x]"], "bf16[2,x]"),
           (MAXTEXT[:1] + ["--gin.inspect.shapes=bf16[2,8]"], "missing 2 required"),
           (MAXTEXT[:1] + [f"--gin.inspect.inputs={here}:bad_inputs"], "(args, kwargs)"),
           (MAXTEXT + ["--gin.inspect.shapes=bf16[2]"], "not both"),
           (MAXTEXT + ["--gin.inspect.expect='sometimes'"], "'auto'"),
           (MAXTEXT + ["--gin.inspect.expect='none'", "--gin_file=precision/bf16.gin"],
            "would not be used"),
           ([], "inspect.fn")]
  for argv, named in cases:
    assert runner.main(argv + [f"--run_dir={nothing}"]) == 2, argv
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err and err.count("\n") == 1, (argv, err)
  assert not nothing.exists() or not os.listdir(nothing)
  blocker = tmp_path / "file"
  blocker.write_text("x")
  assert runner.main(MAXTEXT + [f"--run_dir={blocker / 'sub'}"]) == 2


def test_no_runner_shadows_the_standard_library():
  """A script's directory is first on sys.path: runners/inspect.py would replace the
  standard library's `inspect` (imported by numpy, gin) for every runner."""
  names = {f[:-3] for f in os.listdir(RUNNERS) if f.endswith(".py")}
  assert not names & set(sys.stdlib_module_names), names & set(sys.stdlib_module_names)
  out = subprocess.run([sys.executable, RUNNER], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": os.path.dirname(RUNNERS)})
  assert out.returncode == 2 and "inspect.fn" in out.stderr, out.stderr
