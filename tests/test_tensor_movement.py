"""Movement against numpy: reshape, permute, transpose, expand, pad, shrink, indexing, flip, squeeze, unsqueeze,
flatten, cat, stack and repeat; that they are views (no copies, merged into one VIEW where one View can say it);
and the errors of bad shapes, axes and indices."""
import numpy as np
import pytest
from numpy.testing import assert_allclose

from rewrite import Ops
from helpers import realize_and_check as check_all
from tensor import Tensor, dtypes

X = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) - 7.5
M = np.arange(5 * 6, dtype=np.int32).reshape(5, 6)


def realize_and_check(pairs):
  """Exactly: movement moves values, it never computes them."""
  return check_all(pairs, rtol=0, atol=0)


def test_reshape_permute_transpose_expand():
  x = Tensor(X)
  realize_and_check([
    (x.reshape(6, 4), X.reshape(6, 4)), (x.reshape((4, -1)), X.reshape(4, -1)), (x.reshape(-1), X.reshape(-1)),
    (x.permute(2, 0, 1), X.transpose(2, 0, 1)), (x.permute((1, -1, 0)), X.transpose(1, 2, 0)),
    (x.transpose(), X.swapaxes(-2, -1)), (x.transpose(0, 2), X.swapaxes(0, 2)), (x.T, X.T),
    (x.permute(2, 1, 0).reshape(4, 6), X.transpose(2, 1, 0).reshape(4, 6)),  # not one View: a stacked VIEW
    (x[:, :1].expand(2, 5, 4), np.broadcast_to(X[:, :1], (2, 5, 4))), (x.expand(3, -1, -1, -1), np.broadcast_to(X, (3, 2, 3, 4))),
    (Tensor(2.0).reshape(1, 1), [[2.0]]), (Tensor(M)[1:3].reshape(12), M[1:3].reshape(12)),
  ])


def test_movements_are_views_merged_into_one():
  x = Tensor(X)
  for t in (x.reshape(6, 4), x.permute(2, 0, 1), x.T[1:, ::2], x.flip(1).expand(2, 2, 3, 4), x.pad(((1, 0), None, None))):
    assert t.uop.op is Ops.VIEW and t.uop.src[0].op is Ops.BUFFER  # one VIEW straight on the buffer: no copy
  stacked = x.permute(2, 1, 0).reshape(4, 6)
  assert stacked.uop.op is Ops.VIEW and stacked.uop.src[0].op is Ops.VIEW  # a reshape no single View can say
  assert x.reshape(2, 3, 4) is x and x.permute(0, 1, 2) is x and x[...] is x
  y = (x + 1).reshape(6, 4).reshape(2, 3, 4)
  assert y.uop.op is Ops.ADD  # a VIEW that reads its computed source as it is goes away


def test_pad_and_shrink():
  x = Tensor(X)
  m = Tensor(M)
  realize_and_check([
    (x.pad(((1, 0), (0, 2), (1, 1))), np.pad(X, ((1, 0), (0, 2), (1, 1)))),
    (x.pad((None, (1, 1), None), value=-1.5), np.pad(X, ((0, 0), (1, 1), (0, 0)), constant_values=-1.5)),
    (m.pad(((2, 1), (0, 3)), value=7), np.pad(M, ((2, 1), (0, 3)), constant_values=7)),
    (m.T.pad(((1, 1), (1, 1)), value=-1), np.pad(M.T, 1, constant_values=-1)),
    (x.shrink(((0, 1), (1, 3), (0, 4))), X[0:1, 1:3, 0:4]), (m.shrink((None, (2, 5))), M[:, 2:5]),
    (m.pad(((1, 1), (1, 1))).shrink(((1, 6), (1, 7))), M), (Tensor([True, False]).pad(((1, 1),)), [False, True, False, False]),
  ])
  assert x.pad(((1, 0), None, None), value=np.inf).dtype is dtypes.float32


def test_basic_indexing_like_numpy():
  x, m = Tensor(X), Tensor(M)
  cases = [
    (x[1], X[1]), (x[-1, 2], X[-1, 2]), (x[0, 1, 2], X[0, 1, 2]), (x[:, 1:], X[:, 1:]), (x[..., ::2], X[..., ::2]),
    (x[:, ::-1], X[:, ::-1]), (x[::-1, 2:0:-1, ::-3], X[::-1, 2:0:-1, ::-3]), (x[None, 1, None, :, -1], X[None, 1, None, :, -1]),
    (x[..., None], X[..., None]), (x[1, ...], X[1, ...]), (x[:, 1:2], X[:, 1:2]),
    (m[1:5:2, ::4], M[1:5:2, ::4]), (m[::2, 1::3], M[::2, 1::3]), (m[-2:, -3], M[-2:, -3]), (m[4:0:-2], M[4:0:-2]),
    (m.T[::-2, 1:4], M.T[::-2, 1:4]), (m[1:4].T[::2], M[1:4].T[::2]),
    (m.pad(((1, 1), (1, 1)), value=-1)[::3, ::2], np.pad(M, 1, constant_values=-1)[::3, ::2]),  # steps through a padded view
    (Tensor(3.5)[None], [3.5]), (x[np.int64(1), np.int32(-1)], X[1, -1]),
    (x[:, 0:0], X[:, 0:0]), (x[1, 2:2, None], X[1, 2:2, None]), (x[()], X[()]), (x[1:2, ::-1][0], X[1:2, ::-1][0]),
  ]
  lazy = x * 1   # (indexing a computed tensor: one VIEW over it)
  cases += [(lazy[1, ::-2], X[1, ::-2]), (lazy[None, :, 3:0:-1, -1], X[None, :, 3:0:-1, -1]), (lazy[::-1, 0:0], X[::-1, 0:0]),
            (lazy[..., None, 1], X[..., None, 1])]
  realize_and_check(cases)
  assert x[0, 1, 2].shape == () and m[1:5:2, ::4].uop.src[0].op is Ops.BUFFER


def test_flip_squeeze_unsqueeze_flatten():
  x = Tensor(X)
  y = Tensor(X[:, :1, :, None])  # (2, 1, 4, 1)
  realize_and_check([
    (x.flip(0), np.flip(X, 0)), (x.flip((0, 2)), np.flip(X, (0, 2))), (x.flip(), np.flip(X)), (x.flip(-1), X[..., ::-1]),
    (y.squeeze(), X[:, 0, :]), (y.squeeze(1), X[:, 0, :, None]), (y.squeeze((1, -1)), X[:, 0, :]),
    (x.unsqueeze(0), X[None]), (x.unsqueeze(-1), X[..., None]), (x.unsqueeze(2), X[:, :, None]),
    (x.flatten(), X.reshape(-1)), (x.flatten(1), X.reshape(2, 12)), (x.flatten(0, 1), X.reshape(6, 4)),
    (x.T.flatten(), X.T.reshape(-1)), (Tensor(1.5).flatten(), [1.5]),
  ])


def test_cat_stack_repeat():
  a, b = Tensor(X), Tensor(X[:, :2] * 2)
  i, j = Tensor(M[:2]), Tensor(M[2:3].astype(np.int8))
  realize_and_check([
    (a.cat(b, axis=1), np.concatenate([X, X[:, :2] * 2], 1)), (Tensor.cat(a, a, a, axis=-1), np.concatenate([X] * 3, -1)),
    (Tensor.cat(i, j), np.concatenate([M[:2], M[2:3]])), (a.T.cat(a.T), np.concatenate([X.T, X.T])),
    (Tensor.stack(a, a * 2), np.stack([X, X * 2])), (Tensor.stack(i, i, axis=-1), np.stack([M[:2]] * 2, -1)),
    (Tensor.stack(Tensor(1.0), Tensor(2.0)), [1.0, 2.0]), (i.repeat(2, 3), np.tile(M[:2], (2, 3))),
    (Tensor([True]).cat(Tensor([False, True])), [True, False, True]),
  ])
  assert Tensor.cat(i, j).dtype is dtypes.int32


def test_bad_movements_raise():
  x = Tensor(X)
  with pytest.raises(ValueError, match=r"\(2, 3, 4\).*\(5, 5\)"): x.reshape(5, 5)
  with pytest.raises(ValueError, match="-1"): x.reshape(-1, -1)
  with pytest.raises(ValueError, match=r"\(7, -1\)"): x.reshape(7, -1)
  with pytest.raises(ValueError, match=r"permute\(0, 0, 1\)"): x.permute(0, 0, 1)
  with pytest.raises(ValueError, match="permute"): x.permute(0, 1)
  with pytest.raises(ValueError, match=r"\(2, 3, 4\) to \(2, 5, 4\)"): x.expand(2, 5, 4)
  with pytest.raises(ValueError, match="fewer"): x.expand(3, 4)
  with pytest.raises(ValueError, match="pair"): x.pad(((1, 1),))
  with pytest.raises(ValueError, match=">= 0"): x.pad(((0, 0), (-1, 0), (0, 0)))
  with pytest.raises(ValueError, match="start <= end"): x.shrink(((0, 3), None, None))
  with pytest.raises(IndexError, match="index 3 is out of bounds for axis 1 with size 3"): x[0, 3]
  with pytest.raises(IndexError, match="too many indices"): x[0, 0, 0, 0]
  with pytest.raises(IndexError, match="ellipsis"): x[..., ...]
  with pytest.raises(IndexError, match="more than one integer array"): x[[0, 1], [0, 1]]
  with pytest.raises(TypeError): x[1.5]
  with pytest.raises(ValueError, match="size-1"): x.squeeze(0)
  with pytest.raises(IndexError): x.unsqueeze(4)
  with pytest.raises(IndexError): x.flip(3)
  with pytest.raises(IndexError): x.transpose(0, 3)
  with pytest.raises(ValueError, match=r"\(2, 3, 4\), \(2, 2, 3\)"): x.cat(Tensor.ones(2, 2, 3), axis=1)
  with pytest.raises(ValueError, match="0-d"): Tensor(1.0).cat(Tensor(2.0))
  with pytest.raises(ValueError, match="differ"): Tensor.stack(x, x[0])
