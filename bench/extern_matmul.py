"""WORKLOADS.md's matmul, (N,N) @ (N,N) float32, in one process: numpy, torch (when installed), Graft's generated
kernel (GRAFT_EXTERN=0) and Graft calling the device's sgemm (GRAFT_EXTERN=1): OpenBLAS of scipy-openblas32 on the
CPU, cuBLAS on CUDA.

  python bench/extern_matmul.py [--size N] [--device CPU|CUDA]   (default: the DEVICE environment variable, or CPU)

Warm: median of 10 calls after 3 warm-ups, the graph rebuilt each call (its compiled kernel and host program
cached), each call ended with the device synchronized.
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


LIBRARY = {"CPU": "OpenBLAS", "CUDA": "cuBLAS"}


def torch_row(a, b, device: str):
  """torch's matmul on the same device, synchronized; None when torch (or its CUDA) is missing."""
  try: import torch
  except ImportError: return None
  if device == "CUDA" and not torch.cuda.is_available(): return None
  dev = "cuda" if device == "CUDA" else "cpu"
  if dev == "cuda": torch.backends.cuda.matmul.allow_tf32 = False  # float32 products, as Graft computes them
  ta, tb = torch.from_numpy(a).to(dev), torch.from_numpy(b).to(dev)
  sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
  return warm_ms(lambda: (ta @ tb, sync()))


def main() -> None:
  import numpy as np
  from tensor import Tensor
  from runtime import extern
  from runtime.device import get_device
  from runtime.realize import last_program
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--size", type=int, default=1024)
  p.add_argument("--device", type=str.upper, default=os.environ.get("DEVICE", "CPU").upper(), choices=sorted(LIBRARY))
  args = p.parse_args()
  n, device = args.size, args.device
  dev = get_device(device)
  rng = np.random.default_rng(0)
  a, b = rng.standard_normal((n, n), dtype=np.float32), rng.standard_normal((n, n), dtype=np.float32)
  x, w = Tensor(a, device=device), Tensor(b, device=device)
  gflop = 2 * n ** 3 / 1e9
  rows = [("numpy (CPU)", warm_ms(lambda: a @ b))]
  if (ms := torch_row(a, b, device)) is not None: rows.append((f"torch ({device})", ms))
  for mode, label in (("0", "graft generated"), ("1", f"graft sgemm ({LIBRARY[device]})")):
    os.environ["GRAFT_EXTERN"] = mode
    if mode == "1" and extern.routine(device, "sgemm") is None:
      print(f"no sgemm on {device} (CPU: pip install scipy-openblas32; CUDA: the toolkit's libcublas): no row"); continue
    np.testing.assert_allclose((x @ w).numpy(), a @ b, rtol=1e-3, atol=1e-2)
    assert ("extern sgemm" in str(last_program())) == (mode == "1"), str(last_program())
    rows.append((label, warm_ms(lambda: ((x @ w).realize(), dev.synchronize()))))
  base = rows[0][1]
  print(f"matmul {n}x{n}x{n} float32 on {device}, warm medians")
  for label, ms in rows: print(f"  {label:<24s} {ms:9.3f} ms  {gflop / ms * 1e3:8.1f} GFLOP/s  {base / ms:6.2f}x numpy")


if __name__ == "__main__":
  main()
