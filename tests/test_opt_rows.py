"""One-pass rows on the CPU (rules/opt/rows.py): a row's costly value (softmax's exp) is computed once into a local
row and read back by the sum and by the store; a row statistic read twice is lowered once (rules/lower.py)."""
import math
import numpy as np
from numpy.testing import assert_allclose
import pytest
from rewrite import Ops
from tensor import Tensor
from tests.opt_helpers import lowered, run_with

pytestmark = pytest.mark.usefixtures("on_cpu")

rng = np.random.default_rng(7)


def count(linear, op, arg=None): return sum(u.op is op and (arg is None or u.arg is arg) for u in linear.src)


def softmax_np(x):
  e = np.exp(x - x.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("shape", [(16, 40), (2, 16, 33), (2, 3, 16, 8)])
def test_softmax_computes_each_exp_once_into_a_local_row(shape):
  x = rng.standard_normal(shape, dtype=np.float32)
  t = (Tensor(x) / math.sqrt(8)).softmax(-1)
  linear, plan = lowered(t)
  # one max, one exp (in the fill loop), one local row; the sum and the store read it
  assert count(linear, Ops.REDUCE, Ops.MAX) == 1 and count(linear, Ops.EXP2) == 1
  (local,) = [u for u in linear.src if u.op is Ops.DEFINE_LOCAL]
  assert local.arg[1] == shape[-1]
  assert sum(u.op is Ops.LOAD and u.src[0].src[0].op is Ops.BARRIER for u in linear.src) == 2
  assert_allclose(run_with(t, *plan.opts), softmax_np(x / np.float32(math.sqrt(8))), rtol=1e-6, atol=1e-7)


def test_a_masked_row_and_infinities_stay_as_numpy_has_them():
  x = rng.standard_normal((16, 24), dtype=np.float32)
  x[0, :] = -np.inf
  x[1, 3] = np.inf
  x[2, 5] = np.nan
  t = Tensor(x).softmax(-1)
  linear, plan = lowered(t)
  assert count(linear, Ops.EXP2) == 1
  with np.errstate(invalid="ignore"): want = softmax_np(x)
  assert_allclose(run_with(t, *plan.opts), want, rtol=1e-6, atol=1e-7)


def test_rows_without_a_costly_value_or_read_once_are_left_alone():
  x = rng.standard_normal((16, 40), dtype=np.float32)
  for t, want in ((Tensor(x).layernorm(), (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5)),
                  (Tensor(x).log_softmax(-1), np.log(softmax_np(x)))):
    linear, plan = lowered(t)
    assert count(linear, Ops.DEFINE_LOCAL) == 0
    assert_allclose(run_with(t, *plan.opts), want, rtol=1e-5, atol=1e-5)


def test_a_row_statistic_broadcast_along_its_row_is_lowered_once():
  # max is read by the exp of the sum's pass and by the exp of the output's: one loop, not two (3-d: the view's
  # flat index would have needed a division and a modulo undone)
  q, k = rng.standard_normal((2, 16, 8), dtype=np.float32), rng.standard_normal((2, 16, 8), dtype=np.float32)
  s = (Tensor(q) @ Tensor(k).transpose(-1, -2)).contiguous().realize()
  linear, _ = lowered(s.softmax(-1))
  assert count(linear, Ops.REDUCE, Ops.MAX) == 1
