"""Library routines a host program can call instead of a generated kernel (`EXTERN` steps, rules/host.py).

`routines(device) -> tuple of names` says which routine variants a device has (what the `host` stage may use: an
Extern's `name`, e.g. "sgemm", "sgemm_batched", "hgemm"); `routine(device, name)` returns the callable,
`fn(buffer_handles, extern)`, taking the step's buffer handles and the `Extern` (its parameters and which handles are
the output and inputs). One callable per device serves the whole gemm family: the parameters say the dtypes, the
batch and each operand's layout.

- CPU: float32 products from the OpenBLAS of the `scipy-openblas32` package (`pip install scipy-openblas32`, or the
  `blas` extra of pyproject.toml), loaded with cffi's ABI mode like our own kernels (pointers passed as uintptr_t):
  `cblas_sgemm`, and for a batch `cblas_sgemm_batch_strided` (recent OpenBLAS releases export it; 0.3.34 here does) or else one
  `cblas_sgemm` per product. No float16 routine: OpenBLAS has none, so half products stay generated code. Without
  the package there is no routine and every matrix product is generated code.
- CUDA: cuBLAS (libcublas.so: the toolkit's, or the `nvidia-cublas` wheel's; `cublas_candidates()`), through cffi, on
  the default stream our kernels use: `cublasGemmEx`, and `cublasGemmStridedBatchedEx` for a batch, with float32 or
  float16 operands and output (CUDA_R_32F / CUDA_R_16F) and CUBLAS_COMPUTE_32F: products and sums in float32, as
  the generated code does; for float16 operands cuBLAS runs them on tensor cores (float16 inputs, float32
  accumulation, one rounding to the output's dtype at the end), for float32 the ordinary float32 path (no TF32) unless
  the user asks for TF32 with GRAFT_TF32=1 (`tf32()`, read at each call): then CUBLAS_COMPUTE_32F_FAST_TF32, float32
  operands rounded to TF32's 10-bit mantissa on tensor cores, sums in float32 (torch's allow_tf32).
  cuBLAS is column-major, so the row-major C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T
  (`cublas_gemm`; tests/test_extern.py checks the calls against a numpy model of cuBLAS's column-major contract).

GRAFT_EXTERN=0 turns routines off, =1 uses them wherever they apply; unset, the runtime times both on first use
(runtime/pick.py).
"""
from __future__ import annotations
import functools, os, threading, warnings
from typing import Callable
from rules.host import INT32_MAX
from runtime import pick

CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS = 101, 111, 112
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUDA_R_32F, CUDA_R_16F = 0, 2
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32, CUBLAS_GEMM_DEFAULT = 68, 77, -1


def tf32() -> bool:
  """GRAFT_TF32=1: float32 products on the GPU may round their operands to TF32 (10 bits of mantissa) on tensor cores;
  unset or 0 (the default), they are strict float32 (the same switch as generated code's: rules/opt/tensor_core.py)."""
  from rules.opt.tensor_core import tf32_requested
  return tf32_requested()
ITEMSIZE = {"float32": 4, "float16": 2}
CPU_ROUTINES = ("sgemm", "sgemm_batched")
CUDA_ROUTINES = ("sgemm", "sgemm_batched", "hgemm", "hgemm_batched")
ROUTINES = {"CPU": CPU_ROUTINES, "CUDA": CUDA_ROUTINES}
_lock = threading.Lock()


def mode() -> str:
  """"off", "on" or "pick" from GRAFT_EXTERN (0, 1, unset); anything else is a ValueError naming the choices."""
  return pick.mode("GRAFT_EXTERN", "generated code only", "libraries where they apply")


def routines(device: str) -> tuple[str, ...]:
  return ROUTINES[device] if _gemm(device) is not None else ()


def routine(device: str, name: str) -> Callable | None:
  return _gemm(device) if name in ROUTINES[device] else None


def _gemm(device: str) -> Callable | None:
  with _lock: return {"CPU": _cpu_gemm, "CUDA": _cuda_gemm}[device]()


def operand_addresses(handles: list[int], ext) -> tuple[dict, int, int, int]:
  """The parameters as a dict, and the addresses of C, A and B's first elements (their offsets applied)."""
  p = dict(ext.params)
  c, a, b = (handles[i] for i in ext.operands)
  size, c_size = ITEMSIZE[p["dtype"]], ITEMSIZE[p["c_dtype"]]
  return p, c + c_size * p["offset_c"], a + size * p["offset_a"], b + size * p["offset_b"]


# ---------------------------------------------------------------- CPU: OpenBLAS of scipy-openblas32

@functools.cache
def _cpu_gemm(batch_strided: bool = True) -> Callable | None:
  """OpenBLAS's float32 gemm; a batch through its strided-batch routine where the library exports one and
  `batch_strided` (False: one sgemm per product, what older OpenBLAS releases get), else one call per product."""
  try: import scipy_openblas32
  except ImportError: return None
  import cffi
  ffi = cffi.FFI()
  prefix = scipy_openblas32.get_library().removeprefix("lib").removesuffix("openblas")  # "scipy_"
  ffi.cdef(f"void {prefix}cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, uintptr_t a, int lda,"
           f" uintptr_t b, int ldb, float beta, uintptr_t c, int ldc);"
           f"void {prefix}cblas_sgemm_batch_strided(int order, int ta, int tb, int m, int n, int k, float alpha,"
           f" uintptr_t a, int lda, int stridea, uintptr_t b, int ldb, int strideb, float beta, uintptr_t c, int ldc,"
           f" int stridec, int count);")
  # OpenBLAS's threads spin for 2^28 cycles (~0.1 s) after each call before they sleep: on the cores that our OpenMP
  # kernels run on next (attention's softmax after q @ k.T), so those ran at half speed or worse (8x512x64 attention,
  # 2 cores: 15.9 -> 8.0 ms with 2^4). Read by the library when it loads; a user's own setting wins.
  os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
  lib = ffi.dlopen(os.path.join(scipy_openblas32.get_lib_dir(), f"lib{scipy_openblas32.get_library()}.so"))
  gemm = getattr(lib, f"{prefix}cblas_sgemm")
  try: batched = getattr(lib, f"{prefix}cblas_sgemm_batch_strided") if batch_strided else None
  except AttributeError: batched = None   # an older OpenBLAS

  def sgemm(handles: list[int], ext) -> None:
    p, c, a, b = operand_addresses(handles, ext)
    ta, tb = (CBLAS_NO_TRANS if p[t] == "N" else CBLAS_TRANS for t in ("trans_a", "trans_b"))
    if p["batch"] > 1 and batched is not None and max(p["stride_a"], p["stride_b"], p["stride_c"]) <= INT32_MAX:
      batched(CBLAS_ROW_MAJOR, ta, tb, p["m"], p["n"], p["k"], 1.0, a, p["lda"], p["stride_a"], b, p["ldb"], p["stride_b"],
              0.0, c, p["ldc"], p["stride_c"], p["batch"])
      return
    for i in range(p["batch"]):
      step = ITEMSIZE["float32"] * i
      gemm(CBLAS_ROW_MAJOR, ta, tb, p["m"], p["n"], p["k"], 1.0, a + step * p["stride_a"], p["lda"],
           b + step * p["stride_b"], p["ldb"], 0.0, c + step * p["stride_c"], p["ldc"])
  sgemm.library = f"OpenBLAS ({scipy_openblas32.__name__} {scipy_openblas32.__version__})"  # type: ignore[attr-defined]
  return sgemm


# ---------------------------------------------------------------- CUDA: cuBLAS

CUBLAS_CDEF = """
typedef struct cublasContext *cublasHandle_t;
int cublasCreate_v2(cublasHandle_t *handle);
int cublasGemmEx(cublasHandle_t handle, int transa, int transb, int m, int n, int k, const float *alpha,
                 uintptr_t A, int Atype, int lda, uintptr_t B, int Btype, int ldb, const float *beta,
                 uintptr_t C, int Ctype, int ldc, int computeType, int algo);
int cublasGemmStridedBatchedEx(cublasHandle_t handle, int transa, int transb, int m, int n, int k, const float *alpha,
                               uintptr_t A, int Atype, int lda, long long strideA, uintptr_t B, int Btype, int ldb,
                               long long strideB, const float *beta, uintptr_t C, int Ctype, int ldc, long long strideC,
                               int batchCount, int computeType, int algo);
"""
CUBLAS_NAMES = ("libcublas.so", "libcublas.so.13", "libcublas.so.12", "libcublas.so.11")


def cublas_candidates() -> list[str]:
  """Where libcublas is looked for, in order: the loader's own search path (bare names), then $CUDA_HOME/lib64 and the
  toolkit's lib64, then NVIDIA's pip wheels (`nvidia-cublas`: site-packages/nvidia/cu13/lib for CUDA 13,
  nvidia/cublas/lib for CUDA 12), which PyTorch installs and no loader path names."""
  dirs = [os.path.join(os.environ["CUDA_HOME"], "lib64")] if os.environ.get("CUDA_HOME") else []
  dirs += ["/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
  try:
    import nvidia   # the namespace package of NVIDIA's wheels; importing it loads nothing
    dirs += [os.path.join(p, sub, "lib") for p in nvidia.__path__ for sub in ("cu13", "cublas")]
  except ImportError: pass
  return [*CUBLAS_NAMES, *(os.path.join(d, n) for d in dirs for n in CUBLAS_NAMES if os.path.exists(os.path.join(d, n)))]


def _open_cublas(ffi):
  """The first libcublas of `cublas_candidates()` that loads, or None. One found by path has its libcublasLt (same
  folder, same version) loaded first, globally, in case the folder is on no loader path."""
  import ctypes
  for path in cublas_candidates():
    lt = os.path.join(os.path.dirname(path), os.path.basename(path).replace("libcublas", "libcublasLt"))
    try:
      if os.path.isabs(path) and os.path.exists(lt): ctypes.CDLL(lt, mode=ctypes.RTLD_GLOBAL)
      return ffi.dlopen(path)
    except OSError: continue
  return None


@functools.cache
def _cuda_gemm() -> Callable | None:
  import cffi
  ffi = cffi.FFI()
  ffi.cdef(CUBLAS_CDEF)
  if (lib := _open_cublas(ffi)) is None: return None
  from runtime.device import get_device
  try: get_device("CUDA").activate()  # cuBLAS binds to the context current on this thread: ours (the primary one)
  except Exception: return None
  handle = ffi.new("cublasHandle_t *")
  if (status := lib.cublasCreate_v2(handle)) != 0:
    warnings.warn(f"cuBLAS was found but cublasCreate_v2 failed with status {status}: matrix products stay generated code")
    return None
  # alpha and beta: float for CUBLAS_COMPUTE_32F, kept alive with the routine
  return cublas_gemm(lib, handle[0], ffi.new("float *", 1.0), ffi.new("float *", 0.0))


def cublas_gemm(lib, handle, one, zero) -> Callable:
  """The gemm routine over a loaded cuBLAS (`lib`, a created `handle`, alpha = `one` and beta = `zero` as cuBLAS takes
  them). Row-major C (m x n) = op(A) op(B) is column-major C^T (n x m) = op(B)^T op(A)^T: the operands (and their
  leading dimensions and batch strides) swap, the ops stay."""
  calling = threading.Lock()   # a cuBLAS handle is not to be used by two host threads at once
  cuda_type = {"float32": CUDA_R_32F, "float16": CUDA_R_16F}

  def gemm(handles: list[int], ext) -> None:
    p, c, a, b = operand_addresses(handles, ext)
    ab, ct = cuda_type[p["dtype"]], cuda_type[p["c_dtype"]]
    compute = CUBLAS_COMPUTE_32F_FAST_TF32 if p["dtype"] == "float32" and tf32() else CUBLAS_COMPUTE_32F
    ops = (CUBLAS_OP_N if p["trans_b"] == "N" else CUBLAS_OP_T, CUBLAS_OP_N if p["trans_a"] == "N" else CUBLAS_OP_T)
    # the handle's stream is the legacy default stream (0), the one our kernels and copies run on: in order with them
    with calling:
      if p["batch"] == 1:
        code = lib.cublasGemmEx(handle, *ops, p["n"], p["m"], p["k"], one, b, ab, p["ldb"], a, ab, p["lda"], zero,
                                c, ct, p["ldc"], compute, CUBLAS_GEMM_DEFAULT)
      else:
        code = lib.cublasGemmStridedBatchedEx(handle, *ops, p["n"], p["m"], p["k"], one, b, ab, p["ldb"], p["stride_b"],
                                              a, ab, p["lda"], p["stride_a"], zero, c, ct, p["ldc"], p["stride_c"],
                                              p["batch"], compute, CUBLAS_GEMM_DEFAULT)
    if code != 0: raise RuntimeError(f"cuBLAS {ext.name} failed with status {code} ({p})")
  gemm.library = "cuBLAS"  # type: ignore[attr-defined]
  return gemm
