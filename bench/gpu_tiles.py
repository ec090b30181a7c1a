"""A product's tile plans on a GPU, side by side with cuBLAS: the heuristic's plan and variants of it (tile sizes,
registers per lane, the staged slice of k, the block grouping), each compiled and timed on its own (best of 5 calls,
CUDA events), in TFLOP/s, beside torch's matmul in strict fp32 (allow_tf32=False).

  GRAFT_EXTERN=0 python3 bench/gpu_tiles.py      # 4096^3, 1024^3 and the linear layer 8192x4096 @ 4096x4096 + b, GELU
  python3 bench/gpu_tiles.py --sizes 2048        # square sizes of your own
It checks the heuristic's result against torch on the same inputs first. Needs a CUDA GPU.
"""
from __future__ import annotations
import argparse, os, sys, time
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def tile_plans(i: int, j: int, k: int, batch: int = 0):
  """Tile plans of a product over loops (i, j, k) of the kernel: (BM, BN, TM, TN, BK, group) variants."""
  from rules.opt import Opt, OptKind, Plan
  out = []
  for bm, bn, tm, tn, bk, group in ((128, 128, 8, 8, 8, 8), (128, 128, 8, 8, 16, 8), (128, 128, 8, 8, 8, 0),
                                     (128, 64, 8, 4, 8, 8), (128, 64, 8, 4, 16, 8), (64, 128, 4, 8, 8, 8),
                                     (64, 64, 4, 4, 8, 8), (64, 64, 4, 4, 16, 8), (64, 64, 8, 8, 8, 8), (128, 128, 8, 4, 8, 8)):
    if True:
      if True:
        half = tn // 2
        opts = [Opt(OptKind.UPCAST, i, tm), Opt(OptKind.LOCAL, i, bm // tm), Opt(OptKind.GLOBAL, i, group)]
        opts += [Opt(OptKind.UPCAST, j, half)] * (half > 1) + [Opt(OptKind.LOCAL, j, bn // tn), Opt(OptKind.UPCAST, j, 2), Opt(OptKind.GLOBAL, j)]
        opts += [Opt(OptKind.SPLIT, k, bk), Opt(OptKind.PACK, k)]
        out.append(((bm, bn, tm, tn, bk, group), Plan(tuple(opts), "given")))
  return out


def torch_time(fn) -> float:
  """Seconds of one call of a torch function on the GPU: the median of 10 after 3 warm-ups, CUDA events."""
  import torch
  for _ in range(3): fn()
  s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
  ts = []
  for _ in range(10):
    s.record(); fn(); e.record(); e.synchronize(); ts.append(s.elapsed_time(e) / 1e3)
  return float(np.median(ts))


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", default="4096,1024")
  ap.add_argument("--linear", action=argparse.BooleanOptionalAction, default=True)
  ap.add_argument("--max-plans", type=int, default=36)
  args = ap.parse_args()
  import torch
  torch.backends.cuda.matmul.allow_tf32 = False
  from tensor import Tensor
  from rules.pipeline import Run, schedule, lower_kernel
  from rules.realize import normalize
  from rules.opt import OptContext, InvalidPlan
  from runtime.search import time_plan
  from runtime.device import get_device, CompileError
  dev = get_device("CUDA")
  print(f"GPU: {dev.device_name}, {dev.multiprocessor_count} SMs")
  cases = [(f"matmul {n}^3", n, n, n, False) for n in map(int, args.sizes.split(","))]
  if args.linear: cases.append(("(x@W+b).gelu() 8192x4096 @ 4096x4096", 8192, 4096, 4096, True))
  rng = np.random.default_rng(0)
  for name, m, n, k, linear in cases:
    a, b = rng.standard_normal((m, k), dtype=np.float32), (rng.standard_normal((k, n), dtype=np.float32) / np.float32(np.sqrt(k)))
    bias = rng.standard_normal(n, dtype=np.float32)
    ta, tb, tbias = Tensor(a, device="CUDA"), Tensor(b, device="CUDA"), Tensor(bias, device="CUDA")
    t = ((ta @ tb) + tbias).gelu() if linear else ta @ tb
    flops = 2 * m * n * k
    # torch: cuBLAS strict fp32 (+ its epilogue kernel: eager), and the same through torch.compile
    xa, xb, xbias = (torch.from_numpy(v).cuda() for v in (a, b, bias))
    f = (lambda: torch.nn.functional.gelu(xa @ xb + xbias, approximate="tanh")) if linear else (lambda: xa @ xb)
    eager = torch_time(f)
    print(f"\n{name}: torch eager {eager * 1e3:.3f} ms ({flops / eager / 1e12:.1f} TFLOP/s)")
    if linear:
      comp = torch_time(torch.compile(f))
      print(f"  torch.compile {comp * 1e3:.3f} ms ({flops / comp / 1e12:.1f} TFLOP/s)")
    kernels, _ = schedule([t.uop], ["CUDA"], Run("CUDA", parallel=False, device_loops=True))
    # Graft's generated kernel (run with GRAFT_EXTERN=0: no library call), checked against torch
    t0 = time.perf_counter()
    got = t.numpy()
    print(f"  graft first call {time.perf_counter() - t0:.2f} s (GRAFT_EXTERN={os.environ.get('GRAFT_EXTERN')}); "
          f"max error vs torch {float(np.abs(got - f().cpu().numpy()).max()):.2e}")
    norm, bufs = normalize(kernels[-1])
    run = Run("CUDA", parallel=False, device_loops=True, opt=OptContext(device_loops=True, multiprocessors=dev.multiprocessor_count))
    lower_kernel(norm, run)
    heur = run.opt.plan
    axes = sorted(run.opt.axis_of, key=run.opt.axis_of.get)
    i, j, kk = 0, 1, 2
    results = []
    for label, plan in [("heuristic", heur)] + tile_plans(i, j, kk)[:args.max_plans]:
      try: s = time_plan(norm, bufs, "CUDA", plan, repeats=5, device_loops=True, multiprocessors=dev.multiprocessor_count)
      except (InvalidPlan, CompileError, ValueError) as e:
        print(f"  {label}: {type(e).__name__} {str(e)[:100]}")
        continue
      results.append((s, label))
      print(f"  {str(label):<28s} {s * 1e3:8.3f} ms {flops / s / 1e12:6.1f} TFLOP/s  {eager / s:5.2f}x torch eager")
    best = min(results)
    print(f"  best: {best[1]} {best[0] * 1e3:.3f} ms, {eager / best[0]:.2f}x torch eager")


if __name__ == "__main__":
  main()
