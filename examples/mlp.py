"""A 3-layer perceptron forward pass, relu(x @ W.T + b) three times, with the Tensor API; checked against numpy.

  DEVICE=CPU python examples/mlp.py            # batch 256, width 1024
  DEVICE=CPU python examples/mlp.py --small    # tiny sizes
"""
import numpy as np
from tensor import Tensor
from timing import parse_args, first_and_warm, report


def mlp(x: Tensor, layers: list[tuple[Tensor, Tensor]]) -> Tensor:
  for w, b in layers: x = x.linear(w, b).relu()
  return x


def main():
  args = parse_args(__doc__.splitlines()[0])
  batch, width = (8, 32) if args.small else (256, 1024)
  rng = np.random.default_rng(0)
  x = rng.standard_normal((batch, width), dtype=np.float32)
  # weights scaled by 1/sqrt(width) keep the activations of order 1 through the layers
  params = [(rng.standard_normal((width, width), dtype=np.float32) / np.float32(np.sqrt(width)),
             rng.standard_normal(width, dtype=np.float32)) for _ in range(3)]

  xt, layers = Tensor(x), [(Tensor(w), Tensor(b)) for w, b in params]
  # each call builds the graph anew, as user code does; realize() runs it (the kernels are cached after the first)
  out, first, warm = first_and_warm(lambda: mlp(xt, layers).realize())

  ref = x
  for w, b in params: ref = np.maximum(ref @ w.T + b, 0)
  np.testing.assert_allclose(out.numpy(), ref, rtol=1e-4, atol=1e-4)
  report(f"mlp {batch}x{width}, 3 layers", first, warm)
  print("ok")


if __name__ == "__main__":
  main()
