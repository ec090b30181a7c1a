"""Host time of a warm non-jit call (issue 23, the memory-bound rows and attention): what Graft's Python costs on every
call besides the kernels, in microseconds, split into its parts.

  PYTHONPATH=$PWD python3 bench/host_time.py [--repeats 2000]

Each workload of bench/workloads.py (ew, sum, softmax, layernorm, attn) is called on a new input tensor each call, at
a tiny size (16x16; attention 2x16x8) so that its kernels take next to nothing on the CPU: the figures are host time,
the same Python that runs before and between a GPU's kernel launches. Columns: building the graph (the tensor
operations), `find_program` (the warm call's key: the cached program is found), running the program (binding
buffers, the steps, the tiny kernels) and the whole call (`realize()` of the built graph, plus the build). Medians
of CPU time of this process (`time.process_time_ns` over batches of 50 calls), so another process's load counts
little. Last, `to launch`: the median wall time from the start of a whole call to its first kernel launch, the part
of the host time that a GPU's kernels cannot hide (what follows the launch runs while the kernel does).
"""
from __future__ import annotations
import argparse, math, os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np

WORKLOADS = {   # name -> (input shapes, the call as bench/workloads.py writes it)
  "ew": ([(16, 16)] * 3, lambda a, b, c: (a * b + c).relu()),
  "sum": ([(16, 16)], lambda x: x.sum(axis=1)),
  "softmax": ([(16, 16)], lambda x: x.softmax(1)),
  "layernorm": ([(16, 16)], lambda x: x.layernorm(1, eps=1e-5)),
  "attn": ([(2, 16, 8)] * 3, lambda q, k, v: (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ v),
}
BATCH = 50


def per_call_us(fn, calls: int) -> float:
  """Median CPU microseconds of one fn(i) call, over batches of BATCH calls."""
  out = []
  for b in range(calls // BATCH):
    t0 = time.process_time_ns()
    for i in range(b * BATCH, (b + 1) * BATCH): fn(i)
    out.append((time.process_time_ns() - t0) / BATCH / 1e3)
  return statistics.median(out)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--repeats", type=int, default=2000, help="calls timed per column")
  ap.add_argument("--only", default=",".join(WORKLOADS))
  args = ap.parse_args()
  from tensor import Tensor
  from runtime.realize import find_program
  rng = np.random.default_rng(0)
  n = args.repeats
  import runtime.program as program
  launched, launch = [0], program._launch
  def first_launch(*a, **k):
    launched[0] = launched[0] or time.perf_counter_ns()
    return launch(*a, **k)
  program._launch = first_launch
  def to_launch(i: int) -> float:
    launched[0] = 0
    t0 = time.perf_counter_ns()
    f(*inputs[i]).realize()
    return (launched[0] - t0) / 1e3
  print(f"{'workload (us per warm call)':<28s}{'build':>8s}{'find_program':>14s}{'run':>8s}{'whole call':>12s}{'to launch':>11s}")
  for name in args.only.split(","):
    shapes, f = WORKLOADS[name]
    data = [[rng.standard_normal(s, np.float32) for s in shapes] for _ in range(4)]
    inputs = [[Tensor(a) for a in data[i % 4]] for i in range(n)]   # a new input (a new buffer) every call
    for i in range(5): f(*inputs[i]).realize()
    build = per_call_us(lambda i: f(*inputs[i]), n)
    built = [f(*inputs[i]) for i in range(n)]
    # (`_graph()`: a composite's result as realize reads it, unbuilt where a record replays it: tensor/recorded.py)
    key = per_call_us(lambda i: find_program([(built[i]._graph(), built[i].device)]), n)
    found = [find_program([(o._graph(), o.device)]) for o in built]
    run = per_call_us(lambda i: found[i][0].run(found[i][1]), n)
    del built, found
    whole = per_call_us(lambda i: f(*inputs[i]).realize(), n)
    first = statistics.median(to_launch(i) for i in range(n))
    print(f"{name:<28s}{build:8.1f}{key:14.1f}{run:8.1f}{whole:12.1f}{first:11.1f}", flush=True)


if __name__ == "__main__":
  main()
