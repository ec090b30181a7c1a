"""A warm call of a memory-bound workload on a GPU, taken apart (issue 23: the memory-bound rows against
torch.compile): the wall time of one plain call (`f(x).realize()` and a synchronize, as bench/workloads.py times it),
the kernels' own time (CUDA events around each launch), the host time before the first launch (what no kernel can
hide), and torch eager / torch.compile timed both ways (CUDA events, as workloads.py did, and wall clock with a
synchronize, as Graft is timed).

  python3 bench/call_time.py [--only sum,layernorm] [--calls 50] [--profile 20] [--no-compile]
Needs a CUDA GPU; inputs 16384 x 16384 float32 (bench/workloads.py's CUDA sizes).
"""
from __future__ import annotations
import argparse, os, statistics, sys, time
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", default="ew,sum,softmax,layernorm")
  ap.add_argument("--calls", type=int, default=50)
  ap.add_argument("--size", type=int, default=16384)
  ap.add_argument("--profile", type=int, default=0, help="print this many lines of a profile of the warm calls")
  ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
  args = ap.parse_args()
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from workloads import WORKLOADS
  from tensor import Tensor
  from runtime.device import get_device
  from runtime.realize import find_program
  import runtime.program as program
  dev = get_device("CUDA")
  launched, launch = [0], program._launch
  def first_launch(*a, **k):
    launched[0] = launched[0] or time.perf_counter_ns()
    return launch(*a, **k)
  program._launch = first_launch
  allocs, alloc = [0], dev.allocator._alloc
  def counted(n):
    allocs[0] += 1
    return alloc(n)
  dev.allocator._alloc = counted
  try: import torch
  except ImportError: torch = None
  rng = np.random.default_rng(0)
  for name in args.only.split(","):
    w = WORKLOADS[name]
    shapes = 3 if name == "ew" else 1
    xs = [rng.standard_normal((args.size, args.size), dtype=np.float32) for _ in range(shapes)]
    ts = [Tensor(x, device="CUDA") for x in xs]
    for _ in range(3): w.graft(*ts).realize(); dev.synchronize()
    walls, tolaunch = [], []
    allocs[0] = 0
    for _ in range(args.calls):
      launched[0] = 0
      t0 = time.perf_counter_ns()
      w.graft(*ts).realize(); dev.synchronize()
      t1 = time.perf_counter_ns()
      walls.append((t1 - t0) / 1e6); tolaunch.append((launched[0] - t0) / 1e6)
    out = w.graft(*ts)
    prog, inputs = find_program([(out.uop, out.device)])
    kern = []
    for _ in range(10):
      secs = []; prog.run(inputs, step_seconds=secs); kern.append(sum(secs) * 1e3)
    wall, k = statistics.median(walls), statistics.median(kern)
    print(f"{name}: graft wall {wall:.3f} ms, steps (kernels by events) {k:.3f} ms, host before launch "
          f"{statistics.median(tolaunch):.3f} ms, wall - steps {wall - k:.3f} ms; device allocations in {args.calls} "
          f"calls: {allocs[0]}", flush=True)
    if args.profile:
      import cProfile, pstats
      pr = cProfile.Profile(); pr.enable()
      for _ in range(args.calls): w.graft(*ts).realize(); dev.synchronize()
      pr.disable(); pstats.Stats(pr).sort_stats("tottime").print_stats(args.profile)
    if torch is None: continue
    gx = [torch.from_numpy(x).cuda() for x in xs]
    for label, fn in [("torch", w.torch)] + ([] if args.no_compile else [("torch.compile", torch.compile(w.torch))]):
      for _ in range(3): fn(*gx)
      torch.cuda.synchronize()
      ev, wl = [], []
      for _ in range(args.calls):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); fn(*gx); e.record(); e.synchronize(); ev.append(s.elapsed_time(e))
      for _ in range(args.calls):
        t0 = time.perf_counter_ns(); fn(*gx); torch.cuda.synchronize(); wl.append((time.perf_counter_ns() - t0) / 1e6)
      me, mw = statistics.median(ev), statistics.median(wl)
      print(f"  {label}: events {me:.3f} ms, wall+sync {mw:.3f} ms; graft/{label} {me / wall:.3f}x (events) "
            f"{mw / wall:.3f}x (wall)", flush=True)
    del gx, ts, out, prog, inputs
    torch.cuda.empty_cache()


if __name__ == "__main__":
  main()
