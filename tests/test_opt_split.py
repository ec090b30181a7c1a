"""opt_split: a loop split by a `split` record becomes an outer loop and an inner tile loop nested inside the rest."""
import numpy as np
import pytest
from numpy.testing import assert_allclose
from tensor import Tensor
from rules.opt import Opt, OptKind
from tests.opt_helpers import lowered, run_with, loops

pytestmark = pytest.mark.usefixtures("on_cpu")   # the CPU's optimization vocabulary, whatever DEVICE says

rng = np.random.default_rng(0)
a = rng.standard_normal((16, 24), dtype=np.float32)


def test_split_one_loop_into_outer_and_inner():
  t = Tensor(a) * 2
  linear, plan = lowered(t, Opt(OptKind.SPLIT, 1, 8))
  assert [n for n, _ in loops(linear)] == [16, 3, 8]
  assert_allclose(run_with(t, Opt(OptKind.SPLIT, 1, 8)), a * 2)


def test_split_two_loops_is_a_tiling():
  t = Tensor(a) + 1
  linear, _ = lowered(t, Opt(OptKind.SPLIT, 0, 4), Opt(OptKind.SPLIT, 1, 8))
  assert [n for n, _ in loops(linear)] == [4, 3, 4, 8]   # rows, columns, then the tile's rows and columns
  assert_allclose(run_with(t, Opt(OptKind.SPLIT, 0, 4), Opt(OptKind.SPLIT, 1, 8)), a + 1)


def test_split_a_reduction_loop():
  t = Tensor(a).sum(axis=1)
  linear, _ = lowered(t, Opt(OptKind.SPLIT, 1, 6))
  assert [n for n, _ in loops(linear)] == [16, 4, 6]
  assert_allclose(run_with(t, Opt(OptKind.SPLIT, 1, 6)), a.sum(axis=1), rtol=1e-5)


def test_split_twice_takes_the_next_inner_factor():
  t = Tensor(a) * 3
  linear, _ = lowered(t, Opt(OptKind.SPLIT, 1, 2), Opt(OptKind.SPLIT, 1, 3))
  assert sorted(n for n, _ in loops(linear)) == [2, 3, 4, 16]
  assert_allclose(run_with(t, Opt(OptKind.SPLIT, 1, 2), Opt(OptKind.SPLIT, 1, 3)), a * 3)
