"""WGMMA tiles on a GPU, side by side with torch: each variant of rules/opt/tensor_core.py WGMMA_TILES rendered for the
product, built, run alone on the same inputs (median of 10 CUDA-event timings) and checked against torch.matmul.

  python bench/wgmma_tiles.py

Needs a CUDA GPU of sm_90 and torch with CUDA. The kernels are lowered here (not through the kernel cache), so each
variant is its own kernel."""
import os, sys, statistics
import numpy as np, torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from rewrite import Ops
from tensor import Tensor
from renderers.cuda import renderer
from runtime.device import get_device
from rules.gpu import launch_dims
from rules.pipeline import Run, lower_kernel, schedule
from rules.realize import normalize
import rules.opt.tensor_core as tc

dev = get_device("CUDA")
print(torch.cuda.get_device_name(), dev.arch, flush=True)

def source_for(m, k, n, dtype, transposed=False, multiprocessors=132, arch="sm_90"):
  """The product's kernel as this process's WGMMA_TILES make it (CUDA text named probe_kernel) and its launch sizes."""
  a = Tensor(np.zeros((m, k), np.float32), dtype=dtype, device="CPU")
  w = Tensor(np.zeros((n, k) if transposed else (k, n), np.float32), dtype=dtype, device="CPU")
  t = a @ (w.T if transposed else w)
  (kern,) = [x for x in schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))[0] if x.op is Ops.KERNEL]
  linear = lower_kernel(normalize(kern)[0], Run("CUDA", parallel=False, device_loops=True, multiprocessors=multiprocessors, arch=arch))
  return renderer.render("probe_kernel", linear), launch_dims(linear)

VARIANTS = [   # (label, the one WGMMA tile: BM, BN, WM, WN, BK, STAGES); STAGES - 2 slices are copied ahead
  ("128x256 s4", (128, 256, 8, 1, 64, 4)),
  ("128x256 s3", (128, 256, 8, 1, 64, 3)),
  ("128x128 s3 (2/SM)", (128, 128, 8, 1, 64, 3)),
  ("128x128 s4", (128, 128, 8, 1, 64, 4)),
  ("256x128 s4", (256, 128, 16, 1, 64, 4)),
]


def timed(fn):
  for _ in range(3): fn()
  torch.cuda.synchronize()
  out = []
  for _ in range(10):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(); fn(); e.record(); e.synchronize(); out.append(s.elapsed_time(e) / 1e3)
  return statistics.median(out)

for (m, k, n, dtype, tr) in [(8192, 8192, 8192, "float16", False), (4096, 4096, 4096, "float16", False),
                             (8192, 8192, 8192, "bfloat16", False), (8192, 8192, 8192, "float16", True)]:
  td = torch.float16 if dtype == "float16" else torch.bfloat16
  A = torch.randn(m, k, device="cuda").to(td)
  W = (torch.randn(n, k, device="cuda") if tr else torch.randn(k, n, device="cuda")).to(td)
  ref = A @ (W.T if tr else W)
  t_torch = timed(lambda: A @ (W.T if tr else W))
  flops = 2 * m * n * k
  print(f"{m}x{k}x{n} {dtype} {'nt' if tr else 'nn'}: torch {t_torch*1e3:.3f} ms {flops/t_torch/1e12:.0f} TFLOP/s", flush=True)
  for label, tile in VARIANTS:
    try:
      tc.WGMMA_TILES = (tile,)
      src, dims = source_for(m, k, n, dtype, tr, dev.multiprocessor_count, dev.arch)
      if "g_wgmma_tile" not in src: print(f"  {label}: not wgmma"); continue
      prog = dev.build(renderer.source([src]), ["probe_kernel"])["probe_kernel"]
      O = torch.empty(m, n, dtype=td, device="cuda")
      run = lambda: prog(O.data_ptr(), A.data_ptr(), W.data_ptr(), global_size=dims[0], local_size=dims[1])
      t = timed(run)
      err = ((O.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
      print(f"  {label:<22} {t*1e3:.3f} ms {flops/t/1e12:6.0f} TFLOP/s  ratio {t_torch/t:.2f}  err {err:.1e}", flush=True)
    except Exception as e: print(f"  {label}: FAILED {repr(e)[:300]}", flush=True)
