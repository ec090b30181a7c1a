"""opt_loops: interchange, parallel and simd records mark the loops that remain."""
import numpy as np
import pytest
from numpy.testing import assert_allclose
from tensor import Tensor
from rules.opt import Opt, OptKind
from tests.opt_helpers import lowered, run_with, loops

pytestmark = pytest.mark.usefixtures("on_cpu")   # the CPU's optimization vocabulary, whatever DEVICE says

rng = np.random.default_rng(3)
a = rng.standard_normal((6, 10, 4), dtype=np.float32)


def test_interchange_moves_a_loop_outermost():
  t = Tensor(a) * 2
  linear, _ = lowered(t, Opt(OptKind.INTERCHANGE, 2))
  assert [n for n, _ in loops(linear)] == [4, 6, 10]
  assert_allclose(run_with(t, Opt(OptKind.INTERCHANGE, 2)), a * 2)


def test_interchange_of_reduction_loops_reorders_their_nest():
  t = Tensor(a).sum(axis=(1, 2))
  linear, _ = lowered(t, Opt(OptKind.INTERCHANGE, 2))
  assert [n for n, _ in loops(linear)] == [6, 4, 10]
  assert_allclose(run_with(t, Opt(OptKind.INTERCHANGE, 2)), a.sum(axis=(1, 2)), rtol=1e-5)


def test_parallel_marks_the_loop_and_the_c_source_runs_it_with_openmp():
  t = Tensor(a) + 1
  linear, _ = lowered(t, Opt(OptKind.PARALLEL, 0))
  assert loops(linear)[0] == (6, "parallel")
  assert_allclose(run_with(t, Opt(OptKind.PARALLEL, 0)), a + 1)


def test_a_parallel_loop_is_dealt_to_threads_in_chunks_as_they_come_free():
  # a thread that has its core takes what a late or descheduled one has not reached; up to 64 chunks a loop
  from runtime.device import get_device
  src = lambda t: get_device("CPU").renderer.render("k", lowered(t, Opt(OptKind.PARALLEL, 0))[0])
  assert "#pragma omp for schedule(dynamic, 1) nowait\n" in src(Tensor(a) + 1)   # 6 trips: one chunk each
  big = rng.standard_normal((1000, 64), dtype=np.float32)
  assert "#pragma omp for schedule(dynamic, 16) nowait\n" in src(Tensor(big) + 1)   # 1000 trips: 63 chunks of 16
  assert_allclose(run_with(Tensor(big) + 1, Opt(OptKind.PARALLEL, 0)), big + 1)


def test_simd_marks_the_innermost_reduction_loop():
  t = Tensor(a).max(axis=2)
  linear, _ = lowered(t, Opt(OptKind.SIMD, 2))
  assert loops(linear)[-1] == (4, "simd")
  assert_allclose(run_with(t, Opt(OptKind.SIMD, 2)), a.max(axis=2))
