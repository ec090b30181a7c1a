"""Loaded kernel libraries stay under the cap (runtime/cpu.py): N distinct kernels built, loaded and called in one
process, once with the default cap and once with no cap (what the CPU device did before it had one).

  python3 bench/library_cap.py                  # 10,000 kernels (the first run spends most of its time in gcc)
  python3 bench/library_cap.py --kernels 300    # a quick run

Phase 1 fills a disk cache with the N libraries, --jobs gcc calls at a time; it is gcc's time and is not measured
(a second run with the same --cache-dir skips it). Phase 2 runs once per cap, each in a fresh process: the CPU device
builds every kernel (a disk hit: checksum and dlopen) and calls it, in turn; then it calls the first 100 again, whose
libraries were unloaded long before (they load again on that call). Reported per process: the libraries of the cache
mapped (read from /proc/self/maps) and the resident memory (VmRSS) before the first kernel and after the last.
"""
from __future__ import annotations
import argparse, concurrent.futures, os, platform, subprocess, sys, time
from tabulate import tabulate

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

NO_CAP = 1_000_000


def kernel_source(n: int) -> str:
  return (f"void affine(float* restrict out, const float* restrict a, int n) {{\n"
          f"  for (int i = 0; i < n; i++) out[i] = a[i] * 2.0f + {n}.0f;\n}}\n")


def mapped_libraries(cache_dir: str) -> int:
  with open("/proc/self/maps") as f:
    return len({ln.split()[-1] for ln in f if ln.rstrip().endswith(".so") and cache_dir in ln})


def rss_mb() -> float:
  with open("/proc/self/status") as f:
    return next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:")) / 1024


def worker(kernels: int, cache_dir: str) -> None:
  import numpy as np
  from rewrite.dtypes import dtypes
  from runtime import cache
  from runtime.buffer import Buffer
  from runtime.device import get_device
  cpu = get_device("CPU")
  a = Buffer("CPU", 16, dtypes.float32).copyin(np.arange(16, dtype=np.float32))
  out = Buffer("CPU", 16, dtypes.float32)
  programs = []
  before = (mapped_libraries(cache_dir), rss_mb())
  t0 = time.perf_counter()
  for n in range(kernels):
    prog = cpu.build(kernel_source(n), ["affine"])["affine"]
    prog(out.handle, a.handle, 16)
    programs.append(prog)
  per_kernel = (time.perf_counter() - t0) / kernels
  peak_mapped = mapped_libraries(cache_dir)
  for n, prog in enumerate(programs[:100]):  # unloaded long ago (under a cap): they load again
    prog(out.handle, a.handle, 16)
    assert out.numpy()[3] == 3 * 2 + n, "a reloaded kernel computed something else"
  after = (mapped_libraries(cache_dir), rss_mb())
  assert cache.stats["build"] == 0, "phase 1 should have built every library"
  print(f"RESULT {before[0]} {before[1]:.1f} {peak_mapped} {after[0]} {after[1]:.1f} {per_kernel * 1e3:.3f}")


def fill_cache(kernels: int, jobs: int) -> None:
  from runtime.cpu import library_path
  t0 = time.perf_counter()
  with concurrent.futures.ThreadPoolExecutor(jobs) as pool:  # gcc runs outside the GIL
    for done, _ in enumerate(pool.map(library_path, (kernel_source(n) for n in range(kernels))), 1):
      if done % 500 == 0: print(f"  phase 1: {done}/{kernels} libraries in the cache, {time.perf_counter() - t0:.0f} s",
                                file=sys.stderr)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--kernels", type=int, default=10_000)
  ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="gcc calls at a time in phase 1")
  ap.add_argument("--cache-dir", default=os.path.join(os.environ.get("TMPDIR", "/tmp"), "graft-bench-library-cap"))
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args()
  os.environ["GRAFT_CACHE_DIR"] = args.cache_dir
  os.environ.pop("GRAFT_CACHE", None)
  if args.worker: return worker(args.kernels, args.cache_dir)
  fill_cache(args.kernels, args.jobs)
  from runtime.cpu import MAX_LIBRARIES
  rows = []
  for label, cap in ((f"default cap ({MAX_LIBRARIES})", MAX_LIBRARIES), ("no cap", NO_CAP)):
    env = {**os.environ, "GRAFT_MAX_LIBRARIES": str(cap)}
    r = subprocess.run([sys.executable, __file__, "--worker", "--kernels", str(args.kernels), "--cache-dir",
                        args.cache_dir], env=env, capture_output=True, text=True)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if r.returncode != 0 or line is None:
      rows.append([label, f"failed: {(r.stderr.strip().splitlines() or ['?'])[-1][:200]}"] + [""] * 5)
      continue
    m0, rss0, peak, m1, rss1, ms = line.split()[1:]
    rows.append([label, f"{int(m0):,}", rss0, f"{int(peak):,}", f"{int(m1):,}", rss1, ms])
  print(tabulate(rows, headers=["libraries", "mapped before", "RSS MB before", f"mapped after {args.kernels:,}",
                                "mapped after 100 reloads", "RSS MB after", "ms per kernel (build+call)"],
                 tablefmt="github"))
  cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
  print(f"{args.kernels:,} distinct kernels; {cpu}, {os.cpu_count()} cores; Python {platform.python_version()}")


if __name__ == "__main__":
  main()
