"""Where a GPT-2-style training step's kernel time goes (bench/train.py's model and step): one warm step with each
step of its program waited for alone, kernels grouped by name (summed ms, count, share, plan), largest first.

  python bench/train_kernels.py                       # bench/train.py's CPU size: 4 layers, 64 tokens, width 256
  python bench/train_kernels.py --device CUDA --layers 12 --tokens 1024 --width 768 --heads 12
  python bench/train_kernels.py --phases              # and the step's kernel time split forward / backward / optimizer
  python bench/train_kernels.py --top 0               # every kernel, not the 30 largest

Last line: a warm step's wall time split into building the graph (forward, backward, the optimizer's updates) and
realize (finding the program and running it), beside the kernels' sum.

--phases also times two smaller programs of the same step, on the same ids: the loss alone (the forward), and the
loss with every gradient (forward and backward). The backward's share is the second's kernel sum less the first's, the
optimizer's the whole step's less the second's: differences of whole programs, so work that fusion moves across a
phase boundary (a gradient's last kernel feeding AdamW's update) counts where the whole step runs it.
"""
from __future__ import annotations
import argparse, os, sys, time
from collections import defaultdict
import numpy as np
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "examples"))


def timed_programs(work) -> list:
  """Run `work()` once with every program it realizes waited for step by step: [(program, seconds per step)]."""
  from runtime.program import Program
  timed: list = []

  def timed_run(self, inputs, debug=0, step_seconds=None):
    timed.append((self, []))
    return plain_run(self, inputs, debug, timed[-1][1])
  plain_run, Program.run = Program.run, timed_run
  try: work()
  finally: Program.run = plain_run
  return timed


def step_rows(program) -> list[tuple[str, str]]:
  """(name, plan) of each step: a kernel's name and plan; a library call as the routine it stands for (shape, which
  operands it reads transposed) and what the first run picked, the library or the generated kernel (whose plan)."""
  rows = []
  for s in program.steps:
    if s[0] == "call": rows.append((s[1].name, s[1].plan))
    elif s[0] == "extern": rows.append((f"{s[1]} -> {s[5][0] or 'unpicked'}", f"generated {s[3].name}: {s[3].plan}"))
    elif s[0] == "pick":
      rows.append(("+".join(ck.name for _, calls in s[1] for ck, _ in calls) + f" -> {s[2][0]}",
                   " | ".join(getattr(ck, "plan", "library") for ck, _ in s[2][1])))
    else: rows.append((s[0], ""))
  return rows


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--device", default=os.environ.get("DEVICE", "CPU"))
  ap.add_argument("--layers", type=int, default=4); ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--width", type=int, default=256); ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--batch", type=int, default=4); ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--top", type=int, default=30, help="kernels listed, largest first (0: all)")
  ap.add_argument("--phases", action="store_true", help="split the step's kernel time into forward, backward, optimizer")
  a = ap.parse_args()
  os.environ["DEVICE"] = a.device
  from tensor import Tensor
  from tensor.optim import AdamW
  from train_gpt import GPTLM
  model = GPTLM(a.vocab, a.tokens, a.layers, a.width, a.heads)
  opt = AdamW(model.parameters(), lr=1e-4)
  rng = np.random.default_rng(1)

  def step() -> tuple[float, float]:
    ids = rng.integers(0, a.vocab, (a.batch, a.tokens + 1)).astype(np.int32)
    t0 = time.perf_counter()
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    opt.zero_grad()
    loss.backward()
    t1 = time.perf_counter()
    opt.step()
    loss.item()
    return t1 - t0, time.perf_counter() - t1

  def forward() -> None:
    ids = rng.integers(0, a.vocab, (a.batch, a.tokens + 1)).astype(np.int32)
    model.loss(ids[:, :-1], ids[:, 1:]).realize()

  def forward_backward() -> None:
    ids = rng.integers(0, a.vocab, (a.batch, a.tokens + 1)).astype(np.int32)
    loss = model.loss(ids[:, :-1], ids[:, 1:])
    opt.zero_grad()
    loss.backward()
    Tensor.realize_all(loss, *(p.grad for p in opt.params))

  for _ in range(3): step()
  parts = sorted((step() for _ in range(5)), key=sum)[2]
  program, seconds = max(timed_programs(step), key=lambda ps: len(ps[1]))   # the step's program: its largest realize
  rows = step_rows(program)
  total, by, plans = sum(seconds), defaultdict(lambda: [0.0, 0]), dict(rows)
  for (n, _), s in zip(rows, seconds): by[n][0] += s; by[n][1] += 1
  print(f"{a.device} training step, {a.layers} layers, {a.tokens} tokens, width {a.width}, batch {a.batch}, vocabulary "
        f"{a.vocab}: kernel time {total * 1e3:.2f} ms over {len(seconds)} steps")
  for n, (s, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:a.top or None]:
    print(f"  {s * 1e3:9.3f} ms  x{c:<3d} {100 * s / total:5.1f}%  {n}  {plans[n]}")
  print(f"warm step (median of 5): build the graph {parts[0] * 1e3:.1f} ms, realize {parts[1] * 1e3:.1f} ms "
        f"(kernels waited for one at a time: {total * 1e3:.1f} ms)")
  if a.phases:
    sums = []
    for work in (forward, forward_backward):
      for _ in range(2): work()   # compiled and picked before it is timed
      sums.append(sum(max(timed_programs(work), key=lambda ps: len(ps[1]))[1]))
    f, fb = sums
    print(f"phases (kernel ms): forward {f * 1e3:.1f}, backward {(fb - f) * 1e3:.1f}, optimizer {(total - fb) * 1e3:.1f} "
          f"(of {total * 1e3:.1f}: the loss alone, the loss with its gradients, the whole step)")


if __name__ == "__main__":
  main()
