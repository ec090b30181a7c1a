"""Where a GPT-2-style training step's kernel time goes (bench/train.py's model and step): one warm step with each
step of its program waited for alone, kernels grouped by name (summed ms, count, share, plan), largest first.

  python bench/train_kernels.py                       # bench/train.py's CPU size: 4 layers, 64 tokens, width 256
  python bench/train_kernels.py --device CUDA --layers 12 --tokens 1024 --width 768 --heads 12

Last line: a warm step's wall time split into building the graph (forward, backward, the optimizer's updates) and
realize (finding the program and running it), beside the kernels' sum.
"""
from __future__ import annotations
import argparse, os, sys, time
from collections import defaultdict
import numpy as np
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "examples"))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--device", default=os.environ.get("DEVICE", "CPU"))
  ap.add_argument("--layers", type=int, default=4); ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--width", type=int, default=256); ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--batch", type=int, default=4); ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--top", type=int, default=30)
  a = ap.parse_args()
  os.environ["DEVICE"] = a.device
  from tensor.optim import AdamW
  from runtime.program import Program
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

  for _ in range(3): step()
  parts = sorted((step() for _ in range(5)), key=sum)[2]
  timed: list[tuple[Program, list[float]]] = []   # each realize of the step (the ids' check is one): its program, times

  def timed_run(self, inputs, debug=0, step_seconds=None):
    timed.append((self, []))
    return plain_run(self, inputs, debug, timed[-1][1])
  plain_run, Program.run = Program.run, timed_run
  try: step()
  finally: Program.run = plain_run
  program, seconds = max(timed, key=lambda ps: len(ps[1]))   # the step's program: the largest realize
  names = [s[1].name if s[0] == "call" else s[3].name if s[0] == "extern" else
           "+".join(ck.name for _, calls in s[1] for ck, _ in calls) if s[0] == "pick" else s[0] for s in program.steps]
  total, by = sum(seconds), defaultdict(lambda: [0.0, 0])
  for n, s in zip(names, seconds): by[n][0] += s; by[n][1] += 1
  print(f"{a.device} training step, {a.layers} layers, {a.tokens} tokens, width {a.width}, batch {a.batch}, vocabulary "
        f"{a.vocab}: kernel time {total * 1e3:.2f} ms over {len(seconds)} steps")
  for n, (s, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:a.top]:
    plan = next((st[1].plan for st in program.steps if st[0] == "call" and st[1].name == n), "")
    print(f"  {s * 1e3:9.3f} ms  x{c:<3d} {100 * s / total:5.1f}%  {n}  {plan}")
  print(f"warm step (median of 5): build the graph {parts[0] * 1e3:.1f} ms, realize {parts[1] * 1e3:.1f} ms "
        f"(kernels waited for one at a time: {total * 1e3:.1f} ms)")


if __name__ == "__main__":
  main()
