"""Random tensors: made on the device from IOTA and an integer hash (no buffer, no numpy), reproducible by seed,
distinct across seeds and draws, uniform in [0, 1) and normal by Box-Muller."""
import numpy as np
import pytest

from rewrite import Ops
from tensor import Tensor, dtypes, manual_seed


def test_random_tensors_are_computed_from_iota_not_stored():
  for t in (Tensor.rand(4, 5, seed=1), Tensor.randn((3,), seed=2)):
    ops = {u.op for u in t.uop.toposort}
    assert Ops.IOTA in ops and Ops.BUFFER not in ops
    assert any(u.dtype is dtypes.uint32 and u.op is Ops.XOR for u in t.uop.toposort)


def test_rand_is_uniform_and_reproducible():
  a, b, c, d = Tensor.rand(200, 50, seed=7), Tensor.rand(200, 50, seed=7), Tensor.rand(200, 50, seed=8), Tensor.rand(200, 50)
  Tensor.realize_all(a, b, c, d)
  x = a.numpy()
  assert x.shape == (200, 50) and x.dtype == np.float32
  assert x.min() >= 0.0 and x.max() < 1.0
  assert abs(x.mean() - 0.5) < 0.01 and abs(x.var() - 1 / 12) < 0.005
  assert np.array_equal(x, b.numpy()) and not np.array_equal(x, c.numpy()) and not np.array_equal(x, d.numpy())
  assert np.histogram(x, bins=10, range=(0, 1))[0].min() > 800  # 1000 expected per bin
  assert abs(np.corrcoef(x.ravel()[:-1], x.ravel()[1:])[0, 1]) < 0.05  # neighbours are not correlated


def test_unseeded_draws_differ_and_restart_with_manual_seed():
  manual_seed(3)
  a, b = Tensor.rand(64), Tensor.rand(64)
  manual_seed(3)
  c = Tensor.rand(64)
  Tensor.realize_all(a, b, c)
  assert not np.array_equal(a.numpy(), b.numpy()) and np.array_equal(a.numpy(), c.numpy())


def test_randn_is_standard_normal():
  z = Tensor.randn(100, 100, seed=11)
  h = Tensor.randn(1000, seed=11, dtype=dtypes.float16)
  s = Tensor.randn(seed=5)
  Tensor.realize_all(z, h, s)
  x = z.numpy()
  assert np.isfinite(x).all() and abs(x.mean()) < 0.03 and abs(x.std() - 1) < 0.03
  assert abs((np.abs(x) < 1).mean() - 0.6827) < 0.02  # the one-sigma mass of a normal
  assert h.numpy().dtype == np.float16 and np.isfinite(h.numpy()).all() and s.shape == ()


def test_rand_in_float16_stays_below_one():
  x = Tensor.rand(4096, seed=4, dtype=dtypes.float16).numpy()
  assert x.dtype == np.float16 and x.max() < 1.0 and x.min() >= 0.0


def test_bad_random_arguments_raise():
  with pytest.raises(TypeError, match="int32"): Tensor.rand(3, dtype=dtypes.int32)
  with pytest.raises(ValueError, match="negative"): Tensor.randn(3, -1)
  with pytest.raises(TypeError): Tensor.rand(2.5)
