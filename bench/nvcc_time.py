"""nvcc's time per generated CUDA kernel, by phase (`nvcc -time`): each kernel of a workload (bench/workloads.py, the
GPU's sizes) alone in a translation unit, compiled as the CUDA device compiles it (`runtime.cuda.target_flags`:
a self-contained source without cuda_runtime.h) and as a plain `nvcc -cubin -arch=sm_90` of the same source does
(cuda_runtime.h included), alternating, median of --repeats. Needs nvcc, not a GPU; the cache is not used.

  PYTHONPATH=$PWD python3 bench/nvcc_time.py [--only attn,softmax] [--repeats 5] [--quick]

A first call compiles its kernels in up to 8 nvcc calls side by side (runtime/realize.py `compile_groups`), so it
waits for its slowest kernel: the `max` line. Inputs are made on the CPU at the GPU's sizes (ew, sum, softmax and
layernorm take 1 GiB each).
"""
from __future__ import annotations
import argparse, csv, os, re, statistics, subprocess, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from workloads import WORKLOADS, make_inputs, sizes_for   # bench/workloads.py: the same workloads and sizes
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PHASES = ("gcc (preprocessing 1)", "cicc", "ptxas")


def kernel_sources(wid: str, quick: bool) -> list[str]:
  from tensor import Tensor
  w = WORKLOADS[wid]
  ts = [Tensor(a, device="CPU") for a in make_inputs(w, sizes_for("CUDA", quick)[wid])]
  return w.graft(*ts).kernel_sources(device="CUDA")


def nvcc_time(nvcc: str, source: str, flags: list[str], work: str) -> dict[str, float]:
  """Seconds of each phase of one nvcc call, and its wall time."""
  src, out, times = (os.path.join(work, n) for n in ("k.cu", "k.cubin", "time.csv"))
  with open(src, "w") as f: f.write(source)
  if os.path.exists(times): os.remove(times)
  t0 = time.perf_counter()
  subprocess.run([nvcc, "-cubin", *flags, "-time", times, "-o", out, src], check=True, capture_output=True)
  wall = time.perf_counter() - t0
  with open(times) as f:
    rows = {r[1].strip(): float(r[6]) / 1e3 for r in csv.reader(f) if len(r) > 6 and r[7].strip() == "ms"}
  return {**{p: rows.get(p, 0.0) for p in PHASES}, "wall": wall}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--only", default="attn")
  ap.add_argument("--repeats", type=int, default=5)
  ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
  args = ap.parse_args()
  from renderers.cuda import renderer
  from runtime import cuda
  nvcc = cuda.find_nvcc()
  ways = {"device": lambda s: cuda.target_flags(s, "sm_90"), "headers": lambda s: ["-arch=sm_90"]}
  print(f"nvcc seconds per kernel, median of {args.repeats}: {' / '.join(PHASES)} / wall")
  for wid in args.only.split(","):
    sources = [renderer.source([k]) for k in kernel_sources(wid, args.quick)]
    worst = {w: 0.0 for w in ways}
    with tempfile.TemporaryDirectory() as work:
      for i, source in enumerate(sources):
        runs = {w: [] for w in ways}
        for _ in range(args.repeats):
          for w, flags in ways.items(): runs[w].append(nvcc_time(nvcc, source, flags(source), work))
        for w, rs in runs.items():
          med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
          worst[w] = max(worst[w], med["wall"])
          name = re.findall(r"void (\w+)\(", source)[-1]
          print(f"{wid:<10s} {name:<28s} {len(source):7d} chars  {w:<8s}"
                + "".join(f"{med[p]:8.3f}" for p in PHASES) + f"{med['wall']:8.3f}", flush=True)
    print(f"{wid:<10s} {'max (a first call waits for it)':<42s}  " + "  ".join(f"{w} {t:.3f}" for w, t in worst.items()))


if __name__ == "__main__":
  main()
