"""The GPT forward's steps one by one, Graft's kernel beside the torch operations it replaces, at the model's shapes
(bench/models.py's CPU model: 128 tokens, width 768; examples/gpt.py):

  python bench/gpt_ops.py                       # every row, the threads the environment gives (both cores here)
  OMP_NUM_THREADS=1 python bench/gpt_ops.py     # one core each: what the kernels do, apart from the threads
  python bench/gpt_ops.py --only fc1,fc2 --copies 1

Rows: qkv `x @ W + b` (128x768 @ 768x2304), proj `r + (x @ W + b)` (768x768), fc1 `gelu(x @ W + b)` (768x3072, GELU
tanh), fc2 `r + (x @ W + b)` (3072x768), layernorm `x.layernorm(-1) * g + b` (128x768), and `bare` (the qkv product
alone). Graft: the step's own time (the host program run with each step timed alone: the kernel, no graph building);
torch eager: the wall time of its operations (torch's CPU ops are synchronous). Each framework runs in a process of its
own (two thread pools never share the cores), each row `--rounds` times over `--copies` sets of weights in turn (12,
as the model's 12 layers: the weights come from memory, not from a cache that one layer's leave warm); min and median.
"""
from __future__ import annotations
import argparse, os, statistics, sys, time
import numpy as np
from isolated import report, run_isolated  # bench/isolated.py, beside this script

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
T, D = 128, 768
# name: (k, n, what follows the product)
ROWS = {"qkv": (D, 3 * D, "bias"), "proj": (D, D, "residual"), "fc1": (D, 4 * D, "gelu"), "fc2": (4 * D, D, "residual"),
        "layernorm": (D, D, "layernorm"), "bare": (D, 3 * D, "none")}


def arrays(name: str, copies: int) -> tuple[np.ndarray, list[np.ndarray], np.ndarray, np.ndarray]:
  k, n, _ = ROWS[name]
  rng = np.random.default_rng(0)
  x = rng.standard_normal((T, k), np.float32)
  ws = [rng.standard_normal((k, n), np.float32) * np.float32(0.02) for _ in range(copies)]
  return x, ws, rng.standard_normal(n, np.float32), rng.standard_normal((T, n), np.float32)


def numpy_step(name: str, x, w, b, r) -> np.ndarray:
  """The step in float64 numpy (GELU tanh as torch's approximate="tanh"; layernorm's gain is the row's first weights)."""
  x, w, b, r, what = x.astype(np.float64), w.astype(np.float64), b.astype(np.float64), r.astype(np.float64), ROWS[name][2]
  if what == "layernorm": return (x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + 1e-5) * w[0] + b
  y = x @ w if what == "none" else x @ w + b
  if what == "gelu": return 0.5 * y * (1 + np.tanh(np.sqrt(2 / np.pi) * (y + 0.044715 * y ** 3)))
  return r + y if what == "residual" else y


def summary(times: list[float]) -> dict: return {"min": min(times) * 1e3, "median": statistics.median(times) * 1e3}


def graft_row(name: str, a) -> dict:
  from tensor import Tensor
  from runtime.realize import find_program
  data = arrays(name, a.copies)
  x, ws, b, r = (Tensor(v).realize() if isinstance(v, np.ndarray) else [Tensor(w).realize() for w in v] for v in data)
  what = ROWS[name][2]
  def step(w):
    if what == "layernorm": return x.layernorm(-1) * w[0] + b
    y = x @ w if what == "none" else x @ w + b
    return y.gelu() if what == "gelu" else r + y if what == "residual" else y
  want = numpy_step(name, data[0], data[1][0], data[2], data[3])
  if (err := np.abs(step(ws[0]).numpy() - want).max() / np.abs(want).max()) > 1e-5: raise AssertionError(f"{name}: off by {err:.1e}")
  programs = [find_program([(step(w).uop, "CPU")]) for w in ws]
  for program, params in programs: program.run(params)
  times = []
  for _ in range(a.rounds):
    for program, params in programs:
      seconds: list[float] = []
      program.run(params, step_seconds=seconds)
      times.append(sum(seconds))
  plan = "; ".join(str(s[1].plan) if s[0] == "call" else s[0] for s in programs[0][0].steps)
  return {**summary(times), "plan": plan}


def torch_row(name: str, a) -> dict:
  import torch
  torch.set_grad_enabled(False)
  x, ws, b, r = (torch.from_numpy(v) if isinstance(v, np.ndarray) else [torch.from_numpy(w) for w in v] for v in arrays(name, a.copies))
  what = ROWS[name][2]
  F = torch.nn.functional
  def step(w):
    if what == "layernorm": return F.layer_norm(x, (D,), w[0], b)
    y = x @ w if what == "none" else x @ w + b
    return F.gelu(y, approximate="tanh") if what == "gelu" else r + y if what == "residual" else y
  for w in ws: step(w)
  times = []
  for _ in range(a.rounds):
    for w in ws:
      t0 = time.perf_counter(); step(w); times.append(time.perf_counter() - t0)
  return summary(times)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--only", default=",".join(ROWS), help="rows: " + ",".join(ROWS))
  ap.add_argument("--copies", type=int, default=12, help="sets of weights used in turn (default 12, the model's layers)")
  ap.add_argument("--rounds", type=int, default=10)
  ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
  a = ap.parse_args()
  names = [n for n in a.only.split(",") if n]
  if unknown := [n for n in names if n not in ROWS]: ap.error(f"unknown rows {unknown}: choose from {', '.join(ROWS)}")
  if a.worker:
    row = graft_row if a.worker == "graft" else torch_row
    return report(lambda: {n: row(n, a) for n in names})
  # (a CPU bench: its steps are timed as CPU host programs, whatever DEVICE the caller's environment names)
  env = {**os.environ, "DEVICE": "CPU", "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
  found = {}
  for fw in ("graft", "torch"):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", fw, "--only", ",".join(names), "--copies", str(a.copies),
           "--rounds", str(a.rounds)]
    found[fw], why = run_isolated(cmd, env, 900)
    if found[fw] is None: print(f"{fw} failed: {why}")
  threads = os.environ.get("OMP_NUM_THREADS", "all cores")
  print(f"GPT steps at 128 tokens, width 768, threads: {threads}; {a.copies} weight sets x {a.rounds} rounds; ms min / median")
  print(f"  {'step':<10s} {'graft':>17s} {'torch eager':>17s} {'torch/graft (min)':>18s}  graft plan")
  for n in names:
    g, t = (found[fw][n] if found[fw] else None for fw in ("graft", "torch"))
    cell = lambda r: f"{r['min']:7.3f} / {r['median']:7.3f}" if r else f"{'-':>17s}"
    ratio = f"{t['min'] / g['min']:17.3f}x" if g and t else f"{'-':>18s}"
    print(f"  {n:<10s} {cell(g)} {cell(t)} {ratio}  {g['plan'] if g else ''}")


if __name__ == "__main__":
  main()
