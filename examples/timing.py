"""What the examples share: the `--small` switch and timing of a first call against warm calls.

The first call of a Graft computation pays for scheduling, code generation and the C (or CUDA) compile; later calls
rebuild the same graph and find its kernels cached, so the two figures are reported apart.
"""
from __future__ import annotations
import argparse, statistics, time
from runtime.device import Device


def parse_args(description: str) -> argparse.Namespace:
  ap = argparse.ArgumentParser(description=description)
  ap.add_argument("--small", action="store_true", help="tiny sizes, for a quick check (what the tests run)")
  return ap.parse_args()


def first_and_warm(fn, repeats: int = 10):
  """(result of the first call, its seconds, median seconds of `repeats` later calls)."""
  t0 = time.perf_counter()
  out = fn()
  first = time.perf_counter() - t0
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return out, first, statistics.median(times)


def report(what: str, first: float, warm: float) -> None:
  print(f"{what} on {Device.default().name}: first call {first * 1e3:.1f} ms, warm median {warm * 1e3:.2f} ms")
