"""Memory-bound kernels on a GPU (elementwise, a row sum, softmax, layer norm of 16384 x 16384 float32): the rows
plan's heuristic and variants of it (runs of 4 floats or single ones, lanes per row, rows per block and per thread),
each compiled and timed on its own (best of 5 calls, CUDA events), in GB/s, beside torch eager and torch.compile on
the same inputs.

  python3 bench/gpu_rows.py                      # all four
  python3 bench/gpu_rows.py --only softmax --rows 4096
Needs a CUDA GPU.
"""
from __future__ import annotations
import argparse, os, sys
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def variants(plan):
  """The plan without or with runs of 4 floats (`vector(-1, 4)`: floatx4 loads and stores), with other lanes per row
  (every lane record together), or other rows per block / per thread."""
  from rules.opt import Opt, OptKind, Plan
  run = Opt(OptKind.VECTOR, -1, 4)
  out = [("scalar (no vector record)", Plan(tuple(o for o in plan.opts if o != run)))] if run in plan.opts else []
  spread = [o for o in plan.opts if o.kind in (OptKind.LOCAL, OptKind.GROUP) and o.axis >= 0]
  if spread:
    for n in (128, 256, 512, 1024):
      if n != spread[0].amount: out.append((f"lanes {n}", Plan(tuple(Opt(o.kind, o.axis, n) if o in spread else o for o in plan.opts if o != run))))
  else:
    base = [o for o in plan.opts if o.axis >= 0]
    for vec in (False, True):
      for rows in (128, 256, 512):
        for per in (1, 2, 4, 8):
          if vec and per == 8: continue
          out.append((f"{rows} a block, {per} a thread{', runs of 4' if vec else ''}",
                      Plan(tuple(base + [Opt(OptKind.LOCAL, -1, rows)] + ([Opt(OptKind.UPCAST, -1, per)] if per > 1 else []) + [run] * vec))))
  return [(label, p) for label, p in out if p.opts != plan.opts]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", default="ew,sum,softmax,layernorm")
  ap.add_argument("--rows", type=int, default=16384)
  ap.add_argument("--cols", type=int, default=16384)
  args = ap.parse_args()
  import torch
  from tensor import Tensor
  from rules.pipeline import Run, schedule, lower_kernel
  from rules.realize import normalize
  from rules.opt import InvalidPlan
  from runtime.search import time_plan
  from gpu_tiles import torch_time   # bench/gpu_tiles.py, beside this script
  from runtime.device import get_device, CompileError
  dev = get_device("CUDA")
  shape = (args.rows, args.cols)
  rng = np.random.default_rng(0)
  xs = [rng.standard_normal(shape, dtype=np.float32) for _ in range(3)]
  tx = [Tensor(x, device="CUDA") for x in xs]
  gx = [torch.from_numpy(x).cuda() for x in xs]
  F = torch.nn.functional
  work = {"ew": (lambda a, b, c: (a * b + c).relu(), lambda a, b, c: torch.relu(a * b + c), 4),
          "sum": (lambda a, b, c: a.sum(1), lambda a, b, c: a.sum(1), 1),
          "softmax": (lambda a, b, c: a.softmax(1), lambda a, b, c: torch.softmax(a, 1), 2),
          "layernorm": (lambda a, b, c: a.layernorm(1, eps=1e-5), lambda a, b, c: F.layer_norm(a, a.shape[-1:], eps=1e-5), 2)}
  for name in args.only.split(","):
    g, t, passes = work[name]
    nbytes = passes * 4 * shape[0] * shape[1]
    eager, comp = torch_time(lambda: t(*gx)), torch_time(lambda f=torch.compile(t): f(*gx))
    print(f"\n{name} {shape}: torch eager {eager * 1e3:.3f} ms ({nbytes / eager / 1e9:.0f} GB/s), torch.compile "
          f"{comp * 1e3:.3f} ms ({nbytes / comp / 1e9:.0f} GB/s)")
    kernels, _ = schedule([g(*tx).uop], ["CUDA"], Run("CUDA", parallel=False, device_loops=True))
    if len(kernels) != 1: print(f"  {len(kernels)} kernels: timing the last only")
    norm, bufs = normalize(kernels[-1])
    run = Run("CUDA", parallel=False, device_loops=True, multiprocessors=dev.multiprocessor_count)
    lower_kernel(norm, run)
    best = None
    for label, plan in [("heuristic", run.opt.plan)] + variants(run.opt.plan):
      try: s = time_plan(norm, bufs, "CUDA", plan, repeats=5, device_loops=True, multiprocessors=dev.multiprocessor_count)
      except (InvalidPlan, CompileError, ValueError) as e:
        print(f"  {label}: {type(e).__name__} {str(e)[:90]}")
        continue
      best = min(best or (s, label, plan), (s, label, plan), key=lambda r: r[0])
      print(f"  {label:<26s} {s * 1e3:7.3f} ms {nbytes / s / 1e9:6.0f} GB/s  {comp / s:5.2f}x torch.compile  {plan}")
    print(f"  best: {best[1]} {best[0] * 1e3:.3f} ms, {comp / best[0]:.2f}x torch.compile")


if __name__ == "__main__":
  main()
