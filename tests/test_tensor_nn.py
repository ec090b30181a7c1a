"""NN functions against numpy: matmul (1-d, batched, broadcast), dot, linear, softmax, log_softmax, layernorm,
conv2d (stride, padding, bias), max_pool2d and avg_pool2d; that matmul and conv2d are single kernels over views (a
padded conv2d stores its padded input first); and the errors of mismatched shapes."""
import numpy as np
import pytest

from rewrite import Ops
from helpers import realize_and_check as check_all
from tensor import Tensor, dtypes

rng = np.random.default_rng(2)


def randn(*shape): return rng.standard_normal(shape).astype(np.float32)


def realize_and_check(pairs, rtol=1e-4, atol=1e-5):
  return check_all(pairs, rtol=rtol, atol=atol)


def test_matmul_follows_numpy():
  a, b, v = randn(3, 5), randn(5, 4), randn(5)
  ba, bb = randn(2, 1, 3, 5), randn(3, 5, 2)
  realize_and_check([
    (Tensor(a) @ Tensor(b), a @ b), (Tensor(a).matmul(Tensor(b)), a @ b), (Tensor(a) @ Tensor(v), a @ v),
    (Tensor(v) @ Tensor(b), v @ b), (Tensor(v) @ Tensor(v), v @ v), (Tensor(ba) @ Tensor(bb), ba @ bb),
    (Tensor(b).T @ Tensor(a).T, b.T @ a.T), (Tensor(a)[:, ::2] @ Tensor(b)[::2], a[:, ::2] @ b[::2]),
    (Tensor(a) @ b, a @ b),
  ])


def test_matmul_is_one_reduction_over_a_broadcast_product():
  out = Tensor(randn(3, 5)) @ Tensor(randn(5, 4))
  reduces = [u for u in out.uop.toposort if u.op is Ops.REDUCE_AXIS]
  assert len(reduces) == 1 and reduces[0].arg == (Ops.ADD, (2,)) and reduces[0].src[0].op is Ops.MUL


def test_integer_and_half_matmul():
  a, b = rng.integers(-5, 5, (3, 4)).astype(np.int32), rng.integers(-5, 5, (4, 2)).astype(np.int32)
  h, g = randn(4, 8).astype(np.float16), randn(8, 3).astype(np.float16)
  assert (Tensor(h) @ Tensor(g)).dtype is dtypes.float16 and Tensor(h).matmul(Tensor(g), dtype=dtypes.float32).dtype is dtypes.float32
  realize_and_check([
    (Tensor(a) @ Tensor(b), a @ b),
    (Tensor(h).matmul(Tensor(g), dtype=dtypes.float32), h.astype(np.float32) @ g.astype(np.float32)),
    (Tensor(h) @ Tensor(g), (h.astype(np.float32) @ g.astype(np.float32)).astype(np.float16)),
  ], rtol=2e-3, atol=2e-3)


def test_dot_and_linear():
  a, b, v, w3 = randn(3, 5), randn(5, 4), randn(5), randn(2, 5, 3)
  x, weight, bias = randn(6, 5), randn(4, 5), randn(4)
  realize_and_check([
    (Tensor(v).dot(Tensor(v)), np.dot(v, v)), (Tensor(a).dot(Tensor(b)), np.dot(a, b)), (Tensor(a).dot(Tensor(v)), np.dot(a, v)),
    (Tensor(a).dot(Tensor(w3)), np.dot(a, w3)), (Tensor(2.0).dot(Tensor(v)), 2.0 * v),
    (Tensor(x).linear(Tensor(weight), Tensor(bias)), x @ weight.T + bias), (Tensor(x).linear(Tensor(weight)), x @ weight.T),
  ])


def _softmax(x, axis):
  e = np.exp(x - x.max(axis=axis, keepdims=True))
  return e / e.sum(axis=axis, keepdims=True)


def test_softmax_log_softmax_layernorm():
  x = randn(3, 7) * 4
  x[0, 0] = 80.0  # exp(80) overflows float32: only a max-subtracted softmax survives it
  y = randn(2, 3, 4)
  realize_and_check([
    (Tensor(x).softmax(), _softmax(x, -1)), (Tensor(x).softmax(0), _softmax(x, 0)), (Tensor(x).T.softmax(), _softmax(x.T, -1)),
    (Tensor(x).log_softmax(), np.log(_softmax(x.astype(np.float64), -1))), (Tensor(y).log_softmax(1), np.log(_softmax(y, 1))),
    (Tensor(y).layernorm(), (y - y.mean(-1, keepdims=True)) / np.sqrt(y.var(-1, keepdims=True) + 1e-5)),
    (Tensor(y).layernorm((1, 2), eps=1e-3), (y - y.mean((1, 2), keepdims=True)) / np.sqrt(y.var((1, 2), keepdims=True) + 1e-3)),
  ])


def test_a_half_precision_layernorm_is_computed_in_float32():
  # two close values: their difference keeps a few bits in float16, so the normalized pair came out [-0.542, 0.4065]
  # where float32 (torch's way) gives +-0.4754 (found by bench/fuzz.py --patterns, seed 1300147)
  x = Tensor(np.array([[0.5303, 0.5337], [1.0, -3.0]], np.float16))
  for t in (x, x.cast(dtypes.bfloat16)):
    x32 = t.float().numpy()   # the input as the 16-bit type holds it
    got = t.layernorm()
    assert got.dtype == t.dtype
    want = (x32 - x32.mean(-1, keepdims=True)) / np.sqrt(x32.var(-1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(got.float().numpy(), want, rtol=1e-2, atol=1e-2)


def _conv2d(x, w, stride=(1, 1), padding=(0, 0)):
  """The definition, in float64 loops over the kernel offsets."""
  x = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2))
  n, c, h, wd = x.shape
  o, _, kh, kw = w.shape
  oh, ow = (h - kh) // stride[0] + 1, (wd - kw) // stride[1] + 1
  out = np.zeros((n, o, oh, ow))
  for i in range(kh):
    for j in range(kw):
      patch = x[:, :, i:i + stride[0] * oh:stride[0], j:j + stride[1] * ow:stride[1]]
      out += np.einsum("nchw,oc->nohw", patch, w[:, :, i, j])
  return out


def test_conv2d():
  x, w, b = randn(2, 3, 7, 6), randn(4, 3, 3, 2), randn(4)
  w1 = randn(5, 3, 1, 1)
  realize_and_check([
    (Tensor(x).conv2d(Tensor(w)), _conv2d(x, w)),
    (Tensor(x).conv2d(Tensor(w), Tensor(b), stride=2, padding=1), _conv2d(x, w, (2, 2), (1, 1)) + b.reshape(1, 4, 1, 1)),
    (Tensor(x).conv2d(Tensor(w), stride=(1, 2), padding=(2, 0)), _conv2d(x, w, (1, 2), (2, 0))),
    (Tensor(x).conv2d(Tensor(w1)), _conv2d(x, w1)),
    (Tensor(x.transpose(0, 1, 3, 2).copy()).permute(0, 1, 3, 2).conv2d(Tensor(w), padding=1), _conv2d(x, w, padding=(1, 1))),
  ])


def test_conv2d_reads_sliding_windows_through_one_view():
  out = Tensor(randn(1, 2, 5, 5)).conv2d(Tensor(randn(3, 2, 3, 3)))
  reduces = [u for u in out.uop.toposort if u.op is Ops.REDUCE_AXIS]
  assert len(reduces) == 1 and reduces[0].arg == (Ops.ADD, (4, 5, 6))
  # without padding the windows View lies right on the input buffer: the only VIEWs are the input's and the weight's
  views = [u for u in out.uop.toposort if u.op is Ops.VIEW and u.src[0].op is not Ops.CONST]
  assert [v.src[0].op for v in views].count(Ops.BUFFER) == 2 and all(v.arg.mask is None for v in views)
  assert [v.arg.strides for v in views if v.src[0].op is Ops.BUFFER][0] == (0, 0, 5, 1, 25, 5, 1)  # the windows


def test_pooling():
  x = randn(2, 3, 6, 7)
  def pool(x, k, s, f):
    oh, ow = (x.shape[2] - k[0]) // s[0] + 1, (x.shape[3] - k[1]) // s[1] + 1
    return np.array([[[[f(x[n, c, i * s[0]:i * s[0] + k[0], j * s[1]:j * s[1] + k[1]]) for j in range(ow)] for i in range(oh)]
                      for c in range(x.shape[1])] for n in range(x.shape[0])])
  realize_and_check([
    (Tensor(x).max_pool2d(2), pool(x, (2, 2), (2, 2), np.max)), (Tensor(x).avg_pool2d(2), pool(x, (2, 2), (2, 2), np.mean)),
    (Tensor(x).max_pool2d((3, 2), stride=1), pool(x, (3, 2), (1, 1), np.max)),
    (Tensor(x).avg_pool2d(3, stride=(2, 1)), pool(x, (3, 3), (2, 1), np.mean)),
  ])


def test_bad_nn_shapes_raise():
  a = Tensor(randn(3, 5))
  with pytest.raises(ValueError, match=r"\(3, 5\) and \(4, 2\)"): a @ Tensor(randn(4, 2))
  with pytest.raises(ValueError, match=r"\(3, 5\) and \(4,\)"): a @ Tensor(randn(4))
  with pytest.raises(ValueError, match=r"\(2, 3, 5\) and \(4, 5, 2\)"): Tensor(randn(2, 3, 5)) @ Tensor(randn(4, 5, 2))
  with pytest.raises(ValueError, match="0-d"): a @ Tensor(2.0)
  with pytest.raises(ValueError, match="dot"): a.dot(Tensor(randn(3)))
  with pytest.raises(ValueError, match="bias"): a.linear(Tensor(randn(4, 5)), Tensor(randn(3)))
  x = Tensor(randn(1, 3, 5, 5))
  with pytest.raises(ValueError, match="channels"): x.conv2d(Tensor(randn(2, 4, 3, 3)))
  with pytest.raises(ValueError, match="4-d"): Tensor(randn(3, 5, 5)).conv2d(Tensor(randn(2, 3, 3, 3)))
  with pytest.raises(ValueError, match="larger"): x.conv2d(Tensor(randn(2, 3, 7, 3)))
  with pytest.raises(ValueError, match="stride"): x.max_pool2d(2, stride=0)
  with pytest.raises(ValueError, match="padding"): x.conv2d(Tensor(randn(2, 3, 3, 3)), padding=-1)
