"""The CUDA device: kernels built with nvcc into a cubin, loaded and launched through the CUDA driver API.

The driver (`libcuda.so.1`, installed with the NVIDIA driver, not with the toolkit) is reached through cffi's ABI
mode: a `cdef` of the few functions used and a `dlopen`, so nothing is compiled to talk to it. Every driver call that
fails raises `CUDAError`, which carries the call's name and the driver's own error name and text.

Nothing is touched at import: the driver is loaded when the device is created (`get_device("CUDA")`, which is what
`DEVICE=CUDA` does), and nvcc is looked for at the first build. Without the driver that creation raises
`CUDAUnavailable`; without nvcc the build raises `CompileError`; both messages say how to fall back to DEVICE=CPU.
`compile_cuda(source, arch)` needs nvcc only, so machines without a GPU (CI) can still check that kernels compile.

Kernels. All kernels of one source are built by one nvcc call (`-cubin -arch=sm_XY`, XY the device's compute
capability; no --use_fast_math, so float math stays IEEE and matches numpy within float32 rounding; nvcc's default
FMA contraction is kept, it only rounds less). Each kernel named in `build(source, names)` must be `extern "C"` (so
its symbol is its name) and declared as `__global__ void NAME(params)` with its parameter list up to the first `)`
written out in the source, e.g. `extern "C" __global__ void add(float* out, const float* a, int n)`. The launch reads
that list: a pointer parameter takes a device pointer (an int, what the allocator hands out), a scalar parameter takes
a Python int or float converted to its declared C type (the renderer's indices and sizes are `int`: 32 bits, so a
Python int outside int32 is refused instead of being truncated).

A kernel may also take tensor maps (Hopper's TMA: renderers/cuda_tma.py): each declared by `G_TMAP(...)` before its
name and passed as a `const __grid_constant__ g_tensor_map` parameter after the others. They are no arguments of the
call: each launch makes them (`cuTensorMapEncodeTiled`, once per buffer pointer) from the pointer argument each names,
so a warm call over new buffers copies from those.

Launch geometry: `global_size` is the grid, in blocks (not threads), and `local_size` the block, in threads; each is
a 3-tuple (shorter tuples and plain ints are padded with 1s). A kernel marked `G_PERSISTENT` before its name loops
over its blocks itself: it is launched with at most a block a multiprocessor, and where it also declares
`__cluster_dims__(n, 1, 1)`, in whole clusters of n, at most as many as the GPU holds at once
(cuOccupancyMaxActiveClusters). Launches go to the legacy default stream, so they run in order with each other and
with the copies, and `copyout` waits for them.
"""
from __future__ import annotations
import atexit
import functools
import operator
import os
import re
import shutil
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from runtime import cache
from runtime.device import Allocator, CompileError, Device, parameter_types, run_compiler

LIBCUDA = "libcuda.so.1"  # the driver library's soname; a module attribute so tests can point it elsewhere
NVCC_FLAGS = ("-cubin",)  # plus -arch=sm_XY; nothing that relaxes IEEE float semantics
# The first line of a source that declares itself all it uses of CUDA's headers (renderers/cuda.py writes such
# sources): nvcc compiles it without cuda_runtime.h, which it otherwise puts before every translation unit (it has no
# switch to leave it out). The directory below holds an empty cuda_runtime.h; first on the include path, it is the one
# nvcc's preprocessor finds.
SELF_CONTAINED = "// self-contained: compiled without cuda_runtime.h (runtime/cuda.py)"
NO_RUNTIME_HEADER = Path(__file__).with_name("cuda_include")
# where nvcc is looked for when it is not on PATH ($CUDA_HOME/bin/nvcc is tried before these)
NVCC_FALLBACKS: tuple[str, ...] = ("/usr/local/cuda/bin/nvcc",)

# CUdevice_attribute values (cuda.h)
_ATTRIBUTES = {
  "max_threads_per_block": 1,
  "max_block_dim_x": 2, "max_block_dim_y": 3, "max_block_dim_z": 4,
  "max_grid_dim_x": 5, "max_grid_dim_y": 6, "max_grid_dim_z": 7,
  "shared_memory_per_block": 8,
  "multiprocessor_count": 16,
  "compute_capability_major": 75, "compute_capability_minor": 76,
}
_CUDA_ERROR_OUT_OF_MEMORY = 2
_CUDA_ERROR_DEINITIALIZED = 4
_CUDA_ERROR_NOT_FOUND = 500
# the driver refuses the image itself: INVALID_IMAGE, NO_BINARY_FOR_GPU, INVALID_PTX, UNSUPPORTED_PTX_VERSION,
# INVALID_SOURCE (cuModuleLoadData reads a buffer with no length, so an empty or garbled file may look like bad PTX)
_CUDA_IMAGE_ERRORS = frozenset({200, 209, 218, 222, 300})

_CDEF = """
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphNode_st *CUgraphNode;
typedef struct CUgraphExec_st *CUgraphExec;
typedef struct {
  CUfunction func;
  unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
  void **kernelParams;
  void **extra;
} CUDA_KERNEL_NODE_PARAMS;

CUresult cuInit(unsigned int flags);
CUresult cuDeviceGet(CUdevice *device, int ordinal);
CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device);
CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);
CUresult cuDevicePrimaryCtxRetain(CUcontext *ctx, CUdevice device);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuCtxSynchronize(void);
CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);
CUresult cuMemFree_v2(CUdeviceptr dptr);
CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void *src, size_t nbytes);
CUresult cuMemcpyDtoH_v2(void *dst, CUdeviceptr src, size_t nbytes);
CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t nbytes);
CUresult cuModuleLoadData(CUmodule *module, const void *image);
CUresult cuModuleGetFunction(CUfunction *function, CUmodule module, const char *name);
CUresult cuFuncSetAttribute(CUfunction hfunc, int attrib, int value);
CUresult cuLaunchKernel(CUfunction f, unsigned int gridX, unsigned int gridY, unsigned int gridZ,
                        unsigned int blockX, unsigned int blockY, unsigned int blockZ,
                        unsigned int sharedMemBytes, CUstream stream, void **kernelParams, void **extra);
CUresult cuEventCreate(CUevent *event, unsigned int flags);
CUresult cuEventRecord(CUevent event, CUstream stream);
CUresult cuEventSynchronize(CUevent event);
CUresult cuEventElapsedTime(float *milliseconds, CUevent start, CUevent end);
CUresult cuEventDestroy_v2(CUevent event);
CUresult cuGraphCreate(CUgraph *graph, unsigned int flags);
CUresult cuGraphAddKernelNode(CUgraphNode *node, CUgraph graph, const CUgraphNode *dependencies, size_t count,
                              const CUDA_KERNEL_NODE_PARAMS *params);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *exec, CUgraph graph, unsigned long long flags);
CUresult cuGraphExecKernelNodeSetParams(CUgraphExec exec, CUgraphNode node, const CUDA_KERNEL_NODE_PARAMS *params);
CUresult cuGraphLaunch(CUgraphExec exec, CUstream stream);
CUresult cuGraphExecDestroy(CUgraphExec exec);
CUresult cuGraphDestroy(CUgraph graph);
typedef struct { unsigned long long opaque[16]; } CUtensorMap;
CUresult cuTensorMapEncodeTiled(CUtensorMap *tensorMap, int tensorDataType, unsigned int tensorRank, void *globalAddress,
                                const unsigned long long *globalDim, const unsigned long long *globalStrides,
                                const unsigned int *boxDim, const unsigned int *elementStrides, int interleave,
                                int swizzle, int l2Promotion, int oobFill);
typedef struct { unsigned int gridDimX, gridDimY, gridDimZ, blockDimX, blockDimY, blockDimZ, sharedMemBytes;
                 CUstream hStream; void *attrs; unsigned int numAttrs; } CUlaunchConfig;
CUresult cuOccupancyMaxActiveClusters(int *numClusters, CUfunction func, const CUlaunchConfig *config);
CUresult cuGetErrorName(CUresult error, const char **name);
CUresult cuGetErrorString(CUresult error, const char **text);
"""

_ffi: Any = None  # cffi.FFI, made on first use so that importing this module costs nothing
_lib: Any = None  # the dlopened driver
_exiting = False  # set at interpreter exit: the process is about to drop all device memory anyway


@atexit.register
def _mark_exiting() -> None:
  global _exiting
  _exiting = True


class CUDAUnavailable(RuntimeError):
  """DEVICE=CUDA was asked for on a machine without a usable NVIDIA driver or GPU."""


class CUDAError(RuntimeError):
  """A CUDA driver call failed: `call` (its name), `code`, `error_name` (e.g. CUDA_ERROR_INVALID_VALUE) and
  `error_string` (the driver's explanation)."""

  def __init__(self, call: str, code: int, error_name: str, error_string: str, context: str = ""):
    self.call, self.code, self.error_name, self.error_string = call, code, error_name, error_string
    super().__init__(f"{call} failed with {error_name} ({code}): {error_string}" + (f"; {context}" if context else ""))


class CUDAOutOfMemory(CUDAError, MemoryError):
  """CUDA_ERROR_OUT_OF_MEMORY: a MemoryError too, so the pool gives its memory back and the allocation is retried."""


class CUDAInvalidImage(CUDAError):
  """The driver refused a module image: a cached cubin that fails so is rebuilt (runtime/cache.py load_cached)."""


# ---------------------------------------------------------------- driver

# why each driver library that failed to load did (by its name): sources for a GPU render on a machine without one
# (Tensor.kernel_sources, the CUDA compile tests), and each kernel asks for the device a few times; a failed load is
# ~50 ms (cffi's parse of the declarations, the library search), so it is tried once
_unloadable: dict[str, str] = {}


def driver() -> Any:
  """The driver library, loaded on first use (CUDAUnavailable when it is not installed)."""
  global _ffi, _lib
  if _lib is None:
    if (why := _unloadable.get(LIBCUDA)) is not None: raise CUDAUnavailable(why)
    import cffi
    ffi = cffi.FFI()
    ffi.cdef(_CDEF)
    try: lib = ffi.dlopen(LIBCUDA)
    except OSError as e:
      _unloadable[LIBCUDA] = why = (f"DEVICE=CUDA needs the NVIDIA driver's library {LIBCUDA}, which could not be "
                                    f"loaded ({e}): this machine has no NVIDIA driver (or no GPU). Install the driver, "
                                    f"or run on the CPU with DEVICE=CPU")
      raise CUDAUnavailable(why) from None
    _ffi, _lib = ffi, lib
  return _lib


def _error_text(code: int) -> tuple[str, str]:
  if _lib is None: return f"CUresult {code}", "(the driver is not loaded, so it cannot describe the error)"
  name, text = _ffi.new("const char **"), _ffi.new("const char **")
  n = _ffi.string(name[0]).decode() if _lib.cuGetErrorName(code, name) == 0 and name[0] else f"CUresult {code}"
  s = _ffi.string(text[0]).decode() if _lib.cuGetErrorString(code, text) == 0 and text[0] else "unknown error"
  return n, s


def check(call: str, code: int, context: str = "") -> None:
  """Raise CUDAError for a failed driver call `call` that returned `code`."""
  if code != 0:
    name, text = _error_text(code)
    cls = (CUDAOutOfMemory if code == _CUDA_ERROR_OUT_OF_MEMORY else
           CUDAInvalidImage if code in _CUDA_IMAGE_ERRORS else CUDAError)
    raise cls(call, code, name, text, context)


def _call(name: str, *args: Any, context: str = "") -> None:
  check(name, getattr(_lib, name)(*args), context)


# ---------------------------------------------------------------- nvcc

def find_nvcc() -> str:
  """The nvcc to use: from PATH, else $CUDA_HOME/bin/nvcc, else /usr/local/cuda/bin/nvcc (CompileError if none)."""
  candidates = [os.path.join(os.environ["CUDA_HOME"], "bin", "nvcc")] if os.environ.get("CUDA_HOME") else []
  candidates += NVCC_FALLBACKS
  if (found := shutil.which("nvcc")) is not None: return found
  for c in candidates:
    if os.path.isfile(c) and os.access(c, os.X_OK): return c
  raise CompileError("nvcc (the CUDA compiler, from the CUDA toolkit) was not found: not on PATH, "
                     f"nor at {', '.join(candidates) or '$CUDA_HOME/bin/nvcc'}. Install the CUDA toolkit and put its "
                     "bin/ on PATH (or set CUDA_HOME), or run on the CPU with DEVICE=CPU")


@functools.cache
def nvcc_identity(nvcc: str) -> str:
  """Resolved path and version of nvcc, for the cache key: a new toolkit must not reuse old cubins."""
  try: out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout.strip()
  except (OSError, subprocess.SubprocessError) as e: out = f"unknown ({e})"
  return f"{os.path.realpath(nvcc)}: {out}"


def target_flags(source: str, arch: str) -> list[str]:
  """nvcc's flags for `source` on a GPU of `arch`: the target, -arch=sm_XY, or for a source that uses Hopper's
  warpgroup MMA (renderers/cuda_wgmma.py) on sm_90 the arch-specific sm_90a, the only target with wgmma (written as
  -gencode: with nvcc 13.0, -arch=sm_90a also ran a plain sm_90 pass that rejects wgmma); and for a SELF_CONTAINED
  source, the include directory whose empty cuda_runtime.h stands in for the real one."""
  wgmma = arch == "sm_90" and "wgmma.mma_async" in source
  target = ["-gencode=arch=compute_90a,code=sm_90a"] if wgmma else [f"-arch={arch}"]
  return target + (["-I", str(NO_RUNTIME_HEADER)] if source.startswith(SELF_CONTAINED) else [])


def _run_nvcc(nvcc: str, arch: str, src: Path, out: Path) -> str:
  """The one compiler call: `src` (CUDA C++) into the cubin `out`; returns what nvcc printed (ptxas's warnings and
  notes). Raises CompileError with nvcc's message."""
  return run_compiler([nvcc, *NVCC_FLAGS, *target_flags(src.read_text(), arch), "-o", str(out), str(src)], "nvcc", src)


def _nvcc_build(arch: str) -> tuple[tuple[str, ...], Any]:
  """The cache key's compiler part and the build function of cubins for `arch`."""
  nvcc = find_nvcc()
  return (nvcc_identity(nvcc), f"-arch={arch}", *NVCC_FLAGS), functools.partial(_run_nvcc, nvcc, arch)


def cubin_path(source: str, arch: str) -> Path:
  """The cached cubin of `source` for `arch` (e.g. "sm_90"), built now by nvcc when it is not cached yet."""
  key_extra, build = _nvcc_build(arch)
  return cache.build_cached(source, key_extra, ".cubin", build)


def compile_cuda(source: str, arch: str = "sm_90") -> bytes:
  """The cubin nvcc makes of `source` for `arch`. Needs nvcc, not a GPU."""
  return cubin_path(source, arch).read_bytes()


# ---------------------------------------------------------------- kernel signatures

# C scalar types a kernel parameter may have -> the cffi type its value is stored as for cuLaunchKernel
_SCALARS = {
  "int": "int32_t", "signed int": "int32_t", "int32_t": "int32_t",
  "unsigned int": "uint32_t", "unsigned": "uint32_t", "uint32_t": "uint32_t",
  "long long": "int64_t", "long long int": "int64_t", "int64_t": "int64_t",
  "unsigned long long": "uint64_t", "unsigned long long int": "uint64_t", "uint64_t": "uint64_t", "size_t": "uint64_t",
  "float": "float", "double": "double", "bool": "_Bool",
}


def kernel_params(source: str, name: str) -> list[str]:
  """The cffi storage type of each parameter of kernel `name` (pointers are "CUdeviceptr", tensor maps
  "CUtensorMap"), read from the source."""
  m = re.search(rf"__global__[^;{{}}]*?\b{re.escape(name)}\s*\(([^)]*)\)", source)
  if m is None:
    raise ValueError(f"kernel {name!r} not found in the source: the CUDA device expects it declared as "
                     f"'extern \"C\" __global__ void {name}(...)' with its parameters written out")
  types = []
  for p, t in zip(m.group(1).split(","), parameter_types(m.group(1), name)):
    if t == TENSOR_MAP: types.append("CUtensorMap"); continue
    if t is not None and t not in _SCALARS:
      raise ValueError(f"kernel {name!r}: cannot pass parameter {p.strip()!r}; CUDA kernels here take pointers and "
                       f"scalars of the types {', '.join(sorted(_SCALARS))}")
    types.append("CUdeviceptr" if t is None else _SCALARS[t])
  return types


def dynamic_shared_bytes(source: str, name: str) -> int:
  """The dynamic shared memory kernel `name` declares with `G_SHARED(bytes)` before its name (0 where it does not):
  a tensor-core tile (renderers/cuda_mma.py)."""
  m = re.search(rf"__global__([^;{{}}]*?)\b{re.escape(name)}\s*\(", source)
  g = re.search(r"\bG_SHARED\((\d+)\)", m.group(1)) if m else None
  return int(g.group(1)) if g else 0


TENSOR_MAP = "g_tensor_map"   # the C type of a tensor-map parameter (renderers/cuda_tma.py)


@dataclass(frozen=True)
class TensorMapDecl:
  """A tensor map a kernel takes (`G_TMAP(param, itemsize, inner, outer, stride, box_inner, box_outer, offset)` before
  its name, and a `const __grid_constant__ g_tensor_map` parameter after the others, in the same order): the 2-d
  tensor of `inner` x `outer` elements of `itemsize` bytes, outer rows `stride` elements apart, starting `offset`
  elements into the buffer passed as parameter `param`, copied by TMA in boxes of box_inner x box_outer laid out with
  the 128-byte swizzle. The launch makes it from that argument's pointer (`CUDAProgram.pack`), so a call on new
  buffers gets maps of its own."""
  param: int
  itemsize: int
  inner: int
  outer: int
  stride: int
  box_inner: int
  box_outer: int
  offset: int


def persistent(source: str, name: str) -> bool:
  """Whether kernel `name` loops over its grid's blocks itself (`G_PERSISTENT` before its name: renderers/cuda_tma.py),
  so that a launch of one block a multiprocessor does all its work."""
  m = re.search(rf"__global__([^;{{}}]*?)\b{re.escape(name)}\s*\(", source)
  return bool(m and re.search(r"\bG_PERSISTENT\b", m.group(1)))


def cluster_blocks(source: str, name: str) -> int:
  """The blocks of a cluster of kernel `name` (`__cluster_dims__(n, 1, 1)` before its name: renderers/cuda_tma.py's
  blocks sharing a tile by multicast), 1 where it declares none."""
  m = re.search(rf"__global__([^;{{}}]*?)\b{re.escape(name)}\s*\(", source)
  c = re.search(r"\b__cluster_dims__\((\d+)", m.group(1)) if m else None
  return int(c.group(1)) if c else 1


def tensor_maps(source: str, name: str) -> list[TensorMapDecl]:
  """The tensor maps kernel `name` declares with `G_TMAP(...)` before its name, in order."""
  m = re.search(rf"__global__([^;{{}}]*?)\b{re.escape(name)}\s*\(", source)
  return [TensorMapDecl(*map(int, g.split(","))) for g in re.findall(r"\bG_TMAP\(([^)]*)\)", m.group(1) if m else "")]


# CUtensorMapDataType by element size (TMA copies bits: unsigned types of the width); the 128-byte swizzle; L2
# promotion of 256 bytes; (cuda.h's enums)
_TMA_TYPES = {1: 0, 2: 1, 4: 2, 8: 4}
_TMA_SWIZZLE_128B, _TMA_L2_256B = 3, 3


def encode_tensor_map(d: TensorMapDecl, handle: int) -> tuple[Any, Any]:
  """The tensor map `d` over the buffer at device pointer `handle`: (a `CUtensorMap *`, 64-byte aligned, and the
  memory holding it, to keep alive while the map is used)."""
  raw = _ffi.new("char[]", 128 + 64)
  tmap = _ffi.cast("CUtensorMap *", (int(_ffi.cast("uintptr_t", raw)) + 63) & ~63)
  address = handle + d.offset * d.itemsize
  _call("cuTensorMapEncodeTiled", tmap, _TMA_TYPES[d.itemsize], 2, _ffi.cast("void *", address),
        _ffi.new("unsigned long long[2]", [d.inner, d.outer]), _ffi.new("unsigned long long[1]", [d.stride * d.itemsize]),
        _ffi.new("unsigned int[2]", [d.box_inner, d.box_outer]), _ffi.new("unsigned int[2]", [1, 1]), 0,
        _TMA_SWIZZLE_128B, _TMA_L2_256B, 0,
        context=f"a tensor map of {d.outer}x{d.inner} elements of {d.itemsize} bytes, rows {d.stride} apart, at {address:#x} "
                f"(TMA needs the address and the row stride in bytes multiples of 16)")
  return tmap, raw


_CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES = 8
_STATIC_SHARED_LIMIT = 48 << 10   # a launch may take this much dynamic shared memory without raising the limit


# ---------------------------------------------------------------- allocator

class CUDAAllocator(Allocator):
  """Device memory from cuMemAlloc; handles are CUdeviceptr ints. Freed handles wait in the size-keyed pool."""

  def __init__(self, device: CUDADevice):
    super().__init__()
    self.device = device

  def _alloc(self, nbytes: int) -> int:
    self.device.activate()
    ptr = _ffi.new("CUdeviceptr *")
    # a zero-byte cuMemAlloc is an error; empty buffers still need a distinct handle
    _call("cuMemAlloc_v2", ptr, max(nbytes, 1), context=f"allocating {nbytes} bytes on {self.device.device_name}")
    return int(ptr[0])

  def _free(self, handle: int, nbytes: int) -> None:
    # at interpreter exit the driver may already be tearing the context down; the process frees everything anyway
    if _exiting or _lib is None: return
    self.device.activate()
    code = _lib.cuMemFree_v2(handle)
    if code != _CUDA_ERROR_DEINITIALIZED: check("cuMemFree_v2", code)

  def copyin(self, handle: int, src: memoryview) -> None:
    self.device.activate()
    _call("cuMemcpyHtoD_v2", handle, _ffi.from_buffer(src), src.nbytes)

  def copyout(self, dst: memoryview, handle: int) -> None:
    self.device.activate()
    _call("cuMemcpyDtoH_v2", _ffi.from_buffer(dst, require_writable=True), handle, dst.nbytes)

  def copy(self, dst: int, src: int, nbytes: int) -> None:
    """Device-to-device copy of `nbytes` from handle `src` to handle `dst`."""
    self.device.activate()
    _call("cuMemcpyDtoD_v2", dst, src, nbytes)


# ---------------------------------------------------------------- programs

_dims_seen: dict = {}   # launch sizes already checked -> their three dimensions (a program launches the same few)


def _dims(size: int | Sequence[int] | None, what: str) -> tuple[int, int, int]:
  try: return _dims_seen[size]
  except (KeyError, TypeError): pass   # (TypeError: a list, which does not hash)
  dims = _check_dims(size, what)
  if size.__class__ in (int, tuple) and len(_dims_seen) < 4096: _dims_seen[size] = dims
  return dims


def _check_dims(size: int | Sequence[int] | None, what: str) -> tuple[int, int, int]:
  if size is None: return (1, 1, 1)
  try: dims = tuple(map(operator.index, (size,) if not hasattr(size, "__len__") else size))  # numpy ints too
  except TypeError: dims = ()
  if not 1 <= len(dims) <= 3 or min(dims) < 1:
    raise ValueError(f"{what} must be one to three positive ints, got {size!r}")
  return dims + (1,) * (3 - len(dims))  # type: ignore[return-value]


class CUDAProgram:
  """One kernel of a loaded cubin. Call it with device pointers and scalars in the order of its parameters."""
  __slots__ = ("name", "device", "function", "params", "pointer_types", "param_array", "path", "shared", "maps", "made_maps",
               "max_blocks", "cluster", "held")

  def __init__(self, name: str, device: CUDADevice, function: Any, params: list[str], path: Path, shared: int = 0,
               maps: Sequence[TensorMapDecl] = (), persistent: bool = False, cluster: int = 1):
    # the tensor maps (the last parameters) are no arguments of the call: each launch makes them from its pointers
    n = len(params) - len(maps)
    if params[n:] != ["CUtensorMap"] * len(maps) or "CUtensorMap" in params[:n]:
      raise ValueError(f"kernel {name} (in {path}): its {len(maps)} G_TMAP declarations must match its last parameters, "
                       f"of type {TENSOR_MAP} ({params})")
    self.name, self.device, self.function, self.params, self.path = name, device, function, params[:n], path
    self.maps, self.made_maps = tuple(maps), {}   # (map number, pointer) -> (CUtensorMap *, its memory)
    self.pointer_types = [_ffi.typeof(f"{t} *") for t in self.params]   # each launch stores its arguments as these
    self.param_array = _ffi.typeof("void *[]")                        # and points at them from one of these
    self.shared = shared   # bytes of dynamic shared memory each launch gets
    self.max_blocks = device.multiprocessor_count if persistent else 0   # (a kernel that loops over its blocks)
    self.cluster, self.held = cluster, None   # (blocks launched in clusters of this many; how many clusters fit at once)
    if shared > _STATIC_SHARED_LIMIT:
      check("cuFuncSetAttribute", _lib.cuFuncSetAttribute(function, _CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, shared),
            f"kernel {name} asks for {shared} bytes of dynamic shared memory")

  def __call__(self, *args: int | float, global_size: int | Sequence[int] | None = None,
               local_size: int | Sequence[int] | None = None, wait: bool = False) -> float | None:
    """Launch on grid `global_size` (blocks) of blocks `local_size` (threads). With wait=True, block until the kernel
    is done and return its time in seconds, measured with CUDA events; else return None at once."""
    params, _values = self.pack(args)   # _values: what params points at, alive until the launch has read it
    block = _dims(local_size, "local_size")
    grid = self.grid(global_size, block)
    self.device.activate()
    if not wait:
      self._launch(grid, block, params)
      return None
    start, end = _ffi.new("CUevent *"), _ffi.new("CUevent *")
    _call("cuEventCreate", start, 0)
    try:
      _call("cuEventCreate", end, 0)
      try:
        _call("cuEventRecord", start[0], _ffi.NULL)
        self._launch(grid, block, params)
        _call("cuEventRecord", end[0], _ffi.NULL)
        _call("cuEventSynchronize", end[0])
        ms = _ffi.new("float *")
        _call("cuEventElapsedTime", ms, start[0], end[0])
        return ms[0] / 1e3
      finally:
        _lib.cuEventDestroy_v2(end[0])
    finally:
      _lib.cuEventDestroy_v2(start[0])

  def grid(self, global_size: int | Sequence[int] | None, block: tuple[int, int, int]) -> tuple[int, int, int]:
    """The grid a launch of `global_size` blocks of `block` takes: for a persistent kernel at most one block a
    multiprocessor, and in clusters at most the whole clusters the GPU holds at once (a cluster that waited for others
    to end would run its tiles after all the rest)."""
    dims, most = _dims(global_size, "global_size"), self.max_blocks
    if most and self.cluster > 1: most = self.cluster * max(1, min(most // self.cluster, self.clusters_held(block)))
    return (most, *dims[1:]) if 0 < most < dims[0] else dims

  def clusters_held(self, block: tuple[int, int, int]) -> int:
    """The clusters of this kernel's blocks `block` the GPU holds at once (cuOccupancyMaxActiveClusters; asked once)."""
    if self.held is None:
      config = _ffi.new("CUlaunchConfig *", {"gridDimX": self.cluster, "gridDimY": 1, "gridDimZ": 1, "blockDimX": block[0],
                                              "blockDimY": block[1], "blockDimZ": block[2], "sharedMemBytes": self.shared})
      n = _ffi.new("int *")
      self.device.activate()
      _call("cuOccupancyMaxActiveClusters", n, self.function, config)
      self.held = n[0]
    return self.held

  def pack(self, args: Sequence[int | float]) -> tuple[Any, list]:
    """kernelParams for `args`: an array of pointers, each to one argument's value stored in its parameter's C type;
    and the values it points at (keep them alive until the launch, or the graph node, has read them)."""
    if len(args) != len(self.params):
      raise TypeError(f"kernel {self.name} (in {self.path}) takes {len(self.params)} arguments, got {len(args)}")
    try: values = list(map(_ffi.new, self.pointer_types, args))   # (every launch of a warm call comes here)
    except (TypeError, OverflowError): self._refuse(args)
    if not self.maps: return _ffi.new(self.param_array, values or 1), values
    maps = [self.tensor_map(i, args[d.param]) for i, d in enumerate(self.maps)]   # (each: the map, its memory)
    return _ffi.new(self.param_array, values + [m for m, _ in maps]), values + maps

  def tensor_map(self, i: int, handle: int) -> tuple[Any, Any]:
    """Tensor map i over the buffer at `handle`, made once per pointer (a warm call on the same buffers reuses it)."""
    if (made := self.made_maps.get((i, handle))) is None:
      if len(self.made_maps) >= 256: self.made_maps.clear()   # (freed buffers' maps go; a map costs microseconds)
      made = self.made_maps[(i, handle)] = encode_tensor_map(self.maps[i], handle)
    return made

  def _refuse(self, args: Sequence[int | float]) -> None:
    """Raise the TypeError that names the first argument its parameter's C type cannot take."""
    for i, (t, a) in enumerate(zip(self.pointer_types, args)):
      try: _ffi.new(t, a)
      except (TypeError, OverflowError) as e:
        kind = "a pointer: pass a device pointer (an int)" if self.params[i] == "CUdeviceptr" else f"of C type {self.params[i]}"
        raise TypeError(f"kernel {self.name} (in {self.path}) argument {i} is {kind}; cannot pass {a!r}: {e}") from None
    raise TypeError(f"kernel {self.name} (in {self.path}): cannot pass {list(args)!r} as {self.params}")

  def _launch(self, grid: tuple[int, int, int], block: tuple[int, int, int], params: Any) -> None:
    code = _lib.cuLaunchKernel(self.function, *grid, *block, self.shared, _ffi.NULL, params, _ffi.NULL)
    if code != 0:
      d = self.device
      check("cuLaunchKernel", code, f"kernel {self.name} (in {self.path}) with grid {grid} and block {block}; "
                                    f"{d.device_name} allows {d.max_threads_per_block} threads per block, blocks up "
                                    f"to {d.max_block_dims} and grids up to {d.max_grid_dims}")

  def __repr__(self): return f"<CUDAProgram {self.name} in {self.path}>"


class CUDAGraph:
  """Kernel launches recorded once as a CUDA graph and launched again and again by one driver call (instead of one
  cuLaunchKernel each, issued from Python). The launches form a chain, each after the one before, so a launch of the
  graph means what launching them in order on the default stream means; it is itself launched on that stream.

  `launches`: (program, args, global_size, local_size) per kernel, as `CUDAProgram.__call__` takes them.
  `set_args(i, args)` changes launch i's arguments for the next launches (a new input or output pointer)."""

  def __init__(self, device: CUDADevice, launches: Sequence[tuple[CUDAProgram, Sequence[int | float], Any, Any]]):
    self.device, self.graph, self.exec = device, None, None
    self.launches = [(prog, prog.grid(g, b), b) for prog, _, g, l in launches for b in [_dims(l, "local_size")]]
    device.activate()
    graph = _ffi.new("CUgraph *")
    _call("cuGraphCreate", graph, 0)
    self.graph, self.nodes = graph[0], []
    for i, (_, args, _, _) in enumerate(launches):
      node, after = _ffi.new("CUgraphNode *"), self.nodes[-1:]
      params, _values = self._node_params(i, args)
      _call("cuGraphAddKernelNode", node, self.graph, _ffi.new("CUgraphNode[]", after) if after else _ffi.NULL,
            len(after), params, context=f"recording kernel {self.launches[i][0].name} into a CUDA graph")
      self.nodes.append(node[0])
    exec_ = _ffi.new("CUgraphExec *")
    _call("cuGraphInstantiateWithFlags", exec_, self.graph, 0)
    self.exec = exec_[0]

  def _node_params(self, i: int, args: Sequence[int | float]) -> tuple[Any, list]:
    prog, grid, block = self.launches[i]
    kernel_params, values = prog.pack(args)
    p = _ffi.new("CUDA_KERNEL_NODE_PARAMS *")
    p.func, p.sharedMemBytes, p.kernelParams, p.extra = prog.function, prog.shared, kernel_params, _ffi.NULL
    p.gridDimX, p.gridDimY, p.gridDimZ = grid
    p.blockDimX, p.blockDimY, p.blockDimZ = block
    return p, [kernel_params, values]   # the driver copies the values when it takes p

  def set_args(self, i: int, args: Sequence[int | float]) -> None:
    params, _values = self._node_params(i, args)
    self.device.activate()
    _call("cuGraphExecKernelNodeSetParams", self.exec, self.nodes[i], params)

  def launch(self) -> None:
    self.device.activate()
    _call("cuGraphLaunch", self.exec, _ffi.NULL)

  def close(self) -> None:
    """Destroy the graph (also at garbage collection; not at interpreter exit, when the driver may be gone)."""
    if _exiting or _lib is None: return
    if self.exec is not None: _lib.cuGraphExecDestroy(self.exec); self.exec = None
    if self.graph is not None: _lib.cuGraphDestroy(self.graph); self.graph = None

  def __del__(self):
    try: self.close()
    except Exception: pass   # a destructor must not raise; the process is ending or the context is gone


# ---------------------------------------------------------------- device

class CUDADevice(Device):
  """GPU 0 through its primary context. Creating it loads the driver (CUDAUnavailable without one)."""
  name = "CUDA"
  renderer_module = "renderers.cuda"
  compilers = max(1, min(8, os.cpu_count() or 1))   # nvcc processes at once (Device.compilers)

  def __init__(self, ordinal: int = 0):
    lib = driver()
    code = lib.cuInit(0)
    if code != 0:
      err_name, text = _error_text(code)
      raise CUDAUnavailable(f"DEVICE=CUDA: the NVIDIA driver ({LIBCUDA}) is installed but cuInit failed with "
                            f"{err_name}: {text}. Check that a GPU is visible (nvidia-smi), or run on the CPU with "
                            f"DEVICE=CPU")
    dev = _ffi.new("CUdevice *")
    _call("cuDeviceGet", dev, ordinal)
    self.ordinal, self.cu_device = ordinal, dev[0]
    attrs = {}
    for key, attr in _ATTRIBUTES.items():
      value = _ffi.new("int *")
      _call("cuDeviceGetAttribute", value, attr, self.cu_device)
      attrs[key] = value[0]
    self.compute_capability = (attrs["compute_capability_major"], attrs["compute_capability_minor"])
    self.arch = f"sm_{self.compute_capability[0]}{self.compute_capability[1]}"
    self.max_threads_per_block = attrs["max_threads_per_block"]
    self.max_block_dims = (attrs["max_block_dim_x"], attrs["max_block_dim_y"], attrs["max_block_dim_z"])
    self.max_grid_dims = (attrs["max_grid_dim_x"], attrs["max_grid_dim_y"], attrs["max_grid_dim_z"])
    self.shared_memory_per_block = attrs["shared_memory_per_block"]
    self.multiprocessor_count = attrs["multiprocessor_count"]
    total = _ffi.new("size_t *")
    _call("cuDeviceTotalMem_v2", total, self.cu_device)
    self.memory_bytes = total[0]
    self.device_name = f"CUDA:{ordinal} ({self.arch})"
    # the primary context is the one the runtime API (and so PyTorch, CuPy) shares: retaining it never makes a
    # second context on the GPU
    ctx = _ffi.new("CUcontext *")
    _call("cuDevicePrimaryCtxRetain", ctx, self.cu_device)
    self.context = ctx[0]
    self._current = threading.local()  # a context is current per thread: each thread that uses us sets it once
    self.activate()
    self.allocator = CUDAAllocator(self)
    self._modules: dict[str, Any] = {}

  def activate(self) -> None:
    """Make our context current on the calling thread."""
    if not getattr(self._current, "set", False):
      _call("cuCtxSetCurrent", self.context)
      self._current.set = True

  def build(self, source: str, names: list[str]) -> dict[str, CUDAProgram]:
    """Compile `source` (one nvcc call for all its kernels, cached on disk) and return a program per name."""
    names = list(names)
    params = {n: kernel_params(source, n) for n in names}  # before nvcc: a misnamed kernel fails fast
    key_extra, build = _nvcc_build(self.arch)
    self.activate()
    # a cached cubin the driver refuses (CUDAInvalidImage) is rebuilt once by the cache
    path, module = cache.load_cached(source, key_extra, ".cubin", build, self._module, unloadable=CUDAInvalidImage)
    progs = {}
    for n in names:
      fn = _ffi.new("CUfunction *")
      code = _lib.cuModuleGetFunction(fn, module, n.encode())
      if code == _CUDA_ERROR_NOT_FOUND:
        raise CompileError(f"kernel {n!r} is not in {path} (source {path.with_suffix('.cu')}); is it declared "
                           f"extern \"C\" __global__?")
      check("cuModuleGetFunction", code)
      progs[n] = CUDAProgram(n, self, fn[0], params[n], path, dynamic_shared_bytes(source, n), tensor_maps(source, n),
                             persistent(source, n), cluster_blocks(source, n))
    return progs

  def _module(self, path: Path) -> Any:
    """The loaded module of the cubin at `path` (loaded now if it is not yet)."""
    if (module := self._modules.get(str(path))) is None:
      mod = _ffi.new("CUmodule *")
      _call("cuModuleLoadData", mod, _ffi.from_buffer(path.read_bytes()), context=f"loading {path}")
      module = self._modules[str(path)] = mod[0]
    return module

  def synchronize(self) -> None:
    self.activate()
    _call("cuCtxSynchronize")
