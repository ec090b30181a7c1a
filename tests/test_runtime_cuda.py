"""The CUDA device: nvcc builds (no GPU needed), the errors for a missing driver or nvcc, and, where a GPU and its
driver are present, copies, launches, event timing, the pool and driver errors. Tests that need what this machine
lacks are skipped with the reason (run `pytest -rs` to see them)."""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from rewrite.dtypes import dtypes
from runtime import cache, cuda, device
from runtime.buffer import Buffer
from runtime.cuda import CUDAError, CUDAUnavailable, compile_cuda, kernel_params
from runtime.device import CompileError, Device, get_device

REPO = Path(__file__).resolve().parent.parent

KERNELS = r"""
extern "C" __global__ void add(float* __restrict__ out, const float* __restrict__ a, const float* __restrict__ b, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = a[i] + b[i];
}
extern "C" __global__ void __launch_bounds__(256) saxpy(float* y, const float* x, float k, long long n) {
  long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) y[i] = k * x[i] + y[i];
}
extern "C" __global__ void where(int* out) {
  // each thread writes its flat index at the place its grid and block coordinates name
  int bx = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  int t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  int i = bx * blockDim.x * blockDim.y * blockDim.z + t;
  out[i] = i;
}
"""


def _nvcc_or_none():
  try: return cuda.find_nvcc()
  except CompileError: return None


needs_nvcc = pytest.mark.skipif(_nvcc_or_none() is None, reason="nvcc not found (not on PATH, $CUDA_HOME/bin or "
                                                                 "/usr/local/cuda/bin): CUDA builds not tested")


pytestmark = pytest.mark.usefixtures("cache_env")  # every test builds into a private cache (tests/conftest.py)


@pytest.fixture(scope="module")
def gpu():
  try: dev = get_device("CUDA")
  except CUDAUnavailable as e: pytest.skip(f"no usable CUDA GPU here: {str(e).split(' (')[0]}")
  if _nvcc_or_none() is None: pytest.skip("a CUDA GPU is present but nvcc is not: GPU kernels not tested")
  return dev


# ---------------------------------------------------------------- without a GPU

def test_import_touches_nothing():
  # a fresh interpreter: importing the module loads neither cffi's driver handle nor runs nvcc
  code = "import runtime.cuda as c, sys; assert c._lib is None and 'cffi' not in sys.modules; print('ok')"
  r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
  assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@needs_nvcc
def test_nvcc_compiles_a_kernel_to_an_sm90_cubin():
  cubin = compile_cuda(KERNELS, "sm_90")
  assert cubin[:4] == b"\x7fELF"
  # nvcc names the kernels in the cubin's symbol table; extern "C" keeps them unmangled
  for name in (b"add", b"saxpy", b"where"): assert name in cubin
  before = dict(cache.stats)
  assert compile_cuda(KERNELS, "sm_90") == cubin
  assert cache.stats["build"] == before.get("build", 0)


@needs_nvcc
def test_nvcc_failure_is_a_compile_error_naming_the_source():
  with pytest.raises(CompileError) as e:
    compile_cuda('extern "C" __global__ void broken(float* x) { x[0] = undefined_thing; }')
  msg = str(e.value)
  assert "nvcc failed" in msg and "undefined_thing" in msg
  src = next(w for w in msg.split() if w.endswith(".cu"))
  assert Path(src).is_file() and "broken" in Path(src).read_text()


def test_missing_nvcc_says_how_to_use_the_cpu(monkeypatch, tmp_path):
  monkeypatch.setenv("PATH", str(tmp_path))
  monkeypatch.setenv("CUDA_HOME", str(tmp_path / "cuda"))
  monkeypatch.setattr(cuda, "NVCC_FALLBACKS", (str(tmp_path / "nowhere" / "nvcc"),))
  with pytest.raises(CompileError, match="nvcc.*not found.*DEVICE=CPU"):
    compile_cuda(KERNELS)


def test_missing_driver_says_how_to_use_the_cpu(monkeypatch):
  monkeypatch.setattr(cuda, "LIBCUDA", "libcuda-that-is-not-installed.so.1")
  monkeypatch.setattr(cuda, "_lib", None)
  monkeypatch.setattr(device, "_instances", {})  # so get_device makes a new CUDADevice
  monkeypatch.setenv("DEVICE", "CUDA")
  with pytest.raises(CUDAUnavailable, match="NVIDIA driver.*DEVICE=CPU"):
    Device.default()


def test_a_driver_that_failed_to_load_is_not_searched_for_again(monkeypatch):
  # a machine without a GPU renders CUDA sources, and each kernel asks for the device: the first failure is kept
  monkeypatch.setattr(cuda, "LIBCUDA", "libcuda-that-is-not-installed.so.1")
  monkeypatch.setattr(cuda, "_lib", None)
  monkeypatch.setattr(cuda, "_unloadable", {})
  with pytest.raises(CUDAUnavailable) as first: cuda.driver()
  import cffi
  monkeypatch.setattr(cffi, "FFI", None)   # a second load would fail on this, not with the driver's message
  with pytest.raises(CUDAUnavailable) as again: cuda.driver()
  assert str(again.value) == str(first.value) and "libcuda-that-is-not-installed" in str(again.value)


def test_failed_driver_calls_raise_errors_that_carry_the_call_and_code():
  cuda.check("cuCtxSynchronize", 0)  # success says nothing
  with pytest.raises(cuda.CUDAOutOfMemory, match=r"cuMemAlloc_v2 failed with .*\(2\).*; allocating 9 bytes") as e:
    cuda.check("cuMemAlloc_v2", 2, "allocating 9 bytes")
  assert isinstance(e.value, MemoryError) and e.value.code == 2  # so the allocator gives its pool back and retries
  with pytest.raises(cuda.CUDAInvalidImage, match=r"cuModuleLoadData failed with .*\(200\)") as e:
    cuda.check("cuModuleLoadData", 200)
  assert not isinstance(e.value, MemoryError)  # the cache rebuilds an image the driver refuses
  with pytest.raises(CUDAError, match=r"cuLaunchKernel failed with .*\(701\).*; kernel k") as e:
    cuda.check("cuLaunchKernel", 701, "kernel k")
  assert type(e.value) is CUDAError and e.value.error_string


def test_parameters_come_from_the_source():
  assert kernel_params(KERNELS, "add") == ["CUdeviceptr", "CUdeviceptr", "CUdeviceptr", "int32_t"]
  assert kernel_params(KERNELS, "saxpy") == ["CUdeviceptr", "CUdeviceptr", "float", "int64_t"]
  assert kernel_params(KERNELS, "where") == ["CUdeviceptr"]
  with pytest.raises(ValueError, match="__global__ void missing"):
    kernel_params(KERNELS, "missing")
  with pytest.raises(ValueError, match="cannot pass parameter"):
    kernel_params('extern "C" __global__ void f(struct S s) {}', "f")


def test_a_kernels_tensor_maps_are_declared_before_its_name_and_passed_after_its_buffers():
  from runtime.cuda import TensorMapDecl, cluster_blocks, persistent, tensor_maps
  src = ('extern "C" __global__ __launch_bounds__(384, 1) G_SHARED(1024) G_PERSISTENT __cluster_dims__(2, 1, 1) '
         'G_TMAP(1, 2, 512, 2048, 520, 64, 128, 8) void k(half* data0, const half* data1, const __grid_constant__ g_tensor_map g_map_a) {}')
  # the map of parameter 1's buffer: 2048 rows of 512 two-byte elements, 520 apart, from element 8, in 64 x 128 boxes
  assert tensor_maps(src, "k") == [TensorMapDecl(1, 2, 512, 2048, 520, 64, 128, 8)]
  assert kernel_params(src, "k") == ["CUdeviceptr", "CUdeviceptr", "CUtensorMap"]
  assert tensor_maps(KERNELS, "add") == [] and persistent(src, "k") and not persistent(KERNELS, "add")
  # launched in clusters of 2 blocks (a persistent one: in whole clusters, as many as the GPU holds at once)
  assert cluster_blocks(src, "k") == 2 and cluster_blocks(KERNELS, "add") == 1


# ---------------------------------------------------------------- with a GPU

def test_device_properties(gpu):
  major, minor = gpu.compute_capability
  assert gpu.arch == f"sm_{major}{minor}" and major >= 3
  assert gpu.max_threads_per_block >= 512 and gpu.max_block_dims[0] >= 512 and gpu.max_grid_dims[0] >= 65535
  assert gpu.shared_memory_per_block >= 16384 and gpu.multiprocessor_count >= 1
  assert get_device("cuda") is gpu and gpu.name == "CUDA"


def test_copy_in_and_out(gpu):
  a = np.arange(1000, dtype=np.float32) * 0.5
  buf = Buffer("CUDA", 1000, dtypes.float32).copyin(a)
  np.testing.assert_array_equal(buf.numpy(), a)
  other = Buffer("CUDA", 1000, dtypes.float32)
  gpu.allocator.copy(other.handle, buf.handle, buf.nbytes)
  np.testing.assert_array_equal(other.numpy(), a)
  empty = Buffer("CUDA", 0, dtypes.int32)
  assert empty.numpy().shape == (0,) and empty.handle


def test_kernels_match_numpy(gpu):
  progs = gpu.build(KERNELS, ["add", "saxpy", "where"])
  n = 1000  # not a multiple of the block, so the bounds check matters
  a, b = np.random.rand(n).astype(np.float32), np.random.rand(n).astype(np.float32)
  A, B = Buffer("CUDA", n, dtypes.float32).copyin(a), Buffer("CUDA", n, dtypes.float32).copyin(b)
  out = Buffer("CUDA", n, dtypes.float32)
  assert progs["add"](out.handle, A.handle, B.handle, n, global_size=((n + 255) // 256, 1, 1),
                      local_size=(256, 1, 1)) is None
  np.testing.assert_array_equal(out.numpy(), a + b)  # one IEEE add: exactly numpy's

  progs["saxpy"](out.handle, A.handle, 2.5, n, global_size=(n + 127) // 128, local_size=128)
  np.testing.assert_allclose(out.numpy(), np.float32(2.5) * a + (a + b), rtol=1e-6)

  grid, block = (2, 3, 2), (4, 2, 1)
  total = int(np.prod(grid) * np.prod(block))
  W = Buffer("CUDA", total, dtypes.int32)
  progs["where"](W.handle, global_size=grid, local_size=block)
  np.testing.assert_array_equal(W.numpy(), np.arange(total, dtype=np.int32))


def test_a_cuda_graph_runs_its_launches_in_order_and_takes_new_arguments(gpu):
  add = gpu.build(KERNELS, ["add"])["add"]
  n = 1000
  a, b, c = (np.random.default_rng(i).random(n, np.float32) for i in range(3))
  A, B, C = (Buffer("CUDA", n, dtypes.float32).copyin(x) for x in (a, b, c))
  T, out = Buffer("CUDA", n, dtypes.float32), Buffer("CUDA", n, dtypes.float32)
  grid = (n + 255) // 256
  graph = cuda.CUDAGraph(gpu, [(add, [T.handle, A.handle, B.handle, n], grid, 256),     # t = a + b
                               (add, [out.handle, T.handle, B.handle, n], grid, 256)])  # out = t + b: after the first
  graph.launch()
  np.testing.assert_array_equal(out.numpy(), (a + b) + b)
  graph.set_args(0, [T.handle, C.handle, B.handle, n])   # t = c + b from now on
  graph.launch(); graph.launch()
  np.testing.assert_array_equal(out.numpy(), (c + b) + b)
  with pytest.raises(TypeError, match="takes 4 arguments"):
    graph.set_args(1, [out.handle])
  graph.close(); graph.close()   # closing twice is harmless


def test_build_is_cached_and_checks_names(gpu):
  gpu.build(KERNELS, ["add"])
  before = dict(cache.stats)
  gpu.build(KERNELS, ["add", "where"])
  assert cache.stats["build"] == before.get("build", 0)
  with pytest.raises(ValueError, match="nope"):
    gpu.build(KERNELS, ["nope"])
  # declared in the source but not extern "C": the cubin holds only a mangled name
  src = '__global__ void mangled(int* x) { x[0] = 1; }'
  with pytest.raises(CompileError, match="extern"):
    gpu.build(src, ["mangled"])


def test_event_timing(gpu):
  add = gpu.build(KERNELS, ["add"])["add"]
  n = 1 << 22
  A = Buffer("CUDA", n, dtypes.float32).copyin(np.ones(n, np.float32))
  out = Buffer("CUDA", n, dtypes.float32)
  t = add(out.handle, A.handle, A.handle, n, global_size=n // 256, local_size=256, wait=True)
  assert isinstance(t, float) and 0 < t < 1.0
  assert out.numpy()[-1] == 2.0
  gpu.synchronize()


def test_pool_reuses_freed_memory(gpu):
  alloc = gpu.allocator
  alloc.clear_pool()
  h = alloc.alloc(4096)
  alloc.free(h, 4096)
  assert alloc.pooled_bytes() == 4096 and alloc.alloc(4096) == h
  # a Buffer that goes away gives its memory back to the pool
  buf = Buffer("CUDA", 1024, dtypes.float32)
  handle = buf.handle
  del buf
  assert alloc.alloc(4096) == handle
  alloc.free(h, 4096)
  alloc.free(handle, 4096)
  alloc.clear_pool()
  assert alloc.pooled_bytes() == 0


def test_driver_errors_become_cuda_errors(gpu):
  add = gpu.build(KERNELS, ["add"])["add"]
  A = Buffer("CUDA", 16, dtypes.float32)
  with pytest.raises(CUDAError) as e:
    add(A.handle, A.handle, A.handle, 16, global_size=1, local_size=gpu.max_threads_per_block * 2)
  assert e.value.call == "cuLaunchKernel" and e.value.error_name == "CUDA_ERROR_INVALID_VALUE"
  assert "threads per block" in str(e.value) and e.value.error_string
  # the error is not sticky: the context still works
  add(A.handle, A.handle, A.handle, 16, global_size=1, local_size=16)
  gpu.synchronize()


def test_bad_arguments_are_refused_before_launch(gpu):
  add = gpu.build(KERNELS, ["add"])["add"]
  A = Buffer("CUDA", 16, dtypes.float32)
  with pytest.raises(TypeError, match="takes 4 arguments, got 3"):
    add(A.handle, A.handle, A.handle, global_size=1, local_size=16)
  with pytest.raises(TypeError, match="int32_t"):
    add(A.handle, A.handle, A.handle, 1 << 40, global_size=1, local_size=16)
  with pytest.raises(ValueError, match="local_size"):
    add(A.handle, A.handle, A.handle, 16, global_size=1, local_size=(0, 1))


def test_buffers_alive_at_exit_are_harmless(gpu):
  # buffers still alive (and pooled) when the interpreter exits must not print errors or crash
  code = ("from rewrite.dtypes import dtypes; from runtime.buffer import Buffer; import numpy as np\n"
          "keep = [Buffer('CUDA', 1 << 20, dtypes.float32).copyin(np.ones(1 << 20, np.float32)) for _ in range(3)]\n"
          "gone = Buffer('CUDA', 4, dtypes.float32); gone.handle; del gone\n"
          "print('ok')")
  r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                     env={**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
  assert r.returncode == 0 and r.stdout.strip() == "ok" and not r.stderr, r.stderr
