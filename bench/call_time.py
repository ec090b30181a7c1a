"""A warm call of a workload taken apart (issue 23, the memory-bound rows against torch.compile, on a GPU; issue 21,
the mlp and attn rows against torch eager, on the CPU): the wall time of one plain call (`f(x).realize()` and a
synchronize, as bench/workloads.py times it), the kernels' own time, the host time before the first launch (what no
kernel can hide), and torch timed beside it.

  python3 bench/call_time.py [--only sum,layernorm] [--calls 50] [--profile 20] [--no-compile]
  python3 bench/call_time.py --device CPU [--only mlp,attn,gpt_tiny] [--calls 50] [--busy 2]

GPU (needs CUDA): inputs 16384 x 16384 float32 (bench/workloads.py's CUDA sizes); the kernels by CUDA events around
each launch; torch eager and torch.compile timed both ways (CUDA events, and wall clock with a synchronize, as Graft).
CPU: bench/workloads.py's CPU sizes and inputs; the kernels each timed alone (the host program run with each step
waited for); beside the plain call, the same call with one parallel region per kernel (what ran before a host program's
consecutive kernels shared one team of threads, runtime/cpu.py `run_team`), alternating call by call so that a shared
machine's load falls on both alike; per call, the parallel regions started and the process's voluntary context switches
(a thread that sleeps and is woken again: OMP_WAIT_POLICY=passive); torch eager last (its OpenMP threads spin after its
calls, and would take the cores from Graft's). Medians and minima of wall time.
gpt_tiny: examples/gpt.py with 12 layers of width 64 and 16 tokens (tiny kernels: the host program and the waits
between kernels are all of it), a new input each call. --busy N: N processes spin on the CPU while Graft's calls are
timed (a loaded machine; torch is timed after they stop).
"""
from __future__ import annotations
import argparse, multiprocessing, os, statistics, sys, time
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", default="ew,sum,softmax,layernorm")
  ap.add_argument("--calls", type=int, default=50)
  ap.add_argument("--size", type=int, default=16384)
  ap.add_argument("--profile", type=int, default=0, help="print this many lines of a profile of the warm calls")
  ap.add_argument("--no-compile", action="store_true", help="leave torch.compile out")
  ap.add_argument("--device", default="CUDA", type=str.upper, choices=("CUDA", "CPU"))
  ap.add_argument("--busy", type=int, default=0, help="CPU: processes spinning while Graft is timed")
  args = ap.parse_args()
  if args.device == "CPU": return cpu_main(args)
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


def cpu_main(args) -> None:
  import resource
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from workloads import WORKLOADS, SIZES, make_inputs
  from tensor import Tensor
  from runtime.realize import find_program
  only = "mlp,attn" if args.only == "ew,sum,softmax,layernorm" else args.only
  def switches() -> int: return resource.getrusage(resource.RUSAGE_SELF).ru_nvcsw
  results = {}
  busy = [multiprocessing.Process(target=_spin, daemon=True) for _ in range(args.busy)]
  for p in busy: p.start()
  for name in only.split(","):
    if name == "gpt_tiny":
      sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
      from gpt import GPT
      model, rng = GPT(layers=12, width=64, heads=4), np.random.default_rng(0)
      xs = [Tensor(rng.standard_normal((16, 64), np.float32)) for _ in range(8)]
      w, arrays, graft = None, None, lambda i: model.forward(xs[i % len(xs)])   # a new input each call
    else:
      w = WORKLOADS[name]
      arrays = make_inputs(w, SIZES["CPU"][name])
      ts = [Tensor(a) for a in arrays]
      graft = lambda i, w=w, ts=ts: w.graft(*ts)
    for i in range(5): graft(i).realize()
    out = graft(0)
    prog, inputs = find_program([(out.uop, out.device)])
    teamed = prog.run_steps
    kinds = {"plain call": teamed, "one region per kernel": prog.steps}
    walls, csw = {k: [] for k in kinds}, {k: [] for k in kinds}
    for i in range(args.calls):
      for k, steps in kinds.items():
        prog.run_steps = steps
        c0, t0 = switches(), time.perf_counter()
        graft(i).realize()
        walls[k].append((time.perf_counter() - t0) * 1e3); csw[k].append(switches() - c0)
    prog.run_steps = teamed
    kern = []
    for _ in range(10):
      secs = []; prog.run(inputs, step_seconds=secs); kern.append(sum(secs) * 1e3)
    calls = sum(s[0] in ("call", "extern", "pick") for s in prog.steps)
    for k, steps in kinds.items():
      regions = sum(s[0] in ("call", "extern", "pick", "team") for s in steps)
      print(f"{name}: graft {k:<22s} wall {statistics.median(walls[k]):7.3f} ms (min {min(walls[k]):7.3f}); {calls} kernels "
            f"in {regions} parallel regions; voluntary context switches {statistics.median(csw[k]):.0f} a call", flush=True)
    print(f"{name}: kernels each alone {statistics.median(kern):7.3f} ms", flush=True)
    if w is not None: results[name] = (w, arrays, statistics.median(walls["plain call"]))
  for p in busy: p.terminate()
  try: import torch
  except ImportError: return
  torch.set_grad_enabled(False)
  for name, (w, arrays, graft) in results.items():
    tx = [torch.from_numpy(a) for a in arrays]
    for _ in range(5): w.torch(*tx)
    wl = []
    for _ in range(args.calls):
      t0 = time.perf_counter(); w.torch(*tx); wl.append((time.perf_counter() - t0) * 1e3)
    print(f"{name}: torch eager wall {statistics.median(wl):7.3f} ms (min {min(wl):7.3f}); graft/torch "
          f"{statistics.median(wl) / graft:.3f}x", flush=True)


def _spin() -> None:
  while True: pass


if __name__ == "__main__":
  main()
