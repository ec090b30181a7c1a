"""A product's tile plans on a GPU, side by side with cuBLAS: the heuristic's plan and variants of it (tile sizes,
registers per lane, the staged slice of k, the block grouping), each compiled and timed on its own (best of 5 calls,
CUDA events), in TFLOP/s, beside torch's matmul in strict fp32 (allow_tf32=False).

  GRAFT_EXTERN=0 python3 bench/gpu_tiles.py      # 4096^3, 1024^3 and the linear layer 8192x4096 @ 4096x4096 + b, GELU
  python3 bench/gpu_tiles.py --sizes 2048        # square sizes of your own
  GRAFT_EXTERN=0 python3 bench/gpu_tiles.py --gpt   # the GPT forward's product kernels (examples/gpt.py, 1024 tokens)

`--gpt` takes the product kernels of the GPT-2-style forward as the model makes them (a product with its bias and
GELU or residual; attention's two batched products), beside cuBLAS's time for the bare product of the same shape
(torch.matmul, strict fp32): the heuristic's plan, tile variants and, for the linear layers, the reduction split into partials (a batch of
products) and their combine (rules/split.py), the time of both kernels together; `ratio` is Graft's time over
cuBLAS's (issue 23's target: at most 1.25).
It checks the heuristic's result against torch on the same inputs first. Needs a CUDA GPU.
"""
from __future__ import annotations
import argparse, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (BM, BN, TM, TN), BK: the tiles tried beside the heuristic's
VARIANTS = (((128, 128, 8, 8), 8), ((128, 128, 8, 8), 16), ((128, 64, 8, 4), 8), ((128, 64, 8, 4), 16),
            ((64, 128, 4, 8), 8), ((64, 128, 4, 8), 16), ((64, 64, 4, 4), 8), ((64, 64, 4, 4), 16), ((64, 64, 8, 8), 8),
            ((64, 64, 8, 8), 16), ((128, 64, 8, 8), 16), ((64, 128, 8, 8), 16), ((128, 32, 8, 4), 16),
            ((32, 128, 4, 8), 16), ((32, 64, 4, 4), 16), ((64, 32, 4, 4), 16), ((32, 32, 4, 4), 16))
SPLIT_VARIANTS = (((128, 128, 8, 8), 8), ((128, 64, 8, 4), 16), ((64, 64, 4, 4), 16), ((64, 64, 8, 8), 16), ((128, 64, 8, 8), 16))


def tile_axes(plan):
  """(i, j, k, batch axes) of a tile plan (rules/opt/gpu_tile.py `tile_opts`), or None for another plan."""
  from rules.opt import OptKind
  ups = [o.axis for o in plan.opts if o.kind is OptKind.UPCAST]
  ks = [o.axis for o in plan.opts if o.kind is OptKind.SPLIT]
  if not ups or not ks: return None
  i = ups[0]
  j = next(o.axis for o in plan.opts if o.kind is OptKind.LOCAL and o.axis != i)
  return i, j, ks[0], [o.axis for o in plan.opts if o.kind is OptKind.GLOBAL and o.axis not in (i, j)]


def tile_plans(plan, sizes, variants=VARIANTS):
  """(label, plan) of each variant tile that divides the kernel's loops (`sizes`), around the heuristic's tile plan."""
  from rules.opt import Plan
  from rules.opt.gpu_tile import tile_opts, GROUP
  if (ax := tile_axes(plan)) is None: return []
  i, j, k, batch = ax
  out = []
  for (bm, bn, tm, tn), bk in variants:
    if sizes[i] % bm or sizes[j] % bn or sizes[k] % bk: continue
    group = GROUP if sizes[i] // bm % GROUP == 0 else 0
    out.append((f"{bm}x{bn} of {tm}x{tn}, bk {bk}", Plan(tile_opts(i, j, k, (bm, bn, tm, tn), bk, group, batch), "given")))
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


def timed_plans(dev, jobs, repeats: int = 5):
  """Seconds of each (kernel, plan) in `jobs` (a plan None: the heuristic's), or the error's name: every kernel is
  lowered first, nvcc builds them all at once (its cache then holds them), and each is timed alone."""
  from rules.realize import normalize
  from runtime.search import plan_source, time_source, lower_with
  from runtime.cuda import compile_cuda
  sms, lowered = dev.multiprocessor_count, []
  for kernel, plan in jobs:
    norm, bufs = normalize(kernel)
    try:
      plan = plan or lower_with(norm, "CUDA", True, None, sms)[1].plan
      lowered.append((plan, plan_source(norm, "CUDA", plan, True, sms), bufs))
    except Exception as e: lowered.append((plan, e, bufs))
  with ThreadPoolExecutor(16) as pool:
    list(pool.map(lambda x: None if isinstance(x[1], Exception) else _try(compile_cuda, x[1][1], dev.arch), lowered))
  out = []
  for plan, src, bufs in lowered:
    if isinstance(src, Exception): out.append((plan, type(src).__name__)); continue
    try: out.append((plan, time_source(*src, bufs, "CUDA", repeats, True)))
    except Exception as e: out.append((plan, type(e).__name__))
  return out


def _try(f, *a):
  try: return f(*a)
  except Exception as e: return e


def gpt_product_kernels(tokens: int, width: int, heads: int):
  """(reduction shape, kernel) of each product kernel of examples/gpt.py's forward (one layer: the others repeat it)
  as the model makes them, with their bias, GELU and residual: a kernel of one sum over its last axis of a product."""
  sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))
  from gpt import GPT
  from tensor import Tensor
  from rewrite import Ops
  from rules.pipeline import Run, schedule
  from rules.split import splittable_reductions
  from rules.shapes import shape_of
  x = Tensor(np.random.default_rng(0).standard_normal((tokens, width), np.float32))
  kernels, _ = schedule([GPT(1, width, heads).forward(x).uop], ["CUDA"], Run("CUDA", parallel=False, device_loops=True))
  out = []
  for k in kernels:
    reds = splittable_reductions(k) if k.op is Ops.KERNEL else None
    if reds and len(reds) == 1 and reds[0].src[0].op is Ops.MUL and len(shape := shape_of(reds[0].src[0])) >= 3 and reds[0].arg[1] == (len(shape) - 1,):
      out.append((shape_of(reds[0].src[0]), k))
  return out


def gpt_products(dev, tokens: int, width: int, heads: int, only: str | None, max_plans: int) -> None:
  import torch
  from rules.split import split_reduction, SplitReduce
  summary = []
  for shape, k in gpt_product_kernels(tokens, width, heads):
    name = "x".join(map(str, shape))
    if only and name not in only.split(","): continue
    *batch, m, n, kk = shape
    a, b = torch.randn(*batch, m, kk, device="cuda"), torch.randn(*batch, kk, n, device="cuda")
    cublas = torch_time(lambda: torch.matmul(a, b))
    flops = 2 * int(np.prod(shape))
    print(f"\n{name} (batch x M x N x K): cuBLAS bare product {cublas * 1e3:.3f} ms ({flops / cublas / 1e12:.1f} TFLOP/s)")
    (heur, ht), = timed_plans(dev, [(k, None)])
    rows = [("heuristic", heur, ht)] + offered_split(dev, k)
    run_as = min((r[2] for r in rows if not isinstance(r[2], str)), default=ht)   # the pick runs the faster
    variants = tile_plans(heur, _sizes(k, heur, dev))[:max_plans]
    rows += [(label, p, s) for (label, _), (p, s) in zip(variants, timed_plans(dev, [(k, p) for _, p in variants]))]
    # the reduction split into partials (a batch of products) and their combine: both kernels' time
    for parts in (2, 3, 4, 6, 8) if max_plans and not batch else ():
      if kk % (parts * 16) or kk // parts < 128: continue
      partials, combine, _ = split_reduction(k, SplitReduce(2, parts))
      (ph, pt), (ch, ct) = timed_plans(dev, [(partials, None), (combine, None)])
      if isinstance(pt, str) or isinstance(ct, str): rows.append((f"split {parts}", ph, f"{pt} {ct}")); continue
      rows.append((f"split {parts}: partials heuristic + combine {ct * 1e3:.3f} ms", ph, pt + ct))
      pv = tile_plans(ph, _sizes(partials, ph, dev), SPLIT_VARIANTS)
      rows += [(f"split {parts}: partials {label} + combine", p, s + ct if not isinstance(s, str) else s)
               for (label, _), (p, s) in zip(pv, timed_plans(dev, [(partials, p) for _, p in pv]))]
    for label, plan, s in rows:
      if isinstance(s, str): print(f"  {label:<58s} {s}"); continue
      print(f"  {label:<58s} {s * 1e3:8.3f} ms {flops / s / 1e12:6.1f} TFLOP/s  ratio {s / cublas:5.2f}  {plan}")
    best = min((r for r in rows if not isinstance(r[2], str)), key=lambda r: r[2])
    summary.append((name, cublas, ht, run_as, best))
  print("\nsummary (Graft's time / cuBLAS's bare product; target <= 1.25; as run: the heuristic's kernel or the split the "
        "host offers beside it, whichever is faster, as the pick takes it)")
  for name, cublas, ht, run_as, (label, plan, s) in summary:
    hr = f"{ht / cublas:5.2f}" if not isinstance(ht, str) else ht
    print(f"  {name:<18s} cuBLAS {cublas * 1e3:7.3f} ms  heuristic {hr}  as run {run_as * 1e3:7.3f} ms {run_as / cublas:5.2f}  "
          f"best {s / cublas:5.2f} ({label}: {plan})")


def offered_split(dev, kernel) -> list:
  """[(label, partials' plan, seconds of both kernels)] of the split the host stage offers beside the kernel (rules/
  split.py, the heuristic's plans), or [] where it offers none."""
  from rules.split import split_reduction_plan, split_reduction
  if (opt := split_reduction_plan(kernel, dev.multiprocessor_count)) is None: return []
  partials, combine, _ = split_reduction(kernel, opt)
  (ph, pt), (_, ct) = timed_plans(dev, [(partials, None), (combine, None)])
  if isinstance(pt, str) or isinstance(ct, str): return [(f"offered {opt!r}", ph, f"{pt} {ct}")]
  return [(f"offered {opt!r}: partials + combine {ct * 1e3:.3f} ms", ph, pt + ct)]


def _sizes(kernel, plan, dev):
  """The trip counts of the kernel's loops, numbered as its plan numbers them."""
  from runtime.search import lower_with
  from rules.realize import normalize
  _, ctx = lower_with(normalize(kernel)[0], "CUDA", True, plan, dev.multiprocessor_count)
  return [r.src[0].arg for r in sorted(ctx.axis_of, key=ctx.axis_of.get)]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--sizes", default="4096,1024")
  ap.add_argument("--linear", action=argparse.BooleanOptionalAction, default=True)
  ap.add_argument("--max-plans", type=int, default=36, help="tile variants timed beside the heuristic (0: none, nor the "
                  "splits into other numbers of parts with --gpt)")
  ap.add_argument("--gpt", action="store_true", help="the GPT forward's product kernels (1024 tokens, width 768, 12 heads)")
  ap.add_argument("--only", default=None, help="with --gpt: comma-separated product shapes, e.g. 1024x768x3072")
  args = ap.parse_args()
  import torch
  torch.backends.cuda.matmul.allow_tf32 = False
  from tensor import Tensor
  from rules.pipeline import Run, schedule
  from runtime.device import get_device
  dev = get_device("CUDA")
  print(f"GPU: {dev.device_name}, {dev.multiprocessor_count} SMs; GRAFT_EXTERN={os.environ.get('GRAFT_EXTERN')}")
  if args.gpt: return gpt_products(dev, 1024, 768, 12, args.only, args.max_plans)
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
    (heur, _), = timed_plans(dev, [(kernels[-1], None)], repeats=1)
    plans = [("heuristic", heur)] + tile_plans(heur, _sizes(kernels[-1], heur, dev))[:args.max_plans]
    results = []
    for label, plan, s in offered_split(dev, kernels[-1]):
      if isinstance(s, str): print(f"  {label}: {s}"); continue
      results.append((s, label))
      print(f"  {label:<28s} {s * 1e3:8.3f} ms {flops / s / 1e12:6.1f} TFLOP/s  {eager / s:5.2f}x torch eager  {plan}")
    for (label, _), (plan, s) in zip(plans, timed_plans(dev, [(kernels[-1], p) for _, p in plans])):
      if isinstance(s, str): print(f"  {label}: {s}"); continue
      results.append((s, label))
      print(f"  {str(label):<28s} {s * 1e3:8.3f} ms {flops / s / 1e12:6.1f} TFLOP/s  {eager / s:5.2f}x torch eager  {plan}")
    best = min(results)
    print(f"  best: {best[1]} {best[0] * 1e3:.3f} ms, {eager / best[0]:.2f}x torch eager")


if __name__ == "__main__":
  main()
