"""Reductions against numpy: sum, mean, max, min, var, std, argmax/argmin, any/all over every kind of axis argument,
with and without keepdim, on odd shapes, size-1 dims, 0-d tensors and non-contiguous views."""
import numpy as np
import pytest

from rewrite import Ops
from helpers import realize_and_check as check_all
from tensor import Tensor, dtypes, AxisError

rng = np.random.default_rng(1)
X = rng.standard_normal((3, 1, 5)).astype(np.float32)
Y = rng.standard_normal((4, 6)).astype(np.float32)          # used transposed: a non-contiguous view
I = rng.integers(-50, 50, (2, 7)).astype(np.int32)


def realize_and_check(pairs, rtol=1e-5, atol=1e-5):
  return check_all(pairs, rtol=rtol, atol=atol)


AXES = [None, 0, -1, (0, 2), (2, 0, 1), 1]


def test_sum_and_mean_over_every_axis_form():
  x = Tensor(X)
  pairs = []
  for axis in AXES:
    for keepdim in (False, True):
      pairs.append((x.sum(axis, keepdim=keepdim), X.sum(axis=axis, keepdims=keepdim)))
      pairs.append((x.mean(axis, keepdim=keepdim), X.mean(axis=axis, keepdims=keepdim)))
  realize_and_check(pairs)


def test_max_min_over_axes_and_views():
  x, yt = Tensor(X), Tensor(Y).T
  pairs = []
  for axis in (None, 0, (0, 2), -1):
    pairs += [(x.max(axis), X.max(axis=axis)), (x.min(axis, keepdim=True), X.min(axis=axis, keepdims=True))]
  pairs += [(yt.max(0), Y.T.max(0)), (yt.min(1), Y.T.min(1)), (yt.sum(1), Y.T.sum(1)), (yt[1:5:2].mean(), Y.T[1:5:2].mean())]
  realize_and_check(pairs)


def test_reductions_of_0d_and_size_1_tensors():
  s = Tensor(np.array(2.5, np.float32))
  one = Tensor(np.array([[4.0]], np.float32))
  realize_and_check([
    (s.sum(), 2.5), (s.max(), 2.5), (s.mean(), 2.5), (one.sum(), 4.0), (one.max(1), [4.0]), (one.mean(0, keepdim=True), [[4.0]]),
    (Tensor(3.0).sum(), 3.0),
  ])


def test_integer_and_bool_reductions():
  i, b = Tensor(I), Tensor(I > 0)
  assert i.sum().dtype is dtypes.int32 and b.sum().dtype is dtypes.int32 and i.mean().dtype is dtypes.float32
  assert Tensor(I.astype(np.int64)).sum().dtype is dtypes.int64 and Tensor(I.astype(np.uint8)).sum().dtype is dtypes.int32
  realize_and_check([
    (i.sum(), I.sum()), (i.sum(1), I.sum(1)), (b.sum(0), (I > 0).sum(0)), (i.mean(1), I.mean(1)),
    (i.max(1), I.max(1)), (i.min(), I.min()), (b.any(1), (I > 0).any(1)), (b.all(1), (I > 0).all(1)), (b.max(), True),
    (Tensor(I.astype(np.uint8)).min(1), I.astype(np.uint8).min(1)), (Tensor(I.astype(np.int8)).sum(), I.sum()),
  ], rtol=1e-6, atol=0)


def test_float16_sums_accumulate_in_float32():
  h = np.full(4096, 0.1, np.float16)  # a float16 accumulator would stall near 256 (its spacing there is 0.25)
  t = Tensor(h)
  assert t.sum().dtype is dtypes.float16
  realize_and_check([(t.sum(), np.float16(h.astype(np.float32).sum())), (t.mean(), np.float16(0.1))], rtol=1e-3)


def test_var_and_std():
  x, yt = Tensor(X), Tensor(Y).T
  realize_and_check([
    (x.var(), X.var(ddof=1)), (x.var(2), X.var(axis=2, ddof=1)), (x.var((0, 2), correction=0), X.var(axis=(0, 2))),
    (x.std(0, keepdim=True), X.std(axis=0, ddof=1, keepdims=True)), (yt.std(1, correction=0), Y.T.std(1)),
    (Tensor(I).var(1), I.var(1, ddof=1)),
  ])
  realize_and_check([(x.var(1), np.full((3, 5), np.nan))])  # one sample, correction 1: 0/0 is NaN, as in numpy


def test_argmax_argmin_take_the_first_extreme():
  z = np.array([[1, 5, 5, -2], [7, 7, 0, 7], [-1, -3, -3, 2]], np.float32)
  t = Tensor(z)
  assert t.argmax(1).dtype is dtypes.int32
  realize_and_check([
    (t.argmax(), z.argmax()), (t.argmax(1), z.argmax(1)), (t.argmax(0), z.argmax(0)), (t.argmin(1), z.argmin(1)),
    (t.argmax(-1, keepdim=True), z.argmax(-1, keepdims=True)), (t.T.argmax(1), z.T.argmax(1)),
    (Tensor(I).argmin(0), I.argmin(0)), (Tensor(X).argmax(2), X.argmax(2)),
  ], rtol=0, atol=0)

def test_argmax_argmin_return_the_first_nan_like_numpy():
  nan, inf = np.nan, np.inf
  rows = [[1., nan, 2.], [nan, nan, 0.], [5., 4., nan], [inf, 1., inf], [-inf, -inf, 3.], [2., 2., 2.]]
  z = np.array(rows, np.float32)
  t = Tensor(z)
  assert Tensor(np.array([1., nan, 2.], np.float32)).argmax().item() == 1
  assert Tensor(np.array([nan, nan], np.float32)).argmin().item() == 0
  realize_and_check([
    (t.argmax(1), z.argmax(1)), (t.argmin(1), z.argmin(1)), (t.argmax(0), z.argmax(0)), (t.argmin(0), z.argmin(0)),
    (t.argmax(), z.argmax()), (t.argmin(), z.argmin()), (t.T.argmax(0), z.T.argmax(0)),
    (Tensor(z.astype(np.float16)).argmin(1), z.argmin(1)), (Tensor(z.astype(np.float64)).argmax(1), z.argmax(1)),
  ], rtol=0, atol=0)


def test_a_sum_is_one_reduce_axis():
  r = Tensor(Y).sum(1)
  reduces = [u for u in r.uop.toposort if u.op is Ops.REDUCE_AXIS]
  assert len(reduces) == 1 and reduces[0].arg == (Ops.ADD, (1,))
  assert Tensor(Y).max(0, keepdim=True).uop.arg == (Ops.MAX, (0,))  # keepdim: the reduce itself, no reshape


def test_bad_axes_raise():
  x = Tensor(X)
  with pytest.raises(AxisError, match=r"axis 3 .*\(3, 1, 5\)"): x.sum(3)
  with pytest.raises(IndexError): x.max(-4)
  with pytest.raises(ValueError, match="repeats"): x.sum((0, -3))
  with pytest.raises(TypeError): x.sum(1.5)
  with pytest.raises(ValueError): Tensor(2.0).sum(0)
  with pytest.raises(TypeError): x.argmax((0, 1))
