"""opt_upcast: an upcast loop part is unrolled into copies that share what does not depend on it."""
import numpy as np
import pytest
from numpy.testing import assert_allclose
from rewrite import Ops
from tensor import Tensor
from rules.opt import Opt, OptKind
from tests.opt_helpers import lowered, run_with, loops

pytestmark = pytest.mark.usefixtures("on_cpu")   # the CPU's optimization vocabulary, whatever DEVICE says

rng = np.random.default_rng(1)
a, b = rng.standard_normal((8, 12), dtype=np.float32), rng.standard_normal((12, 10), dtype=np.float32)


def test_upcast_output_rows_makes_a_tile_of_accumulators_sharing_loads():
  t = Tensor(a) @ Tensor(b)
  linear, _ = lowered(t, Opt(OptKind.UPCAST, 0, 4))
  assert [n for n, _ in loops(linear)] == [2, 10, 12]       # 4 rows per iteration, one shared reduction loop
  assert sum(u.op is Ops.DEFINE_ACC for u in linear.src) == 4
  b_loads = [u for u in linear.src if u.op is Ops.LOAD and u.src[0].src[0].arg == 2]
  assert len(b_loads) == 1                                   # B does not depend on the row: loaded once for 4 rows
  assert_allclose(run_with(t, Opt(OptKind.UPCAST, 0, 4)), a @ b, rtol=1e-5, atol=1e-5)


def test_upcast_a_reduction_loop_unrolls_it():
  t = Tensor(a).sum(axis=1)
  linear, _ = lowered(t, Opt(OptKind.UPCAST, 1, 3))
  assert [n for n, _ in loops(linear)] == [8, 4]
  assert_allclose(run_with(t, Opt(OptKind.UPCAST, 1, 3)), a.sum(axis=1), rtol=1e-5, atol=1e-6)


def test_upcast_a_whole_loop_leaves_no_loop():
  t = Tensor(a).max(axis=1)
  linear, _ = lowered(t, Opt(OptKind.UPCAST, 1, 12))
  assert [n for n, _ in loops(linear)] == [8]
  assert_allclose(run_with(t, Opt(OptKind.UPCAST, 1, 12)), a.max(axis=1))
