"""Issue 19's GPU targets in one process, side by side: Graft's generated code (GRAFT_EXTERN=0: tensor cores through
rules/opt/tensor_core.py) against torch (cuBLAS) on the same inputs.

  python bench/tensor_cores.py [--quick] [--only fp16_8192,gelu]

tc: the tensor-core path the product took (tma: Hopper's warpgroup MMA fed by TMA; wgmma: the same fed by cp.async;
mma: mma.sync; GRAFT_WGMMA=0 keeps mma.sync;
fma: a strict float32 convolution's FMA tile). Rows: fp16 and bf16 products 8192^3 and 4096^3 (float32 accumulation),
(x @ W + b).gelu() in fp16 with x 8192x4096 and W 4096x4096 (torch eager: cuBLAS, then the add and the tanh-GELU as
kernels of their own), float32 4096^3 with TF32 (GRAFT_TF32=1: Graft's generated TF32 kernel -- wgmma for x @ W
(tf32_4096: B stored along j, the transposed product) and for x @ W.T (tf32_4096_nt: B stored along k) -- and Graft's
cuBLAS call, against torch with allow_tf32), and the convolution 32x128x56x56, 128 filters of 3x3, padding 1 (Graft:
the padded copy -- fp16: channels-last, and the filters' copy -- then the implicit product) against cuDNN: fp32 strict
(torch's cudnn.allow_tf32 off), fp32 with TF32 on both sides, fp16.
Each figure: the median over 5 rounds of (10 calls back to back, then one device synchronize) / 10, after 3 warm-up
calls; Graft's call replays its compiled program (no graph rebuilt; `call ms` beside it rebuilds the graph each call,
as a user's loop does). ok: Graft's result against torch's within the dtype's tolerance.
"""
from __future__ import annotations
import argparse, math, os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def timed(fn, sync, calls: int = 10, rounds: int = 5) -> float:
  """Seconds per call."""
  for _ in range(3): fn()
  sync()
  out = []
  for _ in range(rounds):
    t0 = time.perf_counter()
    for _ in range(calls): fn()
    sync()
    out.append((time.perf_counter() - t0) / calls)
  return statistics.median(out)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="256-sized problems (a smoke run)")
  ap.add_argument("--device", default="CUDA", help="CUDA, or CPU for a smoke run of the script itself")
  ap.add_argument("--only", default="", help="comma-separated row names")
  ap.add_argument("--graft-only", action="store_true", help="no torch rows (comparing Graft's tiles: GRAFT_TC_TILE)")
  args = ap.parse_args()
  os.environ.setdefault("GRAFT_EXTERN", "0")
  import numpy as np, torch
  from tensor import Tensor
  from runtime import realize as rr
  from runtime.device import get_device
  dev, on_gpu = get_device(args.device), args.device == "CUDA"
  sync, tdev = dev.synchronize, "cuda" if on_gpu else "cpu"
  tsync = torch.cuda.synchronize if on_gpu else (lambda: None)
  torch.backends.cuda.matmul.allow_tf32 = False
  big, mid = (256, 128) if args.quick else (8192, 4096)
  rng = np.random.default_rng(0)
  rows = []

  def run(name, shapes, dtype, graft_fn, torch_fn, flops, tol, env=None):
    if args.only and name not in args.only.split(","): return
    saved = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
      arrays = [rng.standard_normal(s, dtype=np.float32) * (1 / np.sqrt(s[-1]) if i else 1) for i, s in enumerate(shapes)]
      td = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}[dtype]
      tt = [torch.from_numpy(a).to(tdev, td) for a in arrays]
      gt = [Tensor(a, dtype=dtype, device=args.device).realize() for a in arrays]
      t0 = time.perf_counter(); first = graft_fn(*gt).realize(); sync(); cold = time.perf_counter() - t0
      program, inputs = rr.find_program([(graft_fn(*gt).uop, args.device)])   # the cached program and its input buffers
      kernels = " ".join(ck.name for ck in program.kernels_called()) or "extern"
      sources = [ck.source for ck in program.kernels_called()]
      tc = "tma" if any("g_tma_pipeline" in k for k in sources) else "wgmma" if any("g_wgmma_tile" in k for k in sources) else "mma" if any("g_mma_tile" in k for k in sources) else \
        "fma" if any("g_fma_tile" in k for k in sources) else "-"
      g = timed(lambda: program.run(inputs), sync)
      call = timed(lambda: graft_fn(*gt).realize(), sync, calls=3, rounds=3)
      ref = torch_fn(*tt)
      t = math.nan if args.graft_only else timed(lambda: torch_fn(*tt), tsync)
      got, want = first.numpy().astype(np.float32), ref.float().cpu().numpy()
      err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
      rows.append((name, dtype, g * 1e3, call * 1e3, flops / g / 1e12, t * 1e3, flops / t / 1e12, t / g, err < tol, err, tc, cold, kernels))
    except Exception as e:   # a row that fails keeps its place, with the error
      rows.append((name, dtype, None, None, None, None, None, None, False, repr(e)[:200], "-", None, ""))
    finally:
      for k, v in saved.items():
        if v is None: os.environ.pop(k, None)
        else: os.environ[k] = v

  mm = lambda a, b: a @ b
  for n in (big, mid):
    for dt in ("float16", "bfloat16"):
      run(f"{'fp16' if dt == 'float16' else 'bf16'}_{n}", [(n, n), (n, n)], dt, mm, mm, 2 * n ** 3, 1e-2)
  gelu_t = lambda x, w, b: torch.nn.functional.gelu(x @ w + b, approximate="tanh")
  run("gelu", [(big, mid), (mid, mid), (mid,)], "float16", lambda x, w, b: (x @ w + b).gelu(), gelu_t, 2 * big * mid * mid, 1e-2)

  def tf32(fn):
    def with_tf32(*a):
      torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
      try: return fn(*a)
      finally: torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    return with_tf32
  torch.backends.cudnn.allow_tf32 = False   # (torch's default is on for convolutions)
  run(f"tf32_{mid}", [(mid, mid), (mid, mid)], "float32", mm, tf32(mm), 2 * mid ** 3, 1e-2, env={"GRAFT_TF32": "1"})
  nt = lambda a, b: a @ b.T
  run(f"tf32_{mid}_nt", [(mid, mid), (mid, mid)], "float32", nt, tf32(nt), 2 * mid ** 3, 1e-2, env={"GRAFT_TF32": "1"})
  run(f"tf32_{mid}_cublas", [(mid, mid), (mid, mid)], "float32", mm, tf32(mm), 2 * mid ** 3, 1e-2, env={"GRAFT_TF32": "1", "GRAFT_EXTERN": "1"})
  run(f"fp32_{mid}_strict", [(mid, mid), (mid, mid)], "float32", mm, mm, 2 * mid ** 3, 1e-4)
  n, c, hw = (2, 32, 8) if args.quick else (32, 128, 56)
  conv_g, conv_t = lambda x, w: x.conv2d(w, padding=1), lambda x, w: torch.nn.functional.conv2d(x, w, padding=1)
  conv_shapes, conv_flops = [(n, c, hw, hw), (c, c, 3, 3)], 2 * n * c * hw * hw * c * 9
  run("conv_fp32_strict", conv_shapes, "float32", conv_g, conv_t, conv_flops, 1e-4)
  run("conv_tf32", conv_shapes, "float32", conv_g, tf32(conv_t), conv_flops, 1e-2, env={"GRAFT_TF32": "1"})
  run("conv_fp16", conv_shapes, "float16", conv_g, conv_t, conv_flops, 1e-2)

  print(f"device: {torch.cuda.get_device_name() if on_gpu else args.device}  (torch {torch.__version__}; Graft GRAFT_EXTERN={os.environ['GRAFT_EXTERN']} "
        f"except the tf32_cublas row; GRAFT_TC_TILE={os.environ.get('GRAFT_TC_TILE', '')!r})")
  print(f"{'row':<18}{'dtype':<10}{'graft ms':>10}{'call ms':>9}{'TFLOP/s':>9}{'torch ms':>10}{'TFLOP/s':>9}{'ratio':>7}  ok      tc  cold s  kernels")
  for r in rows:
    name, dt, g, call, gf, t, tf, ratio, ok, err, tc, cold, kernels = r
    if g is None: print(f"{name:<18}{dt:<10} FAILED {err}"); continue
    print(f"{name:<18}{dt:<10}{g:10.3f}{call:9.3f}{gf:9.1f}{t:10.3f}{tf:9.1f}{ratio:7.2f}  {'yes' if ok else 'NO'} {err:.0e} "
          f"{tc:>6}{cold:7.2f}  {kernels}")


if __name__ == "__main__":
  main()
