"""The reference workloads of WORKLOADS.md: Graft side by side with numpy and torch, cold and warm, as one table.

  python bench/workloads.py                      # every CPU workload at its CPU size (several minutes)
  python bench/workloads.py --only ew,sum        # some of them
  python bench/workloads.py --quick              # small sizes, 3 repeats: a smoke run
  python bench/workloads.py --device CUDA        # the GPU table: Graft, torch eager and torch.compile
  python bench/workloads.py --peers torch        # only these peers beside Graft

How each figure is taken (WORKLOADS.md):
  - Every (workload, framework) pair runs in a fresh Python process of its own, so no framework's thread pool or
    caches are warm for another (two OpenMP runtimes in one process also spin against each other on 2 cores).
    Graft gets an empty GRAFT_CACHE_DIR there, torch.compile an empty TORCHINDUCTOR_CACHE_DIR.
  - cold: wall time of that process's first call (graph build, scheduling, codegen, compile, run); the inputs
    already sit on the device, and imports are not counted.
  - warm: median of 20 calls after 3 warm-ups (and at least WARM_SECONDS of calls) in the same process. Graft rebuilds its graph every call (its kernel
    cache may hit). On a GPU every framework's call is timed alike: the wall clock from the call to the device
    synchronized after it. (torch was timed with CUDA events before: they leave out the host's return from the
    synchronize, which Graft's clock counted: 4-13 us of a 0.3-0.6 ms call on an H200)
  - rate: GB/s over the bytes read and written once each, or GFLOP/s, or plain ms, as the table of WORKLOADS.md
    says; from the warm median.
  - ok: Graft's result of its first warm-up call, against numpy in float64 on the same float32 inputs (the largest
    absolute error, relative to the largest absolute reference value, within the workload's tolerance).
  - graft/numpy, graft/torch: the warm speed ratio, the peer's warm time over Graft's (above 1: Graft is faster).
DEBUG is forced to 0 in the measured processes: its per-kernel timing waits for every kernel.

Inputs are numpy random normal (seed 0), float32. The mlp's weights are scaled by 1/sqrt(width) so that its
activations stay of order 1. A workload that crashes or computes a wrong result keeps its row, with the error noted
below the table.
"""
from __future__ import annotations
import argparse, itertools, math, os, shutil, statistics, sys, tempfile, time
from dataclasses import dataclass
from typing import Callable

import numpy as np
from isolated import report, run_isolated  # bench/isolated.py, beside this script

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ---- the workloads: inputs, and the same computation written for each framework ----

def softmax_np(x, axis=-1):
  e = np.exp(x - x.max(axis, keepdims=True))
  return e / e.sum(axis, keepdims=True)


def layernorm_np(x, eps=1e-5):
  c = x - x.mean(-1, keepdims=True)
  return c / np.sqrt((c * c).mean(-1, keepdims=True) + eps)


def conv_np(x, w, pad=1):
  """Cross-correlation, stride 1, through the sliding windows of the padded input."""
  from numpy.lib.stride_tricks import sliding_window_view
  win = sliding_window_view(np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad))), w.shape[2:], axis=(2, 3))
  return np.tensordot(win, w, axes=((1, 4, 5), (1, 2, 3))).transpose(0, 3, 1, 2)  # (N, H, W, O) -> (N, O, H, W)


def gelu_np(x):
  return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def mlp_np(x, *params):
  for w, b in zip(params[0::2], params[1::2]): x = np.maximum(x @ w.T + b, 0)
  return x


def attn_np(q, k, v):
  return softmax_np(q @ k.transpose(0, 2, 1) / math.sqrt(q.shape[-1])) @ v


def mlp_graft(x, *params):
  for w, b in zip(params[0::2], params[1::2]): x = x.linear(w, b).relu()
  return x


def mlp_torch(x, *params):
  import torch
  for w, b in zip(params[0::2], params[1::2]): x = torch.relu(torch.nn.functional.linear(x, w, b))
  return x


def matmul16_graft(a, b):
  from tensor import dtypes
  return a.matmul(b, dtype=dtypes.float32)


@dataclass(frozen=True)
class Workload:
  id: str
  inputs: Callable[[dict, np.random.Generator], list[np.ndarray]]
  graft: Callable
  numpy: Callable
  torch: Callable
  amount: Callable[[dict], float]     # bytes or flops of one call (unused for ms workloads)
  unit: str                           # "GB/s", "GFLOP/s", "TFLOP/s" or "ms"
  describe: Callable[[dict], str]
  tol: float = 1e-4


def _normal(rng, shape, dtype=np.float32): return rng.standard_normal(shape, dtype=np.float32).astype(dtype)


def _mlp_inputs(s, rng):
  x = _normal(rng, (s["batch"], s["width"]))
  params = []
  for _ in range(s["layers"]):
    params += [_normal(rng, (s["width"], s["width"])) / np.float32(math.sqrt(s["width"])), _normal(rng, (s["width"],))]
  return [x] + params


def _n(s): return math.prod(s["shape"])


def _sized(w: "Workload", id: str) -> "Workload":
  return Workload(id, w.inputs, w.graft, w.numpy, w.torch, w.amount, w.unit, w.describe, w.tol)


WORKLOADS: dict[str, Workload] = {w.id: w for w in [
  Workload("ew", lambda s, rng: [_normal(rng, s["shape"]) for _ in range(3)],
           lambda a, b, c: (a * b + c).relu(), lambda a, b, c: np.maximum(a * b + c, 0),
           lambda a, b, c: __import__("torch").relu(a * b + c),
           lambda s: 4 * 4 * _n(s), "GB/s", lambda s: "x".join(map(str, s["shape"]))),
  Workload("sum", lambda s, rng: [_normal(rng, s["shape"])],
           lambda x: x.sum(axis=1), lambda x: x.sum(axis=1), lambda x: x.sum(1),
           lambda s: 4 * _n(s), "GB/s", lambda s: "x".join(map(str, s["shape"]))),
  Workload("softmax", lambda s, rng: [_normal(rng, s["shape"])],
           lambda x: x.softmax(1), lambda x: softmax_np(x, 1), lambda x: __import__("torch").softmax(x, 1),
           lambda s: 2 * 4 * _n(s), "GB/s", lambda s: "x".join(map(str, s["shape"]))),
  Workload("layernorm", lambda s, rng: [_normal(rng, s["shape"])],
           lambda x: x.layernorm(1, eps=1e-5), layernorm_np,
           lambda x: __import__("torch").nn.functional.layer_norm(x, x.shape[-1:], eps=1e-5),
           lambda s: 2 * 4 * _n(s), "GB/s", lambda s: "x".join(map(str, s["shape"]))),
  Workload("matmul", lambda s, rng: [_normal(rng, (s["m"], s["k"])), _normal(rng, (s["k"], s["n"]))],
           lambda a, b: a @ b, lambda a, b: a @ b, lambda a, b: a @ b,
           lambda s: 2 * s["m"] * s["n"] * s["k"], "GFLOP/s", lambda s: f"{s['m']}x{s['k']} @ {s['k']}x{s['n']}"),
  # float16 inputs accumulated in float32; numpy has no such product, so its reference multiplies in float64
  Workload("matmul16", lambda s, rng: [_normal(rng, (s["m"], s["k"]), np.float16), _normal(rng, (s["k"], s["n"]), np.float16)],
           matmul16_graft, lambda a, b: a.astype(np.float32) @ b.astype(np.float32), lambda a, b: (a @ b).float(),
           lambda s: 2 * s["m"] * s["n"] * s["k"], "TFLOP/s", lambda s: f"{s['m']}x{s['k']} @ {s['k']}x{s['n']} f16",
           tol=2e-3),
  # a product with its epilogue: the bias and the GELU (tanh form, as Graft's) in the product's kernel
  Workload("linear_gelu", lambda s, rng: [_normal(rng, (s["m"], s["k"])), _normal(rng, (s["k"], s["n"])) / np.float32(math.sqrt(s["k"])),
                                          _normal(rng, (s["n"],))],
           lambda x, w, b: (x @ w + b).gelu(), lambda x, w, b: gelu_np(x @ w + b),
           lambda x, w, b: __import__("torch").nn.functional.gelu(x @ w + b, approximate="tanh"),
           lambda s: 2 * s["m"] * s["n"] * s["k"], "GFLOP/s", lambda s: f"({s['m']}x{s['k']} @ {s['k']}x{s['n']} + b).gelu()"),
  Workload("conv", lambda s, rng: [_normal(rng, s["x"]), _normal(rng, s["w"])],
           lambda x, w: x.conv2d(w, padding=1), conv_np,
           lambda x, w: __import__("torch").nn.functional.conv2d(x, w, padding=1),
           lambda s: 2 * s["x"][0] * s["w"][0] * s["x"][2] * s["x"][3] * s["x"][1] * s["w"][2] * s["w"][3], "GFLOP/s",
           lambda s: f"x{s['x']} w{s['w']}".replace(" ", "")),
  Workload("mlp", _mlp_inputs, mlp_graft, mlp_np, mlp_torch, lambda s: 0, "ms",
           lambda s: f"{s['batch']}x{s['width']}, {s['layers']} layers"),
  Workload("attn", lambda s, rng: [_normal(rng, s["shape"]) for _ in range(3)],
           lambda q, k, v: (q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])).softmax(-1) @ v, attn_np,
           lambda q, k, v: __import__("torch").softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ v,
           lambda s: 0, "ms", lambda s: "q,k,v " + "x".join(map(str, s["shape"]))),
]}

WORKLOADS["matmul1k"] = _sized(WORKLOADS["matmul"], "matmul1k")

# the tables of WORKLOADS.md, one per device (and small sizes for --quick)
SIZES: dict[str, dict[str, dict]] = {
  "CPU": {
    "ew": {"shape": (4096, 4096)}, "sum": {"shape": (4096, 4096)}, "softmax": {"shape": (4096, 4096)},
    "layernorm": {"shape": (4096, 4096)}, "matmul": {"m": 1024, "n": 1024, "k": 1024},
    "conv": {"x": (8, 64, 56, 56), "w": (64, 64, 3, 3)}, "mlp": {"batch": 256, "width": 1024, "layers": 3},
    "attn": {"shape": (8, 512, 64)},
  },
  "CUDA": {
    "ew": {"shape": (16384, 16384)}, "sum": {"shape": (16384, 16384)}, "softmax": {"shape": (16384, 16384)},
    "layernorm": {"shape": (16384, 16384)}, "matmul": {"m": 4096, "n": 4096, "k": 4096},
    "matmul1k": {"m": 1024, "n": 1024, "k": 1024}, "linear_gelu": {"m": 8192, "n": 4096, "k": 4096},
    "matmul16": {"m": 8192, "n": 8192, "k": 8192}, "conv": {"x": (32, 128, 56, 56), "w": (128, 128, 3, 3)},
    "attn": {"shape": (32, 1024, 64)},
  },
}
QUICK_SIZES: dict[str, dict] = {
  "ew": {"shape": (512, 512)}, "sum": {"shape": (512, 512)}, "softmax": {"shape": (512, 512)},
  "layernorm": {"shape": (512, 512)}, "matmul": {"m": 128, "n": 128, "k": 128}, "matmul1k": {"m": 128, "n": 128, "k": 128},
  "linear_gelu": {"m": 128, "n": 128, "k": 128}, "matmul16": {"m": 128, "n": 128, "k": 128},
  "conv": {"x": (2, 8, 16, 16), "w": (8, 8, 3, 3)}, "mlp": {"batch": 32, "width": 128, "layers": 3},
  "attn": {"shape": (2, 64, 16)},
}


def sizes_for(device: str, quick: bool) -> dict[str, dict]:
  return {k: QUICK_SIZES[k] for k in SIZES[device]} if quick else SIZES[device]


def make_inputs(w: Workload, size: dict) -> list[np.ndarray]:
  return w.inputs(size, np.random.default_rng(0))


# ---- frameworks: each makes a runner, a function that does one synchronized call and says how long it took ----

def graft_runner(w: Workload, arrays, device: str):
  from tensor import Tensor
  from runtime.device import get_device
  dev = get_device(device)
  ts = [Tensor(a, device=device) for a in arrays]
  def run():
    t0 = time.perf_counter()
    out = w.graft(*ts).realize()
    dev.synchronize()
    return out, time.perf_counter() - t0
  return run


def numpy_runner(w: Workload, arrays, device: str):
  def run():
    t0 = time.perf_counter()
    out = w.numpy(*arrays)
    return out, time.perf_counter() - t0
  return run


def torch_runner(w: Workload, arrays, device: str, compiled: bool = False):
  import torch
  torch.set_grad_enabled(False)
  tdev = "cuda" if device == "CUDA" else "cpu"
  if tdev == "cuda":
    # float32 stays float32 (IEEE, like Graft's kernels): no TF32 in cuBLAS or cuDNN, which would also fail the check
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
  ts = [torch.from_numpy(a).to(tdev) for a in arrays]
  fn = torch.compile(w.torch) if compiled else w.torch
  sync = torch.cuda.synchronize if tdev == "cuda" else (lambda: None)
  def run():   # as Graft's call is timed: from the call to the device synchronized after it
    t0 = time.perf_counter()
    out = fn(*ts)
    sync()
    return out, time.perf_counter() - t0
  return run


FRAMEWORKS: dict[str, Callable] = {
  "graft": graft_runner, "numpy": numpy_runner, "torch": torch_runner,
  "torch.compile": lambda w, arrays, device: torch_runner(w, arrays, device, compiled=True),
}


def to_numpy(out) -> np.ndarray:
  if isinstance(out, np.ndarray): return out
  if hasattr(out, "cpu"): return out.detach().float().cpu().numpy()  # torch (Graft tensors have detach() too)
  return out.numpy()                                                    # Graft


def torch_sees(device: str) -> bool:
  try: import torch
  except ImportError: return False
  return device == "CPU" or torch.cuda.is_available()


def peers_for(device: str) -> list[str]:
  """The frameworks measured beside Graft: numpy and torch eager on the CPU; torch eager and compiled on a GPU."""
  if device == "CPU": return ["numpy"] + (["torch"] if torch_sees("CPU") else [])
  return ["torch", "torch.compile"] if torch_sees(device) else []


# ---- one measurement, in a fresh process ----

# Every framework calls for this long before its calls are timed. Why (a guess, not yet checked on a GPU): a GPU left
# idle through a compile clocks down and needs some ms of work to clock up, and torch.compile's first call may run
# autotuning on the GPU just before its timed calls where Graft's runs none. Seen on H100s (2026-11-26): Graft's
# softmax 16384^2 took 0.996 ms a call here after 3 warm-ups, 0.795 ms in bench/call_time.py after 100 calls
# (another machine, one commit earlier); torch.compile's 0.774 and 0.762 ms.
WARM_SECONDS = 0.25

def worker(wid: str, framework: str, device: str, quick: bool, warmups: int, repeats: int, out_path: str) -> dict:
  """Cold, then warm, for one workload in one framework; the first warm-up's result is saved to out_path."""
  w = WORKLOADS[wid]
  arrays = make_inputs(w, sizes_for(device, quick)[wid])
  run = FRAMEWORKS[framework](w, arrays, device)
  _, cold = run()
  out, _ = run()
  np.save(out_path, to_numpy(out))
  del out
  t0 = time.perf_counter()
  for i in itertools.count():   # warm-ups: `warmups` calls, and calls for WARM_SECONDS at least (below)
    if i >= warmups - 1 and time.perf_counter() - t0 >= WARM_SECONDS: break
    run()
  times = [run()[1] for _ in range(repeats)]
  return {"cold": cold, "warm": statistics.median(times), "times": times}


def measure(wid: str, framework: str, device: str, quick: bool, warmups: int, repeats: int, tmp: str,
            timeout: float) -> tuple[dict | None, str | None, str]:
  """Run `worker` in a fresh process with empty compile caches: (result, error, path of the saved output)."""
  out_path = os.path.join(tmp, f"{wid}-{framework}.npy")
  cache = tempfile.mkdtemp(prefix="graft-bench-cache-", dir=tmp)
  env = {**os.environ, "GRAFT_CACHE_DIR": cache, "TORCHINDUCTOR_CACHE_DIR": os.path.join(cache, "inductor"),
         "DEBUG": "0", "DEVICE": device}
  env.pop("GRAFT_CACHE", None)
  cmd = [sys.executable, os.path.abspath(__file__), "--worker", wid, framework, out_path, "--device", device,
         "--warmups", str(warmups), "--repeats", str(repeats)] + (["--quick"] if quick else [])
  try: res, err = run_isolated(cmd, env, timeout)
  finally: shutil.rmtree(cache, ignore_errors=True)
  return res, err, out_path


def check(out_path: str, ref: np.ndarray, tol: float) -> tuple[bool, str]:
  out = np.load(out_path)
  if out.shape != ref.shape: return False, f"shape {out.shape}, expected {ref.shape}"
  if not np.isfinite(out).all() and np.isfinite(ref).all(): return False, "non-finite values"
  err = float(np.abs(out.astype(np.float64) - ref).max() / max(np.abs(ref).max(), 1e-30))
  return err <= tol, f"relative max error {err:.1e} (tolerance {tol:.0e})"


# ---- the table ----

def fmt_ms(s: float | None) -> str:
  if s is None: return "-"
  ms = s * 1e3
  return f"{ms:.3g}" if ms < 1000 else f"{ms:,.0f}"


def fmt_rate(w: Workload, size: dict, warm: float | None) -> str:
  if warm is None: return "-"
  if w.unit == "ms": return f"{warm * 1e3:.3g} ms"
  scale = {"GB/s": 1e9, "GFLOP/s": 1e9, "TFLOP/s": 1e12}[w.unit]
  return f"{w.amount(size) / warm / scale:.3g} {w.unit}"


def bench(ids: list[str], device: str, quick: bool, warmups: int, repeats: int, timeout: float,
          only_peers: list[str] | None = None) -> None:
  from tabulate import tabulate
  sizes = sizes_for(device, quick)
  peers = [p for p in peers_for(device) if only_peers is None or p in only_peers]
  frameworks = ["graft"] + peers
  rows, notes = [], []
  with tempfile.TemporaryDirectory(prefix="graft-bench-") as tmp:
    for wid in ids:
      w, size = WORKLOADS[wid], sizes[wid]
      results: dict[str, dict | None] = {}
      ref = None
      for fw in frameworks:
        t0 = time.perf_counter()
        res, err, out_path = measure(wid, fw, device, quick, warmups, repeats, tmp, timeout)
        results[fw] = res
        if err: notes.append(f"{wid}, {fw}: {err}")
        else:
          # every framework is checked, so that a wrong peer (a harness bug) shows too; the float64 reference is
          # computed once per workload, after the first framework is done with the memory
          if ref is None: ref = np.asarray(w.numpy(*[a.astype(np.float64) for a in make_inputs(w, size)]))
          res["ok"], detail = check(out_path, ref, w.tol)
          if not res["ok"]: notes.append(f"{wid}, {fw}: WRONG RESULT, {detail}")
        if os.path.exists(out_path): os.remove(out_path)
        print(f"  {wid:<10s} {fw:<14s} {time.perf_counter() - t0:7.1f} s{'  ' + err if err else ''}", file=sys.stderr)
      g = results["graft"]
      del ref
      row = [wid, w.describe(size), "-" if g is None else "yes" if g["ok"] else "NO"]
      for fw in frameworks:
        r = results[fw]
        row += [fmt_ms(r and r["cold"]), fmt_ms(r and r["warm"]), fmt_rate(w, size, r and r["warm"])]
      for fw in peers:
        r = results[fw]
        row.append(f"{r['warm'] / g['warm']:.3g}x" if g and r else "-")
      rows.append(row)
  headers = ["id", "size", "ok"]
  for fw in frameworks: headers += [f"{fw} cold ms", f"{fw} warm ms", f"{fw} rate"]
  headers += [f"graft/{fw}" for fw in peers]
  print(tabulate(rows, headers=headers, tablefmt="github", disable_numparse=True))
  print(f"{device}; warm = median of {repeats} calls after {warmups} warm-up(s); cold = first call in a fresh process "
        f"with empty caches; graft/x = x's warm time / Graft's (above 1: Graft faster)")
  for n in notes: print(f"  ! {n}")
  sys.stdout.flush()


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--device", default="CPU", type=str.upper, choices=sorted(SIZES), help="whose table of sizes (CPU)")
  ap.add_argument("--only", default="", help="comma-separated workload ids, e.g. ew,sum")
  ap.add_argument("--quick", action="store_true", help="small sizes, 3 repeats after 1 warm-up: a smoke run")
  ap.add_argument("--warmups", type=int, default=None)
  ap.add_argument("--repeats", type=int, default=None)
  ap.add_argument("--peers", default=None, help="comma-separated peers to measure beside Graft (default: every one "
                  "installed), e.g. torch to leave out torch.compile's long cold compiles")
  ap.add_argument("--timeout", type=float, default=1800, help="seconds allowed to one (workload, framework) process")
  ap.add_argument("--worker", nargs=3, metavar=("ID", "FRAMEWORK", "OUT"), help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  warmups = args.warmups if args.warmups is not None else 1 if args.quick else 3
  repeats = args.repeats if args.repeats is not None else 3 if args.quick else 20
  if args.worker:
    wid, fw, out_path = args.worker
    return report(lambda: worker(wid, fw, args.device, args.quick, max(warmups, 1), repeats, out_path))
  table = SIZES[args.device]
  ids = [s.strip() for s in args.only.split(",") if s.strip()] or list(table)
  if (unknown := [i for i in ids if i not in table]):
    ap.error(f"--only: no workload {', '.join(unknown)} on {args.device}; choose from {', '.join(table)}")
  peers = [s.strip() for s in args.peers.split(",") if s.strip()] if args.peers is not None else None
  if peers and (unknown := [p for p in peers if p not in FRAMEWORKS]):
    ap.error(f"--peers: no framework {', '.join(unknown)}; choose from {', '.join(f for f in FRAMEWORKS if f != 'graft')}")
  bench(ids, args.device, args.quick, warmups, repeats, args.timeout, peers)


if __name__ == "__main__":
  main()
