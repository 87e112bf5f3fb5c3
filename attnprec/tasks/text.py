"""Byte-level language modelling on local text files (no downloads).

Tokens are bytes 0..255 plus two specials (vocabulary V = 258): PAD = 256, BOS = 257.
Each file is split once: its first (1 - heldout_fraction) bytes train, the rest is held
out for eval NLL. The splits of all files are concatenated (BOS between files) into a
train stream and an eval stream. A sequence is BOS followed by T - 1 consecutive bytes from
a uniformly drawn offset; the loss covers every byte.

Batches are a pure function of the Generator passed in; the train loop seeds it with
(seed, step), so the data position of a run is its step and resuming is exact.

Default corpus (`text.files` empty): the sources of a few pure-Python standard-library
modules (DEFAULT_MODULES), found under `sysconfig.get_paths()['stdlib']`, which ships with
every CPython install (~0.4 MB of code, comments and docstrings).
"""
import dataclasses
import functools
import hashlib
import os
import sysconfig
from typing import Tuple

import gin
import numpy as np

from attnprec import checks
from attnprec.errors import UserError

PAD, BOS = 256, 257
VOCAB_SIZE = 258
DEFAULT_MODULES = ("argparse.py", "textwrap.py", "difflib.py", "dataclasses.py",
                   "functools.py", "inspect.py")


def default_files() -> Tuple[str, ...]:
  stdlib = sysconfig.get_paths()["stdlib"]
  return tuple(os.path.join(stdlib, m) for m in DEFAULT_MODULES)


@functools.lru_cache(maxsize=8)
def _load(files: Tuple[str, ...], heldout_fraction: float):
  """(train_N uint16, eval_M uint16, [(path, bytes, sha256)]) for the files."""
  train_parts, eval_parts, listing = [], [], []
  for path in files:
    try:
      with open(path, "rb") as f:
        data = f.read()
    except OSError as e:
      raise UserError(f"Cannot read text file {path!r} ({e.strerror}); set text.files to "
                      f"readable files, or leave it empty for the stdlib default.") from None
    cut = int(len(data) * (1.0 - heldout_fraction))
    for parts, chunk in ((train_parts, data[:cut]), (eval_parts, data[cut:])):
      parts.append(np.frombuffer(chunk, np.uint8).astype(np.uint16))
      parts.append(np.array([BOS], np.uint16))
    listing.append((path, len(data), hashlib.sha256(data).hexdigest()))
  return np.concatenate(train_parts), np.concatenate(eval_parts), listing


@checks.validated("text", seq_len=checks.at_least(2),
                  files=checks.sequence_of(checks.regular_file, nonempty=False),
                  heldout_fraction=checks.number(gt=0, lt=1))
@dataclasses.dataclass(frozen=True, kw_only=True)
class TextTask:
  files: Tuple[str, ...] = ()      # text files; empty -> default_files() (stdlib sources)
  seq_len: int = 128               # T: tokens per sequence (BOS + T - 1 bytes)
  heldout_fraction: float = 0.1    # tail of every file kept for eval

  def __post_init__(self):
    object.__setattr__(self, "files", tuple(self.files) or default_files())
    if not 0.0 < self.heldout_fraction < 1.0:
      raise UserError(f"text.heldout_fraction={self.heldout_fraction} must be in (0, 1).")
    if self.seq_len < 2:
      raise UserError(f"text.seq_len={self.seq_len} must be at least 2.")
    train, held, _ = _load(self.files, self.heldout_fraction)
    for name, stream in (("training", train), ("held-out", held)):
      if len(stream) < self.seq_len:
        raise UserError(f"The {name} split of text.files has {len(stream)} tokens, fewer "
                        f"than text.seq_len={self.seq_len}; add text or shorten seq_len.")

  @property
  def vocab_size(self) -> int:
    return VOCAB_SIZE

  def _windows(self, stream, rng: np.random.Generator, batch: int):
    starts_B = rng.integers(0, len(stream) - (self.seq_len - 1) + 1, batch)
    idx_BxT = starts_B[:, None] + np.arange(self.seq_len - 1)
    bos_Bx1 = np.full((batch, 1), BOS, np.int32)
    tokens_BxT = np.concatenate([bos_Bx1, stream[idx_BxT].astype(np.int32)], axis=1)
    return tokens_BxT, np.ones(tokens_BxT.shape, np.float32)

  def train_batch(self, rng: np.random.Generator, batch: int):
    """(tokens_BxT int32, loss_mask_BxT float32) from the training split."""
    return self._windows(_load(self.files, self.heldout_fraction)[0], rng, batch)

  def eval_batch(self, rng: np.random.Generator, batch: int):
    """(tokens_BxT int32, loss_mask_BxT float32) from the held-out split."""
    return self._windows(_load(self.files, self.heldout_fraction)[1], rng, batch)

  def describe(self) -> dict:
    """Settings plus each file's size and sha256 (a resumed run can tell if they changed)."""
    listing = _load(self.files, self.heldout_fraction)[2]
    return {"kind": "text_bytes", "seq_len": self.seq_len,
            "heldout_fraction": self.heldout_fraction,
            "files": [{"path": p, "bytes": n, "sha256": h} for p, n, h in listing]}


def encode(text: str) -> np.ndarray:
  """UTF-8 bytes as int32 tokens (no BOS)."""
  return np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)


def decode(tokens) -> str:
  """Tokens -> text; specials are dropped, invalid UTF-8 replaced."""
  data = bytes(int(t) for t in np.asarray(tokens).ravel() if 0 <= int(t) < 256)
  return data.decode("utf-8", errors="replace")


# gin root (`text.seq_len = 128`); wraps a copy, so TextTask(...) in code reads no gin.
text_task = gin.external_configurable(TextTask, "text")
