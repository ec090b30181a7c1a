"""The CPU steps of the mlp and attention workloads, one thread, Graft beside torch eager (issue 21):

  python bench/cpu_steps.py                 # every row
  python bench/cpu_steps.py --only linear   # rows whose name contains a word

Rows, each a whole call (the graph built, the program found, the kernels run) on float32 inputs:
- linear 256x1024x1024 (the mlp workload's layer, W of shape (out, in)): the bare product `x @ W.T`, with bias and
  relu, with bias and GELU (tanh); torch: `F.linear`, then `relu` / `gelu(approximate="tanh")`;
- attention 8x512x64 (the attn workload): `q @ k.T`, softmax of the scores (divided by sqrt(64)), `p @ v`, and the
  whole `softmax(q @ k.T / 8) @ v`; torch: `bmm`, `softmax`, `bmm`, and the whole.
Each row's figure is the minimum over `--repeats` rounds of CPU time of this process (`time.process_time`: another
process's load on a shared machine counts only through the caches), the rows of a round run one after another, so a
slow stretch of the machine slows every row alike. One thread each (OMP_NUM_THREADS, OPENBLAS_NUM_THREADS and torch's
are set to 1 before anything loads): what a core does, not how the threads scale; bench/workloads.py has the whole
calls with every core. GRAFT_EXTERN is as the environment says (unset: the first call picks the library or the
generated kernel by timing both).
"""
from __future__ import annotations
import argparse, math, os, sys, time
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"): os.environ[var] = "1"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np


def rows(torch):
  from tensor import Tensor
  rng = np.random.default_rng(0)
  x, w, b = rng.standard_normal((256, 1024), np.float32), rng.standard_normal((1024, 1024), np.float32) / 32, rng.standard_normal(1024, np.float32)
  q, k, v = (rng.standard_normal((8, 512, 64), np.float32) for _ in range(3))
  gx, gw, gb, gq, gk, gv = (Tensor(a).realize() for a in (x, w, b, q, k, v))
  gs = (gq @ gk.transpose(-1, -2) / 8).contiguous().realize()
  gp = gs.softmax(-1).realize()
  yield "linear bare", lambda: (gx @ gw.T).contiguous().realize(), None
  yield "linear+relu", lambda: gx.linear(gw, gb).relu().realize(), None
  yield "linear+gelu", lambda: gx.linear(gw, gb).gelu().realize(), None
  yield "attention q@k.T", lambda: (gq @ gk.transpose(-1, -2)).contiguous().realize(), None
  yield "attention softmax", lambda: (gs + 0).softmax(-1).realize(), None
  yield "attention p@v", lambda: (gp @ gv).realize(), None
  yield "attention whole", lambda: ((gq @ gk.transpose(-1, -2) / math.sqrt(64)).softmax(-1) @ gv).realize(), None
  if torch is None: return
  F = torch.nn.functional
  tx, tw, tb, tq, tk, tv = (torch.tensor(a) for a in (x, w, b, q, k, v))
  ts = torch.bmm(tq, tk.transpose(1, 2)) / 8
  tp = torch.softmax(ts, -1)
  yield "linear bare", None, lambda: F.linear(tx, tw)
  yield "linear+relu", None, lambda: torch.relu(F.linear(tx, tw, tb))
  yield "linear+gelu", None, lambda: F.gelu(F.linear(tx, tw, tb), approximate="tanh")
  yield "attention q@k.T", None, lambda: torch.bmm(tq, tk.transpose(1, 2))
  yield "attention softmax", None, lambda: torch.softmax(ts, -1)
  yield "attention p@v", None, lambda: torch.bmm(tp, tv)
  yield "attention whole", None, lambda: torch.bmm(torch.softmax(torch.bmm(tq, tk.transpose(1, 2)) / 8, -1), tv)


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--repeats", type=int, default=20)
  ap.add_argument("--only", default="")
  args = ap.parse_args()
  try:
    import torch
    torch.set_num_threads(1)
  except ImportError: torch = None
  calls = [(name, fn or tfn, "graft" if fn else "torch") for name, fn, tfn in rows(torch) if args.only in name]
  for _, fn, _ in calls:
    for _ in range(2): fn()   # compiled, picked, warm
  best = {(name, who): math.inf for name, _, who in calls}
  ctx = torch.no_grad() if torch is not None else None
  if ctx: ctx.__enter__()
  for _ in range(args.repeats):
    for name, fn, who in calls:
      t0 = time.process_time(); fn(); best[name, who] = min(best[name, who], time.process_time() - t0)
  names = list(dict.fromkeys(name for name, _, _ in calls))
  print(f"{'one thread, CPU ms (min)':26s} {'graft':>8s} {'torch':>8s} {'graft/torch':>12s}")
  for name in names:
    g, t = best[name, "graft"], best.get((name, "torch"), math.inf)
    ratio = f"{t / g:11.2f}x" if t < math.inf else f"{'-':>12s}"
    print(f"{name:26s} {g * 1e3:8.2f} {t * 1e3 if t < math.inf else float('nan'):8.2f} {ratio}")
  print("(graft/torch: torch's time over Graft's; above 1: Graft faster)")


if __name__ == "__main__":
  main()
