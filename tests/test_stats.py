"""The evals' statistics (`attnprec.stats`) against independent values: published
Wilson intervals (Newcombe 1998), scipy's binomial test and Wilson interval, brute-force
enumeration and Monte Carlo simulation of the McNemar test's power; and bad arguments."""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats as sps

from attnprec.errors import UserError
from attnprec import stats


# --- Wilson ---------------------------------------------------------------------------------

# Newcombe (1998), Stat Med 17:857-872, Table I, method 3 (Wilson score, no continuity
# correction), 95%: (k, n, lower, upper) to four decimals.
NEWCOMBE = [(81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611),
            (1, 29, 0.0061, 0.1718)]


@pytest.mark.parametrize("k,n,lo,hi", NEWCOMBE)
def test_wilson_published_examples(k, n, lo, hi):
  got = stats.wilson(k, n)
  assert round(got[0], 4) == lo and round(got[1], 4) == hi


def test_wilson_matches_scipy():
  for n in (1, 2, 7, 30, 164, 1000):
    for k in sorted({0, 1, n // 3, n // 2, n - 1, n}):
      ci = sps.binomtest(k, n).proportion_ci(confidence_level=0.95, method="wilson")
      lo, hi = stats.wilson(k, n, z=sps.norm.ppf(0.975))
      assert lo == pytest.approx(ci.low, abs=1e-12) and hi == pytest.approx(ci.high, abs=1e-12)


def test_wilson_no_items_and_other_levels():
  assert stats.wilson(0, 0) == (0.0, 1.0)
  lo90, hi90 = stats.wilson(30, 100, z=1.645)
  lo95, hi95 = stats.wilson(30, 100)
  assert lo95 < lo90 < 0.3 < hi90 < hi95


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 10_000).flatmap(lambda n: st.tuples(st.integers(0, n), st.just(n))))
def test_wilson_contains_estimate_inside_unit_interval(kn):
  k, n = kn
  lo, hi = stats.wilson(k, n)
  assert 0.0 <= lo <= k / n <= hi <= 1.0


# --- paired table and exact McNemar ---------------------------------------------------------

def test_paired_table():
  a = [True, True, False, False, True, False, True]
  b = [True, False, True, False, False, False, True]
  t = stats.paired_table(a, b)
  assert t == stats.PairedTable(both=2, only_a=2, only_b=1, neither=2)
  assert (t.n, t.discordant) == (7, 3)
  assert stats.paired_table(np.array([1, 0]), np.array([0, 0])).only_a == 1
  with pytest.raises(Exception):
    t.both = 3                                                   # frozen
  with pytest.raises(UserError, match="lengths must match"):
    stats.paired_table([True, False], [True])
  with pytest.raises(UserError, match="only_b"):
    stats.PairedTable(1, 2, -1, 0)


def test_scipy_two_sided_is_twice_the_smaller_tail():
  """The reference: for p = 1/2 scipy's two-sided binomtest is min(1, 2 * smaller tail)."""
  for d in range(1, 60):
    for k in range(d + 1):
      two_tails = min(1.0, 2 * sps.binom.cdf(min(k, d - k), d, 0.5))
      assert sps.binomtest(k, d, 0.5).pvalue == pytest.approx(two_tails, rel=1e-12, abs=1e-300)


def test_mcnemar_exact_matches_scipy():
  pairs = list(itertools.product(range(0, 41, 3), range(0, 41, 4)))
  pairs += [(100, 130), (130, 100), (0, 1), (1, 0), (5, 5), (700, 800), (1500, 1580)]
  for a, b in pairs:
    if a + b == 0:
      continue
    want = sps.binomtest(a, a + b, 0.5, alternative="two-sided").pvalue
    assert stats.mcnemar_exact(a, b) == pytest.approx(want, rel=1e-10, abs=1e-300)


def test_mcnemar_exact_edges():
  assert stats.mcnemar_exact(0, 0) == 1.0
  assert stats.mcnemar_exact(7, 7) == 1.0
  assert stats.mcnemar_exact(0, 7) == 2 / 2 ** 7
  assert stats.mcnemar_exact(0, 5000) == 0.0                    # underflows, no error


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 400), st.integers(0, 400))
def test_mcnemar_exact_symmetric_and_a_probability(a, b):
  p = stats.mcnemar_exact(a, b)
  assert p == stats.mcnemar_exact(b, a) and 0.0 <= p <= 1.0


# --- power ----------------------------------------------------------------------------------

def _power_by_enumeration(n, pa, pb, alpha):
  """Sum of the trinomial probabilities of every (only A, only B, rest) outcome that the
  exact test rejects."""
  total = 0.0
  for a in range(n + 1):
    for b in range(n + 1 - a):
      if stats.mcnemar_exact(a, b) <= alpha:
        total += (math.factorial(n) / (math.factorial(a) * math.factorial(b)
                                       * math.factorial(n - a - b))
                  * pa ** a * pb ** b * (1 - pa - pb) ** (n - a - b))
  return total


@pytest.mark.parametrize("n,pa,pb,alpha", [(12, 0.3, 0.1, 0.05), (20, 0.25, 0.05, 0.05),
                                           (25, 0.2, 0.2, 0.1), (18, 0.5, 0.0, 0.05),
                                           (30, 0.1, 0.35, 0.01),
                                           (15, 0.3, 0.2, 0.125), (16, 0.2, 0.3, 0.25)])
def test_power_matches_enumeration(n, pa, pb, alpha):
  """(alpha = 1/8 and 1/4 are attained p-values, 2 / 2^D: the rejection includes them.)"""
  assert stats.mcnemar_power(n, pa, pb, alpha) == pytest.approx(
      _power_by_enumeration(n, pa, pb, alpha), rel=1e-9, abs=1e-12)


def _power_by_scipy(n, pa, pb, alpha):
  """The same sum over D, with scipy's binomial distribution and critical values."""
  p, q = pa + pb, pa / (pa + pb)
  total = 0.0
  for d in range(1, n + 1):
    c = np.arange(d // 2 + 1)
    ok = c[2 * sps.binom.cdf(c, d, 0.5) <= alpha]
    if ok.size:
      c = ok[-1]
      tails = sps.binom.cdf(c, d, q) + sps.binom.sf(d - c - 1, d, q)
      total += sps.binom.pmf(d, n, p) * tails
  return total


def test_power_matches_scipy_sum():
  assert stats.mcnemar_power(300, 0.08, 0.04) == pytest.approx(
      _power_by_scipy(300, 0.08, 0.04, 0.05), rel=1e-9)


@pytest.mark.parametrize("n,pa,pb", [(200, 0.10, 0.04), (164, 0.06, 0.06)])
def test_power_matches_simulation(n, pa, pb):
  draws = 20_000
  counts = np.random.default_rng(0).multinomial(n, [pa, pb, 1 - pa - pb], size=draws)
  a, b = counts[:, 0], counts[:, 1]
  p = np.minimum(1.0, 2 * sps.binom.cdf(np.minimum(a, b), a + b, 0.5))
  p[a + b == 0] = 1.0
  sim = float(np.mean(p <= 0.05))
  exact = stats.mcnemar_power(n, pa, pb)
  se = math.sqrt(max(exact * (1 - exact), 1e-4) / draws)
  assert abs(sim - exact) < 3 * se


def test_power_edges_and_speed():
  assert stats.mcnemar_power(0, 0.1, 0.1) == 0.0
  assert stats.mcnemar_power(500, 0.0, 0.0) == 0.0
  assert stats.mcnemar_power(500, 0.05, 0.05) <= 0.05           # exact test: level <= alpha
  assert stats.mcnemar_power(500, 1.0, 0.0) == pytest.approx(1.0)
  assert stats.mcnemar_power(3000, 0.03, 0.02) == pytest.approx(
      stats.mcnemar_power(3000, 0.02, 0.03))
  powers = [stats.mcnemar_power(400, 0.05 + d, 0.05 - d) for d in (0.0, 0.01, 0.02, 0.04)]
  assert powers == sorted(powers)


@pytest.mark.parametrize("n,s", [(164, 0.10), (1000, 0.05), (50, 0.4)])
def test_min_detectable_difference(n, s):
  d = stats.min_detectable_difference(n, s)
  assert 0 < d <= s
  assert stats.mcnemar_power(n, (s + d) / 2, (s - d) / 2) >= 0.8
  smaller = d - 1e-3
  assert stats.mcnemar_power(n, (s + smaller) / 2, (s - smaller) / 2) < 0.8


def test_min_detectable_difference_unreachable():
  assert stats.min_detectable_difference(10, 0.1) is None       # ~1 discordant pair
  assert stats.min_detectable_difference(100, 0.0) is None


# --- first divergence ------------------------------------------------------------------------

def test_first_divergence():
  assert stats.first_divergence([1, 2, 3], [1, 2, 3]) is None
  assert stats.first_divergence([], []) is None
  assert stats.first_divergence([1, 2, 3], [1, 5, 3]) == 1
  assert stats.first_divergence([9], [1]) == 0
  assert stats.first_divergence([1, 2], [1, 2, 3]) == 2
  assert stats.first_divergence(np.array([1, 2, 3, 4]), [1, 2]) == 2
  with pytest.raises(UserError, match="1-D"):
    stats.first_divergence([[1, 2]], [1, 2])


# --- bad arguments ---------------------------------------------------------------------------

@pytest.mark.parametrize("call,name", [
    (lambda: stats.wilson(-1, 5), "k"),
    (lambda: stats.wilson(6, 5), "cannot exceed"),
    (lambda: stats.wilson(1.5, 3), "k"),
    (lambda: stats.wilson(1, -3), "n"),
    (lambda: stats.wilson(1, 3, z=0), "z"),
    (lambda: stats.mcnemar_exact(-1, 2), "only_a"),
    (lambda: stats.mcnemar_exact(1, True), "only_b"),
    (lambda: stats.mcnemar_power(-5, 0.1, 0.1), "n"),
    (lambda: stats.mcnemar_power(10, 1.2, 0.0), "p_a_only"),
    (lambda: stats.mcnemar_power(10, 0.1, -0.1), "p_b_only"),
    (lambda: stats.mcnemar_power(10, 0.6, 0.6), "sum must be <= 1"),
    (lambda: stats.mcnemar_power(10, 0.1, float("nan")), "p_b_only"),
    (lambda: stats.mcnemar_power(10, 0.1, 0.1, alpha=0.0), "alpha"),
    (lambda: stats.mcnemar_power(10, 0.1, 0.1, alpha=1.0), "alpha"),
    (lambda: stats.min_detectable_difference(10, 1.5), "discordance"),
    (lambda: stats.min_detectable_difference(10, 0.1, power=1.0), "power"),
    (lambda: stats.min_detectable_difference(10, 0.1, alpha=-0.05), "alpha"),
])
def test_bad_arguments(call, name):
  with pytest.raises(UserError, match=name) as e:
    call()
  assert "\n" not in str(e.value)
