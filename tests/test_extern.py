"""Library calls in the host program (runtime/extern.py): sgemm from OpenBLAS (scipy-openblas32) on the CPU, cuBLAS on
CUDA (checked here against its header and library where they are installed; no GPU is needed for that)."""
import glob, os, subprocess, sys
import numpy as np
import pytest
import cffi
from tensor import Tensor
from runtime import extern, realize as rr
from runtime.realize import last_program

rng = np.random.default_rng(0)
a, b = rng.standard_normal((64, 40)).astype(np.float32), rng.standard_normal((40, 48)).astype(np.float32)
has_openblas = extern.routine("CPU", "sgemm") is not None
needs_openblas = pytest.mark.skipif(not has_openblas, reason="scipy-openblas32 is not installed (pip install scipy-openblas32)")


@needs_openblas
@pytest.mark.parametrize("make", [
  lambda: (Tensor(a) @ Tensor(b), "(A, B)"),
  lambda: (Tensor(a) @ Tensor(b.T.copy()).T, "(A, B^T)"),
  lambda: (Tensor(a.T.copy()).T @ Tensor(b), "(A^T, B)"),
  lambda: (Tensor(a.T.copy()).T @ Tensor(b.T.copy()).T, "(A^T, B^T)"),
])
def test_graft_extern_1_runs_sgemm_and_matches_numpy(monkeypatch, make):
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  out, layout = make()
  np.testing.assert_allclose(out.numpy(), a @ b, rtol=1e-4, atol=1e-4)
  assert f"extern sgemm 64x48x40 {layout}  out0 <- in0, in1" in str(last_program())


@needs_openblas
def test_graft_extern_0_runs_generated_code_with_the_same_result(monkeypatch):
  monkeypatch.setenv("GRAFT_EXTERN", "0")
  out = (Tensor(a) @ Tensor(b)).numpy()
  assert "extern" not in str(last_program())
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  np.testing.assert_allclose((Tensor(a) @ Tensor(b)).numpy(), out, rtol=1e-4, atol=1e-4)


@needs_openblas
def test_a_matmul_fused_with_more_work_stays_generated(monkeypatch):
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  out = (Tensor(a) @ Tensor(b)).relu()
  np.testing.assert_allclose(out.numpy(), np.maximum(a @ b, 0), rtol=1e-4, atol=1e-4)
  assert "extern" not in str(last_program())


@needs_openblas
def test_a_matmul_between_other_kernels_takes_its_buffers_from_the_plan(monkeypatch):
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  x = (Tensor(a) * 2).contiguous()
  out = ((x @ Tensor(b)).contiguous() + 1).numpy()
  assert "extern sgemm" in str(last_program()) and "alloc" in str(last_program())
  np.testing.assert_allclose(out, (a * 2) @ b + 1, rtol=1e-4, atol=1e-4)


def test_without_the_package_there_is_no_routine_and_matmul_is_generated(monkeypatch, on_cpu):
  monkeypatch.setitem(sys.modules, "scipy_openblas32", None)  # import fails as if it were not installed
  extern._cpu_sgemm.cache_clear()
  try:
    assert extern.routines("CPU") == ()
    monkeypatch.setenv("GRAFT_EXTERN", "1")
    np.testing.assert_allclose((Tensor(a) @ Tensor(b)).numpy(), a @ b, rtol=1e-4, atol=1e-4)
    assert "extern" not in str(last_program())
  finally:
    monkeypatch.undo()
    extern._cpu_sgemm.cache_clear()


def test_a_bad_graft_extern_names_the_choices(monkeypatch):
  monkeypatch.setenv("GRAFT_EXTERN", "yes")
  with pytest.raises(ValueError, match="GRAFT_EXTERN='yes'.*0.*1"): extern.mode()


# ---- cuBLAS: the declarations match the toolkit's header, and the library resolves them (no GPU needed) ----
def cublas_include() -> str | None:
  dirs = [os.environ.get("CUBLAS_INCLUDE", ""), *glob.glob("/usr/local/cuda*/include")]
  try:
    import nvidia   # NVIDIA's wheels: nvidia/cu13/include (CUDA 13), nvidia/cublas/include (CUDA 12)
    dirs += [os.path.join(p, sub, "include") for p in nvidia.__path__ for sub in ("cu13", "cublas")]
  except ImportError: pass
  return next((d for d in dirs if d and os.path.exists(os.path.join(d, "cublas_v2.h"))), None)


def test_cublas_sgemm_declaration_matches_the_header(tmp_path):
  inc = cublas_include()
  if inc is None: pytest.skip("no cublas_v2.h here (set CUBLAS_INCLUDE to the directory holding it)")
  cuda_inc = glob.glob("/usr/local/cuda*/include")
  # our cdef passes pointers as uintptr_t (the same registers); the parameter order and the ops' values must be the header's
  check = tmp_path / "check.c"
  check.write_text("#include <cublas_v2.h>\n"
                   "cublasStatus_t (*sgemm)(cublasHandle_t, cublasOperation_t, cublasOperation_t, int, int, int, const float *,"
                   " const float *, int, const float *, int, const float *, float *, int) = cublasSgemm_v2;\n"
                   "cublasStatus_t (*create)(cublasHandle_t *) = cublasCreate_v2;\n"
                   f"int ops[CUBLAS_OP_N == {extern.CUBLAS_OP_N} && CUBLAS_OP_T == {extern.CUBLAS_OP_T} ? 1 : -1];\n")
  r = subprocess.run(["gcc", "-fsyntax-only", f"-I{inc}", *(f"-I{d}" for d in cuda_inc), str(check)], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]


def test_cublas_library_resolves_the_declared_functions():
  ffi = cffi.FFI()
  ffi.cdef(extern.CUBLAS_CDEF)
  if (lib := extern._open_cublas(ffi)) is None: pytest.skip(f"libcublas is not installed here (looked for {extern.cublas_candidates()})")
  assert lib.cublasSgemm_v2 and lib.cublasCreate_v2


@needs_openblas
def test_a_matmul_assigned_into_rows_of_a_tensor_writes_only_those_rows_with_sgemm(monkeypatch):
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  t0 = rng.standard_normal((100, 48)).astype(np.float32)
  t = Tensor(t0.copy())
  t[:64] = Tensor(a) @ Tensor(b)
  assert "extern sgemm" in str(last_program())
  expect = t0.copy(); expect[:64] = a @ b
  np.testing.assert_allclose(t.numpy(), expect, rtol=1e-4, atol=1e-4)
  t[36:] = Tensor(a) @ Tensor(b)   # at an offset in the buffer
  assert "extern sgemm" in str(last_program())
  expect[36:] = a @ b
  np.testing.assert_allclose(t.numpy(), expect, rtol=1e-4, atol=1e-4)


def cuda_gpu():
  from runtime.device import get_device
  from runtime.cuda import CUDAUnavailable
  try: return get_device("CUDA")
  except CUDAUnavailable as e: pytest.skip(f"no usable CUDA GPU here: {str(e).split(' (')[0]}")


@pytest.mark.parametrize("layout", ["(A, B)", "(A, B^T)", "(A^T, B)", "(A^T, B^T)"])
def test_cublas_sgemm_on_a_gpu_matches_numpy_in_every_layout(monkeypatch, layout):
  cuda_gpu()
  if extern.routine("CUDA", "sgemm") is None: pytest.skip(f"no libcublas found (looked for {extern.cublas_candidates()})")
  monkeypatch.setenv("GRAFT_EXTERN", "1")
  ta, tb = "A^T" in layout, "B^T" in layout
  A = Tensor(a.T.copy(), device="CUDA").T if ta else Tensor(a, device="CUDA")
  B = Tensor(b.T.copy(), device="CUDA").T if tb else Tensor(b, device="CUDA")
  t = Tensor(rng.standard_normal((100, 48)).astype(np.float32), device="CUDA")
  t[30:94] = A @ B   # at an offset of the output's buffer
  assert f"extern sgemm 64x48x40 {layout}" in str(last_program())
  np.testing.assert_allclose(t.numpy()[30:94], a @ b, rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose((A @ B).numpy(), a @ b, rtol=1e-4, atol=1e-4)
