"""Statistics of the task evaluations and the study (one module for both, below them):
intervals, paired tests, power.

Every evaluation scores items pass/fail under several precision presets, on the same items,
so the statistics are those of proportions and of matched pairs:

- `wilson`: the Wilson score interval of one preset's pass rate.
- `paired_table` / `mcnemar_exact`: the paired 2x2 table of two presets on the same items
  and the exact (conditional) McNemar test of "A and B pass equally often".
- `mcnemar_power` / `min_detectable_difference`: the exact power of that test, and the
  smallest difference a sample of this size could have detected, which is what docs/evals.md
  quotes when no preset differs significantly.
- `first_divergence`: where two presets' token sequences first differ.

Pure numpy and the standard library (math.comb, math.lgamma): nothing here needs scipy.
Arguments are validated; a bad one raises `attnprec.errors.UserError`.
"""
import dataclasses
import functools
import math
import numbers
from typing import Optional, Sequence, Tuple

import numpy as np

from attnprec.errors import UserError


# --- argument checks ------------------------------------------------------------------

def _count(name: str, value) -> int:
  """`value` as a non-negative int, or a UserError naming `name`."""
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
    raise UserError(f"Invalid {name} {value!r}: it must be a whole number of items "
                    f"(an int >= 0).")
  if value < 0:
    raise UserError(f"Invalid {name} {value!r}: a count cannot be negative; valid values "
                    f"are integers >= 0.")
  return int(value)


def _real(name: str, value) -> float:
  if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
    raise UserError(f"Invalid {name} {value!r}: it must be a real number.")
  value = float(value)
  if not math.isfinite(value):
    raise UserError(f"Invalid {name} {value!r}: it must be a finite number.")
  return value


def _prob(name: str, value) -> float:
  """`value` as a probability in [0, 1], or a UserError naming `name`."""
  value = _real(name, value)
  if not 0.0 <= value <= 1.0:
    raise UserError(f"Invalid {name} {value!r}: a probability must lie in [0, 1].")
  return value


def _open_unit(name: str, value) -> float:
  """`value` in the open interval (0, 1) (a significance level or a target power)."""
  value = _real(name, value)
  if not 0.0 < value < 1.0:
    raise UserError(f"Invalid {name} {value!r}: it must lie strictly between 0 and 1 "
                    f"(e.g. 0.05 for a level, 0.8 for a power).")
  return value


# --- one proportion ---------------------------------------------------------------------

def wilson(k: int, n: int, z: float = 1.96) -> Tuple[float, float]:
  """Wilson score interval for a binomial proportion k/n (Wilson 1927, JASA 22:209-212;
  'method 3' of Newcombe 1998, Stat Med 17:857-872).

    centre = (k + z^2/2) / (n + z^2)
    half   = z / (n + z^2) * sqrt(k (n - k) / n + z^2 / 4)
    (lo, hi) = (centre - half, centre + half)   (lo = 0 when k = 0, hi = 1 when k = n)

  z = 1.96 gives the 95% interval. n == 0 (no items) gives (0, 1).
  """
  k, n = _count("k (successes)", k), _count("n (trials)", n)
  z = _real("z", z)
  if k > n:
    raise UserError(f"Invalid k (successes) {k}: it cannot exceed n (trials) {n}; valid "
                    f"values are 0 <= k <= n.")
  if z <= 0:
    raise UserError(f"Invalid z {z!r}: the normal quantile must be > 0 (1.96 for 95%).")
  if n == 0:
    return (0.0, 1.0)
  z2 = z * z
  centre = (k + z2 / 2) / (n + z2)
  half = z / (n + z2) * math.sqrt(k * (n - k) / n + z2 / 4)
  lo = 0.0 if k == 0 else max(0.0, centre - half)     # exactly 0 and 1 at the ends,
  hi = 1.0 if k == n else min(1.0, centre + half)     # where rounding could miss them
  return (lo, hi)


# --- paired items ------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class PairedTable:
  """The paired 2x2 table of presets A and B on the same items: how many items both pass,
  only A passes, only B passes, neither passes."""
  both: int
  only_a: int
  only_b: int
  neither: int

  def __post_init__(self):
    for f in dataclasses.fields(self):
      _count(f.name, getattr(self, f.name))

  @property
  def n(self) -> int:
    """Number of items (pairs)."""
    return self.both + self.only_a + self.only_b + self.neither

  @property
  def discordant(self) -> int:
    """Pairs answered differently (only A + only B): all McNemar's test looks at."""
    return self.only_a + self.only_b


def paired_table(a: Sequence[bool], b: Sequence[bool]) -> PairedTable:
  """The PairedTable of two per-item pass/fail sequences over the same items, in order."""
  a = np.asarray(a).astype(bool).ravel()
  b = np.asarray(b).astype(bool).ravel()
  if a.shape != b.shape:
    raise UserError(f"Invalid paired sequences: A has {a.size} items and B has {b.size}; "
                    f"a paired table needs one result of each preset per item, so the "
                    f"lengths must match.")
  return PairedTable(both=int(np.sum(a & b)), only_a=int(np.sum(a & ~b)),
                     only_b=int(np.sum(~a & b)), neither=int(np.sum(~a & ~b)))


def _lower_tail_half(d: int, c: int) -> float:
  """P(X <= c) for X ~ Binomial(d, 1/2), exactly: sum_{i<=c} C(d, i) / 2^d."""
  term, total = 1, 0
  for i in range(c + 1):
    total += term
    term = term * (d - i) // (i + 1)
  return total / 2 ** d


def mcnemar_exact(only_a: int, only_b: int) -> float:
  """Two-sided exact McNemar p-value (McNemar 1947, Psychometrika 12:153-157; exact
  conditional form as in Fagerland, Lydersen & Laake 2013, BMC Med Res Methodol 13:91).

  Under H0 (A and B pass equally often) each of the D = only_a + only_b discordant pairs
  is 'only A' with probability 1/2, so with X ~ Binomial(D, 1/2):

    p = min(1, 2 * P(X <= min(only_a, only_b)))

  computed in exact integer arithmetic. No discordant pairs (D = 0) gives p = 1.
  """
  only_a, only_b = _count("only_a", only_a), _count("only_b", only_b)
  d = only_a + only_b
  if d == 0:
    return 1.0
  return min(1.0, 2.0 * _lower_tail_half(d, min(only_a, only_b)))


# --- power ---------------------------------------------------------------------------------

@functools.lru_cache(maxsize=4096)
def _log_factorials(n: int) -> np.ndarray:
  """[log 0!, log 1!, ..., log n!]."""
  return np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1, dtype=np.float64)))])


def _log_pmf(lf: np.ndarray, d, i, q: float) -> np.ndarray:
  """log P(Y = i) for Y ~ Binomial(d, q), elementwise, with 0 * log 0 = 0."""
  d, i = np.asarray(d), np.asarray(i)
  out = lf[d] - lf[i] - lf[d - i]
  with np.errstate(divide="ignore", invalid="ignore"):
    out = out + np.where(i > 0, i * np.log(q) if q > 0 else -np.inf, 0.0)
    out = out + np.where(d - i > 0, (d - i) * np.log1p(-q) if q < 1 else -np.inf, 0.0)
  return out


def _critical_count(d: int, alpha: float, lf: np.ndarray) -> int:
  """The largest c with mcnemar_exact(c, d - c) <= alpha (-1 if none): with D = d
  discordant pairs, the test rejects exactly when min(only_a, only_b) <= c."""
  i = np.arange(d // 2 + 1)
  two_tail = 2.0 * np.cumsum(np.exp(_log_pmf(lf, d, i, 0.5)))
  c = int(np.searchsorted(two_tail, alpha, side="right")) - 1
  # Floating point decides all but near-ties; those are settled by the exact test.
  while c + 1 < len(i) and abs(two_tail[c + 1] - alpha) < 1e-9:
    if mcnemar_exact(c + 1, d - c - 1) > alpha:
      break
    c += 1
  while c >= 0 and abs(two_tail[c] - alpha) < 1e-9 and mcnemar_exact(c, d - c) > alpha:
    c -= 1
  return c


@functools.lru_cache(maxsize=64)
def _rejection_regions(n: int, alpha: float):
  """For D = 0..n discordant pairs, the rejection region {i <= c_D} of the only-A count's
  lower tail, flattened: (D of each entry, i of each entry, offsets[D] = first entry of D)."""
  lf = _log_factorials(n)
  crit = np.array([_critical_count(d, alpha, lf) for d in range(n + 1)])
  sizes = crit + 1
  offsets = np.concatenate([[0], np.cumsum(sizes)])
  d_idx = np.repeat(np.arange(n + 1), sizes)
  i_idx = np.arange(offsets[-1]) - offsets[d_idx]
  return d_idx, i_idx, offsets


def mcnemar_power(n: int, p_a_only: float, p_b_only: float, alpha: float = 0.05) -> float:
  """Exact power of the two-sided exact McNemar test (`mcnemar_exact(...) <= alpha`) for n
  pairs, each 'only A' with probability p_a_only and 'only B' with p_b_only (the
  conditional-test power of Fagerland, Lydersen & Laake 2013, BMC Med Res Methodol 13:91).

  With p = p_a_only + p_b_only and q = p_a_only / p, the number of discordant pairs is
  D ~ Binomial(n, p) and, given D, the only-A count is Y ~ Binomial(D, q). The test rejects
  when min(Y, D - Y) <= c_D (c_D: the largest c with 2 P(Binomial(D, 1/2) <= c) <= alpha;
  c_D < D/2, so the two tails are disjoint):

    power = sum_D P(D) [P(Y <= c_D) + P(D - Y <= c_D)]

  The regions c_D are computed once per (n, alpha); pmfs in log space; values of D with
  P(D) < 1e-30 are skipped.
  """
  n = _count("n (pairs)", n)
  pa, pb = _prob("p_a_only", p_a_only), _prob("p_b_only", p_b_only)
  alpha = _open_unit("alpha", alpha)
  p = pa + pb
  if p > 1.0 + 1e-12:
    raise UserError(f"Invalid p_a_only + p_b_only = {p!r}: the two discordant shares are "
                    f"probabilities of disjoint outcomes, so their sum must be <= 1.")
  if n == 0 or p == 0.0:
    return 0.0
  p, q = min(p, 1.0), pa / p
  lf = _log_factorials(n)
  log_pd = _log_pmf(lf, n, np.arange(n + 1), p)
  keep = np.flatnonzero(log_pd > math.log(1e-30))
  d_idx, i_idx, offsets = _rejection_regions(n, alpha)
  sl = slice(offsets[keep[0]], offsets[keep[-1] + 1])
  d, i = d_idx[sl], i_idx[sl]
  lower = np.exp(log_pd[d] + _log_pmf(lf, d, i, q)).sum()
  upper = np.exp(log_pd[d] + _log_pmf(lf, d, i, 1.0 - q)).sum()
  return float(min(1.0, lower + upper))


def min_detectable_difference(n: int, discordance: float, alpha: float = 0.05,
                              power: float = 0.8) -> Optional[float]:
  """The smallest difference d = p_a_only - p_b_only, with p_a_only + p_b_only =
  `discordance` (the observed share of discordant pairs), that the exact two-sided McNemar
  test detects with probability >= `power` at n pairs:

    min { d in (0, discordance] : mcnemar_power(n, (s + d)/2, (s - d)/2, alpha) >= power }

  with s = discordance, found by bisection (power grows with d at fixed s) to 1e-6.
  None when even d = discordance (every discordant pair 'only A') is not detected with
  that power, or when discordance is 0. This is what docs/evals.md quotes when no preset
  differs significantly: "the smallest difference the sample could have detected at 80%
  power", as a difference of pass rates (A's minus B's, in shares of all n items).
  """
  n = _count("n (pairs)", n)
  s = _prob("discordance", discordance)
  alpha, power = _open_unit("alpha", alpha), _open_unit("power", power)

  def reaches(d):
    return mcnemar_power(n, (s + d) / 2, (s - d) / 2, alpha) >= power

  if s == 0.0 or not reaches(s):
    return None
  lo, hi = 0.0, s
  while hi - lo > 1e-6:
    mid = (lo + hi) / 2
    lo, hi = (lo, mid) if reaches(mid) else (mid, hi)
  return hi


# --- token sequences ------------------------------------------------------------------------

def first_divergence(tokens_a: Sequence[int], tokens_b: Sequence[int]) -> Optional[int]:
  """Index of the first position where two token sequences differ: min {i : a[i] != b[i]},
  a length difference counting as a divergence at the shorter length; None if identical.
  The evals report the median of this over items whose completions differ."""
  a, b = np.asarray(tokens_a), np.asarray(tokens_b)
  if a.ndim != 1 or b.ndim != 1:
    raise UserError(f"Invalid token sequences of shapes {a.shape} and {b.shape}: "
                    f"first_divergence compares two 1-D sequences of token ids.")
  m = min(len(a), len(b))
  diff = np.flatnonzero(a[:m] != b[:m])
  if diff.size:
    return int(diff[0])
  return None if len(a) == len(b) else m
