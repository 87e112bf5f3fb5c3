"""Inputs of the study: a real text that ships on every machine, passkey prompts for the
real models, recall prompts for the recall model.

Two texts (`study.text`):
  'stdlib'        the Python standard library's own documentation: the module docstrings
                  (`inspect.getdoc`) of a fixed list of stdlib modules, then the docstrings
                  of their public functions and classes, in a fixed order. Its exact content
                  depends on the Python version. Public since long before any shipped model
                  was trained: a model may have seen it.
  'project_docs'  held-out text: this project's own README.md and docs/*.md (sorted by
                  name), prose and tables written in 2026, after every shipped model was
                  released, so no model can have trained on it. Frozen: the files as of
                  commit HELDOUT_COMMIT, joined (`freeze_project_docs`), shipped as
                  assets/heldout/project_docs.txt.gz and pinned by its SHA-256
                  (HELDOUT_SHA256): a study reads exactly that text or refuses to run, so
                  a held-out run can be made again byte for byte from any commit.
Results record the source, the character count and a SHA-256 of the text.
"""
import hashlib
import importlib
import inspect
import os
import sys
from typing import List, Tuple

import numpy as np

from attnprec import pinned
from attnprec.errors import UserError

DOC_MODULES = (
    "argparse", "json", "collections", "functools", "re", "string", "textwrap", "typing",
    "difflib", "unittest", "csv", "decimal", "fractions", "heapq", "pathlib", "pickle",
    "random", "shutil", "statistics", "subprocess", "tarfile", "threading", "zipfile",
    "calendar", "codecs", "datetime", "doctest", "email", "getopt", "gettext", "glob",
    "hashlib", "hmac", "inspect", "locale", "logging", "mailbox", "optparse", "pdb",
    "pprint", "pydoc", "queue", "sched", "secrets", "shlex", "smtplib", "socket", "tempfile",
    "tokenize", "trace", "traceback", "uuid", "warnings", "weakref", "zipapp")


def stdlib_text(min_chars: int = 200_000) -> str:
  """Module docstrings, then member docstrings, of DOC_MODULES (deterministic order)."""
  modules = [importlib.import_module(m) for m in DOC_MODULES]
  parts = [inspect.getdoc(m) or "" for m in modules]
  for m in modules:
    if sum(map(len, parts)) >= min_chars:
      break
    for name in sorted(vars(m)):
      obj = getattr(m, name)
      if name.startswith("_") or getattr(obj, "__module__", None) != m.__name__:
        continue
      doc = inspect.getdoc(obj)
      if doc and len(doc) > 80:
        parts.append(f"{m.__name__}.{name}: {doc}")
  return "\n\n".join(p for p in parts if p)


PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def project_docs_files(root: str = PROJECT_ROOT) -> List[str]:
  """README.md, then docs/*.md sorted by name (paths)."""
  docs = os.path.join(root, "docs")
  files = [os.path.join(root, "README.md")]
  if os.path.isdir(docs):
    files += [os.path.join(docs, n) for n in sorted(os.listdir(docs)) if n.endswith(".md")]
  missing = [f for f in files if not os.path.isfile(f)]
  if missing or len(files) < 2:
    raise UserError(f"study.text='project_docs' reads README.md and docs/*.md from the "
                    f"project's checkout ({root}); not found there: "
                    f"{', '.join(missing) or 'docs/*.md'}. Run from a clone of the project, "
                    f"or use study.text='stdlib'.")
  return files


def project_docs_text(root: str = PROJECT_ROOT) -> str:
  """The living README.md + docs/*.md of a checkout, joined (what `freeze_project_docs`
  froze at HELDOUT_COMMIT); the study reads the frozen text, `heldout_text`."""
  parts = []
  for path in project_docs_files(root):
    with open(path, encoding="utf-8") as f:
      parts.append(f.read().strip())
  return "\n\n".join(parts)


# The held-out text, frozen: README.md + docs/*.md of this commit, joined as
# `project_docs_text` joins them, gzipped into HELDOUT_FILE.
HELDOUT_COMMIT = "99216bb"
HELDOUT_SHA256 = "f5d0cb83e7883901e0261559ec2e7c38140df0f9e3ea2ede349c8c50144478da"
HELDOUT_FILE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            "assets", "heldout", "project_docs.txt.gz")


def freeze_project_docs(rev: str = HELDOUT_COMMIT, root: str = PROJECT_ROOT) -> str:
  """README.md + docs/*.md as of git revision `rev`, joined (how HELDOUT_FILE was made:
  `python -c "from attnprec.study import inputs; print(inputs.freeze_project_docs())"`)."""
  import subprocess
  git = lambda *a: subprocess.run(["git", "-C", root, *a], capture_output=True, text=True,  # noqa: E731
                                  check=True).stdout
  names = sorted(n for n in git("ls-tree", "--name-only", rev, "docs/").split()
                 if n.endswith(".md"))
  return "\n\n".join(git("show", f"{rev}:{f}").strip() for f in ["README.md"] + names)


def heldout_text(path: str = HELDOUT_FILE, sha256: str = HELDOUT_SHA256) -> str:
  """The frozen held-out text, checked against its pinned SHA-256; any other text is a
  UserError (a held-out run on an unknown text can never be made again)."""
  return pinned.read(path, sha256, what="The held-out text",
                     remedy=f"the study reads only README.md + docs/*.md of commit "
                            f"{HELDOUT_COMMIT}. Restore the file from the repository, or "
                            f"use study.text='stdlib'.").decode("utf-8")


TEXTS = {"stdlib": stdlib_text, "project_docs": heldout_text}
SOURCES = {"stdlib": "Python stdlib docstrings (attnprec.study.inputs.DOC_MODULES)",
           "project_docs": f"held-out text: the project's own README.md and docs/*.md as of "
                           f"commit {HELDOUT_COMMIT}, written after the model's release "
                           f"(frozen, SHA-256 {HELDOUT_SHA256[:16]})"}


def load_text(name: str) -> str:
  if name not in TEXTS:
    raise UserError(f"study.text={name!r} is not a text the study knows; valid: "
                    f"{', '.join(repr(n) for n in TEXTS)} ('stdlib': Python's docstrings, "
                    f"'project_docs': held-out text the models cannot have seen).")
  return TEXTS[name]()


def describe_text(text: str, name: str = "stdlib") -> dict:
  return {"source": SOURCES[name], "text": name,
          "python": sys.version.split()[0], "chars": len(text),
          "sha256": hashlib.sha256(text.encode()).hexdigest()[:16]}


def text_windows(tokens: List[int], length: int, count: int, bos: List[int]) -> np.ndarray:
  """`count` windows of `length` tokens (each starting with `bos`), taken at evenly
  spaced offsets of the tokenized text."""
  body = length - len(bos)
  if len(tokens) < body:
    raise UserError(f"The study's text has {len(tokens)} tokens; a context of {length} "
                    f"needs {body}. Lower the context lengths (study.context_lengths).")
  starts = np.linspace(0, len(tokens) - body, count).astype(int)
  return np.asarray([bos + tokens[s:s + body] for s in starts], np.int32)


def passkey_prompts(tokenizer, filler_tokens: List[int], length: int, count: int,
                    seed: int) -> Tuple[np.ndarray, List[str]]:
  """Passkey retrieval: a 5-digit key stated once at a random depth inside `length` tokens
  of stdlib text, then asked for at the end. Returns (prompts_BxL int32, keys)."""
  rng = np.random.default_rng(seed)
  question = tokenizer.encode("\n\nQuestion: what is the pass key? Answer: the pass key is",
                              add_bos=False)
  bos = tokenizer.encode("", add_bos=True)
  prompts, keys = [], []
  for b in range(count):
    key = str(rng.integers(10_000, 100_000))
    needle = tokenizer.encode(f"\n\nThe pass key is {key}. Remember it: {key} is the pass "
                              f"key.\n\n", add_bos=False)
    room = length - len(bos) - len(needle) - len(question)
    if room < 16:
      raise UserError(f"A passkey prompt of {length} tokens leaves no room for filler "
                      f"text; use context lengths >= {length - room + 16}.")
    if len(filler_tokens) < room:
      raise UserError(f"The stdlib text has {len(filler_tokens)} tokens; a passkey prompt "
                      f"of {length} tokens needs {room}. Lower study.context_lengths.")
    start = int(rng.integers(0, len(filler_tokens) - room + 1))
    filler = filler_tokens[start:start + room]
    depth = int(rng.integers(0, room + 1))
    prompts.append(bos + filler[:depth] + needle + filler[depth:] + question)
    keys.append(key)
  return np.asarray(prompts, np.int32), keys
