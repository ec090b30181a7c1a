"""A CUDA kernel written for a block's threads (renderers/attention_cuda.py: shared memory, __syncthreads,
__syncthreads_or, warp shuffles), compiled as C++ and run on the CPU with one POSIX thread per CUDA thread, blocks one
after another: a test of its indexing, tiles and synchronization on a machine without a GPU (CI).

Every thread of a block must reach each barrier and shuffle (the kernels here call them uniformly); a shuffle is a
write of each thread's value, a barrier, and a read of its partner's. Warp timing (what only a GPU shows) is not
modelled: a kernel that is right here may still race on a GPU only where it leans on a warp's lockstep, which these
kernels never do."""
from __future__ import annotations
import ctypes, hashlib, re, subprocess, tempfile
from pathlib import Path
import numpy as np

PRELUDE = r"""
#include <pthread.h>
#include <math.h>
#include <string.h>
#include <atomic>
struct __attribute__((aligned(16))) floatx4 { float v[4]; };
struct g_dim { unsigned x, y, z; };
static thread_local g_dim threadIdx, blockIdx;
static pthread_barrier_t g_barrier;
static float g_exchange[1024];
static std::atomic<int> g_any;
static unsigned char g_dynamic_shared[256 << 10] __attribute__((aligned(128)));
static inline void __syncthreads() { pthread_barrier_wait(&g_barrier); }
static inline int __syncthreads_or(int p) {
  __syncthreads(); if (threadIdx.x == 0) g_any = 0; __syncthreads();
  if (p) g_any |= 1;
  __syncthreads(); int r = g_any; __syncthreads(); return r;
}
static inline float __shfl_xor_sync(unsigned, float v, int o) {
  __syncthreads(); g_exchange[threadIdx.x] = v; __syncthreads();
  float r = g_exchange[threadIdx.x ^ o]; __syncthreads(); return r;
}
static inline float __int_as_float(int i) { float f; memcpy(&f, &i, 4); return f; }
#define __global__
#define __launch_bounds__(...)
#define G_SHARED(n)
#define __restrict__ __restrict
"""

_built: dict[str, ctypes.CDLL] = {}


def _library(source: str, name: str) -> ctypes.CDLL:
  params = re.search(rf"\b{name}\(([^)]*)\)", source).group(1).split(",")
  types = [p.replace("__restrict__", "").strip().rsplit(" ", 1)[0] for p in params]
  call = ", ".join(f"({t})args[{i}]" for i, t in enumerate(types))
  text = PRELUDE + source.replace('extern "C"', "") + f"""
struct g_job {{ void** args; int blocks, thread; }};
static void* g_thread(void* p) {{
  g_job* job = (g_job*)p; void** args = job->args; threadIdx.x = job->thread;
  for (int b = 0; b < job->blocks; b++) {{ blockIdx.x = b; {name}({call}); __syncthreads(); }}
  return 0;
}}
extern "C" void g_launch(void** args, int blocks, int threads) {{
  pthread_t t[1024]; g_job jobs[1024];
  pthread_barrier_init(&g_barrier, 0, threads);
  for (int i = 0; i < threads; i++) {{ jobs[i] = g_job{{args, blocks, i}}; pthread_create(&t[i], 0, g_thread, &jobs[i]); }}
  for (int i = 0; i < threads; i++) pthread_join(t[i], 0);
  pthread_barrier_destroy(&g_barrier);
}}
"""
  key = hashlib.sha1(text.encode()).hexdigest()
  if key not in _built:
    d = Path(tempfile.mkdtemp(prefix="cuda_threads_"))
    (d / "k.cpp").write_text(text)
    subprocess.run(["g++", "-O1", "-w", "-shared", "-fPIC", "-o", str(d / "k.so"), str(d / "k.cpp"), "-lpthread"], check=True)
    _built[key] = ctypes.CDLL(str(d / "k.so"))
  return _built[key]


def launch(source: str, name: str, arrays: list[np.ndarray], blocks: int, threads: int) -> None:
  """Run kernel `name` of `source` over `blocks` blocks of `threads` threads on `arrays` (its parameters in order,
  C-contiguous: written in place)."""
  assert threads <= 1024 and all(a.flags.c_contiguous for a in arrays)
  args = (ctypes.c_void_p * len(arrays))(*[a.ctypes.data for a in arrays])
  _library(source, name).g_launch(args, blocks, threads)
