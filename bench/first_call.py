"""The first call of a workload in a fresh process (issue 23: each <= 1 s with the search off), split into its parts:
building the graph and running the pipeline to the host program with its kernels rendered (`lower`), compiling them
(`compile`: cc or nvcc, one call per device) and the rest (the run, and what is neither). Inputs are made on the device
before the clock starts and imports are not counted, as in bench/workloads.py; the compile cache is a new empty
directory.

  PYTHONPATH=$PWD python3 bench/first_call.py [--device CUDA] [--only ew,softmax] [--profile 25]

Each workload runs in its own process (bench/isolated.py). --profile N prints the N functions of the first call with
the most cumulative time (cProfile), to find what is not the compiler.
"""
from __future__ import annotations
import argparse, os, shutil, sys, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from isolated import report, run_isolated   # bench/isolated.py, beside this script
from workloads import WORKLOADS, SIZES, make_inputs   # bench/workloads.py: the same workloads and sizes
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def first_call(wid: str, device: str, profile: int) -> dict:
  import runtime.realize as R
  from tensor import Tensor
  from runtime.device import get_device
  w = WORKLOADS[wid]
  ts = [Tensor(a, device=device) for a in make_inputs(w, SIZES[device][wid])]
  dev = get_device(device)
  dev.synchronize()
  parts = {"lower": 0.0, "compile": 0.0}
  def timed(part, fn):
    def wrapper(*a, **k):
      t0 = time.perf_counter()
      try: return fn(*a, **k)
      finally: parts[part] += time.perf_counter() - t0
    return wrapper
  R._lower, R._build = timed("lower", R._lower), timed("compile", R._build)
  if profile:
    import cProfile, io, pstats
    pr = cProfile.Profile()
    pr.enable()
  t0 = time.perf_counter()
  w.graft(*ts).realize()
  dev.synchronize()
  total = time.perf_counter() - t0
  out = {"total": total, **parts, "rest": total - sum(parts.values())}
  if profile:
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(profile)
    out["profile"] = s.getvalue()
  return out


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--device", default="CPU", type=str.upper, choices=sorted(SIZES))
  ap.add_argument("--only", default="ew,sum,softmax,layernorm,matmul")
  ap.add_argument("--profile", type=int, default=0, help="print this many lines of the first call's profile")
  ap.add_argument("--worker", nargs=1, metavar="ID", help=argparse.SUPPRESS)
  args = ap.parse_args()
  if args.worker: return report(lambda: first_call(args.worker[0], args.device, args.profile))
  print(f"{'first call (s)':<16s}{'total':>8s}{'lower':>8s}{'compile':>9s}{'rest':>8s}   on {args.device}, empty cache, search off")
  for wid in args.only.split(","):
    cache = tempfile.mkdtemp(prefix="graft-first-call-")
    env = {**os.environ, "GRAFT_CACHE_DIR": cache, "DEBUG": "0", "DEVICE": args.device}
    env.pop("GRAFT_SEARCH", None); env.pop("GRAFT_CACHE", None)
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", wid, "--device", args.device, "--profile", str(args.profile)]
    try: res, err = run_isolated(cmd, env, 600)
    finally: shutil.rmtree(cache, ignore_errors=True)
    if err: print(f"{wid:<16s} failed: {err}"); continue
    print(f"{wid:<16s}{res['total']:8.3f}{res['lower']:8.3f}{res['compile']:9.3f}{res['rest']:8.3f}", flush=True)
    if args.profile: print(res["profile"])


if __name__ == "__main__":
  main()
