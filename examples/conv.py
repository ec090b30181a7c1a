"""A convolution block, conv2d 3x3 (padding 1) + bias -> relu -> 2x2 max pool, NCHW; checked against numpy.

  DEVICE=CPU python examples/conv.py            # x (4, 32, 32, 32), 32 filters
  DEVICE=CPU python examples/conv.py --small    # tiny sizes

Graft reads the input through one strided view of its sliding windows, so the convolution is a multiply and a sum
with no im2col buffer. The numpy reference builds those windows explicitly.
"""
import numpy as np
from numpy.lib.stride_tricks import sliding_window_view
from tensor import Tensor
from timing import parse_args, first_and_warm, report


def conv_block(x: Tensor, w: Tensor, b: Tensor) -> Tensor:
  return x.conv2d(w, b, padding=1).relu().max_pool2d(2)


def conv_block_numpy(x: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
  windows = sliding_window_view(np.pad(x, ((0, 0), (0, 0), (1, 1), (1, 1))), w.shape[2:], axis=(2, 3))
  y = np.einsum("nchwij,ocij->nohw", windows, w) + b.reshape(1, -1, 1, 1)   # (N, O, H, W)
  y = np.maximum(y, 0)
  n, o, h, wd = y.shape
  return y.reshape(n, o, h // 2, 2, wd // 2, 2).max(axis=(3, 5))


def main():
  args = parse_args(__doc__.splitlines()[0])
  (n, c, hw), o = ((1, 3, 8), 4) if args.small else ((4, 32, 32), 32)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((n, c, hw, hw), dtype=np.float32)
  w = rng.standard_normal((o, c, 3, 3), dtype=np.float32) / np.float32(np.sqrt(c * 9))
  b = rng.standard_normal(o, dtype=np.float32)

  xt, wt, bt = Tensor(x), Tensor(w), Tensor(b)
  out, first, warm = first_and_warm(lambda: conv_block(xt, wt, bt).realize())

  np.testing.assert_allclose(out.numpy(), conv_block_numpy(x, w, b), rtol=1e-4, atol=1e-5)
  report(f"conv block x{x.shape} w{w.shape}", first, warm)
  print("ok")


if __name__ == "__main__":
  main()
