"""How scheduling scales with depth: layers of matmul, softmax, residual and layernorm (every realize rule fires in
each), scheduled (realize, kernelize, group: no codegen) at 8 and 64 layers. Linear scheduling costs 8x at 8x the
layers.

  python bench/schedule_scaling.py              # 8 and 64 layers, best of 3, CPU time
  python bench/schedule_scaling.py --layers 4,32
"""
from __future__ import annotations
import argparse, os, sys, time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def layers(n: int):
  import numpy as np
  from tensor import Tensor
  def param(): return Tensor(np.zeros((64, 64), np.float32), device="CPU")
  x = param()
  for _ in range(n): x = (x + (x @ param()).softmax(-1)).layernorm(-1)
  return x


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", default="8,64", help="comma-separated layer counts")
  ap.add_argument("--repeats", type=int, default=3)
  args = ap.parse_args(argv)
  from rules.pipeline import schedule, Run
  rows = []
  for n in map(int, args.layers.split(",")):
    best = float("inf")
    for _ in range(args.repeats):
      out = layers(n)   # built outside the timing
      t0 = time.process_time()
      kernels, _ = schedule([out.uop], [out.device], Run(out.device))
      best = min(best, time.process_time() - t0)
    rows.append((n, len(kernels), best * 1e3))
  from tabulate import tabulate
  print(tabulate([(n, k, f"{ms:.1f}", f"{ms / rows[0][2]:.1f}x" if i else "1x") for i, (n, k, ms) in enumerate(rows)],
                 headers=["layers", "kernels", "schedule ms (CPU time, best)", "vs first"], tablefmt="github"))


if __name__ == "__main__":
  main()
