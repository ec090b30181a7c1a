"""Where a GPT-2-style training step's kernel time goes (bench/train.py's model and step): warm steps with each step of
the program waited for alone, each kernel's fastest of `--repeat` steps (a shared machine's noise is one-sided), kernels
grouped by name (summed ms, count, share, plan), largest first.

  python bench/train_kernels.py                       # bench/train.py's CPU size: 4 layers, 64 tokens, width 256
  python bench/train_kernels.py --threads 1,2         # one process per thread count, side by side, with the scaling
  python bench/train_kernels.py --phases              # the kernel time split into forward, backward and optimizer
  python bench/train_kernels.py --device CUDA --layers 12 --tokens 1024 --width 768 --heads 12

A pick (a step with several implementations, the fastest taken on first use) is named by the one it took. Phases are
read off the one program's data flow, not by realizing them apart (which would recompute the forward): a step is the
optimizer's when it writes memory the program was given (parameters, their state), the forward's when the loss
depends on it, the backward's otherwise; allocations and frees are the host's.

Last line (one thread count): a warm step's wall time split into building the graph (forward, backward, the
optimizer's updates) and realize (finding the program and running it), beside the kernels' sum.
"""
from __future__ import annotations
import argparse, json, os, subprocess, sys, time
from collections import defaultdict
import numpy as np
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT); sys.path.insert(0, os.path.join(ROOT, "examples"))


def step_name(step) -> tuple[str, str]:
  """(name, plan) of one step of a Program: a kernel's, a library call's, a pick's choice, or the step's kind."""
  if step[0] == "call": return step[1].name, step[1].plan
  if step[0] == "extern": return (step[3].name, step[3].plan) if step[5][0] == "generated" else (str(step[1]), "library")
  if step[0] == "pick":
    calls = step[2][1] or step[1][0][1]
    return "+".join(ck.name for ck, _ in calls), " then ".join(getattr(ck, "plan", "library") for ck, _ in calls)
  return step[0], ""


def phases(program) -> list[str]:
  """The phase of each step: 'optimizer', 'forward', 'backward' or 'host' (see the module's docstring)."""
  io = [program.step_buffers(s) for s in program.steps]
  loss = [i for _, _, i in program.outputs if program.table[i][0] == "new" and program.table[i][2] == 1]   # (kind, device, size, dtype)
  needed, forward = set(loss), set()
  for n in reversed(range(len(io))):   # the steps the loss depends on, walking back from its last write
    if io[n][0] & needed: forward.add(n); needed |= io[n][1]
  out = []
  for n, s in enumerate(program.steps):
    if s[0] in ("alloc", "free"): out.append("host")
    elif any(program.table[i][0] == "param" for i in io[n][0]): out.append("optimizer")
    else: out.append("forward" if n in forward else "backward")
  return out


def measure(a) -> dict:
  """In one process: per kernel name, [fastest ms summed over its calls, calls, plan, phase]; the step's split."""
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
  runs: list[list] = []   # per timed step: each realize's (program, step seconds)

  def timed_run(self, inputs, debug=0, step_seconds=None):
    runs[-1].append((self, []))
    return plain_run(self, inputs, debug, runs[-1][-1][1])
  plain_run, Program.run = Program.run, timed_run
  try:
    for _ in range(a.repeat): runs.append([]); step()
  finally: Program.run = plain_run
  # the step's program: the largest realize (the ids' check is another); each step's fastest run
  at = max(range(len(runs[0])), key=lambda i: len(runs[0][i][1]))
  program = runs[0][at][0]
  seconds = np.min([r[at][1] for r in runs], axis=0)
  by: dict = defaultdict(lambda: [0.0, 0, "", ""])
  split: dict = defaultdict(float)
  for s, t, phase in zip(program.steps, seconds, phases(program)):
    name, plan = step_name(s)
    e = by[name]; e[0] += t * 1e3; e[1] += 1; e[2] = plan; e[3] = phase
    split[phase] += t * 1e3
  return {"kernels": dict(by), "total_ms": float(seconds.sum() * 1e3), "steps": len(seconds), "phases": dict(split),
          "build_ms": parts[0] * 1e3, "realize_ms": parts[1] * 1e3}


def main() -> None:
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--device", default=os.environ.get("DEVICE", "CPU"))
  ap.add_argument("--layers", type=int, default=4); ap.add_argument("--tokens", type=int, default=64)
  ap.add_argument("--width", type=int, default=256); ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--batch", type=int, default=4); ap.add_argument("--vocab", type=int, default=8192)
  ap.add_argument("--top", type=int, default=30)
  ap.add_argument("--repeat", type=int, default=5, help="timed steps; each kernel's fastest is kept")
  ap.add_argument("--threads", default=None, help="comma-separated OpenMP thread counts, one process each (CPU)")
  ap.add_argument("--phases", action="store_true", help="the kernel time of forward, backward and optimizer")
  ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)   # a child of --threads
  a = ap.parse_args()
  if a.json: print("RESULT " + json.dumps(measure(a))); return
  counts = [int(n) for n in a.threads.split(",")] if a.threads else [None]
  results = []
  for n in counts:
    if n is None: results.append(measure(a)); continue
    env = {**os.environ, "OMP_NUM_THREADS": str(n), "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run([sys.executable, __file__, "--json", *sys.argv[1:]], env=env, capture_output=True, text=True)
    line = next((ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")), None)
    if line is None: sys.exit(f"--threads {n}: the measuring process failed:\n{out.stderr[-2000:]}")
    results.append(json.loads(line[7:]))
  first = results[0]
  heads = [f"{n} thread{'s' * (n != 1)}" if n else "this run" for n in counts]
  print(f"{a.device} training step, {a.layers} layers, {a.tokens} tokens, width {a.width}, batch {a.batch}, vocabulary "
        f"{a.vocab}: {first['steps']} steps, each kernel the fastest of {a.repeat} steps")
  print("kernel time ms: " + ", ".join(f"{h} {r['total_ms']:.2f}" for h, r in zip(heads, results)))
  if a.phases:
    for ph in ("forward", "backward", "optimizer", "host"):
      print(f"  {ph:<9s} " + "  ".join(f"{r['phases'].get(ph, 0.0):8.2f} ms ({h})" for h, r in zip(heads, results)))
  cols = "  ".join(f"{h:>10s}" for h in heads) + ("   scaling" if len(results) > 1 else "")
  print(f"  {cols}  calls  share  phase      kernel  plan")
  for name, (ms, calls, plan, phase) in sorted(first["kernels"].items(), key=lambda kv: -kv[1][0])[:a.top]:
    row = [r["kernels"].get(name, [float("nan")])[0] for r in results]
    scale = f"  {row[0] / row[-1]:7.2f}x" if len(row) > 1 else ""
    print("  " + "  ".join(f"{t:10.3f}" for t in row) + f"{scale}  x{calls:<4d} {100 * ms / first['total_ms']:5.1f}%  "
          f"{phase:<9s}  {name}  {plan}")
  for h, r in zip(heads, results):
    print(f"warm step ({h}, median of 5): build the graph {r['build_ms']:.1f} ms, realize {r['realize_ms']:.1f} ms "
          f"(kernels waited for one at a time: {r['total_ms']:.1f} ms)")


if __name__ == "__main__":
  main()
