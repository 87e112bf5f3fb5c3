"""The LR sweep's text: CPython 3.11's standard-library sources, frozen and shipped.

Byte-level (tokens 0..255, BOS = 257; vocabulary 258, as `attnprec.tasks.text`). The
corpus is every top-level module of the standard library whose name does not start with
'_' (code, comments, docstrings; PSF licence), in name order, each file preceded by a
line `# ==== <name>.py`. It is frozen from one Python (3.11.7) by `freeze` into
assets/lrsweep/stdlib311.txt.xz and pinned by SHA-256 (CORPUS_SHA256) of the text, so a
CPU and a TPU machine (whose Python differs in patch version) train on the same bytes, and
a run refuses a text that is not the pinned one.

Split by file, not by position: every HELDOUT_EVERY-th file (in name order) is held out
whole, so eval loss is measured on modules the model never saw.

Batches are a pure function of (seed, step): the batch of step s of seed k is drawn with
numpy's Generator seeded [k, 0, s] (the eval batch with [k, 1]), so a resumed run
draws the same batches as an uninterrupted one.
"""
import hashlib
import lzma
import os
import sysconfig
from typing import List, Tuple

import numpy as np

from attnprec import pinned
from attnprec.tasks.text import BOS, VOCAB_SIZE  # noqa: F401  (re-exported)

ASSET = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                     "assets", "lrsweep", "stdlib311.txt.xz")
CORPUS_SHA256 = "e3d5694e36d6d1e8c2e1e5832d4bbdd805b733051cc28efebbb49c024cbe9556"
HELDOUT_EVERY = 10
HEADER = "# ==== {}\n"


def freeze(path: str = ASSET, stdlib: str = "") -> str:
  """Writes the corpus of this Python's stdlib into `path` (xz); returns its text's
  SHA-256. Run once (`python -c 'from attnprec.lrsweep import corpus; print(corpus.freeze())'`)
  and pin the digest in CORPUS_SHA256."""
  stdlib = stdlib or sysconfig.get_paths()["stdlib"]
  names = sorted(n for n in os.listdir(stdlib)
                 if n.endswith(".py") and not n.startswith("_"))
  parts = []
  for n in names:
    with open(os.path.join(stdlib, n), "rb") as f:
      data = f.read()
    try:
      data.decode("utf-8")
    except UnicodeDecodeError:
      continue
    parts.append(HEADER.format(n).encode() + data)
  text = b"".join(parts)
  with lzma.open(path, "wb", preset=9 | lzma.PRESET_EXTREME) as f:
    f.write(text)
  return hashlib.sha256(text).hexdigest()


def _files(text: bytes) -> List[bytes]:
  """The corpus's files, each with its header line."""
  marker = b"# ==== "
  starts = []
  pos = 0
  while True:
    i = text.find(marker, pos)
    if i < 0:
      break
    if i == 0 or text[i - 1:i] == b"\n":
      end = text.find(b"\n", i)
      if end > i and text[i + len(marker):end].endswith(b".py") and \
          b" " not in text[i + len(marker):end]:
        starts.append(i)
    pos = i + 1
  starts.append(len(text))
  return [text[a:b] for a, b in zip(starts, starts[1:])]


_CACHE = {}


def load(path: str = ASSET, sha256: str = CORPUS_SHA256) -> Tuple[np.ndarray, np.ndarray, dict]:
  """(train uint16 [N], heldout uint16 [M], description) of the pinned corpus; a file
  that is missing, unreadable or not the pinned text is refused by name."""
  key = (path, sha256)
  if key in _CACHE:
    return _CACHE[key]
  text = pinned.read(path, sha256, what="The LR sweep's corpus",
                     remedy="it ships with attnprec (assets/lrsweep/): restore it from the "
                            "repository.")
  digest = sha256
  files = _files(text)
  train = [f for i, f in enumerate(files) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
  held = [f for i, f in enumerate(files) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]

  def stream(parts):
    out = []
    for p in parts:
      out.append(np.frombuffer(p, np.uint8).astype(np.uint16))
      out.append(np.array([BOS], np.uint16))
    return np.concatenate(out)

  held_names = [f.split(b"\n", 1)[0][len(b"# ==== "):].decode() for f in held]
  desc = {"kind": "stdlib_bytes", "asset": os.path.relpath(path, os.path.dirname(ASSET)),
          "sha256": digest, "bytes": len(text), "files": len(files),
          "train_bytes": int(sum(map(len, train))), "heldout_bytes": int(sum(map(len, held))),
          "heldout_files": held_names}
  _CACHE[key] = (stream(train), stream(held), desc)
  return _CACHE[key]


def windows(stream: np.ndarray, rng: np.random.Generator, batch: int,
            seq_len: int) -> np.ndarray:
  """int32 [batch, seq_len]: BOS then seq_len - 1 consecutive bytes from uniform offsets."""
  starts_B = rng.integers(0, len(stream) - (seq_len - 1) + 1, batch)
  idx_BxT = starts_B[:, None] + np.arange(seq_len - 1)
  return np.concatenate([np.full((batch, 1), BOS, np.int32),
                         stream[idx_BxT].astype(np.int32)], axis=1)


def train_batch(seed: int, step: int, batch: int, seq_len: int) -> np.ndarray:
  return windows(load()[0], np.random.default_rng([seed, 0, step]), batch, seq_len)


def eval_batch(seed: int, batch: int, seq_len: int) -> np.ndarray:
  return windows(load()[1], np.random.default_rng([seed, 1]), batch, seq_len)
