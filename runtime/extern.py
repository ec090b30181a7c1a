"""Library routines a host program can call instead of a generated kernel (`EXTERN` steps, rules/host.py).

`routines(device) -> tuple of names` says what is available on a device (what the `host` stage may use);
`routine(device, name)` returns the callable, `fn(buffer_handles, extern)`, taking the step's buffer handles and the
`Extern` (its parameters and which handles are the output and inputs).

- CPU: `sgemm` from the OpenBLAS of the `scipy-openblas32` package (`pip install scipy-openblas32`, or the `blas` extra
  of pyproject.toml), loaded with cffi's ABI mode like our own kernels (pointers passed as uintptr_t). Without the
  package there is no routine and every matrix product is generated code.
- CUDA: `sgemm` from cuBLAS (libcublas.so: the toolkit's, or the `nvidia-cublas` wheel's; `cublas_candidates()`),
  through cffi, on the default stream our kernels use.
  cuBLAS is column-major, so the row-major C = op(A) op(B) is computed as the column-major C^T = op(B)^T op(A)^T.

GRAFT_EXTERN=0 turns routines off, =1 uses them wherever they apply; unset, the runtime times both on first use
(runtime/pick.py).
"""
from __future__ import annotations
import functools, os, threading, warnings
from typing import Callable
from runtime import pick

CBLAS_ROW_MAJOR, CBLAS_NO_TRANS, CBLAS_TRANS = 101, 111, 112
CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
_lock = threading.Lock()


def mode() -> str:
  """"off", "on" or "pick" from GRAFT_EXTERN (0, 1, unset); anything else is a ValueError naming the choices."""
  return pick.mode("GRAFT_EXTERN", "generated code only", "libraries where they apply")


def routines(device: str) -> tuple[str, ...]:
  return ("sgemm",) if routine(device, "sgemm") is not None else ()


def routine(device: str, name: str) -> Callable | None:
  if name != "sgemm": return None
  with _lock: return {"CPU": _cpu_sgemm, "CUDA": _cuda_sgemm}[device]()


# ---------------------------------------------------------------- CPU: OpenBLAS of scipy-openblas32

@functools.cache
def _cpu_sgemm() -> Callable | None:
  try: import scipy_openblas32
  except ImportError: return None
  import cffi
  ffi = cffi.FFI()
  prefix = scipy_openblas32.get_library().removeprefix("lib").removesuffix("openblas")  # "scipy_"
  ffi.cdef(f"void {prefix}cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha, uintptr_t a, int lda,"
           f" uintptr_t b, int ldb, float beta, uintptr_t c, int ldc);")
  lib = ffi.dlopen(os.path.join(scipy_openblas32.get_lib_dir(), f"lib{scipy_openblas32.get_library()}.so"))
  gemm = getattr(lib, f"{prefix}cblas_sgemm")

  def sgemm(handles: list[int], ext) -> None:
    p = dict(ext.params)
    c, a, b = (handles[i] for i in ext.operands)
    gemm(CBLAS_ROW_MAJOR, CBLAS_NO_TRANS if p["trans_a"] == "N" else CBLAS_TRANS,
         CBLAS_NO_TRANS if p["trans_b"] == "N" else CBLAS_TRANS, p["m"], p["n"], p["k"], 1.0,
         a + 4 * p["offset_a"], p["lda"], b + 4 * p["offset_b"], p["ldb"], 0.0, c + 4 * p["offset_c"], p["ldc"])
  sgemm.library = f"OpenBLAS ({scipy_openblas32.__name__} {scipy_openblas32.__version__})"  # type: ignore[attr-defined]
  return sgemm


# ---------------------------------------------------------------- CUDA: cuBLAS

CUBLAS_CDEF = """
typedef struct cublasContext *cublasHandle_t;
int cublasCreate_v2(cublasHandle_t *handle);
int cublasSgemm_v2(cublasHandle_t handle, int transa, int transb, int m, int n, int k, const float *alpha,
                   uintptr_t A, int lda, uintptr_t B, int ldb, const float *beta, uintptr_t C, int ldc);
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
def _cuda_sgemm() -> Callable | None:
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
  one, zero = ffi.new("float *", 1.0), ffi.new("float *", 0.0)
  calling = threading.Lock()   # a cuBLAS handle is not to be used by two host threads at once

  def sgemm(handles: list[int], ext) -> None:
    p = dict(ext.params)
    c, a, b = (handles[i] for i in ext.operands)
    # row-major C (m x n) = op(A) op(B) is column-major C^T (n x m) = op(B)^T op(A)^T: swap the operands, keep the ops.
    # The handle's stream is the legacy default stream (0), the one our kernels and copies run on: in order with them
    with calling:
      code = lib.cublasSgemm_v2(handle[0], CUBLAS_OP_N if p["trans_b"] == "N" else CUBLAS_OP_T,
                                CUBLAS_OP_N if p["trans_a"] == "N" else CUBLAS_OP_T, p["n"], p["m"], p["k"], one,
                                b + 4 * p["offset_b"], p["ldb"], a + 4 * p["offset_a"], p["lda"], zero, c + 4 * p["offset_c"], p["ldc"])
    if code != 0: raise RuntimeError(f"cublasSgemm_v2 failed with status {code} ({ext.name} {p})")
  sgemm.library = "cuBLAS"  # type: ignore[attr-defined]
  return sgemm
