"""The fused product (x @ W + b).gelu() in fp16 on Hopper's TMA tile (renderers/cuda_tma.py), its epilogue's share and
variants of it, side by side with cuBLAS and torch eager on the same inputs (issue 19's GELU row).

  python bench/tma_epilogue.py [--m 8192 --k 4096 --n 4096] [--only gelu,bare] [--ncu]

Kernels (each lowered here through the CUDA pipeline, not the kernel cache, so each variant is its own kernel, built,
run alone and checked against torch): `bare` x @ W, `bias` x @ W + b, `gelu` (x @ W + b).gelu(), as the tree renders
them; then the gelu kernel's source with one change each (VARIANTS: what each measures). Each figure: the median over
7 rounds of (10 launches back to back between two CUDA events) / 10, after 3 warm-ups, the rounds of all kernels
interleaved (a clock that drifts moves them alike). torch: `x @ W` (cuBLAS), and eager `gelu(x @ W + b)` with
approximate="tanh" (cuBLAS, then the add and the GELU as kernels of their own).
--ncu: launch only the gelu and the bare kernel once each (named probe_gelu, probe_bare), for
`ncu --set full -k regex:probe -c 2 python3 bench/tma_epilogue.py --ncu`.
"""
from __future__ import annotations
import argparse, os, re, statistics, sys
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("GRAFT_EXTERN", "0")
import numpy as np
from rewrite import Ops
from tensor import Tensor
from renderers.cuda import renderer
from rules.gpu import launch_dims
from rules.pipeline import Run, lower_kernel, schedule
from rules.realize import normalize

# the epilogue's stores, `*(data0+i) = v;`, in accumulator order (a lane's e = 0, 1, ...: e and e + 1 are neighbours)
_STORE = re.compile(r"^(\s*)\*\(data0\+(v\d+)\) = (v\d+);$", re.M)
# tanh(u) as tensor/elementwise.py builds it: 2 / (1 + 2^(-2u log2 e)) - 1
_TANH = re.compile(r"float (v\d+) = \((v\d+)\*2\.0f\);\n\s*float v\d+ = \(\1\*\(-1\.4426950408889634f\)\);\n"
                   r"\s*float (v\d+) = exp2f\(v\d+\);\n\s*float (v\d+) = \(\3\+1\.0f\);\n\s*float (v\d+) = \(1\.0f/\4\);\n"
                   r"\s*float (v\d+) = \(\5\*2\.0f\);\n(\s*float v\d+ = \(-1\.0f\);\n)?\s*float (v\d+) = \(\6\+v\d+\);")
HELPERS = r"""
__device__ __forceinline__ float g_rcp_approx(float x) { float r; asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
__device__ __forceinline__ float g_tanh_approx(float x) { float r; asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
"""


def paired_stores(src: str) -> str:
  """The stores of accumulators e and e + 1 (even e: neighbouring columns) as one 4-byte half2 store."""
  found = list(_STORE.finditer(src))
  assert len(found) % 2 == 0 and found, "no stores to pair"
  out, at = [], 0
  for lo, hi in zip(found[::2], found[1::2]):
    out += [src[at:lo.start()], src[lo.end():hi.start()],
            f"{hi.group(1)}*((half2*)(data0+{lo.group(2)})) = __halves2half2({lo.group(3)}, {hi.group(3)});"]
    at = hi.end()
  return "".join(out) + src[at:]


VARIANTS = {   # name: (what it measures, the change to the gelu kernel's source)
  "rcp": ("1/x as rcp.approx.ftz (sigmoid's reciprocal: IEEE division is ~10 instructions and a branch)",
          lambda s: re.sub(r"\(1\.0f/(v\d+)\)", r"g_rcp_approx(\1)", s)),
  "tanh": ("the tanh as one tanh.approx.f32", lambda s: _TANH.sub(r"float \8 = g_tanh_approx(\2);", s)),
  "half2": ("each lane's two neighbouring outputs stored as one half2", paired_stores),
  "tanh+half2": ("both", lambda s: paired_stores(_TANH.sub(r"float \8 = g_tanh_approx(\2);", s))),
  "rcp+half2": ("both", lambda s: paired_stores(re.sub(r"\(1\.0f/(v\d+)\)", r"g_rcp_approx(\1)", s))),
}


def kernel_for(t, name: str, multiprocessors: int, arch: str) -> tuple[str, tuple]:
  """The CUDA text of t's one kernel (named `name`) as this tree lowers it for the GPU, and its launch sizes."""
  (kern,) = [x for x in schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))[0] if x.op is Ops.KERNEL]
  linear = lower_kernel(normalize(kern)[0], Run("CUDA", parallel=False, device_loops=True, multiprocessors=multiprocessors, arch=arch))
  return renderer.render(name, linear), launch_dims(linear)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--m", type=int, default=8192)
  ap.add_argument("--k", type=int, default=4096)
  ap.add_argument("--n", type=int, default=4096)
  ap.add_argument("--only", default="", help="comma-separated kernels (bare, bias, gelu, and the VARIANTS' names)")
  ap.add_argument("--ncu", action="store_true", help="launch probe_gelu and probe_bare once each, nothing else")
  args = ap.parse_args()
  import torch
  from runtime.device import get_device
  dev = get_device("CUDA")
  m, k, n = args.m, args.k, args.n
  host = lambda *s: Tensor(np.zeros(s, np.float32), dtype="float16", device="CPU")
  x, w, b = host(m, k), host(k, n), host(n)
  exprs = {"bare": (x @ w, 2), "bias": (x @ w + b, 3), "gelu": ((x @ w + b).gelu(), 3)}
  torch.manual_seed(0)
  X = torch.randn(m, k, device="cuda").half()
  W = (torch.randn(k, n, device="cuda") / k ** 0.5).half()
  B = torch.randn(n, device="cuda").half()
  refs = {"bare": X @ W, "bias": X @ W + B}
  refs["gelu"] = torch.nn.functional.gelu(refs["bias"], approximate="tanh")
  kernels = {}   # name: (source, launch sizes, operands, reference)
  for name, (t, operands) in exprs.items():
    src, dims = kernel_for(t, f"probe_{name}", dev.multiprocessor_count, dev.arch)
    kernels[name] = (src, dims, operands, refs[name])
  if not args.ncu:
    gelu_src, dims, _, ref = kernels["gelu"]
    for name, (_, change) in VARIANTS.items():
      src = change(gelu_src).replace("probe_gelu", f"probe_{re.sub('[^a-z0-9]', '_', name)}")
      assert src != gelu_src, f"variant {name} changed nothing"
      kernels[name] = (src, dims, 3, ref)
  if args.only: kernels = {nm: v for nm, v in kernels.items() if nm in args.only.split(",")}
  if args.ncu: kernels = {nm: kernels[nm] for nm in ("gelu", "bare")}
  out = torch.empty(m, n, device="cuda", dtype=torch.float16)
  ptrs = [out.data_ptr(), X.data_ptr(), W.data_ptr(), B.data_ptr()]
  runs, errs = {}, {}
  for name, (src, dims, operands, ref) in kernels.items():
    fn = re.search(r"void (probe_\w+)\(", src).group(1)
    try: prog = dev.build(renderer.source([HELPERS + src]), [fn])[fn]
    except Exception as e: print(f"{name}: build FAILED {repr(e)[:400]}", flush=True); continue
    runs[name] = lambda prog=prog, dims=dims, operands=operands: prog(*ptrs[:operands + 1], global_size=dims[0], local_size=dims[1])
    runs[name](); torch.cuda.synchronize()
    errs[name] = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
  if args.ncu: return
  runs["torch x@W (cuBLAS)"] = lambda: X @ W
  runs["torch eager gelu"] = lambda: torch.nn.functional.gelu(X @ W + B, approximate="tanh")
  for fn in runs.values():
    for _ in range(3): fn()
  torch.cuda.synchronize()
  times = {name: [] for name in runs}
  for _ in range(7):
    for name, fn in runs.items():
      s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
      s.record()
      for _ in range(10): fn()
      e.record(); e.synchronize()
      times[name].append(s.elapsed_time(e) / 10)
  med = {name: statistics.median(v) for name, v in times.items()}
  eager, flops = med["torch eager gelu"], 2 * m * n * k
  print(f"device: {torch.cuda.get_device_name()} (torch {torch.__version__}); {m}x{k} @ {k}x{n} fp16, fp32 accumulate; "
        f"median of 7 rounds of 10 launches")
  print(f"{'kernel':<20}{'ms':>8}{'TFLOP/s':>9}{'vs eager':>9}  err      what")
  for name, t in med.items():
    what = VARIANTS[name][0] if name in VARIANTS else ""
    err = f"{errs[name]:.1e}" if name in errs else "   -   "
    print(f"{name:<20}{t:8.3f}{flops / t / 1e9:9.1f}{eager / t:9.3f}  {err}  {what}")


if __name__ == "__main__":
  main()
