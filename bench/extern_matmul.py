"""WORKLOADS.md's CPU matmul, (1024,1024) @ (1024,1024) float32, three ways in one process: numpy, Graft's generated
kernel (GRAFT_EXTERN=0) and Graft calling OpenBLAS's sgemm of scipy-openblas32 (GRAFT_EXTERN=1).

  python bench/extern_matmul.py [--size N]

Warm: median of 10 calls after 3 warm-ups, the graph rebuilt each call (its compiled kernel and host program cached).
"""
from __future__ import annotations
import argparse, os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def warm_ms(fn) -> float:
  for _ in range(3): fn()
  times = []
  for _ in range(10):
    t0 = time.perf_counter(); fn(); times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def main() -> None:
  import numpy as np
  from tensor import Tensor
  from runtime import extern
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size", type=int, default=1024)
  n = p.parse_args().size
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
  x, w = Tensor(a), Tensor(b)
  gflop = 2 * n ** 3 / 1e9
  rows = [("numpy", warm_ms(lambda: a @ b))]
  for mode, label in (("0", "graft generated"), ("1", "graft sgemm (OpenBLAS)")):
    os.environ["GRAFT_EXTERN"] = mode
    if mode == "1" and extern.routine("CPU", "sgemm") is None:
      print("scipy-openblas32 is not installed: no sgemm row (pip install scipy-openblas32)"); continue
    np.testing.assert_allclose((x @ w).numpy(), a @ b, rtol=1e-3, atol=1e-2)
    rows.append((label, warm_ms(lambda: (x @ w).realize())))
  base = rows[0][1]
  print(f"matmul {n}x{n}x{n} float32, warm medians")
  for label, ms in rows: print(f"  {label:<24s} {ms:9.2f} ms  {gflop / ms * 1e3:8.1f} GFLOP/s  {base / ms:5.2f}x numpy")


if __name__ == "__main__":
  main()
