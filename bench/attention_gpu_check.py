"""Fused attention on a device: its host program (one kernel, no T x T buffer), numpy's values, its time.

  DEVICE=CUDA python3 bench/attention_gpu_check.py --shape 1,4096,64 --causal   # T = 4096: the program, one head
  DEVICE=CUDA python3 bench/attention_gpu_check.py --shape 32,1024,64 --lanes 1,2,4,16   # each in its own process
  DEVICE=CUDA python3 bench/attention_gpu_check.py --shape 32,1024,64 --unroll 64,16,8

--lanes sets the chunks of keys a GPU row is split into (rules/attention.py LANES, whatever the rows) for each run;
--unroll the steps the tiled kernel's loops over d and keys unroll at a time (renderers/attention_cuda.py UNROLL);
each value runs in a fresh process (its own compile, timed: "first call"). Time: median of 20 calls of realize +
device synchronize, after 3 warm-ups.
"""
import argparse, math, os, subprocess, sys, time
import numpy as np

p = argparse.ArgumentParser()
p.add_argument("--shape", default="1,4096,64")
p.add_argument("--causal", action="store_true")
p.add_argument("--lanes", default="")
p.add_argument("--unroll", default="")
args = p.parse_args()
for flag in ("lanes", "unroll"):
  if "," in getattr(args, flag):
    for value in getattr(args, flag).split(","):
      cmd = [sys.executable, __file__, "--shape", args.shape, f"--{flag}", value] + (["--causal"] if args.causal else [])
      subprocess.run(cmd, check=False)
    sys.exit(0)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import rules.attention
if args.lanes: rules.attention.LANES, rules.attention.THREADS_PER_SM = int(args.lanes), 1 << 62   # exactly that many
import renderers.attention_cuda
if args.unroll: renderers.attention_cuda.UNROLL = int(args.unroll)
from tensor import Tensor
from runtime.realize import last_program
from runtime.device import Device

b, t, d = map(int, args.shape.split(","))
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((b, t, d)).astype(np.float32) for _ in range(3))
mask = np.triu(np.full((t, t), -np.inf, np.float32), 1) if args.causal else np.zeros((t, t), np.float32)
qt, kt, vt, mt = Tensor(q), Tensor(k), Tensor(v), Tensor(mask)
f = lambda: ((qt @ kt.transpose(-1, -2)) / math.sqrt(d) + mt).softmax(-1) @ vt
t0 = time.perf_counter()
got = f().numpy()
first = time.perf_counter() - t0
program = last_program()
ref = np.empty_like(got)
for i in range(b):   # per batch: numpy's T x T scores of one head at a time
  s = q[i] @ k[i].T / math.sqrt(d) + mask
  e = np.exp(s - s.max(-1, keepdims=True))
  ref[i] = (e / e.sum(-1, keepdims=True)) @ v[i]
dev = Device.default()
times = []
for n in range(23):
  t0 = time.perf_counter()
  f().realize()
  dev.synchronize()
  if n >= 3: times.append(time.perf_counter() - t0)
print(f"{b}x{t}x{d}{' causal' if args.causal else ''} LANES={rules.attention.LANES} UNROLL={renderers.attention_cuda.UNROLL}: first call {first:.3f} s, median {sorted(times)[len(times) // 2] * 1e3:.3f} ms, "
      f"max abs error against numpy {np.abs(got - ref).max():.2e}; {program.__str__().splitlines()[0]}")
