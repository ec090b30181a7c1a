"""How a parallel loop's iterations are dealt to the threads: in chunks taken as threads come free (renderers/c.py
`parallel_pragma`, the default) against OpenMP's static split (one block per thread), on the CPU workloads whose
kernels are parallel loops (bench/workloads.py's attn and mlp), generated code only (GRAFT_EXTERN=0):

  python3 bench/parallel_schedule.py                 # as the machine is
  python3 bench/parallel_schedule.py --busy 1        # with a busy process pinned to core 1 the whole time

Each (workload, schedule) runs in a fresh process with an empty kernel cache, `--rounds` times, alternating, so a slow
stretch of a shared machine falls on both; each process reports the median and minimum of `--calls` warm calls.
`--busy CORE` models a machine whose other processes take part of one core: the thread that runs there gets about
half of it, and a static split waits for that thread's whole block.
"""
from __future__ import annotations
import argparse, math, os, statistics, subprocess, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from isolated import report, run_isolated  # bench/isolated.py, beside this script
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def worker(workload: str, schedule: str, calls: int) -> dict:
  sys.path.insert(0, ROOT)
  import numpy as np
  if schedule == "static":
    import renderers.c
    renderers.c.parallel_pragma = lambda r: "#pragma omp parallel for"
  from tensor import Tensor
  rng = np.random.default_rng(0)
  if workload == "attn":
    args = [Tensor(rng.standard_normal((8, 512, 64), np.float32)).realize() for _ in range(3)]
    fn = lambda q, k, v: (q @ k.transpose(-1, -2) / math.sqrt(64)).softmax(-1) @ v
  else:
    args = [Tensor(rng.standard_normal((256, 1024), np.float32)).realize()]
    for _ in range(3): args += [Tensor(rng.standard_normal((1024, 1024), np.float32) / 32).realize(),
                                Tensor(rng.standard_normal(1024, np.float32)).realize()]
    def fn(x, *params):
      for w, b in zip(params[0::2], params[1::2]): x = x.linear(w, b).relu()
      return x
  for _ in range(3): fn(*args).realize()
  times = []
  for _ in range(calls):
    t0 = time.perf_counter(); fn(*args).realize(); times.append(time.perf_counter() - t0)
  return {"median": statistics.median(times), "min": min(times)}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--only", default="attn,mlp"); ap.add_argument("--threads", type=int, default=2)
  ap.add_argument("--rounds", type=int, default=3); ap.add_argument("--calls", type=int, default=20)
  ap.add_argument("--busy", type=int, default=None, metavar="CORE", help="keep a busy process pinned to this core")
  ap.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
  a = ap.parse_args()
  if a.worker: return report(lambda: worker(*a.worker, a.calls))
  busy = None
  if a.busy is not None:
    busy = subprocess.Popen(["taskset", "-c", str(a.busy), sys.executable, "-c", "while True: pass"])
  results: dict[tuple[str, str], list[dict]] = {}
  try:
    for _ in range(a.rounds):
      for wl in a.only.split(","):
        for schedule in ("dynamic", "static"):
          with tempfile.TemporaryDirectory(prefix="graft-sched-") as cache:
            env = {**os.environ, "GRAFT_CACHE_DIR": cache, "GRAFT_EXTERN": "0", "DEBUG": "0", "DEVICE": "CPU",
                   "OMP_NUM_THREADS": str(a.threads)}
            res, err = run_isolated([sys.executable, os.path.abspath(__file__), "--worker", wl, schedule,
                                     "--calls", str(a.calls)], env, 600)
          if err: print(f"{wl} {schedule}: {err}")
          else: results.setdefault((wl, schedule), []).append(res)
  finally:
    if busy is not None: busy.kill()
  print(f"{a.threads} threads{f', core {a.busy} kept busy' if a.busy is not None else ''}; ms per warm call, "
        f"each round's median (min) in a fresh process:")
  for (wl, schedule), rs in results.items():
    print(f"  {wl:5s} {schedule:8s} " + "  ".join(f"{r['median'] * 1e3:7.2f} ({r['min'] * 1e3:.2f})" for r in rs))


if __name__ == "__main__":
  main()
