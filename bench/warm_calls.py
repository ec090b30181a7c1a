"""Warm calls with new input data: what a service answering requests sees.

Prints (1) the median time of a warm call of a two-layer product network with a new input tensor each call against
the same call with the same input tensor (the cached host program is found either way: inputs are its parameters),
and (2) resident memory over many warm calls with new inputs: its growth after the first 1,000 calls must be flat
(nothing grows per call).

  PYTHONPATH=$PWD python3 bench/warm_calls.py [--calls 100000] [--size 64]
"""
from __future__ import annotations
import argparse, gc, os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np
from tensor import Tensor


def rss_mib() -> float:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmRSS:"): return int(line.split()[1]) / 1024
  return float("nan")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--calls", type=int, default=100_000)
  ap.add_argument("--size", type=int, default=64, help="width of the network (batch 8)")
  ap.add_argument("--timed", type=int, default=200, help="calls timed for each of the two medians")
  args = ap.parse_args()
  rng = np.random.default_rng(0)
  n = args.size
  w1, w2 = (Tensor(rng.standard_normal((n, n)).astype(np.float32)) for _ in range(2))
  inputs = [rng.standard_normal((8, n)).astype(np.float32) for _ in range(16)]
  def forward(x: Tensor) -> np.ndarray: return ((x @ w1).relu() @ w2).numpy()

  same = Tensor(inputs[0])
  for _ in range(3): forward(same); forward(Tensor(inputs[1]))
  def timed(make) -> float:
    ts = []
    for i in range(args.timed):
      x = make(i)
      t0 = time.perf_counter(); forward(x); ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
  # alternated in rounds, so a change of load on a shared machine falls on both alike
  t_same, t_new = [], []
  for _ in range(5):
    t_same.append(timed(lambda i: same))
    t_new.append(timed(lambda i: Tensor(inputs[i % len(inputs)])))   # a new Tensor (new buffer) each call
  same_ms, new_ms = statistics.median(t_same) * 1e3, statistics.median(t_new) * 1e3
  print(f"warm call, batch 8, width {n}, two products: same input {same_ms:.3f} ms, new input {new_ms:.3f} ms, "
        f"ratio {new_ms / same_ms:.3f}x (median of 5 rounds of {args.timed})")

  gc.collect()
  marks = {}
  t0 = time.perf_counter()
  for i in range(1, args.calls + 1):
    forward(Tensor(inputs[i % len(inputs)]))
    if i in (1_000, 10_000) or i == args.calls or i % 25_000 == 0:
      gc.collect()
      marks[i] = rss_mib()
      print(f"  after {i:>7,d} calls: resident {marks[i]:8.1f} MiB", flush=True)
  total = time.perf_counter() - t0
  if 1_000 in marks:
    growth = marks[args.calls] - marks[1_000]
    print(f"{args.calls:,d} warm calls with new inputs in {total:.1f} s; resident growth after the first 1,000: "
          f"{growth:+.2f} MiB ({growth * 1024 * 1024 / max(1, args.calls - 1000):+.1f} B per call)")


if __name__ == "__main__":
  main()
