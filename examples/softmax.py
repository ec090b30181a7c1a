"""Row softmax written from Tensor primitives (max, subtract, exp, sum, divide); checked against numpy.

  DEVICE=CPU python examples/softmax.py            # 2048 x 2048
  DEVICE=CPU python examples/softmax.py --small    # tiny sizes

Subtracting each row's max first keeps exp from overflowing; Graft fuses the whole expression into few kernels, so
the intermediate `e` is never written out in full. `Tensor.softmax(axis)` is the built-in form of the same thing.
"""
import numpy as np
from tensor import Tensor
from timing import parse_args, first_and_warm, report


def softmax(x: Tensor) -> Tensor:
  e = (x - x.max(axis=1, keepdim=True)).exp()
  return e / e.sum(axis=1, keepdim=True)


def main():
  args = parse_args(__doc__.splitlines()[0])
  rows, cols = (16, 50) if args.small else (2048, 2048)
  x = np.random.default_rng(0).standard_normal((rows, cols), dtype=np.float32) * 4

  xt = Tensor(x)
  out, first, warm = first_and_warm(lambda: softmax(xt).realize())

  e = np.exp(x - x.max(axis=1, keepdims=True))
  ref = e / e.sum(axis=1, keepdims=True)
  np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(xt.softmax(1).numpy(), ref, rtol=1e-5, atol=1e-7)
  report(f"softmax {rows}x{cols}", first, warm)
  print("ok")


if __name__ == "__main__":
  main()
