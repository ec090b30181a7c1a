"""The operations model scripts need, against numpy (and torch where installed): indexing by an integer array on one
axis (`W[ids]`, numpy's placement of the picked dimensions), gather (take_along_axis), tril/triu, masked_fill,
cumsum, one_hot, logsumexp and cross_entropy; their errors; and that a pick is a lookup, not a sweep over the table
(rules/one_hot.py turns the one-hot sum into a load)."""
import numpy as np
import pytest

from helpers import realize_and_check
from tensor import Tensor, dtypes, AxisError

rng = np.random.default_rng(21)
try:
  import torch
except ImportError:  # torch is optional: its comparisons are skipped
  torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


def randn(*shape): return rng.standard_normal(shape).astype(np.float32)


def test_embedding_lookup_by_tensor_array_and_list():
  W = randn(11, 5)
  ids = rng.integers(-11, 11, (3, 4))
  realize_and_check([
    (Tensor(W)[Tensor(ids)], W[ids]), (Tensor(W)[ids], W[ids]), (Tensor(W)[[0, 10, -1]], W[[0, 10, -1]]),
    (Tensor(W)[Tensor(ids.astype(np.int8))], W[ids]), (Tensor(W)[Tensor(3)], W[3]),
    (Tensor(W)[np.array([], dtype=np.int64)], W[np.array([], dtype=np.int64)]),
  ])


@pytest.mark.parametrize("index", [
  (0, slice(None), [1, 2]), (slice(None), 1, [0, 2]), ([1, 2], 0), (Ellipsis, [1, 0]), (None, [2, 0], None, 1),
  (0, None, [3]), (slice(1, None), [[0, 1], [2, 0]]), ([2, -1], slice(None, None, -2)), (1, [0, 3], slice(None)),
])
def test_one_array_among_basic_indices_places_its_dimensions_as_numpy(index):
  x = randn(3, 4, 5)
  realize_and_check([(Tensor(x)[index], x[index])])


def test_indexing_keeps_dtype_and_reads_through_views():
  b = rng.integers(0, 2, (6, 3)).astype(bool)
  i = rng.integers(-100, 100, (6, 3)).astype(np.int64)
  x = randn(6, 7)
  ids = np.array([5, 0, 2])
  realize_and_check([(Tensor(b)[ids], b[ids]), (Tensor(i)[ids], i[ids]), (Tensor(x).T[ids], x.T[ids]),
                     ((Tensor(x) * 2 + 1)[:, ids], (x * 2 + 1)[:, ids])])
  assert Tensor(b)[ids].dtype is dtypes.bool and Tensor(i)[ids].dtype is dtypes.int64


def test_computed_index_tensor():
  W = randn(9, 4)
  ids = Tensor(np.array([[1, 2], [3, 4]])) * 2 - 1   # lazy: realized once for the bounds check, then read
  realize_and_check([(Tensor(W)[ids], W[np.array([[1, 3], [5, 7]])])])


def test_bad_indices_raise():
  t = Tensor(randn(4, 3))
  with pytest.raises(IndexError, match="index 4 is out of bounds for an axis of size 4"): t[np.array([0, 4])]
  with pytest.raises(IndexError, match="index -5 is out of bounds"): t[Tensor([0, -5])]
  with pytest.raises(IndexError, match="out of bounds for an axis of size 3"): t[:, [3]]
  with pytest.raises(IndexError, match="must be an integer tensor, not float32"): t[Tensor([0.0])]
  with pytest.raises(IndexError, match="must be integers"): t[np.array([0.5])]
  with pytest.raises(IndexError, match="boolean masks"): t[np.array([True, False, True, False])]
  with pytest.raises(IndexError, match="more than one integer array"): t[[0, 1], [0, 1]]
  with pytest.raises(IndexError, match="too many indices"): t[0, 0, [0]]


def test_gather_is_take_along_axis():
  x = randn(3, 4, 5)
  i1 = rng.integers(-4, 4, (3, 6, 5))
  i2 = rng.integers(0, 5, (3, 1, 2))   # broadcasts over axis 1
  i0 = rng.integers(0, 3, (1, 4, 1))
  realize_and_check([
    (Tensor(x).gather(1, Tensor(i1)), np.take_along_axis(x, i1, 1)), (Tensor(x).gather(-1, i2), np.take_along_axis(x, i2, -1)),
    (Tensor(x).gather(0, i0), np.take_along_axis(x, i0, 0)),
  ])


@needs_torch
def test_gather_matches_torch():
  x, idx = randn(4, 7), rng.integers(0, 7, (4, 3))
  want = torch.gather(torch.tensor(x), 1, torch.tensor(idx)).numpy()
  realize_and_check([(Tensor(x).gather(1, Tensor(idx)), want)])


def test_gather_errors():
  t = Tensor(randn(3, 4))
  with pytest.raises(ValueError, match="needs 2 dimensions"): t.gather(1, np.array([0, 1]))
  with pytest.raises(ValueError, match="does not broadcast"): t.gather(1, np.zeros((2, 4), dtype=np.int64))
  with pytest.raises(IndexError, match="out of bounds"): t.gather(1, np.full((3, 1), 4))
  with pytest.raises(AxisError): t.gather(2, np.zeros((3, 1), dtype=np.int64))


def test_tril_triu():
  x, b = randn(2, 4, 6), rng.integers(0, 2, (5, 3)).astype(bool)
  pairs = [(Tensor(x).tril(k), np.tril(x, k)) for k in (-5, -1, 0, 2, 7)]
  pairs += [(Tensor(x).triu(k), np.triu(x, k)) for k in (-2, 0, 3)]
  pairs += [(Tensor(b).tril(), np.tril(b)), (Tensor.ones(4, 4).tril(), np.tril(np.ones((4, 4), np.float32)))]
  realize_and_check(pairs)
  with pytest.raises(ValueError, match="at least 2 dimensions"): Tensor(randn(3)).tril()
  with pytest.raises(TypeError, match="k must be an int"): Tensor(x).triu(0.5)


def test_masked_fill():
  x = randn(3, 4)
  m = rng.integers(0, 2, (1, 4)).astype(bool)
  i = rng.integers(-9, 9, (3, 4)).astype(np.int32)
  causal = ~np.tril(np.ones((3, 4), bool))
  realize_and_check([
    (Tensor(x).masked_fill(Tensor(m), -np.inf), np.where(m, -np.inf, x)), (Tensor(x).masked_fill(m, 2), np.where(m, 2, x)),
    (Tensor(i).masked_fill(Tensor(m), 7), np.where(m, 7, i)), (Tensor(x).masked_fill(causal, Tensor(0.5)), np.where(causal, 0.5, x)),
  ])
  assert Tensor(i).masked_fill(m, 7).dtype is dtypes.int32
  with pytest.raises(TypeError, match="must be a bool tensor"): Tensor(x).masked_fill(Tensor(i), 0)
  with pytest.raises(ValueError, match="does not broadcast"): Tensor(x).masked_fill(np.ones((3, 4, 1), bool), 0)
  with pytest.raises(TypeError, match="cast the tensor first"): Tensor(i).masked_fill(m, 0.5)
  with pytest.raises(OverflowError): Tensor(i.astype(np.int8)).masked_fill(m, 300)


def test_cumsum():
  x, i, b = randn(3, 5, 4), rng.integers(-9, 9, (4, 7)).astype(np.int32), rng.integers(0, 2, (6,)).astype(bool)
  realize_and_check([
    (Tensor(x).cumsum(1), np.cumsum(x, 1)), (Tensor(x).cumsum(-1), np.cumsum(x, -1)), (Tensor(x).cumsum(0), np.cumsum(x, 0)),
    (Tensor(x).cumsum(), np.cumsum(x)), (Tensor(i).cumsum(1), np.cumsum(i, 1)), (Tensor(b).cumsum(0), np.cumsum(b)),
    (Tensor(x[:, :0]).cumsum(1), np.cumsum(x[:, :0], 1)),
  ], rtol=1e-5, atol=1e-5)
  with pytest.raises(AxisError): Tensor(x).cumsum(3)


def test_one_hot():
  t = np.array([[0, 3], [2, 1]])
  realize_and_check([(Tensor(t).one_hot(4), np.eye(4, dtype=np.int32)[t]),
                     (Tensor(t).one_hot(5, dtype=dtypes.float32), np.eye(5, dtype=np.float32)[t])])
  with pytest.raises(IndexError, match="index 3 is out of bounds for an axis of size 3"): Tensor(t).one_hot(3)
  with pytest.raises(IndexError, match="index -1"): Tensor([-1]).one_hot(3)
  with pytest.raises(ValueError, match="an int >= 1"): Tensor(t).one_hot(0)


def test_logsumexp_keeps_infinite_rows():
  x = randn(3, 6) * 30
  x[1] = -np.inf
  with np.errstate(divide="ignore"): want = np.log(np.exp(x.astype(np.float64)).sum(-1))
  realize_and_check([(Tensor(x).logsumexp(-1), want.astype(np.float32)),
                     (Tensor(x).logsumexp(0, keepdim=True), np.log(np.exp(x.astype(np.float64)).sum(0, keepdims=True)))],
                    rtol=1e-5, atol=1e-5)


@needs_torch
@pytest.mark.parametrize("shape", [(7,), (5, 7), (2, 7, 3)])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_matches_torch(shape, reduction):
  logits = randn(*shape) * 3
  target = rng.integers(0, 7, shape[:1] + shape[2:] if len(shape) > 1 else ())
  if target.ndim: target.flat[0] = -100   # ignored
  want = torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(target), reduction=reduction).numpy()
  realize_and_check([(Tensor(logits).cross_entropy(Tensor(target), reduction=reduction), want),
                     (Tensor(logits).cross_entropy(target, reduction=reduction), want)], rtol=1e-5, atol=1e-5)


def test_cross_entropy_errors():
  logits = Tensor(randn(4, 3))
  with pytest.raises(ValueError, match=r"need targets of shape \(4,\)"): logits.cross_entropy(np.zeros((4, 1), np.int64))
  with pytest.raises(IndexError, match="index 3 is out of bounds"): logits.cross_entropy(np.array([0, 1, 2, 3]))
  with pytest.raises(IndexError, match="integer tensor"): logits.cross_entropy(Tensor([0.0, 1, 2, 0]))
  with pytest.raises(ValueError, match="reduction must be"): logits.cross_entropy(np.zeros(4, np.int64), reduction="avg")


def test_a_lookup_reads_its_rows_not_the_table():
  """W[ids] over a 5000-row table: the kernel has no loop over the rows (the one-hot sum became a load)."""
  W, ids = Tensor(randn(5000, 8)), Tensor(rng.integers(0, 5000, (2, 3)))
  out = W[ids]
  src = "\n".join(out.kernel_sources())
  assert "5000;" not in src.replace(" ", "") and "< 5000" not in src
  x, idx = randn(3, 5000), np.array([[4999], [0], [7]])
  picked = Tensor(x).gather(1, Tensor(idx))
  assert "< 5000" not in "\n".join(picked.kernel_sources())
  realize_and_check([(out, W.numpy()[ids.numpy()]), (picked, np.take_along_axis(x, idx, 1))])


def test_sums_that_only_look_one_hot_stay_sums():
  """A diagonal (the compared value is another loop's counter) is picked; a sum whose compared sides both hold the
  summed counter is not a pick and stays a sum."""
  x = randn(6, 6)
  r = Tensor.arange(6)
  diag = (r.reshape(6, 1) == r.reshape(1, 6)).where(Tensor(x), 0).sum(1)
  same = (r == r).where(Tensor(x[0]), 0).sum()
  shifted = (r.reshape(6, 1) == r.reshape(1, 6) + 1).where(Tensor(x), 0).sum(1)   # x[i, i-1], 0 for i = 0
  realize_and_check([(diag, np.diag(x)), (same, x[0].sum()), (shifted, np.r_[0, x[np.arange(1, 6), np.arange(5)]])])
