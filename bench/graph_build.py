"""Building the graph: what a tensor operation costs the host before anything runs (issue 24), Graft beside tinygrad.

  python bench/graph_build.py                # every row, 12-layer GPT
  python bench/graph_build.py --quick        # fewer repeats, 2-layer GPT

Rows: one tensor operation each on float32 tensors x (128, 768), y (128, 768), b (768,), w (768, 768), s (128, 128),
qkv (3, 128, 64) and a bool mask m (128, 128), built and dropped (nothing is realized), in microseconds per operation; then the GPT forward of examples/gpt.py (12 layers,
128 tokens, width 768): the graph built on a new input tensor (ms per forward and the number of tensors it makes), and
`find_program` on that graph (the warm call's key: the cached program is found, nothing is compiled).

Figures are CPU time of this process (`time.process_time`, so another process's load on a shared machine does not
count), the median of alternating repeats. tinygrad 0.14 builds its lazy graph of the same operations (Tensor.empty
inputs, nothing realized), where it is importable; it has no GPT forward here.
"""
from __future__ import annotations
import argparse, gc, math, os, statistics, sys, time
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "examples"))
import numpy as np

OPS = {   # name -> what it builds (the same text for both frameworks)
  "x + y": lambda t: t.x + t.y,
  "x + b (broadcast)": lambda t: t.x + t.b,
  "x * 2.0": lambda t: t.x * 2.0,
  "x.exp()": lambda t: t.x.exp(),
  "x.reshape(128, 12, 64)": lambda t: t.x.reshape(128, 12, 64),
  "x.permute(1, 0)": lambda t: t.x.permute(1, 0),
  "x[:, :64]": lambda t: t.x[:, :64],
  "x.sum(-1)": lambda t: t.x.sum(-1),
  "x @ w": lambda t: t.x @ t.w,
  "x.softmax(-1)": lambda t: t.x.softmax(-1),
  # what a GPT layer's attention builds besides (examples/gpt.py): its causal mask, the masked scores, q @ k.T of one
  # qkv tensor, and an index
  "full((128, 128), True).triu(1)": lambda t: t.Tensor.full((128, 128), True).triu(1),
  "s.masked_fill(m, -inf)": lambda t: t.s.masked_fill(t.m, -math.inf),
  "qkv[0] @ qkv[1].T": lambda t: t.qkv[0] @ t.qkv[1].T,
  "x[0]": lambda t: t.x[0],
}


def graft_tensors():
  from tensor import Tensor
  rng = np.random.default_rng(0)
  t = lambda *s: Tensor(rng.standard_normal(s, np.float32))
  class T: x, y, b, w, s, qkv = t(128, 768), t(128, 768), t(768), t(768, 768), t(128, 128), t(3, 128, 64)
  T.Tensor, T.m = Tensor, Tensor(np.triu(np.ones((128, 128), bool), 1))
  return T


def tinygrad_tensors():
  try:
    os.environ.setdefault("DEV", "CPU")
    from tinygrad import Tensor
  except Exception: return None
  class T: x, y, b, w = Tensor.empty(128, 768), Tensor.empty(128, 768), Tensor.empty(768), Tensor.empty(768, 768)
  T.Tensor, T.s, T.qkv, T.m = Tensor, Tensor.empty(128, 128), Tensor.empty(3, 128, 64), Tensor.full((128, 128), True).triu(1)
  return T


def timed_alternately(fns: list, repeats: int) -> list[float]:
  """Median CPU seconds of each function, the functions taking turns."""
  times = [[] for _ in fns]
  for _ in range(repeats):
    for f, ts in zip(fns, times):
      gc.collect()
      t0 = time.process_time(); f(); ts.append(time.process_time() - t0)
  return [statistics.median(ts) for ts in times]


def op_rows(n: int, repeats: int) -> None:
  frameworks = [("graft", graft_tensors())] + [("tinygrad", t) for t in [tinygrad_tensors()] if t is not None]
  print(f"{'operation (us each, built and dropped)':<40s}" + "".join(f"{name:>10s}" for name, _ in frameworks)
        + ("   graft / tinygrad" if len(frameworks) > 1 else ""))
  for name, op in OPS.items():
    def loop(T, op=op):
      for _ in range(n): op(T)
    for _, T in frameworks: loop(T)   # warm: lazy setup, hash-consed nodes of the first build
    us = [t / n * 1e6 for t in timed_alternately([lambda T=T: loop(T) for _, T in frameworks], repeats)]
    print(f"{name:<40s}" + "".join(f"{u:10.1f}" for u in us) + (f"   {us[0] / us[1]:.2f}x" if len(us) > 1 else ""),
          flush=True)


def gpt_rows(layers: int, repeats: int) -> None:
  from tensor import Tensor
  from tensor.tensor import Tensor as T
  from runtime.realize import find_program
  from gpt import GPT
  model = GPT(layers, 768, 12)
  rng = np.random.default_rng(1)
  xs = [Tensor(rng.standard_normal((128, 768), np.float32)) for _ in range(4)]
  out = model.forward(xs[0]); out.realize()   # compiled once: later keys find the program
  made = [0]
  make, new = T._from_uop.__func__, T._new   # every tensor an operation makes comes from one of the two
  def counting(cls, *a):
    made[0] += 1
    return make(cls, *a)
  def counting_new(self, *a):
    made[0] += 1
    return new(self, *a)
  T._from_uop, T._new = classmethod(counting), counting_new
  model.forward(xs[1])
  T._from_uop, T._new = classmethod(make), new
  calls = iter(range(10**9))
  def build(): model.forward(xs[next(calls) % len(xs)])
  outs = [model.forward(x) for x in xs]
  def key(): o = outs[next(calls) % len(outs)]; find_program([(o._graph(), o.device)])   # (as realize keys it)
  t_build, t_key = timed_alternately([build, key], repeats)
  print(f"gpt forward, {layers} layers, 128 tokens, width 768: graph built {t_build * 1e3:.2f} ms ({made[0]} tensors "
        f"made, {t_build / made[0] * 1e6:.1f} us each); find_program {t_key * 1e3:.2f} ms")


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--quick", action="store_true", help="2 layers, fewer repeats")
  ap.add_argument("--layers", type=int, default=None)
  ap.add_argument("--rows", default="ops,gpt", help="ops, gpt or both")
  a = ap.parse_args()
  repeats, n = (3, 100) if a.quick else (7, 500)
  if "ops" in a.rows: op_rows(n, repeats)
  if "gpt" in a.rows: gpt_rows(a.layers or (2 if a.quick else 12), repeats)


if __name__ == "__main__":
  main()
