"""The fused product (x @ W + b).gelu() in fp16 on Hopper's TMA tile (renderers/cuda_tma.py), its epilogue's share and
variants of it, side by side with cuBLAS and torch eager on the same inputs (issue 19's GELU row).

  python bench/tma_epilogue.py [--m 8192 --k 4096 --n 4096] [--only gelu,bare] [--ncu]

Kernels (each lowered here through the CUDA pipeline, not the kernel cache, so each variant is its own kernel, built,
run alone and checked against torch): `bare` x @ W, `bias` x @ W + b, `gelu` (x @ W + b).gelu(), as the tree renders
them; `bare-nt` x @ W.T (B stored along k: wgmma reads it K-major, no transpose); `bare-128x128` x @ W on 128x128 tiles
(6 slices in flight); `-cols8`, `-rows16`, `-cols4`: blocks in groups of 8 column tiles (16 row tiles, 4 column tiles:
rules/opt/tensor_core.py BLOCK_GROUP; delivered: 8 rows); `-block-a-tile`: a block per tile, `bare-persistent`: a block a
multiprocessor looping over the tiles (rules/opt/tensor_core.py PERSISTENT_SLICES: delivered, persistent where k is at most
64 slices of 64); `NAME-nocluster` / `NAME-cluster4`: kernel NAME with no cluster or in clusters of 4 blocks sharing
B's tile (rules/opt/tensor_core.py TMA_CLUSTER; delivered: 2 where persistent); `NAME-lanes` / `NAME-whole` /
`NAME-parts4`: the output stored by the lanes (the kernel before TMA stores), by TMA from a staging tile of the whole
output tile, or of a quarter of its columns at a time (rules/opt/tensor_core.py TMA_STORE_PARTS; delivered: halves); then a kernel's source with one change
each (VARIANTS: what each measures; `bare-nostore` is a probe of the stores' share). `grid`: the blocks launched (a
persistent kernel: a block a multiprocessor, in whole clusters the GPU holds at once). Each figure: the median
over 7 rounds of (10 launches back to back between two CUDA events) / 10, after 3 warm-ups, the rounds of all kernels
interleaved (a clock that drifts moves them alike). torch: `x @ W` (cuBLAS), and eager `gelu(x @ W + b)` with
approximate="tanh" (cuBLAS, then the add and the GELU as kernels of their own).
--ncu: launch only the gelu and the bare kernel (probe_gelu, probe_bare) and torch's x @ W once each, for
`ncu --set full -k regex:"probe|gemm|xmma" -c 3 python3 bench/tma_epilogue.py --ncu`.
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

# the sigmoid of gelu as tensor/elementwise.py builds it, x sigmoid(2u) = x / (1 + 2^(y)) (y = -2u log2 e; its
# reciprocal approximate: a 16-bit epilogue)
_SIGMOID = re.compile(r"float (v\d+) = exp2f\((v\d+)\);\n\s*float (v\d+) = \(\1\+1\.0f\);\n\s*float (v\d+) = g_rcp_approx\(\3\);")
HELPERS = r"""
__device__ __forceinline__ float g_tanh_approx(float x) { float r; asm("tanh.approx.f32 %0, %1;" : "=f"(r) : "f"(x)); return r; }
"""


def unpaired(src: str) -> str:
  """The epilogue as it was before pairs: each 16-bit output stored alone, the reciprocal IEEE's 1.0f/x."""
  pairs = dict((p, (a, b)) for p, a, b in re.findall(r"half2 (v\d+) = __halves2half2\((v\d+), (v\d+)\);", src))
  def split(m):
    a, b = pairs[m.group(3)]
    return f"{m.group(1)}*(data0+{m.group(2)}) = {a};\n{m.group(1)}*(data0+{m.group(2)}+1) = {b};"
  out = re.sub(r"^(\s*)\*\(half2\*\)\(data0\+(v\d+)\) = (v\d+);$", split, src, flags=re.M)
  return re.sub(r"g_rcp_approx\((v\d+)\)", r"(1.0f/\1)", out)


VARIANTS = {   # name: (the kernel it changes, what it measures, the change to its source)
  "gelu-before": ("gelu-lanes", "the lanes' epilogue before pairs: each output stored alone (2 bytes), IEEE 1.0f/x (main 03ddfa3)", unpaired),
  "bare-before": ("bare-lanes", "the same for the bare product (each output stored alone)", unpaired),
  "bare-nostore": ("bare-lanes-nocluster", "(a probe, not a kernel) the stores made only where a value is 12345: the product and "
                   "the conversions without the stores' traffic",
                   lambda s: re.sub(r"^(\s*)(\*\(half2\*\)\(data0\+v\d+\) = (v\d+);)$", r"\1if (__low2float(\3) == 12345.0f) \2", s, flags=re.M)),
  "gelu-tanh": ("gelu", "the sigmoid as one tanh.approx.f32, 1/(1 + 2^y) = (1 + tanh(-y ln2 / 2)) / 2: one MUFU op a value "
                "in place of two (not delivered: relative error 2^-11 of tanh, large against gelu's negative tail)",
                lambda s: _SIGMOID.sub(r"float \4 = fmaf(0.5f, g_tanh_approx(\2*(-0.34657359f)), 0.5f);", s)),
}


def kernel_for(t, name: str, multiprocessors: int, arch: str, patch: dict | None = None) -> tuple[str, tuple]:
  """The CUDA text of t's one kernel (named `name`) as this tree lowers it for the GPU, with the settings in `patch`
  where given (rules/opt/tensor_core.py WGMMA_TILES, BLOCK_GROUP, PERSISTENT_SLICES, TMA_CLUSTER), and its launch
  sizes."""
  import rules.opt.tensor_core as tc
  saved = {k: getattr(tc, k) for k in patch or {}}
  for k, v in (patch or {}).items(): setattr(tc, k, v)
  try:
    (kern,) = [x for x in schedule([t.uop], ["CPU"], Run("CPU", parallel=False, device_loops=True))[0] if x.op is Ops.KERNEL]
    linear = lower_kernel(normalize(kern)[0], Run("CUDA", parallel=False, device_loops=True, multiprocessors=multiprocessors, arch=arch))
    return renderer.render(name, linear), launch_dims(linear)
  finally:
    for k, v in saved.items(): setattr(tc, k, v)


def main() -> None:
  ap = argparse.ArgumentParser()
  ap.add_argument("--m", type=int, default=8192)
  ap.add_argument("--k", type=int, default=4096)
  ap.add_argument("--n", type=int, default=4096)
  ap.add_argument("--only", default="", help="comma-separated kernels (bare, bias, gelu, bare-nt, bare-128x128, the block "
                  "orders gelu-cols8, gelu-rows16, gelu-cols4, bare-cols8, bare-rows16, gelu-block-a-tile, bare-block-a-tile, bare-persistent, and VARIANTS)")
  ap.add_argument("--ncu", action="store_true", help="launch probe_gelu, probe_bare and torch's x @ W once each, nothing else")
  args = ap.parse_args()
  import torch
  from runtime.device import get_device
  dev = get_device("CUDA")
  m, k, n = args.m, args.k, args.n
  host = lambda *s: Tensor(np.zeros(s, np.float32), dtype="float16", device="CPU")
  x, w, b, wt = host(m, k), host(k, n), host(n), host(n, k)
  torch.manual_seed(0)
  X = torch.randn(m, k, device="cuda").half()
  W = (torch.randn(k, n, device="cuda") / k ** 0.5).half()
  B = torch.randn(n, device="cuda").half()
  WT = W.T.contiguous()
  out = torch.empty(m, n, device="cuda", dtype=torch.float16)
  # name: (the tensor, its parameters after the output, the WGMMA tiles it is planned with)
  gelu, order = (x @ w + b).gelu(), lambda *g: {"BLOCK_GROUP": g}
  exprs = {"bare": (x @ w, (X, W), None), "bias": (x @ w + b, (X, W, B), None), "gelu": (gelu, (X, W, B), None),
           "bare-nt": (x @ wt.T, (X, WT), None), "bare-128x128": (x @ w, (X, W), {"WGMMA_TILES": ((128, 128, 8, 1, 64, 4),)}),
           "gelu-cols8": (gelu, (X, W, B), order(8, "cols")), "gelu-rows16": (gelu, (X, W, B), order(16, "rows")),
           "gelu-cols4": (gelu, (X, W, B), order(4, "cols")), "bare-cols8": (x @ w, (X, W), order(8, "cols")),
           "bare-rows16": (x @ w, (X, W), order(16, "rows")),
           "gelu-block-a-tile": (gelu, (X, W, B), {"PERSISTENT_SLICES": 0}), "bare-block-a-tile": (x @ w, (X, W), {"PERSISTENT_SLICES": 0}),
           "bare-persistent": (x @ w, (X, W), {"PERSISTENT_SLICES": 1 << 30})}
  only = args.only.split(",") if args.only else None
  # NAME-lanes, NAME-whole, NAME-parts4: kernel NAME with its output stored by the lanes (rules/opt/tensor_core.py
  # TMA_STORE_PARTS = 0, the kernel before), staged whole (1 part: 64 KiB for 128x256, one slice fewer in flight) or in
  # 4 parts (delivered: 2)
  exprs.update({f"{nm}-{tag}": (t, params, {**(patch or {}), "TMA_STORE_PARTS": c}) for nm, (t, params, patch) in list(exprs.items())
                for tag, c in (("lanes", 0), ("whole", 1), ("parts4", 4))})
  # NAME-nocluster, NAME-cluster4: kernel NAME with no clusters (rules/opt/tensor_core.py TMA_CLUSTER = 1: each block
  # copies all of B) or in clusters of 4 (each copies a quarter of B)
  exprs.update({f"{nm}-{tag}": (t, params, {**(patch or {}), "TMA_CLUSTER": c}) for nm, (t, params, patch) in list(exprs.items())
                for tag, c in (("nocluster", 1), ("cluster4", 4))})
  if args.ncu: only = ["gelu", "bare"]
  if only: exprs = {nm: e for nm, e in exprs.items() if nm in only or any(VARIANTS.get(v, ("",))[0] == nm for v in only)}
  kernels = {}   # name: (source, launch sizes, parameters)
  for name, (t, params, patch) in exprs.items():
    kernels[name] = (*kernel_for(t, f"probe_{name.replace('-', '_')}", dev.multiprocessor_count, dev.arch, patch), params)
  if not args.ncu:
    for name, (base, _, change) in VARIANTS.items():
      if base not in kernels: continue
      src, dims, params = kernels[base]
      new = change(src).replace(f"probe_{base}(", f"probe_{name.replace('-', '_')}(")
      assert new != src, f"variant {name} changed nothing"
      kernels[name] = (new, dims, params)
  if only: kernels = {nm: v for nm, v in kernels.items() if nm in only}
  runs, errs, grids = {}, {}, {}
  refs = {}
  for name, (src, dims, params) in kernels.items():
    fn = re.search(r"void (probe_\w+)\(", src).group(1)
    try: prog = dev.build(renderer.source([HELPERS + src]), [fn])[fn]
    except Exception as e: print(f"{name}: build FAILED {repr(e)[:400]}", flush=True); continue
    ptrs = [out.data_ptr(), *(p.data_ptr() for p in params)]
    runs[name] = lambda prog=prog, dims=dims, ptrs=ptrs: prog(*ptrs, global_size=dims[0], local_size=dims[1])
    out.zero_(); runs[name](); torch.cuda.synchronize()   # (zeroed: a tile it missed shows as an error)
    grids[name] = prog.grid(dims[0], dims[1])[0]
    if args.ncu: continue
    kind = "gelu" if "gelu" in name else "bias" if "bias" in name else "bare"
    if kind not in refs:
      refs[kind] = {"bare": lambda: X @ W, "bias": lambda: X @ W + B,
                    "gelu": lambda: torch.nn.functional.gelu(X @ W + B, approximate="tanh")}[kind]().float()
    errs[name] = ((out.float() - refs[kind]).abs().max() / refs[kind].abs().max()).item()
  runs["torch x@W (cuBLAS)"] = lambda: X @ W
  if args.ncu: runs["torch x@W (cuBLAS)"](); torch.cuda.synchronize(); return
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
        f"median of 7 rounds of 10 launches (min-max of the rounds)")
  print(f"{'kernel':<20}{'ms':>8}{'min-max':>15}{'TFLOP/s':>9}{'vs eager':>9}  err      what")
  for name, t in med.items():
    what = (VARIANTS[name][1] if name in VARIANTS else "") + (f" (grid {grids[name]})" if name in grids else "")
    err = f"{errs[name]:.1e}" if name in errs else "   -   "
    spread = f"{min(times[name]):.3f}-{max(times[name]):.3f}"
    print(f"{name:<20}{t:8.3f}{spread:>15}{flops / t / 1e9:9.1f}{eager / t:9.3f}  {err}  {what}")


if __name__ == "__main__":
  main()
