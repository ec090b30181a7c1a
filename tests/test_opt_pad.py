"""opt_pad: a pad record lengthens an output loop to a multiple of a tile; the extra iterations redo the last one."""
import numpy as np
import pytest
from numpy.testing import assert_allclose
from rewrite import Ops
from tensor import Tensor
from rules.opt import Opt, OptKind, InvalidPlan
from tests.opt_helpers import lowered, run_with, loops

pytestmark = pytest.mark.usefixtures("on_cpu")   # the CPU's optimization vocabulary, whatever DEVICE says

rng = np.random.default_rng(4)
a, b = rng.standard_normal((10, 12), dtype=np.float32), rng.standard_normal((12, 8), dtype=np.float32)


def test_pad_rows_to_a_multiple_of_the_tile_then_unroll_it():
  t = Tensor(a) @ Tensor(b)
  plan = (Opt(OptKind.PAD, 0, 4), Opt(OptKind.UPCAST, 0, 4))
  linear, _ = lowered(t, *plan)
  assert [n for n, _ in loops(linear)] == [3, 8, 12]   # 10 rows run as 3 tiles of 4: the last has 2 past the end
  assert sum(u.op is Ops.DEFINE_ACC for u in linear.src) == 4
  assert any(u.op is Ops.MAX for u in linear.src)       # the row index is clamped to the last row
  assert_allclose(run_with(t, *plan), a @ b, rtol=1e-5, atol=1e-5)


def test_a_loop_that_the_tile_divides_is_not_padded():
  t = Tensor(a) * 2
  linear, _ = lowered(t, Opt(OptKind.PAD, 1, 6), Opt(OptKind.SPLIT, 1, 6))
  assert [n for n, _ in loops(linear)] == [10, 2, 6] and not any(u.op is Ops.MAX for u in linear.src)
  assert_allclose(run_with(t, Opt(OptKind.PAD, 1, 6), Opt(OptKind.SPLIT, 1, 6)), a * 2)


def test_pad_a_parallel_elementwise_loop():
  t = (Tensor(a) + 1).relu()
  plan = (Opt(OptKind.PAD, 0, 3), Opt(OptKind.SPLIT, 0, 3), Opt(OptKind.PARALLEL, 0))
  assert [n for n, _ in loops(lowered(t, *plan)[0])] == [4, 12, 3]
  assert_allclose(run_with(t, *plan), np.maximum(a + 1, 0))


def test_a_reduction_loop_is_not_padded():
  with pytest.raises(InvalidPlan, match="names a reduction loop"): run_with(Tensor(a).sum(axis=1), Opt(OptKind.PAD, 1, 5))
