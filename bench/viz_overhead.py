"""What the rewrite viewer (rewrite/viz, GRAFT_VIZ) costs: nothing while off, this much while recording, and the page.

  python bench/viz_overhead.py               # a 12-layer GPT forward (seq 64, width 256, 4 heads)
  python bench/viz_overhead.py --layers 2 --repeats 1 --quick   # smoke run

Rows:
  check       graph_rewrite's only work while nothing records: reading `viz.recorder` (timed alone, ns per call),
              beside one graph_rewrite of a small expression (symbolic rules, 10,000 distinct expressions, median
              us per call): the check's share of a call.
  plan off    the GPT forward through the whole pipeline to rendered kernels (runtime.realize.plan: schedule, lower
              and render every kernel, no C compile), nothing recording: median of --repeats, CPU time.
  plan rec    the same while recording (viz.record()): every rule tried apart to name the one that fired.
  write       the recording written as the page (.html: Graphviz lays out every stage's graph, in pages, and the
              first steps of each stage) and as JSON: seconds and size.
Every run of `plan` builds the model anew (fresh tensors), so no program or kernel is reused from the one before.
"""
from __future__ import annotations
import argparse, math, os, platform, statistics, sys, tempfile, time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import numpy as np
from tensor import Tensor
from rewrite import UOp, viz, graph_rewrite
from rules.symbolic import symbolic_rules
from runtime import realize


def gpt(layers: int, seq: int = 64, d: int = 256, heads: int = 4) -> Tensor:
  """A GPT forward: `layers` pre-layernorm blocks (attention with causal-free softmax, GELU MLP), then a final norm."""
  rng = np.random.default_rng(0)
  def param(*shape): return Tensor(rng.standard_normal(shape, dtype=np.float32) * 0.02)
  def norm(h): return h.layernorm(-1) * param(d) + param(d)
  def dense(h, n_in, n_out): return h @ param(n_in, n_out) + param(n_out)
  def split_heads(h): return h.reshape(seq, heads, d // heads).permute(1, 0, 2)
  x = param(seq, d)
  for _ in range(layers):
    h = norm(x)
    q, k, v = (split_heads(dense(h, d, d)) for _ in range(3))
    att = (q @ k.transpose(-1, -2) / math.sqrt(d // heads)).softmax(-1) @ v
    x = x + dense(att.permute(1, 0, 2).reshape(seq, d), d, d)
    x = x + dense(dense(norm(x), d, 4 * d).gelu(), 4 * d, d)
  return norm(x)


def cpu_time(fn) -> float:
  t0 = time.process_time(); fn(); return time.process_time() - t0


def check_row(n: int = 10_000) -> tuple[float, float]:
  """(ns of reading viz.recorder, us of one graph_rewrite of a small expression)."""
  def reads(k: int):
    for _ in range(k): viz.recorder is None
  t = min(cpu_time(lambda: reads(1_000_000)) for _ in range(5)) / 1e6
  x, y = UOp.variable("x", 0, 100), UOp.variable("y", 0, 100)
  exprs = [((x * (i % 7 + 1) + y * 0 + i) // (i % 5 + 1)) % (i % 11 + 2) for i in range(n)]
  per_call = cpu_time(lambda: [graph_rewrite(e, symbolic_rules) for e in exprs]) / n
  return t * 1e9, per_call * 1e6


def plan_once(layers: int) -> float:
  out = gpt(layers)
  return cpu_time(lambda: realize.plan([(out.uop, out.device)]))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--quick", action="store_true", help="1,000 expressions in the check row")
  a = ap.parse_args(argv)
  cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.processor())
  print(f"{cpu}; load {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; GPT {a.layers} layers, seq 64, width 256")

  ns, us = check_row(1_000 if a.quick else 10_000)
  print(f"check     reading viz.recorder {ns:.1f} ns; one graph_rewrite {us:.1f} us: {100 * ns / 1e3 / us:.3f}% of a call")

  plan_once(a.layers)   # the rule sets' lazy setup, outside the timing
  off = statistics.median(plan_once(a.layers) for _ in range(a.repeats))
  print(f"plan off  {off * 1e3:8.0f} ms  (median of {a.repeats}, CPU time)")
  recorded = []
  for _ in range(a.repeats):
    with viz.record() as rec: recorded.append(plan_once(a.layers))
  on = statistics.median(recorded)
  steps = sum(len(r.steps) for s in _scopes(rec.root) for r in s.items if isinstance(r, viz.Rewrite))
  kernels = sum(1 for s in _scopes(rec.root) if s.kind == "kernel")
  print(f"plan rec  {on * 1e3:8.0f} ms  ({on / off:.2f}x off; {kernels} kernels compiled, {steps} rule applications, "
        f"{len(rec.nodes)} nodes recorded)")

  with tempfile.TemporaryDirectory() as tmp:
    for ext in ("json", "html"):
      path = os.path.join(tmp, f"gpt.{ext}")
      t0 = time.perf_counter()
      rec.write(path)
      print(f"write     {ext:4s} {time.perf_counter() - t0:6.1f} s wall, {os.path.getsize(path) / 2**20:6.1f} MiB")


def _scopes(scope):
  yield scope
  for item in scope.items:
    if isinstance(item, viz.Scope): yield from _scopes(item)


if __name__ == "__main__":
  main()
