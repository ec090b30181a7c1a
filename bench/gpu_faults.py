"""What a GPU does at its limits, run on a real one (the things CI's model of a grid cannot show):

1. the grid-stride loop: kernels planned with MAX_GRID lowered to 7 blocks (rules/gpu.py) loop over their blocks,
   and give numpy's values (elementwise, a row sum, a tiled product);
2. a cached cubin the driver refuses (CUDAInvalidImage) is rebuilt: a kernel's cache entry overwritten with garbage,
   the module dropped from the device, the kernel built again;
3. an illegal address (CUDA error 700) in a child process: the error it raises, and what later calls in that process
   do (the context is poisoned: they raise too, no wrong answer comes back).

  python3 bench/gpu_faults.py          # needs a CUDA GPU; prints one line per check
"""
from __future__ import annotations
import os, subprocess, sys, tempfile
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def grid_stride() -> None:
  import rules.gpu
  from tensor import Tensor
  rng = np.random.default_rng(0)
  x, y = rng.standard_normal((1000, 300), dtype=np.float32), rng.standard_normal(300, dtype=np.float32)
  a, b = rng.standard_normal((256, 64), dtype=np.float32), rng.standard_normal((64, 256), dtype=np.float32)
  old = rules.gpu.MAX_GRID
  rules.gpu.MAX_GRID = 7
  try:
    tx, ty = Tensor(x, device="CUDA"), Tensor(y, device="CUDA")
    got = [((tx * ty + 1).relu()).numpy(), tx.sum(1).numpy()]
  finally: rules.gpu.MAX_GRID = old
  want = [np.maximum(x * y + 1, 0), x.sum(1)]
  ok = all(np.allclose(g, w, rtol=1e-4, atol=1e-4) for g, w in zip(got, want))
  print(f"1. grid-stride loop (MAX_GRID=7 blocks): elementwise 1000x300 and a row sum {'match numpy' if ok else 'WRONG'}")
  tile = (Tensor(a, device="CUDA") @ Tensor(b, device="CUDA")).numpy()
  print(f"   a tiled product 256x64 @ 64x256: {'matches numpy' if np.allclose(tile, a @ b, rtol=1e-4, atol=1e-4) else 'WRONG'}")


def invalid_image() -> None:
  from runtime.device import get_device
  dev = get_device("CUDA")
  src = 'extern "C" __global__ void fault_check_k(float* __restrict__ p) { p[threadIdx.x] += 1.0f; }\n'
  dev.build(src, ["fault_check_k"])
  cubins = sorted(p for p in __import__("pathlib").Path(os.environ["GRAFT_CACHE_DIR"]).rglob("*.cubin"))
  path = max(cubins, key=lambda p: p.stat().st_mtime)
  path.write_bytes(b"not a cubin" * 100)
  dev._modules.clear()   # the loaded module goes: the next build loads the entry from disk again
  prog = dev.build(src, ["fault_check_k"])["fault_check_k"]
  from runtime.buffer import Buffer
  from rewrite import dtypes
  buf = Buffer("CUDA", 32, dtypes.float32).copyin(np.zeros(32, np.float32))
  prog(buf.handle, global_size=1, local_size=32, wait=True)
  ok = np.array_equal(buf.numpy(), np.ones(32, np.float32))
  print(f"2. a cached cubin overwritten with garbage: rebuilt ({path.stat().st_size} bytes now) and it runs: {ok}")


CHILD = r'''
import numpy as np
from runtime.device import get_device
from runtime.cuda import CUDAError
from tensor import Tensor
dev = get_device("CUDA")
prog = dev.build('extern "C" __global__ void fault_bad(float* p) { p[threadIdx.x] = 1.0f; }\n', ["fault_bad"])["fault_bad"]
try:
  prog(16, global_size=1, local_size=32, wait=True)
  print("   the bad launch returned without an error")
except CUDAError as e: print(f"   the bad launch: {type(e).__name__}: {str(e)[:160]}")
try:
  got = (Tensor(np.ones(4, np.float32), device="CUDA") + 1).numpy()
  print(f"   a later computation returned {got}: {'right' if (got == 2).all() else 'WRONG'}")
except Exception as e: print(f"   a later computation: {type(e).__name__}: {str(e)[:160]}")
'''


def illegal_address() -> None:
  print("3. an illegal address in a child process:")
  r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120, env=os.environ)
  print(r.stdout.rstrip() or "   (no output)")
  print(f"   the child exited with {r.returncode}" + (f"; stderr: {r.stderr.strip()[-300:]}" if r.returncode else ""))


if __name__ == "__main__":
  with tempfile.TemporaryDirectory() as d:
    os.environ["GRAFT_CACHE_DIR"] = d
    grid_stride()
    invalid_image()
    illegal_address()
