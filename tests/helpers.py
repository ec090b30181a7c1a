"""What the Tensor tests share: realize many tensors at once, then compare each with numpy."""
import numpy as np
from numpy.testing import assert_allclose
from tensor import Tensor


def realize_and_check(pairs, rtol=1e-5, atol=1e-6):
  """Realize every tensor of `pairs` in one go (one compile for all their kernels), then compare each with numpy."""
  Tensor.realize_all(*(t for t, _ in pairs))
  for i, (t, want) in enumerate(pairs):
    want = np.asarray(want)
    got = t.numpy()
    assert got.shape == want.shape, f"pair {i}: shape {got.shape} != {want.shape}"
    assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=f"pair {i}")
