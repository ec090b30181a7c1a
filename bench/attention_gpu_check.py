"""Fused attention at T = 4096 on a device: its host program (one kernel, no T x T buffer), its time, numpy's values.

  DEVICE=CUDA python3 bench/attention_gpu_check.py [T]
"""
import math, sys, time
import numpy as np
from tensor import Tensor
from runtime.realize import last_program
from runtime.device import Device

t = int(sys.argv[1]) if len(sys.argv) > 1 else 4096
rng = np.random.default_rng(0)
q, k, v = (rng.standard_normal((1, t, 64)).astype(np.float32) for _ in range(3))
mask = np.triu(np.full((t, t), -np.inf, np.float32), 1)
qt, kt, vt, mt = Tensor(q), Tensor(k), Tensor(v), Tensor(mask)
f = lambda: ((qt @ kt.transpose(-1, -2)) / 8 + mt).softmax(-1) @ vt
got = f().numpy()
print(last_program())
s = q @ k.transpose(0, 2, 1) / 8 + mask
e = np.exp(s - s.max(-1, keepdims=True))
print("max abs error against numpy:", np.abs(got - (e / e.sum(-1, keepdims=True)) @ v).max())
times = []
for _ in range(10):
  t0 = time.perf_counter(); out = f(); out.numpy(); times.append(time.perf_counter() - t0)
print(f"T={t} causal, one head of 64: median {sorted(times)[5] * 1e3:.2f} ms (wall, with the copy back)")
