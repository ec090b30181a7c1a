"""Where the GPT forward's kernel time goes: one warm run of `examples/gpt.py`'s forward with each step timed alone,
kernels grouped by name (summed ms, count, share, plan), largest first; each step is waited for alone, so the
sum is the device's share of a call without overlap.

  python bench/gpt_kernels.py --device CUDA                      # 12 layers, 1024 tokens, width 768
  python bench/gpt_kernels.py --layers 2 --tokens 64 --width 128 --heads 4
  python bench/gpt_kernels.py --device CUDA --attention 32,1024,64   # bench/workloads.py's attn row instead

Last line: a warm call's wall time (a new input every call) split into building the graph, realize (finding the program, issuing its steps) and
the wait for the device after the last step is issued (the host's share is what the first two leave unhidden).
"""
from __future__ import annotations
import argparse, math, os, sys, time
from collections import defaultdict
import numpy as np
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "examples"))


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--device", default="CPU"); ap.add_argument("--layers", type=int, default=12)
  ap.add_argument("--tokens", type=int, default=None); ap.add_argument("--width", type=int, default=768)
  ap.add_argument("--heads", type=int, default=12); ap.add_argument("--top", type=int, default=25)
  ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
  ap.add_argument("--attention", default=None, metavar="B,T,D",
                  help="time the attn workload softmax(q @ k^T / sqrt(D)) @ v of that shape instead of the GPT")
  a = ap.parse_args()
  tokens = a.tokens or (1024 if a.device == "CUDA" else 128)
  from tensor import Tensor, dtypes
  from runtime.realize import find_program
  from gpt import GPT
  rng = np.random.default_rng(0)
  if a.attention:
    b, tokens, d = map(int, a.attention.split(","))
    def new_input():
      return tuple(Tensor(rng.standard_normal((b, tokens, d), np.float32), device=a.device).realize() for _ in range(3))
    fn, what = lambda q, k, v: (q @ k.transpose(-1, -2) / math.sqrt(d)).softmax(-1) @ v, f"attention {a.attention}"
  else:
    model = GPT(a.layers, a.width, a.heads, getattr(dtypes, a.dtype))
    def new_input():
      return (Tensor(rng.standard_normal((tokens, a.width), np.float32), device=a.device).cast(getattr(dtypes, a.dtype)).realize(),)
    fn, what = model.forward, f"gpt {a.layers} layers, {tokens} tokens, width {a.width}"
  inputs = [new_input() for _ in range(23)]   # a new input every call, as a service sees (bench/models.py too)
  forward = lambda i: fn(*inputs[i])
  forward(0).realize(); forward(1).realize()
  program, params = find_program([(forward(2).uop, a.device)])
  names = []
  for s in program.steps:   # the name each timed step reports under
    names.append(s[1].name if s[0] == "call" else s[3].name if s[0] == "extern" else
                 "+".join(ck.name for _, calls in s[1] for ck, _ in calls) if s[0] == "pick" else s[0])
  best = None
  for _ in range(3):
    seconds: list[float] = []
    program.run(params, step_seconds=seconds)
    if best is None or sum(seconds) < sum(best): best = seconds
  total, by = sum(best), defaultdict(lambda: [0.0, 0])
  for n, s in zip(names, best): by[n][0] += s; by[n][1] += 1
  print(f"{a.device} {a.dtype} {what}: kernel time {total * 1e3:.2f} ms over {len(best)} steps")
  for n, (s, c) in sorted(by.items(), key=lambda kv: -kv[1][0])[:a.top]:
    plan = next((st[1].plan for st in program.steps if st[0] == "call" and st[1].name == n), "")
    print(f"  {s * 1e3:9.3f} ms  x{c:<3d} {100 * s / total:5.1f}%  {n}  {plan}")
  # a warm call's wall time in three parts: building the graph, realize (find the program, issue every step), the
  # wait for the device after the last step was issued
  from runtime.device import get_device
  dev, parts = get_device(a.device), []
  for i in range(3, 23):
    t0 = time.perf_counter(); out = forward(i); t1 = time.perf_counter(); out.realize(); t2 = time.perf_counter()
    dev.synchronize(); parts.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
  med = lambda i: sorted(p[i] for p in parts)[len(parts) // 2] * 1e3
  print(f"warm call (median of 20): build the graph {med(0):.3f} ms, realize {med(1):.3f} ms, then wait for the device "
        f"{med(2):.3f} ms; the whole call {sorted(sum(p) for p in parts)[len(parts) // 2] * 1e3:.3f} ms")


if __name__ == "__main__":
  main()
