"""Reductions of few, long rows on a GPU, side by side in one process: Graft's one kernel (a block of lanes per row,
or a thread per output for a column sum), Graft's split reduction (partials over many blocks into a scratch buffer,
then a small kernel combining them: rules/split.py), what Graft picks when neither is forced (both
timed on its first call, runtime/pick.py), and torch where it is installed.

  python3 bench/gpu_reduce.py [--device CUDA] [--quick]

Each figure is the median of 20 warm calls after 3 warm-ups, in milliseconds, each call waited for (the device
synchronized); Graft rebuilds the graph each call (its compiled kernels and host program are cached), so its figures
include Python's cost of a call. GB/s counts the input read once. "x torch" is torch's time over Graft's picked time
(above 1: Graft is faster). A "-" under split: the heuristic offers no split for that reduction (the one kernel
already fills the GPU, or the device is not a GPU). `--quick` uses small shapes (a smoke run, on CPU too).
"""
from __future__ import annotations
import argparse, os, statistics, sys, time
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

CASES = [  # (shape, what, the reduction: of a Graft tensor, a torch tensor or a numpy array alike)
  ((8192, 8192), "sum()", lambda x: x.sum()),
  ((8192, 8192), "max()", lambda x: x.max()),
  ((1 << 26,), "sum()", lambda x: x.sum()),
  ((8192, 8192), "sum(0)", lambda x: x.sum(0)),
  ((65536, 1024), "sum(0)", lambda x: x.sum(0)),
  ((16, 1 << 22), "sum(1)", lambda x: x.sum(1)),
  ((4, 1 << 24), "mean(1)", lambda x: x.mean(1)),
  ((8192, 8192), "sum(1)", lambda x: x.sum(1)),   # many rows: no split offered, the control
]
QUICK = [((1024, 1024), "sum()", CASES[0][2]), ((8192, 96), "sum(0)", CASES[3][2]), ((4, 65536), "sum(1)", CASES[5][2])]


def median_ms(fn, sync) -> float:
  for _ in range(3): fn(); sync()
  times = []
  for _ in range(20):
    t0 = time.perf_counter(); fn(); sync(); times.append(time.perf_counter() - t0)
  return statistics.median(times) * 1e3


def graft_row(x, reduce, want, sync) -> tuple[float, float | None, float, str]:
  """(one kernel ms, split ms or None where none is offered, picked ms, what the pick chose and why)."""
  import numpy as np
  from runtime import pick
  from runtime.realize import last_program
  times = {}
  for mode in ("0", "1", ""):
    os.environ["GRAFT_SPLIT_REDUCE"] = mode
    if mode == "": pick.forget()
    got = reduce(x).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-3, atol=1e-3 * max(1.0, float(np.abs(want).max())))
    if mode == "1" and len(last_program().kernels_called()) == 1: times[mode] = None; continue
    times[mode] = median_ms(lambda: reduce(x).realize(), sync)
  why = "; ".join(last_program().ran) or "nothing to pick"
  os.environ.pop("GRAFT_SPLIT_REDUCE")
  return times["0"], times["1"], times[""], why


def main() -> None:
  import numpy as np
  from tensor import Tensor
  p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  p.add_argument("--device", default=os.environ.get("DEVICE", "CUDA"))
  p.add_argument("--quick", action="store_true", help="small shapes: a smoke run")
  args = p.parse_args()
  try: import torch
  except ImportError: torch = None
  on_gpu = args.device.upper().startswith("CUDA")
  if torch is not None and on_gpu and not torch.cuda.is_available(): torch = None
  from runtime.device import get_device
  dev = get_device(args.device)
  print(f"device: {getattr(dev, 'device_name', args.device)}; torch: {torch.__version__ if torch else 'not installed'}")
  print(f"| {'input':<14s} | {'reduce':<7s} | {'one kernel':>10s} | {'split':>8s} | {'picked':>8s} | {'GB/s':>6s} | "
        f"{'torch':>8s} | {'x torch':>7s} | pick |")
  print(f"|{'-' * 16}|{'-' * 9}|{'-' * 12}|{'-' * 10}|{'-' * 10}|{'-' * 8}|{'-' * 10}|{'-' * 9}|------|")
  rng = np.random.default_rng(0)
  for shape, what, reduce in (QUICK if args.quick else CASES):
    a = rng.standard_normal(shape, dtype=np.float32)
    want = reduce(a.astype(np.float64))   # numpy arrays have the same methods
    one, split, picked, why = graft_row(Tensor(a, device=args.device), reduce, want, dev.synchronize)
    torch_ms = None
    if torch is not None:
      ta = torch.from_numpy(a).to("cuda" if on_gpu else "cpu")
      torch_ms = median_ms(lambda: reduce(ta), torch.cuda.synchronize if on_gpu else (lambda: None))
    gbs = a.nbytes / picked / 1e6
    fmt = lambda ms: "-" if ms is None else f"{ms:8.3f}"
    print(f"| {'x'.join(map(str, shape)):<14s} | {what:<7s} | {fmt(one):>10s} | {fmt(split):>8s} | {fmt(picked):>8s} | "
          f"{gbs:6.0f} | {fmt(torch_ms):>8s} | {'-' if torch_ms is None else f'{torch_ms / picked:7.2f}':>7s} | {why} |")


if __name__ == "__main__":
  main()
